"""Gated activations other than SwiGLU, in Triton: one pass forward, one pass backward.

    a = f(g) * m(u)

    ACT_GELU_TANH   f(g) = 0.5 g (1 + tanh(k (g + c g^3))),  k = sqrt(2/pi), c = 0.044715;  m(u) = u
                    (GeGLU as Gemma computes it: gelu_pytorch_tanh)
    ACT_GELU_ERF    f(g) = 0.5 g (1 + erf(g / sqrt(2)));  m(u) = u           (GeGLU, exact gelu)
    ACT_CLAMPED     g' = min(g, L),  f(g) = g' sigmoid(alpha g');  m(u) = clamp(u, -L, L) + 1
                    (gpt-oss's experts: alpha 1.702, L = 7.0, transformers' GptOssExperts._apply_gate)

Backward (fp32 inside; torch's clamp passes the gradient where the input lies within the
bounds, ends included, and so does this):
    dg = da * m(u) * f'(g)          f'(g): tanh form  0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 c g^2)
                                           erf form   0.5 (1 + erf(g / sqrt 2)) + g exp(-g^2 / 2) / sqrt(2 pi)
                                           clamped    (s + alpha g' s (1 - s)) where g <= L, else 0;
                                                      s = sigmoid(alpha g')
    du = da * f(g) * m'(u)          m'(u) = 1 (clamped: 1 where -L <= u <= L, else 0)

tanh(z) is computed as 2 sigmoid(2z) - 1 (Triton has no tanh of its own on every version).

The inputs: two (..., F) tensors, or one packed (..., 2F) matmul output whose gate and up are
its halves (gate_up.chunk(2, -1)) or interleaved (gate = [..., 0::2], up = [..., 1::2]: gpt-oss's
layout). Both are read in place through a row and a column stride; the packed form's gradient is
one (..., 2F) tensor in the same layout, so autograd has no halves to put together.

The op is elementwise: a program takes a tile of rows x columns; one fixed tile per width (4096
elements; a tuned table, as silu_mul has, is later work), kept per shape so a later call is a
dictionary lookup and one launch.

Layout: the @triton.jit kernels; the launchers; the compiled ops (torch.compile calls them
without a graph break); the autograd.Functions; `gated_pair` / `gated_packed`, the entry points
behind profuse.blockops.gelu_mul and profuse.blockops.clamped_swiglu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.kernels.autotune import Launch, PlanCache, compiled_op
from profuse.kernels.rows import as_rows, check_runnable, double_backward_error

ACT_GELU_TANH, ACT_GELU_ERF, ACT_CLAMPED = 0, 1, 2
ACT_NAMES = {ACT_GELU_TANH: "gelu_mul", ACT_GELU_ERF: "gelu_mul", ACT_CLAMPED: "clamped_swiglu"}
EAGER_NAMES = {
    ACT_GELU_TANH: "profuse.blockops.gelu_mul_eager",
    ACT_GELU_ERF: "profuse.blockops.gelu_mul_eager",
    ACT_CLAMPED: "profuse.blockops.clamped_swiglu_eager",
}

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _gate(g, alpha, limit, ACT: tl.constexpr):
    """(f(g), f'(g)) in fp32 (module docstring)."""
    if ACT == 0:
        k = 0.7978845608028654  # sqrt(2 / pi)
        t = 2.0 * tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g)) - 1.0
        f = 0.5 * g * (1.0 + t)
        df = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    elif ACT == 1:
        e = tl.math.erf(g * 0.7071067811865476)
        f = 0.5 * g * (1.0 + e)
        df = 0.5 * (1.0 + e) + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1 / sqrt(2 pi)
    else:
        gc = tl.minimum(g, limit)
        s = tl.sigmoid(alpha * gc)
        f = gc * s
        df = tl.where(g <= limit, s + alpha * gc * s * (1.0 - s), 0.0)
    return f, df


