"""The fused decoder layer and final norm of a Hugging Face Llama-family model, and their probes.

A decoder layer computes

    h  = x + attn(input_layernorm(x))
    x' = h + mlp(post_attention_layernorm(h)),    mlp(y) = down(silu(gate(y)) * up(y))

and the model ends with norm(x_L). Fused, a layer takes the stream as one tensor (layer 0, where
the embeddings enter) or as the pair (x, residual) whose sum it is, and hands on the pair
(mlp_out, h): the next layer's input norm, or the final norm, does the add.

    rms_norm(x, w_in, eps)                  layer 0's input norm (no add in front)
    add_rms_norm(x, residual, w_in, eps)    layer i's input norm and layer i-1's MLP add
    add_rms_norm(attn_out, h, w_post, eps)  post_attention_layernorm and the attention add
    silu_mul(gate(y), up(y))                the MLP's activation
    add_rms_norm(mlp_out, h, w_final, eps)  the final norm and the last layer's MLP add

Each place runs its op only when the modules it stands for would compute it (hf_modules.runs_as);
otherwise it calls them. A layer hands on the pair only when nothing outside would see it: no
hook observes the layer, and the module that takes its output (the next layer, or the final norm)
is a fused one that takes pairs and that no hook observes either. Otherwise it hands on the
hidden state itself, so a hook on a fused layer sees what it saw unfused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profuse.errors import UnsupportedModel
from profuse.fusion.hf_modules import (
    PROBE_MODES,
    STATE,
    forward_owner,
    is_fused,
    observed,
    runs_as,
    seeded,
    stand_in,
)
from profuse.fusion.hf_recompute import recomputed

_MLP_CHILDREN = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # one thing, by version
PROBE_TOL = 1e-5  # the probes run float64 but Hugging Face's norms compute in fp32 (eps 1.2e-7)
# transformers 4.54 is the first whose decoder layers return the hidden state alone and whose models
# hand it straight to the next layer (before, layer_outputs[0]); the layer probe checks it.
MIN_TRANSFORMERS = "4.54"


@dataclass(frozen=True)
class NormSpec:
    """A norm class the probe checked, the attribute that holds its eps (read at each call), and
    the offset its weight is scaled by: 0.0 for rms_norm(x) * w, 1.0 for Gemma's (1 + w)."""

    cls: type
    eps_name: str
    offset: float = 0.0

    def eps(self, norm: nn.Module) -> float:
        return getattr(norm, self.eps_name)

    def kwargs(self) -> dict:
        """What a norm op takes beyond (x, weight, eps): weight_offset, only where there is one
        (so an op set without offsets still serves every plain norm)."""
        return {"weight_offset": self.offset} if self.offset else {}


@dataclass(frozen=True)
class LayerState:
    """What a fused layer calls. An op is None where it is not fused; the norm and MLP classes are
    those the probes checked (`silu_mul` is the MLP's gated op for its `activation`: gelu_mul
    for a GELU); `stack` and `index` find the module that takes the layer's output."""

    silu_mul: Callable | None
    add_rms_norm: Callable | None
    rms_norm: Callable | None
    input_norm: NormSpec | None
    post_norm: NormSpec | None
    mlp_cls: type | None
    act_cls: type | None
    attn_defaults: dict  # the arguments the layer's own forward hands attention by default
    stack: nn.Module | None  # None: always hand on the pair (the probe's stand-in)
    index: int
    activation: str = "silu"  # the MLP's, a name in MLP_ACTIVATIONS: silu_mul holds its gated op
    recompute: bool = True  # the norms' outputs made again in the backward, not kept (hf_recompute)
    # The layer's own float attribute each sublayer's output is multiplied by before its add
    # (Granite's residual_multiplier: h = x + attn(norm(x)) * m), read at each call; None: no scale.
    scale: str | None = None
    # The layer's own modules each sublayer's output passes through before its add (Phi-3's
    # resid_attn_dropout and resid_mlp_dropout, nn.Dropout), by name; None: straight to the add.
    attn_out: str | None = None
    mlp_out: str | None = None
    mlp_name: str = "mlp"  # the layer's MLP, whatever it is named (GraniteMoE's block_sparse_moe)
    # The layer's own arguments that its forward does not hand attention (Llama 4's position_ids),
    # found by the probe: the fused body withholds them too. Empty: attention gets every one.
    withheld: frozenset = frozenset()
    # The layer takes the first of its MLP's two outputs, viewed as the stream (Llama 4's MoE
    # layers: out, router_logits = feed_forward(y); x' = h + out.view(h.shape)), found by the probe.
    mlp_unpack: bool = False

    def __deepcopy__(self, memo):
        """A deep copy of the model copies the stack once, and the copy's layers find the copy's
        stack; a layer copied alone keeps the stack it belongs to."""
        return dataclasses.replace(self, stack=memo.get(id(self.stack), self.stack))


