"""Part C: how much faster does fusing make the training step, really?

Whole training steps (forward, loss, backward, AdamW step and zero_grad) of the GPT in four
variants, each with its own copy of the same initial parameters and its own optimizer, all on
the same batch:

    eager            the model as written, one op at a time
    fused            its block ops swapped for the fused Triton ones (profuse.fusion)
    compile          the whole model under torch.compile (profuse.compile.compile_model)
    compile+fused    the fused model under torch.compile (the block ops are compiled ops: no break)

bf16 autocast on CUDA, as Part A; fp32 on the CPU. In order, each step before the next:

1. The size is checked against the device's free memory (one line, before any work).
2. Same math: on a small copy of the model (2 layers, 128 tokens, the run's widths) the fused
   step's loss and every gradient are compared with float64 and must be as close to it as the
   unfused step is (within a factor 2, or the dtype's tolerance). A fused step that is not is
   reported as failed and never timed.
3. The first step of every variant (compilation included), its loss and gradients compared with
   eager's at the real size; then interleaved trials of whole steps, back to back as a training
   loop runs them (bench.timing.compare, timing "loop", no L2 flush: a step's own traffic
   evicts the cache), and the step speedup over eager with its bootstrap CI.
4. Peak memory of one step per variant (CUDA): its resident state (parameters, AdamW moments)
   plus the most a step allocates above it.
5. A short profile of each variant (profiling.run_profile): kernels per step, the memory-bound
   share, GPU idle. The eager one labels the block ops (fusion.label_block_ops), so the trace
   says how much of the step is in the ops fusion replaces, forward and backward.
6. Amdahl: those ops' share f of the eager step and their own speedups s, timed like Part B
   (fused vs eager at the model's shapes, forward + backward, device time), predict the step's
   gain 1 / ((1 - sum f) + sum f / s), printed beside the gain measured in 3.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from profuse import __version__, fusion
from profuse import compile as _compile
from profuse import model as M
from profuse.bench.stats import Speedup, speedup_ci
from profuse.bench.timing import Comparison, compare
from profuse.env import check_fits, dtype_name, environment, interpreting
from profuse.errors import UsageError
from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.model import GPT, GPTConfig, random_batch
from profuse.profiling import ProfileConfig, analyze_trace, run_profile
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error

Progress = Callable[[str, int, int], None]

BASELINE = "eager"
VARIANTS = ("eager", "fused", "compile", "compile+fused")
FUSED_VARIANTS = ("fused", "compile+fused")
COMPILED_VARIANTS = ("compile", "compile+fused")

# Model sizes. lab: the GPTConfig defaults (4 layers, d_model 256, 2048 tokens a step). small and
# medium: issue #15's sizes, 8 layers and 8192 tokens a step (1024 x 8); head dim 128 in both.
PRESETS: dict[str, dict] = {
    "lab": {},
    "small": dict(n_layer=8, d_model=1024, n_head=8, seq_len=1024, batch_size=8),
    "medium": dict(n_layer=8, d_model=2048, n_head=16, seq_len=1024, batch_size=8),
}

# The kernel modules behind profuse.blockops' fused ops.
KERNEL_MODULES = ("profuse.kernels.swiglu", "profuse.kernels.add_rms_norm")

# The same-math check's model: the run's widths, few layers and tokens (cheap in float64, and
# through Triton's interpreter on a CPU).
CHECK_LAYERS, CHECK_SEQ_LEN, CHECK_BATCH = 2, 64, 2
# The fused step may be this many times further from float64 than the unfused step: two
# roundings of like size, summed over a whole tensor, differ by much less than 2x.
CHECK_FACTOR = 2.0

# A variant's first step may differ from eager's by this many times the dtype's tolerance (the
# loss's FORWARD_TOL, the gradients' BACKWARD_TOL): each side rounds once, and bf16 autocast
# puts compile and eager 1.8e-2 apart in the gradients at d_model 2048, a third of this bound.
FIRST_STEP_FACTOR = 2.0

# The ops the fused variants replace: their names in fusion, and the profiler range of each.
OPS = (fusion.SILU_MUL, fusion.ADD_RMS_NORM)


def preset_model(preset: str, **overrides: int | None) -> GPTConfig:
    """The preset's GPTConfig with the given fields (None: the preset's) overriding it."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class StepConfig:
    """What Part C runs. The CLI maps --preset and the model flags onto `model`."""

    model: GPTConfig = field(default_factory=GPTConfig)
    preset: str = "lab"  # recorded with the results; `model` is what runs
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    variants: Sequence[str] = VARIANTS  # eager, the baseline, is always in
    trials: int = 30  # interleaved trials of whole steps (and of each op, for Amdahl)
    warmup: int | None = None  # untimed steps after the first: 3 on CUDA, 1 on CPU (steps take ~1 s)
    seed: int = 0  # weights, the batch of random tokens, the trial order
    profile_steps: int = 3  # profiled steps per variant; 0: no profiles and no Amdahl prediction
    out_dir: Path = Path(".")  # the profiles' traces go here
    lr: float = 1e-3  # AdamW's, as Part A

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.out_dir = Path(self.out_dir)
        if self.preset not in PRESETS:
            raise UsageError(f"unknown preset {self.preset!r}: choose from {', '.join(PRESETS)}")
        names = list(dict.fromkeys(self.variants))
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            raise UsageError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
        if BASELINE not in names:
            names.insert(0, BASELINE)
        self.variants = tuple(v for v in VARIANTS if v in names)  # table order
        if self.trials < 2:
            raise UsageError(f"--trials must be at least 2 for a confidence interval, got {self.trials}")
        if self.profile_steps < 0:
            raise UsageError(f"--profile-steps cannot be negative ({self.profile_steps})")
        if self.warmup is None:
            self.warmup = 3 if self.device.type == "cuda" else 1
        if self.warmup < 0:
            raise UsageError(f"warm-up steps cannot be negative ({self.warmup})")

    @property
    def precision(self) -> str:
        return "bf16 autocast" if self.device.type == "cuda" else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the branches compute in: bf16 under CUDA autocast, fp32 on the CPU."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    @property
    def tokens(self) -> int:
        return self.model.tokens

    def to_dict(self) -> dict:
        return {
            "preset": self.preset,
            "resized": self.model != preset_model(self.preset),  # model flags changed the preset's
            "model": {**asdict(self.model), "ffn_hidden": self.model.hidden},
            "device": str(self.device),
            "variants": list(self.variants),
            "trials": self.trials,
            "warmup": self.warmup,
            "seed": self.seed,
            "profile_steps": self.profile_steps,
            "out_dir": str(self.out_dir),
            "lr": self.lr,
            "precision": self.precision,
            "timing": "loop",
        }


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def num_params(m: GPTConfig) -> int:
    """GPT(m).num_params() without building it (GPTConfig.param_count)."""
    return m.param_count()


