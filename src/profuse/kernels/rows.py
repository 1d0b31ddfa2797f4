"""What the block ops' launchers do to their inputs first: see a (..., N) tensor as (rows, N)
with one row stride (no copy where a view can say it), and check that its device can run Triton.
"""

from __future__ import annotations

import os

import torch


def as_rows(x: torch.Tensor, n_cols: int) -> torch.Tensor:
    """x as (rows, n_cols) with contiguous columns and one row stride, copying only if it must.

    The halves of one (..., 2F) matmul output (`chunk(2, -1)`) stay views: row stride 2F.
    """
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    if x.stride(-1) != 1:  # e.g. a broadcast gradient (stride 0): the kernels need unit columns
        x = x.contiguous()
    try:
        return x.view(-1, n_cols)
    except RuntimeError:  # leading dims that no single row stride can describe
        return x.reshape(-1, n_cols)


def check_runnable(device: torch.device, op: str) -> None:
    """Raise ValueError unless Triton can run `op` on `device` (CUDA, or the interpreter on CPU).
    Called where a plan is built, so a call that finds its plan pays nothing."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{op} needs CUDA tensors (got {device}); "
            "set TRITON_INTERPRET=1 to run it on CPU tensors through the interpreter"
        )
