"""The model specs (profuse.models): the built-in GPT and Hugging Face Llama-family models behind
one interface; Liger-Kernel's patch kept to one model (profuse.models.liger).

Published sizes are built on the meta device (nothing allocated); the tiny ones on the CPU.
"""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from profuse.errors import UsageError
from profuse.model import GPT
from profuse.models import ModelSpec, make_step, model_spec
from profuse.models import liger as L
from profuse.models.spec import CHECK_BATCH, CHECK_LAYERS, CHECK_SEQ_LEN

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'profuse[hf]'"
)

from profuse.models.hf import ARCHS, PRESETS  # noqa: E402

CPU = torch.device("cpu")

# The model cards' parameter counts (total; non-embedding where the card gives it), tied
# embeddings counted once: the presets' hyperparameters must reproduce them.
PUBLISHED = {
    ("llama", "Llama-3.2-1B"): (1.24e9, None),  # 1,235,814,400
    ("qwen2", "Qwen2.5-0.5B"): (0.49e9, 0.36e9),
    ("qwen3", "Qwen3-0.6B"): (0.60e9, 0.44e9),
}


def tiny(arch: str, **kw) -> ModelSpec:
    return model_spec(f"hf:{arch}", "tiny", **kw)


def saved_activation_bytes(spec: ModelSpec) -> int:
    """What autograd keeps for the backward of one forward and loss (fp32, CPU), parameters
    left out, each storage counted once."""
    model = spec.build(CPU)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        spec.loss(model, spec.batch(CPU, seed=3))
    return sum(seen.values())


# --------------------------------------------------------------------------------------------
# Every spec builds, and says what it built
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hf_models_build_and_count_their_parameters(arch):
    spec = tiny(arch, batch_size=3, seq_len=37)
    model = spec.build(CPU, seed=1)
    assert type(model).__name__.lower().startswith(arch) and model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    assert spec.family == arch and spec.model_arg == f"hf:{arch}"
    assert (
        spec.describe()
        == f"hf:{arch} tiny: {spec.param_count() / 1e6:,.1f}M parameters, 3 x 37 tokens a step"
    )
    dims = spec.dims()
    assert (dims["d_model"], dims["ffn_hidden"], dims["batch_size"], dims["seq_len"]) == (96, 224, 3, 37)
    assert spec.to_dict()["n_params"] == spec.param_count()


@pytest.mark.parametrize("arch, preset", list(PUBLISHED))
def test_published_presets_match_the_model_cards(arch, preset):
    spec = model_spec(f"hf:{arch}", preset)
    assert PRESETS[preset][0] == arch
    model = spec.build("meta")  # every shape, nothing allocated
    n = sum(p.numel() for p in model.parameters())
    assert n == spec.param_count()
    total, non_embedding = PUBLISHED[(arch, preset)]
    assert round(n / 1e9, 2) == round(total / 1e9, 2)
    if non_embedding is not None:
        assert round((n - spec.vocab_size * spec.d_model) / 1e9, 2) == round(non_embedding / 1e9, 2)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as published
    assert (spec.batch_size, spec.seq_len) == (4, 2048)


@pytest.mark.parametrize("preset", ["lab", "small", "medium"])
def test_gpt_presets(preset):
    spec = model_spec("gpt", preset)
    with torch.device("meta"):
        model = GPT(spec.config)
    assert spec.param_count() == sum(p.numel() for p in model.parameters())
    assert spec.model_arg == "gpt" and spec.dims()["n_layer"] == spec.config.n_layer
    over = model_spec("gpt", preset, n_layer=3, batch_size=2)
    assert (over.config.n_layer, over.batch_size, over.config.d_model) == (3, 2, spec.config.d_model)


def test_a_local_config_file(tmp_path):
    base = {k: v for k, v in tiny("qwen2").config.to_dict().items() if k != "layer_types"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, "num_hidden_layers": 3, "intermediate_size": 150}))
    for where in (path, tmp_path):  # the file, or its folder
        spec = model_spec("hf:qwen2", config_path=where, batch_size=2, seq_len=16)
        assert (spec.n_layer, spec.ffn_hidden, spec.preset) == (3, 150, where.name)
        assert spec.param_count() == sum(p.numel() for p in spec.build(CPU).parameters())


# --------------------------------------------------------------------------------------------
# The batch and the loss
# --------------------------------------------------------------------------------------------


SMALL_GPT = dict(n_layer=1, d_model=48, n_head=2, vocab_size=97, seq_len=11, batch_size=3)
SPECS = [tiny("llama", batch_size=3, seq_len=19), tiny("qwen3"), model_spec("gpt", "lab", **SMALL_GPT)]


