"""PNG plots of the checks (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

from pathlib import Path


def write_plots(plots: dict, out_dir: str | Path) -> list[Path]:
    """Write the plots whose data ``plots`` holds; return the files written.

    Raises ImportError when matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    if "allocation" in plots:
        cases = plots["allocation"]
        fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4), squeeze=False)
        for ax, c in zip(axes[0], cases, strict=True):
            depth = list(range(1, c["L"] + 1))
            ax.plot(depth, c["optimal"], "o-", label="optimal (greedy, exact)")
            ax.plot(depth, c["harmonic"], "s--", label="harmonic 1/i")
            ax.plot(depth, c["uniform"], "^:", label="uniform")
            b0 = c["optimal"][0]
            ax.plot(depth, [max(0.0, b0 - c["slope"] * (d - 1)) for d in depth], color="gray", lw=0.8,
                    label=f"KKT slope -{c['slope']:.2f}")
            ax.set_title(f"p={c['p']}, q={c['q']}, L={c['L']}, M={c['M']}")
            ax.set_xlabel("spine depth")
            ax.set_ylabel("branches")
            ax.legend(fontsize=8)
        fig.suptitle("Proposition 2: branch allocation along the spine")
        fig.tight_layout()
        written.append(_save(fig, out / "allocation_vs_depth.png", plt))

    if "prop3" in plots:
        rows = plots["prop3"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, p in enumerate(sorted({r["p"] for r in rows})):
            pr = [r for r in rows if r["p"] == p]
            x = [r["ratio"] for r in pr]
            color = f"C{i}"
            ax.plot(x, [100 * (r["spine"] / r["iso"] - 1) for r in pr], "o-", ms=3, color=color,
                    label=f"p={p}: spine rule / best iso-k")
            ax.plot(x, [100 * (r["opt"] / r["iso"] - 1) for r in pr], "--", color=color,
                    label=f"p={p}: model optimum / best iso-k")
            ax.plot(x, [100 * (r["spine"] / r["single"] - 1) for r in pr], ":", color=color,
                    label=f"p={p}: spine rule / best single source")
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("p / q")
        ax.set_ylabel("gain in expected tokens per step (%)")
        ax.set_title("Proposition 3: anisotropic vs isotropic (budget 60)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "spine_vs_iso_gain.png", plt))

    if "tau" in plots:
        pts = plots["tau"]
        fig, ax = plt.subplots(figsize=(5, 5))
        lo = min(min(m, p) for _, m, p in pts) * 0.95
        hi = max(max(m, p) for _, m, p in pts) * 1.05
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        for name, m, p in pts:
            ax.scatter([m], [p])
            ax.annotate(name, (m, p), fontsize=8)
        ax.set_xlabel("measured tau")
        ax.set_ylabel("predicted tau")
        ax.set_title(plots.get("tau_title", "predicted vs measured tau"), fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out / "tau_predicted_vs_measured.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
