"""Part C: how much faster does fusing make the training step, really?

Whole training steps (forward, loss, backward, AdamW step and zero_grad) of one model
(profuse.models: the built-in GPT, or a Hugging Face Llama-family model) in several variants, all
on the same batch, all from the same initial parameters:

    eager            the model as written, one op at a time
    fused            its block ops swapped for the fused Triton ones (ModelSpec.fuse: profuse.fusion)
    moe-best         a mixture of experts unfused, its experts run by transformers' implementation
                     that is fastest on the card (profuse.models.experts: grouped_mm where torch
                     has a native grouped matmul, else batched_mm or the eager loop)
    moe-best+fused   fused over that same experts implementation: like with like (MoE models);
                     both skipped where the model as built runs that implementation already
    liger-ops        Liger-Kernel's RMSNorm and SwiGLU alone: op for op with fused (HF, CUDA)
    liger            Liger-Kernel as its users apply it: RoPE, RMSNorm, SwiGLU and fused linear
                     cross-entropy (profuse.models.liger) (HF, CUDA)
    compile          the whole model under torch.compile (profuse.compile.compile_model), with
                     the causal-mask fix profuse.fuse makes for itself (ModelSpec.fix_causal_mask,
                     profuse.fusion.hf_mask: a plain causal call reaches SDPA as is_causal, where
                     transformers on torch < 2.14 builds a (B, 1, T, T) mask while compiling), so
                     compile+fused vs compile measures the fusion alone
    compile-stock    torch.compile of the model as transformers ships it, its mask built while
                     compiling (Hugging Face models; not a default: the baseline earlier runs had)
    compile+fused    the fused model under torch.compile (the block ops are compiled ops: no break;
                     profuse.fuse's own mask fix)
    compile+loss     torch.compile of the model with profuse's fused linear cross-entropy alone
                     and profuse.fuse's mask fix: the norms, SwiGLU and RoPE left to Inductor,
                     which fuses them with their neighbours inside the graph (Hugging Face models;
                     not a default: asked for by name)
    cudagraphs       torch.compile mode "reduce-overhead": the compiled step replayed as CUDA
                     graphs, for launch-bound steps (CUDA), with compile's mask fix

Every variant's step computes the loss its users compute (ModelSpec.loss: for a Hugging Face model
`model(input_ids, labels=input_ids).loss`, so a fused linear cross-entropy inside the model
applies), and pays the same loss. The variants share one set of Parameter objects and one AdamW
state (each is a deep copy of the model whose parameters map to themselves): a 1B-parameter
model's 20 GB of fp32 weights, gradients and moments stay resident once, not once a variant.
AdamW runs at lr 0 through every variant's steps (profuse.stepstate), so all of them time the
same weights, bitwise. The precision is the run's (StepConfig.precision,
profuse.models.spec.PRECISIONS): amp (fp32 parameters and AdamW state, bf16 autocast on CUDA;
fp32 on a CPU) or bf16 (bf16 parameters and AdamW state, no autocast); `profuse step --precision
both` runs the whole of it once in each. In order:

1. The size is checked against the device's free memory (one line, before any work).
2. Same math, small (profuse.samemath): on a copy of the model cut to 2 layers and 128 tokens
   (ModelSpec.small, the run's widths) each variant that swaps ops (fused, moe-best and
   moe-best+fused, liger-ops, liger)
   computes the loss and every gradient in the run's precision, compared with float64 (the same
   weights; the loss from the logits, ModelSpec.reference_loss): it must be as close to it as
   the unfused step is (within a factor 2, or the dtype's tolerance). A variant that is not is
   reported as failed and never built at full size.
3. At full size: the reference (the unfused model in fp32, or float64 where the step computes in
   fp32, no autocast); then each variant's own first steps in table order, each from an emptied
   allocator (profuse.stepstate): the first one's time (compilation included, split by
   profuse.compiletime into torch.compile's phases and profuse's autotuner), the peak memory
   reserved over its warm-up, capture and steady steps (CUDA), and its loss and every gradient
   against the reference, tensor by tensor, each within its bound from the unfused step's own
   error for that tensor (profuse.samemath). A variant outside a bound is failed and never
   timed. Then interleaved trials of whole steps in the referee's design (bench.timing.REFEREE:
   balanced orders, several steps a trial, warm-up until steady, more trials where the top two
   are close; timing "loop", no L2 flush: a step's own traffic evicts the cache), each trial's
   clocks read (NVML, where there is one), the step speedup over eager with its bootstrap CI and
   its paired per-trial statistic, and the weights and each variant's last loss checked finite.
4. A short profile of each timed variant as it was timed (profuse.stepprofile: nothing built or
   compiled again): kernels per step, the memory-bound share, GPU idle, time by category. The
   eager one runs through a labelled copy (ModelSpec.label), so the trace says how much of the
   step is in each op fusion replaces, forward and backward.
5. Amdahl (profuse.amdahl): those ops' time in each profiled eager step (their spread carried
   into the interval), their own speedups inside the step (each op's time under its range in the
   profiled eager steps over the profiled fused steps, the fused one profiled through a copy
   labelled the same way: forward + backward, the profile's basis), the gain 1 / ((1 - sum f) +
   sum f / s) printed beside the gain measured in 3, with a caveat where the eager step is not
   device-bound.
6. The verdict (profuse.verdict): the winner, or the variants tied with it (bench.stats.
   tie_verdict over the paired trials), and what bounds each step (bench.stats.bound), decided
   once and saved; the report prints it.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from profuse import __version__, fusion, samemath, stepstate
from profuse import amdahl as A
from profuse import compile as _compile
from profuse import env as _env
from profuse.amdahl import Amdahl, OpTiming
from profuse.bench import DEFAULT_TRIALS
from profuse.bench.stats import OVER_COMPILE, Speedup, speedup_ci
from profuse.bench.timing import REFEREE, Comparison, TrialDesign, balanced_trials, compare, design_rows
from profuse.compiletime import CHECK_SPLIT, CompileSplit, split_compile
from profuse.env import FIT_SHARE, check_fits, dtype_name, environment, interpreting
from profuse.errors import UsageError
from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.model import GPTConfig
from profuse.models import ModelSpec, autocast_for  # noqa: F401 (re-exported)
from profuse.models import experts as _experts
from profuse.models import liger as L
from profuse.models.experts import ExpertsChoice
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
from profuse.samemath import CHECK_FACTOR, FullCheck, MathCheck
from profuse.stepprofile import UNSYNCED_STEPS, VariantProfile, agreement, profile_variant
from profuse.stepstate import StepMemory, WeightsCheck
from profuse.verdict import StepVerdict, decide

__all__ = ["CHECK_BATCH", "CHECK_FACTOR", "CHECK_LAYERS", "CHECK_SEQ_LEN", "PRESETS"]
__all__ += ["VariantProfile", "preset_model"]

Progress = Callable[[str, int, int], None]
Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

BASELINE = "eager"
# Every variant, in the table's order.
ALL_VARIANTS = (
    "eager", "fused", "moe-best", "moe-best+fused", "liger-ops", "liger", "compile", "compile-stock",
    "compile+fused", "compile+loss", "cudagraphs",
)  # fmt: skip
# The built-in GPT's default (Liger patches HF models only): the four the lab's Part C compares.
VARIANTS = ("eager", "fused", "compile", "compile+fused")
# The variants that set the experts' implementation to the card's best (profuse.models.experts):
# a mixture-of-experts model's, in its default.
EXPERTS_VARIANTS = ("moe-best", "moe-best+fused")
# The variants asked for by name only.
BY_NAME_VARIANTS = ("compile-stock", "compile+loss")
# A Hugging Face model's default: every variant but those asked for by name and, for a dense
# model, the experts' ones; a mixture of experts' (MOE_VARIANTS) has them.
HF_VARIANTS = tuple(v for v in ALL_VARIANTS if v not in (*BY_NAME_VARIANTS, *EXPERTS_VARIANTS))
MOE_VARIANTS = tuple(v for v in ALL_VARIANTS if v not in BY_NAME_VARIANTS)
FUSED_VARIANTS = ("fused", "moe-best+fused", "compile+fused", "compile+loss")
# The fused variants that place a subset of profuse.fuse's ops (ModelSpec.fuse's `only`).
SUBSET_VARIANTS = {"compile+loss": ("linear_cross_entropy",)}
# The compiled fused variants: fused's same-math check on the small copy is theirs too (the same
# Triton ops; each still meets the reference at full size on its own).
RIDES_ON_FUSED = ("compile+fused", "compile+loss")
LIGER_VARIANTS = ("liger-ops", "liger")
# StepConfig.optimizer's choices: AdamW as torch builds it with no flags, or its fused kernel.
OPTIMIZERS = ("default", "fused")
COMPILED_VARIANTS = ("compile", "compile-stock", "compile+fused", "compile+loss", "cudagraphs")
# The compiled variants of the unfused model that take the causal-mask fix (ModelSpec.fix_causal_mask).
MASK_FIXED_VARIANTS = ("compile", "cudagraphs")
STOCK_VARIANTS = ("compile-stock",)
GRAPH_VARIANTS = ("cudagraphs",)
# The variants that swap ops in an unfused model: each passes the same-math check first.
CHECKED_VARIANTS = ("fused", "moe-best", "moe-best+fused", "liger-ops", "liger")

# The kernel modules behind the fused ops (profuse.blockops, rotary, crossentropy).
KERNEL_MODULES = tuple(
    f"profuse.kernels.{name}" for name in ("swiglu", "add_rms_norm", "rms_norm", "rope", "cross_entropy")
)

# The ops the fused variants replace: their names in fusion, and the profiler range of each.
OPS = A.OPS


@dataclass
class StepConfig:
    """What Part C runs. The CLI maps --model, --preset and the size flags onto `model`."""

    # The model and its batch (profuse.models.model_spec). A GPTConfig is taken too, with
    # `preset` its name: the built-in GPT at those sizes.
    model: ModelSpec | GPTConfig = field(default_factory=GPTConfig)
    preset: str | None = None  # recorded with the results; with a spec, the spec's
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    variants: Sequence[str] | None = None  # eager, the baseline, is always in; None: the model's default
    # interleaved trials of whole steps; None: fitted to the step (fitted_trials), DEFAULT_TRIALS
    # where its length is not known before the trials (a CPU)
    trials: int | None = None
    warmup: int | None = None  # untimed steps after the first: 3 on CUDA, 1 on CPU (steps take ~1 s)
    seed: int = 0  # weights, the batch of random tokens, the trial order
    profile_steps: int = 3  # profiled steps per variant; 0: no profiles and no Amdahl prediction
    out_dir: Path = Path(".")  # the profiles' traces go here
    lr: float = 1e-3  # AdamW's, as Part A
    # amp: fp32 parameters and AdamW state, bf16 autocast on CUDA; bf16: bf16 parameters and AdamW
    # state, no autocast (profuse.models.spec.PRECISIONS)
    precision: str = DEFAULT_PRECISION
    # AdamW's implementation, the same for every variant: "default" (torch.optim.AdamW with no
    # flags: foreach on CUDA, a loop on a CPU) or "fused" (AdamW(fused=True): one kernel over all
    # parameters; Hugging Face's Trainer default, adamw_torch_fused, from torch 2.8 on)
    optimizer: str = "default"
    trace_tag: str = ""  # appended to the traces' names: the precision, where one folder holds two runs

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.out_dir = Path(self.out_dir)
        check_precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}: choose from {', '.join(OPTIMIZERS)}")
        if isinstance(self.model, GPTConfig):
            preset = self.preset or "lab"
            if preset not in PRESETS:
                raise UsageError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
            self.model = GPTSpec(self.model, preset)
        elif not isinstance(self.model, ModelSpec):
            kind = type(self.model).__name__
            raise TypeError(f"StepConfig.model takes a ModelSpec or a GPTConfig, not {kind}")
        self.preset = self.model.preset
        default = VARIANTS if self.model.family == "gpt" else HF_VARIANTS
        if self.experts is not None:
            default = MOE_VARIANTS
        names = list(dict.fromkeys(default if self.variants is None else self.variants))
        unknown = [v for v in names if v not in ALL_VARIANTS]
        if unknown:
            choices = ", ".join(ALL_VARIANTS)
            raise UsageError(f"unknown variant(s) {', '.join(unknown)}: choose from {choices}")
        if BASELINE not in names:
            names.insert(0, BASELINE)
        self.variants = tuple(v for v in ALL_VARIANTS if v in names)  # table order
        if self.trials is not None and self.trials < 2:
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

    @property
    def experts(self) -> ExpertsChoice | None:
        """The experts implementation the moe-best variants run, and why (None: no experts)."""
        return self.spec.experts_choice(self.device, self.precision)

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
            "optimizer": self.optimizer,
            "timing": "loop",
            **({"experts": self.experts.to_dict()} if self.experts is not None else {}),
        }


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def num_params(m: GPTConfig) -> int:
    """GPT(m).num_params() without building it (GPTConfig.param_count)."""
    return m.param_count()


def estimated_bytes(cfg: StepConfig, variants: Sequence[str] | int | None = None) -> int:
    """A generous estimate of the peak memory of the run.

    Once, whatever the number of variants (they share them): fp32 parameters, gradients and
    AdamW's two moments (16 bytes a parameter), autocast's bf16 weight copies (2), the gradients
    of a variant while the same-math check compares them (4; the reference waits on the host, and
    its own peak is sized apart, samemath.plan_chunks; 4 more where liger runs, a margin for its
    second loss), one step's activations (ModelSpec.activation_bytes). A CUDA-graph variant keeps
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
        elif name in STOCK_VARIANTS and spec.family == "gpt":
            why = "the built-in GPT builds no mask: compile is its stock torch.compile"
        if name in SUBSET_VARIANTS and spec.family == "gpt" and not why:
            why = "the built-in GPT's fusion has no loss op: silu_mul and add_rms_norm, swapped together"
        if name in EXPERTS_VARIANTS and not why:
            why = _experts_unavailable(cfg, name)
        if why:
            skipped[name] = why
        else:
            runs.append(name)
    _drop_graphs_that_do_not_fit(cfg, runs, skipped)
    return runs, skipped