@dataclass(frozen=True)
class FinalNormState:
    """What the fused final norm calls: add_rms_norm on a pair, rms_norm on a tensor (or None)."""

    add_rms_norm: Callable | None
    rms_norm: Callable | None
    norm: NormSpec


# --------------------------------------------------------------------------------------------
# The fused forwards
# --------------------------------------------------------------------------------------------


def takes_pair(module: nn.Module) -> bool:
    """True when `module` is a fused layer or final norm that takes the (x, residual) pair, runs
    its class's forward, and no hook sees its input."""
    st = module.__dict__.get(STATE)
    return (
        isinstance(st, (LayerState, FinalNormState))
        and st.add_rms_norm is not None
        and is_fused(module)
        and "forward" not in module.__dict__
        and not observed(module)
    )


def _hands_pair(layer: nn.Module, st: LayerState) -> bool:
    if st.add_rms_norm is None:
        return False
    if st.stack is None:
        return True
    if observed(layer):
        return False
    layers = st.stack.layers
    return takes_pair(layers[st.index + 1] if st.index + 1 < len(layers) else st.stack.norm)


def norm_alone(
    op, spec: NormSpec | None, norm: nn.Module, x: torch.Tensor, owned: bool = False
) -> torch.Tensor:
    """rms_norm(x) through the op where `norm` is as probed, else the module itself. `owned`: the
    gradient reaching the output is autograd's own (hf_ops.bound_op)."""
    if op is not None and spec is not None and runs_as(norm, spec.cls):
        return op(x, norm.weight, spec.eps(norm), owned=owned, **spec.kwargs())
    return norm(x)


def norm_after_add(add_op, op, spec: NormSpec | None, norm: nn.Module, x, residual, owned: bool = False):
    """(norm(h), h), h = residual + x: add_rms_norm where `norm` is as probed, else the add and
    then norm_alone."""
    if add_op is not None and spec is not None and runs_as(norm, spec.cls):
        return add_op(x, residual, norm.weight, spec.eps(norm), owned=owned, **spec.kwargs())
    h = residual + x
    return norm_alone(op, spec, norm, h, owned), h


def _keeps_output(*modules: nn.Module) -> bool:
    """Whether a forward hook (a module's own, or a global one) could hold a module's output past
    the forward: then a backward must not write over it."""
    if getattr(nn.modules.module, "_global_forward_hooks", None):
        return True
    return any(m._forward_hooks for m in modules)


def _unowned(op: Callable | None) -> Callable | None:
    """A plain op as a fused place calls a bound one (hf_ops.bound_op): `owned` taken and ignored."""
    if op is None:
        return None
    return lambda *args, owned=False, **kwargs: op(*args, **kwargs)


def _mlp_runs_as(mlp: nn.Module, st: LayerState) -> bool:
    if not runs_as(mlp, st.mlp_cls):
        return False
    act = getattr(mlp, "act_fn", None)
    if type(act) is not st.act_cls:
        return False
    return not isinstance(act, nn.Module) or runs_as(act, st.act_cls)


def attn_kwargs(st: LayerState | PostNormState, kwargs: dict) -> dict:
    """What a fused body hands attention: the layer's arguments (defaults, then those given)
    but the ones its own forward withholds."""
    return {k: v for k, v in {**st.attn_defaults, **kwargs}.items() if k not in st.withheld}


def layer_forward(self, hidden_states, *args, **kwargs):
    """The fused decoder layer: the stream as one tensor or the (x, residual) pair in; the pair
    (mlp_out, h) out, or the hidden state where something would see the pair."""
    st: LayerState = self.__dict__[STATE]
    if args:  # arguments given by position, in the order of the layer's own forward
        kwargs = {**dict(zip(st.attn_defaults, args)), **kwargs}
    x, residual = hidden_states if isinstance(hidden_states, tuple) else (hidden_states, None)
    pair = _hands_pair(self, st)
    if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
        # As transformers' GradientCheckpointingLayer does, but with x and residual as two tensor
        # arguments: through a tuple argument, use_reentrant=True would carry no gradient.
        kwargs = _without_cache(self, kwargs)
        body = functools.partial(layer_body, self, pair=pair, **kwargs)
        return self._gradient_checkpointing_func(body, x, residual)
    return layer_body(self, x, residual, pair=pair, **kwargs)


