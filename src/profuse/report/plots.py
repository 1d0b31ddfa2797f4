"""Sweep plots: (a) speedup vs size with CI error bars, (b) achieved bandwidth under the copy roof.

The x axis is rows where every size shares one cols (the lab's sweep), else cols, the hidden size.
A grid over hidden sizes (`--cols ... --elements 4M,32M,128M`, or several --rows with several
--cols) draws one line per variant and group, the group being the elements value (or the rows
value): colour says the variant, the same in both plots; line style and marker say the group.
A hollow point rests on unsteady trials (report.sweep.VariantRow.unsteady: its median is not to be
trusted); in the speedup plot a half-filled point is a speedup whose CI holds 1.0.

matplotlib is optional (`pip install 'profuse[plot]'`): without it HAS_MATPLOTLIB is False and a
sweep still writes its JSON and CSV. Figures are drawn on the Agg canvas directly, never through
pyplot: no window opens, and a process that imports profuse keeps its own matplotlib backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from profuse.errors import UsageError
from profuse.files import atomic_path
from profuse.report.sweep import SavedRun, VariantRow, ci_terms, parse
from profuse.report.units import fmt_bandwidth

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.transforms import ScaledTranslation

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
# Variants at one size sit side by side, at most this far apart in log2(x), so their error bars
# do not hide each other; small next to the usual 8x step between sizes, and narrowed where the
# sizes sit closer (hidden sizes 14336 and 16384 are 0.19 apart).
DODGE = 0.06
# One colour per variant key, whatever the run holds, so a variant looks the same in both plots
# and in every run (keys in bench.tail_bench.variants() order). No red: the copy ceiling is crimson;
# no gray: it draws the groups' line styles in a grid's legend.
VARIANT_COLORS = {
    "eager": "C0",
    "rms_norm": "C6",
    "compile": "C1",
    "compile-max": "C5",
    "triton": "C2",
    "liger": "C4",
}
SPARE_COLORS = ("C8", "C9", "C3")
# A grid's groups (elements or rows values), smallest first: line style and marker.
GROUP_STYLES = (
    ("-", "o"),
    ("--", "s"),
    (":", "^"),
    ("-.", "D"),
    ((0, (5, 1, 1, 1, 1, 1)), "v"),
    ((0, (1, 1)), "P"),
)
GROUP_COLOR = "gray"
LEGEND_GAP_IN = 0.06  # between the x label and the legend under it


def _require() -> None:
    if not HAS_MATPLOTLIB:
        raise UsageError(MATPLOTLIB_MISSING)


# --------------------------------------------------------------------------------------------
# What goes on x, and which sizes share a line
# --------------------------------------------------------------------------------------------

Size = tuple[int, int]


@dataclass
class _Layout:
    x: dict[Size, float]  # every size's place on the x axis
    xlabel: str
    tick: Callable[[float], str]
    group: dict[Size, int]  # every size's group: an elements or rows value (0: a single group)
    group_labels: dict[int, str]  # the groups, smallest first

    @property
    def grid(self) -> bool:
        return len(self.group_labels) > 1


def _elements_of(elements: list[int], size: Size) -> int:
    """The --elements value a size came from (rows = max(1, elements // cols))."""
    rows, cols = size
    return next((e for e in elements if max(1, e // cols) == rows), rows * cols)


def _layout(run: SavedRun) -> _Layout:
    """rows on x where all sizes share one cols; else cols, with a line per elements (or rows) value."""
    sizes = run.sizes
    cols = sorted({c for _, c in sizes})
    if len(cols) == 1:
        return _Layout(
            {s: float(s[0]) for s in sizes}, f"rows (cols = {cols[0]}), log scale", _tick,
            {s: 0 for s in sizes}, {0: ""},
        )  # fmt: skip
    if run.elements:
        group = {s: _elements_of(run.elements, s) for s in sizes}
        name = lambda g: f"{_tick(g)} elements"
    else:
        group = {s: s[0] for s in sizes}
        name = lambda g: f"{g} rows"
    labels = {g: name(g) for g in sorted(set(group.values()))}
    xlabel = "cols (the hidden size N), log scale"
    if len(labels) == 1:
        xlabel += f"; {next(iter(labels.values()))} at every cols"
    elif run.elements:
        xlabel += "; rows = elements / cols"
    return _Layout({s: float(s[1]) for s in sizes}, xlabel, lambda x: f"{x:.0f}", group, labels)


def _tick(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


Series = dict[tuple[str, int], list[VariantRow]]  # (variant, group) -> its timed rows along x


def _series(run: SavedRun, layout: _Layout, skip: str | None = None) -> Series:
    """The timed rows of every (variant, group), in order along x; `skip`: a variant left out."""
    out: Series = {}
    for r in run.variant_rows:
        if r.median_s is not None and r.variant != skip:
            out.setdefault((r.variant, layout.group[r.size]), []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: layout.x[r.size])
    # Grouped by variant (in run order), then by group, smallest first.
    order = {v: i for i, v in enumerate(dict.fromkeys(r.variant for r in run.variant_rows))}
    return dict(sorted(out.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])))


def variant_colors(run: SavedRun) -> dict[str, str]:
    """The colour of every variant of a run: fixed per key, spare colours for keys profuse does not know."""
    spare = iter(SPARE_COLORS * 4)
    keys = dict.fromkeys(r.variant for r in run.variant_rows)
    return {k: VARIANT_COLORS.get(k) or next(spare, "black") for k in keys}


def _group_style(layout: _Layout, group: int) -> tuple:
    return GROUP_STYLES[list(layout.group_labels).index(group) % len(GROUP_STYLES)]


# --------------------------------------------------------------------------------------------
# Axes, legend, files
# --------------------------------------------------------------------------------------------


def _new_axes(run: SavedRun, title: str, layout: _Layout):
    fig = Figure(figsize=(9, 6) if layout.grid else (8, 5), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_xlabel(layout.xlabel)
    ax.set_title(
        f"{title}\n{run.card} · {run.dtype} · {run.what} · {run.trials} trials per size", fontsize=11
    )
    ax.grid(True, which="major", alpha=0.3)
    return fig, ax


def _finish(fig, ax, layout: _Layout) -> None:
    """Ticks at the measured sizes only (the reader reads off sizes that exist), labelled in full
    and turned 45 degrees where neighbours would overlap (hidden sizes 14336 and 16384 do); then
    the legend just under the x label, however tall the tick labels came out."""
    xs = sorted(set(layout.x.values()))
    labels = [layout.tick(x) for x in xs]
    ax.set_xticks(xs, labels)
    ax.minorticks_off()
    fig.draw_without_rendering()
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    if any(b.x0 < a.x1 + 4 for a, b in zip(boxes, boxes[1:])):
        ax.set_xticks(xs, labels, rotation=45, ha="right", rotation_mode="anchor")
        ax.minorticks_off()
        fig.draw_without_rendering()
    legend = ax.get_legend()
    if legend is not None:
        # The drop from the axes to the bottom of the x label is the same in pixels whatever
        # height the layout then gives the axes: anchor the legend that far below, plus a gap.
        below = ax.get_window_extent().y0 - ax.xaxis.get_tightbbox(fig.canvas.get_renderer()).y0
        drop = ScaledTranslation(0, -(below / fig.dpi + LEGEND_GAP_IN), fig.dpi_scale_trans)
        legend.set_bbox_to_anchor((0.5, 0), transform=ax.transAxes + drop)


def _dodge(layout: _Layout, n: int) -> list[float]:
    """x factors that set n series side by side at each size, never past half the closest gap."""
    if n < 2:
        return [1.0] * n
    xs = sorted(set(layout.x.values()))
    gaps = [math.log2(b / a) for a, b in zip(xs, xs[1:])]
    step = min(DODGE, 0.5 * min(gaps, default=1.0) / (n - 1))
    return [2 ** (step * (i - (n - 1) / 2)) for i in range(n)]


def _blank():
    return Line2D([], [], linestyle="none")


def _legend_below(ax, handles, labels, ncols: int = 3) -> None:
    # Below the axes, not inside: inside, "best" still lands on the roof line or on the top series
    # (seen on the H200 sweep, where the fused variants climb to the copy ceiling). _finish moves
    # it under the x label once the tick labels are drawn.
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=ncols, fontsize=9,
              frameon=False)  # fmt: skip


def _legend(ax, layout: _Layout, reference: list, variants: list, notes: list) -> None:
    """One list of (handle, label) pairs each: today's legend where there is one group; on a grid,
    columns: the reference line and the variants' colours | the groups' styles | notes."""
    if not layout.grid:
        pairs = reference + variants + notes
        _legend_below(ax, [h for h, _ in pairs], [lb for _, lb in pairs])
        return
    groups = [
        (Line2D([], [], color=GROUP_COLOR, linestyle=ls, marker=m, markersize=6), label)
        for (ls, m), label in ((_group_style(layout, g), lb) for g, lb in layout.group_labels.items())
    ]
    columns = [c for c in (reference + variants, groups, notes) if c]
    depth = max(len(c) for c in columns)
    pairs = [p for c in columns for p in c + [(_blank(), "")] * (depth - len(c))]  # column-major
    _legend_below(ax, [h for h, _ in pairs], [lb for _, lb in pairs], ncols=len(columns))


def _variant_handles(series, colors: dict[str, str], layout: _Layout) -> list:
    """One legend entry per variant: its line where there is one group, its colour on a grid."""
    out, seen = [], set()
    for (key, _group), rows in series.items():
        if key in seen:
            continue
        seen.add(key)
        style = dict(linewidth=2.5) if layout.grid else dict(marker="o", markersize=6)
        out.append((Line2D([], [], color=colors[key], **style), rows[0].label))
    return out


def _save(fig, path: str | Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return Path(path)


def _run(data: dict | SavedRun) -> SavedRun:
    return data if isinstance(data, SavedRun) else parse(data)


# --------------------------------------------------------------------------------------------
# The two plots
# --------------------------------------------------------------------------------------------


def _unsteady_speedups(run: SavedRun) -> set[tuple[str, Size]]:
    """(variant, size) of every speedup that rests on unsteady trials: the variant's or the
    baseline's at that size (report.sweep.VariantRow.unsteady)."""
    base = {r.size: r.unsteady for r in run.variant_rows if r.variant == run.baseline}
    return {(r.variant, r.size) for r in run.variant_rows if r.unsteady or base.get(r.size, False)}


def _hollow(ax, x, y, marker: str, color: str) -> None:
    """Unsteady points: the marker drawn again, white inside."""
    ax.plot(x, y, linestyle="none", marker=marker, markersize=7, markerfacecolor="white",
            markeredgecolor=color, markeredgewidth=1.5, zorder=4)  # fmt: skip


UNSTEADY_NOTE = "hollow: unsteady trials, the median is not to be trusted"
NO_GAIN_NOTE = "half-filled: CI holds 1.0, no measurable gain"


def speedup_figure(data: dict | SavedRun):
    """The speedup plot as a matplotlib Figure (not saved): every variant over the baseline,
    median with its CI, a line at 1.0. A half-filled marker is a size whose CI holds 1.0; a hollow
    one a speedup resting on unsteady trials (the variant's or the baseline's)."""
    _require()
    run = _run(data)
    layout = _layout(run)
    colors = variant_colors(run)
    shaky = _unsteady_speedups(run)
    fig, ax = _new_axes(run, f"Fused tail: speedup over {run.baseline_label}", layout)
    base = ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    series = {k: rs for k, rs in _series(run, layout, skip=run.baseline).items() if rs[0].speedup}
    half, hollow = False, False
    for ((key, group), rows), shift in zip(series.items(), _dodge(layout, len(series))):
        linestyle, marker = _group_style(layout, group)
        x = [layout.x[r.size] * shift for r in rows]
        med = [r.speedup["median"] for r in rows]
        # Over a few trials a BCa interval need not hold its point estimate (a 3-trial sweep on
        # the 2-core machine had one beside it, and drawing it raised); matplotlib refuses
        # negative bar lengths, so the bar spans the CI and the median both.
        err = [
            [max(m - r.speedup["low"], 0.0) for m, r in zip(med, rows)],
            [max(r.speedup["high"] - m, 0.0) for m, r in zip(med, rows)],
        ]
        bars = ax.errorbar(
            x, med, yerr=err, color=colors[key], linestyle=linestyle, marker=marker, capsize=4, markersize=6,
            label=rows[0].label + (f", {layout.group_labels[group]}" if layout.grid else ""),
        )  # fmt: skip
        bars.lines[0].set_gid(f"series:{key}:{group}")
        unsteady = [(xi, m) for xi, m, r in zip(x, med, rows) if (key, r.size) in shaky]
        no_gain = [
            (xi, m)
            for xi, m, r in zip(x, med, rows)
            if r.speedup["verdict"] == "no measurable gain" and (key, r.size) not in shaky
        ]
        if no_gain:
            half = True
            (line,) = ax.plot(
                *zip(*no_gain), linestyle="none", marker=marker, markersize=7, fillstyle="bottom",
                markerfacecoloralt="white", color=colors[key], zorder=3,
            )  # fmt: skip
            line.set_gid(f"no-gain:{key}:{group}")
        if unsteady:
            hollow = True
            _hollow(ax, *zip(*unsteady), marker, colors[key])
            ax.get_lines()[-1].set_gid(f"unsteady:{key}:{group}")
    notes = []
    if half:
        handle = Line2D([], [], marker="o", linestyle="", fillstyle="bottom", markerfacecoloralt="white",
                        color="gray")  # fmt: skip
        notes.append((handle, NO_GAIN_NOTE))
    if hollow:
        notes.append((_hollow_handle(), UNSTEADY_NOTE))
    reference = [(base, f"{run.baseline_label} (baseline) = 1.0")]
    _legend(ax, layout, reference, _variant_handles(series, colors, layout), notes)
    ci = ci_terms(r.speedup for r in run.variant_rows)[0]  # '95% CI', or order statistics' coverage
    ax.set_ylabel(f"speedup over {run.baseline_label} (x), median and {ci}")
    ax.set_ylim(bottom=0)  # from zero, so the height of a bar is the size of the gain
    _finish(fig, ax, layout)
    return fig


def _hollow_handle():
    return Line2D([], [], marker="o", linestyle="", markerfacecolor="white", markeredgecolor="gray")


def bandwidth_figure(data: dict | SavedRun):
    """The bandwidth plot as a matplotlib Figure (not saved): every variant under the copy ceiling
    measured in the run, with the ceiling's percentage on the right where there is one."""
    _require()
    run = _run(data)
    layout = _layout(run)
    colors = variant_colors(run)
    fig, ax = _new_axes(run, "Fused tail: achieved bandwidth", layout)
    series = _series(run, layout)
    top = 0.0
    hollow = False
    for (key, group), rows in series.items():
        linestyle, marker = _group_style(layout, group)
        gbps = [r.achieved_Bps / 1e9 for r in rows]
        top = max(top, *gbps)
        (line,) = ax.plot(
            [layout.x[r.size] for r in rows], gbps, color=colors[key], linestyle=linestyle, marker=marker,
            label=rows[0].label + (f", {layout.group_labels[group]}" if layout.grid else ""),
        )  # fmt: skip
        line.set_gid(f"series:{key}:{group}")
        unsteady = [(layout.x[r.size], g) for r, g in zip(rows, gbps) if r.unsteady]
        if unsteady:
            hollow = True
            _hollow(ax, *zip(*unsteady), marker, colors[key])
            ax.get_lines()[-1].set_gid(f"unsteady:{key}:{group}")
    notes = []
    if run.copy_ceiling_Bps:
        roof = run.copy_ceiling_Bps / 1e9
        top = max(top, roof)
        label = f"copy ceiling, measured in this run ({fmt_bandwidth(run.copy_ceiling_Bps)})"
        notes.append((ax.axhline(roof, color="crimson", linewidth=2), label))
        # The same heights as a share of the ceiling: the y axis stays in GB/s.
        pct = ax.secondary_yaxis("right", functions=(lambda y: y / roof * 100, lambda p: p * roof / 100))
        pct.set_ylabel("% of the copy ceiling")
    else:
        notes.append((_blank(), "no copy ceiling (measured on CUDA only)"))
    if hollow:
        notes.append((_hollow_handle(), UNSTEADY_NOTE))
    tensors = {4: "4 tensors", 11: "11 tensors"}.get(run.model_tensors, f"{run.model_tensors} tensors")
    ax.set_ylabel(f"achieved bandwidth (GB/s)\n= minimum fused traffic ({tensors}) / median time")
    ax.set_ylim(0, top * 1.12 if top > 0 else 1)
    _legend(ax, layout, [], _variant_handles(series, colors, layout), notes)
    _finish(fig, ax, layout)
    return fig


def plot_speedup(data: dict | SavedRun, path: str | Path) -> Path:
    """speedup_figure, written whole to `path` (a PNG)."""
    return _save(speedup_figure(data), path)


def plot_bandwidth(data: dict | SavedRun, path: str | Path) -> Path:
    """bandwidth_figure, written whole to `path` (a PNG)."""
    return _save(bandwidth_figure(data), path)


def write_plots(data: dict | SavedRun, out_dir: str | Path) -> list[Path]:
    """speedup.png and bandwidth.png under `out_dir`, each written whole or not at all."""
    _require()
    run = _run(data)
    if not any(r.median_s is not None for r in run.variant_rows):
        return []  # nothing was timed: an empty plot would only look like a result
    out = Path(out_dir)
    return [plot_speedup(run, out / SPEEDUP_PNG), plot_bandwidth(run, out / BANDWIDTH_PNG)]