@pytest.mark.parametrize("spec", SPECS, ids=["llama", "qwen3", "gpt"])
def test_batch_and_loss(spec):
    idx, labels = spec.batch(CPU, seed=5)
    assert idx.shape == labels.shape == (spec.batch_size, spec.seq_len) and idx.dtype == torch.long
    if spec.family == "gpt":
        assert torch.equal(idx[:, 1:], labels[:, :-1])  # targets are the next tokens
    else:
        assert labels is idx  # a causal LM's labels are its input ids; the model shifts them
    assert 0 <= int(idx.min()) and int(idx.max()) < spec.vocab_size
    again, _ = spec.batch(CPU, seed=5)
    other, _ = spec.batch(CPU, seed=6)
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    model = spec.build(CPU)
    logits = spec.logits(model, idx)
    assert logits.shape == (spec.batch_size, spec.seq_len, spec.vocab_size)
    if spec.family == "gpt":  # every token predicts the next one
        want = F.cross_entropy(logits.reshape(-1, spec.vocab_size), labels.reshape(-1))
    else:  # position t predicts label t + 1: B x (T - 1) tokens
        want = F.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab_size), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(spec.loss(model, (idx, labels)), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(spec.reference_loss(model, (idx, labels)), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_step_loss_is_the_models_own_and_the_reference_is_its_math_in_float64(arch):
    """Every variant's step computes what a Hugging Face training loop does (the model's own
    loss, labels = input ids); the float64 check's reference computes that loss from the logits
    itself, since Hugging Face's casts the logits to fp32."""
    spec = tiny(arch, batch_size=3, seq_len=23)
    model = spec.build(CPU, seed=2)
    batch = spec.batch(CPU, seed=4)
    idx, labels = batch
    own = model(input_ids=idx, labels=labels, use_cache=False).loss
    assert torch.equal(spec.loss(model, batch), own)
    from transformers.loss.loss_utils import ForCausalLMLoss  # Hugging Face's causal-LM loss itself

    logits = spec.logits(model, idx)
    hf = ForCausalLMLoss(logits, labels, vocab_size=spec.vocab_size)
    torch.testing.assert_close(own, hf, rtol=1e-6, atol=0)
    double = spec.build(CPU, seed=2).double()
    ref = spec.reference_loss(double, batch)
    assert ref.dtype == torch.float64  # the reference stays in float64
    assert hf.dtype == torch.float32  # where Hugging Face's own drops to fp32
    torch.testing.assert_close(ref.float(), own, rtol=1e-5, atol=0)
    with pytest.raises(AssertionError):  # not profuse's loss over all T positions
        torch.testing.assert_close(own, F.cross_entropy(logits.reshape(-1, spec.vocab_size), idx.reshape(-1)))


@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_make_step_trains(precision):
    spec = tiny("mistral")
    step = make_step(spec, CPU, lr=1e-2, precision=precision)
    losses = [float(step()) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# --------------------------------------------------------------------------------------------
# Precision: amp (fp32 parameters, bf16 autocast on CUDA) and bf16 (bf16 parameters)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=["llama", "qwen3", "gpt"])
def test_bf16_parameters_keep_their_objects_ties_and_fp32_buffers(spec):
    amp, bf16 = spec.build_for(CPU, seed=3), spec.build_for(CPU, seed=3, precision="bf16")
    assert all(p.dtype == torch.float32 for p in amp.parameters())
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    for (n, p), (m, q) in zip(amp.named_parameters(), bf16.named_parameters(), strict=True):
        assert n == m and torch.equal(p.to(torch.bfloat16), q)  # the same weights, rounded once
    assert {b.dtype for b in bf16.buffers()} <= {torch.float32}  # RoPE's frequencies stay fp32
    assert sum(p.numel() for p in bf16.parameters()) == spec.param_count()  # tied weights stay tied


def test_precision_settings():
    from profuse.models.spec import (
        autocast_for,
        check_precision,
        compute_dtype,
        param_dtype,
        precision_text,
        state_bytes_per_parameter,
    )

    cuda = torch.device("cuda")  # only read, never used
    assert (param_dtype("amp"), param_dtype("bf16")) == (torch.float32, torch.bfloat16)
    assert (
        compute_dtype(cuda, "amp")
        == compute_dtype(CPU, "bf16")
        == compute_dtype(cuda, "bf16")
        == torch.bfloat16
    )
    assert compute_dtype(CPU, "amp") == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # made, never entered: no GPU is needed for that
        assert isinstance(autocast_for(cuda, "amp")(), torch.autocast)
    for device, precision in ((cuda, "bf16"), (CPU, "amp"), (CPU, "bf16")):
        assert not isinstance(autocast_for(device, precision)(), torch.autocast)
    assert (state_bytes_per_parameter("amp"), state_bytes_per_parameter("bf16")) == (18, 8)
    assert precision_text(cuda, "amp").startswith("amp: bf16 autocast over fp32 parameters")
    assert precision_text(CPU, "bf16").endswith("slow on a CPU")
    for bad in ("fp16", "both", ""):
        with pytest.raises(UsageError, match="unknown precision") as err:
            check_precision(bad)
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The small copy and the memory estimate
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [model_spec("hf:llama", "Llama-3.2-1B"), tiny("qwen3", seq_len=200),
                                  model_spec("gpt", "medium")], ids=["llama-1b", "qwen3", "gpt"])  # fmt: skip
def test_small_keeps_the_widths_and_cuts_layers_and_tokens(spec):
    small = spec.small()
    keep = ("d_model", "n_head", "ffn_hidden", "vocab_size")
    assert {k: small.dims()[k] for k in keep} == {k: spec.dims()[k] for k in keep}
    assert small.dims()["n_layer"] == min(spec.dims()["n_layer"], CHECK_LAYERS)
    assert (small.batch_size, small.seq_len) == (
        min(spec.batch_size, CHECK_BATCH),
        min(spec.seq_len, CHECK_SEQ_LEN),
    )
    assert small.family == spec.family
    cut = spec.dims()["n_layer"] > CHECK_LAYERS
    assert (small.param_count() < spec.param_count()) if cut else (small.param_count() == spec.param_count())
    assert spec.seq_len > small.seq_len  # the original is left as it was


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch, seq", [(2, 64), (3, 37)])
def test_activation_estimate_bounds_what_autograd_keeps(arch, batch, seq):
    spec = tiny(arch, batch_size=batch, seq_len=seq)
    saved = saved_activation_bytes(spec)
    estimate = spec.activation_bytes(torch.float32)
    # A bound, not a guess: above what the forward keeps (the backward adds the logits' gradient
    # and transients), and not more than 2.5x over it.
    assert saved < estimate < 2.5 * saved, (saved, estimate)
    assert spec.activation_bytes(torch.bfloat16) < estimate  # bf16 halves the matmuls' tensors
    assert spec.train_bytes() == 18 * spec.param_count() + estimate


def test_llama_1b_step_estimate():
    spec = model_spec("hf:llama", "Llama-3.2-1B")
    act = spec.activation_bytes(torch.bfloat16)
    # 4 x 2048 tokens under bf16 autocast: ~21 GB of layer activations, ~15 GB of logits work.
    assert 30e9 < act < 45e9
    assert 55e9 < spec.train_bytes(torch.bfloat16) < 70e9


# --------------------------------------------------------------------------------------------
# Bad input: one line each
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kw, words",
    [
        (("bert",), {}, "unknown model 'bert'"),
        (("hf:gpt2",), {}, "unknown Hugging Face architecture 'gpt2'"),
        (("hf:gpt2",), {}, "--hf-config PATH"),
        (("hf:meta-llama/Llama-3.2-1B",), {}, "--model hf:llama --preset Llama-3.2-1B, or"),
        (("hf:Qwen/Qwen3-8B",), {}, "Hub model id, and hf: takes an architecture (llama,"),
        (("hf:Qwen/Qwen3-8B",), {}, "--hf-config with its config.json"),
        (("hf:llama", "huge"), {}, "unknown preset 'huge' for hf:llama"),
        (("hf:qwen2", "Llama-3.2-1B"), {}, "use --model hf:llama"),
        (("hf:llama",), {"n_layer": 3, "d_model": 64}, "--d-model, --layers: sizes of the built-in GPT"),
        (("hf:llama",), {"seq_len": 4096}, "longer than the model's 1024 positions"),
        (("hf:llama",), {"batch_size": 0}, "must be positive"),
        (("gpt", "tiny"), {}, "unknown preset 'tiny' for the built-in GPT"),
        (("gpt",), {"config_path": "x.json"}, "--hf-config is for Hugging Face models"),
        (("hf:llama", "tiny"), {"config_path": "x.json"}, "give one"),
    ],
)
def test_bad_model_input_is_one_line(args, kw, words):
    with pytest.raises(UsageError) as err:
        model_spec(*args, **kw)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, words",
    [
        (None, "no such file"),
        ("{not json", "not a readable config.json"),
        ('{"hidden_size": 8}', "no model_type"),
        ('{"model_type": "gpt2"}', "'gpt2' is not one of"),
        ('{"model_type": "qwen3"}', "use --model hf:qwen3"),
        ('{"model_type": "llama", "num_hidden_layers": 3, "layer_types": ["full_attention"]}', "rejects it"),
    ],
)
def test_bad_config_files(tmp_path, text, words):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=words) as err:
        model_spec("hf:llama", config_path=path)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Liger-Kernel's patch, kept to one model
