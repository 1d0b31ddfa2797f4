"""Timing any callables against each other, the way single timings cannot lie.

- Warm-up first: the first call (where torch.compile compiles and Triton builds and tunes its
  kernels) is timed apart and reported as `first_call_s`. Then warm-up calls, until the variant is
  steady: at least `warmup` of them, and on until its last STEADY_CALLS calls agree (the slowest
  within STEADY_RATIO x the fastest) or its `warmup_budget_s` runs out. One call is not steady
  state: compile's next calls on a CPU took 24-28 ms against 57 us later, and 3 trials taken
  after one warm-up call read "145x slower". The count, and whether it settled, is recorded
  per variant (VariantTiming.warmup_calls, warmup_steady).
- Host time per call (CUDA): rounds of every variant once, in shuffled orders, the wall time of
  each call (it returns once its work is queued: the CPU's cost to issue it). A call whose host
  time exceeds its device time is host-bound: a loop that cannot run ahead pays the host's.
- Then the trials, timed by the mode's timer (profuse/timers.py): `device` (CUDA events, the CPU
  kept ahead, the L2 flushed before each call), `loop` (back to back from an idle queue, as
  do_bench and a CPU-bound loop), `graph` (CUDA-graph replay). On CPU, time.perf_counter.
- Trials interleave the variants, in an order shuffled per trial with a seed, so drift (clocks,
  temperature, other work on the machine) falls on all variants alike.
- Speedups: the ratio of medians over the baseline, with a paired bootstrap CI (bench/stats.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from profuse.bench.stats import (
    STATISTIC,
    UNSTEADY_RATIO,
    Speedup,
    Steadiness,
    speedup_ci,
    steadiness,
    unsteady_warning,
)
from profuse.env import resolve_device
from profuse.timers import GraphError, GraphTimer, host_times, make_timer

# Loop timing counts the host's time in: a call whose loop time is within this factor of its
# host time is bound by the host (the GPU waited for it).
LOOP_HOST_MARGIN = 1.1

# Warm-up runs until the last STEADY_CALLS calls agree within STEADY_RATIO (slowest / fastest),
# the same factor that marks a trial as disturbed (stats.UNSTEADY_RATIO), or until the budget
# (seconds of warm-up calls per variant, the first call not counted) runs out. Five calls: three
# slow calls in a row (a compile's follow-up builds) would read as steady.
STEADY_CALLS = 5
STEADY_RATIO = UNSTEADY_RATIO
WARMUP_BUDGET_S = 5.0


@dataclass
class VariantTiming:
    name: str
    times_s: list[float]  # one per trial, in trial order
    first_call_s: float  # the first call alone: compilation, autotuning, kernel builds
    host_times_s: list[float] = field(default_factory=list)  # CUDA: CPU time to issue one call, per round
    warmup_calls: int = 0  # untimed calls after the first, until steady or out of budget
    warmup_steady: bool = True  # False: the warm-up budget ran out before its calls agreed

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))

    @property
    def steadiness(self) -> Steadiness | None:
        """How far the trials wandered from the fastest (stats.steadiness)."""
        return steadiness(self.times_s)

    @property
    def host_s(self) -> float | None:
        return float(np.median(self.host_times_s)) if self.host_times_s else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "median_s": self.median_s,
            "host_s": self.host_s,
            "first_call_s": self.first_call_s,
            "times_s": list(self.times_s),
            "host_times_s": list(self.host_times_s),
            "warmup_calls": self.warmup_calls,
            "warmup_steady": self.warmup_steady,
            "steadiness": self.steadiness.to_dict() if self.times_s else None,
        }


def host_bound(host_s: float | None, time_s: float, timing: str) -> bool:
    """Does the host's time to issue a call bound it? Device and graph times leave the host out,
    so the host bounds where it is the larger; a loop time holds it, so there the host bounds
    where the loop time is no more than LOOP_HOST_MARGIN over it."""
    if host_s is None:
        return False
    return host_s * (LOOP_HOST_MARGIN if timing == "loop" else 1.0) >= time_s


@dataclass
class Comparison:
    """What `compare` measured. `speedups[name]` is baseline time / variant time with its CI.

    Read `unsteady` (variants whose trials swung: their medians are not to be trusted) and
    `warnings` (the same lines every report prints) before trusting a median or a speedup."""

    baseline: str
    device: str
    trials: int
    warmup: int
    flush_l2: bool
    seed: int
    timings: dict[str, VariantTiming]
    speedups: dict[str, Speedup]
    orders: list[list[str]] = field(default_factory=list)  # the shuffled order of each trial
    statistic: str = STATISTIC
    timer: str = ""
    timing: str = "device"  # the mode: device, loop or graph (profuse/timers.py)
    not_timed: dict[str, str] = field(default_factory=dict)  # variant -> why (graph capture failed)
    warmup_budget_s: float = WARMUP_BUDGET_S

    def median_s(self, name: str) -> float:
        return self.timings[name].median_s

    @property
    def unsteady(self) -> dict[str, Steadiness]:
        """The variants whose trials were unsteady (stats.UNSTEADY_RATIO, UNSTEADY_SHARE): their
        medians, and the speedups made from them, are not to be trusted. Empty when all were steady."""
        out = {n: t.steadiness for n, t in self.timings.items() if t.times_s}
        return {n: s for n, s in out.items() if s.unsteady}

    @property
    def warnings(self) -> list[str]:
        """What makes these numbers less than they look, in the words every report uses: unsteady
        trials (stats.unsteady_warning) and warm-ups that ran out of budget."""
        out = []
        if self.unsteady:
            counts = {n: t.steadiness for n, t in self.timings.items() if t.times_s}
            out.append(unsteady_warning(counts))
        out += [
            warmup_warning(n, t.warmup_calls, self.warmup_budget_s)
            for n, t in self.timings.items()
            if not t.warmup_steady
        ]
        return out

    def host_bound(self, name: str) -> bool:
        t = self.timings[name]
        return host_bound(t.host_s, t.median_s, self.timing)

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline,
            "device": self.device,
            "trials": self.trials,
            "warmup": self.warmup,
            "flush_l2": self.flush_l2,
            "seed": self.seed,
            "timer": self.timer,
            "timing": self.timing,
            "statistic": self.statistic,
            "timings": {k: v.to_dict() for k, v in self.timings.items()},
            "speedups": {k: v.to_dict() for k, v in self.speedups.items()},
            "orders": self.orders,
            "not_timed": self.not_timed,
            "warmup_budget_s": self.warmup_budget_s,
            "steady_rule": {"calls": STEADY_CALLS, "ratio": STEADY_RATIO},
        }


def warmup_warning(name: str, calls: int, budget_s: float) -> str:
    """The note on a variant whose warm-up ran out of budget before its calls agreed."""
    return (
        f"WARNING {name}: warm-up stopped at its {budget_s:g} s budget after {calls} calls, before its "
        f"last {STEADY_CALLS} agreed within {STEADY_RATIO}x; its trials may still be warming up"
    )


def warmed_up(times_s: list[float]) -> bool:
    """Do the last STEADY_CALLS warm-up calls agree (slowest <= STEADY_RATIO x fastest)?"""
    recent = times_s[-STEADY_CALLS:]
    return len(recent) == STEADY_CALLS and max(recent) <= STEADY_RATIO * min(recent)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(
    fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, object]:
    """(seconds, result) of one call, wall clock, synchronised: for a first call, everything it
    had to build first (compilation, autotuning, kernel builds) is in the seconds."""
    _sync(device)
    t0 = clock()
    out = fn()
    _sync(device)
    return clock() - t0, out


def compare(
    variants: Mapping[str, Callable[[], object]],
    baseline: str,
    trials: int = 30,
    device: str | torch.device | None = "auto",
    *,
    warmup: int = 3,
    flush_l2: bool = True,
    seed: int = 0,
    confidence: float = 0.95,
    n_resamples: int = 5000,
    progress: Callable[[str, int, int], None] | None = None,
    timing: str = "device",
    timer=None,
    first_calls: Mapping[str, float] | None = None,
    host_rounds: bool | None = None,
    warmup_budget_s: float = WARMUP_BUDGET_S,
) -> Comparison:
    """Time `variants` (name -> zero-argument callable) against `baseline` in interleaved trials.

    `device` is where the callables run ('auto': cuda if there is a GPU); with `timing` it picks
    the timer (profuse.timers.make_timer), unless `timer` is given. With graph timing, a variant
    that cannot be captured is left out and named in `not_timed` (the baseline must capture).
    `progress(stage, done, total)` is called as work advances ("warm-up", "host time", "trials").
    `first_calls` gives first-call times measured elsewhere (e.g. while checking correctness),
    for variants that were already called once. `host_rounds` (default: on CUDA) measures each
    call's host time in `trials` interleaved rounds; on a CPU a call's time is all host time.
    `warmup` is the least number of warm-up calls; each variant warms on until its last
    STEADY_CALLS calls agree or `warmup_budget_s` seconds of them have passed (the timer's clock
    where it has one, else time.perf_counter, so a fake clock drives the warm-up as well).
    Returns a `Comparison`; `speedups` holds every timed variant but the baseline.
    """
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    if trials < 2:
        raise ValueError(f"trials must be at least 2 for a confidence interval, got {trials}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if not warmup_budget_s >= 0:
        raise ValueError(f"warmup_budget_s must be 0 or more, got {warmup_budget_s}")
    dev = resolve_device(device)
    if timer is None:
        timer = make_timer(timing, dev, flush_l2)
    timing = getattr(timer, "timing", timing)
    first: dict[str, float] = dict(first_calls or {})
    clock = getattr(timer, "clock", time.perf_counter)
    warm = _WarmUp(warmup, warmup_budget_s, clock)
    calls, not_timed = _warm_up(variants, baseline, dev, warm, timer, first, progress)
    names = list(calls)
    host: dict[str, list[float]] = {n: [] for n in names}
    if dev.type == "cuda" if host_rounds is None else host_rounds:
        # The calls as a loop makes them (not the graph replays).
        host = _host_rounds({n: variants[n] for n in names}, dev, trials, seed + 1, clock, progress)
    times, orders = _trial_rounds(calls, timer, trials, seed, progress)
    timings = {
        n: VariantTiming(n, times[n], first[n], host[n], len(warm.times[n]), warm.steady[n]) for n in names
    }
    speedups = {
        n: speedup_ci(times[baseline], times[n], confidence, n_resamples, seed)
        for n in names
        if n != baseline
    }
    return Comparison(
        baseline=baseline,
        device=str(dev),
        trials=trials,
        warmup=warmup,
        flush_l2=flush_l2 and dev.type == "cuda",
        seed=seed,
        timings=timings,
        speedups=speedups,
        orders=orders,
        timer=timer.name,
        timing=timing,
        not_timed=not_timed,
        warmup_budget_s=warmup_budget_s,
    )


@dataclass
class _WarmUp:
    """The warm-up rule and what it saw: each variant's warm-up call times, and whether it settled."""

    least: int  # warm-up calls at the least (compare's `warmup`)
    budget_s: float
    clock: Callable[[], float]
    times: dict[str, list[float]] = field(default_factory=dict)
    steady: dict[str, bool] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], object], dev: torch.device) -> None:
        """Call `fn` (synchronised, timed by the clock) until steady or out of budget."""
        times: list[float] = []
        spent = 0.0
        while True:
            if len(times) >= self.least:
                if warmed_up(times):
                    steady = True
                    break
                if spent >= self.budget_s:
                    steady = False  # out of time before its last calls agreed
                    break
            t = timed_call(fn, dev, self.clock)[0]
            times.append(t)
            spent += t
        self.times[name], self.steady[name] = times, steady


