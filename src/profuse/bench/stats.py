"""The speedup of one variant over a baseline, with a bootstrap confidence interval.

Statistic: the ratio of medians, median(baseline times) / median(variant times); above 1 means
the variant is faster. Trials are paired (trial i timed every variant once, interleaved), so the
bootstrap resamples whole trials and keeps each pair together: drift that slowed a trial slows
both sides of its pair, and the interval does not widen for it. Beside it, the paired statistic
(`Speedup.per_trial`): exp(median_i log(baseline_i / variant_i)), the median of the per-trial
ratios, which uses the pairing in the point estimate too.

The interval fits the count (`ci_method`): below BCA_LEAST_TRIALS paired trials, a
distribution-free interval for the median of the per-trial ratios from two of their order
statistics, with its exact coverage (a binomial sum, not a nominal level): with 4 trials the best
there is covers 87.5%, and it is printed as an 87.5% CI, never as a 95% one. From
BCA_LEAST_TRIALS trials on, the bootstrap (BCa).

Also here: the verdict over several variants with its tie set (`tie_verdict`), a drift through
the trials (`trend`), the trials' noise (`noise`), the one rule for device-, host- and
launch-bound (`bound`), the unpaired ratio of two saved runs (`time_ratio_ci`, for `profuse
diff`) and a saved run's speedups recomputed over another baseline (`rebase`, for `profuse
report --vs`).
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats as _sps

from profuse.attribution import LAUNCH_BOUND_IDLE_PCT
from profuse.bench import DEFAULT_TRIALS
from profuse.errors import UsageError

STATISTIC = (
    "ratio of medians: median(baseline) / median(variant); its CI from the paired trials, order "
    "statistics of the per-trial ratios under 30 trials (exact coverage printed), BCa from 30"
)
PER_TRIAL_STATISTIC = (
    "median of per-trial ratios: exp(median(log(baseline_i / variant_i))), order statistics under "
    "30 trials, paired bootstrap from 30"
)

# From this many paired trials on, the bootstrap's BCa interval; below it, order statistics.
# Why 30: the bootstrap of a median can only return values of the sample's order statistics,
# and at small n its nominal 95% interval covers less than it says. Simulated paired trials
# (t-distributed noise with 3 degrees of freedom, 1% a trial, a 2% drift shared by each pair,
# a true speedup of 1.1, 300 repetitions each, scipy's BCa with 1000 resamples; the standard
# error of each figure is about 1.3 points) covered the true ratio of medians 81% of the time
# at 4 trials, 86% at 8, 92% at 12, 93% at 16, 92% at 20 and 95% at 30; the median of per-trial
# ratios 90%, 94%, 94%, 93%, 94% and 95%. The order statistics' interval covers what it says at
# any count by construction (12 trials: 96.1%, 20: 95.9%), so it holds below 30, and BCa, whose
# endpoints are not tied to whole ranks, from 30 on.
BCA_LEAST_TRIALS = 30
BOOTSTRAP = "BCa"
ORDER_STATISTICS = "order statistics"

# Below this many trials a report says its CIs are order statistics' and how to get more: a
# bootstrap can only draw the distinct resamples of n trials, C(2n-1, n) of them (3 at n = 2,
# 126 at n = 5), and under BCA_LEAST_TRIALS it is not used at all.
FEW_TRIALS = BCA_LEAST_TRIALS
assert DEFAULT_TRIALS >= BCA_LEAST_TRIALS  # the default count gets the bootstrap

# A trial more than UNSTEADY_RATIO x its variant's fastest was disturbed (another process, a
# clock change, threads waiting on each other): steady runs on an H200 keep every trial within
# ~10% of the fastest. Where more than UNSTEADY_SHARE of a variant's trials were, its median is
# disturbed too. One rule for every report (Part B, sweeps, Part C, report, diff) and every
# library user (Comparison.unsteady).
UNSTEADY_RATIO = 1.5
UNSTEADY_SHARE = 0.2

FASTER = "faster"
SLOWER = "slower"
NO_GAIN = "no measurable gain"


@dataclass
class Speedup:
    """`median` is the ratio of medians; (`low`, `high`) its confidence interval. `per_trial`, where
    computed, is the paired statistic (the median of per-trial ratios) with its own interval."""

    median: float
    low: float
    high: float
    confidence: float  # the level asked for
    method: str  # "order statistics", "BCa", or "percentile" where BCa degenerated (tied data)
    per_trial: Speedup | None = None
    coverage: float | None = None  # order statistics: the interval's exact coverage (binomial)
    trials: int | None = None  # the paired trials it came from

    @property
    def level(self) -> float:
        """The coverage to print beside the interval: the exact one where known, else the level
        asked for."""
        return self.coverage if self.coverage is not None else self.confidence

    @property
    def verdict(self) -> str:
        """'faster' or 'slower' only when the whole interval says so."""
        if self.low > 1.0:
            return FASTER
        if self.high < 1.0:
            return SLOWER
        return NO_GAIN

    @property
    def measurable(self) -> bool:
        return self.verdict != NO_GAIN

    def to_dict(self) -> dict:
        out = {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "confidence": self.confidence,
            "method": self.method,
            "verdict": self.verdict,
        }
        if self.coverage is not None:
            out["coverage"] = self.coverage
        if self.trials is not None:
            out["trials"] = self.trials
        if self.per_trial is not None:
            out["per_trial"] = self.per_trial.to_dict()
        return out


@dataclass(frozen=True)
class Steadiness:
    """How far one variant's trials wandered from its fastest: `slow_trials` of `trials` took more
    than UNSTEADY_RATIO x `fastest_s`. `unsteady` where over UNSTEADY_SHARE of them did."""

    trials: int
    slow_trials: int
    fastest_s: float
    median_s: float
    slowest_s: float

    @property
    def unsteady(self) -> bool:
        return self.slow_trials > UNSTEADY_SHARE * self.trials

    @property
    def spread(self) -> float:
        """slowest / fastest trial."""
        return self.slowest_s / self.fastest_s if self.fastest_s > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "unsteady": self.unsteady}


def steadiness(times_s) -> Steadiness | None:
    """The steadiness of one variant's trials (None for no trials)."""
    t = np.asarray(times_s, dtype=float)
    if t.size == 0:
        return None
    fastest = float(t.min())
    slow = int(np.sum(t > UNSTEADY_RATIO * fastest))
    return Steadiness(int(t.size), slow, fastest, float(np.median(t)), float(t.max()))


