"""The built-in GPT (profuse.model) as a ModelSpec: the lab's model and Part C's presets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from profuse.errors import UsageError
from profuse.model import GPT, GPTConfig
from profuse.models.spec import CHECK_BATCH, CHECK_LAYERS, CHECK_SEQ_LEN, ModelSpec, OpShapes

# Sizes. lab: the GPTConfig defaults (4 layers, d_model 256, 2048 tokens a step). small and
# medium: 8 layers and 8192 tokens a step (8 x 1024); head dim 128 in both.
PRESETS: dict[str, dict] = {
    "lab": {},
    "small": dict(n_layer=8, d_model=1024, n_head=8, seq_len=1024, batch_size=8),
    "medium": dict(n_layer=8, d_model=2048, n_head=16, seq_len=1024, batch_size=8),
}


def preset_model(preset: str, **overrides: int | None) -> GPTConfig:
    """The preset's GPTConfig with the given fields (None: the preset's) overriding it."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r} for the built-in GPT: choose from {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class GPTSpec(ModelSpec):
    """profuse's own GPT: its GPTConfig holds the batch too (batch_size x seq_len)."""

    config: GPTConfig = field(default_factory=GPTConfig)
    preset: str = "lab"
    family: str = field(default="gpt", init=False)

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self.config.batch_size

    @property
    def seq_len(self) -> int:  # type: ignore[override]
        return self.config.seq_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def build(self, device: torch.device | str, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.config).to(device)

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        logits, _ = model(idx)
        return logits

    def small(self) -> GPTSpec:
        m = self.config
        cut = replace(
            m,
            n_layer=min(m.n_layer, CHECK_LAYERS),
            seq_len=min(m.seq_len, CHECK_SEQ_LEN),
            batch_size=min(m.batch_size, CHECK_BATCH),
        )
        return GPTSpec(cut, self.preset)

    def param_count(self) -> int:
        return self.config.param_count()

    def activation_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """GPTConfig.activation_bytes: the fp32 bound, whatever `dtype` (bf16 counts as fp32)."""
        return self.config.activation_bytes()

    def dims(self) -> dict:
        return {**asdict(self.config), "ffn_hidden": self.config.hidden}

    def op_shapes(self) -> OpShapes:
        m = self.config
        return OpShapes(tokens=m.tokens, d_model=m.d_model, ffn_hidden=m.hidden, eps=m.norm_eps)

    def fuse(self, model: nn.Module, ops=None, *, label: bool = False, only: Sequence[str] | None = None):
        from profuse import fusion

        if only is not None:
            raise UsageError("the built-in GPT's fusion swaps silu_mul and add_rms_norm together, no subset")

        fusion.apply_block_ops(model, ops or fusion.FUSED)
        if label:
            fusion.label_block_ops(model)
        return model

    def label(self, model: nn.Module) -> nn.Module:
        from profuse import fusion

        return fusion.label_block_ops(model)

    def to_dict(self) -> dict:
        return {
            "model": self.model_arg,
            "preset": self.preset,
            "resized": self.config != preset_model(self.preset) if self.preset in PRESETS else True,
            "config": {**asdict(self.config), "ffn_hidden": self.config.hidden},
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_params": self.param_count(),
        }
