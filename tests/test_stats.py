"""profuse.bench.stats: the paired speedup CI, the unpaired ratio of two runs, and rebasing a saved run.

Synthetic arrays whose ratio is known; the rebase test reads the session's saved sweep.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cases import run_cli

from profuse.bench import DEFAULT_TRIALS, stats
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, STATISTIC, Speedup, speedup_ci
from profuse.report.units import fmt_speedup

# --------------------------------------------------------------------------------------------
# speedup_ci on arrays
# --------------------------------------------------------------------------------------------


def test_point_estimate_is_the_ratio_of_medians():
    rng = np.random.default_rng(0)
    base = rng.uniform(1.0, 3.0, 25)
    var = rng.uniform(0.5, 1.5, 25)
    sp = speedup_ci(base, var, n_resamples=500)
    assert sp.median == np.median(base) / np.median(var)  # exact, not approximately
    assert sp.low <= sp.median <= sp.high
    assert sp.confidence == 0.95
    assert "ratio of medians" in STATISTIC


def test_identical_data_gives_no_measurable_gain_without_nan():
    """base == var: every paired resample has ratio exactly 1, BCa degenerates, and the fallback
    still gives a finite interval, containing 1.0."""
    data = np.random.default_rng(1).uniform(1e-3, 2e-3, 20)
    sp = speedup_ci(data, data.copy(), n_resamples=500)
    assert all(math.isfinite(x) for x in (sp.median, sp.low, sp.high))
    assert sp.method != "exact"  # the data vary: this went through the bootstrap
    assert sp.low <= 1.0 <= sp.high
    assert sp.verdict == NO_GAIN and not sp.measurable


def test_constant_data_gives_exact_interval():
    sp = speedup_ci([2.0] * 5, [1.0] * 5)
    assert (sp.median, sp.low, sp.high) == (2.0, 2.0, 2.0)
    assert sp.verdict == FASTER


def test_heavily_tied_data_falls_back_without_nan():
    """Mostly ties: the BCa acceleration is 0/0; the interval must come back finite anyway."""
    base = np.array([2.0] * 19 + [2.5])
    var = np.array([1.0] * 20)
    sp = speedup_ci(base, var, n_resamples=500, method="BCa")  # 20 trials would take order statistics
    assert all(math.isfinite(x) for x in (sp.median, sp.low, sp.high))
    assert sp.low <= sp.median <= sp.high
    assert sp.method == "percentile"  # the fallback, taken because BCa came back NaN
    assert sp.verdict == FASTER


@pytest.mark.parametrize(("base_mean", "var_mean", "verdict"), [(2.0, 1.0, FASTER), (1.0, 2.0, SLOWER)])
def test_clearly_separated_timings(base_mean, var_mean, verdict):
    rng = np.random.default_rng(2)
    base = base_mean * (1 + 0.05 * rng.random(15))
    var = var_mean * (1 + 0.05 * rng.random(15))
    sp = speedup_ci(base, var, n_resamples=1000)
    assert sp.verdict == verdict and sp.measurable
    if verdict == FASTER:
        assert sp.low > 1.0
    else:
        assert sp.high < 1.0


def test_bootstrap_keeps_trials_paired():
    """Drift that slows a whole trial (here 3x, like a clock throttling) slows both sides of the
    pair, so a paired bootstrap sees through it: the interval stays narrow around the true 1.2.
    Resampling the two sides independently would mix slow and fast trials and straddle 1.0."""
    rng = np.random.default_rng(4)
    drift = rng.uniform(1.0, 3.0, 20)
    base = 1.2 * drift * (1 + 0.01 * rng.random(20))
    var = drift * (1 + 0.01 * rng.random(20))
    sp = speedup_ci(base, var, n_resamples=1000)
    assert sp.low <= 1.2 <= sp.high
    assert sp.high - sp.low < 0.05, f"CI {sp.low:.3f}-{sp.high:.3f} is as wide as unpaired data"
    assert sp.verdict == FASTER
    # Exactly proportional pairs: every paired resample has ratio 2, so the interval is the point.
    exact = speedup_ci(2 * drift, drift, n_resamples=500)
    assert exact.low == pytest.approx(2.0) and exact.high == pytest.approx(2.0)


def test_verdict_follows_the_interval_only():
    assert Speedup(1.5, 1.01, 2.0, 0.95, "BCa").verdict == FASTER
    assert Speedup(0.7, 0.5, 0.99, 0.95, "BCa").verdict == SLOWER
    assert Speedup(1.5, 0.99, 2.0, 0.95, "BCa").verdict == NO_GAIN  # a big median is not enough
    assert Speedup(1.0, 1.0, 1.0, 0.95, "exact").verdict == NO_GAIN


def test_same_seed_same_interval():
    rng = np.random.default_rng(3)
    base, var = rng.uniform(1, 2, 12), rng.uniform(1, 2, 12)
    a, b = speedup_ci(base, var, n_resamples=300, seed=7), speedup_ci(base, var, n_resamples=300, seed=7)
    assert (a.low, a.high) == (b.low, b.high)


@pytest.mark.parametrize(
    ("base", "var"),
    [
        ([1.0, 2.0], [1.0, 2.0, 3.0]),  # not paired
        ([[1.0, 2.0]], [[1.0, 2.0]]),  # not 1-D
        ([1.0], [1.0]),  # one trial: no interval
        ([1.0, 0.0], [1.0, 1.0]),  # a zero time
        ([1.0, 1.0], [1.0, -1.0]),  # a negative time
        ([1.0, math.nan], [1.0, 1.0]),
        ([1.0, 1.0], [1.0, math.inf]),
    ],
)
def test_speedup_ci_rejects_bad_input(base, var):
    with pytest.raises(ValueError):
        speedup_ci(base, var)


# --------------------------------------------------------------------------------------------
# Two saved runs: the unpaired ratio; a saved run over another baseline
# --------------------------------------------------------------------------------------------


def test_time_ratio_ci_sees_a_real_difference_and_no_invented_one():
    rng = np.random.default_rng(0)
    a = 1.0 + 0.02 * rng.standard_normal(20)
    faster = 0.5 + 0.01 * rng.standard_normal(25)  # a different trial count: the runs are unpaired
    r = stats.time_ratio_ci(a, faster)
    assert r.high < 1.0 and r.low <= r.median <= r.high and r.verdict.startswith("B faster")
    same = 1.0 + 0.02 * rng.standard_normal(20)
    assert stats.time_ratio_ci(a, same).verdict == "no measurable difference"


def test_report_vs_recomputes_speedups_from_the_saved_trials(saved):
    """The saved sweep's trials are replaced by seeded synthetic ones (a real clock's readings
    depend on how busy the machine is: under two busy loops a 3-trial interval once came out
    beside its own point), three trials each, as the sweep took them; one size gets trials whose
    BCa interval lands 1 ulp beside its point unless the code holds the point."""
    out, _ = saved["a"]
    data = json.loads((out / "results.json").read_text())
    rng = np.random.default_rng(11)
    for i, run in enumerate(data["runs"]):
        timings = run["comparison"]["timings"]
        if i == 0:  # rms_norm over eager: point 0.9, BCa low 0.9000000000000001 without the guard
            timings["rms_norm"]["times_s"], timings["eager"]["times_s"] = [1.7, 2.1, 1.8], [1.0, 2.1, 2.0]
        else:
            for t in timings.values():
                t["times_s"] = list(rng.uniform(1e-4, 3e-4, 3))
    rebased = stats.rebase(data, "rms_norm")
    for run, old in zip(rebased["runs"], data["runs"]):
        times = {k: np.array(v["times_s"]) for k, v in old["comparison"]["timings"].items()}
        eager = run["results"]["eager"]["speedup"]
        # the point estimate is the ratio of the saved medians, rms_norm over eager
        assert eager["median"] == np.median(times["rms_norm"]) / np.median(times["eager"])
        assert eager["low"] <= eager["median"] <= eager["high"]
        paired = eager["per_trial"]
        assert paired["low"] <= paired["median"] <= paired["high"]
        assert run["results"]["rms_norm"]["speedup"] is None  # the new baseline
        assert old["results"]["eager"]["speedup"] is None  # the original is left alone
    code, stdout, _ = run_cli("report", str(out / "results.json"), "--vs", "rms_norm")
    # the label, as its rows say it: 3 trials' order statistics (the min and max) cover 75%
    assert code == 0 and "speedup vs eager F.rms_norm (75% CI)" in stdout


# --------------------------------------------------------------------------------------------
# An interval holds its point estimate
# --------------------------------------------------------------------------------------------


def test_an_endpoint_a_rounding_away_from_the_point_is_snapped_onto_it():
    """3 trials [1.7, 2.1, 1.8] / [1.0, 2.1, 2.0]: the point is 0.9, and scipy's BCa returns a low
    of 0.9000000000000001 (its percentile interpolated): a CI that excludes its own median."""
    sp = speedup_ci([1.7, 2.1, 1.8], [1.0, 2.1, 2.0], n_resamples=200, seed=0, method="BCa")
    assert sp.median == pytest.approx(0.9) and sp.low <= sp.median <= sp.high
    assert sp.low == sp.median and sp.method == "BCa"


def test_an_interval_that_misses_its_point_falls_back_and_then_widens(monkeypatch):
    """Where BCa's interval misses its point by more than rounding, the percentile interval is
    taken; where that misses too, the interval is widened to the point and says so."""
    from types import SimpleNamespace

    calls = []

    def off_by_far(data, statistic, method, **kw):
        calls.append(method)
        point = float(statistic(*data))
        return SimpleNamespace(confidence_interval=SimpleNamespace(low=point * 1.1, high=point * 1.2))

    monkeypatch.setattr(stats._sps, "bootstrap", off_by_far)
    base, var = [2.0, 2.2, 2.1, 1.9], [1.0, 1.1, 1.0, 1.2]
    low, high, method = stats.bootstrap_ratio_ci(
        np.array(base), np.array(var), stats._ratio_of_medians, True, 0.95, 100, 0
    )
    point = np.median(base) / np.median(var)
    assert calls == ["BCa", "percentile"]
    assert low == point and high == pytest.approx(point * 1.2)
    assert method == "percentile, widened to its point"


# --------------------------------------------------------------------------------------------
# The paired statistic: the median of per-trial ratios
# --------------------------------------------------------------------------------------------


def test_per_trial_statistic_is_the_median_of_per_trial_ratios():
    rng = np.random.default_rng(5)
    base = rng.uniform(1.0, 3.0, 15)
    var = base / rng.uniform(1.1, 1.3, 15)
    sp = speedup_ci(base, var, n_resamples=500)
    assert sp.per_trial.median == pytest.approx(np.exp(np.median(np.log(base / var))), rel=1e-12)
    assert sp.per_trial.low <= sp.per_trial.median <= sp.per_trial.high
    assert 1.1 <= sp.per_trial.low and sp.per_trial.high <= 1.3
    d = json.loads(json.dumps(sp.to_dict()))
    assert d["per_trial"]["median"] == sp.per_trial.median and d["per_trial"]["verdict"] == FASTER
    assert "per_trial" not in d["per_trial"]
    assert speedup_ci(base, var, n_resamples=200, per_trial=False).per_trial is None


def test_per_trial_statistic_uses_the_pairing_where_the_ratio_of_medians_cannot():
    """Trials whose times swing 3x together (drift) and a variant 1% faster in every trial: the
    ratio of medians can pick its two medians from different trials; the per-trial ratio is 1.01
    in each, so its interval is tight around it."""
    rng = np.random.default_rng(6)
    drift = rng.uniform(1.0, 3.0, 21)
    base, var = 1.01 * drift, drift * (1 + 1e-4 * rng.random(21))
    sp = speedup_ci(base, var, n_resamples=500)
    assert sp.per_trial.median == pytest.approx(1.01, rel=2e-4)
    assert sp.per_trial.high - sp.per_trial.low < 2e-4


# --------------------------------------------------------------------------------------------
# The verdict and its tie set
# --------------------------------------------------------------------------------------------


def paired_trials(ratios: dict[str, float], trials: int, cv: float, seed: int, drift: float = 0.01):
    """Paired trial times: a shared per-trial drift (the machine), each variant's own noise
    (CV `cv`) and its true time `ratio`."""
    rng = np.random.default_rng(seed)
    common = 0.1 * (1 + drift * rng.standard_normal(trials))
    return {n: list(r * common * (1 + cv * rng.standard_normal(trials))) for n, r in ratios.items()}


def test_the_h200_llama_run_s_four_way_tie_is_a_tie():
    """The H200 Llama-3.2-1B run's paired figures: fused, cudagraphs and compile+fused 1.003-1.004
    of compile, with trials varying ~0.3%: no winner among them; eager 18% slower is called."""
    ratios = {"compile": 1.0, "fused": 1.003, "cudagraphs": 1.003, "compile+fused": 1.004, "eager": 1.18}
    v = stats.tie_verdict(paired_trials(ratios, 12, 0.003, seed=0), n_resamples=2000)
    assert v.winner in ("compile", "fused", "cudagraphs")
    assert set(v.tie) == {"compile", "fused", "cudagraphs", "compile+fused"}
    assert "eager" not in v.tied_with and v.called.keys() == {"eager"}
    assert v.text.startswith(f"{v.tie[0]}, ") and " tie (within " in v.text and "next: eager, " in v.text
    assert 0 < v.within < 0.02
    assert v.confidence_each == pytest.approx(1 - 0.05 / 4) and v.correction == "Bonferroni"
    trials = paired_trials(ratios, 12, 0.003, seed=0)
    for name, sp in v.ratios.items():
        assert sp.confidence == v.confidence_each and sp.per_trial is None
        assert sp.median == pytest.approx(
            np.exp(np.median(np.log(np.divide(trials[name], trials[v.winner]))))
        )
        assert (name in v.tied_with) == (sp.low <= 1 + v.band)


def test_a_clear_winner_wins_and_a_wide_interval_ties():
    v = stats.tie_verdict(paired_trials({"a": 1.0, "b": 1.05}, 20, 0.002, seed=1), n_resamples=1000)
    assert (v.winner, v.tied_with) == ("a", []) and v.within == 0.0
    assert v.text.startswith("a wins; next: b, 5") and "slower" in v.text
    lo, hi = v.ratios["b"].low, v.ratios["b"].high
    assert 1.04 < lo < 1.05 < hi < 1.06
    # 5% slower by the median, but so noisy that the interval reaches under 1.01: not told apart
    noisy = paired_trials({"a": 1.0, "b": 1.05}, 6, 0.1, seed=2, drift=0.0)
    w = stats.tie_verdict(noisy, n_resamples=1000)
    assert w.tied_with and w.within > 0.01 and " tie (within " in w.text


def test_identical_variants_tie_in_most_seeds():
    """Two identical variants: the verdict calls one slower (beyond the band) rarely; 20 seeds."""
    ties = sum(
        bool(stats.tie_verdict(paired_trials({"a": 1.0, "b": 1.0}, 12, 0.01, s), n_resamples=500).tied_with)
        for s in range(20)
    )
    assert ties >= 18


@pytest.mark.parametrize(
    ("x", "text"), [(0.006, "0.6%"), (0.0123, "1.2%"), (0.18, "18%"), (1.37, "137%"), (0.0004, "0.04%")]
)
def test_percentages_read_as_a_person_writes_them(x, text):
    assert stats._pct(x) == text


def test_a_verdict_of_one_and_its_dict():
    v = stats.tie_verdict({"only": [1.0, 1.1, 0.9]})
    assert (v.winner, v.tied_with, v.ratios, v.text) == (
        "only",
        [],
        {},
        "only alone: nothing to compare it with",
    )
    d = json.loads(json.dumps(stats.tie_verdict(paired_trials({"a": 1, "b": 1.2}, 8, 0.01, 3)).to_dict()))
    assert d["winner"] == "a" and d["tied_with"] == [] and d["band"] == stats.TIE_BAND
    assert d["ratios"]["b"]["low"] > 1 and d["statistic"] == stats.PER_TRIAL_STATISTIC


@pytest.mark.parametrize(
    ("times", "kw", "match"),
    [
        ({}, {}, "at least one"),
        ({"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0]}, {}, "paired"),
        ({"a": [1.0, 2.0]}, {"alpha": 1.5}, "alpha"),
        ({"a": [1.0, 2.0]}, {"band": -0.1}, "band"),
        ({"a": [1.0]}, {}, "at least 2"),
    ],
)
def test_tie_verdict_rejects_bad_input(times, kw, match):
    with pytest.raises(ValueError, match=match):
        stats.tie_verdict(times, **kw)


def test_noise_over_a_called_difference_is_warned():
    """A drift shared by every trial (CV 5%) and a variant 3% slower in each: the paired interval
    calls it, and the warning says the trials' own noise is larger than the difference called."""
    v = stats.tie_verdict(
        paired_trials({"a": 1.0, "b": 1.03}, 16, 0.001, seed=4, drift=0.05), n_resamples=1000
    )
    assert v.tied_with == [] and v.called["b"] == pytest.approx(0.03, abs=0.002)
    (warning,) = v.warnings
    assert warning.startswith("WARNING: trial noise (") and "exceeds the smallest difference" in warning
    assert "(b 3" in warning
    quiet = stats.tie_verdict(paired_trials({"a": 1.0, "b": 1.03}, 16, 0.001, seed=4, drift=0.001))
    assert quiet.warnings == []


