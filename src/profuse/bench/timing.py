"""Timing any callables against each other, the way single timings cannot lie.

- Warm-up first: the first call (where torch.compile compiles and Triton builds and tunes its
  kernels) is timed apart and reported as `first_call_s`. Then warm-up calls, until the variant is
  steady: at least `warmup` of them, and on until its last STEADY_CALLS calls agree (the slowest
  within STEADY_RATIO x the fastest) or its `warmup_budget_s` runs out. One call is not steady
  state: compile's next calls on a CPU took 24-28 ms against 57 us later, and 3 trials taken
  after one warm-up call read "145x slower". The count, and whether it settled, is recorded
  per variant (VariantTiming.warmup_calls, warmup_steady).
- Host time per call (CUDA): rounds of every variant once, in shuffled orders, each call issued
  while the GPU is held busy, so the CPU's time cannot include waiting for the GPU; where the
  launch queue filled all the same, a lower bound ("at least"; bench/host.py). A call whose
  host time exceeds its device time is host-bound: a loop that cannot run ahead pays the host's.
- Then the trials, timed by the mode's timer (profuse/timers.py): `device` (CUDA events, the CPU
  kept ahead, the L2 flushed before each call), `loop` (back to back from an idle queue, as
  do_bench and a CPU-bound loop), `graph` (CUDA-graph replay). On CPU, time.perf_counter.
- Trials interleave the variants, in an order shuffled per trial with a seed, so drift (clocks,
  temperature, other work on the machine) falls on all variants alike.
- Speedups: the ratio of medians over the baseline, with a paired bootstrap CI, and the median of
  per-trial ratios beside it (bench/stats.py); the verdict over all variants with its tie set.

`TrialDesign` changes how a trial is laid out; its defaults are the above (Part B's). `REFEREE`
is the design for whole training steps (Part C's referee): a trial of a variant is one clock or event pair
around K >= 10 calls after one discarded call; orders balanced for position and carry-over (a
Williams design: each variant in each position, and right after each other variant, equally
often; the trials rounded up to whole designs, n trials for n variants, 2n where n is odd);
warm-up until the last STEADY_BLOCKS blocks agree within 1% with no drift;
up to 30 trials where the two fastest are within 2%; warnings on drift through the trials and on
noise larger than a difference the verdict calls. On CUDA each trial's SM clock, power and
throttling are read (bench/clocks.py), with a warning where any trial throttled.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from profuse.bench import DEFAULT_TRIALS
from profuse.bench.clocks import ClockSample, monitor_for, throttle_warning
from profuse.bench.host import HostTime, cpu_host_times, measure_host
from profuse.bench.stats import (
    STATISTIC,
    TIE_BAND,
    UNSTEADY_RATIO,
    Speedup,
    Steadiness,
    Trend,
    Verdict,
    noise,
    speedup_ci,
    steadiness,
    tie_verdict,
    trend,
    trend_warning,
    unsteady_warning,
)
from profuse.env import resolve_device
from profuse.timers import GraphError, GraphTimer, HeldIssue, host_times, make_timer

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

# Warm-up by blocks (TrialDesign.steady_spread): steady once the last STEADY_BLOCKS blocks spread
# no more than steady_spread (slowest - fastest, over their median) and the median of their second
# half is within steady_spread / 2 of their first half's (no drift). Six: three a half.
STEADY_BLOCKS = 6


@dataclass(frozen=True)
class TrialDesign:
    """How the trials are laid out. The defaults are Part B's: one call a trial, an order shuffled
    per trial, warm-up until STEADY_CALLS calls agree within STEADY_RATIO."""

    calls: int = 1  # K: calls timed back to back in one trial, one clock or event pair around them
    discard: int = 0  # untimed calls before each timed block (the queue filled as a loop's is)
    balanced: bool = False  # each variant in each position equally often (trials rounded up)
    steady_spread: float | None = None  # warm-up by blocks until they agree within this; None: calls
    warmup_block: int | None = None  # calls in a warm-up block (None: `calls`), after `discard`
    max_trials: int = 0  # more trials, up to this, where the two fastest are within `close`
    close: float = 0.02
    band: float = TIE_BAND  # the verdict's equivalence band (stats.tie_verdict)
    host_rounds: int | None = None  # rounds of host time (None: one a trial)
    checks: bool = False  # drift and noise warnings in Comparison.warnings

    def __post_init__(self):
        if self.calls < 1:
            raise ValueError(f"calls must be at least 1, got {self.calls}")
        if self.discard < 0:
            raise ValueError(f"discard must be 0 or more, got {self.discard}")
        if self.steady_spread is not None and not 0 < self.steady_spread < 1:
            raise ValueError(f"steady_spread must be in (0, 1), got {self.steady_spread}")
        if self.max_trials < 0 or not 0 <= self.close < 1:
            raise ValueError("max_trials must be 0 or more and close in [0, 1)")
        if self.host_rounds is not None and self.host_rounds < 1:
            raise ValueError(f"host_rounds must be at least 1, got {self.host_rounds}")
        if self.warmup_block is not None and self.warmup_block < 1:
            raise ValueError(f"warmup_block must be at least 1, got {self.warmup_block}")

    @property
    def blocks(self) -> bool:
        return self.calls > 1 or self.discard > 0

    @property
    def warmup_design(self) -> TrialDesign:
        """The design of a warm-up block: `warmup_block` calls after the same discard."""
        return replace(self, calls=self.warmup_block or self.calls)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict | None) -> TrialDesign | None:
        """The design to_dict saved; None where a run saved none (older files). Unknown keys are
        dropped, missing ones take their defaults."""
        if not saved:
            return None
        fields = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in saved.items() if k in fields})


# Whole training steps, as Part C's referee times them: K = 10 steps a trial after one
# discarded (so a trial starts with the queue as full as a training loop keeps it, and one event
# pair's overhead is a tenth of a step's), balanced orders, warm-up to 1% in blocks of 3 steps
# after one discarded (6 blocks at the least: 24 steps, 4 s of a 166 ms step, where blocks of 10
# would take 11 s a variant), 30 trials where the two fastest are within 2%, and the drift and
# noise warnings.
REFEREE = TrialDesign(
    calls=10, discard=1, balanced=True, steady_spread=0.01, warmup_block=3, max_trials=30, checks=True
)


@dataclass
class VariantTiming:
    name: str
    times_s: list[float]  # one per trial, in trial order (per call: a block's time over its calls)
    first_call_s: float  # the first call alone: compilation, autotuning, kernel builds
    host_times_s: list[float] = field(default_factory=list)  # CPU time to issue one call, per round
    warmup_calls: int = 0  # untimed calls after the first, until steady or out of budget
    warmup_steady: bool = True  # False: the warm-up budget ran out before its calls agreed
    host: HostTime | None = None  # how the host time was read (bench/host.py); None: not measured

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))

    @property
    def steadiness(self) -> Steadiness | None:
        """How far the trials wandered from the fastest (stats.steadiness)."""
        return steadiness(self.times_s)

    @property
    def trend(self) -> Trend | None:
        """How its time moved with the trial number (stats.trend)."""
        return trend(self.times_s)

    @property
    def noise(self) -> float:
        """Its trials' robust coefficient of variation (stats.noise)."""
        return noise(self.times_s)

    @property
    def host_s(self) -> float | None:
        """The CPU's own time to issue one call (never a wait for the GPU); where the launch queue
        filled, a lower bound (host_is_lower_bound) or None where not even that could be read."""
        if self.host is not None:
            return self.host.seconds
        return float(np.median(self.host_times_s)) if self.host_times_s else None

    @property
    def host_is_lower_bound(self) -> bool:
        """host_s is 'at least': the launch queue filled while the CPU issued the call."""
        return self.host is not None and self.host.lower_bound

    def to_dict(self) -> dict:
        tr = self.trend
        return {
            "name": self.name,
            "median_s": self.median_s,
            "host_s": self.host_s,
            "host_is_lower_bound": self.host_is_lower_bound,
            "first_call_s": self.first_call_s,
            "times_s": list(self.times_s),
            "host_times_s": list(self.host_times_s),
            "host": self.host.to_dict() if self.host else None,
            "warmup_calls": self.warmup_calls,
            "warmup_steady": self.warmup_steady,
            "steadiness": self.steadiness.to_dict() if self.times_s else None,
            "trend": tr.to_dict() if tr else None,
            "noise": self.noise,
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
    design: TrialDesign = field(default_factory=TrialDesign)
    trials_asked: int | None = None  # `trials` as asked, before rounding up and extending
    clocks: list[ClockSample] = field(default_factory=list)  # CUDA with NVML: one a trial
    confidence: float = 0.95
    n_resamples: int = 5000
    _verdicts: dict = field(default_factory=dict, repr=False, compare=False)

    def median_s(self, name: str) -> float:
        return self.timings[name].median_s

    def verdict(self, candidates: Sequence[str] | None = None) -> Verdict:
        """The leader among `candidates` (default: every timed variant) and the set it cannot be
        told apart from (stats.tie_verdict over the paired trials), with the design's band."""
        names = tuple(self.timings if candidates is None else candidates)
        unknown = [n for n in names if n not in self.timings]
        if unknown:
            raise ValueError(f"no timings of {', '.join(unknown)}: timed were {', '.join(self.timings)}")
        if names not in self._verdicts:
            times = {n: self.timings[n].times_s for n in names}
            self._verdicts[names] = tie_verdict(
                times, self.design.band, 1 - self.confidence, self.seed, self.n_resamples
            )
        return self._verdicts[names]

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
        for n, t in self.timings.items():
            drifting = None if t.trend is None else t.trend.drifting
            note = warmup_note(
                n, t.warmup_steady, t.warmup_calls, self.warmup_budget_s, self.design, drifting
            )
            if note:
                out.append(note)
        throttled = throttle_warning(self.clocks)
        if throttled:
            out.append(throttled)
        if self.design.checks:
            drifting = {n: t.trend for n, t in self.timings.items() if t.trend and t.trend.drifting}
            out += [trend_warning(n, tr) for n, tr in drifting.items()]
            out += self.verdict().warnings
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
            "steady_rule": saved_steady_rule(self.design),
            "design": self.design.to_dict(),
            "trials_asked": self.trials_asked,
            "verdict": self.verdict().to_dict() if self.timings else None,
            **({"clocks": [c.to_dict() for c in self.clocks]} if self.clocks else {}),
        }