def _experts_unavailable(cfg: StepConfig, name: str) -> str:
    """Why moe-best (or moe-best+fused) does not run: no experts, or the model as built runs the
    best implementation already, so eager (fused) is that variant and timing it twice tells
    nothing ('' where it runs)."""
    choice = cfg.experts
    if choice is None:
        return f"{cfg.spec.model_arg} has no experts (transformers' use_experts_implementation)"
    if choice.same_as_built:
        same = "fused" if name in FUSED_VARIANTS else BASELINE
        impl = choice.implementation
        return f"{same} is it: the model as built runs transformers' {impl} experts, the best here"
    return ""


def _drop_graphs_that_do_not_fit(cfg: StepConfig, runs: list[str], skipped: dict[str, str]) -> None:
    """Where the run fits the device's free memory without the CUDA-graph variants but not with
    them (each keeps a step's activations in its graphs' pool), those are skipped with the reason,
    not the whole run refused: Llama-3.2-1B's 7 default variants on an 80 GB card."""
    graphs = [n for n in runs if n in GRAPH_VARIANTS]
    free = _env.free_memory_bytes(cfg.device) if graphs else None
    if free is None:
        return
    rest = [n for n in runs if n not in GRAPH_VARIANTS]
    need, need_rest = estimated_bytes(cfg, runs), estimated_bytes(cfg, rest)
    if need > FIT_SHARE * free >= need_rest:
        for name in graphs:
            runs.remove(name)
            skipped[name] = (
                f"its graphs' memory pool would not fit: about {need / 1e9:.0f} GB with it, "
                f"{need_rest / 1e9:.0f} GB without, {free / 1e9:.0f} GB free"
            )


