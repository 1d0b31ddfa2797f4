"""Part C: how much faster does fusing make the training step, really?

Whole training steps (forward, loss, backward, AdamW step and zero_grad) of one model
(profuse.models: the built-in GPT, or a Hugging Face Llama-family model) in several variants, all
on the same batch, all from the same initial parameters:

    eager            the model as written, one op at a time
    fused            its block ops swapped for the fused Triton ones (ModelSpec.fuse: profuse.fusion)
    liger-ops        Liger-Kernel's RMSNorm and SwiGLU alone: op for op with fused (HF, CUDA)
    liger            Liger-Kernel as its users apply it: RoPE, RMSNorm, SwiGLU and fused linear
                     cross-entropy (profuse.models.liger) (HF, CUDA)
    compile          the whole model under torch.compile (profuse.compile.compile_model)
    compile+fused    the fused model under torch.compile (the block ops are compiled ops: no break)
    cudagraphs       torch.compile mode "reduce-overhead": the compiled step replayed as CUDA
                     graphs, for launch-bound steps (CUDA)

Every variant's step computes the loss its users compute (ModelSpec.loss: for a Hugging Face model
`model(input_ids, labels=input_ids).loss`, so a fused linear cross-entropy inside the model
applies), and pays the same loss. The variants share one set of Parameter objects and one AdamW
state (each is a deep copy of the model whose parameters map to themselves): a step's time does
not depend on the weights' values, and a 1B-parameter model's 20 GB of fp32 weights, gradients
and moments stay resident once, not once a variant. The precision is the run's
(StepConfig.precision, profuse.models.spec.PRECISIONS): amp (fp32 parameters and AdamW state,
bf16 autocast on CUDA; fp32 on a CPU) or bf16 (bf16 parameters and AdamW state, no autocast);
`profuse step --precision both` runs the whole of it once in each. In order:

1. The size is checked against the device's free memory (one line, before any work).
2. Same math: on a small copy of the model (ModelSpec.small: 2 layers, 128 tokens, the run's
   widths) each variant that swaps ops (fused, liger-ops, liger) computes the loss and every
   gradient in the run's precision, compared with float64 (the same weights; the loss from the
   logits, ModelSpec.reference_loss): it must be as close to it as the unfused step is (within a
   factor 2, or the dtype's tolerance). A variant that is not is reported as failed and never
   timed.
3. The first forward and backward of every variant (compilation included, split by
   profuse.compiletime into torch.compile's phases and profuse's autotuner) from the same initial
   weights, before any optimizer step: loss and gradients compared with eager's at the real size.
   Then interleaved trials of whole steps, back to back as a training loop runs them
   (bench.timing.compare, timing "loop", no L2 flush: a step's own traffic evicts the cache),
   and the step speedup over eager with its bootstrap CI.
4. Peak memory of one step per variant (CUDA): the resident state (parameters, AdamW moments)
   plus the most a step allocates above it.
5. A short profile of each timed variant as it was timed (profuse.stepprofile: nothing built or
   compiled again): kernels per step, the memory-bound share, GPU idle, time by category. The
   eager one runs through a labelled copy (ModelSpec.label), so the trace says how much of the
   step is in the ops fusion replaces, forward and backward.
6. Amdahl (profuse.amdahl): those ops' share f of the eager step and their own speedups s,
   timed like Part B (fused vs eager at the model's shapes, ModelSpec.op_shapes, forward +
   backward, device time), predict the step's gain 1 / ((1 - sum f) + sum f / s), printed beside
   the gain measured in 3.
7. The verdict (profuse.verdict): the winner and what bounds the eager step, decided once and
   saved; the report prints it.

Each phase's wall time is recorded (StepResult.phases) with the run's budget counted before it
starts (`budget`), and progress goes out through the `progress(stage, done, total)` callback.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from profuse import __version__, fusion
from profuse import compile as _compile
from profuse.amdahl import Amdahl, OpTiming, time_block_ops
from profuse.bench.stats import Speedup, speedup_ci
from profuse.bench.timing import Comparison, compare
from profuse.compiletime import CompileSplit, split_compile
from profuse.env import check_fits, environment, interpreting
from profuse.errors import UsageError
from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.model import GPTConfig
from profuse.models import ModelSpec, autocast_for
from profuse.models import liger as L
from profuse.models.gpt import PRESETS, GPTSpec, preset_model
from profuse.models.spec import (
    CHECK_BATCH,
    CHECK_LAYERS,
    CHECK_SEQ_LEN,
    DEFAULT_PRECISION,
    check_precision,
    compute_dtype,
    param_dtype,
    precision_text,
    state_bytes_per_parameter,
)
from profuse.profiling import BACKWARD, FORWARD, OPTIMIZER
from profuse.stepprofile import VariantProfile, profile_variant
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error
from profuse.verdict import StepVerdict, decide

__all__ = ["CHECK_BATCH", "CHECK_LAYERS", "CHECK_SEQ_LEN", "PRESETS", "VariantProfile", "preset_model"]

Progress = Callable[[str, int, int], None]
Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

BASELINE = "eager"
# Every variant, in the table's order.
ALL_VARIANTS = ("eager", "fused", "liger-ops", "liger", "compile", "compile+fused", "cudagraphs")
# The built-in GPT's default (Liger patches HF models only): the four the lab's Part C compares.
VARIANTS = ("eager", "fused", "compile", "compile+fused")
FUSED_VARIANTS = ("fused", "compile+fused")
LIGER_VARIANTS = ("liger-ops", "liger")
COMPILED_VARIANTS = ("compile", "compile+fused", "cudagraphs")
GRAPH_VARIANTS = ("cudagraphs",)
# The variants that swap ops in an unfused model: each passes the same-math check first.
CHECKED_VARIANTS = ("fused", "liger-ops", "liger")

# The kernel modules behind profuse.blockops' fused ops.
KERNEL_MODULES = ("profuse.kernels.swiglu", "profuse.kernels.add_rms_norm")

# A checked variant may be this many times further from float64 than the unfused step: two
# roundings of like size, summed over a whole tensor, differ by much less than 2x.
CHECK_FACTOR = 2.0

# A variant's first step may differ from eager's by this many times the dtype's tolerance (the
# loss's FORWARD_TOL, the gradients' BACKWARD_TOL): each side rounds once, and bf16 autocast
# puts compile and eager 1.8e-2 apart in the gradients at d_model 2048, a third of this bound.
FIRST_STEP_FACTOR = 2.0

# The ops the fused variants replace: their names in fusion, and the profiler range of each.
OPS = (fusion.SILU_MUL, fusion.ADD_RMS_NORM)


@dataclass
class StepConfig:
    """What Part C runs. The CLI maps --model, --preset and the size flags onto `model`."""

    # The model and its batch (profuse.models.model_spec). A GPTConfig is taken too, with
    # `preset` its name: the built-in GPT at those sizes.
    model: ModelSpec | GPTConfig = field(default_factory=GPTConfig)
    preset: str | None = None  # recorded with the results; with a spec, the spec's
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    variants: Sequence[str] | None = None  # eager, the baseline, is always in; None: the model's default
    trials: int = 30  # interleaved trials of whole steps (and of each op, for Amdahl)
    warmup: int | None = None  # untimed steps after the first: 3 on CUDA, 1 on CPU (steps take ~1 s)
    seed: int = 0  # weights, the batch of random tokens, the trial order
    profile_steps: int = 3  # profiled steps per variant; 0: no profiles and no Amdahl prediction
    out_dir: Path = Path(".")  # the profiles' traces go here
    lr: float = 1e-3  # AdamW's, as Part A
    # amp: fp32 parameters and AdamW state, bf16 autocast on CUDA; bf16: bf16 parameters and AdamW
    # state, no autocast (profuse.models.spec.PRECISIONS)
    precision: str = DEFAULT_PRECISION
    trace_tag: str = ""  # appended to the traces' names: the precision, where one folder holds two runs

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.out_dir = Path(self.out_dir)
        check_precision(self.precision)
        if isinstance(self.model, GPTConfig):
            preset = self.preset or "lab"
            if preset not in PRESETS:
                raise UsageError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
            self.model = GPTSpec(self.model, preset)
        elif not isinstance(self.model, ModelSpec):
            kind = type(self.model).__name__
            raise TypeError(f"StepConfig.model takes a ModelSpec or a GPTConfig, not {kind}")
        self.preset = self.model.preset
        default = VARIANTS if self.model.family == "gpt" else ALL_VARIANTS
        names = list(dict.fromkeys(default if self.variants is None else self.variants))
        unknown = [v for v in names if v not in ALL_VARIANTS]
        if unknown:
            choices = ", ".join(ALL_VARIANTS)
            raise UsageError(f"unknown variant(s) {', '.join(unknown)}: choose from {choices}")
        if BASELINE not in names:
            names.insert(0, BASELINE)
        self.variants = tuple(v for v in ALL_VARIANTS if v in names)  # table order
        if self.trials < 2:
            raise UsageError(f"--trials must be at least 2 for a confidence interval, got {self.trials}")
        if self.profile_steps < 0:
            raise UsageError(f"--profile-steps cannot be negative ({self.profile_steps})")
        if self.warmup is None:
            self.warmup = 3 if self.device.type == "cuda" else 1
        if self.warmup < 0:
            raise UsageError(f"warm-up steps cannot be negative ({self.warmup})")

    @property
    def spec(self) -> ModelSpec:
        return self.model  # a ModelSpec once constructed

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the branches compute in: bf16 under CUDA autocast or with bf16 parameters,
        fp32 for amp on the CPU (models.spec.compute_dtype)."""
        return compute_dtype(self.device, self.precision)

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' and AdamW state's dtype: fp32 for amp, bf16 for bf16."""
        return param_dtype(self.precision)

    @property
    def autocast(self) -> Callable[[], contextlib.AbstractContextManager]:
        """The autocast context the step's forward runs under (models.spec.autocast_for)."""
        return autocast_for(self.device, self.precision)

    @property
    def tokens(self) -> int:
        return self.spec.tokens

    def to_dict(self) -> dict:
        spec = self.spec
        out = {
            "model_arg": spec.model_arg,
            "preset": spec.preset,
            "model": spec.dims(),
        }
        if isinstance(spec, GPTSpec):
            out["resized"] = spec.preset not in PRESETS or spec.config != preset_model(spec.preset)
        return {
            **out,
            "spec": spec.to_dict(),
            "device": str(self.device),
            "variants": list(self.variants),
            "trials": self.trials,
            "warmup": self.warmup,
            "seed": self.seed,
            "profile_steps": self.profile_steps,
            "out_dir": str(self.out_dir),
            "lr": self.lr,
            "precision": self.precision,
            "precision_text": precision_text(self.device, self.precision),
            "timing": "loop",
        }


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def num_params(m: GPTConfig) -> int:
    """GPT(m).num_params() without building it (GPTConfig.param_count)."""
    return m.param_count()