def warmup_warning(name: str, calls: int, budget_s: float, rule: str | None = None) -> str:
    """The note on a variant whose warm-up ran out of budget before its calls agreed. `rule`:
    what they had to do, where not the default (STEADY_CALLS calls within STEADY_RATIO)."""
    rule = rule or f"last {STEADY_CALLS} agreed within {STEADY_RATIO}x"
    return (
        f"WARNING {name}: warm-up stopped at its {budget_s:g} s budget after {calls} calls, before its "
        f"{rule}; its trials may still be warming up"
    )


def warmup_note(
    name: str,
    steady: bool,
    calls: int,
    budget_s: float,
    design: TrialDesign | None,
    drifting: bool | None,
) -> str | None:
    """The warm-up warning where it still says something: a warm-up that ran out of budget
    (warmup_warning, with the design's own rule), unless the design tests its trials for drift
    (`checks`) and they show none (`drifting` False): the trials themselves then answer the
    question the warning asks. None where there is nothing to say."""
    if steady or (design is not None and design.checks and drifting is False):
        return None
    return warmup_warning(name, calls, budget_s, steady_rule(design))


def saved_steady_rule(design: TrialDesign | None) -> dict:
    """The warm-up rule a run used, as its file records it: blocks that agree within the
    design's spread with no drift, or Part B's calls within STEADY_RATIO. (Files before this
    recorded Part B's rule whatever the design; steady_rule reads the design instead.)"""
    if design is None or design.steady_spread is None:
        return {"calls": STEADY_CALLS, "ratio": STEADY_RATIO}
    return {
        "blocks": STEADY_BLOCKS,
        "calls_per_block": design.warmup_design.calls,
        "discard": design.discard,
        "spread": design.steady_spread,
        "no_drift": True,
    }


