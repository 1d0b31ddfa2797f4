"""LayerNorm with a bias (nn.LayerNorm, F.layer_norm) in Triton: one pass forward, one backward.

    y = (x - mean) * rstd * w + b,   mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)

over the last dimension (N columns), y in x's dtype, fp32 inside, rounded once. The bias is
optional (nn.LayerNorm(bias=False)). Backward (x_hat = (x - mean) * rstd, g = dy * w):
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
    dw = the sum over rows of dy * x_hat,   db = the sum over rows of dy
The forward stores mean and rstd, one fp32 each a row; the backward reads x, dy and them. dw and
db are summed in fp32 per program on a persistent grid, then each (programs, N) partial in the
fixed-order column sum of kernels/colsum.py: bitwise repeatable.

Bytes, per element of the (rows, N) input (bf16: 2 B each; 8 B of statistics a row):
    forward    read x, write y                      2 tensors
    backward   read dy, x, write dx (+ partials)    3 tensors
torch's own CUDA LayerNorm moves the same in its forward and about as much in its backward (its
dw and db come from a second kernel over dy and x again), so this op's gain over nn.LayerNorm is
not derived, and it is not measured on a card: it exists so that pre-norm LayerNorm layouts
(StarCoder2, GPT-NeoX, Phi-1/2) run their norms under profuse's labels and with its repeatable
dweight. Its launch shapes are fixed rules below, not tuned.

Rows are held whole in registers up to configs.ADD_RMS_NORM_MAX_COLS columns (rms_norm's
limit); wider rows raise ValueError. x is read in place through one row stride (rows.as_rows).

Layout: the @triton.jit kernels; the launch rules and launchers; the compiled ops (torch.compile
calls them without a graph break); the autograd.Function; `layer_norm_fused`, the entry point
behind profuse.blockops.layer_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.env import sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import Launch, compiled_op
from profuse.kernels.colsum import col_sum_launch
from profuse.kernels.rows import as_rows, check_runnable, double_backward_error

MAX_COLS = C.ADD_RMS_NORM_MAX_COLS


@triton.jit
def _layer_norm_fwd_kernel(
    X_ptr,  # (n_rows, n_cols), rows x_row_stride apart, unit column stride
    W_ptr,  # (n_cols,)
    B_ptr,  # (n_cols,) bias; unused unless HAS_BIAS
    Y_ptr,  # (n_rows, n_cols) out in x's dtype, contiguous
    MEAN_ptr,  # (n_rows,) fp32 out, for the backward; unused unless STORE_STATS
    RSTD_ptr,  # (n_rows,) fp32 out; unused unless STORE_STATS
    x_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_M: tl.constexpr,  # rows per program: several when rows are narrow
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row is held
    HAS_BIAS: tl.constexpr,
    STORE_STATS: tl.constexpr,
):
    """BLOCK_M whole rows: the mean, the centred variance (two passes over registers, not
    E[x^2] - E[x]^2, which cancels), y rounded once."""
    eps = tl.cast(eps, tl.float32)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols  # masked columns hold 0
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(MEAN_ptr + rows, mean, mask=row_mask)
        tl.store(RSTD_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY_ptr,  # (n_rows, n_cols), rows dy_row_stride apart, unit column stride
    X_ptr,  # (n_rows, n_cols) as the forward read it
    W_ptr,  # (n_cols,)
    MEAN_ptr,  # (n_rows,) fp32, the forward's
    RSTD_ptr,  # (n_rows,) fp32, the forward's
    DX_ptr,  # (n_rows, n_cols) out in x's dtype, contiguous; unused unless STORE_DX
    DW_ptr,  # (programs, n_cols) fp32 out: this program's partial of dw; unused unless COMPUTE_DW
    DB_ptr,  # (programs, n_cols) fp32 out: this program's partial of db; unused unless HAS_BIAS
    dy_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    BLOCK_N: tl.constexpr,
    STORE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,  # the weight's and the bias's partials
    HAS_BIAS: tl.constexpr,
):
    """Persistent grid: program p takes rows p, p + P, ...; dx per row, dw and db summed over the
    program's rows in fp32 and stored as its partial rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in tl.range(pid, n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        x = tl.load(X_ptr + row * x_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + row * dy_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN_ptr + row)
        rstd = tl.load(RSTD_ptr + row)
        x_hat = tl.where(col_mask, (x - mean) * rstd, 0.0)
        if STORE_DX:
            g = dy * w
            c_g = tl.sum(g, axis=0) / n_cols
            c_gx = tl.sum(g * x_hat, axis=0) / n_cols
            dx = rstd * (g - c_g - x_hat * c_gx)
            tl.store(DX_ptr + row * n_cols + cols, dx.to(DX_ptr.dtype.element_ty), mask=col_mask)
        dw += dy * x_hat
        db += dy
    if COMPUTE_DW:
        part = pid.to(tl.int64) * n_cols + cols
        tl.store(DW_ptr + part, dw, mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_ptr + part, db, mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch rules and launchers
# --------------------------------------------------------------------------------------------
# Fixed rules, not tuned (no card has timed this op): the whole row in one program's registers,
# four rows to a program while rows are 512 columns or fewer, warps growing with the row as
# rms_norm's favourite candidates do; the backward on four programs an SM (CPU: the
# interpreter's stand-in count), never more than there are rows.


def _too_wide(n_cols: int) -> ValueError:
    return ValueError(
        f"layer_norm holds whole rows in registers: at most {MAX_COLS} columns, got {n_cols} "
        "(a chunked kernel for wider rows is not written yet)"
    )


def _warps(block_n: int) -> int:
    return 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16


def _forward_launch(n_rows: int, n_cols: int, has_bias: bool, store_stats: bool) -> Launch:
    block_n = triton.next_power_of_2(n_cols)
    block_m = 4 if block_n <= 512 else 1
    return Launch(
        _layer_norm_fwd_kernel, (triton.cdiv(n_rows, block_m),), None, "layer_norm fwd",
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias, STORE_STATS=store_stats,
        num_warps=_warps(block_n),
    )  # fmt: skip


def layer_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    store_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, mean, rstd) for x (..., N): y in x's dtype, contiguous; mean and rstd fp32 shaped
    x.shape[:-1] (None when `store_stats` is off: no gradient wanted)."""
    n_cols = x.shape[-1]
    if n_cols > MAX_COLS:
        raise _too_wide(n_cols)
    xr = as_rows(x, n_cols)
    n_rows, dev = xr.shape[0], x.device
    y = torch.empty(x.shape, dtype=x.dtype, device=dev)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_stats else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_stats else None
    if n_rows == 0:
        return y, mean, rstd
    check_runnable(dev, "layer_norm")
    w = weight.contiguous()
    # Pointers a flag leaves unused get any tensor: the kernel never touches them.
    args = (xr, w, w if bias is None else bias.contiguous(), y, y if mean is None else mean,
            y if rstd is None else rstd, xr.stride(0), n_rows, n_cols, eps)  # fmt: skip
    _forward_launch(n_rows, n_cols, bias is not None, store_stats)(*args)
    return y, mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    needs: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias): dx shaped and typed as x; dweight and dbias in the weight's dtype
    (dbias None without a bias); None where `needs` = (dx, the weight's and bias's) says no."""
    need_x, need_w = needs
    n_cols = x.shape[-1]
    xr, dyr = as_rows(x, n_cols), as_rows(dy, n_cols)
    n_rows, dev = xr.shape[0], x.device
    dx = torch.empty(x.shape, dtype=x.dtype, device=dev) if need_x else None
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
    db = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w and has_bias else None
    if n_rows == 0 or not (need_x or need_w):
        return dx, (dw.zero_() if dw is not None else None), (db.zero_() if db is not None else None)
    check_runnable(dev, "layer_norm")
    programs = max(1, min(4 * sm_count(dev), n_rows))
    dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=dev) if need_w else None
    db_part = torch.empty((programs, n_cols), dtype=torch.float32, device=dev) if db is not None else None
    block_n = triton.next_power_of_2(n_cols)
    launch = Launch(
        _layer_norm_bwd_kernel, (programs,), None, "layer_norm bwd",
        BLOCK_N=block_n, STORE_DX=need_x, COMPUTE_DW=need_w, HAS_BIAS=db is not None,
        num_warps=_warps(block_n),
    )  # fmt: skip
    out = dx if dx is not None else xr
    launch(dyr, xr, weight.contiguous(), mean, rstd, out, xr if dw_part is None else dw_part,
           xr if db_part is None else db_part, dyr.stride(0), xr.stride(0), n_rows, n_cols)  # fmt: skip
    if dw_part is not None:
        # One reduction over the programs' partials each, in a fixed order: the same bits every run.
        col_sum_launch(n_cols)(dw_part, dw, programs, n_cols)
    if db_part is not None:
        col_sum_launch(n_cols)(db_part, db, programs, n_cols)
    return dx, dw, db


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