def unsteady_warning(counts: dict[str, Steadiness], where: str = "", again: str = "") -> str:
    """The one warning for unsteady trials, the same in every report and for library users:
    'WARNING 128 x 96: unsteady timings (trials over 1.5x their fastest: eager 0/30, triton 9/30
    (1.02 ms to 3.1 ms)); their medians, and the speedups and predictions made from them, are not
    to be trusted. On a quiet machine, time it again: profuse ...'
    `counts`: label -> Steadiness of each variant timed together; `where`: what was timed
    ('128 x 96'); `again`: the command that times it again."""
    parts = [
        f"{label} {s.slow_trials}/{s.trials}"
        + (f" ({_seconds(s.fastest_s)} to {_seconds(s.slowest_s)})" if s.unsteady else "")
        for label, s in counts.items()
    ]
    text = (
        f"WARNING{' ' + where if where else ''}: unsteady timings (trials over {UNSTEADY_RATIO}x their "
        f"fastest: {', '.join(parts)}); their medians, and the speedups and predictions made from them, "
        "are not to be trusted"
    )
    if again:
        text += f". On a quiet machine, time it again: {again}"
    return text


def _seconds(t: float) -> str:
    """'8.7 ms', '552 ms', '57.3 us': three figures, for a warning's range."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def _ratio_of_medians(base: np.ndarray, var: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(base, axis=axis) / np.median(var, axis=axis)


def _median_per_trial_ratio(base: np.ndarray, var: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.exp(np.median(np.log(base) - np.log(var), axis=axis))


def _rng_kwarg(seed: int) -> dict:
    # scipy 1.15 renamed random_state to rng; accept either so old and new scipy both work.
    params = inspect.signature(_sps.bootstrap).parameters
    gen = np.random.default_rng(seed)
    return {"rng": gen} if "rng" in params else {"random_state": gen}


def bootstrap_ratio_ci(
    first: np.ndarray,
    second: np.ndarray,
    statistic,
    paired: bool,
    confidence: float,
    n_resamples: int,
    seed: int,
) -> tuple[float, float, str]:
    """(low, high, method) of `statistic(first, second)`: BCa, percentile where BCa degenerates.

    `paired` resamples whole trials (pairs kept together); unpaired resamples each sample alone.
    The interval always holds the point estimate (_hold_point).
    """
    point = float(statistic(first, second))
    if np.all(first == first[0]) and np.all(second == second[0]):
        return point, point, "exact"  # every resample is the same: the interval is the point
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            # BCa warns (and returns NaN) when the resampled statistic is degenerate.
            warnings.simplefilter("ignore")
            res = _sps.bootstrap(
                (first, second),
                statistic,
                paired=paired,
                vectorized=True,
                confidence_level=confidence,
                n_resamples=n_resamples,
                method=method,
                **_rng_kwarg(seed),
            )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if np.isfinite(low) and np.isfinite(high):
            held = _hold_point(point, low, high, method)
            if held is not None:
                return held
            if method == "BCa":
                continue  # BCa's interval missed its point: the percentile interval instead
            return min(low, point), max(high, point), f"{method}, widened to its point"
    return point, point, "degenerate"


# An interval endpoint this close to the point estimate (relative) is the point, computed another
# way: scipy interpolates its percentiles, so an endpoint that is the point can come back 1 ulp
# beside it (3 trials [1.7, 2.1, 1.8] / [1.0, 2.1, 2.0]: point 0.9, BCa low 0.9000000000000001).
# With a few trials much of the bootstrap's mass sits on the point itself, which is how a CI came to
# "exclude" its median in a 3-trial sweep under two busy loops, and how a plot's error bar once had
# a negative length.
POINT_ROUNDING = 1e-9


def _hold_point(point: float, low: float, high: float, method: str) -> tuple[float, float, str] | None:
    """(low, high, method) with an endpoint within rounding of the point snapped onto it; None
    where the interval misses its point by more than rounding."""
    tol = POINT_ROUNDING * abs(point)
    if low - tol <= point <= high + tol:
        return min(low, point), max(high, point), method
    return None


def check_timings(*samples) -> list[np.ndarray]:
    """Each sample as a 1-D float array of at least 2 positive, finite times; ValueError otherwise."""
    out = [np.asarray(x, dtype=float) for x in samples]
    for x in out:
        if x.ndim != 1 or len(x) < 2:
            raise ValueError("a confidence interval needs at least 2 trials")
        if np.any(~np.isfinite(x)) or np.any(x <= 0):
            raise ValueError("timings must be positive and finite")
    return out


def ci_method(trials: int) -> str:
    """The interval a count of paired trials gets: order statistics below BCA_LEAST_TRIALS, the
    bootstrap (BCa) from there on."""
    return BOOTSTRAP if trials >= BCA_LEAST_TRIALS else ORDER_STATISTICS


def median_coverage(n: int, k: int) -> float:
    """P(x_(k) <= m <= x_(n+1-k)): how often the k-th smallest and k-th largest of n independent
    draws hold their distribution's median m, whatever the distribution (continuous). Each draw
    falls below m with probability 1/2, so the interval misses m exactly when at most k-1 draws
    fall below it, or at most k-1 above: coverage 1 - 2 P(B <= k-1), B ~ Binomial(n, 1/2), with
    P(B <= k-1) = sum_{j<k} C(n, j) / 2^n summed in integers."""
    if not 1 <= k <= (n + 1) // 2:
        raise ValueError(f"order statistic k must be in 1..{(n + 1) // 2} for {n} draws, got {k}")
    tail = sum(math.comb(n, j) for j in range(k))
    return 1.0 - 2.0 * tail / 2**n


def median_ranks(n: int, confidence: float) -> tuple[int, float]:
    """(k, coverage): the narrowest pair of order statistics x_(k), x_(n+1-k) of n draws whose
    coverage of the median (median_coverage) is at least `confidence`; where even the widest,
    the minimum and maximum (k = 1), falls short, k = 1 and its coverage (4 draws: 87.5%)."""
    if n < 2:
        raise ValueError("an interval needs at least 2 trials")
    k = 1
    while k + 1 <= (n + 1) // 2 and median_coverage(n, k + 1) >= confidence:
        k += 1
    return k, median_coverage(n, k)


def order_statistic_ci(base: np.ndarray, var: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(low, high, coverage) for the median of the paired per-trial ratios base_i / var_i: their
    k-th smallest and k-th largest (median_ranks). Distribution-free: it assumes only that the
    trials' ratios are independent draws of one distribution, which the interleaved, balanced
    trials are built to make them."""
    ratios = np.sort(np.asarray(base, dtype=float) / np.asarray(var, dtype=float))
    k, coverage = median_ranks(ratios.size, confidence)
    return float(ratios[k - 1]), float(ratios[ratios.size - k]), coverage


