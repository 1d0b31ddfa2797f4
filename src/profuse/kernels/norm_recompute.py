"""A fused RMSNorm's output made again from what its backward keeps anyway:

    y = h * rstd * (w + w_offset)          fp32, rounded once to y's dtype

h is the norm's input (add_rms_norm's stored sum, rms_norm's x) and rstd the fp32 value per row the
forward stored; the product is taken in the forward kernels' order ((h * rstd) * w, no fused
multiply-add can join two products), so the value is bitwise the forward's y. That lets a fused
model keep no copy of y through the step: the projections that read y save a recipe in its place
and make it here when their backward needs it (profuse.fusion.hf_recompute), one read of h and
one write of y, against holding 2 bytes per element (bf16) from the forward to the backward.

`recipe(y)` says whether and how y can be made again: only for the output of profuse's own norm
Functions (add_rms_norm's y, rms_norm's y), read from the autograd node that made it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from profuse.kernels.add_rms_norm import AddRMSNormFunction
from profuse.kernels.rms_norm import RMSNormFunction
from profuse.kernels.rows import as_rows, check_runnable

# Elements a program covers: whole rows, several where rows are narrow (a plain elementwise pass).
_TILE = 8192


@triton.jit
def _apply_kernel(
    H_ptr,
    RSTD_ptr,  # (n_rows,) fp32
    W_ptr,
    Y_ptr,  # (n_rows, n_cols) contiguous, in y's dtype
    h_row_stride,
    n_rows,
    n_cols,
    w_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
    h = tl.load(H_ptr + rows[:, None] * h_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
    y = h * rstd[:, None] * w[None, :]
    tl.store(Y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


def norm_output(
    h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, w_offset: float, dtype: torch.dtype
) -> torch.Tensor:
    """y = h * rstd * (weight + w_offset) in `dtype`, shaped and laid out as h (contiguous)."""
    n_cols = h.shape[-1]
    hr = as_rows(h, n_cols)
    n_rows = hr.shape[0]
    y = torch.empty(h.shape, dtype=dtype, device=h.device)
    if n_rows == 0:
        return y
    check_runnable(h.device, "the norm's recompute")
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(_TILE // block_n, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_m),)
    _apply_kernel[grid](
        hr, rstd.reshape(-1), weight.contiguous(), y, hr.stride(0), n_rows, n_cols, float(w_offset),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m * block_n <= 4096 else 8,
    )  # fmt: skip
    return y


def recipe(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """(h, weight, rstd, w_offset) that norm_output makes y from, where y is the first output of
    profuse's add_rms_norm or rms_norm Function (eager, not traced) and nothing has written over
    it since; else None. The tensors are those the norm saved for its own backward."""
    node = y.grad_fn
    cls = getattr(type(node), "_forward_cls", None)
    if cls is not AddRMSNormFunction and cls is not RMSNormFunction:
        return None
    if y.output_nr != 0 or y._version != 0 or not y.is_contiguous():  # y, not add_rms_norm's h
        return None
    h, weight, rstd = node.saved_tensors
    if h.shape != y.shape or rstd.dtype != torch.float32:
        return None
    return h, weight, rstd, float(node.w_offset)


__all__ = ["norm_output", "recipe"]