# --------------------------------------------------------------------------------------------
# A variant: the model prepared, its loss, and the step a training loop runs
# --------------------------------------------------------------------------------------------


@dataclass
class _Variant:
    name: str
    model: nn.Module  # the prepared copy; its parameters are the run's shared ones
    net: nn.Module  # the model, or the model under torch.compile
    loss: LossFn  # what its step minimises: the spec's, the users' loss (the same for every variant)
    ref_loss: LossFn  # that loss's math from the logits (ModelSpec.reference_loss): the references'
    autocast: Callable[[], contextlib.AbstractContextManager]  # the precision's (nothing for bf16)
    globals: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)
    mask: MaskRoute | None = None  # a compiled variant's causal mask: fixed or transformers' own
    # what profuse.fuse placed in a fused variant: {"counts": op -> places, "left_unfused": [...]}
    fused: dict | None = None


@dataclass(frozen=True)
class MaskRoute:
    """How a compiled variant's plain causal call reaches attention: with the causal-mask fix
    (SDPA's is_causal, no mask built while compiling: profuse.fusion.hf_mask) or as the model
    ships it, and why."""

    fixed: bool
    note: str  # why not fixed ('' where fixed)

    def to_dict(self) -> dict:
        return asdict(self)


def _mask_route(spec: ModelSpec, name: str, model: nn.Module, fused) -> MaskRoute:
    """The causal mask of compiled variant `name`: fused ones have profuse.fuse's own fix (`fused`
    its summary), compile and cudagraphs take the same fix here, compile-stock none."""
    if name in STOCK_VARIANTS:
        return MaskRoute(False, "transformers' own: the mask is built while compiling on torch < 2.14")
    if name in FUSED_VARIANTS:
        if getattr(fused, "causal_mask", False):
            return MaskRoute(True, "")
        if not hasattr(fused, "causal_mask"):  # a fusion without a mask step: the spec says why
            return MaskRoute(False, spec.fix_causal_mask(nn.Module()))
        return MaskRoute(False, "profuse.fuse left the mask as the model builds it")
    why = spec.fix_causal_mask(model)
    return MaskRoute(not why, why)


def _prepare(
    spec: ModelSpec, name: str, model: nn.Module, ops: fusion.BlockOps, autocast, experts: str | None = None
) -> _Variant:
    """`model` (in place) made into variant `name`; `autocast` the precision's context; `experts`
    the implementation the experts variants set (the run's StepConfig.experts, whatever the
    size of `spec`: the small check's copy runs the run's)."""
    module_globals: contextlib.AbstractContextManager = contextlib.nullcontext()
    fused = None
    if name in EXPERTS_VARIANTS:
        if experts is None:
            raise UsageError(f"{name}: {spec.model_arg} has no experts implementation to set")
        _experts.set_implementation(model, experts)
    if name in FUSED_VARIANTS:
        only = SUBSET_VARIANTS.get(name)  # a subset variant's ops; the others call fuse as it was
        fused = spec.fuse(model, ops) if only is None else spec.fuse(model, ops, only=only)
    elif name in LIGER_VARIANTS:
        module_globals = L.patch(model, spec.family, ops_only=name == "liger-ops")
    net, mask = model, None
    if name in COMPILED_VARIANTS:
        mask = _mask_route(spec, name, model, fused)
        net = _compile.compile_model(model, cudagraphs=name in GRAPH_VARIANTS)
    placed = None
    if getattr(fused, "counts", None) is not None:  # a Hugging Face model's FuseSummary
        placed = {"counts": dict(fused.counts), "left_unfused": list(fused.left_unfused)}
    return _Variant(name, model, net, spec.loss, spec.reference_loss, autocast, module_globals, mask, placed)


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
# 2. Same math: a variant vs the unfused step vs float64 on a small model (profuse.samemath)
# --------------------------------------------------------------------------------------------


