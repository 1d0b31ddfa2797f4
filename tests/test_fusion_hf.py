"""profuse.fuse / profuse.unfuse on tiny random Hugging Face models (Llama, Mistral, Qwen2, Qwen3).

The fused Triton ops run through the interpreter on the CPU (tests/conftest.py); blockops' eager
ops (fusion.EAGER) stand in where a test is about the plumbing. Every model is built from its
Config class with random weights (the norms' weights too: at their init, ones, a norm that
ignored its weight would pass), hidden sizes that are not powers of two, 3 layers, vocab 97.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from profuse import blockops, fusion  # noqa: E402
from profuse.errors import UnsupportedModel, UsageError  # noqa: E402
from profuse.fusion.hf import FusedFinalNorm, fuse, unfuse  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402

FP32 = torch.float32
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LAYERS = 3
VOCAB = 97


def tiny(arch: str, *, tie: bool = False, seed: int = 0, layers: int = LAYERS, **overrides) -> nn.Module:
    """A tiny {arch}ForCausalLM with random weights, norms included; odd widths (hidden 56,
    intermediate 92, 4 query heads over 2 key/value heads of 14)."""
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


def loss_and_grads(model: nn.Module, ids: torch.Tensor):
    """Hugging Face's loss on (ids, ids) and every parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def own_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in the logits' own dtype (Hugging Face's loss casts to fp32)."""
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def counting_ops(calls: Counter) -> fusion.BlockOps:
    """blockops' eager ops, counting their calls."""

    def silu_mul(*args):
        calls[fusion.SILU_MUL] += 1
        return blockops.silu_mul_eager(*args)

    def add_rms_norm(*args):
        calls[fusion.ADD_RMS_NORM] += 1
        return blockops.add_rms_norm_eager(*args)

    return fusion.BlockOps(silu_mul, add_rms_norm, "counting")


def snapshot(model: nn.Module):
    """Everything fuse could change: each module's class, object and instance attributes, the
    parameters' values."""
    modules = [(name, type(m), id(m), sorted(m.__dict__)) for name, m in model.named_modules()]
    return modules, {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before) -> None:
    modules, state = snapshot(model)
    assert modules == before[0]
    assert state.keys() == before[1].keys()
    for k in state:
        assert torch.equal(state[k], before[1][k]), k


# --------------------------------------------------------------------------------------------
# Same loss and gradients, fused and unfused; unfuse is exact
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_gives_the_same_loss_and_gradients_and_unfuse_restores_it(arch, tie):
    seed = ARCHS.index(arch) * 2 + tie
    model = tiny(arch, tie=tie, seed=seed)
    ids = tokens(seed)
    want_loss, want = loss_and_grads(model, ids)
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}

    summary = fuse(model)  # profuse's Triton kernels, through the interpreter
    assert summary.counts == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}
    assert summary.ops == fusion.FUSED.name and summary.layers == LAYERS
    # The same tensors under the same names: optimizers, state_dict and save_pretrained see no change.
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    got_loss, got = loss_and_grads(model, ids)
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[FP32]
    assert got.keys() == want.keys()
    for name in want:
        assert relative_error(got[name], want[name]) <= BACKWARD_TOL[FP32], name

    unfuse(model)
    again_loss, again = loss_and_grads(model, ids)
    assert torch.equal(again_loss, want_loss)
    for name in want:
        assert torch.equal(again[name], want[name]), name
    assert type(model.model.norm) is not FusedFinalNorm
    assert all(type(layer).__name__ == layer.__class__.__name__ for layer in model.model.layers)
    assert not any(type(m).__name__.startswith("Fused") for m in model.modules())


