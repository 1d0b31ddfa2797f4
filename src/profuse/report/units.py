"""Numbers with units a person reads at a glance."""


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


def fmt_bytes(n: float) -> str:
    """Decimal megabytes, as the lab prints traffic ('537 MB'); GB past 10 GB, kB under 1 MB."""
    if n >= 10e9:
        return f"{n / 1e9:.1f} GB"
    if n < 1e6:
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.0f} MB"


def fmt_bandwidth(bps: float) -> str:
    if bps >= 1e12:
        return f"{bps / 1e12:.2f} TB/s"
    return f"{bps / 1e9:.1f} GB/s"


def fmt_speedup(sp, baseline_label: str) -> str:
    """'speedup vs eager 2.14x  (95% CI 2.11-2.16)', or 'no measurable gain' when the CI holds 1.0."""
    ci = f"({sp.confidence:.0%} CI {sp.low:.2f}-{sp.high:.2f})"
    if sp.verdict == "no measurable gain":
        return f"no measurable gain vs {baseline_label}  {ci}"
    word = "speedup" if sp.verdict == "faster" else "slower:"
    return f"{word} vs {baseline_label} {sp.median:.2f}x  {ci}"