def check_model(m: GPTConfig) -> GPTConfig:
    """The run's GPT cut to CHECK_LAYERS layers and CHECK_BATCH x CHECK_SEQ_LEN tokens."""
    return GPTSpec(m).small().config


def check_variant_math(cfg: StepConfig, name: str, ops: fusion.BlockOps) -> MathCheck:
    """Loss and gradients of one step of the small model: variant `name`, unfused, float64."""
    return samemath.check_small(
        cfg.spec,
        lambda spec, model: _prepare(spec, name, model, ops, cfg.autocast, _experts_name(cfg)),
        device=cfg.device,
        seed=cfg.seed,
        precision=cfg.precision,
        dtype=cfg.dtype,
        autocast=cfg.autocast,
    )


def _experts_name(cfg: StepConfig) -> str | None:
    choice = cfg.experts
    return None if choice is None else choice.implementation


def check_same_math(cfg: StepConfig, ops: fusion.BlockOps) -> MathCheck:
    """The fused step (block ops `ops`) against the unfused one and float64, on a small model."""
    return check_variant_math(cfg, "fused", ops)


def _checked(names: Sequence[str]) -> list[str]:
    """The variants among `names` whose same-math check runs: fused's for the ones riding on it."""
    rides = any(n in names for n in RIDES_ON_FUSED)
    return [c for c in CHECKED_VARIANTS if c in names or (c == "fused" and rides)]


def _math_stage(
    cfg, names, block_ops, failed, tell, todo: Sequence[str] | None = None, splits: dict | None = None
) -> tuple[dict[str, MathCheck], list[str]]:
    """Step 2: the same-math check of each checked variant that is to run (the compiled fused
    ones ride on fused's), or of `todo`; the variants that fail it go to `failed` and leave `names`.
    Each check's split (compiletime: a cold process builds most of profuse's kernels here) goes
    to `splits` as "check:NAME"."""
    checks: dict[str, MathCheck] = {}
    if todo is None:
        todo = _checked(names)
    for i, name in enumerate(todo):
        what = f"checking the {name} step against float64"
        tell(what, i, len(todo))
        with split_compile() as split:
            check = (
                check_same_math(cfg, block_ops)
                if name == "fused"
                else check_variant_math(cfg, name, block_ops)
            )
        if splits is not None:
            splits[f"{CHECK_SPLIT}{name}"] = split[0]
        if split[0].compiled_anything:
            tell(f"{what} took {split[0].seconds:.1f} s: {split[0].summary()}", i + 1, len(todo))
        checks[name] = check
        if not check.passed:
            why = check.error or f"its {check.worst} is outside the bound against float64"
            for n in ("fused", *RIDES_ON_FUSED) if name == "fused" else (name,):  # they ride on it
                if n in names:
                    failed[n] = f"failed the same-math check: {why}"
    return checks, [n for n in names if n not in failed]


# --------------------------------------------------------------------------------------------
# 3. The variants, their first step, and the timed steps
# --------------------------------------------------------------------------------------------


@dataclass
class FirstStep:
    """A variant's first whole step: its time (compilation included) and the loss it computed.

    The time depends on what ran before it in this process (CUDA's and cuBLAS's start-up fall on
    the first variant; Inductor's and Triton's caches are warm for later ones), so it is reported
    as information, never compared: compile time per compiled variant is the figure to read."""

    seconds: float
    loss: float

    def to_dict(self) -> dict:
        return asdict(self)


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
            v = _prepare(cfg.spec, name, model, ops, cfg.autocast, _experts_name(cfg))
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
    return out, make_optimizer(base.parameters(), cfg.lr, cfg.optimizer)


def make_optimizer(params, lr: float, kind: str = "default") -> torch.optim.Optimizer:
    """The run's one AdamW (StepConfig.optimizer): torch's default implementation, or fused=True."""
    if kind == "fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    return torch.optim.AdamW(params, lr=lr)


def _loss_and_grads(v: _Variant, loss_fn: LossFn, params: list, batch: Batch, device) -> tuple[float, list]:
    """One forward and backward of variant `v`, no optimizer step (every variant from the same
    weights): (loss, each parameter's .grad, not copied: the caller clears them)."""
    if v.name in GRAPH_VARIANTS:
        torch.compiler.cudagraph_mark_step_begin()
    with v.globals:
        with v.autocast():
            loss = loss_fn(v.net, batch)
        loss.backward()
    return loss.item(), [p.grad for p in params]


def _clear(params: list) -> None:
    for p in params:
        p.grad = None


def _references(cfg, variants, params, batch, tell) -> tuple[dict, str]:
    """Step 3's reference (profuse.samemath), before any variant's own steps: for each loss the
    variants minimise, the unfused model's loss and gradients in fp32 without autocast (float64
    where the step computes in fp32), in as few chunks of sequences as fit, and the unfused
    step's own errors against them; the gradients then wait on the host. Returns ({loss function:
    (reference, the unfused step's errors, their global error)}, why not, where it cannot run)."""
    eager = next((v for v in variants if v.name == BASELINE), None)
    if eager is None:
        return {}, ""
    dev, ref_dtype = cfg.device, samemath.reference_dtype(cfg.dtype)
    act = cfg.spec.activation_bytes(torch.float32) * (2 if ref_dtype == torch.float64 else 1)
    n = cfg.spec.param_count()
    stepstate.empty_allocator(dev)
    chunks, why = samemath.plan_chunks(
        batch[0].shape[0],
        lambda k: samemath.reference_bytes(n, params[0].dtype, cfg.dtype, act, k),
        dev,
    )
    if not chunks:
        return {}, f"the same-math check at full size was not run: {why}"
    size = batch[0].shape[0]
    tries = [k for k in range(chunks, size + 1) if size % k == 0]
    refs: dict = {}
    for key in dict.fromkeys(v.ref_loss for v in variants):
        tell(f"the {dtype_name(ref_dtype)} reference at full size", len(refs), len(variants))
        for i, k in enumerate(tries):
            try:
                # the gradients wait on the host while the unfused step runs beside the resident state
                ref = samemath.compute_reference(eager.model, params, key, batch, ref_dtype, k).to("cpu")
                value, grads = _loss_and_grads(eager, eager.loss, params, batch, dev)
                errors, glob = samemath.compare_to(value, grads, ref)
                tries = tries[i:]  # the next loss's reference starts from the chunking that fitted
                break
            except Exception as err:  # out of memory: smaller chunks; else say so (the small check stands)
                _clear(params)
                ref = grads = None
                if not isinstance(err, torch.cuda.OutOfMemoryError) or k == tries[-1]:
                    return {}, f"the same-math check at full size did not run: {_first_line(err)}"
                stepstate.empty_allocator(dev)
        _clear(params)
        refs[key] = (ref, errors, glob)
        del ref, grads
    stepstate.empty_allocator(dev)
    return refs, ""


