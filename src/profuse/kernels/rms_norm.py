"""RMSNorm alone (no residual add in front) in Triton: one pass forward, one pass backward.

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)         y in x's dtype

Backward (x_hat = x * rstd, N = cols):
    dx = rstd * (w * dy - x_hat * mean(x_hat * w * dy))
    dw = sum over rows of dy * x_hat

This is add_rms_norm's backward with h = x and no dh, so the backward is that kernel itself
(profuse.kernels.add_rms_norm.add_rms_norm_backward: a persistent grid, fp32 dw partials, then
the fixed-order column sum of kernels/colsum.py, so dweight is bitwise repeatable). What is new
here is the forward: add_rms_norm's reads a residual and writes h, which a plain norm has not.

Bytes, per element of the (rows, N) input (bf16: 2 B each; rstd is 4 B a row, w N elements):
    forward    read x, write y                      2 tensors   (add_rms_norm's moves 4)
    backward   read dy, x, write dx (+ dw partials) 3 tensors
Hugging Face's LlamaRMSNorm, eager, in bf16: x.to(fp32) (2 + 4 B), pow (4 + 4), mean (4),
x * rsqrt (4 + 4 + 4), .to(bf16) (4 + 2), weight * (2 + 2): 40 B an element against 4 here.

x is read in place through one row stride (strided rows, as rows.as_rows sees them); rows are
held whole in registers up to configs.ADD_RMS_NORM_MAX_COLS columns (the backward's limit);
wider rows raise ValueError. The forward's launch shapes are add_rms_norm's candidates (whole
rows, several to a program when narrow), tuned for this kernel under its own key.

Layout: the @triton.jit kernel; the launchers; the compiled ops (torch.compile calls them
without a graph break); the autograd.Function; `rms_norm_fused`, the entry point behind
profuse.blockops.rms_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.env import sm_count
from profuse.kernels import configs as C
from profuse.kernels.add_rms_norm import add_rms_norm_backward
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing, compiled_op
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import as_rows, check_runnable, double_backward_error

MAX_COLS = C.ADD_RMS_NORM_MAX_COLS


@triton.jit
def _rms_norm_fwd_kernel(
    X_ptr,  # (n_rows, n_cols), rows x_row_stride apart, unit column stride
    W_ptr,  # (n_cols,)
    Y_ptr,  # (n_rows, n_cols) out in x's dtype, contiguous
    RSTD_ptr,  # (n_rows,) fp32 out, for the backward; unused unless STORE_RSTD
    x_row_stride,
    n_rows,
    n_cols,
    eps,
    w_offset,  # added to w in fp32: 1.0 for Gemma's (1 + w) norms, else 0.0
    BLOCK_M: tl.constexpr,  # rows per tile: several when rows are narrow
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row is held
    NUM_STAGES: tl.constexpr,  # pipelining of the tile loop (persistent grids)
    STORE_RSTD: tl.constexpr,
):
    """Tiles of BLOCK_M whole rows: y = x * rstd * w, rounded once. Program p takes tiles p,
    p + P, ...: one each where the grid covers every tile, else a persistent loop that loads the
    next tile while it reduces this one."""
    eps = tl.cast(eps, tl.float32)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    for tile in tl.range(
        tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES
    ):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # masked columns hold 0
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD_ptr + rows, rstd, mask=row_mask)


# --------------------------------------------------------------------------------------------
# Launch plans and launchers
# --------------------------------------------------------------------------------------------

# Forward plans by (rows, cols, x and weight dtypes, device, rstd stored): a call looks its plan
# up and launches. The backward's plans are add_rms_norm's own.
_FWD_PLANS = PlanCache()


def _too_wide(n_cols: int) -> ValueError:
    return ValueError(
        f"rms_norm holds whole rows in registers: at most {MAX_COLS} columns, got {n_cols} "
        "(a chunked kernel for wider rows is not written yet)"
    )


def _forward_launch(cfg: KernelConfig, n_rows: int, store_rstd: bool) -> Launch:
    """The forward kernel of `cfg`, bound to its grid. Runtime arguments:
    (x, w, y, rstd, x_row_stride, n_rows, n_cols, eps)."""
    n_tiles = triton.cdiv(n_rows, cfg.block_m)
    grid = (min(cfg.programs, n_tiles) if cfg.programs else n_tiles,)
    return Launch(
        _rms_norm_fwd_kernel, grid, cfg, "rms_norm fwd",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, STORE_RSTD=store_rstd,
        num_warps=cfg.num_warps,
    )  # fmt: skip


def _forward_plan(key: tuple, args: tuple) -> Launch:
    """The forward's launch for a new signature: the tuned config (timed now if its tuning key
    is new), bound to this shape's grid."""
    n_rows, n_cols, x_dtype, w_dtype, device, store_rstd = key
    check_runnable(device, "rms_norm")
    candidates = C.add_rms_norm_forward_candidates(n_rows, n_cols, sm_count(device))
    tune_key = ("rms_norm_fwd", C.pow2_rows(n_rows), n_cols, x_dtype, w_dtype, store_rstd)

    def run(c):  # returns y, so the tuner compares each candidate's answer
        _forward_launch(c, n_rows, store_rstd)(*args)
        return args[2]

    return _forward_launch(TUNER.pick(tune_key, candidates, run, device), n_rows, store_rstd)


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: KernelConfig | None = None,
    store_rstd: bool = True,
    w_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, rstd) for x (..., N): y in x's dtype, contiguous; rstd fp32 shaped x.shape[:-1]
    (None when `store_rstd` is off: no gradient wanted). `config` runs that launch shape;
    without it the shape's plan runs (tuned on its first call)."""
    n_cols = x.shape[-1]
    if n_cols > MAX_COLS:
        raise _too_wide(n_cols)
    xr = as_rows(x, n_cols)
    n_rows, dev = xr.shape[0], x.device
    y = torch.empty(x.shape, dtype=x.dtype, device=dev)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_rstd else None
    if n_rows == 0:
        return y, rstd
    # Without rstd, y stands in for its pointer (STORE_RSTD is off).
    args = (
        xr,
        weight.contiguous(),
        y,
        y if rstd is None else rstd,
        xr.stride(0),
        n_rows,
        n_cols,
        eps,
        w_offset,
    )
    if config is not None:
        launch = _forward_launch(config, n_rows, store_rstd)
    else:
        key = (n_rows, n_cols, x.dtype, weight.dtype, dev, store_rstd)
        launch = _FWD_PLANS.get(key)
        if launch is None:
            launch = _forward_plan(key, args)
            if not capturing(dev):  # a plan made inside a graph capture is untuned: not kept
                _FWD_PLANS.add(key, launch)
    launch(*args)
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    needs: tuple[bool, bool] = (True, True),
    config: KernelConfig | None = None,
    inplace: bool = False,
    w_offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight), None where `needs` says no: add_rms_norm's backward with h = x, no dh
    (`inplace`: dx over dy where it fits)."""
    need_x, need_w = needs
    dx, _, dw = add_rms_norm_backward(
        dy, None, x, weight, rstd, x.dtype, x.dtype, (need_x, False, need_w), config, inplace, w_offset
    )
    return dx, dw


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


def _forward_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, w_offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = rms_norm_forward(x, weight, eps, w_offset=w_offset)
    return y, rstd


def _forward_fake(x, weight, eps, w_offset):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_x: bool,
    need_w: bool,
    w_offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight); an empty tensor (each its own) where not asked for."""
    dx, dw = rms_norm_backward(dy, x, weight, rstd, (need_x, need_w), w_offset=w_offset)
    return (x.new_empty(0) if dx is None else dx), (x.new_empty(0) if dw is None else dw)


