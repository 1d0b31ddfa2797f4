"""The MLP places of a dense model whose decoder layer profuse does not fuse whole, fused by the
MLP's own class: each layer's `mlp` computes one of

    down(act(gate(x)) * up(x))                    gate_proj, up_proj, down_proj, act_fn
                                                  (Gemma 3, OLMo 2: the layer has other norms;
                                                  Llama 4's dense layers: activation_fn)
    down(act(g) * u),  g, u = gate_up(x).chunk(2)  gate_up_proj, down_proj, activation_fn
                                                  (Phi-3, GLM-4: the packed projection)

with act SiLU or GELU (tanh or exact), and its fused class's forward runs the gated op in their
place: silu_mul or gelu_mul on the two projections' outputs, or on the packed (..., 2F) output,
whose gradient then comes back as one tensor, as the packed matmul wants it. The layer itself,
its norms and adds, stay as they are (hf_layer fuses the MLP inside the layer where it fuses
the layer).

An MLP of two projections around an activation (GPT-NeoX, Phi-1/2, StarCoder2, GPT-J:
down(act(up(x))), no gate) has no place for a gated op: `ungated` says so in one line.

Probes, on float64 stand-ins (hf_layer.probe_mlp for the unpacked form): the class's forward
must give down(act(g) * u) in eval and train mode for one activation of
hf_layer.MLP_ACTIVATIONS. At each call the place runs fused only where the act is still the one
probed (hf_modules.runs_as); else the class's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from profuse.errors import UnsupportedModel
from profuse.fusion.hf_layer import MLP_ACTIVATIONS, PROBE_TOL, probe_mlp
from profuse.fusion.hf_modules import (
    PROBE_MODES,
    STATE,
    forward_owner,
    fused_class,
    fused_target,
    runs_as,
    seeded,
    stand_in,
)

_PACKED_CHILDREN = frozenset({"gate_up_proj", "down_proj"})
_SPLIT_CHILDREN = frozenset({"gate_proj", "up_proj", "down_proj"})
_ACT_NAMES = ("activation_fn", "act_fn")  # Phi-3's, GLM-4's and Llama 4's; Llama's


@dataclass(frozen=True)
class MlpSpec:
    """An MLP class the probe checked: its act's attribute and class, the activation's name in
    hf_layer.MLP_ACTIVATIONS, and whether gate and up come packed from one projection."""

    owner: type
    act_name: str
    act_cls: type
    activation: str
    packed: bool


@dataclass(frozen=True)
class MlpState:
    """What a fused MLP calls: the gated op for its activation (hf_ops.bound_gated), and its spec."""

    gated: Callable
    spec: MlpSpec


def _act_runs_as(mlp: nn.Module, spec: MlpSpec) -> bool:
    act = getattr(mlp, spec.act_name, None)
    return type(act) is spec.act_cls and (not isinstance(act, nn.Module) or runs_as(act, spec.act_cls))


def _keeps_output(*modules: nn.Module) -> bool:
    """Whether a forward hook could hold a projection's output past the forward (hf_layer's rule)."""
    if getattr(nn.modules.module, "_global_forward_hooks", None):
        return True
    return any(m._forward_hooks for m in modules)


def mlp_forward(self, x):
    """A fused MLP: down(op(gate(x), up(x))) or down(op(gate_up(x))), or the class's own forward
    where its act changed."""
    st: MlpState = self.__dict__[STATE]
    spec = st.spec
    if not _act_runs_as(self, spec):
        return spec.owner.forward(self, x)
    if spec.packed:  # the projection's own output, read by nothing else unless a hook holds it
        gate_up = self.gate_up_proj(x)
        return self.down_proj(st.gated(gate_up, owned=not _keeps_output(self.gate_up_proj)))
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(st.gated(gate, up, owned=not _keeps_output(self.gate_proj, self.up_proj)))


def _probe_named(mlp: nn.Module, where: str, packed: bool) -> MlpSpec:
    """The spec of a gated MLP whose act is under one of _ACT_NAMES, once its class's forward is
    seen to compute down(act(g) * u) in train and eval mode: g, u = gate_up(x).chunk(2, -1)
    where `packed`, else g, u = gate(x), up(x)."""
    projections = _PACKED_CHILDREN if packed else _SPLIT_CHILDREN
    form = "gate_up_proj/down_proj" if packed else "gate_proj/up_proj/down_proj"
    cls = forward_owner(type(mlp))
    children = {name for name, _ in mlp.named_children()}
    act_name = next((n for n in _ACT_NAMES if getattr(mlp, n, None) is not None), None)
    if act_name is None or not projections <= children or not children <= projections | {act_name}:
        raise UnsupportedModel(
            f"{where} ({type(mlp).__name__}) is not {form} with an activation (has {sorted(children)})"
        )
    if type(mlp) is not cls or "forward" in mlp.__dict__:
        raise UnsupportedModel(f"{where} ({type(mlp).__name__}) runs a forward other than its class's")
    act = getattr(mlp, act_name)
    gen = torch.Generator().manual_seed(3)
    n, f = 8, 11
    with torch.random.fork_rng():
        torch.manual_seed(3)
        lin = lambda i, o: nn.Linear(i, o, dtype=torch.float64)  # noqa: E731
        if packed:
            modules = {"gate_up_proj": lin(n, 2 * f), "down_proj": lin(f, n)}
        else:
            modules = {"gate_proj": lin(n, f), "up_proj": lin(n, f), "down_proj": lin(f, n)}
    if act_name in children:
        modules[act_name] = act
    x = 2 * torch.randn(5, n, generator=gen, dtype=torch.float64)
    got = []
    with torch.no_grad():
        model = stand_in(mlp, cls, modules)
        try:
            for training in PROBE_MODES:
                with seeded(5):
                    got.append(cls.forward(model.train(training), x))
        except Exception as e:
            raise UnsupportedModel(f"{where} ({type(mlp).__name__}) could not be checked: {e}") from None
        if packed:
            g, u = modules["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            g, u = modules["gate_proj"](x), modules["up_proj"](x)
        for name, fn in MLP_ACTIVATIONS.items():
            want = modules["down_proj"](fn(g) * u)
            tol = PROBE_TOL * want.abs().max()
            if all(y.shape == want.shape and bool(((y - want).abs() <= tol).all()) for y in got):
                return MlpSpec(cls, act_name, type(act), name, packed)
    inputs = "g, u = gate_up_proj(x).chunk(2)" if packed else "g, u = gate_proj(x), up_proj(x)"
    raise UnsupportedModel(
        f"{where} ({type(mlp).__name__}) does not compute down(act(g) * u), {inputs}, "
        f"with act SiLU or GELU in train and eval mode (its {act_name} is {type(act).__name__})"
    )


def probe_packed_mlp(mlp: nn.Module, where: str) -> MlpSpec:
    """The spec of an MLP with one gate_up_proj (Phi-3, GLM-4): see _probe_named."""
    return _probe_named(mlp, where, packed=True)


def ungated(mlp: nn.Module) -> str | None:
    """Why an MLP of two projections around an activation has no gated op's place, where it is
    one (GPT-NeoX, Phi-1/2, StarCoder2, GPT-J: down(act(up(x))), GELU without a gate); else None."""
    linears = [name for name, m in mlp.named_children() if isinstance(m, nn.Linear)]
    acts = [name for name, m in mlp.named_children() if not isinstance(m, (nn.Linear, nn.Dropout))]
    if len(linears) != 2 or len(acts) != 1:
        return None
    a, b = (getattr(mlp, name) for name in linears)
    pairs = ((a, b), (b, a))
    through = [u.out_features == d.in_features and d.out_features == u.in_features for u, d in pairs]
    if not any(through):
        return None  # not hidden -> F -> hidden: a packed gate_up (2F out, F back in) is gated
    act = type(getattr(mlp, acts[0])).__name__
    return (
        f"{type(mlp).__name__} is down(act(up(x))) with no gate ({'/'.join(linears)}, {act}): "
        "an activation alone is not an op of profuse's (silu_mul and gelu_mul take a gate)"
    )


def probe_gated_mlp(mlp: nn.Module, where: str) -> MlpSpec:
    """The spec of a gated MLP, packed (gate_up_proj) or not (gate_proj and up_proj; its act as
    Llama's act_fn, or Llama 4's activation_fn)."""
    if isinstance(mlp._modules.get("gate_up_proj"), nn.Module):
        return probe_packed_mlp(mlp, where)
    why = ungated(mlp)
    if why is not None:
        raise UnsupportedModel(f"{where}: {why}")
    if getattr(mlp, "act_fn", None) is None and getattr(mlp, "activation_fn", None) is not None:
        return _probe_named(mlp, where, packed=False)
    owner, act_cls, activation = probe_mlp(mlp, where)
    return MlpSpec(owner, "act_fn", act_cls, activation, False)


def plan_mlps(
    mlps: list[nn.Module], gated_for: Callable[[str], Callable], what: str
) -> list[tuple[nn.Module, type, MlpState]]:
    """(module, fused class, state) for each MLP, once every one is probed (one class, one
    activation) and `gated_for(activation)` gives its op; raises UnsupportedModel with the reason."""
    specs = {probe_gated_mlp(mlp, f"layer {i}'s mlp") for i, mlp in enumerate(mlps)}
    if len(specs) != 1:
        raise UnsupportedModel(f"{what}'s MLPs differ from layer to layer")
    spec = specs.pop()
    state = MlpState(gated_for(spec.activation), spec)
    fused = fused_class(spec.owner, "gated_mlp", mlp_forward)
    installs = []
    for i, mlp in enumerate(mlps):
        target = fused_target(mlp, spec.owner, fused)
        if target is None:
            raise UnsupportedModel(
                f"layer {i}'s mlp ({type(mlp).__name__}) is derived from {spec.owner.__name__} "
                "with a forward of its own"
            )
        installs.append((mlp, target, state))
    return installs


__all__ = [
    "MlpSpec",
    "MlpState",
    "mlp_forward",
    "plan_mlps",
    "probe_gated_mlp",
    "probe_packed_mlp",
    "ungated",
]
