"""profuse.fuse / profuse.unfuse on tiny random Hugging Face models (Llama, Mistral, Qwen2, Qwen3).

The fused Triton ops run through the interpreter on the CPU (tests/conftest.py); the ops' eager
versions (fusion.EAGER) stand in where a test is about the plumbing, and where a Triton kernel is
not in this build (FUSED then leaves its op unfused, and says so). The models and helpers are in
tests/fusion_cases.py. The new ops one by one: tests/test_fusion_hf_ops.py; real training code
(swapped parameters, FSDP2, PEFT, hooks, offload, float64): tests/test_fusion_hf_robust.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from fusion_cases import (  # noqa: E402
    ARCHS,
    FP32,
    LAYERS,
    assert_untouched,
    counting_ops,
    expected_counts,
    fused_modules,
    has_kernel,
    labels_for,
    loss_and_grads,
    snapshot,
    tiny,
    tokens,
)

from profuse import fusion  # noqa: E402
from profuse.errors import UnsupportedModel, UsageError  # noqa: E402
from profuse.fusion.hf import fuse, unfuse  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402


def own_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in the logits' own dtype (Hugging Face's loss casts to fp32)."""
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def fused_counts(arch: str) -> dict[str, int]:
    """What FUSED fuses in this build: every op whose Triton kernel is here."""
    return {op: n for op, n in expected_counts(arch).items() if has_kernel(op)}


