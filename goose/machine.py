"""What machine a measurement ran on: CPU model and the vector extensions that decide which tree pays."""

from __future__ import annotations

import platform
from functools import lru_cache

# The extensions that change CPU matmul speed the most (AVX2 only: bfloat16 is emulated).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@lru_cache(maxsize=1)
def cpu() -> dict:
    """{"model": str, "cores": int, "flags": [...]}, from /proc/cpuinfo where there is one."""
    import os

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
                if key == "flags" and model:
                    break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count() or 0, "flags": [f for f in FLAGS if f in flags]}


def describe() -> str:
    """One line: model, cores, extensions (e.g. "Intel(R) Xeon(R) Processor, 2 cores, AVX2 AVX-512 AMX")."""
    c = cpu()
    fl = set(c["flags"])
    ext = [n for n, k in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if k in fl]
    return f"{c['model']}, {c['cores']} cores, {' '.join(ext) or 'no AVX2'}"
