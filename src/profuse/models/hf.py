"""Hugging Face Llama-family models as ModelSpecs, built from a config with random weights.

Nothing is downloaded: a size is a preset of published hyperparameters (each model's
config.json), the CPU-sized `tiny`, or a local config.json (`--hf-config PATH`). The model is
transformers' own class for the config (AutoModelForCausalLM.from_config), with SDPA attention
and no KV cache (a training step has no use for one). Weights are random: the time and memory of
a step depend on the shapes, not the values. The step's loss is the model's own
(`model(input_ids, labels=input_ids).loss`, shifted inside), as a training loop computes it.

Supported families (they share the MLP, decoder layer and norm layouts that profuse.fusion fuses):
llama, mistral, qwen2, qwen3, and the mixture-of-experts olmoe and qwen3_moe (the same layer with
the MLP an experts block; profuse.fusion.hf_experts). transformers is an optional dependency:
pip install 'profuse[hf]'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from profuse.crossentropy import IGNORE_INDEX, shifted_labels
from profuse.errors import UsageError
from profuse.models.spec import (
    CHECK_BATCH,
    CHECK_LAYERS,
    CHECK_SEQ_LEN,
    DEFAULT_PRECISION,
    ModelSpec,
    OpShapes,
    param_dtype,
)

try:
    import transformers

    HAS_TRANSFORMERS = True
except ImportError:  # an optional extra
    transformers = None
    HAS_TRANSFORMERS = False

TRANSFORMERS_MISSING = "transformers is not installed: pip install 'profuse[hf]'"

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("olmoe", "qwen3_moe")  # the same layer, its MLP an experts block (top-k of E experts)
# Other layouts profuse.fuse reads by structure: Gemma 3's (1 + w) sandwich norms, GeGLU and
# (1 + w) q/k norms; OLMo 2's post-norm layers; Phi-3/4's packed gate_up and partial rotary.
OTHER_ARCHS = ("gemma3_text", "olmo2", "phi3")
FAMILIES = ARCHS + MOE_ARCHS + OTHER_ARCHS

# Each family's CPU-sized model: odd-ish widths, two layers, grouped-query attention.
_TINY = dict(
    hidden_size=96,
    intermediate_size=224,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
# The MoE families' tiny experts: 8 of width 64, top-2 (their defaults, 64 to 128 experts of
# 768-2048, would make the CPU model the size of a real layer); the router's aux loss on.
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, output_router_logits=True)
# Special tokens inside the tiny vocabulary, for families whose defaults lie past it.
_TINY_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TINY_FAMILY = {
    "olmoe": {**_TINY_MOE, "intermediate_size": 64},
    "qwen3_moe": _TINY_MOE,
    "olmo2": _TINY_TOKENS,
    "phi3": _TINY_TOKENS,
}

# Published sizes: the fields of each model's config.json that set a training step's shapes
# (read 2026-12-04). RoPE scaling is left out: it changes no shape and no cost of a step.
PRESETS: dict[str, tuple[str, dict]] = {
    "Llama-3.2-1B": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=True,
        ),
    ),
    "Qwen2.5-0.5B": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "Qwen3-0.6B": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    # google/gemma-3-1b-pt's text model: a 262,144 vocabulary, so the loss is a large share of
    # the step; every sixth layer global, the others over a 512-token window.
    "Gemma-3-1B": (
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            sliding_window=512,
            query_pre_attn_scalar=256,
            tie_word_embeddings=True,
        ),
    ),
    # allenai/OLMo-2-0425-1B: post-norm layers, q/k norms over the whole projection.
    "OLMo-2-1B": (
        "olmo2",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=100352,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # microsoft/Phi-4-mini-instruct: packed gate_up and qkv, 0.75 of each head rotated; 3.8B
    # parameters, so 4 x 2048 tokens with AdamW fits one 141 GB card in bf16, not in amp.
    "Phi-4-mini": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=200064,
            max_position_embeddings=131072,
            partial_rotary_factor=0.75,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    # allenai/OLMoE-1B-7B-0924: 6.92B parameters, 1.28B active (8 of 64 experts a token). A
    # training step adds the router's aux loss (output_router_logits; the config.json turns it off
    # for inference). On one 141 GB card in bf16 with AdamW (8 bytes a parameter): 55 GB of state.
    "OLMoE-1B-7B": (
        "olmoe",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            router_aux_loss_coef=0.01,
            output_router_logits=True,
            vocab_size=50304,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen/Qwen3-30B-A3B's layer (128 experts of 768, top-8, 32 query heads over 4 of 128) at 12 of
    # its 48 layers: 48 hold 30.5B parameters, 244 GB in bf16 with AdamW (2 bytes the weights, 2
    # the gradients, 4 the moments), over any one card. 12 hold 8.1B (65 GB), with ~1.7 GB of
    # saved activations a layer at 4 x 2048 tokens (the 8 experts' gathered inputs, gate_up,
    # activation and outputs a token) and ~12 GB for the unfused logits: ~100 GB, leaving room
    # for the eager baseline's transients and torch.compile on a 141 GB H200 (16 layers: ~125 GB).
    "Qwen3-30B-A3B-12L": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            output_router_logits=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
}
# The same two mixtures of experts at the depth an 80 GB card (an H100) holds at 4 x 2048 tokens with
# AdamW and the baselines: every layer is alike, so half (a third) of the layers is the same step's
# work per layer, the embeddings and the loss unchanged.
PRESETS["OLMoE-1B-7B-8L"] = ("olmoe", {**PRESETS["OLMoE-1B-7B"][1], "num_hidden_layers": 8})
PRESETS["Qwen3-30B-A3B-4L"] = ("qwen3_moe", {**PRESETS["Qwen3-30B-A3B-12L"][1], "num_hidden_layers": 4})

# Batch defaults: the tiny model's fit a CPU; the published sizes' are the 4 x 2048 tokens a
# step that profuse's H200 targets use.
TINY_BATCH = (2, 64)
PUBLISHED_BATCH = (4, 2048)


def require_transformers() -> None:
    if not HAS_TRANSFORMERS:
        raise UsageError(TRANSFORMERS_MISSING)


def preset_names() -> tuple[str, ...]:
    return ("tiny", *PRESETS)


def _config_fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_")}


@dataclass
class HFSpec(ModelSpec):
    """A Llama-family model: its transformers config, and the batch."""

    config: object  # a transformers PretrainedConfig of one of FAMILIES
    preset: str
    batch_size: int
    seq_len: int
    family: str = field(init=False)
    _n_params: int | None = field(default=None, init=False, repr=False, compare=False)
    _experts_default: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.family = self.config.model_type
        if self.family not in FAMILIES:
            choices = ", ".join(FAMILIES)
            raise UsageError(f"model type {self.family!r} is not supported: choose from {choices}")
        self.config.use_cache = False  # a training step has no use for a KV cache
        if self.batch_size < 1 or self.seq_len < 1:
            raise UsageError(f"batch and sequence must be positive: {self.batch_size} x {self.seq_len}")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and self.seq_len > limit:
            raise UsageError(f"--seq-len {self.seq_len} is longer than the model's {limit} positions")

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def n_layer(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def d_model(self) -> int:
        return int(self.config.hidden_size)

    @property
    def ffn_hidden(self) -> int:
        """The MLP's width a token: an MoE's top-k experts of their width each."""
        if self.family in MOE_ARCHS:
            width = getattr(self.config, "moe_intermediate_size", None) or self.config.intermediate_size
            return int(width) * int(self.config.num_experts_per_tok)
        return int(self.config.intermediate_size)

    def build(self, device: torch.device | str, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(self.config, attn_implementation="sdpa")
        return model.float().train()

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return model(input_ids=idx, use_cache=False).logits

    def batch(self, device: torch.device | str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each (batch_size, seq_len): random tokens, and the labels a
        causal-LM training loop passes, the input ids themselves (the model shifts them). The same
        tokens as ModelSpec.batch's inputs."""
        idx, _targets = super().batch(device, seed)
        return idx, idx

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The model's own loss, as its users compute it: `model(input_ids, labels=labels).loss`,
        shifted inside (token t predicts label t + 1), the mean over B x (T - 1) tokens. A fused
        linear cross-entropy inside the model (profuse.fuse's, Liger's) computes it without the
        logits; unfused, Hugging Face casts the logits to fp32 for it."""
        idx, labels = batch
        return model(input_ids=idx, labels=labels, use_cache=False).loss

    def reference_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`loss`'s math from the logits in their own dtype (float64 stays float64): labels shifted
        as Hugging Face shifts them (profuse.crossentropy.shifted_labels), ignore_index -100."""
        idx, labels = batch
        logits = self.logits(model, idx)
        target = shifted_labels(labels).to(logits.device)
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def small(self) -> HFSpec:
        cfg = type(self.config).from_dict(_config_fields(self.config))
        cfg.num_hidden_layers = min(self.n_layer, CHECK_LAYERS)
        if getattr(cfg, "layer_types", None):  # per-layer attention kinds, where the family has them
            cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
        return HFSpec(cfg, self.preset, min(self.batch_size, CHECK_BATCH), min(self.seq_len, CHECK_SEQ_LEN))

    def param_count(self) -> int:
        """Parameters of the model the config makes, counted on the meta device (nothing allocated)."""
        if self._n_params is None:
            self._meta_build()
        return self._n_params

    def _meta_build(self) -> None:
        """The model on the meta device (nothing allocated): its parameter count and the experts
        implementation transformers sets it to by default."""
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(self.config)
        self._n_params = sum(p.numel() for p in model.parameters())
        self._experts_default = str(getattr(model.config, "_experts_implementation", None) or "eager")

    @property
    def n_head(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def n_kv_head(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.d_model // self.n_head)

    def activation_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """What one step keeps for the backward, a token and a layer (d the width, q and kv the
        query and key/value widths, heads x head_dim): the residual stream and the norms, which
        stay fp32 under autocast (HF's RMSNorm upcasts: input, normalised hidden, output, twice a
        layer, ~8 d fp32 numbers; Qwen3's q/k norms ~3 (q + kv) more); in `dtype` the norm
        outputs cast for the projections (2 d), q, k, v, the RoPE'd q and k and attention's
        output (3 q + 3 kv), gate, up, silu(gate) and their product (4 F). Then the logits in
        `dtype` with their fp32 upcast, log-softmax and gradient (V + 3 V fp32 a token), and
        one layer's attention scores where a backend writes them out (B x heads x T^2 fp32,
        CPU's math path). Against what autograd saves for the tiny models in fp32
        (tests/test_models.py) it is 1-2x over."""
        low = torch.finfo(dtype).bits // 8
        q, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        fp32 = 8 * self.d_model + (3 * (q + kv) if self.family == "qwen3" else 0)
        lowp = 2 * self.d_model + 3 * (q + kv) + 4 * self.ffn_hidden
        per_token = self.n_layer * (4 * fp32 + low * lowp) + self.vocab_size * (low + 12)
        scores = self.batch_size * self.n_head * self.seq_len**2 * 4
        return self.tokens * per_token + scores

    def dims(self) -> dict:
        return {
            "n_layer": self.n_layer,
            "d_model": self.d_model,
            "n_head": self.n_head,
            "n_kv_head": self.n_kv_head,
            "head_dim": self.head_dim,
            "ffn_hidden": self.ffn_hidden,
            "vocab_size": self.vocab_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "tie_weights": bool(getattr(self.config, "tie_word_embeddings", False)),
        }

    def op_shapes(self) -> OpShapes:
        eps = float(self.config.rms_norm_eps)
        return OpShapes(tokens=self.tokens, d_model=self.d_model, ffn_hidden=self.ffn_hidden, eps=eps)

    def fuse(self, model: nn.Module, ops=None, *, label: bool = False, only: Sequence[str] | None = None):
        from profuse.fusion import fuse

        if only is None:
            return fuse(model, ops, label=label)
        return fuse(model, list(only), impl=ops, label=label, causal_mask=True)

    def experts_choice(self, device: torch.device | str, precision: str = DEFAULT_PRECISION):
        """An MoE family's best experts implementation on `device` (profuse.models.experts), for
        this step's tokens x top-k (token, expert) pairs a layer; None for a dense family."""
        if self.family not in MOE_ARCHS:
            return None
        from profuse.models.experts import best_implementation

        if self._experts_default is None:
            self._meta_build()
        return best_implementation(
            device,
            pairs=self.tokens * int(self.config.num_experts_per_tok),
            num_experts=int(self.config.num_experts),
            dtype=param_dtype(precision),
            default=self._experts_default,
        )

    def fix_causal_mask(self, model: nn.Module) -> str:
        """The decoder stack (transformers' base_model) takes hf_mask's class, as profuse.fuse
        installs it, and nothing else changes; '' where done, else hf_mask's reason."""
        from profuse.fusion.hf_mask import plan_mask

        stack = getattr(model, "base_model", None)
        if not isinstance(stack, nn.Module) or stack is model:
            return f"{type(model).__name__} has no decoder stack apart from its head"
        plan = plan_mask(stack)
        if plan.target is None:
            return plan.reason or "hf_mask found no way to skip the mask"
        stack.__class__ = plan.target
        return ""

    def label(self, model: nn.Module) -> nn.Module:
        """The fused structure with the model's own eager math (profuse.fusion.HF_EAGER: bitwise
        what the unfused model computes), each op in its profiler range."""
        from profuse import fusion

        fusion.fuse(model, fusion.HF_EAGER, label=True)
        return model

    def to_dict(self) -> dict:
        return {
            "model": self.model_arg,
            "preset": self.preset,
            "config": _config_fields(self.config),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_params": self.param_count(),
        }


def read_config_json(path: Path) -> dict:
    """A Hugging Face config.json (or the folder holding one) as a dict with its model_type;
    UsageError in one line where it is missing, unreadable or no such config."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--hf-config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--hf-config {path}: not a readable config.json ({type(err).__name__})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(f"--hf-config {path}: no model_type in it, so not a Hugging Face config.json")
    return data


def _read_config_file(path: Path):
    data = read_config_json(path)
    family = data.pop("model_type")
    if family not in FAMILIES:
        supported = ", ".join(FAMILIES)
        raise UsageError(f"--hf-config {path}: model type {family!r} is not one of {supported}")
    try:
        return transformers.AutoConfig.for_model(family, **data)
    except Exception as err:  # transformers validates the fields (huggingface_hub strict dataclasses)
        reason = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
        raise UsageError(f"--hf-config {path}: transformers rejects it: {reason}") from None


def hf_spec(
    arch: str,
    preset: str | None = None,
    *,
    config_path: str | Path | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> HFSpec:
    """The spec for `--model hf:ARCH` with `--preset` (default tiny) or `--hf-config PATH`."""
    if arch not in FAMILIES and "/" in arch:  # a Hub model id: profuse builds a shape, it downloads nothing
        preset = next((p for p in PRESETS if arch.endswith("/" + p)), None)
        same = f"--model hf:{PRESETS[preset][0]} --preset {preset}, or " if preset else ""
        raise UsageError(
            f"hf:{arch} is a Hub model id, and hf: takes an architecture ({', '.join(FAMILIES)}): for its "
            f"shape with random weights use {same}--model hf:ARCH --hf-config with its config.json"
        )
    if arch not in FAMILIES:
        raise UsageError(
            f"unknown Hugging Face architecture {arch!r}: choose from {', '.join(FAMILIES)} "
            "(another size of one: --hf-config PATH to its config.json)"
        )
    require_transformers()
    if config_path is not None:
        if preset is not None:
            raise UsageError(f"--preset {preset} and --hf-config: give one (a config.json names its size)")
        config = _read_config_file(Path(config_path))
        if config.model_type != arch:
            held = config.model_type
            raise UsageError(f"--hf-config holds a {held!r} model, not {arch!r}: use --model hf:{held}")
        name, batch = Path(config_path).name, PUBLISHED_BATCH
    else:
        name = preset or "tiny"
        if name == "tiny":
            fields = {**_TINY, **_TINY_FAMILY.get(arch, {})}
            config, batch = transformers.AutoConfig.for_model(arch, **fields), TINY_BATCH
        elif name in PRESETS:
            family, fields = PRESETS[name]
            if family != arch:
                raise UsageError(f"preset {name} is a {family} model: use --model hf:{family}")
            config, batch = transformers.AutoConfig.for_model(arch, **fields), PUBLISHED_BATCH
        else:
            choices = ", ".join(preset_names())
            raise UsageError(f"unknown preset {name!r} for hf:{arch}: choose from {choices}")
    return HFSpec(
        config,
        name,
        batch[0] if batch_size is None else batch_size,
        batch[1] if seq_len is None else seq_len,
    )
