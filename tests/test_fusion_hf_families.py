"""profuse.fuse on the dense families past Llama's layout, by structure: Gemma's (1 + w) norms in
its fp32-then-cast order and its GeGLU MLP (gelu tanh, and the exact erf form); the MLPs of
layers not fused whole (Gemma 3, OLMo 2), and the packed gate_up_proj MLPs of Phi-3 and GLM-4,
fused by their own class.

Each family is fused against an unfused copy: the train-mode loss and every gradient, the eval
logits, fp32 and bf16; HF_EAGER (the model's own math in the fused structure) must agree
bitwise, EAGER (the ops' eager versions) within the ops' tolerances, and FUSED once through the
interpreter. Tiny models: hidden 40, 2 layers, vocab 71, the norms' weights perturbed from
Gemma's zeros (a norm that dropped the 1 + would fail).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_cases import assert_untouched, fused_modules, labels_for, loss_and_grads, snapshot  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.errors import UnsupportedModel  # noqa: E402
from profuse.fusion import hf_ops  # noqa: E402
from profuse.fusion.hf import fuse, unfuse  # noqa: E402
from profuse.fusion.hf_modules import STATE  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402

VOCAB = 71
BF16 = torch.bfloat16
GEMMA_COUNTS = {"silu_mul": 2, "add_rms_norm": 4, "rms_norm": 1, "rope": 2, "linear_cross_entropy": 1}


def gemma(seed: int, layers: int = 2, dtype=torch.float32):
    config = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=52,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=20,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    model = transformers.GemmaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's init is 0, (1 + w) = 1: away from it, per channel
                p.copy_(0.4 * torch.randn_like(p))
    return model.to(dtype)


def family(arch: str, seed: int, dtype=torch.float32, layers: int = 2, **overrides):
    """A tiny model of `arch` (a transformers model type) with its norms perturbed."""
    config = transformers.AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=40,
        intermediate_size=52,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=20,
        max_position_embeddings=32,
        **{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.4 * torch.randn_like(p))
    return model.to(dtype)


def ids_for(seed: int, batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _compare(model, impl, dtype, seed, exact: bool):
    """The fused model against its unfused copy: train loss, every gradient, eval logits."""
    ref = copy.deepcopy(model)
    summary = fuse(model, impl)
    ids = ids_for(seed)
    labels = labels_for(ids, seed + 1)
    model.train(), ref.train()
    want, want_grads = loss_and_grads(ref, ids, labels)
    got, grads = loss_and_grads(model, ids, labels)
    assert want_grads.keys() == grads.keys() and len(grads) == len(list(ref.parameters()))
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
@pytest.mark.parametrize("impl", ["HF_EAGER", "EAGER"])
def test_gemma_fuses_every_layer_op_and_keeps_its_loss_gradients_and_logits(impl, dtype):
    model = gemma(seed=11 if dtype is BF16 else 12, dtype=dtype)
    summary = _compare(model, getattr(fusion, impl), dtype, seed=3, exact=impl == "HF_EAGER")
    assert summary.counts == GEMMA_COUNTS and summary.left_unfused == ()
    layer, final = model.model.layers[0], model.model.norm
    assert layer.__dict__[STATE].input_norm.offset == 1.0 and final.__dict__[STATE].norm.offset == 1.0
    assert layer.__dict__[STATE].activation == "gelu_tanh"


def test_gemma_with_the_exact_gelu_calls_gelu_mul_with_approximate_none(monkeypatch):
    from profuse import blockops

    seen = []
    real = blockops.gelu_mul_eager

    def spy(gate, up=None, approximate="tanh"):
        seen.append(approximate)
        return real(gate, up, approximate)

    monkeypatch.setattr(blockops, "gelu_mul_eager", spy)
    monkeypatch.setattr(hf_ops, "_GELU_FORMS", {blockops.silu_mul_eager: spy})
    model = gemma(seed=13)
    for layer in model.model.layers:  # GemmaConfig reads hidden_act="gelu" as the tanh form
        layer.mlp.act_fn = transformers.activations.GELUActivation()
    summary = _compare(model, fusion.HF_EAGER, torch.float32, seed=4, exact=True)
    assert model.model.layers[0].__dict__[STATE].activation == "gelu"
    assert summary.counts["silu_mul"] == 2 and set(seen) == {"none"}
    # the tanh form would not do: the probe tells them apart
    tanh = gemma(seed=13)
    fuse(tanh, fusion.EAGER)
    assert tanh.model.layers[0].__dict__[STATE].activation == "gelu_tanh"


def test_an_op_set_without_offsets_or_gelu_leaves_gemmas_places_unfused_with_the_reason():
    def plain_add(x, residual, weight, eps):
        return fusion.EAGER.add_rms_norm(x, residual, weight, eps)

    def plain_rms(x, weight, eps):
        return fusion.EAGER.rms_norm(x, weight, eps)

    ops = fusion.BlockOps(
        lambda gate, up=None: fusion.EAGER.silu_mul(gate, up),
        plain_add,
        "plain",
        rms_norm=plain_rms,
        rope=fusion.EAGER.rope,
    )
    model = gemma(seed=14)
    before = snapshot(model)
    summary = fuse(model, ops, dry_run=True)
    assert_untouched(model, before)
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    assert "(1 + weight)" in left["add_rms_norm"] and "weight_offset" in left["add_rms_norm"]
    assert "(1 + weight)" in left["rms_norm"] and "'plain''s rms_norm" in left["rms_norm"]
    assert "no GELU form" in left["silu_mul"]
    assert summary.counts == {"rope": 2}


def test_gemma_fused_then_unfused_is_the_model_it_was():
    model = gemma(seed=15)
    before = snapshot(model)
    assert fuse(model, fusion.EAGER, dry_run=True).counts == GEMMA_COUNTS
    assert_untouched(model, before)
    fuse(model, fusion.EAGER)
    unfuse(model)
    assert_untouched(model, before)


GEMMA3_COUNTS = {
    "silu_mul": 2,
    "rms_norm": 5,
    "qk_norm_rope": 2,
    "linear_cross_entropy": 1,
    "rms_norm_add": 4,
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gemma3_fuses_every_op_its_q_k_norms_with_their_offset_in_qk_norm_rope(dtype):
    """Gemma 3's (1 + w) q/k norms run inside qk_norm_rope (weight_offset=1.0): HF_EAGER bitwise,
    EAGER within the ops' tolerances, train-mode loss and gradients, eval-mode logits."""
    for impl, exact in ((fusion.HF_EAGER, True), (fusion.EAGER, False)):
        model = family("gemma3_text", seed=31, dtype=dtype)
        summary = _compare(model, impl, dtype, seed=7, exact=exact)
        assert summary.counts == GEMMA3_COUNTS and summary.left_unfused == ()
        st = model.model.layers[0].self_attn.__dict__[STATE]
        assert st.q_norm.offset == st.k_norm.offset == 1.0


