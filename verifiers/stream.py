"""A linear layer for 1-64 rows that reads each weight once per pass: ``x @ W.T`` compiled by numba (docs/speed.md,
"Linear layers at the memory limit: the stream kernel"): numba's loop (:func:`_xwt`), or verifiers/stream_ir.py's
block kernel where the CPU has AVX-512 (:func:`kernel_info` says which runs).

What the verifier relies on, for both kernels: the weights are read in their own layout (the only extra memory
is the padded input and the output), and every output element is computed by the same instruction sequence, by
one thread, so a row's result depends neither on the other rows of the pass nor on the thread count
(tests/test_stream.py checks it bit for bit). The sums run in another order than MKL's: a near-tie may flip.
numba's OpenMP threading layer is not fork-safe: a process forked after a stream pass should not run one.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

BLOCK = 2  # input rows per block; the input is padded to a multiple of it
W_BLOCK = 12  # weight rows per block

# numba's "workqueue" threading layer (where no OpenMP or TBB runtime loads) must not be entered by two threads at once
_serial = threading.Lock()

_prange = range  # numba.prange once the kernel is compiled (_kernel sets it before compiling)


def _xwt(x, w, out):
    # out[r, o] = sum_k x[r, k] * w[o, k]; x has an even number of rows. Each block of twelve weight rows is read
    # once, against every pair of input rows in turn: 24 running sums, held in registers (hence written out).
    n, k_dim = x.shape
    o_dim = w.shape[0]
    zero = np.float32(0)
    for b in _prange(o_dim // 12):
        o = b * 12
        w0 = w[o]
        w1 = w[o + 1]
        w2 = w[o + 2]
        w3 = w[o + 3]
        w4 = w[o + 4]
        w5 = w[o + 5]
        w6 = w[o + 6]
        w7 = w[o + 7]
        w8 = w[o + 8]
        w9 = w[o + 9]
        w10 = w[o + 10]
        w11 = w[o + 11]
        for r in range(0, n, 2):
            x0 = x[r]
            x1 = x[r + 1]
            a0_0 = a0_1 = zero
            a1_0 = a1_1 = zero
            a2_0 = a2_1 = zero
            a3_0 = a3_1 = zero
            a4_0 = a4_1 = zero
            a5_0 = a5_1 = zero
            a6_0 = a6_1 = zero
            a7_0 = a7_1 = zero
            a8_0 = a8_1 = zero
            a9_0 = a9_1 = zero
            a10_0 = a10_1 = zero
            a11_0 = a11_1 = zero
            for k in range(k_dim):
                y0 = x0[k]
                y1 = x1[k]
                v = w0[k]
                a0_0 += v * y0
                a0_1 += v * y1
                v = w1[k]
                a1_0 += v * y0
                a1_1 += v * y1
                v = w2[k]
                a2_0 += v * y0
                a2_1 += v * y1
                v = w3[k]
                a3_0 += v * y0
                a3_1 += v * y1
                v = w4[k]
                a4_0 += v * y0
                a4_1 += v * y1
                v = w5[k]
                a5_0 += v * y0
                a5_1 += v * y1
                v = w6[k]
                a6_0 += v * y0
                a6_1 += v * y1
                v = w7[k]
                a7_0 += v * y0
                a7_1 += v * y1
                v = w8[k]
                a8_0 += v * y0
                a8_1 += v * y1
                v = w9[k]
                a9_0 += v * y0
                a9_1 += v * y1
                v = w10[k]
                a10_0 += v * y0
                a10_1 += v * y1
                v = w11[k]
                a11_0 += v * y0
                a11_1 += v * y1
            out[r, o] = a0_0
            out[r + 1, o] = a0_1
            out[r, o + 1] = a1_0
            out[r + 1, o + 1] = a1_1
            out[r, o + 2] = a2_0
            out[r + 1, o + 2] = a2_1
            out[r, o + 3] = a3_0
            out[r + 1, o + 3] = a3_1
            out[r, o + 4] = a4_0
            out[r + 1, o + 4] = a4_1
            out[r, o + 5] = a5_0
            out[r + 1, o + 5] = a5_1
            out[r, o + 6] = a6_0
            out[r + 1, o + 6] = a6_1
            out[r, o + 7] = a7_0
            out[r + 1, o + 7] = a7_1
            out[r, o + 8] = a8_0
            out[r + 1, o + 8] = a8_1
            out[r, o + 9] = a9_0
            out[r + 1, o + 9] = a9_1
            out[r, o + 10] = a10_0
            out[r + 1, o + 10] = a10_1
            out[r, o + 11] = a11_0
            out[r + 1, o + 11] = a11_1
    if o_dim % 12:
        _xwt_rest(x, w, out, o_dim - o_dim % 12)


def _xwt_rest(x, w, out, start):
    # the weight rows from ``start`` on (those that fill no block), one at a time, against every pair of input rows
    n, k_dim = x.shape
    zero = np.float32(0)
    for o in range(start, w.shape[0]):
        wv = w[o]
        for r in range(0, n, 2):
            x0 = x[r]
            x1 = x[r + 1]
            a0 = a1 = zero
            for k in range(k_dim):
                v = wv[k]
                a0 += v * x0[k]
                a1 += v * x1[k]
            out[r, o] = a0
            out[r + 1, o] = a1


# Set to 0 to compile the kernel with numba's own choice of vector width (see _wide_vectors).
WIDE_ENV = "GOOSE_STREAM_WIDE"
_width: dict = {}  # "bits": the vector width asked of LLVM (512, or None: numba's default), "why": how it was decided


def _wide_vectors(numba) -> None:
    """Ask LLVM for 512-bit vectors in the numba code compiled from now on, where the CPU has AVX-512 (docs/speed.md,
    "The vector width"). numba reads the features once per process, at its first compilation, so this applies to
    all numba code compiled later (a tuning preference: results stay as exact); nothing where numba compiled before,
    ``NUMBA_CPU_FEATURES`` is set or ``$GOOSE_STREAM_WIDE`` is 0."""
    import os

    from numba.core import codegen, config, registry

    if os.environ.get(WIDE_ENV, "1").strip() == "0":
        _width.update(bits=None, why=f"{WIDE_ENV}=0: numba's default width")
    elif config.CPU_FEATURES is not None:
        _width.update(bits=None, why="NUMBA_CPU_FEATURES is set: the features it names")
    elif "_toplevel_target_context" in vars(registry.cpu_target):
        _width.update(bits=None, why="numba compiled code before Goose's kernel: its code generator's width")
    else:
        features = codegen.get_host_cpu_features()
        if not _avx512(features):
            _width.update(bits=None, why="no AVX-512: numba's default width")
        else:
            config.CPU_FEATURES = features + ",-prefer-256-bit"
            _width.update(bits=512, why="AVX-512: LLVM asked to prefer 512-bit vectors")


def vector_width() -> dict:
    """{"bits": 512 or None (numba's default), "why": str}: the vector width the kernel was compiled with."""
    _kernel()
    return dict(_width) or {"bits": None, "why": "numba is not available"}


# Set to "loop" to run numba's loop kernel where the IR block kernel would run (see _kernel).
KERNEL_ENV = "GOOSE_STREAM_KERNEL"
_choice: dict = {}  # the kernel compiled: see kernel_info


@functools.cache
def _kernel():
    """``kernel(x, w, out, threads)`` computing ``out = x @ w.T`` (x's rows as :func:`padded_rows` gives them;
    ``threads``: the block kernel's runs of weight blocks), or None without numba; compiled on first call."""
    import os

    global _prange
    try:
        import numba
    except ImportError:
        return None
    _wide_vectors(numba)
    _prange = numba.prange
    global _xwt_rest  # compiled first: the kernels call it, and numba resolves the global when compiling
    if not isinstance(_xwt_rest, numba.core.registry.CPUDispatcher):
        _xwt_rest = numba.njit(fastmath=True, cache=True, boundscheck=False, nogil=True)(_xwt_rest)
    asked = os.environ.get(KERNEL_ENV, "auto").strip() or "auto"
    if asked not in ("auto", "blocks", "loop"):
        raise ValueError(f"${KERNEL_ENV}={asked!r} is not a stream kernel. Allowed: 'auto' (the IR block kernel "
                         "where the CPU has AVX-512, numba's loop elsewhere), 'blocks', 'loop'. Hint: unset it.")
    avx512 = _avx512()
    if asked == "blocks" and not avx512:
        raise ValueError(f"${KERNEL_ENV}='blocks' needs AVX-512, which numba's target here lacks. "
                         "Allowed here: 'auto', 'loop'. Hint: unset it.")
    if avx512 and asked != "loop":
        from . import stream_ir

        blocks = stream_ir.compile_blocks()
        rest, step = _xwt_rest, stream_ir.W_ROWS

        def kernel(x, w, out, threads):
            n = x.shape[0]
            blocks(x, w, out, threads)
            if w.shape[0] % step:
                start = w.shape[0] - w.shape[0] % step
                if n % 2:  # the rest loop runs pairs of rows: one row goes through it padded to two
                    x2 = np.zeros((n + 1, x.shape[1]), np.float32)
                    x2[:n] = x
                    out2 = np.empty((n + 1, w.shape[0]), np.float32)
                    rest(x2, w, out2, start)
                    out[:, start:] = out2[:n, start:]
                else:
                    rest(x, w, out, start)

        _choice.update(kernel="blocks", rows=stream_ir.X_ROWS, few=stream_ir.FEW_ROWS,
                       why="AVX-512: the IR block kernel")
        return kernel
    why = f"${KERNEL_ENV}=loop" if asked == "loop" else "no AVX-512: numba's loop"
    _choice.update(kernel="loop", rows=BLOCK, why=why)
    loop = numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)(_xwt)
    return lambda x, w, out, threads: loop(x, w, out)


def _avx512(features: str | None = None) -> bool:
    """Whether an LLVM feature string (default: the one numba compiles with, else the host's) has AVX-512."""
    if features is None:
        from numba.core import codegen, config

        features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    return "+avx512f" in features.split(",")


def row_multiple() -> int:
    """The multiple of input rows the kernel pads its input to (the block kernel: past six rows)."""
    _kernel()
    return _choice.get("rows", BLOCK)


def padded_rows(rows: int) -> int:
    """The rows the kernel computes for ``rows`` input rows: the block kernel's one as it is, up to six padded to
    an even count, more to a multiple of four; numba's loop's, to a multiple of two."""
    multiple = row_multiple()
    if rows <= _choice.get("few", 0):
        return rows if rows == 1 else rows + rows % 2
    return -(-rows // multiple) * multiple


def kernel_info() -> dict:
    """{"kernel": "blocks" or "loop", "rows": the row multiple, "few" (blocks: up to this many rows run in jobs
    of one or two), "why": str} (empty where numba is missing)."""
    _kernel()
    return dict(_choice)


@functools.cache
def _threading():
    """(numba module, whether calls must be serialised), after one call has chosen the threading layer."""
    import numba

    k = _kernel()
    rows = row_multiple()
    x = np.zeros((rows, 8), np.float32)
    with torch_threads_kept():  # the first call launches numba's thread pool
        k(x, np.zeros((W_BLOCK + 1, 8), np.float32), np.zeros((rows, W_BLOCK + 1), np.float32), 1)
    return numba, numba.threading_layer() == "workqueue"


@contextmanager
def torch_threads_kept():
    """Within the block, whatever runs may change torch's thread count; it is set back after (numba's OpenMP
    layer, launching its pool, sets the OpenMP thread count that torch shares to numba's own)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def supported(weight: torch.Tensor) -> bool:
    """Whether this kernel can serve a layer of this weight: float32, on the CPU, 2-D."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2


def available(modules) -> bool:
    """Whether the stream form can serve these linear layers: numba importable and every weight supported."""
    return bool(modules) and _kernel() is not None and all(supported(m.weight) for m in modules)


def unavailable_reason(modules) -> str:
    """Why :func:`available` is False for these layers: what failed, the value, what is allowed, a hint."""
    if not modules:
        return ("verifier option linear='stream' found no plain torch.nn.Linear layers in this model to serve. "
                "Allowed: 'auto', 'stock'. Hint: leave linear='auto'.")
    if _kernel() is None:
        return ("verifier option linear='stream' needs numba, which cannot be imported here. Allowed without it: "
                "'auto', 'stock', 'skinny', 'packed'. Hint: pip install numba (a wheel; no compiler needed).")
    bad = next(m.weight for m in modules if not supported(m.weight))
    return (f"verifier option linear='stream' serves float32 weights on the CPU; this model's are {bad.dtype} on "
            f"{bad.device.type}. Allowed here: 'auto', 'stock', 'skinny'. Hint: load the model in float32, or leave "
            "linear='auto', which uses the stream form only where it serves and is measured faster.")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D float32 ``x`` on the CPU, by the streaming kernel. The buffers are
    numpy arrays handed to torch without a copy: on small layers torch's allocation and views cost more than
    the kernel's launch."""
    rows, k_dim = x.shape
    if weight.shape[1] != k_dim:
        raise ValueError(f"input has {k_dim} features; the weight takes {weight.shape[1]}")
    numba, serial = _threading()
    kernel = _kernel()
    xn = x.detach().numpy()
    padded = padded_rows(rows)
    if padded != rows or not xn.flags.c_contiguous:
        xp = np.zeros((padded, k_dim), np.float32)
        xp[:rows] = xn
        xn = xp
    wn = np.ascontiguousarray(weight.detach().numpy())  # no copy where it already is
    on = np.empty((xn.shape[0], wn.shape[0]), np.float32)
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    # numba's thread count is the calling thread's own setting: set for the call, then set back
    with _serial if serial else nullcontext():
        mine = numba.get_num_threads()
        if mine != threads:
            numba.set_num_threads(threads)
        try:
            kernel(xn, wn, on, threads)
        finally:
            if mine != threads:
                numba.set_num_threads(mine)
    out = torch.from_numpy(on[:rows] if on.shape[0] != rows else on)
    if bias is not None:
        out = out + bias
    return out
