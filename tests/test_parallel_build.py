"""A new tuning key's candidates built at once (kernels/autotune: dry_run, build_at_once,
Autotuner.precompile), with stand-in kernels: the dry run collects every launch and runs none,
the builds all happen before the first candidate runs, the pick is the one a tuner without the
builds makes, and a build that fails or a tuner asked inside a dry run changes nothing. That
triton's own AsyncCompileMode compiles real kernels in threads, and that the launches then find
them, is research/parallel_build_check.py's (the last test runs its quick form)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402

CUDA = torch.device("cuda")
CONFIGS = [KernelConfig("fused", bm, 1024, 4) for bm in (1, 2, 4, 8)]
ROOT = Path(__file__).resolve().parents[1]


class StandInKernel:
    """What Launch and build_at_once ask of a JITFunction: `kernel[grid](*args, **meta)` runs
    (recorded in `events`), `warmup(*args, grid=..., **meta)` builds (recorded, and may fail)."""

    def __init__(self, name: str, events: list, fail_build: bool = False):
        self.name, self.events, self.fail_build = name, events, fail_build

    def __getitem__(self, grid):
        return lambda *args, **meta: self.events.append(("run", self.name, grid, args, meta))

    def warmup(self, *args, grid, **meta):
        self.events.append(("build", self.name, grid, args, meta, Mode.active))
        if self.fail_build:
            raise RuntimeError("out of resource: a stand-in's failed compile")


class Mode:
    """triton.AsyncCompileMode's stand-in: records the executor it got and while it is active."""

    active = False
    executors: list = []

    def __init__(self, executor, *, ignore_errors=False):
        Mode.executors.append((executor, ignore_errors))

    def __enter__(self):
        Mode.active = True
        return self

    def __exit__(self, *exc):
        Mode.active = False


class RankedTimer:
    """Each candidate 'takes' its place in `order` (the first fastest), read off the launch it
    ran; a call that ran nothing takes no time, as a device timer would see it."""

    def __init__(self, events: list, order: list[str]):
        self.events, self.order = events, order

    def time_calls(self, calls):
        out = []
        for call in calls:
            n = len(self.events)
            call()
            ran = [e[1] for e in self.events[n:] if e[0] == "run"]
            out.append(float(self.order.index(ran[0])) if ran else 0.0)
        return out


@pytest.fixture
def building(monkeypatch):
    """Autotuning on as on a GPU, kernels compiled (not interpreted), the stand-in mode, three
    threads; returns the event list the stand-in kernels record into."""
    monkeypatch.setattr(A, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(A, "capturing", lambda device: False)
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_ASYNC_COMPILE", Mode)
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "3")
    Mode.executors = []
    return []


def launcher(events: list, fail_build: str | None = None):
    """launch(cfg): a kernel per config (its name the config's rows), then a shared column sum,
    on a fresh output each call, as profuse's plans launch."""
    kernels = {c: StandInKernel(f"k{c.block_m}", events, fail_build == f"k{c.block_m}") for c in CONFIGS}
    col_sum = StandInKernel("col_sum", events)

    def launch(cfg):
        out = torch.empty(6, 8)
        meta = dict(BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)
        A.Launch(kernels[cfg], (3,), cfg, "stand-in", **meta)(out, 6, 1.5)
        A.Launch(col_sum, (1,), None, "col_sum", BLOCK=8)(out, 6)

    return launch


def test_a_dry_run_collects_every_launch_and_runs_none():
    events: list = []
    k = StandInKernel("k", events)
    t = torch.empty(4, 5, dtype=torch.bfloat16)

    def one():
        A.Launch(k, (2, 1), None, "k", BLOCK_M=4, num_warps=8)(t, 7, 0.5, None)

    def raises_after_a_launch():
        A.Launch(k, (1,), None, "k", BLOCK_M=1)(t, 3)
        raise RuntimeError("out of resource")

    jobs = A.dry_run([one, raises_after_a_launch, one])
    assert events == []  # nothing ran, nothing built
    assert jobs == [
        (k, (2, 1), (torch.bfloat16, 7, 0.5, None), {"BLOCK_M": 4, "num_warps": 8}),
        (k, (1,), (torch.bfloat16, 3), {"BLOCK_M": 1}),
        (k, (2, 1), (torch.bfloat16, 7, 0.5, None), {"BLOCK_M": 4, "num_warps": 8}),
    ]
    assert A._DETOUR is None and A._TRACING is False
    A.Launch(k, (1,), None, "k")(t, 1)  # after it, a launch runs again
    assert [e[0] for e in events] == ["run"]


def test_every_candidate_is_built_at_once_before_any_runs(building):
    events = building
    order = ["k4", "k1", "k8", "k2"]
    tuner = A.Autotuner(make_timer=lambda d: RankedTimer(events, order), trials=3)
    key = ("fwd", 8, 1024, torch.bfloat16)
    assert tuner.pick(key, CONFIGS, launcher(events), CUDA) == CONFIGS[2]  # k4: ranked first
    first_run = next(i for i, e in enumerate(events) if e[0] == "run")
    builds = events[:first_run]
    assert all(e[0] == "build" and e[5] for e in builds)  # all inside the mode
    assert {e[1] for e in builds} == {"k1", "k2", "k4", "k8", "col_sum"}
    assert [e[3] for e in builds if e[1] == "k2"] == [(torch.float32, 6, 1.5)]  # placeholders
    assert not any(e[0] == "build" for e in events[first_run:])
    assert len(Mode.executors) == 1 and Mode.executors[0][0]._max_workers == 3
    assert Mode.executors[0][1] is True  # a failed build is ignored there


