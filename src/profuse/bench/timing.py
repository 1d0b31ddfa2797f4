"""Timing any callables against each other, the way single timings cannot lie.

- Warm-up first: the first call (where torch.compile compiles and Triton builds its kernels) is
  timed apart and reported as `first_call_s`; more warm-up calls follow, untimed.
- On CUDA each call is timed with CUDA events; before it, a buffer larger than the L2 cache is
  zeroed so every call starts with a cold cache (a warm L2 overstates bandwidth). On CPU,
  time.perf_counter around the call.
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

from profuse.bench.stats import STATISTIC, Speedup, speedup_ci
from profuse.env import l2_cache_bytes, resolve_device


@dataclass
class VariantTiming:
    name: str
    times_s: list[float]  # one per trial, in trial order
    first_call_s: float  # the first call alone: compilation, autotuning, kernel builds
    dispatch_s: float | None = None  # CUDA: CPU time to issue one call (median of the warm-up)

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "median_s": self.median_s,
            "first_call_s": self.first_call_s,
            "dispatch_s": self.dispatch_s,
            "times_s": list(self.times_s),
        }


@dataclass
class Comparison:
    """What `compare` measured. `speedups[name]` is baseline time / variant time with its CI."""

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

    def median_s(self, name: str) -> float:
        return self.timings[name].median_s

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline,
            "device": self.device,
            "trials": self.trials,
            "warmup": self.warmup,
            "flush_l2": self.flush_l2,
            "seed": self.seed,
            "timer": self.timer,
            "statistic": self.statistic,
            "timings": {k: v.to_dict() for k, v in self.timings.items()},
            "speedups": {k: v.to_dict() for k, v in self.speedups.items()},
            "orders": self.orders,
        }


class CpuTimer:
    """Wall-clock time of a call; CPU ops in torch return only when they are done."""

    name = "time.perf_counter"

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def time_calls(self, fns: list[Callable[[], object]]) -> list[float]:
        out = []
        for fn in fns:
            t0 = self.clock()
            fn()
            out.append(self.clock() - t0)
        return out


class CudaTimer:
    """CUDA events around each call, with the L2 cache flushed before it unless `flush_l2=False`.

    A trial's calls are all queued behind a short GPU sleep, so the CPU's dispatch (Python,
    autograd, kernel launches) runs ahead of the GPU and the events measure device time alone,
    as in a training step where the CPU keeps ahead, and as triton.testing.do_bench measures.
    Without the sleep, the first call after each synchronisation would also count the time the
    GPU sat waiting for the CPU to launch it.
    """

    name = "cuda events"

    def __init__(self, device: torch.device, flush_l2: bool = True):
        self.device = device
        self.flush_buffer = None
        if flush_l2:
            # Twice the L2, so nothing of the last call survives the zeroing.
            nbytes = 2 * l2_cache_bytes(device)
            self.flush_buffer = torch.empty(nbytes, dtype=torch.int8, device=device)
        self._cycles_per_s = self._calibrate_sleep()
        self._lead_s = 1e-3  # the CPU's time to queue one trial, learnt from the last trial

    def _calibrate_sleep(self) -> float | None:
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        cycles = 1_000_000
        sleep(cycles)  # the first call can be slower (clocks ramping up)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sleep(cycles)
        end.record()
        torch.cuda.synchronize(self.device)
        return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)

    def time_calls(self, fns: list[Callable[[], object]]) -> list[float]:
        if self._cycles_per_s:
            # Twice the CPU time the last trial took to queue, at least 1 ms, at most 50 ms.
            lead = min(max(2 * self._lead_s, 1e-3), 50e-3)
            torch.cuda._sleep(int(lead * self._cycles_per_s))
        t0 = time.perf_counter()
        events = []
        for fn in fns:
            if self.flush_buffer is not None:
                self.flush_buffer.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        self._lead_s = time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """(seconds, result) of one call, wall clock, synchronised: for a first call, everything it
    had to build first (compilation, autotuning, kernel builds) is in the seconds."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


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
    timer: CpuTimer | CudaTimer | None = None,
    first_calls: Mapping[str, float] | None = None,
) -> Comparison:
    """Time `variants` (name -> zero-argument callable) against `baseline` in interleaved trials.

    `device` is where the callables run ('auto': cuda if there is a GPU); it picks the timer.
    `progress(stage, done, total)` is called as work advances (stage "warm-up" or "trials").
    `first_calls` gives first-call times measured elsewhere (e.g. while checking correctness),
    for variants that were already called once.
    Returns a `Comparison`; `speedups` holds every variant but the baseline.
    """
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    if trials < 2:
        raise ValueError(f"trials must be at least 2 for a confidence interval, got {trials}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    dev = resolve_device(device)
    if timer is None:
        timer = CudaTimer(dev, flush_l2) if dev.type == "cuda" else CpuTimer()
    names = list(variants)
    first: dict[str, float] = dict(first_calls or {})

    dispatch: dict[str, float | None] = {}
    for i, name in enumerate(names):
        if name not in first:
            first[name] = timed_call(variants[name], dev)[0]
        issue = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            variants[name]()
            issue.append(time.perf_counter() - t0)
        _sync(dev)
        # On CUDA a call returns once its work is queued: its wall time is the CPU's share.
        dispatch[name] = float(np.median(issue)) if issue and dev.type == "cuda" else None
        if progress:
            progress("warm-up", i + 1, len(names))

    rng = random.Random(seed)
    times: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for t in range(trials):
        order = names[:]
        rng.shuffle(order)
        orders.append(order)
        for name, sec in zip(order, timer.time_calls([variants[n] for n in order])):
            times[name].append(sec)
        if progress:
            progress("trials", t + 1, trials)

    timings = {n: VariantTiming(n, times[n], first[n], dispatch[n]) for n in names}
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
    )
