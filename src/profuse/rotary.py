"""Rotary position embedding on queries and keys, and Qwen3's per-head q/k RMSNorm before it.

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

over the last dimension (head_dim D, halves x1 and x2), with cos and sin of shape (B, T, D) as a
Hugging Face model's rotary module returns them (the same for every head). Partial rotary (Phi-3
and Phi-4-mini, GLM-4): cos and sin of (B, T, R), R < D even, rotate each head's first R lanes
(their halves) and pass the other D - R through, as those models' apply_rotary_pos_emb does. Queries are
(B, Hq, T, D) and keys (B, Hk, T, D), Hk <= Hq under grouped-query attention: the layout
Hugging Face's attention passes (views of (B, T, H, D) projections, transposed; any strides with
a contiguous last dimension).

Interleaved rope (`interleaved=`): the lane pairs (x0, x1), (x2, x3), ... of each head rotated in
place of its halves, as GLM, GLM-4, Ernie 4.5, Cohere and Cohere 2 do:

    rope(x) = x * cos + rotate_pairs(x) * sin,   rotate_pairs(x) = [-x1, x0, -x3, x2, ...]

with the pairs' angles read one of two ways: "lanes", cos and sin as given, one value a lane
(Cohere's rotary module repeats each angle lane by lane); "first_half", cos's first half repeated
lane by lane (cos[..., :R/2].repeat_interleave(2): GLM's, GLM-4's and Ernie 4.5's reading of
Llama's [f, f] table). The rotary dim R is cos's width, partial rotary as for the halves (GLM-4).
With keep_dtype the pairs are rotated in fp32 and cast back: Ernie 4.5's q.float() * cos + ...
(keep_dtype=True, each product upcast, as OLMo 2's promotion does for the halves) or Cohere's
q.float() first (keep_dtype="float"); the fused op rounds once either way.

`qk_norm_rope` first normalises each head (Qwen3's q_norm and k_norm: an RMSNorm over D with a
(D,) weight each), taking q and k before the transpose, (B, T, H, D), as Qwen3 normalises them,
and returns them rotated in the (B, H, T, D) layout, as Hugging Face's attention goes on with.
`weight_offset=1.0`: Gemma 3's q/k norms, which scale by (1 + w) in fp32 and cast once
(Gemma3RMSNorm's order: the output is q's dtype whatever the weight's).

Dtypes: Hugging Face computes in the dtypes it is given, so where cos is fp32 and q bf16 (bf16
autocast over fp32 parameters) its rotated q comes out fp32, and attention casts it back to bf16.
The fused ops return q's and k's own dtype under autocast (what attention reads: the same values,
one pass fewer) and the promoted dtype otherwise. All arithmetic is fp32 inside the kernels.

Each op here: the eager math (the baseline, Hugging Face's op for op), the float64 reference
(the oracle), the argument check (one-line ValueError naming the argument), and the public entry
point, which runs the Triton kernels (profuse.kernels.rope).
"""

from __future__ import annotations

import torch

from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.tail import DEFAULT_EPS, SUPPORTED_DTYPES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] for the halves x1, x2 of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


