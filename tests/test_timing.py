"""The timing harness (profuse.bench.timing, profuse.timers) on synthetic callables whose time
ratio is known (its statistics: tests/test_stats.py).

A fake clock makes timings exact: each callable advances it by d * (1 + 0.2 * U), U ~ uniform
[0, 1) from a seeded generator, so the true ratio of median times of two callables is the ratio
of their d, and every run is deterministic given its seeds. No assertion here depends on the
speed of this machine, except the one coarse real-clock test at the end.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
import torch

import profuse
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, STATISTIC, Speedup
from profuse.bench.timing import Comparison, compare
from profuse.timers import CpuTimer

NOISE = 0.2


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def synthetic(clock: FakeClock, d: float, rng: random.Random, log: list | None = None, name: str = ""):
    """A callable that 'takes' d * (1 + NOISE * U) seconds of fake time."""

    def fn():
        clock.now += d * (1 + NOISE * rng.random())
        if log is not None:
            log.append(name)

    return fn


def fake_compare(
    durations: dict[str, float], baseline: str, seed: int = 0, trials: int = 20, **kw
) -> Comparison:
    clock = FakeClock()
    rng = random.Random(seed)
    variants = {name: synthetic(clock, d, rng) for name, d in durations.items()}
    kw.setdefault("n_resamples", 1000)
    kw.setdefault("warmup", 1)
    return compare(variants, baseline, trials=trials, device="cpu", seed=seed, timer=CpuTimer(clock), **kw)


# --------------------------------------------------------------------------------------------
# compare with a fake clock
# --------------------------------------------------------------------------------------------


def test_known_ratio_two_is_found():
    res = fake_compare({"base": 2e-3, "fast": 1e-3}, "base", seed=0)
    sp = res.speedups["fast"]
    assert sp.low <= 2.0 <= sp.high
    assert sp.verdict == FASTER
    assert abs(sp.median - 2.0) < 0.2
    assert set(res.speedups) == {"fast"}  # the baseline gets no speedup against itself
    assert res.median_s("base") == pytest.approx(2 * res.median_s("fast"), rel=0.1)


def test_slower_variant_is_slower():
    sp = fake_compare({"base": 1e-3, "slow": 3e-3}, "base", seed=1).speedups["slow"]
    assert sp.low <= 1 / 3 <= sp.high and sp.verdict == SLOWER


def test_identical_callables_give_no_measurable_gain():
    res = fake_compare({"a": 1e-3, "b": 1e-3}, "a", seed=0)
    sp = res.speedups["b"]
    assert sp.low <= 1.0 <= sp.high
    assert sp.verdict == NO_GAIN


def test_coverage_over_seeds():
    """The 95% CI contains the true ratio in most seeds, and two identical callables rarely get a
    verdict. 30 seeds, 20 trials each; deterministic given the seeds. A correct 95% interval
    misses in ~1.5 of 30 seeds; >= 24 hits allows for the bootstrap's small-sample
    undercoverage (28-29 seen) while a broken interval (too narrow, or around the wrong
    statistic) falls far below."""
    seeds = range(30)
    cis = [
        fake_compare({"base": 2e-3, "fast": 1e-3}, "base", seed=s, n_resamples=300).speedups["fast"]
        for s in seeds
    ]
    covered = sum(sp.low <= 2.0 <= sp.high for sp in cis)
    assert covered >= 24, f"the CI held the true ratio 2.0 in only {covered} of 30 seeds"
    null = sum(
        fake_compare({"a": 1e-3, "b": 1e-3}, "a", seed=s, n_resamples=300).speedups["b"].verdict == NO_GAIN
        for s in seeds
    )
    assert null >= 24, f"identical callables got a verdict in {30 - null} of 30 seeds"


def test_trials_are_interleaved_and_shuffled_by_seed():
    clock = FakeClock()
    rng = random.Random(0)
    log: list[str] = []
    names = ["a", "b", "c", "d"]
    variants = {n: synthetic(clock, 1e-3, rng, log, n) for n in names}
    warmup, trials = 2, 12
    res = compare(
        variants,
        "a",
        trials=trials,
        device="cpu",
        warmup=warmup,
        seed=5,
        n_resamples=200,
        timer=CpuTimer(clock),
    )
    assert len(res.orders) == trials
    for order in res.orders:
        assert sorted(order) == sorted(names)  # every trial times each variant once
    assert len({tuple(o) for o in res.orders}) > 1, "the order never changes across trials"
    # The calls really happened in the recorded orders, after all warm-up calls.
    n_warm = len(names) * (1 + warmup)  # the first call, then the warm-up calls
    assert Counter(log[:n_warm]) == {n: 1 + warmup for n in names}
    assert log[n_warm:] == [n for order in res.orders for n in order]
    for name in names:
        assert len(res.timings[name].times_s) == trials
    # Same seed, same orders; another seed, other orders.
    again = fake_compare(dict.fromkeys(names, 1e-3), "a", seed=5, trials=trials, n_resamples=200)
    other = fake_compare(dict.fromkeys(names, 1e-3), "a", seed=6, trials=trials, n_resamples=200)
    assert again.orders == res.orders
    assert other.orders != res.orders


def test_warm_up_and_first_call_stay_out_of_the_trials():
    """The first call (slow, as a compile is) is timed apart; warm-up calls precede every trial."""
    clock = FakeClock()
    rng = random.Random(1)
    calls = {"n": 0}
    compile_s = 0.02  # real time: timed_call measures the first call on the wall clock

    def slow_first():
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(compile_s)  # sleep returns no earlier than asked
            clock.now += 1000.0  # and a huge fake duration, which no trial may contain
        else:
            clock.now += 1e-3 * (1 + NOISE * rng.random())

    stages = []
    res = compare(
        {"base": synthetic(clock, 1e-3, rng), "compiled": slow_first},
        "base", trials=5, device="cpu", warmup=3, n_resamples=200, timer=CpuTimer(clock),
        progress=lambda stage, done, total: stages.append((stage, done, total)),
    )  # fmt: skip
    assert calls["n"] == 1 + 3 + 5  # first call, warm-up, trials
    assert res.timings["compiled"].first_call_s >= compile_s
    assert max(res.timings["compiled"].times_s) < 1.0
    assert res.warmup == 3
    assert [s for s in stages if s[0] == "warm-up"] == [("warm-up", 1, 2), ("warm-up", 2, 2)]
    assert [s for s in stages if s[0] == "trials"][-1] == ("trials", 5, 5)
    assert stages.index(("warm-up", 2, 2)) < stages.index(("trials", 1, 5))


def test_first_calls_given_are_not_called_again():
    clock = FakeClock()
    rng = random.Random(2)
    log: list[str] = []
    variants = {n: synthetic(clock, 1e-3, rng, log, n) for n in ("a", "b")}
    res = compare(
        variants,
        "a",
        trials=3,
        device="cpu",
        warmup=0,
        first_calls={"a": 12.5},
        n_resamples=200,
        timer=CpuTimer(clock),
    )
    assert res.timings["a"].first_call_s == 12.5
    assert log.count("a") == 3 and log.count("b") == 1 + 3


def test_to_dict_is_json_and_holds_every_timing():
    res = fake_compare({"base": 2e-3, "fast": 1e-3, "same": 2e-3}, "base", seed=3, trials=7)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["baseline"] == "base" and d["trials"] == 7 and d["seed"] == 3
    assert d["statistic"] == STATISTIC and d["device"] == "cpu"
    for name, timing in res.timings.items():
        assert d["timings"][name]["times_s"] == timing.times_s
        assert len(timing.times_s) == 7
        assert d["timings"][name]["median_s"] == timing.median_s
        assert d["timings"][name]["first_call_s"] == timing.first_call_s
    assert set(d["speedups"]) == {"fast", "same"}
    fast = d["speedups"]["fast"]
    assert fast["verdict"] == FASTER and fast["low"] <= fast["median"] <= fast["high"]
    assert d["orders"] == res.orders


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(baseline="missing"), "baseline"),
        (dict(trials=1), "trials"),
        (dict(warmup=-1), "warmup"),
    ],
)
def test_compare_rejects_bad_arguments(kwargs, match):
    args = dict(variants={"a": lambda: None, "b": lambda: None}, baseline="a", trials=3, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compare(**args)


def test_public_api_exports_the_harness():
    assert profuse.compare is compare and profuse.Comparison is Comparison and profuse.Speedup is Speedup


# --------------------------------------------------------------------------------------------
# The real clock, once, coarsely
# --------------------------------------------------------------------------------------------


def _busy(seconds: float):
    def fn():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return fn


def test_real_clock_busy_wait_ratio():
    """Busy-waits of 4 ms and 2 ms: the point estimate lands within 15% of 2 and the verdict is
    'faster'. Only that: on a noisy shared 2-core machine a real CI cannot promise coverage."""
    res = compare(
        {"base": _busy(4e-3), "fast": _busy(2e-3)}, "base", trials=15, device="cpu", warmup=1, n_resamples=500
    )
    sp = res.speedups["fast"]
    assert abs(sp.median - 2.0) <= 0.3, f"ratio {sp.median:.2f}"
    assert sp.verdict == FASTER
    assert res.timer == "time.perf_counter"


# --------------------------------------------------------------------------------------------
# Host time per call and timing modes
# --------------------------------------------------------------------------------------------


def test_host_rounds_time_every_call_interleaved():
    """Host rounds call each variant once per round in a shuffled order, and each variant's
    host time is the median of its rounds (here: the fake clock's duration of its calls)."""
    clock = FakeClock()
    rng = random.Random(4)
    log: list[str] = []
    variants = {n: synthetic(clock, d, rng, log, n) for n, d in (("a", 2e-3), ("b", 1e-3), ("c", 4e-3))}
    trials = 9
    res = compare(
        variants, "a", trials=trials, device="cpu", warmup=0, n_resamples=200, timer=CpuTimer(clock),
        host_rounds=True,
    )  # fmt: skip
    host_log = log[3 : 3 + 3 * trials]  # after the first calls, before the trials
    rounds = [host_log[i : i + 3] for i in range(0, len(host_log), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1, "every round ran in the same order"
    for name, d in (("a", 2e-3), ("b", 1e-3), ("c", 4e-3)):
        t = res.timings[name]
        assert len(t.host_times_s) == trials
        assert d <= t.host_s <= d * (1 + NOISE)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["timings"]["b"]["host_s"] == res.timings["b"].host_s
    assert d["timings"]["b"]["host_times_s"] == res.timings["b"].host_times_s


def test_a_cpu_run_has_no_separate_host_time():
    res = fake_compare({"a": 1e-3, "b": 1e-3}, "a", trials=3)
    assert res.timings["a"].host_s is None and res.timings["a"].host_times_s == []
    assert res.timing == "device" and not res.host_bound("a")


@pytest.mark.parametrize(
    ("timing", "host", "time", "bound"),
    [
        ("device", 300e-6, 100e-6, True),  # the host takes 3x what the GPU needs
        ("device", 50e-6, 100e-6, False),
        ("graph", 120e-6, 100e-6, True),
        ("loop", 300e-6, 310e-6, True),  # the loop time is the host's plus a little
        ("loop", 50e-6, 100e-6, False),  # the loop time is the device's
        ("device", None, 100e-6, False),
    ],
)
def test_host_bound_says_which_cost_bounds_a_call(timing, host, time, bound):
    from profuse.bench.timing import host_bound

    assert host_bound(host, time, timing) is bound


def test_make_timer_picks_by_mode_and_refuses_graphs_on_a_cpu():
    from profuse.timers import TIMINGS, make_timer

    cpu = torch.device("cpu")
    assert TIMINGS == ("device", "loop", "graph")
    assert isinstance(make_timer("device", cpu), CpuTimer)
    assert isinstance(make_timer("loop", cpu), CpuTimer)  # on a CPU every call is synchronous
    with pytest.raises(ValueError, match="CUDA GPU"):
        make_timer("graph", cpu)
    with pytest.raises(ValueError, match="unknown timing"):
        make_timer("wall", cpu)


def test_uncapturable_variants_are_named_not_timed():
    """Graph timing: a variant whose capture fails is left out with the reason; the others are
    timed from their replays."""
    from profuse.timers import GraphError

    clock = FakeClock()
    rng = random.Random(5)

    class FakeGraphTimer(CpuTimer):
        timing = "graph"

        def capture(self, fn):
            if fn is variants["syncs"]:
                raise GraphError("cannot be captured in a CUDA graph (RuntimeError: sync)")
            return fn

    import profuse.bench.timing as timing_mod

    variants = {n: synthetic(clock, 1e-3, rng) for n in ("base", "fine", "syncs")}
    orig = timing_mod.GraphTimer
    timing_mod.GraphTimer = FakeGraphTimer
    try:
        res = compare(variants, "base", trials=4, device="cpu", warmup=0, n_resamples=200,
                      timer=FakeGraphTimer(clock))  # fmt: skip
    finally:
        timing_mod.GraphTimer = orig
    assert set(res.timings) == {"base", "fine"} and res.timing == "graph"
    assert "CUDA graph" in res.not_timed["syncs"]
    assert set(res.speedups) == {"fine"}
