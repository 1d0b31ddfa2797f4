"""Fusion applied to a Hugging Face Llama-family model, in place: `fuse(model)` and `unfuse(model)`.

A decoder layer of LlamaForCausalLM (Mistral, Qwen2 and Qwen3 have the same layer) computes

    h  = x + attn(input_layernorm(x))
    x' = h + mlp(post_attention_layernorm(h)),    mlp(y) = down(silu(gate(y)) * up(y))

and the model ends with norm(x_L). `fuse` moves every residual add into the norm after it, and
the MLP's activation into one op (profuse.blockops' signatures):

    silu_mul(gate(y), up(y))                       the MLP's silu(gate) * up          L places
    add_rms_norm(attn_out, x, w_post, eps)         post_attention_layernorm + the attention add
    add_rms_norm(mlp_out, h, w_in, eps)            layer i's input_layernorm + layer i-1's MLP add
    add_rms_norm(mlp_out, h, w_final, eps)         the final norm + the last layer's MLP add
                                                   (add_rms_norm: 2L places in all)

Layer 0's input_layernorm has no add in front (the embeddings enter the stream there): it stays
the model's own norm module. A fused plain rms_norm would save at most one pass over the (B, T, C)
activations per step, which is not measured here, so it is left as it is. Qwen3's per-head q_norm
and k_norm inside attention have no add in front either and are left too.

Which implementation runs is the `ops` pair: FUSED (the default), profuse's Triton kernels;
EAGER, blockops' eager ops (F.rms_norm), anywhere; HF_EAGER, the model's own eager norm math, so
the fused model computes bitwise what the unfused one did (what a labelled trace should time).

What changes, beyond which kernels run:
- A layer hands on the pair (mlp_out, h) whose sum is its hidden state; the next norm does the
  add. The intermediate hidden states are therefore never formed as tensors of their own, so a
  fused model refuses `output_hidden_states` (a one-line UsageError at the forward) rather than
  return something else under that name. `last_hidden_state`, the logits and the loss are
  unchanged (up to rounding: in bf16 the fused norm rounds once, fp32 inside, where Hugging Face's
  rounds the normalised value to bf16 before the weight multiply: about one bf16 ulp apart;
  bitwise with HF_EAGER).
- The norm and MLP modules stay where they were with their parameters (optimizers, state_dict and
  save_pretrained see the same tensors under the same names), but their forwards are no longer
  called, except layer 0's input norm: hooks on them do not fire. The final norm is replaced by a
  module that holds the same weight Parameter (same state_dict key).
- Each decoder layer's class becomes a subclass made here (`Fused<Layer>`): isinstance checks
  still hold; the model does not pickle while fused (its state_dict does).

What stays exact:
- Gradient checkpointing: a fused layer checkpoints itself with the model's own checkpoint
  function (set by activation_checkpointing_enable, before or after fusing), with the pair as two
  tensor arguments, so use_reentrant=True carries gradients too; caches are dropped under
  checkpointing as transformers does.
- Hub kernels (`set_use_kernels`, and the re-kernelize on every train/eval switch): kernelize
  rebinds the forwards of `use_kernel_forward_from_hub` modules, the norms among them. The fused
  path calls the norms' weights, not their forwards (except layer 0's input norm, which runs
  whatever the unfused model runs), and the fused layers and final norm are no kernel layers, so
  kernelize cannot undo or bypass the fusion.
- torch.compile(fullgraph=True) and `generate` (the cache passes through to attention as before).

The model is recognised by structure and behaviour, not by class name: one decoder stack (a
module with `layers` and a final `norm`); layers with exactly self_attn, mlp, input_layernorm and
post_attention_layernorm, whose class forwards run (not an instance's own, as accelerate's
device_map hooks set); and three probes on small float64 stand-ins (on the CPU, whatever device
the model is on): each norm class's own forward must compute rms_norm(x) * weight with the eps it
holds (Gemma's (1 + w) fails this), the MLP class's forward down(silu(gate(x)) * up(x)) with its
own act_fn (a GELU fails), and the layer class's forward must equal the fused one and hand
attention the same arguments. Anything else raises profuse.errors.UnsupportedModel with the
reason, before the model is changed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profuse import blockops
from profuse.errors import UnsupportedModel, UsageError
from profuse.fusion.gpt import ADD_RMS_NORM, BLOCK_OP_RANGES, EAGER, FUSED, SILU_MUL, BlockOps, labelled

# transformers 4.54 is the first whose decoder layers return the hidden state alone and whose models
# hand it straight to the next layer (before, layer_outputs[0]); the layer probe checks it too.
MIN_TRANSFORMERS = "4.54"
TRANSFORMERS_MISSING = "transformers is not installed: pip install 'profuse[hf]'"

_LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
_MLP_CHILDREN = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")  # one thing, by version
_STATE = "_profuse_fusion"  # a fused layer's _LayerOps; the decoder stack's _Installed
_PROBE_TOL = 1e-5  # the probes run float64 but Hugging Face's norms compute in fp32 (eps 1.2e-7)


def add_rms_norm_hf(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual, then Hugging Face's Llama RMSNorm on h op for op (fp32 inside,
    the normalised value cast back to h's dtype, then times the weight), in its dtypes."""
    h = x + residual
    h32 = h.to(torch.float32)
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h


