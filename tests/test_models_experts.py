"""profuse.models.experts and Part C's moe-best variants: transformers' experts implementation
fastest on the card, unfused and fused over it, on a tiny OLMoE on the CPU.

The CPU's torch has a native grouped matmul (torch >= 2.9), so transformers' default, grouped_mm,
is also the best here; the tests that need the variants to run something other than the eager
variant make grouped_mm unavailable (monkeypatched), and the choice falls to the eager loop.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")  # transformers >= 5: experts as 3-D weights

from fusion_cases import counting_ops  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse import step as S  # noqa: E402
from profuse.models import experts as X  # noqa: E402
from profuse.models.hf import HFSpec  # noqa: E402

NO_GROUPED = "torch 0.0 has no grouped matmul (test)"


def tiny_olmoe(batch: int = 1, seq: int = 8) -> HFSpec:
    """OLMoE at hidden 32, 2 layers, 4 experts of 24 top-2, vocab 64: 16 (token, expert) pairs."""
    config = transformers.OlmoeConfig(
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return HFSpec(config, "tiny", batch, seq)


def test_best_implementation_is_grouped_mm_where_native_else_batched_mm_for_few_pairs_else_eager(monkeypatch):
    got = X.best_implementation("cpu", pairs=16384, num_experts=64, dtype=torch.bfloat16)
    assert got.implementation == X.GROUPED_MM and "bf16 kernel" in got.why  # torch 2.13 on a CPU
    monkeypatch.setattr(X, "native_grouped_mm", lambda device: NO_GROUPED)
    few = X.best_implementation("cpu", pairs=48, num_experts=64)
    many = X.best_implementation("cpu", pairs=65536, num_experts=64)
    assert few.implementation == X.BATCHED_MM and NO_GROUPED in few.why
    assert many.implementation == X.EAGER and "1,024 times the experts' weights" in many.why
    assert all("\n" not in c.why for c in (got, few, many))


@pytest.mark.parametrize("capability,native", [((9, 0), True), ((8, 0), True), ((7, 5), False)])
def test_native_grouped_mm_on_cuda_follows_the_cards_capability(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = X.native_grouped_mm("cuda")
    assert (why == "") == native
    if not native:
        assert f"SM{capability[0]}{capability[1]}" in why and "\n" not in why


def test_for_dtype_runs_float64_experts_by_the_eager_loop_with_the_same_loss():
    spec = tiny_olmoe()
    model = spec.build("cpu")
    assert X.implementation_of(model) == X.GROUPED_MM and X.has_experts(model)
    batch = spec.batch("cpu")
    want = spec.reference_loss(model, batch).double()
    double = X.for_dtype(model.double(), torch.float64)
    assert X.implementation_of(double) == X.EAGER
    got = spec.reference_loss(double, batch)  # the loss from float64 logits
    assert got.dtype == torch.float64 and abs(got - want) <= 1e-5 * want
    config = transformers.LlamaConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, vocab_size=32
    )
    dense = transformers.LlamaForCausalLM(config)
    assert not X.has_experts(dense) and X.for_dtype(dense, torch.float64) is dense


def test_moe_best_is_in_an_moes_default_variants_and_skipped_in_one_line_for_a_dense_model():
    from profuse.models import model_spec

    moe = S.StepConfig(model=tiny_olmoe())
    assert moe.variants == S.MOE_VARIANTS and {"moe-best", "moe-best+fused"} <= set(moe.variants)
    assert moe.to_dict()["experts"] == {
        "implementation": X.GROUPED_MM,
        "why": moe.experts.why,
        "default": X.GROUPED_MM,  # transformers 5.x builds it so: eager and fused run the best already
    }
    runs, skipped = S.plan(moe, fusion.EAGER)
    assert "moe-best" not in runs and "moe-best+fused" not in runs  # timing them twice tells nothing
    assert skipped["moe-best"].startswith("eager is it: the model as built runs transformers' grouped_mm")
    assert skipped["moe-best+fused"].startswith("fused is it")
    dense = S.StepConfig(model=model_spec("hf:llama", "tiny"), variants=("eager", "moe-best"))
    assert S.StepConfig(model=model_spec("hf:llama", "tiny")).variants == S.HF_VARIANTS
    runs, skipped = S.plan(dense, fusion.EAGER)
    assert runs == ["eager"] and skipped["moe-best"] == "hf:llama has no experts (transformers' " + (
        "use_experts_implementation)"
    )


def test_moe_best_variants_run_the_cards_implementation_unfused_and_fused_with_the_same_math(monkeypatch):
    """grouped_mm made unavailable: moe-best runs the eager loop where eager runs transformers'
    default grouped_mm; moe-best+fused runs profuse's silu_mul in that loop; both pass the
    same-math check against float64, and the report says which implementation and why."""
    monkeypatch.setattr(X, "native_grouped_mm", lambda device: NO_GROUPED)
    cfg = S.StepConfig(
        model=tiny_olmoe(), variants=("eager", "moe-best", "moe-best+fused"), trials=2, profile_steps=0
    )
    assert cfg.experts.implementation == X.EAGER
    calls = Counter()
    ops = counting_ops(calls, only=(fusion.SILU_MUL,))
    failed: dict = {}
    variants, _ = S._build_variants(cfg, list(cfg.variants), ops, failed)
    assert not failed
    impls = {v.name: X.implementation_of(v.model) for v in variants}
    assert impls == {"eager": X.GROUPED_MM, "moe-best": X.EAGER, "moe-best+fused": X.EAGER}
    fused = next(v for v in variants if v.name == "moe-best+fused")
    batch = cfg.spec.batch("cpu")
    fused.loss(fused.net, batch).backward()
    assert calls[fusion.SILU_MUL] > 2  # the eager loop: once per expert hit, in each of 2 layers

    checks, names = S._math_stage(cfg, list(cfg.variants), fusion.EAGER, failed, lambda *a: None)
    assert names == list(cfg.variants) and not failed
    assert all(checks[n].passed for n in ("moe-best", "moe-best+fused"))  # against float64
    from profuse.report.step import experts_lines

    (line,) = experts_lines({"config": cfg.to_dict()})
    assert line.startswith("moe-best: transformers' eager experts") and NO_GROUPED in line
    assert line.endswith("eager and fused run transformers' default, grouped_mm")
    assert S.plan(cfg, fusion.EAGER) == (list(cfg.variants), {})  # not the model's default: both run
