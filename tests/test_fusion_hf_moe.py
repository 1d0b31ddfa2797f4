"""profuse.fuse on tiny mixture-of-experts models: Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GraniteMoE,
GraniteMoeShared, gpt-oss (transformers 5.x, experts as 3-D weights behind
use_experts_implementation).

Each model: hidden 32, 2 layers, 4 experts top-2, vocab 64, random weights (norms and routers
too), labels with ignored tokens, output_router_logits on, so the loss is the language-model loss
plus router_aux_loss_coef times the router's load-balancing loss. Fused with profuse's Triton
kernels (the interpreter, on the CPU) against an unfused copy: the same experts chosen (each
router's top-k indices), the same loss and aux loss, every gradient; unfuse is exact.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from collections import Counter

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")  # transformers >= 5: experts as 3-D weights

from fusion_cases import counting_ops, fused_modules, has_kernel  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.fusion.hf import fuse, unfuse  # noqa: E402
from profuse.fusion.hf_experts import PROBED_IMPLEMENTATIONS  # noqa: E402
from profuse.fusion.hf_modules import STATE  # noqa: E402
from profuse.tail import relative_error  # noqa: E402

VOCAB, HIDDEN, EXPERTS, TOP_K = 64, 32, 4, 2
# fp32: the fused ops round differently from eager (fp32 inside, one rounding): a few fp32 ulps
# grown over two layers and the loss's sum, well under 1e-4 relative. bf16: both are compared with
# the same model in float64, and the fused step must be as close to it as eager's, within twice
# eager's error or bf16's floor (a few ulps of 2^-8 = 3.9e-3 over two layers): a gradient summed
# over the batch's tokens (a q/k bias) can cancel to a fraction of its terms, and then eager bf16
# itself is 0.1-0.3 away from float64, so fused against eager directly would test nothing.
FP32_TOL = 1e-4
BF16_FLOOR = 2e-2

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=TOP_K,
    output_router_logits=True,
    router_aux_loss_coef=0.37,  # not the default: the coefficient must be the model's own
    tie_word_embeddings=False,
)


def _configs():
    T = transformers
    return {
        "qwen3_moe": (
            T.Qwen3MoeConfig,
            T.Qwen3MoeForCausalLM,
            dict(
                head_dim=8,
                intermediate_size=40,
                moe_intermediate_size=24,
                num_experts=EXPERTS,
                norm_topk_prob=True,
            ),
        ),
        "mixtral": (
            T.MixtralConfig,
            T.MixtralForCausalLM,
            dict(head_dim=8, intermediate_size=24, num_local_experts=EXPERTS),
        ),
        "qwen2_moe": (
            T.Qwen2MoeConfig,
            T.Qwen2MoeForCausalLM,
            dict(
                intermediate_size=40,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=36,
                num_experts=EXPERTS,
            ),
        ),
        "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(intermediate_size=24, num_experts=EXPERTS)),
        "granitemoe": (
            T.GraniteMoeConfig,
            T.GraniteMoeForCausalLM,
            dict(
                intermediate_size=24,
                num_local_experts=EXPERTS,
                embedding_multiplier=2.5,
                residual_multiplier=0.6,
                logits_scaling=1.7,
                attention_multiplier=0.3,
            ),
        ),
        # GraniteMoE's multipliers (embeddings, residual branches, attention scores, logits divided)
        # and a packed shared MLP beside the experts (input_linear -> activation -> output_linear)
        "granitemoeshared": (
            T.GraniteMoeSharedConfig,
            T.GraniteMoeSharedForCausalLM,
            dict(
                intermediate_size=24,
                shared_intermediate_size=20,
                num_local_experts=EXPERTS,
                embedding_multiplier=2.5,
                residual_multiplier=0.6,
                logits_scaling=1.7,
                attention_multiplier=0.3,
            ),
        ),
        "gpt_oss": (
            T.GptOssConfig,
            T.GptOssForCausalLM,
            dict(
                head_dim=8,
                intermediate_size=24,
                num_local_experts=EXPERTS,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
    }


FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss"]


def tiny_moe(family: str, seed: int = 0, dtype=torch.float32, **overrides) -> nn.Module:
    config_cls, model_cls, extra = _configs()[family]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "router" in name or name.endswith("mlp.gate.weight") or "bias" in name or "sinks" in name:
                p.copy_(0.5 * torch.randn_like(p))  # routers spread: top-k far from ties
    return model.to(dtype)


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=gen) < 0.3] = -100
    labels[:, 0] = ids[:, 0]
    return ids, labels


def routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def run(model: nn.Module, ids, labels, **kwargs):
    """(loss, aux loss, gradients by name, each router's top-k indices) of one training step."""
    chosen = []
    hooks = [
        r.register_forward_hook(lambda m, a, out: chosen.append(out[2].detach())) for r in routers(model)
    ]
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), out.aux_loss.detach().float(), grads, chosen


