"""What each module of a model is, read from its structure, and profiler ranges named after it.

Part A names fusion candidates by where their work runs, not by op names: an aten::mul may be
SwiGLU's gate x up, RoPE's rotation, a norm's weight or AdamW's update. `module_ranges()` installs
global module hooks (torch.nn.modules.module.register_module_forward_pre_hook and ..._forward_hook)
for the profiled steps; each call of a module whose role it recognises runs inside a
record_function range `profuse.module: ROLE (ClassName)`, so the trace says which module issued
every operator, and through autograd's sequence numbers, every backward node
(profuse.attribution reads it). Nothing is asked of the user's code.

Roles, by structure (class names are a hint, never the only test):
    rms_norm, layer_norm  a 1-D weight and an epsilon attribute (eps, variance_epsilon), or
                          nn.RMSNorm / nn.LayerNorm; layer_norm when it has a bias or says so
    mlp                   gate_proj + up_proj + down_proj (Hugging Face), w1 + w2 + w3, or a
                          class named *MLP / *FFN / *FeedForward / *SwiGLU holding linear layers
    attention             q_proj + k_proj + v_proj, a packed qkv / c_attn / Wqkv, or a class
                          named *Attention holding linear layers
    layer                 a module whose direct children hold a norm and an attention or an MLP
                          (a decoder layer: what it runs itself, outside them, is the residual adds)
    rotary                a class named *Rotary* / *RoPE* (the cos / sin tables)
    experts               a mixture of experts' experts: 3-D gate_up_proj (or up_proj) and
                          down_proj parameters, every expert's weights in one tensor
                          (transformers 5.x); its own work is the tokens gathered by expert,
                          the activation x up, the routing weights' product and the combine
    router                the MoE block's child that scores the experts: a 2-D (experts, hidden)
                          weight, no children (top-k and the softmax over experts run in it)
    moe                   a module whose direct children hold experts (the sparse MoE block:
                          router, experts, a shared expert; what it runs itself is the combine)
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.profiler import record_function

RANGE_PREFIX = "profuse.module: "
NORM_ROLES = ("rms_norm", "layer_norm")
MOE_ROLES = ("moe", "router", "experts")
ROLES = (*NORM_ROLES, "mlp", "attention", "layer", "rotary", *MOE_ROLES)

_MLP_NAME = re.compile(r"mlp|ffn|feedforward|feed_forward|swiglu|geglu|glu$", re.IGNORECASE)
_ATTENTION_NAME = re.compile(r"attention|attn", re.IGNORECASE)
_ROTARY_NAME = re.compile(r"rotary|rope", re.IGNORECASE)
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)
_ROUTER_NAME = re.compile(r"router|gate", re.IGNORECASE)


def _linear_children(m: nn.Module) -> int:
    return sum(isinstance(c, nn.Linear) for c in m.children())


def _has(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Module) for n in names)


def _norm_role(m: nn.Module) -> str | None:
    cls = type(m).__name__
    if isinstance(m, nn.LayerNorm) or "layernorm" in cls.lower():
        return "layer_norm"
    if isinstance(m, getattr(nn, "RMSNorm", ())) or "rmsnorm" in cls.lower():
        return "rms_norm"
    weight = getattr(m, "weight", None)
    has_eps = any("eps" in name for name in vars(m)) or hasattr(m, "eps")
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and has_eps and not any(m.children()):
        bias = getattr(m, "bias", None)
        return "layer_norm" if isinstance(bias, torch.Tensor) else "rms_norm"
    if _NORM_NAME.search(cls) and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return "rms_norm"
    return None


def _is_experts(m: nn.Module) -> bool:
    p = m._parameters
    up = p.get("gate_up_proj", p.get("up_proj"))
    return all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (up, p.get("down_proj")))


def _router_of(m: nn.Module, experts: nn.Module) -> nn.Module | None:
    """The child of MoE block `m` that scores `experts`: a leaf with an (experts, hidden) weight."""
    n = experts._parameters["down_proj"].shape[0]
    for c in m.children():
        weight = c._parameters.get("weight") if not any(c.children()) else None
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == n:
            return c
    return None


def _classify(m: nn.Module) -> str | None:
    cls = type(m).__name__
    if isinstance(m, (nn.Linear, nn.Embedding, nn.Dropout)) or isinstance(m, nn.ModuleList):
        return None
    if _is_experts(m):
        return "experts"
    experts = next((c for c in m.children() if _is_experts(c)), None)
    if experts is not None:  # the MoE block: its router is known by its place beside the experts
        router = _router_of(m, experts)
        if router is not None:
            _ROLE_CACHE[router] = "router"
        return "moe"
    weight = m._parameters.get("weight")
    if _ROUTER_NAME.search(cls) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return "router"  # a router met before its block (a hook on it alone)
    norm = _norm_role(m)
    if norm is not None:
        return norm
    if _ROTARY_NAME.search(cls) and _linear_children(m) == 0:
        return "rotary"
    if _has(m, "gate_proj", "up_proj", "down_proj") or _has(m, "w1", "w2", "w3"):
        return "mlp"
    if _has(m, "q_proj", "k_proj", "v_proj") or any(_has(m, n) for n in ("qkv", "c_attn", "Wqkv")):
        return "attention"
    if _linear_children(m) >= 2 and _MLP_NAME.search(cls):
        return "mlp"
    if _linear_children(m) >= 2 and _ATTENTION_NAME.search(cls):
        return "attention"
    kids = {role_of(c) for c in m.children()}
    if kids & {"attention", "mlp", "moe"} and kids & set(NORM_ROLES):
        return "layer"
    return None


_ROLE_CACHE: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()


def role_of(m: nn.Module) -> str | None:
    """The module's role (one of ROLES) by its structure, or None: modules are classified once."""
    try:
        return _ROLE_CACHE[m]
    except KeyError:
        role = _ROLE_CACHE[m] = _classify(m)
        return role