def _full_check(cfg, v: _Variant, params, batch, refs) -> FullCheck:
    """Variant `v`'s loss and every gradient at the run's size against its loss's reference."""
    ref, unfused, unfused_global = refs[v.ref_loss]
    try:
        if v.name == BASELINE:  # its errors are the unfused step's, computed with the reference
            errors, glob = unfused, unfused_global
        else:
            value, grads = _loss_and_grads(v, v.loss, params, batch, cfg.device)
            errors, glob = samemath.compare_to(value, grads, ref)
    except Exception as err:  # a variant that cannot run here is a failed row, not a crash
        return samemath.failed_check(ref.kind, _first_line(err))
    finally:
        _clear(params)
    kernels_interpreted = cfg.device.type != "cuda" and interpreting() and v.name in FUSED_VARIANTS
    return samemath.judge(
        errors, unfused, cfg.dtype, ref.kind, global_err=glob, unfused_global_err=unfused_global,
        interpreted=kernels_interpreted,
    )  # fmt: skip


def _first_steps(
    cfg, variants, optimizer, batch, refs, failed, tell, splits, phase
) -> tuple[dict[str, FirstStep], dict[str, StepMemory], dict[str, FullCheck]]:
    """Step 3: each variant's own first whole steps (stepstate.own_steps), in table order, each
    from an emptied allocator: the first step's time, compilation included, and on CUDA the peak
    memory over its warm-up, capture and steady steps; then its loss and gradients at this size
    against the reference (`refs`: _references'), tensor by tensor. CUDA graph variants come last
    in the table: their graphs' pool stays allocated after their steps. AdamW runs at lr 0 (the
    caller holds it so). A variant that raises, whose loss is not finite, or that fails the check
    goes to `failed`. Each first step's split (compiletime) goes to `splits`, its own steps' wall
    time to `phase` ("first:NAME")."""
    dev = cfg.device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    steps = stepstate.MEMORY_STEPS if dev.type == "cuda" else 1
    first_steps: dict[str, FirstStep] = {}
    memory: dict[str, StepMemory] = {}
    checks: dict[str, FullCheck] = {}
    for i, v in enumerate(variants):
        what = " (compiling)" if v.name in COMPILED_VARIANTS else ""
        tell(f"first step: {v.name}{what}", i, len(variants))
        try:
            with phase(f"first:{v.name}"), split_compile() as split:
                own = stepstate.own_steps(_train_step(v, optimizer, batch, dev), dev, steps)
            splits[v.name] = split[0]
            done = f": {split[0].summary()}" if split[0].compiled_anything else ""
            tell(f"first step: {v.name} took {own.first_s:.1f} s{done}", i + 1, len(variants))
            loss = own.loss.item()
            if not math.isfinite(loss):
                raise FloatingPointError(f"its loss is {loss} in its first steps")
        except Exception as err:  # a variant that cannot run here is a failed row, not a crash
            failed[v.name] = _first_line(err)
            optimizer.zero_grad(set_to_none=True)
            continue
        first_steps[v.name] = FirstStep(own.first_s, loss)
        if own.memory is not None:
            memory[v.name] = own.memory
        if refs:
            checks[v.name] = _full_check(cfg, v, params, batch, refs)
            if not checks[v.name].passed:
                failed[v.name] = f"failed the same-math check at full size: {checks[v.name].reason()}"
    return first_steps, memory, checks


# A trial's timed steps span at least TRIAL_SPAN_S where a step is long: K = 10 steps of a 166 ms
# step (Llama-3.2-1B on the H200) would take 1.8 s a trial, 12 s a round of 7 variants, and the
# event pair's overhead (microseconds) and the queue (full after the discarded step) need far fewer.
TRIAL_SPAN_S = 0.5
MIN_CALLS = 3
# The extension to 30 trials (where the two fastest are within 2%) stops where its rounds would
# pass this many seconds of steps: the run's minutes stay bounded whatever the model.
TRIALS_BUDGET_S = 120.0
# Host time has rounds of its own (bench/host.py: each variant's step issued against a held GPU,
# about HOST_ROUND_STEPS steps' time a variant and round). Where steps are long they stop at
# HOST_BUDGET_S of rounds, HOST_MIN_ROUNDS at the least: beside a long step's device time its host
# time is a lower bound that only has to be far enough below it, and a round per trial would be
# 42 rounds of 7 variants of a 190 ms step (Llama-3.2-1B on an H100, 2026-12-07), 3 minutes a
# precision. A short step, where the host can bound it, keeps a round per trial.
HOST_BUDGET_S = 20.0
HOST_MIN_ROUNDS = 5
HOST_ROUND_STEPS = 3


