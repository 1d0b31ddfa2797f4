"""A plain causal call's attention reaches SDPA as `is_causal=True`, under torch.compile too.

For a training step with no padding mask, no position ids and no cache, transformers' SDPA path
makes no mask in eager: `create_causal_mask` returns None and attention runs with `is_causal=True`,
GQA through `enable_gqa`. While torch.compile traces on torch < 2.14 it cannot tell (its check,
`_ignore_causal_mask_sdpa`, treats every trace as an export), so it builds the (B, 1, T, T) mask,
and SDPA then repeats the key/value heads and runs masked, computing every block above the
diagonal too. On an H100 (2026-12-05, Llama-3.2-1B bf16, 4 x 2048 tokens) that took the step's
attention from 14.4 to 33.0 ms under torch.compile, the same cuDNN kernels.

The decoder stack's forward is its own, rebuilt once per class (hf_modules.rebuilt) with the
mask builders it calls (`create_causal_mask`, `create_sliding_window_causal_mask`) replaced by
ones that return None, which is what they return in eager for such a call (the probe asks them,
on the model's config). The fused stack runs that forward only for a plain causal call: SDPA
attention, a causal config, and no argument given but the inputs, `use_cache` and the output
switches (no attention_mask, position_ids, cache or anything else). Every other call, and every
attention implementation but SDPA, runs the class's own forward. A sliding window returns None
only where the sequence is shorter than the window, as in eager.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from profuse.fusion.hf_modules import (
    ORIGINAL,
    forward_owner,
    fused_class,
    fused_target,
    innermost,
    parameter_names,
    rebuilt,
)

_FULL, _SLIDING = "create_causal_mask", "create_sliding_window_causal_mask"
_FORWARD = "_profuse_causal_forward"
_NAMES = "_profuse_stack_arguments"
# Arguments a plain causal call may give (anything else given, not None, runs the own forward).
_FREE = frozenset(
    {"input_ids", "inputs_embeds", "use_cache", "output_attentions", "output_hidden_states", "return_dict"}
)


def _no_mask(*args, **kwargs):
    """create_causal_mask for a plain causal call: SDPA's is_causal does the masking."""
    return None


def _sliding(original: Callable) -> Callable:
    def create_sliding_window_causal_mask(*args, **kwargs):
        """None where the sequence is shorter than the window (the mask is then the causal one)."""
        config = kwargs.get("config", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds", args[1] if len(args) > 1 else None))
        window = getattr(config, "sliding_window", None)
        if isinstance(window, int) and isinstance(embeds, torch.Tensor) and embeds.shape[1] < window:
            return None
        return original(*args, **kwargs)

    return create_sliding_window_causal_mask


def plain_causal(stack: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Is this call one whose mask is the causal one, with SDPA attention?"""
    config = stack.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(config, "is_causal", True):
        return False
    names = type(stack).__dict__[_NAMES]
    if len(args) > len(names):
        return False
    given = list(zip(names, args)) + list(kwargs.items())
    return all(value is None or name in _FREE for name, value in given)


def stack_forward(self, *args, **kwargs):
    """The fused decoder stack: the forward without mask builders for a plain causal call."""
    cls = type(self)
    if plain_causal(self, args, kwargs):
        return getattr(cls, _FORWARD)(self, *args, **kwargs)
    return getattr(cls, ORIGINAL).forward(self, *args, **kwargs)


@dataclass
class MaskPlan:
    """The fused class the decoder stack takes, or why it keeps its own."""

    target: type | None
    reason: str | None


def plan_mask(stack: nn.Module) -> MaskPlan:
    """Check that the stack builds its mask with transformers' builders, which return None for a
    plain causal call on its config; change nothing."""
    name = type(stack).__name__
    owner = forward_owner(type(stack))
    func = innermost(owner.forward)
    code = getattr(func, "__code__", None)
    used = [n for n in (_FULL, _SLIDING) if code is not None and n in code.co_names]
    if not used:
        return MaskPlan(None, f"{name}.forward builds no mask with {_FULL} (an older transformers)")
    config = getattr(stack, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        impl = getattr(config, "_attn_implementation", None)
        return MaskPlan(None, f"attention runs as {impl!r}, not 'sdpa'")
    builders = {n: func.__globals__.get(n) for n in used}
    why = _probe(builders, config, name)
    if why:
        return MaskPlan(None, why)
    sites = {n: _no_mask if n == _FULL else _sliding(builders[n]) for n in used}
    try:
        forward = rebuilt(owner.forward, {}, sites)
    except ValueError as e:
        return MaskPlan(None, f"{name}.forward cannot be rebuilt without its mask: {e}")
    names = tuple(parameter_names(owner.forward))
    fused = fused_class(owner, "causal_mask", stack_forward, {_FORWARD: forward, _NAMES: names})
    target = fused_target(stack, owner, fused)
    if target is None:
        return MaskPlan(None, f"{name} is derived from {owner.__name__} by a class with a forward of its own")
    return MaskPlan(target, None)


def _probe(builders: dict[str, Callable], config, name: str) -> str | None:
    """Each builder, called eagerly as the forward calls it for a plain causal call of 3 tokens,
    must return None (its own decision that SDPA's is_causal suffices). The reason where not."""
    embeds = torch.zeros(1, 3, 1)
    positions = torch.arange(3).unsqueeze(0)
    for builder_name, builder in builders.items():
        if not callable(builder):
            return f"{name}.forward's {builder_name} is not a function"
        if builder_name == _SLIDING and not isinstance(getattr(config, "sliding_window", None), int):
            continue  # no window: the forward does not call it, and the site calls it as it is
        params = inspect.signature(builder).parameters
        values = {
            "config": config,
            "inputs_embeds": embeds,
            "input_embeds": embeds,
            "attention_mask": None,
            "cache": None,
            "past_key_values": None,
            "cache_position": torch.arange(3),
            "position_ids": positions,
        }
        if "cache" in params:  # past_key_values is its deprecated name there
            values.pop("past_key_values")
        kwargs = {k: v for k, v in values.items() if k in params}
        try:
            with torch.no_grad():
                mask = builder(**kwargs)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            return f"{builder_name} could not be asked for a plain causal call's mask: {why}"
        if mask is not None:
            return f"{builder_name} makes a mask for a plain causal call in eager ({type(mask).__name__})"
    return None


__all__ = ["MaskPlan", "plain_causal", "plan_mask", "stack_forward"]