def speedup_ci(
    baseline_s,
    variant_s,
    confidence: float = 0.95,
    n_resamples: int = 5000,
    seed: int = 0,
    per_trial: bool = True,
    method: str | None = None,
) -> Speedup:
    """Ratio of medians of paired timings with a CI, and with `per_trial` the median of
    per-trial ratios with its own CI beside it. `method` (default: ci_method(trials)):
    "order statistics" gives both the distribution-free interval of the median per-trial ratio
    with its exact coverage (the ratio of medians keeps its own point, the interval widened to
    hold it where it falls outside, which only adds coverage); "BCa" the paired bootstrap (BCa,
    percentile as fallback)."""
    if np.shape(baseline_s) != np.shape(variant_s):
        raise ValueError("baseline and variant timings must be 1-D and paired (same length)")
    base, var = check_timings(baseline_s, variant_s)
    n = int(base.size)
    method = method or ci_method(n)
    if method not in (BOOTSTRAP, ORDER_STATISTICS):
        raise ValueError(f"method must be {BOOTSTRAP!r} or {ORDER_STATISTICS!r}, got {method!r}")
    point = float(_ratio_of_medians(base, var))
    if method == ORDER_STATISTICS:
        low, high, coverage = order_statistic_ci(base, var, confidence)
        paired = None
        if per_trial:
            pt = float(_median_per_trial_ratio(base, var))
            paired = Speedup(pt, low, high, confidence, ORDER_STATISTICS, coverage=coverage, trials=n)
        how = ORDER_STATISTICS if low <= point <= high else f"{ORDER_STATISTICS}, widened to its point"
        return Speedup(point, min(low, point), max(high, point), confidence, how, paired, coverage, n)
    low, high, how = bootstrap_ratio_ci(base, var, _ratio_of_medians, True, confidence, n_resamples, seed)
    paired = _per_trial_ci(base, var, confidence, n_resamples, seed, BOOTSTRAP) if per_trial else None
    return Speedup(point, low, high, confidence, how, paired, trials=n)


