"""profuse.fuse under real training code: never silently wrong.

Each case against an unfused copy doing the same, on Llama and Qwen3 (tied and untied
embeddings where it matters): parameters swapped under a fused model (load_state_dict with
assign=True), FSDP2 before and after fusing, PEFT (LN tuning, LoRA, modules_to_save) before and
after, hooks on fused layers and on the modules fusion stands in for, float64, accelerate's
offload, a model built on the meta device, deep copies, output_attentions, save_pretrained.

peft and accelerate are test extras: their tests skip without them. FSDP2 runs in this process
on a gloo group of one rank.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from fusion_cases import (  # noqa: E402
    FP32,
    LAYERS,
    assert_untouched,
    counting_ops,
    expected_counts,
    fused_modules,
    labels_for,
    loss_and_grads,
    snapshot,
    tiny,
    tokens,
)

from profuse import fusion  # noqa: E402
from profuse.errors import UnsupportedModel  # noqa: E402
from profuse.fusion import fuse, unfuse  # noqa: E402
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error  # noqa: E402

CASES = [("llama", False), ("qwen3", True)]
CASE_IDS = ["llama-untied", "qwen3-tied"]


def assert_same_step(got, want, dtype=FP32) -> None:
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert got_grads.keys() == want_grads.keys()
    assert relative_error(got_loss, want_loss) <= FORWARD_TOL[dtype], (got_loss, want_loss)
    for name in want_grads:
        assert relative_error(got_grads[name], want_grads[name]) <= BACKWARD_TOL[dtype], name


def train(model: nn.Module, ids, labels, steps: int = 3) -> list[float]:
    """SGD steps; the losses."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_same_losses(got: list[float], want: list[float]) -> None:
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= FORWARD_TOL[FP32] * abs(w), (got, want)


# --------------------------------------------------------------------------------------------
# Parameters swapped under a fused model; unfuse keeps what the model has now
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_parameters_assigned_to_a_fused_model_are_used_and_kept_by_unfuse(arch, tie):
    reference = tiny(arch, tie=tie, seed=201)
    model = copy.deepcopy(reference)
    ids = tokens(202)
    fuse(model, impl=fusion.EAGER)
    state = {k: v * 1.1 for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)
    model.load_state_dict(state, assign=True)
    if tie:
        model.tie_weights()
    want = loss_and_grads(reference, ids)
    assert_same_step(loss_and_grads(model, ids), want)
    unfuse(model)
    assert model.model.norm.weight is model.state_dict(keep_vars=True)["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    got = loss_and_grads(model, ids)
    assert torch.equal(got[0], want[0])


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def _fully_shard():
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard  # torch 2.5
        except ImportError:
            pytest.skip("this torch has no FSDP2 (fully_shard)")
    return fully_shard, FSDPModule


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of one rank, in this process, for the module's tests."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        yield
        return
    init = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard(model: nn.Module) -> None:
    fully_shard, _ = _fully_shard()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_fuse_then_fsdp2_trains_as_unfused_and_unfuse_keeps_the_shards(one_rank, arch, tie):
    _, FSDPModule = _fully_shard()
    base = tiny(arch, tie=tie, seed=211)
    ids = tokens(212)
    labels = labels_for(ids, 213)
    reference = copy.deepcopy(base)
    want = train(reference, ids, labels)
    model = copy.deepcopy(base)
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls))
    _shard(model)
    assert_same_losses(train(model, ids, labels), want)
    assert dict(calls) == {op: 3 * n for op, n in summary.counts.items()}  # every op ran, every step
    unfuse(model)
    assert fused_modules(model) == []
    assert all(isinstance(m, FSDPModule) for m in (model, *model.model.layers))
    with torch.no_grad():
        assert (
            relative_error(model(ids, labels=labels).loss, reference(ids, labels=labels).loss)
            <= FORWARD_TOL[FP32]
        )


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_fsdp2_then_fuse_fuses_the_shards(one_rank, arch, tie):
    _, FSDPModule = _fully_shard()
    base = tiny(arch, tie=tie, seed=221)
    ids = tokens(222)
    labels = labels_for(ids, 223)
    reference = copy.deepcopy(base)
    _shard(reference)
    want = train(reference, ids, labels)
    model = copy.deepcopy(base)
    _shard(model)
    before = [type(m) for m in model.modules()]
    calls = Counter()
    summary = fuse(model, impl=counting_ops(calls))
    assert summary.counts == expected_counts(arch)
    assert_same_losses(train(model, ids, labels), want)
    assert dict(calls) == {op: 3 * n for op, n in summary.counts.items()}
    unfuse(model)
    assert [type(m) for m in model.modules()] == before


# --------------------------------------------------------------------------------------------
# PEFT
# --------------------------------------------------------------------------------------------


def _ln_tuning(arch: str):
    peft = pytest.importorskip("peft")
    targets = ["input_layernorm", "post_attention_layernorm", "norm"]
    if arch == "qwen3":
        targets += ["q_norm", "k_norm"]
    return peft.get_peft_model, peft.LNTuningConfig(target_modules=targets)


