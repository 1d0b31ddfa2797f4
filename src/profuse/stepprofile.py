"""Part C's profiles: a short torch.profiler run of each timed variant's step, read for the table.

Each variant is profiled as it was timed (the same model, compiled graphs and AdamW: nothing is
built or compiled again), after the trials; the eager step is profiled through a labelled copy
over the same parameters (ModelSpec.label: the ops fusion replaces in profiler ranges, the math
unchanged), so the trace says how much of the step is in them. What a profile gives the report:
kernels (operators on a CPU) per step, the memory-bound share, the GPU's idle share, and, per
step, the time in each category and in the operator table's top rows: what `--precision both`
reads to say why a variant's rank moved between the precisions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from profuse.profiling import profile

# Warm-up steps before the profiled ones: the variants are warm from the trials, so only the
# profiler's own warm-up step (a compiled step gets one more, outside the profiler: profiling._warm_up).
PROFILE_WARMUP = 1
TOP_OPS = 8  # the operator table's rows kept a step


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
    top_ops: dict[str, float] = field(default_factory=dict)  # the table's top rows -> ms (self) a step
    steps: int = 0  # profiled steps
    step_times_ms: list[float] = field(default_factory=list)  # each profiled step, synchronised

    def to_dict(self) -> dict:
        return asdict(self)


def trace_name(variant: str, tag: str = "") -> str:
    """'trace-step-compile-fused.json'; with a tag (the precision, where a run holds two)
    'trace-step-compile-fused-bf16.json'."""
    suffix = f"-{tag}" if tag else ""
    return f"trace-step-{variant.replace('+', '-')}{suffix}.json"


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
) -> VariantProfile:
    """Profile `steps` of variant `name`'s `step` (warm already). `regions`: profiler range
    names to measure; `block_ops` (op -> its range) the ones whose shares the eager profile
    reports."""
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
    )
    s = result.summary
    n = max(s.steps, 1)
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
        steps=s.steps,
        step_times_ms=list(result.step_times_ms),
    )
