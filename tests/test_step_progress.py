"""What a long Part C run says while it runs and keeps about where its time went: progress lines
on stderr (a fake clock, no sleeping), each phase's wall time, the first step's split into
torch.compile's phases and profuse's autotuner, and the verdict decided once.
"""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest

from profuse import compiletime as C
from profuse import step as S
from profuse.cli.common import ProgressLines, TrackedStages, tagged
from profuse.model import GPTConfig
from profuse.verdict import SYNCED_SOURCE, decide

TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


# --------------------------------------------------------------------------------------------
# Progress lines
# --------------------------------------------------------------------------------------------


def test_a_line_as_each_stage_starts_with_the_time_since_the_run_began():
    clock, out = FakeClock(), io.StringIO()
    say = ProgressLines(out, clock=clock, thread=False)
    say("checking the fused step against float64", 0, 1)
    clock.advance(65)
    say("first step: compile+fused (compiling)", 4, 6)
    assert lines_of(out) == [
        "[ 0:00] checking the fused step against float64",
        "[ 1:05] first step: compile+fused (compiling): 4/6",
    ]


def test_counted_stages_say_how_far_and_the_time_left_at_most_every_few_seconds():
    clock, out = FakeClock(), io.StringIO()
    say = ProgressLines(out, clock=clock, thread=False, every_s=5.0)
    say("steps: trials", 1, 30)  # the stage starts: a line; the pace is measured from the next
    for k in range(2, 31):
        clock.advance(2.0)  # a trial every 2 s
        say("steps: trials", k, 30)
    lines = lines_of(out)
    assert lines[0] == "[ 0:00] steps: trials: 1/30"
    assert lines[1] == "[ 0:06] steps: trials: 4/30, about 0:52 left"  # 2 s a trial, 26 to go
    assert lines[-1] == "[ 0:58] steps: trials: 30/30"  # the last always said, with nothing left
    gaps = [b - a for a, b in zip(_times(lines), _times(lines)[1:])]
    assert all(g <= 6 for g in gaps) and len(lines) < 30  # throttled, never silent for long


def _times(lines: list[str]) -> list[int]:
    out = []
    for line in lines:
        m, s = re.match(r"\[ *(\d+):(\d\d)\]", line).groups()
        out.append(60 * int(m) + int(s))
    return out


def test_a_heartbeat_while_a_stage_runs_long_so_no_ten_seconds_pass_silent():
    clock, out = FakeClock(), io.StringIO()
    say = ProgressLines(out, clock=clock, thread=False, heartbeat_s=8.0)
    say("first step: compile+fused (compiling)", 5, 7)
    for _ in range(40):  # the background thread's one-second ticks, by hand
        clock.advance(1.0)
        say.beat()
    lines = lines_of(out)
    assert lines[1] == "[ 0:08] first step: compile+fused (compiling): 5/7, 8 s so far"
    assert lines[-1] == "[ 0:40] first step: compile+fused (compiling): 5/7, 40 s so far"
    assert all(b - a <= 10 for a, b in zip(_times(lines), _times(lines)[1:]))
    say.beat()  # no time passed: nothing to say
    assert len(lines_of(out)) == len(lines)


def test_a_quiet_start_says_nothing_unless_it_lasts_past_the_heartbeat():
    """The start of `profuse step` (importing torch, the memory check): no line if it ends within
    the heartbeat (a bad input's error stays the one line), a heartbeat naming it if it lasts."""
    clock, out = FakeClock(), io.StringIO()
    say = ProgressLines(out, clock=clock, thread=False, heartbeat_s=8.0)
    say.quietly("starting: torch, the model's sizes and the memory check")
    for _ in range(7):
        clock.advance(1.0)
        say.beat()
    assert lines_of(out) == []
    for _ in range(9):
        clock.advance(1.0)
        say.beat()
    assert lines_of(out) == [
        "[ 0:08] starting: torch, the model's sizes and the memory check, 8 s so far",
        "[ 0:16] starting: torch, the model's sizes and the memory check, 16 s so far",
    ]
    say("plan (bf16): eager, fused", 0, 1)  # the run's first stage: a line, from the same start
    assert lines_of(out)[-1] == "[ 0:16] plan (bf16): eager, fused"


