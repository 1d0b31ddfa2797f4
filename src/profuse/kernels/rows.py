"""What the fused ops' launchers do to their inputs first: see a (..., N) tensor as (rows, N)
with one row stride (no copy where a view can say it), and check that its device can run Triton;
and the one line their backwards raise where a second derivative is asked for.
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


def double_backward_error(op: str, instead: str) -> RuntimeError:
    """The refusal of a fused op's backward run with grad mode on, that is under
    backward(create_graph=True) or autograd.grad(create_graph=True).

    The gradients come out of a Triton kernel that autograd cannot see into: returned from that
    pass they would carry no grad_fn, and a gradient penalty sum(dL/dx ** 2) would be taken as
    a constant, its own gradient silently dropped. The backward checks torch.is_grad_enabled()
    (a C call, no measurable host time) in its eager branch; under torch.compile, AOTAutograd
    refuses double backward itself.
    """
    return RuntimeError(
        f"profuse: {op} does not support double backward (create_graph=True): its gradients come "
        f"from a Triton kernel autograd cannot differentiate; use {instead} for higher-order gradients"
    )