def _backward_fake(dy, x, weight, rstd, need_x, need_w, w_offset):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else x.new_empty(0))  # fmt: skip


# The ops torch.compile calls: profuse::rms_norm_fwd / _bwd (opaque), and on CUDA their
# Triton-op twins, whose kernels Inductor launches itself (kernels/autotune.compiled_op).
_forward_compiled = compiled_op("rms_norm_fwd", _forward_op, _forward_fake)
_backward_compiled = compiled_op("rms_norm_bwd", _backward_op, _backward_fake)


class RMSNormFunction(torch.autograd.Function):
    """Saves x (the input: alive anyway), the weight and one fp32 rstd per row. Eager calls go to
    the launchers; a traced call, to the compiled ops. Double backward is refused in one line."""

    @staticmethod
    def forward(ctx, x, weight, eps, inplace=False, w_offset=0.0):
        ctx.inplace, ctx.w_offset = inplace, w_offset
        if torch.compiler.is_compiling():
            y, rstd = _forward_compiled(x)(x, weight, eps, w_offset)
        else:
            y, rstd = rms_norm_forward(x, weight, eps, w_offset=w_offset)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if torch.compiler.is_compiling():
            dx, dw = _backward_compiled(x)(dy, x, weight, rstd, need_x, need_w, ctx.w_offset)
            return (dx if need_x else None), (dw if need_w else None), None, None, None
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
            raise double_backward_error("rms_norm", "profuse.blockops.rms_norm_eager")
        grads = rms_norm_backward(
            dy, x, weight, rstd, (need_x, need_w), inplace=ctx.inplace, w_offset=ctx.w_offset
        )
        return (*grads, None, None, None)


def rms_norm_fused(
    x: torch.Tensor, weight: torch.Tensor, eps: float, inplace_backward: bool = False, w_offset: float = 0.0
) -> torch.Tensor:
    """y on checked inputs: through autograd where a gradient is wanted, else the forward launch
    alone (no autograd node, no rstd stored). Rows wider than MAX_COLS: ValueError."""
    if x.shape[-1] > MAX_COLS:
        raise _too_wide(x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps, inplace_backward, w_offset)
    if torch.compiler.is_compiling():
        return _forward_compiled(x)(x, weight, eps, w_offset)[0]
    return rms_norm_forward(x, weight, eps, store_rstd=False, w_offset=w_offset)[0]