def test_tracked_stages_speak_only_through_the_heartbeat_with_their_count_and_pace():
    """Parts A and B in a log: a quick stage prints nothing; one that runs past the heartbeat is
    named with its count and the time left at its pace, and never ten seconds pass silent."""
    clock, out = FakeClock(), io.StringIO()
    say = ProgressLines(out, clock=clock, thread=False, heartbeat_s=8.0)
    for k in range(4):  # quick stages, 1 s each
        say.track(f"Part B: checking {k}", 0, 1)
        clock.advance(1.0)
        say.beat()
    assert lines_of(out) == []
    say.track("Part B: trials", 1, 20)
    for k in range(2, 21):
        clock.advance(2.0)  # a trial every 2 s
        say.track("Part B: trials", k, 20)
        say.beat()
    lines = lines_of(out)
    assert lines[0] == "[ 0:08] Part B: trials: 3/20, about 0:34 left, 4 s so far"
    assert all(b - a <= 10 for a, b in zip(_times(lines), _times(lines)[1:]))
    assert len(lines) == 5  # every 8 s over the stage's 38 s, not a line a count


def test_tracked_stages_on_a_terminal_are_bars_and_the_lines_fall_silent():
    class Bars:
        enabled = True

        def __init__(self):
            self.calls, self.closed = [], 0

        def __call__(self, stage, done, total):
            self.calls.append((stage, done, total))

        def close(self):
            self.closed += 1

    clock, out = FakeClock(), io.StringIO()
    lines = ProgressLines(out, clock=clock, thread=False, heartbeat_s=8.0)
    lines.quietly("starting: torch and the device")
    bars = Bars()
    stages = TrackedStages(lines, bars)
    stages("Part A: profiling 2 training steps", 0, 1)
    for _ in range(30):
        clock.advance(1.0)
        lines.beat()
    stages.close()
    assert bars.calls == [("Part A: profiling 2 training steps", 0, 1)] and bars.closed == 1
    assert lines_of(out) == []  # the bar speaks; no heartbeat line breaks it
    bars.enabled = False
    stages = TrackedStages(lines, bars)
    stages("Part B: trials", 2, 3)
    clock.advance(9.0)
    lines.beat()
    assert lines_of(out) == ["[ 0:39] Part B: trials: 2/3, 9 s so far"]


@pytest.fixture
def in_a_log(monkeypatch):
    """The CLI's progress as in a log (no terminal's bars, whatever pytest's stderr is), with
    what goes to the ProgressLines recorded: ("quietly" | "track", stage)."""
    from profuse.cli import common, parts, results

    seen = []

    class Recording(ProgressLines):
        def __init__(self):
            super().__init__(io.StringIO(), thread=False)

        def quietly(self, stage):
            seen.append(("quietly", stage))
            super().quietly(stage)

        def track(self, stage, done, total):
            seen.append(("track", stage))
            super().track(stage, done, total)

    class NoTerminal(common.Progress):
        def __init__(self):
            super().__init__(enabled=False)

    for module in (parts, results):
        monkeypatch.setattr(module, "ProgressLines", Recording)
    monkeypatch.setattr(common, "Progress", NoTerminal)  # TrackedStages' own default
    monkeypatch.setattr(results, "Progress", NoTerminal)
    return seen


def test_the_main_job_tracks_parts_a_and_b_from_its_start(in_a_log, tmp_path):
    """`profuse` in a log: one ProgressLines from before torch is imported, Part A's and Part
    B's stages tracked by it, named as theirs."""
    from profuse.cli import parts

    argv = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64", "--seq-len", "16",
            "--batch-size", "2", "--profile-steps", "1", "--rows", "8", "--cols", "16", "--trials", "2",
            "--variants", "eager,rms_norm", "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    assert parts.cmd_main(argv) == 0
    assert in_a_log[0] == ("quietly", "starting: torch and the device")
    stages = [stage for how, stage in in_a_log if how == "track"]
    assert stages and {s.split(":")[0] for s in stages} == {"Part A", "Part B"}
    first_b = next(i for i, s in enumerate(stages) if s.startswith("Part B"))
    assert all(s.startswith("Part A") for s in stages[:first_b])
    assert all(s.startswith("Part B") for s in stages[first_b:])


