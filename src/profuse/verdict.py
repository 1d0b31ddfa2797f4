"""Part C's verdict, decided in one place: which variant wins the step, and what bounds the step.

`decide(data)` reads a run as saved (profuse.step.StepResult.to_dict(): the comparison's paired
trials, the results, the profiles, the device) and returns a StepVerdict. The run stores it as
step.json's `verdict`; the report prints its words from that field (and decides it here for
files written before it).

The rules, bench's own, so that Part A, Part B and Part C say the same things the same way:
- the winner is the variant with the lowest median over the paired trials, and `tied_with` the
  variants it cannot be told apart from: bench.stats.tie_verdict over the saved trials (the
  median of per-trial ratios with a paired bootstrap interval each, Bonferroni-corrected over the
  comparisons, a tie where an interval reaches within the band of 1). Its sentence is the
  verdict's text;
- what bounds a variant's step: bench.stats.bound from the GPU idle share of its consecutive
  unsynchronised profiled steps (stepprofile.steady_steps) where their step time falls within the
  timed trials' range, the held host time a step (bench.host: "at least" where the launch queue
  filled) and the kernel time a step (on a CPU: host-bound). Where that profile's step time is
  outside the trials' range its idle share is not used (the host and kernel times decide, and the
  evidence says why); a file from before it reads its synchronised profile's idle share, and says
  that it did.
The speedups over eager (faster, level, slower) are kept beside it, read from each variant's
ratio-of-medians CI: they say how each variant stands against eager, the verdict who wins.
A timed variant whose math no check covered (step.json's `math`: the full-size check could not
run and no small copy checked it, or a file from before the rows) is named in `unchecked`, and the
verdict's sentence says so: only checked variants are called faster without that caveat.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from profuse.bench.stats import TIE_BAND, bound, tie_verdict


@dataclass
class StepVerdict:
    """Who wins the step (or ties for it), and what bounds the eager step."""

    winner: str | None  # the lowest median over the paired trials (None: nothing timed)
    tied_with: list[str] = field(default_factory=list)  # variants the winner cannot be told apart from
    text: str = ""  # tie_verdict's sentence: 'compile and compile+fused tie (within 0.9%); next: ...'
    ratios: dict[str, dict] = field(default_factory=dict)  # variant -> the winner's per-trial speedup over it
    warnings: list[str] = field(default_factory=list)  # noise over the smallest difference called
    band: float = TIE_BAND
    confidence_each: float = 0.95  # each interval's, Bonferroni-corrected
    faster: list[str] = field(default_factory=list)  # measurably faster than eager, fastest first
    level: list[str] = field(default_factory=list)  # not measurably different from eager
    slower: list[str] = field(default_factory=list)  # measurably slower than eager
    bound: str = ""  # "device-bound", "host-bound", "launch-bound", or "" where not known
    bound_why: str = ""  # the evidence, in words
    bounds: dict[str, str] = field(default_factory=dict)  # every timed variant's bound, by the same rule
    unchecked: list[str] = field(default_factory=list)  # timed, but no same-math check covered them

    @property
    def tie(self) -> list[str]:
        return [self.winner, *self.tied_with] if self.winner else []

    def to_dict(self) -> dict:
        return asdict(self)


# The bound's source in a file with no unsynchronised profile (written before it).
SYNCED_SOURCE = "a synchronised profiled step, no unsynchronised one saved: "


def step_bound(data: dict, name: str | None = None) -> tuple[str, str]:
    """What bounds variant `name`'s step (default the baseline, eager): ('device-bound' |
    'host-bound' | 'launch-bound' | '', the evidence), by bench.stats.bound from its profile's
    GPU idle share and kernel time a step and the harness's held host time a step."""
    cmp = data["comparison"]
    name = name or cmp["baseline"]
    profile = (data.get("profiles") or {}).get(name) or {}
    timing = (cmp.get("timings") or {}).get(name) or {}
    host = data["results"][name]["host_s"]
    device = None
    if profile.get("basis") == "GPU kernel time" and profile.get("time_per_step_us") is not None:
        device = profile["time_per_step_us"] * 1e-6
    on_cpu = not data["config"]["device"].startswith("cuda")
    idle, source = profile.get("gpu_idle_pct"), ""
    steady = profile.get("steady")
    if steady and not on_cpu:
        device = steady["busy_ms"] / steady["steps"] / 1e3
        n, low, high = steady["steps"], steady.get("timed_low_ms"), steady.get("timed_high_ms")
        if steady.get("agrees") is False:
            idle = None
            source = (
                f"{n} unsynchronised profiled steps took {steady['step_ms']:.3g} ms a step, outside the "
                f"timed trials' {low:.3g}-{high:.3g} ms, so their idle share is not used; "
            )
        else:
            idle = steady["gpu_idle_pct"]
            source = f"{n} unsynchronised profiled steps, as fast as the timed loop: "
    elif profile.get("gpu_idle_pct") is not None and not on_cpu:
        source = SYNCED_SOURCE
    b = bound(idle, host, bool(timing.get("host_is_lower_bound")), device, on_cpu=on_cpu)
    if not b.word and not profile:
        return "", "no profile to say what bounds it (--profile-steps 0)"
    return b.word, source + b.why


def decide(data: dict) -> StepVerdict | None:
    """The verdict of a saved run; None where nothing was timed."""
    cmp = data.get("comparison")
    if cmp is None or not cmp.get("timings"):
        return None
    times = {n: t["times_s"] for n, t in cmp["timings"].items()}
    band = (cmp.get("design") or {}).get("band", TIE_BAND)
    tie = tie_verdict(times, band=band, alpha=0.05, seed=cmp.get("seed", 0))
    speedups = {n: r["speedup"] for n, r in data["results"].items() if r["speedup"]}
    faster = sorted(
        (n for n, sp in speedups.items() if sp["low"] > 1.0), key=lambda n: -speedups[n]["median"]
    )
    slower = sorted(n for n, sp in speedups.items() if sp["high"] < 1.0)
    level = sorted(n for n in speedups if n not in slower and n not in faster)
    bound_word, why = step_bound(data)
    unchecked = unchecked_variants(data)
    text = tie.text
    if unchecked:
        text += f" ({', '.join(unchecked)}: math NOT checked, timed all the same)"
    return StepVerdict(
        winner=tie.winner,
        tied_with=list(tie.tied_with),
        text=text,
        ratios={k: v.to_dict() for k, v in tie.ratios.items()},
        warnings=list(tie.warnings),
        band=tie.band,
        confidence_each=tie.confidence_each,
        faster=faster,
        level=level,
        slower=slower,
        bound=bound_word,
        bound_why=why,
        bounds={name: step_bound(data, name)[0] for name in data["results"]},
        unchecked=unchecked,
    )


def unchecked_variants(data: dict) -> list[str]:
    """The timed variants, eager aside, whose row says no check covered their math (none for a
    file written before the rows: it cannot say)."""
    rows = data.get("math") or {}
    base = (data.get("comparison") or {}).get("baseline", "eager")
    return [n for n in data.get("results") or {} if n != base and n in rows and not rows[n]["checked"]]
