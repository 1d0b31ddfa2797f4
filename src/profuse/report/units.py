"""Numbers with units a person reads at a glance."""

from profuse.bench.stats import ci_label


def time_unit(seconds: float) -> str:
    """The unit a column of times around `seconds` reads best in."""
    return "us" if seconds < 1e-3 else "ms" if seconds < 1.0 else "s"


def fmt_time(seconds: float, unit: str | None = None) -> str:
    """'69.3 us', '26.307 ms', '1.20 s' (the lab prints milliseconds with three decimals).

    Pass `unit` to keep a column in one unit."""
    unit = unit or time_unit(seconds)
    if unit == "us":
        return f"{seconds * 1e6:7.1f} us"
    if unit == "ms":
        return f"{seconds * 1e3:7.3f} ms"
    return f"{seconds:7.2f} s"


def fmt_bytes(n: float, digits: int = 0) -> str:
    """Decimal units, as the lab prints them: traffic in whole megabytes ('537 MB'), a file to
    `digits=1` ('1.2 MB'); kB below the smallest megabyte figure the digits show (1 MB, 0.1 MB),
    GB past 10 GB."""
    if n >= 10e9:
        return f"{n / 1e9:.1f} GB"
    if n < 10 ** (6 - digits):
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.{digits}f} MB"


def fmt_bandwidth(bps: float) -> str:
    if bps >= 1e12:
        return f"{bps / 1e12:.2f} TB/s"
    return f"{bps / 1e9:.1f} GB/s"


def speedup_terms(median: float, low: float, high: float, verdict: str) -> tuple[str, str]:
    """A speedup and its CI as a reader says them: ('2.14x', '2.11-2.16') for a gain, and for a
    slowdown the factor by which the variant takes longer, its CI turned round with it:
    ('2.17x slower', '2.10-2.25') rather than '0.46x slower'."""
    if verdict == "slower":
        return f"{1 / median:.2f}x slower", f"{1 / high:.2f}-{1 / low:.2f}"
    return f"{median:.2f}x", f"{low:.2f}-{high:.2f}"


def fmt_speedup(sp, baseline_label: str) -> str:
    """'speedup vs eager 2.14x  (95% CI 2.11-2.16)', '2.17x slower than eager  (95% CI 2.10-2.25)',
    or 'no measurable gain' when the CI holds 1.0."""
    ratio, ci = speedup_terms(sp.median, sp.low, sp.high, sp.verdict)
    ci = f"({ci_label(sp)} {ci})"
    if sp.verdict == "no measurable gain":
        return f"no measurable gain vs {baseline_label}  {ci}"
    if sp.verdict == "slower":
        return f"{ratio} than {baseline_label}  {ci}"
    return f"speedup vs {baseline_label} {ratio}  {ci}"