@triton.jit
def _up(u, limit, ACT: tl.constexpr):
    """(m(u), m'(u)) in fp32."""
    if ACT == 2:
        m = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        dm = tl.where((u >= -limit) & (u <= limit), 1.0, 0.0)
    else:
        m = u
        dm = tl.full(u.shape, 1.0, tl.float32)
    return m, dm


@triton.jit
def _gated_fwd_kernel(
    G_ptr,  # gate's first element; (rows, cols) through g_row_stride, col_stride
    U_ptr,  # up's first element, the same strides as gate's columns
    A_ptr,  # (n_rows, n_cols) out, contiguous
    g_row_stride,
    u_row_stride,
    col_stride,  # 1, or 2 for the interleaved packed layout
    n_rows,
    n_cols,
    alpha,  # the clamped form's sigmoid scale (unused otherwise)
    limit,  # the clamped form's bound L (unused otherwise)
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tile (program 0, program 1) of a = f(g) * m(u), fp32 inside, rounded once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    c = (cols * col_stride)[None, :]
    g = tl.load(G_ptr + rows[:, None] * g_row_stride + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + rows[:, None] * u_row_stride + c, mask=mask, other=0.0).to(tl.float32)
    f, _ = _gate(g, alpha, limit, ACT)
    m, _ = _up(u, limit, ACT)
    tl.store(A_ptr + rows[:, None] * n_cols + cols[None, :], (f * m).to(A_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    DA_ptr,  # (rows, n_cols) incoming gradient, row stride da_row_stride
    G_ptr,
    U_ptr,
    DG_ptr,  # dgate out (with PACKED_D: the packed gradient, dup at du_offset from it)
    DU_ptr,  # dup out when not PACKED_D
    da_row_stride,
    g_row_stride,
    u_row_stride,
    col_stride,  # the inputs' column stride
    d_row_stride,  # the gradients' row stride
    d_col_stride,  # the gradients' column stride (2: interleaved packed gradient)
    du_offset,  # dup's first element from its pointer (packed: F for halves, 1 interleaved)
    n_rows,
    n_cols,
    alpha,
    limit,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    PACKED_D: tl.constexpr,
):
    """Tile of dg = da * m(u) * f'(g), du = da * f(g) * m'(u). The packed gradient is written
    through one pointer (under torch.compile one written tensor, never two aliasing ones)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    c = (cols * col_stride)[None, :]
    da = tl.load(DA_ptr + rows[:, None] * da_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + rows[:, None] * g_row_stride + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + rows[:, None] * u_row_stride + c, mask=mask, other=0.0).to(tl.float32)
    f, df = _gate(g, alpha, limit, ACT)
    m, dm = _up(u, limit, ACT)
    out = rows[:, None] * d_row_stride + (cols * d_col_stride)[None, :]
    if COMPUTE_DG:
        tl.store(DG_ptr + out, (da * m * df).to(DG_ptr.dtype.element_ty), mask=mask)
    if COMPUTE_DU:
        du = da * f * dm
        if PACKED_D:
            tl.store(DG_ptr + du_offset + out, du.to(DG_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(DU_ptr + du_offset + out, du.to(DU_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers: a fixed tile per width, kept per signature
# --------------------------------------------------------------------------------------------

TILE = 4096  # elements a program
_PLANS = PlanCache()


def _launch(n_rows: int, n_cols: int, device, act: int, backward: bool, needs=(True, True), packed=False):
    key = (n_rows, n_cols, device, act, backward, needs, packed)
    launch = _PLANS.get(key)
    if launch is None:
        check_runnable(device, ACT_NAMES[act])
        block_n = min(triton.next_power_of_2(n_cols), TILE)
        block_m = max(1, TILE // block_n)
        grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
        meta = dict(ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
        if backward:
            flags = dict(COMPUTE_DG=needs[0], COMPUTE_DU=needs[1], PACKED_D=packed)
            launch = Launch(_gated_bwd_kernel, grid, None, f"{ACT_NAMES[act]} bwd", **flags, **meta)
        else:
            launch = Launch(_gated_fwd_kernel, grid, None, f"{ACT_NAMES[act]} fwd", **meta)
        _PLANS.add(key, launch)
    return launch


def _packed_views(gate_up: torch.Tensor, interleaved: bool):
    """(gate, up) of a (..., 2F) tensor as 2-D (rows, F) views sharing its storage."""
    n_cols = gate_up.shape[-1] // 2
    gu = as_rows(gate_up, 2 * n_cols)
    if interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    return gu[:, :n_cols], gu[:, n_cols:]


def gated_forward(gate: torch.Tensor, up: torch.Tensor, act: int, alpha: float, limit: float) -> torch.Tensor:
    """f(gate) * m(up) for 2-D (rows, F) views with one column stride (1 or 2): (rows, F)."""
    n_rows, n_cols = gate.shape
    a = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if a.numel():
        _launch(n_rows, n_cols, gate.device, act, False)(
            gate, up, a, gate.stride(0), up.stride(0), gate.stride(1), n_rows, n_cols, alpha, limit
        )
    return a


def gated_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    act: int,
    alpha: float,
    limit: float,
    needs=(True, True),
    packed_out: torch.Tensor | None = None,
    interleaved: bool = False,
):
    """(dgate, dup) for 2-D views; with `packed_out` (a (rows, 2F) contiguous tensor) both are
    written into it in the inputs' packed layout and it is returned as dgate (dup None)."""
    n_rows, n_cols = gate.shape
    da = as_rows(grad, n_cols)
    dev = gate.device
    if packed_out is not None:
        dg = du = packed_out
        d_row, d_col, du_off = packed_out.stride(0), (2 if interleaved else 1), (1 if interleaved else n_cols)
    else:
        dg = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=dev) if needs[0] else None
        du = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=dev) if needs[1] else None
        d_row, d_col, du_off = n_cols, 1, 0
    if n_rows and n_cols and any(needs):
        packed = packed_out is not None
        _launch(n_rows, n_cols, dev, act, True, tuple(needs), packed)(
            da, gate, up, gate if dg is None else dg, gate if du is None or packed else du, da.stride(0),
            gate.stride(0), up.stride(0), gate.stride(1), d_row, d_col, du_off, n_rows, n_cols, alpha, limit,
        )  # fmt: skip
    if packed_out is not None:
        return packed_out, None
    return dg, du


