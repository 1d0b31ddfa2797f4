"""The transformer block's own memory-bound ops, fused: SiLU-and-multiply, and add-then-RMSNorm.

The lab's tail rms_norm(silu(gate) * up + residual) * w never occurs literally in a block: the
down projection sits between silu(gate) * up and the residual add. Its two real pieces do, in
every block:

    silu_mul(gate, up)                  a = silu(gate) * up            (the SwiGLU activation)
    add_rms_norm(x, residual, w, eps)   h = x + residual,  y = h * rstd * w,
                                        rstd = 1 / sqrt(mean(h^2) + eps)   -> (y, h)

add_rms_norm is the residual add followed by the next norm (twice per block): h is the new
residual stream, y what the next matmul reads. `rms_norm(x, w, eps)` is the norm alone, for the
one norm of a model with no add in front (where the embeddings enter the stream).

Dtypes, as a bf16-autocast model has them: the residual stream is fp32 and a branch's output
bf16. So x and residual may differ: h comes out in the dtype `x + residual` would have (bf16 +
fp32 -> fp32), and y in x's dtype, the dtype the next matmul reads under autocast (eager makes
an fp32 y and autocast casts it to bf16 in the matmul: the same values, one pass more). All
arithmetic is fp32 inside the kernels.

silu_mul reads gate and up in place when they are the two halves of one matmul output (strided
rows). Given the packed (..., 2F) tensor alone, `silu_mul(gate_up)` uses its halves and returns
the gradient as one (..., 2F) tensor, so the backward writes the matmul output's gradient
directly instead of concatenating two halves.

Each op here: the eager math (the baseline), the float64 reference (the oracle), the argument
check (one-line ValueError naming the argument), and the public entry point, which runs the
Triton kernels (profuse.kernels.swiglu, profuse.kernels.add_rms_norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.tail import DEFAULT_EPS, SUPPORTED_DTYPES

# --------------------------------------------------------------------------------------------
# silu_mul
# --------------------------------------------------------------------------------------------


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a packed (..., 2F) tensor, as views (no copy)."""
    return gate_up.chunk(2, dim=-1)