def estimated_bytes(cfg: StepConfig, variants: Sequence[str] | int | None = None) -> int:
    """A generous estimate of the peak memory of the run.

    Once, whatever the number of variants (they share them): parameters, gradients and AdamW's
    two moments (16 bytes a parameter in fp32, 8 in bf16), autocast's bf16 weight copies (2, amp),
    eager's first-step gradients kept to compare the others with (one more copy of the
    parameters), one step's activations (ModelSpec.activation_bytes). A CUDA-graph variant keeps
    one more step's activations resident in its graphs' memory pool.
    """
    names = cfg.variants if variants is None or isinstance(variants, int) else variants
    p = cfg.spec.param_count()
    kept = cfg.param_dtype.itemsize * p
    graphs = sum(n in GRAPH_VARIANTS for n in names)
    state = state_bytes_per_parameter(cfg.precision) * p
    return state + kept + cfg.spec.activation_bytes(cfg.dtype) * (1 + graphs)


def check_step_fits(cfg: StepConfig, variants: Sequence[str] | int | None = None) -> None:
    """UsageError (one line) when the run will not fit in the device's free memory."""
    names = cfg.variants if variants is None or isinstance(variants, int) else variants
    n = variants if isinstance(variants, int) else len(names)
    check_fits(
        estimated_bytes(cfg, variants),
        cfg.device,
        f"the step of {cfg.spec.param_count() / 1e6:.0f}M parameters and {cfg.tokens} tokens in {n} "
        "variant(s) (one copy of the parameters and AdamW state, shared)",
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan(cfg: StepConfig, ops: fusion.BlockOps | None) -> tuple[list[str], dict[str, str]]:
    """(variants that can run here, {variant: why not} for the others). Custom `ops` run anywhere
    the model can be fused."""
    dev, spec = cfg.device, cfg.spec
    why_fused = "" if ops is not None else fused_unavailable(dev)
    runs, skipped = [], {}
    for name in cfg.variants:
        why = ""
        if name in FUSED_VARIANTS:
            why = why_fused
        elif name in LIGER_VARIANTS:
            why = L.unavailable(dev, spec.family)
        elif name in GRAPH_VARIANTS and dev.type != "cuda":
            why = "needs CUDA: CUDA graphs are a GPU feature"
        if why:
            skipped[name] = why
        else:
            runs.append(name)
    return runs, skipped


# --------------------------------------------------------------------------------------------
# A variant: the model prepared, its loss, and the step a training loop runs
# --------------------------------------------------------------------------------------------


@dataclass
class _Variant:
    name: str
    model: nn.Module  # the prepared copy; its parameters are the run's shared ones
    net: nn.Module  # the model, or the model under torch.compile
    loss: LossFn  # what its step minimises: the spec's, the users' loss (the same for every variant)
    autocast: Callable[[], contextlib.AbstractContextManager]  # the precision's (nothing for bf16)
    globals: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)


