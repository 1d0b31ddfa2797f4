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
from dataclasses import replace

import numpy as np
import pytest
import torch

import profuse
from profuse.bench import host, stats
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, STATISTIC, Speedup
from profuse.bench.timing import (
    REFEREE,
    STEADY_BLOCKS,
    STEADY_CALLS,
    STEADY_RATIO,
    Comparison,
    TrialDesign,
    balanced_orders,
    balanced_trials,
    compare,
    design_rows,
    saved_steady_rule,
    settled,
    warmup_note,
    williams_square,
)
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


def test_a_saved_steady_rule_is_the_designs_own():
    """A run warmed by blocks saves its blocks' rule, not Part B's calls within 1.5x."""
    saved = saved_steady_rule(REFEREE)
    assert saved["blocks"] == STEADY_BLOCKS and saved["spread"] == REFEREE.steady_spread == 0.01
    assert saved["calls_per_block"] == REFEREE.warmup_block and saved["discard"] == REFEREE.discard
    assert "ratio" not in saved
    assert saved_steady_rule(TrialDesign()) == {"calls": STEADY_CALLS, "ratio": STEADY_RATIO}


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


def test_a_warm_up_out_of_budget_is_answered_by_trials_tested_for_drift():
    """On an H100 a 140 ms step's 1% block warm-up ran out of its 5 s budget, and the report said
    'last 5 agreed within 1.5x' (Part B's rule, not the one applied); where the design tests the
    trials for drift and they show none, the trials answer what the warning asks."""
    assert warmup_note("fused", True, 40, 5.0, REFEREE, None) is None
    assert warmup_note("fused", False, 40, 5.0, REFEREE, False) is None
    for drifting in (True, None):  # drifting, or too few trials to tell
        note = warmup_note("fused", False, 40, 5.0, REFEREE, drifting)
        assert note.startswith("WARNING fused: warm-up stopped at its 5 s budget after 40 calls")
        assert f"blocks of {REFEREE.warmup_block} calls agreed within 1.0% with no drift" in note
    unchecked = replace(REFEREE, checks=False)
    assert "blocks of" in warmup_note("fused", False, 40, 5.0, unchecked, False)
    plain = warmup_note("fused", False, 40, 5.0, None, False)
    assert f"last {STEADY_CALLS} agreed within {STEADY_RATIO}x" in plain


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