INTERLEAVED = ("lanes", "first_half")  # the lane pairs' forms (`interleaved=`), None: the halves


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[-x1, x0, -x3, x2, ...]: each lane pair of the last dimension turned a quarter."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keep_dtype: bool | str = False,
    interleaved: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's apply_rotary_pos_emb op for op: q, k (B, H, T, D); cos, sin (B, T, D).
    Partial rotary (cos and sin (B, T, R), R < D; Phi-3/4's form): the first R lanes of each
    head are rotated, the rest passed through, as Phi3's apply_rotary_pos_emb does.
    `keep_dtype`: the results cast back to q's and k's dtypes, True: each product promoted (OLMo
    2's form, whose cos is fp32), "float": q and k cast to fp32 first (Cohere's); the two round
    the gradients in other places. `interleaved`: the lane pairs rotated, "lanes" or "first_half"
    (_rope_pairs_eager)."""
    if interleaved is not None:
        return _rope_pairs_eager(q, k, cos, sin, keep_dtype, interleaved)
    if keep_dtype == "float":
        qo, ko = rope_eager(q.float(), k.float(), cos, sin)
        return qo.to(q.dtype), ko.to(k.dtype)
    if keep_dtype:
        qo, ko = rope_eager(q, k, cos, sin)
        return qo.to(q.dtype), ko.to(k.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        (q_rot, q_pass), (k_rot, k_pass) = (
            q.split((rot, q.shape[-1] - rot), -1),
            k.split((rot, k.shape[-1] - rot), -1),
        )
        return (torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), -1),
                torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), -1))  # fmt: skip
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope_pairs_eager(
    q, k, cos, sin, keep_dtype: bool | str, interleaved: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lane pairs' apply_rotary_pos_emb of each family op for op: "first_half" as GLM's and
    GLM-4's (partial rotary: the first R lanes, the rest concatenated after) and, with
    keep_dtype=True, Ernie 4.5's (x.float() * cos + rotate_pairs(x).float() * sin, cast back:
    the pair turned in x's dtype, each product in fp32); "lanes" with keep_dtype="float" as
    Cohere's (x.float() first, everything in fp32, cast back)."""
    dtypes = (q.dtype, k.dtype)
    if keep_dtype == "float":
        q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved == "first_half":
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rot = cos.shape[-1]
    out = []
    for x in (q, k):
        x_rot = x[..., :rot] if rot < x.shape[-1] else x
        if keep_dtype is True:
            y = (x_rot.float() * cos) + (rotate_pairs(x_rot).float() * sin)
        else:
            y = (x_rot * cos) + (rotate_pairs(x_rot) * sin)
        out.append(torch.cat((y, x[..., rot:]), dim=-1) if rot < x.shape[-1] else y)
    if keep_dtype:
        return out[0].to(dtypes[0]), out[1].to(dtypes[1])
    return out[0], out[1]


def rope_reference(q, k, cos, sin, interleaved: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the same math in float64."""
    return rope_eager(q.double(), k.double(), cos.double(), sin.double(), interleaved=interleaved)


def head_rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (Qwen3's q_norm, k_norm) op for op: fp32 inside, the normalised
    value cast back to x's dtype, then times the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def head_offset_rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float):
    """Gemma's RMSNorm (Gemma 3's q_norm, k_norm) op for op: fp32 throughout, times
    (offset + w_f32), one cast back to x's dtype."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (weight_offset + weight.float())).to(x.dtype)


def qk_norm_rope_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention op for op: q (B, T, Hq, D) and k (B, T, Hk, D) normalised per head,
    transposed to (B, H, T, D), then rotated; with weight_offset, Gemma 3's (1 + w) norms in
    their own order."""
    if weight_offset:
        qn = head_offset_rms_norm_hf(q, q_weight, eps, weight_offset).transpose(1, 2)
        kn = head_offset_rms_norm_hf(k, k_weight, eps, weight_offset).transpose(1, 2)
    else:
        qn = head_rms_norm_hf(q, q_weight, eps).transpose(1, 2)
        kn = head_rms_norm_hf(k, k_weight, eps).transpose(1, 2)
    return rope_eager(qn, kn, cos, sin)


def qk_norm_rope_reference(
    q, k, q_weight, k_weight, cos, sin, eps: float = DEFAULT_EPS, weight_offset: float = 0.0
):
    """The oracle: the same math in float64 (the norm written out, no casts in between)."""

    def norm(x, w):
        x = x.double()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (x * rstd * (weight_offset + w.double())).transpose(1, 2)

    return rope_reference(norm(q, q_weight), norm(k, k_weight), cos, sin)


def _check_common(q, k, cos, sin, heads_dim: int) -> None:
    named = {"q": q, "k": k, "cos": cos, "sin": sin}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    d = q.shape[-1]
    if d == 0 or d % 2:
        raise ValueError(f"head_dim must be even and non-zero, got {d}")
    seq_dim = 2 if heads_dim == 1 else 1
    if k.shape[0] != q.shape[0] or k.shape[seq_dim] != q.shape[seq_dim] or k.shape[-1] != d:
        raise ValueError(f"k has shape {tuple(k.shape)}, which does not match q's {tuple(q.shape)}")
    if q.shape[heads_dim] % max(k.shape[heads_dim], 1):
        raise ValueError(f"q's {q.shape[heads_dim]} heads are not a multiple of k's {k.shape[heads_dim]}")
    rot = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() == 3 else d
    if rot > d or rot == 0 or rot % 2:
        rot = d  # reported as a shape mismatch below
    want = (q.shape[seq_dim], rot)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] not in (1, q.shape[0]):
            expected = f"({q.shape[0]} or 1, {want[0]}, {d}, or an even rotary dim below {d})"
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dimension (head_dim)")


def check_rope_args(q, k, cos, sin) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off."""
    _check_common(q, k, cos, sin, heads_dim=1)


def check_rope_options(keep_dtype, interleaved) -> None:
    """Raise ValueError unless `keep_dtype` is False, True or "float" and `interleaved` None or
    one of the lane pairs' forms."""
    if keep_dtype not in (False, True, "float"):
        raise ValueError(f"keep_dtype is {keep_dtype!r}; expected False, True or 'float'")
    if interleaved is not None and interleaved not in INTERLEAVED:
        forms = " or ".join(map(repr, INTERLEAVED))
        raise ValueError(f"interleaved is {interleaved!r}; expected None, {forms}")


def check_qk_norm_rope_args(q, k, q_weight, k_weight, cos, sin) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off."""
    _check_common(q, k, cos, sin, heads_dim=2)
    d = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if tuple(w.shape) != (d,):
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected ({d},)")
        if w.dtype not in SUPPORTED_DTYPES or w.device != q.device:
            raise ValueError(f"{name} must be a bf16, fp16 or fp32 tensor on {q.device}")


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keep_dtype: bool | str = False,
    interleaved: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_eager's (q, k) in one Triton launch forward and one backward, fp32 inside;
    `keep_dtype` (True or "float"): stored in q's and k's own dtypes, as rope_eager's cast back;
    `interleaved`: the lane pairs rotated ("lanes" or "first_half", as rope_eager)."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    check_rope_args(q, k, cos, sin)
    check_rope_options(keep_dtype, interleaved)
    from profuse.kernels import rope as kernel

    return kernel.rope_fused(q, k, cos, sin, bool(keep_dtype), interleaved)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope_eager's (q, k) in one Triton launch forward and one backward, fp32 inside;
    the weights' gradients bitwise repeatable. `weight_offset=1.0`: the norms scale by (1 + w)
    (Gemma 3), and the outputs keep q's and k's dtypes as Gemma3RMSNorm's cast does."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    check_qk_norm_rope_args(q, k, q_weight, k_weight, cos, sin)
    from profuse.kernels import rope as kernel

    return kernel.qk_norm_rope_fused(q, k, q_weight, k_weight, cos, sin, float(eps), float(weight_offset))
