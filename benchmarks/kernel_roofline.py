"""The stream kernel against this CPU's two ceilings: arithmetic with the weights in cache, and the read of
weights that are not (docs/speed.md, issue 58).

For each inner dimension and row count, the kernel runs twice on the same number of multiply-adds:

- **in cache**: one weight small enough that each thread's share of it stays in its L2 (by default at
  most 512 KiB a thread), called over and over: the arithmetic alone;
- **streamed**: distinct weights of that inner dimension, 1 GB in all, each called once: what a pass
  over a model's layers meets.

From the lower of the streamed times at one and two rows it takes the read's time, and it prints for
each row count the two lower bounds (the arithmetic in cache, the read), the streamed time, and where the
streamed time lies between them: ``overlap`` 0 when it costs the sum of the two (nothing of the read
hides the arithmetic; below 0, more than the sum), 1 when it costs the larger of them (all of it
does). A kernel at 1 is at this CPU's limit for that row count; well below 1, the read and the
arithmetic add up; a low in-cache
rate against the CPU's GEMM rate says the arithmetic itself is slow. Kernels are interleaved per
round; medians are printed.

    python benchmarks/kernel_roofline.py --threads 2 --rows 1,4,8,16,32
    python benchmarks/kernel_roofline.py --kernels blocks,loop --k 576,1536,8960
"""

from __future__ import annotations

import argparse
import statistics
import time


def kernels(names: list[str]):
    """name -> (kernel(x, w, out, threads), the rows it computes for n rows) for the stream kernels asked
    for: 'blocks' (verifiers/stream_ir.py, AVX-512 only) and 'loop' (numba's loop in verifiers/stream.py)."""
    import numba

    from goose.verifiers import stream, stream_ir

    stream._kernel()  # the vector width and the compiled tail, as the verifier sets them up
    out = {}
    for name in names:
        if name == "blocks":
            if not stream._avx512():
                raise SystemExit("--kernels: 'blocks' needs AVX-512, which this CPU lacks. Allowed here: loop. "
                                 "Hint: --kernels loop")
            out[name] = (stream_ir.compile_blocks(), stream.padded_rows)  # the weights here fill whole blocks
        elif name == "loop":
            loop = numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)(stream._xwt)
            out[name] = (lambda x, w, o, t, loop=loop: loop(x, w, o), lambda n: -(-n // stream.BLOCK) * stream.BLOCK)
        else:
            raise SystemExit(f"--kernels: {name!r} is not a stream kernel. Allowed: blocks, loop. "
                             "Hint: --kernels blocks,loop")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--k", default="576,1536", help="inner dimensions (SmolLM2's hidden size, Qwen2.5-1.5B's)")
    ap.add_argument("--kernels", default=None, help="blocks (AVX-512 only), loop; default: the ones this CPU runs")
    ap.add_argument("--l2-kib", type=int, default=512, help="the in-cache weight's share a thread, KiB")
    ap.add_argument("--streamed-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import numba
    import numpy as np
    import torch

    from goose.verifiers import machine

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    from goose.verifiers import stream

    stream._kernel()
    default = "blocks,loop" if stream._avx512() else "loop"
    ks = kernels([k for k in (args.kernels or default).split(",") if k])
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {machine.describe()}; {args.threads} threads; float32; vector width {stream.vector_width()}")
    rng = np.random.default_rng(0)
    for k in (int(v) for v in args.k.split(",")):
        small_o = max(12, (args.l2_kib * 1024 * args.threads // (4 * k)) // 12 * 12)
        small = rng.standard_normal((small_o, k), dtype=np.float32)
        big_o = 1536
        big = [rng.standard_normal((big_o, k), dtype=np.float32)
               for _ in range(max(1, int(args.streamed_gb * 1e9 / (4 * big_o * k))))]
        nbytes = sum(w.nbytes for w in big)
        repeat = round(len(big) * big_o / small_o)  # in-cache calls with the streamed set's multiply-adds
        res: dict = {(name, n, kind): [] for name in ks for n in rows for kind in ("cache", "stream")}
        for r in range(args.rounds):
            for n in rows:
                order = list(ks) if r % 2 == 0 else list(ks)[::-1]
                for name in order:
                    run, pad = ks[name]
                    m = pad(n)
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    o_small, o_big = np.empty((m, small_o), np.float32), np.empty((m, big_o), np.float32)
                    run(x, small, o_small, args.threads)
                    t0 = time.perf_counter()
                    for _ in range(repeat):
                        run(x, small, o_small, args.threads)
                    t1 = time.perf_counter()
                    for w in big:
                        run(x, w, o_big, args.threads)
                    t2 = time.perf_counter()
                    res[(name, n, "cache")].append((t1 - t0) * big_o / (small_o * repeat / len(big)))
                    res[(name, n, "stream")].append(t2 - t1)
        print(f"\ninner dimension {k}: streamed {len(big)} weights of {big_o} x {k} ({nbytes / 1e9:.2f} GB); "
              f"in cache one of {small_o} x {k} ({small.nbytes / 1024:.0f} KiB), {repeat} calls")
        print("| kernel | rows | in cache ms (GFLOP/s) | read alone ms | streamed ms (GFLOP/s, GB/s) | overlap |")
        print("|---|---|---|---|---|---|")
        for name in ks:
            read = min(statistics.median(res[(name, n, "stream")]) for n in rows if n <= 2) if min(rows) <= 2 \
                else None
            for n in rows:
                c, s = (statistics.median(res[(name, n, kind)]) for kind in ("cache", "stream"))
                flops = 2 * n * big_o * k * len(big)
                cells = [f"{1e3 * c:.1f} ({flops / c / 1e9:.0f})", "-" if read is None else f"{1e3 * read:.1f}",
                         f"{1e3 * s:.1f} ({flops / s / 1e9:.0f}, {nbytes / s / 1e9:.1f})"]
                if read is None:
                    cells.append("-")
                else:
                    lo, hi = max(c, read), c + read
                    cells.append(f"{(hi - s) / (hi - lo):.2f}" if hi > lo else "-")
                print(f"| {name} | {n} | " + " | ".join(cells) + " |", flush=True)
        del big


if __name__ == "__main__":
    main()