# --------------------------------------------------------------------------------------------
# Trial design: balanced orders, blocks of K calls, warm-up by blocks, more trials where close
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "trials"), [(2, 5), (3, 7), (4, 4), (5, 5), (6, 13), (7, 12)])
def test_balanced_orders_put_each_variant_in_each_position_and_after_each_other_equally_often(n, trials):
    names = [f"v{i}" for i in range(n)]
    orders = balanced_orders(names, trials, random.Random(n))
    size = n if n % 2 == 0 else 2 * n  # one Williams square, or a square and its mirror
    assert len(orders) == -(-trials // size) * size == balanced_trials(n, trials) >= trials
    for order in orders:
        assert sorted(order) == sorted(names)
    for pos in range(n):
        assert Counter(o[pos] for o in orders) == dict.fromkeys(names, len(orders) // n)
    # Carry-over: every ordered pair of distinct variants adjacent, each equally often, in every
    # whole design and so over all of them.
    every_pair = {(a, b) for a in names for b in names if a != b}
    for start in range(0, len(orders), size):
        pairs = Counter((o[i], o[i + 1]) for o in orders[start : start + size] for i in range(n - 1))
        assert set(pairs) == every_pair
        assert set(pairs.values()) == {size * (n - 1) // len(every_pair)}
    if len(orders) > size and n > 2:  # a new labelling each design: its rows differ
        assert orders[:size] != orders[size : 2 * size]


@pytest.mark.parametrize("n", range(1, 10))
def test_williams_square_is_latin_and_carry_over_balanced(n):
    rows = williams_square(n)
    assert len(rows) == design_rows(n) == (n if n % 2 == 0 else 2 * n)
    for row in rows:
        assert sorted(row) == list(range(n))
    pairs = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
    assert len(pairs) == n * (n - 1)
    assert set(pairs.values()) <= {1 if n % 2 == 0 else 2}


def test_rotations_alone_leave_ordered_pairs_out_where_williams_does_not():
    # What the design replaced: the 5 rotations of one order give 4 x 5 = 20 adjacencies but only
    # 5 distinct ordered pairs of the 20, so the other 15 never occur.
    base = list(range(5))
    rotations = [base[i:] + base[:i] for i in range(5)]
    assert len({(r[i], r[i + 1]) for r in rotations for i in range(4)}) == 5
    assert len({(r[i], r[i + 1]) for r in williams_square(5) for i in range(4)}) == 20


def test_a_balanced_design_rounds_the_trials_up_and_balances_positions():
    res = fake_compare(dict.fromkeys("abc", 1e-3), "a", trials=7, design=TrialDesign(balanced=True))
    # 3 variants: a Williams square and its mirror, 6 trials a design, so 7 becomes 12
    assert res.trials == 12 and res.trials_asked == 7 and len(res.timings["b"].times_s) == 12
    for pos in range(3):
        assert Counter(o[pos] for o in res.orders) == dict.fromkeys("abc", 4)
    assert json.loads(json.dumps(res.to_dict()))["design"]["balanced"] is True


def test_a_trial_is_one_clock_pair_around_k_calls_after_a_discarded_one():
    clock = FakeClock()
    log: list[str] = []
    durations = {"a": 2e-3, "b": 1e-3}
    calls = {n: 0 for n in durations}

    def make(name):
        def fn():
            calls[name] += 1
            # the discarded call of every block is 100x slower: it must never reach a time
            slow = (calls[name] - after_warmup[name]) % 4 == 1 if after_warmup[name] is not None else False
            clock.now += durations[name] * (100 if slow else 1)
            log.append(name)

        return fn

    after_warmup: dict[str, int | None] = dict.fromkeys(durations)
    variants = {n: make(n) for n in durations}

    def progress(stage, done, total):
        if stage == "warm-up" and done == len(durations):
            after_warmup.update(calls)

    design = TrialDesign(calls=3, discard=1)
    res = compare(variants, "a", trials=4, device="cpu", warmup=1, n_resamples=200, timer=CpuTimer(clock),
                  design=design, progress=progress)  # fmt: skip
    assert [calls[n] - after_warmup[n] for n in durations] == [4 * 4, 4 * 4]  # (1 + 3) calls a trial
    for name, d in durations.items():
        assert res.timings[name].times_s == pytest.approx([d] * 4)  # per call; the discarded one is out
    trial_log = log[-4 * 2 * 4 :]
    blocks = [trial_log[i : i + 4] for i in range(0, len(trial_log), 4)]
    assert all(len(set(b)) == 1 for b in blocks)  # a variant's block is back to back
    assert [b[0] for b in blocks] == [n for order in res.orders for n in order]


def test_a_timer_without_blocks_is_given_the_block_as_one_call():
    clock = FakeClock()

    class CallsOnly:
        name, timing = "calls only", "device"

        def __init__(self):
            self.clock = clock
            self.inner = CpuTimer(clock)

        def time_calls(self, fns):
            return self.inner.time_calls(fns)

    rng = random.Random(1)
    variants = {"a": synthetic(clock, 2e-3, rng), "b": synthetic(clock, 1e-3, rng)}
    res = compare(variants, "a", trials=3, device="cpu", warmup=0, n_resamples=100, timer=CallsOnly(),
                  design=TrialDesign(calls=4, discard=1))  # fmt: skip
    assert all(1e-3 <= t <= 1.2e-3 for t in res.timings["b"].times_s)


def drifting(clock: FakeClock, start_s: float, end_s: float, calls_to_settle: int):
    """A callable that speeds up linearly from start_s to end_s over its first calls, then holds."""
    n = {"calls": 0}

    def fn():
        n["calls"] += 1
        k = min(n["calls"], calls_to_settle) / calls_to_settle
        clock.now += start_s + (end_s - start_s) * k

    return fn


def test_block_warm_up_waits_out_a_drift_then_stops_at_one_percent():
    clock = FakeClock()
    rng = random.Random(2)
    design = TrialDesign(calls=4, discard=1, steady_spread=0.01)
    variants = {"a": synthetic(clock, 1e-3, random.Random(3)), "b": drifting(clock, 1.2e-3, 1e-3, 200)}
    variants["a"] = lambda: setattr(clock, "now", clock.now + 1e-3 * (1 + 0.002 * rng.random()))
    res = compare(variants, "a", trials=4, device="cpu", warmup=1, n_resamples=100, timer=CpuTimer(clock),
                  design=design)  # fmt: skip
    a, b = res.timings["a"], res.timings["b"]
    assert a.warmup_steady and b.warmup_steady
    assert a.warmup_calls == STEADY_BLOCKS * 5  # steady from the start: the window, blocks of 1 + 4
    steady = lambda: setattr(clock, "now", clock.now + 2e-3)
    small = compare({"a": variants["a"], "c": steady}, "a", trials=2,
                    device="cpu", warmup=0, n_resamples=100, timer=CpuTimer(clock),
                    design=replace(design, warmup_block=2))  # fmt: skip
    assert small.timings["a"].warmup_calls == STEADY_BLOCKS * 3  # warm-up blocks of 1 + 2
    assert b.warmup_calls > 200 * 0.9  # on until the drift has (nearly) stopped
    assert max(b.times_s) <= 1e-3 * 1.01
    assert res.warnings == []


def test_block_warm_up_that_never_settles_says_so_with_its_rule():
    clock = FakeClock()
    design = TrialDesign(calls=2, steady_spread=0.01)
    flip = {"n": 0}

    def jumpy():
        flip["n"] += 1
        clock.now += 1e-3 if flip["n"] % 3 else 1.05e-3

    base = lambda: setattr(clock, "now", clock.now + 1e-3)  # steady: settles at once
    res = compare({"a": jumpy, "b": base}, "b", trials=3, device="cpu", warmup=0, n_resamples=100,
                  timer=CpuTimer(clock), design=design, warmup_budget_s=0.05)  # fmt: skip
    assert not res.timings["a"].warmup_steady
    (warning,) = [w for w in res.warnings if "warm-up" in w]
    assert f"last {STEADY_BLOCKS} blocks of 2 calls agreed within 1.0% with no drift" in warning


def test_settled_wants_the_spread_and_no_drift():
    flat = [1.0, 1.004, 0.998, 1.002, 1.0, 1.003]
    assert settled(flat, 0.01) and not settled(flat[:-1], 0.01)
    assert not settled([1.0, 1.0, 1.0, 1.02, 1.0, 1.0], 0.01)  # one block 2% off
    assert not settled([1.008, 1.007, 1.006, 1.0, 1.001, 1.002], 0.01)  # within 1%, but a 0.6% step


def quiet_compare(durations: dict[str, float], trials: int, **kw) -> Comparison:
    """fake_compare with 0.1% noise, so medians sit where their durations say."""
    clock = FakeClock()
    rng = random.Random(0)
    variants = {n: (lambda d=d: setattr(clock, "now", clock.now + d * (1 + 1e-3 * rng.random())))
                for n, d in durations.items()}  # fmt: skip
    kw.setdefault("n_resamples", 300)
    return compare(variants, next(iter(durations)), trials=trials, device="cpu", warmup=1,
                   timer=CpuTimer(clock), **kw)  # fmt: skip


def test_more_trials_where_the_two_fastest_are_close():
    design = TrialDesign(balanced=True, max_trials=30, close=0.02)
    close = quiet_compare({"a": 1e-3, "b": 1.01e-3, "c": 2e-3}, 6, design=design)
    assert close.trials_asked == 6 and close.trials == 30  # 30 is a whole number of designs of 6
    for pos in range(3):
        assert Counter(o[pos] for o in close.orders) == dict.fromkeys("abc", 10)
    far = quiet_compare({"a": 1e-3, "b": 1.03e-3}, 6, design=design)
    assert far.trials == 6
    odd = quiet_compare({"a": 1e-3, "b": 1.001e-3, "c": 1e-3, "d": 3e-3}, 5, design=design)
    assert odd.trials == 28  # whole blocks of 4, none past 30
    stages = []
    quiet_compare({"a": 1e-3, "b": 1e-3}, 4, design=TrialDesign(max_trials=9),
                  progress=lambda *s: stages.append(s))  # fmt: skip
    trials = [s for s in stages if s[0] == "trials"]
    assert trials[3] == ("trials", 4, 4) and trials[-1] == ("trials", 9, 9)


# --------------------------------------------------------------------------------------------
# The verdict, drift and noise on the Comparison
# --------------------------------------------------------------------------------------------


def test_the_comparison_carries_the_verdict_and_its_tie_set():
    res = fake_compare({"eager": 3e-3, "fast": 1e-3, "same": 1e-3}, "eager", seed=2, trials=20)
    v = res.verdict()
    assert v.winner in ("fast", "same") and v.tie == sorted(v.tie, key=lambda n: n != v.winner)
    assert set(v.tie) == {"fast", "same"} and "eager" in v.called
    assert res.verdict() is v  # computed once
    sub = res.verdict(["eager", "same"])
    assert (sub.winner, sub.tied_with) == ("same", [])
    with pytest.raises(ValueError, match="no timings of nope"):
        res.verdict(["eager", "nope"])
    d = json.loads(json.dumps(res.to_dict()))
    assert d["verdict"]["winner"] == v.winner and d["verdict"]["tied_with"] == v.tied_with
    assert d["verdict"]["band"] == TrialDesign().band
    # the verdict agrees with the saved paired trials
    again = stats.tie_verdict({n: t["times_s"] for n, t in d["timings"].items()}, n_resamples=1000)
    assert (again.winner, again.tied_with) == (v.winner, v.tied_with)
    assert d["speedups"]["fast"]["per_trial"]["low"] > 1


def steady_then(clock: FakeClock, d: float, rng: random.Random, after: int, drift: float):
    """Steady for `after` calls (its warm-up), then slower by `drift` a call: a variant whose
    trials drift."""
    n = {"calls": 0}

    def fn():
        n["calls"] += 1
        extra = max(n["calls"] - after, 0) * drift
        clock.now += (d + extra) * (1 + 0.001 * rng.random())

    return fn


def test_drift_and_noise_are_warned_only_where_the_design_checks():
    def run(checks: bool):
        clock = FakeClock()
        rng = random.Random(3)
        variants = {
            "a": synthetic(clock, 1e-3, rng),
            "b": steady_then(clock, 2e-3, rng, 1 + STEADY_CALLS, 2e-5),
        }
        return compare(variants, "a", trials=12, device="cpu", warmup=1, n_resamples=200,
                       timer=CpuTimer(clock), design=TrialDesign(checks=checks))  # fmt: skip

    checked, unchecked = run(True), run(False)
    assert checked.timings["b"].trend.drifting and checked.timings["b"].trend.r > 0.5
    (drift,) = [w for w in checked.warnings if "drifted" in w]
    assert drift.startswith("WARNING b: its times drifted through the trials")
    # a's trials vary up to 20% (the fake's noise) while b is called 2x slower: no noise warning
    assert not any("trial noise" in w for w in checked.warnings)
    assert not any("drifted" in w for w in unchecked.warnings)
    d = json.loads(json.dumps(checked.to_dict()))
    assert d["timings"]["b"]["trend"]["drifting"] is True and d["timings"]["a"]["noise"] > 0


def test_noise_larger_than_a_called_difference_is_warned_on_the_comparison():
    clock = FakeClock()
    rng = random.Random(9)
    # both variants see the same machine swings (up to 40% a trial), b 5% slower in each
    swing = {"now": 1.0}

    def maker(d):
        def fn():
            clock.now += d * swing["now"]

        return fn

    class Swinging(CpuTimer):
        def time_calls(self, fns):
            swing["now"] = 1 + 0.4 * rng.random()
            return super().time_calls(fns)

    res = compare({"a": maker(1e-3), "b": maker(1.05e-3)}, "a", trials=16, device="cpu", warmup=0,
                  n_resamples=500, timer=Swinging(clock), design=TrialDesign(checks=True))  # fmt: skip
    assert res.verdict().tied_with == []
    assert any(w.startswith("WARNING: trial noise (") for w in res.warnings)


# --------------------------------------------------------------------------------------------
# Clocks, power and throttling through a fake NVML
# --------------------------------------------------------------------------------------------


class FakeNvmlLib:
    """libnvidia-ml.so.1 as ctypes calls it: each function writes through its byref argument.
    `state` is what the card reads now; a missing key is a function the driver lacks."""

    def __init__(self, state: dict):
        self.state = state
        self.handles: list[bytes] = []

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByUUID(self, key, out):
        self.handles.append(key)
        out._obj.value = 1234
        return 0

    def _put(self, key, out):
        if key not in self.state:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        out._obj.value = self.state[key]
        return 0

    def nvmlDeviceGetClockInfo(self, handle, clock, out):
        assert handle.value == 1234 and clock == 1
        return self._put("sm", out)

    def nvmlDeviceGetPowerUsage(self, handle, out):
        return self._put("mw", out)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, out):
        return self._put("mj", out)

    def nvmlDeviceGetTemperature(self, handle, sensor, out):
        return self._put("temp", out)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
        return self._put("reasons", out)

    def nvmlDeviceGetViolationStatus(self, handle, policy, out):
        key = ("power_ns", "thermal_ns")[policy]
        if key not in self.state:
            return 3
        out._obj.violationTime = self.state[key]
        return 0


def test_nvml_is_read_through_ctypes_and_a_missing_function_leaves_its_field_out():
    from profuse.bench import clocks

    lib = FakeNvmlLib({"sm": 1980, "mw": 650_000, "mj": 1_000_000, "temp": 61, "reasons": 0x1,
                       "power_ns": 0, "thermal_ns": 0})  # fmt: skip
    nvml = clocks.Nvml(lib, clocks.ctypes.c_void_p(1234))
    clock = FakeClock()
    mon = clocks.ClockMonitor(nvml, clock)
    mon.start()
    clock.now += 2.0
    lib.state["mj"] += 1_300_000  # 1300 J over 2 s: 650 W mean
    s = mon.stop()
    assert (s.sm_mhz, s.power_w, s.temperature_c, s.reasons, s.throttled) == (1980, 650.0, 61, [], False)
    assert s.power_violation_s == 0 and s.to_dict()["reasons"] == []
    lib.state.update(reasons=0x4 | 0x1)
    del lib.state["mj"], lib.state["thermal_ns"]
    mon.start()
    lib.state["power_ns"] += 250_000_000
    s = mon.stop()
    assert s.power_w == 650.0  # no energy counter: the reading at the trial's end
    assert s.reasons == ["SW power cap"] and s.throttled and s.power_violation_s == 0.25
    assert "thermal_violation_s" not in s.to_dict() and s.to_dict()["throttled"] is True
    assert clocks.load_nvml(torch.device("cpu")) is None  # nothing at all on a CPU


def test_load_nvml_finds_the_device_by_uuid_or_gives_up(monkeypatch):
    from profuse.bench import clocks

    lib = FakeNvmlLib({"sm": 1})

    class Props:
        uuid = "6b5f9c3a-0000-1111-2222-333344445555"

    monkeypatch.setattr(clocks.torch.cuda, "get_device_properties", lambda i: Props())
    nvml = clocks.load_nvml(torch.device("cuda", 0), loader=lambda name: lib)
    assert nvml is not None and lib.handles == [b"GPU-6b5f9c3a-0000-1111-2222-333344445555"]

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    assert clocks.load_nvml(torch.device("cuda", 0), loader=missing) is None


class FakeMonitor:
    """A ClockMonitor that replays readings: the trials in `hot` throttled."""

    def __init__(self, hot: set[int]):
        from profuse.bench.clocks import ClockSample

        self.sample, self.hot, self.n = ClockSample, hot, 0

    def start(self):
        pass

    def stop(self):
        self.n += 1
        throttled = self.n in self.hot
        return self.sample(
            sm_mhz=1410 if throttled else 1980, power_w=700.0, reasons=["SW power cap"] if throttled else [],
            reason_bits=0x4 if throttled else 0, power_violation_s=0.1 if throttled else 0.0,
        )  # fmt: skip


def test_each_trial_s_clocks_are_recorded_and_throttling_is_warned():
    res = fake_compare({"a": 1e-3, "b": 2e-3}, "a", trials=6, monitor=FakeMonitor({2, 5}))
    assert len(res.clocks) == 6 and [c.throttled for c in res.clocks] == [
        False,
        True,
        False,
        False,
        True,
        False,
    ]
    (warning,) = [w for w in res.warnings if "throttled" in w]
    assert warning.startswith("WARNING: the GPU throttled in 2 of 6 trials (SW power cap; held back 0.2 s")
    assert "SM clock 1410-1980 MHz" in warning
    d = json.loads(json.dumps(res.to_dict()))
    assert d["clocks"][1] == {"sm_mhz": 1410, "power_w": 700.0, "reasons": ["SW power cap"],
                              "power_violation_s": 0.1, "throttled": True}  # fmt: skip
    cool = fake_compare({"a": 1e-3, "b": 2e-3}, "a", trials=4, monitor=FakeMonitor(set()))
    assert not any("throttled" in w for w in cool.warnings)
    assert "clocks" not in fake_compare({"a": 1e-3, "b": 2e-3}, "a", trials=3).to_dict()  # a CPU: absent


# --------------------------------------------------------------------------------------------
# Host time that cannot include waiting for the GPU
# --------------------------------------------------------------------------------------------


class FakeGpu:
    """A GPU held by a sleep and a launch queue of `depth`: a call of `launches` launches, each
    after `own_s` of the CPU's own work, costing the CPU `launch_s` and the GPU `kernel_s`.
    issue() plays one held issue and says whether the hold ended first; traced_issue() returns
    the trace it would leave."""

    def __init__(
        self, launches: int, launch_s: float, kernel_s: float, own_s: float = 0.0, depth: int = 1000
    ):
        self.launches, self.launch_s, self.kernel_s = launches, launch_s, kernel_s
        self.own_s, self.depth = own_s, depth
        self.holds: dict[int, list[float]] = {}  # by the call issued

    def _play(self, hold_s: float):
        """(host seconds, filled, [(start, dur) of each launch call]) from t = 0."""
        t, calls, gpu_free = 0.0, [], hold_s  # the GPU starts on the call's kernels when the hold ends
        done: list[float] = []  # when each kernel finishes
        for i in range(self.launches):
            t += self.own_s
            start = t
            if i >= self.depth:  # the queue is full until kernel i - depth has finished
                t = max(t, done[i - self.depth])
            t += self.launch_s
            calls.append((start, t - start))
            begin = max(gpu_free, t)
            gpu_free = begin + self.kernel_s
            done.append(gpu_free)
        return t, t > hold_s, calls

    def issue(self, fn, hold_s):
        self.holds.setdefault(id(fn), []).append(hold_s)
        fn()
        t, filled, _ = self._play(hold_s)
        return t, filled

    def traced_issue(self, fn, hold_s):
        fn()
        t, _, calls = self._play(hold_s)
        us = 1e6
        events = [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": -10.0, "dur": 5.0,
             "args": {"correlation": 1}},
            {"ph": "X", "cat": "kernel", "name": "at::cuda::(anonymous namespace)::spin_kernel(long)",
             "ts": 0.0, "dur": hold_s * us, "args": {"correlation": 1}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventRecord", "ts": -4.0, "dur": 2.0, "args": {}},
        ]  # fmt: skip
        for k, (start, dur) in enumerate(calls):
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": start * us,
                           "dur": dur * us, "args": {"correlation": 10 + k}})  # fmt: skip
        events += [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t * us + 3, "dur": 4.0,
             "args": {"correlation": 2}},
            {"ph": "X", "cat": "kernel", "name": "spin_kernel", "ts": t * us + 50, "dur": 1.0,
             "args": {"correlation": 2}},
        ]  # fmt: skip
        return events