# --------------------------------------------------------------------------------------------
# Drift and noise
# --------------------------------------------------------------------------------------------


def test_a_drift_through_the_trials_is_a_trend():
    """cudagraphs on the H200: 167.7 -> 165.0 ms through 12 trials, r = -0.64."""
    rng = np.random.default_rng(7)
    times = np.linspace(167.7e-3, 165.0e-3, 12) * (1 + 0.002 * rng.standard_normal(12))
    tr = stats.trend(times)
    assert tr.drifting and tr.r < -stats.TREND_R and tr.p < stats.TREND_P and tr.trials == 12
    assert tr.first_s > tr.last_s
    warning = stats.trend_warning("cudagraphs", tr)
    assert (
        warning.startswith("WARNING cudagraphs: its times drifted through the trials (")
        and "Spearman r -" in warning
    )
    steady = stats.trend(1e-3 * (1 + 0.002 * np.random.default_rng(8).standard_normal(30)))
    assert not steady.drifting
    assert stats.trend([1.0] * 10) is None and stats.trend([1.0, 2.0, 3.0]) is None
    assert json.loads(json.dumps(tr.to_dict()))["drifting"] is True


def test_noise_is_a_robust_coefficient_of_variation():
    assert stats.noise([1.0, 1.0, 1.0]) == 0.0 and stats.noise([2.0]) == 0.0
    # median 2, absolute deviations [1, 0, 0, 0, 98] -> MAD 0: one wild trial moves nothing
    assert stats.noise([1.0, 2.0, 2.0, 2.0, 100.0]) == 0.0
    assert stats.noise([1.0, 2.0, 3.0]) == pytest.approx(1.4826 * 1.0 / 2.0)


