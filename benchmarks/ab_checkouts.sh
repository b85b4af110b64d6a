#!/usr/bin/env bash
# Two commits of Goose, measured interleaved per prompt in one environment.
#
#   bash benchmarks/ab_checkouts.sh MODEL OUT "METHODS" COMMIT_A COMMIT_B SPEC [SPEC ...]
#
# Each commit is checked out into its own git worktree under OUT. The environment's editable
# install maps goose.plugins, goose.policies, goose.verifiers and goose.theory to THIS checkout's
# top-level folders (pyproject.toml, package-dir), whatever PYTHONPATH says: a worktree put first
# on PYTHONPATH still runs this checkout's verifier, policies and sources. So each worktree gets
# links goose/<name> -> ../<name>, which the path finder reaches before the editable finder, and
# the files each side really imports are written to OUT/paths.txt (check them).
#
# For every SPEC (a `goose bench --datasets` value, e.g. gsm8k@41-42) both commits run
# `goose bench --methods METHODS`, each against its own `ar` measured in the same run, their order
# alternating from SPEC to SPEC. Results: OUT/A-<i>/results.json and OUT/B-<i>/results.json.
set -euo pipefail
if [ $# -lt 6 ]; then
  echo "usage: bash benchmarks/ab_checkouts.sh MODEL OUT \"METHODS\" COMMIT_A COMMIT_B SPEC [SPEC ...]" >&2
  echo "  got $# argument(s); e.g. bash benchmarks/ab_checkouts.sh smollm2 /tmp/ab \"ar,pld,spine-fit\" HEAD~1 HEAD gsm8k@41-41" >&2
  exit 2
fi
model=$1 out=$2 methods=$3 commit_a=$4 commit_b=$5
shift 5
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for side in A B; do
  commit=$commit_a
  [ "$side" = B ] && commit=$commit_b
  dir="$out/tree-$side"
  [ -d "$dir" ] || git -C "$root" worktree add -f --detach "$dir" "$commit" >/dev/null
  for name in plugins policies verifiers theory; do ln -sfn "../$name" "$dir/goose/$name"; done
  (cd "$dir" && PYTHONPATH="$dir" python -c "import goose.verifiers.greedy as v, goose.policies.fit as p, goose.plugins.tr as s; print('$side $commit', v.__file__, p.__file__, s.__file__)") >>"$out/paths.txt"
done
i=0
for spec in "$@"; do
  order="A B"
  [ $((i % 2)) = 1 ] && order="B A"
  for side in $order; do
    dir="$out/tree-$side"
    (cd "$dir" && PYTHONPATH="$dir" python -m goose bench --model "$model" --datasets "$spec" --max-new-tokens 64 \
      --threads 2 --methods "$methods" --no-plots --out "$out/$side-$i" >"$out/$side-$i.log" 2>&1)
  done
  i=$((i + 1))
done
echo "done: $i specs" >"$out/done"