def _prepare(spec: ModelSpec, name: str, model: nn.Module, ops: fusion.BlockOps, autocast) -> _Variant:
    """`model` (in place) made into variant `name`; `autocast` the precision's context."""
    module_globals: contextlib.AbstractContextManager = contextlib.nullcontext()
    if name in FUSED_VARIANTS:
        spec.fuse(model, ops)
    elif name in LIGER_VARIANTS:
        module_globals = L.patch(model, spec.family, ops_only=name == "liger-ops")
    net = model
    if name in COMPILED_VARIANTS:
        net = _compile.compile_model(model, cudagraphs=name in GRAPH_VARIANTS)
    return _Variant(name, model, net, spec.loss, autocast, module_globals)


def _train_step(
    v: _Variant, optimizer: torch.optim.Optimizer, batch: Batch, device: torch.device, ranges: bool = False
) -> Callable[[], torch.Tensor]:
    """One whole step, as a training loop runs it; returns the loss without reading it (no sync).
    `ranges`: cut into Part A's forward, backward and optimizer profiler ranges."""
    autocast = v.autocast
    label = record_function if ranges else (lambda _name: contextlib.nullcontext())
    graphs = v.name in GRAPH_VARIANTS

    def step() -> torch.Tensor:
        if graphs:  # a new iteration: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with v.globals:
            with label(FORWARD), autocast():
                loss = v.loss(v.net, batch)
            with label(BACKWARD):
                loss.backward()
        with label(OPTIMIZER):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# --------------------------------------------------------------------------------------------
