"""profuse.fuse under the code people train with, one piece at a time: the fused classes' forward
signatures (what Trainer, generate and PEFT read), the logits policy, probes in training mode,
and the models and calls refused in one line. Trainer, SFTTrainer and generate end to end:
tests/test_fusion_hf_e2e.py.

Where a test compares tokens or bits, the fused model runs HF_EAGER (the model's own eager math
in the fused structure, bitwise the unfused model), so what it checks is the plumbing: which
arguments arrive, which mask is built, what is returned.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_cases import (  # noqa: E402
    ARCHS,
    FP32,
    VOCAB,
    assert_untouched,
    fused_modules,
    labels_for,
    loss_and_grads,
    snapshot,
    tiny,
    tokens,
)

from profuse import fusion  # noqa: E402
from profuse.errors import UnsupportedModel, UsageError  # noqa: E402
from profuse.fusion import fuse, unfuse  # noqa: E402
from profuse.fusion.hf_head import LOGITS_NOT_MADE  # noqa: E402
from profuse.fusion.hf_modules import ORIGINAL  # noqa: E402
from profuse.tail import FORWARD_TOL, relative_error  # noqa: E402

# --------------------------------------------------------------------------------------------
# Point 1: every fused class's forward has its original's signature, and binds as it does
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [*ARCHS, "gemma"])
def test_every_fused_class_keeps_its_originals_forward_signature(arch):
    model = tiny(arch, seed=201, layers=2)
    fuse(model, fusion.EAGER)
    fused = {type(m) for m in fused_modules(model)}
    # the layers, the final norm, the attentions, the head and the stack (causal mask)
    assert len(fused) == 5
    for cls in fused:
        original = getattr(cls, ORIGINAL)
        assert inspect.signature(cls.forward) == inspect.signature(original.forward), cls
        assert cls.forward.__name__ == "forward" and cls.forward.__doc__ == original.forward.__doc__
    for m in fused_modules(model):  # bound, as Trainer and generate read them
        assert inspect.signature(m.forward) == inspect.signature(
            getattr(type(m), ORIGINAL).forward.__get__(m)
        )
    # what Trainer derives from it: the dataset columns it keeps and the label names
    from transformers.utils.generic import find_labels

    assert find_labels(type(model)) == ["labels"]
    params = inspect.signature(model.forward).parameters
    assert {"input_ids", "attention_mask", "position_ids", "labels", "logits_to_keep"} <= set(params)


def test_positional_arguments_bind_as_in_the_original():
    """input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels given by
    position reach the fused head, the stack and the layers where the original takes them."""
    model = tiny("llama", seed=202, layers=2)
    ids = tokens(203)
    labels = labels_for(ids, 204)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    want_loss, want = loss_and_grads(model, ids, labels, attention_mask=mask, position_ids=positions)
    fuse(model, fusion.HF_EAGER)
    model.zero_grad(set_to_none=True)
    out = model(ids, mask, positions, None, None, labels)
    assert out.logits is LOGITS_NOT_MADE  # labels by position: the fused head ran
    out.loss.backward()
    assert torch.equal(out.loss.detach(), want_loss)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want[name]), name


def _padded_prompts(seed: int, pad: int):
    ids = tokens(seed, batch=3, seq=6)
    ids[ids == pad] = pad + 1
    ids[0, :2] = pad  # left padding, as generate wants
    ids[2, :4] = pad
    return ids


def test_generate_on_a_padded_batch_infers_the_mask_as_unfused():
    """Without attention_mask, generate infers it (and the positions) from pad_token_id only
    when forward's signature names it: the fused model gives the unfused tokens, and its prefill
    makes the last position's logits only (logits_to_keep reaches it), (B, 1, V)."""
    pad = 0
    model = tiny("qwen3", seed=205, layers=2, pad_token_id=pad).eval()
    ids = _padded_prompts(206, pad)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=pad)
    want = model.generate(ids, **kwargs)
    with_mask = model.generate(ids, attention_mask=(ids != pad).long(), **kwargs)
    fuse(model, fusion.HF_EAGER)
    shapes = []
    model.register_forward_hook(
        lambda m, a, kw, out: shapes.append(tuple(out.logits.shape)), with_kwargs=True
    )
    got = model.generate(ids, **kwargs)
    assert torch.equal(got, want) and torch.equal(got, with_mask)
    assert shapes[0] == (3, 1, VOCAB) and len(shapes) == 4  # prefill, then one token a step
    assert torch.equal(model.generate(ids, attention_mask=(ids != pad).long(), **kwargs), with_mask)