@pytest.mark.parametrize("when", ["after-fuse", "before-fuse"])
@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_peft_ln_tuning_trains_every_norm_it_wraps(arch, tie, when):
    get_peft_model, config = _ln_tuning(arch)
    base = tiny(arch, tie=tie, seed=231)
    ids = tokens(232)
    labels = labels_for(ids, 233)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    model = copy.deepcopy(base)
    if when == "after-fuse":
        fuse(model, impl=fusion.EAGER)
        model = get_peft_model(model, copy.deepcopy(config))
    else:
        model = get_peft_model(model, copy.deepcopy(config))
        summary = fuse(model, impl=fusion.EAGER)
        assert any(item.startswith("add_rms_norm:") for item in summary.left_unfused)  # the wrapped norms
    got, want = loss_and_grads(model, ids, labels), loss_and_grads(reference, ids, labels)
    trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
    assert trainable and set(got[1]) == set(want[1]) == trainable  # every trainable norm has a gradient
    assert_same_step(got, want)
    assert_same_losses(train(model, ids, labels), train(reference, ids, labels))


@pytest.mark.parametrize("when", ["after-fuse", "before-fuse"])
@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_peft_lora_with_modules_to_save_and_merge(arch, tie, when):
    peft = pytest.importorskip("peft")
    base = tiny(arch, tie=tie, seed=241)
    ids = tokens(242)
    labels = labels_for(ids, 243)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        modules_to_save=["post_attention_layernorm"],
        init_lora_weights=False,  # random B: the adapters change the output
    )

    def wrap(m):
        torch.manual_seed(244)
        return peft.get_peft_model(m, copy.deepcopy(config))

    reference = wrap(copy.deepcopy(base))
    model = copy.deepcopy(base)
    if when == "after-fuse":
        fuse(model, impl=fusion.EAGER)
        model = wrap(model)
    else:
        model = wrap(model)
        fuse(model, impl=fusion.EAGER)
    assert_same_step(loss_and_grads(model, ids, labels), loss_and_grads(reference, ids, labels))
    assert_same_losses(train(model, ids, labels), train(reference, ids, labels))
    merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
    with torch.no_grad():
        assert relative_error(merged(ids).logits, merged_reference(ids).logits) <= FORWARD_TOL[FP32]


# --------------------------------------------------------------------------------------------
# Hooks see what they saw unfused
# --------------------------------------------------------------------------------------------


def _record(seen: list, key: str):
    def hook(module, args, out=None):
        value = args if out is None else out
        seen.append((key, value[0] if isinstance(value, tuple) else value))

    return hook


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_hooks_on_fused_layers_and_on_the_modules_they_stand_for_see_the_unfused_values(arch, tie):
    base = tiny(arch, tie=tie, seed=251)
    ids = tokens(252)
    labels = labels_for(ids, 253)
    seen = {"fused": [], "unfused": []}
    models = {"unfused": copy.deepcopy(base), "fused": copy.deepcopy(base)}
    calls = Counter()
    fuse(models["fused"], impl=counting_ops(calls))
    for name, m in models.items():
        layers = m.model.layers
        layers[1].register_forward_hook(_record(seen[name], "layer 1 out"))
        layers[2].register_forward_pre_hook(_record(seen[name], "layer 2 in"))
        layers[0].input_layernorm.register_forward_hook(_record(seen[name], "layer 0 input norm"))
        layers[1].post_attention_layernorm.register_forward_hook(_record(seen[name], "layer 1 post norm"))
        layers[0].mlp.register_forward_hook(_record(seen[name], "layer 0 mlp"))
        m.model.norm.register_forward_hook(_record(seen[name], "final norm"))
        m.lm_head.register_forward_hook(_record(seen[name], "lm_head"))
        layers[0].register_full_backward_hook(_record(seen[name], "layer 0 grad out"))
        if arch == "qwen3":
            layers[2].self_attn.k_norm.register_forward_hook(_record(seen[name], "layer 2 k_norm"))
    want, got = loss_and_grads(models["unfused"], ids, labels), loss_and_grads(models["fused"], ids, labels)
    assert_same_step(got, want)
    assert [k for k, _ in seen["fused"]] == [k for k, _ in seen["unfused"]]
    for (key, g), (_, w) in zip(seen["fused"], seen["unfused"]):
        assert g.shape == w.shape and relative_error(g, w) <= BACKWARD_TOL[FP32], key
    # the hooked places ran unfused, the others fused
    assert calls["silu_mul"] == LAYERS - 1 and calls["linear_cross_entropy"] == 0
    assert calls["rope" if arch == "llama" else "qk_norm_rope"] == LAYERS - (arch == "qwen3")


def test_a_hook_that_changes_a_fused_layers_output_changes_the_model_as_unfused():
    base = tiny("mistral", seed=261)
    ids = tokens(262)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    fuse(models[1], impl=fusion.EAGER)
    for m in models:
        m.model.layers[1].register_forward_hook(lambda mod, args, out: out * 0.5)
    assert_same_step(loss_and_grads(models[1], ids), loss_and_grads(models[0], ids))