# 2. Same math: a variant vs the unfused step vs float64 on a small model
# --------------------------------------------------------------------------------------------


@dataclass
class MathCheck:
    """A variant's step against the unfused one, both against float64, on a small model."""

    model: dict  # the small model's dims (ModelSpec.dims)
    precision: str
    passed: bool
    # "loss" and every parameter's gradient -> [variant rel err, unfused rel err] vs float64
    errors: dict[str, list[float]] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)  # max(dtype tol, CHECK_FACTOR * unfused's)
    max_abs_diff: float = math.nan  # variant vs unfused, over the loss and every gradient
    worst: str = ""  # the quantity nearest its bound
    error: str = ""  # the exception, where the variant's step did not run

    def to_dict(self) -> dict:
        return asdict(self)


def check_model(m: GPTConfig) -> GPTConfig:
    """The run's GPT cut to CHECK_LAYERS layers and CHECK_BATCH x CHECK_SEQ_LEN tokens."""
    return GPTSpec(m).small().config


def _loss_and_grads(
    net: nn.Module, model: nn.Module, batch: Batch, autocast, loss_fn: LossFn, module_globals=None
) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    with module_globals or contextlib.nullcontext(), autocast():
        loss = loss_fn(net, batch)
    with module_globals or contextlib.nullcontext():
        grads = torch.autograd.grad(loss, list(params.values()))
    return {"loss": loss.detach(), **{f"grad {name}": g for name, g in zip(params, grads)}}


def check_variant_math(cfg: StepConfig, name: str, ops: fusion.BlockOps) -> MathCheck:
    """Loss and gradients of one step of the small model in the run's precision: variant `name`,
    unfused, and float64 (the same weights, the precision's rounding of them included; the loss
    from the logits, ModelSpec.reference_loss)."""
    dev, small = cfg.device, cfg.spec.small()
    autocast = cfg.autocast
    base = small.build_for(dev, cfg.seed, cfg.precision)
    batch = small.batch(dev, cfg.seed)
    check = MathCheck(model=small.dims(), precision=cfg.precision, passed=False)
    try:
        v = _prepare(small, name, copy.deepcopy(base), ops, autocast)
        got = _loss_and_grads(v.net, v.model, batch, autocast, v.loss, v.globals)
    except Exception as err:  # a variant that cannot run here is a failed check, not a crash
        check.error = _first_line(err)
        return check
    ref_model = copy.deepcopy(base).double()
    ref = _loss_and_grads(ref_model, ref_model, batch, contextlib.nullcontext, small.reference_loss)
    unfused = _loss_and_grads(base, base, batch, autocast, small.loss)
    if got.keys() != ref.keys():
        check.error = f"{name} changed the model's parameters: they no longer match the unfused model's"
        return check
    worst_ratio = -1.0
    for key, r in ref.items():
        v_err, u_err = relative_error(got[key], r), relative_error(unfused[key], r)
        tol = (FORWARD_TOL if key == "loss" else BACKWARD_TOL)[cfg.dtype]
        bound = max(tol, CHECK_FACTOR * u_err)
        check.errors[key], check.bounds[key] = [v_err, u_err], bound
        ratio = v_err / bound if math.isfinite(v_err) else math.inf
        if ratio > worst_ratio:
            worst_ratio, check.worst = ratio, key
    check.passed = worst_ratio <= 1.0
    check.max_abs_diff = max((got[k].float() - unfused[k].float()).abs().max().item() for k in ref)
    return check