def assert_same_step(got, want, reference=None):
    """fp32: got within FP32_TOL of want. With a float64 reference (bf16): got as close to it as
    want, within twice want's error or BF16_FLOOR. The routing equal either way."""
    assert len(got[3]) == len(want[3]) > 0
    for a, b in zip(got[3], want[3]):  # the same experts chosen, token by token
        assert torch.equal(a, b)
    assert got[2].keys() == want[2].keys()
    pairs = [("loss", got[0], want[0]), ("aux loss", got[1], want[1])]
    pairs += [(n, got[2][n], want[2][n]) for n in want[2]]
    ref = None if reference is None else {"loss": reference[0], "aux loss": reference[1], **reference[2]}
    bad = {}
    for name, a, b in pairs:
        if ref is None:
            error, bound = relative_error(a, b), FP32_TOL
        else:
            error, bound = relative_error(a, ref[name]), max(2 * relative_error(b, ref[name]), BF16_FLOOR)
        if not error <= bound:
            bad[name] = (error, bound)
    assert not bad, bad


def gate_places(family: str) -> dict[str, int]:
    """The experts' gate places over 2 layers, by op: silu_mul in each experts module and
    Qwen2-MoE's and GraniteMoeShared's shared experts (dense and packed SiLU MLPs);
    clamped_swiglu in gpt-oss's experts."""
    if family == "gpt_oss":
        return {fusion.CLAMPED_SWIGLU: 2}
    return {fusion.SILU_MUL: 4 if family in ("qwen2_moe", "granitemoeshared") else 2}


# --------------------------------------------------------------------------------------------
# Every family: the experts' activation and the head fused, the same step as unfused
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_model_fused_gives_the_same_routing_loss_aux_loss_and_gradients(family, dtype):
    if not (has_kernel(fusion.SILU_MUL) and has_kernel(fusion.LINEAR_CROSS_ENTROPY)):
        pytest.skip("the Triton kernels are not in this build")
    if family == "gpt_oss" and importlib.util.find_spec("profuse.kernels.gated") is None:
        pytest.skip("clamped_swiglu's kernel is not in this build")
    seed = FAMILIES.index(family)
    model = tiny_moe(family, seed, dtype)
    ids, labels = batch(seed)
    want = run(model, ids, labels)
    reference = None
    if dtype == torch.bfloat16:  # grouped_mm takes no float64 on the CPU: batched_mm, the same math
        double = copy.deepcopy(model).double()
        double.set_experts_implementation("batched_mm")
        reference = run(double, ids, labels)
    original = {name: type(m) for name, m in model.named_modules()}

    # Every op placed, the MoE places (the experts' gate, the head) with the Triton kernels and
    # the norms and RoPE with their eager versions: those kernels have their own tests, and the
    # interpreter's time goes with each kernel run.
    ops = dataclasses.replace(
        fusion.FUSED,
        add_rms_norm=fusion.EAGER.add_rms_norm,
        rms_norm=fusion.EAGER.rms_norm,
        rope=fusion.EAGER.rope,
        qk_norm_rope=fusion.EAGER.qk_norm_rope,
        name="the MoE places' kernels",
    )
    summary = fuse(model, ops)
    gates = {op: n for op, n in summary.counts.items() if op in (fusion.SILU_MUL, fusion.CLAMPED_SWIGLU)}
    assert gates == gate_places(family)  # gpt-oss's clamped, biased gate: clamped_swiglu
    assert summary.counts[fusion.LINEAR_CROSS_ENTROPY] == 1  # the MoE head, aux loss and all
    assert not any(r.startswith((fusion.SILU_MUL, fusion.CLAMPED_SWIGLU)) for r in summary.left_unfused)
    got = run(model, ids, labels)
    assert_same_step(got, want, reference)
    with torch.no_grad():  # the aux loss is the model's own on the model's own router logits
        assert got[1] > 0 and torch.isfinite(got[0])

    unfuse(model)
    assert {name: type(m) for name, m in model.named_modules()} == original
    again = run(model, ids, labels)
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
    assert all(torch.equal(again[2][n], want[2][n]) for n in want[2])