def layer_body(self, x, residual, *, pair: bool, **kwargs):
    st: LayerState = self.__dict__[STATE]
    if residual is None:  # layer 0, or a layer handed the hidden state
        residual = x
        y = norm_alone(st.rms_norm, st.input_norm, self.input_layernorm, x, owned=True)
    else:  # the previous layer's MLP add, with this layer's input norm
        y, residual = norm_after_add(
            st.add_rms_norm, st.rms_norm, st.input_norm, self.input_layernorm, x, residual, owned=True
        )
    with _kept(st, y):
        attn_out = self.self_attn(hidden_states=y, **attn_kwargs(st, kwargs))[0]
    if st.attn_out is not None:
        attn_out = getattr(self, st.attn_out)(attn_out)
    if st.scale is not None:
        attn_out = attn_out * getattr(self, st.scale)
    y, residual = norm_after_add(
        st.add_rms_norm,
        st.rms_norm,
        st.post_norm,
        self.post_attention_layernorm,
        attn_out,
        residual,
        owned=True,
    )
    mlp = getattr(self, st.mlp_name)
    if st.silu_mul is not None and not st.mlp_unpack and _mlp_runs_as(mlp, st):
        # gate and up are the projections' own outputs, read by nothing else unless a hook holds one
        with _kept(st, y):
            gate, up = mlp.gate_proj(y), mlp.up_proj(y)
        owned = not _keeps_output(mlp.gate_proj, mlp.up_proj)
        out = mlp.down_proj(st.silu_mul(gate, up, owned=owned))  # silu_mul, or gelu_mul for a GELU
    else:
        with _kept(st, y):
            out = mlp(y)
        if st.mlp_unpack:
            out = out[0].view(residual.shape)
    if st.mlp_out is not None:
        out = getattr(self, st.mlp_out)(out)
    if st.scale is not None:
        out = out * getattr(self, st.scale)
    return (out, residual) if pair else residual + out