def estimated_bytes(cfg: StepConfig, n_variants: int) -> int:
    """A generous estimate of the peak memory of the run.

    Per variant, resident: fp32 parameters, gradients and AdamW's two moments (16 bytes a
    parameter). Once: eager's first-step gradients, kept to compare the others with (4), and
    autocast's bf16 copies of the weights (2); one step's activations (GPTConfig.activation_bytes).
    """
    p = num_params(cfg.model)
    return n_variants * 16 * p + 6 * p + cfg.model.activation_bytes()


def check_step_fits(cfg: StepConfig, n_variants: int | None = None) -> None:
    """UsageError (one line) when the run will not fit in the device's free memory."""
    n = len(cfg.variants) if n_variants is None else n_variants
    m = cfg.model
    check_fits(
        estimated_bytes(cfg, n),
        cfg.device,
        f"the step of {num_params(m) / 1e6:.0f}M parameters and {cfg.tokens} tokens in {n} variant(s)",
    )


# --------------------------------------------------------------------------------------------
# What can run here
# --------------------------------------------------------------------------------------------


def fused_unavailable(device: torch.device) -> str:
    """Why the fused Triton block ops cannot run on `device` ('' where they can)."""
    if not HAS_TRITON:
        return TRITON_MISSING
    if device.type != "cuda" and not interpreting():
        return "needs a CUDA GPU; TRITON_INTERPRET=1 runs it on the CPU through Triton's interpreter (slow)"
    for name in KERNEL_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # ImportError, or a kernel module that fails to load
            return f"the fused block-op kernels cannot be imported ({name}: {_first_line(err)})"
    return ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _autocast(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if device.type == "cuda":
        return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# 2. Same math: fused vs unfused vs float64 on a small model
# --------------------------------------------------------------------------------------------


@dataclass
class MathCheck:
    """The fused step against the unfused one, both against float64, on a small model."""

    model: dict  # the small model's GPTConfig
    precision: str
    passed: bool
    # "loss" and every parameter's gradient -> [fused rel err, unfused rel err] vs float64
    errors: dict[str, list[float]] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)  # max(dtype tol, CHECK_FACTOR * unfused's)
    max_abs_diff: float = math.nan  # fused vs unfused, over the loss and every gradient
    worst: str = ""  # the quantity nearest its bound
    error: str = ""  # the exception, where the fused step did not run

    def to_dict(self) -> dict:
        return asdict(self)


