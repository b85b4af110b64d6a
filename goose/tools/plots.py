"""PNG plots for ``goose bench`` (matplotlib, Agg backend; optional dependency ``goose-spec[plots]``)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _bars(plt, groups: list[str], series: dict[str, list[float]], figsize) -> tuple:
    """A grouped bar chart: one group of bars per ``groups`` entry, one bar per ``series`` entry in each."""
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(series)
    for j, (label, vals) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=20)
    return fig, ax


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_plots(rows: list[dict], out: Path, tree_step=None) -> list[Path]:
    """speedup and tau per dataset and method; acceptance by source; one drawn tree. Returns the paths written."""
    plt = _plt()
    if plt is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    datasets = [d for d in dict.fromkeys(r["dataset"] for r in rows) if d != "ALL"] + ["ALL"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["dataset"], r["method"]): r for r in rows}
    for key, label, fname in [
        ("speedup_pooled", "speedup over greedy (pooled)", "speedup.png"),
        ("speedup_median", "speedup over greedy (median per prompt)", "speedup_median.png"),
        ("tau", "tau (tokens per forward pass)", "tau.png")]:
        ms = [m for m in methods if any(by.get((d, m), {}).get(key) is not None for d in datasets)]
        if not ms:
            continue
        series = {m: [by.get((d, m), {}).get(key) or 0.0 for d in datasets] for m in ms}
        fig, ax = _bars(plt, datasets, series, (max(6, 1.3 * len(datasets) * max(1, len(ms)) / 3), 4))
        if key.startswith("speedup"):
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel(label)
        ax.legend(fontsize=8, ncol=min(4, len(ms)))
        paths.append(_save(plt, fig, out / fname))
    ms = [m for m in methods if by.get(("ALL", m), {}).get("per_source")]
    if ms:
        sources = [by[("ALL", m)]["per_source"] for m in ms]
        origins = sorted({o for ps in sources for o in ps})
        series = {o: [ps.get(o, {}).get("accepted", 0) / ps[o]["drafted"] if ps.get(o, {}).get("drafted") else 0.0
                      for ps in sources] for o in origins}
        fig, ax = _bars(plt, ms, series, (7, 4))
        ax.set_ylabel("accepted / drafted nodes")
        ax.set_title("acceptance by source (all datasets)")
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "acceptance.png"))
    if tree_step is not None:
        p = out / "tree.png"
        draw_tree(tree_step.tree, tree_step.verified.path, p, title=f"step {tree_step.step}: route {tree_step.tree.route}")
        paths.append(p)
    return paths


COLORS = {"root": "#444444", "lead": "#1f77b4", "pld": "#1f77b4", "branch": "#ff7f0e", "root-branch": "#2ca02c"}


def draw_tree(tree, path, file: Path, title: str = "") -> None:
    """Depth on x, one row per leaf on y; the accepted path in red."""
    plt = _plt()
    if plt is None:
        return
    n = tree.num_nodes
    y = [0.0] * n
    leaf_row = [0]
    stack = [0]  # leaves get rows in depth-first order, without recursion (a chain may be thousands deep)
    while stack:
        i = stack.pop()
        if not tree.children[i]:
            y[i] = leaf_row[0]
            leaf_row[0] += 1
        stack.extend(reversed(tree.children[i]))
    for i in range(n - 1, -1, -1):  # a parent's index is below its children's: children are placed first
        if tree.children[i]:
            y[i] = sum(y[c] for c in tree.children[i]) / len(tree.children[i])
    acc = set(path)
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.4 * max(tree.depths)), min(12, max(3.5, 1 + 0.18 * leaf_row[0]))))
    for i in range(1, n):
        p = tree.parents[i]
        on = i in acc and p in acc
        ax.plot([tree.depths[p], tree.depths[i]], [y[p], y[i]], color="red" if on else "#bbbbbb", lw=2 if on else 0.7, zorder=1)
    for i in range(n):
        ax.scatter(tree.depths[i], y[i], s=28 if i in acc else 14, color=COLORS.get(tree.origins[i], "#9467bd"),
                   edgecolors="red" if i in acc else "none", zorder=2)
    for o, c in COLORS.items():
        ax.scatter([], [], color=c, label=o)
    ax.plot([], [], color="red", label="accepted path")
    ax.set_xlabel("depth")
    ax.set_yticks([])
    ax.set_title(title or f"draft tree: {n} nodes, accepted {len(path) - 1}")
    ax.legend(fontsize=8, loc="upper right")
    _save(plt, fig, file)
