"""What profuse needs to know of a model to profile and referee its training step.

A `ModelSpec` names a model and one batch: it builds the model with random weights (nothing is
downloaded), draws a batch of random tokens, computes the loss profuse's own way, makes a small
copy of itself for the float64 check, estimates the memory a step needs before anything is
built, and fuses a built model from outside. Part A (profuse.profiling) and Part C (profuse.step)
take any spec; `profuse.models.gpt` is the built-in GPT's, `profuse.models.hf` Hugging Face
Llama-family models'.

The step is the same for every spec, so the variants a referee compares differ only in what was
fused or compiled:

    with autocast():                        # the precision's (below)
        loss = spec.loss(model, batch)      # forward and loss, the way the model's users compute it
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

The loss is the users': the built-in GPT's mean cross-entropy over every token; for a Hugging
Face model `model(input_ids=idx, labels=idx).loss`, which shifts inside (B x (T - 1) tokens), so a
fused linear cross-entropy inside the model (profuse.fuse's, Liger's) applies and every variant
pays the same loss. `spec.reference_loss` is the same loss computed by profuse from the logits,
in the logits' dtype: the float64 check's (Hugging Face's own casts the logits to fp32).

Two precisions, as people train (PRECISIONS):

    amp     fp32 parameters and AdamW state, the forward under bf16 autocast on CUDA (HF Trainer's
            bf16=True); on a CPU no autocast: all fp32
    bf16    bf16 parameters and AdamW state, no autocast, on any device (many fine-tuning
            scripts, Liger-Kernel's benchmarks); slow on a CPU, which has few bf16 kernels
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from profuse.errors import UsageError

PRECISIONS = ("amp", "bf16")
DEFAULT_PRECISION = "amp"
PRECISION_HELP = (
    "amp = fp32 parameters and AdamW state, bf16 autocast on CUDA (fp32 on a CPU; the default); "
    "bf16 = bf16 parameters and AdamW state, no autocast (slow on a CPU)"
)


def check_precision(precision: str) -> str:
    """`precision` if it is one of PRECISIONS, else UsageError in one line."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    return precision


def param_dtype(precision: str = DEFAULT_PRECISION) -> torch.dtype:
    """The parameters' (and so AdamW's state's) dtype."""
    return torch.bfloat16 if check_precision(precision) == "bf16" else torch.float32


def compute_dtype(device: torch.device | str, precision: str = DEFAULT_PRECISION) -> torch.dtype:
    """The dtype the branches (matmuls, attention, the ops fusion replaces) compute in: bf16 under
    CUDA autocast or with bf16 parameters; fp32 for amp on a CPU."""
    if check_precision(precision) == "bf16" or torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.float32


def precision_text(device: torch.device | str, precision: str = DEFAULT_PRECISION) -> str:
    """How a step computes, in a few words, for the reports."""
    if check_precision(precision) == "bf16":
        slow = "; slow on a CPU" if torch.device(device).type != "cuda" else ""
        return f"bf16: bf16 parameters and AdamW state, no autocast{slow}"
    if torch.device(device).type == "cuda":
        return "amp: bf16 autocast over fp32 parameters and AdamW state"
    return "amp: fp32 (no autocast on a CPU)"


def state_bytes_per_parameter(precision: str = DEFAULT_PRECISION) -> int:
    """Parameters, gradients and AdamW's two moments, per parameter: 16 in fp32, plus autocast's bf16
    weight copies (2) for amp; 8 all in bf16."""
    return 8 if check_precision(precision) == "bf16" else 18


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with every parameter in `dtype`, in place: the same Parameter objects (tied weights
    stay tied), buffers left as they are (RoPE's inverse frequencies stay fp32, as Hugging Face
    keeps them when it loads a model in bf16)."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


# Sizes of the float64 check's small copy: the run's widths, few layers and tokens (cheap in
# float64, and through Triton's interpreter on a CPU).
CHECK_LAYERS, CHECK_SEQ_LEN, CHECK_BATCH = 2, 64, 2


