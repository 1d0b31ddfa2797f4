"""The speedup of one variant over a baseline, with a bootstrap confidence interval.

Statistic: the ratio of medians, median(baseline times) / median(variant times); above 1 means
the variant is faster. Trials are paired (trial i timed every variant once, interleaved), so the
bootstrap resamples whole trials and keeps each pair together: drift that slowed a trial slows
both sides of its pair, and the interval does not widen for it.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _sps

STATISTIC = "ratio of medians: median(baseline) / median(variant), paired bootstrap over trials"

# Below this many trials a CI is printed with a caveat. A bootstrap can only draw the distinct
# resamples of n trials, C(2n-1, n) of them: 3 at n = 2, 126 at n = 5, 92378 at n = 10; with a
# handful the interval reflects the few values drawn, not the spread of the timings.
FEW_TRIALS = 10

FASTER = "faster"
SLOWER = "slower"
NO_GAIN = "no measurable gain"


@dataclass
class Speedup:
    """`median` is the ratio of medians; (`low`, `high`) its confidence interval."""

    median: float
    low: float
    high: float
    confidence: float
    method: str  # "BCa", or "percentile" where BCa degenerated (tied data)

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
        return {**asdict(self), "verdict": self.verdict}


def _ratio_of_medians(base: np.ndarray, var: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(base, axis=axis) / np.median(var, axis=axis)


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
    """
    if np.all(first == first[0]) and np.all(second == second[0]):
        point = float(statistic(first, second))
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
            return low, high, method
    point = float(statistic(first, second))
    return point, point, "degenerate"


def check_timings(*samples) -> list[np.ndarray]:
    """Each sample as a 1-D float array of at least 2 positive, finite times; ValueError otherwise."""
    out = [np.asarray(x, dtype=float) for x in samples]
    for x in out:
        if x.ndim != 1 or len(x) < 2:
            raise ValueError("a confidence interval needs at least 2 trials")
        if np.any(~np.isfinite(x)) or np.any(x <= 0):
            raise ValueError("timings must be positive and finite")
    return out


def speedup_ci(
    baseline_s,
    variant_s,
    confidence: float = 0.95,
    n_resamples: int = 5000,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians of paired timings with a bootstrap CI (BCa, percentile as fallback)."""
    if np.shape(baseline_s) != np.shape(variant_s):
        raise ValueError("baseline and variant timings must be 1-D and paired (same length)")
    base, var = check_timings(baseline_s, variant_s)
    point = float(_ratio_of_medians(base, var))
    low, high, method = bootstrap_ratio_ci(base, var, _ratio_of_medians, True, confidence, n_resamples, seed)
    return Speedup(point, low, high, confidence, method)
