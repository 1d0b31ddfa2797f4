"""Part C's variants on fair terms: the compile baseline takes the causal-mask fix profuse.fuse
makes for itself (compile-stock keeps transformers' own), read from the graphs torch.compile
traces on the CPU (a recording backend, no clock)."""

from __future__ import annotations

import pytest
import torch

from profuse import fusion
from profuse import step as S
from profuse.model import GPTConfig
from profuse.report.step import mask_lines

transformers = pytest.importorskip("transformers")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)


def hf_tiny():
    from profuse.models import model_spec

    return model_spec("hf:llama", "tiny", batch_size=2, seq_len=12)


def attention_calls(model, ids) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of each SDPA call in the graph torch.compile traces of `model`'s
    forward on `ids` (fullgraph: one graph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids)
    torch._dynamo.reset()
    calls = []
    for node in (n for gm in graphs for n in gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA:
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            calls.append((mask is not None, bool(node.kwargs.get("is_causal", False))))
    return calls


@pytest.fixture
def older_torch(monkeypatch):
    """What transformers sees while compiling on torch < 2.14: every trace looks like an export,
    and it builds the (B, 1, T, T) mask."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking_utils, "is_torchdynamo_exporting"):
        pytest.skip("this transformers does not ask is_torchdynamo_exporting")
    monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling)


def test_compile_takes_the_mask_fix_and_compile_stock_keeps_transformers_own(older_torch):
    spec = hf_tiny()
    names = ["eager", "compile", "compile-stock", "compile+fused"]
    cfg = S.StepConfig(model=spec, variants=names, trials=2)
    failed: dict[str, str] = {}
    variants, _ = S._build_variants(cfg, names, fusion.HF_EAGER, failed)
    assert not failed
    by_name = {v.name: v for v in variants}
    ids = spec.batch("cpu", 1)[0]
    layers = spec.n_layer
    assert attention_calls(by_name["eager"].model, ids) == [(True, False)] * layers  # the premise
    assert attention_calls(by_name["compile-stock"].model, ids) == [(True, False)] * layers
    for name in ("compile", "compile+fused"):  # the same route: the ratio is the fusion alone
        assert attention_calls(by_name[name].model, ids) == [(False, True)] * layers, name
    routes = {v.name: v.mask for v in variants}
    assert routes["eager"] is None
    assert routes["compile"].fixed and routes["compile+fused"].fixed and not routes["compile-stock"].fixed
    assert "transformers' own" in routes["compile-stock"].note
    # the fix leaves the unfused math alone: eager and the fixed model agree bitwise in eager
    with torch.no_grad():
        want = spec.loss(by_name["eager"].model, spec.batch("cpu", 1))
        got = spec.loss(by_name["compile"].model, spec.batch("cpu", 1))
    assert torch.equal(want, got)


def test_the_report_says_which_compile_has_the_fix_and_what_the_ratio_measures():
    data = {
        "fusion_over_compile": {"ratio": 1.05},
        "masks": {
            "compile": {"fixed": True, "note": ""},
            "compile-stock": {"fixed": False, "note": "transformers' own"},
            "compile+fused": {"fixed": True, "note": ""},
        },
    }
    text = "\n".join(mask_lines(data))
    assert "compile, compile+fused with profuse's fix" in text
    assert "compile-stock as the model builds it (transformers' own)" in text
    assert "the ratio is the fusion alone" in text
    data["masks"]["compile"] = {"fixed": False, "note": "attention runs as 'eager', not 'sdpa'"}
    assert "NOT the fusion alone" in "\n".join(mask_lines(data))
    assert mask_lines({"masks": {}}) == []


def test_compile_stock_is_asked_for_by_name_and_skipped_for_the_built_in_gpt():
    hf = S.StepConfig(model=hf_tiny())
    assert "compile" in hf.variants and "compile-stock" not in hf.variants
    assert S.StepConfig(model=hf_tiny(), variants=("compile-stock",)).variants == ("eager", "compile-stock")
    gpt = S.StepConfig(model=TINY, variants=("compile", "compile-stock"))
    runs, skipped = S.plan(gpt, fusion.EAGER)
    assert runs == ["eager", "compile"] and "builds no mask" in skipped["compile-stock"]
    from profuse.cli.step import build_step_parser

    text = " ".join(build_step_parser().format_help().split())
    assert "compile-stock: torch.compile of the model as transformers ships it" in text
    assert "compile+fused vs compile is the fusion alone" in text