def _per_trial_ci(
    base: np.ndarray,
    var: np.ndarray,
    confidence: float,
    n_resamples: int,
    seed: int,
    method: str | None = None,
) -> Speedup:
    """The median of per-trial ratios base_i / var_i with its CI: by `method`, by default order
    statistics below BCA_LEAST_TRIALS and the paired bootstrap from there on."""
    point = float(_median_per_trial_ratio(base, var))
    n = int(base.size)
    if (method or ci_method(n)) == ORDER_STATISTICS:
        low, high, coverage = order_statistic_ci(base, var, confidence)
        return Speedup(point, low, high, confidence, ORDER_STATISTICS, coverage=coverage, trials=n)
    low, high, method = bootstrap_ratio_ci(
        base, var, _median_per_trial_ratio, True, confidence, n_resamples, seed
    )
    return Speedup(point, low, high, confidence, method, trials=n)


def ci_label(sp: Speedup | Mapping) -> str:
    """'95% CI', '96.1% CI' or '87.5% CI': the interval's coverage, exact where it is known (order
    statistics), the level asked for otherwise. Takes a Speedup or its saved dict."""
    if isinstance(sp, Mapping):
        level = sp.get("coverage") if sp.get("coverage") is not None else sp.get("confidence", 0.95)
    else:
        level = sp.level
    return f"{_level(level)} CI"


def _level(x: float) -> str:
    """0.95 -> '95%', 0.96142578125 -> '96.1%', 0.875 -> '87.5%', 0.9921875 -> '99.2%'."""
    pct = round(x * 100, 1)
    return f"{pct:.0f}%" if pct == int(pct) else f"{pct:.1f}%"


# --------------------------------------------------------------------------------------------
# Drift and noise through a variant's trials
# --------------------------------------------------------------------------------------------