def test_output_attentions_after_fusing():
    base = tiny("qwen3", seed=271, attn_implementation="eager")
    ids = tokens(272)
    model = copy.deepcopy(base)
    fuse(model, impl=fusion.EAGER)
    got, want = model(ids, output_attentions=True), base(ids, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == LAYERS
    for g, w in zip(got.attentions, want.attentions):
        assert relative_error(g, w) <= FORWARD_TOL[FP32]
    assert (
        relative_error(model(ids).logits, base(ids).logits) <= FORWARD_TOL[FP32]
    )  # the capture hooks are inert


# --------------------------------------------------------------------------------------------
# Dtypes the kernels do not take, offload, meta, copies, files
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_float64_after_fusing_runs_the_models_own_math(arch, tie):
    """FUSED (Triton, or left unfused where not in this build) on a model moved to float64: the
    kernels do not take it, so each op runs Hugging Face's eager math: bitwise the unfused model."""
    base = tiny(arch, tie=tie, seed=281)
    ids = tokens(282)
    labels = labels_for(ids, 283)
    model = copy.deepcopy(base)
    fuse(model)
    model.double()
    want, got = loss_and_grads(base.double(), ids, labels), loss_and_grads(model, ids, labels)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


@pytest.mark.parametrize("arch, tie", CASES, ids=CASE_IDS)
def test_accelerate_offload_is_refused_before_fusing_and_works_after(arch, tie):
    accelerate = pytest.importorskip("accelerate")
    base = tiny(arch, tie=tie, seed=291)
    ids = tokens(292)
    offloaded = copy.deepcopy(base)
    accelerate.cpu_offload(offloaded, execution_device=torch.device("cpu"))
    before = snapshot(offloaded)
    with pytest.raises(UnsupportedModel, match="accelerate hooks") as info:
        fuse(offloaded)
    assert "\n" not in str(info.value)
    assert_untouched(offloaded, before)
    model = copy.deepcopy(base)
    fuse(model, impl=fusion.EAGER)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with torch.no_grad():
        got, want = model(ids, labels=ids), base(ids, labels=ids)
    assert relative_error(got.logits, want.logits) <= FORWARD_TOL[FP32]
    assert relative_error(got.loss, want.loss) <= FORWARD_TOL[FP32]


def test_a_model_built_on_the_meta_device_fuses_and_then_loads():
    base = tiny("llama", seed=301)
    ids = tokens(302)
    with torch.device("meta"):
        model = type(base)(base.config)
    fuse(model, impl=fusion.EAGER)
    model.to_empty(device="cpu")
    model.load_state_dict(base.state_dict())
    model.tie_weights()
    for name, buf in base.named_buffers():  # rotary inv_freq: not in the state_dict
        model.get_buffer(name).copy_(buf)
    assert_same_step(loss_and_grads(model, ids), loss_and_grads(base, ids))


def test_a_deep_copy_of_a_fused_model_is_fused_and_independent():
    base = tiny("qwen3", seed=311)
    ids = tokens(312)
    model = copy.deepcopy(base)
    calls = Counter()
    fuse(model, impl=counting_ops(calls))
    twin = copy.deepcopy(model)
    twin.model.layers[1].register_forward_hook(lambda mod, args, out: out * 2)  # the twin's alone
    assert_same_step(loss_and_grads(model, ids), loss_and_grads(base, ids))
    assert len(fused_modules(twin)) == len(fused_modules(model))
    calls.clear()
    loss_and_grads(twin, ids)
    # the twin's layer 1 is hooked (a forward hook sees its input and its output): layer 0 hands it
    # the hidden state, and it hands layer 2 the hidden state: two input norms with no add to fuse
    assert calls["add_rms_norm"] == 2 * LAYERS - 2 and calls["rms_norm"] == 3
    unfuse(twin)
    assert fused_modules(twin) == [] and len(fused_modules(model)) > 0
    assert_same_step(loss_and_grads(model, ids), loss_and_grads(base, ids))


def test_save_pretrained_from_a_fused_model_loads_as_the_original_class(tmp_path):
    base = tiny("llama", seed=321, tie=True)
    ids = tokens(322)
    model = copy.deepcopy(base)
    fuse(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(base) and loaded.config.architectures == ["LlamaForCausalLM"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, base(ids).logits)


def test_unfuse_refuses_a_class_it_cannot_rebuild_and_leaves_the_model_working():
    base = tiny("llama", seed=331)
    ids = tokens(332)
    model = copy.deepcopy(base)
    fuse(model, impl=fusion.EAGER)
    layer = model.model.layers[1]

    class Mine(type(layer)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    layer.__class__ = Mine
    before = snapshot(model)
    with pytest.raises(UnsupportedModel, match="cannot rebuild it unfused") as info:
        unfuse(model)
    assert "\n" not in str(info.value)
    assert_untouched(model, before)
    assert_same_step(loss_and_grads(model, ids), loss_and_grads(base, ids))
