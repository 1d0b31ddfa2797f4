"""Fusion applied to the GPT from outside: its block ops swapped for fused ones, or labelled.

The model (profuse.model) does its two memory-bound block ops in plain torch, each through a
function a module holds: `SwiGLU.silu_mul` (the activation on the packed gate/up matmul output)
and `AddRMSNorm.add_rms_norm` (the residual add and the norm after it). `use_block_ops` swaps
those functions, by default for profuse.blockops' Triton ones:

    silu_mul(gate_up)                   (..., 2F) -> silu(gate) * up, (..., F)
    add_rms_norm(x, residual, w, eps)   -> (y, h): h = residual + x, y = rms_norm(h) * w

The parameters stay where they are (the optimizer keeps them), and the model's first norm, which
has no add to fuse, stays plain. Under bf16 autocast the model hands the fused add_rms_norm the
mix autocast makes: x (a branch output) bf16, residual (the stream) and w fp32; it returns h fp32
and y bf16, the dtype the next matmul reads (eager makes an fp32 y that autocast then casts).
The fused ops are registered with torch.library, so a fused model under torch.compile has no graph
break at them (on CUDA as Triton ops, whose kernels Inductor launches itself).

`label_block_ops` wraps whatever ops a model holds in profiler ranges (`BLOCK_OP_RANGES`), so a
trace of the unfused step shows which operators (and, through their autograd sequence numbers,
which backward kernels) fusion would replace: profuse.profiling.analyze_trace(regions=...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.profiler import record_function

from profuse import blockops, crossentropy, rotary
from profuse.model import AddRMSNorm, SwiGLU

SILU_MUL, ADD_RMS_NORM = "silu_mul", "add_rms_norm"
# The ops of the rest of the step, which Hugging Face models fuse (profuse.fusion.hf)
RMS_NORM, ROPE, QK_NORM_ROPE = "rms_norm", "rope", "qk_norm_rope"
LINEAR_CROSS_ENTROPY = "linear_cross_entropy"
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's experts' gate (profuse.fusion.hf_experts)
RMS_NORM_ADD = "rms_norm_add"  # post-norm layers' norm, then the add (OLMo 2: profuse.fusion.hf_layer)
LAYER_NORM = "layer_norm"  # LayerNorm with a bias, each alone (StarCoder2: profuse.fusion.hf_layernorm)
OP_NAMES = (
    SILU_MUL,
    ADD_RMS_NORM,
    RMS_NORM,
    ROPE,
    QK_NORM_ROPE,
    LINEAR_CROSS_ENTROPY,
    CLAMPED_SWIGLU,
    RMS_NORM_ADD,
    LAYER_NORM,
)

# Profiler ranges around each op, by op: what Part C looks for in the eager trace.
BLOCK_OP_RANGES = {op: f"profuse.block_op: {op}" for op in OP_NAMES}


@dataclass(frozen=True)
class BlockOps:
    """Implementations of the block ops, and a name for them in reports. The first two are the
    GPT's (and every Hugging Face layer's); an op left None is one this set does not implement,
    which profuse.fuse then leaves unfused."""

    silu_mul: Callable  # (gate, up) or (gate_up) -> silu(gate) * up
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (y, h)
    name: str = "custom"
    rms_norm: Callable | None = None  # (x, weight, eps) -> y
    rope: Callable | None = None  # (q, k, cos, sin) -> (q, k), (B, H, T, D)
    qk_norm_rope: Callable | None = None  # (q, k, q_weight, k_weight, cos, sin, eps), q, k (B, T, H, D)
    linear_cross_entropy: Callable | None = None  # (hidden, weight, labels, **HF loss kwargs) -> loss
    # (gate_up, alpha=, limit=, interleaved=) -> (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha g)
    clamped_swiglu: Callable | None = None
    rms_norm_add: Callable | None = None  # (x, residual, weight, eps) -> residual + rms_norm(x) * weight
    layer_norm: Callable | None = None  # (x, weight, bias or None, eps) -> nn.LayerNorm's y


# profuse's Triton kernels (profuse.kernels: swiglu, add_rms_norm, rms_norm, rope, cross_entropy).
FUSED = BlockOps(
    blockops.silu_mul,
    blockops.add_rms_norm,
    "profuse Triton kernels",
    rms_norm=blockops.rms_norm,
    rope=rotary.rope,
    qk_norm_rope=rotary.qk_norm_rope,
    linear_cross_entropy=crossentropy.linear_cross_entropy,
    clamped_swiglu=blockops.clamped_swiglu,
    rms_norm_add=blockops.rms_norm_add,
    layer_norm=blockops.layer_norm,
)
# The same math one op at a time, through the ops' own eager versions: a stand-in for the fused
# ops that runs anywhere (it tests the plumbing; it fuses nothing).
EAGER = BlockOps(
    blockops.silu_mul_eager,
    blockops.add_rms_norm_eager,
    "blockops eager",
    rms_norm=blockops.rms_norm_eager,
    rope=rotary.rope_eager,
    qk_norm_rope=rotary.qk_norm_rope_eager,
    linear_cross_entropy=crossentropy.linear_cross_entropy_eager,
    clamped_swiglu=blockops.clamped_swiglu_eager,
    rms_norm_add=blockops.rms_norm_add_eager,
    layer_norm=blockops.layer_norm_eager,
)


def _block_modules(model: nn.Module) -> tuple[list[SwiGLU], list[AddRMSNorm]]:
    mlps = [m for m in model.modules() if isinstance(m, SwiGLU)]
    norms = [m for m in model.modules() if isinstance(m, AddRMSNorm)]
    if not mlps or not norms:
        raise ValueError(f"{type(model).__name__} holds no SwiGLU and AddRMSNorm: not a profuse GPT")
    return mlps, norms


def use_block_ops(
    model: nn.Module,
    silu_mul: Callable = blockops.silu_mul,
    add_rms_norm: Callable = blockops.add_rms_norm,
) -> nn.Module:
    """Swap the block ops of every block of `model` (in place) and return it.

    Defaults: profuse.blockops' fused Triton ops. Any callables with their signatures will do
    (blockops.silu_mul_eager and add_rms_norm_eager test the plumbing on any machine). A model
    wrapped in torch.compile or DistributedDataParallel is walked through to its GPT: swap before
    compiling, so the compiled graph holds the new ops.
    """
    mlps, norms = _block_modules(model)
    for m in mlps:
        m.silu_mul = silu_mul
    for m in norms:
        m.add_rms_norm = add_rms_norm
    return model


def apply_block_ops(model: nn.Module, ops: BlockOps) -> nn.Module:
    """use_block_ops with a BlockOps' silu_mul and add_rms_norm (the GPT's two block ops)."""
    return use_block_ops(model, ops.silu_mul, ops.add_rms_norm)


def labelled(fn: Callable, name: str) -> Callable:
    """`fn` with each call inside the profiler range `name`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return call


def label_block_ops(model: nn.Module, ranges: dict[str, str] = BLOCK_OP_RANGES) -> nn.Module:
    """Wrap the block ops `model` holds (whichever they are) in profiler ranges, in place.

    Only the calls that fusion replaces are labelled: the first norm (no add) is not one of them.
    A range costs a few microseconds of host time per call; the kernels are untouched.
    """
    mlps, norms = _block_modules(model)
    for m in mlps:
        m.silu_mul = labelled(m.silu_mul, ranges[SILU_MUL])
    for m in norms:
        m.add_rms_norm = labelled(m.add_rms_norm, ranges[ADD_RMS_NORM])
    return model