def test_a_call_that_fits_the_queue_has_its_exact_host_time():
    """500 launches of 5 us on the CPU, 20 us on the GPU: held, the CPU issues them all in 2.5 ms
    and never waits; the older reading (wall time, the GPU running behind) would be the same here."""
    gpu = FakeGpu(launches=500, launch_s=5e-6, kernel_s=20e-6)
    res = fake_compare(
        {"a": 1e-3, "b": 1e-3}, "a", trials=5, host_issuer=gpu, design=TrialDesign(host_rounds=3)
    )
    t = res.timings["a"]
    assert t.host_s == pytest.approx(2.5e-3) and not t.host_is_lower_bound
    assert t.host.filled == [False] * 3 and t.host.trace is None
    for holds in gpu.holds.values():
        assert holds[0] == pytest.approx(2e-3)  # the first hold: too short, so once more, longer
        assert holds[1] == pytest.approx(2 * 2.5e-3)
        assert holds[2:] == pytest.approx([5e-3] * 2)  # then twice the last exact time
    d = json.loads(json.dumps(res.to_dict()))
    assert d["timings"]["a"]["host_is_lower_bound"] is False and d["timings"]["a"]["host"]["method"] == "held"


def test_a_call_that_fills_the_queue_is_at_least_its_own_cpu_time():
    """2,813 launches (the Llama-3.2-1B eager step), each 20 us of the CPU's own work and a 30 us
    launch, and 66 us on the GPU: the CPU needs 141 ms, the GPU 186 ms. The queue fills whatever
    the hold, so the host time is a lower bound, read from the trace: the CPU's time outside the
    launch calls, 56 ms; the trace's estimate (each launch's time past its cheapest) is the 141 ms."""
    gpu = FakeGpu(launches=2813, launch_s=30e-6, kernel_s=66e-6, own_s=20e-6)
    res = fake_compare(
        {"a": 1e-3, "b": 1e-3}, "a", trials=3, host_issuer=gpu, design=TrialDesign(host_rounds=2)
    )
    t = res.timings["a"]
    assert t.host.filled == [True, True] and t.host_is_lower_bound
    assert t.host.trace.calls == 2813 + 1  # the launches and the hold's event record
    assert t.host.trace.estimate_s == pytest.approx(2813 * 50e-6, rel=1e-3)
    assert t.host_s == t.host.trace.at_least_s == pytest.approx(2813 * 20e-6, rel=1e-3)
    assert max(max(h) for h in gpu.holds.values()) <= host.HOLD_CAP_S
    # each filled round's wall time counted the wait: more than the CPU's 141 ms, every time
    assert min(t.host.times_s) > 2813 * 50e-6