def test_a_sweep_in_a_log_is_tracked_from_its_start(in_a_log, tmp_path):
    from cases import TINY_SWEEP

    from profuse.cli import main

    assert main(["sweep", *TINY_SWEEP, "--out", str(tmp_path)]) == 0
    assert in_a_log[0] == ("quietly", "starting: torch and the device")
    stages = [stage for how, stage in in_a_log if how == "track"]
    assert any(s.startswith("size 2/2") for s in stages)


def test_the_prefix_names_the_precision_and_the_thread_stops_on_close():
    out = io.StringIO()
    say = ProgressLines(out, heartbeat_s=60.0)  # a real thread, which says nothing in this test
    say.prefix = "bf16: "
    say("first step: eager", 0, 2)
    say.close()
    assert lines_of(out)[0].endswith("] bf16: first step: eager") and say._thread is None


def test_tagged_file_names():
    assert tagged("trace.json", "bf16") == "trace-bf16.json" and tagged("trace.json", "") == "trace.json"


# --------------------------------------------------------------------------------------------
# The first step, split
# --------------------------------------------------------------------------------------------


class FakeTuner:
    """Autotuner's shape: `chosen` keys, and `pick` that tunes a new key for 2 s of fake time."""

    def __init__(self, clock: FakeClock):
        self.chosen: dict = {}
        self.clock = clock
        self.build_s = 10.0  # from before the step

    def pick(self, key, candidates, launch, device):
        if key not in self.chosen:
            self.clock.advance(2.0)  # compiling and timing every candidate
            self.build_s += 1.5  # of which building them
            self.chosen[key] = candidates[0]
        return self.chosen[key]


def test_the_tuner_is_watched_for_one_step_and_left_as_it_was():
    clock = FakeClock()
    tuner = FakeTuner(clock)
    with C.split_compile(clock=clock, tuner=tuner) as split:
        tuner.pick(("add_rms_norm", 8192), ["a", "b", "c"], None, None)
        tuner.pick(("add_rms_norm", 8192), ["a", "b", "c"], None, None)  # a lookup now
        tuner.pick(("silu_mul", 8192), ["a", "b"], None, None)
        clock.advance(1.0)  # the rest of the step
    [cs] = split
    assert (cs.seconds, cs.tuner_s, cs.tuner_shapes, cs.tuner_configs) == (5.0, 4.0, 2, 5)
    assert "pick" not in vars(tuner)  # the class's own pick again
    assert (
        cs.compiled_anything
        and "profuse's autotuner 4.0 s (2 new shape(s), 5 launch config(s)" in cs.summary()
    )
    assert cs.tuner_build_s == 3.0 and "launch config(s) compiled and timed, built in 3.0 s)" in cs.summary()
    with C.split_compile(clock=clock, tuner=tuner) as split:
        tuner.pick(("silu_mul", 8192), ["a", "b"], None, None)
    assert split[0].tuner_shapes == 0 and split[0].tuner_build_s == 0 and not split[0].compiled_anything


def test_first_launch_checks_in_the_step_are_counted(monkeypatch):
    """The first launches through a binding (checked against triton's JIT route) that fall in
    the step: their count and seconds, not those before it."""
    from profuse.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from profuse.kernels import autotune as A

    monkeypatch.setattr(A, "FIRST_LAUNCH_CHECKS", [7, 30.0])
    clock = FakeClock()
    with C.split_compile(clock=clock, tuner=FakeTuner(clock)) as split:
        A.FIRST_LAUNCH_CHECKS[0] += 3
        A.FIRST_LAUNCH_CHECKS[1] += 2.5
    cs = split[0]
    assert (cs.launch_checks, cs.launch_checks_s) == (3, 2.5) and cs.compiled_anything
    assert cs.summary().endswith("; 3 first launch(es) checked against triton's JIT route 2.5 s")