def check_model(m: GPTConfig) -> GPTConfig:
    """The run's model cut to CHECK_LAYERS layers and CHECK_BATCH x CHECK_SEQ_LEN tokens."""
    return replace(
        m,
        n_layer=min(m.n_layer, CHECK_LAYERS),
        seq_len=min(m.seq_len, CHECK_SEQ_LEN),
        batch_size=min(m.batch_size, CHECK_BATCH),
    )


def _loss_and_grads(model: GPT, idx, targets, autocast) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    with autocast():
        _, loss = model(idx, targets)
    grads = torch.autograd.grad(loss, list(params.values()))
    return {"loss": loss.detach(), **{f"grad {name}": g for name, g in zip(params, grads)}}


def check_same_math(cfg: StepConfig, ops: fusion.BlockOps) -> MathCheck:
    """Loss and gradients of one step of the small model: fused, unfused and float64."""
    dev, small = cfg.device, check_model(cfg.model)
    torch.manual_seed(cfg.seed)
    base = GPT(small).to(dev)
    idx, targets = random_batch(small, torch.Generator().manual_seed(cfg.seed), dev)
    ref = _loss_and_grads(copy.deepcopy(base).double(), idx, targets, contextlib.nullcontext)
    unfused = _loss_and_grads(base, idx, targets, _autocast(dev))
    check = MathCheck(model=asdict(small), precision=cfg.precision, passed=False)
    try:
        fused = _loss_and_grads(
            fusion.apply_block_ops(copy.deepcopy(base), ops), idx, targets, _autocast(dev)
        )
    except Exception as err:  # a fused op that cannot run here is a failed check, not a crash
        check.error = _first_line(err)
        return check
    worst_ratio = -1.0
    for name, r in ref.items():
        f_err, u_err = relative_error(fused[name], r), relative_error(unfused[name], r)
        tol = (FORWARD_TOL if name == "loss" else BACKWARD_TOL)[cfg.dtype]
        bound = max(tol, CHECK_FACTOR * u_err)
        check.errors[name], check.bounds[name] = [f_err, u_err], bound
        ratio = f_err / bound if math.isfinite(f_err) else math.inf
        if ratio > worst_ratio:
            worst_ratio, check.worst = ratio, name
    check.passed = worst_ratio <= 1.0
    check.max_abs_diff = max((fused[n].float() - unfused[n].float()).abs().max().item() for n in ref)
    return check


# --------------------------------------------------------------------------------------------
# 3. The variants, their first step, and the timed steps
# --------------------------------------------------------------------------------------------


@dataclass
class FirstStep:
    """A variant's first step: what it cost (compilation included) and what it computed."""

    seconds: float
    loss: float
    loss_rel_diff: float | None = None  # |loss - eager's| / |eager's|; None for eager
    grad_rel_diff: float | None = None  # ||g - g_eager|| / ||g_eager|| over all gradients at once

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepMemory:
    """Peak memory of one step (CUDA): resident state plus the most the step allocates above it."""

    state_bytes: int  # parameters and AdamW's two moments, held between steps
    step_bytes: int  # activations, gradients and workspaces: max_memory_allocated over the step

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.step_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