# --------------------------------------------------------------------------------------------
# Every experts implementation; the MoE head's aux loss; dense-then-MoE; shared experts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", PROBED_IMPLEMENTATIONS)
def test_each_experts_implementation_runs_the_fused_activation_and_computes_its_own_step(impl):
    model = tiny_moe("mixtral", seed=11)
    model.set_experts_implementation(impl)
    ids, labels = batch(11)
    want = run(model, ids, labels)
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls, only=(fusion.SILU_MUL,)))
    assert summary.counts == {fusion.SILU_MUL: 2}
    got = run(model, ids, labels)
    assert calls[fusion.SILU_MUL] >= 2  # eager: once per expert hit; batched/grouped: once a layer
    assert_same_step(got, want)
    # An implementation not probed (a kernel registered by the user) runs the class's own math.
    calls.clear()
    model.config._experts_implementation_internal = "profuse_test_unprobed"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("profuse_test_unprobed", ALL_EXPERTS_FUNCTIONS["batched_mm"])
    try:
        other = run(model, ids, labels)
    finally:
        model.config._experts_implementation_internal = impl
    assert calls[fusion.SILU_MUL] == 0
    assert_same_step(other, want)


def test_moe_head_adds_the_aux_loss_as_the_model_does_with_padding_and_without_router_logits():
    model = tiny_moe("qwen3_moe", seed=3)
    fused = copy.deepcopy(model)
    fuse(fused, [fusion.LINEAR_CROSS_ENTROPY], impl=fusion.EAGER)
    ids, labels = batch(3)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding: the aux loss counts only the tokens the mask keeps
    for kwargs in ({"attention_mask": mask}, {"output_router_logits": False}, {}):
        model.zero_grad(set_to_none=True)
        fused.zero_grad(set_to_none=True)
        want = model(ids, labels=labels, **kwargs)
        got = fused(ids, labels=labels, **kwargs)
        assert got.logits is None or not isinstance(got.logits, torch.Tensor)  # never made
        assert relative_error(got.loss, want.loss) <= 1e-5
        if kwargs.get("output_router_logits") is False:
            assert got.aux_loss is None and want.aux_loss is None
        else:
            assert relative_error(got.aux_loss, want.aux_loss) <= 1e-6
        want.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(model.named_parameters(), fused.parameters()):
            assert relative_error(q.grad, p.grad) <= 1e-4, name
        # the router's gradient comes from the aux loss too: it is there, fused or not
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_dense_then_moe_stack_and_shared_experts_fuse_every_mlp_place():
    # Qwen3-MoE with layer 0 dense (mlp_only_layers) and Qwen2-MoE with decoder_sparse_step 2 (layer 0
    # dense, layer 1 MoE with its shared expert): every dense MLP and every experts module.
    cases = [
        (tiny_moe("qwen3_moe", seed=5, mlp_only_layers=[0]), 2, {"Qwen3MoeMLP", "Qwen3MoeExperts"}),
        (tiny_moe("qwen2_moe", seed=6, decoder_sparse_step=2), 3, {"Qwen2MoeMLP", "Qwen2MoeExperts"}),
    ]
    for model, places, classes in cases:
        ids, labels = batch(5)
        want = run(model, ids, labels)
        calls = Counter()
        summary = fuse(model, impl=counting_ops(calls, only=(fusion.SILU_MUL,)))
        assert summary.counts == {fusion.SILU_MUL: places}
        assert {type(m).__name__ for m in fused_modules(model)} - {"Qwen3MoeModel"} == classes  # (+ its mask)
        got = run(model, ids, labels)
        assert calls[fusion.SILU_MUL] >= places
        assert_same_step(got, want)