def test_an_op_set_whose_qk_norm_rope_takes_no_offset_leaves_gemma3s_q_k_norms_unfused_with_the_reason():
    def plain_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
        return fusion.EAGER.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)

    ops = dataclasses.replace(fusion.EAGER, qk_norm_rope=plain_qk_norm_rope, name="plain")
    summary = fuse(family("gemma3_text", seed=32), ops, dry_run=True)
    why = dict(item.split(": ", 1) for item in summary.left_unfused)["qk_norm_rope"]
    assert "(1 + weight)" in why and "'plain''s qk_norm_rope takes no offset" in why
    assert summary.counts["rope"] == 2  # rope fuses alone, the norms as modules


def _has_fused_kernels() -> bool:
    from profuse.kernels import HAS_TRITON

    needed = ("profuse.kernels.gated", "profuse.kernels.add_rms_norm", "profuse.kernels.rms_norm")
    return HAS_TRITON and all(importlib.util.find_spec(m) is not None for m in needed)


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_gemma3s_offset_q_k_norms_through_the_qk_norm_rope_kernel_in_the_interpreter():
    model = family("gemma3_text", seed=33, layers=1)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=8, exact=False)
    assert summary.counts["qk_norm_rope"] == 1 and summary.notes == ()


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_gemma_fused_with_the_triton_kernels_through_the_interpreter():
    model = gemma(seed=16, layers=1)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=5, exact=False)
    assert summary.notes == ()  # the kernels ran (interpreted), not the eager fallback
    assert summary.counts == {**GEMMA_COUNTS, "silu_mul": 1, "add_rms_norm": 2, "rope": 1}