def silu_mul_eager(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up one op at a time, in the input dtype (two kernels forward)."""
    if up is None:
        gate, up = _halves(gate)
    return F.silu(gate) * up


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: the same math in float64."""
    if up is None:
        gate, up = _halves(gate)
    return silu_mul_eager(gate.double(), up.double())


def check_silu_mul_args(gate, up) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off.

    Every call of silu_mul pays this, so inputs that are right pass one chain of comparisons;
    only wrong ones are looked at one by one, for the message."""
    try:
        shape = gate.shape
        if up is None:
            ok = shape[-1] > 0 and not shape[-1] % 2 and gate.dtype in SUPPORTED_DTYPES
        else:
            ok = (
                shape[-1] > 0 and gate.dtype in SUPPORTED_DTYPES and up.shape == shape
                and up.dtype == gate.dtype and up.device == gate.device and isinstance(up, torch.Tensor)
            )  # fmt: skip
        ok = ok and isinstance(gate, torch.Tensor)
    except (AttributeError, IndexError, TypeError):
        ok = False
    if not ok:
        _explain_silu_mul_args(gate, up)


def _explain_silu_mul_args(gate, up) -> None:
    named = {"gate": gate} if up is None else {"gate": gate, "up": up}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if gate.dim() < 1 or gate.shape[-1] == 0:
        raise ValueError(f"gate must have a non-empty last dimension, got shape {tuple(gate.shape)}")
    if gate.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate has dtype {gate.dtype}; supported: bfloat16, float16, float32")
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"a packed gate_up needs an even last dimension (gate and up halves), got {gate.shape[-1]}"
            )
    elif up.shape != gate.shape:
        raise ValueError(f"up has shape {tuple(up.shape)}, gate has {tuple(gate.shape)}")
    elif up.dtype != gate.dtype:
        raise ValueError(f"up has dtype {up.dtype}, gate has {gate.dtype}")
    elif up.device != gate.device:
        raise ValueError(f"up is on {up.device}, gate is on {gate.device}")
    raise ValueError("gate and up do not fit together")  # a safety net


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor | None = None, *, inplace_backward: bool = False
) -> torch.Tensor:
    """silu(gate) * up in one Triton kernel forward and one backward, fp32 inside.

    `silu_mul(gate, up)`: two (..., F) tensors (strided rows are read in place), their own
    gradients. `silu_mul(gate_up)`: the packed (..., 2F) matmul output; its gradient is one
    (..., 2F) tensor. Differentiable; compiled ops under torch.compile (no graph break).

    `inplace_backward=True` is the caller's promise that gate and up (gate_up) are intermediates
    nothing else reads after this op (a fused model's projections): the backward then writes
    their gradients over them, a leaf or a shared or strided buffer excepted, and refuses a second
    backward through the graph. The default never writes to its inputs.
    """
    check_silu_mul_args(gate, up)
    swiglu = _SWIGLU or _load_kernels()[0]
    if up is None:
        return swiglu.silu_mul_packed(gate, inplace_backward)
    return swiglu.silu_mul_pair(gate, up, inplace_backward)


# The kernel modules, imported on the first call: importing them builds their Triton wrappers
# (and must follow TRITON_INTERPRET's setting), so `import profuse` stays light. Kept here, a
# call pays no import statement.
_SWIGLU = _ADD_RMS_NORM = None


def _load_kernels():
    global _SWIGLU, _ADD_RMS_NORM
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    from profuse.kernels import add_rms_norm, swiglu

    _SWIGLU, _ADD_RMS_NORM = swiglu, add_rms_norm
    return _SWIGLU, _ADD_RMS_NORM


# --------------------------------------------------------------------------------------------
# add_rms_norm
# --------------------------------------------------------------------------------------------


def add_rms_norm_eager(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual, then F.rms_norm(h) * weight, in torch ops; y in x's dtype. -> (y, h)
    With a weight_offset (Gemma's 1.0), Gemma's order: fp32 throughout, one cast at the end."""
    h = x + residual
    if weight_offset:
        return rms_norm_eager(h, weight, eps, weight_offset).to(x.dtype), h
    y = F.rms_norm(h, (h.shape[-1],), weight, eps)
    return y.to(x.dtype), h


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: h and y in float64, written out (no fused norm kernel)."""
    h = x.double() + residual.double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)
    return y, h


def check_add_rms_norm_args(x, residual, weight) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off.

    One chain of comparisons where the inputs are right (as check_silu_mul_args)."""
    try:
        shape, device = x.shape, x.device
        ok = (
            shape[-1] > 0 and residual.shape == shape and weight.shape == shape[-1:]
            and x.dtype in SUPPORTED_DTYPES and residual.dtype in SUPPORTED_DTYPES
            and weight.dtype in SUPPORTED_DTYPES and residual.device == device and weight.device == device
            and isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor)
            and isinstance(weight, torch.Tensor)
        )  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        ok = False
    if not ok:
        _explain_add_rms_norm_args(x, residual, weight)


def _explain_add_rms_norm_args(x, residual, weight) -> None:
    named = {"x": x, "residual": residual, "weight": weight}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    for name in ("residual", "weight"):
        if named[name].device != x.device:
            raise ValueError(f"{name} is on {named[name].device}, x is on {x.device}")
    raise ValueError("x, residual and weight do not fit together")  # a safety net


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    *,
    weight_offset: float = 0.0,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual, y = rms_norm(h) * weight, in one Triton kernel forward and one
    backward, fp32 inside. Gradients flow through both outputs; dweight is bitwise repeatable.
    x and residual may differ in dtype (see the module's docstring). Custom ops under
    torch.compile (no graph break).

    `inplace_backward=True` is the caller's promise that the gradients reaching y and h are
    autograd's own intermediates (not a `gradient=` tensor the caller holds): the backward then
    writes dx over dy's buffer (and dresidual of its own dtype over dh's) where they fit, as
    Liger-Kernel's RMSNorm does. A second backward stays correct: it gets new gradients.

    `weight_offset=1.0`: the norm scales by (1 + weight), Gemma's RMSNorm, in its order (fp32,
    then one cast); the weight's gradient is unchanged by the offset."""
    check_add_rms_norm_args(x, residual, weight)
    kernel = _ADD_RMS_NORM or _load_kernels()[1]
    return kernel.add_rms_norm_fused(x, residual, weight, float(eps), inplace_backward, float(weight_offset))


