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


def speedup_ci(
    baseline_s,
    variant_s,
    confidence: float = 0.95,
    n_resamples: int = 5000,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians of paired timings with a bootstrap CI (BCa, percentile as fallback)."""
    base = np.asarray(baseline_s, dtype=float)
    var = np.asarray(variant_s, dtype=float)
    if base.shape != var.shape or base.ndim != 1:
        raise ValueError("baseline and variant timings must be 1-D and paired (same length)")
    if len(base) < 2:
        raise ValueError("a confidence interval needs at least 2 trials")
    if np.any(~np.isfinite(base)) or np.any(~np.isfinite(var)) or np.any(var <= 0) or np.any(base <= 0):
        raise ValueError("timings must be positive and finite")
    point = float(_ratio_of_medians(base, var))
    if np.all(base == base[0]) and np.all(var == var[0]):
        # Every resample is the same: the interval is the point.
        return Speedup(point, point, point, confidence, "exact")
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            # BCa warns (and returns NaN) when the resampled statistic is degenerate.
            warnings.simplefilter("ignore")
            res = _sps.bootstrap(
                (base, var),
                _ratio_of_medians,
                paired=True,
                vectorized=True,
                confidence_level=confidence,
                n_resamples=n_resamples,
                method=method,
                **_rng_kwarg(seed),
            )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if np.isfinite(low) and np.isfinite(high):
            return Speedup(point, low, high, confidence, method)
    return Speedup(point, point, point, confidence, "degenerate")