# model type -> (the MLP's form, its activation, the other ops that fuse)
MLP_FAMILIES = {
    # Phi-3: rope on its packed qkv_proj's q, k; its layer fused whole, dropout modules and all
    "phi3": (True, "silu", {"rope": 2, "linear_cross_entropy": 1, "add_rms_norm": 4, "rms_norm": 1}),
    # GLM-4: a sandwich layer whose four norms the probe gives their roles (not Gemma 2's names);
    # rope over interleaved lane pairs, partial rotary
    "glm4": (True, "silu", {"rope": 2, "linear_cross_entropy": 1, "rms_norm": 5, "rms_norm_add": 4}),
    # OLMo 2: post-norm; its q/k norms span the whole projection, so rope fuses after them
    "olmo2": (False, "silu", {"rms_norm": 1, "rope": 2, "linear_cross_entropy": 1, "rms_norm_add": 4}),
    "gemma3_text": (
        False,
        "gelu_tanh",
        {"rms_norm": 5, "qk_norm_rope": 2, "linear_cross_entropy": 1, "rms_norm_add": 4},
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("arch", list(MLP_FAMILIES))
def test_mlps_of_layers_not_fused_whole_fuse_by_their_class_packed_or_not(arch, dtype):
    packed, activation, others = MLP_FAMILIES[arch]
    # OLMo 2's final norm multiplies by the weight in fp32, then casts; HF_EAGER's rms_norm is
    # Llama's order (cast, then the weight): in bf16 one ulp apart (its rms_norm_add is bitwise)
    # (GLM-4's post-norms are Llama's order, cast then the weight: HF_EAGER's rms_norm_add, OLMo
    # 2's, is an ulp apart in bf16 there)
    hf_exact = not (arch in ("olmo2", "glm4") and dtype is BF16)
    for impl, exact in ((fusion.HF_EAGER, hf_exact), (fusion.EAGER, False)):
        model = family(arch, seed=21, dtype=dtype)
        summary = _compare(model, impl, dtype, seed=6, exact=exact)
        assert summary.counts == {"silu_mul": 2, **others}
        spec = model.model.layers[1].mlp.__dict__[STATE].spec
        assert (spec.packed, spec.activation) == (packed, activation)
        left = dict(item.split(": ", 1) for item in summary.left_unfused)
        # post-norm and sandwich layers have no add before a norm: no add_rms_norm place
        assert "add_rms_norm" not in left
        if arch == "olmo2":
            assert "normalise the whole projection" in left["qk_norm_rope"]


def test_a_packed_geglu_mlp_calls_gelu_mul_on_the_packed_output(monkeypatch):
    calls = []
    real = hf_ops._GELU_FORMS[fusion.EAGER.silu_mul]

    def spy(gate, up=None, approximate="tanh"):
        calls.append((up is None, gate.shape[-1], approximate))
        return real(gate, up, approximate)

    monkeypatch.setattr(hf_ops, "_GELU_FORMS", {fusion.EAGER.silu_mul: spy})
    model = family("phi3", seed=22, hidden_act="gelu_pytorch_tanh")
    summary = _compare(model, fusion.EAGER, torch.float32, seed=7, exact=False)
    assert summary.counts["silu_mul"] == 2
    assert calls and set(calls) == {(True, 2 * 52, "tanh")}


def test_a_packed_mlp_that_computes_something_else_stays_unfused_with_the_reason():
    class SwappedMLP(transformers.models.phi3.modeling_phi3.Phi3MLP):
        def forward(self, x):  # act on the second half: not act(gate) * up
            up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))

    class DroppedMLP(transformers.models.phi3.modeling_phi3.Phi3MLP):
        def forward(self, x):  # dropout in training only
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            hidden = torch.nn.functional.dropout(up * self.activation_fn(gate), 0.5, self.training)
            return self.down_proj(hidden)

    for cls in (SwappedMLP, DroppedMLP):
        model = family("phi3", seed=23)
        for layer in model.model.layers:
            layer.mlp.__class__ = cls
        before = snapshot(model)
        summary = fuse(model, fusion.EAGER, dry_run=True)
        assert_untouched(model, before)
        left = dict(item.split(": ", 1) for item in summary.left_unfused)
        assert "silu_mul" not in summary.counts
        assert "the MLP alone" in left["silu_mul"] and "does not compute down(act(g) * u)" in left["silu_mul"]


def test_a_fused_mlp_whose_act_changed_runs_its_own_forward_and_unfuse_restores_it():
    model = family("glm4", seed=24)
    before = snapshot(model)
    fuse(model, fusion.EAGER)
    unfuse(model)
    assert_untouched(model, before)
    ref = copy.deepcopy(model)
    fuse(model, fusion.EAGER)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.activation_fn = torch.nn.Tanh()
    ids = ids_for(8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_a_packed_mlp_fused_with_the_triton_kernels_through_the_interpreter():
    model = family("phi3", seed=25, layers=1)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=9, exact=False)
    assert summary.notes == ()
    assert summary.counts == {
        "silu_mul": 1,
        "rope": 1,
        "linear_cross_entropy": 1,
        "add_rms_norm": 2,
        "rms_norm": 1,
    }