def test_torch_compile_phases_are_read_from_its_own_timers(monkeypatch):
    from torch._dynamo import utils

    metrics = {"_compile.compile_inner": [1.0]}
    monkeypatch.setattr(utils, "compilation_time_metrics", metrics, raising=False)
    clock = FakeClock()
    with C.split_compile(clock=clock, tuner=FakeTuner(clock)) as split:
        metrics["_compile.compile_inner"].append(3.5)  # what compiling this step added
        metrics["OutputGraph.call_user_compiler"] = [2.5]
    assert split[0].phases == {"_compile.compile_inner": 3.5, "OutputGraph.call_user_compiler": 2.5}
    assert split[0].summary().startswith("torch.compile: Dynamo (the forward's compile within) 3.5 s; ")
    metrics.clear()  # a torch whose timers have other names: the largest, by name
    with C.split_compile(clock=clock, tuner=FakeTuner(clock)) as split:
        metrics["compile_attempt_0"] = [1.5]
    assert split[0].summary().startswith("torch.compile: compile_attempt_0 1.5 s; ")


# --------------------------------------------------------------------------------------------
# Phases and the verdict, decided once
# --------------------------------------------------------------------------------------------


def test_phases_sum_each_name_on_the_clock_given():
    clock = FakeClock()
    phases = S.PhaseClock(clock)
    with phases("trials"):
        clock.advance(3.0)
    with phases("profile:eager"):
        clock.advance(1.5)
    with pytest.raises(RuntimeError), phases("trials"):  # a phase that fails still counts
        clock.advance(1.0)
        raise RuntimeError
    assert phases.seconds == {"trials": 4.0, "profile:eager": 1.5}


def test_the_budget_counts_what_a_run_will_do():
    cfg = S.StepConfig(model=TINY, device="cuda", trials=30, profile_steps=3)
    names = ["eager", "fused", "compile", "compile+fused", "cudagraphs"]
    b = S.budget(cfg, names)
    # each variant's own steps (stepstate.MEMORY_STEPS on CUDA); 30 trials balanced over 5 variants
    assert (b["compiles"], b["checks"], b["first_steps"], b["trial_rounds"], b["host_rounds"]) == (
        3,
        1,
        5 * (S.stepstate.MEMORY_STEPS + S.stepstate.STEADY_STEPS),  # and the steady-state memory steps
        30,
        30,
    )
    assert (b["steps_per_trial"], b["trial_rounds_at_most"], b["references"]) == (11, 30, 1)
    assert b["profiled_steps"] == 15 and b["profile_warmup_steps"] == 5 + 3 and b["op_timings"] == 0
    assert b["steady_profiled_steps"] == 5 * (S.UNSYNCED_STEPS + 1)  # the unsynchronised ones, for the bound
    assert S.budget(S.StepConfig(model=TINY, profile_steps=0), ["eager"])["builds"] == 1


def test_the_run_uses_the_clock_it_is_given(tmp_path):
    ticks = iter(range(10_000))
    cfg = S.StepConfig(model=TINY, variants=("eager",), trials=2, profile_steps=0, out_dir=tmp_path)
    res = S.run_step(cfg, clock=lambda: float(next(ticks)))
    assert all(float(v).is_integer() and v >= 1 for v in res.phases.values())  # counted in ticks


def _data(results: dict, *, device="cpu", profile=None) -> dict:
    """A saved run: each variant's paired trials at 0.1 s / its speedup (the same small wobble
    in every variant's, as a shared drift), and its speedup over eager as given."""
    wobble = [1 + 0.001 * ((i * 7) % 5 - 2) for i in range(12)]
    timings = {
        n: {"times_s": [0.1 / (s["median"] if s else 1.0) * w for w in wobble]} for n, s in results.items()
    }
    return {
        "comparison": {"baseline": "eager", "seed": 0, "timings": timings},
        "config": {"device": device},
        "results": {
            n: {"median_s": 0.1, "host_s": None, "host_bound": False, "speedup": sp}
            for n, sp in results.items()
        },
        "profiles": {"eager": profile} if profile else {},
    }