@dataclass
class _Variant:
    name: str
    model: GPT  # its own copy of the initial parameters
    net: torch.nn.Module  # the model, or the model under torch.compile
    optimizer: torch.optim.Optimizer


def _build_variants(cfg: StepConfig, names: Sequence[str], ops: fusion.BlockOps) -> list[_Variant]:
    torch.manual_seed(cfg.seed)
    base = GPT(cfg.model).to(cfg.device)
    out = []
    for name in names:
        model = copy.deepcopy(base)  # the same initial parameters (the tied head stays tied)
        if name in FUSED_VARIANTS:
            fusion.apply_block_ops(model, ops)
        net = _compile.compile_model(model) if name in COMPILED_VARIANTS else model
        out.append(_Variant(name, model, net, torch.optim.AdamW(model.parameters(), lr=cfg.lr)))
    return out


def _train_step(v: _Variant, idx, targets, autocast) -> Callable[[], torch.Tensor]:
    """One whole step, as a training loop runs it; returns the loss without reading it (no sync)."""

    def step() -> torch.Tensor:
        with autocast():
            _, loss = v.net(idx, targets)
        loss.backward()
        v.optimizer.step()
        v.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _check_first_step(first: FirstStep, dtype: torch.dtype) -> None:
    """ValueError where the first step's loss or gradients are further from eager's than two
    roundings of the step's dtype could put them (FIRST_STEP_FACTOR x the dtype's tolerance): a
    variant that computes something else is reported as failed, never timed."""
    bounds = {
        "loss": FIRST_STEP_FACTOR * FORWARD_TOL[dtype],
        "gradients": FIRST_STEP_FACTOR * BACKWARD_TOL[dtype],
    }
    for what, diff in (("loss", first.loss_rel_diff), ("gradients", first.grad_rel_diff)):
        if not diff <= bounds[what]:  # NaN fails too
            raise ValueError(
                f"its first step is {diff:.1e} (relative) from eager's in the {what}, "
                f"over the bound {bounds[what]:.1e}: it computes something else"
            )


def _first_step(
    v: _Variant, idx, targets, autocast, device, dtype: torch.dtype, eager: dict | None
) -> tuple[FirstStep, dict]:
    """The first step, timed whole; its loss and gradients compared with eager's (`eager`), or
    returned to compare the others with (for eager itself)."""
    _sync(device)
    t0 = time.perf_counter()
    with autocast():
        _, loss = v.net(idx, targets)
    loss.backward()
    _sync(device)
    fwd_bwd = time.perf_counter() - t0
    grads = [p.grad for p in v.model.parameters() if p.grad is not None]
    value = loss.item()
    if not math.isfinite(value) or not all(bool(torch.isfinite(g).all()) for g in grads):
        raise FloatingPointError("the first step's loss or gradients are not finite")
    first = FirstStep(seconds=0.0, loss=value)
    kept: dict = {}
    if eager is None:
        kept = {"loss": value, "grads": [g.detach().clone() for g in grads]}
    else:
        first.loss_rel_diff = abs(value - eager["loss"]) / abs(eager["loss"])
        num = sum(
            torch.linalg.vector_norm(g.float() - e.float()).item() ** 2 for g, e in zip(grads, eager["grads"])
        )
        den = sum(torch.linalg.vector_norm(e.float()).item() ** 2 for e in eager["grads"])
        first.grad_rel_diff = math.sqrt(num / den) if den > 0 else math.nan
        _check_first_step(first, dtype)
    del grads
    t1 = time.perf_counter()
    v.optimizer.step()
    v.optimizer.zero_grad(set_to_none=True)
    _sync(device)
    first.seconds = fwd_bwd + time.perf_counter() - t1
    return first, kept


