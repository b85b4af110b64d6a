"""Calibrate where ``spine-fit`` starts its trust in a context match: pld's confidence tiers (issue 21).

A fresh decoder knows nothing of this request, so ``fit`` starts every spine at a pessimistic
prior and trusts a long chain only once it is earned; on a prompt whose first match is right for
50 tokens, plain PLD then wins. ``FitOptions.source_priors`` starts a chain of a confidence tier
at (p_1, p_deeper) instead. This script measures those two numbers per tier, offline:

for each prompt, the model's greedy output (``model.generate``, ``--max-new-tokens``); at every
position of it, what ``pld`` (default options) would propose from the prompt and the tokens
before, and how many of its tokens the greedy output then continues with (what a verifier would
accept). Per tier of pld's confidence: p_1 of the *first* proposal of each prompt in that tier
(what a fresh decoder meets first), and the conditional rate of depth d >= 2 given depth d - 1
(pooled over those first proposals, then over all). No timing: the machine's load does not move it.

    python benchmarks/pld_tiers.py --model gemma-3-270m [--datasets SPEC] [--out rows.json]

The default prompts are the tune split's four datasets and Spec-Bench QA and translation,
prompts 1-20 each (never the measure split's 41-60); they need ``--data-dir`` or ``$GOOSE_DATA``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

TUNE = ("humaneval@1-20,gsm8k@1-20,mt_bench@1-20,spec_bench:summarization@1-20,"
        "spec_bench:qa@1-20,spec_bench:translation@1-20")
TIERS = ((1.0, "1.0 (consensus)"), (0.7, "0.7-0.9 (long match)"), (0.0, "< 0.7 (short match)"))


def tier_of(conf: float) -> str:
    return next(label for floor, label in TIERS if conf >= floor)


def proposals(model, tok, prompts, max_new: int) -> list[dict]:
    import torch

    from goose.interfaces import DraftState
    from goose.plugins.pld import PLDSource

    rows = []
    for k, p in enumerate(prompts):
        ids = tok(p.text, return_tensors="pt")["input_ids"]
        pad = getattr(model.generation_config, "eos_token_id", None) or 0
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
        with torch.inference_mode():
            g = model.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids),
                               pad_token_id=pad)
        prompt, gen = ids[0].tolist(), g[0, ids.shape[1]:].tolist()
        src = PLDSource()
        src.begin(None)
        for i in range(len(gen)):
            toks = prompt + gen[:i]
            st = DraftState(toks, len(prompt), toks[-1], toks[-2] if len(toks) > 1 else None, 60, len(gen) - i, i)
            prop = src.propose(st)
            if prop is None:
                continue
            rest, a = gen[i:], 0
            while a < len(prop.tokens) and a < len(rest) and prop.tokens[a] == rest[a]:
                a += 1
            rows.append(dict(dataset=p.dataset, prompt=p.id, pos=i, confidence=prop.confidence, n=len(prop.tokens),
                             accepted=a, left=len(rest)))
        print(f"pld_tiers: {k + 1}/{len(prompts)} {p.dataset} {p.id}", file=sys.stderr, flush=True)
    return rows


def deeper(rows: list[dict]) -> tuple[float, int]:
    """Pooled rate of depth d >= 2 given d - 1 (trials counted where the chain and the output reach d)."""
    t = h = 0
    for r in rows:
        for d in range(2, min(r["n"], r["left"]) + 1):
            if r["accepted"] >= d - 1:
                t += 1
                h += r["accepted"] >= d
    return (h / t if t else float("nan")), t


def table(rows: list[dict]) -> str:
    out = ["| pld confidence tier | proposals | prompts (first proposal) | p_1 of the first | p_deeper, first | p_deeper, all |",
           "|---|---|---|---|---|---|"]
    for _, label in TIERS:
        rs = [r for r in rows if tier_of(r["confidence"]) == label]
        first: dict = {}
        for r in rs:
            key = (r["dataset"], r["prompt"])
            if key not in first or r["pos"] < first[key]["pos"]:
                first[key] = r
        fs = list(first.values())
        if not fs:
            out.append(f"| {label} | 0 | 0 | - | - | - |")
            continue
        p1 = sum(r["accepted"] >= 1 for r in fs) / len(fs)
        (df, tf), (da, ta) = deeper(fs), deeper(rs)
        out.append(f"| {label} | {len(rs)} | {len(fs)} | {p1:.2f} | {df:.2f} ({tf}) | {da:.2f} ({ta}) |")
    return "\n".join(out)


BANDS = ((2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))


def by_depth(rows: list[dict]) -> str:
    """Per tier, the rate of depth d given d - 1 in bands of d, over all proposals: does a copy that has
    held longer hold on likelier? (A floor rising with depth lost to the flat one: docs/results-archive.md.)"""
    out = ["| pld confidence tier | " + " | ".join(f"p_d, d {a}-{b}" if a != b else f"p_{a}" for a, b in BANDS) + " |",
           "|---" * (len(BANDS) + 1) + "|"]
    for _, label in TIERS:
        rs = [r for r in rows if tier_of(r["confidence"]) == label]
        cells = []
        for lo, hi in BANDS:
            t = h = 0
            for r in rs:
                for d in range(lo, min(hi, r["n"], r["left"]) + 1):
                    if r["accepted"] >= d - 1:
                        t += 1
                        h += r["accepted"] >= d
            cells.append(f"{h / t:.3f} ({t})" if t else "-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--datasets", default=TUNE, help="prompts (goose bench's --datasets syntax); default: prompts 1-20")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the per-proposal rows here (JSON)")
    ap.add_argument("--rows", default=None, help="tabulate rows written earlier by --out instead of running the model")
    a = ap.parse_args(argv)
    if a.rows:
        try:
            rows = json.load(open(a.rows))
        except (OSError, ValueError) as exc:
            print(f"pld_tiers: cannot read {a.rows!r} ({exc}). Hint: the file an earlier run wrote with --out",
                  file=sys.stderr)
            return 2
    else:
        import torch

        from goose.tools import models
        from goose.tools.bench import select_prompts

        torch.set_num_threads(a.threads)
        prompts = select_prompts(a.datasets, a.data_dir)
        model, tok = models.load(a.model, "float32")
        rows = proposals(model, tok, prompts, a.max_new_tokens)
        if a.out:
            json.dump(rows, open(a.out, "w"))
    per = defaultdict(int)
    for r in rows:
        per[r["dataset"]] += 1
    print(f"pld proposals along greedy outputs: {len(rows)} ({dict(per)})")
    print(table(rows))
    print()
    print(by_depth(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
