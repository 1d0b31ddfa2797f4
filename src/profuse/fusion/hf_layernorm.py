"""The LayerNorm places of a decoder stack, fused by the norm's class: every nn.LayerNorm a layer
holds as its own norm (StarCoder2's input_layernorm and post_attention_layernorm, GPT-NeoX's,
Phi-1/2's one, GPT-J's ln_1) and the final norm, each running

    layer_norm(x, weight, bias, eps)      (x - mean) * rstd * weight + bias, one launch

in place of F.layer_norm (profuse.blockops.layer_norm; its bias optional). The residual adds
stay where they are: an add_layer_norm, the add and the next LayerNorm in one pass, would need
the layer's own forward rebuilt as hf_layer does for RMSNorm layers, and is not built.

Recognised by class, not by name: a module whose forward is nn.LayerNorm's own (no subclass
forward, none of its own on the instance) with a weight over one dimension; its weight, bias and
eps are read at each call. Whether layer_norm beats torch's LayerNorm on a card is not measured
(profuse.kernels.layer_norm): this places it, checked against the unfused model, so a run on a
card can say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from profuse import blockops
from profuse.errors import UnsupportedModel
from profuse.fusion.gpt import BLOCK_OP_RANGES, LAYER_NORM, BlockOps, labelled
from profuse.fusion.hf_modules import STATE, forward_owner, fused_class, fused_target
from profuse.fusion.hf_ops import interpreted
from profuse.tail import SUPPORTED_DTYPES


@dataclass(frozen=True)
class LayerNormState:
    """What a fused LayerNorm calls: the bound layer_norm."""

    layer_norm: Callable


def layer_norm_forward(self, input):
    """A fused nn.LayerNorm: layer_norm on its own weight, bias and eps, read at the call."""
    st: LayerNormState = self.__dict__[STATE]
    return st.layer_norm(input, self.weight, self.bias, self.eps)


def bound_layer_norm(ops: BlockOps, label: bool) -> Callable:
    """`ops`' layer_norm as a fused norm calls it: where it is profuse's Triton op, F.layer_norm
    (nn.LayerNorm's own math) for dtypes the kernels do not take (float64) and for CPU tensors
    without TRITON_INTERPRET=1 when fused; inside its profiler range when `label`."""
    impl = ops.layer_norm
    kernels = impl is blockops.layer_norm
    cpu_ok = interpreted()

    def call(x, weight, bias, eps):
        if kernels:
            tensors = (x, weight) if bias is None else (x, weight, bias)
            if any(t.dtype not in SUPPORTED_DTYPES for t in tensors) or (x.is_cpu and not cpu_ok):
                return blockops.layer_norm_eager(x, weight, bias, eps)
        return impl(x, weight, bias, eps)

    return labelled(call, BLOCK_OP_RANGES[LAYER_NORM]) if label else call


def layer_norms(layers: list[nn.Module], final: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """(where, module) for each LayerNorm the layers hold as their own children, and the final
    norm where it is one."""
    found = [
        (f"layer {i}'s {name}", m)
        for i, layer in enumerate(layers)
        for name, m in layer.named_children()
        if isinstance(m, nn.LayerNorm)
    ]
    if isinstance(final, nn.LayerNorm):
        found.append(("the final norm", final))
    return found


def plan_layer_norms(
    norms: list[tuple[str, nn.Module]], layer_norm: Callable
) -> list[tuple[nn.Module, type, LayerNormState]]:
    """(module, fused class, state) for each of `norms`; raises UnsupportedModel with the reason
    where one is not nn.LayerNorm's forward over one dimension with a weight."""
    state = LayerNormState(layer_norm)
    fused = fused_class(nn.LayerNorm, LAYER_NORM, layer_norm_forward)
    installs = []
    for where, m in norms:
        if forward_owner(type(m)) is not nn.LayerNorm or "forward" in m.__dict__:
            raise UnsupportedModel(f"{where} ({type(m).__name__}) runs a forward other than nn.LayerNorm's")
        if len(m.normalized_shape) != 1 or m.weight is None:
            raise UnsupportedModel(
                f"{where} normalises over {tuple(m.normalized_shape)} with"
                f"{'out' if m.weight is None else ''} a weight: layer_norm takes one dimension and a weight"
            )
        target = fused_target(m, nn.LayerNorm, fused)
        if target is None:
            raise UnsupportedModel(f"{where} ({type(m).__name__}) is a LayerNorm class profuse cannot rebase")
        installs.append((m, target, state))
    return installs


__all__ = [
    "LayerNormState",
    "bound_layer_norm",
    "layer_norm_forward",
    "layer_norms",
    "plan_layer_norms",
]
