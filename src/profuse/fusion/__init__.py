"""Fusion applied to a model from outside: its memory-bound ops swapped for fused ones.

Two routes, one per kind of model:

    profuse.fusion.gpt   the built-in GPT (profuse.model): its block ops are functions its modules
                         hold, swapped in place (use_block_ops, apply_block_ops, label_block_ops)
    profuse.fusion.hf    a Hugging Face Llama-family model, fused in place (fuse, unfuse): the
                         block ops, and rms_norm, rope / qk_norm_rope and linear_cross_entropy
                         (hf_layer, hf_attention, hf_head; hf_modules says how classes are swapped)

Both install the same ops (a BlockOps: FUSED, profuse's Triton kernels, or EAGER, the same math
in plain torch; for Hugging Face models also HF_EAGER, their own eager math) and label them with
the same profiler ranges (BLOCK_OP_RANGES). OP_NAMES lists the ops by name.
"""

from profuse.fusion.gpt import (
    ADD_RMS_NORM,
    BLOCK_OP_RANGES,
    CLAMPED_SWIGLU,
    EAGER,
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
    apply_block_ops,
    label_block_ops,
    labelled,
    use_block_ops,
)
from profuse.fusion.hf import HF_EAGER, FuseSummary, add_rms_norm_hf, fuse, unfuse

__all__ = [
    "ADD_RMS_NORM",
    "BLOCK_OP_RANGES",
    "EAGER",
    "FUSED",
    "HF_EAGER",
    "LAYER_NORM",
    "LINEAR_CROSS_ENTROPY",
    "OP_NAMES",
    "QK_NORM_ROPE",
    "CLAMPED_SWIGLU",
    "RMS_NORM",
    "RMS_NORM_ADD",
    "ROPE",
    "SILU_MUL",
    "BlockOps",
    "FuseSummary",
    "add_rms_norm_hf",
    "apply_block_ops",
    "fuse",
    "label_block_ops",
    "labelled",
    "unfuse",
    "use_block_ops",
]
