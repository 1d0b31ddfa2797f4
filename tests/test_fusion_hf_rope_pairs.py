"""profuse.fuse's rope on the families that rotate interleaved lane pairs (x0, x1), (x2, x3), ...:
GLM-4 (cos's first half, partial rotary over half of each head), Ernie 4.5 (cos's first half,
each product in fp32, cast back), Cohere (cos by lane, q and k in fp32 first, cast back). GLM
and Helium share GLM-4's function, Cohere 2 Cohere's.

Each is fused with rope alone (every other op stays the model's own) against an unfused copy:
the train-mode loss and every gradient, the eval logits, fp32 and bf16. HF_EAGER (each family's
apply_rotary_pos_emb op for op, in the form and rounding order the probes found) must agree
bitwise: the wrong form is off by O(1), the wrong cast-back order by bf16 roundings in the
gradients. FUSED runs the kernel through the interpreter. (test_fusion_hf_families.py fuses
GLM-4 and Cohere whole, rope included.) Tiny models: hidden 40, 1 layer, vocab 71, head_dim 20.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_cases import has_kernel, labels_for, loss_and_grads  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.fusion.hf import fuse  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402

VOCAB = 71
BF16 = torch.bfloat16
FAMILIES = ["glm4", "ernie4_5", "cohere"]


def family(arch: str, seed: int, dtype=torch.float32, **overrides):
    config = transformers.AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=52,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=20,
        max_position_embeddings=32,
        **{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides},
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)


def compare(model, impl, dtype, seed, exact: bool):
    """The model with rope fused against its unfused copy: train loss, every gradient, eval logits."""
    ref = copy.deepcopy(model)
    summary = fuse(model, ["rope"], impl=impl)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))
    labels = labels_for(ids, seed + 1)
    model.train(), ref.train()
    want, want_grads = loss_and_grads(ref, ids, labels)
    got, grads = loss_and_grads(model, ids, labels)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(ref.parameters()))
    model.eval(), ref.eval()
    with torch.no_grad():
        want_logits, logits = ref(ids).logits, model(ids).logits
    if exact:
        assert torch.equal(got, want) and torch.equal(logits, want_logits)
        for name in grads:
            assert torch.equal(grads[name], want_grads[name]), name
    else:
        assert relative_error(got, want) <= FORWARD_TOL[dtype]
        assert relative_error(logits, want_logits) <= FORWARD_TOL[dtype]
        for name in grads:
            assert relative_error(grads[name], want_grads[name]) <= BACKWARD_TOL[dtype], name
    return summary


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("arch", FAMILIES)
def test_rope_over_lane_pairs_fuses_bitwise_with_the_models_own_math(arch, dtype):
    model = family(arch, seed=71, dtype=dtype)
    summary = compare(model, fusion.HF_EAGER, dtype, seed=18, exact=True)
    assert summary.counts == {"rope": 1} and summary.left_unfused == ()


@pytest.mark.skipif(not has_kernel("rope"), reason="triton or the rope kernel is missing")
@pytest.mark.parametrize("arch", ["glm4", "cohere"])
def test_rope_over_lane_pairs_runs_the_kernel_through_the_interpreter(arch):
    """GLM-4's first-half form over part of each head, Cohere's by-lane form cast back."""
    model = family(arch, seed=72)
    summary = compare(model, fusion.FUSED, torch.float32, seed=19, exact=False)
    assert summary.counts == {"rope": 1} and summary.notes == ()


def test_lane_pairs_without_the_op_say_why_in_one_line():
    """An op set whose rope takes no interleaved= leaves a pairs' rotation as the model's own;
    Cohere's q/k norms (use_qk_norm) stay unfused beside the pairs, rope fusing after them."""
    halves_only = dataclasses.replace(fusion.EAGER, rope=lambda q, k, cos, sin: (q, k), name="halves")
    summary = fuse(family("glm4", seed=73), impl=halves_only, dry_run=True)
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    assert "rope" not in summary.counts and "interleaved lane pairs" in left["rope"]
    assert "takes no interleaved" in left["rope"] and "\n" not in left["rope"]
    summary = fuse(family("cohere", seed=74, use_qk_norm=True), impl=fusion.EAGER, dry_run=True)
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    assert summary.counts["rope"] == 1 and "interleaved lane pairs" in left["qk_norm_rope"]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_probes_read_each_rotations_form_and_rounding_under_any_grad_mode(mode):
    """What the attention's own apply_rotary_pos_emb computes, read from calling it (fuse may be
    called under no_grad or inference_mode: the rounding probe runs a backward all the same)."""
    from profuse.fusion import hf_attention as H

    models = transformers.models
    found = {
        "cohere": (models.cohere.modeling_cohere.CohereAttention, "lanes", "float"),
        "ernie4_5": (models.ernie4_5.modeling_ernie4_5.Ernie4_5Attention, "first_half", True),
        "glm4": (models.glm4.modeling_glm4.Glm4Attention, "first_half", False),
        "olmo2": (models.olmo2.modeling_olmo2.Olmo2Attention, "halves", True),
        "llama": (models.llama.modeling_llama.LlamaAttention, "halves", False),
    }
    with mode():
        for arch, (attention, form, keep) in found.items():
            assert H._rope_form(attention) == form, arch
            keeps = H._casts_back(attention, form)
            assert keeps == keep and type(keeps) is type(keep), arch