def test_experts_that_are_not_silu_are_left_unfused_in_one_line_and_the_rest_fuses():
    model = tiny_moe("mixtral", seed=7, hidden_act="gelu")
    summary = fuse(model, impl=fusion.EAGER)
    (why,) = [r for r in summary.left_unfused if r.startswith(fusion.SILU_MUL)]
    assert "silu(gate) * up" in why and "GELU" in why and "\n" not in why
    assert fusion.SILU_MUL not in summary.counts and fusion.LINEAR_CROSS_ENTROPY in summary.counts
    assert not any(type(m).__name__ == "MixtralExperts" for m in fused_modules(model))


def test_an_experts_act_fn_changed_after_fusing_runs_its_own_math():
    model = tiny_moe("olmoe", seed=8)
    calls = Counter()
    fuse(model, impl=counting_ops(calls, only=(fusion.SILU_MUL,)))
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = nn.GELU()
    ids, labels = batch(8)
    got = run(model, ids, labels)
    unfuse(model)
    want = run(model, ids, labels)
    assert calls[fusion.SILU_MUL] == 0
    assert_same_step(got, want)


# --------------------------------------------------------------------------------------------
# profuse step's MoE presets
# --------------------------------------------------------------------------------------------


def test_moe_presets_have_the_published_sizes_and_the_tiny_ones_fuse():
    from profuse.models.hf import HFSpec, hf_spec

    # OLMoE-1B-7B: 6.92B parameters (allenai's model card: "6.9B total"); Qwen3-30B-A3B's layer at
    # its 48 layers: 30.5B (Qwen's card), at the preset's 12: 8.1B. Counted on the meta device.
    olmoe = hf_spec("olmoe", "OLMoE-1B-7B")
    assert abs(olmoe.param_count() / 1e9 - 6.92) < 0.01
    qwen = hf_spec("qwen3_moe", "Qwen3-30B-A3B-12L")
    assert qwen.n_layer == 12 and abs(qwen.param_count() / 1e9 - 8.10) < 0.01
    whole = type(qwen.config).from_dict({**qwen.config.to_dict(), "num_hidden_layers": 48})
    assert abs(HFSpec(whole, "whole", 1, 8).param_count() / 1e9 - 30.53) < 0.01
    for spec in (olmoe, qwen):
        assert spec.config.output_router_logits and (spec.batch_size, spec.seq_len) == (4, 2048)
    # the 80 GB card's: the same layer, fewer of them, and the run's estimate under 90% of 80 GB
    from profuse.step import StepConfig, estimated_bytes

    for arch, name, whole, layers in (
        ("olmoe", "OLMoE-1B-7B-8L", olmoe, 8),
        ("qwen3_moe", "Qwen3-30B-A3B-4L", qwen, 4),
    ):
        small = hf_spec(arch, name)
        assert small.n_layer == layers
        keep = {k: v for k, v in small.config.to_dict().items() if k != "num_hidden_layers"}
        assert keep == {k: v for k, v in whole.config.to_dict().items() if k != "num_hidden_layers"}
        variants = ("eager", "moe-best", "moe-best+fused", "liger")
        cfg = StepConfig(model=small, device=torch.device("cpu"), precision="bf16", variants=variants)
        assert estimated_bytes(cfg) < 0.9 * 80e9 < estimated_bytes(dataclasses.replace(cfg, model=whole))

    for arch in ("olmoe", "qwen3_moe"):  # the CPU-sized model: the router's aux loss in its loss
        spec = hf_spec(arch, batch_size=1, seq_len=9)
        model = spec.build("cpu")
        ids, labels = spec.batch("cpu")
        out = model(input_ids=ids, labels=labels)
        assert out.aux_loss is not None and torch.isfinite(out.loss)
        summary = fuse(model, dry_run=True)
        assert summary.counts[fusion.SILU_MUL] == 2 and summary.counts[fusion.LINEAR_CROSS_ENTROPY] == 1