# --------------------------------------------------------------------------------------------
# rms_norm
# --------------------------------------------------------------------------------------------


def rms_norm_eager(
    x: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_EPS, weight_offset: float = 0.0
) -> torch.Tensor:
    """y = rms_norm(x) * weight as Hugging Face's Llama RMSNorm computes it: fp32 inside, the
    normalised value cast back to x's dtype, then times the weight; y in x's dtype. With a
    weight_offset, Gemma's RMSNorm: y = (x_f32 * rstd * (offset + w_f32)).to(x.dtype)."""
    x32 = x.to(torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        return (y * (weight_offset + weight.float())).to(x.dtype)
    return (weight * y.to(x.dtype)).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_EPS, weight_offset: float = 0.0
) -> torch.Tensor:
    """The oracle: float64, written out."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)


def check_rms_norm_args(x, weight) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x is on {x.device}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    *,
    weight_offset: float = 0.0,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """y = rms_norm(x) * weight in one Triton kernel forward and one backward, fp32 inside; y in
    x's dtype; dweight bitwise repeatable. Custom ops under torch.compile (no graph break).
    `weight_offset=1.0`: y = x * rstd * (1 + weight) in fp32, one cast (Gemma's RMSNorm).
    `inplace_backward=True`: dx is written over dy's buffer, as add_rms_norm's."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    check_rms_norm_args(x, weight)
    from profuse.kernels import rms_norm as kernel

    return kernel.rms_norm_fused(x, weight, float(eps), inplace_backward, float(weight_offset))


# --------------------------------------------------------------------------------------------
# gelu_mul (GeGLU) and clamped_swiglu (gpt-oss's experts)
# --------------------------------------------------------------------------------------------

GELU_APPROXIMATIONS = ("tanh", "none")
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def _interleaved(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's packed layout: gate in the even columns, up in the odd ones (views)."""
    return gate_up[..., 0::2], gate_up[..., 1::2]


def gelu_mul_eager(
    gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(gate) * up one op at a time, in the input dtype (Gemma's GeGLU with "tanh")."""
    if up is None:
        gate, up = _halves(gate)
    return F.gelu(gate, approximate=approximate) * up


def gelu_mul_reference(
    gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """The oracle: the same math in float64."""
    if up is None:
        gate, up = _halves(gate)
    return gelu_mul_eager(gate.double(), up.double(), approximate)


def gelu_mul(
    gate: torch.Tensor, up: torch.Tensor | None = None, *, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(gate) * up in one Triton kernel forward and one backward, fp32 inside; `approximate`
    "tanh" (gelu_pytorch_tanh, Gemma's) or "none" (the exact erf form). Two (..., F) tensors, or
    the packed (..., 2F) gate_up whose halves they are (its gradient one tensor), as silu_mul."""
    check_silu_mul_args(gate, up)
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    gated = _gated_kernels()
    act = gated.ACT_GELU_TANH if approximate == "tanh" else gated.ACT_GELU_ERF
    if up is None:
        return gated.gated_packed(gate, act)
    return gated.gated_pair(gate, up, act)


def clamped_swiglu_eager(
    gate: torch.Tensor,
    up: torch.Tensor | None = None,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    interleaved: bool = True,
) -> torch.Tensor:
    """gpt-oss's expert activation as transformers' GptOssExperts computes it, one op at a time:
    g = gate.clamp(max=limit), u = up.clamp(-limit, limit), (u + 1) * g * sigmoid(alpha * g).
    A packed gate_up is interleaved (gpt-oss's layout) unless `interleaved` is False (halves)."""
    if up is None:
        gate, up = _interleaved(gate) if interleaved else _halves(gate)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_reference(
    gate: torch.Tensor,
    up: torch.Tensor | None = None,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    interleaved: bool = True,
) -> torch.Tensor:
    """The oracle: the same math in float64."""
    if up is None:
        gate, up = _interleaved(gate) if interleaved else _halves(gate)
    return clamped_swiglu_eager(gate.double(), up.double(), alpha, limit)


def clamped_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor | None = None,
    *,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    interleaved: bool = True,
) -> torch.Tensor:
    """gpt-oss's clamped, biased gated activation in one Triton kernel forward and one backward:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit); fp32 inside.
    Two (..., F) tensors, or the packed (..., 2F) gate_up (interleaved, gpt-oss's layout, unless
    `interleaved=False`: halves), whose gradient is one tensor in the same layout."""
    check_silu_mul_args(gate, up)
    if not (limit > 0 and alpha == alpha):
        raise ValueError(f"limit must be > 0 and alpha a number, got limit={limit}, alpha={alpha}")
    gated = _gated_kernels()
    if up is None:
        return gated.gated_packed(gate, gated.ACT_CLAMPED, float(alpha), float(limit), bool(interleaved))
    return gated.gated_pair(gate, up, gated.ACT_CLAMPED, float(alpha), float(limit))


_GATED = None


def _gated_kernels():
    global _GATED
    if _GATED is None:
        if not HAS_TRITON:
            raise RuntimeError(TRITON_MISSING)
        from profuse.kernels import gated

        _GATED = gated
    return _GATED


# --------------------------------------------------------------------------------------------
# rms_norm_add: the post-norm layouts' norm, then the add (OLMo 2 and 3)
# --------------------------------------------------------------------------------------------


def rms_norm_add_eager(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """residual + norm(x) as OLMo 2's layer computes it: Olmo2RMSNorm (fp32 inside, times the
    weight in fp32, one cast to x's dtype), then the residual add."""
    x32 = x.to(torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return residual + ((weight.float() + weight_offset) * y).to(x.dtype)


def rms_norm_add_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """The oracle: float64, written out."""
    return residual.double() + rms_norm_reference(x, weight, eps, weight_offset)


def rms_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = DEFAULT_EPS,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """h = residual + rms_norm(x) * weight (post-norm: the sublayer's output x normalised, then
    added to the stream), in one Triton kernel forward (fp32 inside, rounded once, h in the dtype
    x + residual has) and rms_norm's one backward kernel (dresidual is dh itself). A mode of the
    rms_norm kernel, not of add_rms_norm: add_rms_norm adds before its norm and keeps the sum,
    this adds after and keeps x, so only the forward's last step differs from rms_norm."""
    check_add_rms_norm_args(x, residual, weight)
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    from profuse.kernels import rms_norm as kernel

    return kernel.rms_norm_add_fused(x, residual, weight, float(eps), float(weight_offset))


# --------------------------------------------------------------------------------------------
# layer_norm (LayerNorm with a bias: StarCoder2's, GPT-NeoX's, Phi-1/2's nn.LayerNorm)
# --------------------------------------------------------------------------------------------


def layer_norm_eager(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """y = (x - mean) * rstd * weight + bias, as nn.LayerNorm computes it (F.layer_norm: fp32
    inside for 16-bit inputs, rounded once to x's dtype)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """The oracle: float64, written out (the variance centred, biased)."""
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y if bias is None else y + bias.double()


def check_layer_norm_args(x, weight, bias) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off."""
    check_rms_norm_args(x, weight)
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"bias has dtype {bias.dtype}; supported: bfloat16, float16, float32")
    if bias.shape != weight.shape or bias.device != x.device:
        raise ValueError(
            f"bias must be ({x.shape[-1]},) on {x.device}, got {tuple(bias.shape)} on {bias.device}"
        )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm with an optional bias in one Triton kernel forward and one backward, fp32 inside;
    y in x's dtype; dweight and dbias bitwise repeatable. Custom ops under torch.compile. Whether
    it beats torch's own LayerNorm on a card is not measured (profuse.kernels.layer_norm)."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    check_layer_norm_args(x, weight, bias)
    from profuse.kernels import layer_norm as kernel

    return kernel.layer_norm_fused(x, weight, bias, float(eps))
