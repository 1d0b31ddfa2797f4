"""Part C's profiles: a short torch.profiler run of each timed variant's step, read for the table.

Each variant is profiled as it was timed (the same model, compiled graphs and AdamW: nothing is
built or compiled again), after the trials; the eager step is profiled through a labelled copy
over the same parameters (ModelSpec.label: the ops fusion replaces in profiler ranges, the math
unchanged), so the trace says how much of the step is in them. What a profile gives the report:
kernels (operators on a CPU) per step, the memory-bound share, the GPU's idle share, and, per
step, the time in each category and in the operator table's top rows: what `--precision both`
reads to say why a variant's rank moved between the precisions.

The profiled steps above each end in a synchronisation, so the GPU drains between them and the
next step's first launches run on an idle card: their idle share and wall time are not the timed
loop's (3-10% longer for Llama-3.2-1B on an H100, 35-60% for the small preset). What bounds a
step is read instead from UNSYNCED_STEPS consecutive steps with no synchronisation between them
(`steady_steps`, CUDA only): the profiler records the GPU's activity alone (no host events, the
least overhead it can add), one synchronisation ends the run, and the kernels' timeline gives the
GPU's idle share between the first kernel and the last, and the time a step there. That step
time is set beside the timed trials' (`agreement`): the profile stands for the timed loop only
where it falls within the trials' own range, and the report shows both.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from profuse.attribution import read_spans, union
from profuse.profiling import profile

# Warm-up steps before the profiled ones: the variants are warm from the trials, so only the
# profiler's own warm-up step (a compiled step gets one more, outside the profiler: profiling._warm_up).
PROFILE_WARMUP = 1
TOP_OPS = 8  # the operator table's rows kept a step
# Consecutive unsynchronised steps profiled for the idle share: enough that the first step's
# start from a drained queue is a tenth of the window.
UNSYNCED_STEPS = 10
# The profiled steps match the timed loop where their step time lies within the trials' range, or
# within this share of the trials' median where the trials spread less: whole trials of steady
# steps can agree to 0.1%, closer than two separate runs of the same loop do (the profiled steps
# run after the trials, under the profiler). On an H100 (2026-12-07, Part C small) eager's trials
# spanned 21.9-21.9 ms and its profiled steps took 22.0 ms (+0.3%).
AGREE_FLOOR = 0.01
_BUSY = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class SteadySteps:
    """The GPU's activity over consecutive unsynchronised steps (the timed loop's way of running),
    and how it stands against the timed trials."""

    steps: int
    window_ms: float  # first kernel's start to the last one's end
    busy_ms: float  # the union of kernels, copies and sets in it
    wall_ms: float  # the steps' wall time, one synchronisation at the end
    trace_path: str = ""
    timed_median_ms: float | None = None  # the variant's timed trials (agreement)
    timed_low_ms: float | None = None  # their fastest and slowest trial
    timed_high_ms: float | None = None
    agrees: bool | None = None  # step_ms within [timed_low_ms, timed_high_ms], or floor x the median
    floor: float | None = None  # the share of the median the agreement allows at least (AGREE_FLOOR)

    @property
    def step_ms(self) -> float:
        """A step on the GPU's timeline: the window over the steps."""
        return self.window_ms / self.steps

    @property
    def gpu_idle_pct(self) -> float:
        return 100.0 * max(self.window_ms - self.busy_ms, 0.0) / self.window_ms if self.window_ms > 0 else 0.0

    @property
    def device_s(self) -> float:
        """The GPU's busy time a step (s)."""
        return self.busy_ms / self.steps / 1e3

    def to_dict(self) -> dict:
        return {**asdict(self), "step_ms": self.step_ms, "gpu_idle_pct": self.gpu_idle_pct}


def read_steady(trace: dict | list, steps: int, wall_s: float, trace_path: str = "") -> SteadySteps:
    """SteadySteps from a trace of `steps` consecutive steps: the window from the first device
    event's start to the last one's end, and the union of the device events in it."""
    busy = [(sp.ts, sp.end) for sp in read_spans(trace) if sp.cat in _BUSY]
    if not busy or steps < 1:
        raise ValueError("the steady steps' trace holds no kernel")
    merged = union(busy)
    window_us = merged[-1][1] - merged[0][0]
    busy_us = sum(end - start for start, end in merged)
    return SteadySteps(steps, window_us / 1e3, busy_us / 1e3, wall_s * 1e3, trace_path)


def agreement(steady: SteadySteps, trial_times_s: list[float]) -> SteadySteps:
    """`steady` with the timed trials beside it: their median, range, and whether its step time
    falls in that range (the trials' own noise), widened to AGREE_FLOOR of the median."""
    if not trial_times_s:
        return steady
    ms = [t * 1e3 for t in trial_times_s]
    steady.timed_median_ms = statistics.median(ms)
    steady.timed_low_ms, steady.timed_high_ms = min(ms), max(ms)
    steady.floor = AGREE_FLOOR
    median, floor = steady.timed_median_ms, AGREE_FLOOR * steady.timed_median_ms
    low, high = min(steady.timed_low_ms, median - floor), max(steady.timed_high_ms, median + floor)
    steady.agrees = low <= steady.step_ms <= high
    return steady


