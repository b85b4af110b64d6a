"""The drafting decisions of a checkout, with the clock taken out: for comparing two commits that should not
change behaviour (a refactor), where `goose bench`'s `spine-fit` follows each machine's step times.

    # in each checkout (a worktree of benchmarks/ab_checkouts.sh, PYTHONPATH set to it):
    python benchmarks/decisions_ab.py run --model smollm2 --data-dir DATA --out A.json
    python benchmarks/decisions_ab.py compare A.json B.json

``run`` decodes the prompts (default: prompts 41-42 of every dataset of the measure split, 64 new tokens) with
``pld + tr`` under ``spine-fit`` on a fixed latency curve (no observed-time correction: its trees depend on the
code alone), ``spine`` and ``iso3``, and writes each generation's forward passes and a digest of its tokens.
``compare`` counts, per policy, the prompts with the same tokens and the same forward passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import defaultdict

SPECS = ("humaneval@41-42,gsm8k@41-42,mt_bench@41-42,spec_bench:summarization@41-42,spec_bench:qa@41-42,"
         "spec_bench:translation@41-42")
# seconds per tree size: SmolLM2-135M float32 on 2 AVX-512 cores, rounded (any fixed curve serves the comparison)
CURVE = {1: 0.065, 2: 0.07, 4: 0.075, 8: 0.085, 16: 0.097, 32: 0.135, 64: 0.205}


def run(a) -> None:
    import torch

    import goose
    from goose.tools import models
    from goose.tools.bench import select_prompts

    torch.set_num_threads(a.threads)
    model, tok = models.load(a.model, "float32")
    prompts = select_prompts(a.datasets, a.data_dir)
    rows = []
    for policy, opts in (("spine-fit", {"latency": CURVE}), ("spine", None), ("iso3", None)):
        dec = goose.compose(model, tok, sources=["pld", "tr"], policy=policy, policy_options=opts)
        for p in prompts:
            out = dec.generate(tok(p.text, return_tensors="pt")["input_ids"][0], max_new_tokens=a.max_new_tokens)
            rows.append([policy, p.dataset, p.id, out.stats.forward_passes,
                         hashlib.sha1(str(out.token_ids).encode()).hexdigest()[:12]])
    with open(a.out, "w") as f:
        json.dump(rows, f)
    print(f"{len(rows)} generations written to {a.out}")


def compare(a) -> None:
    with open(a.a) as f:
        left = json.load(f)
    with open(a.b) as f:
        right = json.load(f)
    count: dict = defaultdict(lambda: [0, 0, 0, 0, 0])  # policy -> n, same tokens, same forwards, forwards A, B
    for x, y in zip(left, right):
        if x[:3] != y[:3]:
            raise SystemExit(f"the two runs decoded different prompts: {x[:3]} / {y[:3]}")
        c = count[x[0]]
        c[0] += 1
        c[1] += x[4] == y[4]
        c[2] += x[3] == y[3]
        c[3] += x[3]
        c[4] += y[3]
    for policy, (n, tok, fw, fa, fb) in count.items():
        print(f"{policy:>10}: {n} prompts; same tokens {tok}/{n}; same forward passes {fw}/{n} ({fa} / {fb} in all)")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--data-dir", default=None)
    r.add_argument("--datasets", default=SPECS)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args()
    run(a) if a.cmd == "run" else compare(a)


if __name__ == "__main__":
    main()
