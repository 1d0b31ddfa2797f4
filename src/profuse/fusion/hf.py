"""Fusion applied to a Hugging Face Llama-family model, in place: `fuse(model)` and `unfuse(model)`.

Llama, Mistral, Qwen2, Qwen3 and Gemma (and any model with their decoder layer) get the
memory-bound ops of a training step fused, each in its place:

    silu_mul               each MLP's silu(gate) * up                                  L places
                           (Gemma's GeGLU: gelu(gate) * up, tanh or exact, through
                           blockops.gelu_mul; the probe reads which from the MLP;
                           packed gate_up_proj, Phi-3 and GLM-4: the packed form)
                           (a mixture of experts: each experts module's, in every
                           experts implementation, and each shared or dense MLP beside
                           them: profuse.fusion.hf_experts)
    add_rms_norm           each residual add with the norm after it, the last one
                           with the final norm (profuse.fusion.hf_layer); Gemma's      2L places
                           (1 + w) norms with weight_offset=1.0, in its fp32 order
    rms_norm               layer 0's input norm, which has no add in front             1 place
    rope                   attention's rotary embedding, q and k in one launch         L places
    qk_norm_rope           Qwen3: q_norm and k_norm with the rotary embedding,         L places
                           in place of rope (profuse.fusion.hf_attention); Gemma 3's
                           (1 + w) q/k norms with weight_offset=1.0
    linear_cross_entropy   the causal-LM head and its loss, in training with labels    1 place
                           (in training with labels, no logits: profuse.fusion.hf_head;
                           an MoE head adds the router's aux loss as it did: hf_moe_head;
                           Gemma 2 and 3's final-logit soft-cap as softcap=, read at
                           each call from the config)
    rms_norm_add           OLMo 2's post-norm layers and Gemma 2 and 3's sandwich      2L places
                           layers: each sublayer's output normalised, then added to
                           the stream (hf_layer's post-norm layer; the final norm,
                           and a sandwich layer's norms in front, are rms_norm's)
    layer_norm             each nn.LayerNorm a layer holds, and a LayerNorm final      up to 2L + 1
                           norm, by its class (profuse.fusion.hf_layernorm: StarCoder2,
                           GPT-NeoX, Phi-1/2, GPT-J, GPT-2); the adds stay (no
                           add_layer_norm); whether it pays is not measured on a card

By family past Llama's (`profuse fuse --model hf:FAMILY` prints the table and each reason):

    Gemma          every op but qk_norm_rope (it has no q/k norms)
    Gemma 2, 3     every op but add_rms_norm (sandwich layers: rms_norm_add after each
                   sublayer, rms_norm before it, all (1 + w)), the GeGLU MLP by its class
                   (profuse.fusion.hf_mlp), the soft-capped linear_cross_entropy; Gemma 3's
                   (1 + w) q/k norms in qk_norm_rope (Gemma 2 has none: rope)
    OLMo 2         silu_mul, rms_norm_add, rms_norm (the final norm), rope (after its q/k
                   norms, which span the whole projection: no qk_norm_rope), the loss
    Phi-3          its layer whole (residual dropout modules placed by the probe), silu_mul on
                   the packed gate_up_proj (hf_mlp), rope (partial rotary, q and k from its
                   packed qkv_proj), the loss
    GLM-4, GLM     GLM-4's sandwich layer (four norms, roles by the probe), silu_mul on the
                   packed gate_up_proj, rope over interleaved lane pairs (partial rotary);
                   GLM's pre-norm layer
    Cohere,        rope over interleaved lane pairs (Ernie 4.5 and Helium too), silu_mul, the
    Cohere 2       loss; not their norms (one LayerNorm feeds attention and MLP in parallel)
    GPT-NeoX,      rope (partial rotary on the packed query_key_value's chunks, or on
    Phi-1/2,       slices of each head), linear_cross_entropy where the head has no bias;
    StarCoder2     their LayerNorms (layer_norm), not their MLPs (GELU with no gate)
    Llama 4        add_rms_norm and rms_norm in every layer, dense or MoE (an MoE layer takes
                   the first of its feed_forward's (out, router_logits)), attention not handed
                   position_ids (its own layer withholds them); silu_mul in the dense layers'
                   feed_forward (hf_mlp), the MoE layers' experts the experts' plan's; not
                   rope (complex rotary of its own)
    GPT-J, CodeGen their LayerNorms alone: one norm feeds attention and MLP in parallel,
                   interleaved rotary through a one-tensor apply_rotary_pos_emb, a head with
                   a bias (each reason named)

Which implementation runs is a BlockOps: FUSED (the default), profuse's Triton kernels; EAGER,
the ops' eager versions, anywhere; HF_EAGER, the model's own eager math, so the fused model
computes bitwise what the unfused one did (what a labelled trace should time). A dtype the
kernels do not take (float64) runs HF_EAGER's math in the same structure. `ops=[names]` fuses a
subset: without add_rms_norm, rms_norm takes every norm (2L + 1 places).

How (profuse.fusion.hf_modules): classes are swapped, never modules, so parameters, state_dict
keys, hooks and save_pretrained stay as they were; the fused classes carry their originals'
names. Each fused module checks at every call that the modules it stands in for are still as the
probes saw them (same class, no forward of their own, no hooks that would see them): where not
(PEFT wrapped a norm, a hook was registered, accelerate offloaded a module after fusing), that
place calls them, unfused. Nothing is cached from the model but classes: parameters and eps are
read at each call, so load_state_dict(assign=True), FSDP2 and to_empty are seen.

What changes, beyond which kernels run:
- A layer hands on the pair (mlp_out, h) whose sum is its hidden state; the next norm does the
  add. The intermediate hidden states are never formed, so a fused model refuses
  `output_hidden_states` (a one-line UsageError at the forward). A layer with a hook on it, or
  whose next layer has one, hands on the hidden state itself: hooks on fused layers see what they
  saw unfused. `last_hidden_state`, the logits and the loss are unchanged (up to rounding: in bf16
  the fused norm rounds once, fp32 inside, where Hugging Face's rounds the normalised value to
  bf16 before the weight multiply: about one bf16 ulp apart; bitwise with HF_EAGER).
- Hooks on the norm and MLP modules: a place whose module has hooks calls it (they fire). On the
  q/k norms and lm_head likewise.
- In training with labels and gradients on, the logits are not made (linear_cross_entropy never
  forms them): outputs.logits then raises a UsageError that says so at any use. Eval mode,
  no_grad, no labels and generate make them as unfused; `fuse(model, logits="always")` makes
  them in every forward (the head then stays unfused).
- The fused classes' forwards have their originals' signatures (Trainer's dataset columns and
  label names, generate's mask, position and logits_to_keep inference read them).
- The model does not pickle while fused (torch.save(model) raises a UsageError in one line;
  its state_dict and save_pretrained work, and so does copy.deepcopy).

What stays exact: gradient checkpointing (a fused layer checkpoints itself, with the pair as two
tensor arguments), hub kernels and their re-kernelize on train/eval switches (kernelize rebinds
the norms' forwards; the fused places read the norms' weights, not their forwards),
torch.compile(fullgraph=True), generate, FSDP2 (fully_shard before or after fusing; unfuse keeps
its classes), PEFT (LoRA, LN tuning, modules_to_save, before or after fusing), unfuse.

The model is recognised by structure and behaviour, not by class name: one decoder stack (a
module with one layer list, `layers`, `h` or `blocks`, and one final norm, `norm`,
`final_layernorm`, `final_layer_norm`, `norm_f` or `ln_f`), each layer with one attention
(`self_attn`, `self_attention`, `attention` or `attn`; its output projection `o_proj`, `dense`
or `out_proj`) and one MLP (`mlp` or `feed_forward`); a layer fused whole holds exactly self_attn, mlp,
input_layernorm and post_attention_layernorm in a stack of `layers` and `norm`; and probes on
small float64 stand-ins (on the CPU, whatever device the model is on): each norm class's
forward must compute rms_norm(x) * weight, or Gemma's rms_norm(x) * (1 + weight), with the eps
it holds; the MLP class's down(act(gate(x)) * up(x))
with act SiLU or GELU, tanh or exact (a ReLU fails); the layer class's forward must equal the
fused one, the attention's and the head's rebuilt forwards their own. A model whose layers are
not fused whole (Gemma 3's and GLM-4's four norms, OLMo 2's post-norms, Phi-3's residual
dropouts) still gets each layer's `mlp` fused by its own class (profuse.fusion.hf_mlp), the
packed gate_up_proj of Phi-3 and GLM-4 included: down(act(g) * u), g, u = gate_up(x).chunk(2),
through the packed form of silu_mul or gelu_mul. An op whose place fails is left unfused with
the reason (FuseSummary.left_unfused); the others still fuse, unless the op was asked for by
name: then, as when nothing can be fused, a model already fused, or one with accelerate hooks,
fuse raises profuse.errors.UnsupportedModel in one line before the model is changed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from profuse import blockops
from profuse.errors import UnsupportedModel, UsageError
from profuse.fusion.gpt import (
    ADD_RMS_NORM,
    BLOCK_OP_RANGES,
    CLAMPED_SWIGLU,
    FUSED,
    LAYER_NORM,
    LINEAR_CROSS_ENTROPY,
    OP_NAMES,
    QK_NORM_ROPE,
    RMS_NORM,
    RMS_NORM_ADD,
    ROPE,
    SILU_MUL,
    BlockOps,
)
from profuse.fusion.hf_attention import plan_attention
from profuse.fusion.hf_experts import has_clamped_experts, has_experts, is_experts, plan_experts
from profuse.fusion.hf_head import plan_head, softcaps
from profuse.fusion.hf_layer import (
    MIN_TRANSFORMERS,
    POSTNORM_CHILDREN,
    POSTNORM_ROLES,
    SANDWICH_CHILDREN,
    FinalNormState,
    LayerState,
    PostNormState,
    attn_defaults,
    final_norm_forward,
    layer_forward,
    layer_parts,
    postnorm_layer_forward,
    probe_layer,
    probe_mlp,
    probe_norm,
    probe_postnorm_layer,
    sandwich_roles,
)
from profuse.fusion.hf_layernorm import bound_layer_norm, layer_norms, plan_layer_norms
from profuse.fusion.hf_mask import plan_mask
from profuse.fusion.hf_mlp import plan_mlps, ungated
from profuse.fusion.hf_modules import STATE, forward_owner, fused_class, fused_target, is_fused, unfused_class
from profuse.fusion.hf_ops import (
    HF_EAGER,
    add_rms_norm_hf,
    bound_gated,
    bound_op,
    interpreted,
    runs_kernels,
    takes_keyword,
    takes_offset,
    unavailable,
)

TRANSFORMERS_MISSING = "transformers is not installed: pip install 'profuse[hf]'"

_LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
# The names a decoder stack's parts go by across families: the layer list (Llama's `layers`,
# GPT-J's and CodeGen's `h`), the final norm (Llama's `norm`, Phi's `final_layernorm`, GPT-NeoX's
# `final_layer_norm`, GPT-J's `ln_f`, Mamba's `norm_f`), a layer's attention (GPT-NeoX's
# `attention`, GPT-J's `attn`, Falcon's `self_attention`) and its MLP (Llama 4's `feed_forward`).
# A stack holds exactly one of each; which one is read from the module, never from the family's name.
LAYER_LISTS = ("layers", "h", "blocks")
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "norm_f", "ln_f")
ATTENTIONS = ("self_attn", "self_attention", "attention", "attn")
MLPS = ("mlp", "feed_forward")
_LAYER_OPS = (SILU_MUL, ADD_RMS_NORM, RMS_NORM)
_WHAT = {
    SILU_MUL: "the MLP's silu(gate) * up (a GeGLU's gelu(gate) * up: gelu_mul)",
    ADD_RMS_NORM: "each residual add with the norm after it",
    RMS_NORM: "each norm with no add in front",
    ROPE: "the rotary embedding of q and k, one launch",
    QK_NORM_ROPE: "q_norm and k_norm with the rotary embedding, one launch",
    CLAMPED_SWIGLU: "gpt-oss's experts' (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate)",
    RMS_NORM_ADD: "post-norm: each sublayer's output normalised, then added to the stream",
    LINEAR_CROSS_ENTROPY: "lm_head and the loss: in training with labels, no logits (logits='always')",
    LAYER_NORM: "each LayerNorm (with its bias) alone: the adds stay as they are",
}
# The logits policy (profuse.fusion.hf_head): "auto" skips the logits only in training with labels
# and gradients on, where linear_cross_entropy computes the loss without them; "always" leaves the
# head unfused, so every forward makes them.
LOGITS_POLICIES = ("auto", "always")
_CAUSAL_MASK = "none made for a plain causal call: SDPA's is_causal, under torch.compile too"
_RECOMPUTE = "made again in the backward from what each norm keeps, not held (recompute=False)"


@dataclass(frozen=True)
class FuseSummary:
    """What `fuse` did to a model: which ops run where, and what it left unfused and why."""

    model: str  # the class of the model fused, e.g. "LlamaForCausalLM"
    layers: int  # decoder layers
    ops: str  # the BlockOps' name: which implementation runs
    counts: dict[str, int]  # op -> places it runs per forward (ops that run nowhere are left out)
    left_unfused: tuple[str, ...]  # "op: why", one entry per op with a place it cannot fuse
    labelled: bool  # each op call inside its profiler range (profuse.fusion.BLOCK_OP_RANGES)
    # A plain causal call's attention runs with SDPA's is_causal, under torch.compile too
    # (profuse.fusion.hf_mask); False where the stack builds its mask as before.
    causal_mask: bool = False
    notes: tuple[str, ...] = ()  # how the ops run where it is not as `ops` says (a CPU model)
    # The fused norms' outputs made again in the backward, not held from the forward
    # (profuse.fusion.hf_recompute); False where fuse(recompute=False) or no norm runs as a kernel.
    recompute: bool = False

    def __str__(self) -> str:
        lines = [f"fused {self.model} ({self.layers} decoder layers) with {self.ops}:"]
        lines += [f"  {op:<20} x{n:<4} {_WHAT[op]}" for op, n in self.counts.items()]
        if self.causal_mask:
            lines.append(f"  {'causal mask':<26} {_CAUSAL_MASK}")
        if self.recompute:
            lines.append(f"  {'norm outputs':<26} {_RECOMPUTE}")
        lines += [f"  left unfused: {item}" for item in self.left_unfused]
        lines += [f"  note: {note}" for note in self.notes]
        if self.labelled:
            lines.append(
                "  each call labelled: " + ", ".join(repr(BLOCK_OP_RANGES[op]) for op in self.counts)
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class _Installed:
    """The decoder stack's record of a fuse: its summary."""

    summary: FuseSummary


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


