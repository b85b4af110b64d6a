"""What machine a measurement ran on: CPU model and the vector extensions that decide which tree pays.

The latency curve a fitted policy trusts is keyed by it (verifiers/latency.py), so a cache shared between
machines, or a run with torch's kernels limited to AVX2, never reuses a curve measured on other hardware.
Results tables print :func:`describe`.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

# The extensions that change CPU matmul speed the most (AVX2 only: bfloat16 is emulated).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# Environment variables that limit the instruction sets torch, oneDNN and MKL use, and those that decide the
# stream kernel's vector width (numba's target CPU and features, GOOSE_STREAM_WIDE / GOOSE_STREAM_KERNEL).
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
           "MKL_DEBUG_CPU_TYPE", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "GOOSE_STREAM_WIDE", "GOOSE_STREAM_KERNEL")


@lru_cache(maxsize=1)
def cpu() -> dict:
    """{"model": str, "cores": int, "flags": [...]}, from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.processor(), platform.machine()):
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    if model:
                        break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count() or 0, "flags": [f for f in FLAGS if f in flags]}


def kernels() -> dict:
    """torch's CPU kernel level and any instruction-set limits set in the environment."""
    import torch

    try:
        level = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an old or unusual build: the level is unknown, not an error
        level = "?"
    return {"torch_cpu_capability": level, "env": {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}}


def describe() -> str:
    """One line: model, cores, extensions (e.g. "Intel(R) Xeon(R) Processor, 2 cores, AVX2 AVX-512 AMX")."""
    c = cpu()
    names = (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16"))
    ext = [n for n, k in names if k in c["flags"]]
    line = f"{c['model']}, {c['cores']} cores, {' '.join(ext) or 'no AVX2'}"
    env = kernels()["env"]
    if env:
        line += "; kernels limited by " + " ".join(f"{k}={v}" for k, v in env.items())
    return line
