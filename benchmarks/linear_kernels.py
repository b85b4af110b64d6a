"""One linear layer of the three models' shapes, alone: stock ``F.linear``, ``weight @ x.T`` and the stream
kernel (verifiers/stream.py) on 1-32 rows, float32, interleaved per repetition (docs/speed.md, issue 40).

Prints milliseconds and the rate at which the weight was read (its bytes / the time): at the memory
limit one pass costs what reading the weight costs, whatever the row count.

    python benchmarks/linear_kernels.py --threads 2 --rows 1,4,8,16,32
    python benchmarks/linear_kernels.py --tiles 12x2,8x3,6x3,16x2,8x2,4x4,16x1 --rows 1,2,4,8,16,32

``--tiles`` times block shapes of the kernel instead (W x X: W weight rows against X input rows at a
time, W*X running sums), each compiled from the same loop written out for that shape: how the stream
kernel's 12 x 2 was chosen.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {  # name: (out features, in features)
    "smollm2 lm head": (49152, 576),
    "smollm2 mlp up": (1536, 576),
    "gemma-3-270m lm head": (262144, 640),
    "qwen2.5-coder-1.5b mlp up": (8960, 1536),
    "qwen2.5-coder-1.5b mlp down": (1536, 8960),
    "qwen2.5-coder-1.5b lm head": (151936, 1536),
}


def tile_kernel(tw: int, tx: int):
    """The stream kernel's loop for blocks of ``tw`` weight rows and ``tx`` input rows (weight rows past the
    last whole block are left out: timing only)."""
    import numba
    import numpy as np

    lines = ["def k(x, w, out):", "    n, kd = x.shape", f"    for b in numba.prange(w.shape[0] // {tw}):",
             f"        o = b * {tw}"]
    lines += [f"        w{i} = w[o + {i}]" for i in range(tw)]
    lines += [f"        for r in range(0, n, {tx}):"] + [f"            x{j} = x[r + {j}]" for j in range(tx)]
    lines += [f"            a{i}_{j} = np.float32(0)" for i in range(tw) for j in range(tx)]
    lines += ["            for k in range(kd):"] + [f"                y{j} = x{j}[k]" for j in range(tx)]
    for i in range(tw):
        lines.append(f"                v = w{i}[k]")
        lines += [f"                a{i}_{j} += v * y{j}" for j in range(tx)]
    lines += [f"            out[r + {j}, o + {i}] = a{i}_{j}" for i in range(tw) for j in range(tx)]
    ns = {"numba": numba, "np": np}
    exec("\n".join(lines), ns)
    return numba.njit(parallel=True, fastmath=True, boundscheck=False)(ns["k"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tiles", default=None, help="block shapes WxX to time instead of the three forms")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from goose.verifiers import machine
    from goose.verifiers import stream

    torch.set_num_threads(args.threads)
    forms = {
        "F.linear": lambda x, w: F.linear(x, w),
        "weight @ x.T": lambda x, w: torch.matmul(w, x.t()),
        "stream": lambda x, w: stream.linear(x, w),
    }
    if args.tiles:
        import numba
        import numpy as np

        numba.set_num_threads(args.threads)
        forms = {}
        for tile in args.tiles.split(","):
            tw, tx = (int(v) for v in tile.split("x"))
            kern = tile_kernel(tw, tx)

            def run(x, w, kern=kern, tx=tx):
                rows = -(-x.shape[0] // tx) * tx
                xp = np.zeros((rows, x.shape[1]), np.float32)
                xp[: x.shape[0]] = x.numpy()
                kern(xp, w.numpy(), np.empty((rows, w.shape[0]), np.float32))

            forms[tile] = run
    print(f"CPU: {machine.describe()}; {args.threads} threads; float32")
    print("| layer | rows | " + " | ".join(f"{f} ms (GB/s)" for f in forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    g = torch.Generator().manual_seed(0)
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, generator=g)
        gb = w.numel() * 4 / 1e9
        reps = max(3, args.reps // 2) if w.numel() > 5e7 else args.reps
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f, generator=g)
            times = {f: [] for f in forms}
            with torch.inference_mode():
                for f, fn in forms.items():  # untimed: the first call of a shape
                    fn(x, w)
                for _ in range(reps):
                    for f, fn in forms.items():
                        t0 = time.perf_counter()
                        fn(x, w)
                        times[f].append(time.perf_counter() - t0)
            cells = []
            for f in forms:
                t = statistics.median(times[f])
                cells.append(f"{1000 * t:.2f} ({gb / t:.1f})")
            print(f"| {name} | {rows} | " + " | ".join(cells) + " |", flush=True)
        del w


if __name__ == "__main__":
    main()
