"""A fused norm's output recomputed in the backward instead of kept through the step.

In a decoder layer the output y of each norm is read by projections (q, k, v; gate, up), and
each saves y for its weight gradient, so autograd holds every layer's two y's from the forward to
the backward: 2 x tokens x hidden x 2 bytes a layer in bf16 (1.07 GB for Llama-3.2-1B at 4 x 2048
tokens, 16 layers), more than the fused loss's larger accumulator costs over Liger-Kernel's.
Yet the norm's own backward keeps what makes y again: its input h and one fp32 rstd a row. Inside
`recomputed(y)`, what autograd saves that is y (or a view of it) is saved as a recipe instead,
and the first backward that needs it makes y again (kernels/norm_recompute.py: one read of h,
one write of y, bitwise the forward's value), shared by every projection that saved it and
dropped after the last. The cost is that pass, once per norm in the backward: about 0.5% of a
Llama-3.2-1B step by the byte count, against the memory at the step's peak.

It steps aside, saving y as autograd would, where it cannot be sure of the value or would change
someone else's saving: y not made by profuse's norm kernels (the model's own math on float64 or
the CPU), y written to since, no gradient wanted, a trace (torch.compile decides what to keep
itself), or saved-tensor hooks already active (activation checkpointing, offloading: theirs must
see every tensor). A backward runs the recipe once per saved copy at most; profuse refuses a
second backward through a fused graph anyway (the ops' in-place gradients).
"""

from __future__ import annotations

import contextlib

import torch

from profuse.kernels import norm_recompute


class _Packed:
    """What autograd holds in y's place: the shared recipe and the view of y it saved."""

    __slots__ = ("norm", "size", "stride", "offset")

    def __init__(self, norm: _Recomputed, t: torch.Tensor, offset: int):
        self.norm, self.size, self.stride, self.offset = norm, t.size(), t.stride(), offset


class _Recomputed:
    """One norm output y: which saved tensors are y, and y made again while backwards need it."""

    def __init__(self, y: torch.Tensor, recipe: tuple):
        self.recipe, self.dtype = recipe, y.dtype
        self.lo = y.data_ptr()
        self.hi = self.lo + y.numel() * y.element_size()
        self.itemsize = y.element_size()
        self.value: torch.Tensor | None = None
        self.pending = 0  # saved copies not unpacked yet

    def pack(self, t: torch.Tensor):
        try:
            p = t.data_ptr()
        except RuntimeError:  # a tensor with no storage of its own (a subclass): not y
            return t
        # y is alive while the forward saves, so an address inside it is y or a view of it
        if self.lo <= p < self.hi and t.dtype == self.dtype and t._version == 0:
            self.pending += 1
            return _Packed(self, t, (p - self.lo) // self.itemsize)
        return t

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if self.value is None:
            h, weight, rstd, w_offset = self.recipe
            self.value = norm_recompute.norm_output(h, weight, rstd, w_offset, self.dtype)
        value = self.value
        self.pending -= 1
        if self.pending <= 0:  # the last projection that saved y has it: drop the copy
            self.value = None
        return value.as_strided(packed.size, packed.stride, packed.offset)


def _unpack(packed):
    return packed.norm.unpack(packed) if type(packed) is _Packed else packed


def _hooks_active() -> bool:
    """Whether saved-tensor hooks are already set (checkpointing, offloading), or it cannot tell."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True


def recomputed(y: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context for the modules that read the norm output `y`: inside it, y's saved copies are
    recipes (see the module docstring), or nothing changes where that would not be exact."""
    if not torch.is_grad_enabled() or not y.requires_grad or torch.compiler.is_compiling() or _hooks_active():
        return contextlib.nullcontext()
    recipe = norm_recompute.recipe(y)
    if recipe is None:
        return contextlib.nullcontext()
    norm = _Recomputed(y, recipe)
    return torch.autograd.graph.saved_tensors_hooks(norm.pack, _unpack)


__all__ = ["recomputed"]