def check_same_math(cfg: StepConfig, ops: fusion.BlockOps) -> MathCheck:
    """The fused step (block ops `ops`) against the unfused one and float64, on a small model."""
    return check_variant_math(cfg, "fused", ops)


def _math_stage(cfg, names, block_ops, failed, tell) -> tuple[dict[str, MathCheck], list[str]]:
    """Step 2: the same-math check of each checked variant that is to run (compile+fused rides
    on fused's); the variants that fail it go to `failed` and leave `names`."""
    checks: dict[str, MathCheck] = {}
    todo = [n for n in CHECKED_VARIANTS if n in names or (n == "fused" and "compile+fused" in names)]
    for i, name in enumerate(todo):
        tell(f"checking the {name} step against float64", i, len(todo))
        check = (
            check_same_math(cfg, block_ops) if name == "fused" else check_variant_math(cfg, name, block_ops)
        )
        checks[name] = check
        if not check.passed:
            why = check.error or f"its {check.worst} is outside the bound against float64"
            for n in FUSED_VARIANTS if name == "fused" else (name,):
                if n in names:
                    failed[n] = f"failed the same-math check: {why}"
    return checks, [n for n in names if n not in failed]


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

    state_bytes: int  # parameters and AdamW's two moments, held between steps (shared by the variants)
    step_bytes: int  # activations, gradients and workspaces: max_memory_allocated over the step

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.step_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


def _build_variants(
    cfg: StepConfig, names: Sequence[str], ops: fusion.BlockOps, failed: dict[str, str]
) -> tuple[list[_Variant], torch.optim.Optimizer]:
    """Every variant over one set of parameters, and the one AdamW that steps them. Each is a
    deep copy of the model in which every Parameter maps to itself (the tied head stays tied);
    eager is the model itself. A variant that cannot be prepared goes to `failed`."""
    base = cfg.spec.build_for(cfg.device, cfg.seed, cfg.precision)
    shared = {id(p): p for p in base.parameters()}
    out = []
    for name in names:
        model = base if name == BASELINE else copy.deepcopy(base, memo=dict(shared))
        try:
            v = _prepare(cfg.spec, name, model, ops, cfg.autocast)
        except Exception as err:  # e.g. a model fusion cannot fuse: a failed row, not a crash
            failed[name] = _first_line(err)
            continue
        if {id(p) for p in v.model.parameters()} != shared.keys():
            failed[name] = (
                "preparing it replaced the model's parameters, so it cannot share the run's weights and "
                "AdamW state, nor be compared from the same initial weights"
            )
            continue
        out.append(v)
    return out, torch.optim.AdamW(base.parameters(), lr=cfg.lr)


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


def _forward_backward(
    v: _Variant, net: nn.Module, loss_fn: LossFn, params: list, batch: Batch, device
) -> tuple[float, float, list[torch.Tensor]]:
    """(seconds, loss, gradients) of one forward and backward, timed whole; gradients cloned
    and the parameters' .grad cleared (no optimizer step: every variant starts from the same weights)."""
    autocast = v.autocast
    _sync(device)
    t0 = time.perf_counter()
    if v.name in GRAPH_VARIANTS:
        torch.compiler.cudagraph_mark_step_begin()
    with v.globals:
        with autocast():
            loss = loss_fn(net, batch)
        loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    value = loss.item()
    if not math.isfinite(value) or not all(bool(torch.isfinite(g).all()) for g in grads):
        raise FloatingPointError("the first step's loss or gradients are not finite")
    return seconds, value, grads