def pair_forward(gate, up, act: int, alpha: float, limit: float) -> torch.Tensor:
    n = gate.shape[-1]
    return gated_forward(as_rows(gate, n), as_rows(up, n), act, alpha, limit).view(gate.shape)


def pair_backward(grad, gate, up, act: int, alpha: float, limit: float, need_gate: bool, need_up: bool):
    n = gate.shape[-1]
    dg, du = gated_backward(grad, as_rows(gate, n), as_rows(up, n), act, alpha, limit, (need_gate, need_up))
    return (None if dg is None else dg.view(gate.shape)), (None if du is None else du.view(gate.shape))


def packed_forward(gate_up, act: int, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    g, u = _packed_views(gate_up, interleaved)
    return gated_forward(g, u, act, alpha, limit).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def packed_backward(grad, gate_up, act: int, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    g, u = _packed_views(gate_up, interleaved)
    out = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    gated_backward(grad, g, u, act, alpha, limit, (True, True), out.view(-1, gate_up.shape[-1]), interleaved)
    return out


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Functions, entry points
# --------------------------------------------------------------------------------------------


def _pair_fwd_op(gate: torch.Tensor, up: torch.Tensor, act: int, alpha: float, limit: float) -> torch.Tensor:
    return pair_forward(gate, up, act, alpha, limit)


def _pair_bwd_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int, alpha: float, limit: float,
    need_gate: bool, need_up: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    dg, du = pair_backward(grad, gate, up, act, alpha, limit, need_gate, need_up)
    return (gate.new_empty(0) if dg is None else dg), (gate.new_empty(0) if du is None else du)


def _packed_fwd_op(
    gate_up: torch.Tensor, act: int, alpha: float, limit: float, interleaved: bool
) -> torch.Tensor:
    return packed_forward(gate_up, act, alpha, limit, interleaved)


def _packed_bwd_op(
    grad: torch.Tensor, gate_up: torch.Tensor, act: int, alpha: float, limit: float, interleaved: bool
) -> torch.Tensor:
    return packed_backward(grad, gate_up, act, alpha, limit, interleaved)


_pair_fwd = compiled_op("gated_fwd", _pair_fwd_op, lambda gate, up, *a: gate.new_empty(gate.shape))


def _pair_bwd_fake(grad, gate, up, act, alpha, limit, need_gate, need_up):
    return (gate.new_empty(gate.shape) if need_gate else gate.new_empty(0),
            gate.new_empty(gate.shape) if need_up else gate.new_empty(0))  # fmt: skip


_pair_bwd = compiled_op("gated_bwd", _pair_bwd_op, _pair_bwd_fake)
_packed_fwd = compiled_op(
    "gated_packed_fwd", _packed_fwd_op, lambda gu, *a: gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))
)
_packed_bwd = compiled_op("gated_packed_bwd", _packed_bwd_op, lambda grad, gu, *a: gu.new_empty(gu.shape))


