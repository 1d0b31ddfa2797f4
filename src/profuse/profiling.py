"""Part A: a GPT training step under torch.profiler -> operator table, trace.json, and its reading.

`run_profile` trains the model of `profuse.model` on one fixed batch of random tokens:

1. `warmup` steps first, so first-call costs (allocator growth, kernel selection, torch.compile)
   stay out of the profile; the last of them runs under the profiler's own warm-up phase, so
   the profiler's start-up stays out too. A compiled model compiles in a step before that.
2. `steps` steps under torch.profiler. Each is one `ProfilerStep#N` span holding `forward` (the
   loss included), `backward` and `optimizer` (AdamW step and zero_grad) ranges, so the trace in
   Perfetto shows the steps and their phases. Each step ends with a device synchronisation, which
   makes its wall time honest and keeps every kernel of a step inside its span.
3. The operator table (`key_averages().table`), sorted by self CPU time on CPU and by self device
   time on CUDA, as the lab prints it; the trace, written whole or not at all.
4. The reading of the trace (`analyze_trace`): the step's time by category, operators or kernels
   per step, the GPU's idle share, and the memory-bound hot spot to fuse.

On CUDA the forward and the loss run under bf16 autocast (the lab's CUDA dtype): matmuls and
attention in bf16 on the tensor cores, the weights, AdamW and the loss in fp32. On CPU all is
fp32, as in the lab.

Categories come from names (`CATEGORY_RULES`, first match wins): over the self CPU time of every
host range on CPU, over kernel time on CUDA. Anything started inside the `optimizer` range is
optimizer work whatever its name (AdamW's mul_, add_, lerp_ would otherwise read as elementwise).
A CUDA kernel is classified by its own name first; a name that matches no rule (cuDNN's
compute_dot_do_o, GammaBetaBackward, CatArrayBatchedCopy) takes the category of the operator that
launched it, found through the launch's correlation id. On an H200 (torch 2.11) every kernel
matched its launch, and 4.5% of the eager step's kernel time stayed "other": the embedding's
backward.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import statistics
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import profiler as torch_profiler
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, record_function, schedule

from profuse.compile import compile_model
from profuse.env import check_fits, quiet_native_stderr
from profuse.errors import UsageError
from profuse.files import atomic_path
from profuse.model import GPT, GPTConfig, random_batch

Progress = Callable[[str], None]

# The "kind" of a saved Part A summary (profile.json: {"kind": ..., "eager": ..., "compiled": ...});
# Part B's results files are "tail" and "sweep".
SUMMARY_KIND = "part_a"

# The ranges each profiled step is cut into; the trace shows them under ProfilerStep#N.
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
STEP_PREFIX = "ProfilerStep#"

CATEGORIES = ("matmul", "attention", "memory_bound", "loss", "optimizer", "other")
CATEGORY_LABELS = {
    "matmul": "matmul",
    "attention": "attention",
    "memory_bound": "elementwise + norm (memory-bound)",
    "loss": "loss",
    "optimizer": "optimizer",
    "other": "other",
}

# Elementwise ops, reductions and normalisations: a few flops per byte, bound by memory traffic.
_MEMORY_BOUND_OPS = (
    "silu|gelu|relu|sigmoid|tanh|threshold|mul|add|sub|div|neg|reciprocal|pow|rsqrt|sqrt|exp|abs"
    "|clamp|maximum|minimum|where|masked_fill|mean|sum|norm|rms_norm|fused_rms_norm|layer_norm"
    "|native_layer_norm|copy|to_copy|to|type_as|clone|contiguous|fill|zero|zeros|ones|zeros_like"
    "|ones_like|cat|lerp|addcmul|addcdiv"
)

# (category, pattern) over the lower-cased name of an operator or kernel; the first match wins,
# whatever does not match is "other" (views, allocation, embedding gathers, framework overhead).
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    # AdamW in any form: the for-loop's ranges, foreach ops, the multi-tensor and fused kernels.
    ("optimizer", r"optimizer|adam|_foreach_|multi_tensor_apply"),
    # cross_entropy = log_softmax + nll_loss, forward and backward; CUDA names its kernel
    # cunn_SoftMaxForward<..LogSoftMaxForwardEpilogue>, Inductor triton_..__log_softmax_..
    ("loss", r"log_?softmax|nll_?loss|cross_?entropy"),
    # SDPA and its backends: flash (pytorch_flash::), memory-efficient (fmha_cutlass), cuDNN (sdpa)
    ("attention", r"scaled_?dot_?product|flash|fmha|sdpa|attention|attn"),
    # aten matmuls and their autograd nodes; cuBLAS/cuBLASLt kernels (gemm, nvjet on Hopper,
    # sm90_xmma, cutlass, split-K reductions); Inductor's matmul templates (triton_tem_)
    (
        "matmul",
        r"(?<![a-z])(add|b|baddb)?mm(?![a-z])|mmbackward|matmul|aten::linear|gemm|gemv|cublas|cutlass"
        r"|nvjet|xmma|wgmma|splitk|triton_tem",
    ),
    # Kernels Inductor generates: pointwise (poi), reductions (red, per); on CPU the compiled
    # graph's fused C++ code runs inside the '## Call CompiledFxGraph ##' range, which carries its
    # self time (the matmuls and SDPA it calls still show as aten ops).
    ("memory_bound", r"triton_(poi|red|per)_|cpp_fused|compiledfxgraph"),
    # Gathers and scatters (embedding forward and backward, sorts of token ids): memory-bound,
    # but no fusion of the tail removes them.
    ("other", r"embedding|index_?select|indexselect|scatter|gather|sort|segment"),
    (
        "memory_bound",
        rf"aten::_?({_MEMORY_BOUND_OPS})(_backward|_backward_data|_)?$"
        rf"|({_MEMORY_BOUND_OPS.replace('_', '')})backward"  # autograd nodes: MulBackward0, ...
        r"|elementwise|reduce_kernel|layer_norm|rms_?norm|silu|copy_kernel|fillfunctor",
    ),
)
_RULES = tuple((cat, re.compile(pat)) for cat, pat in CATEGORY_RULES)
Rules = tuple[tuple[str, "re.Pattern[str]"], ...]

# The SwiGLU tail's ops, unfused (aten names) or as Inductor names its fused kernels.
_TAIL_OPS = re.compile(r"silu|(?<![a-z])(mul|add|pow|mean)(?![a-z])|rsqrt|rms_?norm")

HOST_CATS = ("cpu_op", "user_annotation")  # trace categories of host-side ranges
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernel (Triton)
_DEVICE_BUSY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

# Above this share of the step with no kernel, memcpy or memset running, the GPU spends more of
# the step waiting for the CPU to launch work than doing it: the step is launch-bound, and making
# kernels faster (fusion's bytes saved) cannot shorten it. Issue #15, on an H200: ~90% idle at the
# lab's d_model 256 (launch-bound), 4% at d_model 2048 (bound by the GPU's work).
LAUNCH_BOUND_IDLE_PCT = 50.0

# Autograd's backward nodes run as this range, carrying the sequence number of the forward op
# that made them: how a backward kernel is traced to the forward op it belongs to.
_BACKWARD_NODE = "autograd::engine::evaluate_function: "

# The ranges torch's optimizers open themselves (Optimizer.step#AdamW.step, ...zero_grad): the
# optimizer's work is found in any step, labelled by its author or not.
_TORCH_OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")


def is_tail_op(name: str) -> bool:
    """Whether an op (or fused kernel) name is one of the tail's: silu, mul, add, rms_norm's parts."""
    return _TAIL_OPS.search(name.lower()) is not None


def categorize(name: str, rules: Rules = _RULES) -> str:
    """The category of an operator, autograd node or kernel name, by CATEGORY_RULES (or `rules`)."""
    low = name.lower()
    for cat, pattern in rules:
        if pattern.search(low):
            return cat
    return "other"


@dataclass
class ProfileConfig:
    """What Part A profiles and where it writes. The CLI maps its flags onto these fields."""

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

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.out_dir = Path(self.out_dir)
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
        }


@dataclass
class OperatorRow:
    """One row of the operator table, as data."""

    name: str
    self_us: float  # the table's sort key: self CPU time on CPU, self device time on CUDA
    calls: int
    self_cpu_us: float


def _required(f) -> bool:
    """Is dataclass field `f` one without a default?"""
    return f.default is MISSING and f.default_factory is MISSING


@dataclass
class TraceSummary:
    """What `analyze_trace` reads from a trace: where the step's time went."""

    steps: int  # ProfilerStep spans found
    basis: str  # "self CPU time" or "GPU kernel time": what the shares divide
    total_us: float  # that time summed over the steps
    shares: dict[str, float]  # category -> % of total_us, CATEGORIES (+ extra_rules') order, adding to 100
    launches_per_step: float  # kernels on CUDA, aten operator calls on CPU
    launch_unit: str  # "kernels" or "operators"
    gpu_idle_pct: float | None  # % of the step spans with no kernel, memcpy or memset running; CUDA only
    memory_bound_groups: dict[str, float]  # op (or kernel) -> % of total_us, memory-bound only, largest first
    tail_pct: float  # the part of memory_bound that is the SwiGLU tail's ops
    # region (a profiler range name given to analyze_trace) -> % of total_us in it, forward and
    # backward: its operators and kernels, and the backward nodes its forward operators made
    region_pct: dict[str, float] = field(default_factory=dict)

    @property
    def launch_bound(self) -> bool:
        """GPU idle over LAUNCH_BOUND_IDLE_PCT of the step (CUDA only): derived, so not a field."""
        return self.gpu_idle_pct is not None and self.gpu_idle_pct > LAUNCH_BOUND_IDLE_PCT

    def launch_bound_reading(self) -> str:
        """What a launch-bound step means and what helps it (empty when the GPU is busy)."""
        if not self.launch_bound:
            return ""
        return (
            f"the GPU sat idle {self.gpu_idle_pct:.0f}% of the step (over {LAUNCH_BOUND_IDLE_PCT:.0f}%): "
            "the step is launch-bound, the CPU cannot issue kernels as fast as the GPU runs them. "
            f"Fusion helps here only by launching fewer kernels ({self.launches_per_step:.0f} per step "
            "now), not by moving fewer bytes; what helps: CUDA graphs (torch.compile "
            'mode="reduce-overhead") or a bigger batch, so each launch carries more work'
        )

    def hotspot(self, compiled: bool = False) -> str:
        """The one line naming what to fuse (or, for a compiled step, what Inductor fused)."""
        mb = self.shares.get("memory_bound", 0.0)
        if self.launch_bound:  # no kernel is the bottleneck: naming one to fuse would mislead
            return (
                f"none named: the step is launch-bound (GPU idle {self.gpu_idle_pct:.0f}%), so shorter "
                f"kernels do not shorten it (memory-bound work is {mb:.1f}% of the {self.basis})"
            )
        if mb <= 0.0:
            return f"no memory-bound elementwise work in the {self.basis}: nothing to fuse"
        head = f"memory-bound elementwise + norm work is {mb:.1f}% of the {self.basis}"
        tail = [(n, pct) for n, pct in self.memory_bound_groups.items() if is_tail_op(n)][:3]
        if not tail:  # Inductor on CPU: the fused code runs inside the compiled graph's range
            top = ", ".join(f"{n} {pct:.1f}%" for n, pct in list(self.memory_bound_groups.items())[:2])
            return f"{head} ({top}); no unfused tail op is left: Part B times how much fusing saved"
        ops = ", ".join(f"{n} {pct:.1f}%" for n, pct in tail)
        if compiled:
            return (
                f"{head}, {self.tail_pct:.1f}% in fused kernels holding the SwiGLU tail's ops ({ops}) "
                "-> Part B times these fusions against a hand-written Triton kernel"
            )
        return (
            f"{head}, {self.tail_pct:.1f}% in the SwiGLU tail's ops ({ops}) "
            "-> fuse rms_norm(silu(gate) * up + residual) * w, as Part B does"
        )


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
        }

    @classmethod
    def from_dict(cls, d: dict) -> ProfileResult:
        """The result again from `to_dict()`'s JSON (the summary's fields are flattened into it)."""
        # A field with a default may be absent: a summary written before it existed (region_pct).
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
        )