# The fused structure with the model's own eager math: a model fused with these computes exactly
# what it did unfused (bitwise, in every dtype), so with label=True its trace times precisely the
# ops that FUSED replaces (blockops' EAGER uses F.rms_norm, which rounds once in bf16).
HF_EAGER = BlockOps(blockops.silu_mul_eager, add_rms_norm_hf, "Hugging Face's eager math")


@dataclass(frozen=True)
class FuseSummary:
    """What `fuse` did to a model: which ops run where, and what it left unfused and why."""

    model: str  # the class of the model fused, e.g. "LlamaForCausalLM"
    layers: int  # decoder layers
    ops: str  # the BlockOps' name: which implementation runs
    counts: dict[str, int]  # op -> places it runs per forward
    left_unfused: tuple[str, ...]  # "what: why", one entry per kind of place
    labelled: bool  # each op call inside its profiler range (profuse.fusion.BLOCK_OP_RANGES)

    def __str__(self) -> str:
        lines = [
            f"fused {self.model} ({self.layers} decoder layers) with {self.ops}:",
            f"  {SILU_MUL:<13} x{self.counts[SILU_MUL]:<4} the MLP's silu(gate) * up",
            f"  {ADD_RMS_NORM:<13} x{self.counts[ADD_RMS_NORM]:<4} each residual add with the norm after it",
        ]
        lines += [f"  left unfused: {item}" for item in self.left_unfused]
        if self.labelled:
            lines.append(
                "  each call labelled: " + ", ".join(repr(BLOCK_OP_RANGES[op]) for op in self.counts)
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class _LayerOps:
    """What a fused layer calls: the ops (labelled or not), its norms' eps, and the arguments its
    own forward hands attention when the caller leaves them out."""

    silu_mul: Callable
    add_rms_norm: Callable
    input_eps: float
    post_eps: float
    attn_defaults: dict


@dataclass
class _Installed:
    """What unfuse puts back: each layer's class, the final norm, the forward pre-hook."""

    layer_classes: list[type]
    norm: nn.Module
    hook: torch.utils.hooks.RemovableHandle
    summary: FuseSummary


# --------------------------------------------------------------------------------------------
# The fused forwards
# --------------------------------------------------------------------------------------------


def _fused_layer_forward(self, hidden_states, **kwargs):
    """The fused decoder layer. It takes the stream as one tensor (layer 0) or as the pair
    (x, residual) whose sum it is, and hands on the pair (mlp_out, h)."""
    x, residual = hidden_states if isinstance(hidden_states, tuple) else (hidden_states, None)
    if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
        # As transformers' GradientCheckpointingLayer does, but with x and residual as two tensor
        # arguments: through a tuple argument, use_reentrant=True would carry no gradient.
        kwargs = _without_cache(self, kwargs)
        body = functools.partial(_fused_layer_body, self, **kwargs)
        return self._gradient_checkpointing_func(body, x, residual)
    return _fused_layer_body(self, x, residual, **kwargs)


def _fused_layer_body(self, x, residual, **kwargs):
    ops: _LayerOps = getattr(self, _STATE)
    if residual is None:  # layer 0: no add in front of its norm
        residual, y = x, self.input_layernorm(x)
    else:  # the previous layer's MLP add, fused with this layer's input norm
        y, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, ops.input_eps)
    attn_out, _ = self.self_attn(hidden_states=y, **{**ops.attn_defaults, **kwargs})
    y, residual = ops.add_rms_norm(attn_out, residual, self.post_attention_layernorm.weight, ops.post_eps)
    mlp = self.mlp
    return mlp.down_proj(ops.silu_mul(mlp.gate_proj(y), mlp.up_proj(y))), residual


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