def test_the_pick_is_the_one_made_one_at_a_time(building, monkeypatch):
    """The builds change what runs first, never what is chosen or what is timed."""
    order = ["k2", "k8", "k1", "k4"]
    picks = {}
    for threads in ("1", "3"):
        monkeypatch.setenv(A.COMPILE_THREADS_ENV, threads)
        events: list = []
        tuner = A.Autotuner(make_timer=lambda d, ev=events: RankedTimer(ev, order), trials=2)
        picks[threads] = tuner.pick(("bwd", 16), CONFIGS, launcher(events), CUDA)
        picks[threads, "runs"] = [e[1] for e in events if e[0] == "run"]
        picks[threads, "builds"] = sum(e[0] == "build" for e in events)
    assert picks["1"] == picks["3"] == CONFIGS[1]
    assert picks["1", "runs"] == picks["3", "runs"]
    assert picks["1", "builds"] == 0 and picks["3", "builds"] == 2 * len(CONFIGS)


def test_a_failed_build_is_left_to_its_launch(building):
    """A candidate whose build fails is built (and fails) again where it launches, and is
    skipped there as before; the others are still built at once."""
    events = building
    real = launcher(events, fail_build="k2")

    def launch(cfg):
        if cfg.block_m == 2 and not A._DETOUR:
            raise RuntimeError("out of resource: shared memory")
        real(cfg)

    tuner = A.Autotuner(make_timer=lambda d: RankedTimer(events, ["k2", "k1", "k4", "k8"]), trials=2)
    assert tuner.pick(("fwd", 4), CONFIGS, launch, CUDA) == CONFIGS[0]
    assert {e[1] for e in events if e[0] == "build"} == {"k1", "k2", "k4", "k8", "col_sum"}
    assert "k2" not in {e[1] for e in events if e[0] == "run"}


def test_a_tuner_asked_inside_a_dry_run_tunes_later_not_then(building):
    """A candidate whose launch needs another key tuned: the dry run stops that candidate there
    (no choice is made from launches that never ran) and the real run tunes the inner key."""
    events = building
    order = ["k8", "k4", "k2", "k1", "col_sum"]
    tuner = A.Autotuner(make_timer=lambda d: RankedTimer(events, order), trials=2)
    inner = launcher(events)
    seen = []

    def outer(cfg):
        seen.append((A._DETOUR is not None, ("inner", 8) in tuner.chosen))
        tuner.pick(("inner", 8), CONFIGS, inner, CUDA)
        inner(cfg)

    assert tuner.pick(("outer", 8), CONFIGS, outer, CUDA) == CONFIGS[3]
    assert tuner.chosen[("inner", 8)] == CONFIGS[3]
    assert seen[0] == (True, False)  # the dry run reached the inner pick first, and left it
    assert all(not dry for dry, _ in seen[len(CONFIGS) :])


def test_compile_threads(monkeypatch):
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_ASYNC_COMPILE", Mode)
    monkeypatch.delenv(A.COMPILE_THREADS_ENV, raising=False)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert A.compile_threads() == max(1, min(cpus, A.MAX_COMPILE_THREADS))
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "1")
    assert A.compile_threads() == 1
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "0")
    assert A.compile_threads() == 1
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "40")
    assert A.compile_threads() == 40
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="PROFUSE_COMPILE_THREADS='many' is not a whole number"):
        A.compile_threads()
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "4")
    monkeypatch.setattr(A, "interpreting", lambda: True)
    assert A.compile_threads() == 1  # the interpreter compiles nothing
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_ASYNC_COMPILE", None)
    assert A.compile_threads() == 1  # triton before 3.6


def test_only_a_mode_that_can_drop_a_failed_compile_is_used():
    """triton 3.5's AsyncCompileMode raises a failed compile when it waits and stays active for
    every later compile: only one that takes ignore_errors (3.6 and later) is used."""

    class Older:
        def __init__(self, executor):
            pass

    assert A.async_compile_mode(Mode) is Mode
    assert A.async_compile_mode(Older) is None


def test_a_mode_whose_wait_raised_is_not_left_active(building, monkeypatch):
    """Should triton's mode exit by raising, it is no longer the active one after the builds,
    and a mode that was active before is left so."""
    active = pytest.importorskip("triton.runtime._async_compile").active_mode

    class Raising(Mode):
        def __enter__(self):
            active.set(self)
            return self

        def __exit__(self, *exc):
            raise RuntimeError("a compile failed")

    monkeypatch.setattr(A, "_ASYNC_COMPILE", Raising)
    events = building
    launch = launcher(events)
    jobs = A.dry_run([functools.partial(launch, c) for c in CONFIGS])
    A.build_at_once(jobs, 3)
    assert active.get() is None
    assert len([e for e in events if e[0] == "build"]) == len(jobs)


def test_one_thread_builds_nothing_ahead(building, monkeypatch):
    monkeypatch.setenv(A.COMPILE_THREADS_ENV, "1")
    events = building
    tuner = A.Autotuner(make_timer=lambda d: RankedTimer(events, ["k1", "k2", "k4", "k8"]), trials=1)
    assert tuner.precompile(CONFIGS, launcher(events)) == 0
    assert events == [] and Mode.executors == []


def test_with_triton_real_kernels_are_built_in_threads_and_found_by_their_launches():
    """research/parallel_build_check.py --quick: add_rms_norm's candidates compiled by triton for
    an sm_90 target through the stand-in driver, in threads; its launches compile nothing."""
    import triton

    if A.async_compile_mode() is None:
        pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode profuse uses")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "research" / "parallel_build_check.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: add_rms_norm") and "0 compiled on a launch" in proc.stdout
