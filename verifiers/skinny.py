"""The linear layers of tree passes in another form than ``F.linear`` (docs/speed.md, "The one-token step").

:func:`rerouted` gives, for one pass, every plain ``torch.nn.Linear`` an instance ``forward`` that computes the
calling thread's rows in the chosen form where it serves (:func:`serves`) and exactly ``F.linear`` otherwise
(other threads, larger inputs); the instance attributes are removed afterwards. The model's own weights stay as
they are. Rounding differs from ``F.linear``'s (as a GEMM's already differs from a GEMV's): a near-tie may flip,
which ``goose bench`` reports with its logit gap.

``packed`` keeps each weight in MKL's GEMM layout (``torch.ops.mkl``: float32 CPU), packed once. The layout is
opaque and padded, so a pack's size is the process's resident-memory growth while it is made (at least the
weight's own size); packs are made only within ``pack_limit_mib`` and re-made for a weight changed in place.
"""

from __future__ import annotations

import functools
import os
import threading
import types
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from goose.verifiers import stream

MAX_ROWS = 64
FORMS = ("skinny", "packed", "stream")
# forms that also serve one-row passes (the plain steps); the others run F.linear there
ONE_ROW_FORMS = ("stream",)
# packed bytes / weight bytes assumed for a pack not yet made (a made one counts its measured size)
PACK_RATIO = 2.5

_local = threading.local()  # .forms: this thread's rerouted passes, innermost last (empty: stock)
_lock = threading.Lock()
_installed: dict[int, int] = {}  # id(model) -> passes in flight (any thread)
# module -> (weight data pointer, weight version, packed weight, bytes measured): made on first use, per weight
_packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pack_lock = threading.Lock()


def serves(form: str | None, rows: int) -> bool:
    """Whether ``form`` computes a linear layer of ``rows`` rows (else that layer runs ``F.linear``)."""
    return form is not None and (2 <= rows <= MAX_ROWS or (rows == 1 and form in ONE_ROW_FORMS))


def _tree_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    forms = getattr(_local, "forms", None)
    form = forms[-1] if forms else None
    if not serves(form, rows):
        return F.linear(x, self.weight, self.bias)
    x2 = x.reshape(rows, x.shape[-1])
    if form == "stream":
        out = stream.linear(x2, self.weight, self.bias)
    elif form == "packed":
        out = torch.ops.mkl._mkl_linear(x2, _pack(self), self.weight, self.bias, rows)
    else:
        out = torch.matmul(self.weight, x2.t()).t()
        if self.bias is not None:
            out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def _pack(m: torch.nn.Linear) -> torch.Tensor:
    w = m.weight
    have = _packs.get(m)
    if have is not None and have[0] == w.data_ptr() and have[1] == w._version:
        return have[2]
    with _pack_lock, torch.inference_mode():
        have = _packs.get(m)
        if have is None or have[0] != w.data_ptr() or have[1] != w._version:
            _packs.pop(m, None)  # the stale pack is freed before its successor is measured
            before = resident_bytes()
            # the row count only sizes MKL's scratch; the packed layout serves any row count
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), 8)
            grown = resident_bytes() - before
            # reused memory shows no growth: a pack holds at least its weight's values
            own = w.numel() * w.element_size()
            size = max(grown, own) if before else int(PACK_RATIO * own)
            have = (w.data_ptr(), w._version, packed, size)
            _packs[m] = have
    return have[2]