def run_profile(
    cfg: ProfileConfig,
    progress: Progress | None = None,
    *,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    batch_seed: int | None = None,
    extra_rules: tuple[tuple[str, str], ...] = (),
) -> ProfileResult:
    """Profile `cfg.steps` training steps; write the trace to cfg.out_dir / cfg.trace_name.

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
    train_step = _training_step(cfg, wrap, batch_seed)
    return _profile_step(train_step, cfg, cfg.to_dict(), progress, extra_rules=extra_rules)


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
) -> ProfileResult:
    """Profile any training step: `step` is a zero-argument callable that runs one whole step.

    `warmup` untimed steps first (a compiled step compiles in them), then `steps` steps under
    torch.profiler, each ended by a device synchronisation. Writes the trace to out/trace_name
    and returns what Part A returns: the operator table, the step's time by category, kernels
    (CUDA) or operators (CPU) per step, the GPU's idle share, and its reading. `device`: where
    the step runs (default: CUDA if there is a GPU); `regions`: record_function range names
    whose share of the step to report (ProfileResult.summary.region_pct). `compiled` only
    labels the result (and asks for a warm-up step).
    """
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    cfg = ProfileConfig(
        device=device, steps=steps, warmup=warmup, compile=compiled, out_dir=Path(out),
        trace_name=trace_name, row_limit=row_limit,
    )  # fmt: skip
    config = {k: v for k, v in cfg.to_dict().items() if k not in ("model", "seed", "lr")}
    result, _trace = _profile_step(step, cfg, config, progress, regions=tuple(regions))
    return result


def _profile_step(
    train_step: Callable[[], object],
    cfg: ProfileConfig,
    config: dict,
    progress: Progress | None,
    *,
    extra_rules: tuple[tuple[str, str], ...] = (),
    regions: tuple[str, ...] = (),
) -> tuple[ProfileResult, dict]:
    """Warm-up, the profiled steps, the table, the trace and its reading, for any step."""
    say = progress or (lambda _msg: None)
    device = cfg.device
    profiler_warmup = _warm_up(cfg, train_step, say)
    prof, step_times = _profiled_steps(cfg, train_step, profiler_warmup, say)
    table, sort_by, rows = _operator_table(prof, device.type == "cuda", cfg.row_limit)
    trace_path = cfg.out_dir / cfg.trace_name
    trace = _write_trace(prof, trace_path, say)
    summary = analyze_trace(trace, device=device.type, extra_rules=extra_rules, regions=regions)
    result = ProfileResult(
        device=str(device),
        compiled=cfg.compile,
        precision="bf16 autocast" if device.type == "cuda" else "fp32",
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
    )
    return result, trace


def _training_step(
    cfg: ProfileConfig,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None,
    batch_seed: int | None,
) -> Callable[[], None]:
    """The set-up: the model on its device (wrapped, then compiled), AdamW and one fixed batch.
    Returns one training step, cut into the `forward`, `backward` and `optimizer` ranges."""
    device = cfg.device
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    generator = torch.Generator().manual_seed(cfg.seed if batch_seed is None else batch_seed)
    idx, targets = random_batch(cfg.model, generator, device)
    net = wrap(model) if wrap is not None else model
    net = compile_model(net) if cfg.compile else net  # profuse.compile holds the settings
    autocast = (
        (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else contextlib.nullcontext
    )

    def train_step() -> None:
        with record_function(FORWARD), autocast():
            _logits, loss = net(idx, targets)
        with record_function(BACKWARD):
            loss.backward()
        with record_function(OPTIMIZER):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train_step


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


def _operator_table(
    prof: torch_profiler.profile, on_cuda: bool, row_limit: int
) -> tuple[str, str, list[OperatorRow]]:
    """The lab's operator table (key_averages().table), its sort key, and its top rows as data."""
    averages = prof.key_averages()
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


