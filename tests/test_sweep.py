"""profuse sweep, report and diff, end to end on the CPU at tiny sizes.

Behaviour only: files exist, parse and hold what they should; an interrupted or failing run leaves
no half-written file; sizes that do not fit are skipped. Never an assertion on seconds.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shlex

import numpy as np
import pytest
import torch

from profuse import cli
from profuse import sweep as S
from profuse.errors import UsageError
from profuse.report import plots
from profuse.report import sweep as R

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# An empty 8x5 inch canvas at 120 dpi compresses to about 3 KB; axes, ticks, text and markers
# push a real plot well past 5 KB.
MIN_DRAWN_PNG_BYTES = 5_000
# Tiny sizes and two eager variants: the sweep mechanics without compile's ~2-8 s per size.
TINY = "--rows 64,128 --cols 96 --trials 3 --variants eager,rms_norm --device cpu".split()
# rows x cols that no machine has memory for: the memory check rejects it before any allocation.
HUGE_ROWS = 2**40


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def part_files(folder) -> list:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".part")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two tiny sweeps, A and B, saved through the CLI (shared: each run costs a second or two)."""
    root = tmp_path_factory.mktemp("sweeps")
    runs = {}
    for name, seed in (("a", "0"), ("b", "1")):
        out = root / name
        code, stdout, stderr = run_cli("sweep", *TINY, "--seed", seed, "--out", str(out))
        assert code == 0, stderr
        runs[name] = (out, stdout)
    return runs


# --------------------------------------------------------------------------------------------
# profuse sweep
# --------------------------------------------------------------------------------------------


def test_sweep_writes_valid_json(saved):
    out, stdout = saved["a"]
    data = json.loads((out / "results.json").read_text())
    assert data["kind"] == "sweep"
    assert [(r["config"]["rows"], r["config"]["cols"]) for r in data["runs"]] == [(64, 96), (128, 96)]
    assert data["skipped"] == []
    assert "env" in data and all("env" not in r for r in data["runs"])  # the environment once
    assert data["copy_ceiling_Bps"] is None  # measured on CUDA only
    for run in data["runs"]:
        assert run["kind"] == "tail"
        assert set(run["results"]) == {"eager", "rms_norm"}
        times = run["comparison"]["timings"]["rms_norm"]["times_s"]
        assert len(times) == 3 and all(t > 0 for t in times)
        sp = run["results"]["rms_norm"]["speedup"]
        assert sp["low"] <= sp["median"] <= sp["high"]


def test_sweep_writes_csv_one_row_per_size_and_variant(saved):
    out, _ = saved["a"]
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == R.CSV_FIELDS
    assert [(r["rows"], r["cols"], r["variant"]) for r in rows] == [
        ("64", "96", "eager"), ("64", "96", "rms_norm"), ("128", "96", "eager"), ("128", "96", "rms_norm"),
    ]  # fmt: skip
    for r in rows:
        assert r["dtype"] == "float32" and r["backward"] == "False" and r["passed"] == "True"
        assert float(r["median_s"]) > 0 and float(r["achieved_GBps"]) > 0
        if r["variant"] == "eager":
            assert (r["speedup"], r["ci_low"], r["verdict"]) == ("1.0", "", "baseline")
        else:
            assert float(r["ci_low"]) <= float(r["speedup"]) <= float(r["ci_high"])
            assert r["verdict"] in ("faster", "slower", "no measurable gain")


@pytest.mark.skipif(not plots.HAS_MATPLOTLIB, reason="matplotlib is not installed")
@pytest.mark.parametrize("name", [plots.SPEEDUP_PNG, plots.BANDWIDTH_PNG])
def test_sweep_writes_drawn_pngs(saved, name):
    out, _ = saved["a"]
    blob = (out / name).read_bytes()
    assert blob.startswith(PNG_SIGNATURE)
    assert len(blob) > MIN_DRAWN_PNG_BYTES