def _compared(first: FirstStep, value: float, grads, eager: tuple[float, list]) -> FirstStep:
    e_loss, e_grads = eager
    first.loss_rel_diff = abs(value - e_loss) / abs(e_loss)
    num = sum(torch.linalg.vector_norm(g.float() - e.float()).item() ** 2 for g, e in zip(grads, e_grads))
    den = sum(torch.linalg.vector_norm(e.float()).item() ** 2 for e in e_grads)
    first.grad_rel_diff = math.sqrt(num / den) if den > 0 else math.nan
    return first


def _first_steps(cfg, variants, optimizer, batch, failed, tell, splits, phase) -> dict[str, FirstStep]:
    """Step 3's first half: every variant's first forward and backward from the same initial
    weights, eager's first (the others are compared with it), then the optimizer's first step,
    timed once and counted in every variant's first step (the AdamW state it allocates is
    shared). A variant that raises goes to `failed`. Each first step's split (compiletime) goes to
    `splits`, its wall time to `phase` ("first:NAME")."""
    dev, dtype = cfg.device, cfg.dtype
    params = [p for group in optimizer.param_groups for p in group["params"]]
    first_steps: dict[str, FirstStep] = {}
    kept: dict[str, tuple[float, list]] = {}  # eager's (loss, gradients)
    eager = next((v for v in variants if v.name == BASELINE), None)
    for i, v in enumerate(variants):
        what = " (compiling)" if v.name in COMPILED_VARIANTS else ""
        tell(f"first step: {v.name}{what}", i, len(variants))
        try:
            with phase(f"first:{v.name}"), split_compile() as split:
                seconds, value, grads = _forward_backward(v, v.net, v.loss, params, batch, dev)
            splits[v.name] = split[0]
            what = f": {split[0].summary()}" if split[0].compiled_anything else ""
            tell(f"first step: {v.name} took {seconds:.1f} s{what}", i + 1, len(variants))
            first = FirstStep(seconds=seconds, loss=value)
            if v.name == BASELINE:
                kept["own"] = (value, grads)
            elif eager is not None and BASELINE in first_steps:
                _check_first_step(_compared(first, value, grads, kept["own"]), dtype)
            del grads
        except Exception as err:  # a variant that cannot run here is a failed row, not a crash
            failed[v.name] = _first_line(err)
            for p in params:
                p.grad = None
            continue
        first_steps[v.name] = first
    kept.clear()
    if eager is not None and BASELINE in first_steps:  # the optimizer's first step, on eager's gradients
        with eager.autocast():
            loss = eager.loss(eager.net, batch)
        loss.backward()
        _sync(dev)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(dev)
        opt_s = time.perf_counter() - t0
        for first in first_steps.values():
            first.seconds += opt_s
    return first_steps


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = {p.data_ptr(): p for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                tensors[t.data_ptr()] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _step_memory(step: Callable[[], object], state_bytes: int, device: torch.device) -> StepMemory:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return StepMemory(state_bytes, torch.cuda.max_memory_allocated(device) - before)


def _timed_steps(cfg, steps, optimizer, first_steps, tell, phase) -> tuple[Comparison, dict[str, StepMemory]]:
    """Step 3's second half and step 4: interleaved trials of whole steps, then (CUDA) each
    variant's peak memory. No recompile is allowed while timing."""
    dev = cfg.device
    memory: dict[str, StepMemory] = {}
    say = lambda stage, done, total: tell(f"steps: {stage}", done, total)
    tell(f"steps: warm-up, then {cfg.trials} trials of {', '.join(steps)}", 0, 1)
    with _compile.no_recompiles():
        with phase("trials"):
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
            with phase("memory"):
                state = _state_bytes(optimizer)
                for i, (name, step) in enumerate(steps.items()):
                    tell(f"memory: {name}", i, len(steps))
                    memory[name] = _step_memory(step, state, dev)
    return comparison, memory


def _release(device: torch.device) -> None:
    """Drop compiled graphs and cached blocks, so what comes next starts from a clean device."""
    _compile.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# 5. Profiles, of the variants as they were timed
# --------------------------------------------------------------------------------------------


def _labelled(cfg: StepConfig, eager: _Variant) -> tuple[_Variant, str]:
    """A copy of the eager model over the same parameters, the ops fusion replaces in profiler
    ranges (ModelSpec.label, the math unchanged); or the eager variant itself and why, where the
    model cannot be labelled (profiled unlabelled: no Amdahl prediction)."""
    shared = {id(p): p for p in eager.model.parameters()}
    model = copy.deepcopy(eager.model, memo=dict(shared))
    try:
        cfg.spec.label(model)
    except ValueError as err:  # a model fusion cannot fuse
        return eager, _first_line(err)
    if {id(p) for p in model.parameters()} != shared.keys():
        return eager, "labelling it replaced the model's parameters"
    return _Variant(BASELINE, model, model, eager.loss, eager.autocast, eager.globals), ""


def _profile_stage(cfg, variants, optimizer, batch, tell, phase) -> dict[str, VariantProfile]:
    """Step 5: each timed variant's step profiled as it was timed (nothing built or compiled
    again); eager through its labelled copy."""
    profiles: dict[str, VariantProfile] = {}
    for i, v in enumerate(variants):
        say = lambda msg, i=i, name=v.name: tell(f"profile: {name}: {msg}", i, len(variants))
        target, label_error, block_ops = v, "", {}
        if v.name == BASELINE:
            target, label_error = _labelled(cfg, v)
            block_ops = {} if label_error else {op: fusion.BLOCK_OP_RANGES[op] for op in OPS}
        with phase(f"profile:{v.name}"):
            step = _train_step(target, optimizer, batch, cfg.device, ranges=True)
            profiles[v.name] = profile_variant(
                step,
                v.name,
                steps=cfg.profile_steps,
                out_dir=cfg.out_dir,
                device=cfg.device,
                compiled=v.name in COMPILED_VARIANTS,
                regions=block_ops.values(),
                block_ops=block_ops,
                tag=cfg.trace_tag,
                label_error=label_error,
                say=say,
            )
        del target, step
    return profiles


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class PhaseClock:
    """The wall time of each phase of a run (name -> seconds, summed where a name repeats), read
    off `clock`; `with phases("trials"): ...` times one."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - t0


def budget(cfg: StepConfig, names: Sequence[str]) -> dict[str, int]:
    """What a run of `names` does at `cfg`'s settings, counted before it starts: where its
    minutes can go. Steps are whole training steps at the real size; a timed trial round runs
    every variant once (as many steps as the harness's timer takes a trial), and the warm-up
    runs at least `warmup` steps a variant (on until steady: bench.timing)."""
    n, cuda = len(names), cfg.device.type == "cuda"
    checked = [c for c in CHECKED_VARIANTS if c in names or (c == "fused" and "compile+fused" in names)]
    profiled = cfg.profile_steps > 0
    compiled = sum(name in COMPILED_VARIANTS for name in names)
    fused_timed = profiled and any(name in FUSED_VARIANTS for name in names)
    return {
        "variants": n,
        "compiles": compiled,  # torch.compile of the whole model, forward and backward, once each
        "builds": 1 + (1 if profiled else 0),  # the model, and eager's labelled copy for its profile
        "checks": len(checked),  # each: a small copy's step as the variant, unfused and in float64
        "first_steps": n + 1,  # and eager's again, for the optimizer's first step
        "warmup_steps_at_least": n * cfg.warmup,
        "trial_rounds": cfg.trials,
        "host_rounds": cfg.trials if cuda else 0,  # each variant's step once a round (CUDA)
        "memory_steps": n if cuda else 0,
        "profiled_steps": n * cfg.profile_steps if profiled else 0,
        "profile_warmup_steps": (n + compiled) if profiled else 0,
        "op_timings": len(OPS) if fused_timed else 0,  # each: trial_rounds of the op, fused and eager
    }


@dataclass
class StepResult:
    config: StepConfig
    env: dict
    n_params: int
    block_ops: str  # the name of the fused implementations
    check: MathCheck | None  # fused's; None where no fused variant runs
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
    checks: dict[str, MathCheck] = field(default_factory=dict)  # the Liger variants' same-math checks
    amdahl_note: str = ""  # why there is no Amdahl prediction, where profiles ran but it could not be made
    compile: dict[str, CompileSplit] = field(default_factory=dict)  # each first step, split (compiletime)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds ("total": the run)
    budget: dict[str, int] = field(default_factory=dict)  # what the run was to do, counted up front
    verdict: StepVerdict | None = None  # decided once (profuse.verdict); the report prints it

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
            "checks": {k: v.to_dict() for k, v in self.checks.items()},
            "skipped": self.skipped,
            "failed": self.failed,
            "first_steps": {k: v.to_dict() for k, v in self.first_steps.items()},
            "results": results,
            "fusion_over_compile": self.fusion_over_compile.to_dict() if self.fusion_over_compile else None,
            "memory": {k: v.to_dict() for k, v in self.memory.items()},
            "profiles": {k: v.to_dict() for k, v in self.profiles.items()},
            "ops": {k: v.to_dict() for k, v in self.ops.items()},
            "amdahl": self.amdahl.to_dict() if self.amdahl else None,
            "amdahl_note": self.amdahl_note,
            "compile": {k: v.to_dict() for k, v in self.compile.items()},
            "phases": self.phases,
            "budget": self.budget,
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "comparison": cmp.to_dict() if cmp else None,
        }


def _amdahl_stage(
    cfg, block_ops, comparison, profiles, timed, tell
) -> tuple[dict[str, OpTiming], Amdahl | None, str]:
    """Step 6: the fused ops' own speedups (where a fused variant was timed) and the Amdahl
    prediction from the eager profile's shares; or why there is none."""
    eager_profile = profiles.get(BASELINE)
    if eager_profile is None or comparison is None:
        return {}, None, ""
    if not eager_profile.block_op_pct:
        why = eager_profile.label_error or "the eager profile has no labelled block ops"
        return {}, None, f"no Amdahl prediction: the ops fusion replaces could not be labelled ({why})"
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
    return ops_timed, amdahl, ""


def run_step(
    cfg: StepConfig,
    progress: Progress | None = None,
    ops: fusion.BlockOps | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepResult:
    """Part C, steps 1-7 of the module's docstring. `ops`: the fused implementations (default
    profuse.blockops' Triton ones; fusion.EAGER runs anywhere); `clock` times the phases.
    Nothing is printed: `progress(stage, done, total)` hears of each stage as it starts."""
    tell = progress or (lambda _stage, _done, _total: None)
    phase = PhaseClock(clock)
    start = clock()
    dev, spec = cfg.device, cfg.spec
    names, skipped = plan(cfg, ops)
    block_ops = ops or fusion.FUSED
    check_step_fits(cfg, names)
    counts = budget(cfg, names)
    tell(
        f"plan ({cfg.precision}): {', '.join(names)}; {counts['compiles']} compile(s), {counts['checks']} "
        f"check(s), {counts['trial_rounds']} trial rounds, {counts['profiled_steps']} profiled steps",
        0,
        1,
    )
    failed: dict[str, str] = {}
    with phase("check"):
        checks, names = _math_stage(cfg, names, block_ops, failed, tell)
        _release(dev)

    with phase("build"):
        tell(f"build: {', '.join(names)} over one set of parameters ({cfg.precision})", 0, 1)
        batch = spec.batch(dev, cfg.seed)
        variants, optimizer = _build_variants(cfg, names, block_ops, failed)
    splits: dict[str, CompileSplit] = {}
    first_steps = _first_steps(cfg, variants, optimizer, batch, failed, tell, splits, phase)
    variants = [v for v in variants if v.name in first_steps]
    steps = {v.name: _train_step(v, optimizer, batch, dev) for v in variants}
    comparison, memory = (
        _timed_steps(cfg, steps, optimizer, first_steps, tell, phase) if BASELINE in steps else (None, {})
    )
    timed = list(comparison.timings) if comparison else []
    fusion_over_compile = None
    if "compile" in timed and "compile+fused" in timed:
        t = comparison.timings
        fusion_over_compile = speedup_ci(t["compile"].times_s, t["compile+fused"].times_s, seed=cfg.seed)

    profiles: dict[str, VariantProfile] = {}
    if cfg.profile_steps > 0 and timed:  # step 5
        with phase("profiles"):
            timed_variants = [v for v in variants if v.name in timed]
            profiles = _profile_stage(cfg, timed_variants, optimizer, batch, tell, phase)
            del timed_variants
    del steps, variants, optimizer
    _release(dev)
    with phase("ops"):
        ops_timed, amdahl, amdahl_note = _amdahl_stage(cfg, block_ops, comparison, profiles, timed, tell)

    result = StepResult(
        config=cfg,
        env=environment(dev),
        n_params=spec.param_count(),
        block_ops=block_ops.name,
        check=checks.get("fused"),
        checks={k: v for k, v in checks.items() if k != "fused"},
        skipped=skipped,
        failed=failed,
        first_steps=first_steps,
        comparison=comparison,
        fusion_over_compile=fusion_over_compile,
        memory=memory,
        profiles=profiles,
        ops=ops_timed,
        amdahl=amdahl,
        amdahl_note=amdahl_note,
        compile=splits,
        phases=phase.seconds,
        budget=counts,
    )
    result.phases["total"] = clock() - start
    result.verdict = decide(result.to_dict())
    return result
