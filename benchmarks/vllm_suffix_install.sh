#!/usr/bin/env bash
# vLLM's own `suffix` method, for benchmarks/vllm_serving.py: it imports `arctic_inference.suffix_decoding`
# (Arctic Inference's suffix tree), which this package index has only as a source archive. The whole package's
# build compiles Arctic's torch custom ops and registers a vLLM plugin that patches vLLM; this builds only the
# suffix tree extension (C++20, nanobind, CMake) and installs that part, so vLLM runs unpatched.
#
#   bash benchmarks/vllm_suffix_install.sh VLLM_ENV     # e.g. /work/vllm-env; about a minute on 2 cores
set -euo pipefail
env_dir=$(cd "${1:?usage: vllm_suffix_install.sh VLLM_ENV (the vLLM virtual environment)}" && pwd)
py="$env_dir/bin/python"
if ! "$py" -c "import vllm, torch" > /dev/null 2>&1; then
  echo "vllm_suffix_install.sh: $env_dir is not a vLLM environment ($py cannot import vllm and torch). Allowed: the" \
    "virtual environment vLLM was installed into. Hint: docs/vllm.md, section Install, gives its steps." >&2
  exit 2
fi
version=0.3.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# no build isolation: preparing the archive's metadata imports torch, which the vLLM environment has (isolated, pip would
# install torch again for it)
"$py" -m pip download -q --no-deps --no-build-isolation --no-binary :all: "arctic-inference==$version" -d "$work"
tar xzf "$work/arctic_inference-$version.tar.gz" -C "$work"
src="$work/arctic_inference-$version"
python3 -m venv "$work/nb" && "$work/nb/bin/pip" install -q nanobind==2.9.2  # build-time only
cmake -S "$src/csrc/suffix_decoding" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
  -Dnanobind_DIR="$("$work/nb/bin/python" -m nanobind --cmake_dir)" > "$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work/build" -j 2 > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
dest="$site/arctic_inference"
mkdir -p "$dest/suffix_decoding"
cp "$src/arctic_inference/__init__.py" "$dest/"
cp "$src/arctic_inference/suffix_decoding/__init__.py" "$src/arctic_inference/suffix_decoding/cache.py" "$dest/suffix_decoding/"
cp "$work"/build/_C*.so "$dest/suffix_decoding/"
(cd / && "$py" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(max_tree_depth=24)")
echo "arctic-inference $version's suffix tree installed in $dest (vLLM's suffix method can run)"