def _warm_up(variants, baseline, dev, warm, timer, first, progress) -> tuple[dict, dict[str, str]]:
    """Each variant's first call (timed into `first` unless given there), its warm-up calls, and
    with graph timing its capture. Returns (the calls to time by name, {variant: why not timed});
    a baseline that cannot be captured raises."""
    calls: dict[str, Callable[[], object]] = {}
    not_timed: dict[str, str] = {}
    for i, name in enumerate(variants):
        if name not in first:
            first[name] = timed_call(variants[name], dev, warm.clock)[0]
        warm.run(name, variants[name], dev)
        calls[name] = variants[name]
        if isinstance(timer, GraphTimer):
            try:
                calls[name] = timer.capture(variants[name])
            except GraphError as err:
                if name == baseline:
                    raise
                not_timed[name] = str(err)
                del calls[name]
        if progress:
            progress("warm-up", i + 1, len(variants))
    return calls, not_timed


def _host_rounds(calls, dev, rounds, seed, clock, progress) -> dict[str, list[float]]:
    """Host time per call of each variant, in `rounds` rounds each in its own shuffled order."""
    rng = random.Random(seed)
    names = list(calls)
    host: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name, sec in zip(order, host_times([calls[n] for n in order], dev, clock)):
            host[name].append(sec)
        if progress:
            progress("host time", r + 1, rounds)
    return host


def _trial_rounds(calls, timer, trials, seed, progress) -> tuple[dict[str, list[float]], list[list[str]]]:
    """The timed trials: every variant once per trial, in an order shuffled per trial.
    Returns (seconds per trial by variant, the orders)."""
    rng = random.Random(seed)
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for t in range(trials):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name, sec in zip(order, timer.time_calls([calls[n] for n in order])):
            times[name].append(sec)
        if progress:
            progress("trials", t + 1, trials)
    return times, orders