def _forward_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, has_bias: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = layer_norm_forward(x, weight, bias if has_bias else None, eps)
    return y, mean, rstd


def _forward_fake(x, weight, bias, has_bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)


def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); an empty tensor (each its own) where not asked for."""
    dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, has_bias, (need_x, need_w))
    return (x.new_empty(0) if dx is None else dx, x.new_empty(0) if dw is None else dw,
            x.new_empty(0) if db is None else db)  # fmt: skip


def _backward_fake(dy, x, weight, mean, rstd, has_bias, need_x, need_w):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w and has_bias else x.new_empty(0))  # fmt: skip


_forward_compiled = compiled_op("layer_norm_fwd", _forward_op, _forward_fake)
_backward_compiled = compiled_op("layer_norm_bwd", _backward_op, _backward_fake)


class LayerNormFunction(torch.autograd.Function):
    """Saves x (the input: alive anyway), the weight and two fp32 numbers a row (mean, rstd).
    Eager calls go to the launchers; a traced call, to the compiled ops. Double backward is
    refused in one line."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        has_bias = bias is not None
        if torch.compiler.is_compiling():
            y, mean, rstd = _forward_compiled(x)(x, weight, bias if has_bias else weight, has_bias, eps)
        else:
            y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = has_bias
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        needs = (need_x, need_w or need_b)
        if torch.compiler.is_compiling():
            dx, dw, db = _backward_compiled(x)(dy, x, weight, mean, rstd, ctx.has_bias, *needs)
        else:
            if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
                raise double_backward_error("layer_norm", "profuse.blockops.layer_norm_eager")
            dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, ctx.has_bias, needs)
        return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None


def layer_norm_fused(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """y on checked inputs: through autograd where a gradient is wanted, else the forward launch
    alone (no autograd node, no statistics stored). Rows wider than MAX_COLS: ValueError."""
    if x.shape[-1] > MAX_COLS:
        raise _too_wide(x.shape[-1])
    wants = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and wants:
        return LayerNormFunction.apply(x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return _forward_compiled(x)(x, weight, weight if bias is None else bias, bias is not None, eps)[0]
    return layer_norm_forward(x, weight, bias, eps, store_stats=False)[0]