class GatedFunction(torch.autograd.Function):
    """gate and up as two tensors: saves them (alive anyway), a gradient for each. Double
    backward (create_graph=True) is refused in one line (rows.double_backward_error)."""

    @staticmethod
    def forward(ctx, gate, up, act, alpha, limit):
        ctx.params = (act, alpha, limit)
        ctx.save_for_backward(gate, up)
        if torch.compiler.is_compiling():
            return _pair_fwd(gate)(gate, up, act, alpha, limit)
        return pair_forward(gate, up, act, alpha, limit)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[:2]
        act, alpha, limit = ctx.params
        if torch.compiler.is_compiling():
            dg, du = _pair_bwd(gate)(grad, gate, up, act, alpha, limit, need_g, need_u)
            return (dg if need_g else None), (du if need_u else None), None, None, None
        if torch.is_grad_enabled():
            raise double_backward_error(ACT_NAMES[act], EAGER_NAMES[act])
        return (*pair_backward(grad, gate, up, act, alpha, limit, need_g, need_u), None, None, None)


class GatedPackedFunction(torch.autograd.Function):
    """The packed (..., 2F) gate_up (halves or interleaved): its gradient is one tensor."""

    @staticmethod
    def forward(ctx, gate_up, act, alpha, limit, interleaved):
        ctx.params = (act, alpha, limit, interleaved)
        ctx.save_for_backward(gate_up)
        if torch.compiler.is_compiling():
            return _packed_fwd(gate_up)(gate_up, act, alpha, limit, interleaved)
        return packed_forward(gate_up, act, alpha, limit, interleaved)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        act, alpha, limit, interleaved = ctx.params
        if torch.compiler.is_compiling():
            return _packed_bwd(gate_up)(grad, gate_up, act, alpha, limit, interleaved), None, None, None, None
        if torch.is_grad_enabled():
            raise double_backward_error(ACT_NAMES[act], EAGER_NAMES[act])
        return packed_backward(grad, gate_up, act, alpha, limit, interleaved), None, None, None, None


def gated_pair(gate, up, act: int, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """f(gate) * m(up) on checked inputs: through autograd where a gradient is wanted."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return GatedFunction.apply(gate, up, act, alpha, limit)
    if torch.compiler.is_compiling():
        return _pair_fwd(gate)(gate, up, act, alpha, limit)
    return pair_forward(gate, up, act, alpha, limit)


def gated_packed(gate_up, act: int, alpha: float = 0.0, limit: float = 0.0, interleaved: bool = False):
    """f(gate) * m(up) for the halves (or interleaved columns) of a checked (..., 2F) gate_up."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return GatedPackedFunction.apply(gate_up, act, alpha, limit, interleaved)
    if torch.compiler.is_compiling():
        return _packed_fwd(gate_up)(gate_up, act, alpha, limit, interleaved)
    return packed_forward(gate_up, act, alpha, limit, interleaved)