# --------------------------------------------------------------------------------------------


def test_liger_says_why_it_cannot_run():
    assert L.unavailable(CPU, "gpt").startswith("Liger-Kernel patches Hugging Face models")
    assert L.unavailable(CPU, "llama").startswith("needs CUDA and liger-kernel")
    if not L.HAS_LIGER:
        assert L.LIGER_MISSING in L.unavailable(torch.device("cuda"), "llama")


def fake_liger(calls: list):
    """Stands in for liger_kernel.transformers: patches a built Llama's norms (the same math)
    and, as Liger does, a global of the modeling module (RoPE, here counting its calls)."""
    module = L.modeling_module("llama")
    rope = module.apply_rotary_pos_emb

    def counting_rope(*args, **kwargs):
        calls.append("rope")
        return rope(*args, **kwargs)

    def apply_liger_kernel_to_llama(rope=True, rms_norm=True, model=None, **_kw):
        if rope:
            module.apply_rotary_pos_emb = counting_rope
        if rms_norm:
            module.LlamaRMSNorm = type("PatchedNorm", (module.LlamaRMSNorm,), {})
            for norm in (m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"):
                norm.patched = True

    return types.SimpleNamespace(apply_liger_kernel_to_llama=apply_liger_kernel_to_llama), rope


def test_liger_patch_leaves_the_modeling_module_as_it_was(monkeypatch):
    calls: list = []
    fake, rope = fake_liger(calls)
    monkeypatch.setattr(L, "liger_transformers", fake)
    module = L.modeling_module("llama")
    norm_class = module.LlamaRMSNorm
    spec = tiny("llama")
    model, eager = spec.build(CPU), spec.build(CPU)
    globals_ = L.patch(model, "llama")
    assert module.apply_rotary_pos_emb is rope and module.LlamaRMSNorm is norm_class  # put back
    assert set(globals_.patched) == {"apply_rotary_pos_emb", "LlamaRMSNorm"}
    assert all(getattr(m, "patched", False) for m in model.modules() if type(m).__name__ == "LlamaRMSNorm")
    batch = spec.batch(CPU)
    spec.loss(eager, batch)
    assert calls == []  # another model of the family runs its own RoPE
    with globals_:
        assert module.apply_rotary_pos_emb is not rope
        spec.loss(model, batch)
    assert calls == ["rope"] * spec.dims()["n_layer"] and module.apply_rotary_pos_emb is rope
    ops_only = L.patch(spec.build(CPU), "llama", ops_only=True)
    assert set(ops_only.patched) == {"LlamaRMSNorm"}  # rope off: Liger's RMSNorm and SwiGLU alone


def test_liger_has_no_loss_of_its_own():
    """Liger's variants train on the model's own loss, as every other variant does."""
    assert not hasattr(L, "hf_loss") and not hasattr(L, "shifted_loss")


@pytest.mark.parametrize(
    "arch, preset, total, tied",
    [
        ("gemma3_text", "Gemma-3-1B", 999_885_952, True),  # google/gemma-3-1b-pt
        ("olmo2", "OLMo-2-1B", 1_484_916_736, False),  # allenai/OLMo-2-0425-1B
        ("phi3", "Phi-4-mini", 3_836_021_760, True),  # microsoft/Phi-4-mini-instruct
    ],
)
def test_the_other_layouts_presets_have_their_published_sizes_and_their_tiny_models_fuse(
    arch, preset, total, tied
):
    """Gemma 3's sandwich norms, OLMo 2's post-norm, Phi-4's packed MLP: published shapes for
    `profuse step`, and tiny ones that profuse.fuse places its ops in, the loss unchanged."""
    from profuse import fusion

    spec = model_spec(f"hf:{arch}", preset)
    model = spec.build("meta")
    assert spec.param_count() == sum(p.numel() for p in model.parameters()) == total
    assert (model.lm_head.weight is model.get_input_embeddings().weight) is tied
    small = tiny(arch)
    net = small.build(CPU, seed=2)
    batch = small.batch(CPU, seed=3)
    want = small.loss(net, batch)
    summary = fusion.fuse(net, impl=fusion.EAGER)
    assert summary.counts.get("silu_mul") == small.n_layer and "linear_cross_entropy" in summary.counts
    torch.testing.assert_close(small.loss(net, batch), want, rtol=1e-5, atol=1e-6)