def check_profile_fits(cfg: ProfileConfig) -> None:
    """UsageError (one line) when the profiled model will not fit in the device's free memory."""
    m = cfg.model
    check_fits(
        m.train_bytes(),
        cfg.device,
        f"Part A's step of {m.param_count() / 1e6:.0f}M parameters and {m.tokens} tokens",
    )


def compiled_config(cfg: ProfileConfig) -> ProfileConfig:
    """`cfg` under torch.compile: at least one warm-up step (it compiles), trace name marked."""
    stem, suffix = os.path.splitext(cfg.trace_name)
    return replace(cfg, compile=True, warmup=max(cfg.warmup, 1), trace_name=f"{stem}-compiled{suffix}")


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


# --- reading the trace ----------------------------------------------------------------------------


@dataclass
class Span:
    """A complete ('X') event of the Chrome trace, with what nesting tells about it."""

    name: str
    cat: str
    ts: float  # us
    end: float  # us
    args: dict
    child_us: float = 0.0
    parents: tuple[Span, ...] = ()  # the host ranges open around it, innermost first

    @property
    def self_us(self) -> float:
        return max(self.end - self.ts - self.child_us, 0.0)


class _Windows:
    """Sorted, non-overlapping time windows; `find(t)` is the index of the one holding t, or -1."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: s.ts)
        self._starts = [s.ts for s in self.spans]

    def find(self, t: float) -> int:
        i = bisect.bisect_right(self._starts, t) - 1
        return i if i >= 0 and t <= self.spans[i].end else -1

    def __len__(self) -> int:
        return len(self.spans)


def _nest(spans: list[Span]) -> None:
    """Fill child_us and parents for host-side spans, thread by thread, as the profiler nests them."""
    by_thread: dict[tuple, list[Span]] = defaultdict(list)
    for s in spans:
        if s.cat in HOST_CATS or s.cat in _LAUNCH_CATS:
            by_thread[(s.args.get("_pid"), s.args.get("_tid"))].append(s)
    for thread_spans in by_thread.values():
        thread_spans.sort(key=lambda s: (s.ts, -(s.end - s.ts)))
        stack: list[Span] = []
        for s in thread_spans:
            while stack and stack[-1].end <= s.ts:
                stack.pop()
            if stack:
                parent = stack[-1]
                parent.child_us += min(s.end, parent.end) - s.ts
                s.parents = tuple(reversed(stack))
            stack.append(s)


def read_spans(trace: dict | list) -> list[Span]:
    """The complete events of a Chrome trace, host ranges nested thread by thread."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = []
    for e in events:  # keep pid and tid with the args, for nesting
        if e.get("ph") != "X" or "ts" not in e:
            continue
        ts = float(e["ts"])
        args = dict(e.get("args") or {})
        args["_pid"], args["_tid"] = e.get("pid"), e.get("tid")
        spans.append(
            Span(str(e.get("name", "")), str(e.get("cat", "")), ts, ts + float(e.get("dur", 0.0)), args)
        )
    _nest(spans)
    return spans


