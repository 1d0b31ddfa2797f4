"""The head probe's extension for a mixture-of-experts causal LM: the router's auxiliary loss.

An MoE causal LM's forward (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GraniteMoE, gpt-oss in
transformers 5.x) adds the router's load-balancing loss to the language-model loss:

    loss = lm_loss + router_aux_loss_coef * aux,
    aux  = load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)

when `output_router_logits` is on (the argument, else config.output_router_logits). The fused head
(profuse.fusion.hf_head) rebuilds the model's own forward with lm_head and loss_function renamed,
so the aux loss is still the model's own code on the model's own router logits: only lm_loss comes
from linear_cross_entropy. Here is what the probe needs to check that on a stand-in: the stack's
stand-in output carries router logits (two layers of (tokens, experts) float64 logits, with the
head's own expert count and top-k), the cases with output_router_logits on and off and with a
padding mask, and the aux loss, a scalar made anew by each forward, compared by value.
"""

from __future__ import annotations

import torch
from torch import nn

from profuse.fusion.hf_modules import innermost

ROUTER_FLAG = "output_router_logits"


def reads_router_logits(forward) -> bool:
    """Whether a causal LM's forward (the function under its decorators) reads router_logits
    from the stack's output: MoE heads do, to pass them on (DeepSeek-V3, GLM-4-MoE) and to add
    the aux loss (those that take output_router_logits)."""
    return "router_logits" in innermost(forward).__code__.co_names


def takes_router_flag(params: list[str]) -> bool:
    """Whether a causal LM's forward (its parameter names) takes output_router_logits."""
    return ROUTER_FLAG in params


def _num_experts(head: nn.Module) -> int:
    config = head.config
    for n in (
        getattr(head, "num_experts", None),
        getattr(config, "num_experts", None),
        getattr(config, "num_local_experts", None),
        getattr(config, "n_routed_experts", None),
    ):
        if isinstance(n, int) and n > 0:
            return n
    return 4  # a head that only passes router logits on: any expert count


def stack_fields(head: nn.Module, hidden: torch.Tensor) -> dict:
    """The stand-in stack's output fields beyond last_hidden_state: router logits for two layers,
    (batch * seq, experts) each, spread enough that top-k is never a tie."""
    n = _num_experts(head)
    tokens = hidden.shape[0] * hidden.shape[1]
    gen = torch.Generator().manual_seed(9)
    return {
        "router_logits": tuple(
            3 * torch.randn(tokens, n, generator=gen, dtype=hidden.dtype) for _ in range(2)
        )
    }


def stack_output(hidden: torch.Tensor, fields: dict):
    """The stand-in stack's output: MoE's when there are router logits to carry."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    cls = MoeModelOutputWithPast if fields else BaseModelOutputWithPast
    return cls(last_hidden_state=hidden, **fields)


def moe_cases(labels: torch.Tensor) -> list[dict]:
    """The probe's extra calls for an MoE head: the aux loss added, without and with padding."""
    mask = torch.ones_like(labels)
    mask[0, -2:] = 0
    return [
        {"labels": labels, ROUTER_FLAG: True},
        {"labels": labels, ROUTER_FLAG: True, "attention_mask": mask},
        {"labels": labels, ROUTER_FLAG: True, "return_dict": False},
        {"labels": labels, ROUTER_FLAG: False},
    ]


def tuple_logits_index(out: tuple) -> int:
    """Where the logits are in a causal LM's tuple output with a loss: (loss, logits, ...), or
    (loss, aux_loss, logits, ...) where the aux loss, a scalar, was made."""
    return 2 if isinstance(out[1], torch.Tensor) and out[1].dim() == 0 and len(out) > 2 else 1


def same_scalar(got, want, tol: float) -> bool:
    """A scalar the forward made anew from the same inputs (the aux loss): equal by value."""
    return (
        isinstance(got, torch.Tensor)
        and isinstance(want, torch.Tensor)
        and got.dim() == want.dim() == 0
        and bool((got - want).abs() <= tol * want.abs().clamp_min(1))
    )


__all__ = [
    "ROUTER_FLAG",
    "moe_cases",
    "reads_router_logits",
    "same_scalar",
    "stack_fields",
    "stack_output",
    "takes_router_flag",
    "tuple_logits_index",
]