class FusedFinalNorm(nn.Module):
    """The model's final norm with the last layer's MLP add in front: add_rms_norm(mlp_out, h).

    Holds the original norm's weight Parameter itself (the same tensor, the same state_dict key).
    Given a plain tensor, it runs the original norm."""

    def __init__(self, norm: nn.Module, add_rms_norm: Callable, eps: float):
        super().__init__()
        self.weight = norm.weight
        self.eps = eps
        self.add_rms_norm = add_rms_norm
        self.__dict__["original"] = norm  # not a submodule: its one parameter is registered here

    def forward(self, hidden_states):
        if not isinstance(hidden_states, tuple):
            return self.original(hidden_states)
        x, residual = hidden_states
        return self.add_rms_norm(x, residual, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, with the last layer's MLP add in front"


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """Fused<cls>: cls with the fused forward. Made once per class. The forward is set after the
    class is made, so transformers' __init_subclass__ does not wrap it in a second checkpoint, and
    __call__ is nn.Module's (transformers before 5.x checkpointed in GradientCheckpointingLayer's
    __call__, with the tuple as its argument)."""
    fused = _FUSED_CLASSES.get(cls)
    if fused is None:
        fused = type(f"Fused{cls.__name__}", (cls,), {"__module__": __name__, "_profuse_fused": True})
        fused.forward = _fused_layer_forward
        fused.__call__ = nn.Module.__call__
        _FUSED_CLASSES[cls] = fused
    return fused


def _refuse_hidden_states(module: nn.Module, args, kwargs):
    """Forward pre-hook on a fused decoder stack: output_hidden_states would return the pairs'
    first halves, not the hidden states."""
    wanted = kwargs.get("output_hidden_states")
    if wanted is None:
        wanted = getattr(getattr(module, "config", None), "output_hidden_states", False)
    if wanted is not None and wanted is not False:
        raise UsageError(
            "output_hidden_states is not available on a fused model: each layer's residual add runs in "
            "the next layer's norm (profuse.unfuse(model) first)"
        )


# --------------------------------------------------------------------------------------------
# Recognising the model (nothing is changed here)
# --------------------------------------------------------------------------------------------


def _checkpointing_layer_class() -> type:
    if importlib.util.find_spec("transformers") is None:
        raise UnsupportedModel(TRANSFORMERS_MISSING)
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        raise UnsupportedModel(
            f"transformers is too old to fuse: pip install 'transformers>={MIN_TRANSFORMERS}'"
        ) from None
    return GradientCheckpointingLayer


def _decoder_stack(model: nn.Module, what: str) -> nn.Module:
    stacks = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layers", None), nn.ModuleList)
        and isinstance(getattr(m, "norm", None), nn.Module)
    ]
    if len(stacks) != 1:
        found = "no decoder stack" if not stacks else f"{len(stacks)} decoder stacks"
        raise UnsupportedModel(
            f"{what}: {found} (a module with `layers` and a final `norm`); profuse fuses one"
        )
    return stacks[0]


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _probe_norm(norm: nn.Module, where: str) -> float:
    """The eps `norm` uses, once its class's forward is seen to compute rms_norm(x) * weight."""
    eps, w = _eps(norm), getattr(norm, "weight", None)
    params = {name for name, _ in norm.named_parameters()}
    if eps is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or params != {"weight"}:
        raise UnsupportedModel(f"{where} ({type(norm).__name__}) is not an RMSNorm with a weight and an eps")
    gen = torch.Generator().manual_seed(0)
    n = w.shape[0]
    stand_in = copy.copy(norm)  # shares everything but the parameters, replaced below
    stand_in.__dict__["_parameters"] = {
        "weight": nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64))
    }
    # rows of mean square 1, about eps (where eps matters) and 1e6
    x = (
        torch.randn(3, n, generator=gen, dtype=torch.float64)
        * torch.tensor([[1.0], [eps**0.5], [1e3]]).double()
    )
    want = F.rms_norm(x, (n,), stand_in.weight, eps)
    try:
        with torch.no_grad():
            got = type(norm).forward(stand_in, x)
        ok = got.shape == want.shape and bool(
            ((got - want).abs() <= _PROBE_TOL * want.abs().amax(-1, True)).all()
        )
    except Exception as e:  # any failure of the stand-in is a layout profuse does not know
        raise UnsupportedModel(f"{where} ({type(norm).__name__}) could not be checked: {e}") from None
    if not ok:
        raise UnsupportedModel(
            f"{where} ({type(norm).__name__}) does not compute rms_norm(x) * weight with eps={eps} "
            "(an offset norm such as Gemma's (1 + weight)?): fusing it would change the model"
        )
    return eps