def test_experts_with_a_forward_of_their_own_fuse_only_where_the_probe_saw_their_output():
    """A class with a forward of its own: SquaredWeights dispatches as transformers' does (with
    the top-k weights squared), so batched_mm and grouped_mm fuse through _apply_gate but
    profuse's eager loop is not its math; Scaled runs transformers' eager loop times 1.5 and
    calls no _apply_gate, so nothing fuses, and the summary says why in one line."""
    from profuse.fusion.hf_modules import STATE, innermost

    model = tiny_moe("mixtral", seed=9)
    base = type(model.model.layers[0].mlp.experts)

    class SquaredWeights(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return base.forward(self, hidden_states, top_k_index, top_k_weights * top_k_weights)

    class Scaled(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 1.5 * innermost(base.forward)(self, hidden_states, top_k_index, top_k_weights)

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = Scaled
    summary = fuse(model, impl=fusion.EAGER, dry_run=True)
    (why,) = [r for r in summary.left_unfused if r.startswith(fusion.SILU_MUL)]
    assert "Scaled" in why and "do not compute their own forward" in why and "\n" not in why
    assert fusion.SILU_MUL not in summary.counts

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = SquaredWeights
    ids, labels = batch(9)
    want = {}
    for impl in ("eager", "grouped_mm"):
        model.set_experts_implementation(impl)
        want[impl] = run(model, ids, labels)
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls, only=(fusion.SILU_MUL,)))
    assert summary.counts[fusion.SILU_MUL] == 2
    assert model.model.layers[0].mlp.experts.__dict__[STATE].implementations == ("batched_mm", "grouped_mm")
    (why,) = [r for r in summary.left_unfused if r.startswith(fusion.SILU_MUL)]
    assert "SquaredWeights) runs its own math under eager: differs" in why and "\n" not in why
    for impl, fused in (("grouped_mm", True), ("eager", False)):  # eager: the class's own forward
        model.set_experts_implementation(impl)
        calls.clear()
        assert_same_step(run(model, ids, labels), want[impl])
        assert (calls[fusion.SILU_MUL] > 0) == fused


# --------------------------------------------------------------------------------------------
# Liger-Kernel's own MoE patches, as profuse step's liger variants apply them
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_liger_variants_apply_liger_kernels_own_patch_of_the_moe_family(family):
    """Liger's kernels do not run on the CPU (its RMSNorm kernel under the interpreter, its fused
    MoE op asks for a GPU driver): the patch selection is what is checked. liger: the family's
    own lce_forward (the aux loss added to the fused linear cross-entropy's) and, where Liger
    patches them, LigerExperts' fused MoE forward; gpt-oss's clamped experts are left as they
    are. liger-ops: the experts and norms alone. The modeling module is left as it was."""
    pytest.importorskip("liger_kernel.transformers")
    from liger_kernel.transformers.swiglu import LigerExperts

    from profuse.models import liger as L

    assert L.no_patch(family) == ""
    for ops_only in (False, True):
        model = tiny_moe(family, seed=12)
        module = L.modeling_module(family, model)
        before = dict(vars(module))
        globals_ = L.patch(model, family, ops_only=ops_only)
        assert all(vars(module)[k] is v for k, v in before.items()) and vars(module).keys() == before.keys()
        norm = next(n for n in globals_.patched if n.endswith("RMSNorm"))
        with globals_:
            assert getattr(module, norm).__module__.startswith("liger_kernel.")
        assert getattr(module, norm) is before[norm]
        forward = model.__dict__.get("forward")
        if ops_only:
            assert forward is None and "apply_rotary_pos_emb" not in globals_.patched
        else:
            assert forward.__func__.__module__ == f"liger_kernel.transformers.model.{family}"
            assert forward.__func__.__name__ == "lce_forward" and "apply_rotary_pos_emb" in globals_.patched
        for layer in model.model.layers:
            own = layer.mlp.experts.__dict__.get("forward")
            if family == "gpt_oss":
                assert own is None  # Liger's SwiGLU is off for gpt-oss's clamped experts
            else:
                assert own.__func__ is LigerExperts.forward