# --------------------------------------------------------------------------------------------
# Point 2 (issue points 4, 5): the logits policy
# --------------------------------------------------------------------------------------------


def test_logits_are_made_in_eval_mode_and_under_no_grad_and_skipped_only_in_training():
    model = tiny("llama", seed=211, layers=2)
    ids = tokens(212)
    labels = labels_for(ids, 213)
    reference = copy.deepcopy(model)
    fuse(model, fusion.HF_EAGER)
    for training, grad in ((False, True), (True, False), (False, False)):
        for m in (model, reference):
            m.train(training)
        with torch.set_grad_enabled(grad):
            got, want = model(ids, labels=labels), reference(ids, labels=labels)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss), (training, grad)
    model.train()
    out = model(ids, labels=labels)
    assert out.logits is LOGITS_NOT_MADE and relative_error(out.loss, want.loss) <= FORWARD_TOL[FP32]
    assert repr(out.logits).startswith("<logits not made")
    uses = [
        lambda x: x[:, -1],
        lambda x: x.shape,
        lambda x: torch.argmax(x, -1),
        lambda x: x.float(),
        lambda x: len(x),
        lambda x: bool(x),
    ]
    for use in uses:
        with pytest.raises(UsageError, match="logits='always'") as info:
            use(out.logits)
        assert "\n" not in str(info.value)
    assert out.to_tuple()[0] is out.loss and copy.copy(out).logits is LOGITS_NOT_MADE
    assert not hasattr(out.logits, "dtype")  # what accelerate's output casts ask
    from accelerate.utils import convert_to_fp32

    assert convert_to_fp32(out).logits is LOGITS_NOT_MADE


def test_logits_always_makes_them_in_every_forward():
    model = tiny("qwen3", seed=214, layers=2)
    ids = tokens(215)
    labels = labels_for(ids, 216)
    want = model(ids, labels=labels)
    summary = fuse(model, fusion.HF_EAGER, logits="always")
    assert "linear_cross_entropy" not in summary.counts
    assert any(item.startswith("linear_cross_entropy: logits='always'") for item in summary.left_unfused)
    got = model(ids, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    unfuse(model)
    with pytest.raises(UsageError, match="logits takes 'auto' or 'always'"):
        fuse(model, logits="never")
    with pytest.raises(UsageError, match="never makes the logits"):
        fuse(model, ["linear_cross_entropy"], impl=fusion.EAGER, logits="always")
    assert fused_modules(model) == []


def test_all_ignored_labels_give_hugging_faces_nan_and_zero_gradients():
    """A batch whose labels are all -100: NaN without num_items_in_batch, as Hugging Face's
    eager loss gives (0 / 0), and 0 with it; no gradient either way, fused as unfused."""
    model = tiny("llama", seed=217, layers=1)
    ids = tokens(218)
    labels = torch.full_like(ids, -100)
    reference = copy.deepcopy(model)
    fuse(model)  # linear_cross_entropy's Triton kernel, through the interpreter
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(5)}):
        want_loss, want = loss_and_grads(reference, ids, labels, **kwargs)
        got_loss, got = loss_and_grads(model, ids, labels, **kwargs)
        assert torch.equal(got_loss.isnan(), want_loss.isnan()) and want_loss.isnan() == (not kwargs)
        assert kwargs == {} or got_loss == want_loss == 0
        assert all(not g.any() for g in got.values()) and all(not g.any() for g in want.values())


