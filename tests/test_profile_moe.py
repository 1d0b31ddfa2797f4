"""Part A's profile of a mixture-of-experts step: routing, the experts' activation and the loss
named as shares, by the modules that issued the work (profuse.structure's moe / router / experts
ranges), on tiny OLMoE and Qwen3-MoE steps on the CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")  # transformers >= 5: experts as 3-D weights

from test_fusion_hf_moe import tiny_moe  # noqa: E402
from test_models_experts import tiny_olmoe  # noqa: E402

import profuse  # noqa: E402
from profuse import attribution as A  # noqa: E402
from profuse.attribution import _moe_category, _Place  # noqa: E402
from profuse.models import make_step  # noqa: E402
from profuse.models.hf import HFSpec  # noqa: E402
from profuse.report.profile import format_profile  # noqa: E402
from profuse.structure import role_of  # noqa: E402


def test_moe_modules_have_their_roles_by_structure():
    for family, block in (("qwen2_moe", "mlp"), ("granitemoe", "block_sparse_moe"), ("gpt_oss", "mlp")):
        layer = tiny_moe(family).model.layers[0]
        moe = getattr(layer, block)
        router = moe.gate if hasattr(moe, "gate") else moe.router
        assert (role_of(layer), role_of(moe), role_of(moe.experts), role_of(router)) == (
            "layer",
            "moe",
            "experts",
            "router",
        ), family
        if family == "qwen2_moe":  # the shared expert is a dense MLP; its sigmoid gate a plain Linear
            assert role_of(moe.shared_expert) == "mlp" and role_of(moe.shared_expert_gate) is None


@pytest.mark.parametrize(
    "op, roles, cat, want",
    [
        ("aten::topk", ("router", "moe"), "routing", "routing"),
        ("aten::_softmax", ("router", "moe"), "other", "routing"),  # the softmax over experts
        ("aten::linear", ("router", "moe"), "matmul", "matmul"),  # the router's scores stay matmul
        ("aten::index", ("experts", "moe"), "other", "routing"),  # tokens gathered by expert
        ("aten::sort", ("experts", "moe"), "other", "routing"),
        ("aten::index_add_", ("experts", "moe"), "other", "routing"),
        ("aten::mul", ("experts", "moe"), "memory_bound", "memory_bound"),  # act(gate) x up
        ("aten::_grouped_mm", ("experts", "moe"), "matmul", "matmul"),
        ("aten::mul", ("mlp", "moe"), "memory_bound", "memory_bound"),  # a shared expert's MLP
        ("aten::index_add_", (), "other", "other"),  # an embedding's backward: not routing
        ("aten::sum", ("moe", "layer"), "memory_bound", "routing"),  # the block's combine
    ],
)
def test_moe_work_is_routing_by_the_module_that_issued_it_and_what_it_does(op, roles, cat, want):
    assert _moe_category(cat, _Place(roles), op) == want


def _profile(spec, tmp_path, **kw):
    step = make_step(spec, "cpu")
    return profuse.profile(step, steps=1, warmup=1, out=tmp_path, summary_name=None, **kw)


@pytest.mark.parametrize("family, implementation", [("olmoe", "grouped_mm"), ("qwen3_moe", "eager")])
def test_profile_of_an_moe_step_names_routing_activation_and_loss_shares(tmp_path, family, implementation):
    spec = tiny_olmoe(batch=2, seq=12)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **{k: v for k, v in spec.config.to_dict().items() if k in ("hidden_size", "num_hidden_layers")},
            intermediate_size=40, moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, vocab_size=64, max_position_embeddings=64,
            output_router_logits=True,
        )  # fmt: skip
        spec = HFSpec(config, "tiny", 2, 12)
    spec.config._experts_implementation = implementation
    r = _profile(spec, tmp_path)
    s = r.summary
    assert s.structured and abs(sum(s.shares.values()) - 100) < 1e-6
    assert s.shares["routing"] > 0 and s.shares["loss"] > 0 and s.shares["matmul"] > 0
    found = {c.name: c for c in s.candidates}
    routing, activation = found[A.ROUTING], found[A.EXPERTS_ACTIVATION]
    assert routing.covered_by is None and "where a card's profile shows it pays" in routing.note
    assert activation.covered_by == "silu_mul" and activation.pct > 0
    assert abs(routing.pct - s.shares["routing"]) < 1e-6  # every routing op is the candidate's
    # The experts' work split by what it does: token moves (the gathers, the sort or one-hot by
    # expert, the scatter back, the combine's sum) are routing, the elementwise math the activation.
    moves = [op for op in routing.ops if op.startswith("aten::") and A._MOVES_TOKENS.search(op)]
    assert moves and not any(A._MOVES_TOKENS.search(op) for op in activation.ops if op.startswith("aten::"))
    assert {"aten::silu", "aten::mul"} <= set(activation.ops)
    assert A.ACTIVATION_MUL not in found  # no dense MLP here: the experts' mul is theirs
    text = format_profile(r)
    assert "MoE routing (top-k, permutes)" in text and "experts' activation x mul" in text


def test_a_dense_step_has_no_routing_share_and_prints_none(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    r = _profile(HFSpec(config, "tiny", 1, 8), tmp_path)
    assert r.summary.shares["routing"] == 0
    assert {c.name for c in r.summary.candidates} & {A.ROUTING, A.EXPERTS_ACTIVATION} == set()
    assert "MoE routing" not in format_profile(r)
    assert torch.is_grad_enabled()
