"""The ops of the whole step in profuse.fuse: rms_norm, rope, qk_norm_rope, linear_cross_entropy.

Each op alone (the `ops=[name]` subset) and all together, on tiny Llama and Qwen3 models (Mistral
and Qwen2 where cheap), tied and untied embeddings: the loss and every gradient against the
unfused model and float64, labels with ignored tokens, num_items_in_batch, shift_labels,
return_dict=False, in fp32 and under CPU bf16 autocast. The eager ops (fusion.EAGER) run here on
any build; the Triton kernels of the new ops arrive with their modules (profuse.kernels.rope,
.rms_norm, .cross_entropy), and the tests of FUSED with them skip until then.

Tolerances: profuse.tail.FORWARD_TOL / BACKWARD_TOL, relative error in the dtype compared (8u and
16u, an fp32 floor of 1e-5). Against float64 a fused model may be at most twice as far as the
unfused one (both round the same number of ops; a fused op rounds fewer times, never more), or
the dtype's tolerance where both are below it.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from fusion_cases import (  # noqa: E402
    FP32,
    LAYERS,
    assert_untouched,
    counting_ops,
    expected_counts,
    has_kernel,
    labels_for,
    loss_and_grads,
    snapshot,
    tiny,
    tokens,
)

from profuse import crossentropy, fusion  # noqa: E402
from profuse.errors import UnsupportedModel, UsageError  # noqa: E402
from profuse.fusion import fuse, unfuse  # noqa: E402
from profuse.fusion.hf_head import LOGITS_NOT_MADE  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402

BF16 = torch.bfloat16
NEW_OPS = ("rms_norm", "rope", "qk_norm_rope", "linear_cross_entropy")


def assert_close_to(got_loss, got, want_loss, want, dtype=FP32) -> None:
    assert got.keys() == want.keys()
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[dtype], (got_loss, want_loss)
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[dtype], name


# --------------------------------------------------------------------------------------------
# Each op alone, and the subset API
# --------------------------------------------------------------------------------------------

ALONE = {
    # (arch, op) -> places
    ("llama", "silu_mul"): LAYERS,
    ("llama", "add_rms_norm"): 2 * LAYERS,
    ("llama", "rms_norm"): 2 * LAYERS + 1,  # without add_rms_norm, every norm
    ("llama", "rope"): LAYERS,
    ("llama", "linear_cross_entropy"): 1,
    ("qwen3", "rope"): LAYERS,  # q_norm and k_norm stay modules
    ("qwen3", "qk_norm_rope"): LAYERS,
    ("qwen3", "linear_cross_entropy"): 1,
}


@pytest.mark.parametrize("arch, op", list(ALONE), ids=[f"{a}-{o}" for a, o in ALONE])
def test_each_op_alone_through_the_subset(arch, op):
    model = tiny(arch, seed=101, tie=op == "linear_cross_entropy")
    ids = tokens(102)
    labels = labels_for(ids, 103)
    want_loss, want = loss_and_grads(model, ids, labels)
    calls = Counter()
    summary = fuse(model, [op], impl=counting_ops(calls))
    assert summary.counts == {op: ALONE[arch, op]} and summary.left_unfused == ()
    got_loss, got = loss_and_grads(model, ids, labels)
    assert dict(calls) == summary.counts
    assert_close_to(got_loss, got, want_loss, want)


def test_ops_take_names_a_blockops_or_an_implementation_and_refuse_anything_else():
    model = tiny("llama", seed=104)
    assert fuse(model, "rope", impl=fusion.EAGER, dry_run=True).counts == {"rope": LAYERS}
    assert fuse(model, ("rope", "silu_mul"), impl=fusion.EAGER, dry_run=True).counts == {
        "silu_mul": LAYERS,
        "rope": LAYERS,
    }
    as_ops = fuse(model, fusion.EAGER, dry_run=True)  # a BlockOps as ops: the implementation, every op
    assert as_ops == fuse(model, impl=fusion.EAGER, dry_run=True) and as_ops.counts == expected_counts(
        "llama"
    )
    before = snapshot(model)
    for bad, match in (
        (["rope", "fast"], "op names from silu_mul, add_rms_norm"),
        ([], "op names"),
        (7, "op names"),
    ):
        with pytest.raises(UsageError, match=match) as info:
            fuse(model, bad)
        assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="not both"):
        fuse(model, fusion.EAGER, impl=fusion.EAGER)
    with pytest.raises(UsageError, match="impl takes a profuse.fusion.BlockOps"):
        fuse(model, ["rope"], impl="eager")
    assert_untouched(model, before)


# --------------------------------------------------------------------------------------------
# linear_cross_entropy: Hugging Face's loss semantics, and the logits
# --------------------------------------------------------------------------------------------

HEAD_CASES = {
    "labels": lambda ids, labels: {},
    "num-items-int": lambda ids, labels: {"num_items_in_batch": 13},
    "num-items-tensor": lambda ids, labels: {"num_items_in_batch": torch.tensor(9)},
    "shift-labels": lambda ids, labels: {"shift_labels": torch.roll(labels, 2, dims=1)},
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen3", True), ("qwen2", False)])
def test_linear_cross_entropy_is_hugging_faces_loss_and_returns_no_logits_in_training(arch, tie, case):
    model = tiny(arch, tie=tie, seed=111)
    ids = tokens(112)
    labels = labels_for(ids, 113)
    kwargs = HEAD_CASES[case](ids, labels)
    want_loss, want = loss_and_grads(model, ids, labels, **kwargs)
    calls = Counter()
    fuse(model, ["linear_cross_entropy"], impl=counting_ops(calls))
    out = model(ids, labels=labels, **kwargs)
    assert out.logits is LOGITS_NOT_MADE  # never made; any use says why (tests/test_fusion_hf_training.py)
    got_loss, got = loss_and_grads(model, ids, labels, **kwargs)
    assert calls["linear_cross_entropy"] == 2
    assert_close_to(got_loss, got, want_loss, want)
    tup = model(ids, labels=labels, return_dict=False, **kwargs)
    unfuse(model)
    with torch.no_grad():
        want_tup = model(ids, labels=labels, return_dict=False, **kwargs)
    assert len(tup) == len(want_tup) - 1  # the tuple transformers makes when logits are None
    assert relative_error(tup[0], want_tup[0]) <= FORWARD_TOL[FP32]


def test_without_labels_or_gradients_the_head_is_the_models_own():
    """No labels, labels under no_grad (evaluation), logits_to_keep, generate: the logits come
    back as before, bitwise, and the fused op is not called."""
    model = tiny("llama", seed=121)
    ids = tokens(122)
    with torch.no_grad():
        want = model(ids).logits
        want_eval = model(ids, labels=ids)
        want_last = model(ids, logits_to_keep=1).logits
    calls = Counter()
    fuse(model, ["linear_cross_entropy"], impl=counting_ops(calls))
    assert torch.equal(model(ids).logits, want)  # gradients on, no labels
    with torch.no_grad():
        got_eval = model(ids, labels=ids)
        assert torch.equal(got_eval.logits, want_eval.logits) and torch.equal(got_eval.loss, want_eval.loss)
        assert torch.equal(model(ids, logits_to_keep=1).logits, want_last)
    model.eval()
    assert model.generate(ids[:, :4], max_new_tokens=3, do_sample=False).shape == (2, 7)
    assert calls["linear_cross_entropy"] == 0


def test_a_custom_loss_function_or_a_wrapped_lm_head_is_left_to_the_model():
    """A loss_function of the user's, or an lm_head replaced after fusing: the model's own forward
    runs, logits and all, and computes what the unfused model does."""
    model = tiny("mistral", seed=131)
    ids = tokens(132)
    reference = copy.deepcopy(model)
    calls = Counter()
    fuse(model, ["linear_cross_entropy"], impl=counting_ops(calls))
    custom = lambda logits, labels, vocab_size, **kwargs: logits.float().pow(2).mean()  # noqa: E731
    for m in (model, reference):
        m._loss_function = custom
    assert torch.equal(model(ids, labels=ids).loss, reference(ids, labels=ids).loss)
    for m in (model, reference):
        del m._loss_function
        m.lm_head = nn.Sequential(m.lm_head)  # a wrapper around the same Linear
    out = model(ids, labels=ids)
    assert out.logits is not None and torch.equal(out.loss, reference(ids, labels=ids).loss)
    assert calls["linear_cross_entropy"] == 0
    with pytest.raises(UnsupportedModel, match="not a plain bias-free nn.Linear"):
        fuse(reference, ["linear_cross_entropy"], impl=fusion.EAGER)


# --------------------------------------------------------------------------------------------
# rope and qk_norm_rope
# --------------------------------------------------------------------------------------------


def test_qwen3_with_its_norms_replaced_after_fusing_runs_rope_and_the_norms():
    """q_norm wrapped after fusing: qk_norm_rope no longer stands for it; the attention runs the
    norms as modules and rope alone, and computes what the unfused model does."""
    model = tiny("qwen3", seed=141)
    ids = tokens(142)
    reference = copy.deepcopy(model)
    calls = Counter()
    fuse(model, impl=counting_ops(calls))
    for m in (model, reference):
        for layer in m.model.layers:
            layer.self_attn.q_norm = nn.Sequential(layer.self_attn.q_norm)
    want_loss, want = loss_and_grads(reference, ids)
    calls.clear()
    got_loss, got = loss_and_grads(model, ids)
    assert calls["qk_norm_rope"] == 0 and calls["rope"] == LAYERS
    assert_close_to(got_loss, got, want_loss, want)


def test_rope_runs_the_models_own_for_a_call_it_does_not_cover():
    """An attention called without position_embeddings (or with extra rotary arguments) runs its
    own forward: the same answer as unfused (here, the model's own error)."""
    model = tiny("llama", seed=151)
    attn = model.model.layers[0].self_attn
    reference = copy.deepcopy(attn)
    fuse(model, ["rope"], impl=fusion.EAGER)
    x = torch.randn(2, 5, 56)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    assert torch.equal(attn(x, (cos, sin), None)[0], reference(x, (cos, sin), None)[0])  # by position
    with pytest.raises(TypeError):
        attn(x, attention_mask=None)  # no position_embeddings: the model's own error
    with pytest.raises(TypeError):
        reference(x, attention_mask=None)


# --------------------------------------------------------------------------------------------
# Against float64, in fp32 and under bf16 autocast
# --------------------------------------------------------------------------------------------


def float64_oracle(model: nn.Module) -> nn.Module:
    """The unfused model in float64 all through: Hugging Face's norms compute in fp32 and its loss
    casts the logits to fp32 whatever the model's dtype, so both are written out in float64."""
    oracle = copy.deepcopy(model).double()
    for m in oracle.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = lambda x, m=m: F.rms_norm(x.double(), (x.shape[-1],), m.weight, m.variance_epsilon)

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
        target = crossentropy.shifted_labels(labels) if shift_labels is None else shift_labels
        return F.cross_entropy(
            logits.double().reshape(-1, vocab_size), target.reshape(-1), ignore_index=ignore_index
        )

    oracle._loss_function = loss
    return oracle


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_op_fused_is_as_close_to_float64_as_the_unfused_model(arch, autocast):
    """The loss and every gradient against the float64 oracle: the fused model (every op, eager)
    within twice the unfused model's error, or the dtype's tolerance."""
    model = tiny(arch, seed=161, tie=True)
    ids = tokens(162)
    labels = labels_for(ids, 163)
    want_loss, want = loss_and_grads(float64_oracle(model), ids, labels)

    def run(m):
        with torch.autocast("cpu", BF16, enabled=autocast):
            return loss_and_grads(m, ids, labels)

    errors = {}
    for name, impl in (("unfused", None), ("fused", fusion.EAGER)):
        m = copy.deepcopy(model)
        if impl is not None:
            assert fuse(m, impl=impl).counts == expected_counts(arch)
        loss, grads = run(m)
        assert grads.keys() == want.keys()
        errors[name] = {k: relative_error(g, want[k]) for k, g in grads.items()}
        errors[name]["loss"] = relative_error(loss, want_loss)
    dtype = BF16 if autocast else FP32
    for key, err in errors["fused"].items():
        tol = FORWARD_TOL[dtype] if key == "loss" else BACKWARD_TOL[dtype]
        assert err <= max(2 * errors["unfused"][key], tol), (key, err, errors["unfused"][key])


# --------------------------------------------------------------------------------------------
# profuse's Triton kernels, once in this build
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", NEW_OPS)
def test_the_triton_kernel_of_each_new_op_in_a_model(op):
    if not has_kernel(op):
        pytest.skip(f"the Triton kernel of {op} is not in this build")
    arch = "qwen3" if op == "qk_norm_rope" else "llama"
    model = tiny(arch, seed=171, layers=2, tie=True)
    ids = tokens(172)
    labels = labels_for(ids, 173)
    want_loss, want = loss_and_grads(model, ids, labels)
    summary = fuse(model, [op])
    assert summary.counts == {op: 2 * 2 + 1 if op == "rms_norm" else 1 if op == "linear_cross_entropy" else 2}
    got_loss, got = loss_and_grads(model, ids, labels)
    assert_close_to(got_loss, got, want_loss, want)


def test_every_triton_kernel_together_with_compile_and_generate():
    missing = [op for op in NEW_OPS if not has_kernel(op)]
    if missing:
        pytest.skip(f"not in this build: {', '.join(missing)}")
    for arch in ("llama", "qwen3"):
        model = tiny(arch, seed=181, layers=2)
        ids = tokens(182)
        labels = labels_for(ids, 183)
        want_loss, want = loss_and_grads(model, ids, labels)
        prompt = ids[:, :5]
        want_tokens = model.eval().generate(prompt, max_new_tokens=4, do_sample=False)
        model.train()
        assert fuse(model).counts == expected_counts(arch, layers=2)
        got_loss, got = loss_and_grads(model, ids, labels)
        assert_close_to(got_loss, got, want_loss, want)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        c_loss, c = loss_and_grads(compiled, ids, labels)
        torch._dynamo.reset()
        assert_close_to(c_loss, {k.removeprefix("_orig_mod."): v for k, v in c.items()}, want_loss, want)
        assert torch.equal(model.eval().generate(prompt, max_new_tokens=4, do_sample=False), want_tokens)
