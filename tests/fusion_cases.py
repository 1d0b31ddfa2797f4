"""Tiny random Hugging Face models and helpers shared by the profuse.fuse tests.

Every model is built from its Config class with random weights (the norms' weights too: at their
init, ones, a norm that ignored its weight would pass), widths that are not powers of two (hidden
56, intermediate 92, 4 query heads over 2 key/value heads of 14), 3 layers, vocab 97.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch
from torch import nn

from profuse import fusion
from profuse.fusion.hf_modules import FUSED_MARK

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LAYERS = 3
VOCAB = 97
FP32 = torch.float32


def tiny(arch: str, *, tie: bool = False, seed: int = 0, layers: int = LAYERS, **overrides) -> nn.Module:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=56,
        intermediate_size=92,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=14,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def tokens(seed: int, batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def labels_for(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """ids as labels with about a third of them -100 (ignored), never a whole row."""
    labels = ids.clone()
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.33
    drop[:, 0] = False
    labels[drop] = -100
    return labels


def loss_and_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
    """Hugging Face's loss (labels default ids) and every gradient it reaches, by parameter name."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids if labels is None else labels, **kwargs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def counting_ops(calls: Counter, base: fusion.BlockOps = fusion.EAGER, only=None) -> fusion.BlockOps:
    """`base`'s ops (those named in `only`, default all), each counting its calls."""

    def counted(op, fn):
        def call(*args, **kwargs):
            calls[op] += 1
            return fn(*args, **kwargs)

        return call

    ops = {op: counted(op, getattr(base, op)) for op in fusion.OP_NAMES if only is None or op in only}
    return fusion.BlockOps(
        ops.get(fusion.SILU_MUL),
        ops.get(fusion.ADD_RMS_NORM),
        "counting",
        **{op: fn for op, fn in ops.items() if op not in (fusion.SILU_MUL, fusion.ADD_RMS_NORM)},
    )


def expected_counts(arch: str, layers: int = LAYERS, head: bool = True) -> dict[str, int]:
    """Every op's places in a model of `arch` fused whole."""
    attention = fusion.QK_NORM_ROPE if arch == "qwen3" else fusion.ROPE
    counts = {fusion.SILU_MUL: layers, fusion.ADD_RMS_NORM: 2 * layers, fusion.RMS_NORM: 1, attention: layers}
    if head:
        counts[fusion.LINEAR_CROSS_ENTROPY] = 1
    return {op: counts[op] for op in fusion.OP_NAMES if op in counts}


KERNEL_MODULES = {
    fusion.SILU_MUL: "profuse.kernels.swiglu",
    fusion.ADD_RMS_NORM: "profuse.kernels.add_rms_norm",
    fusion.RMS_NORM: "profuse.kernels.rms_norm",
    fusion.ROPE: "profuse.kernels.rope",
    fusion.QK_NORM_ROPE: "profuse.kernels.rope",
    fusion.LINEAR_CROSS_ENTROPY: "profuse.kernels.cross_entropy",
}


def has_kernel(op: str) -> bool:
    """Whether this build holds the Triton kernel behind FUSED's `op`."""
    from profuse.kernels import HAS_TRITON

    return HAS_TRITON and importlib.util.find_spec(KERNEL_MODULES[op]) is not None


def fused_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(type(m), FUSED_MARK, False)]


def snapshot(model: nn.Module):
    """Everything fuse could change: each module's class, object and instance attributes, hooks,
    the parameters' values."""
    modules = [
        (name, type(m), id(m), sorted(m.__dict__), list(m._forward_pre_hooks))
        for name, m in model.named_modules()
    ]
    return modules, {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before) -> None:
    modules, state = snapshot(model)
    assert modules == before[0]
    assert state.keys() == before[1].keys()
    for k in state:
        if state[k].is_meta:  # offloaded: no values to compare here
            assert (state[k].shape, state[k].dtype) == (before[1][k].shape, before[1][k].dtype), k
        else:
            assert torch.equal(state[k], before[1][k]), k


def max_grad_error(got: dict, want: dict) -> dict[str, float]:
    from profuse.tail import relative_error

    assert got.keys() == want.keys()
    return {name: relative_error(got[name], want[name]) for name in want}