def _kept(st, y: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where the modules reading the norm output y run: y's saved copies made again in the
    backward where the layer was fused so (hf_recompute), else autograd's own saving."""
    return recomputed(y) if st.recompute else contextlib.nullcontext()


def _without_cache(layer: nn.Module, kwargs: dict) -> dict:
    """kwargs with the cache dropped, as transformers drops it under checkpointing (a recompute
    would write the cache twice)."""
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
    return kwargs


def final_norm_forward(self, hidden_states):
    """The fused final norm: add_rms_norm on the pair, rms_norm (or its own forward) on a tensor."""
    st: FinalNormState = self.__dict__[STATE]
    if isinstance(hidden_states, tuple):
        x, residual = hidden_states
        if st.add_rms_norm is not None:
            return st.add_rms_norm(x, residual, self.weight, st.norm.eps(self), **st.norm.kwargs())[0]
        hidden_states = residual + x
    if st.rms_norm is not None:
        return st.rms_norm(hidden_states, self.weight, st.norm.eps(self), **st.norm.kwargs())
    return st.norm.cls.forward(self, hidden_states)


# --------------------------------------------------------------------------------------------
# The post-norm layer (OLMo 2): each sublayer's output normalised, then added to the stream
#
#     h  = x + post_attention_layernorm(attn(x))        rms_norm_add(attn_out, x, w_attn, eps)
#     x' = h + post_feedforward_layernorm(mlp(h))       rms_norm_add(mlp_out, h, w_mlp, eps)
#
# and the sandwich layer (Gemma 2 and 3), the same with a norm in front of each sublayer too:
# attn(input_layernorm(x)) and mlp(pre_feedforward_layernorm(h)), each an rms_norm.
# The hidden state passes from layer to layer as it is (no pair); the MLP is its own module
# (fused by its class where it can be: hf_mlp), and the final norm a plain rms_norm.
# --------------------------------------------------------------------------------------------

POSTNORM_CHILDREN = frozenset({"self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"})
SANDWICH_CHILDREN = POSTNORM_CHILDREN | {"input_layernorm", "pre_feedforward_layernorm"}
# A sandwich layer's four norms by role: (in front of attention, after it, in front of the MLP,
# after it), Gemma 2's names; another layer's four are given these roles by the probe
# (sandwich_roles), GLM-4's (input_layernorm, post_self_attn_layernorm, post_attention_layernorm,
# post_mlp_layernorm).
SANDWICH_ROLES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
POSTNORM_ROLES = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


def sandwich_roles(layer: nn.Module) -> list[tuple[str, str, str, str]]:
    """The role assignments worth probing for a layer of self_attn, mlp and four other children:
    Gemma 2's names as they are where the layer has them, else every order of its four."""
    others = sorted(
        name
        for name, m in layer.named_children()
        if name not in ("self_attn", "mlp") and not isinstance(m, nn.Dropout)
    )
    if len(others) != 4 or not {"self_attn", "mlp"} <= dict(layer.named_children()).keys():
        return []
    if set(others) == set(SANDWICH_ROLES):
        return [SANDWICH_ROLES]
    return list(itertools.permutations(others))


@dataclass(frozen=True)
class PostNormState:
    """What a fused post-norm layer calls: rms_norm_add, with the two norm classes the probe
    checked; a sandwich layer's pre-norms too (rms_norm, None where not fused)."""

    rms_norm_add: Callable
    attn_norm: NormSpec
    mlp_norm: NormSpec
    attn_defaults: dict
    sandwich: bool = False
    rms_norm: Callable | None = None
    pre_norm: NormSpec | None = None  # input_layernorm's and pre_feedforward_layernorm's class
    recompute: bool = True  # the pre-norms' outputs made again in the backward (hf_recompute)
    roles: tuple = POSTNORM_ROLES  # the norms' names by role (SANDWICH_ROLES' order)
    withheld: frozenset = frozenset()  # as LayerState's: the arguments attention is not handed


def norm_then_add(op, spec: NormSpec, norm: nn.Module, x, residual):
    """residual + norm(x): rms_norm_add where `norm` is as probed, else the module and the add."""
    if runs_as(norm, spec.cls):
        return op(x, residual, norm.weight, spec.eps(norm), **spec.kwargs())
    return residual + norm(x)


def postnorm_layer_forward(self, hidden_states, *args, **kwargs):
    """The fused post-norm decoder layer: the hidden state in, the hidden state out."""
    st: PostNormState = self.__dict__[STATE]
    if args:
        kwargs = {**dict(zip(st.attn_defaults, args)), **kwargs}
    if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
        body = functools.partial(postnorm_layer_body, self, **_without_cache(self, kwargs))
        return self._gradient_checkpointing_func(body, hidden_states)
    return postnorm_layer_body(self, hidden_states, **kwargs)


def postnorm_layer_body(self, x, **kwargs):
    st: PostNormState = self.__dict__[STATE]
    attn_pre, attn_post, mlp_pre, mlp_post = st.roles
    y = norm_alone(st.rms_norm, st.pre_norm, getattr(self, attn_pre), x) if st.sandwich else x
    with _kept(st, y) if st.sandwich else contextlib.nullcontext():
        attn_out = self.self_attn(hidden_states=y, **attn_kwargs(st, kwargs))[0]
    h = norm_then_add(st.rms_norm_add, st.attn_norm, getattr(self, attn_post), attn_out, x)
    y = norm_alone(st.rms_norm, st.pre_norm, getattr(self, mlp_pre), h) if st.sandwich else h
    with _kept(st, y) if st.sandwich else contextlib.nullcontext():
        out = self.mlp(y)
    return norm_then_add(st.rms_norm_add, st.mlp_norm, getattr(self, mlp_post), out, h)


# --------------------------------------------------------------------------------------------
# Probes (nothing is changed here): each raises UnsupportedModel with the reason
# --------------------------------------------------------------------------------------------

_EPS_NAMES = ("variance_epsilon", "eps")


# The weight offsets a norm may scale by: w (Llama's) and 1 + w (Gemma's, its weight initialised at 0)
NORM_OFFSETS = (0.0, 1.0)


def probe_norm(norm: nn.Module, where: str) -> NormSpec:
    """The norm's class, eps attribute and weight offset, once its class's forward is seen to
    compute rms_norm(x) * (offset + weight) with that eps, for one offset of NORM_OFFSETS."""
    cls = forward_owner(type(norm))
    eps_name = next((n for n in _EPS_NAMES if isinstance(getattr(norm, n, None), float)), None)
    w = getattr(norm, "weight", None)
    params = {name for name, _ in norm.named_parameters()}
    if eps_name is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or params != {"weight"}:
        raise UnsupportedModel(f"{where} ({type(norm).__name__}) is not an RMSNorm with a weight and an eps")
    if type(norm) is not cls:
        raise UnsupportedModel(
            f"{where} is a {type(norm).__name__}, a {cls.__name__} wrapped by a class of its own"
        )
    eps = getattr(norm, eps_name)
    gen = torch.Generator().manual_seed(0)
    n = w.shape[0]
    weight = nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64))
    # rows of mean square 1, about eps (where eps matters) and 1e6
    x = (
        torch.randn(3, n, generator=gen, dtype=torch.float64)
        * torch.tensor([[1.0], [eps**0.5], [1e3]]).double()
    )
    normed = F.rms_norm(x, (n,), None, eps)
    try:
        model, got = stand_in(norm, cls, {}, weight=weight), []
        for training in PROBE_MODES:
            with torch.no_grad(), seeded(5):
                got.append(cls.forward(model.train(training), x))
    except Exception as e:  # any failure of the stand-in is a layout profuse does not know
        raise UnsupportedModel(f"{where} ({type(norm).__name__}) could not be checked: {e}") from None
    for offset in NORM_OFFSETS:
        want = normed * (offset + weight.detach())
        tol = PROBE_TOL * want.abs().amax(-1, True)
        if all(y.shape == want.shape and bool(((y - want).abs() <= tol).all()) for y in got):
            return NormSpec(cls, eps_name, offset)
    raise UnsupportedModel(
        f"{where} ({type(norm).__name__}) computes neither rms_norm(x) * weight nor "
        f"rms_norm(x) * (1 + weight) with eps={eps}: fusing it would change the model"
    )


