"""The residual add and the next RMSNorm in Triton: one pass forward, one pass backward.

    h = x + residual,   y = h * rstd * w,   rstd = 1 / sqrt(mean(h^2) + eps)   -> (y, h)

Forward reads x and residual and writes y and h (4 tensors, each in its own dtype) and one fp32
rstd per row for the backward. h comes out in the dtype `x + residual` has (bf16 + fp32 ->
fp32) and y in x's dtype (see profuse.blockops). h is rounded to its dtype before the norm: y
normalises the h that is stored, the residual stream the next block reads, as eager does, and
the backward recomputes x_hat from that same stored h.

Backward (x_hat = h * rstd, N = cols; dy and dh are the gradients of y and h, either absent):
    dh_total = rstd * (w * dy - x_hat * mean(x_hat * w * dy)) + dh
    dx = dresidual = dh_total           (dx in x's dtype, dresidual in residual's)
    dw = sum over rows of dy * x_hat     (in w's dtype)
It reads dy, dh and h and writes dx and dresidual: one tensor for both where their dtypes agree
(as add's own backward hands one gradient to both inputs), so 4 tensors, or 5. It saves only h
(an output: no memory of its own) and rstd, never x and residual. Without dy (y fed nothing that
needs a gradient) dh passes straight through and no kernel runs; without dh (h unused) the
kernel is compiled without its loads. dw is summed in fp32 per program over a persistent grid,
then the (programs, N) partials are summed in one fixed order (kernels/colsum.py): no atomics,
so dweight is bitwise repeatable.

Whole rows are held in registers, several rows per program for narrow rows, up to
configs.ADD_RMS_NORM_MAX_COLS columns; wider rows raise ValueError (a chunked kernel, as the
tail has, is later work). Launch shapes are chosen per shape by kernels/configs.py and
kernels/autotune.py once, and kept as the signature's plan: a later call is a dictionary lookup
and its launches.

Layout: the @triton.jit kernels; the launch plans; the launchers; the compiled ops (torch.compile
calls them without a graph break); the autograd.Function; and `add_rms_norm_fused`, the entry
point behind profuse.blockops.add_rms_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.env import sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing, compiled_op, scratch_key
from profuse.kernels.colsum import col_sum_launch
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import as_rows, check_runnable, double_backward_error, fits

MAX_COLS = C.ADD_RMS_NORM_MAX_COLS

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_fwd_kernel(
    X_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,  # (n_rows, n_cols) out in x's dtype, contiguous
    H_ptr,  # (n_rows, n_cols) out in promote(x, residual)'s dtype, contiguous
    RSTD_ptr,  # (n_rows,) fp32, for the backward
    x_row_stride,  # row strides in elements; columns are contiguous
    r_row_stride,
    n_rows,
    n_cols,
    eps,
    w_offset,  # added to w in fp32: 1.0 for Gemma's (1 + w) norms, else 0.0
    BLOCK_M: tl.constexpr,  # rows per tile: several when rows are narrow
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row is held
    NUM_STAGES: tl.constexpr,  # pipelining of the tile loop (persistent grids)
    STORE_RSTD: tl.constexpr,
):
    """Tiles of BLOCK_M whole rows: h = x + r (rounded to h's dtype), y = h * rstd * (w + w_offset).

    Program p takes tiles p, p + P, ...: one tile each when the grid covers every tile, or a
    persistent loop that loads the next tile while it reduces this one.
    """
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        c2 = cols[None, :]
        x = tl.load(X_ptr + rows[:, None] * x_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R_ptr + rows[:, None] * r_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
        out = rows[:, None] * n_cols + c2
        h = (x + r).to(H_ptr.dtype.element_ty)
        tl.store(H_ptr + out, h, mask=mask)
        h = h.to(tl.float32)  # masked columns give h = 0 and leave the sum alone
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        y = h * rstd[:, None] * w[None, :]
        tl.store(Y_ptr + out, y.to(Y_ptr.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _add_rms_norm_bwd_kernel(
    DY_ptr,
    DH_ptr,  # h's gradient; unused unless HAS_DH
    H_ptr,
    W_ptr,
    RSTD_ptr,
    D1_ptr,  # (n_rows, n_cols) contiguous: dx, or dresidual when only it is asked for
    D2_ptr,  # (n_rows, n_cols) contiguous: dresidual in its own dtype; unused unless STORE_D2
    DW_ptr,  # (programs, n_cols) fp32 partial sums of dy * x_hat, one row per program
    dy_row_stride,
    dh_row_stride,
    h_row_stride,
    n_rows,
    n_cols,
    w_offset,  # added to w in fp32 (the forward's)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # whole row
    NUM_STAGES: tl.constexpr,  # software pipelining of the tile loop: the next tile loads early
    HAS_DH: tl.constexpr,
    STORE_D1: tl.constexpr,
    STORE_D2: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """Persistent grid: program p takes row tiles p, p + P, ... and, per row,

    x_hat    = h * rstd,  w = the weight + w_offset
    dh_total = rstd * (w * dy - x_hat * mean(x_hat * w * dy)) + dh   -> D1 (and D2), rounded once
    dw      += dy * x_hat                                           (fp32, this program's rows)
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        c2 = cols[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H_ptr + rows[:, None] * h_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
        x_hat = h * rstd[:, None]
        if COMPUTE_DW:
            dw_acc += dy * x_hat
        if STORE_D1:
            wdy = w[None, :] * dy
            c = tl.sum(x_hat * wdy, axis=1) / n_cols
            d = (wdy - x_hat * c[:, None]) * rstd[:, None]
            if HAS_DH:
                d += tl.load(DH_ptr + rows[:, None] * dh_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
            out = rows[:, None] * n_cols + c2
            tl.store(D1_ptr + out, d.to(D1_ptr.dtype.element_ty), mask=mask)
            if STORE_D2:
                tl.store(D2_ptr + out, d.to(D2_ptr.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch plans: built on the first call of a signature, then looked up
# --------------------------------------------------------------------------------------------

# Forward plans by (rows, cols, x/residual/weight dtypes, device, rstd stored); backward plans by
# (rows, cols, x/residual/weight dtypes, device, dh given, gradients asked for). A plan is what
# the autotuner chose for the shape, bound to its grid: a call looks it up and launches.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _too_wide(n_cols: int) -> ValueError:
    return ValueError(
        f"add_rms_norm holds whole rows in registers: at most {MAX_COLS} columns, got {n_cols} "
        "(a chunked kernel for wider rows is not written yet)"
    )


def _forward_launch(cfg: KernelConfig, n_rows: int, n_cols: int, store_rstd: bool) -> Launch:
    """The forward kernel of `cfg`, bound to its grid for this shape. Runtime arguments:
    (x, residual, w, y, h, rstd, x/residual row strides, n_rows, n_cols, eps)."""
    n_tiles = triton.cdiv(n_rows, cfg.block_m)
    grid = (min(cfg.programs, n_tiles) if cfg.programs else n_tiles,)
    return Launch(
        _add_rms_norm_fwd_kernel, grid, cfg, "add_rms_norm fwd",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, STORE_RSTD=store_rstd,
        num_warps=cfg.num_warps,
    )  # fmt: skip


class _BackwardPlan:
    """The backward for one shape, set of dtypes and set of gradients: its launches, fixed.

    Calling it allocates the input gradients asked for and dw, and launches the gradient
    kernel, then the column sum of the dw partials. The fp32 partials, one row per program, are
    scratch: kept per stream (autotune.scratch_key), not allocated per call.
    """

    __slots__ = ("config", "programs", "main", "col_sum", "d1_dtype", "d2_dtype", "need_x", "need_r",
                 "partials")  # fmt: skip

    def __init__(
        self, cfg: KernelConfig, n_rows: int, n_cols: int, dtypes: tuple, has_dh: bool, needs: tuple
    ):
        x_dtype, r_dtype, _ = dtypes
        need_x, need_r, need_w = needs
        self.config = cfg
        self.need_x, self.need_r = need_x, need_r
        # D1 is dx (or dresidual alone); D2 is dresidual when it needs a dtype of its own.
        self.d1_dtype = (x_dtype if need_x else r_dtype) if (need_x or need_r) else None
        self.d2_dtype = r_dtype if need_x and need_r and r_dtype != x_dtype else None
        # Every program has a tile, so every row of the dw partials gets written.
        self.programs = programs = min(cfg.programs, triton.cdiv(n_rows, cfg.block_m))
        self.main = Launch(
            _add_rms_norm_bwd_kernel, (programs,), cfg, "add_rms_norm bwd",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, HAS_DH=has_dh,
            STORE_D1=self.d1_dtype is not None, STORE_D2=self.d2_dtype is not None, COMPUTE_DW=need_w,
            num_warps=cfg.num_warps,
        )  # fmt: skip
        self.col_sum = col_sum_launch(n_cols) if need_w else None
        self.partials: dict = {}  # scratch_key -> the (programs, N) fp32 dw partials

    def __call__(
        self, dy, dh, h, w, rstd, like, over=(None, None), w_offset: float = 0.0
    ) -> tuple[torch.Tensor | None, ...]:
        """(dx, dresidual, dweight) over 2-D row views: dx and dresidual shaped and strided as
        `like` (the saved h itself), one tensor where their dtypes agree and both are asked
        for; None where not asked for. `over`: buffers to write D1 and D2 into instead of new
        ones (inplace_backward; the caller checked they fit: rows.fits)."""
        n_rows, n_cols = h.shape
        cf, d1_dtype, d2_dtype = torch.contiguous_format, self.d1_dtype, self.d2_dtype
        d1 = d2 = None
        if d1_dtype is not None:
            d1 = over[0] if over[0] is not None else torch.empty_like(like, dtype=d1_dtype, memory_format=cf)
        if d2_dtype is not None:
            d2 = over[1] if over[1] is not None else torch.empty_like(like, dtype=d2_dtype, memory_format=cf)
        partial = None
        if self.col_sum is not None:
            key = scratch_key(h.device)
            partial = self.partials.get(key) if key is not None else None
            if partial is None:
                partial = torch.empty((self.programs, n_cols), dtype=torch.float32, device=h.device)
                if key is not None:
                    self.partials[key] = partial
        # Pointers not used get any tensor: their flag is off, the kernel never touches them.
        self.main(dy, h if dh is None else dh, h, w, rstd, h if d1 is None else d1, h if d2 is None else d2,
                  h if partial is None else partial, dy.stride(0), 0 if dh is None else dh.stride(0),
                  h.stride(0), n_rows, n_cols, w_offset)  # fmt: skip
        dw = None
        if partial is not None:
            # One reduction over the programs' partials, in a fixed order: the same bits every run.
            dw = torch.empty_like(w)
            self.col_sum(partial, dw, self.programs, n_cols)
        dx = d1 if self.need_x else None
        dr = (d1 if d2 is None else d2) if self.need_r else None
        return dx, dr, dw


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def add_rms_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: KernelConfig | None = None,
    store_rstd: bool = True,
    w_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward on (..., N) inputs: (y, h, rstd), y in x's dtype, h in the promoted
    dtype, rstd fp32 shaped x.shape[:-1] (None when `store_rstd` is off: no gradient wanted).
    `w_offset` is added to the weight in fp32 (1.0: Gemma's (1 + w)).

    `config` runs that launch shape; without it the shape's plan runs (tuned on its first call).
    """
    n_cols = x.shape[-1]
    xr, rr = as_rows(x, n_cols), as_rows(residual, n_cols)
    n_rows = xr.shape[0]
    dev = x.device
    # empty_like parses its arguments in about half the time of torch.empty(shape, dtype=, device=)
    # (research/HOST_WIRING.md: 9.0k against 20.1k instructions a call).
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    h = torch.empty_like(x, dtype=h_dtype, memory_format=torch.contiguous_format)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_rstd else None
    if n_rows == 0:
        return y, h, rstd
    # Without rstd, y stands in for its pointer (STORE_RSTD is off).
    w = weight.contiguous()
    args = (xr, rr, w, y, h, y if rstd is None else rstd, xr.stride(0), rr.stride(0), n_rows, n_cols, eps,
            w_offset)  # fmt: skip
    if config is not None:
        launch = _forward_launch(config, n_rows, n_cols, store_rstd)
    else:
        key = (n_rows, n_cols, x.dtype, residual.dtype, weight.dtype, dev, store_rstd)
        launch = _FWD_PLANS.get(key)
        if launch is None:
            launch = _forward_plan(key, args)
            if not capturing(dev):  # a plan made inside a graph capture is untuned: not kept
                _FWD_PLANS.add(key, launch)
    launch(*args)
    return y, h, rstd


def _forward_plan(key: tuple, args: tuple) -> Launch:
    """The forward's launch for a new signature: the tuned config (timed now if its tuning key
    is new), bound to this shape's grid."""
    n_rows, n_cols, x_dtype, r_dtype, w_dtype, device, store_rstd = key
    check_runnable(device, "add_rms_norm")
    if n_cols > MAX_COLS:
        raise _too_wide(n_cols)
    candidates = C.add_rms_norm_forward_candidates(n_rows, n_cols, sm_count(device))
    # Whether rstd is stored is a different kernel: one timed without the store is not picked
    # for the other (the tail's forward ran 68.9 us tuned as itself, 80.3 us on the other's pick).
    tune_key = ("add_rms_norm_fwd", C.pow2_rows(n_rows), n_cols, x_dtype, r_dtype, w_dtype, store_rstd)
    run = lambda c: _forward_launch(c, n_rows, n_cols, store_rstd)(*args)
    return _forward_launch(TUNER.pick(tune_key, candidates, run, device), n_rows, n_cols, store_rstd)


def add_rms_norm_backward(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    needs: tuple[bool, bool, bool],
    config: KernelConfig | None = None,
    inplace: bool = False,
    w_offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dresidual, dweight) from dy (required), dh (None: h needs no gradient), the saved h
    and rstd; None where `needs` says no. Where x and residual share a dtype and both gradients
    are asked for, dx and dresidual are the same tensor (autograd hands it to both).

    `config` runs that launch shape; without it the shape's plan runs (tuned on its first call).
    `inplace`: the first gradient (dx, or dresidual alone) is written over dy and a dresidual of
    its own dtype over dh, each where it fits (rows.fits); a program reads its rows of
    dy and dh before it stores them, so the same math.
    """
    n_cols = h.shape[-1]
    hr = as_rows(h, n_cols)
    n_rows = hr.shape[0]
    need_x, need_r, need_w = needs
    if n_rows == 0 or not any(needs):
        dev = h.device
        dx = torch.empty(h.shape, dtype=x_dtype, device=dev) if need_x else None
        dr = torch.empty(h.shape, dtype=residual_dtype, device=dev) if need_r else None
        return dx, dr, torch.zeros(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
    dyr = as_rows(dy, n_cols)
    dhr = None if dh is None else as_rows(dh, n_cols)
    has_dh = dh is not None
    w = weight.contiguous()
    dtypes = (x_dtype, residual_dtype, weight.dtype)
    if config is not None:
        plan = _BackwardPlan(config, n_rows, n_cols, dtypes, has_dh, needs)
    else:
        key = (n_rows, n_cols, dtypes, h.device, has_dh, needs)
        plan = _BWD_PLANS.get(key)
        if plan is None:
            plan = _backward_plan(key, (dyr, dhr, hr, w, rstd, h))
            if not capturing(h.device):  # a plan made inside a graph capture is untuned: not kept
                _BWD_PLANS.add(key, plan)
    over = (None, None)
    if inplace:
        d1 = dy if plan.d1_dtype is not None and fits(dy, h.shape, plan.d1_dtype) else None
        d2 = dh if plan.d2_dtype is not None and fits(dh, h.shape, plan.d2_dtype) else None
        over = (d1, d2)
    return plan(dyr, dhr, hr, w, rstd, h, over, w_offset)


def _backward_plan(key: tuple, args: tuple) -> _BackwardPlan:
    """The backward's plan for a new signature: the tuned config (timed now if its tuning key
    is new; each candidate's run includes its dw column sum)."""
    n_rows, n_cols, dtypes, device, has_dh, needs = key
    check_runnable(device, "add_rms_norm")
    candidates = C.add_rms_norm_backward_candidates(n_rows, n_cols, sm_count(device))
    tune_key = ("add_rms_norm_bwd", C.pow2_rows(n_rows), n_cols, *dtypes, has_dh, needs)
    run = lambda c: _BackwardPlan(c, n_rows, n_cols, dtypes, has_dh, needs)(*args)
    return _BackwardPlan(TUNER.pick(tune_key, candidates, run, device), n_rows, n_cols, dtypes, has_dh, needs)


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


def _forward_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, w_offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps, w_offset=w_offset)


def _forward_fake(x, residual, weight, eps, w_offset):
    h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1], dtype=torch.float32)


def _backward_op(
    dy: torch.Tensor,
    dh: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    has_dh: bool,
    need_x: bool,
    need_residual: bool,
    need_weight: bool,
    w_offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dresidual, dweight); an empty tensor where not asked for, and in dresidual's place
    where it is dx itself (same dtype, both asked for): an op's outputs may not alias each other,
    so each empty is its own (one shared empty fails torch's aliasing check when only one
    gradient is asked for)."""
    dx, dr, dw = add_rms_norm_backward(dy, dh if has_dh else None, h, weight, rstd, x_dtype, residual_dtype,
                                       (need_x, need_residual, need_weight), w_offset=w_offset)  # fmt: skip
    return (h.new_empty(0) if dx is None else dx, h.new_empty(0) if dr is None or dr is dx else dr,
            h.new_empty(0) if dw is None else dw)  # fmt: skip


def _backward_fake(
    dy, dh, h, weight, rstd, x_dtype, residual_dtype, has_dh, need_x, need_residual, need_weight, w_offset
):
    shared = need_x and need_residual and x_dtype == residual_dtype
    return (h.new_empty(h.shape, dtype=x_dtype) if need_x else h.new_empty(0),
            h.new_empty(h.shape, dtype=residual_dtype) if need_residual and not shared else h.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else h.new_empty(0))  # fmt: skip


# The ops torch.compile calls: profuse::add_rms_norm_fwd / _bwd (opaque), and on CUDA their
# Triton-op twins, whose kernels Inductor launches itself (kernels/autotune.compiled_op).
_forward_compiled = compiled_op("add_rms_norm_fwd", _forward_op, _forward_fake)
_backward_compiled = compiled_op("add_rms_norm_bwd", _backward_op, _backward_fake)


class AddRMSNormFunction(torch.autograd.Function):
    """Saves h (an output) and one fp32 rstd per row; gradients flow in through y and h, either
    of which may get none (set_materialize_grads(False): no zeros made or read for it). Double
    backward (create_graph=True) is refused in one line (rows.double_backward_error), except
    where y gets no gradient and dh passes through in torch ops, which autograd differentiates.

    Eager calls go to the launchers directly; only a traced call (torch.compile) goes through
    the compiled ops.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, eps, inplace=False, w_offset=0.0):
        ctx.inplace, ctx.w_offset = inplace, w_offset
        if torch.compiler.is_compiling():
            ctx.set_materialize_grads(False)  # the call Dynamo knows
            y, h, rstd = _forward_compiled(x)(x, residual, weight, eps, w_offset)
        else:
            ctx.materialize_grads = False  # what set_materialize_grads(False) does, one frame fewer
            y, h, rstd = add_rms_norm_forward(x, residual, weight, eps, w_offset=w_offset)
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        x_dtype, r_dtype = ctx.dtypes
        if dy is None:
            # y fed nothing that needs a gradient: dh passes through the add (as add's backward
            # does it, no kernel), and dweight is zero (None).
            if dh is None:
                return None, None, None, None, None, None
            return (dh.to(x_dtype) if need_x else None), (dh.to(r_dtype) if need_r else None), *([None] * 4)
        if torch.compiler.is_compiling():
            has_dh = dh is not None
            dx, dr, dw = _backward_compiled(h)(
                dy, dh if has_dh else h, h, weight, rstd, x_dtype, r_dtype, has_dh, need_x, need_r, need_w,
                ctx.w_offset,
            )  # fmt: skip
            if need_x and need_r and x_dtype == r_dtype:
                dr = dx
            return (
                (dx if need_x else None),
                (dr if need_r else None),
                (dw if need_w else None),
                None,
                None,
                None,
            )
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
            raise double_backward_error("add_rms_norm", "profuse.blockops.add_rms_norm_eager")
        needs = (need_x, need_r, need_w)
        grads = add_rms_norm_backward(
            dy, dh, h, weight, rstd, x_dtype, r_dtype, needs, inplace=ctx.inplace, w_offset=ctx.w_offset
        )
        return (*grads, None, None, None)


def add_rms_norm_fused(
    x, residual, weight, eps: float, inplace_backward: bool = False, w_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) on checked inputs: through autograd where a gradient is wanted, else the forward
    launch alone (no autograd node, no rstd stored). Rows wider than MAX_COLS: ValueError."""
    if x.shape[-1] > MAX_COLS:
        raise _too_wide(x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        return AddRMSNormFunction.apply(x, residual, weight, eps, inplace_backward, w_offset)
    if torch.compiler.is_compiling():
        y, h, _ = _forward_compiled(x)(x, residual, weight, eps, w_offset)
        return y, h
    y, h, _ = add_rms_norm_forward(x, residual, weight, eps, store_rstd=False, w_offset=w_offset)
    return y, h
