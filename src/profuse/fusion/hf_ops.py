"""The ops a fused Hugging Face model calls, as it calls them.

Three sets of implementations (profuse.fusion.BlockOps): FUSED, profuse's Triton kernels; EAGER,
the ops' own eager versions; HF_EAGER, Hugging Face's own eager math op for op, so that a model
fused with it computes bitwise what it computed unfused (what a labelled trace should time).

`bound_op` turns one op of a set into what a fused module calls: the kernels take bf16, fp16
and fp32, so a call with any other dtype (a model moved to float64) runs HF_EAGER's op instead,
the model's own math in the same structure; with `label=True` each call runs inside the op's
profiler range (BLOCK_OP_RANGES). A Triton op handed CPU tensors without TRITON_INTERPRET=1
(a model fused on the CPU) runs HF_EAGER's op too: the fused structure in plain torch, where the
kernels would raise (FuseSummary says so). `unavailable` says why an implementation cannot run here (no
triton, or a kernel module missing from this build).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from collections.abc import Callable

import torch

from profuse import blockops, crossentropy, rotary
from profuse.errors import UnsupportedModel
from profuse.fusion.gpt import (
    ADD_RMS_NORM,
    BLOCK_OP_RANGES,
    CLAMPED_SWIGLU,
    LINEAR_CROSS_ENTROPY,
    QK_NORM_ROPE,
    RMS_NORM,
    RMS_NORM_ADD,
    ROPE,
    SILU_MUL,
    BlockOps,
    labelled,
)
from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.tail import SUPPORTED_DTYPES


def add_rms_norm_hf(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual, then Hugging Face's Llama RMSNorm on h op for op (fp32 inside,
    the normalised value cast back to h's dtype, then times the weight), in its dtypes. With a
    weight_offset, Gemma's RMSNorm op for op: fp32 throughout, times (offset + w_f32), one cast."""
    h = x + residual
    if weight_offset:
        return blockops.rms_norm_eager(h, weight, eps, weight_offset), h
    h32 = h.to(torch.float32)
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h


