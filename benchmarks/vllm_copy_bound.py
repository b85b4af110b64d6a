"""At one request, how far can any drafter that copies earlier text go past vLLM's ``ngram``? (issue 41)

Reads a ``benchmarks/vllm_serving.py`` results file (it keeps every group's prompt ids, the
no-speculation outputs, and Goose's proposer's measured step costs) and replays each greedy output
of concurrency 1, step by step, for:

- ``ngram``: vLLM's own n-gram proposer function (the benchmark's settings: n-grams of 2-4 tokens,
  ``k`` tokens), as the engine runs it: its count of passes is what the engine's metrics report;
- ``oracle m``: at each step every earlier occurrence of the last ``m`` tokens in the request's own
  prompt and output is looked at, and the continuation that agrees longest with what the model then
  generated is drafted, cut to exactly the tokens that will be accepted (at most ``k``): no drafter
  that copies from the request's own text, with any choice of match and any cut, does better;
- ``oracle m + history``: the same over the earlier prompts and outputs of the group too (what a
  cross-request source such as ``suffix`` sees at one request in the benchmark's phases).

Printed per dataset: passes, tokens per pass (the prefill's pass counted) and drafted rows per pass;
and, with the step cost measured at one request in Goose's phases of the same run (its proposer's trace:
mean seconds of a decoding step by drafted rows), each one's predicted speed over no speculation: the
no-speculation phase's measured time, less its steps at the cost of a step with no draft, plus each
step at the cost of its drafted rows. The prediction for ``ngram`` is printed beside ``ngram``'s
measured ratio as a check of the model. Counts do not depend on the machine's load; the predicted times use its costs.

    python benchmarks/vllm_copy_bound.py vllm-serving.json [--min-match 1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from copy_bound import longest_copy  # benchmarks/copy_bound.py (this script's folder is on the path)


def replay(prompts: list[list[int]], outputs: list[list[int]], draft) -> list[int]:
    """Drafted rows of every verification pass over the group, in order (the prefill's pass, which gives each
    output's first token, is not among them). ``draft(earlier, full, at, left)`` gives (drafted, accepted) at
    position ``at`` of ``full`` with ``left`` output tokens still to come."""
    rows = []
    earlier: list[list[int]] = []
    for p, out in zip(prompts, outputs):
        full = list(p) + list(out)
        i = 1
        while i < len(out):
            d, a = draft(earlier, full, len(p) + i, len(out) - i)
            rows.append(d)
            i += a + 1
        earlier.append(full)
    return rows


def ngram_drafter(k: int, lo: int = 2, hi: int = 4):
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find

    def draft(earlier, full, at, left):
        dr = find(np.asarray(full[:at]), lo, hi, 1 << 30, k).tolist()
        a = 0
        while a < len(dr) and a < left - 1 and dr[a] == full[at + a]:  # the last token is the pass's own
            a += 1
        return len(dr), a

    return draft


def oracle_drafter(k: int, m: int, history: bool):
    def draft(earlier, full, at, left):
        docs = [full[:at], *(earlier if history else ())]
        a = min(longest_copy(docs, full, at, m, k), left - 1)  # the last token is the pass's own
        return a, a  # drafts exactly what will be accepted

    return draft


def step_costs(trace: str, requests: int = 1) -> dict[int, tuple[int, float]]:
    """{drafted rows: (steps, mean seconds)} of the decoding steps with ``requests`` requests in Goose's
    proposer's trace (``GOOSE_VLLM_TRACE``, JSON lines): a step's time is the clock between the call that
    planned it and the next call; a step that ran a prompt or lost a request is left out."""
    calls = []
    try:
        with open(trace) as f:
            for line in f:
                e = json.loads(line)
                if isinstance(e, list) and len(e) >= 7:
                    calls.append(e)
    except OSError:
        return {}
    acc: dict[int, list[float]] = {}
    for a, b in zip(calls, calls[1:]):
        if a[0] == requests and not b[5] and b[3] > a[3]:
            acc.setdefault(a[1] - a[0], []).append((b[3] - a[3]) / 1e3)
    return {d: (len(v), statistics.fmean(v)) for d, v in sorted(acc.items())}


def cost_curve(costs: dict[int, tuple[int, float]], min_steps: int = 5):
    """Seconds of a step by drafted rows: the measured means (row counts with at least ``min_steps`` steps) made
    non-decreasing (a mean above the next is pooled with it, weighted by steps), interpolated, and extended past
    the last along the slope from the first; None without a measured step that drafted nothing."""
    from goose.vllm import pool_non_decreasing

    pts = [(float(d), s, float(n)) for d, (n, s) in costs.items() if n >= min_steps]
    if not pts or pts[0][0] != 0.0:
        return None
    pooled = pool_non_decreasing(pts)
    xs = np.array([x for x, _ in pooled])
    ys = np.array([y for _, y in pooled])
    xs[0] = 0.0  # the baseline stays at no drafts
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if len(xs) > 1 and xs[-1] > xs[0] else 0.0

    def cost(d: float) -> float:
        if d > xs[-1]:
            return float(ys[-1] + slope * (d - xs[-1]))
        return float(np.interp(d, xs, ys))

    return cost, list(zip(xs.tolist(), ys.tolist()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a benchmarks/vllm_serving.py --out file")
    ap.add_argument("--min-match", default="1,2", help="the oracle's match lengths, comma-separated")
    ap.add_argument("--trace", default="", help="Goose's proposer's trace (default: the one the benchmark wrote "
                    "beside RESULTS, RESULTS.none+goose.json.trace)")
    args = ap.parse_args()
    try:
        ms = sorted({int(x) for x in args.min_match.split(",")})
    except ValueError:
        ms = []
    if not ms or ms[0] < 1:
        ap.error(f"--min-match must be positive integers joined by commas, got {args.min_match!r}. Hint: --min-match 1,2")
    try:
        with open(args.results) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read the results file {args.results!r} ({e}). Allowed: the JSON a benchmarks/vllm_serving.py "
                 "run wrote with --out. Hint: run it with --concurrency 1 first")
    ones = [g for g in res.get("prompts", {}) if g.endswith("|1")]
    if not ones or "none_tokens" not in res:
        ap.error(f"{args.results!r} has no prompts or no-speculation outputs at concurrency 1 (written by "
                 "benchmarks/vllm_serving.py since this script exists, for runs that include --concurrency 1). Hint: "
                 "rerun the benchmark with --concurrency 1 --configs none,ngram,goose")
    k = int(res.get("k", 8))
    costs = step_costs(args.trace or f"{args.results}.none+goose.json.trace")
    model = cost_curve(costs)
    print(f"CPU: {res.get('cpu')}; vLLM {res.get('vllm')}; k = {k}")
    if costs:
        print("decoding steps at one request in Goose's phases (drafted rows: steps, mean ms): "
              + ", ".join(f"{d}: {n}, {1e3 * s:.1f}" for d, (n, s) in costs.items()))
    rows = res["rows"]
    print("\n| dataset | drafter | passes | tokens per pass | drafted per pass | predicted / none | measured / none |")
    print("|---|---|---|---|---|---|---|")
    for group, prompts in res.get("prompts", {}).items():
        ds, c = group.rsplit("|", 1)
        if c != "1":
            continue
        outputs = res["none_tokens"].get(f"{ds}|1|0|none")
        if outputs is None:
            continue
        n = sum(len(o) for o in outputs)
        drafters = [("ngram", ngram_drafter(k))]
        for m in ms:
            drafters.append((f"oracle m={m}", oracle_drafter(k, m, False)))
            drafters.append((f"oracle m={m} + history", oracle_drafter(k, m, True)))
        none_s = statistics.median(r["seconds"] for r in rows if r["dataset"] == ds and r["concurrency"] == 1
                                   and r["config"] == "none")
        measured = {}
        for r in rows:
            if r["dataset"] == ds and r["concurrency"] == 1 and r.get("speedup"):
                measured.setdefault(r["config"], []).append(r)
        for name, draft in drafters:
            steps = replay(prompts, outputs, draft)
            passes = len(steps) + len(outputs)
            pred = "-"
            if model is not None:  # no speculation's time, its n - prompts decoding steps priced as steps drafting none
                cost = model[0]
                t = none_s - (n - len(outputs)) * cost(0.0) + sum(cost(d) for d in steps)
                pred = f"{none_s / t:.3f}x"
            print(f"| {ds} | {name} | {passes} | {n / passes:.3f} | {sum(steps) / passes:.2f} | {pred} | "
                  f"{_measured(measured.get(name, []))} |")
        if measured.get("goose"):
            got = measured["goose"]
            passes = _passes(got)
            drafted = statistics.median(r["draft_tokens"] for r in got) if passes else None
            print(f"| {ds} | Goose's proposer | {passes or '-'} | {f'{n / passes:.3f}' if passes else '-'} | "
                  f"{f'{drafted / passes:.2f}' if passes else '-'} | - | {_measured(got)} |")
    return 0


def _passes(rows: list[dict]) -> float | None:
    """Passes of the engine over a phase (median over rounds): each commits one token and the drafts accepted."""
    if not rows or not all("accepted_tokens" in r for r in rows):
        return None
    return statistics.median(r["tokens"] - r["accepted_tokens"] for r in rows)


def _measured(rows: list[dict]) -> str:
    if not rows:
        return "-"
    passes = _passes(rows)
    return f"{statistics.median(r['speedup'] for r in rows):.3f}x" + (f" ({passes:g} passes)" if passes else "")


if __name__ == "__main__":
    sys.exit(main())