# --------------------------------------------------------------------------------------------
# Same loss and gradients, fused and unfused; unfuse is exact
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_gives_the_same_loss_and_gradients_and_unfuse_restores_it(arch, tie):
    seed = ARCHS.index(arch) * 2 + tie
    model = tiny(arch, tie=tie, seed=seed)
    ids = tokens(seed)
    labels = labels_for(ids, seed)
    want_loss, want = loss_and_grads(model, ids, labels)
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    classes = {name: type(m) for name, m in model.named_modules()}

    summary = fuse(model)  # profuse's Triton kernels, through the interpreter
    assert summary.counts == fused_counts(arch)
    assert summary.ops == fusion.FUSED.name and summary.layers == LAYERS
    # The same tensors under the same names: optimizers, state_dict and save_pretrained see no change;
    # the classes keep their names (config.architectures, _no_split_modules).
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    assert {name: type(m).__name__ for name, m in model.named_modules()} == {
        n: c.__name__ for n, c in classes.items()
    }
    got_loss, got = loss_and_grads(model, ids, labels)
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    assert got.keys() == want.keys()
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name

    unfuse(model)
    again_loss, again = loss_and_grads(model, ids, labels)
    assert torch.equal(again_loss, want_loss)
    for name in want:
        assert torch.equal(again[name], want[name]), name
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert fused_modules(model) == [] and not model.model._forward_pre_hooks


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "fp32-autocast-bf16"],
)
def test_fused_with_the_models_own_math_is_bitwise_the_unfused_model(dtype, autocast, arch):
    """HF_EAGER is the model's own eager math in the fused structure, every op (rope or
    qk_norm_rope, and linear_cross_entropy with labels): equal bits, loss and every gradient, in
    each dtype and under autocast (bf16 branches added into an fp32 stream)."""
    model = tiny(arch, tie=True, seed=71).to(dtype)
    ids = tokens(72)
    labels = labels_for(ids, 73)

    def run(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return loss_and_grads(m, ids, labels)

    want_loss, want = run(model)
    assert fuse(model, fusion.HF_EAGER).counts == expected_counts(arch)
    got_loss, got = run(model)
    assert torch.equal(got_loss, want_loss)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_is_as_close_to_float64_as_eager(arch):
    """Against the same model in float64 (its norms in float64 too: Hugging Face's compute in
    fp32), the fused fp32 model's loss and logits' gradients are as close as the unfused one's."""
    model = tiny(arch, seed=11)
    ids = tokens(12)
    reference = copy.deepcopy(model).double()
    fuse(reference, fusion.EAGER)
    first = reference.model.layers[0].input_layernorm  # the one plain norm: made float64 as well
    first.forward = lambda x, n=first: F.rms_norm(x, (x.shape[-1],), n.weight, n.variance_epsilon)
    want = own_loss(reference, ids)
    errors = {}
    for name, ops in (("eager", None), ("fused", fusion.FUSED)):
        m = copy.deepcopy(model)
        if ops is not None:
            fuse(m, ops)
        errors[name] = relative_error(own_loss(m, ids), want)
    # fp32 rounding alone: both ~1e-7; the fused within twice eager's error or the fp32 floor.
    assert errors["eager"] <= FORWARD_TOL[FP32]
    assert errors["fused"] <= max(2 * errors["eager"], FORWARD_TOL[FP32]), errors


def test_bf16_model_fused_is_as_close_to_float64_as_eager():
    """In bf16 the fused norm rounds once where Hugging Face's rounds twice: the fused logits are
    no further from float64 than the unfused ones (twice, or bf16's forward tolerance)."""
    model = tiny("llama", seed=21).to(torch.bfloat16)
    ids = tokens(22)
    reference = copy.deepcopy(model).double()
    fuse(reference, fusion.EAGER)
    first = reference.model.layers[0].input_layernorm
    first.forward = lambda x, n=first: F.rms_norm(x, (x.shape[-1],), n.weight, n.variance_epsilon)
    want = reference(ids).logits
    errors = {}
    for name, ops in (("eager", None), ("fused", fusion.FUSED)):
        m = copy.deepcopy(model)
        if ops is not None:
            fuse(m, ops)
        errors[name] = relative_error(m(ids).logits, want)
    # both ~0.007 here (bf16's u = 0.004, over 3 layers); the fused within twice eager's error
    assert 0 < errors["fused"] <= 2 * errors["eager"], errors


def test_base_model_fuses_too():
    """A LlamaModel (no LM head): the same last hidden state."""
    config = tiny("llama").config
    torch.manual_seed(31)
    model = transformers.LlamaModel(config)
    ids = tokens(32)
    want = model(ids).last_hidden_state
    assert fuse(model, fusion.EAGER).counts == expected_counts("llama", head=False)
    assert relative_error(model(ids).last_hidden_state, want) <= FORWARD_TOL[FP32]


# --------------------------------------------------------------------------------------------
# What runs where: counts, labels, the summary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_each_forward_calls_the_ops_as_many_times_as_the_summary_counts(arch):
    """Llama-like: silu_mul L, add_rms_norm 2L, rope L, rms_norm 1, linear_cross_entropy 1 (with
    labels, in training); Qwen3 the same with qk_norm_rope L in place of rope."""
    model = tiny(arch, seed=41)
    calls = Counter()
    summary = fuse(model, counting_ops(calls))
    ids = tokens(42)
    model(ids, labels=ids)
    assert dict(calls) == summary.counts == expected_counts(arch)
    calls.clear()
    with torch.no_grad():  # no gradient wanted: the head is the model's own
        model(ids, labels=ids)
    assert dict(calls) == {op: n for op, n in summary.counts.items() if op != "linear_cross_entropy"}


def test_label_puts_each_op_call_in_its_profiler_range():
    model = tiny("qwen2", seed=43)
    ids = tokens(44)
    want = model(ids, labels=ids).loss
    summary = fuse(model, fusion.HF_EAGER, label=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = model(ids, labels=ids).loss
    names = Counter(e.name for e in prof.events())
    assert summary.counts == expected_counts("qwen2")
    for op, places in summary.counts.items():
        assert names[fusion.BLOCK_OP_RANGES[op]] == places, (op, names)
    assert torch.equal(got, want)  # the ranges label; they change nothing
    assert summary.labelled and fusion.BLOCK_OP_RANGES["rope"] in str(summary)


def test_dry_run_says_what_fuse_would_do_and_changes_nothing():
    model = tiny("qwen2", seed=47)
    before = snapshot(model)
    planned = fuse(model, fusion.EAGER, label=True, dry_run=True)
    assert_untouched(model, before)
    assert fuse(model, fusion.EAGER, label=True) == planned
    with pytest.raises(UnsupportedModel, match="already fused"):
        fuse(model, dry_run=True)


def test_summary_says_what_was_left_unfused_and_why():
    llama = fuse(tiny("llama", seed=45), fusion.EAGER)
    text = str(llama)
    assert llama.left_unfused == () and "left unfused" not in text and "LlamaForCausalLM" in text
    for op, n in expected_counts("llama").items():
        assert f"{op} " in text and f"x{n} " in text
    assert "no logits (logits='always')" in text  # what linear_cross_entropy changes, said
    # An implementation without an op: that op is left unfused, with the reason; the rest fuse.
    pair = fusion.BlockOps(fusion.EAGER.silu_mul, fusion.EAGER.add_rms_norm, "the pair")
    qwen3 = fuse(tiny("qwen3", seed=46), pair)
    assert qwen3.counts == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}
    assert "rms_norm: 'the pair' has no rms_norm" in qwen3.left_unfused
    assert "qk_norm_rope: 'the pair' has no qk_norm_rope" in qwen3.left_unfused
    # Qwen3's rope place is qk_norm_rope's: an implementation without rope leaves nothing unfused there
    without_rope = fuse(tiny("qwen3", seed=46), dataclasses.replace(fusion.EAGER, rope=None))
    assert without_rope.left_unfused == () and without_rope.counts == expected_counts("qwen3")
    assert "left unfused: linear_cross_entropy: 'the pair' has no linear_cross_entropy" in str(qwen3)


# --------------------------------------------------------------------------------------------
# Hazards: checkpointing, hub kernels and train/eval, hidden states, compile, generate
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("enable", ["before-fuse", "after-fuse"])
def test_gradient_checkpointing_stays_on_with_the_same_gradients(reentrant, enable):
    model = tiny("llama", seed=51)
    ids = tokens(52)
    want_loss, want = loss_and_grads(model, ids)
    model.train()

    def enable_checkpointing():
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    if enable == "before-fuse":
        enable_checkpointing()
    fuse(model)
    if enable == "after-fuse":
        enable_checkpointing()
    checkpoints = []
    for layer in model.model.layers:
        run = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, run=run, **k: checkpoints.append(1) or run(*a, **k)
    got_loss, got = loss_and_grads(model, ids)
    assert len(checkpoints) == LAYERS  # every layer checkpointed, once
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name


def test_fusion_survives_train_eval_switches_and_hub_kernels():
    """transformers re-kernelizes on every train/eval switch once hub kernels are on, rebinding
    the norms' forwards: the fused path must still run, every op, with the same loss."""
    from transformers.utils import is_kernels_available

    model = tiny("llama", seed=53)
    ids = tokens(54)
    if is_kernels_available():
        model.set_use_kernels(True)  # offline on the CPU: every layer falls back to its own forward
        assert model.use_kernels
    want = own_loss(model, ids).detach()
    calls = Counter()
    summary = fuse(model, counting_ops(calls))
    for switch in (model.eval, model.train, model.eval, model.train):
        switch()
        calls.clear()
        got = own_loss(model, ids)
        assert dict(calls) == {op: n for op, n in summary.counts.items() if op != "linear_cross_entropy"}
        assert relative_error(got, want) <= FORWARD_TOL[FP32]
    unfuse(model)
    model.eval()
    assert torch.equal(own_loss(model, ids), want)


def test_output_hidden_states_is_refused_while_fused():
    model = tiny("llama", seed=55)
    ids = tokens(56)
    fuse(model, fusion.EAGER)
    with pytest.raises(UsageError, match="output_hidden_states"):
        model(ids, output_hidden_states=True)
    model.config.output_hidden_states = True
    with pytest.raises(UsageError, match="output_hidden_states"):
        model(ids)
    unfuse(model)
    assert len(model(ids).hidden_states) == LAYERS + 1


def test_compile_fullgraph_without_a_break_calls_the_fused_ops():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: dict[str, set] = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind] |= {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compiler

    model = tiny("llama", seed=57, layers=2)
    ids = tokens(58)
    fuse(model)
    want_loss, want = loss_and_grads(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        backend=aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward")),
        fullgraph=True,
    )
    got_loss, got = loss_and_grads(compiled, ids)
    got = {name.removeprefix("_orig_mod."): grad for name, grad in got.items()}
    torch._dynamo.reset()
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name
    for op in ("silu_mul_fwd", "add_rms_norm_fwd"):
        assert any(f"profuse.{op}" in t for t in seen["forward"]), (op, seen["forward"])
    for op in ("silu_mul_bwd", "add_rms_norm_bwd"):
        assert any(f"profuse.{op}" in t for t in seen["backward"]), (op, seen["backward"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compile_fullgraph_without_a_break_with_every_op(arch):
    """The rebuilt attention and head forwards, the rotary carrier and the call-time checks all
    trace into one graph: with labels (linear_cross_entropy) and without (the model's own head)."""
    model = tiny(arch, seed=57, layers=2)
    ids = tokens(58)
    labels = labels_for(ids, 59)
    calls = Counter()
    fuse(model, counting_ops(calls))
    want_loss, want = loss_and_grads(model, ids, labels)
    want_logits = model(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    calls.clear()
    got_loss, got = loss_and_grads(compiled, ids, labels)
    assert dict(calls) == expected_counts(arch, layers=2)  # traced through every op once
    got = {name.removeprefix("_orig_mod."): grad for name, grad in got.items()}
    assert torch.equal(compiled(ids).logits, want_logits)
    torch._dynamo.reset()
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name


@pytest.mark.parametrize("ops", ["fused", "eager"])
def test_greedy_generate_with_the_cache_gives_the_same_tokens(ops):
    model = tiny("qwen3", seed=59).eval()
    prompt = tokens(60, batch=2, seq=7)
    want = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    fuse(model, fusion.FUSED if ops == "fused" else fusion.EAGER)
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    assert got.shape == (2, 7 + 8)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# Refusals: one line, the model untouched
# --------------------------------------------------------------------------------------------


def _parallel_layer_class():
    class ParallelDecoderLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
        """The same modules wired as a parallel block: x + attn(norm(x)) + mlp(norm(x))."""

        def forward(self, hidden_states, **kwargs):
            y = self.input_layernorm(hidden_states)
            return hidden_states + self.self_attn(hidden_states=y, **kwargs)[0] + self.mlp(y)

    return ParallelDecoderLayer


def _with_parallel_layers(model):
    cls = _parallel_layer_class()
    for layer in model.model.layers:
        layer.__class__ = cls
    return model


def _with_extra_module(model):
    model.model.layers[1].dropout = nn.Dropout(0.1)
    return model


def _with_instance_forward(model):
    layer = model.model.layers[2]  # as accelerate's hooks wrap a module's forward
    layer.forward = functools.partial(type(layer).forward, layer)
    return model


# A layer not fused whole leaves its norms; its MLP still fuses by its own class (hf_mlp)
_NORM_OPS = ("add_rms_norm", "rms_norm")
# case -> (model, the ops left unfused, the reason)
PARTLY = {
    "relu-mlp": (lambda: tiny("llama", seed=62, hidden_act="relu"), ("silu_mul",), "with act SiLU or GELU"),
    "parallel-block": (
        lambda: _with_parallel_layers(tiny("llama", seed=63)),
        _NORM_OPS,
        "not the pre-norm layer",
    ),
    "extra-module": (lambda: _with_extra_module(tiny("llama", seed=64)), _NORM_OPS, "unknown layout"),
    "instance-forward": (
        lambda: _with_instance_forward(tiny("llama", seed=67)),
        _NORM_OPS,
        "forward of its own",
    ),
}


@pytest.mark.parametrize("case", list(PARTLY))
def test_a_place_it_cannot_fuse_exactly_is_left_unfused_with_its_reason(case):
    """The other ops still fuse, and the model computes what it did; asked for by name, the op is
    refused in one line and the model left untouched."""
    make, left, reason = PARTLY[case]
    model = make()
    ids = tokens(68)
    before = snapshot(model)
    for op in left:
        with pytest.raises(UnsupportedModel, match=reason) as info:
            fuse(model, [op], impl=fusion.EAGER)
        assert isinstance(info.value, ValueError) and "\n" not in str(info.value) and op in str(info.value)
        assert_untouched(model, before)
    want_loss, want = loss_and_grads(model, ids)
    calls = Counter()
    summary = fuse(model, counting_ops(calls))
    assert sorted(item.split(":")[0] for item in summary.left_unfused) == sorted(left)
    assert all(re_search(reason, item) for item in summary.left_unfused)
    assert set(summary.counts).isdisjoint(left) and summary.counts
    got_loss, got = loss_and_grads(model, ids)
    assert dict(calls) == summary.counts
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    assert got.keys() == want.keys()
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


REFUSED = {
    "no-decoder-stack": (lambda: nn.Sequential(nn.Linear(5, 7), nn.SiLU()), None, "no decoder stack"),
    "nothing-to-fuse": (
        lambda: _with_parallel_layers(tiny("llama", seed=63)),
        fusion.BlockOps(None, fusion.EAGER.add_rms_norm, "the norm"),  # the MLP alone would fuse
        "nothing to fuse .*not the pre-norm layer",
    ),
    "named-op-without-a-place": (
        lambda: tiny("llama", seed=69),
        ["qk_norm_rope"],
        "no per-head q_norm and k_norm",
    ),
    "head-on-a-base-model": (
        lambda: transformers.LlamaModel(tiny("llama").config),
        ["linear_cross_entropy"],
        "no causal-LM head",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_it_cannot_fuse_is_refused_and_left_untouched(case):
    make, ops, reason = REFUSED[case]
    model = make()
    before = snapshot(model)
    with pytest.raises(UnsupportedModel, match=reason) as info:
        fuse(model, ops, impl=None if isinstance(ops, fusion.BlockOps) else fusion.EAGER)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert_untouched(model, before)


def test_double_fuse_is_refused_and_unfuse_needs_a_fused_model():
    model = tiny("llama", seed=65)
    with pytest.raises(UnsupportedModel, match="not fused"):
        unfuse(model)
    calls = Counter()
    fuse(model, counting_ops(calls))
    before = snapshot(model)
    with pytest.raises(UnsupportedModel, match="already fused"):
        fuse(model)
    assert_untouched(model, before)
    model(tokens(66))  # fused once, not twice
    assert dict(calls) == {
        op: n for op, n in expected_counts("llama").items() if op != "linear_cross_entropy"
    }


def test_a_fused_model_refuses_double_backward_in_one_line():
    """A gradient penalty through the fused model: the Triton ops' gradients have no second term,
    so create_graph=True is refused ("profuse: ..."), never answered without it."""
    model = tiny("llama", seed=73, layers=2)
    ids = tokens(74)
    fuse(model)
    loss = model(ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="^profuse: .*double backward") as info:
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True, allow_unused=True)
        sum(g.pow(2).sum() for g in grads if g is not None).backward()
    assert "\n" not in str(info.value).strip()


def test_the_public_api_names_them():
    import profuse

    assert profuse.fuse is fuse and profuse.unfuse is unfuse and profuse.FuseSummary is fusion.FuseSummary
    assert fusion.fuse is fuse and issubclass(UnsupportedModel, UsageError)