def range_name(m: nn.Module, role: str) -> str:
    return f"{RANGE_PREFIX}{role} ({type(m).__name__})"


def role_of_range(name: str) -> str | None:
    """'profuse.module: rms_norm (LlamaRMSNorm)' -> 'rms_norm'; None for any other range."""
    if not name.startswith(RANGE_PREFIX):
        return None
    return name[len(RANGE_PREFIX) :].split(" ", 1)[0]


class _Ranges:
    """The hooks' state: the ranges open on each thread, and the first device a module showed."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.device: torch.device | None = None

    def stack(self) -> list:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def pre(self, m: nn.Module, _args) -> None:
        if self.device is None:
            p = next(m.parameters(recurse=False), None)
            if p is not None:
                self.device = p.device
        role = role_of(m)
        if role is None:
            return
        r = record_function(range_name(m, role))
        r.__enter__()
        self.stack().append((m, r))

    def post(self, m: nn.Module, _args, _out) -> None:
        stack = self.stack()
        if role_of(m) is None or not stack or stack[-1][0] is not m:
            return
        _, r = stack.pop()
        r.__exit__(None, None, None)


@contextlib.contextmanager
def module_ranges(enabled: bool = True) -> Iterator[_Ranges]:
    """Open a `profuse.module: ROLE` range around every call of a module with a role, for the
    duration; yields the state, whose `device` is that of the first module parameter seen (how
    profuse.profile finds where a step runs). `enabled=False` installs nothing (a compiled step:
    Dynamo would trace the hooks into its graphs), and the device stays unknown."""
    state = _Ranges()
    if not enabled:
        yield state
        return
    pre = nn_module.register_module_forward_pre_hook(state.pre)
    post = nn_module.register_module_forward_hook(state.post, always_call=True)
    try:
        yield state
    finally:
        pre.remove()
        post.remove()
        for _, r in reversed(state.stack()):  # a forward that raised: close what it left open
            r.__exit__(None, None, None)
        state.stack().clear()