def trial_design(device: torch.device, step_s: float | None = None, variants: int = 1) -> TrialDesign:
    """The referee's design of the step's trials (bench.timing.REFEREE) on CUDA, fitted to a step
    of `step_s` seconds (where known) over `variants` variants: K = TRIAL_SPAN_S / step_s steps a
    trial within [MIN_CALLS, REFEREE.calls], and no more trials than TRIALS_BUDGET_S of steps
    holds. On a CPU, where a step of even the lab's GPT takes about a second and the machine is
    shared, one step a trial in balanced orders, warmed up by steps (Part B's rule), with the drift
    and noise warnings: the same verdict's statistics, without blocks of 10 steps and a 1% warm-up
    no shared CPU meets. Host time's own rounds stop at HOST_BUDGET_S of a long step's."""
    if device.type != "cuda":
        return replace(REFEREE, calls=1, discard=0, steady_spread=None, warmup_block=None, max_trials=0)
    if not step_s or step_s <= 0:
        return REFEREE
    calls = min(REFEREE.calls, max(MIN_CALLS, math.ceil(TRIAL_SPAN_S / step_s)))
    round_s = _round_seconds(replace(REFEREE, calls=calls), step_s, variants)
    host = int(HOST_BUDGET_S // (max(variants, 1) * HOST_ROUND_STEPS * step_s))
    return replace(
        REFEREE,
        calls=calls,
        max_trials=min(REFEREE.max_trials, int(TRIALS_BUDGET_S // round_s)),
        host_rounds=None if host >= REFEREE.max_trials else max(HOST_MIN_ROUNDS, host),
    )


def _round_seconds(design: TrialDesign, step_s: float, variants: int) -> float:
    """One trial round's steps in seconds: every variant's timed and discarded steps."""
    return max(variants, 1) * (design.calls + design.discard) * step_s


def fitted_trials(device: torch.device, step_s: float | None, variants: int) -> int:
    """How many trials a run that names none gets: DEFAULT_TRIALS (rounded up to whole balanced
    designs, as asking for them would be), except on CUDA where a round of every variant's
    steps is long: as many whole designs as TRIALS_BUDGET_S of steps holds, one at the least.
    Seven variants of Llama-3.2-1B (a 150-190 ms step, 5 steps a trial) fit 14 trials, not 42,
    which at about 5 s a round took 3.5 minutes a precision (H100, 2026-12-07); under 30
    trials each CI is the order statistics' interval with its exact coverage."""
    n = max(variants, 1)
    most = balanced_trials(n, DEFAULT_TRIALS)
    if device.type != "cuda" or not step_s or step_s <= 0:
        return most
    round_s = _round_seconds(trial_design(device, step_s, n), step_s, n)
    size = design_rows(n)
    return max(size, min(most, int(TRIALS_BUDGET_S // round_s) // size * size))


def _step_seconds(step: Callable[[], object], device: torch.device) -> float:
    """One step's wall time after a synchronisation, the second of two (the first refills caches):
    what fits the trial design to the model (trial_design), not a measurement that is reported."""
    for _ in range(2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _timed_steps(cfg, steps, first_steps, tell, phase) -> tuple[Comparison, dict[str, torch.Tensor]]:
    """Step 3's second half: interleaved trials of whole steps in the referee's design
    (trial_design), each trial's clocks read where NVML is (bench.clocks), each variant's held host
    time (bench.host). No recompile is allowed while timing. Returns the comparison and each
    variant's last loss (for the finiteness check)."""
    last = stepstate.LastLoss()
    say = lambda stage, done, total: tell(f"steps: {stage}", done, total)
    step_s = (
        _step_seconds(steps[BASELINE], cfg.device)
        if cfg.device.type == "cuda" and BASELINE in steps
        else None
    )
    design = trial_design(cfg.device, step_s, len(steps))
    trials = cfg.trials if cfg.trials is not None else fitted_trials(cfg.device, step_s, len(steps))
    tell(f"steps: warm-up, then {trials} trials of {', '.join(steps)} ({design.calls} steps a trial)", 0, 1)
    with _compile.no_recompiles(), phase("trials"):
        comparison = compare(
            {name: last.wrap(name, step) for name, step in steps.items()},
            BASELINE,
            trials=trials,
            device=cfg.device,
            warmup=cfg.warmup,
            flush_l2=False,  # a step's own traffic (hundreds of MB) evicts the L2
            seed=cfg.seed,
            progress=say,
            timing="loop",  # back to back, as a training loop runs steps
            first_calls={k: first_steps[k].seconds for k in steps},
            design=design,
        )
    return comparison, last.last


def _drop_failed(comparison: Comparison, failed: dict[str, str], fails: dict[str, str]) -> Comparison | None:
    """The comparison without the variants in `fails` (which join `failed`); None where eager is one."""
    failed.update(fails)
    if BASELINE in fails:
        return None
    for name in fails:
        comparison.timings.pop(name, None)
        comparison.speedups.pop(name, None)
    comparison.orders = [[n for n in order if n not in fails] for order in comparison.orders]
    return comparison


def _release(device: torch.device) -> None:
    """Drop compiled graphs and cached blocks, so what comes next starts from a clean device."""
    _compile.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# 5. Profiles, of the variants as they were timed
# --------------------------------------------------------------------------------------------


def _labelled(
    cfg: StepConfig, eager: _Variant, v: _Variant | None = None, ops: fusion.BlockOps | None = None
) -> tuple[_Variant, str]:
    """A copy of the eager model over the same parameters, the ops fusion replaces in profiler
    ranges (ModelSpec.label, the math unchanged), or with `ops` the fused variant `v` made again
    from it with the same ranges around its fused ops (ModelSpec.fuse(label=True)); or the
    variant itself and why, where the model cannot be labelled (profiled unlabelled: no Amdahl
    prediction)."""
    target = v or eager
    shared = {id(p): p for p in eager.model.parameters()}
    model = copy.deepcopy(eager.model, memo=dict(shared))
    try:
        if v is None:
            cfg.spec.label(model)
        else:
            cfg.spec.fuse(model, ops, label=True)
    except Exception as err:  # a model fusion cannot fuse (or label): profiled as timed, no Amdahl
        return target, _first_line(err)
    if {id(p) for p in model.parameters()} != shared.keys():
        return target, "labelling it replaced the model's parameters"
    return replace(target, model=model, net=model), ""


def _profile_stage(cfg, variants, optimizer, batch, tell, phase, ops, profiles: dict) -> None:
    """Step 5: each timed variant's step profiled as it was timed (nothing built or compiled
    again); eager and fused (block ops `ops`) through labelled copies, for Amdahl's in-step times.
    Each profile goes into `profiles` as it is made: an interrupted stage leaves the finished ones."""
    eager = next((v for v in variants if v.name == BASELINE), None)
    for i, v in enumerate(variants):
        say = lambda msg, i=i, name=v.name: tell(f"profile: {name}: {msg}", i, len(variants))
        target, label_error, block_ops = v, "", {}
        if v.name == BASELINE or (v.name == "fused" and eager is not None):  # Amdahl's two sides
            target, label_error = _labelled(cfg, v) if v is eager else _labelled(cfg, eager, v, ops)
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
                timed_step=_train_step(v, optimizer, batch, cfg.device),
            )
        del target, step


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
    design = trial_design(cfg.device)
    # whole Williams designs; trials left to fit (fitted_trials) count at their most, the step's
    # length being unknown before it runs
    asked = cfg.trials if cfg.trials is not None else fitted_trials(cfg.device, None, n)
    rounds = balanced_trials(n, asked) if design.balanced and n else asked
    checked = _checked(names)
    profiled = cfg.profile_steps > 0
    compiled = sum(name in COMPILED_VARIANTS for name in names)
    return {
        "variants": n,
        "compiles": compiled,  # torch.compile of the whole model, forward and backward, once each
        "builds": 1 + (1 if profiled else 0),  # the model, and eager's labelled copy for its profile
        "checks": len(checked),  # each: a small copy's step as the variant, unfused and in float64
        "references": 1 if BASELINE in names else 0,  # the full-size fp32 / float64 step (samemath)
        # each variant's own (stepstate), and on CUDA its steady-state memory steps
        "first_steps": n * (stepstate.MEMORY_STEPS + stepstate.STEADY_STEPS if cuda else 1),
        "warmup_steps_at_least": n * cfg.warmup * (design.warmup_block or design.calls),
        "trial_rounds": rounds,
        "trials_fitted": int(cfg.trials is None),  # 1: fewer where a round of steps is long
        "trial_rounds_at_most": max(rounds, design.max_trials),  # more where the top two are close
        "steps_per_trial": design.calls + design.discard,
        "host_rounds": (design.host_rounds or asked) if cuda else 0,  # each variant once a round
        "profiled_steps": n * cfg.profile_steps if profiled else 0,
        "profile_warmup_steps": (n + compiled) if profiled else 0,
        # CUDA: each variant's unsynchronised steps for the bound, one more first (stepprofile)
        "steady_profiled_steps": n * (UNSYNCED_STEPS + 1) if profiled and cuda else 0,
        "op_timings": 0,  # Amdahl reads the ops' in-step times from the profiles: none timed alone
    }


def plan_line(cfg: StepConfig, names: Sequence[str], counts: dict[str, int]) -> str:
    """The run's first progress line: its variants and what it will do (`budget`'s counts); trials
    left to fit the step on CUDA are counted at their most."""
    rounds = f"{counts['trial_rounds']} trial rounds"
    if counts.get("trials_fitted") and cfg.device.type == "cuda":
        rounds = f"up to {rounds} (fewer where a round of steps is long)"
    return (
        f"plan ({cfg.precision}): {', '.join(names)}; {counts['compiles']} compile(s), {counts['checks']} "
        f"check(s), {rounds}, {counts['profiled_steps']} profiled steps"
    )


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
    # each first step, split (compiletime), and each same-math check's ("check:NAME")
    compile: dict[str, CompileSplit] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds ("total": the run)
    budget: dict[str, int] = field(default_factory=dict)  # what the run was to do, counted up front
    verdict: StepVerdict | None = None  # decided once (profuse.verdict); the report prints it
    same_math: dict[str, FullCheck] = field(default_factory=dict)  # every variant's, at the run's size
    same_math_note: str = ""  # why the full-size check did not run, where it did not
    weights: WeightsCheck | None = None  # the shared weights through the timed steps
    # each compiled variant's causal mask: profuse's fix (SDPA's is_causal) or the model's own
    masks: dict[str, MaskRoute] = field(default_factory=dict)
    # each fused variant's placed ops and what profuse.fuse left unfused, and why (_Variant.fused)
    fused_ops: dict[str, dict] = field(default_factory=dict)
    # each variant's row: its math checked or not, at which size, against what (samemath.status)
    math: dict[str, samemath.MathStatus] = field(default_factory=dict)
    # "compile+loss vs compile": the fused loss alone on top of torch.compile, like fusion_over_compile
    loss_over_compile: Speedup | None = None
    # where an interrupt (Ctrl-C, a time limit's SIGINT) stopped the run after its timed trials;
    # "" where it ran to its end
    interrupted: str = ""

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
            "loss_over_compile": self.loss_over_compile.to_dict() if self.loss_over_compile else None,
            "memory": {k: v.to_dict() for k, v in self.memory.items()},
            "profiles": {k: v.to_dict() for k, v in self.profiles.items()},
            "ops": {k: v.to_dict() for k, v in self.ops.items()},
            "amdahl": self.amdahl.to_dict() if self.amdahl else None,
            "amdahl_note": self.amdahl_note,
            "compile": {k: v.to_dict() for k, v in self.compile.items()},
            "phases": self.phases,
            "budget": self.budget,
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "same_math": {k: v.to_dict() for k, v in self.same_math.items()},
            "same_math_note": self.same_math_note,
            "weights": self.weights.to_dict() if self.weights else None,
            "masks": {k: v.to_dict() for k, v in self.masks.items()},
            "fused_ops": self.fused_ops,
            "math": {k: v.to_dict() for k, v in self.math.items()},
            "comparison": cmp.to_dict() if cmp else None,
            "interrupted": self.interrupted,
        }


class StepInterrupted(KeyboardInterrupt):
    """An interrupt that came after the timed trials: `result` holds the run as far as it went
    (its trials, memory and checks; the profiles finished before it; `result.interrupted` says
    where it stopped), for the caller to save."""

    def __init__(self, result: StepResult):
        super().__init__(result.interrupted)
        self.result = result


def math_rows(
    names: Sequence[str],
    skipped: dict[str, str],
    failed: dict[str, str],
    small: dict[str, MathCheck],
    full: dict[str, FullCheck],
    full_note: str,
) -> dict[str, samemath.MathStatus]:
    """Every variant that ran (skipped ones did not): its own checks, small and full size (a
    variant counts only checks of itself: compile+fused's small gate is fused's, so it counts its
    full-size check, or its own small one where the full one could not run)."""
    rows = {}
    for name in names:
        if name in skipped:
            continue
        why = failed.get(name) or full_note or "no check ran for it"
        rows[name] = samemath.status(
            name, small.get(name), full.get(name), baseline=name == BASELINE, why_not=why
        )
    return rows


def _amdahl_stage(cfg, comparison, profiles) -> tuple[dict[str, OpTiming], Amdahl | None, str]:
    """Step 5 (profuse.amdahl): the labelled eager profile read step by step, each op's speedup
    from its own time inside the eager and the labelled fused step (amdahl.in_step_speedups,
    where fused was timed and profiled), and the prediction; or why there is none. No op is
    timed alone: the first element stays empty (older files hold such timings)."""
    eager_profile = profiles.get(BASELINE)
    if eager_profile is None or comparison is None:
        return {}, None, ""
    no_labels = "no Amdahl prediction: the ops fusion replaces could not be labelled"
    if eager_profile.label_error:
        return {}, None, f"{no_labels} ({eager_profile.label_error})"
    shares = A.read_step_shares(eager_profile.trace_path, cfg.device.type)
    if not shares.ops:
        return {}, None, f"{no_labels} (the eager profile has no labelled block ops)"
    speedups: dict[str, dict] = {}
    not_timed: dict[str, str] = {}
    fused_profile = profiles.get("fused")
    if fused_profile is not None and fused_profile.label_error:
        why = f"the fused step could not be labelled ({fused_profile.label_error})"
        not_timed = dict.fromkeys(shares.ops, why)
    elif fused_profile is not None:
        fused_shares = A.read_step_shares(fused_profile.trace_path, cfg.device.type)
        speedups, not_timed = A.in_step_speedups(shares, fused_shares)
    cuda = cfg.device.type == "cuda"
    fused_sp = comparison.speedups.get("fused")
    steady = eager_profile.steady
    idle = shares.idle_pct  # the synchronised profile's, where no unsynchronised one matches the loop
    if steady is not None and steady.agrees is not False:
        idle = steady.gpu_idle_pct
    amdahl = Amdahl(
        eager_step_s=comparison.median_s(BASELINE),
        op_s={op: share.step_s for op, share in shares.ops.items()},
        op_speedups=speedups,
        measured=fused_sp.to_dict() if fused_sp else None,
        calls={op: share.calls for op, share in shares.ops.items()},
        gpu_idle_pct=idle,
        host_s=comparison.timings[BASELINE].host_s if cuda else None,
        device_s=shares.device_s if cuda else None,
        not_timed=not_timed,
        speedup_source="in-step",
    )
    return {}, amdahl, ""


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
    tell(plan_line(cfg, names, counts), 0, 1)
    failed: dict[str, str] = {}
    splits: dict[str, CompileSplit] = {}
    with phase("check"):
        checks, names = _math_stage(cfg, names, block_ops, failed, tell, splits=splits)
        _release(dev)

    with phase("build"):
        tell(f"build: {', '.join(names)} over one set of parameters ({cfg.precision})", 0, 1)
        batch = spec.batch(dev, cfg.seed)
        variants, optimizer = _build_variants(cfg, names, block_ops, failed)
    masks = {v.name: v.mask for v in variants if v.mask is not None}
    fused_ops = {v.name: v.fused for v in variants if v.fused is not None}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    comparison, memory, weights = None, {}, None
    with stepstate.zero_lr(optimizer):  # every variant times the same weights (profuse.stepstate)
        stepstate.make_state(optimizer)
        before = stepstate.fingerprint(params)
        with phase("reference"):
            refs, same_math_note = _references(cfg, variants, params, batch, tell)
        if not refs:  # the timed shapes go unchecked: a small copy checks every variant step 2 did not
            with phase("check"):
                todo = [v.name for v in variants if v.name != BASELINE and v.name not in checks]
                more, _ = _math_stage(cfg, todo, block_ops, failed, tell, todo, splits)
                checks.update(more)
                _release(dev)
            variants = [v for v in variants if v.name not in failed]
        first_steps, memory, same_math = _first_steps(
            cfg, variants, optimizer, batch, refs, failed, tell, splits, phase
        )
        del refs
        variants = [v for v in variants if v.name not in failed]
        steps = {v.name: _train_step(v, optimizer, batch, dev) for v in variants}
        if BASELINE in steps:
            comparison, last = _timed_steps(cfg, steps, first_steps, tell, phase)
            weights = stepstate.after_trials(params, before, last)
            comparison = _drop_failed(comparison, failed, stepstate.failures(weights, list(steps)))
    timed = list(comparison.timings) if comparison else []
    t = comparison.timings if comparison else {}
    over_compile = {
        key: speedup_ci(t["compile"].times_s, t[name].times_s, seed=cfg.seed)
        for name, key in OVER_COMPILE.items()
        if "compile" in timed and name in timed
    }

    profiles: dict[str, VariantProfile] = {}
    ops_timed, amdahl, amdahl_note, interrupted = {}, None, "", ""
    to_profile = [v for v in variants if v.name in timed] if cfg.profile_steps > 0 else []
    stage = "the profiles"
    try:  # an interrupt from here on keeps the timed trials (StepInterrupted)
        if to_profile:  # step 4
            with phase("profiles"):
                _profile_stage(cfg, to_profile, optimizer, batch, tell, phase, block_ops, profiles)
        stage = "Amdahl's prediction"
        with phase("ops"):
            ops_timed, amdahl, amdahl_note = _amdahl_stage(cfg, comparison, profiles)
    except KeyboardInterrupt:
        if comparison is None:
            raise
        left = [v.name for v in to_profile if v.name not in profiles]
        interrupted = f"interrupted in {stage}" + (f" ({', '.join(left)} not profiled)" if left else "")
        amdahl_note = "the run was interrupted before Amdahl's prediction"
    del to_profile
    for name, p in profiles.items():  # the unsynchronised profile beside the timed trials
        if p.steady is not None:
            agreement(p.steady, comparison.timings[name].times_s)
    del steps, variants, optimizer, params
    _release(dev)

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
        fusion_over_compile=over_compile.get("fusion_over_compile"),
        loss_over_compile=over_compile.get("loss_over_compile"),
        memory=memory,
        profiles=profiles,
        ops=ops_timed,
        amdahl=amdahl,
        amdahl_note=amdahl_note,
        compile=splits,
        phases=phase.seconds,
        budget=counts,
        same_math=same_math,
        same_math_note=same_math_note,
        weights=weights,
        masks=masks,
        fused_ops=fused_ops,
        math=math_rows(cfg.variants, skipped, failed, checks, same_math, same_math_note),
        interrupted=interrupted,
    )
    result.phases["total"] = clock() - start
    result.verdict = decide(result.to_dict())
    if interrupted:
        raise StepInterrupted(result)
    return result