@dataclass(frozen=True)
class OpShapes:
    """The shapes at which a step calls the ops fusion replaces (Part C times them alone)."""

    tokens: int  # rows of every op: batch x sequence
    d_model: int  # add_rms_norm's width
    ffn_hidden: int  # silu_mul's width (gate and up each)
    eps: float  # the norms' epsilon


class ModelSpec(ABC):
    """A model and its batch, described without building either."""

    family: str  # "gpt", or the Hugging Face model_type: "llama", "mistral", "qwen2", "qwen3"
    preset: str  # the size's name ("lab", "tiny", "Llama-3.2-1B", "config.json", ...)
    batch_size: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def model_arg(self) -> str:
        """The --model value that names this family: 'gpt' or 'hf:ARCH'."""
        return "gpt" if self.family == "gpt" else f"hf:{self.family}"

    def describe(self) -> str:
        """One line: which model, how big, how many tokens a step."""
        return (
            f"{self.model_arg} {self.preset}: {self.param_count() / 1e6:,.1f}M parameters, "
            f"{self.batch_size} x {self.seq_len} tokens a step"
        )

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def build(self, device: torch.device | str, seed: int = 0) -> nn.Module:
        """The model with random weights (fp32 parameters), on `device`, in train mode."""

    def build_for(
        self, device: torch.device | str, seed: int = 0, precision: str = DEFAULT_PRECISION
    ) -> nn.Module:
        """`build`, its parameters in the precision's dtype (the same values, rounded, for bf16)."""
        return cast_parameters(self.build(device, seed), param_dtype(precision))

    @abstractmethod
    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V), through whatever `model` is (fused, compiled)."""

    @abstractmethod
    def small(self) -> ModelSpec:
        """The same widths cut to CHECK_LAYERS layers and CHECK_BATCH x CHECK_SEQ_LEN tokens."""

    @abstractmethod
    def param_count(self) -> int: ...

    @abstractmethod
    def activation_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """A generous bound on one training step's activations, the matmuls and attention in
        `dtype` (bf16 under CUDA autocast, fp32 on the CPU)."""

    @abstractmethod
    def dims(self) -> dict:
        """The step's shapes in one flat dict: n_layer, d_model, n_head, ffn_hidden, vocab_size,
        batch_size, seq_len (what a report's model line says)."""

    @abstractmethod
    def op_shapes(self) -> OpShapes: ...

    @abstractmethod
    def fuse(self, model: nn.Module, ops=None, *, label: bool = False, only: Sequence[str] | None = None):
        """Swap the fused block ops into a built `model` in place (profuse.fusion); `ops` a
        profuse.fusion.BlockOps (default the Triton kernels). `label` wraps each in the profiler
        ranges fusion.BLOCK_OP_RANGES. `only`: these op names alone (profuse.fusion.OP_NAMES),
        with the causal-mask fix all of them get; UsageError in one line where the model's fusion
        cannot place a subset. Returns what fusion says it did."""

    def fix_causal_mask(self, model: nn.Module) -> str:
        """Let the unfused `model`'s plain causal call reach attention as SDPA's is_causal under
        torch.compile too, the math unchanged: what profuse.fuse does for the fused model
        (profuse.fusion.hf_mask), so a compile baseline runs on the fused one's terms. Returns ''
        where done, else why not (the model then runs as it is)."""
        return "its attention builds no mask to skip (SDPA's is_causal, under torch.compile too)"

    def experts_choice(self, device: torch.device | str, precision: str = DEFAULT_PRECISION):
        """The experts implementation fastest on `device` for this model's step, and why
        (profuse.models.experts.ExpertsChoice); None where the model has no experts to set."""
        return None

    @abstractmethod
    def label(self, model: nn.Module) -> nn.Module:
        """The unfused `model` with the ops fusion would replace in profiler ranges, the math
        unchanged (Part C's Amdahl prediction reads their share of the eager step)."""

    @abstractmethod
    def to_dict(self) -> dict: ...

    def train_bytes(self, dtype: torch.dtype = torch.float32, precision: str = DEFAULT_PRECISION) -> int:
        """A generous bound on training one copy: parameters, gradients and AdamW's two moments
        (state_bytes_per_parameter: 18 bytes a parameter for amp, 8 for bf16), one step's
        activations in `dtype`."""
        return state_bytes_per_parameter(precision) * self.param_count() + self.activation_bytes(dtype)

    def batch(self, device: torch.device | str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), each (batch_size, seq_len): random tokens, targets the next ones (what
        `loss` takes; a Hugging Face spec's second tensor is its labels, the input ids).

        Drawn on the CPU from a seeded generator (the same tokens on every machine), then moved.
        """
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(self.vocab_size, (self.batch_size, self.seq_len + 1), generator=gen)
        tokens = tokens.to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Forward and loss, the way the model's users compute it (what every variant's step
        runs). Here: the mean cross-entropy over every token of the logits (the built-in GPT's);
        under bf16 autocast cross_entropy runs in fp32."""
        return self.reference_loss(model, batch)

    def reference_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`loss`'s math computed by profuse from the logits, in the logits' dtype: float64 for
        the float64 check's model."""
        idx, targets = batch
        logits = self.logits(model, idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def autocast_for(
    device: torch.device, precision: str = DEFAULT_PRECISION
) -> Callable[[], contextlib.AbstractContextManager]:
    """amp: bf16 autocast on CUDA (the lab's CUDA precision), nothing on the CPU (fp32); bf16:
    nothing (the parameters are bf16 already)."""
    if check_precision(precision) == "amp" and torch.device(device).type == "cuda":
        return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


Phases = tuple[str, str, str]  # profiler range names of a step's forward, backward and optimizer


def train_step(
    spec: ModelSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    phases: Phases | None = None,
    precision: str = DEFAULT_PRECISION,
) -> Callable[[], torch.Tensor]:
    """One whole training step of `model` (built by `spec`, maybe fused or compiled) as a training
    loop runs it; returns the loss without reading it (no device synchronisation). `phases`: the
    names of profiler ranges to cut it into, for a trace a person reads (nothing reads them back:
    profuse.attribution finds the phases without them); `precision`: the autocast it runs under
    (the model's parameters are already in the precision's dtype)."""
    autocast = autocast_for(device, precision)
    label = record_function if phases else (lambda _name: contextlib.nullcontext())
    forward, backward, optimize = phases or ("", "", "")

    def step() -> torch.Tensor:
        with label(forward), autocast():
            loss = spec.loss(model, batch)
        with label(backward):
            loss.backward()
        with label(optimize):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_step(
    spec: ModelSpec,
    device: torch.device | str,
    *,
    seed: int = 0,
    lr: float = 1e-3,
    fuse: bool = False,
    ops=None,
    compile: bool = False,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    batch_seed: int | None = None,
    phases: Phases | None = None,
    precision: str = DEFAULT_PRECISION,
) -> Callable[[], torch.Tensor]:
    """Build `spec`'s model on `device` (fused, wrapped, then compiled, as asked), AdamW and one
    batch; return its training step: the zero-argument callable profuse.profile takes.

    `wrap` is applied to the model on its device before torch.compile (DistributedDataParallel;
    the optimizer holds the parameters, which the wrapper shares); `batch_seed` draws the batch
    (default `seed`), so data-parallel ranks can each have their own; `phases` as train_step's;
    `precision` one of PRECISIONS (the parameters' dtype and the autocast).
    """
    device = torch.device(device)
    model = spec.build_for(device, seed, precision)
    if fuse:
        spec.fuse(model, ops)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    net = wrap(model) if wrap is not None else model
    if compile:
        from profuse.compile import compile_model

        net = compile_model(net)
    batch = spec.batch(device, seed if batch_seed is None else batch_seed)
    return train_step(spec, net, optimizer, batch, device, phases, precision)