def test_the_trace_reading_counts_the_cpu_s_own_time_outside_cuda_calls():
    us = 1e6
    ev = lambda cat, ts, dur, corr=None, name="cudaLaunchKernel": {
        "ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
        "args": {"correlation": corr} if corr else {},
    }  # fmt: skip
    events = [
        ev("cuda_runtime", 0, 10, 1),  # the hold's launch: the window opens at 10 us
        ev("kernel", 20, 5000, 1, name="spin_kernel"),
        ev("cuda_runtime", 30, 10, 2),  # 10 us in a launch
        ev("cuda_runtime", 60, 400, 3),  # a launch that waited 400 us for a queue slot
        ev("cuda_driver", 500, 20, 4, name="cuLaunchKernel"),  # Triton's launch: a driver call...
        ev("cuda_driver", 505, 5, 5, name="cuGetProcAddress"),  # ... with another nested in it
        ev("cuda_runtime", 1010, 10, 6),  # the end marker's launch: the window closes at 1010 us
        ev("kernel", 6000, 1, 6, name="spin_kernel"),
        {"ph": "i", "cat": "cuda_runtime", "ts": 700},  # not a complete event
    ]
    tr = host.host_from_trace(events)
    assert tr.window_s == pytest.approx(1000 / us)
    assert tr.runtime_s == pytest.approx((10 + 400 + 20) / us) and tr.calls == 4
    # the launch's own cost is its cheapest (10 us): 390 us of waiting; the nested call is not counted
    assert tr.waiting_s == pytest.approx(390 / us)
    assert tr.at_least_s == pytest.approx(570 / us) and tr.estimate_s == pytest.approx(610 / us)
    assert host.host_from_trace(events[2:6]) is None  # no sleep kernels: no window
    assert json.loads(json.dumps(tr.to_dict()))["at_least_s"] == pytest.approx(570 / us)


