"""Part C's verdict, decided in one place: which variant wins the step, and what bounds the step.

`decide(data)` reads a run as saved (profuse.step.StepResult.to_dict(): the results, the
profiles, the device) and returns a StepVerdict. The run stores it as step.json's `verdict`; the
report prints its words from that field (and decides it here for files written before it).

The rules, today's:
- the winner is the fastest variant (largest median speedup) whose CI over eager lies above 1;
  where none does, eager wins when every other variant is measurably slower, else nothing
  differs measurably (winner None);
- what bounds a variant's step (the eager step's is the verdict's): on a CPU the whole step is
  host time; on CUDA, launch-bound where the variant's profile's GPU idles over
  profiling.LAUNCH_BOUND_IDLE_PCT, else host- or device-bound by the CPU's time to issue a step
  against the profile's kernel time a step.
The paired tie test (the set the winner cannot be told apart from, `tied_with`) and the bound
from a host time that cannot include waiting for the GPU replace the two rules here, and only
here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepVerdict:
    """Who wins the step over eager, and what bounds the eager step."""

    # the fastest variant measurably faster than eager; eager where all others are slower; None: a draw
    winner: str | None
    tied_with: list[str] = field(default_factory=list)  # variants the winner cannot be told apart from
    faster: list[str] = field(default_factory=list)  # measurably faster than eager, fastest first
    level: list[str] = field(default_factory=list)  # not measurably different from eager
    slower: list[str] = field(default_factory=list)  # measurably slower than eager
    bound: str = ""  # "device-bound", "host-bound", "launch-bound", or "" where not known
    bound_why: str = ""  # the evidence, in words
    bounds: dict[str, str] = field(default_factory=dict)  # every timed variant's bound, by the same rule

    def to_dict(self) -> dict:
        return asdict(self)


def _time(seconds: float) -> str:
    """'222.436 ms', '69.3 us', '1.20 s': the reports' way (report.units.fmt_time)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds:.2f} s"


def step_bound(data: dict, name: str | None = None) -> tuple[str, str]:
    """What bounds variant `name`'s step (default the baseline, eager): ('device-bound' |
    'host-bound' | 'launch-bound' | '', the evidence). From its profile's GPU idle share
    (launch-bound where the profile says so) and the harness's host time per step against the
    profile's kernel time per step (host over device: host-bound); '' where neither was measured."""
    name = name or data["comparison"]["baseline"]
    result = data["results"][name]
    profile = (data.get("profiles") or {}).get(name)
    if not data["config"]["device"].startswith("cuda"):
        return "host-bound", "on a CPU the whole step is host time"
    if profile and profile["launch_bound"]:
        return "launch-bound", f"the GPU idles {profile['gpu_idle_pct']:.0f}% of it, waiting for launches"
    host = result["host_s"]
    device = profile["time_per_step_us"] * 1e-6 if profile and profile["basis"] == "GPU kernel time" else None
    if host is not None and device is not None:
        terms = f"the CPU issues it in {_time(host)}, its kernels take {_time(device)}"
        return ("host-bound", terms) if host >= device else ("device-bound", terms)
    if result["host_bound"]:
        return "host-bound", "its host time is within 10% of its time a step"
    if profile and profile["gpu_idle_pct"] is not None:
        return "device-bound", f"the GPU idles only {profile['gpu_idle_pct']:.0f}% of it"
    return "", "no profile to say what bounds it (--profile-steps 0)"


def decide(data: dict) -> StepVerdict | None:
    """The verdict of a saved run; None where nothing was timed."""
    if data.get("comparison") is None:
        return None
    speedups = {n: r["speedup"] for n, r in data["results"].items() if r["speedup"]}
    bound, why = step_bound(data)
    faster = sorted(
        (n for n, sp in speedups.items() if sp["low"] > 1.0), key=lambda n: -speedups[n]["median"]
    )
    slower = sorted(n for n, sp in speedups.items() if sp["high"] < 1.0)
    level = sorted(n for n in speedups if n not in slower and n not in faster)
    if faster:
        winner = faster[0]
    elif speedups and not level:
        winner = data["comparison"]["baseline"]
    else:
        winner = None
    bounds = {name: step_bound(data, name)[0] for name in data["results"]}
    return StepVerdict(
        winner=winner, faster=faster, level=level, slower=slower, bound=bound, bound_why=why, bounds=bounds
    )