def test_sweep_prints_table_and_paths(saved):
    out, stdout = saved["a"]
    assert "Sweep: fused tail forward, float32 on cpu" in stdout
    assert "64 x 96" in stdout and "128 x 96" in stdout and "eager F.rms_norm" in stdout
    for name in ("results.json", "results.csv"):
        assert f"wrote {out / name}" in stdout
    assert part_files(out) == []


def test_sweep_without_matplotlib_writes_json_and_csv(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "HAS_MATPLOTLIB", False)
    out = tmp_path / "noplot"
    code, stdout, _ = run_cli("sweep", "--rows", "64", "--cols", "96", "--trials", "2",
                              "--variants", "eager", "--device", "cpu", "--out", str(out))  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.json"]
    assert "pip install matplotlib" in stdout and "profuse[plot]" in stdout
    with pytest.raises(UsageError, match="pip install"):
        plots.write_plots(json.loads((out / "results.json").read_text()), out)


# --------------------------------------------------------------------------------------------
# Interrupted or failing runs leave whole files or none
# --------------------------------------------------------------------------------------------


class _InterruptAtSecondSize:
    """Stands in for the CLI's Progress: Ctrl-C arrives while the second size runs."""

    def __init__(self, *args, **kwargs):
        self.stages = []

    def __call__(self, stage, done, total):
        self.stages.append(stage)
        if stage.startswith("size 2/"):
            raise KeyboardInterrupt

    def close(self):
        pass


def test_interrupted_sweep_keeps_only_the_sizes_done_in_a_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "Progress", _InterruptAtSecondSize)
    out = tmp_path / "killed"
    code, _, stderr = run_cli("sweep", *TINY, "--out", str(out))
    assert code == 130 and "interrupted" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.partial.json"]
    data = json.loads((out / "results.partial.json").read_text())
    assert data["partial"] is True and len(data["runs"]) == 1
    code, report, _ = run_cli("report", str(out / "results.partial.json"))
    assert code == 0 and "partial sweep: it stopped after 1 sizes" in report


def test_interrupted_sweep_says_what_it_kept_and_how_to_go_on(tmp_path, monkeypatch):
    """Ctrl-C names the partial file, the command that reads it, and a command that times the
    sizes left (which the sweep's parser reads back as exactly those sizes)."""
    monkeypatch.setattr(cli, "Progress", _InterruptAtSecondSize)
    out = tmp_path / "killed run"  # a space: the command must quote it
    argv = ["--rows", "64,128,160", "--cols", "96", "--trials", "3", "--variants", "eager", "--seed", "7"]
    code, stdout, stderr = run_cli("sweep", *argv, "--device", "cpu", "--out", str(out))
    assert code == 130
    partial = out / "results.partial.json"
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("profuse: interrupted") and f"(1 of 3) are saved in {partial}" in lines[0]
    assert f"profuse report {partial}" in stderr
    [rest] = [line.split("2 sizes left: ", 1)[1] for line in lines if "sizes left: " in line]
    args = cli.build_sweep_parser().parse_args(shlex.split(rest)[2:])
    assert (args.rows, args.cols, args.trials, args.variants, args.seed) == ([128, 160], [96], 3, "eager", 7)
    assert args.out not in (out, tmp_path) and args.out.parent == out  # the partial file stays as it is
    assert stdout == ""


def test_sizes_left_of_a_grid_are_given_as_elements():
    parser = cli.build_sweep_parser()
    args = parser.parse_args("--cols 64,96 --elements 6144,12288 --trials 3 --variants eager".split())
    cfg = S.SweepConfig(rows=args.rows, cols=args.cols, elements=args.elements, trials=3, variants=("eager",))
    sizes = cfg.sizes()  # 96x64, 192x64, 64x96, 128x96: cols by cols
    for n_done in range(1, len(sizes)):
        commands = cli.sizes_left_commands(args, cfg, set(sizes[:n_done]))
        covered = []
        for command in commands:
            again = parser.parse_args(shlex.split(command)[2:])
            assert again.elements and again.trials == 3 and again.variants == "eager"
            covered += S.SweepConfig(rows=again.rows, cols=again.cols, elements=again.elements).sizes()
        assert sorted(covered) == sorted(sizes[n_done:])
        assert len({parser.parse_args(shlex.split(c)[2:]).out for c in commands}) == len(commands)