def _probe_mlp(mlp: nn.Module, where: str) -> None:
    """Raise unless the MLP class's forward computes down(silu(gate(x)) * up(x))."""
    children = {name for name, _ in mlp.named_children()}
    act = getattr(mlp, "act_fn", None)
    if not {"gate_proj", "up_proj", "down_proj"} <= children or act is None or not children <= _MLP_CHILDREN:
        raise UnsupportedModel(
            f"{where} ({type(mlp).__name__}) is not gate_proj/up_proj/down_proj with an act_fn "
            f"(has {sorted(children)})"
        )
    gen = torch.Generator().manual_seed(1)
    n, f = 8, 11
    lin = lambda i, o: nn.Linear(i, o, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        gate, up, down = lin(n, f), lin(n, f), lin(f, n)
    stand_in = copy.copy(mlp)
    stand_in.__dict__["_modules"] = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    if "act_fn" in children:
        stand_in.__dict__["_modules"]["act_fn"] = act
    x = 2 * torch.randn(5, n, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        want = down(F.silu(gate(x)) * up(x))
        try:
            got = type(mlp).forward(stand_in, x)
            ok = got.shape == want.shape and bool(((got - want).abs() <= _PROBE_TOL * want.abs().max()).all())
        except Exception as e:
            raise UnsupportedModel(f"{where} ({type(mlp).__name__}) could not be checked: {e}") from None
    if not ok:
        raise UnsupportedModel(
            f"{where} ({type(mlp).__name__}) does not compute down(silu(gate(x)) * up(x)) "
            f"(its act_fn is {type(act).__name__}): only a SiLU MLP fuses into silu_mul"
        )


class _Sentinel:
    """A stand-in argument: the probe checks that attention receives it, untouched."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _attn_defaults(cls: type) -> dict:
    """The arguments the layer class's forward names after hidden_states, with their defaults."""
    params = list(inspect.signature(cls.forward).parameters.values())[2:]  # self, hidden_states
    return {
        p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    }


def _probe_layer(layer: nn.Module, ops: _LayerOps, where: str) -> None:
    """Run the layer class's own forward and the fused one on stand-in submodules (float64, CPU):
    raise unless they give the same output and hand attention the same arguments."""
    n, f = 8, 11
    calls: list[dict] = []

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(n, n, dtype=torch.float64) / n**0.5)

        def forward(self, hidden_states, **kwargs):
            calls.append(kwargs)
            return torch.tanh(hidden_states @ self.w), None

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
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Norm(nn.Module):
        def __init__(self, eps):
            super().__init__()
            self.weight, self.eps = nn.Parameter(1 + torch.randn(n, dtype=torch.float64) / 4), eps

        def forward(self, x):
            return F.rms_norm(x, (n,), self.weight, self.eps)

    with torch.random.fork_rng():
        torch.manual_seed(2)
        stand_in = copy.copy(layer)
        stand_in.__dict__["_modules"] = {
            "self_attn": Attention(),
            "mlp": Mlp(),
            "input_layernorm": Norm(ops.input_eps),
            "post_attention_layernorm": Norm(ops.post_eps),
        }
        # float64 needs the eager ops (the Triton ones take bf16, fp16 and fp32): the same math
        stand_in.__dict__[_STATE] = dataclasses.replace(
            ops, silu_mul=EAGER.silu_mul, add_rms_norm=EAGER.add_rms_norm
        )
        x, r = torch.randn(2, 2, 5, n, dtype=torch.float64)
    named = {name: _Sentinel(name) for name in ops.attn_defaults}
    named["probe_extra"] = _Sentinel("probe_extra")  # **kwargs pass through to attention too
    original = type(layer).forward
    try:
        with torch.no_grad():
            for kwargs in (named, {}):
                calls.clear()
                want = original(stand_in, x + r, **kwargs)
                if not isinstance(want, torch.Tensor):
                    raise UnsupportedModel(
                        f"{where} ({type(layer).__name__}) returns a {type(want).__name__}, not the "
                        f"hidden state alone: pip install 'transformers>={MIN_TRANSFORMERS}'"
                    )
                first = _fused_layer_body(stand_in, x + r, None, **kwargs)  # layer 0's form
                later = _fused_layer_body(stand_in, x, r, **kwargs)  # the others' form
                same_args = len(calls) == 3 and calls[0] == calls[1] == calls[2]
                for got in (first, later):
                    err = (got[0] + got[1] - want).abs().max()
                    if not same_args or not err <= _PROBE_TOL * want.abs().max():
                        raise UnsupportedModel(
                            f"{where} ({type(layer).__name__}) is not the pre-norm layer "
                            "x + attn(norm(x)), then h + mlp(norm(h)): profuse cannot fuse it exactly"
                        )
    except UnsupportedModel:
        raise
    except Exception as e:
        raise UnsupportedModel(f"{where} ({type(layer).__name__}) could not be checked: {e}") from None


def _plan(
    model: nn.Module, ops: BlockOps, label: bool
) -> tuple[nn.Module, list[_LayerOps], float, FuseSummary]:
    """Check everything fuse needs and say what it will install; change nothing."""
    what = type(model).__name__
    checkpointing_layer = _checkpointing_layer_class()
    stack = _decoder_stack(model, what)
    if hasattr(stack, _STATE) or any(getattr(m, "_profuse_fused", False) for m in stack.layers):
        raise UnsupportedModel(f"{what} is already fused by profuse: profuse.unfuse(model) first")
    layers = list(stack.layers)
    n_config = getattr(getattr(stack, "config", None), "num_hidden_layers", len(layers))
    if not layers or n_config != len(layers):
        raise UnsupportedModel(
            f"{what} runs {n_config} of its {len(layers)} decoder layers: profuse fuses all"
        )
    classes = {type(layer) for layer in layers}
    if len(classes) != 1:
        raise UnsupportedModel(f"{what} mixes decoder layer classes {sorted(c.__name__ for c in classes)}")
    cls = classes.pop()
    if not issubclass(cls, checkpointing_layer):
        raise UnsupportedModel(
            f"{what}'s {cls.__name__} is not a GradientCheckpointingLayer: "
            f"pip install 'transformers>={MIN_TRANSFORMERS}'"
        )
    if hasattr(cls, "kernel_layer_name"):
        raise UnsupportedModel(
            f"{what}'s {cls.__name__} is a hub-kernel layer: kernelize would replace its forward"
        )

    silu_mul, add_rms_norm = ops.silu_mul, ops.add_rms_norm
    if label:
        silu_mul = labelled(silu_mul, BLOCK_OP_RANGES[SILU_MUL])
        add_rms_norm = labelled(add_rms_norm, BLOCK_OP_RANGES[ADD_RMS_NORM])
    attn_defaults = _attn_defaults(cls)
    plans, attn_norms = [], 0
    for i, layer in enumerate(layers):
        children = {name for name, _ in layer.named_children()}
        if children != _LAYER_CHILDREN:
            raise UnsupportedModel(
                f"{what}'s layer {i} holds {sorted(children)}, not {sorted(_LAYER_CHILDREN)}: "
                "an unknown layout"
            )
        for name, module in (("layer", layer), ("mlp", layer.mlp)):
            # an instance-level forward (accelerate's device_map hooks set one) would run instead of
            # the fused class's, or be bypassed by it; the norms' (kernelize's) are not called
            if "forward" in module.__dict__:
                raise UnsupportedModel(
                    f"{what}'s layer {i} {'' if name == 'layer' else 'mlp '}has a forward of its own "
                    "(accelerate hooks from a device_map?): profuse fuses class forwards only"
                )
        _probe_mlp(layer.mlp, f"layer {i}'s mlp")
        plans.append(
            _LayerOps(
                silu_mul,
                add_rms_norm,
                _probe_norm(layer.input_layernorm, f"layer {i}'s input_layernorm"),
                _probe_norm(layer.post_attention_layernorm, f"layer {i}'s post_attention_layernorm"),
                attn_defaults,
            )
        )
        attn_norms += sum(1 for name, _ in layer.self_attn.named_children() if "norm" in name)
    _probe_layer(layers[0], plans[0], f"{what}'s {cls.__name__}")
    final_eps = _probe_norm(stack.norm, "the final norm")

    left = [
        "layer 0's input_layernorm: no add in front (the embeddings enter the stream there); it stays the "
        "model's own norm (a fused rms_norm alone would save one pass over (B, T, C) at most, not measured)"
    ]
    if attn_norms:
        names = sorted({name for name, _ in layers[0].self_attn.named_children() if "norm" in name})
        left.append(
            f"{'/'.join(names)} in attention ({attn_norms} in all): per-head norms with no add in front"
        )
    L = len(layers)
    summary = FuseSummary(what, L, ops.name, {SILU_MUL: L, ADD_RMS_NORM: 2 * L}, tuple(left), label)
    return stack, plans, final_eps, summary


# --------------------------------------------------------------------------------------------
# The public API
# --------------------------------------------------------------------------------------------


def fuse(
    model: nn.Module, ops: BlockOps | None = None, *, label: bool = False, dry_run: bool = False
) -> FuseSummary:
    """Fuse a Hugging Face Llama-family model in place (see this module's docstring) and say how.

    `ops`: the BlockOps pair to run (default profuse.fusion.FUSED, the Triton kernels;
    profuse.fusion.EAGER runs the same structure in plain torch anywhere, and HF_EAGER in the
    model's own eager math, bitwise the unfused model). `label=True` wraps each op call in its
    profiler range (profuse.fusion.BLOCK_OP_RANGES): fused with HF_EAGER and labelled, an
    unfused model's trace shows exactly the ops (and their time) that FUSED replaces.
    Raises profuse.errors.UnsupportedModel (a ValueError), with the model left untouched, for a
    model it cannot fuse exactly: an unknown layout, an offset norm, a non-SiLU MLP, a model
    already fused. `dry_run=True` checks and summarises, changing nothing (a caller can refuse
    a model before long work starts). Undo with `unfuse(model)`.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModel(f"fuse takes an nn.Module, got {type(model).__name__}")
    if ops is None:
        ops = FUSED
    stack, plans, final_eps, summary = _plan(model, ops, label)
    if dry_run:
        return summary
    classes = [type(layer) for layer in stack.layers]
    for layer, plan in zip(stack.layers, plans):
        setattr(layer, _STATE, plan)
        layer.__class__ = _fused_class(type(layer))
    original_norm = stack.norm
    stack.norm = FusedFinalNorm(original_norm, plans[-1].add_rms_norm, final_eps)
    hook = stack.register_forward_pre_hook(_refuse_hidden_states, with_kwargs=True)
    setattr(stack, _STATE, _Installed(classes, original_norm, hook, summary))
    return summary


def unfuse(model: nn.Module) -> None:
    """Undo `fuse` in place: the layers' own classes, the final norm and its forward come back, and
    the model computes exactly what it did before (the same parameters throughout)."""
    stack = _decoder_stack(model, type(model).__name__)
    installed = getattr(stack, _STATE, None)
    if installed is None:
        raise UnsupportedModel(f"{type(model).__name__} is not fused by profuse")
    for layer, cls in zip(stack.layers, installed.layer_classes):
        layer.__class__ = cls
        delattr(layer, _STATE)
    stack.norm = installed.norm
    installed.hook.remove()
    delattr(stack, _STATE)


__all__ = ["HF_EAGER", "FuseSummary", "FusedFinalNorm", "add_rms_norm_hf", "fuse", "unfuse"]
