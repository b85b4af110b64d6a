"""How much can copying from earlier text give a repeating workload, at best? (issue 22)

Reads a ``goose bench --samples K`` results.json and replays transformers' own draws (method
``ar``): for every draw, what an *oracle* copy drafter could have had verified. At each step the
oracle looks at every earlier occurrence of the last ``m`` committed tokens (``--min-match``) in
the texts it is allowed to see, takes the continuation that agrees longest with what the sampler
then drew (as if a tree of unlimited width and depth held every continuation and verification
were free), and commits that plus the target's own token. Tokens per forward pass of that oracle
bound any drafter that copies (PLD, a suffix index over the request and over earlier draws):

- ``own``: the prompt and this draw's own tokens (what a per-request source sees);
- ``history``: those and every earlier draw of the same prompt (what a cross-request source sees).

Their ratio bounds what the cross-request history can add to copying, and the ``history`` tau,
divided by a pass's cost relative to a one-token pass, bounds the speed-up of copying alone.
Printed per draw index (the first draw has no history) and pooled, beside each method's measured
tau from the same file. A count, not a timing: the machine's load does not move it.

    python benchmarks/copy_bound.py RESULTS.json [--min-match 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def longest_copy(docs: list[list[int]], seq: list[int], i: int, m: int, limit: int | None = None) -> int:
    """The longest run of ``seq[i:]`` (at most ``limit`` tokens) that follows some occurrence of ``seq[i-m:i]``
    in ``docs``."""
    if i < m:
        return 0
    key = seq[i - m : i]
    cap = len(seq) - i if limit is None else min(limit, len(seq) - i)
    best = 0
    for doc in docs:
        for j in range(m, len(doc)):
            if doc[j - m : j] == key:
                a = 0
                while a < cap and j + a < len(doc) and doc[j + a] == seq[i + a]:
                    a += 1
                best = max(best, a)
                if best == cap:
                    return best
    return best


def oracle_passes(earlier: list[list[int]], prompt: list[int], seq: list[int], m: int) -> int:
    """Forward passes of the oracle copy drafter over ``seq`` (the prefill's token is the first)."""
    passes, i, full, p = 1, 1, prompt + seq, len(prompt)
    while i < len(seq):
        n = longest_copy([*earlier, full[: p + i]], full, p + i, m)
        passes += 1
        i += n + 1
    return passes


def prompt_ids(meta: dict, dataset: str, pid: str, cache: dict) -> list[int]:
    """The prompt as the benchmark encoded it (its chat template when it used one); [] without the data."""
    from goose.tools import models
    from goose.tools.bench import select_prompts

    key = (dataset, pid)
    if key not in cache:
        if "tok" not in cache:
            from transformers import AutoTokenizer

            cache["tok"] = AutoTokenizer.from_pretrained(models.resolve(meta["model"]))
            cache["prompts"] = {(p.dataset, p.id): p for p in select_prompts(meta["datasets"])}
        tok, p = cache["tok"], cache["prompts"][key]
        text = p.text
        if meta.get("chat"):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        cache[key] = tok(text)["input_ids"]
    return cache[key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of a goose bench --samples K run")
    ap.add_argument("--min-match", type=int, default=2, help="tokens the oracle's match must have (default 2, at least 1)")
    ap.add_argument("--no-prompt", action="store_true", help="do not let the oracle copy from the prompt")
    a = ap.parse_args(argv)
    if a.min_match < 1:
        ap.error(f"--min-match {a.min_match}: must be at least 1 (a match needs a token to match). Hint: --min-match 2")
    try:
        r = json.load(open(a.results))
    except (OSError, ValueError) as exc:
        print(f"copy_bound: cannot read {a.results!r} ({exc}). Hint: the results.json that "
              "goose bench --samples K --out DIR wrote in DIR", file=sys.stderr)
        return 2
    if "runs" not in r or "meta" not in r:
        print(f"copy_bound: {a.results!r} is not a goose bench results.json (no 'meta' and 'runs')", file=sys.stderr)
        return 2
    meta, runs = r["meta"], r["runs"]
    if meta.get("samples", 1) < 2:
        print(f"copy_bound: {a.results} has no repeated draws (samples={meta.get('samples')}). "
              "Hint: goose bench ... --samples 10", file=sys.stderr)
        return 2
    draws = defaultdict(list)
    for x in runs:
        if x["method"] == "ar":
            draws[(x["dataset"], x["prompt_id"].split("#")[0])].append(x)
    cache: dict = {}
    tokens, own, hist = defaultdict(int), defaultdict(int), defaultdict(int)
    for (ds, pid), xs in draws.items():
        xs.sort(key=lambda x: x["sample"])
        prompt = [] if a.no_prompt else prompt_ids(meta, ds, pid, cache)
        for k, x in enumerate(xs, start=1):
            seq = x["tokens"]
            earlier = [y["tokens"] for y in xs[: k - 1]]
            tokens[k] += len(seq)
            own[k] += oracle_passes([], prompt, seq, a.min_match)
            hist[k] += oracle_passes(earlier, prompt, seq, a.min_match)
    measured = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for x in runs:
        if x["method"] != "ar" and x.get("forward_passes"):
            cell = measured[x["method"]][x["sample"]]
            cell[0] += len(x["tokens"])
            cell[1] += x["forward_passes"]
    methods = sorted(measured)
    print(f"oracle copy bound, {a.results} (min match {a.min_match}, prompt {'excluded' if a.no_prompt else 'included'})")
    head = "| draw | oracle tau, own text | oracle tau, with history | history / own | " + " | ".join(
        f"{m} tau" for m in methods) + " |"
    print(head)
    print("|" + "---|" * (4 + len(methods)))
    for k in sorted(tokens):
        cells = [f"{tokens[k] / own[k]:.2f}", f"{tokens[k] / hist[k]:.2f}", f"{own[k] / hist[k]:.2f}"]
        cells += [f"{c[0] / c[1]:.2f}" for c in (measured[m][k] for m in methods)]
        print(f"| {k} | " + " | ".join(cells) + " |")
    T, O, H = sum(tokens.values()), sum(own.values()), sum(hist.values())
    cells = [f"{T / O:.2f}", f"{T / H:.2f}", f"{O / H:.2f}"]
    for m in methods:
        t = sum(c[0] for c in measured[m].values())
        f = sum(c[1] for c in measured[m].values())
        cells.append(f"{t / f:.2f}")
    print("| pooled | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