def test_a_sweep_that_crashes_later_says_what_it_kept(tmp_path, monkeypatch, capsys):
    real = S.run_tail_bench

    def crash_at_128(cfg, **kwargs):
        if cfg.rows == 128:
            raise RuntimeError("a real bug")
        return real(cfg, **kwargs)

    monkeypatch.setattr(S, "run_tail_bench", crash_at_128)
    out = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["sweep", *TINY, "--out", str(out)])
    err = capsys.readouterr().err
    assert f"saved in {out / 'results.partial.json'}" in err
    assert len(json.loads((out / "results.partial.json").read_text())["runs"]) == 1


def test_a_sweep_into_a_used_folder_says_which_files_it_replaced(tmp_path):
    argv = [
        "sweep",
        "--rows",
        "64",
        "--cols",
        "96",
        "--trials",
        "2",
        "--variants",
        "eager",
        "--device",
        "cpu",
    ]
    code, first, _ = run_cli(*argv, "--out", str(tmp_path))
    assert code == 0 and "replaced" not in first
    code, second, _ = run_cli(*argv, "--out", str(tmp_path))
    assert code == 0
    wrote = [line for line in second.splitlines() if line.startswith("wrote ")]
    assert wrote and all("(replaced the " in line and "of an earlier run" in line for line in wrote)


def test_finished_sweep_leaves_no_partial_file(saved):
    out, _ = saved["a"]
    assert not (out / "results.partial.json").exists()


def test_interrupted_sweep_keeps_the_previous_files(tmp_path, monkeypatch, saved):
    src, _ = saved["a"]
    out = tmp_path / "again"
    out.mkdir()
    before = {n: (src / n).read_bytes() for n in ("results.json", "results.csv")}
    for name, blob in before.items():
        (out / name).write_bytes(blob)
    monkeypatch.setattr(cli, "Progress", _InterruptAtSecondSize)
    code, _, _ = run_cli("sweep", *TINY, "--out", str(out))
    assert code == 130
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "results.partial.json"} == before


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


@pytest.mark.skipif(not plots.HAS_MATPLOTLIB, reason="matplotlib is not installed")
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


# --------------------------------------------------------------------------------------------
# Sizes that do not fit
# --------------------------------------------------------------------------------------------


def test_oversized_size_is_skipped_with_a_note():
    cfg = S.SweepConfig(rows=[64, HUGE_ROWS], cols=[96], trials=2, warmup=0, variants=("eager",))
    res = S.run_sweep(cfg)
    assert [(r.config.rows, r.config.cols) for r in res.runs] == [(64, 96)]
    [skip] = res.to_dict()["skipped"]
    assert (skip["rows"], skip["cols"]) == (HUGE_ROWS, 96)
    assert "GB" in skip["reason"] and "smaller sizes" in skip["reason"]
    text = R.format_sweep(res.to_dict())
    assert f"{HUGE_ROWS} x 96: skipped" in text and "(1 skipped)" in text