def rms_norm_hf(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """Hugging Face's RMSNorm op for op: Llama's (rotary.head_rms_norm_hf), or with a
    weight_offset Gemma's, (x_f32 * rstd * (offset + w_f32)).to(x.dtype)."""
    if weight_offset:
        return blockops.rms_norm_eager(x, weight, eps, weight_offset)
    return rotary.head_rms_norm_hf(x, weight, eps)


# The fused structure with the model's own eager math: a model fused with these computes exactly
# what it did unfused (bitwise, in every dtype), so with label=True its trace times precisely the
# ops that FUSED replaces (EAGER's add_rms_norm uses F.rms_norm, which rounds once in bf16).
# rope_eager, qk_norm_rope_eager and rms_norm_hf are Hugging Face's apply_rotary_pos_emb and
# RMSNorm (Llama's, or Gemma's with an offset) op for op; gelu_mul_eager (the GeGLU place's op,
# bound_gated) is GemmaMLP's act_fn(gate) * up; linear_cross_entropy_eager is its lm_head matmul
# and ForCausalLMLoss.
HF_EAGER = BlockOps(
    blockops.silu_mul_eager,
    add_rms_norm_hf,
    "Hugging Face's eager math",
    rms_norm=rms_norm_hf,
    rope=rotary.rope_eager,
    qk_norm_rope=rotary.qk_norm_rope_eager,
    linear_cross_entropy=crossentropy.linear_cross_entropy_eager,
    clamped_swiglu=blockops.clamped_swiglu_eager,  # GptOssExperts._apply_gate op for op
    rms_norm_add=blockops.rms_norm_add_eager,  # Olmo2RMSNorm, then the add, op for op
    layer_norm=blockops.layer_norm_eager,  # nn.LayerNorm's own F.layer_norm
)

# How many leading arguments of each op are tensors whose dtype the kernels must take.
_TENSOR_ARGS = {
    SILU_MUL: 2,
    ADD_RMS_NORM: 3,
    RMS_NORM: 2,
    ROPE: 4,
    QK_NORM_ROPE: 6,
    LINEAR_CROSS_ENTROPY: 2,
    CLAMPED_SWIGLU: 1,
    RMS_NORM_ADD: 3,
}

# profuse's Triton ops and the kernel module each needs: an op whose module is not in this build
# (a kernel not merged yet, or triton missing) is left unfused with that reason.
_KERNEL_MODULES = {
    blockops.silu_mul: "profuse.kernels.swiglu",
    blockops.add_rms_norm: "profuse.kernels.add_rms_norm",
    blockops.rms_norm: "profuse.kernels.rms_norm",
    rotary.rope: "profuse.kernels.rope",
    rotary.qk_norm_rope: "profuse.kernels.rope",
    crossentropy.linear_cross_entropy: "profuse.kernels.cross_entropy",
    blockops.clamped_swiglu: "profuse.kernels.gated",
    blockops.gelu_mul: "profuse.kernels.gated",
    blockops.rms_norm_add: "profuse.kernels.rms_norm",
}

# The GELU form of each op set's silu_mul: a GeGLU MLP's place calls it (bound_gated). The op set
# names no gelu_mul of its own: the place is silu_mul's, its activation read from the MLP.
_GELU_FORMS = {blockops.silu_mul: blockops.gelu_mul, blockops.silu_mul_eager: blockops.gelu_mul_eager}
_GELU_APPROXIMATE = {"gelu_tanh": "tanh", "gelu": "none"}


def takes_offset(ops: BlockOps, op: str) -> bool:
    """Whether `ops`' norm op takes weight_offset (Gemma's (1 + w)), and so can stand in for an
    offset norm."""
    return takes_keyword(ops, op, "weight_offset")


def takes_keyword(ops: BlockOps, op: str, name: str) -> bool:
    """Whether `ops`' `op` takes the keyword `name` (weight_offset, softcap): the probes run
    float64, where HF_EAGER's op stands in, so they cannot see it."""
    try:
        params = inspect.signature(getattr(ops, op)).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def unavailable(ops: BlockOps, op: str) -> str | None:
    """Why `ops` cannot run `op` here, or None when it can."""
    fn = getattr(ops, op)
    if fn is None:
        return f"{ops.name!r} has no {op}"
    return _missing(fn)


def _missing(fn: Callable) -> str | None:
    module = _KERNEL_MODULES.get(fn)
    if module is None:
        return None
    if not HAS_TRITON:
        return TRITON_MISSING
    if importlib.util.find_spec(module) is None:
        return f"{module} is not in this build of profuse"
    return None


def interpreted() -> bool:
    """Whether Triton kernels run on CPU tensors here (TRITON_INTERPRET=1, read when fusing)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_kernels(ops: BlockOps, op: str) -> bool:
    """Whether `ops`' `op` is one of profuse's Triton kernels."""
    return getattr(ops, op) in _KERNEL_MODULES


# The ops whose backward can write its input gradients over buffers the caller owns
# (blockops' inplace_backward): what a fused place passes as owned=True.
_OWNED_OPS = {SILU_MUL, ADD_RMS_NORM, RMS_NORM}


def bound_op(ops: BlockOps, op: str, label: bool) -> Callable:
    """`ops`' `op` as a fused module calls it: HF_EAGER's for dtypes the kernels do not take, and
    for CPU tensors where the Triton kernels cannot run them (no TRITON_INTERPRET=1 when fused);
    inside the op's profiler range when `label`. A call may say `owned=True`: the place owns the
    buffers the op's backward could write its input gradients over (a projection's output, the
    gradients autograd hands it), and profuse's kernels then do (inplace_backward); every other
    implementation ignores it."""
    impl, fallback = getattr(ops, op), getattr(HF_EAGER, op)
    kernels = runs_kernels(ops, op)
    return _bound(impl, fallback, _TENSOR_ARGS[op], kernels, op in _OWNED_OPS and kernels, op, label)


def bound_gated(ops: BlockOps, activation: str, label: bool) -> Callable:
    """The gated MLP op for `activation` (a name in hf_layer.MLP_ACTIVATIONS) as a fused MLP place
    calls it: `ops`' silu_mul for SiLU, its GELU form (blockops.gelu_mul, tanh or exact) for a
    GELU, bound as bound_op binds them and labelled as silu_mul's place. Raises UnsupportedModel
    with the reason where `ops` has no GELU form or its kernel is not here."""
    if activation == "silu":
        return bound_op(ops, SILU_MUL, label)
    gelu = _GELU_FORMS.get(ops.silu_mul)
    if gelu is None:
        raise UnsupportedModel(f"{ops.name!r} has no GELU form of silu_mul (gelu_mul) for a GeGLU MLP")
    why = _missing(gelu)
    if why is not None:
        raise UnsupportedModel(f"gelu_mul for a GeGLU MLP: {why}")
    approximate = _GELU_APPROXIMATE[activation]
    impl = functools.partial(gelu, approximate=approximate)
    fallback = functools.partial(blockops.gelu_mul_eager, approximate=approximate)
    kernels = gelu in _KERNEL_MODULES
    return _bound(impl, fallback if kernels else impl, 2, kernels, False, SILU_MUL, label)


def _bound(impl, fallback, n: int, kernels: bool, inplace: bool, op: str, label: bool) -> Callable:
    cpu_ok = not kernels or interpreted()
    if impl is fallback:

        def call(*args, owned: bool = False, **kwargs):
            return impl(*args, **kwargs)

    else:

        def call(*args, owned: bool = False, **kwargs):
            if all(t.dtype in SUPPORTED_DTYPES for t in args[:n]) and (cpu_ok or not args[0].is_cpu):
                if owned and inplace:
                    return impl(*args, inplace_backward=True, **kwargs)
                return impl(*args, **kwargs)
            return fallback(*args, **kwargs)  # float64, or the CPU: the model's own math

    return labelled(call, BLOCK_OP_RANGES[op]) if label else call


__all__ = [
    "HF_EAGER",
    "add_rms_norm_hf",
    "bound_gated",
    "bound_op",
    "interpreted",
    "rms_norm_hf",
    "runs_kernels",
    "takes_keyword",
    "takes_offset",
    "unavailable",
]