def _state_bytes(v: _Variant) -> int:
    tensors = {t.data_ptr(): t for t in v.model.parameters()}
    for state in v.optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                tensors[t.data_ptr()] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _step_memory(step: Callable[[], object], v: _Variant, device: torch.device) -> StepMemory:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return StepMemory(_state_bytes(v), torch.cuda.max_memory_allocated(device) - before)


def _release(device: torch.device) -> None:
    """Drop compiled graphs and cached blocks, so what comes next starts from a clean device."""
    _compile.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# 5. Profiles
# --------------------------------------------------------------------------------------------


@dataclass
class VariantProfile:
    """What a short profile of one variant's step says (profiling.run_profile's reading)."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def _trace_name(variant: str) -> str:
    return f"trace-step-{variant.replace('+', '-')}.json"


def profile_variant(
    cfg: StepConfig, name: str, ops: fusion.BlockOps, say: Callable[[str], None]
) -> VariantProfile:
    if name == BASELINE:
        wrap = fusion.label_block_ops  # the ranges that say where the ops fusion replaces run
    elif name in FUSED_VARIANTS:
        wrap = lambda model: fusion.apply_block_ops(model, ops)
    else:
        wrap = None
    pcfg = ProfileConfig(
        model=cfg.model,
        device=cfg.device,
        steps=cfg.profile_steps,
        warmup=2,
        compile=name in COMPILED_VARIANTS,
        out_dir=cfg.out_dir,
        trace_name=_trace_name(name),
        seed=cfg.seed,
        lr=cfg.lr,
    )
    result = run_profile(pcfg, say, wrap=wrap)
    s = result.summary
    block_ops = {}
    if name == BASELINE:  # read the trace again for the ranges (run_profile reads it without them)
        with open(result.trace_path, encoding="utf-8") as f:
            trace = json.load(f)
        ranges = [fusion.BLOCK_OP_RANGES[op] for op in OPS]
        regions = analyze_trace(trace, device=cfg.device.type, regions=ranges)
        block_ops = {op: regions.region_pct[fusion.BLOCK_OP_RANGES[op]] for op in OPS}
    return VariantProfile(
        step_ms=result.step_ms,
        basis=s.basis,
        time_per_step_us=s.total_us / max(s.steps, 1),
        launches_per_step=s.launches_per_step,
        launch_unit=s.launch_unit,
        memory_bound_pct=s.shares.get("memory_bound", 0.0),
        gpu_idle_pct=s.gpu_idle_pct,
        launch_bound=s.launch_bound,
        block_op_pct=block_ops,
        trace_path=result.trace_path,
    )


# --------------------------------------------------------------------------------------------
# 6. The ops alone, and Amdahl's prediction
# --------------------------------------------------------------------------------------------


@dataclass
class OpTiming:
    """One block op at the model's shapes, fused vs eager, forward + backward, timed like Part B."""

    op: str
    shape: str  # e.g. "8192 x 5504 (gate_up 8192 x 11008) bf16"
    comparison: Comparison

    @property
    def speedup(self) -> Speedup:
        return self.comparison.speedups["fused"]

    def to_dict(self) -> dict:
        return {"op": self.op, "shape": self.shape, "comparison": self.comparison.to_dict()}


def _op_inputs(cfg: StepConfig) -> dict[str, tuple[list[torch.Tensor], str]]:
    """Fresh random inputs of each op as the model calls it: (leaves, shape text)."""
    m, dev, dt = cfg.model, cfg.device, cfg.dtype
    n, d, f = cfg.tokens, m.d_model, m.hidden
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    rand = lambda *shape, dtype=dt: torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    stream = torch.float32  # the residual stream and the weights stay fp32 under autocast
    weight = 1 + 0.1 * rand(d, dtype=stream)
    return {
        fusion.SILU_MUL: ([rand(n, 2 * f)], f"{n} x {f} (gate_up {n} x {2 * f}) {dtype_name(dt)}"),
        fusion.ADD_RMS_NORM: (
            [rand(n, d), rand(n, d, dtype=stream), weight],
            f"{n} x {d}, x {dtype_name(dt)}, residual {dtype_name(stream)}",
        ),
    }