def steady_rule(design: TrialDesign | None, verb: str = "agreed") -> str | None:
    """'last 6 blocks of 3 calls agreed within 1.0% with no drift': the warm-up rule of a design
    that warms up by blocks; None for Part B's rule by calls (STEADY_CALLS within STEADY_RATIO)."""
    if design is None or design.steady_spread is None:
        return None
    return (
        f"last {STEADY_BLOCKS} blocks of {design.warmup_design.calls} calls {verb} within "
        f"{design.steady_spread:.1%} with no drift"
    )


def settled(blocks_s: Sequence[float], spread: float) -> bool:
    """Do the last STEADY_BLOCKS block times agree within `spread` (slowest - fastest over their
    median) and show no drift (their halves' medians within spread / 2)?"""
    recent = np.asarray(blocks_s[-STEADY_BLOCKS:], dtype=float)
    if recent.size < STEADY_BLOCKS:
        return False
    med = float(np.median(recent))
    half = STEADY_BLOCKS // 2
    drift = abs(float(np.median(recent[half:])) - float(np.median(recent[:half])))
    return (recent.max() - recent.min()) <= spread * med and drift <= spread / 2 * med


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
    trials: int = DEFAULT_TRIALS,
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
    design: TrialDesign | None = None,
    monitor="auto",
    host_issuer=None,
) -> Comparison:
    """Time `variants` (name -> zero-argument callable) against `baseline` in interleaved trials.

    `device` is where the callables run ('auto': cuda if there is a GPU); with `timing` it picks
    the timer (profuse.timers.make_timer), unless `timer` is given. With graph timing, a variant
    that cannot be captured is left out and named in `not_timed` (the baseline must capture).
    `progress(stage, done, total)` is called as work advances ("warm-up", "host time", "trials").
    `first_calls` gives first-call times measured elsewhere (e.g. while checking correctness),
    for variants that were already called once. `host_rounds` (default: on CUDA) measures each
    call's host time in interleaved rounds (bench/host.py); on a CPU a call's time is all host time.
    `warmup` is the least number of warm-up calls (blocks, with a design's steady_spread); each
    variant warms on until steady or `warmup_budget_s` seconds of warm-up have passed (the timer's
    clock where it has one, else time.perf_counter, so a fake clock drives the warm-up as well).
    `design` lays the trials out (TrialDesign; REFEREE for whole steps); the default is Part B's.
    `monitor` reads clocks, power and throttling around each trial ('auto': NVML on CUDA,
    nothing on a CPU; None: nothing; or a bench.clocks.ClockMonitor). `host_issuer` replaces
    timers.HeldIssue (tests).
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
    design = design or TrialDesign()
    dev = resolve_device(device)
    if timer is None:
        timer = make_timer(timing, dev, flush_l2)
    timing = getattr(timer, "timing", timing)
    first: dict[str, float] = dict(first_calls or {})
    clock = getattr(timer, "clock", time.perf_counter)
    if design.steady_spread is None:
        warm = _WarmUp(warmup, warmup_budget_s, clock)
    else:
        warm = _BlockWarmUp(warmup, warmup_budget_s, clock, timer, design)
    calls, not_timed = _warm_up(variants, baseline, dev, warm, timer, first, progress)
    names = list(calls)
    hosts: dict[str, HostTime | None] = dict.fromkeys(names)
    if host_issuer is not None or (dev.type == "cuda" if host_rounds is None else host_rounds):
        # The calls as a loop makes them (not the graph replays).
        loop_calls = {n: variants[n] for n in names}
        rounds = min(design.host_rounds, trials) if design.host_rounds else trials
        hosts.update(_host(loop_calls, dev, rounds, seed + 1, clock, progress, host_issuer))
    if monitor == "auto":
        monitor = monitor_for(dev)
    trial_run = _Trials(calls, timer, design, random.Random(seed), monitor, progress)
    trial_run.run(trials)
    if design.max_trials > trial_run.count and _close_at_top(trial_run.times, design.close):
        trial_run.run(design.max_trials, extend=True)
    times = trial_run.times
    timings = {}
    for n in names:
        host = hosts[n]
        timings[n] = VariantTiming(
            n, times[n], first[n], host.times_s if host else [], warm.counts[n], warm.steady[n], host
        )
    speedups = {
        n: speedup_ci(times[baseline], times[n], confidence, n_resamples, seed)
        for n in names
        if n != baseline
    }
    return Comparison(
        baseline=baseline,
        device=str(dev),
        trials=trial_run.count,
        warmup=warmup,
        flush_l2=flush_l2 and dev.type == "cuda",
        seed=seed,
        timings=timings,
        speedups=speedups,
        orders=trial_run.orders,
        timer=timer.name,
        timing=timing,
        not_timed=not_timed,
        warmup_budget_s=warmup_budget_s,
        design=design,
        trials_asked=trials,
        clocks=trial_run.clocks,
        confidence=confidence,
        n_resamples=n_resamples,
    )


def _host(calls, dev, rounds, seed, clock, progress, issuer) -> dict[str, HostTime]:
    """Host time per call (bench/host.py): the GPU held on CUDA; the wall clock on a CPU, or where
    this torch has no way to hold the GPU (then each call's wall time, as timers.host_times)."""
    if issuer is None and dev.type == "cuda":
        issuer = HeldIssue(dev)
        if not issuer.available:
            return _wall_rounds(calls, dev, rounds, seed, clock, progress)
    if issuer is not None:
        return measure_host(calls, issuer, rounds, seed, progress)
    return cpu_host_times(calls, rounds, seed, clock, progress)


def _wall_rounds(calls, dev, rounds, seed, clock, progress) -> dict[str, HostTime]:
    """Each call's wall time in shuffled rounds (timers.host_times), for a torch without a GPU
    sleep to hold the GPU with: it may include waiting for the GPU, and says so by its method."""
    rng = random.Random(seed)
    names = list(calls)
    out = {n: HostTime(method="wall, may include waiting") for n in names}
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name, sec in zip(order, host_times([calls[n] for n in order], dev, clock)):
            out[name].times_s.append(sec)
            out[name].filled.append(False)
        if progress:
            progress("host time", r + 1, rounds)
    return out


@dataclass
class _WarmUp:
    """The warm-up rule and what it saw: each variant's warm-up call times, and whether it settled."""

    least: int  # warm-up calls at the least (compare's `warmup`)
    budget_s: float
    clock: Callable[[], float]
    times: dict[str, list[float]] = field(default_factory=dict)
    steady: dict[str, bool] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Untimed calls after the first, by variant."""
        return {n: len(t) for n, t in self.times.items()}

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


@dataclass
class _BlockWarmUp:
    """Warm-up by blocks timed as the trials time them (TrialDesign.steady_spread): until the last
    STEADY_BLOCKS agree within the spread with no drift (`settled`), or the budget runs out."""

    least: int  # blocks at the least
    budget_s: float
    clock: Callable[[], float]
    timer: object
    design: TrialDesign
    times: dict[str, list[float]] = field(default_factory=dict)  # per-call time of each block
    steady: dict[str, bool] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        per = self.design.warmup_design.calls + self.design.discard
        return {n: len(t) * per for n, t in self.times.items()}

    def run(self, name: str, fn: Callable[[], object], dev: torch.device) -> None:
        blocks: list[float] = []
        spent = 0.0
        while True:
            if len(blocks) >= max(self.least, STEADY_BLOCKS):
                if settled(blocks, self.design.steady_spread):
                    steady = True
                    break
                if spent >= self.budget_s:
                    steady = False
                    break
            t0 = self.clock()
            blocks += _time_blocks(self.timer, [fn], self.design.warmup_design)
            spent += self.clock() - t0
        self.times[name], self.steady[name] = blocks, steady


def _time_blocks(timer, fns: Sequence[Callable[[], object]], design: TrialDesign) -> list[float]:
    """Per-call seconds of one block of each fn: the timer's own time_blocks, or for a timer
    without one, its time_calls around a callable that makes the block's calls."""
    if not design.blocks:
        return timer.time_calls(fns)
    if hasattr(timer, "time_blocks"):
        return timer.time_blocks(fns, design.calls, design.discard)
    out = []
    for fn in fns:
        for _ in range(design.discard):
            fn()
        (sec,) = timer.time_calls([lambda fn=fn: [fn() for _ in range(design.calls)]])
        out.append(sec / design.calls)
    return out


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


def williams_square(n: int) -> list[list[int]]:
    """A Williams design for n treatments, as rows of indices: each index in each position equally
    often, and each ordered pair (a, b) of distinct indices with b right after a equally often.

    Even n: one Latin square of n rows, each ordered pair once. Its first row is 0, 1, n-1, 2, n-2,
    ... and row r adds r to every entry mod n: the steps between neighbours of the first row (+1,
    -2, +3, -4, ...) are every non-zero residue once, so across the n rows each one follows each
    other exactly once. Odd n: this square's steps repeat one residue and miss another (and no
    single balanced square exists at all for 3, 5 or 7), so the square and its mirror (every row
    reversed), 2n rows, each ordered pair twice (Williams 1949, Aust. J. Sci. Res. A 2, 149-168)."""
    if n < 1:
        raise ValueError(f"a design needs at least one variant, got {n}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def design_rows(n: int) -> int:
    """Trials in one whole Williams design of n variants: n (even n) or 2n (odd n)."""
    return n if n % 2 == 0 else 2 * n


def balanced_trials(n: int, trials: int) -> int:
    """`trials` rounded up to whole designs of n variants (design_rows): what balanced orders run."""
    size = design_rows(n)
    return -(-trials // size) * size


def balanced_orders(names: Sequence[str], trials: int, rng: random.Random) -> list[list[str]]:
    """Orders for `trials` trials rounded up to whole Williams designs (balanced_trials), balanced
    for carry-over as well as position: in each design every variant runs in each position equally
    often and follows each other variant equally often (williams_square), so what one variant
    leaves behind (a warm cache, a clock that rose, the allocator's state) falls on every other
    alike. Each design draws its own labelling of the variants and its own order of rows, which
    keeps both balances and changes who neighbours whom from design to design. Rotations of one
    order alone, as before, left 9 of the 20 ordered pairs of 5 variants never adjacent."""
    names = list(names)
    square = williams_square(len(names))
    out: list[list[str]] = []
    for _ in range(balanced_trials(len(names), trials) // len(square)):
        labels = names[:]
        rng.shuffle(labels)
        rows = [[labels[i] for i in row] for row in square]
        rng.shuffle(rows)
        out += rows
    return out


def _close_at_top(times: Mapping[str, list[float]], close: float) -> bool:
    """Are the two lowest medians within `close` of each other?"""
    medians = sorted(float(np.median(t)) for t in times.values())
    return len(medians) >= 2 and medians[1] <= medians[0] * (1 + close)


class _Trials:
    """The timed trials: every variant once a trial, each trial's clocks read around it."""

    def __init__(self, calls, timer, design: TrialDesign, rng: random.Random, monitor, progress):
        self.calls, self.timer, self.design, self.rng = calls, timer, design, rng
        self.monitor, self.progress = monitor, progress
        self.names = list(calls)
        self.times: dict[str, list[float]] = {n: [] for n in self.names}
        self.orders: list[list[str]] = []
        self.clocks: list[ClockSample] = []

    @property
    def count(self) -> int:
        return len(self.orders)

    def _orders(self, total: int, extend: bool) -> list[list[str]]:
        n = len(self.names)
        more = total - self.count
        if self.design.balanced:
            if extend:  # whole designs only, none past `total`
                size = design_rows(n)
                more = (total // size) * size - self.count
            return balanced_orders(self.names, more, self.rng) if more > 0 else []
        orders = []
        for _ in range(max(more, 0)):
            order = self.names[:]
            self.rng.shuffle(order)
            orders.append(order)
        return orders

    def run(self, total: int, extend: bool = False) -> None:
        """Trials up to `total` (balanced: rounded up to whole blocks; extending: down)."""
        todo = self._orders(total, extend)
        done_before = self.count
        for k, order in enumerate(todo):
            if self.monitor is not None:
                self.monitor.start()
            secs = _time_blocks(self.timer, [self.calls[n] for n in order], self.design)
            if self.monitor is not None:
                self.clocks.append(self.monitor.stop())
            for name, sec in zip(order, secs):
                self.times[name].append(sec)
            self.orders.append(order)
            if self.progress:
                self.progress("trials", done_before + k + 1, done_before + len(todo))
