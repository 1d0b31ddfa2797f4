"""profuse.report.sweep: saved results as tables, CSV and a diff of two runs, with their warnings.

Everything here reads saved JSON (the session's two tiny sweeps, `saved` in conftest.py), as the
report does.
"""

from __future__ import annotations

import csv
import json
import shlex

import pytest
from cases import HUGE_ROWS, PNG_SIGNATURE, part_files

from profuse import cli
from profuse import sweep as S
from profuse.bench import stats
from profuse.report import plots
from profuse.report import sweep as R

# --------------------------------------------------------------------------------------------
# Tables and CSV
# --------------------------------------------------------------------------------------------


def test_csv_failing_mid_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch, saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    target = tmp_path / "results.csv"
    target.write_text("old,file\n")
    real_writerow = csv.DictWriter.writerow
    written = []

    def disk_full_after_one_row(self, row):
        if written:
            raise OSError(28, "No space left on device")
        written.append(row)
        return real_writerow(self, row)

    monkeypatch.setattr(csv.DictWriter, "writerow", disk_full_after_one_row)
    with pytest.raises(OSError, match="No space left"):
        R.write_csv(target, data)
    assert written  # it failed halfway, not before starting
    assert target.read_text() == "old,file\n"
    assert part_files(tmp_path) == []


def test_report_and_plot_show_the_copy_ceiling(tmp_path, saved):
    # A CUDA run saves the copy ceiling; here it is written into a CPU file to check the rendering.
    data = json.loads((saved["a"][0] / "results.json").read_text())
    data["copy_ceiling_Bps"] = 4.0e12
    for run in data["runs"]:
        for res in run["results"].values():
            res["fraction_of_copy"] = res["achieved_Bps"] / 4.0e12
    text = R.format_report(data)
    assert "% of copy" in text and "4.00 TB/s" in text
    if plots.HAS_MATPLOTLIB:  # the roof is drawn too
        png = plots.plot_bandwidth(data, tmp_path / "roof.png")
        assert png.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    "sp, cell, line",
    [
        ((2.14, 2.11, 2.16, "faster"), "2.14x (2.11-2.16)", "speedup vs eager 2.14x  (95% CI 2.11-2.16)"),
        ((0.46, 0.44, 0.5, "slower"), "2.17x slower (2.00-2.27)",
         "2.17x slower than eager  (95% CI 2.00-2.27)"),
        ((0.99, 0.97, 1.02, "no measurable gain"), "no measurable gain (0.97-1.02)",
         "no measurable gain vs eager  (95% CI 0.97-1.02)"),
    ],
)  # fmt: skip
def test_a_slowdown_reads_as_how_many_times_slower(sp, cell, line):
    """The report's cell, the main job's line and diff's column say a slowdown the same way: the
    factor the variant takes longer, never '0.46x slower'."""
    from profuse.bench.stats import Speedup
    from profuse.report.units import fmt_speedup

    median, low, high, verdict = sp
    row = R.VariantRow(64, 96, "float32", False, "x", "x", True, False, median_s=1e-3,
                       speedup={"median": median, "low": low, "high": high, "verdict": verdict})  # fmt: skip
    assert R.speedup_cell(row) == cell
    assert fmt_speedup(Speedup(median, low, high, 0.95, "BCa"), "eager") == line
    assert R._short_speedup(row) == ("no gain" if verdict.startswith("no") else cell.split(" (")[0])


def test_a_sweep_where_nothing_fitted_names_no_byte_model():
    cfg = S.SweepConfig(rows=[HUGE_ROWS], cols=[96], trials=2, warmup=0, variants=("eager",))
    text = R.format_sweep(S.run_sweep(cfg).to_dict())
    assert "skipped" in text and "None" not in text


# --------------------------------------------------------------------------------------------
# Warnings: unsteady timings, too few trials
# --------------------------------------------------------------------------------------------