# --------------------------------------------------------------------------------------------
# Point 3 (issue points 6, 7): training mode in the probes; refusals in one line
# --------------------------------------------------------------------------------------------


def _seed_oss(dropout: float, seed: int):
    config = transformers.SeedOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        residual_dropout=dropout,
        attention_dropout=dropout,
    )
    torch.manual_seed(seed)
    return transformers.SeedOssForCausalLM(config)


def test_dropout_in_an_mlp_leaves_silu_mul_unfused_and_dropout_in_attention_is_kept():
    """Seed-OSS applies dropout inside its MLP's forward (silu_mul's place would skip it) and
    inside its attention's (the rebuilt forward keeps it). In training, from the same seed, the
    fused model draws the same masks and computes the same loss and gradients."""
    model = _seed_oss(0.3, seed=221)
    ids = tokens(222)
    labels = labels_for(ids, 223)
    torch.manual_seed(7)
    want_loss, want = loss_and_grads(model, ids, labels)
    summary = fuse(model, fusion.HF_EAGER)
    assert "silu_mul" not in summary.counts and summary.counts["rope"] == 2
    assert [item.split(":")[0] for item in summary.left_unfused] == ["silu_mul"]
    assert "only in eval mode" in summary.left_unfused[0] and "dropout" in summary.left_unfused[0]
    torch.manual_seed(7)
    got_loss, got = loss_and_grads(model, ids, labels)
    assert torch.equal(got_loss, want_loss)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # no dropout: the MLP is the plain SiLU one, and fuses
    assert "silu_mul" in fuse(_seed_oss(0.0, seed=224), fusion.EAGER, dry_run=True).counts


def _qwen3_next():
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    return transformers.Qwen3NextForCausalLM(config)


def test_a_model_whose_layers_it_cannot_read_is_refused_in_one_line():
    model = _qwen3_next()
    before = snapshot(model)
    with pytest.raises(UnsupportedModel, match="has no attention") as info:
        fuse(model)
    assert "\n" not in str(info.value) and "Qwen3NextForCausalLM" in str(info.value)
    assert_untouched(model, before)


def test_torch_save_of_a_fused_model_says_why_in_one_line(tmp_path):
    model = tiny("llama", seed=225, layers=1)
    fuse(model, fusion.EAGER)
    with pytest.raises(UsageError, match="does not pickle.*state_dict") as info:
        torch.save(model, tmp_path / "model.pt")
    assert "\n" not in str(info.value)
    torch.save(model.state_dict(), tmp_path / "state.pt")  # the state_dict saves
    unfuse(model)
    torch.save(model, tmp_path / "model.pt")  # and the model, once unfused


# --------------------------------------------------------------------------------------------
# Issue point 8: a CPU model fused without Triton's interpreter
# --------------------------------------------------------------------------------------------


def test_a_cpu_model_fused_without_the_interpreter_runs_the_fused_structure_in_plain_torch(monkeypatch):
    """Without TRITON_INTERPRET=1 the Triton kernels cannot take CPU tensors: fuse keeps the
    structure, each op runs the model's own eager math (bitwise the unfused model), and the
    summary says so. A GPU would run the kernels."""
    model = tiny("qwen3", seed=231, layers=2)
    ids = tokens(232)
    labels = labels_for(ids, 233)
    want_loss, want = loss_and_grads(model, ids, labels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    summary = fuse(model)
    assert summary.ops == fusion.FUSED.name and summary.counts
    assert len(summary.notes) == 1 and "TRITON_INTERPRET=1 is not set" in summary.notes[0]
    assert "note: the model is on the CPU" in str(summary)
    got_loss, got = loss_and_grads(model, ids, labels)
    assert torch.equal(got_loss, want_loss)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fuse(tiny("llama", seed=234, layers=1), dry_run=True).notes == ()