def softcapped(arch: str, seed: int, dtype=torch.float32, layers: int = 2):
    """Gemma 2 or 3 with its final-logit cap low enough that the tiny model's logits reach it."""
    model = family(arch, seed, dtype, layers, final_logit_softcapping=2.0, attn_implementation="eager")
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_a_soft_capped_head_fuses_and_passes_its_cap_to_the_loss(arch, dtype):
    for impl, exact in ((fusion.HF_EAGER, True), (fusion.EAGER, False)):
        model = softcapped(arch, seed=31, dtype=dtype)
        summary = _compare(model, impl, dtype, seed=10, exact=exact)
        rotary = "qk_norm_rope" if arch == "gemma3_text" else "rope"  # Gemma 3's q/k norms in it
        assert summary.counts["linear_cross_entropy"] == 1 and summary.counts[rotary] == 2
        # the GeGLU MLP by its class; the sandwich layer's four (1 + w) norms and the final one
        assert summary.counts["silu_mul"] == 2 and summary.counts["rms_norm_add"] == 4
        assert summary.counts["rms_norm"] == 5


def test_the_cap_is_read_at_each_call_and_a_loss_without_softcap_leaves_the_head_unfused():
    model = softcapped("gemma2", seed=32)
    ref = copy.deepcopy(model)
    fuse(model, fusion.HF_EAGER)
    for m in (model, ref):
        m.config.final_logit_softcapping = 0.7
    ids = ids_for(11)
    model.train(), ref.train()
    assert torch.equal(model(ids, labels=ids).loss, ref(ids, labels=ids).loss)

    def no_cap(hidden, weight, labels, **kwargs):
        return fusion.EAGER.linear_cross_entropy(hidden, weight, labels, **kwargs)

    def plain(hidden, weight, labels, ignore_index=-100, num_items_in_batch=None, shift_labels=None):
        return no_cap(
            hidden,
            weight,
            labels,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            shift_labels=shift_labels,
        )

    ops = fusion.BlockOps(
        fusion.EAGER.silu_mul, fusion.EAGER.add_rms_norm, "no cap", linear_cross_entropy=plain
    )
    summary = fuse(softcapped("gemma2", seed=33), ops, dry_run=True)
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    assert "softcap" in left["linear_cross_entropy"] and "linear_cross_entropy" not in summary.counts


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_a_soft_capped_head_fused_with_the_triton_kernels_through_the_interpreter():
    model = softcapped("gemma2", seed=34, layers=1)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=12, exact=False)
    assert summary.counts["linear_cross_entropy"] == 1 and summary.notes == ()
    assert summary.counts["rms_norm_add"] == 2 and summary.counts["rms_norm"] == 3  # the sandwich


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gemma2s_sandwich_layers_fuse_under_checkpointing_too(dtype):
    model = softcapped("gemma2", seed=35, dtype=dtype)
    model.gradient_checkpointing_enable()
    summary = _compare(model, fusion.HF_EAGER, dtype, seed=16, exact=True)
    assert summary.counts["rms_norm_add"] == 4 and summary.counts["rms_norm"] == 5
    state = model.model.layers[0].__dict__[STATE]
    assert state.sandwich and state.attn_norm.offset == state.pre_norm.offset == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_olmo2s_post_norm_layers_fuse_into_rms_norm_add_under_checkpointing_too(dtype):
    model = family("olmo2", seed=41, dtype=dtype)
    summary = _compare(model, fusion.HF_EAGER, dtype, seed=13, exact=dtype is torch.float32)
    assert summary.counts["rms_norm_add"] == 4 and summary.counts["rms_norm"] == 1
    assert "rms_norm_add" not in str(summary.left_unfused)
    model = family("olmo2", seed=41, dtype=dtype)  # the final norm's order apart: bitwise in bf16 too
    ref = copy.deepcopy(model)
    fuse(model, ["rms_norm_add", "silu_mul"], impl=fusion.HF_EAGER)
    ids = ids_for(13)
    (got, grads), (want, want_grads) = loss_and_grads(model, ids), loss_and_grads(ref, ids)
    assert torch.equal(got, want) and all(torch.equal(grads[k], want_grads[k]) for k in want_grads)
    model = family("olmo2", seed=42, dtype=dtype)
    model.gradient_checkpointing_enable()
    _compare(model, fusion.EAGER, dtype, seed=14, exact=False)


