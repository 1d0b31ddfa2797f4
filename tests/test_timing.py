"""The timing harness (profuse.bench.timing, profuse.timers) on synthetic callables whose time
ratio is known (its statistics: tests/test_stats.py).

A fake clock makes timings exact: each callable advances it by d * (1 + 0.2 * U), U ~ uniform
[0, 1) from a seeded generator, so the true ratio of median times of two callables is the ratio
of their d, and every run is deterministic given its seeds. No assertion here depends on the
speed of this machine or on how busy it is: no test reads a real clock's timings.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import numpy as np
import pytest
import torch

import profuse
from profuse.bench import stats
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, STATISTIC, Speedup
from profuse.bench.timing import STEADY_CALLS, STEADY_RATIO, Comparison, compare
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
    # The calls really happened in the recorded orders, after all warm-up calls: at least
    # `warmup`, and on until STEADY_CALLS agree (these callables are steady from the start).
    per = max(warmup, STEADY_CALLS)
    n_warm = len(names) * (1 + per)  # the first call, then the warm-up calls
    assert Counter(log[:n_warm]) == {n: 1 + per for n in names}
    assert all(res.timings[n].warmup_calls == per and res.timings[n].warmup_steady for n in names)
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

    def slow_first():
        calls["n"] += 1
        if calls["n"] == 1:
            clock.now += 1000.0  # a huge duration, which no trial may contain
        else:
            clock.now += 1e-3 * (1 + NOISE * rng.random())

    stages = []
    res = compare(
        {"base": synthetic(clock, 1e-3, rng), "compiled": slow_first},
        "base", trials=5, device="cpu", warmup=3, n_resamples=200, timer=CpuTimer(clock),
        progress=lambda stage, done, total: stages.append((stage, done, total)),
    )  # fmt: skip
    assert calls["n"] == 1 + STEADY_CALLS + 5  # first call, warm-up until steady, trials
    assert res.timings["compiled"].first_call_s == 1000.0  # the timer's clock times it too
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
    assert log.count("a") == STEADY_CALLS + 3 and log.count("b") == 1 + STEADY_CALLS + 3


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
# The real clock: which one is used, never what it reads
# --------------------------------------------------------------------------------------------


def test_without_a_timer_cpu_calls_are_timed_by_perf_counter(monkeypatch):
    """compare's default timer on a CPU reads time.perf_counter; here the timer's clock is then
    swapped for a fake one, since a real clock's readings depend on what else the machine runs."""
    from profuse.timers import make_timer

    assert make_timer("device", torch.device("cpu")).clock is time.perf_counter
    clock = FakeClock()
    monkeypatch.setattr(CpuTimer.__init__, "__defaults__", (clock,))
    rng = random.Random(7)
    variants = {"base": synthetic(clock, 4e-3, rng), "fast": synthetic(clock, 2e-3, rng)}
    res = compare(variants, "base", trials=15, device="cpu", warmup=1, n_resamples=500)
    assert res.timer == "time.perf_counter"
    sp = res.speedups["fast"]
    assert sp.low <= 2.0 <= sp.high and sp.verdict == FASTER
    assert 4e-3 <= res.median_s("base") <= 4e-3 * (1 + NOISE)


# --------------------------------------------------------------------------------------------
# Warm-up until steady, on a fake clock
# --------------------------------------------------------------------------------------------


def settling(clock: FakeClock, slow_s: float, n_slow: int, fast_s: float):
    """A callable whose first call and next `n_slow` calls take `slow_s`, then `fast_s`: a
    torch.compile on a CPU (24-28 ms for a few calls, then 57 us)."""
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        clock.now += slow_s if calls["n"] <= 1 + n_slow else fast_s

    return fn


def test_warm_up_runs_until_the_last_calls_agree():
    """A variant still slow after one warm-up call warms on until STEADY_CALLS calls agree, so
    no trial sees its slow calls and the verdict is the steady one (the CPU run that read
    '145x slower' at 3 trials)."""
    clock = FakeClock()
    rng = random.Random(3)
    variants = {"eager": synthetic(clock, 60e-6, rng), "compile": settling(clock, 26e-3, 4, 57e-6)}
    res = compare(variants, "eager", trials=6, device="cpu", warmup=1, n_resamples=300, timer=CpuTimer(clock))
    t = res.timings["compile"]
    assert t.warmup_calls == 4 + STEADY_CALLS and t.warmup_steady
    assert max(t.times_s) == pytest.approx(57e-6)
    assert res.timings["eager"].warmup_calls == STEADY_CALLS
    assert res.speedups["compile"].verdict == FASTER
    assert res.warnings == []
    d = json.loads(json.dumps(res.to_dict()))
    assert d["timings"]["compile"]["warmup_calls"] == 4 + STEADY_CALLS
    assert d["timings"]["compile"]["warmup_steady"] is True
    assert d["steady_rule"] == {"calls": STEADY_CALLS, "ratio": STEADY_RATIO}


