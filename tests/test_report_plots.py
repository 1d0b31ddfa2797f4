"""profuse.report.plots: the speedup and bandwidth plots of a saved run, written whole or not at all."""

from __future__ import annotations

import json

import pytest
from cases import PNG_SIGNATURE, needs_matplotlib, run_cli

from profuse.report import plots
from profuse.report import sweep as R


@needs_matplotlib
def test_png_failing_mid_write_leaves_no_file(tmp_path, monkeypatch, saved):
    from matplotlib.figure import Figure

    data = json.loads((saved["a"][0] / "results.json").read_text())

    def half_a_png(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(PNG_SIGNATURE)  # a start of a PNG, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", half_a_png)
    with pytest.raises(KeyboardInterrupt):
        plots.write_plots(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


GRID = "--cols 64,96 --elements 6144,12288 --trials 3 --variants eager,rms_norm --device cpu".split()


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A 2 cols x 2 elements grid saved through the CLI: sizes 64x96, 128x96, 96x64, 192x64."""
    out = tmp_path_factory.mktemp("grid")
    code, _, stderr = run_cli("sweep", *GRID, "--out", str(out))
    assert code == 0, stderr
    return json.loads((out / "results.json").read_text())


def series_lines(fig) -> dict[str, object]:
    """The lines drawn for a (variant, group), by their gid 'series:VARIANT:GROUP'."""
    ax = fig.axes[0]
    return {ln.get_gid(): ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("series:")}


@needs_matplotlib
def test_grid_plots_put_the_hidden_size_on_x_and_a_line_per_variant_and_group(grid):
    run = R.parse(grid)
    assert run.elements == [6144, 12288]
    speedup, bandwidth = plots.speedup_figure(grid), plots.bandwidth_figure(grid)
    for fig in (speedup, bandwidth):
        ax = fig.axes[0]
        assert list(ax.get_xticks()) == [64, 96]  # the cols values, not rows or rows x cols
        assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "96"]
        assert ax.get_xscale() == "log" and "cols" in ax.get_xlabel()
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "6144 elements" in legend and "12288 elements" in legend and "eager F.rms_norm" in legend
    # The baseline is the line at 1.0 in the speedup plot; every variant is a line in bandwidth.
    assert set(series_lines(speedup)) == {"series:rms_norm:6144", "series:rms_norm:12288"}
    lines = series_lines(bandwidth)
    assert set(lines) == {f"series:{v}:{e}" for v in ("eager", "rms_norm") for e in (6144, 12288)}
    for ln in lines.values():
        assert sorted(ln.get_xdata()) == [64, 96]  # one point per cols value
    # Colour says the variant, the same in both plots; line style and marker say the group.
    assert lines["series:eager:6144"].get_color() == lines["series:eager:12288"].get_color()
    assert lines["series:eager:6144"].get_color() != lines["series:rms_norm:6144"].get_color()
    drawn_over_eager = series_lines(speedup)["series:rms_norm:6144"]
    assert drawn_over_eager.get_color() == lines["series:rms_norm:6144"].get_color()
    style = lambda ln: (ln.get_linestyle(), ln.get_marker())
    assert style(lines["series:eager:6144"]) == style(lines["series:rms_norm:6144"])
    assert style(lines["series:eager:6144"]) != style(lines["series:eager:12288"])


@needs_matplotlib
def test_one_cols_sweep_keeps_rows_on_x_and_old_files_without_elements_plot(saved, grid):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    ax = plots.speedup_figure(data).axes[0]
    assert list(ax.get_xticks()) == [64, 128] and ax.get_xlabel().startswith("rows (cols = 96)")
    assert set(series_lines(ax.figure)) == {"series:rms_norm:0"}  # one line per variant
    old = json.loads(json.dumps(grid))
    del old["config"]["elements"]  # saved before --elements existed: the groups are rows values
    assert R.parse(old).elements == []
    lines = series_lines(plots.bandwidth_figure(old))
    assert {gid.rsplit(":", 1)[1] for gid in lines} == {"64", "96", "128", "192"}


@needs_matplotlib
def test_a_ci_beside_its_median_is_still_drawn(saved):
    """Over 3 trials a BCa interval can miss its own point estimate; the plot draws the bar over
    both instead of failing (matplotlib refuses negative error lengths)."""
    data = json.loads((saved["a"][0] / "results.json").read_text())
    sp = data["runs"][0]["results"]["rms_norm"]["speedup"]
    sp.update(median=0.74, low=0.75, high=0.89, verdict="slower")
    fig = plots.speedup_figure(data)
    [bars] = [c for c in fig.axes[0].containers if c.lines[0].get_gid() == "series:rms_norm:0"]
    segments = bars.lines[2][0].get_segments()  # the vertical bars, one per size
    low, high = sorted(segments[0][:, 1])
    assert low == pytest.approx(0.74) and high == pytest.approx(0.89)


def marked(fig, kind: str) -> dict[str, list[float]]:
    """The x values of the points marked `kind` ('unsteady' or 'no-gain'), by 'VARIANT:GROUP'."""
    ax = fig.axes[0]
    out = {}
    for ln in ax.get_lines():
        gid = ln.get_gid() or ""
        if gid.startswith(kind + ":"):
            out[gid.split(":", 1)[1]] = list(ln.get_xdata())
    return out


def legend_texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


@needs_matplotlib
def test_unsteady_points_are_hollow_and_the_legend_says_why(saved):
    """rms_norm unsteady at 128 rows: hollow in the bandwidth plot, and in the speedup plot (its
    speedup rests on those trials); an unsteady baseline makes every speedup at its size hollow."""
    from test_report_sweep import unsteady_at_128

    data = unsteady_at_128(saved)
    bandwidth, speedup = plots.bandwidth_figure(data), plots.speedup_figure(data)
    hollow = marked(bandwidth, "unsteady")
    assert list(hollow) == ["rms_norm:0"] and hollow["rms_norm:0"] == [128]
    (line,) = [ln for ln in bandwidth.axes[0].get_lines() if ln.get_gid() == "unsteady:rms_norm:0"]
    assert line.get_markerfacecolor() == "white"
    assert plots.UNSTEADY_NOTE in legend_texts(bandwidth) and plots.UNSTEADY_NOTE in legend_texts(speedup)
    assert [round(x) for x in marked(speedup, "unsteady")["rms_norm:0"]] == [128]
    base = unsteady_at_128(saved, "eager")
    assert [round(x) for x in marked(plots.speedup_figure(base), "unsteady")["rms_norm:0"]] == [128]
    assert marked(plots.bandwidth_figure(base), "unsteady") == {"eager:0": [128]}
    steady = json.loads(json.dumps(data))
    steady["runs"][1]["comparison"]["timings"]["rms_norm"]["times_s"] = [1e-3] * 30
    assert marked(plots.speedup_figure(steady), "unsteady") == {}
    assert plots.UNSTEADY_NOTE not in legend_texts(plots.bandwidth_figure(steady))


@needs_matplotlib
def test_a_speedup_without_a_measurable_gain_is_half_filled(saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    for run in data["runs"]:
        for timing in run["comparison"]["timings"].values():
            timing["times_s"] = [1e-3] * 3
    run = data["runs"][0]
    run["results"]["rms_norm"]["speedup"].update(
        median=1.01, low=0.98, high=1.04, verdict="no measurable gain"
    )
    data["runs"][1]["results"]["rms_norm"]["speedup"].update(median=1.5, low=1.4, high=1.6, verdict="faster")
    fig = plots.speedup_figure(data)
    assert [round(x) for x in marked(fig, "no-gain")["rms_norm:0"]] == [64]
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == "no-gain:rms_norm:0"]
    assert line.get_fillstyle() == "bottom"
    assert plots.NO_GAIN_NOTE in legend_texts(fig) and plots.UNSTEADY_NOTE not in legend_texts(fig)
