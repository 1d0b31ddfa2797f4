"""The command line end to end on a small size, its entry points, and every kind of bad input;
then profuse sweep, report and diff: the files they write, runs stopped part-way, saved files read back.

In-process runs call profuse.cli.main; argparse reports its errors by raising SystemExit, which is
what the real process exits with, so `run` (tests/cases.py) turns that into the exit status.
Behaviour only: never an assertion on seconds.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import (
    HUGE_ROWS,
    MIN_DRAWN_PNG_BYTES,
    PNG_SIGNATURE,
    TINY_SWEEP,
    InterruptAtSecondSize,
    assert_one_clear_line,
    needs_matplotlib,
    part_files,
    run,
    run_cli,
)

from profuse import cli
from profuse import sweep as S
from profuse.cli import main
from profuse.cli import results as cli_results
from profuse.errors import UsageError
from profuse.report import plots
from profuse.report import sweep as R

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


def test_part_b_end_to_end(tmp_path, capsys):
    argv = ["--skip-profile", "--rows", "64", "--cols", "96", "--trials", "3", "--variants", "eager,rms_norm"]
    argv += ["--out", str(tmp_path)]
    if torch.cuda.is_available():
        argv += ["--device", "cpu"]  # the lines below are the CPU run's
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert err == "", f"non-interactive output must carry no progress bar, got {err!r}"
    lines = [line.strip() for line in out.splitlines()]

    # The lab's lines.
    diffs = [line for line in lines if "max |diff| vs eager" in line]
    assert len(diffs) == 2 and diffs[0].startswith("eager:"), diffs
    assert all("ok" in line and "FAILED" not in line for line in diffs), diffs
    assert "=== Part B: fused tail, 64 x 96 float32 on cpu, 3 trials ===" in lines
    traffic = [line for line in lines if line.startswith("minimum traffic if fused: 3 inputs + 1 output =")]
    assert len(traffic) == 1
    rows = dict(line.split(": median ", 1) for line in lines if ": median " in line)
    assert set(rows) == {"eager", "eager F.rms_norm"}, rows
    assert "CI" in rows["eager F.rms_norm"]  # its speedup (or 'no measurable gain') with the interval

    # results.json: valid JSON with the environment and every timing.
    path = tmp_path / "results.json"
    assert any(line.startswith("results:") and str(path) in line for line in lines)
    data = json.loads(path.read_text())
    env = data["env"]
    assert env["torch"] == torch.__version__
    assert env["python"] == platform.python_version()
    assert data["config"]["rows"] == 64 and data["config"]["cols"] == 96 and data["config"]["trials"] == 3
    timings = data["comparison"]["timings"]
    assert set(timings) == {"eager", "rms_norm"}
    for name, t in timings.items():
        assert len(t["times_s"]) == 3, name
        assert all(math.isfinite(s) and s > 0 for s in t["times_s"]), name
        assert t["median_s"] == sorted(t["times_s"])[1]
    sp = data["comparison"]["speedups"]["rms_norm"]
    assert sp["low"] <= sp["median"] <= sp["high"]
    assert data["checks"]["eager"]["passed"] and data["checks"]["rms_norm"]["passed"]


def test_part_b_warns_where_report_would():
    """The main job prints the warnings `profuse report` gives for its file: too few trials for
    the CI, and a variant whose trials were disturbed, with the command to time it again."""
    from profuse.bench.tail_bench import TailBenchConfig, run_tail_bench
    from profuse.report.bench import format_tail_bench

    cfg = TailBenchConfig(rows=16, cols=40, trials=30, warmup=0, variants=("eager", "rms_norm"))
    res = run_tail_bench(cfg)
    for timing in res.comparison.timings.values():  # steady: within 10% of the fastest
        timing.times_s = [1e-3 * (1 + 0.1 * (i % 2)) for i in range(30)]
    assert "WARNING" not in format_tail_bench(res)
    res.comparison.timings["eager"].times_s = [1e-3] * 10 + [2e-3] * 20
    lines = format_tail_bench(res).splitlines()
    [warning] = [line for line in lines if line.startswith("WARNING")]
    assert "16 x 40" in warning and "eager 20/30" in warning
    assert "profuse --skip-profile --rows 16 --cols 40" in warning
    assert lines.index(warning) > max(i for i, line in enumerate(lines) if ": median " in line)
    cfg.trials = res.config.trials = 3
    assert any(line.startswith("WARNING only 3 trials") for line in format_tail_bench(res).splitlines())


def test_threads_flag_sets_torchs_threads_and_is_recorded(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        code, out, err = run([*SMALL, "--device", "cpu", "--threads", "1", "--out", str(tmp_path)], capsys)
        assert code == 0, err
        env = json.loads((tmp_path / "results.json").read_text())["env"]
        assert env["threads"] == 1 == torch.get_num_threads()
        assert env["cores_available"] >= 1 and "load_1m" in env
    finally:
        torch.set_num_threads(before)
    parsers = (
        cli.build_parser(),
        cli.build_sweep_parser(),
        cli.build_step_parser(),
        cli.build_profile_parser(),
    )
    for parser in parsers:  # profile too: its busy-CPU warning advises --threads 1
        assert parser.parse_args(["--threads", "3"]).threads == 3
        assert "torch.set_num_threads" in parser.format_help()


@pytest.mark.parametrize(
    ("env", "noted", "flag"),
    [
        ({"threads": 2, "cores_available": 2, "load_1m": 1.0}, False, "2"),
        ({"threads": 2, "cores_available": 2, "load_1m": 5.2}, True, "1"),  # six jobs on two cores
        ({"threads": 8, "cores_available": 2, "load_1m": 0.1}, True, "1"),
        ({"threads": 4, "cores_available": 8, "load_1m": 9.0}, True, "3"),
        ({"threads": 1, "cores_available": 2, "load_1m": 4.0}, True, "1"),
        ({"gpu": "NVIDIA H200", "threads": 64, "cores_available": 2, "load_1m": 9.0}, False, None),
        ({}, False, None),  # a file saved before threads were recorded
    ],
)
def test_an_oversubscribed_cpu_is_named_with_a_thread_count(env, noted, flag):
    from profuse.env import oversubscribed

    note = oversubscribed(env)
    assert bool(note) is noted
    if noted:
        assert note.startswith("note: the CPU was oversubscribed (")
        assert (f"--threads {flag}" in note) is (env["threads"] > 1)
    assert R.threads_flag(env) == ([] if flag is None else ["--threads", flag])


def test_the_cpu_job_says_the_triton_variant_was_left_out_and_how_to_add_it(tmp_path, capsys, monkeypatch):
    from profuse.bench import tail_bench as bench_tail
    from profuse.kernels import HAS_TRITON

    monkeypatch.setattr(bench_tail, "CPU_DEFAULT_VARIANTS", ("eager",))  # no torch.compile: quick
    argv = ["--skip-profile", "--rows", "8", "--cols", "8", "--trials", "2", "--device", "cpu"]
    code, out, err = run([*argv, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    [note] = [line for line in out.splitlines() if line.startswith("triton variant skipped: ")]
    if HAS_TRITON:
        assert "TRITON_INTERPRET=1" in note and "--variants eager,compile,triton" in note
    else:
        assert "pip install" in note
    code, out, err = run([*argv, "--variants", "eager", "--out", str(tmp_path)], capsys)
    assert code == 0 and "triton variant skipped" not in out  # the user chose the variants


# A model small enough that Part A takes a second or two on the CPU.
TINY_MODEL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64", "--seq-len", "16",
              "--batch-size", "2", "--profile-steps", "1"]  # fmt: skip


def test_ctrl_c_in_part_b_says_that_part_a_is_kept(tmp_path, capsys, monkeypatch):
    import profuse.bench.tail_bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profuse.bench.tail_bench, "run_tail_bench", interrupted)
    code, _out, err = run([*TINY_MODEL, "--device", "cpu", "--out", str(tmp_path)], capsys)
    assert code == 130
    summary = tmp_path / "profile.json"
    assert summary.is_file() and (tmp_path / "trace.json").is_file()
    assert err.startswith("profuse: interrupted") and f"profuse report {summary}" in err


@pytest.fixture(scope="module")
def part_a(tmp_path_factory):
    """Part A of a tiny model through the main job: (its folder, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("part_a")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--profile-only", *TINY_MODEL, "--device", "cpu", "--out", str(out)])
    assert code == 0
    return out, stdout.getvalue()


def test_part_a_names_its_summary_and_report_prints_it_again(part_a, capsys):
    out, printed = part_a
    summary = out / "profile.json"
    assert json.loads(summary.read_text())["kind"] == "part_a"
    [line] = [ln for ln in printed.splitlines() if ln.startswith("summary: ")]
    assert str(summary) in line and f"profuse report {summary}" in line
    code, text, err = run(["report", str(summary)], capsys)
    assert code == 0, err
    # The block the run printed, but for its trace: written by that run, not by the report.
    block = printed.split("\nsummary: ")[0].strip()
    assert "\ntrace written: " in block and "trace written" not in text
    text, provenance = text.split("\nprovenance:\n")  # then the saved provenance
    assert text.strip() == block.replace("\ntrace written: ", "\ntrace (written by that run): ")
    assert "  command: " in provenance and "--profile-only" in provenance
    assert json.loads(summary.read_text())["provenance"]["command"]["profuse_args"][0] == "--profile-only"


def test_report_reads_a_part_a_summary_saved_before_it_had_a_kind(part_a, tmp_path, capsys):
    data = json.loads((part_a[0] / "profile.json").read_text())
    del data["kind"]
    data["compiled"] = data["eager"] | {"compiled": True, "step_ms": data["eager"]["step_ms"] / 2}
    old = tmp_path / "profile.json"
    old.write_text(json.dumps(data))
    code, text, err = run(["report", str(old)], capsys)
    assert code == 0, err
    assert "=== Part A: eager vs torch.compile" in text and "eager / compiled = 2.00x" in text


PART_B_ONLY = {
    "report --vs": ["report", "{p}", "--vs", "compile"],
    "report --markdown": ["report", "{p}", "--markdown"],
    "diff": ["diff", "{p}", "{p}"],
}


@pytest.mark.parametrize("argv", PART_B_ONLY.values(), ids=PART_B_ONLY)
def test_part_a_summary_where_part_b_results_are_wanted_is_one_line(part_a, argv, capsys):
    summary = str(part_a[0] / "profile.json")
    code, _, err = run([a.replace("{p}", summary) for a in argv], capsys)
    assert_one_clear_line(code, err)
    assert "Part A's summary" in err
    if argv[0] == "diff":
        assert f"profuse report {summary}" in err


def test_a_second_run_says_it_replaced_the_first(tmp_path, capsys):
    argv = [*SMALL, "--out", str(tmp_path)]
    code, first, err = run(argv, capsys)
    assert code == 0, err
    assert "replaced" not in first
    code, second, err = run(argv, capsys)
    assert code == 0, err
    [line] = [ln for ln in second.splitlines() if ln.startswith("results: ")]
    assert "replaced the results.json of an earlier run, written 20" in line


def test_part_b_prints_its_header_first_and_names_the_cpu(tmp_path, capsys):
    code, out, err = run(
        [*SMALL, "--variants", "eager,rms_norm", "--device", "cpu", "--out", str(tmp_path)], capsys
    )
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("=== Part B:"))
    checks = [i for i, line in enumerate(lines) if "max |diff| vs eager" in line]
    assert header == 0 and checks and min(checks) > header
    [hardware] = [line for line in lines if line.startswith(("card:", "CPU:"))]
    assert hardware.startswith("CPU: ") and f"({os.cpu_count()} cores)" in hardware
    assert "cpu (" not in hardware  # the CPU's name, not the device type
    assert "None" not in out


