"""The speedup of one variant over a baseline, with a bootstrap confidence interval.

Statistic: the ratio of medians, median(baseline times) / median(variant times); above 1 means
the variant is faster. Trials are paired (trial i timed every variant once, interleaved), so the
bootstrap resamples whole trials and keeps each pair together: drift that slowed a trial slows
both sides of its pair, and the interval does not widen for it.

Also here: the unpaired ratio of two saved runs (`time_ratio_ci`, for `profuse diff`) and a saved
run's speedups recomputed over another baseline (`rebase`, for `profuse report --vs`).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _sps

from profuse.errors import UsageError

STATISTIC = "ratio of medians: median(baseline) / median(variant), paired bootstrap over trials"

# Below this many trials a CI is printed with a caveat. A bootstrap can only draw the distinct
# resamples of n trials, C(2n-1, n) of them: 3 at n = 2, 126 at n = 5, 92378 at n = 10; with a
# handful the interval reflects the few values drawn, not the spread of the timings.
FEW_TRIALS = 10

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