# --------------------------------------------------------------------------------------------
# What bounds a step: one rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("idle", "host", "lower", "device", "word", "says"),
    [
        (None, None, False, None, "host-bound", "on a CPU"),  # on_cpu below
        (62.0, 0.01, False, 0.02, "launch-bound", "idles 62.0%"),
        (4.3, 0.222, False, 0.187, "device-bound", "idles 4.3%"),  # the H200 eager Llama step
        (4.3, 0.15, True, 0.187, "device-bound", "keeps ahead"),
        (25.0, 0.03, False, 0.02, "host-bound", "issues it in 30 ms"),
        (25.0, 0.01, False, 0.02, "device-bound", "its kernels take 20 ms"),
        (25.0, 0.03, True, 0.02, "host-bound", "at least 30 ms"),
        (25.0, 0.01, True, 0.02, "", "only a lower bound"),
        (25.0, None, False, 0.02, "", "no host time"),
        (None, 0.03, False, 0.02, "host-bound", "issues it in 30 ms"),
        (None, 0.01, False, 0.02, "device-bound", "its kernels take 20 ms"),
        (None, 0.01, False, None, "", "no device time"),
    ],
)
def test_bound_follows_one_rule(idle, host, lower, device, word, says):
    b = stats.bound(idle, host, lower, device, on_cpu=idle is None and host is None)
    assert b.word == word and says in b.why, b
    assert json.loads(json.dumps(b.to_dict())) == {"word": word, "why": b.why}