def test_out_of_memory_is_skipped_and_other_errors_are_not(monkeypatch):
    real = S.run_tail_bench

    def oom_at_128(cfg, **kwargs):
        if cfg.rows == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, **kwargs)

    monkeypatch.setattr(S, "run_tail_bench", oom_at_128)
    cfg = S.SweepConfig(rows=[64, 128], cols=[96], trials=2, warmup=0, variants=("eager",))
    res = S.run_sweep(cfg)
    assert len(res.runs) == 1
    assert res.skipped[0].rows == 128 and "out of memory" in res.skipped[0].reason

    def broken(cfg, **kwargs):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(S, "run_tail_bench", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        S.run_sweep(cfg)


def test_sweep_where_nothing_fits_writes_nothing(tmp_path):
    out = tmp_path / "none"
    code, _, stderr = run_cli("sweep", "--rows", str(HUGE_ROWS), "--cols", "96", "--trials", "2",
                              "--variants", "eager", "--device", "cpu", "--out", str(out))  # fmt: skip
    assert code == 2 and "no size fitted" in stderr
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# The sweep's settings and progress
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rows": [], "cols": [96]}, "at least one"),
        ({"rows": [64], "cols": [96], "variants": ("eager", "nope")}, "unknown variant"),
        ({"rows": [64, 0], "cols": [96]}, "positive"),
        ({"rows": [64], "cols": [96], "trials": 1}, "at least 2"),
    ],
)
def test_bad_settings_fail_before_any_size_runs(kwargs, match):
    with pytest.raises(UsageError, match=match):
        S.SweepConfig(**kwargs)


def test_config_adds_the_baseline_and_drops_repeated_sizes():
    cfg = S.SweepConfig(rows=[64, 64, 128], cols=[96], variants=("rms_norm",))
    assert cfg.sizes() == [(64, 96), (128, 96)]
    assert cfg.variants == ("eager", "rms_norm")


def test_progress_counts_over_the_whole_sweep_and_compiles_fresh_per_size(monkeypatch):
    resets = []
    monkeypatch.setattr(S._compile, "reset", lambda: resets.append(1))
    calls = []
    cfg = S.SweepConfig(rows=[64, 128], cols=[96], trials=2, warmup=0, variants=("eager", "rms_norm"))
    S.run_sweep(cfg, progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert len(resets) == 2
    assert {total for _, _, total in calls} == {2 * S.STEPS_PER_SIZE}
    dones = [done for _, done, _ in calls]
    assert dones == sorted(dones) and dones[-1] == 2 * S.STEPS_PER_SIZE
    stages = list(dict.fromkeys(stage for stage, _, _ in calls))
    assert stages == ["size 1/2: 64 x 96", "size 2/2: 128 x 96"]


def test_sweep_with_torch_compile_compiles_each_size():
    # The one test with compile (a few seconds per size on CPU): after reset() the second size
    # compiles fresh inside the bench, so its timing loop never trips no_recompiles().
    cfg = S.SweepConfig(rows=[32, 48], cols=[64], trials=2, warmup=1, variants=("eager", "compile"))
    res = S.run_sweep(cfg)
    assert res.skipped == []
    for run in res.runs:
        assert run.checks["compile"].passed
        assert "compile" in run.comparison.timings


# --------------------------------------------------------------------------------------------
# profuse report and profuse diff
# --------------------------------------------------------------------------------------------


def test_report_prints_a_saved_sweep(saved):
    out, stdout = saved["a"]
    code, text, _ = run_cli("report", str(out / "results.json"))
    assert code == 0
    table = lambda s: s.split("\n\nwrote")[0].strip()
    assert text.strip() == table(stdout)


def test_report_markdown(saved):
    out, _ = saved["a"]
    code, text, _ = run_cli("report", str(out / "results.json"), "--markdown")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("**Sweep: fused tail forward")
    header = next(i for i, line in enumerate(lines) if line.startswith("| size |"))
    assert set(lines[header + 1]) <= set("|-: ")
    assert sum(line.startswith("| 64 x 96 |") or line.startswith("| 128 x 96 |") for line in lines) == 4


def test_report_prints_a_single_run(tmp_path):
    from profuse.bench.tail import TailBenchConfig, run_tail_bench
    from profuse.files import write_json

    cfg = TailBenchConfig(rows=16, cols=40, trials=2, warmup=0, variants=("eager", "rms_norm"))
    res = run_tail_bench(cfg)
    path = write_json(tmp_path / "results.json", res.to_dict())
    code, text, _ = run_cli("report", str(path))
    assert code == 0
    assert "Part B: fused tail forward, 16 x 40 float32 on cpu, 2 trials" in text
    assert "eager F.rms_norm" in text


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory, saved):
    """A results file of each kind profuse writes, made through the CLI: a single run with a
    variant skipped (liger-kernel: not installed, or no GPU), a sweep, a sweep with a size that
    did not fit, and the partial file of a sweep stopped after its first size."""
    root = tmp_path_factory.mktemp("kinds")
    single = root / "single"
    code, _, err = run_cli(
        "--skip-profile", "--rows", "16", "--cols", "40", "--trials", "3",
        "--variants", "eager,rms_norm,liger", "--device", "cpu", "--out", str(single),
    )  # fmt: skip
    assert code == 0, err
    skipped = root / "skipped"
    code, _, err = run_cli(
        "sweep", "--rows", f"64,{HUGE_ROWS}", "--cols", "96", "--trials", "3",
        "--variants", "eager,rms_norm", "--device", "cpu", "--out", str(skipped),
    )  # fmt: skip
    assert code == 0, err
    partial = root / "partial"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "Progress", _InterruptAtSecondSize)
        code, _, _ = run_cli("sweep", *TINY, "--out", str(partial))
    assert code == 130
    return {
        "single run, a variant skipped": single / "results.json",
        "sweep": saved["a"][0] / "results.json",
        "sweep, a size skipped": skipped / "results.json",
        "partial sweep": partial / "results.partial.json",
    }