def steady_steps(
    step: Callable[[], object], device: torch.device, path: Path, steps: int = UNSYNCED_STEPS
) -> SteadySteps:
    """`steps` consecutive steps under torch.profiler recording the GPU's activity alone, one
    synchronisation at the end; the trace written to `path` and read (read_steady)."""
    step()  # the previous profile ended synchronised: one step refills the queue first
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - t0
    prof.export_chrome_trace(str(path))
    trace = json.loads(Path(path).read_text())
    return read_steady(trace, steps, wall_s, str(path))


@dataclass
class VariantProfile:
    """What a short profile of one variant's step says (profiling.profile's reading)."""

    step_ms: float  # median profiled step, synchronised, under the profiler
    basis: str  # "GPU kernel time" or "self CPU time": what the shares divide
    time_per_step_us: float  # that time, per step
    launches_per_step: float
    launch_unit: str  # "kernels" or "operators"
    memory_bound_pct: float  # memory-bound elementwise + norm work, % of the basis
    gpu_idle_pct: float | None
    launch_bound: bool
    block_op_pct: dict[str, float]  # op -> % of the basis in it, forward and backward (eager only)
    trace_path: str
    label_error: str = ""  # eager: why the ops fusion replaces could not be labelled
    category_ms: dict[str, float] = field(default_factory=dict)  # category -> ms of the basis a step
    # the most time a step by name, read off the trace (attribution.event_rows): on CUDA each
    # kernel's device time, on a CPU each host event's self time (files before 2026-12-07 hold the
    # profiler's operator table rows, ops and kernels mixed)
    top_ops: dict[str, float] = field(default_factory=dict)
    # the events with the most self CPU time (profiling.ProfileResult.host_rows): name ->
    # {"ms": a step, "calls": a step}, under the profiler (its own cost included)
    host_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: int = 0  # profiled steps
    step_times_ms: list[float] = field(default_factory=list)  # each profiled step, synchronised
    steady: SteadySteps | None = None  # CUDA: consecutive unsynchronised steps (steady_steps)
    steady_error: str = ""  # why there are none, where their profile could not be read

    def to_dict(self) -> dict:
        out = asdict(self)
        out["steady"] = self.steady.to_dict() if self.steady else None
        return out


def trace_name(variant: str, tag: str = "") -> str:
    """'trace-step-compile-fused.json'; with a tag (the precision, where a run holds two)
    'trace-step-compile-fused-bf16.json'."""
    suffix = f"-{tag}" if tag else ""
    return f"trace-step-{variant.replace('+', '-')}{suffix}.json"


def steady_or_why(
    step: Callable[[], object], device: torch.device, path: Path
) -> tuple[SteadySteps | None, str]:
    """steady_steps, or None and why (one line) where its profile cannot be taken or read (no
    CUPTI, a trace with no kernel): the run keeps its trials, and the bound says it has no idle
    share from them."""
    try:
        return steady_steps(step, device, path), ""
    except Exception as err:  # a profile that fails must not cost the run its timed trials
        text = str(err).strip().splitlines()
        return None, f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def profile_variant(
    step: Callable[[], object],
    name: str,
    *,
    steps: int,
    out_dir: Path,
    device: torch.device,
    compiled: bool,
    regions: Iterable[str] = (),
    block_ops: dict[str, str] | None = None,
    tag: str = "",
    label_error: str = "",
    say: Callable[[str], None] | None = None,
    timed_step: Callable[[], object] | None = None,
) -> VariantProfile:
    """Profile `steps` of variant `name`'s `step` (warm already). `regions`: profiler range
    names to measure; `block_ops` (op -> its range) the ones whose shares the eager profile
    reports. On CUDA, then UNSYNCED_STEPS of `timed_step` (the step as it was timed, no profiler
    ranges; default `step`) unsynchronised (steady_steps)."""
    result = profile(
        step,
        steps=steps,
        warmup=PROFILE_WARMUP,
        out=out_dir,
        device=device,
        trace_name=trace_name(name, tag),
        regions=tuple(regions),
        compiled=compiled,
        progress=say,
        summary_name=None,  # Part C writes step.json; a variant's profile.json would be clutter
        operator_table=False,  # its rows from the trace: key_averages is the slowest reading
    )
    s = result.summary
    n = max(s.steps, 1)
    steady, steady_error = None, ""
    if device.type == "cuda":
        steady, steady_error = steady_or_why(
            timed_step or step, device, out_dir / trace_name(f"{name}-steady", tag)
        )
    per_step_ms = s.total_us / n / 1e3
    return VariantProfile(
        step_ms=result.step_ms,
        basis=s.basis,
        time_per_step_us=s.total_us / n,
        launches_per_step=s.launches_per_step,
        launch_unit=s.launch_unit,
        memory_bound_pct=s.shares.get("memory_bound", 0.0),
        gpu_idle_pct=s.gpu_idle_pct,
        launch_bound=s.launch_bound,
        # the ops the trace holds: a model labels only the ops it has (Qwen3 qk_norm_rope, not rope)
        block_op_pct={
            op: s.region_pct[rng] for op, rng in (block_ops or {}).items() if s.region_pct.get(rng)
        },
        trace_path=result.trace_path,
        label_error=label_error,
        category_ms={cat: per_step_ms * pct / 100.0 for cat, pct in s.shares.items()},
        top_ops={row.name: row.self_us / n / 1e3 for row in result.rows[:TOP_OPS]},
        host_ops={r.name: {"ms": r.self_cpu_us / n / 1e3, "calls": r.calls / n} for r in result.host_rows},
        steps=s.steps,
        step_times_ms=list(result.step_times_ms),
        steady=steady,
        steady_error=steady_error,
    )
