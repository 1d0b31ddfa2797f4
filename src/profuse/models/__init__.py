"""The models profuse profiles and referees, behind one interface (profuse.models.spec.ModelSpec).

    model_spec("gpt", "small")                          the built-in GPT (profuse.model)
    model_spec("hf:llama", "Llama-3.2-1B")              a Hugging Face model, random weights
    model_spec("hf:qwen3", config_path="config.json")   a local config.json

`make_step(spec, device, precision="amp" | "bf16")` builds one and returns its training step, the
zero-argument callable profuse.profile takes. `profuse.models.liger` applies Liger-Kernel's patch to
one built Hugging Face model without leaving it on the others (Part C's liger and liger-ops
variants).
"""

from __future__ import annotations

from pathlib import Path

from profuse.errors import UsageError
from profuse.models.spec import (
    DEFAULT_PRECISION,
    PRECISION_HELP,
    PRECISIONS,
    ModelSpec,
    OpShapes,
    autocast_for,
    check_precision,
    compute_dtype,
    make_step,
    param_dtype,
    precision_text,
    train_step,
)

MODEL_HELP = (
    "gpt (the built-in, default) or hf:ARCH, ARCH one of llama, mistral, qwen2, qwen3, olmoe, qwen3_moe"
)

__all__ = [
    "DEFAULT_PRECISION",
    "MODEL_HELP",
    "PRECISIONS",
    "PRECISION_HELP",
    "ModelSpec",
    "OpShapes",
    "autocast_for",
    "check_precision",
    "compute_dtype",
    "make_step",
    "model_spec",
    "param_dtype",
    "precision_text",
    "train_step",
]


def model_spec(
    model: str = "gpt",
    preset: str | None = None,
    *,
    config_path: str | Path | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    **gpt_fields: int | None,
) -> ModelSpec:
    """The spec a --model value names. For the built-in GPT, `gpt_fields` are GPTConfig fields
    (n_layer, d_model, n_head, vocab_size; None keeps the preset's); for hf:ARCH they must all
    be None (a Hugging Face model's widths come from its config)."""
    if model == "gpt":
        from profuse.models.gpt import GPTSpec, preset_model

        if config_path is not None:
            raise UsageError("--hf-config is for Hugging Face models: add --model hf:ARCH")
        name = preset or "lab"
        config = preset_model(name, batch_size=batch_size, seq_len=seq_len, **gpt_fields)
        return GPTSpec(config, name)
    if model.startswith("hf:"):
        from profuse.models.hf import hf_spec

        given = sorted(k for k, v in gpt_fields.items() if v is not None)
        if given:
            flag = {"n_layer": "layers", "n_head": "heads"}
            flags = ", ".join("--" + flag.get(k, k).replace("_", "-") for k in given)
            raise UsageError(f"{flags}: sizes of the built-in GPT; a Hugging Face model's are its config's")
        return hf_spec(model[3:], preset, config_path=config_path, batch_size=batch_size, seq_len=seq_len)
    raise UsageError(f"unknown model {model!r}: {MODEL_HELP}")