def sp(median, low, high):
    return {"median": median, "low": low, "high": high}


def test_the_verdict_names_a_winner_or_a_tie_and_the_bound():
    """The winner and its tie set are tie_verdict's over the saved trials; faster, level and
    slower each variant's CI over eager; the bound bench.stats.bound's."""
    v = decide(_data({"eager": None, "fused": sp(1.2, 1.1, 1.3), "compile": sp(1.3, 1.25, 1.35)}))
    assert (v.winner, v.faster, v.level, v.slower, v.tied_with) == (
        "compile",
        ["compile", "fused"],
        [],
        [],
        [],
    )
    assert v.text.startswith("compile wins; next: fused, 8.3% slower")
    assert (v.bound, v.bound_why) == ("host-bound", "on a CPU the whole step is host time")
    v = decide(_data({"eager": None, "fused": sp(0.9, 0.85, 0.95)}))
    assert v.winner == "eager" and v.tied_with == [] and v.slower == ["fused"]
    v = decide(_data({"eager": None, "fused": sp(1.0, 0.95, 1.05), "compile": sp(0.8, 0.7, 0.9)}))
    assert (v.winner, v.tied_with, v.level, v.slower) == ("eager", ["fused"], ["fused"], ["compile"])
    assert v.text.startswith("eager and fused tie (within 0%)")
    busy = {
        "launch_bound": False,
        "gpu_idle_pct": 4.3,
        "basis": "GPU kernel time",
        "time_per_step_us": 186_616,
    }
    v = decide(_data({"eager": None, "fused": sp(1.2, 1.1, 1.3)}, device="cuda:0", profile=busy))
    assert (
        v.bound == "device-bound"
        and v.bound_why == SYNCED_SOURCE + "the GPU idles 4.3% of the step: the CPU keeps ahead of it"
    )
    assert v.bounds == {"eager": "device-bound", "fused": ""}  # fused: no profile, no host time to say
    assert decide({"comparison": None}) is None


# --------------------------------------------------------------------------------------------
# amdahl is a tool of step, never the reverse
# --------------------------------------------------------------------------------------------


def test_amdahl_does_not_import_step_even_for_types():
    import profuse.amdahl

    tree = ast.parse(Path(profuse.amdahl.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "profuse.step" not in imported


def test_the_report_names_each_check_and_first_step_split_and_reads_older_files():
    from profuse.report.step import time_lines

    check = C.CompileSplit(seconds=21.0, tuner_s=12.0, tuner_shapes=8, tuner_configs=58, tuner_build_s=11.0)
    first = C.CompileSplit(seconds=11.2, tuner_s=3.7, tuner_shapes=9, tuner_configs=72, launch_checks=14,
                           launch_checks_s=4.2)  # fmt: skip
    older = {
        "seconds": 36.6,
        "phases": {"_compile.compile_inner": 23.7},
        "counts": {},
        "tuner_s": 0.0,
        "tuner_shapes": 0,
        "tuner_configs": 0,
    }  # fmt: skip  (a file from before the build split)
    data = {
        "phases": {"check": 26.3, "first:fused": 13.9, "first:compile": 38.5, "total": 325.0},
        "compile": {"check:fused": check.to_dict(), "fused": first.to_dict(), "compile": older},
    }
    lines = time_lines(data)
    assert lines[0].startswith("run time: check 26.3 s, first steps 52.4 s")
    assert lines[1] == (
        "    same-math check of fused: 21.0 s; profuse's autotuner 12.0 s (8 new shape(s), 58 launch "
        "config(s) compiled and timed, built in 11.0 s)"
    )
    assert lines[2].startswith("    first step of fused: 11.2 s; profuse's autotuner 3.7 s")
    assert lines[2].endswith("; 14 first launch(es) checked against triton's JIT route 4.2 s")
    assert lines[3].startswith("    first step of compile: 36.6 s; torch.compile: Dynamo")