def test_liger_variants_of_a_family_liger_does_not_patch_are_refused_in_one_line_naming_it():
    from profuse.models import liger as L

    if not L.HAS_LIGER:
        pytest.skip("liger-kernel is not installed")
    why = L.unavailable(torch.device("cuda"), "olmoe")  # the device's type only is read
    assert "has no patch for olmoe" in why and "\n" not in why
    assert L.unavailable(torch.device("cuda"), "qwen3_moe") == ""


# --------------------------------------------------------------------------------------------
# GraniteMoE: its multipliers, its layer refused in one line, its packed shared MLP
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["granitemoe", "granitemoeshared"])
def test_granite_moe_fuses_its_experts_head_and_layer_with_its_multipliers(family):
    """The experts' activation and the head (logits / logits_scaling inside the fused loss) fuse
    with the multipliers as the model applies them (the step's equality: the first test here).
    GraniteMoE's decoder layer fuses too: its MLP is block_sparse_moe and each residual branch is
    scaled by residual_multiplier, both found by the layer probe. GraniteMoeShared's layer adds a
    shared MLP beside the experts: left unfused in one line naming what it holds."""
    model = tiny_moe(family, seed=13)
    ids, labels = batch(13)
    want = run(model, ids, labels)
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls))  # every op asked for, each counting its calls
    places = gate_places(family)[fusion.SILU_MUL]
    counts = {fusion.SILU_MUL: places, fusion.ROPE: 2, fusion.LINEAR_CROSS_ENTROPY: 1}
    layer = [r for r in summary.left_unfused if r.startswith(fusion.ADD_RMS_NORM)]
    if family == "granitemoe":
        assert summary.counts == {**counts, fusion.ADD_RMS_NORM: 4, fusion.RMS_NORM: 1} and not layer
        state = model.model.layers[0].__dict__[STATE]
        assert (state.mlp_name, state.scale) == ("block_sparse_moe", "residual_multiplier")
    else:
        assert summary.counts == counts
        assert len(layer) == 1 and "shared_mlp" in layer[0] and "\n" not in layer[0]
    assert not any(r.startswith(fusion.SILU_MUL) for r in summary.left_unfused)
    assert_same_step(run(model, ids, labels), want)
    assert calls[fusion.SILU_MUL] >= places and calls[fusion.LINEAR_CROSS_ENTROPY] == 1  # each ran


def test_a_packed_shared_mlp_that_does_not_compute_silu_gate_times_up_is_left_unfused_in_one_line():
    model = tiny_moe("granitemoeshared", seed=14)
    base = type(model.model.layers[0].shared_mlp)

    class UpFirst(base):  # the halves the other way round: silu(up) * gate
        def forward(self, x):
            gate_up = self.input_linear(x)
            up, gate = gate_up.chunk(2, dim=-1)
            return self.output_linear(self.activation(gate) * up)

    for layer in model.model.layers:
        layer.shared_mlp.__class__ = UpFirst
    ids, labels = batch(14)
    want = run(model, ids, labels)
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls, only=(fusion.SILU_MUL,)))
    (why,) = [r for r in summary.left_unfused if r.startswith(fusion.SILU_MUL)]
    assert "UpFirst" in why and "input_linear -> activation -> output_linear" in why and "\n" not in why
    assert summary.counts[fusion.SILU_MUL] == 2  # the experts still fuse
    assert_same_step(run(model, ids, labels), want)
