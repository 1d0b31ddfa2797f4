"""The LM head and the loss in one op: linear cross-entropy, never holding the whole logits.

    loss = sum_t [ lse(x_t W^T) - (x_t W^T)[y_t] ] / n,   over the tokens t whose label y_t counts

with Hugging Face's causal-LM semantics (transformers' ForCausalLMLoss):
- `shift=True` (its default): the labels are shifted inside, token t predicts label t + 1 of the
  same sequence and the last position of each sequence predicts nothing;
- labels equal to `ignore_index` (-100) count for nothing;
- n is the number of counted tokens, or `num_items_in_batch` where given (gradient
  accumulation: the sum over micro-batches then divides by the whole batch's count);
- the logits are computed in the matmul dtype (the autocast dtype under autocast, else the
  inputs'), the softmax in fp32; the loss is fp32.

Each op here: the eager math (the baseline: the head's matmul, then Hugging Face's loss, whole
logits in fp32), the float64 reference (the oracle), the argument check (a one-line ValueError
naming the argument), and the public entry point, which runs the chunked kernels
(profuse.kernels.cross_entropy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.tail import SUPPORTED_DTYPES

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels[..., 1:] with `ignore_index` appended to each sequence: the label each position
    predicts (Hugging Face's shift)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _targets(labels, shift, shift_labels, ignore_index) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels.reshape(-1)
    return (shifted_labels(labels, ignore_index) if shift else labels).reshape(-1)


def linear_cross_entropy_eager(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift: bool = True,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The head's matmul (whole logits, in the matmul dtype), then Hugging Face's loss: the
    logits cast to fp32, cross-entropy summed over the counted tokens, divided by their count or
    `num_items_in_batch`. `shift_labels`, where given, are the targets already shifted.
    `softcap`: Gemma 2 and 3's final-logit soft-capping, as their CausalLM forward applies it
    (logits / cap, tanh, * cap, in the matmul dtype) before the loss."""
    logits = F.linear(hidden, weight)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()  # (..., V), as ForCausalLMLoss upcasts
    target = _targets(labels, shift, shift_labels, ignore_index).to(logits.device)
    logits = logits.reshape(-1, logits.shape[-1])
    if num_items_in_batch is None:
        return F.cross_entropy(logits, target, ignore_index=ignore_index)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift: bool = True,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The oracle: the same math in float64 (logits, softmax and the sum), with no autocast."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.double(), weight.double())
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    target = _targets(labels, shift, shift_labels, ignore_index).to(logits.device)
    logits = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if num_items_in_batch is None:
        return loss / (target != ignore_index).sum().double()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device).double()
    return loss / num_items_in_batch


def check_linear_cross_entropy_args(hidden, weight, labels, shift_labels=None, shift: bool = True) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have a non-empty last dimension, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected (vocab_size, {hidden.shape[-1]})")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden is on {hidden.device}")
    targets = shift_labels if shift_labels is not None else labels
    name = "shift_labels" if shift_labels is not None else "labels"
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of class indices, got {type(targets).__name__}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} has dtype {targets.dtype}; expected int64 (or int32) class indices")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{name} has shape {tuple(targets.shape)}, expected hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if shift and shift_labels is None and targets.dim() < 1:
        raise ValueError("labels need a sequence dimension to shift (shift=False for per-token targets)")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift: bool = True,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """linear_cross_entropy_eager's loss, computed in chunks of tokens: each chunk's logits are
    made, turned into their loss and gradients, and dropped, so the whole (tokens, vocab) logits
    never exist. Gradients for hidden and weight (a tied embedding's too). Differentiable once;
    double backward is refused in one line. `softcap` (Gemma 2 and 3): the loss of
    softcap * tanh(logits / softcap), the tanh applied to each logit in fp32 inside the kernel."""
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    check_linear_cross_entropy_args(hidden, weight, labels, shift_labels, shift)
    from profuse.kernels import cross_entropy as kernel

    target = _targets(labels, shift, shift_labels, ignore_index)
    return kernel.linear_cross_entropy_fused(
        hidden, weight, target, ignore_index, num_items_in_batch, softcap=softcap
    )