def test_a_layer_that_norms_before_its_add_is_not_taken_for_post_norm():
    olmo2 = transformers.models.olmo2.modeling_olmo2

    class PreAddLayer(olmo2.Olmo2DecoderLayer):
        def forward(self, hidden_states, **kwargs):  # norm(x + attn(x)): not post-norm
            attn = self.self_attn(hidden_states=hidden_states, **kwargs)[0]
            h = self.post_attention_layernorm(hidden_states + attn)
            return self.post_feedforward_layernorm(h + self.mlp(h))

    model = family("olmo2", seed=43)
    for layer in model.model.layers:
        layer.__class__ = PreAddLayer
    before = snapshot(model)
    summary = fuse(model, fusion.EAGER, dry_run=True)
    assert_untouched(model, before)
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    assert "not the post-norm layer" in left["rms_norm_add"] and "rms_norm_add" not in summary.counts
    with pytest.raises(UnsupportedModel, match="rms_norm_add cannot be fused"):
        fuse(model, ["rms_norm_add"], impl=fusion.EAGER)
    assert_untouched(model, before)


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_olmo2_fused_with_the_triton_kernels_through_the_interpreter():
    model = family("olmo2", seed=44, layers=1)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=15, exact=False)
    assert summary.counts["rms_norm_add"] == 2 and summary.notes == ()
    assert fused_modules(model)
    unfuse(model)
    assert not fused_modules(model)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "olmo2", "phi3", "glm4"])
