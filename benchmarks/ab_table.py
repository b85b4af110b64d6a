"""The table of a two-commit run (benchmarks/ab_checkouts.sh): per side and method, the speedup over
that side's own ``ar`` pooled and median per prompt, outputs identical to greedy, forward passes,
and per dataset.

    python benchmarks/ab_table.py OUT
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import defaultdict


def main(out: str) -> None:
    rows: dict = defaultdict(list)  # (side, method) -> [(dataset, ar seconds, seconds, forwards, identical)]
    secs: dict = {}  # (side, method, dataset, prompt) -> seconds
    for side in "AB":
        for path in sorted(glob.glob(f"{out}/{side}-*/results.json")):
            runs = json.load(open(path))["runs"]
            ar = {(r["dataset"], r["prompt_id"]): r for r in runs if r["method"] == "ar"}
            for r in runs:
                if r["method"] == "ar":
                    continue
                ref = ar[(r["dataset"], r["prompt_id"])]
                rows[(side, r["method"])].append(
                    (r["dataset"], ref["seconds"], r["seconds"], r.get("forward_passes"), r["tokens"] == ref["tokens"])
                )
                secs[(side, r["method"], r["dataset"], r["prompt_id"])] = r["seconds"]
    if not rows:
        sys.exit(f"ab_table: no {out}/A-*/results.json or {out}/B-*/results.json; is {out!r} the OUT folder "
                 "of benchmarks/ab_checkouts.sh, and did its runs finish (OUT/done, the OUT/*.log files)?")
    print("| method | side | pooled | median | identical | forwards | per dataset (pooled) |")
    print("|---|---|---|---|---|---|---|")
    for (side, method), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pooled = sum(a for _, a, _, _, _ in v) / sum(s for _, _, s, _, _ in v)
        median = statistics.median(a / s for _, a, s, _, _ in v)
        by = defaultdict(lambda: [0.0, 0.0])
        for d, a, s, _, _ in v:
            by[d][0] += a
            by[d][1] += s
        per = ", ".join(f"{d.split(':')[-1]} {a / s:.2f}x" for d, (a, s) in by.items())
        same = sum(x[4] for x in v)
        fwd = sum(x[3] or 0 for x in v)
        print(f"| {method} | {side} | {pooled:.2f}x | {median:.2f}x | {same}/{len(v)} | {fwd} | {per} |")

    print()
    print("| method | A seconds / B seconds, pooled | median per prompt | prompts |")
    print("|---|---|---|---|")
    for method in sorted({m for _, m in rows}):
        pairs = [(t, secs[("B", *key)]) for (side, *key), t in secs.items()
                 if side == "A" and key[0] == method and ("B", *key) in secs]
        if pairs:
            pooled = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
            median = statistics.median(a / b for a, b in pairs)
            print(f"| {method} | {pooled:.2f} | {median:.2f} | {len(pairs)} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/ab_table.py OUT  (the OUT folder of benchmarks/ab_checkouts.sh)")
    main(sys.argv[1])