KINDS = ["single run, a variant skipped", "sweep", "sweep, a size skipped", "partial sweep"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_results_file_reads_back_in_report(every_kind, kind):
    path = every_kind[kind]
    data = json.loads(path.read_text())
    if kind.startswith("single"):  # what the file holds: a dict of skipped variants
        assert data["kind"] == "tail" and "liger" in data["skipped"]
    code, text, err = run_cli("report", str(path))
    assert code == 0, err
    assert err == ""
    rows = [line for line in text.splitlines() if "eager F.rms_norm" in line and "GB/s" in line]
    speedup = re.compile(r"\d\.\d\dx( slower)? \(\d|no measurable gain \(")  # a ratio with its CI
    assert rows and all(speedup.search(line) for line in rows), text
    if kind.startswith("single"):
        assert any(line.startswith("liger") and ": skipped (" in line for line in text.splitlines()), text
    if kind == "sweep, a size skipped":
        assert f"{HUGE_ROWS} x 96: skipped" in text
    if kind == "partial sweep":
        assert "partial sweep" in text


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_results_file_diffs_against_itself(every_kind, kind):
    """A run compared with itself: every size and variant it timed is in the table, and none
    shows a measurable difference (each point ratio is 1)."""
    path = str(every_kind[kind])
    run = R.parse(json.loads(every_kind[kind].read_text()))
    timed = [r for r in run.variant_rows if r.median_s is not None]
    code, text, err = run_cli("diff", path, path)
    assert code == 0, err
    rows = [line for line in text.splitlines() if " 1.00x (" in line]
    assert len(rows) == len(timed) > 0, text
    assert all("no measurable difference" in line for line in rows)


def test_a_single_run_and_a_sweep_diff_where_their_sizes_meet(every_kind):
    single, sweep = every_kind["single run, a variant skipped"], every_kind["sweep"]
    code, text, err = run_cli("diff", str(single), str(sweep))
    assert code == 0, err
    assert "only in A: 16 x 40" in text and "only in B: 64 x 96" in text


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


def test_diff_compares_two_saved_sweeps(saved):
    a, b = saved["a"][0] / "results.json", saved["b"][0] / "results.json"
    code, text, _ = run_cli("diff", str(a), str(b))
    assert code == 0
    assert f"A: {a}" in text and f"B: {b}" in text
    assert "64 x 96" in text and "128 x 96" in text
    rows = [line for line in text.splitlines() if "eager" in line and "x (" in line]
    assert len(rows) == 4  # two sizes x two variants, each with a ratio and its CI
    assert all(any(v in line for v in ("B faster", "B slower", "no measurable difference")) for line in rows)


def test_diff_notes_sizes_in_one_run_only(saved):
    a = json.loads((saved["a"][0] / "results.json").read_text())
    b = json.loads((saved["b"][0] / "results.json").read_text())
    b["runs"] = b["runs"][:1]
    text = R.format_diff(a, b)
    assert "only in A: 128 x 96 (eager, eager F.rms_norm)" in text


def test_time_ratio_ci_sees_a_real_difference_and_no_invented_one():
    rng = np.random.default_rng(0)
    a = 1.0 + 0.02 * rng.standard_normal(20)
    faster = 0.5 + 0.01 * rng.standard_normal(25)  # a different trial count: the runs are unpaired
    r = R.time_ratio_ci(a, faster)
    assert r.high < 1.0 and r.low <= r.median <= r.high and r.verdict.startswith("B faster")
    same = 1.0 + 0.02 * rng.standard_normal(20)
    assert R.time_ratio_ci(a, same).verdict == "no measurable difference"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ('{"kind": "sweep", "runs": [', "not valid JSON"),
        ('{"kind": "profile"}', "not a profuse results file"),
        ("[1, 2]", "not a profuse results file"),
        ('{"kind": "sweep", "config": {}}', "malformed"),
    ],
)
def test_bad_results_files_are_one_line_errors(tmp_path, saved, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    for argv in (["report", str(path)], ["diff", str(saved["a"][0] / "results.json"), str(path)]):
        code, out, err = run_cli(*argv)
        assert code == 2 and out == ""
        assert message in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# Grids over hidden sizes (--elements) and speedups over another variant (report --vs)
# --------------------------------------------------------------------------------------------


def test_elements_give_each_cols_its_own_rows(tmp_path):
    code, _, stderr = run_cli(
        "sweep", "--elements", "6K,12K", "--cols", "96,200", "--trials", "3", "--variants", "eager",
        "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stderr
    data = json.loads((tmp_path / "results.json").read_text())
    sizes = [(r["config"]["rows"], r["config"]["cols"]) for r in data["runs"]]
    # rows = elements // cols, per cols value: 6144 // 96 = 64, 12288 // 96 = 128, ...
    assert sizes == [(64, 96), (128, 96), (30, 200), (61, 200)]
    assert data["config"]["elements"] == [6144, 12288]


@pytest.mark.parametrize("value", ["0", "-4M", "4X", ","])
def test_bad_elements_are_one_line_errors(value):
    code, _, stderr = run_cli("sweep", "--elements", value)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and "--elements" in stderr


def test_report_vs_recomputes_speedups_from_the_saved_trials(saved):
    out, _ = saved["a"]
    data = json.loads((out / "results.json").read_text())
    rebased = R.rebase(data, "rms_norm")
    for run, old in zip(rebased["runs"], data["runs"]):
        times = {k: np.array(v["times_s"]) for k, v in old["comparison"]["timings"].items()}
        eager = rebased_sp = run["results"]["eager"]["speedup"]
        # the point estimate is the ratio of the saved medians, rms_norm over eager
        assert rebased_sp["median"] == pytest.approx(np.median(times["rms_norm"]) / np.median(times["eager"]))
        assert eager["low"] <= eager["median"] <= eager["high"]
        assert run["results"]["rms_norm"]["speedup"] is None  # the new baseline
        assert old["results"]["eager"]["speedup"] is None  # the original is left alone
    code, stdout, _ = run_cli("report", str(out / "results.json"), "--vs", "rms_norm")
    assert code == 0 and "speedup vs eager F.rms_norm (95% CI)" in stdout  # the label, as its rows say it


def test_report_vs_an_untimed_variant_is_a_one_line_error(saved):
    out, _ = saved["a"]
    code, _, stderr = run_cli("report", str(out / "results.json"), "--vs", "triton")
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "triton" in stderr


# --------------------------------------------------------------------------------------------
# Plots of a grid (hidden size on x, a line per variant and elements value); report --variants
# and report --plots
# --------------------------------------------------------------------------------------------

GRID = "--cols 64,96 --elements 6144,12288 --trials 3 --variants eager,rms_norm --device cpu".split()
needs_matplotlib = pytest.mark.skipif(not plots.HAS_MATPLOTLIB, reason="matplotlib is not installed")


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


def test_report_variants_shows_only_those_rows(saved):
    path = str(saved["a"][0] / "results.json")
    rows = lambda text: [ln for ln in text.splitlines() if ln.startswith(("| 64 x 96 |", "| 128 x 96 |"))]
    code, full, _ = run_cli("report", path, "--markdown")
    assert code == 0 and len(rows(full)) == 4
    code, text, _ = run_cli("report", path, "--markdown", "--variants", "rms_norm")
    assert code == 0 and len(rows(text)) == 2
    assert all("| eager F.rms_norm |" in ln for ln in rows(text))
    assert "speedup vs eager" in text  # still over the baseline, whose row is left out


@pytest.mark.parametrize("value, message", [("rms_norm,nope", "'nope'"), (",", "--variants")])
def test_report_variants_unknown_key_is_a_one_line_error(saved, value, message):
    code, out, err = run_cli("report", str(saved["a"][0] / "results.json"), "--variants", value)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@needs_matplotlib
def test_report_vs_plots_writes_both_pngs_over_the_new_baseline(saved, tmp_path):
    src = saved["a"][0]
    results, same, rebased = str(src / "results.json"), tmp_path / "same", tmp_path / "vs"
    code, _, _ = run_cli("report", results, "--plots", str(same))
    assert code == 0
    # Drawn again from the file, the sweep's own plots come out byte for byte...
    assert (same / plots.SPEEDUP_PNG).read_bytes() == (src / plots.SPEEDUP_PNG).read_bytes()
    code, stdout, _ = run_cli("report", results, "--vs", "rms_norm", "--plots", str(rebased))
    assert code == 0
    for name in (plots.SPEEDUP_PNG, plots.BANDWIDTH_PNG):
        blob = (rebased / name).read_bytes()
        assert blob.startswith(PNG_SIGNATURE) and len(blob) > MIN_DRAWN_PNG_BYTES
        assert f"wrote {rebased / name}" in stdout
    # ... so a different speedup.png is the rebased data, speedups over rms_norm.
    assert (rebased / plots.SPEEDUP_PNG).read_bytes() != (src / plots.SPEEDUP_PNG).read_bytes()
    assert part_files(tmp_path) == []


def test_report_plots_without_matplotlib_is_a_one_line_error(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "HAS_MATPLOTLIB", False)
    code, out, err = run_cli("report", str(saved["a"][0] / "results.json"), "--plots", str(tmp_path / "p"))
    assert code == 2 and out == ""
    assert "pip install matplotlib" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


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


@pytest.mark.parametrize("trials, warned", [(2, True), (3, True), (9, True), (10, False), (30, False)])
def test_few_trials_carry_a_caveat_on_their_ci(saved, trials, warned):
    data = json.loads((saved["a"][0] / "results.json").read_text())
    data["config"]["trials"] = trials
    text = R.format_report(data)
    caveats = [line for line in text.splitlines() if f"only {trials} trials" in line]
    assert len(caveats) == (1 if warned else 0), text
    if warned:
        assert "--trials 10" in caveats[0] and "CI" in caveats[0]


def test_sweep_and_diff_show_the_warnings_too(saved):
    """The sweep's own table, report and diff all carry the few-trials caveat of a 3-trial run."""
    out, stdout = saved["a"]
    assert "WARNING only 3 trials" in stdout
    path = str(out / "results.json")
    code, text, _ = run_cli("diff", path, path)
    assert code == 0
    assert "A: WARNING only 3 trials" in text and "B: WARNING only 3 trials" in text


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


def test_a_sweep_where_nothing_fitted_names_no_byte_model():
    cfg = S.SweepConfig(rows=[HUGE_ROWS], cols=[96], trials=2, warmup=0, variants=("eager",))
    text = R.format_sweep(S.run_sweep(cfg).to_dict())
    assert "skipped" in text and "None" not in text


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