def test_the_versions_line_says_when_triton_is_missing():
    from profuse.env import describe

    cpu = {"cpu_model": "AMD EPYC 7B13", "cpu_count": 2, "torch": "2.13.0", "triton": None}
    assert describe(cpu) == "CPU: AMD EPYC 7B13 (2 cores), torch 2.13.0, triton not installed"
    gpu = {"gpu": "NVIDIA H200", "cpu_count": 96, "torch": "2.11.0", "triton": "3.6.0"}
    assert describe(gpu) == "card: NVIDIA H200, torch 2.11.0, triton 3.6.0"
    old = {"processor": "x86_64", "cpu_count": 2, "torch": "2.13.0", "triton": "3.9.0"}  # no cpu_model yet
    assert describe(old).startswith("CPU: x86_64 (2 cores)")


def test_progress_bars_show_no_rate(capsys):
    progress = cli.Progress(enabled=True)
    for done in (0, 50, 100):  # 100 steps of work at once: the rate that read '19972876.19it/s'
        progress("trials", done, 100)
    progress.close()
    err = capsys.readouterr().err
    assert "trials" in err and "it/s" not in err and "/s" not in err


def test_native_noise_is_kept_off_a_bar_and_other_lines_come_after_it():
    """While a bar is shown, what native code writes to fd 2 is held: the profiler's USDT lines
    and a CUDA build's complaints are dropped (with one hint about the CPU build), the rest comes
    out when the bar closes."""
    script = (
        "import os, sys\n"
        "from profuse.cli import Progress\n"
        "p = Progress(enabled=True)\n"
        "p('trials', 0, 4)\n"
        "os.write(2, b'USDT:2026-12-02 18:41:36 3704:3704 SyncActivityProfilerHandler.cpp:52] start\\n')\n"
        "os.write(2, b'[W1202 CuptiActivityApi.cpp:100] gpuGetDeviceCount failed with code 35\\n')\n"
        "print('a line to keep', file=sys.stderr)\n"
        "p('trials', 4, 4)\n"
        "p.close()\n"
        "print('after the bar', file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "USDT" not in err and "gpuGetDeviceCount" not in err
    assert err.count("download.pytorch.org/whl/cpu") == 1
    assert "trials" in err.split("a line to keep")[0]  # the bar, then the held line
    assert err.index("a line to keep") < err.index("after the bar")


def test_profile_and_fuse_help():
    proc = subprocess.run(
        [sys.executable, "profile_and_fuse.py", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for flag in ("--skip-profile", "--rows", "--cols", "--trials", "--device", "--dtype", "--out"):
        assert flag in proc.stdout, flag


def test_python_m_profuse_help():
    proc = subprocess.run(
        [sys.executable, "-m", "profuse", "--help"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "usage: profuse" in proc.stdout and "--skip-profile" in proc.stdout


def test_the_readmes_cpu_example_runs_on_a_cpu():
    """The README's library example for a machine without a GPU, run as a user would paste it."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("**On a CPU.**") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {k: v for k, v in subprocess_env().items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    proc = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Speedup(median=")


# The modules that make up most of a command's start-up time (about 3.5 s on 2 cores).
HEAVY_MODULES = ("torch", "numpy", "scipy", "triton", "matplotlib")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["sweep", "--help"], ["profile", "--help"], ["report", "--help"], ["step", "--help"],
     ["diff", "--help"], ["--rows", "0"], ["sweep", "--elements", "4X"], ["step", "--bogus"], ["--version"]],
    ids=" ".join,
)  # fmt: skip
def test_help_and_argument_errors_import_nothing_heavy(argv):
    """`profuse --help` and a mistyped flag answer without loading torch: the package's public
    names load on first use, and each command imports what it runs after parsing its flags."""
    script = (
        "import sys\n"
        "from profuse.cli import main\n"
        f"code = main({argv!r})\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "print('HEAVY', heavy, 'CODE', code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    expected = 2 if "0" in argv or "4X" in argv or "--bogus" in argv else 0
    assert last == f"HEAVY [] CODE {expected}", (last, proc.stderr)


def test_public_names_load_on_first_use():
    script = (
        "import sys\n"
        "import profuse\n"
        "assert 'torch' not in sys.modules, 'import profuse loaded torch'\n"
        "from profuse import compare, FusedTail\n"
        "assert callable(profuse.tail_triton) and callable(compare) and 'torch' in sys.modules\n"
        "assert set(profuse.__all__) <= set(dir(profuse))\n"
        "from profuse import compile as c, tail as t\n"  # submodules, not public names
        "assert c.__name__ == 'profuse.compile' and t.__name__ == 'profuse.tail'\n"
        "try:\n"
        "    profuse.no_such_name\n"
        "except AttributeError as err:\n"
        "    assert 'no_such_name' in str(err)\n"
        "else:\n"
        "    raise SystemExit('an unknown name must raise AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr, no traceback
# --------------------------------------------------------------------------------------------

# A small run, so a bad input that slipped through fails fast instead of timing 8192 x 4096;
# the flags of each case come after and override these (argparse keeps the last).
SMALL = ["--skip-profile", "--rows", "8", "--cols", "8", "--trials", "2", "--variants", "eager"]
BAD = {
    "rows 0": ["--rows", "0"],
    "rows negative": ["--rows", "-5"],
    "rows not a number": ["--rows", "many"],
    "cols 0": ["--cols", "0"],
    "trials 0": ["--trials", "0"],
    "trials 1": ["--trials", "1"],
    "dtype int8": ["--dtype", "int8"],
    "device tpu": ["--device", "tpu"],
    "too big for memory": ["--rows", "10000000", "--cols", "10000000"],
    "unknown variant": ["--variants", "nope"],
    "unknown flag": ["--frobnicate"],
    "unknown timing": ["--timing", "wall"],
    "graph timing on a cpu": ["--timing", "graph", "--device", "cpu"],
    "seed negative": ["--seed", "-1"],
    "variants empty": ["--variants", ""],  # was a run of eager alone
    "variants only commas": ["--variants", " , "],
    "threads 0": ["--threads", "0"],
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_2_with_one_line(case, capsys, tmp_path):
    code, _out, err = run([*SMALL, *BAD[case], "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    "setting, value, message",
    [
        (
            "PROFUSE_COMPILE_THREADS",
            "many",
            "PROFUSE_COMPILE_THREADS='many' is not a whole number of threads",
        ),
        ("PROFUSE_CE_CHUNK", "1.5k", "PROFUSE_CE_CHUNK='1.5k' is not a whole number of tokens"),
        ("PROFUSE_CE_ACCUM", "fp16", "PROFUSE_CE_ACCUM must be one of fp32, weight; got 'fp16'"),
    ],
)
def test_a_bad_setting_in_the_environment_is_one_line_before_any_work(
    setting, value, message, capsys, tmp_path, monkeypatch
):
    """The kernels read these at their first call, minutes into a run on a card: the command
    reads them first. --help still answers."""
    pytest.importorskip("triton")
    monkeypatch.setenv(setting, value)
    for argv in ([*SMALL], ["step", "--model", "hf:llama", "--preset", "tiny", "--trials", "2"]):
        code, _out, err = run([*argv, "--out", str(tmp_path)], capsys)
        assert_one_clear_line(code, err)
        assert message in err and not any(tmp_path.iterdir())
    assert run(["step", "--help"], capsys)[0] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "--d-model", "65536", "--layers", "64"],
        ["--profile-only", "--seq-len", "100000", "--batch-size", "64"],
    ],
    ids=["too many parameters", "too many tokens"],
)
def test_part_a_too_big_for_memory_is_one_line_before_any_work(argv, capsys, tmp_path):
    code, _out, err = run([*argv, "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "Part A's step" in err and "GB" in err
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "profile.json").exists()


# --------------------------------------------------------------------------------------------
# An output folder that cannot be written fails before any work: one line, exit 2
# --------------------------------------------------------------------------------------------

COMMANDS = {
    "main": SMALL,
    "main, Part A": ["--profile-only"],
    "profile": ["profile"],
    "profile --nproc": ["profile", "--nproc", "2"],
    "sweep": ["sweep", "--rows", "8", "--cols", "8", "--trials", "2", "--variants", "eager"],
}


def _a_file(tmp_path, monkeypatch=None):
    path = tmp_path / "results.json"
    path.write_text("an earlier run\n")
    return path


def _under_a_file(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("a file\n")
    return tmp_path / "notes.txt" / "out"


def _name_too_long(tmp_path, monkeypatch):
    return tmp_path / "new" / ("x" * 300)  # past the 255 bytes a file name may have


def _read_only(tmp_path, monkeypatch):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes into read-only folders: the file system refuses instead
        import profuse.files

        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(profuse.files.tempfile, "mkstemp", refused)
    return folder


BAD_OUT = {"a file": _a_file, "a folder under a file": _under_a_file, "a name too long": _name_too_long,
           "a read-only folder": _read_only}  # fmt: skip


@pytest.fixture
def no_work(monkeypatch):
    """Any measuring fails the test: a bad output folder must be found before it starts."""
    import profuse.bench.tail_bench
    import profuse.distributed
    import profuse.profiling
    import profuse.sweep

    def started(*args, **kwargs):
        raise AssertionError("the work started before the output folder was checked")

    work = [(profuse.bench.tail_bench, "run_tail_bench"), (profuse.sweep, "run_sweep"),
            (profuse.profiling, "run_profile"), (profuse.profiling, "profile"),
            (profuse.distributed, "launch"), (profuse.distributed, "run_worker")]  # fmt: skip
    for module, name in work:
        monkeypatch.setattr(module, name, started)


@pytest.mark.parametrize("bad", BAD_OUT)
@pytest.mark.parametrize("command", COMMANDS)
def test_an_out_that_cannot_be_written_fails_before_any_work(
    command, bad, tmp_path, capsys, monkeypatch, no_work
):
    out = BAD_OUT[bad](tmp_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, stdout, err = run([*COMMANDS[command], "--out", str(out)], capsys)
    assert_one_clear_line(code, err)
    assert "--out" in err and str(out) in err, err
    assert stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing made, nothing left


def test_report_plots_that_cannot_be_written_fail_before_the_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results.json"
    results.write_text("{}")  # never read: the folder for the plots is checked first
    plots = tmp_path / "speedup.png"
    plots.write_bytes(b"an earlier plot")
    code, stdout, err = run(["report", str(results), "--plots", str(plots)], capsys)
    assert_one_clear_line(code, err)
    assert "--plots" in err and stdout == ""


def test_a_results_json_that_is_a_folder_fails_before_any_work(tmp_path, capsys, no_work):
    (tmp_path / "results.json").mkdir()
    code, _, err = run([*SMALL, "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "results.json" in err


def test_a_missing_out_is_made_when_the_run_writes(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    code, _, err = run([*SMALL, "--out", str(out)], capsys)
    assert code == 0, err
    assert (out / "results.json").is_file()
    assert [p.name for p in out.iterdir()] == ["results.json"]  # no probe file left


def test_ranks_get_the_users_flags_with_device_and_out_resolved(tmp_path):
    args = cli.build_profile_parser().parse_args(
        ["--nproc", "3", "--layers", "3", "--seed", "7", "--out", "x"]
    )
    argv = cli.worker_argv(args, torch.device("cpu"), tmp_path)
    assert argv == ["--seed", "7", "--layers", "3", "--device", "cpu", "--out", str(tmp_path), "--nproc", "3"]
    assert cli.build_profile_parser().parse_args(argv).layers == 3


def test_output_names_checked_by_the_cli_are_the_ones_written():
    from profuse import distributed
    from profuse.profiling import ProfileConfig, compiled_config

    assert cli.TRACE_JSON == ProfileConfig().trace_name
    assert cli.part_a_files(True)[1] == compiled_config(ProfileConfig()).trace_name
    assert cli.DDP_FILES[1] == distributed.SUMMARY_NAME
    plots = pytest.importorskip("profuse.report.plots")
    assert cli.PLOTS == (plots.SPEEDUP_PNG, plots.BANDWIDTH_PNG)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_device_cuda_without_gpu(capsys, tmp_path):
    code, _out, err = run([*SMALL, "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "cuda" in err.lower()


def test_nothing_to_run(capsys, tmp_path):
    code, _out, err = run([*SMALL, "--profile-only", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)


def test_messages_say_what_is_wrong(capsys, tmp_path):
    for argv, words in [
        (["--rows", "0"], ["--rows", "0"]),
        (["--trials", "1"], ["--trials", "2"]),
        (["--variants", "nope"], ["nope"]),
        (["--rows", "10000000", "--cols", "10000000"], ["GB", "smaller"]),
    ]:
        code, _out, err = run([*SMALL, *argv, "--out", str(tmp_path)], capsys)
        assert code == 2
        for word in words:
            assert word in err, (argv, err)


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--variants", "nope"]], ids=["argparse", "usage-error"])
def test_bad_input_in_a_real_process(argv, tmp_path):
    """The same as a user sees it: the process's exit status and its whole stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "profuse", *SMALL, *argv, "--out", str(tmp_path)],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_clear_line(proc.returncode, proc.stderr)


def test_without_triton_profuse_imports_and_skips_the_triton_row(tmp_path):
    # sys.modules[name] = None makes `import triton` fail, as on a machine without it.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import profuse\n"
        "from profuse.cli import main\n"
        f"sys.exit(main(['--skip-profile', '--rows', '8', '--cols', '16', '--trials', '2', "
        f"'--variants', 'eager,triton', '--out', {str(tmp_path)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "triton: skipped (triton is not installed" in proc.stdout
    assert "pip install triton" in proc.stdout
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "triton is not installed" in saved["skipped"]["triton"]


def test_graph_timing_on_a_cpu_fails_before_part_a(capsys, tmp_path):
    """The main job checks Part B's settings before it profiles: no trace is written first."""
    code, _out, err = run(["--timing", "graph", "--device", "cpu", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "CUDA GPU" in err
    assert not list(tmp_path.iterdir())


def test_results_record_the_timing_and_host_time(tmp_path, capsys):
    argv = ["--skip-profile", "--device", "cpu", "--rows", "16", "--cols", "32", "--trials", "2"]
    argv += ["--variants", "eager", "--timing", "loop", "--out", str(tmp_path)]
    code, _out, err = run(argv, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["timing"] == "loop" and data["timing"] == "loop"
    row = data["results"]["eager"]
    # On a CPU a call is all host time: none is measured apart, and nothing is host-bound.
    assert "host_s" in row and row["host_s"] is None and row["host_bound"] is False
    assert data["comparison"]["timings"]["eager"]["host_times_s"] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for machines without a GPU")
def test_triton_runs_on_a_cpu_through_the_interpreter(tmp_path, capsys, monkeypatch):
    argv = ["--skip-profile", "--device", "cpu", "--rows", "6", "--cols", "40", "--trials", "2"]
    argv += ["--variants", "triton", "--out", str(tmp_path)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, out, err = run(argv, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["checks"]["triton"]["passed"] and "triton" in data["results"]
    # Its times are the interpreter's: said under the table, recorded, and said again by report.
    assert data["env"]["triton_interpret"] is True
    warning = "triton ran through Triton's interpreter (TRITON_INTERPRET=1)"
    assert warning in out
    code, again, _ = run(["report", str(tmp_path / "results.json")], capsys)
    assert code == 0 and warning in again
    monkeypatch.delenv("TRITON_INTERPRET")
    code, out, err = run(argv, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "results.json").read_text())
    assert "TRITON_INTERPRET=1" in data["skipped"]["triton"]
    assert data["env"]["triton_interpret"] is False and "interpreter (TRITON_INTERPRET" not in out


# --------------------------------------------------------------------------------------------
# profuse sweep: the files it writes, what it prints
# --------------------------------------------------------------------------------------------


def test_sweep_writes_valid_json(saved):
    out, stdout = saved["a"]
    data = json.loads((out / "results.json").read_text())
    assert data["kind"] == "sweep"
    assert [(r["config"]["rows"], r["config"]["cols"]) for r in data["runs"]] == [(64, 96), (128, 96)]
    assert data["skipped"] == []
    assert "env" in data and all("env" not in r for r in data["runs"])  # the environment once
    assert data["copy_ceiling_Bps"] is None  # measured on CUDA only
    for entry in data["runs"]:
        assert entry["kind"] == "tail"
        assert set(entry["results"]) == {"eager", "rms_norm"}
        times = entry["comparison"]["timings"]["rms_norm"]["times_s"]
        assert len(times) == 3 and all(t > 0 for t in times)
        sp = entry["results"]["rms_norm"]["speedup"]
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


@needs_matplotlib
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


def test_elements_give_each_cols_its_own_rows(tmp_path):
    code, stdout, stderr = run_cli(
        "sweep", "--elements", "6K,12K", "--cols", "96,200", "--trials", "3", "--variants", "eager",
        "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0, stderr
    data = json.loads((tmp_path / "results.json").read_text())
    sizes = [(r["config"]["rows"], r["config"]["cols"]) for r in data["runs"]]
    # rows = elements // cols, per cols value: 6144 // 96 = 64, 12288 // 96 = 128, ...
    assert sizes == [(64, 96), (128, 96), (30, 200), (61, 200)]
    assert data["config"]["elements"] == [6144, 12288]
    notes = [line for line in stdout.splitlines() if line.startswith("note: --elements")]
    assert len(notes) == 2 and "timed as 30 x 200 = 6000 elements" in notes[0]


@pytest.mark.parametrize("value", ["0", "-4M", "4X", ",", "4M,,8M", "4M,"])
def test_bad_elements_are_one_line_errors(value):
    code, _, stderr = run_cli("sweep", "--elements", value)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and "--elements" in stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rows", "64,,128"], "an empty item in '64,,128'"),  # was silently 64,128
        (["--cols", "64,"], "an empty item"),
        (["--elements", "50", "--cols", "64"], "--elements 50 is fewer than --cols 64"),  # was 1 x 64
        (["--variants", ""], "--variants"),
    ],
)
def test_sweep_lists_with_holes_are_one_line_errors(argv, words, tmp_path):
    code, out, stderr = run_cli("sweep", *argv, "--device", "cpu", "--trials", "2", "--out", str(tmp_path))
    assert code == 2 and out == "" and len(stderr.strip().splitlines()) == 1
    assert words in stderr
    assert not list(tmp_path.iterdir())


def test_elements_that_cols_does_not_divide_are_noted():
    """--elements 100 --cols 64 became 1 x 64 without a word; now the sweep says so first."""
    assert S.SweepConfig(elements=[100], cols=[64], variants=("eager",)).rounding() == [
        "--elements 100 with --cols 64: timed as 1 x 64 = 64 elements (rows = elements // cols; 36 left over)"
    ]
    cfg = S.SweepConfig(elements=[6144, 12288], cols=[96, 200], variants=("eager",))
    assert cfg.rounding() == [
        "--elements 6144 with --cols 200: timed as 30 x 200 = 6000 elements (rows = elements // cols; "
        "144 left over)",
        "--elements 12288 with --cols 200: timed as 61 x 200 = 12200 elements (rows = elements // cols; "
        "88 left over)",
    ]


def test_sweep_where_nothing_fits_writes_nothing(tmp_path):
    out = tmp_path / "none"
    code, _, stderr = run_cli("sweep", "--rows", str(HUGE_ROWS), "--cols", "96", "--trials", "2",
                              "--variants", "eager", "--device", "cpu", "--out", str(out))  # fmt: skip
    assert code == 2 and "no size fitted" in stderr
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# profuse sweep: interrupted or failing runs leave whole files or none
# --------------------------------------------------------------------------------------------


def test_interrupted_sweep_keeps_only_the_sizes_done_in_a_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_results, "Progress", InterruptAtSecondSize)
    out = tmp_path / "killed"
    code, _, stderr = run_cli("sweep", *TINY_SWEEP, "--out", str(out))
    assert code == 130 and "interrupted" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.partial.json"]
    data = json.loads((out / "results.partial.json").read_text())
    assert data["partial"] is True and len(data["runs"]) == 1
    code, report, _ = run_cli("report", str(out / "results.partial.json"))
    assert code == 0 and "partial sweep: it stopped after 1 sizes" in report


def test_interrupted_sweep_says_what_it_kept_and_how_to_go_on(tmp_path, monkeypatch):
    """Ctrl-C names the partial file, the command that reads it, and a command that times the
    sizes left (which the sweep's parser reads back as exactly those sizes)."""
    monkeypatch.setattr(cli_results, "Progress", InterruptAtSecondSize)
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
        cli.main(["sweep", *TINY_SWEEP, "--out", str(out)])
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
    monkeypatch.setattr(cli_results, "Progress", InterruptAtSecondSize)
    code, _, _ = run_cli("sweep", *TINY_SWEEP, "--out", str(out))
    assert code == 130
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "results.partial.json"} == before


# --------------------------------------------------------------------------------------------
# profuse report and profuse diff
# --------------------------------------------------------------------------------------------


def test_report_prints_a_saved_sweep(saved):
    out, stdout = saved["a"]
    code, text, _ = run_cli("report", str(out / "results.json"))
    assert code == 0
    table = lambda s: s.split("\n\nwrote")[0].strip()
    text, provenance = text.split(
        "\n\nprovenance:\n"
    )  # the table as the sweep printed it, then where it came from
    assert text.strip() == table(stdout)
    assert "profuse sweep" in provenance


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
    from profuse.bench.tail_bench import TailBenchConfig, run_tail_bench
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
        mp.setattr(cli_results, "Progress", InterruptAtSecondSize)
        code, _, _ = run_cli("sweep", *TINY_SWEEP, "--out", str(partial))
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


def test_diff_compares_two_saved_sweeps(saved):
    a, b = saved["a"][0] / "results.json", saved["b"][0] / "results.json"
    code, text, _ = run_cli("diff", str(a), str(b))
    assert code == 0
    assert f"A: {a}" in text and f"B: {b}" in text
    assert "64 x 96" in text and "128 x 96" in text
    rows = [line for line in text.splitlines() if "eager" in line and "x (" in line]
    assert len(rows) == 4  # two sizes x two variants, each with a ratio and its CI
    assert all(any(v in line for v in ("B faster", "B slower", "no measurable difference")) for line in rows)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ('{"kind": "sweep", "runs": [', "not valid JSON"),
        ('{"kind": "profile"}', "not a file profuse writes"),
        ("[1, 2]", "not a file profuse writes"),
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


def test_diff_of_a_step_file_says_what_it_is(tmp_path, saved):
    path = tmp_path / "step.json"
    path.write_text('{"kind": "step"}')
    results = saved["a"][0] / "results.json"
    for argv in ((results, path), (path, results)):
        code, out, err = run_cli("diff", *map(str, argv))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert f"{path} is Part C's step.json and {results} is not" in err and "two step.json" in err


def test_a_foreign_json_is_refused_naming_every_kind_report_reads(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    code, out, err = run_cli("report", str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    for kind in ("results.json", "results.partial.json", "profile.json", "profile_ddp.json", "step.json"):
        assert kind in err, kind


def test_report_vs_an_untimed_variant_is_a_one_line_error(saved):
    out, _ = saved["a"]
    code, _, stderr = run_cli("report", str(out / "results.json"), "--vs", "triton")
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "triton" in stderr


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


def test_sweep_and_diff_show_the_warnings_too(saved):
    """The sweep's own table, report and diff all carry the few-trials note of a 3-trial run."""
    out, stdout = saved["a"]
    assert "note: 3 trials, under 30" in stdout
    path = str(out / "results.json")
    code, text, _ = run_cli("diff", path, path)
    assert code == 0
    assert "A: note: 3 trials, under 30" in text and "B: note: 3 trials, under 30" in text


def test_every_file_the_commands_write_by_default_is_git_ignored():
    """The main job and `profuse profile` write into the current folder by default: a checkout
    run from its root stays clean (profile.json was once left out)."""
    import fnmatch
    from pathlib import Path

    from profuse.cli.common import DDP_FILES, PARTIAL_JSON, RESULTS_JSON, part_a_files

    ignored = [
        line.strip().lstrip("/")
        for line in (Path(__file__).parents[1] / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    written = {RESULTS_JSON, PARTIAL_JSON, *DDP_FILES}
    for compile_step in (False, True):
        for precision in ("amp", "both"):
            written.update(part_a_files(compile_step, precision))
    for name in written:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in ignored), name
