"""profuse.bench.stats: the paired speedup CI, the unpaired ratio of two runs, and rebasing a saved run.

Synthetic arrays whose ratio is known; the rebase test reads the session's saved sweep.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cases import run_cli

from profuse.bench import stats
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, STATISTIC, Speedup, speedup_ci

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
    sp = speedup_ci(base, var, n_resamples=500)
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
    out, _ = saved["a"]
    data = json.loads((out / "results.json").read_text())
    rebased = stats.rebase(data, "rms_norm")
    for run, old in zip(rebased["runs"], data["runs"]):
        times = {k: np.array(v["times_s"]) for k, v in old["comparison"]["timings"].items()}
        eager = rebased_sp = run["results"]["eager"]["speedup"]
        # the point estimate is the ratio of the saved medians, rms_norm over eager
        assert rebased_sp["median"] == pytest.approx(np.median(times["rms_norm"]) / np.median(times["eager"]))
        assert eager["low"] <= eager["median"] <= eager["high"]
        assert run["results"]["rms_norm"]["speedup"] is None  # the new baseline
        assert old["results"]["eager"]["speedup"] is None  # the original is left alone
    code, stdout, _ = run_cli("report", str(out / "results.json"), "--vs", "rms_norm")
    assert code == 0 and "speedup vs eager F.rms_norm (95% CI)" in stdout  # the label, as its rows say it