def _fwd_bwd(fn: Callable, leaves: list[torch.Tensor], douts: list[torch.Tensor]) -> Callable[[], object]:
    """A call of `fn` forward and backward, the output gradients `douts` in its outputs' dtypes."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    with torch.no_grad():
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    douts = [g.to(o.dtype) for g, o in zip(douts, outs)]  # cast once here, not in every timed call

    def run():
        outs = fn(*leaves)
        # autograd.grad returns fresh gradients: nothing accumulates between calls.
        return torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), leaves, douts)

    return run


def time_block_ops(
    cfg: StepConfig, ops: fusion.BlockOps, progress: Progress | None = None
) -> dict[str, OpTiming]:
    """Each block op, the fused one vs the model's own unfused one, forward + backward, in
    interleaved trials of device time with the L2 flushed (Part B's way)."""
    eps = cfg.model.norm_eps
    impls = {
        fusion.SILU_MUL: (M.silu_mul, ops.silu_mul),
        fusion.ADD_RMS_NORM: (
            lambda x, r, w: M.add_rms_norm(x, r, w, eps),
            lambda x, r, w: ops.add_rms_norm(x, r, w, eps),
        ),
    }
    out = {}
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    for op, (leaves, shape) in _op_inputs(cfg).items():
        eager, fused = impls[op]
        with torch.no_grad():
            outs = eager(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        douts = [torch.randn(o.shape, generator=gen, device=cfg.device, dtype=o.dtype) for o in outs]
        say = (
            (lambda stage, done, total, op=op: progress(f"{op}: {stage}", done, total)) if progress else None
        )
        comparison = compare(
            {"eager": _fwd_bwd(eager, leaves, douts), "fused": _fwd_bwd(fused, leaves, douts)},
            "eager",
            trials=cfg.trials,
            device=cfg.device,
            warmup=cfg.warmup,
            flush_l2=True,
            seed=cfg.seed,
            progress=say,
            timing="device",
        )
        out[op] = OpTiming(op, shape, comparison)
        del leaves, douts, outs
    return out


@dataclass
class Amdahl:
    """The step's gain predicted from the ops fusion replaces, beside the gain measured."""

    eager_step_s: float  # the timed eager step: the denominator of every share
    op_s: dict[str, float]  # op -> its time per eager step in the profile, forward and backward
    op_speedups: dict[str, dict]  # op -> Speedup.to_dict(): fused op vs eager op (empty: not timed)
    measured: dict | None  # Speedup.to_dict() of the fused step over eager, as timed

    @property
    def fractions(self) -> dict[str, float]:
        return {op: min(t / self.eager_step_s, 1.0) for op, t in self.op_s.items()}

    @property
    def f(self) -> float:
        return min(sum(self.fractions.values()), 1.0)

    @property
    def ceiling(self) -> float:
        """The gain if those ops took no time at all: 1 / (1 - f)."""
        return 1.0 / (1.0 - self.f) if self.f < 1.0 else math.inf

    def predict(self, which: str = "median") -> float | None:
        """1 / ((1 - sum f) + sum f_i / s_i), with each op's speedup median, low or high."""
        if set(self.op_speedups) != set(self.op_s):
            return None
        fr = self.fractions
        rest = 1.0 - sum(fr.values())
        return 1.0 / (max(rest, 0.0) + sum(fr[op] / self.op_speedups[op][which] for op in fr))

    def to_dict(self) -> dict:
        return {
            "eager_step_s": self.eager_step_s,
            "op_s": self.op_s,
            "fractions": self.fractions,
            "f": self.f,
            "ceiling": self.ceiling,
            "op_speedups": self.op_speedups,
            "predicted": None
            if self.predict() is None
            else {"median": self.predict(), "low": self.predict("low"), "high": self.predict("high")},
            "measured": self.measured,
        }


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    config: StepConfig
    env: dict
    n_params: int
    block_ops: str  # the name of the fused implementations
    check: MathCheck | None  # None where no fused variant runs
    skipped: dict[str, str]  # variant -> why it could not run here
    failed: dict[str, str]  # variant -> why it ran but was not timed
    first_steps: dict[str, FirstStep]
    comparison: Comparison | None
    # "compile+fused vs compile": fusion on top of torch.compile, from the same paired trials
    fusion_over_compile: Speedup | None
    memory: dict[str, StepMemory]  # CUDA only
    profiles: dict[str, VariantProfile]
    ops: dict[str, OpTiming]
    amdahl: Amdahl | None

    def to_dict(self) -> dict:
        cmp = self.comparison
        results = {}
        for name in cmp.timings if cmp else ():
            sp = cmp.speedups.get(name)
            results[name] = {
                "median_s": cmp.median_s(name),
                "host_s": cmp.timings[name].host_s,
                "host_bound": cmp.host_bound(name),
                "speedup": sp.to_dict() if sp else None,
            }
        return {
            "kind": "step",
            "profuse": __version__,
            "config": self.config.to_dict(),
            "env": self.env,
            "n_params": self.n_params,
            "tokens_per_step": self.config.tokens,
            "block_ops": self.block_ops,
            "check": self.check.to_dict() if self.check else None,
            "skipped": self.skipped,
            "failed": self.failed,
            "first_steps": {k: v.to_dict() for k, v in self.first_steps.items()},
            "results": results,
            "fusion_over_compile": self.fusion_over_compile.to_dict() if self.fusion_over_compile else None,
            "memory": {k: v.to_dict() for k, v in self.memory.items()},
            "profiles": {k: v.to_dict() for k, v in self.profiles.items()},
            "ops": {k: v.to_dict() for k, v in self.ops.items()},
            "amdahl": self.amdahl.to_dict() if self.amdahl else None,
            "comparison": cmp.to_dict() if cmp else None,
        }


def plan(cfg: StepConfig, ops: fusion.BlockOps | None) -> tuple[list[str], dict[str, str]]:
    """(variants that can run here, {variant: why not} for the others). Custom `ops` run anywhere."""
    why_fused = "" if ops is not None else fused_unavailable(cfg.device)
    runs, skipped = [], {}
    for name in cfg.variants:
        if name in FUSED_VARIANTS and why_fused:
            skipped[name] = why_fused
        else:
            runs.append(name)
    return runs, skipped


def _math_stage(cfg, names, block_ops, failed, tell) -> tuple[MathCheck | None, list[str]]:
    """Step 2: the same-math check, where a fused variant is to run; the fused variants that
    fail it go to `failed` and leave `names`."""
    if not any(n in FUSED_VARIANTS for n in names):
        return None, names
    tell("checking the fused step against float64", 0, 1)
    check = check_same_math(cfg, block_ops)
    if not check.passed:
        why = check.error or f"its {check.worst} is outside the bound against float64"
        for n in FUSED_VARIANTS:
            if n in names:
                failed[n] = f"failed the same-math check: {why}"
    return check, [n for n in names if n not in failed]


def _first_steps(variants, idx, targets, autocast, dev, dtype, failed, tell) -> dict[str, FirstStep]:
    """Step 3's first half: every variant's first step, eager's first (the others are compared
    with it); a variant that raises goes to `failed`."""
    first_steps: dict[str, FirstStep] = {}
    eager_kept: dict | None = None
    for i, v in enumerate(variants):
        what = ", compiling" if v.name in COMPILED_VARIANTS else ""
        tell(f"first step: {v.name}{what}", i, len(variants))
        try:
            first, kept = _first_step(v, idx, targets, autocast, dev, dtype, eager_kept)
        except Exception as err:  # a variant that cannot run here is a failed row, not a crash
            failed[v.name] = _first_line(err)
            continue
        first_steps[v.name] = first
        if v.name == BASELINE:
            eager_kept = kept
    return first_steps


def _timed_steps(cfg, variants, steps, first_steps, tell) -> tuple[Comparison, dict[str, StepMemory]]:
    """Step 3's second half and step 4: interleaved trials of whole steps, then (CUDA) each
    variant's peak memory. No recompile is allowed while timing."""
    dev = cfg.device
    memory: dict[str, StepMemory] = {}
    say = lambda stage, done, total: tell(f"steps: {stage}", done, total)
    with _compile.no_recompiles():
        comparison = compare(
            steps,
            BASELINE,
            trials=cfg.trials,
            device=dev,
            warmup=cfg.warmup,
            flush_l2=False,  # a step's own traffic (hundreds of MB) evicts the L2
            seed=cfg.seed,
            progress=say,
            timing="loop",  # back to back, as a training loop runs steps
            first_calls={k: first_steps[k].seconds for k in steps},
        )
        if dev.type == "cuda":
            for v in variants:
                memory[v.name] = _step_memory(steps[v.name], v, dev)
    return comparison, memory


def _amdahl_stage(
    cfg, block_ops, comparison, profiles, timed, tell
) -> tuple[dict[str, OpTiming], Amdahl | None]:
    """Step 6: the fused ops' own speedups (where a fused variant was timed) and the Amdahl
    prediction from the eager profile's shares."""
    eager_profile = profiles.get(BASELINE)
    if eager_profile is None or comparison is None:
        return {}, None
    ops_timed: dict[str, OpTiming] = {}
    if any(n in timed for n in FUSED_VARIANTS):
        ops_timed = time_block_ops(cfg, block_ops, tell)
    per_step_s = eager_profile.time_per_step_us * 1e-6
    fused_sp = comparison.speedups.get("fused")
    amdahl = Amdahl(
        eager_step_s=comparison.median_s(BASELINE),
        op_s={op: eager_profile.block_op_pct[op] / 100.0 * per_step_s for op in OPS},
        op_speedups={op: t.speedup.to_dict() for op, t in ops_timed.items()},
        measured=fused_sp.to_dict() if fused_sp else None,
    )
    return ops_timed, amdahl


def run_step(
    cfg: StepConfig, progress: Progress | None = None, ops: fusion.BlockOps | None = None
) -> StepResult:
    """Part C, steps 1-6 of the module's docstring. `ops`: the fused implementations (default
    profuse.blockops' Triton ones; fusion.EAGER runs anywhere). Nothing is printed."""
    tell = progress or (lambda _stage, _done, _total: None)
    dev = cfg.device
    names, skipped = plan(cfg, ops)
    block_ops = ops or fusion.FUSED
    check_step_fits(cfg, len(names))
    failed: dict[str, str] = {}
    check, names = _math_stage(cfg, names, block_ops, failed, tell)

    autocast = _autocast(dev)
    idx, targets = random_batch(cfg.model, torch.Generator().manual_seed(cfg.seed), dev)
    variants = _build_variants(cfg, names, block_ops)
    first_steps = _first_steps(variants, idx, targets, autocast, dev, cfg.dtype, failed, tell)
    variants = [v for v in variants if v.name in first_steps]
    steps = {v.name: _train_step(v, idx, targets, autocast) for v in variants}
    comparison, memory = (
        _timed_steps(cfg, variants, steps, first_steps, tell) if BASELINE in steps else (None, {})
    )
    timed = list(comparison.timings) if comparison else []
    fusion_over_compile = None
    if "compile" in timed and "compile+fused" in timed:
        t = comparison.timings
        fusion_over_compile = speedup_ci(t["compile"].times_s, t["compile+fused"].times_s, seed=cfg.seed)
    del steps, variants
    _release(dev)

    profiles: dict[str, VariantProfile] = {}
    if cfg.profile_steps > 0:  # step 5
        for i, name in enumerate(timed):
            say = lambda _msg, i=i, name=name: tell(f"profiling {name}", i, len(timed))
            profiles[name] = profile_variant(cfg, name, block_ops, say)
            _release(dev)
    ops_timed, amdahl = _amdahl_stage(cfg, block_ops, comparison, profiles, timed, tell)

    return StepResult(
        config=cfg,
        env=environment(dev),
        n_params=num_params(cfg.model),
        block_ops=block_ops.name,
        check=check,
        skipped=skipped,
        failed=failed,
        first_steps=first_steps,
        comparison=comparison,
        fusion_over_compile=fusion_over_compile,
        memory=memory,
        profiles=profiles,
        ops=ops_timed,
        amdahl=amdahl,
    )
