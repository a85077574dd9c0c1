"""The benchmark's plot: latency distributions (empirical CDFs), upstream against cbpause."""

from __future__ import annotations

from pathlib import Path

from .harness import Row


def plot(rows: list[Row], path: Path) -> bool:
    """Latency distributions (empirical CDFs), upstream against cbpause; False without matplotlib or
    without a latency case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    except ImportError:
        return False
    restart = next((r for r in rows if r.metric.startswith("stop/")), None)
    dists = [r for r in rows if r.samples and r.unit in ("ms", "us") and r is not restart]
    if not dists:
        return False
    cols = 3
    nrows = -(-len(dists) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, dists, strict=False):
        colors = (("upstream", "tab:orange"), ("cbpause", "tab:blue"))
        curves = [(impl, row.samples.get(impl, []), color) for impl, color in colors]
        if row.case == "6" and restart is not None:
            curves.append(("stop/restart (no pause)", restart.samples.get("upstream", []), "tab:red"))
        for label, samples, color in curves:
            xs = sorted(samples)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels even within a decade
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{row.case}: {row.metric}", fontsize=9)
        ax.set_xlabel(row.unit)
        ax.set_ylabel("fraction")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(dists) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


