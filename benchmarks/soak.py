"""Soak: many generations on one decoder; resident memory and latency per token over time.

    python benchmarks/soak.py --generations 1000 --out soak.json

The decoder (default configuration: ``pld`` + ``tr`` under ``spine-fit``, SmolLM2 float32, 2
threads) decodes blocks of 100 generations; every block is the same 100 (prompt, length) pairs
(prompts from HumanEval, GSM8K, MT-Bench, Spec-Bench summarization and the demo set, max_new_tokens
cycling 8 / 32 / 64 / 128), so the blocks' latencies compare like with like. After each block:
resident memory (VmRSS) and the block's seconds per generated token. Every output is checked
against plain greedy decoding of the same pair, decoded once before the soak.
"""

from __future__ import annotations

import argparse
import json
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--generations", type=int, default=1000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    import goose
    from goose.verifiers import machine
    from goose.tools import datasets, models

    torch.set_num_threads(a.threads)
    model, tok = models.load(a.model, a.dtype)
    pool = []
    for spec in ("humaneval", "gsm8k", "mt_bench", "spec_bench:summarization"):
        pool += datasets.load(spec)[:24]
    pool += datasets.demo()
    lengths = (8, 32, 64, 128)
    pairs = [(tok(pool[i % len(pool)].text, return_tensors="pt")["input_ids"][0], lengths[i % 4]) for i in range(100)]
    greedy = goose.greedy(model, tok)
    ref = [greedy.generate(ids, max_new_tokens=n).token_ids for ids, n in pairs]
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy="spine-fit")
    rows, mismatches = [], 0
    print(f"CPU: {machine.describe()}; {a.model} {a.dtype}, {a.threads} threads; start RSS {rss_mib():.0f} MiB", flush=True)
    for block in range(a.generations // 100):
        toks = 0
        t0 = time.perf_counter()
        for (ids, n), r in zip(pairs, ref):
            out = dec.generate(ids, max_new_tokens=n)
            toks += len(out.token_ids)
            mismatches += out.token_ids != r
        dt = time.perf_counter() - t0
        rows.append({"generations": 100 * (block + 1), "rss_mib": rss_mib(), "ms_per_token": 1000 * dt / toks})
        print(f"after {100 * (block + 1):>5}: RSS {rows[-1]['rss_mib']:.1f} MiB, {rows[-1]['ms_per_token']:.2f} ms/token, "
              f"mismatches {mismatches}", flush=True)
    growth = (rows[-1]["rss_mib"] - rows[0]["rss_mib"]) / rows[0]["rss_mib"]
    drift = rows[-1]["ms_per_token"] / rows[0]["ms_per_token"]
    print(f"\nmemory growth after the first 100: {growth:+.2%}; latency per token last/first block: {drift:.3f}; "
          f"outputs different from greedy: {mismatches} of {100 * len(rows)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": machine.describe(), "rows": rows, "growth": growth, "drift": drift, "mismatches": mismatches}, f, indent=1)


if __name__ == "__main__":
    main()