@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "fp32-autocast-bf16"],
)
def test_fused_with_the_models_own_math_is_bitwise_the_unfused_model(dtype, autocast):
    """HF_EAGER is the model's own eager math in the fused structure: equal bits, loss and every
    gradient, in each dtype and under autocast (bf16 branches added into an fp32 stream)."""
    model = tiny("mistral", tie=True, seed=71).to(dtype)
    ids = tokens(72)

    def run(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            return loss_and_grads(m, ids)

    want_loss, want = run(model)
    fuse(model, fusion.HF_EAGER)
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
    assert fuse(model, fusion.EAGER).counts == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}
    assert relative_error(model(ids).last_hidden_state, want) <= FORWARD_TOL[FP32]


# --------------------------------------------------------------------------------------------
# What runs where: counts, labels, the summary
# --------------------------------------------------------------------------------------------


def test_each_forward_calls_the_ops_as_many_times_as_the_summary_counts():
    model = tiny("mistral", seed=41)
    calls = Counter()
    summary = fuse(model, counting_ops(calls))
    model(tokens(42))
    assert dict(calls) == summary.counts == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}


def test_label_puts_each_op_call_in_its_profiler_range():
    model = tiny("qwen2", seed=43)
    ids = tokens(44)
    want = model(ids).logits
    summary = fuse(model, fusion.HF_EAGER, label=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = model(ids).logits
    names = Counter(e.name for e in prof.events())
    for op, places in summary.counts.items():
        assert names[fusion.BLOCK_OP_RANGES[op]] == places, (op, names)
    assert torch.equal(got, want)  # the ranges label; they change nothing
    assert summary.labelled and fusion.BLOCK_OP_RANGES["silu_mul"] in str(summary)


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
    assert f"x{LAYERS} " in text and f"x{2 * LAYERS} " in text
    assert len(llama.left_unfused) == 1 and "layer 0's input_layernorm" in llama.left_unfused[0]
    assert "no add in front" in llama.left_unfused[0] and "left unfused" in text
    qwen3 = fuse(tiny("qwen3", seed=46), fusion.EAGER)
    assert any("k_norm/q_norm" in item and f"({2 * LAYERS} in all)" in item for item in qwen3.left_unfused)
    assert "k_norm/q_norm" in str(qwen3) and "LlamaForCausalLM" in text


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
    fuse(model, counting_ops(calls))
    for switch in (model.eval, model.train, model.eval, model.train):
        switch()
        calls.clear()
        got = own_loss(model, ids)
        assert dict(calls) == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}
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


def test_greedy_generate_with_the_cache_gives_the_same_tokens():
    model = tiny("qwen3", seed=59).eval()
    prompt = tokens(60, batch=2, seq=7)
    want = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
    fuse(model)
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


REFUSED = {
    "gemma-offset-norm": (lambda: tiny("gemma", seed=61, hidden_act="silu"), r"\(1 \+ weight\)"),
    "gelu-mlp": (lambda: tiny("llama", seed=62, hidden_act="gelu"), "only a SiLU MLP"),
    "parallel-block": (lambda: _with_parallel_layers(tiny("llama", seed=63)), "not the pre-norm layer"),
    "extra-module": (lambda: _with_extra_module(tiny("llama", seed=64)), "unknown layout"),
    "instance-forward": (lambda: _with_instance_forward(tiny("llama", seed=67)), "forward of its own"),
    "no-decoder-stack": (lambda: nn.Sequential(nn.Linear(5, 7), nn.SiLU()), "no decoder stack"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_it_cannot_fuse_exactly_is_refused_and_left_untouched(case):
    make, reason = REFUSED[case]
    model = make()
    before = snapshot(model)
    with pytest.raises(UnsupportedModel, match=reason) as info:
        fuse(model)
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
    assert dict(calls) == {"silu_mul": LAYERS, "add_rms_norm": 2 * LAYERS}


def test_the_public_api_names_them():
    import profuse

    assert profuse.fuse is fuse and profuse.unfuse is unfuse and profuse.FuseSummary is fusion.FuseSummary
    assert fusion.fuse is fuse and issubclass(UnsupportedModel, UsageError)
