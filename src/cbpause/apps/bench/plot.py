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
    _finish(plt, fig, axes, len(dists), path)
    return True


def plot_scaling(rows: list[Row], path: Path) -> bool:
    """Case 10: p50 against holders, waiting requests and TP ranks, one panel per axis and metric, upstream against
    cbpause; False without matplotlib or without case 10."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ...testing import percentile

    panels: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.scale is not None and row.samples:
            what = row.metric.split(": ", 1)[1]
            panels.setdefault((row.scale[0], what), []).append(row)
    if not panels:
        return False
    cols = 3
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax, ((axis, what), group) in zip(axes.flat, panels.items(), strict=False):
        xs = [r.scale[1] for r in group]
        for impl, color in (("upstream", "tab:orange"), ("cbpause", "tab:blue")):
            p50 = [percentile(r.samples.get(impl, [float("nan")]), 50) for r in group]
            p99 = [percentile(r.samples.get(impl, [float("nan")]), 99) for r in group]
            ax.plot(xs, p50, "o-", color=color, label=f"{impl} p50")
            ax.plot(xs, p99, "x:", color=color, label=f"{impl} p99")
        if axis != "ranks":
            ax.set_xscale("symlog" if 0 in xs else "log")
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_title(f"10: {what}, by {axis}", fontsize=9)
        ax.set_xlabel(axis)
        ax.set_ylabel(group[0].unit)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _finish(plt, fig, axes, len(panels), path)
    return True


def _finish(plt, fig, axes, used: int, path: Path) -> None:
    """Blank the panels left over, and write the figure."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