def _child_name(module: nn.Module, names: tuple[str, ...], kind: type = nn.Module) -> str | None:
    """The one name of `names` under which `module` holds a `kind`; None where none or several."""
    found = [n for n in names if isinstance(module._modules.get(n), kind)]
    return found[0] if len(found) == 1 else None


def stack_layers(stack: nn.Module) -> nn.ModuleList:
    """The decoder stack's layer list, under whichever of LAYER_LISTS it holds it."""
    return stack._modules[_child_name(stack, LAYER_LISTS, nn.ModuleList)]


def final_norm(stack: nn.Module) -> nn.Module:
    """The decoder stack's final norm, under whichever of FINAL_NORMS it holds it."""
    return stack._modules[_child_name(stack, FINAL_NORMS)]


def layer_attention(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention, under whichever of ATTENTIONS it holds it."""
    name = _child_name(layer, ATTENTIONS)
    return None if name is None else layer._modules[name]


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP, under whichever of MLPS it holds it."""
    name = _child_name(layer, MLPS)
    return None if name is None else layer._modules[name]


def _decoder_stack(model: nn.Module, what: str) -> nn.Module:
    stacks = [
        m
        for m in model.modules()
        if _child_name(m, LAYER_LISTS, nn.ModuleList) is not None and _child_name(m, FINAL_NORMS) is not None
    ]
    if len(stacks) != 1:
        found = "no decoder stack" if not stacks else f"{len(stacks)} decoder stacks"
        raise UnsupportedModel(
            f"{what}: {found} (a module with a layer list, {_names(LAYER_LISTS)}, and a final norm, "
            f"{_names(FINAL_NORMS)}); profuse fuses one"
        )
    return stacks[0]


def _names(names: tuple[str, ...]) -> str:
    return "/".join(f"`{n}`" for n in names)


def _rotary_dim(stack: nn.Module) -> int | None:
    """The width of the cos the stack's rotary module hands its attentions: the head dim, or less
    where the family rotates part of each head (GPT-NeoX, Phi-1/2, Phi-3/4-mini), read from what the
    module returns for two positions; None where the stack has none that runs so (per-layer-type
    rotary modules take more arguments: the attention probe then uses the head dim)."""
    rotary = stack._modules.get("rotary_emb")
    buffer = next(iter(rotary.buffers()), None) if isinstance(rotary, nn.Module) else None
    if buffer is None:
        return None
    try:
        with torch.no_grad():
            x = torch.zeros(1, 2, 1, device=buffer.device)
            cos, _ = rotary(x, torch.arange(2, device=buffer.device)[None])
    except Exception:  # a rotary module of another signature: the head dim stands
        return None
    return int(cos.shape[-1]) if isinstance(cos, torch.Tensor) and cos.dim() >= 2 else None


def _selected(ops, impl: BlockOps | None) -> tuple[BlockOps, tuple[str, ...], bool]:
    """(implementation, op names, named): `ops` is a BlockOps (the implementation, every op), a
    list of names (a subset, asked for by name), or None (every op)."""
    if isinstance(ops, BlockOps):
        if impl is not None:
            raise UsageError("fuse: pass the BlockOps as ops or as impl, not both")
        return ops, OP_NAMES, False
    impl = FUSED if impl is None else impl
    if not isinstance(impl, BlockOps):
        raise UsageError(f"fuse: impl takes a profuse.fusion.BlockOps, got {type(impl).__name__}")
    if ops is None:
        return impl, OP_NAMES, False
    names = (ops,) if isinstance(ops, str) else tuple(ops) if isinstance(ops, Iterable) else None
    if not names or any(not isinstance(n, str) or n not in OP_NAMES for n in names):
        raise UsageError(f"fuse: ops takes a BlockOps or op names from {', '.join(OP_NAMES)}; got {ops!r}")
    return impl, tuple(op for op in OP_NAMES if op in names), True


@dataclass
class _Plan:
    stack: nn.Module
    installs: list[tuple[nn.Module, type, object]]  # (module, its fused class, its state)
    refuse_hidden_states: bool
    summary: FuseSummary


def _offset_norms(specs, impl: BlockOps, ops: Iterable[str]) -> dict[str, str]:
    """Why each of `impl`'s norm ops `ops` cannot stand in for the norms of `specs`: op -> reason,
    for an op that takes no weight_offset where a norm scales by (1 + weight)."""
    if not any(spec.offset for spec in specs):
        return {}
    return {
        op: f"the norms scale by (1 + weight) and {impl.name!r}'s {op} takes no weight_offset"
        for op in ops
        if not takes_offset(impl, op)
    }


def _layout_reason(layer: nn.Module) -> str | None:
    """Why a layer's norms cannot be fused, read from its structure, where it is one of the layouts
    profuse knows it has no op for: LayerNorm (GPT-NeoX, Phi-1/2, StarCoder2, GPT-J), or one norm
    feeding attention and MLP in parallel (Cohere, GPT-J, Phi-1/2); else None."""
    norms = [
        name
        for name, m in layer.named_children()
        if "norm" in name.lower() or name.startswith("ln") or isinstance(m, nn.LayerNorm)
    ]
    ln_names = [name for name in norms if isinstance(layer._modules[name], nn.LayerNorm)]
    why = []
    if ln_names:
        why.append(
            f"{'/'.join(ln_names)} {'is' if len(ln_names) == 1 else 'are'} LayerNorm (mean subtracted, "
            "a bias), not RMSNorm: no add_layer_norm op (each LayerNorm alone is layer_norm's place)"
        )
    if len(norms) == 1:
        why.append(
            f"one norm ({norms[0]}) feeds attention and MLP in parallel, x + attn(n(x)) + mlp(n(x)): "
            "no add comes before a norm"
        )
    return f"{type(layer).__name__}: " + "; ".join(why) if why else None


def _mlp_of(layer: nn.Module) -> nn.Module:
    """The layer's MLP, under whatever name hf_layer.layer_parts finds it."""
    parts = layer_parts(layer)
    return getattr(layer, parts[0]) if parts else layer.mlp


def _other_mlp_forms(layers: list[nn.Module], name: str) -> list[tuple[int, nn.Module]]:
    """(index, layer) of the first layer of each MLP class (under `name`) other than layer 0's."""
    seen = {type(getattr(layers[0], name))}
    found = []
    for i, layer in enumerate(layers):
        if type(getattr(layer, name)) not in seen:
            seen.add(type(getattr(layer, name)))
            found.append((i, layer))
    return found


def _layer_forms(layers: list[nn.Module], wiring: dict, eager: dict) -> tuple[dict, str | None]:
    """Each layer's wiring by its MLP's class, and why not where a layer has none. The probe of
    layer 0 stands a plain MLP in for layer 0's, so it covers the layers whose MLP is of that
    class; a layer whose MLP is of another class (Llama 4's MoE layers among its dense ones) may
    read that MLP's output otherwise, so the first layer of each other class is probed too, and
    must wire as layer 0 but for what it takes from its MLP (LayerState.mlp_unpack)."""
    name = wiring["mlp_name"]
    first = type(getattr(layers[0], name))
    forms = {first: wiring}
    for i, layer in _other_mlp_forms(layers, name):
        cls = type(getattr(layer, name))
        differs = f"layer {i}'s {name} is a {cls.__name__}, layer 0's a {first.__name__}"
        try:
            forms[cls] = probe_layer(layer, eager, f"layer {i}")
        except UnsupportedModel as e:
            return forms, f"{differs}: the probe of layer 0 does not cover it ({e})"
        if {**forms[cls], "mlp_unpack": False} != {**wiring, "mlp_unpack": False}:
            return (
                forms,
                f"{differs}, and layer {i} is wired otherwise: the probe of layer 0 does not cover it",
            )
    return forms, None


def _plan_layers(stack: nn.Module, bound: dict, reasons: dict, what: str, impl: BlockOps, label: bool):
    """The fused layers and final norm: (installs, counts); reasons filled for ops that fail."""
    wanted = [op for op in _LAYER_OPS if op in bound]
    if not wanted:
        return [], {}
    layers = list(stack_layers(stack))

    def fail(ops, reason):
        for op in ops:
            if op in wanted:
                reasons.setdefault(op, reason)

    why = _layout_reason(layers[0])
    if why is not None:
        fail(_LAYER_OPS, why)
    classes = {type(layer) for layer in layers}
    cls = classes.pop() if len(classes) == 1 else None
    owner = forward_owner(cls) if cls is not None else None
    if cls is None:
        fail(_LAYER_OPS, f"{what} mixes decoder layer classes")
    elif not issubclass(owner, _checkpointing_layer_class()):
        fail(
            _LAYER_OPS,
            f"{owner.__name__} is not a GradientCheckpointingLayer: "
            f"pip install 'transformers>={MIN_TRANSFORMERS}'",
        )
    elif hasattr(owner, "kernel_layer_name"):
        fail(_LAYER_OPS, f"{owner.__name__} is a hub-kernel layer: kernelize would replace its forward")
    elif stack._modules.get("layers") is None or stack._modules.get("norm") is None:
        # a fused layer hands its pair on to the next layer or the final norm, found as Llama's are
        fail(_LAYER_OPS, f"{type(stack).__name__} holds its layers and final norm under other names")
    for i, layer in enumerate(layers):
        children = {name for name, _ in layer.named_children()}
        first = {name for name, _ in layers[0].named_children()}  # the probed layer's wiring is every layer's
        if (children != _LAYER_CHILDREN and layer_parts(layer) is None) or children != first:
            fail(
                _LAYER_OPS,
                f"layer {i} holds {sorted(children)}, not {sorted(_LAYER_CHILDREN)}: an unknown layout",
            )
        if "forward" in layer.__dict__:
            fail(_LAYER_OPS, f"layer {i} has a forward of its own: profuse fuses class forwards only")
    if all(op in reasons for op in wanted):
        return [], {}
    fused = fused_class(owner, "layer", layer_forward)
    targets = [fused_target(layer, owner, fused) for layer in layers]
    if any(t is None for t in targets):
        fail(
            _LAYER_OPS,
            f"{cls.__name__} is derived from {owner.__name__} by a class with a forward of its own",
        )
        return [], {}

    mlp = act = None
    activation = "silu"
    gated = None
    if SILU_MUL in wanted:
        try:
            found = {probe_mlp(_mlp_of(layer), f"layer {i}'s mlp") for i, layer in enumerate(layers)}
            if len(found) != 1:
                raise UnsupportedModel(f"{what}'s MLPs differ from layer to layer")
            mlp, act, activation = found.pop()
            gated = bound[SILU_MUL] if activation == "silu" else bound_gated(impl, activation, label)
        except UnsupportedModel as e:
            fail([SILU_MUL], str(e))
    norm_specs = None
    if ADD_RMS_NORM in wanted or RMS_NORM in wanted:
        try:
            specs = []
            for key in ("input_layernorm", "post_attention_layernorm"):
                found = {
                    probe_norm(getattr(layer, key), f"layer {i}'s {key}") for i, layer in enumerate(layers)
                }
                if len(found) != 1:
                    raise UnsupportedModel(f"{what}'s {key} classes differ from layer to layer")
                specs.append(found.pop())
            norm_specs = tuple(specs)
        except UnsupportedModel as e:
            fail([ADD_RMS_NORM, RMS_NORM], str(e))
        for op, why in _offset_norms(norm_specs or (), impl, [ADD_RMS_NORM, RMS_NORM]).items():
            fail([op], why)
    ops = {op: bound[op] if op in wanted and op not in reasons else None for op in _LAYER_OPS}
    if ops[SILU_MUL] is not None:
        ops[SILU_MUL] = gated
    if not any(ops.values()):
        return [], {}
    eager = {
        SILU_MUL: blockops.silu_mul_eager,
        ADD_RMS_NORM: blockops.add_rms_norm_eager,
        RMS_NORM: blockops.rms_norm_eager,
    }
    try:  # the layer's wiring, with eager float64 math for each op
        wiring = probe_layer(layers[0], eager, f"{what}'s {cls.__name__}")
    except UnsupportedModel as e:
        fail(_LAYER_OPS, str(e))
        return [], {}
    forms, why = _layer_forms(layers, wiring, eager)
    if why is not None:
        fail(_LAYER_OPS, why)
        return [], {}

    defaults = attn_defaults(owner)
    installs = []
    for i, (layer, target) in enumerate(zip(layers, targets)):
        state = LayerState(
            ops[SILU_MUL],
            ops[ADD_RMS_NORM],
            ops[RMS_NORM],
            *(norm_specs or (None, None)),
            mlp,
            act,
            defaults,
            stack,
            i,
            activation,
            **forms[type(getattr(layer, wiring["mlp_name"]))],  # as its MLP's form was probed
        )
        installs.append((layer, target, state))

    final = False
    add, rms = ops[ADD_RMS_NORM], ops[RMS_NORM]
    if add is not None or rms is not None:
        try:
            norm = final_norm(stack)
            spec = probe_norm(norm, "the final norm")
            norm_ops = [op for op in (ADD_RMS_NORM, RMS_NORM) if ops[op] is not None]
            offsets = _offset_norms([spec], impl, norm_ops)
            if offsets:
                raise UnsupportedModel("; ".join(offsets.values()))
            fused_norm = fused_class(spec.cls, "final_norm", final_norm_forward)
            norm_target = fused_target(norm, spec.cls, fused_norm)
            if norm_target is None:
                raise UnsupportedModel(f"the final norm's class {type(norm).__name__} has its own forward")
            installs.append((norm, norm_target, FinalNormState(add, rms, spec)))
            final = True
        except UnsupportedModel as e:  # the layers still fuse: the last hands the final norm its hidden state
            fail(
                [op for op in (ADD_RMS_NORM, RMS_NORM) if ops[op] is not None],
                f"the final norm stays as it is: {e}",
            )
    L = len(layers)
    counts = {}
    if ops[SILU_MUL] is not None:
        counts[SILU_MUL] = L
    if add is not None:
        counts[ADD_RMS_NORM] = 2 * L - 1 + final
    if rms is not None:
        counts[RMS_NORM] = 1 if add is not None else 2 * L + final
    return installs, counts


def _postnorm_layout(layers: list[nn.Module]) -> str | None:
    """ "postnorm" where every layer holds OLMo 2's post-norm children, "sandwich" where every
    one holds Gemma 2's (the same with a norm in front of each sublayer), else None."""
    found = {frozenset(name for name, _ in layer.named_children()) for layer in layers}
    if len(found) != 1:
        return None
    children = found.pop()
    layouts = {POSTNORM_CHILDREN: "postnorm", SANDWICH_CHILDREN: "sandwich"}
    return layouts.get(children) or ("sandwich" if sandwich_roles(layers[0]) else None)


def _is_postnorm(layers: list[nn.Module]) -> bool:
    """Whether the layers are post-norm or sandwich layers: rms_norm_add's places."""
    return _postnorm_layout(layers) is not None


def _probe_roles(layer: nn.Module, where: str) -> tuple:
    """The sandwich layer's norms by role: the first assignment (hf_layer.sandwich_roles) whose
    fused body the probe finds computing the layer's own forward; the last one's reason if none."""
    candidates = sandwich_roles(layer)
    for roles in candidates[:-1]:
        try:
            probe_postnorm_layer(layer, where, True, roles)
            return roles
        except UnsupportedModel:
            continue
    return candidates[-1]  # probed by the caller, which says why where it fails


def _plan_postnorm(stack: nn.Module, bound: dict, reasons: dict, counts: dict, what: str, impl: BlockOps):
    """The fused post-norm layers (rms_norm_add, 2 places each) and the final norm (rms_norm):
    installs; counts and reasons filled."""
    layers = list(stack_layers(stack))
    op = bound.get(RMS_NORM_ADD)
    layout = _postnorm_layout(layers)
    if op is None or layout is None:
        return []
    sandwich = layout == "sandwich"
    classes = {type(layer) for layer in layers}
    try:
        if len(classes) != 1:
            raise UnsupportedModel(f"{what} mixes decoder layer classes")
        cls = classes.pop()
        owner = forward_owner(cls)
        if not issubclass(owner, _checkpointing_layer_class()) or hasattr(owner, "kernel_layer_name"):
            raise UnsupportedModel(f"{owner.__name__} is not a GradientCheckpointingLayer of its own forward")
        if any("forward" in layer.__dict__ for layer in layers):
            raise UnsupportedModel("a layer has a forward of its own: profuse fuses class forwards only")
        where = f"{what}'s {cls.__name__}"
        roles = _probe_roles(layers[0], where) if sandwich else POSTNORM_ROLES
        specs = []
        keys = [roles[1], roles[3]] + ([roles[0], roles[2]] if sandwich else [])
        for key in keys:
            found = {probe_norm(getattr(layer, key), f"layer {i}'s {key}") for i, layer in enumerate(layers)}
            if len(found) != 1:
                raise UnsupportedModel(f"{what}'s {key} classes differ from layer to layer")
            specs.append(found.pop())
        if sandwich and len(set(specs)) != 1:
            raise UnsupportedModel(f"{what}'s four norms a layer are not of one class")
        offsets = _offset_norms(specs, impl, [RMS_NORM_ADD])
        if offsets:
            raise UnsupportedModel(offsets[RMS_NORM_ADD])
        withheld = probe_postnorm_layer(layers[0], where, sandwich, roles)
        for i, layer in _other_mlp_forms(layers, "mlp"):  # as _layer_forms: each other MLP class's layer
            differs = (
                f"layer {i}'s mlp is a {type(layer.mlp).__name__}, layer 0's a {type(layers[0].mlp).__name__}"
            )
            try:
                if probe_postnorm_layer(layer, f"layer {i}", sandwich, roles) != withheld:
                    raise UnsupportedModel("its attention is handed other arguments")
            except UnsupportedModel as e:
                raise UnsupportedModel(f"{differs}: the probe of layer 0 does not cover it ({e})") from None
        fused = fused_class(owner, "postnorm_layer", postnorm_layer_forward)
        targets = [fused_target(layer, owner, fused) for layer in layers]
        if any(t is None for t in targets):
            raise UnsupportedModel(
                f"{cls.__name__} is derived from {owner.__name__} with a forward of its own"
            )
    except UnsupportedModel as e:
        reasons[RMS_NORM_ADD] = str(e)
        return []
    reasons.pop(ADD_RMS_NORM, None)  # no add comes before a norm here: rms_norm_add has its places
    rms = bound.get(RMS_NORM)
    offsets = _offset_norms(specs, impl, [RMS_NORM]) if rms is not None else {}
    if offsets:
        rms, reasons[RMS_NORM] = None, offsets[RMS_NORM]
    pre = sandwich and rms is not None  # a sandwich layer's pre-norms run as rms_norm
    if pre:
        counts[RMS_NORM] = 2 * len(layers)
        reasons.pop(RMS_NORM, None)
    state = PostNormState(
        op,
        specs[0],
        specs[1],
        attn_defaults(owner),
        sandwich,
        rms if pre else None,
        specs[0],
        roles=roles,
        withheld=withheld,
    )
    installs = [(layer, target, state) for layer, target in zip(layers, targets)]
    counts[RMS_NORM_ADD] = 2 * len(layers)
    if rms is not None:  # the final norm: a plain norm of the last hidden state
        try:
            norm = final_norm(stack)
            spec = probe_norm(norm, "the final norm")
            offsets = _offset_norms([spec], impl, [RMS_NORM])
            if offsets:
                raise UnsupportedModel(offsets[RMS_NORM])
            target = fused_target(norm, spec.cls, fused_class(spec.cls, "final_norm", final_norm_forward))
            if target is None:
                raise UnsupportedModel(f"the final norm's class {type(norm).__name__} has its own forward")
            installs.append((norm, target, FinalNormState(None, rms, spec)))
            counts[RMS_NORM] = counts.get(RMS_NORM, 0) + 1
            reasons.pop(RMS_NORM, None)
        except UnsupportedModel as e:
            reasons[RMS_NORM] = f"the final norm stays as it is: {e}"
    return installs


def _plan_mlps(layers: list[nn.Module], impl: BlockOps, label: bool, reasons: dict, counts: dict, what: str):
    """The MLP places of layers not fused whole, each fused by its MLP's class (hf_mlp): installs;
    counts and reasons filled for silu_mul."""
    mlps = [layer_mlp(layer) for layer in layers]
    try:
        if any(mlp is None for mlp in mlps):
            raise UnsupportedModel(f"{what}'s layers have no MLP ({_names(MLPS)})")
        installs = plan_mlps(mlps, lambda activation: bound_gated(impl, activation, label), what)
    except UnsupportedModel as e:
        layer_why = reasons.get(SILU_MUL)
        no_gate = mlps[0] is not None and ungated(mlps[0]) is not None
        alone = layer_why in (None, str(e)) or no_gate  # the MLP's own reason is the whole reason
        reasons[SILU_MUL] = str(e) if alone else f"{layer_why}; the MLP alone: {e}"
        return []
    reasons.pop(SILU_MUL, None)
    counts[SILU_MUL] = len(layers)
    return installs


def _plan_dense_beside_experts(
    layers, experts, impl: BlockOps, label: bool, counts: dict, reasons: dict, what: str
):
    """The dense layers' MLPs of an MoE stack that the experts' plan left (Llama 4's dense layers:
    a gated MLP whose act is its activation_fn), each fused by its class (hf_mlp) where every one
    is of one class and probes right: installs; counts and silu_mul's reason updated. The MoE
    layers' MLPs stay the experts' plan's, with its reasons."""
    placed = {id(module) for module, _, _ in experts.installs}
    dense = [layer_mlp(layer) for layer in layers]
    dense = [
        mlp
        for mlp in dense
        if mlp is not None and id(mlp) not in placed and not any(is_experts(m) for m in mlp.modules())
    ]
    if not dense or any(id(m) in placed for mlp in dense for m in mlp.modules()):
        return []
    try:
        installs = plan_mlps(dense, lambda activation: bound_gated(impl, activation, label), what)
    except UnsupportedModel:  # the experts' plan has said why of this class already
        return []
    counts[SILU_MUL] = counts.get(SILU_MUL, 0) + len(installs)
    cls = type(dense[0]).__name__
    kept = [why for why in experts.reasons.get(SILU_MUL, []) if f"({cls})" not in why]
    if len(kept) < len(experts.reasons.get(SILU_MUL, [])):  # its class's reason was about these
        kept.append(f"{cls} as an MoE layer's shared expert stays unfused (the experts' plan reads act_fn)")
    if kept:
        reasons[SILU_MUL] = "; ".join(kept)
    else:
        reasons.pop(SILU_MUL, None)
    return installs


def _plan_layer_norms(stack: nn.Module, bound: dict, reasons: dict, counts: dict):
    """Each LayerNorm of the stack's layers and its final norm, fused by class (hf_layernorm):
    installs; counts and reasons filled for layer_norm."""
    norms = layer_norms(list(stack_layers(stack)), final_norm(stack))
    if LAYER_NORM not in bound or not norms:
        return []
    try:
        installs = plan_layer_norms(norms, bound[LAYER_NORM])
    except UnsupportedModel as e:
        reasons[LAYER_NORM] = str(e)
        return []
    counts[LAYER_NORM] = len(installs)
    return installs


def _has_place(op: str, model: nn.Module, stack: nn.Module) -> bool:
    """Whether the model has a place for `op` at all (a decoder stack has one for the others)."""
    if op == QK_NORM_ROPE:
        attentions = [layer_attention(layer) for layer in stack_layers(stack)]
        return all(isinstance(getattr(a, "q_norm", None), nn.Module) for a in attentions)
    if op == CLAMPED_SWIGLU:
        return has_clamped_experts(stack)
    if op == RMS_NORM_ADD:
        return _is_postnorm(list(stack_layers(stack)))
    if op == LINEAR_CROSS_ENTROPY:
        return plan_head(model, stack, lambda *args, **kwargs: None, probe=False).absent is None
    if op == LAYER_NORM:
        return bool(layer_norms(list(stack_layers(stack)), final_norm(stack)))
    return True


def _plan(
    model: nn.Module,
    impl: BlockOps,
    names: tuple[str, ...],
    named: bool,
    label: bool,
    causal_mask: bool,
    logits: str = "auto",
) -> _Plan:
    """Check everything fuse needs and say what it will install; change nothing."""
    what = type(model).__name__
    _checkpointing_layer_class()
    stack = _decoder_stack(model, what)
    if STATE in stack.__dict__ or any(is_fused(m) for m in model.modules()):
        raise UnsupportedModel(f"{what} is already fused by profuse: profuse.unfuse(model) first")
    hooked = sum("_hf_hook" in m.__dict__ for m in model.modules())
    if hooked:
        raise UnsupportedModel(
            f"{what} has accelerate hooks on {hooked} modules (a device_map or cpu_offload, moving weights "
            "in at each forward): profuse fuses a model whose weights stay in place"
        )
    layers = list(stack_layers(stack))
    n_config = getattr(getattr(stack, "config", None), "num_hidden_layers", len(layers))
    if not layers or n_config != len(layers):
        raise UnsupportedModel(
            f"{what} runs {n_config} of its {len(layers)} decoder layers: profuse fuses all"
        )

    for i, layer in enumerate(layers):
        if layer_attention(layer) is None:
            children = sorted(name for name, _ in layer.named_children())
            raise UnsupportedModel(
                f"{what}: layer {i} ({type(layer).__name__}) has no attention ({_names(ATTENTIONS)}; it "
                f"holds {children}): profuse reads decoder layers, each with an attention, an MLP and norms"
            )

    reasons: dict[str, str] = {}
    bound = {}
    for op in names:
        why = unavailable(impl, op)
        if why is None:
            bound[op] = bound_layer_norm(impl, label) if op == LAYER_NORM else bound_op(impl, op, label)
        elif _has_place(op, model, stack):
            reasons[op] = why
    installs, counts = _plan_layers(stack, bound, reasons, what, impl, label)
    if SILU_MUL in bound and SILU_MUL not in counts and not has_experts(stack):
        installs += _plan_mlps(layers, impl, label, reasons, counts, what)
    installs += _plan_postnorm(stack, bound, reasons, counts, what, impl)
    silu = bound.get(SILU_MUL) if SILU_MUL not in counts else None
    if (silu or bound.get(CLAMPED_SWIGLU)) and has_experts(stack):  # MoE: each MLP place by class
        mlps = plan_experts(stack, silu, bound.get(CLAMPED_SWIGLU))
        if silu is not None:
            reasons.pop(SILU_MUL, None)
        installs += mlps.installs
        counts.update(mlps.counts)
        reasons.update({op: "; ".join(why) for op, why in mlps.reasons.items()})
        if silu is not None:
            installs += _plan_dense_beside_experts(layers, mlps, impl, label, counts, reasons, what)
    installs += _plan_layer_norms(stack, bound, reasons, counts)
    attentions = [layer_attention(layer) for layer in layers]
    qk_offset = None if takes_offset(impl, QK_NORM_ROPE) else f"{impl.name!r}'s qk_norm_rope takes no offset"
    attention = plan_attention(
        attentions,
        bound.get(ROPE),
        bound.get(QK_NORM_ROPE),
        what,
        _rotary_dim(stack),
        qk_offset,
        impl.rope is not None and takes_keyword(impl, ROPE, "keep_dtype"),
        impl.rope is not None and takes_keyword(impl, ROPE, "interleaved"),
    )
    reasons.update(attention.reasons)
    if attention.targets is not None:
        installs += [(a, t, attention.state) for a, t in zip(attentions, attention.targets)]
        counts.update(attention.counts)
    if logits == "always" and LINEAR_CROSS_ENTROPY in bound:
        if named:
            raise UsageError(
                "fuse: linear_cross_entropy never makes the logits, and logits='always' asks for them: "
                "choose one"
            )
        del bound[LINEAR_CROSS_ENTROPY]
        if _has_place(LINEAR_CROSS_ENTROPY, model, stack):
            reasons[LINEAR_CROSS_ENTROPY] = "logits='always': the head's own forward makes them in every call"
    if LINEAR_CROSS_ENTROPY in bound and not takes_keyword(impl, LINEAR_CROSS_ENTROPY, "softcap"):
        found = plan_head(model, stack, bound[LINEAR_CROSS_ENTROPY], probe=False).head
        if found is not None and softcaps(forward_owner(type(found))):
            del bound[LINEAR_CROSS_ENTROPY]
            reasons[LINEAR_CROSS_ENTROPY] = (
                f"{type(found).__name__} soft-caps its logits and {impl.name!r}'s linear_cross_entropy "
                "takes no softcap"
            )
    head = plan_head(model, stack, bound.get(LINEAR_CROSS_ENTROPY))
    absent = dict(attention.absent)
    if head.reason:
        reasons[LINEAR_CROSS_ENTROPY] = head.reason
    if head.absent:
        absent[LINEAR_CROSS_ENTROPY] = head.absent
    if head.target is not None:
        installs.append((head.head, head.target, head.state))
        counts[LINEAR_CROSS_ENTROPY] = 1
    if QK_NORM_ROPE in counts:  # rope's place is qk_norm_rope's: rope stands by for its fallback
        reasons.pop(ROPE, None)

    if named:
        for op in names:
            why = reasons.get(op) or absent.get(op)
            if why is not None:
                raise UnsupportedModel(f"{what}: {op} cannot be fused: {why}")
    if not counts:
        why = "; ".join(f"{op}: {r}" for op, r in reasons.items()) or "no op has a place in it"
        raise UnsupportedModel(f"{what}: nothing to fuse ({why})")
    counts = {op: counts[op] for op in OP_NAMES if op in counts}
    left = tuple(f"{op}: {why}" for op, why in reasons.items())
    mask = plan_mask(stack) if causal_mask else None
    if mask is not None and mask.target is not None:
        installs.append((stack, mask.target, None))
    notes = ()
    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if on_cpu and not interpreted() and any(runs_kernels(impl, op) for op in counts):
        notes = (
            "the model is on the CPU and TRITON_INTERPRET=1 is not set: each Triton op runs Hugging Face's "
            "eager math in the fused structure on CPU tensors (the kernels run on a CUDA GPU)",
        )
    summary = FuseSummary(
        what, len(layers), impl.name, counts, left, label, bool(mask and mask.target), notes
    )
    return _Plan(stack, installs, ADD_RMS_NORM in counts, summary)


# --------------------------------------------------------------------------------------------
# The public API
# --------------------------------------------------------------------------------------------


def fuse(
    model: nn.Module,
    ops: BlockOps | Iterable[str] | str | None = None,
    *,
    impl: BlockOps | None = None,
    label: bool = False,
    dry_run: bool = False,
    causal_mask: bool | None = None,
    logits: str = "auto",
    recompute: bool = True,
) -> FuseSummary:
    """Fuse a Hugging Face Llama-family model in place (see this module's docstring) and say how.

    `ops`: which ops, as names from profuse.fusion.OP_NAMES (silu_mul, add_rms_norm, rms_norm,
    rope, qk_norm_rope, linear_cross_entropy): default all of them that have a place in the model.
    A BlockOps given as `ops` is the implementation instead, every op (as before names were
    taken). `impl`: the implementation (default profuse.fusion.FUSED, the Triton kernels;
    profuse.fusion.EAGER runs the same structure in plain torch anywhere, and HF_EAGER in the
    model's own eager math, bitwise the unfused model). `label=True` wraps each op call in its
    profiler range (profuse.fusion.BLOCK_OP_RANGES): fused with HF_EAGER and labelled, an
    unfused model's trace shows exactly the ops (and their time) that FUSED replaces.

    An op whose place cannot be fused exactly is left unfused, its reason in the summary's
    left_unfused. Raises profuse.errors.UnsupportedModel (a ValueError) in one line, with the
    model left untouched, for an op asked for by name that cannot be fused, a model with nothing
    to fuse, one already fused or one with accelerate hooks; UsageError for bad arguments.
    `dry_run=True` checks and summarises, changing nothing. Undo with `unfuse(model)`.

    `causal_mask`: let a plain causal call (no padding mask, position ids or cache) reach SDPA
    as is_causal=True under torch.compile too, where transformers would build a (B, 1, T, T)
    mask (profuse.fusion.hf_mask); in eager nothing changes. Default: with every op (`ops`
    None), not with a subset named, so a subset's measurement is that subset's.

    `logits`: "auto" (default) makes the logits wherever the unfused model would be asked for
    them, eval mode, no_grad, no labels, generate, and skips them only in training with labels
    and gradients on, where linear_cross_entropy computes the loss without forming them (the
    output's logits then raise a UsageError saying so at any use); "always" leaves the head
    unfused, so every forward makes them (for a training loop or callback that reads
    outputs.logits next to the loss).

    `recompute`: each fused norm's output, which the projections reading it would save for the
    backward, is made again there from what the norm keeps anyway (profuse.fusion.hf_recompute:
    bitwise the same value; 2 x tokens x hidden elements a layer less held through the step,
    for one pass over the norm's input a norm in the backward). False keeps autograd's saving.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModel(f"fuse takes an nn.Module, got {type(model).__name__}")
    impl, names, named = _selected(ops, impl)
    if causal_mask is not None and not isinstance(causal_mask, bool):
        raise UsageError(f"fuse: causal_mask takes True or False, got {causal_mask!r}")
    if logits not in LOGITS_POLICIES:
        raise UsageError(f"fuse: logits takes {' or '.join(map(repr, LOGITS_POLICIES))}, got {logits!r}")
    causal = not named if causal_mask is None else causal_mask
    if not isinstance(recompute, bool):
        raise UsageError(f"fuse: recompute takes True or False, got {recompute!r}")
    try:
        plan = _plan(model, impl, names, named, label, causal, logits)
    except (AttributeError, KeyError, IndexError, TypeError) as e:  # a layout the plan cannot read
        raise UnsupportedModel(
            f"{type(model).__name__}: profuse cannot read this model's layout ({type(e).__name__}: {e})"
        ) from e
    plan = _with_recompute(plan, recompute, impl)
    if dry_run:
        return plan.summary
    for module, cls, state in plan.installs:
        module.__dict__[STATE] = state
        module.__class__ = cls
    if plan.refuse_hidden_states:
        plan.stack.register_forward_pre_hook(_refuse_hidden_states, with_kwargs=True)
    plan.stack.__dict__[STATE] = _Installed(plan.summary)
    return plan.summary


def _with_recompute(plan: _Plan, recompute: bool, impl: BlockOps) -> _Plan:
    """The plan with its layers' norm outputs recomputed or held, and a summary that says which
    where a norm runs as profuse's kernel (the only outputs hf_recompute makes again)."""
    installs = [
        (module, cls, dataclasses.replace(state, recompute=recompute))
        if isinstance(state, (LayerState, PostNormState))
        else (module, cls, state)
        for module, cls, state in plan.installs
    ]
    kernels = any(runs_kernels(impl, op) for op in (ADD_RMS_NORM, RMS_NORM) if op in plan.summary.counts)
    summary = dataclasses.replace(plan.summary, recompute=recompute and kernels)
    return dataclasses.replace(plan, installs=installs, summary=summary)


def unfuse(model: nn.Module) -> None:
    """Undo `fuse` in place: every fused module takes its class back (a class made from a fused
    one, such as FSDP2's, is rebuilt on the original), with the parameters, hooks and wrappers
    it has now. Raises UnsupportedModel, changing nothing, when a module's class cannot be
    rebuilt (one derived from a fused class with a forward of its own)."""
    what = type(model).__name__
    stack = _decoder_stack(model, what)
    fused = [m for m in model.modules() if is_fused(m)]
    if not fused and STATE not in stack.__dict__:
        raise UnsupportedModel(f"{what} is not fused by profuse")
    restored = []
    for m in fused:
        cls = unfused_class(type(m))
        if cls is None:
            raise UnsupportedModel(
                f"{what}: {type(m).__name__} is derived from profuse's fused class with a forward of its "
                "own: profuse cannot rebuild it unfused (the model stays fused, and works)"
            )
        restored.append((m, cls))
    for m, cls in restored:
        m.__class__ = cls
        m.__dict__.pop(STATE, None)
    for key, hook in list(stack._forward_pre_hooks.items()):
        if hook is _refuse_hidden_states:
            del stack._forward_pre_hooks[key]
            stack._forward_pre_hooks_with_kwargs.pop(key, None)
    stack.__dict__.pop(STATE, None)


__all__ = [
    "HF_EAGER",
    "LOGITS_POLICIES",
    "TRANSFORMERS_MISSING",
    "FuseSummary",
    "add_rms_norm_hf",
    "fuse",
    "unfuse",
]
