"""Part A: any training step under torch.profiler -> operator table, trace.json, profile.json.

`profile(step)` takes a zero-argument callable that runs one whole training step (forward, loss,
backward, optimizer), the user's own or one profuse builds (`spec_step`, for the built-in GPT and
Hugging Face models of profuse.models):

1. `warmup` steps first, so first-call costs (allocator growth, kernel selection, torch.compile)
   stay out of the profile; the last of them runs under the profiler's own warm-up phase, so
   the profiler's start-up stays out too. Where the step runs is asked of the step itself when
   not given: the device of the first module parameter it uses.
2. `steps` steps under torch.profiler, each one `ProfilerStep#N` span ended by a device
   synchronisation, which makes its wall time honest and keeps every kernel of a step inside its
   span. Every call of a norm, MLP, attention, decoder layer or rotary module runs inside a
   `profuse.module: ROLE` range (profuse.structure), so the trace says which module issued each
   operator. profuse's own steps also cut each step into `forward`, `backward` and `optimizer`
   ranges for Perfetto; the reading needs none of them.
3. The operator table (`key_averages().table`), sorted by self CPU time on CPU and by self device
   time on CUDA, as the lab prints it; the trace and profile.json, each written whole or not at all.
4. The reading of the trace (profuse.attribution.analyze_trace): time by category and by phase,
   operators or kernels per step, the GPU's idle share and the launch-bound verdict, and the
   fusion candidates by the structure that issued them.

profuse's own steps run in one of two precisions (profuse.models.spec.PRECISIONS): amp, the
default, runs the forward and the loss under bf16 autocast on CUDA (the lab's CUDA dtype: matmuls
and attention in bf16 on the tensor cores, the weights, AdamW and the loss in fp32; on CPU all is
fp32, as in the lab); bf16 holds the parameters and AdamW's state in bf16, no autocast. A user's
step runs as written.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import profiler as torch_profiler
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, schedule

from profuse.attribution import (  # noqa: F401 - the trace's reading, under the names profuse used first
    BACKWARD,
    CATEGORIES,
    CATEGORY_LABELS,
    CATEGORY_RULES,
    FORWARD,
    HOST_CATS,
    LAUNCH_BOUND_IDLE_PCT,
    OPTIMIZER,
    OPTIONAL_CATEGORIES,
    STEP_PREFIX,
    Candidate,
    Intervals,
    Span,
    TraceSummary,
    analyze_spans,
    analyze_trace,
    categorize,
    event_rows,
    extend_categories,
    intersect,
    read_spans,
    total_length,
    union,
)
from profuse.env import quiet_native_stderr
from profuse.errors import UsageError
from profuse.files import atomic_path, check_folder, write_result
from profuse.model import GPTConfig
from profuse.models.spec import DEFAULT_PRECISION, ModelSpec, check_precision, make_step, precision_text
from profuse.structure import module_ranges

Progress = Callable[[str], None]


def _required(f) -> bool:
    """Is dataclass field `f` one without a default?"""
    return f.default is MISSING and f.default_factory is MISSING


# The "kind" of a saved Part A summary (profile.json: {"kind": ..., "eager": ..., "compiled": ...});
# Part B's results files are "tail" and "sweep".
SUMMARY_KIND = "part_a"
SUMMARY_NAME = "profile.json"


@dataclass
class ProfileConfig:
    """How a step is profiled and where the files go; `model` is the built-in GPT's size where
    the step is Part A's own (run_profile), and unused by profile()."""

    model: GPTConfig = field(default_factory=GPTConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # resolved by the caller
    steps: int = 4  # profiled steps: the lab's 4; a CPU trace of the default model is about 3 MB
    warmup: int = 2  # unprofiled steps first, so first-call costs stay out
    compile: bool = False  # the model under torch.compile (the warm-up steps compile it)
    out_dir: Path = Path(".")
    trace_name: str = "trace.json"  # the lab writes ./trace.json
    seed: int = 0  # weights and the batch of random tokens
    row_limit: int = 12  # rows in the operator table
    lr: float = 1e-3  # AdamW's; any value profiles the same, this one also lets the model learn fast
    precision: str = DEFAULT_PRECISION  # amp or bf16 (profuse.models.spec.PRECISIONS)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.out_dir = Path(self.out_dir)
        check_precision(self.precision)
        if self.steps < 1:
            raise UsageError(f"the profile needs at least one step, not {self.steps}")
        if self.warmup < 0:
            raise UsageError(f"warm-up steps cannot be negative ({self.warmup})")
        if self.compile and self.warmup < 1:
            raise UsageError("a compiled profile needs a warm-up step, so compilation stays out of it")
        if self.row_limit < 1:
            raise UsageError(f"the operator table needs at least one row, not {self.row_limit}")
        if not self.trace_name or Path(self.trace_name).name != self.trace_name:
            raise UsageError(f"trace name {self.trace_name!r} must be a plain file name")

    def to_dict(self) -> dict:
        return {
            "model": {**asdict(self.model), "ffn_hidden": self.model.hidden},
            "device": str(self.device),
            "steps": self.steps,
            "warmup": self.warmup,
            "compile": self.compile,
            "out_dir": str(self.out_dir),
            "trace_name": self.trace_name,
            "seed": self.seed,
            "row_limit": self.row_limit,
            "lr": self.lr,
            "precision": self.precision,
        }


@dataclass
class OperatorRow:
    """One row of the operator table, as data."""

    name: str
    self_us: float  # the table's sort key: self CPU time on CPU, self device time on CUDA
    calls: int
    self_cpu_us: float


@dataclass
class ProfileResult:
    device: str
    compiled: bool
    precision: str  # "fp32", or "bf16 autocast" on CUDA
    torch_version: str
    config: dict
    steps: int  # profiled steps found in the trace
    table: str  # key_averages().table(...), as the lab prints it
    sort_by: str  # the table's sort key
    rows: list[OperatorRow]
    step_ms: float  # median wall time of a profiled step, synchronised
    step_times_ms: list[float]
    summary: TraceSummary
    hotspot: str
    trace_path: str
    trace_bytes: int
    about: dict = field(default_factory=dict)  # what was profiled: the model's spec, or the user's step
    # the events that took the most self CPU time, ranges included (a range's self time is the
    # Python between its ops): where the host's time goes, on CUDA as on a CPU
    host_rows: list[OperatorRow] = field(default_factory=list)

    @property
    def candidates(self) -> list[Candidate]:
        return self.summary.candidates

    @property
    def shares(self) -> dict[str, float]:
        return self.summary.shares

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "compiled": self.compiled,
            "precision": self.precision,
            "torch": self.torch_version,
            "config": self.config,
            "steps": self.steps,
            "sort_by": self.sort_by,
            "table": self.table,
            "rows": [asdict(r) for r in self.rows],
            "step_ms": self.step_ms,
            "step_times_ms": list(self.step_times_ms),
            **asdict(self.summary),
            "hotspot": self.hotspot,
            "trace_path": self.trace_path,
            "trace_bytes": self.trace_bytes,
            "about": self.about,
            "host_rows": [asdict(r) for r in self.host_rows],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ProfileResult:
        """The result again from `to_dict()`'s JSON (the summary's fields are flattened into it)."""
        # A field with a default may be absent: a summary written before it existed (region_pct,
        # candidates, phase_pct, label_pct: files older than the structural reading).
        summary = TraceSummary(
            **{f.name: d[f.name] for f in fields(TraceSummary) if f.name in d or _required(f)}
        )
        return cls(
            device=d["device"],
            compiled=bool(d["compiled"]),
            precision=d["precision"],
            torch_version=d["torch"],
            config=d["config"],
            steps=int(d["steps"]),
            table=d["table"],
            sort_by=d["sort_by"],
            rows=[OperatorRow(**r) for r in d["rows"]],
            step_ms=float(d["step_ms"]),
            step_times_ms=[float(t) for t in d["step_times_ms"]],
            summary=summary,
            hotspot=d["hotspot"],
            trace_path=d["trace_path"],
            trace_bytes=int(d["trace_bytes"]),
            about=dict(d.get("about") or {}),
            host_rows=[OperatorRow(**r) for r in d.get("host_rows", [])],  # absent before they were kept
        )


def run_profile(
    cfg: ProfileConfig,
    progress: Progress | None = None,
    *,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    batch_seed: int | None = None,
    extra_rules: tuple[tuple[str, str], ...] = (),
) -> ProfileResult:
    """Profile `cfg.steps` training steps of the built-in GPT of size cfg.model; write the trace
    to cfg.out_dir / cfg.trace_name (not profile.json: the caller saves what it ran together).

    For profuse.distributed: `wrap` is applied to the model on its device, before torch.compile
    (DistributedDataParallel; the optimizer holds the parameters, which the wrapper shares);
    `batch_seed` draws the batch (default cfg.seed), so each data-parallel rank has its own;
    `extra_rules` are tried before CATEGORY_RULES when the trace is read (see analyze_trace).
    """
    result, _trace = profile_with_trace(
        cfg, progress, wrap=wrap, batch_seed=batch_seed, extra_rules=extra_rules
    )
    return result


def profile_with_trace(
    cfg: ProfileConfig,
    progress: Progress | None = None,
    *,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    batch_seed: int | None = None,
    extra_rules: tuple[tuple[str, str], ...] = (),
) -> tuple[ProfileResult, dict]:
    """`run_profile`, with the trace as it was read back: a caller that reads more from it
    (profuse.distributed, the communication) parses the JSON once."""
    from profuse.models.gpt import GPTSpec

    spec = GPTSpec(cfg.model)
    step = spec_step(
        spec, cfg.device, seed=cfg.seed, lr=cfg.lr, compile=cfg.compile, wrap=wrap, batch_seed=batch_seed,
        precision=cfg.precision,
    )  # fmt: skip
    precision = spec_precision(cfg.device, cfg.precision)
    return _profile_step(step, cfg, cfg.to_dict(), progress, extra_rules=extra_rules, precision=precision)


def profile(
    step: Callable[[], object],
    *,
    steps: int = 4,
    warmup: int = 2,
    out: str | Path = ".",
    device: str | torch.device | None = None,
    trace_name: str = "trace.json",
    regions: Iterable[str] = (),
    row_limit: int = 12,
    compiled: bool = False,
    progress: Progress | None = None,
    summary_name: str | None = SUMMARY_NAME,
    about: dict | None = None,
    structure: bool = True,
    precision: str | None = None,
    operator_table: bool = True,
) -> ProfileResult:
    """Profile any training step: `step` is a zero-argument callable that runs one whole step.

    `warmup` untimed steps first (a compiled step compiles in them), then `steps` steps under
    torch.profiler, each ended by a device synchronisation. Writes the trace to out/trace_name
    and the result to out/summary_name (profile.json; None writes none), and returns it: the
    operator table, the step's time by category and phase, kernels (CUDA) or operators (CPU) per
    step, the GPU's idle share, and the fusion candidates by the structure that issued them
    (ProfileResult.candidates; profuse.report.profile.format_profile prints it all).

    `device`: where the step runs (default: the device of the first module parameter the step
    uses, found in the warm-up); `regions`: record_function range names whose share of the step
    to report (ProfileResult.summary.region_pct; the user's own ranges are found anyway, in
    label_pct); `compiled` labels the result as torch.compile's and asks for a warm-up step;
    `about`: what was profiled, saved with the result; `structure`: open the module ranges that
    name the candidates (off for a compiled step, where Inductor's kernels mix modules);
    `precision`: how the step computes, for the report (default: "as the step runs it").
    `operator_table=False` leaves the lab's table out (ProfileResult.table empty) and reads the
    rows from the trace instead of the profiler's key_averages, which on a 16-layer step costs
    more than the rest of reading the profile (Part C keeps the rows, never prints the table).
    """
    if summary_name is not None and (not summary_name or Path(summary_name).name != summary_name):
        raise UsageError(f"summary name {summary_name!r} must be a plain file name")
    cfg = ProfileConfig(
        device=torch.device(device) if device is not None else torch.device("cpu"), steps=steps,
        warmup=warmup, compile=compiled, out_dir=Path(out), trace_name=trace_name, row_limit=row_limit,
    )  # fmt: skip
    names = (trace_name,) if summary_name is None else (trace_name, summary_name)
    check_folder(cfg.out_dir, names, flag="out")  # before any step runs
    config = {k: v for k, v in cfg.to_dict().items() if k not in ("model", "seed", "lr", "precision")}
    result, _trace = _profile_step(
        step, cfg, config, progress, regions=tuple(regions), find_device=device is None,
        structure=structure and not compiled, about=about, precision=precision or USERS_PRECISION,
        operator_table=operator_table,
    )  # fmt: skip
    if summary_name is not None:
        write_result(cfg.out_dir / summary_name, {"kind": SUMMARY_KIND, "eager": result.to_dict()})
    return result


def spec_step(
    spec: ModelSpec,
    device: torch.device | str,
    *,
    seed: int = 0,
    lr: float = 1e-3,
    compile: bool = False,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    batch_seed: int | None = None,
    precision: str = DEFAULT_PRECISION,
) -> Callable[[], torch.Tensor]:
    """profuse.models.make_step's training step in `precision` (amp or bf16), cut into
    `forward`, `backward` and `optimizer` ranges for Perfetto (the reading does not depend on them)."""
    return make_step(
        spec, device, seed=seed, lr=lr, compile=compile, wrap=wrap, batch_seed=batch_seed,
        phases=(FORWARD, BACKWARD, OPTIMIZER), precision=precision,
    )  # fmt: skip


def _profile_step(
    train_step: Callable[[], object],
    cfg: ProfileConfig,
    config: dict,
    progress: Progress | None,
    *,
    extra_rules: tuple[tuple[str, str], ...] = (),
    regions: tuple[str, ...] = (),
    find_device: bool = False,
    structure: bool = True,
    about: dict | None = None,
    precision: str | None = None,
    operator_table: bool = True,
) -> tuple[ProfileResult, dict]:
    """Warm-up, the profiled steps, the table, the trace and its reading, for any step
    (`precision` None: profuse's own step's, spec_step's; `operator_table`: see profile)."""
    say = progress or (lambda _msg: None)
    structure = structure and not cfg.compile  # module hooks would break Dynamo's graphs
    with module_ranges(enabled=structure) as ranges:
        profiler_warmup = _warm_up(cfg, train_step, say)
        if find_device:
            cfg = replace(cfg, device=_step_device(ranges.device))
            config = {**config, "device": str(cfg.device)}
        prof, step_times = _profiled_steps(cfg, train_step, profiler_warmup, say)
    device = cfg.device
    on_cuda = device.type == "cuda"
    if operator_table:
        table, sort_by, rows = _operator_table(prof.key_averages(), on_cuda, cfg.row_limit)
    trace_path = cfg.out_dir / cfg.trace_name
    trace = _write_trace(prof, trace_path, say)
    spans = read_spans(trace)  # once: the rows and the reading both come from it
    work, host = event_rows(spans, device.type, cfg.row_limit)
    host_rows = [OperatorRow(name, us, n, us) for name, us, n in host]
    if not operator_table:
        table, sort_by = "", "self_device_time_total" if on_cuda else "self_cpu_time_total"
        rows = [OperatorRow(name, us, n, 0.0 if on_cuda else us) for name, us, n in work]  # kernels: no CPU
    summary = analyze_spans(spans, device=device.type, extra_rules=extra_rules, regions=regions)
    result = ProfileResult(
        device=str(device),
        compiled=cfg.compile,
        precision=precision or spec_precision(device),
        torch_version=torch.__version__,
        config=config,
        steps=summary.steps,
        table=table,
        sort_by=sort_by,
        rows=rows,
        step_ms=statistics.median(step_times) * 1e3,
        step_times_ms=[t * 1e3 for t in step_times],
        summary=summary,
        hotspot=summary.hotspot(compiled=cfg.compile),
        trace_path=str(trace_path),
        trace_bytes=trace_path.stat().st_size,
        about=dict(about or {}),
        host_rows=host_rows,
    )
    return result, trace


USERS_PRECISION = "as the step runs it"


def spec_precision(device: torch.device, precision: str = DEFAULT_PRECISION) -> str:
    """How spec_step computes on `device` in `precision`, in words (models.spec.precision_text):
    'amp: bf16 autocast over fp32 parameters and AdamW state' on CUDA, for instance."""
    return precision_text(device, precision)


def _step_device(seen: torch.device | None) -> torch.device:
    """Where a step runs: the device of the first module parameter it used; for a step that used
    no module, CUDA when it left tensors there, else the CPU."""
    if seen is not None and seen.type == "cuda" and seen.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if seen is not None:
        return seen
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_allocated() > 0:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(cfg: ProfileConfig, train_step: Callable[[], object], say: Progress) -> int:
    """Run the warm-up steps that go before the profiler starts; returns how many more run
    under the profiler's own warm-up phase (the last one, so its start-up stays out too)."""
    profiler_warmup = min(cfg.warmup, 1)
    unprofiled = cfg.warmup - profiler_warmup
    if cfg.compile:  # compile before the profiler starts, not under it (its events would be discarded)
        unprofiled = max(unprofiled, 1)
    what = "eager" if not cfg.compile else "torch.compile (the first step compiles: it takes a while)"
    say(f"warm-up: {unprofiled + profiler_warmup} training step(s), {what}")
    for _ in range(unprofiled):
        train_step()
    _synchronize(cfg.device)
    return profiler_warmup


def _profiled_steps(
    cfg: ProfileConfig, train_step: Callable[[], object], profiler_warmup: int, say: Progress
) -> tuple[torch_profiler.profile, list[float]]:
    """The profiler loop: `profiler_warmup` steps, then `cfg.steps` recorded ones, each ended by
    a device synchronisation. Returns the profiler and the recorded steps' wall times (s)."""
    device = cfg.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*warmup.*")  # warmup=0 is asked for, not a mistake
        sched = schedule(wait=0, warmup=profiler_warmup, active=cfg.steps, repeat=1)
    say(f"profiling {cfg.steps} training steps on {device}")
    step_times: list[float] = []
    with quiet_native_stderr(), torch_profiler.profile(activities=activities, schedule=sched) as prof:
        for i in range(profiler_warmup + cfg.steps):
            t0 = time.perf_counter()
            train_step()
            _synchronize(device)
            if i >= profiler_warmup:
                step_times.append(time.perf_counter() - t0)
            prof.step()
    return prof, step_times


def _operator_table(averages: EventList, on_cuda: bool, row_limit: int) -> tuple[str, str, list[OperatorRow]]:
    """The lab's operator table (key_averages().table), its sort key, and its top rows as data."""
    if on_cuda:
        # On CUDA a range's kernels count twice: for the op that launched them and for the range
        # (its gpu_user_annotation); `forward` showed 291% of the device time on an H200. The
        # table keeps operators and kernels; the ranges stay in the trace.
        averages = EventList([a for a in averages if not _is_range(a)], use_device="cuda")
    sort_by = _sort_key(averages, on_cuda)
    table = averages.table(sort_by=sort_by, row_limit=row_limit)
    ranked = sorted(averages, key=lambda a: getattr(a, sort_by, 0.0), reverse=True)
    rows = [
        OperatorRow(
            name=a.key,
            self_us=float(getattr(a, sort_by, 0.0)),
            calls=int(a.count),
            self_cpu_us=float(a.self_cpu_time_total),
        )
        for a in ranked[:row_limit]
    ]
    return table, sort_by, rows


def _write_trace(prof: torch_profiler.profile, path: Path, say: Progress) -> dict:
    """Export the Chrome trace to `path`, whole or not at all, and read it back."""
    say(f"writing {path}")
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def compiled_trace_name(trace_name: str) -> str:
    """'trace.json' -> 'trace-compiled.json': the compiled step's trace, beside the eager one's."""
    stem, suffix = os.path.splitext(trace_name)
    return f"{stem}-compiled{suffix}"


def compiled_config(cfg: ProfileConfig) -> ProfileConfig:
    """`cfg` under torch.compile: at least one warm-up step (it compiles), trace name marked."""
    return replace(
        cfg, compile=True, warmup=max(cfg.warmup, 1), trace_name=compiled_trace_name(cfg.trace_name)
    )


def _sort_key(averages: EventList, on_cuda: bool) -> str:
    """self_device_time_total from torch 2.4 on; self_cuda_time_total before that rename."""
    if not on_cuda:
        return "self_cpu_time_total"
    sample = next(iter(averages), None)  # an instance attribute: the class does not show it
    if sample is None or hasattr(sample, "self_device_time_total"):
        return "self_device_time_total"
    return "self_cuda_time_total"  # pragma: no cover - torch < 2.4


def _is_range(avg) -> bool:
    """A record_function range (ProfilerStep#N, forward, Optimizer.step#AdamW.step), not an op."""
    flag = getattr(avg, "is_user_annotation", None)
    if flag is not None:
        return bool(flag)
    key = avg.key or ""  # pragma: no cover - a torch without the flag: the ranges profuse knows
    return key.startswith(("ProfilerStep", "Optimizer.")) or key in (FORWARD, BACKWARD, OPTIMIZER)