# A variant whose time correlates with the trial number (Spearman's rank correlation, which one
# odd trial cannot make) by more than TREND_R, with a p-value under TREND_P, was still drifting:
# cudagraphs went 167.7 -> 165.0 ms through 12 trials of the H200 Llama-3.2-1B step (r = -0.64),
# while the differences called between variants were under 1%. With 12 trials |r| > 0.5 alone
# happens by chance 1 time in 10; with the p-value under 0.05 it is 1 in 20 or rarer.
TREND_R = 0.5
TREND_P = 0.05
TREND_LEAST_TRIALS = 6  # fewer trials cannot show a trend worth the name

# 1.4826 x the median absolute deviation estimates a normal spread's standard deviation, and one
# disturbed trial cannot move it.
_MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class Trend:
    """How one variant's time moved with the trial number: Spearman's `r` and its `p`-value, and
    the median of its first and last quarter of trials."""

    r: float
    p: float
    trials: int
    first_s: float
    last_s: float

    @property
    def drifting(self) -> bool:
        return abs(self.r) > TREND_R and self.p < TREND_P

    def to_dict(self) -> dict:
        return {**asdict(self), "drifting": self.drifting}


def trend(times_s: Sequence[float]) -> Trend | None:
    """The trend of one variant's trials, in trial order; None for fewer than
    TREND_LEAST_TRIALS trials or constant times (no rank correlation exists)."""
    t = np.asarray(times_s, dtype=float)
    if t.size < TREND_LEAST_TRIALS or np.all(t == t[0]):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = _sps.spearmanr(np.arange(t.size), t)
    r, p = float(res[0]), float(res[1])
    if not (math.isfinite(r) and math.isfinite(p)):
        return None
    quarter = max(t.size // 4, 1)
    return Trend(r, p, int(t.size), float(np.median(t[:quarter])), float(np.median(t[-quarter:])))


def trend_warning(name: str, tr: Trend) -> str:
    return (
        f"WARNING {name}: its times drifted through the trials ({_seconds(tr.first_s)} in the first "
        f"quarter, {_seconds(tr.last_s)} in the last; Spearman r {tr.r:+.2f} with the trial number, "
        f"p {tr.p:.2g}): it was not steady, and its median depends on when it was taken"
    )


def noise(times_s: Sequence[float]) -> float:
    """The trials' relative noise: 1.4826 x median absolute deviation / median (a robust
    coefficient of variation; 0 for fewer than 2 trials)."""
    t = np.asarray(times_s, dtype=float)
    if t.size < 2:
        return 0.0
    med = float(np.median(t))
    return _MAD_TO_SD * float(np.median(np.abs(t - med))) / med if med > 0 else 0.0


# --------------------------------------------------------------------------------------------
# The verdict over several variants: the leader and the set it cannot be told apart from
# --------------------------------------------------------------------------------------------

# Two variants whose paired interval cannot show one slower than the other by more than this are
# tied. On the H200 Llama-3.2-1B step (2026-12-05) four variants' paired intervals against the
# leader were 0.995-1.006, 0.998-1.007 and 0.998-1.009, with trials varying 0.3-1% (CV): calling a
# winner among them would be calling noise, so the band is that noise's size.
TIE_BAND = 0.01
CORRECTION = "Bonferroni"


@dataclass
class Verdict:
    """The fastest variant (`winner`, the lowest median), and the variants it cannot be told apart
    from (`tied_with`): those whose paired interval against it, corrected for the number of
    comparisons, does not show them slower by more than `band`.

    `ratios[name]` is how many times faster the winner is than `name`: the median of per-trial
    ratios name_i / winner_i with its paired bootstrap interval at `confidence_each` = 1 - alpha / m
    for m comparisons (Bonferroni: all m hold together with at least 1 - alpha). `within`: the
    tie's width, the farthest any tied variant's interval reaches from 1 (0 without ties). `text`:
    'compile, fused and cudagraphs tie (within 0.9%)'."""

    winner: str
    tied_with: list[str]
    band: float
    ratios: dict[str, Speedup]
    within: float
    text: str
    alpha: float = 0.05
    confidence_each: float = 0.95
    correction: str = CORRECTION
    noise: dict[str, float] = field(default_factory=dict)  # variant -> its trials' noise (noise())
    warnings: list[str] = field(default_factory=list)

    @property
    def tie(self) -> list[str]:
        """The winner and every variant tied with it."""
        return [self.winner, *self.tied_with]

    @property
    def called(self) -> dict[str, float]:
        """The differences the verdict calls: variant -> how much slower than the winner it is
        (per-trial ratio - 1), for every variant outside the tie."""
        return {n: sp.median - 1 for n, sp in self.ratios.items() if n not in self.tied_with}

    def to_dict(self) -> dict:
        return {
            "winner": self.winner,
            "tied_with": list(self.tied_with),
            "band": self.band,
            "within": self.within,
            "text": self.text,
            "alpha": self.alpha,
            "confidence_each": self.confidence_each,
            "correction": self.correction,
            "statistic": PER_TRIAL_STATISTIC,
            "ratios": {k: v.to_dict() for k, v in self.ratios.items()},
            "noise": dict(self.noise),
            "warnings": list(self.warnings),
        }


def tie_verdict(
    times: Mapping[str, Sequence[float]],
    band: float = TIE_BAND,
    alpha: float = 0.05,
    seed: int = 0,
    n_resamples: int = 5000,
) -> Verdict:
    """The verdict over paired trials: `times[name][i]` is variant `name`'s time in trial i (the
    same i is the same round of interleaved calls). ValueError for unpaired or too few trials."""
    names = list(times)
    if not names:
        raise ValueError("a verdict needs at least one variant")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1, got {alpha}")
    if not 0 <= band < 1:
        raise ValueError(f"band must be in [0, 1), got {band}")
    arrays = dict(zip(names, check_timings(*(times[n] for n in names))))
    if len({a.size for a in arrays.values()}) > 1:
        raise ValueError("a verdict needs paired trials: every variant timed in the same trials")
    winner = min(names, key=lambda n: float(np.median(arrays[n])))  # the first named among equals
    others = [n for n in names if n != winner]
    each = 1 - alpha / max(len(others), 1)
    ratios = {n: _per_trial_ci(arrays[n], arrays[winner], each, n_resamples, seed) for n in others}
    tied = [n for n in others if ratios[n].low <= 1 + band]
    within = max((max(ratios[n].high - 1, 1 - ratios[n].low) for n in tied), default=0.0)
    verdict = Verdict(
        winner=winner,
        tied_with=tied,
        band=band,
        ratios=ratios,
        within=max(within, 0.0),
        text="",
        alpha=alpha,
        confidence_each=each,
        noise={n: noise(a) for n, a in arrays.items()},
    )
    verdict.text = _verdict_text(verdict)
    verdict.warnings = _noise_warnings(verdict)
    return verdict


def _pct(x: float) -> str:
    """0.006 -> '0.6%', 0.0123 -> '1.2%', 0.18 -> '18%', 1.37 -> '137%'."""
    pct = x * 100
    return f"{pct:.0f}%" if abs(pct) >= 10 else f"{pct:.2g}%"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _verdict_text(v: Verdict) -> str:
    if not v.ratios:
        return f"{v.winner} alone: nothing to compare it with"
    called = v.called
    head = f"{_names(v.tie)} tie (within {_pct(v.within)})" if v.tied_with else f"{v.winner} wins"
    if not called:
        return head
    nxt = min(called, key=called.get)
    pt = v.ratios[nxt]
    return (
        f"{head}; next: {nxt}, {_pct(pt.median - 1)} slower ({_pct(pt.low - 1)}-{_pct(pt.high - 1)}, "
        f"{pt.level:.1%} CI)"
    )


def _noise_warnings(v: Verdict) -> list[str]:
    """A warning where a trial's noise exceeds the smallest difference the verdict calls."""
    called = v.called
    if not called:
        return []
    smallest = min(called, key=called.get)
    diff = called[smallest]
    loudest = max(v.noise, key=v.noise.get)
    if v.noise[loudest] <= diff:
        return []
    return [
        f"WARNING: trial noise ({loudest}'s trials vary {_pct(v.noise[loudest])}, robust CV) exceeds the "
        f"smallest difference the verdict calls ({smallest} {_pct(diff)} slower than {v.winner}): the "
        "paired interval still calls it, but more trials or a quieter machine would make it firmer"
    ]


# --------------------------------------------------------------------------------------------
# What bounds a step: one rule for Part A, Part C and the reports
# --------------------------------------------------------------------------------------------

# Under this share of the step with no kernel running, the GPU is busy nearly all the time: the
# CPU keeps ahead and the step is bound by the device, however long the host takes to issue it.
# The H200 Llama-3.2-1B eager step idled 4.3% of its time (2026-12-05) while a host figure that
# counted waiting for the GPU called it host-bound.
DEVICE_BOUND_IDLE_PCT = 10.0
DEVICE_BOUND = "device-bound"
HOST_BOUND = "host-bound"
LAUNCH_BOUND = "launch-bound"


@dataclass(frozen=True)
class Bound:
    """What bounds a step: `word` is 'device-bound', 'host-bound', 'launch-bound' or '' (not
    known), `why` the evidence in words."""

    word: str
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def bound(
    gpu_idle_pct: float | None,
    host_s: float | None,
    host_lower_bound: bool,
    device_s: float | None,
    *,
    on_cpu: bool = False,
) -> Bound:
    """The one rule. In order:

    1. on a CPU, everything is host time: host-bound;
    2. the GPU idles over LAUNCH_BOUND_IDLE_PCT of the step: launch-bound (it waits for launches
       more than it works; faster kernels cannot shorten it);
    3. it idles under DEVICE_BOUND_IDLE_PCT: device-bound (the CPU keeps ahead);
    4. otherwise the host time (the CPU's own time to issue the step, never counting a wait for
       the GPU) against the device time (its kernels): host-bound where the host takes at least as
       long; device-bound where an exact host time is shorter; not known where the host time is
       only a lower bound under the device time (the launch queue filled), or a figure is missing.
    `gpu_idle_pct` is None where no profile was taken; its rules are then skipped.
    """
    if on_cpu:
        return Bound(HOST_BOUND, "on a CPU the whole step is host time")
    idle = f"the GPU idles {gpu_idle_pct:.1f}% of the step" if gpu_idle_pct is not None else ""
    if gpu_idle_pct is not None and gpu_idle_pct > LAUNCH_BOUND_IDLE_PCT:
        return Bound(LAUNCH_BOUND, f"{idle}, waiting for launches more than it works")
    if gpu_idle_pct is not None and gpu_idle_pct < DEVICE_BOUND_IDLE_PCT:
        return Bound(DEVICE_BOUND, f"{idle}: the CPU keeps ahead of it")
    if host_s is None or device_s is None:
        missing = "no host time" if host_s is None else "no device time"
        return Bound("", f"{idle + '; ' if idle else ''}{missing} to weigh against it")
    at_least = "at least " if host_lower_bound else ""
    terms = f"the CPU issues it in {at_least}{_seconds(host_s)}, its kernels take {_seconds(device_s)}"
    if idle:
        terms = f"{idle}; {terms}"
    if host_s >= device_s:
        return Bound(HOST_BOUND, terms)
    if host_lower_bound:
        return Bound("", f"{terms}: the launch queue filled, so the host time is only a lower bound")
    return Bound(DEVICE_BOUND, terms)


# --------------------------------------------------------------------------------------------
# Two saved runs, not interleaved: the unpaired ratio (profuse diff)
# --------------------------------------------------------------------------------------------


@dataclass
class TimeRatio:
    """median(B) / median(A) of two independent runs; below 1, B is faster."""

    median: float
    low: float
    high: float
    confidence: float
    method: str

    @property
    def verdict(self) -> str:
        if self.high < 1.0:
            return f"B faster ({self.median - 1:+.0%})"
        if self.low > 1.0:
            return f"B slower ({self.median - 1:+.0%})"
        return "no measurable difference"


def _ratio_b_over_a(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(b, axis=axis) / np.median(a, axis=axis)


def time_ratio_ci(a_s, b_s, confidence: float = 0.95, n_resamples: int = 5000, seed: int = 0) -> TimeRatio:
    """median(B) / median(A) with a bootstrap CI that resamples each run's trials on its own.

    The unpaired twin of speedup_ci: two saved runs were not interleaved, so trial i of
    A has nothing to do with trial i of B (their counts may even differ), and pairing them would be
    invented structure. BCa first, percentile where BCa degenerates, as speedup_ci does.
    """
    a, b = check_timings(a_s, b_s)
    point = float(_ratio_b_over_a(a, b))
    low, high, method = bootstrap_ratio_ci(a, b, _ratio_b_over_a, False, confidence, n_resamples, seed)
    return TimeRatio(point, low, high, confidence, method)


# --------------------------------------------------------------------------------------------
# A saved run's speedups over another variant (profuse report --vs)
# --------------------------------------------------------------------------------------------


def rebase(data: dict, baseline: str, only: list[str] | None = None) -> dict:
    """A copy of a saved run whose speedups are over `baseline` (a variant key, e.g. compile)
    instead of eager, recomputed from the saved per-trial times: the trials interleaved every
    variant, so the pairs (and the paired bootstrap) hold for any two of them. With `only`, the
    other variants' speedups are dropped instead of recomputed (each bootstrap takes ~0.1 s)."""
    out = copy.deepcopy(data)
    entries = [out] if out.get("kind") == "tail" else list(out.get("runs", []))
    if not any(baseline in ((e.get("comparison") or {}).get("timings") or {}) for e in entries):
        raise UsageError(f"no size of this run timed the variant {baseline!r}: nothing to compare against")
    for entry in entries:
        comp = entry.get("comparison") or {}
        timings = comp.get("timings") or {}
        if baseline not in timings:
            entry["comparison"] = None  # this size cannot say anything against the new baseline
            entry["results"] = {}
            continue
        base = timings[baseline]["times_s"]
        comp["baseline"] = baseline
        comp["speedups"] = {}
        for key, res in (entry.get("results") or {}).items():
            skip = key == baseline or (only is not None and key not in only)
            sp = None if skip else speedup_ci(base, timings[key]["times_s"]).to_dict()
            res["speedup"] = sp
            if sp:
                comp["speedups"][key] = sp
    return out


# Each compiled fused variant of a Part C step over compile, from the same paired trials, and its
# key in step.json: the fusion (compile+fused) and the fused loss alone (compile+loss).
OVER_COMPILE = {"compile+fused": "fusion_over_compile", "compile+loss": "loss_over_compile"}


# --------------------------------------------------------------------------------------------
# A saved run's CIs made again by the method that fits their count (profuse report --refit)
# --------------------------------------------------------------------------------------------


def refit(data: dict) -> tuple[dict, list[str]]:
    """(a copy of a saved run with every speedup's CI recomputed from its saved paired trials by
    the method that fits their count (ci_method), the methods the file had used). For files
    saved when every count got a bootstrap: a Part B or sweep results.json (each size over its
    own baseline, as rebase does) or a Part C step.json (each variant over eager, compile+fused
    and compile+loss over compile, and the verdict decided again from the same trials)."""
    methods = sorted({m for m in _saved_methods(data)})
    if data.get("kind") == "step":
        return _refit_step(data), methods
    entries = [data] if data.get("kind") == "tail" else list(data.get("runs", []))
    out = copy.deepcopy(data)
    kept = [out] if out.get("kind") == "tail" else out.get("runs", [])
    for entry, new in zip(entries, kept):
        comp = entry.get("comparison") or {}
        if not comp.get("timings") or comp.get("baseline") not in comp["timings"]:
            continue
        single = {**entry, "kind": "tail"}
        redone = rebase(single, comp["baseline"])
        new["comparison"], new["results"] = redone["comparison"], redone["results"]
    return out, methods


def _refit_step(data: dict) -> dict:
    out = copy.deepcopy(data)
    cmp = out.get("comparison")
    if not cmp or not cmp.get("timings"):
        return out
    times = {n: t["times_s"] for n, t in cmp["timings"].items()}
    base = cmp["baseline"]
    cmp["speedups"] = {}
    for name, res in out.get("results", {}).items():
        if res.get("speedup") and name in times and name != base:
            res["speedup"] = speedup_ci(times[base], times[name]).to_dict()
            cmp["speedups"][name] = res["speedup"]
    for name, key in OVER_COMPILE.items():
        if out.get(key) and {"compile", name} <= set(times):
            out[key] = speedup_ci(times["compile"], times[name]).to_dict()
    out["verdict"] = None  # decided again from the same trials (profuse.verdict.decide)
    cmp["verdict"] = None
    return out


def _saved_methods(data) -> list[str]:
    """Every CI method named in a saved file's speedups."""
    found = []
    if isinstance(data, dict):
        if "method" in data and "low" in data and "high" in data:
            found.append(str(data["method"]))
        for value in data.values():
            found += _saved_methods(value)
    elif isinstance(data, list):
        for value in data:
            found += _saved_methods(value)
    return found