def analyze_trace(
    trace: dict | list,
    device: str = "cpu",
    extra_rules: tuple[tuple[str, str], ...] = (),
    regions: Iterable[str] = (),
) -> TraceSummary:
    """Where the profiled steps' time went, read from a Chrome trace written by torch.profiler.

    device "cpu": self CPU time of every host range inside a ProfilerStep span (aten operators,
    autograd nodes, and the Python between them, which lands on `forward`, `backward`,
    `optimizer` and the step itself). device "cuda": device time of every kernel launched inside a
    ProfilerStep span, matched to its launch through the correlation id.

    extra_rules: (category, pattern) pairs tried before CATEGORY_RULES; their categories join the
    shares before "other" (profuse.distributed adds "communication").

    regions: names of record_function ranges (profuse.fusion labels the block ops so); the summary's
    region_pct gives each one's share of the same time, forward and backward: what runs inside the
    range, and the backward nodes made by the operators inside it (matched by sequence number).
    """
    rules = tuple((cat, re.compile(pat)) for cat, pat in extra_rules) + _RULES
    categories = extend_categories(extra_rules)
    spans = read_spans(trace)

    host = [s for s in spans if s.cat in HOST_CATS]
    steps = _Windows(s for s in host if s.name.startswith(STEP_PREFIX))
    if not steps:
        raise RuntimeError("the trace holds no ProfilerStep span: was prof.step() called?")
    optimizer = _Windows(s for s in host if s.name == OPTIMIZER or s.name.startswith(_TORCH_OPTIMIZER_RANGES))

    region_of = _regions(host, tuple(regions))
    time_by_region: dict[str, float] = dict.fromkeys(regions, 0.0)
    time_by_cat: dict[str, float] = dict.fromkeys(categories, 0.0)
    memory_groups: Counter[str] = Counter()
    launches = 0
    gpu_idle_pct = None

    if device == "cuda":
        basis, unit = "GPU kernel time", "kernels"
        launch_of: dict = {}
        for s in spans:
            if s.cat in _LAUNCH_CATS and "correlation" in s.args:
                launch_of.setdefault(s.args["correlation"], s)
        for k in spans:
            if k.cat != "kernel":
                continue
            launch = launch_of.get(k.args.get("correlation"))
            t_launch = launch.ts if launch is not None else k.ts
            if steps.find(t_launch) < 0:
                continue
            launches += 1
            ops = [p for p in launch.parents if p.cat in HOST_CATS] if launch is not None else []
            cat = _kernel_category(k.name, ops, optimizer.find(t_launch) >= 0, rules)
            time_by_cat[cat] += k.end - k.ts
            if cat == "memory_bound":
                memory_groups[_kernel_group(k.name, ops)] += k.end - k.ts
            region = _region(launch.parents, region_of) if region_of and launch is not None else None
            if region is not None:
                time_by_region[region] += k.end - k.ts
        gpu_idle_pct = _idle_pct(steps, [s for s in spans if s.cat in _DEVICE_BUSY_CATS])
    else:
        basis, unit = "self CPU time", "operators"
        for s in host:
            if steps.find(s.ts) < 0:
                continue
            launches += s.name.startswith("aten::")
            cat = "optimizer" if optimizer.find(s.ts) >= 0 else categorize(s.name, rules)
            time_by_cat[cat] += s.self_us
            if cat == "memory_bound":
                memory_groups[s.name] += s.self_us
            region = _region((s, *s.parents), region_of) if region_of else None
            if region is not None:
                time_by_region[region] += s.self_us

    total = sum(time_by_cat.values())
    if total <= 0:
        raise RuntimeError(f"the trace holds no {basis} inside its ProfilerStep spans")
    shares = {c: 100.0 * time_by_cat[c] / total for c in categories}
    groups = {name: 100.0 * t / total for name, t in memory_groups.most_common()}
    tail = sum(pct for name, pct in groups.items() if is_tail_op(name))
    return TraceSummary(
        steps=len(steps),
        basis=basis,
        total_us=total,
        shares=shares,
        launches_per_step=launches / len(steps),
        launch_unit=unit,
        gpu_idle_pct=gpu_idle_pct,
        memory_bound_groups=groups,
        tail_pct=tail,
        region_pct={r: 100.0 * t / total for r, t in time_by_region.items()},
    )