def test_a_dry_run_changes_nothing_and_unfuse_restores_every_family(arch):
    model = softcapped(arch, seed=51) if arch.startswith("gemma") else family(arch, seed=51)
    before = snapshot(model)
    planned = fuse(model, fusion.EAGER, dry_run=True)
    assert_untouched(model, before)
    assert fuse(model, fusion.EAGER).counts == planned.counts and fused_modules(model)
    unfuse(model)
    assert not fused_modules(model)
    assert_untouched(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_granite_fuses_its_layer_with_its_residual_multiplier_read_at_each_call(dtype):
    """Granite's layer adds each sublayer's output times residual_multiplier: the fused layer
    finds that scale by probing the layer's own float attributes, and with the model's own math
    (HF_EAGER) computes bitwise what the unfused layer does, the multiplier read at each call.
    Every op fuses (the head divides by logits_scaling before its matmul: within rounding)."""
    multipliers = dict(residual_multiplier=0.22, embedding_multiplier=3.0, logits_scaling=2.5)
    model = family("granite", 31, dtype, **multipliers)
    summary = _compare(copy.deepcopy(model), fusion.HF_EAGER, dtype, 32, exact=False)
    assert summary.counts == GEMMA_COUNTS and not summary.left_unfused
    ref = copy.deepcopy(model)
    fuse(model, ["silu_mul", "add_rms_norm", "rms_norm"], impl=fusion.HF_EAGER)
    for layer, plain in zip(model.model.layers, ref.model.layers):
        assert layer.__dict__[STATE].scale == "residual_multiplier"
        layer.residual_multiplier = plain.residual_multiplier = 0.5
    ids = ids_for(33)
    labels = labels_for(ids, 34)
    want, want_grads = loss_and_grads(ref, ids, labels)
    got, grads = loss_and_grads(model, ids, labels)
    assert torch.equal(got, want) and all(torch.equal(grads[k], want_grads[k]) for k in want_grads)
    plain = family("llama", 34)
    fuse(plain, fusion.HF_EAGER)
    assert plain.model.layers[0].__dict__[STATE].scale is None  # a layer without one keeps none


# --------------------------------------------------------------------------------------------
# Decoder stacks and MLPs under other names (GPT-NeoX, Phi-1/2, Llama 4, StarCoder2, GPT-J)
# --------------------------------------------------------------------------------------------


def other_names(arch: str, seed: int, dtype=torch.float32, layers: int = 1, **overrides):
    """A tiny `arch` of head dim 16 (GPT-NeoX rotates a quarter of each head, Phi-1/2 a half: an even
    rotary width either way), its norms perturbed."""
    config = transformers.AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=32,
        n_embd=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        n_layer=layers,
        num_attention_heads=2,
        n_head=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln" in name:
                p.add_(0.4 * torch.randn_like(p))
    return model.to(dtype)


# model type -> (the places fused, what each reason left must say); one layer: layer_norm's places
# are its LayerNorms (one for Phi's parallel layer, two elsewhere) and the final norm
OTHER_NAMES = {
    # layers `layers`, final norm `final_layer_norm`, attention `attention` (a packed
    # query_key_value), partial rotary; LayerNorm and an ungated GELU MLP
    "gpt_neox": (
        {"rope": 1, "linear_cross_entropy": 1, "layer_norm": 3},
        {"silu_mul": "no gate", "add_rms_norm": "LayerNorm", "rms_norm": "LayerNorm"},
    ),
    # `final_layernorm`, one LayerNorm feeding attention and MLP in parallel, a head with a bias
    "phi": (
        {"rope": 1, "layer_norm": 2},
        {
            "silu_mul": "no gate",
            "add_rms_norm": "parallel",
            "rms_norm": "LayerNorm",
            "linear_cross_entropy": "bias-free",
        },
    ),
    # one norm feeding attention and MLP in parallel; rope over interleaved lane pairs, cast back
    "cohere": (
        {"silu_mul": 1, "rope": 1, "linear_cross_entropy": 1},
        {"add_rms_norm": "parallel", "rms_norm": "parallel"},
    ),
    "starcoder2": (
        {"rope": 1, "linear_cross_entropy": 1, "layer_norm": 3},
        {"silu_mul": "no gate", "add_rms_norm": "LayerNorm", "rms_norm": "LayerNorm"},
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("arch", list(OTHER_NAMES))
def test_stacks_under_other_names_fuse_what_the_op_set_places_and_say_why_not_the_rest(arch, dtype):
    counts, says = OTHER_NAMES[arch]
    for impl, exact in ((fusion.HF_EAGER, True), (fusion.EAGER, False)):
        model = other_names(arch, seed=61, dtype=dtype)
        summary = _compare(model, impl, dtype, seed=16, exact=exact)
        assert summary.counts == counts
        left = dict(item.split(": ", 1) for item in summary.left_unfused)
        assert set(left) == set(says)
        for op, phrase in says.items():
            assert phrase in left[op] and "\n" not in left[op], (op, left[op])


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
@pytest.mark.parametrize("arch", ["gpt_neox", "phi"])
def test_partial_rotary_on_strided_q_and_k_runs_the_rope_kernel_through_the_interpreter(arch):
    """GPT-NeoX hands rope q and k as chunks of one packed projection, Phi as slices of each head:
    the kernel takes them as the views they are."""
    model = other_names(arch, seed=62)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=17, exact=False)
    assert summary.counts["rope"] == 1 and summary.notes == ()


def llama4(seed: int, dtype=torch.float32, **overrides):
    """A tiny two-layer Llama 4 text model: dense layers (Llama4TextMLP as feed_forward) at
    `moe_layers`' complement, MoE layers (Llama4TextMoe, two experts) at `moe_layers`."""
    return other_names(
        "llama4_text",
        seed=seed,
        dtype=dtype,
        layers=2,
        head_dim=16,
        intermediate_size_mlp=48,
        num_local_experts=2,
        **overrides,
    )


# Llama 4's layouts: Maverick's (dense and MoE layers interleaved) and Scout's (every layer MoE)
LLAMA4_LAYOUTS = {
    "interleaved": dict(moe_layers=[1], interleave_moe_layer_step=2),
    "all-moe": dict(interleave_moe_layer_step=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("layout", list(LLAMA4_LAYOUTS))
def test_llama4s_moe_layers_fuse_whole_taking_the_first_of_the_moes_pair(layout, dtype):
    """An MoE layer of Llama 4 unpacks its feed_forward's (out, router_logits) and views out as
    the stream: the probe of each MLP class's first layer finds that form, and the fused layer
    does the same (LayerState.mlp_unpack); the dense layers' feed_forward fuses by its class, the
    MoE's experts stay the experts' plan's."""
    moe = LLAMA4_LAYOUTS[layout].get("moe_layers", [0, 1])
    for impl, exact in ((fusion.HF_EAGER, True), (fusion.EAGER, False)):
        model = llama4(63, dtype, **LLAMA4_LAYOUTS[layout])
        summary = _compare(model, impl, dtype, seed=18, exact=exact)
        dense = 2 - len(moe)
        assert summary.counts == {
            **({"silu_mul": dense} if dense else {}),
            "add_rms_norm": 4,
            "rms_norm": 1,
            "linear_cross_entropy": 1,
        }
        states = [layer.__dict__[STATE] for layer in model.model.layers]
        assert [s.mlp_unpack for s in states] == [i in moe for i in range(2)]
        assert all(s.withheld == {"position_ids"} for s in states)
        for i, layer in enumerate(model.model.layers):
            fused = fused_modules(layer.feed_forward)
            assert (i in moe) == (layer.feed_forward not in fused), i
        left = dict(item.split(": ", 1) for item in summary.left_unfused)
        assert "apply_rotary_pos_emb" in left["rope"] and "add_rms_norm" not in left


class _Llama4LayerHalvingItsMoe(transformers.models.llama4.modeling_llama4.Llama4TextDecoderLayer):
    """Llama 4's layer, but its MoE layers add half their feed_forward's output: neither form the
    probe knows."""

    def forward(
        self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs
    ):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
        residual = residual + hidden_states
        hidden_states = self.feed_forward(self.post_attention_layernorm(residual))
        if self.is_moe_layer:
            hidden_states = 0.5 * hidden_states[0]
        return residual + hidden_states.view(residual.shape)


def test_a_layer_whose_mlp_form_the_probe_cannot_place_leaves_the_layers_as_they_are_in_one_line():
    model = llama4(64, **LLAMA4_LAYOUTS["interleaved"])
    for layer in model.model.layers:
        layer.__class__ = _Llama4LayerHalvingItsMoe
    summary = _compare(model, fusion.EAGER, torch.float32, seed=19, exact=False)
    assert summary.counts == {"silu_mul": 1, "linear_cross_entropy": 1}
    left = dict(item.split(": ", 1) for item in summary.left_unfused)
    for op in ("add_rms_norm", "rms_norm"):
        assert left[op].startswith(
            "layer 1's feed_forward is a Llama4TextMoe, layer 0's a Llama4TextMLP: the probe of layer 0 "
            "does not cover it (layer 1 (_Llama4LayerHalvingItsMoe) is not the pre-norm layer"
        )
        assert "\n" not in left[op]


def _attention_kwargs(model) -> list[set]:
    """The names of the arguments each layer's attention is handed, recorded at each call."""
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True
        )
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("impl", ["HF_EAGER", "EAGER"])
def test_an_all_dense_llama4_fuses_its_layers_whole_and_withholds_position_ids_from_attention(impl, dtype):
    """Llama 4's layer takes position_ids and does not hand them on to attention (flash
    attention would read them for packed sequences): the probe finds that from the layer's own
    forward, and the fused layer withholds them too."""
    model = llama4(65 if dtype is BF16 else 66, dtype, moe_layers=[])
    assert {type(layer.feed_forward).__name__ for layer in model.model.layers} == {"Llama4TextMLP"}
    ref = copy.deepcopy(model)
    summary = _compare(model, getattr(fusion, impl), dtype, seed=21, exact=impl == "HF_EAGER")
    assert summary.counts == {"silu_mul": 2, "add_rms_norm": 4, "rms_norm": 1, "linear_cross_entropy": 1}
    state = model.model.layers[1].__dict__[STATE]
    assert state.withheld == {"position_ids"} and state.mlp_name == "feed_forward"
    ids = ids_for(22)
    positions = torch.arange(ids.shape[1]).flip(0).expand_as(ids)  # given, and not the default
    got, want = _attention_kwargs(model), _attention_kwargs(ref)
    model.train(), ref.train()
    torch.testing.assert_close(
        loss_and_grads(model, ids, position_ids=positions)[0],
        loss_and_grads(ref, ids, position_ids=positions)[0],
        rtol=FORWARD_TOL[dtype],
        atol=0,
    )
    assert len(got) == 2 and got == want and not any("position_ids" in names for names in got)


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
@pytest.mark.parametrize("layout", ["all-dense", "interleaved"])
def test_llama4s_layers_run_the_triton_kernels_through_the_interpreter(layout):
    model = llama4(69, **LLAMA4_LAYOUTS.get(layout, dict(moe_layers=[])))
    summary = _compare(model, fusion.FUSED, torch.float32, seed=25, exact=False)
    assert summary.counts["add_rms_norm"] == 4 and summary.notes == ()


def test_a_llama_layer_withholds_nothing_from_attention():
    model = family("llama", 67)
    fuse(model, fusion.HF_EAGER)
    assert model.model.layers[0].__dict__[STATE].withheld == frozenset()


class _Olmo2LayerWithoutPositions(transformers.models.olmo2.modeling_olmo2.Olmo2DecoderLayer):
    """OLMo 2's post-norm layer, but it hands attention no position_ids (as Llama 4's does not)."""

    def forward(
        self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs
    ):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


def test_a_post_norm_layer_that_withholds_position_ids_from_attention_is_fused_withholding_them_too():
    model = family("olmo2", 68)
    for layer in model.model.layers:
        layer.__class__ = _Olmo2LayerWithoutPositions
    ref = copy.deepcopy(model)
    summary = _compare(model, fusion.HF_EAGER, torch.float32, seed=23, exact=True)
    assert summary.counts["rms_norm_add"] == 4
    assert model.model.layers[0].__dict__[STATE].withheld == {"position_ids"}
    got, want = _attention_kwargs(model), _attention_kwargs(ref)
    ids = ids_for(24)
    with torch.no_grad():
        model(ids, position_ids=torch.arange(7)[None]), ref(ids, position_ids=torch.arange(7)[None])
    assert len(got) == 2 and got == want and not any("position_ids" in names for names in got)


def test_gptj_fuses_its_layer_norms_and_names_why_not_each_other_op():
    model = other_names("gptj", seed=64, rotary_dim=8)
    summary = _compare(model, fusion.EAGER, torch.float32, seed=19, exact=False)
    assert summary.counts == {"layer_norm": 2}
    why = " ".join(summary.left_unfused)
    for phrase in ("add_layer_norm", "parallel", "no gate", "(tensor, sin, cos)", "bias-free"):
        assert phrase in why, phrase
    without = dataclasses.replace(fusion.EAGER, layer_norm=None, name="plain")
    with pytest.raises(UnsupportedModel) as e:
        fuse(other_names("gptj", seed=64, rotary_dim=8), without)
    assert "\n" not in str(e.value) and str(e.value).startswith("GPTJForCausalLM: nothing to fuse")
    assert "layer_norm: 'plain' has no layer_norm" in str(e.value)


@pytest.mark.skipif(not _has_fused_kernels(), reason="triton or a kernel module is missing")
def test_starcoder2s_layer_norms_run_the_triton_kernel_through_the_interpreter_and_unfuse():
    model = other_names("starcoder2", seed=66)
    before = snapshot(model)
    summary = _compare(model, fusion.FUSED, torch.float32, seed=20, exact=False)
    assert summary.counts["layer_norm"] == 3 and summary.notes == ()
    norm = model.model.layers[0].input_layernorm
    assert isinstance(norm, torch.nn.LayerNorm) and fused_modules(model)
    unfuse(model)
    assert not fused_modules(model) and type(norm) is torch.nn.LayerNorm
    assert_untouched(model, before)


def test_the_stack_is_found_by_its_parts_names_and_two_final_norms_are_no_stack():
    from profuse.fusion import hf as H

    model = other_names("gpt_neox", seed=65)
    stack = model.gpt_neox
    assert H._decoder_stack(model, "m") is stack
    assert H.stack_layers(stack) is stack.layers and H.final_norm(stack) is stack.final_layer_norm
    assert H.layer_attention(stack.layers[0]) is stack.layers[0].attention
    stack.norm = torch.nn.LayerNorm(32)  # two final norms: which one runs is not for names to say
    with pytest.raises(UnsupportedModel, match="no decoder stack .*`final_layer_norm`"):
        fuse(model, fusion.EAGER, dry_run=True)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_phi3s_layer_with_dropout_on_each_sublayer_output_fuses_bitwise_in_training(dtype):
    """Phi-3's layer passes each sublayer's output through a dropout module of its own before the
    add: the probe places each (different p, so only the right order matches in training), and
    with the model's own math the fused model draws the same masks and gives the same loss and
    gradients bitwise."""
    model = family("phi3", 41, dtype, resid_pdrop=0.1)
    for layer in model.model.layers:
        layer.resid_mlp_dropout.p = 0.3
    ref = copy.deepcopy(model)
    summary = fuse(model, fusion.HF_EAGER)
    assert {"silu_mul", "add_rms_norm", "rms_norm"} <= summary.counts.keys()
    state = model.model.layers[0].__dict__[STATE]
    assert (state.attn_out, state.mlp_out) == ("resid_attn_dropout", "resid_mlp_dropout")
    ids = ids_for(42)
    model.train(), ref.train()
    torch.manual_seed(7)
    want, want_grads = loss_and_grads(ref, ids)
    torch.manual_seed(7)
    got, grads = loss_and_grads(model, ids)
    assert torch.equal(got, want) and all(torch.equal(grads[k], want_grads[k]) for k in want_grads)
    odd = family("phi3", 43)
    for layer in odd.model.layers:
        layer.resid_mlp_dropout = torch.nn.Identity()  # an extra child that is not a dropout
    assert any("an unknown layout" in why for why in fuse(odd, fusion.HF_EAGER).left_unfused)


def test_glm4s_four_norms_take_their_roles_from_the_probe_not_their_names():
    """GLM-4 names its sandwich norms input_layernorm, post_self_attn_layernorm (after attention),
    post_attention_layernorm (in front of the MLP!) and post_mlp_layernorm: the probe finds the
    one order of the 24 whose fused body is the layer's own forward."""
    model = family("glm4", 51)
    _compare(model, fusion.HF_EAGER, torch.float32, 52, exact=True)
    roles = model.model.layers[0].__dict__[STATE].roles
    assert roles == (
        "input_layernorm",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "post_mlp_layernorm",
    )