def test_warm_up_that_never_settles_stops_at_its_budget_and_says_so():
    clock = FakeClock()
    flip = {"n": 0}

    def jumpy():  # 1 ms and 3 ms in turn: never STEADY_CALLS within STEADY_RATIO
        flip["n"] += 1
        clock.now += 1e-3 if flip["n"] % 2 else 3e-3

    rng = random.Random(4)
    res = compare(
        {"base": synthetic(clock, 1e-3, rng), "jumpy": jumpy}, "base", trials=4, device="cpu",
        warmup=1, warmup_budget_s=0.05, n_resamples=200, timer=CpuTimer(clock),
    )  # fmt: skip
    t = res.timings["jumpy"]
    assert not t.warmup_steady
    spent = sum(3e-3 if i % 2 == 0 else 1e-3 for i in range(t.warmup_calls))  # the first call was 1 ms
    assert 0.05 <= spent < 0.05 + 3e-3  # it stopped at the first call past its budget
    assert res.timings["base"].warmup_steady
    (warning,) = [w for w in res.warnings if "warm-up" in w]
    assert warning.startswith("WARNING jumpy: warm-up stopped at its 0.05 s budget after ")
    assert f"last {STEADY_CALLS} agreed within {STEADY_RATIO}x" in warning


def test_warm_up_honours_its_least_count_and_rejects_a_bad_budget():
    clock = FakeClock()
    log: list[str] = []
    rng = random.Random(5)
    res = compare({"a": synthetic(clock, 1e-3, rng, log, "a"), "b": synthetic(clock, 1e-3, rng, log, "b")},
                  "a", trials=2, device="cpu", warmup=9, n_resamples=100, timer=CpuTimer(clock))  # fmt: skip
    assert res.timings["a"].warmup_calls == 9 and log.count("a") == 1 + 9 + 2
    with pytest.raises(ValueError, match="warmup_budget_s"):
        compare({"a": lambda: None}, "a", trials=2, device="cpu", warmup_budget_s=-1)


# --------------------------------------------------------------------------------------------
# Unsteady trials: one rule (stats.steadiness), carried by the Comparison
# --------------------------------------------------------------------------------------------


def test_unsteady_trials_are_flagged_on_the_comparison():
    """A variant whose trials swing (threads fighting other processes: 2.6 ms to 545 ms) is named
    in Comparison.unsteady and its warning; a steady one is not."""
    clock = FakeClock()
    rng = random.Random(6)
    n = {"calls": 0}
    trials = 20

    def swinging():
        n["calls"] += 1
        # steady through its warm-up, then every third trial ~100x slower
        slow = n["calls"] > 1 + STEADY_CALLS and n["calls"] % 3 == 0
        clock.now += 0.3 if slow else 3e-3 * (1 + 0.1 * rng.random())

    res = compare({"eager": synthetic(clock, 3e-3, rng), "swinging": swinging}, "eager", trials=trials,
                  device="cpu", warmup=1, n_resamples=200, timer=CpuTimer(clock))  # fmt: skip
    assert set(res.unsteady) == {"swinging"}
    s = res.unsteady["swinging"]
    assert s.slow_trials == sum(t > stats.UNSTEADY_RATIO * min(res.timings["swinging"].times_s)
                                for t in res.timings["swinging"].times_s)  # fmt: skip
    assert s.slow_trials > stats.UNSTEADY_SHARE * trials and s.spread > 50
    (warning,) = res.warnings
    rule = f"trials over {stats.UNSTEADY_RATIO}x their fastest"
    assert warning.startswith(f"WARNING: unsteady timings ({rule}: ")
    assert f"eager 0/{trials}, swinging {s.slow_trials}/{trials} (" in warning
    assert "not to be trusted" in warning
    d = json.loads(json.dumps(res.to_dict()))
    assert d["timings"]["swinging"]["steadiness"]["unsteady"] is True
    assert d["timings"]["eager"]["steadiness"]["unsteady"] is False
    steady = fake_compare({"a": 1e-3, "b": 2e-3}, "a")
    assert steady.unsteady == {} and steady.warnings == []


@pytest.mark.parametrize("slow", [0, 1, 4, 5, 9])
def test_the_unsteady_rule_is_over_a_fifth_of_trials_past_its_factor(slow):
    rng = np.random.default_rng(slow)
    times = list(1e-3 * (1 + 0.1 * rng.random(20 - slow))) + list(2e-3 * (1 + rng.random(slow)))
    rng.shuffle(times)
    s = stats.steadiness(times)
    assert s.trials == 20 and s.slow_trials == slow
    assert s.unsteady is (slow > 4)
    assert s.fastest_s == min(times) and s.slowest_s == max(times)
    assert stats.steadiness([]) is None


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
    warm = 3 * (1 + STEADY_CALLS)  # the first calls and the warm-up
    host_log = log[warm : warm + 3 * trials]  # after the warm-up, before the trials
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
