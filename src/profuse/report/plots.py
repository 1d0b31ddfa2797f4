"""Sweep plots: (a) speedup vs size with CI error bars, (b) achieved bandwidth under the copy roof.

matplotlib is optional (`pip install 'profuse[plot]'`): without it HAS_MATPLOTLIB is False and a
sweep still writes its JSON and CSV. Figures are drawn on the Agg canvas directly, never through
pyplot: no window opens, and a process that imports profuse keeps its own matplotlib backend.
"""

from __future__ import annotations

from pathlib import Path

from profuse.errors import UsageError
from profuse.files import atomic_path
from profuse.report.sweep import SavedRun, VariantRow, parse
from profuse.report.units import fmt_bandwidth

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    HAS_MATPLOTLIB = True
except ImportError:
    HAS_MATPLOTLIB = False

MATPLOTLIB_MISSING = (
    "matplotlib is not installed: pip install matplotlib (or pip install 'profuse[plot]') "
    "to get speedup.png and bandwidth.png"
)

SPEEDUP_PNG = "speedup.png"
BANDWIDTH_PNG = "bandwidth.png"
DPI = 120
# Variants at one size sit side by side, this far apart in log2(x), so their error bars do not
# hide each other; small next to the usual 8x step between sizes.
DODGE = 0.06


def _require() -> None:
    if not HAS_MATPLOTLIB:
        raise UsageError(MATPLOTLIB_MISSING)


def _x_axis(run: SavedRun) -> tuple[dict[tuple[int, int], float], str]:
    """x for every size: rows where all sizes share one cols (the lab's sweep), else elements."""
    sizes = run.sizes
    cols = {c for _, c in sizes}
    if len(cols) == 1:
        return {s: float(s[0]) for s in sizes}, f"rows (cols = {next(iter(cols))}), log scale"
    return {s: float(s[0] * s[1]) for s in sizes}, "elements per tensor (rows x cols), log scale"


def _tick(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def _by_variant(run: SavedRun) -> dict[str, list[VariantRow]]:
    out: dict[str, list[VariantRow]] = {}
    for r in run.variant_rows:
        if r.median_s is not None:
            out.setdefault(r.variant, []).append(r)
    return out


def _new_axes(run: SavedRun, title: str, xlabel: str, xs: list[float]):
    fig = Figure(figsize=(8, 5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    # Ticks at the measured sizes only: the reader reads off sizes that exist.
    ax.set_xticks(xs, [_tick(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_title(
        f"{title}\n{run.card} · {run.dtype} · {run.what} · {run.trials} trials per size", fontsize=11
    )
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


def _legend_below(ax, handles, labels) -> None:
    # Below the axes, not inside: inside, "best" still lands on the roof line or on the top series
    # (seen on the H200 sweep, where the fused variants climb to the copy ceiling).
    ax.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=3, fontsize=9, frameon=False
    )


def _save(fig, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return Path(path)


def plot_speedup(data: dict | SavedRun, path: str | Path) -> Path:
    """Speedup of every variant over the baseline vs size, median with its CI, a line at 1.0.

    A hollow marker is a size whose CI holds 1.0: no measurable gain there.
    """
    _require()
    run = data if isinstance(data, SavedRun) else parse(data)
    xmap, xlabel = _x_axis(run)
    fig, ax = _new_axes(run, f"Fused tail: speedup over {run.baseline}", xlabel, sorted(set(xmap.values())))
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{run.baseline} (baseline) = 1.0")
    series = {k: rs for k, rs in _by_variant(run).items() if k != run.baseline and rs[0].speedup}
    hollow = False
    for n, rows in enumerate(series.values()):
        shift = 2 ** (DODGE * (n - (len(series) - 1) / 2))
        x = [xmap[r.size] * shift for r in rows]
        med = [r.speedup["median"] for r in rows]
        err = [
            [m - r.speedup["low"] for m, r in zip(med, rows, strict=True)],
            [r.speedup["high"] - m for m, r in zip(med, rows, strict=True)],
        ]
        bars = ax.errorbar(x, med, yerr=err, fmt="o-", capsize=4, markersize=6, label=rows[0].label)
        color = bars.lines[0].get_color()
        no_gain = [
            (xi, m)
            for xi, m, r in zip(x, med, rows, strict=True)
            if r.speedup["verdict"] == "no measurable gain"
        ]
        if no_gain:
            hollow = True
            ax.scatter(*zip(*no_gain, strict=True), s=36, facecolors="white", edgecolors=color, zorder=3)
    handles, labels = ax.get_legend_handles_labels()
    if hollow:
        handles.append(
            Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor="gray")
        )
        labels.append("hollow: CI holds 1.0, no measurable gain")
    _legend_below(ax, handles, labels)
    ax.set_ylabel(f"speedup over {run.baseline} (x), median and 95% CI")
    ax.set_ylim(bottom=0)  # from zero, so the height of a bar is the size of the gain
    return _save(fig, path)


def plot_bandwidth(data: dict | SavedRun, path: str | Path) -> Path:
    """Achieved bandwidth of every variant vs size, under the copy ceiling measured in the run."""
    _require()
    run = data if isinstance(data, SavedRun) else parse(data)
    xmap, xlabel = _x_axis(run)
    fig, ax = _new_axes(run, "Fused tail: achieved bandwidth", xlabel, sorted(set(xmap.values())))
    top = 0.0
    for rows in _by_variant(run).values():
        gbps = [r.achieved_Bps / 1e9 for r in rows]
        top = max(top, *gbps)
        ax.plot([xmap[r.size] for r in rows], gbps, "o-", label=rows[0].label)
    if run.copy_ceiling_Bps:
        roof = run.copy_ceiling_Bps / 1e9
        top = max(top, roof)
        label = f"copy ceiling, measured in this run ({fmt_bandwidth(run.copy_ceiling_Bps)})"
        ax.axhline(roof, color="crimson", linewidth=2, label=label)
    else:
        ax.plot([], [], " ", label="no copy ceiling (measured on CUDA only)")
    tensors = {4: "4 tensors", 11: "11 tensors"}.get(run.model_tensors, f"{run.model_tensors} tensors")
    ax.set_ylabel(f"achieved bandwidth (GB/s)\n= minimum fused traffic ({tensors}) / median time")
    ax.set_ylim(0, top * 1.12 if top > 0 else 1)
    _legend_below(ax, *ax.get_legend_handles_labels())
    return _save(fig, path)


def write_plots(data: dict, out_dir: str | Path) -> list[Path]:
    """speedup.png and bandwidth.png under `out_dir`, each written whole or not at all."""
    _require()
    run = parse(data)
    if not any(r.median_s is not None for r in run.variant_rows):
        return []  # nothing was timed: an empty plot would only look like a result
    out = Path(out_dir)
    return [plot_speedup(run, out / SPEEDUP_PNG), plot_bandwidth(run, out / BANDWIDTH_PNG)]