def test_report_warns_of_unsteady_timings(saved):
    """A size where a variant's trials were disturbed (a third of them at 3x the fastest) gets a
    warning naming it; steady sizes get none."""
    data = json.loads((saved["a"][0] / "results.json").read_text())
    for run in data["runs"]:  # steady: every trial within 10% of the fastest
        for timing in run["comparison"]["timings"].values():
            timing["times_s"] = [1e-3 * (1 + 0.1 * (i % 2)) for i in range(30)]
    assert "unsteady" not in R.format_report(data)
    run = data["runs"][1]
    times = run["comparison"]["timings"]["rms_norm"]["times_s"]
    times[:] = [1e-3] * 20 + [3e-3] * 10
    text = R.format_report(data)
    warnings = [line for line in text.splitlines() if "unsteady" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING 128 x 96")
    assert "F.rms_norm 10/30" in warnings[0] and "eager 0/30" in warnings[0]
    # At one disturbed trial in 30 the median holds: no warning.
    times[:] = [1e-3] * 29 + [3e-3]
    assert "unsteady" not in R.format_report(data)


def unsteady_at_128(saved, variant: str = "rms_norm") -> dict:
    """Sweep A with steady trials everywhere but `variant` at 128 x 96 (a third at 3x its fastest)."""
    data = json.loads((saved["a"][0] / "results.json").read_text())
    for run in data["runs"]:
        for timing in run["comparison"]["timings"].values():
            timing["times_s"] = [1e-3 * (1 + 0.1 * (i % 2)) for i in range(30)]
    data["runs"][1]["comparison"]["timings"][variant]["times_s"] = [1e-3] * 20 + [3e-3] * 10
    return data


def test_the_csv_says_which_rows_are_unsteady(tmp_path, saved):
    data = unsteady_at_128(saved)
    R.write_csv(tmp_path / "results.csv", data)
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert "unsteady" in R.CSV_FIELDS
    flagged = {(r["rows"], r["variant"]) for r in rows if r["unsteady"] == "True"}
    assert flagged == {("128", "rms_norm")}
    assert {r["unsteady"] for r in rows} == {"True", "False"}


def test_unsteady_warning_gives_a_command_that_times_the_size_again(saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    for run in data["runs"]:  # steady: every trial within 10% of the fastest
        for timing in run["comparison"]["timings"].values():
            timing["times_s"] = [1e-3 * (1 + 0.1 * (i % 2)) for i in range(3)]
    data["runs"][1]["comparison"]["timings"]["eager"]["times_s"] = [1e-3, 3e-3, 3e-3]
    [warning] = [line for line in R.format_report(data).splitlines() if "unsteady" in line]
    command = warning.split("again: ", 1)[1]
    assert command.startswith("profuse ")
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    assert (args.rows, args.cols, args.dtype, args.device) == (128, 96, "float32", "cpu")
    assert args.skip_profile and not args.backward
    assert args.variants.split(",") == ["eager", "rms_norm"]
    assert args.trials >= 10  # the saved run had 3: the command asks for enough to trust a CI
    assert str(args.out) not in (".", str(saved["a"][0]))  # it does not replace the file it came from
    assert args.timing == "device"
    for run in data["runs"]:  # a run timed in a loop is timed again the same way
        run["comparison"]["timing"] = "loop"
    [warning] = [line for line in R.format_report(data).splitlines() if "unsteady" in line]
    assert cli.build_parser().parse_args(shlex.split(warning.split("again: ", 1)[1])[1:]).timing == "loop"


@pytest.mark.parametrize("trials, warned", [(2, True), (3, True), (29, True), (30, False), (40, False)])
def test_few_trials_say_their_ci_is_order_statistics_with_its_coverage(saved, trials, warned):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    data["config"]["trials"] = trials
    text = R.format_report(data)
    caveats = [line for line in text.splitlines() if f"{trials} trials, under 30" in line]
    assert len(caveats) == (1 if warned else 0), text
    if warned:
        k, coverage = stats.median_ranks(trials, 0.95)
        assert f"order statistics {k} and {trials + 1 - k} of {trials}" in caveats[0]
        assert stats.ci_label(stats.Speedup(1, 1, 1, 0.95, "x", coverage=coverage)) in caveats[0]
        assert "--trials 30" in caveats[0]


def test_a_file_saved_with_bootstrap_cis_at_few_trials_is_warned_and_pointed_at_a_recompute(saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    for run in data["runs"]:
        for res in run["results"].values():
            if res.get("speedup"):
                res["speedup"].update(method="BCa", confidence=0.95)
                res["speedup"].pop("coverage", None)
    text = R.format_report(data)
    assert "(95% CI)" in text  # as saved: the method it was made with
    [warning] = [line for line in text.splitlines() if line.startswith("WARNING only")]
    assert "bootstrap's (BCa)" in warning and "covers less than the 95%" in warning and "--vs" in warning


# --------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------


def test_diff_notes_sizes_in_one_run_only(saved):
    a = json.loads((saved["a"][0] / "results.json").read_text())
    b = json.loads((saved["b"][0] / "results.json").read_text())
    b["runs"] = b["runs"][:1]
    text = R.format_diff(a, b)
    assert "only in A: 128 x 96 (eager, eager F.rms_norm)" in text


def test_diff_names_the_versions_and_what_changed_between_the_runs(saved):
    a = json.loads((saved["a"][0] / "results.json").read_text())
    b = json.loads((saved["b"][0] / "results.json").read_text())
    b["env"] = {**b["env"], "torch": "9.9.9", "triton": None}
    text = R.format_diff(a, b)
    lines = text.splitlines()
    assert f"torch {a['env']['torch']}, triton {a['env']['triton']}" in lines[1]
    assert "torch 9.9.9, triton not installed" in lines[2]
    assert f"from A to B: torch {a['env']['torch']}, triton {a['env']['triton']} -> torch 9.9.9" in text
    assert "from A to B" not in R.format_diff(a, a)


def test_a_host_time_that_is_a_lower_bound_reads_at_least(saved):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    run = data["runs"][0]
    run["results"]["eager"]["host_s"] = 2e-3
    run["comparison"]["timings"]["eager"]["host_is_lower_bound"] = True
    run["results"]["rms_norm"]["host_s"] = 1e-3
    rows = {r.variant: r for r in R.parse(data).variant_rows if r.rows == 64}
    assert R.host_cell(rows["eager"]) == "at least 2.000 ms" and R.host_cell(rows["rms_norm"]) == "1.000 ms"