def test_bound_s_thresholds_are_the_profile_s():
    from profuse.attribution import LAUNCH_BOUND_IDLE_PCT

    assert stats.bound(LAUNCH_BOUND_IDLE_PCT + 0.1, None, False, None).word == "launch-bound"
    assert stats.bound(stats.DEVICE_BOUND_IDLE_PCT - 0.1, None, False, None).word == "device-bound"
    assert stats.bound(stats.DEVICE_BOUND_IDLE_PCT, None, False, None).word == ""


# --------------------------------------------------------------------------------------------
# The interval fits the count: order statistics below BCA_LEAST_TRIALS, BCa from there
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 8, 12, 30])
def test_order_statistics_coverage_is_the_binomial_sum(n):
    from scipy.stats import binom

    k, coverage = stats.median_ranks(n, 0.95)
    # the chosen pair x_(k), x_(n+1-k) covers the median with 1 - 2 P(B <= k-1), B ~ Bin(n, 1/2)
    assert coverage == pytest.approx(1 - 2 * binom.cdf(k - 1, n, 0.5), abs=1e-12)
    for j in range(1, (n + 1) // 2 + 1):
        assert stats.median_coverage(n, j) == pytest.approx(
            binom.cdf(n - j, n, 0.5) - binom.cdf(j - 1, n, 0.5)
        )
    if coverage >= 0.95 and k < (n + 1) // 2:  # the narrowest that reaches 95%: one rank in misses it
        assert stats.median_coverage(n, k + 1) < 0.95
    expected = {4: (1, 0.875), 8: (1, 0.9921875), 12: (3, 0.96142578125), 30: (10, 0.957226)}[n]
    assert k == expected[0] and coverage == pytest.approx(expected[1], abs=1e-6)


def test_four_trials_are_never_called_a_95_percent_ci():
    rng = np.random.default_rng()
    base = 2.0 * (1 + 0.03 * rng.random(4))
    var = 1.5 * (1 + 0.03 * rng.random(4))
    sp = speedup_ci(base, var)
    assert sp.method.startswith(stats.ORDER_STATISTICS) and sp.coverage == 0.875 and sp.trials == 4
    ratios = np.sort(base / var)
    assert sp.per_trial.low == ratios[0] and sp.per_trial.high == ratios[-1]  # min and max: 87.5%
    assert sp.low <= sp.median <= sp.high  # the ratio of medians kept inside its interval
    assert stats.ci_label(sp) == "87.5% CI" and stats.ci_label(sp.to_dict()) == "87.5% CI"
    assert "87.5% CI" in fmt_speedup(sp, "eager") and "95%" not in fmt_speedup(sp, "eager")


def test_the_method_switches_at_the_count_where_bca_is_trusted():
    rng = np.random.default_rng()
    n = stats.BCA_LEAST_TRIALS
    assert stats.ci_method(n - 1) == stats.ORDER_STATISTICS and stats.ci_method(n) == stats.BOOTSTRAP
    assert DEFAULT_TRIALS >= n  # the default count gets the bootstrap
    for trials, method, label in ((12, stats.ORDER_STATISTICS, "96.1% CI"), (n, "BCa", "95% CI")):
        base = 2.0 * (1 + 0.05 * rng.random(trials))
        var = 1.0 * (1 + 0.05 * rng.random(trials))
        sp = speedup_ci(base, var, n_resamples=300)
        assert sp.method == method and sp.per_trial.method == method, trials
        assert stats.ci_label(sp) == label and sp.verdict == FASTER
    # 12 trials: the 3rd smallest and 3rd largest per-trial ratio
    base, var = 2.0 * (1 + 0.05 * rng.random(12)), 1 + 0.05 * rng.random(12)
    sp = speedup_ci(base, var)
    ratios = np.sort(base / var)
    assert (sp.per_trial.low, sp.per_trial.high) == (ratios[2], ratios[9])
    with pytest.raises(ValueError, match="method"):
        speedup_ci(base, var, method="jackknife")


def test_order_statistics_cover_the_median_as_often_as_they_say():
    """20000 draws of 8 paired ratios from a skewed distribution (lognormal) with a known median:
    the min-max interval must hold it 1 - 2/2^8 = 99.2% of the time, whatever the distribution."""
    rng = np.random.default_rng()
    draws = np.exp(rng.normal(0.1, 0.5, size=(20000, 8)))  # median exp(0.1)
    k, coverage = stats.median_ranks(8, 0.95)
    s = np.sort(draws, axis=1)
    held = np.mean((s[:, k - 1] <= np.exp(0.1)) & (np.exp(0.1) <= s[:, 8 - k]))
    assert abs(held - coverage) < 4 * np.sqrt(coverage * (1 - coverage) / 20000)


def test_the_verdict_prints_the_coverage_of_its_intervals():
    rng = np.random.default_rng()
    times = {"a": 1.0 + 0.01 * rng.random(8), "b": 1.2 + 0.01 * rng.random(8)}
    v = stats.tie_verdict(times, n_resamples=200)
    assert v.ratios["b"].method == stats.ORDER_STATISTICS
    assert f"{v.ratios['b'].coverage:.1%} CI" in v.text and v.ratios["b"].coverage == 0.9921875


def test_refit_recomputes_a_saved_step_by_the_method_that_fits_its_count():
    rng = np.random.default_rng()
    n = 12
    times = {"eager": 2.0 + 0.02 * rng.random(n), "compile": 1.6 + 0.02 * rng.random(n),
             "compile+fused": 1.5 + 0.02 * rng.random(n),
             "compile+loss": 1.55 + 0.02 * rng.random(n)}  # fmt: skip
    old = speedup_ci(times["eager"], times["compile"], n_resamples=200, method="BCa").to_dict()
    data = {
        "kind": "step",
        "comparison": {
            "baseline": "eager",
            "trials": n,
            "timings": {k: {"times_s": list(v)} for k, v in times.items()},
            "speedups": {"compile": old},
            "verdict": {"text": "saved"},
        },  # fmt: skip
        "results": {
            "eager": {"speedup": None},
            "compile": {"speedup": old},
            "compile+fused": {"speedup": old},
            "compile+loss": {"speedup": old},
        },  # fmt: skip
        "fusion_over_compile": old,
        "loss_over_compile": old,
        "verdict": {"text": "saved"},
    }
    new, methods = stats.refit(data)
    assert methods == ["BCa"] and data["results"]["compile"]["speedup"] is old  # the file left alone
    for name in ("compile", "compile+fused"):
        sp = new["results"][name]["speedup"]
        assert sp["method"].startswith(stats.ORDER_STATISTICS) and sp["coverage"] == pytest.approx(
            0.96142578125
        )
        ratios = np.sort(times["eager"] / times[name])
        assert (sp["per_trial"]["low"], sp["per_trial"]["high"]) == (ratios[2], ratios[9])
    for key, name in (("fusion_over_compile", "compile+fused"), ("loss_over_compile", "compile+loss")):
        over = new[key]
        assert over["median"] == pytest.approx(np.median(times["compile"]) / np.median(times[name]))
        assert over["method"].startswith(stats.ORDER_STATISTICS)
    assert new["verdict"] is None  # decided again from the trials by the report


def test_report_refit_recomputes_a_saved_sweep_and_says_so(saved, tmp_path):
    out, _ = saved["a"]
    data = json.loads((out / "results.json").read_text())
    for run in data["runs"]:
        for res in run["results"].values():
            if res.get("speedup"):
                res["speedup"].update(method="BCa")
                res["speedup"].pop("coverage", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    code, as_saved, _ = run_cli("report", str(path))
    assert code == 0 and "(95% CI)" in as_saved  # reported with the method it was made with
    code, text, _ = run_cli("report", str(path), "--refit")
    assert code == 0 and "(75% CI)" in text and "(95% CI)" not in text  # 3 trials: min-max, 75%
    assert "CIs recomputed from the saved paired trials" in text and "made by: BCa" in text