# The gated MLPs' activations, act(gate) * up, by name: SiLU (silu_mul) and GELU, tanh or exact (gelu_mul)
MLP_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def probe_mlp(mlp: nn.Module, where: str) -> tuple[type, type, str]:
    """The MLP's class, its act_fn's, and the activation's name in MLP_ACTIVATIONS, once the
    class's forward is seen to compute down(act(gate(x)) * up(x)) in train and eval mode."""
    cls = forward_owner(type(mlp))
    children = {name for name, _ in mlp.named_children()}
    act = getattr(mlp, "act_fn", None)
    if not {"gate_proj", "up_proj", "down_proj"} <= children or act is None or not children <= _MLP_CHILDREN:
        raise UnsupportedModel(
            f"{where} ({type(mlp).__name__}) is not gate_proj/up_proj/down_proj with an act_fn "
            f"(has {sorted(children)})"
        )
    if type(mlp) is not cls or "forward" in mlp.__dict__:
        raise UnsupportedModel(f"{where} ({type(mlp).__name__}) runs a forward other than its class's")
    gen = torch.Generator().manual_seed(1)
    n, f = 8, 11
    lin = lambda i, o: nn.Linear(i, o, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        gate, up, down = lin(n, f), lin(n, f), lin(f, n)
    modules = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    if "act_fn" in children:
        modules["act_fn"] = act
    x = 2 * torch.randn(5, n, generator=gen, dtype=torch.float64)
    got = {}
    with torch.no_grad():
        model = stand_in(mlp, cls, modules)
        for training in PROBE_MODES:  # the gated op's place calls down_proj(op(...)), nothing more
            try:
                with seeded(5):
                    got[training] = cls.forward(model.train(training), x)
            except Exception as e:
                raise UnsupportedModel(f"{where} ({type(mlp).__name__}) could not be checked: {e}") from None
        for name, fn in MLP_ACTIVATIONS.items():
            want = down(fn(gate(x)) * up(x))
            tol = PROBE_TOL * want.abs().max()
            ok = {
                training: y.shape == want.shape and bool(((y - want).abs() <= tol).all())
                for training, y in got.items()
            }
            if all(ok.values()):
                return cls, type(act), name
            if ok.get(False):
                raise UnsupportedModel(
                    f"{where} ({type(mlp).__name__}) computes down(act(gate(x)) * up(x)) only in eval mode: "
                    "in training it does more (dropout?), which the gated op's place would skip"
                )
    raise UnsupportedModel(
        f"{where} ({type(mlp).__name__}) does not compute down(act(gate(x)) * up(x)) with act SiLU or GELU "
        f"(its act_fn is {type(act).__name__}): only those fuse, into silu_mul or gelu_mul"
    )


class _Sentinel:
    """A stand-in argument: the probe checks that attention receives it, untouched."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def attn_defaults(cls: type) -> dict:
    """The arguments the layer class's forward names after hidden_states, with their defaults."""
    params = list(inspect.signature(cls.forward).parameters.values())[2:]  # self, hidden_states
    return {
        p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    }


def _stand_ins(n: int, calls: list[dict]) -> tuple[type, type]:
    """The layer probes' float64 stand-ins of width n: an attention that records the arguments it
    is handed in `calls`, and an RMSNorm with a weight away from its init."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(n, n, dtype=torch.float64) / n**0.5)

        def forward(self, hidden_states, **kwargs):
            calls.append(kwargs)
            return torch.tanh(hidden_states @ self.w), None

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(1 + torch.randn(n, dtype=torch.float64) / 4), 1e-6

        def forward(self, x):
            return F.rms_norm(x, (n,), self.weight, self.eps)

    return Attention, Norm


LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
_NAMED_CHILDREN = LAYER_CHILDREN - {"mlp"}


def layer_parts(layer: nn.Module) -> tuple[str, list[str]] | None:
    """(the MLP's name, the extra dropout modules' names) of a layer holding self_attn and the two
    norms, one more module as its MLP whatever its name (mlp; GraniteMoE's block_sparse_moe), and
    only dropout modules beside (Phi-3's on its sublayers' outputs, which the probe places); else
    None."""
    children = dict(layer.named_children())
    if not _NAMED_CHILDREN <= children.keys():
        return None
    rest = [name for name in children if name not in _NAMED_CHILDREN]
    dropouts = [name for name in rest if isinstance(children[name], nn.Dropout)]
    mlps = [name for name in rest if name not in dropouts]
    if len(mlps) != 1:
        return None
    return mlps[0], dropouts


def probe_layer(layer: nn.Module, ops: dict[str, Callable], where: str) -> dict:
    """Run the layer class's own forward and the fused one on stand-in submodules (float64, CPU),
    with the ops fused and with none: raise unless they give the same output and hand attention
    the same arguments. `ops`: silu_mul, add_rms_norm and rms_norm, as eager float64 math.

    The layer's wiring beyond the four children is found the same way, each candidate tried in
    turn: a scale of each sublayer's output before its add among the layer's own float
    attributes (LayerState.scale), and the layer's extra dropout modules on the sublayers'
    outputs (LayerState.attn_out, mlp_out). The MLP is a stand-in returning a tensor; where no
    wiring matches so, one returning (out, aux) with out flattened to rows, as an MoE does whose
    layer takes out and views it as the stream (LayerState.mlp_unpack: Llama 4's). Returns the
    LayerState fields of the first wiring whose forward matches the layer's own, with the
    layer's arguments that its forward does not hand attention (LayerState.withheld); raises
    the last tensor wiring's reason where none does (the last pair wiring's where the layer
    took no tensor from its MLP)."""
    scales = [None] + [k for k, v in vars(layer).items() if type(v) is float and not k.startswith("_")]
    mlp_name, extra = layer_parts(layer) or ("mlp", [])
    outs = [(a, b) for a in [None, *extra] for b in [None, *extra] if (a is None or a != b)]
    outs = [o for o in outs if set(extra) <= set(o)] or [(None, None)]
    wirings = [dict(scale=s, attn_out=a, mlp_out=b, mlp_name=mlp_name) for (a, b) in outs for s in scales]
    reasons = {}  # by mlp_unpack, the last wiring's
    for wiring in [*wirings, *({**w, "mlp_unpack": True} for w in wirings)]:
        try:
            return _probe_layer(layer, ops, where, wiring)
        except UnsupportedModel as e:
            reasons[wiring.get("mlp_unpack", False)] = e
    # a layer that takes no tensor from its MLP is better told by what it does with a pair
    raise reasons[True] if isinstance(reasons[False], _OtherMlpOutput) else reasons[False]


def _withheld(defaults: dict, named: dict, calls: list[dict]) -> frozenset:
    """The layer's named arguments whose sentinels did not reach attention in its own forward's
    call (the first in `calls`): those its forward withholds from attention."""
    handed = {id(v) for v in calls[0].values()} if calls else set()
    return frozenset(name for name in defaults if id(named[name]) not in handed)


class _OtherMlpOutput(UnsupportedModel):
    """The layer's own forward raised on what the stand-in MLP returned."""


def _own_forward(
    cls: type, model: nn.Module, x, kwargs: dict, mlp_calls: list, where: str, mlp_name: str, returned: str
):
    """The layer class's own forward on the stand-in; where it raises after the stand-in MLP
    returned (`returned`: what it returns), the reason says so: the layer reads its MLP's output
    as something else (Llama 4's MoE layers unpack a tuple)."""
    mlp_calls.clear()
    try:
        with seeded(6):
            return cls.forward(model, x, **kwargs)
    except Exception as e:
        if not mlp_calls:
            raise
        raise _OtherMlpOutput(
            f"{where} does not take {returned} from its {mlp_name}: handed that by a stand-in, its "
            f"forward raised {type(e).__name__}: {e}"
        ) from None


def _probe_layer(layer: nn.Module, ops: dict[str, Callable], where: str, wiring: dict) -> dict:
    cls = forward_owner(type(layer))
    n, f = 8, 11
    calls: list[dict] = []
    mlp_calls: list[int] = []
    unpack = wiring.get("mlp_unpack", False)

    Attention, Norm = _stand_ins(n, calls)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = (
                nn.Linear(n, f, dtype=torch.float64),
                nn.Linear(n, f, dtype=torch.float64),
            )
            self.down_proj = nn.Linear(f, n, dtype=torch.float64)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            mlp_calls.append(1)
            out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return (out.reshape(-1, n), _Sentinel("aux")) if unpack else out

    defaults = attn_defaults(cls)
    spec = NormSpec(Norm, "eps")
    with torch.random.fork_rng():
        torch.manual_seed(2)
        children = {
            "self_attn": Attention(),
            wiring["mlp_name"]: Mlp(),
            "input_layernorm": Norm(),
            "post_attention_layernorm": Norm(),
        }
        extra = (layer_parts(layer) or ("mlp", []))[1]
        children.update({name: copy.deepcopy(getattr(layer, name)) for name in extra})
        model = stand_in(layer, cls, children)
        x, r = torch.randn(2, 2, 5, n, dtype=torch.float64)
    named = {name: _Sentinel(name) for name in defaults}
    named["probe_extra"] = _Sentinel("probe_extra")  # **kwargs pass through to attention too
    mlp = type(getattr(layer, wiring["mlp_name"], None)).__name__
    own = functools.partial(
        _own_forward,
        cls,
        model,
        mlp_calls=mlp_calls,
        where=f"{where} ({type(layer).__name__})",
        mlp_name=f"{wiring['mlp_name']} ({mlp})",
        returned="(out, aux)" if unpack else "a tensor",
    )
    try:
        with torch.no_grad():
            for training, kwargs in ((False, named), (False, {}), (True, named)):
                calls.clear()
                model.train(training)
                want = own(x + r, kwargs)
                if not isinstance(want, torch.Tensor):
                    raise UnsupportedModel(
                        f"{where} ({type(layer).__name__}) returns a {type(want).__name__}, not the "
                        f"hidden state alone: pip install 'transformers>={MIN_TRANSFORMERS}'"
                    )
                if kwargs is named and not training:  # the first run: which arguments reach attention
                    wiring = {**wiring, "withheld": _withheld(defaults, named, calls)}
                    fused = LayerState(
                        *(_unowned(ops[op]) for op in ("silu_mul", "add_rms_norm", "rms_norm")),
                        spec,
                        spec,
                        Mlp,
                        nn.SiLU,
                        defaults,
                        None,
                        0,
                        **wiring,
                    )
                    unfused = dataclasses.replace(fused, silu_mul=None, add_rms_norm=None, rms_norm=None)
                got = []
                for state, pair in ((fused, True), (fused, False), (unfused, False)):
                    model.__dict__[STATE] = state
                    for first, rest in ((x + r, None), (x, r)):  # layer 0's form, the others'
                        with seeded(6):
                            out = layer_body(model, first, rest, pair=pair, **kwargs)
                        got.append(out[0] + out[1] if pair else out)
                same_args = len(calls) == 1 + len(got) and all(c == calls[0] for c in calls)
                for out in got:
                    if not same_args or not (out - want).abs().max() <= PROBE_TOL * want.abs().max():
                        mode = " in training (dropout?)" if training else ""
                        raise UnsupportedModel(
                            f"{where} ({type(layer).__name__}) is not the pre-norm layer "
                            f"x + attn(norm(x)), then h + mlp(norm(h)){mode}: profuse cannot fuse it exactly"
                        )
    except UnsupportedModel:
        raise
    except Exception as e:
        raise UnsupportedModel(f"{where} ({type(layer).__name__}) could not be checked: {e}") from None
    return wiring


def probe_postnorm_layer(
    layer: nn.Module, where: str, sandwich: bool = False, roles: tuple | None = None
) -> frozenset:
    """Run the layer class's own forward and the fused post-norm (or sandwich) body on stand-in
    submodules (float64, CPU): raise unless they give the same output and hand attention the
    same arguments. `roles`: the norms' names by role (default Gemma 2's or OLMo 2's). Returns
    the layer's arguments that its forward does not hand attention (PostNormState.withheld)."""
    roles = roles or (SANDWICH_ROLES if sandwich else POSTNORM_ROLES)
    cls = forward_owner(type(layer))
    n = 8
    calls: list[dict] = []

    Attention, Norm = _stand_ins(n, calls)

    def op(x, residual, weight, eps):
        return residual + F.rms_norm(x, (n,), weight, eps)

    defaults = attn_defaults(cls)
    spec = NormSpec(Norm, "eps")
    with torch.random.fork_rng():
        torch.manual_seed(2)
        children = {
            "self_attn": Attention(),
            "mlp": nn.Sequential(
                nn.Linear(n, 11, dtype=torch.float64), nn.Tanh(), nn.Linear(11, n, dtype=torch.float64)
            ),
            roles[1]: Norm(),
            roles[3]: Norm(),
        }
        if sandwich:
            children.update({roles[0]: Norm(), roles[2]: Norm()})
        model = stand_in(layer, cls, children)
        x = torch.randn(2, 5, n, dtype=torch.float64)

    def rms(x, weight, eps, owned=False):
        return F.rms_norm(x, (n,), weight, eps)

    state = PostNormState(op, spec, spec, defaults, sandwich, rms if sandwich else None, spec, roles=roles)
    named = {name: _Sentinel(name) for name in defaults}
    named["probe_extra"] = _Sentinel("probe_extra")
    try:
        with torch.no_grad():
            for training, kwargs in ((False, named), (False, {}), (True, named)):
                calls.clear()
                model.train(training)
                with seeded(6):
                    want = cls.forward(model, x, **kwargs)
                if kwargs is named and not training:  # the first run: which arguments reach attention
                    state = dataclasses.replace(state, withheld=_withheld(defaults, named, calls))
                    model.__dict__[STATE] = state
                with seeded(6):
                    got = postnorm_layer_body(model, x, **kwargs)
                same_args = len(calls) == 2 and calls[0] == calls[1]
                if (
                    not isinstance(want, torch.Tensor)
                    or not same_args
                    or not ((got - want).abs().max() <= PROBE_TOL * want.abs().max())
                ):
                    raise UnsupportedModel(
                        f"{where} ({type(layer).__name__}) is not the post-norm layer "
                        "h = x + norm(attn(x)), then h + norm(mlp(h))"
                        + (" with a norm in front of each sublayer" if sandwich else "")
                        + ": profuse cannot fuse it exactly"
                    )
    except UnsupportedModel:
        raise
    except Exception as e:
        raise UnsupportedModel(f"{where} ({type(layer).__name__}) could not be checked: {e}") from None
    return state.withheld


__all__ = [
    "POSTNORM_CHILDREN",
    "SANDWICH_CHILDREN",
    "PostNormState",
    "postnorm_layer_body",
    "postnorm_layer_forward",
    "probe_postnorm_layer",
    "MIN_TRANSFORMERS",
    "MLP_ACTIVATIONS",
    "NORM_OFFSETS",
    "FinalNormState",
    "LayerState",
    "NormSpec",
    "attn_defaults",
    "attn_kwargs",
    "final_norm_forward",
    "layer_body",
    "layer_forward",
    "norm_after_add",
    "norm_alone",
    "probe_layer",
    "probe_mlp",
    "probe_norm",
    "takes_pair",
]
