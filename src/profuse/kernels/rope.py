"""Rotary position embedding on q and k, and Qwen3's per-head RMSNorm before it, in Triton: one
launch forward and one backward for q and k together, fp32 inside.

rope, per head x = [x1, x2] (the halves of head_dim D), cos = [c1, c2], sin = [s1, s2]:
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2          (x * cos + rotate_half(x) * sin)
Backward, the transposed rotation (cos and sin get no gradient):
    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1
cos and sin are read whole: their halves are equal for Hugging Face's default rope, but nothing
here assumes it.

Interleaved rope (INTERLEAVED, a compile-time switch: off, the kernels above are compiled as they
were; triton 3.9's TTIR, TTGIR and sm_90 PTX of the halves' forward, backward with partial rotary
and qk_norm forward came out the same instructions with the switch as before it): the same
rotation on the lane pairs (x0, x1), (x2, x3), ... of each head instead of its halves,
x * cos + rotate_pairs(x) * sin with rotate_pairs(x) = [-x1, x0, -x3, x2, ...]; with a1 = x[0::2],
a2 = x[1::2] it is the formula above, lane for lane. Where the pair's angle comes from:
    lanes (1)       c1 = cos[0::2], c2 = cos[1::2]: one value per lane (Cohere's rotary module
                    repeats each angle lane by lane)
    first half (2)  c1 = c2 = cos[:R/2]: pair i takes lane i of cos's first half (GLM, GLM-4 and
                    Ernie 4.5 read Llama's [f, f] table so)
A pair's two lanes are read and written as two stride-2 accesses, which touch the same lines
(not timed on a GPU yet: a (.., D/2, 2) tile split in registers is the alternative to time).

qk_norm_rope, per head: z = x * rstd * (o + w),  rstd = 1 / sqrt(mean(x^2) + eps) over D,  then
rope on z; the weight offset o is 0 (Qwen3) or 1 (Gemma 3's (1 + w) q/k norms). Backward: dz from
dy by the rope backward, then (x_hat = x * rstd, g = dz * (o + w))
    dx = rstd * (g - x_hat * mean(x_hat * g))
    dw = the sum over every row and head of dz * x_hat
The norm is recomputed in the backward from x (saved: the projection's output, alive anyway);
dw is summed in fp32 per program on a persistent grid, then the (programs, 2D) partials of both
weights in one fixed-order column sum (kernels/colsum.py): bitwise repeatable.

One program takes whole tokens (b, t): all Hq + Hk heads of the token, so cos and sin are loaded
once per token and used for every head. Bytes per token, E = (Hq + Hk) * D elements of q and k:
    forward      read q, k (E) + cos, sin (2D); write q_out, k_out (E)
    backward     read dq_out, dk_out (E) + cos, sin (2D); write dq, dk (E)
    qk_norm bwd  read dq_out, dk_out, q, k (2E) + cos, sin (2D); write dq, dk (E)
cos and sin of one batch row, (1, T, D), are read from memory once and from L2 for the other
batches. At Llama-3.2-1B's shapes (32 + 8 heads, D 64, 4 x 2048 tokens, bf16) the forward moves
84 MB. Hugging Face's eager forward, per q: q * cos (2), the negated half (1), cat (2),
* sin (2), + (3): 10 tensor passes against the 2 here; its backward about as many.

Output layout: (B, H, T, D) tensors stored as (B, T, H, D), the layout Hugging Face's own
q * cos + ... returns (TensorIterator follows q's strides, a transposed view of the projection)
and the one attention reads for free: SDPA's CPU flash kernel took it with no copy, forward or
backward, and returns its own output and grad_q that way; a contiguous (B, H, T, D) q cost one
aten::copy_ more in SDPA's backward (a tiny Llama attention, torch 2.13 CPU); CUDA's flash and
memory-efficient kernels work in (B, T, H, D) themselves. The gradients dq and dk are stored that
way too, so the projection's view and transpose take them without a copy. Inputs are read in
place through their strides (a unit last dimension only).

Output dtypes (profuse.rotary states them): under autocast, q's and k's own; otherwise what
Hugging Face's eager math gives, the promotion of q (or k) with cos and sin (and, for
qk_norm_rope, its weight). Gradients come back in the inputs' dtypes.

Layout: the launch candidates; the @triton.jit kernels; the launch plans; the launchers; the
compiled ops (torch.compile calls them without a graph break); the autograd.Functions; the entry
points behind profuse.rotary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.env import sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing, compiled_op
from profuse.kernels.colsum import col_sum_launch
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import check_runnable, double_backward_error

# --------------------------------------------------------------------------------------------
# Launch candidates (policy): which tiles are worth timing, the favourite first
# --------------------------------------------------------------------------------------------
# Not yet timed on a GPU: each choice says what it is borrowed from; the autotuner times the
# candidates on the first call of a shape. KernelConfig here: kernel "rope", block_m = tokens a
# program takes in turn (unrolled, so their loads are all in flight together), block_n = the
# half head_dim rounded up to a power of two, num_warps; the qk_norm backward adds a persistent
# grid (programs) and the pipelining depth of its token loop (num_stages).


def token_lanes(n_q_heads: int, n_k_heads: int, half: int) -> int:
    """Lanes one token takes: q's and k's heads, each rounded up to a power of two, x D."""
    heads = triton.next_power_of_2(n_q_heads) + triton.next_power_of_2(n_k_heads)
    return heads * 2 * triton.next_power_of_2(half)


def rope_candidates(n_rows: int, n_q_heads: int, n_k_heads: int, half: int, norm: bool) -> list[KernelConfig]:
    """Row-grid launches (the forwards and rope's backward): 1, 2 or 4 tokens a program, with
    8 to 32 elements of a token a thread (one or more 16-byte loads of a bf16 half-head: the
    block ops' forward rule), ~16 first; the norm holds its fp32 x a while longer, so ~8 there."""
    lanes = token_lanes(n_q_heads, n_k_heads, half)
    block_d = triton.next_power_of_2(half)
    target = 8 if norm else 16
    warps = [w for w in (1, 2, 4, 8, 16, 32) if 8 <= lanes // (32 * w) <= 32] or [
        max(1, min(32, lanes // (32 * target)))
    ]
    shapes = [(rows, w) for rows in (1, 2, 4) if rows <= C.pow2_rows(n_rows) for w in warps]
    shapes.sort(key=lambda s: (abs(lanes // (32 * s[1]) - target), s[0]))
    return [KernelConfig("rope", rows, block_d, w, l2="plain") for rows, w in shapes]


def norm_backward_candidates(
    n_rows: int, n_q_heads: int, n_k_heads: int, half: int, n_sms: int
) -> list[KernelConfig]:
    """Persistent launches for qk_norm_rope's backward (each program keeps its dw partials in
    registers over its tokens): 4 to 16 elements of a token a thread (~8 fp32 values live per
    element, the tail backward's rule), as many programs as fill an SM's 2048 threads or half
    that, the token loop pipelined (the next token's loads issued early) or not."""
    lanes = token_lanes(n_q_heads, n_k_heads, half)
    block_d = triton.next_power_of_2(half)
    warps = [w for w in (2, 4, 8, 16, 32) if 4 <= lanes // (32 * w) <= 16] or [max(1, min(32, lanes // 256))]
    warps.sort(key=lambda w: abs(lanes // (32 * w) - 8))
    out = []
    for w in warps[:2]:
        full = max(1, 2048 // (32 * w))
        for stages, per_sm in ((1, full), (2, max(1, full // 2)), (2, full), (1, max(1, full // 2))):
            cfg = KernelConfig("rope", 1, block_d, w, stages, max(1, min(n_rows, n_sms * per_sm)), l2="plain")
            if cfg not in out:
                out.append(cfg)
    return out


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rotate(a1, a2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    """The rotation of one head's halves (forward), or its transpose (BACKWARD)."""
    if BACKWARD:
        return a1 * c1 + a2 * s2, a2 * c2 - a1 * s1
    return a1 * c1 - a2 * s1, a2 * c2 + a1 * s2


@triton.jit
def _rope_heads(
    X_ptr, W_ptr, O_ptr, x_base, x_head_stride, out_base, n_heads, half, head_dim, c1, c2, s1, s2, eps,
    offset, d_mask, p_mask, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    NORM: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """All heads of one token of one tensor: load both halves, (norm,) rotate, store both halves
    to the (B, T, H, D)-stored output at `out_base`. `d_mask`: the lanes of a half-head to move
    (none where the token is past the last). With partial rotary (BLOCK_P > 0) the head's last
    head_dim - 2 half lanes (`p_mask`) pass through unrotated (normalised first with NORM).
    INTERLEAVED: the even and odd lanes of the rotary dim in place of its halves (never with NORM)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    offs = x_base + heads[:, None] * x_head_stride + d[None, :]
    if INTERLEAVED:  # lane 2d and 2d + 1: offs + d is x_base + ... + 2d
        a1 = tl.load(X_ptr + offs + d[None, :], mask=mask, other=0.0).to(tl.float32)
        a2 = tl.load(X_ptr + offs + d[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        a1 = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a2 = tl.load(X_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_P > 0:
        p = tl.arange(0, BLOCK_P)
        pmask = (heads < n_heads)[:, None] & p_mask[None, :]
        poffs = x_base + heads[:, None] * x_head_stride + 2 * half + p[None, :]
        ap = tl.load(X_ptr + poffs, mask=pmask, other=0.0).to(tl.float32)
    if NORM:
        eps = tl.cast(eps, tl.float32)
        offset = tl.cast(offset, tl.float32)
        w1 = tl.load(W_ptr + d, mask=d < half, other=0.0).to(tl.float32) + offset
        w2 = tl.load(W_ptr + half + d, mask=d < half, other=0.0).to(tl.float32) + offset
        ss = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
        if BLOCK_P > 0:
            ss += tl.sum(ap * ap, axis=1)
        rstd = tl.rsqrt(ss / head_dim + eps)
        a1 = a1 * rstd[:, None] * w1[None, :]
        a2 = a2 * rstd[:, None] * w2[None, :]
        if BLOCK_P > 0:
            wp = tl.load(W_ptr + 2 * half + p, mask=p < head_dim - 2 * half, other=0.0).to(tl.float32)
            ap = ap * rstd[:, None] * (wp + offset)[None, :]
    y1, y2 = _rotate(a1, a2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], BACKWARD)
    out = out_base + heads[:, None] * head_dim + d[None, :]
    if INTERLEAVED:
        tl.store(O_ptr + out + d[None, :], y1.to(O_ptr.dtype.element_ty), mask=mask)
        tl.store(O_ptr + out + d[None, :] + 1, y2.to(O_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(O_ptr + out, y1.to(O_ptr.dtype.element_ty), mask=mask)
        tl.store(O_ptr + out + half, y2.to(O_ptr.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:
        pout = out_base + heads[:, None] * head_dim + 2 * half + p[None, :]
        tl.store(O_ptr + pout, ap.to(O_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _rope_kernel(
    Q_ptr,  # q (B, Hq, T, D) for rope, (B, T, Hq, D) for qk_norm_rope, or dq_out; any strides, unit last
    K_ptr,  # k, the same for Hk heads
    COS_ptr,  # (B or 1, T, D), unit last stride
    SIN_ptr,  # strided as cos
    QW_ptr,  # (D,) q_norm's weight; unused unless NORM
    KW_ptr,  # (D,) k_norm's weight; unused unless NORM
    QO_ptr,  # out: (B, T, Hq, D) storage, contiguous
    KO_ptr,  # out: (B, T, Hk, D) storage, contiguous
    q_batch_stride,  # q's strides in elements, by batch, head and position
    q_head_stride,
    q_seq_stride,
    k_batch_stride,
    k_head_stride,
    k_seq_stride,
    cos_batch_stride,  # 0 where cos has one batch row for every batch
    cos_seq_stride,
    n_rows,  # B * T tokens
    seq_len,
    n_q_heads,
    n_k_heads,
    half,  # the rotary dim / 2: D / 2, or less for partial rotary
    head_dim,  # D
    eps,
    offset,  # the norms' weight offset: 0.0, or 1.0 for (1 + w); unused unless NORM
    BLOCK_HQ: tl.constexpr,  # heads rounded up to a power of two
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,  # half rounded up to a power of two
    BLOCK_P: tl.constexpr,  # D - 2 half (the lanes passed through) rounded up; 0 for full rotary
    ROWS: tl.constexpr,  # tokens a program takes, unrolled
    NORM: tl.constexpr,  # qk_norm_rope: each head normalised first
    BACKWARD: tl.constexpr,  # rope's backward: the transposed rotation (never with NORM)
    INTERLEAVED: tl.constexpr,  # 0: the halves; lane pairs, cos by lane (1) or its first half (2)
):
    """ROWS tokens (b, t), each with all its q and k heads: (norm and) rotate, stored once."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    for i in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        b = row // seq_len
        t = row - b * seq_len
        cs = b * cos_batch_stride + t * cos_seq_stride + d
        # The lanes to move: none past the last token (the row test as a block: Triton's
        # interpreter takes no scalar in a mask).
        m = d_mask & ((row + tl.zeros([BLOCK_D], dtype=tl.int64)) < n_rows)
        if BLOCK_P > 0:
            p = tl.arange(0, BLOCK_P)
            pm = (p < head_dim - 2 * half) & ((row + tl.zeros([BLOCK_P], dtype=tl.int64)) < n_rows)
        else:
            pm = m
        if INTERLEAVED == 1:  # one angle a lane: pair d's at lanes 2d and 2d + 1
            c1 = tl.load(COS_ptr + cs + d, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(COS_ptr + cs + d + 1, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(SIN_ptr + cs + d, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(SIN_ptr + cs + d + 1, mask=m, other=0.0).to(tl.float32)
        elif INTERLEAVED == 2:  # pair d's angle at lane d of the first half, for both its lanes
            c1 = tl.load(COS_ptr + cs, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(SIN_ptr + cs, mask=m, other=0.0).to(tl.float32)
            c2 = c1
            s2 = s1
        else:
            c1 = tl.load(COS_ptr + cs, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(COS_ptr + cs + half, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(SIN_ptr + cs, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(SIN_ptr + cs + half, mask=m, other=0.0).to(tl.float32)
        _rope_heads(Q_ptr, QW_ptr, QO_ptr, b * q_batch_stride + t * q_seq_stride, q_head_stride,
                    row * n_q_heads * head_dim, n_q_heads, half, head_dim, c1, c2, s1, s2, eps, offset, m,
                    pm, BLOCK_HQ, BLOCK_D, BLOCK_P, NORM, BACKWARD, INTERLEAVED)  # fmt: skip
        _rope_heads(K_ptr, KW_ptr, KO_ptr, b * k_batch_stride + t * k_seq_stride, k_head_stride,
                    row * n_k_heads * head_dim, n_k_heads, half, head_dim, c1, c2, s1, s2, eps, offset, m,
                    pm, BLOCK_HK, BLOCK_D, BLOCK_P, NORM, BACKWARD, INTERLEAVED)  # fmt: skip


@triton.jit
def _norm_rope_bwd_heads(
    DY_ptr, X_ptr, W_ptr, DX_ptr, dy_base, dy_head_stride, x_base, x_head_stride, out_base, n_heads, half,
    head_dim, c1, c2, s1, s2, eps, offset, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, STORE_DX: tl.constexpr,
):  # fmt: skip
    """One token's heads of one tensor: dx stored (STORE_DX), this token's dw terms returned as
    the (BLOCK_D,) sums over its heads of dz1 * x_hat1 and dz2 * x_hat2, and (BLOCK_P,) of
    dy * x_hat over the lanes past the rotary dim (partial rotary; unrotated, so dz = dy)."""
    eps = tl.cast(eps, tl.float32)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & (d < half)[None, :]
    dys = dy_base + heads[:, None] * dy_head_stride + d[None, :]
    xs = x_base + heads[:, None] * x_head_stride + d[None, :]
    dy1 = tl.load(DY_ptr + dys, mask=mask, other=0.0).to(tl.float32)
    dy2 = tl.load(DY_ptr + dys + half, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(X_ptr + xs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + xs + half, mask=mask, other=0.0).to(tl.float32)
    dz1, dz2 = _rotate(dy1, dy2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], True)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    p = tl.arange(0, BLOCK_P if BLOCK_P > 0 else 1)
    if BLOCK_P > 0:
        pmask = (heads < n_heads)[:, None] & (p < head_dim - 2 * half)[None, :]
        dyp = tl.load(DY_ptr + dy_base + heads[:, None] * dy_head_stride + 2 * half + p[None, :], mask=pmask,
                      other=0.0).to(tl.float32)  # fmt: skip
        xp = tl.load(X_ptr + x_base + heads[:, None] * x_head_stride + 2 * half + p[None, :], mask=pmask,
                     other=0.0).to(tl.float32)  # fmt: skip
        ss += tl.sum(xp * xp, axis=1)
    rstd = tl.rsqrt(ss / head_dim + eps)[:, None]
    xh1 = x1 * rstd
    xh2 = x2 * rstd
    if BLOCK_P > 0:
        xhp = xp * rstd
        dwp = tl.sum(dyp * xhp, axis=0)
    else:
        dwp = tl.zeros([1], dtype=tl.float32)
    if STORE_DX:
        offset = tl.cast(offset, tl.float32)
        w1 = (tl.load(W_ptr + d, mask=d < half, other=0.0).to(tl.float32) + offset)[None, :]
        w2 = (tl.load(W_ptr + half + d, mask=d < half, other=0.0).to(tl.float32) + offset)[None, :]
        g1 = dz1 * w1
        g2 = dz2 * w2
        gx = tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)
        if BLOCK_P > 0:
            wp = (tl.load(W_ptr + 2 * half + p, mask=p < head_dim - 2 * half, other=0.0).to(tl.float32)
                  + offset)[None, :]  # fmt: skip
            gp = dyp * wp
            gx += tl.sum(gp * xhp, axis=1)
        mean = (gx / head_dim)[:, None]
        out = out_base + heads[:, None] * head_dim + d[None, :]
        tl.store(DX_ptr + out, (rstd * (g1 - xh1 * mean)).to(DX_ptr.dtype.element_ty), mask=mask)
        tl.store(DX_ptr + out + half, (rstd * (g2 - xh2 * mean)).to(DX_ptr.dtype.element_ty), mask=mask)
        if BLOCK_P > 0:
            pout = out_base + heads[:, None] * head_dim + 2 * half + p[None, :]
            tl.store(DX_ptr + pout, (rstd * (gp - xhp * mean)).to(DX_ptr.dtype.element_ty), mask=pmask)
    return tl.sum(dz1 * xh1, axis=0), tl.sum(dz2 * xh2, axis=0), dwp


@triton.jit
def _norm_rope_bwd_kernel(
    DQO_ptr,  # dq_out (B, Hq, T, D), any strides, unit last
    DKO_ptr,  # dk_out (B, Hk, T, D)
    Q_ptr,  # q (B, T, Hq, D) as the forward read it, any strides, unit last
    K_ptr,
    COS_ptr,
    SIN_ptr,
    QW_ptr,
    KW_ptr,
    DQ_ptr,  # out: (B, T, Hq, D) contiguous; unused unless STORE_DX
    DK_ptr,
    DW_ptr,  # out: (programs, 2D) fp32 dw partials, q_weight's then k_weight's; unused unless COMPUTE_DW
    dqo_batch_stride,
    dqo_head_stride,
    dqo_seq_stride,
    dko_batch_stride,
    dko_head_stride,
    dko_seq_stride,
    q_batch_stride,
    q_head_stride,
    q_seq_stride,
    k_batch_stride,
    k_head_stride,
    k_seq_stride,
    cos_batch_stride,
    cos_seq_stride,
    n_rows,
    seq_len,
    n_q_heads,
    n_k_heads,
    half,
    head_dim,
    eps,
    offset,  # the norms' weight offset: 0.0, or 1.0 for (1 + w)
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # the lanes past the rotary dim, rounded up; 0 for full rotary
    NUM_STAGES: tl.constexpr,  # software pipelining of the token loop
    STORE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """Persistent grid: program p takes tokens p, p + P, ...; dq and dk per token, dw summed
    over the program's tokens in fp32 and stored as its partial row (q's D lanes, then k's)."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    dwq1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dwq2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dwk1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dwk2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    p = tl.arange(0, BLOCK_P if BLOCK_P > 0 else 1)
    dwqp = tl.zeros([BLOCK_P if BLOCK_P > 0 else 1], dtype=tl.float32)
    dwkp = tl.zeros([BLOCK_P if BLOCK_P > 0 else 1], dtype=tl.float32)
    for r in tl.range(pid, n_rows, tl.num_programs(0), num_stages=NUM_STAGES):
        row = tl.cast(r, tl.int64)
        b = row // seq_len
        t = row - b * seq_len
        cs = b * cos_batch_stride + t * cos_seq_stride + d
        c1 = tl.load(COS_ptr + cs, mask=d_mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS_ptr + cs + half, mask=d_mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN_ptr + cs, mask=d_mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN_ptr + cs + half, mask=d_mask, other=0.0).to(tl.float32)
        q1, q2, qp = _norm_rope_bwd_heads(
            DQO_ptr, Q_ptr, QW_ptr, DQ_ptr, b * dqo_batch_stride + t * dqo_seq_stride, dqo_head_stride,
            b * q_batch_stride + t * q_seq_stride, q_head_stride, row * n_q_heads * head_dim, n_q_heads,
            half, head_dim, c1, c2, s1, s2, eps, offset, BLOCK_HQ, BLOCK_D, BLOCK_P, STORE_DX,
        )  # fmt: skip
        k1, k2, kp = _norm_rope_bwd_heads(
            DKO_ptr, K_ptr, KW_ptr, DK_ptr, b * dko_batch_stride + t * dko_seq_stride, dko_head_stride,
            b * k_batch_stride + t * k_seq_stride, k_head_stride, row * n_k_heads * head_dim, n_k_heads,
            half, head_dim, c1, c2, s1, s2, eps, offset, BLOCK_HK, BLOCK_D, BLOCK_P, STORE_DX,
        )  # fmt: skip
        dwq1 += q1
        dwq2 += q2
        dwk1 += k1
        dwk2 += k2
        dwqp += qp
        dwkp += kp
    if COMPUTE_DW:
        part = DW_ptr + pid.to(tl.int64) * (2 * head_dim) + d
        tl.store(part, dwq1, mask=d_mask)
        tl.store(part + half, dwq2, mask=d_mask)
        tl.store(part + head_dim, dwk1, mask=d_mask)
        tl.store(part + head_dim + half, dwk2, mask=d_mask)
        if BLOCK_P > 0:
            p_mask = p < head_dim - 2 * half
            ppart = DW_ptr + pid.to(tl.int64) * (2 * head_dim) + 2 * half + p
            tl.store(ppart, dwqp, mask=p_mask)
            tl.store(ppart + head_dim, dwkp, mask=p_mask)


# --------------------------------------------------------------------------------------------
# Launch plans: built on the first call of a signature, then looked up
# --------------------------------------------------------------------------------------------

# Plans by (what runs, tokens, seq_len, Hq, Hk, D, dtypes, device[, gradients asked for]).
# Strides are runtime arguments: every layout of a shape shares its plan.
_PLANS = PlanCache()


def _row_launch(
    cfg: KernelConfig,
    n_rows: int,
    heads: tuple[int, int],
    norm: bool,
    backward: bool,
    n_pass: int = 0,
    interleaved: int = 0,
) -> Launch:
    """The row-grid kernel for `cfg`, bound to its grid. Runtime arguments: _rope_kernel's.
    `n_pass`: the lanes of a head past the rotary dim (partial rotary), else 0. `interleaved`:
    0 (the halves), or the lane pairs' form (INTERLEAVED_FORMS' code)."""
    kind = "qk_norm_rope fwd" if norm else ("rope bwd" if backward else "rope fwd")
    return Launch(
        _rope_kernel, (triton.cdiv(n_rows, cfg.block_m),), cfg, kind + (" pairs" if interleaved else ""),
        BLOCK_HQ=triton.next_power_of_2(heads[0]), BLOCK_HK=triton.next_power_of_2(heads[1]),
        BLOCK_D=cfg.block_n, BLOCK_P=triton.next_power_of_2(n_pass) if n_pass else 0, ROWS=cfg.block_m,
        NORM=norm, BACKWARD=backward, INTERLEAVED=interleaved, num_warps=cfg.num_warps,
    )  # fmt: skip


class _NormBackwardPlan:
    """qk_norm_rope's backward for one signature: the gradient kernel on its persistent grid,
    then (where a weight needs its gradient) the one column sum of both weights' partials."""

    __slots__ = ("config", "programs", "main", "col_sum", "head_dim")

    def __init__(
        self,
        cfg: KernelConfig,
        n_rows: int,
        heads: tuple[int, int],
        half: int,
        needs: tuple,
        head_dim: int = 0,
    ):
        need_x, need_w = needs
        self.config = cfg
        self.head_dim = head_dim = head_dim or 2 * half
        n_pass = head_dim - 2 * half
        self.programs = programs = max(1, min(cfg.programs, n_rows))  # every program has a token
        self.main = Launch(
            _norm_rope_bwd_kernel, (programs,), cfg, "qk_norm_rope bwd",
            BLOCK_HQ=triton.next_power_of_2(heads[0]), BLOCK_HK=triton.next_power_of_2(heads[1]),
            BLOCK_D=cfg.block_n, BLOCK_P=triton.next_power_of_2(n_pass) if n_pass else 0,
            NUM_STAGES=cfg.num_stages, STORE_DX=need_x, COMPUTE_DW=need_w, num_warps=cfg.num_warps,
        )  # fmt: skip
        self.col_sum = col_sum_launch(2 * head_dim) if need_w else None

    def __call__(self, dqo, dko, q, k, cos, sin, qw, kw, dq, dk, dw, *scalars) -> None:
        """dq, dk (None where not asked for) and dw, the (2, D) sum of both weights' partials."""
        partial = None
        if self.col_sum is not None:
            partial = torch.empty((self.programs, 2 * self.head_dim), dtype=torch.float32, device=q.device)
        # Pointers not used get any tensor: their flag is off, the kernel never touches them.
        self.main(dqo, dko, q, k, cos, sin, qw, kw, q if dq is None else dq, k if dk is None else dk,
                  q if partial is None else partial, *_bht(dqo), *_bht(dko), *_bht(q, seq_dim=1),
                  *_bht(k, seq_dim=1), *scalars)  # fmt: skip
        if partial is not None:
            # One reduction over the programs' partials, in a fixed order: the same bits every run.
            self.col_sum(partial, dw, self.programs, 2 * self.head_dim)


def _bht(x: torch.Tensor, seq_dim: int = 2) -> tuple[int, int, int]:
    """x's strides by batch, head and position: x is (B, H, T, D), or (B, T, H, D) (seq_dim 1)."""
    return x.stride(0), x.stride(3 - seq_dim), x.stride(seq_dim)


def _row_plan(key: tuple, args: tuple, norm: bool, backward: bool, interleaved: int = 0) -> Launch:
    """The row-grid launch for a new signature: the tuned config, bound to this shape's grid."""
    _, n_rows, _, hq, hk, d, rot, *_, device = key
    check_runnable(device, "qk_norm_rope" if norm else "rope")
    candidates = rope_candidates(n_rows, hq, hk, rot // 2, norm)
    tune_key = (key[0], C.pow2_rows(n_rows), *key[3:-1])

    def run(c):  # returns the outputs, so the tuner compares each candidate's answer
        _row_launch(c, n_rows, (hq, hk), norm, backward, d - rot, interleaved)(*args)
        return args[6], args[7]

    cfg = TUNER.pick(tune_key, candidates, run, device)
    launch = _row_launch(cfg, n_rows, (hq, hk), norm, backward, d - rot, interleaved)
    if not capturing(device):  # a plan made inside a graph capture is untuned: not kept
        _PLANS.add(key, launch)
    return launch


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def heads_major_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised (B, H, T, D) tensor stored as (B, T, H, D) (strides (T*H*D, D, H*D, 1))."""
    b, h, t, d = shape
    return torch.empty_strided(shape, (t * h * d, d, h * d, 1), dtype=dtype, device=device)


def _cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """cos and sin with one set of strides and a unit last one: (cos, sin, batch stride, seq stride),
    the batch stride 0 where one batch row serves every batch."""
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy where its last dimension is not contiguous (a broadcast gradient: stride 0)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _run_rows(
    name, q, k, qw, kw, cos, sin, qo, ko, eps, seq_dim, norm, backward, config, offset=0.0, interleaved=0
) -> None:
    """Launch the row-grid kernel over q and k (outputs qo, ko allocated by the caller).
    `interleaved`: a lane pairs' form (its code; `name` then names it, so plans and tunings of the
    halves are their own)."""
    b, t, hq, hk, d = q.shape[0], q.shape[seq_dim], q.shape[3 - seq_dim], k.shape[3 - seq_dim], q.shape[-1]
    n_rows = b * t
    if n_rows == 0:
        return
    cos, sin, cos_bs, cos_ts = _cos_sin(cos, sin)
    rot = cos.shape[-1]  # the rotary dim: d, or less (partial rotary: the rest passes through)
    args = (q, k, cos, sin, qw, kw, qo, ko, *_bht(q, seq_dim), *_bht(k, seq_dim), cos_bs, cos_ts,
            n_rows, t, hq, hk, rot // 2, d, eps, offset)  # fmt: skip
    if config is not None:
        _row_launch(config, n_rows, (hq, hk), norm, backward, d - rot, interleaved)(*args)
        return
    key = (name, n_rows, t, hq, hk, d, rot, q.dtype, k.dtype, cos.dtype, qw.dtype, qo.dtype, ko.dtype,
           q.device)  # fmt: skip
    launch = _PLANS.get(key)
    if launch is None:
        launch = _row_plan(key, args, norm, backward, interleaved)
    launch(*args)


# The lane pairs' forms (profuse.rotary's `interleaved`) and their INTERLEAVED codes; None, the halves, is 0.
INTERLEAVED_FORMS = {"lanes": 1, "first_half": 2}


def _rows_name(name: str, interleaved: int) -> str:
    """The plan's and tuning's name: the halves' own, or with the pairs' form after it."""
    return f"{name}_pairs{interleaved}" if interleaved else name


def rope_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
    config: KernelConfig | None = None,
    interleaved: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) for q (B, Hq, T, D), k (B, Hk, T, D): (B, H, T, D) stored as (B, T, H, D),
    in `out_dtypes` (default: q's and k's). `config` runs that launch shape; without it the
    shape's plan runs (tuned on its first call). `interleaved`: 0, the halves rotated, or an
    INTERLEAVED_FORMS code, the lane pairs."""
    q_dtype, k_dtype = out_dtypes or (q.dtype, k.dtype)
    qo = heads_major_empty(q.shape, q_dtype, q.device)
    ko = heads_major_empty(k.shape, k_dtype, k.device)
    name = _rows_name("rope_fwd", interleaved)
    _run_rows(name, q, k, cos, cos, cos, sin, qo, ko, 0.0, 2, False, False, config, 0.0, interleaved)
    return qo, ko


def rope_backward(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dtypes: tuple[torch.dtype, torch.dtype],
    config: KernelConfig | None = None,
    interleaved: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in `dtypes` (q's and k's), (B, H, T, D) stored as (B, T, H, D)."""
    dq_out, dk_out = _unit_last(dq_out), _unit_last(dk_out)
    dq = heads_major_empty(dq_out.shape, dtypes[0], dq_out.device)
    dk = heads_major_empty(dk_out.shape, dtypes[1], dk_out.device)
    name = _rows_name("rope_bwd", interleaved)
    _run_rows(name, dq_out, dk_out, cos, cos, cos, sin, dq, dk, 0.0, 2, False, True, config, 0.0, interleaved)
    return dq, dk


def qk_norm_rope_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    out_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
    config: KernelConfig | None = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) for q (B, T, Hq, D), k (B, T, Hk, D): each head normalised (times
    weight_offset + w) then rotated, returned (B, H, T, D) stored as (B, T, H, D), in `out_dtypes`
    (default: q's and k's)."""
    b, t, hq, d = q.shape
    q_dtype, k_dtype = out_dtypes or (q.dtype, k.dtype)
    qo = heads_major_empty((b, hq, t, d), q_dtype, q.device)
    ko = heads_major_empty((b, k.shape[2], t, d), k_dtype, k.device)
    qw, kw = q_weight.contiguous(), k_weight.contiguous()
    _run_rows("qk_norm_rope_fwd", q, k, qw, kw, cos, sin, qo, ko, eps, 1, True, False, config, weight_offset)
    return qo, ko


def qk_norm_rope_backward(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool] = (True, True),
    config: KernelConfig | None = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dq, dk, dw): dq and dk shaped and typed as q and k, contiguous; dw (2, D), the gradients
    of q_weight and k_weight as its rows, in q_weight's dtype (fp32 where the two weights' dtypes
    differ). `needs` = (dq and dk, dw); None where not asked for."""
    need_x, need_w = needs
    b, t, hq, d = q.shape
    hk, dev = k.shape[2], q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev) if need_x else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=dev) if need_x else None
    w_dtype = q_weight.dtype if q_weight.dtype == k_weight.dtype else torch.float32
    dw = torch.empty((2, d), dtype=w_dtype, device=dev) if need_w else None
    n_rows = b * t
    if n_rows == 0 or not (need_x or need_w):
        return dq, dk, (dw.zero_() if dw is not None else None)
    dq_out, dk_out = _unit_last(dq_out), _unit_last(dk_out)
    cos, sin, cos_bs, cos_ts = _cos_sin(cos, sin)
    qw, kw = q_weight.contiguous(), k_weight.contiguous()
    half = cos.shape[-1] // 2  # d // 2, or less for partial rotary (the rest passes through)
    args = (
        dq_out,
        dk_out,
        q,
        k,
        cos,
        sin,
        qw,
        kw,
        dq,
        dk,
        dw,
        cos_bs,
        cos_ts,
        n_rows,
        t,
        hq,
        hk,
        half,
        d,
        eps,
        weight_offset,
    )
    if config is not None:
        _NormBackwardPlan(config, n_rows, (hq, hk), half, needs, d)(*args)
        return dq, dk, dw
    key = ("qk_norm_rope_bwd", n_rows, t, hq, hk, d, half, dq_out.dtype, q.dtype, k.dtype, cos.dtype,
           qw.dtype, kw.dtype, needs, dev)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        check_runnable(dev, "qk_norm_rope")
        candidates = norm_backward_candidates(n_rows, hq, hk, half, sm_count(dev))
        tune_key = ("qk_norm_rope_bwd", C.pow2_rows(n_rows), *key[3:-1])

        def run(c):
            _NormBackwardPlan(c, n_rows, (hq, hk), half, needs, d)(*args)
            return [x for x in (dq, dk, dw) if x is not None]

        cfg = TUNER.pick(tune_key, candidates, run, dev)
        plan = _NormBackwardPlan(cfg, n_rows, (hq, hk), half, needs, d)
        if not capturing(dev):
            _PLANS.add(key, plan)
    plan(*args)
    return dq, dk, dw


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Functions, the entry points
# --------------------------------------------------------------------------------------------


def _rope_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return rope_forward(q, k, cos, sin, (q_dtype, k_dtype))


def _rope_bwd_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return rope_backward(dq_out, dk_out, cos, sin, (q_dtype, k_dtype))


def _rope_fake(a, b, cos, sin, a_dtype, b_dtype):
    return heads_major_empty(a.shape, a_dtype, a.device), heads_major_empty(b.shape, b_dtype, b.device)


def _rope_pairs_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
    k_dtype: torch.dtype, interleaved: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return rope_forward(q, k, cos, sin, (q_dtype, k_dtype), interleaved=interleaved)


def _rope_pairs_bwd_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
    k_dtype: torch.dtype, interleaved: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return rope_backward(dq_out, dk_out, cos, sin, (q_dtype, k_dtype), interleaved=interleaved)


def _rope_pairs_fake(a, b, cos, sin, a_dtype, b_dtype, interleaved):
    return _rope_fake(a, b, cos, sin, a_dtype, b_dtype)


def _norm_fwd_op(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, weight_offset: float, q_dtype: torch.dtype, k_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return qk_norm_rope_forward(
        q, k, q_weight, k_weight, cos, sin, eps, (q_dtype, k_dtype), weight_offset=weight_offset
    )


def _norm_fwd_fake(q, k, q_weight, k_weight, cos, sin, eps, weight_offset, q_dtype, k_dtype):
    (b, t, hq, d), hk = q.shape, k.shape[2]
    return heads_major_empty((b, hq, t, d), q_dtype, q.device), heads_major_empty(
        (b, hk, t, d), k_dtype, k.device
    )


def _norm_bwd_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, weight_offset: float,
    need_x: bool, need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dw); an empty tensor (each its own) where not asked for."""
    dq, dk, dw = qk_norm_rope_backward(
        dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, (need_x, need_w), weight_offset=weight_offset
    )
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            q.new_empty(0) if dw is None else dw)  # fmt: skip


def _norm_bwd_fake(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, weight_offset, need_x, need_w):
    w_dtype = q_weight.dtype if q_weight.dtype == k_weight.dtype else torch.float32
    return (q.new_empty(q.shape) if need_x else q.new_empty(0),
            k.new_empty(k.shape) if need_x else k.new_empty(0),
            q.new_empty((2, q.shape[-1]), dtype=w_dtype) if need_w else q.new_empty(0))  # fmt: skip


# The ops torch.compile calls: profuse::rope_fwd and the rest (opaque), and on CUDA their
# Triton-op twins, whose kernels Inductor launches itself (kernels/autotune.compiled_op).
_rope_fwd_compiled = compiled_op("rope_fwd", _rope_fwd_op, _rope_fake)
_rope_bwd_compiled = compiled_op("rope_bwd", _rope_bwd_op, _rope_fake)
_rope_pairs_fwd_compiled = compiled_op("rope_pairs_fwd", _rope_pairs_fwd_op, _rope_pairs_fake)
_rope_pairs_bwd_compiled = compiled_op("rope_pairs_bwd", _rope_pairs_bwd_op, _rope_pairs_fake)
_norm_fwd_compiled = compiled_op("qk_norm_rope_fwd", _norm_fwd_op, _norm_fwd_fake)
_norm_bwd_compiled = compiled_op("qk_norm_rope_bwd", _norm_bwd_op, _norm_bwd_fake)


class RopeFunction(torch.autograd.Function):
    """Saves cos and sin only (q and k are not needed: the rotation is linear). Eager calls go
    to the launchers; a traced call, to the compiled ops. Double backward is refused in one line.
    `interleaved`: 0, the halves (rope_fwd, rope_bwd), or the lane pairs' form (rope_pairs_*)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, q_dtype, k_dtype, interleaved=0):
        if torch.compiler.is_compiling():
            if interleaved:
                qo, ko = _rope_pairs_fwd_compiled(q)(q, k, cos, sin, q_dtype, k_dtype, interleaved)
            else:
                qo, ko = _rope_fwd_compiled(q)(q, k, cos, sin, q_dtype, k_dtype)
        else:
            qo, ko = rope_forward(q, k, cos, sin, (q_dtype, k_dtype), interleaved=interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.interleaved = interleaved
        return qo, ko

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[:2]
        interleaved = ctx.interleaved
        if torch.compiler.is_compiling():
            if interleaved:
                dq, dk = _rope_pairs_bwd_compiled(cos)(dq_out, dk_out, cos, sin, *ctx.dtypes, interleaved)
            else:
                dq, dk = _rope_bwd_compiled(cos)(dq_out, dk_out, cos, sin, *ctx.dtypes)
        else:
            if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
                raise double_backward_error("rope", "profuse.rotary.rope_eager")
            dq, dk = rope_backward(dq_out, dk_out, cos, sin, ctx.dtypes, interleaved=interleaved)
        return (dq if need_q else None), (dk if need_k else None), None, None, None, None, None


class QKNormRopeFunction(torch.autograd.Function):
    """Saves q, k (the projections' outputs: alive anyway), the weights, cos and sin; the norm is
    recomputed in the backward. Double backward is refused in one line."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, offset, q_dtype, k_dtype):
        if torch.compiler.is_compiling():
            qo, ko = _norm_fwd_compiled(q)(q, k, q_weight, k_weight, cos, sin, eps, offset, q_dtype, k_dtype)
        else:
            qo, ko = qk_norm_rope_forward(
                q, k, q_weight, k_weight, cos, sin, eps, (q_dtype, k_dtype), weight_offset=offset
            )
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.offset = eps, offset
        return qo, ko

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        need_q, need_k, need_qw, need_kw = ctx.needs_input_grad[:4]
        needs = (need_q or need_k, need_qw or need_kw)
        args = (dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps)
        if torch.compiler.is_compiling():
            dq, dk, dw = _norm_bwd_compiled(q)(*args, ctx.offset, *needs)
        else:
            if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
                raise double_backward_error("qk_norm_rope", "profuse.rotary.qk_norm_rope_eager")
            dq, dk, dw = qk_norm_rope_backward(*args, needs, weight_offset=ctx.offset)
        dqw = dw[0].to(q_weight.dtype) if need_qw else None
        dkw = dw[1].to(k_weight.dtype) if need_kw else None
        nones = (None,) * 6  # cos, sin, eps, offset and the two dtypes
        return (dq if need_q else None), (dk if need_k else None), dqw, dkw, *nones


def _autocast_on(device: torch.device) -> bool:
    return torch.is_autocast_enabled(device.type)


def out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *more: torch.Tensor) -> torch.dtype:
    """The dtype of a rotated x: its own under autocast (what attention reads), else what Hugging
    Face's eager math gives, x promoted with cos, sin (and the norm's weight)."""
    if _autocast_on(x.device):
        return x.dtype
    dtype = x.dtype
    for t in (cos, sin, *more):
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _no_cos_grad(cos: torch.Tensor, sin: torch.Tensor, op: str) -> None:
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            f"{op} computes no gradient for cos and sin (Hugging Face's come from a buffer without "
            "one); detach them, or use the eager op"
        )


def rope_fused(
    q, k, cos, sin, keep_dtype: bool = False, interleaved: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) on checked inputs: through autograd where a gradient is wanted, else the
    forward launch alone (no autograd node). cos or sin that requires grad: ValueError.
    `keep_dtype`: q's and k's own dtypes out, whatever cos's (OLMo 2's cast back, in the store).
    `interleaved`: None (the halves), or the lane pairs' form, a key of INTERLEAVED_FORMS."""
    _no_cos_grad(cos, sin, "rope")
    if keep_dtype:
        dtypes = (q.dtype, k.dtype)
    else:
        dtypes = (out_dtype(q, cos, sin), out_dtype(k, cos, sin))
    if interleaved is not None:
        code = INTERLEAVED_FORMS[interleaved]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return RopeFunction.apply(q, k, cos, sin, *dtypes, code)
        if torch.compiler.is_compiling():
            return _rope_pairs_fwd_compiled(q)(q, k, cos, sin, *dtypes, code)
        return rope_forward(q, k, cos, sin, dtypes, interleaved=code)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return RopeFunction.apply(q, k, cos, sin, *dtypes)
    if torch.compiler.is_compiling():
        return _rope_fwd_compiled(q)(q, k, cos, sin, *dtypes)
    return rope_forward(q, k, cos, sin, dtypes)


def qk_norm_rope_fused(
    q, k, q_weight, k_weight, cos, sin, eps: float, weight_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) on checked inputs, as rope_fused; the weights' gradients bitwise repeatable.
    With a weight_offset (Gemma 3), the norm casts to q's dtype before the rotation, as
    Gemma3RMSNorm does: the weight's dtype takes no part in the output's."""
    _no_cos_grad(cos, sin, "qk_norm_rope")
    if weight_offset:
        dtypes = (out_dtype(q, cos, sin), out_dtype(k, cos, sin))
    else:
        dtypes = (out_dtype(q, cos, sin, q_weight), out_dtype(k, cos, sin, k_weight))
    wants = q.requires_grad or k.requires_grad or q_weight.requires_grad or k_weight.requires_grad
    if torch.is_grad_enabled() and wants:
        return QKNormRopeFunction.apply(q, k, q_weight, k_weight, cos, sin, eps, weight_offset, *dtypes)
    if torch.compiler.is_compiling():
        return _norm_fwd_compiled(q)(q, k, q_weight, k_weight, cos, sin, eps, weight_offset, *dtypes)
    return qk_norm_rope_forward(q, k, q_weight, k_weight, cos, sin, eps, dtypes, weight_offset=weight_offset)
