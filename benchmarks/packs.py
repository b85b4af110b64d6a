"""What MKL-packed linear weights take, per layer kind, and what each form costs on few rows.

    python benchmarks/packs.py --model smollm2

Packs every linear layer of the model (verifiers/skinny.py: resident memory measured as each is
made; the layout is opaque to torch) and prints MiB per layer kind against the weights' MiB. Then
times all the model's linear layers on 1, 2, 4, 8, 16 rows in each form (stock ``F.linear``, the
packed GEMM, ``weight @ x.T``; median of ``--repeats``): whether the packed layout could serve
one-token steps as well as tree passes.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    from goose.verifiers import machine
    from goose.tools import models
    from goose.verifiers import skinny

    torch.set_num_threads(a.threads)
    model, _ = models.load(a.model, "float32")
    names = {m: n.split(".")[-1] for n, m in model.named_modules()}
    mods = skinny.linears(model)
    if not skinny.packed_supported(mods):
        raise SystemExit("no MKL packed GEMM for this model here")
    skinny.release_packs(mods)
    skinny.prepack(mods, limit_mib=1 << 20)
    kinds: dict = collections.defaultdict(lambda: [0, 0, 0])
    for m in mods:
        k = kinds[names[m]]
        k[0] += 1
        k[1] += skinny._packs[m][3]
        k[2] += m.weight.nbytes
    print(f"CPU: {machine.describe()}; {a.model} float32, {a.threads} threads\n")
    print("| layer | count | packs MiB | weights MiB | ratio |\n|---|---|---|---|---|")
    for name, (n, pb, wb) in kinds.items():
        print(f"| {name} | {n} | {pb / 2**20:.1f} | {wb / 2**20:.1f} | {pb / wb:.2f} |")
    total_p, total_w = skinny.packed_bytes(mods), sum(m.weight.nbytes for m in mods)
    print(f"| all | {len(mods)} | {total_p / 2**20:.0f} | {total_w / 2**20:.0f} | {total_p / total_w:.2f} |\n")

    def once(rows: int, form: str) -> float:
        xs = [torch.randn(rows, m.weight.shape[1]) for m in mods]
        with torch.inference_mode():
            t0 = time.perf_counter()
            for m, x in zip(mods, xs):
                if form == "stock":
                    F.linear(x, m.weight, m.bias)
                elif form == "packed":
                    torch.ops.mkl._mkl_linear(x, skinny._pack(m), m.weight, m.bias, rows)
                else:
                    torch.matmul(m.weight, x.t())
            return time.perf_counter() - t0

    print("| rows | stock ms | packed ms | weight @ x.T ms |\n|---|---|---|---|")
    for rows in (1, 2, 4, 8, 16):
        ms = []
        for form in ("stock", "packed", "skinny"):
            once(rows, form)
            ms.append(1000 * statistics.median(once(rows, form) for _ in range(a.repeats)))
        print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in ms) + " |")
    skinny.release_packs(mods)


if __name__ == "__main__":
    main()
