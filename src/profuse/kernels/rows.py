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


def fits(t: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether a result of `shape` and `dtype` can be written over `t`: contiguous, that shape
    and dtype. (Whether it may be is the caller's: an incoming gradient has no grad_fn to tell.)"""
    return t is not None and t.dtype == dtype and t.shape == shape and t.is_contiguous()


def can_write_over(t: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether a gradient may be written over a saved input `t`: it fits, and an op autograd
    recorded made it (an intermediate; a leaf, a user's own tensor, never)."""
    return t is not None and t.grad_fn is not None and fits(t, shape, dtype)


def mark_written(*tensors: torch.Tensor) -> None:
    """Bump the version counters of tensors a backward wrote over (a Triton store does not), so
    anything else that saved one of them fails autograd's version check instead of reading a
    gradient as its activation."""
    bump = getattr(torch.autograd.graph, "increment_version", None) or torch._C._increment_version
    for t in tensors:
        bump(t)


def second_backward_error(op: str) -> RuntimeError:
    """The refusal of a second backward through a graph whose op wrote its input gradients over
    the buffers it saved (inplace_backward=True): those inputs are gone."""
    return RuntimeError(
        f"profuse: {op} with inplace_backward=True wrote its gradients over the tensors it saved; "
        "run the forward again rather than a second backward (retain_graph=True)"
    )
