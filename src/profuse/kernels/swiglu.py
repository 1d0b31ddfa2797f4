"""SiLU-and-multiply, the SwiGLU activation, in Triton: one pass forward, one pass backward.

    a = silu(g) * u,   silu(g) = g * s,   s = sigmoid(g)

Backward:
    dg = da * u * s * (1 + g * (1 - s))
    du = da * g * s

Forward reads g and u and writes a (3 tensors; eager's silu, then *, moves 5 and keeps silu(g)
alive for its backward). Backward reads da, g, u and writes dg, du (5 tensors; eager moves 9).
All arithmetic is fp32; only the stores round. Nothing is saved but the inputs themselves.

gate and up are read in place when they are the two halves of one matmul output (rows strided
by 2F). Given that packed (..., 2F) tensor itself, the backward writes its gradient as one
(..., 2F) tensor, dg in the first half of each row and du in the second, so autograd has no two
halves to concatenate (4 more tensors of traffic, and an allocation, in the pair form).

The op is elementwise, so a program takes a tile of block_m rows x block_n columns; the launch
shape per (rows, cols, dtype) is chosen by kernels/configs.py and kernels/autotune.py once, and
kept as the signature's plan, so a later call is a dictionary lookup and one launch.

Layout: the @triton.jit kernels; the launches; the launchers (flatten to 2-D, allocate, look up
the plan, launch); the compiled ops (torch.compile calls them without a graph break); the
autograd.Functions; and `silu_mul_pair` / `silu_mul_packed`, the entry points behind
profuse.blockops.silu_mul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing, compiled_op
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import (
    as_rows,
    can_write_over,
    check_runnable,
    double_backward_error,
    mark_written,
    second_backward_error,
)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_fwd_kernel(
    G_ptr,
    U_ptr,
    A_ptr,  # (n_rows, n_cols) out, contiguous
    g_row_stride,  # row strides in elements; columns are contiguous
    u_row_stride,
    u_offset,  # up's first column from U_ptr: n_cols when U_ptr is the packed (rows, 2F) tensor
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile, a power of two
):
    """Tile (program 0, program 1) of a = silu(g) * u, in fp32, rounded once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    c2 = cols[None, :]
    g = tl.load(G_ptr + rows[:, None] * g_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + u_offset + rows[:, None] * u_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(A_ptr + rows[:, None] * n_cols + c2, a.to(A_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    DA_ptr,
    G_ptr,
    U_ptr,
    DG_ptr,  # dgate out; unused unless COMPUTE_DG
    DU_ptr,  # dup out; unused unless COMPUTE_DU and not PACKED_D
    da_row_stride,
    g_row_stride,
    u_row_stride,
    u_offset,  # up's first column from U_ptr (packed input: n_cols)
    d_row_stride,  # the gradients' row stride: n_cols (two tensors) or 2 * n_cols (one packed)
    du_offset,  # dup's first column from its pointer (packed gradient: n_cols from DG_ptr)
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    PACKED_D: tl.constexpr,  # one (rows, 2F) gradient: dup goes to DG_ptr + du_offset
):
    """Tile of  s = sigmoid(g),  dg = da * u * s * (1 + g * (1 - s)),  du = da * g * s.
    Without COMPUTE_DG, u is not read at all. The packed gradient is written through one
    pointer: under torch.compile a kernel argument is one tensor, and the same tensor passed as
    two written arguments would be copied apart (functionalisation)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    c2 = cols[None, :]
    da = tl.load(DA_ptr + rows[:, None] * da_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + rows[:, None] * g_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    out = rows[:, None] * d_row_stride + c2
    if COMPUTE_DG:
        u = tl.load(U_ptr + u_offset + rows[:, None] * u_row_stride + c2, mask=mask, other=0.0).to(tl.float32)
        dg = da * u * s * (1.0 + g * (1.0 - s))
        tl.store(DG_ptr + out, dg.to(DG_ptr.dtype.element_ty), mask=mask)
    if COMPUTE_DU:
        du = da * g * s
        if PACKED_D:
            tl.store(DG_ptr + du_offset + out, du.to(DG_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(DU_ptr + du_offset + out, du.to(DU_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch plans: built on the first call of a signature, then looked up
# --------------------------------------------------------------------------------------------

# Forward plans by (rows, cols, dtype, device): strides are runtime arguments, so the pair and
# packed forms share a plan. Backward plans by (rows, cols, dtype, device, gradients asked for,
# packed gradient or two).
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _launch(
    cfg: KernelConfig, n_rows: int, n_cols: int, backward: bool, needs=(True, True), packed: bool = False
) -> Launch:
    """The kernel for `cfg`, bound to its grid of (row tiles, column tiles) for this shape."""
    grid = (triton.cdiv(n_rows, cfg.block_m), triton.cdiv(n_cols, cfg.block_n))
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    if backward:
        flags = dict(COMPUTE_DG=needs[0], COMPUTE_DU=needs[1], PACKED_D=packed)
        return Launch(_silu_mul_bwd_kernel, grid, cfg, "silu_mul bwd", **flags, **meta)
    return Launch(_silu_mul_fwd_kernel, grid, cfg, "silu_mul fwd", **meta)


def _plan(
    plans: PlanCache, key: tuple, tune_key: tuple, args: tuple, backward: bool, needs, packed: bool = False
) -> Launch:
    """The launch for a new signature: the tuned config (timed now if `tune_key` is new), bound
    to this shape's grid; kept unless made inside a CUDA-graph capture (untuned then)."""
    n_rows, n_cols, _, device = key[:4]
    check_runnable(device, "silu_mul")
    candidates = C.silu_mul_candidates(n_rows, n_cols, backward)
    cfg = TUNER.pick(
        tune_key, candidates, lambda c: _launch(c, n_rows, n_cols, backward, needs, packed)(*args), device
    )
    launch = _launch(cfg, n_rows, n_cols, backward, needs, packed)
    if not capturing(device):
        plans.add(key, launch)
    return launch


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _forward(g, u, u_offset, a, n_cols, config) -> None:
    """a (contiguous (rows, n_cols)) = silu(g) * u over 2-D row views."""
    n_rows = g.shape[0]
    if n_rows == 0:
        return
    args = (g, u, a, g.stride(0), u.stride(0), u_offset, n_rows, n_cols)
    if config is not None:
        _launch(config, n_rows, n_cols, False)(*args)
        return
    key = (n_rows, n_cols, g.dtype, g.device)
    launch = _FWD_PLANS.get(key)
    if launch is None:
        launch = _plan(_FWD_PLANS, key, ("silu_mul_fwd", C.pow2_rows(n_rows), n_cols, g.dtype), args, False,
                       (True, True))  # fmt: skip
    launch(*args)


def silu_mul_forward(
    gate: torch.Tensor, up: torch.Tensor, config: KernelConfig | None = None
) -> torch.Tensor:
    """silu(gate) * up for two (..., F) tensors (strided rows read in place): contiguous, shaped
    like gate. `config` runs that launch shape; without it the shape's plan runs."""
    n_cols = gate.shape[-1]
    a = torch.empty_like(gate, memory_format=torch.contiguous_format)
    _forward(as_rows(gate, n_cols), as_rows(up, n_cols), 0, a, n_cols, config)
    return a


def silu_mul_packed_forward(gate_up: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """silu(gate) * up for gate, up = the halves of the last dim of one (..., 2F) tensor: (..., F)."""
    n_cols = gate_up.shape[-1] // 2
    gu = as_rows(gate_up, 2 * n_cols)
    a = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    _forward(gu, gu, n_cols, a, n_cols, config)
    return a


def _backward(da, g, u, u_offset, dg, du, d_row_stride, du_offset, n_cols, needs, config) -> None:
    """dg, du over 2-D row views (either None where not asked for; du is dg for the packed
    gradient, written through dg's pointer alone)."""
    n_rows = g.shape[0]
    if n_rows == 0:
        return
    # A gradient not asked for gets any tensor: its COMPUTE_ flag is off, the kernel never touches it.
    packed = du is not None and du is dg
    args = (da, g, u, g if dg is None else dg, g if du is None or packed else du, da.stride(0), g.stride(0),
            u.stride(0), u_offset, d_row_stride, du_offset, n_rows, n_cols)  # fmt: skip
    if config is not None:
        _launch(config, n_rows, n_cols, True, needs, packed)(*args)
        return
    key = (n_rows, n_cols, g.dtype, g.device, needs, packed)
    launch = _BWD_PLANS.get(key)
    if launch is None:
        tune_key = ("silu_mul_bwd", C.pow2_rows(n_rows), n_cols, g.dtype, needs)
        launch = _plan(_BWD_PLANS, key, tune_key, args, True, needs, packed)
    launch(*args)


def silu_mul_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    needs: tuple[bool, bool] = (True, True),
    config: KernelConfig | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dgate, dup), each (..., F) and contiguous; None (and no work) where `needs` says no.
    With `inplace`, dgate is written over gate and dup over up where each is a contiguous
    intermediate (rows.can_write_over; else a new tensor), and their versions are bumped: a tile
    reads its g and u before it stores, so the same math."""
    n_cols = gate.shape[-1]
    like = (gate.shape, gate.dtype)
    # Two views of one storage (silu_mul(x, x), overlapping slices): a tile's store could reach
    # what another tile has still to read.
    inplace = inplace and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
    over_g = inplace and needs[0] and can_write_over(gate, *like)
    over_u = inplace and needs[1] and can_write_over(up, *like)
    cf = torch.contiguous_format
    dg = (gate if over_g else torch.empty_like(gate, memory_format=cf)) if needs[0] else None
    du = (up if over_u else torch.empty_like(gate, memory_format=cf)) if needs[1] else None
    if dg is not None or du is not None:
        _backward(as_rows(grad, n_cols), as_rows(gate, n_cols), as_rows(up, n_cols), 0, dg, du,
                  n_cols, 0, n_cols, needs, config)  # fmt: skip
    mark_written(*([gate] if over_g else []), *([up] if over_u else []))
    return dg, du


def silu_mul_packed_backward(
    grad: torch.Tensor, gate_up: torch.Tensor, config: KernelConfig | None = None, inplace: bool = False
) -> torch.Tensor:
    """The gradient of the packed (..., 2F) input as one tensor: dgate | dup along the last dim.
    With `inplace`, written over gate_up itself where it is a contiguous intermediate
    (rows.can_write_over), its version bumped."""
    n_cols = gate_up.shape[-1] // 2
    gu = as_rows(gate_up, 2 * n_cols)
    over = inplace and can_write_over(gate_up, gate_up.shape, gate_up.dtype)
    dgu = gate_up if over else torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    _backward(
        as_rows(grad, n_cols), gu, gu, n_cols, dgu, dgu, 2 * n_cols, n_cols, n_cols, (True, True), config
    )
    if over:
        mark_written(gate_up)
    return dgu


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Functions, entry points
# --------------------------------------------------------------------------------------------


def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_forward(gate, up)


def _packed_forward_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_packed_forward(gate_up)


def _backward_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, need_gate: bool, need_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = silu_mul_backward(grad, gate, up, (need_gate, need_up))
    # An op returns tensors only: an empty one stands for "not asked for".
    return (gate.new_empty(0) if dg is None else dg), (gate.new_empty(0) if du is None else du)


def _packed_backward_op(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_packed_backward(grad, gate_up)


def _backward_fake(grad, gate, up, need_gate, need_up):
    return (gate.new_empty(gate.shape) if need_gate else gate.new_empty(0),
            gate.new_empty(gate.shape) if need_up else gate.new_empty(0))  # fmt: skip


# The ops torch.compile calls: profuse::silu_mul_fwd and the rest (opaque), and on CUDA their
# Triton-op twins, whose kernels Inductor launches itself (kernels/autotune.compiled_op).
_forward_compiled = compiled_op("silu_mul_fwd", _forward_op, lambda gate, up: gate.new_empty(gate.shape))
_packed_forward_compiled = compiled_op(
    "silu_mul_packed_fwd", _packed_forward_op, lambda gu: gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))
)
_backward_compiled = compiled_op("silu_mul_bwd", _backward_op, _backward_fake)
_packed_backward_compiled = compiled_op(
    "silu_mul_packed_bwd", _packed_backward_op, lambda grad, gu: gu.new_empty(gu.shape)
)


class SiluMulFunction(torch.autograd.Function):
    """gate and up as two tensors: saves them (nothing new: they are alive anyway), returns a
    gradient for each. Eager calls go to the launchers; a traced call, to the compiled ops.
    Double backward (create_graph=True) is refused in one line (rows.double_backward_error).

    `inplace` (the op's inplace_backward): the eager backward writes dgate over gate and dup over
    up (Liger-Kernel's SwiGLU does the same), for a caller whose gate and up are intermediates
    no one else reads after the op: a matmul's outputs, which its own backward does not keep.
    Two (..., F) tensors of the backward's memory less at its moment. The saved inputs are then
    gone: a second backward through the graph (retain_graph=True) is refused in one line, and
    anything else that saved them fails autograd's version check. Under torch.compile the
    backward stays out of place (the compiled ops are functional; Inductor plans their buffers)."""

    @staticmethod
    def forward(ctx, gate, up, inplace=False):
        if torch.compiler.is_compiling():
            a = _forward_compiled(gate)(gate, up)
        else:
            a = silu_mul_forward(gate, up)
        ctx.save_for_backward(gate, up)
        ctx.inplace = inplace
        return a

    @staticmethod
    def backward(ctx, grad):
        need_g, need_u = ctx.needs_input_grad[:2]
        if torch.compiler.is_compiling():
            gate, up = ctx.saved_tensors
            dg, du = _backward_compiled(gate)(grad, gate, up, need_g, need_u)
            return (dg if need_g else None), (du if need_u else None), None
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
            raise double_backward_error("silu_mul", "profuse.blockops.silu_mul_eager")
        if ctx.inplace:
            if ctx.inplace == "spent":  # checked before the saved tensors' own version check
                raise second_backward_error("silu_mul")
            ctx.inplace = "spent"
        gate, up = ctx.saved_tensors
        return (*silu_mul_backward(grad, gate, up, (need_g, need_u), inplace=bool(ctx.inplace)), None)


class SiluMulPackedFunction(torch.autograd.Function):
    """The packed (..., 2F) gate_up: saves it, returns its gradient as one (..., 2F) tensor.
    Double backward (create_graph=True) is refused in one line, as SiluMulFunction's."""

    @staticmethod
    def forward(ctx, gate_up, inplace=False):
        if torch.compiler.is_compiling():
            a = _packed_forward_compiled(gate_up)(gate_up)
        else:
            a = silu_mul_packed_forward(gate_up)
        ctx.save_for_backward(gate_up)
        ctx.inplace = inplace
        return a

    @staticmethod
    def backward(ctx, grad):
        if torch.compiler.is_compiling():
            (gate_up,) = ctx.saved_tensors
            return _packed_backward_compiled(gate_up)(grad, gate_up), None
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradient has no grad_fn
            raise double_backward_error("silu_mul", "profuse.blockops.silu_mul_eager")
        if ctx.inplace:
            if ctx.inplace == "spent":
                raise second_backward_error("silu_mul")
            ctx.inplace = "spent"
        (gate_up,) = ctx.saved_tensors
        return silu_mul_packed_backward(grad, gate_up, inplace=bool(ctx.inplace)), None


def silu_mul_pair(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """silu(gate) * up on checked inputs: through autograd where a gradient is wanted, else the
    forward launch alone (no autograd node). `inplace_backward`: see SiluMulFunction."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SiluMulFunction.apply(gate, up, inplace_backward)
    if torch.compiler.is_compiling():
        return _forward_compiled(gate)(gate, up)
    return silu_mul_forward(gate, up)


def silu_mul_packed(gate_up: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """silu(gate) * up for the halves of a checked (..., 2F) gate_up; its gradient is one tensor."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return SiluMulPackedFunction.apply(gate_up, inplace_backward)
    if torch.compiler.is_compiling():
        return _packed_forward_compiled(gate_up)(gate_up)
    return silu_mul_packed_forward(gate_up)