def _regions(host: list[Span], names: tuple[str, ...]) -> dict[int, str]:
    """id(span) -> region, for the spans that open a region: the named ranges themselves, and the
    backward nodes whose sequence number is that of an operator run inside one of them."""
    if not names:
        return {}
    roots = {id(s): s.name for s in host if s.name in names}
    made_by: dict[object, str] = {}  # sequence number of a forward operator -> its region
    for s in host:
        seq = s.args.get("Sequence number")
        if seq is None or s.name.startswith(_BACKWARD_NODE):
            continue
        region = _region((s, *s.parents), roots)
        if region is not None:
            made_by[seq] = region
    for s in host:
        if s.name.startswith(_BACKWARD_NODE) and s.args.get("Sequence number") in made_by:
            roots[id(s)] = made_by[s.args["Sequence number"]]
    return roots


def _region(spans: Iterable[Span], roots: dict[int, str]) -> str | None:
    """The region of the innermost of `spans` (a span, then the ranges open around it) that opens one."""
    for s in spans:
        region = roots.get(id(s))
        if region is not None:
            return region
    return None


def extend_categories(extra_rules: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """CATEGORIES with the categories of `extra_rules` that are new, in their order, before "other"."""
    new = tuple(dict.fromkeys(cat for cat, _ in extra_rules if cat not in CATEGORIES))
    return CATEGORIES[:-1] + new + CATEGORIES[-1:]


def _kernel_category(kernel: str, ops: list[Span], in_optimizer: bool, rules: Rules = _RULES) -> str:
    if in_optimizer:
        return "optimizer"
    cat = categorize(kernel, rules)
    if cat != "other":
        return cat
    for op in ops:  # innermost first: the operator that launched it, then the ones around that
        cat = categorize(op.name, rules)
        if cat != "other":
            return cat
    return "other"


def _kernel_group(kernel: str, ops: list[Span]) -> str:
    """Group kernels by the aten op that launched them (aten::mul); else by the kernel's short name."""
    for op in ops:
        if op.name.startswith("aten::"):
            return op.name
    short = kernel.removeprefix("void ").split("<", 1)[0].split("(", 1)[0]
    return short[:60]


def _idle_pct(steps: _Windows, busy: list[Span]) -> float:
    """% of the step spans during which no kernel, memcpy or memset ran on the GPU."""
    window_us = sum(s.end - s.ts for s in steps.spans)
    busy_us = 0.0
    for step in steps.spans:
        inside = (
            (max(b.ts, step.ts), min(b.end, step.end)) for b in busy if b.end > step.ts and b.ts < step.end
        )
        for start, end in union(inside):
            busy_us += end - start
    return 100.0 * max(window_us - busy_us, 0.0) / window_us if window_us > 0 else 0.0


# --- time intervals on a timeline -------------------------------------------------------------

Intervals = list[tuple[float, float]]  # sorted, disjoint (start, end) in us


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """The union of (start, end) intervals, as sorted disjoint ones; empty ones are dropped."""
    merged: Intervals = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Where two lists of sorted, disjoint intervals overlap."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total_length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)