@functools.cache
def _packing_works() -> bool:
    """Once per process, on a private layer: the packed product equals ``F.linear`` to float32 rounding at every
    row count the form serves (a layout packed for one row count serves all)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g)
        b = torch.randn(48, generator=g)
        with torch.inference_mode():
            pw = torch.ops.mkl._mkl_reorder_linear_weight(w, 8)
            for rows in (2, 3, 4, 5, 8, 13, 16, 33, MAX_ROWS):
                x = torch.randn(rows, 40, generator=g)
                got = torch.ops.mkl._mkl_linear(x, pw, w, b, rows)
                if got.shape != (rows, 48) or not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5):
                    return False
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def packed_supported(modules: list[torch.nn.Linear]) -> bool:
    """Whether the packed form can serve these layers, memory aside: float32 CPU weights and a torch built with
    MKL whose packed GEMM checks out."""
    if not modules or not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    if not _packing_works():
        return False
    return all(m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" for m in modules)


def pack_limit(limit_mib: int | None = None) -> int:
    """Bytes the packs may take: ``limit_mib`` MiB, or (None) a quarter of the available memory."""
    return available_memory() // 4 if limit_mib is None else int(limit_mib) * 2**20


def pack_estimate(modules: list[torch.nn.Linear]) -> int:
    """Bytes the packs of these layers take: measured for those packed, :data:`PACK_RATIO` x the rest."""
    return sum(_packs[m][3] if m in _packs else int(PACK_RATIO * m.weight.numel() * m.weight.element_size())
               for m in modules)


def packed_available(modules: list[torch.nn.Linear], limit_mib: int | None = None) -> bool:
    """Whether the packed form can serve these layers with packs within the limit (``limit_mib`` 0: never)."""
    if (limit_mib is not None and int(limit_mib) <= 0) or not packed_supported(modules):
        return False
    return pack_estimate(modules) <= _limit_for(modules, limit_mib)


def _limit_for(modules, limit_mib: int | None) -> int:
    # the default limit is a quarter of what is available, and packs already made are no longer available: they
    # count at their measured size against the limit they are added back to, so they are kept as memory fills
    return pack_limit(limit_mib) + (packed_bytes(modules) if limit_mib is None else 0)


def packed_bytes(modules: list[torch.nn.Linear]) -> int:
    """Bytes the packs of these layers hold now (resident memory measured as each was made)."""
    return sum(_packs[m][3] for m in modules if m in _packs)


def _proc_bytes(path: str, key: str) -> int:
    """A ``key: N kB`` line of a /proc file, in bytes; 0 where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory (``VmRSS``); 0 where that cannot be read."""
    return _proc_bytes("/proc/self/status", "VmRSS")


def available_memory() -> int:
    """Bytes the system reports available (``MemAvailable``); 0 where that cannot be read."""
    have = _proc_bytes("/proc/meminfo", "MemAvailable")
    if have:
        return have
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def prepack(modules: list[torch.nn.Linear], limit_mib: int | None = None) -> bool:
    """Pack these layers' weights now; False, with the packs dropped again, where they measure over the limit."""
    limit = _limit_for(modules, limit_mib)
    for m in modules:
        _pack(m)
    if packed_bytes(modules) > limit:
        release_packs(modules)
        return False
    return True


def release_packs(modules: list[torch.nn.Linear]) -> None:
    """Drop the packed weights of these layers (they are made again if a packed pass asks)."""
    with _pack_lock:
        for m in modules:
            _packs.pop(m, None)


def linears(model) -> list[torch.nn.Linear]:
    """The model's plain ``nn.Linear`` modules that run their class's own ``forward``: not subclasses (quantised
    layers), nor a module whose ``forward`` someone else replaced on the instance (accelerate's hooks live there,
    and the reroute must neither replace nor remove them)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and _own_forward(m) and not hasattr(m, "_hf_hook")]


def _own_forward(m: torch.nn.Module) -> bool:
    """The layer runs its class's ``forward``, or this module's reroute (another thread's tree pass on the same
    model), not a forward someone else put there."""
    f = m.__dict__.get("forward")
    return f is None or getattr(f, "__func__", None) is _tree_forward


@contextmanager
def rerouted(model, modules: list[torch.nn.Linear] | None = None, form: str = "skinny"):
    """Within the block, this thread's linear layers run in ``form`` on the row counts it serves: ``"skinny"``
    (``weight @ x.T``), ``"packed"`` (MKL's GEMM on weights packed once) or ``"stream"`` (verifiers/stream.py)."""
    if form not in FORMS:
        raise ValueError(f"linear form {form!r} is not one of {FORMS}")
    mods = linears(model) if modules is None else modules
    key = id(model)
    with _lock:
        if _installed.get(key, 0) == 0:
            for m in mods:
                m.forward = types.MethodType(_tree_forward, m)
        _installed[key] = _installed.get(key, 0) + 1
    forms = _local.__dict__.setdefault("forms", [])
    forms.append(form)
    try:
        yield
    finally:
        forms.pop()
        with _lock:
            _installed[key] -= 1
            if _installed[key] == 0:
                del _installed[key]
                for m in mods:
                    m.__dict__.pop("forward", None)
