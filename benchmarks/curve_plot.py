"""Plot latency curves written by ``goose calibrate --full --json FILE`` (t(n) against n).

    python benchmarks/curve_plot.py --out docs/img/latency.png a.json b.json ...

Each curve is drawn relative to its own t(1); sizes whose tree pass ran faster with the
``weight @ x.T`` linear layers are marked.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    cpu = None
    for f in a.files:
        d = json.load(open(f))
        cpu = d.get("cpu", cpu)
        n, t = d["sizes"], d["seconds"]
        rel = [x / t[0] for x in t]
        line, = ax.plot(n, rel, marker=".", label=f"{d['model']} {d['dtype']} (t(1) = {1000 * t[0]:.0f} ms)")
        sk = set(d.get("skinny", ()))
        xs = [x for x in n if x in sk]
        ax.plot(xs, [rel[n.index(x)] for x in xs], "o", mfc="none", color=line.get_color(), ms=7)
    ax.set_xlabel("tokens in one forward (tree nodes), over a 256-token cache")
    ax.set_ylabel("forward time / one-token forward")
    ax.set_title(f"Forward latency, {d['threads']} threads; circles: weight @ x.T faster\n{cpu}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
