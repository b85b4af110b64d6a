"""The stream kernel's inner loop written in LLVM IR, for CPUs with AVX-512 (verifiers/stream.py, docs/speed.md).

From Python, numba's loop cannot be given a prefetch inside the vectorised loop (LLVM then stops vectorising it),
nor told which values stay in registers. Here one *job*, six weight rows against four input rows (one or two up
to six rows), is IR with explicit ``<16 x float>`` multiply-adds into vector sums, prefetching the weight block its
thread reads next so that the read overlaps the arithmetic on this one.

The arithmetic of one output element does not depend on the job's neighbours, on the row count or on the thread
count: sixteen lanes of fused multiply-adds over the inner dimension in steps of 16, a fixed tree of halving adds
(16, 8, 4, 2, 1), then the last ``k % 16`` products added one at a time.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16  # float32 lanes of a 512-bit vector
W_ROWS = 6  # weight rows per job
FEW_ROWS = 6  # up to this many input rows run in jobs of one or two rows (more than one padded to even)
X_ROWS = 4  # input rows per job past FEW_ROWS; the input is padded to a multiple of it

_f32 = ir.FloatType()
_vec = ir.VectorType(_f32, LANES)
_i8p = ir.IntType(8).as_pointer()
_i32 = ir.IntType(32)
_i64 = ir.IntType(64)


def _sum_lanes(builder, v):
    """The lanes of v added in a fixed tree: halves added until one lane is left."""
    n = LANES
    while n > 1:
        half = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, half), list(range(half, n))))
        v = builder.fadd(lo, hi)
        n = half
    return builder.extract_element(v, _i32(0))


def _make_job(x_rows: int, unrolled: int = 0):
    """The intrinsic for one job of six weight rows against ``x_rows`` input rows (4, 2 or 1); with
    ``unrolled``, it prefetches that many rows from ``pf_row`` on, as straight-line code (its
    ``pf_rows`` argument unused), else ``pf_rows`` rows in a loop."""

    @intrinsic
    def job(typingctx, x, w, out, o, r, pf_row, pf_rows):
        """out[r:r+x_rows, o:o+6] = x[r:r+x_rows] @ w[o:o+6].T, prefetching rows pf_row..pf_row+pf_rows-1 of w."""
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in (x, w, out)):
            return None
        sig = types.void(x, w, out, o, r, pf_row, pf_rows)

        def codegen(context, builder, signature, args):
            return _job_ir(context, builder, signature, args, x_rows, unrolled)

        return sig, codegen

    return job


def _job_ir(context, builder, signature, args, x_rows, unrolled=0):
    xa, wa, oa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3]))
    o_, r_, pf_row_, pf_rows_ = (context.cast(builder, a, t, types.int64) for a, t in zip(args[3:], signature.args[3:]))
    k_dim = builder.extract_value(xa.shape, 1)
    o_dim = builder.extract_value(oa.shape, 1)
    vp = _vec.as_pointer()
    wrow = [builder.gep(wa.data, [builder.mul(builder.add(o_, _i64(j)), k_dim)]) for j in range(W_ROWS)]
    xrow = [builder.gep(xa.data, [builder.mul(builder.add(r_, _i64(i)), k_dim)]) for i in range(x_rows)]
    sums = []
    for _ in range(W_ROWS * x_rows):
        s = cgutils.alloca_once(builder, _vec)
        builder.store(ir.Constant(_vec, [0.0] * LANES), s)
        sums.append(s)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_vec, [_vec] * 3), "llvm.fma.v16f32")
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_i8p, _i32, _i32, _i32]), "llvm.prefetch.p0")
    steps = builder.udiv(k_dim, _i64(LANES))
    with cgutils.for_range(builder, steps) as loop:
        k = builder.mul(loop.index, _i64(LANES))
        xs = [builder.load(builder.bitcast(builder.gep(p, [k]), vp), align=4) for p in xrow]
        for j in range(W_ROWS):
            wv = builder.load(builder.bitcast(builder.gep(wrow[j], [k]), vp), align=4)
            for i in range(x_rows):
                s = sums[j * x_rows + i]
                builder.store(builder.call(fma, [wv, xs[i], builder.load(s)]), s)

        def fetch(j):  # one cache line of row pf_row + j
            line = builder.gep(wa.data, [builder.add(builder.mul(builder.add(pf_row_, j), k_dim), k)])
            builder.call(prefetch, [builder.bitcast(line, _i8p), _i32(0), _i32(3), _i32(1)])

        if unrolled:
            for j in range(unrolled):
                fetch(_i64(j))
        else:
            with cgutils.for_range(builder, pf_rows_) as pf:
                fetch(pf.index)
    totals = []
    for s in sums:
        t = cgutils.alloca_once(builder, _f32)
        builder.store(_sum_lanes(builder, builder.load(s)), t)
        totals.append(t)
    with cgutils.for_range_slice(builder, builder.mul(steps, _i64(LANES)), k_dim, _i64(1), inc=True) as (k, _):
        xs = [builder.load(builder.gep(p, [k])) for p in xrow]
        for j in range(W_ROWS):
            wv = builder.load(builder.gep(wrow[j], [k]))
            for i in range(x_rows):
                t = totals[j * x_rows + i]
                builder.store(builder.fadd(builder.load(t), builder.fmul(wv, xs[i])), t)
    for j in range(W_ROWS):
        for i in range(x_rows):
            at = builder.add(builder.mul(builder.add(r_, _i64(i)), o_dim), builder.add(o_, _i64(j)))
            builder.store(builder.load(totals[j * x_rows + i]), builder.gep(oa.data, [at]))
    return context.get_dummy_value()


_job4 = _make_job(4)
_job2, _job1 = _make_job(2, W_ROWS), _make_job(1, W_ROWS)  # one job a block: it prefetches all of the next


def _xwt_blocks(x, w, out, chunks):
    # out[:, :o] = x @ w[:o].T (x's rows a multiple of four) for o the weight rows in whole blocks of six; each of
    # `chunks` threads takes a run of blocks, and each job of four input rows prefetches its share of the next block
    n = x.shape[0]
    blocks = w.shape[0] // 6
    jobs = n // 4
    for c in numba.prange(chunks):
        b0 = c * blocks // chunks
        b1 = (c + 1) * blocks // chunks
        for b in range(b0, b1):
            o = b * 6
            for p in range(jobs):
                lo = p * 6 // jobs
                share = (p + 1) * 6 // jobs - lo if b + 1 < b1 else 0
                _job4(x, w, out, np.int64(o), np.int64(4 * p), np.int64(o + 6 + lo), np.int64(share))


def _xwt_few(x, w, out, chunks):
    # as _xwt_blocks for one input row or an even number up to FEW_ROWS: jobs of one or two rows, each prefetching
    # all of the next block (the last block of a run prefetches itself: unrolled prefetches cannot be skipped)
    n = x.shape[0]
    blocks = w.shape[0] // 6
    for c in numba.prange(chunks):
        b0 = c * blocks // chunks
        b1 = (c + 1) * blocks // chunks
        for b in range(b0, b1):
            o, pf = np.int64(b * 6), np.int64(b * 6 + 6 if b + 1 < b1 else b * 6)
            if n == 1:
                _job1(x, w, out, o, np.int64(0), pf, np.int64(0))
            else:
                for p in range(n // 2):
                    _job2(x, w, out, o, np.int64(2 * p), pf, np.int64(0))


def compile_blocks():
    """``kernel(x, w, out, threads)``: ``out[:, :o] = x @ w[:o].T`` for ``o`` the weight rows in whole
    blocks of six, x's rows one, an even number up to FEW_ROWS (jobs of one or two rows) or a multiple
    of four (numba caches the compiled code on disk like the loop kernel). Every path runs the same
    arithmetic per output element, so a row's result does not depend on which of them computed it."""
    jit = numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
    few, blocks = jit(_xwt_few), jit(_xwt_blocks)

    def kernel(x, w, out, threads):
        (few if x.shape[0] <= FEW_ROWS else blocks)(x, w, out, threads)

    return kernel
