"""What profuse needs to know of a model to profile and referee its training step.

A `ModelSpec` names a model and one batch: it builds the model with random weights (nothing is
downloaded), draws a batch of random tokens, computes the loss profuse's own way, makes a small
copy of itself for the float64 check, estimates the memory a step needs before anything is
built, and fuses a built model from outside. Part A (profuse.profiling) and Part C (profuse.step)
take any spec; `profuse.models.gpt` is the built-in GPT's, `profuse.models.hf` Hugging Face
Llama-family models'.

The step is the same for every spec, so the variants a referee compares differ only in what was
fused or compiled:

    with autocast():                        # bf16 on CUDA (fp32 weights, AdamW and loss); fp32 on CPU
        loss = spec.loss(model, batch)      # forward, then mean cross-entropy over every token
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

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
    def fuse(self, model: nn.Module, ops=None, *, label: bool = False):
        """Swap the fused block ops into a built `model` in place (profuse.fusion); `ops` a
        profuse.fusion.BlockOps (default the Triton kernels). `label` wraps each in the profiler
        ranges fusion.BLOCK_OP_RANGES. Returns what fusion says it did."""

    @abstractmethod
    def label(self, model: nn.Module) -> nn.Module:
        """The unfused `model` with the ops fusion would replace in profiler ranges, the math
        unchanged (Part C's Amdahl prediction reads their share of the eager step)."""

    @abstractmethod
    def to_dict(self) -> dict: ...

    def train_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """A generous bound on training one copy: fp32 parameters, gradients and AdamW's two
        moments (16 bytes a parameter), autocast's bf16 weight copies (2), one step's activations."""
        return 18 * self.param_count() + self.activation_bytes(dtype)

    def batch(self, device: torch.device | str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), each (batch_size, seq_len): random tokens, targets the next ones.

        Drawn on the CPU from a seeded generator (the same tokens on every machine), then moved.
        """
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(self.vocab_size, (self.batch_size, self.seq_len + 1), generator=gen)
        tokens = tokens.to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Forward and the mean cross-entropy over every token, computed here for every model
        (Hugging Face's own loss casts the logits to fp32, which a float64 check cannot use).
        Under bf16 autocast cross_entropy runs in fp32."""
        idx, targets = batch
        logits = self.logits(model, idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def autocast_for(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast on CUDA (the lab's CUDA precision), nothing on the CPU (fp32)."""
    if torch.device(device).type == "cuda":
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
) -> Callable[[], torch.Tensor]:
    """One whole training step of `model` (built by `spec`, maybe fused or compiled) as a training
    loop runs it; returns the loss without reading it (no device synchronisation). `phases`: the
    names of profiler ranges to cut it into, for a trace a person reads (nothing reads them back:
    profuse.attribution finds the phases without them)."""
    autocast = autocast_for(device)
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
) -> Callable[[], torch.Tensor]:
    """Build `spec`'s model on `device` (fused, wrapped, then compiled, as asked), AdamW and one
    batch; return its training step: the zero-argument callable profuse.profile takes.

    `wrap` is applied to the model on its device before torch.compile (DistributedDataParallel;
    the optimizer holds the parameters, which the wrapper shares); `batch_seed` draws the batch
    (default `seed`), so data-parallel ranks can each have their own; `phases` as train_step's.
    """
    device = torch.device(device)
    model = spec.build(device, seed)
    if fuse:
        spec.fuse(model, ops)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    net = wrap(model) if wrap is not None else model
    if compile:
        from profuse.compile import compile_model

        net = compile_model(net)
    batch = spec.batch(device, seed if batch_seed is None else batch_seed)
    return train_step(spec, net, optimizer, batch, device, phases)