def test_a_filled_queue_without_a_trace_leaves_no_host_figure():
    class NoTrace(FakeGpu):
        def traced_issue(self, fn, hold_s):
            return None

    gpu = NoTrace(launches=3000, launch_s=5e-6, kernel_s=50e-6)
    res = fake_compare(
        {"a": 1e-3, "b": 1e-3}, "a", trials=3, host_issuer=gpu, design=TrialDesign(host_rounds=2)
    )
    assert res.timings["a"].host_s is None and res.timings["a"].host_is_lower_bound
    assert not res.host_bound("a")


def test_trial_design_rejects_bad_values():
    for kw in (
        dict(calls=0),
        dict(discard=-1),
        dict(steady_spread=1.5),
        dict(max_trials=-1),
        dict(host_rounds=0),
    ):
        with pytest.raises(ValueError):
            TrialDesign(**kw)
    assert REFEREE.calls >= 10 and REFEREE.discard == 1 and REFEREE.balanced and REFEREE.max_trials == 30


# --------------------------------------------------------------------------------------------
# On a GPU: the timers' blocks and the held issue (skipped here; the lead's H200 runs them)
# --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("timing", ["device", "loop", "graph"])
def test_every_cuda_timer_times_blocks_of_k_calls_after_the_discarded(timing):
    from profuse.timers import make_timer

    dev = torch.device("cuda")
    x = torch.zeros(4096, device=dev)
    count = {"n": 0}

    def fn():
        count["n"] += 1
        x.add_(1)

    timer = make_timer(timing, dev, flush_l2=False)
    (sec,) = timer.time_blocks([fn], calls=5, discard=1)
    assert count["n"] == 6 and sec > 0
    assert x[0].item() == 6  # every call ran


@needs_cuda
def test_held_issue_says_when_the_queue_filled_and_the_trace_reads_it():
    """10 launches under a 1 s hold never fill the launch queue; 10,000 do (a stream holds about
    a thousand): the second is `filled`, and its trace gives a lower bound under its window."""
    from profuse.timers import HeldIssue

    dev = torch.device("cuda")
    held = HeldIssue(dev)
    if not held.available:
        pytest.skip("this torch has no torch.cuda._sleep")
    x = torch.zeros(256, device=dev)
    few = lambda: [x.add_(1) for _ in range(10)]
    many = lambda: [x.add_(1) for _ in range(10_000)]
    assert held.issue(few, 1.0)[1] is False
    assert held.issue(many, 1.0)[1] is True, "10,000 launches did not fill the launch queue"
    events = held.traced_issue(many, 0.05)
    if events is None:
        pytest.skip("torch.profiler recorded no CUDA activity here")
    tr = host.host_from_trace(events)
    assert tr is not None and tr.calls >= 10_000
    assert 0 < tr.at_least_s <= tr.estimate_s <= tr.window_s
