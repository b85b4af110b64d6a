"""Linear layers for few rows at the cost of one weight pass: ``weight @ x.T`` during tree passes.

Verification is memory-bound: one pass over the weights can check many tokens. On some CPUs
torch's ``F.linear`` on 2-64 rows takes a GEMM path that costs 2-4x a one-row GEMV (measured on
an AVX2-only EPYC in issue 11: the 151,936 x 1,536 LM head of Qwen2.5-1.5B took 61 ms for one
row and 231 ms for four; ``weight @ x.T``, 53 ms for four). Computing the same product as
``weight @ x.T`` keeps a few rows near one weight pass there.

:func:`rerouted` does this *temporarily*, through the stock model: for the duration of one tree
pass, every plain ``torch.nn.Linear`` of the model gets an instance ``forward`` that computes
rows 2..``MAX_ROWS`` as ``weight @ x.T`` in the calling thread, and exactly ``F.linear``
otherwise (one-token steps, other threads, larger inputs); the instance attributes are removed
afterwards, so the model's modules are what they were. Rounding differs from ``F.linear``'s (as a
multi-row GEMM's already differs from a one-row GEMV's): float32 outputs stay identical to greedy
decoding unless a near-tie flips, which ``goose bench`` reports with its logit gap.

Whether it pays is measured, per device, dtype and tree size, by the latency calibration
(``goose.latency.measure`` times both forms; the verifier's ``linear="auto"`` uses the faster
one for each size).
"""

from __future__ import annotations

import threading
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

MAX_ROWS = 64

_local = threading.local()  # .depth: > 0 inside a rerouted pass of this thread
_lock = threading.Lock()
_installed: dict[int, int] = {}  # id(model) -> passes in flight (any thread)


def _skinny_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if getattr(_local, "depth", 0) <= 0 or not (2 <= rows <= MAX_ROWS):
        return F.linear(x, self.weight, self.bias)
    out = torch.matmul(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def linears(model) -> list[torch.nn.Linear]:
    """The model's plain ``nn.Linear`` modules that run their class's own ``forward``.

    Subclasses (quantised layers) are left alone, and so is any module whose ``forward`` was
    already replaced on the instance: accelerate's hooks (offloading, device maps) live there, and
    the reroute must neither replace nor remove them."""
    return [
        m for m in model.modules()
        if type(m) is torch.nn.Linear and "forward" not in m.__dict__ and not hasattr(m, "_hf_hook")
    ]


@contextmanager
def rerouted(model, modules: list[torch.nn.Linear] | None = None):
    """Within the block, this thread's linear layers on 2..MAX_ROWS rows run as ``weight @ x.T``."""
    mods = linears(model) if modules is None else modules
    key = id(model)
    with _lock:
        if _installed.get(key, 0) == 0:
            for m in mods:
                m.forward = types.MethodType(_skinny_forward, m)
        _installed[key] = _installed.get(key, 0) + 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _installed[key] -= 1
            if _installed[key] == 0:
                del _installed[key]
                for m in mods:
                    m.__dict__.pop("forward", None)
