"""Every causal-LM family of the installed transformers, as a tiny model with random weights.

`profuse fuse` (profuse.coverage) reads what `profuse.fuse` would do to each family from the real
probes, so it needs an instance of each: the family's own config class with its defaults, every
size field shrunk to a CPU-sized value (the same field names wherever a family uses them, nested
text/decoder configs too), token ids kept inside the shrunk vocabulary and per-layer lists cut to
the shrunk depth. Nothing else about a family is assumed; a family whose config refuses the
shrink, or whose model is still large after it, is reported with the reason, not guessed at.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from profuse.errors import UsageError
from profuse.models.hf import TRANSFORMERS_MISSING

try:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # an optional extra
    transformers = None
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}

# The fields that set a decoder's size, under each name families give them, and the tiny value.
# Widths keep head_dim x heads = hidden, and grouped-query attention (4 query heads, 2 key/value).
TINY_SIZES = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 96,
    "intermediate_size_mlp": 96,
    "ffn_dim": 96,
    "decoder_ffn_dim": 96,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "vocab_size": 128,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "n_positions": 256,
}
# A family still above this many parameters after the shrink has sizes under other names.
MAX_TINY_PARAMS = 5_000_000


def families() -> tuple[str, ...]:
    """The model types transformers maps to a causal-LM class, sorted."""
    if transformers is None:
        raise UsageError(TRANSFORMERS_MISSING)
    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def _within(value, vocab: int):
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return min(value, vocab - 1)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [min(v, vocab - 1) for v in value]
    return value


def shrink(fields: dict) -> dict:
    """The fields of a config's dict that change: sizes to TINY_SIZES (where the family has the
    field and sets it), token ids into the vocabulary, per-layer lists cut to the depth; nested
    sub-configs the same way."""
    out: dict = {}
    vocab = TINY_SIZES["vocab_size"] if fields.get("vocab_size") else None
    depths = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    depth = next((TINY_SIZES[k] for k in depths if fields.get(k)), None)
    for key, value in fields.items():
        if isinstance(value, dict) and key.endswith("config"):
            inner = shrink(value)
            if inner:
                out[key] = {**value, **inner}
        elif key in TINY_SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = TINY_SIZES[key]
        elif vocab is not None and key.endswith("token_id"):
            out[key] = _within(value, vocab)
        elif depth is not None and key == "layer_types" and isinstance(value, list):
            out[key] = value[:depth]
    return out


def tiny_config(family: str, fields: dict | None = None):
    """The family's config (its defaults, or `fields`, a config.json's) at tiny sizes. Raises
    UsageError for a family transformers does not map to a causal LM; whatever transformers
    raises for a config it will not take."""
    if family not in families():
        version = transformers.__version__
        raise UsageError(f"{family!r} is not a causal-LM model type of transformers {version}")
    known = _known(family, fields)
    base = transformers.AutoConfig.for_model(family, **known).to_dict()
    # the config.json's own layout (activation, which layers are MoE, ...) kept, its sizes shrunk
    fields = {k: v for k, v in {**known, **shrink(base)}.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(family, **fields)


def _known(family: str, fields: dict | None) -> dict:
    """A config.json's fields less its model_type and transformers' own bookkeeping."""
    if not fields:
        return {}
    return {k: v for k, v in fields.items() if k != "model_type" and not k.startswith("_")}


def param_count(config) -> int:
    """Parameters of the model the config makes, counted on the meta device."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_tiny(config, seed: int = 0) -> nn.Module:
    """The family's causal-LM class from the config, random weights, fp32, on the CPU, SDPA
    attention where the family has it."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):  # a family without SDPA (Gemma 2): eager attention
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float()
