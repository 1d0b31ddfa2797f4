"""Part C's variants on fair terms: the compile baseline takes the causal-mask fix profuse.fuse
makes for itself (compile-stock keeps transformers' own), read from the graphs torch.compile
traces on the CPU (a recording backend, no clock)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from profuse import fusion
from profuse import step as S
from profuse.model import GPTConfig
from profuse.report.step import format_step, mask_lines

transformers = pytest.importorskip("transformers")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
TINY = GPTConfig(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=8, batch_size=2)


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
    names = ["eager", "compile", "compile-stock", "compile+fused", "compile+loss"]
    cfg = S.StepConfig(model=spec, variants=names, trials=2)
    failed: dict[str, str] = {}
    variants, _ = S._build_variants(cfg, names, fusion.HF_EAGER, failed)
    assert not failed
    by_name = {v.name: v for v in variants}
    ids = spec.batch("cpu", 1)[0]
    layers = spec.n_layer
    assert attention_calls(by_name["eager"].model, ids) == [(True, False)] * layers  # the premise
    assert attention_calls(by_name["compile-stock"].model, ids) == [(True, False)] * layers
    for name in ("compile", "compile+fused", "compile+loss"):  # one route: the ratio is the fusion alone
        assert attention_calls(by_name[name].model, ids) == [(False, True)] * layers, name
    routes = {v.name: v.mask for v in variants}
    assert routes["eager"] is None
    assert routes["compile"].fixed and routes["compile+fused"].fixed and not routes["compile-stock"].fixed
    assert routes["compile+loss"].fixed
    # compile+loss places the loss alone: every norm, SwiGLU and RoPE stays the model's for Inductor
    assert by_name["compile+loss"].fused["counts"] == {"linear_cross_entropy": 1}
    assert set(by_name["compile+fused"].fused["counts"]) > {"linear_cross_entropy", "silu_mul"}
    norms = lambda m: sorted({type(x).__name__ for x in m.modules() if "Norm" in type(x).__name__})
    assert norms(by_name["compile+loss"].model) == norms(by_name["eager"].model) == ["LlamaRMSNorm"]
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
    assert "compile+fused vs compile: both build their mask alike, so the ratio is the fusion alone" in text
    assert "compile+loss vs" not in text  # not run: nothing said of it
    data["loss_over_compile"] = {"ratio": 1.02}
    data["masks"]["compile+loss"] = {
        "fixed": False,
        "note": "profuse.fuse left the mask as the model builds it",
    }
    text = "\n".join(mask_lines(data))
    assert "compile+loss vs compile: NOT the fusion alone" in text
    data["masks"]["compile"] = {"fixed": False, "note": "attention runs as 'eager', not 'sdpa'"}
    assert "compile+fused vs compile: NOT the fusion alone" in "\n".join(mask_lines(data))
    assert mask_lines({"masks": {}}) == []


def test_compile_stock_and_compile_loss_are_asked_for_by_name_and_skipped_for_the_built_in_gpt():
    hf = S.StepConfig(model=hf_tiny())
    assert "compile" in hf.variants and "compile-stock" not in hf.variants
    assert "compile+fused" in hf.variants and "compile+loss" not in hf.variants
    assert S.StepConfig(model=hf_tiny(), variants=("compile-stock",)).variants == ("eager", "compile-stock")
    gpt = S.StepConfig(model=TINY, variants=("compile", "compile-stock", "compile+loss"))
    runs, skipped = S.plan(gpt, fusion.EAGER)
    assert runs == ["eager", "compile"] and "builds no mask" in skipped["compile-stock"]
    assert "has no loss op" in skipped["compile+loss"]
    with pytest.raises(S.UsageError, match="no subset"):  # the spec itself refuses, not only the plan
        gpt.spec.fuse(gpt.spec.build_for("cpu", 0, "amp"), fusion.EAGER, only=("linear_cross_entropy",))
    from profuse.cli.step import build_step_parser

    text = " ".join(build_step_parser().format_help().split())
    assert "compile-stock: torch.compile of the model as transformers ships it" in text
    assert "compile+fused vs compile is the fusion alone" in text


# --------------------------------------------------------------------------------------------
# Every variant's math checked, or marked: torch.compile too
# --------------------------------------------------------------------------------------------


class _Off(torch.nn.Module):
    """A 'compiled' model whose logits are `scale` times the model's (wrong math), or the model
    itself at scale 1: torch.compile's seam without its 10 s a graph on the CPU."""

    def __init__(self, model, scale: float):
        super().__init__()
        self.inner, self.scale = model, scale

    def forward(self, *args, **kwargs):
        logits, loss = self.inner(*args, **kwargs)
        return logits * self.scale, loss


def _stand_in_compile(monkeypatch, scale: float = 1.0):
    monkeypatch.setattr(S._compile, "compile_model", lambda model, cudagraphs=False: _Off(model, scale))


def _no_full_size_check(monkeypatch):
    monkeypatch.setattr(
        S, "_references", lambda *a: ({}, "the same-math check at full size did not run: OOM")
    )


def test_every_row_says_how_its_math_was_checked(monkeypatch):
    _stand_in_compile(monkeypatch)
    cfg = S.StepConfig(model=TINY, variants=("eager", "compile"), trials=2, profile_steps=0)
    res = S.run_step(cfg, ops=fusion.EAGER)
    rows = {k: v.to_dict() for k, v in res.math.items()}
    assert set(rows) == {"eager", "compile"}
    assert rows["compile"]["checked"] and rows["compile"]["passed"]
    assert rows["compile"]["sizes"] == ["full size"]  # the timed shapes, per tensor
    assert rows["compile"]["against"] == ["the unfused model in float64, per tensor"]
    assert "sets each bound" in rows["eager"]["note"]
    data = json.loads(json.dumps(res.to_dict()))
    assert data["math"] == rows and data["verdict"]["unchecked"] == []
    text = format_step(data)
    assert re.search(r"compile  full size against the unfused model in float64, per tensor: passed", text)
    header = next(line for line in text.splitlines() if line.strip().startswith("variant"))
    assert "math" in header
    assert re.search(r"^\s+compile\s.*\s+full(\s|$)", text, re.M)


def test_without_the_full_size_check_compile_is_checked_on_a_small_copy(monkeypatch):
    _stand_in_compile(monkeypatch)
    _no_full_size_check(monkeypatch)
    cfg = S.StepConfig(model=TINY, variants=("eager", "compile"), trials=2, profile_steps=0)
    res = S.run_step(cfg, ops=fusion.EAGER)
    row = res.math["compile"]
    assert row.checked and row.passed and row.sizes == ["small copy"] and row.against == ["float64"]
    assert res.checks["compile"].passed and list(res.comparison.timings) == ["eager", "compile"]
    assert not res.math["eager"].checked and "did not run: OOM" in res.math["eager"].note


def test_a_compiled_variant_with_wrong_math_is_never_timed(monkeypatch):
    _stand_in_compile(monkeypatch, scale=1.05)
    cfg = S.StepConfig(model=TINY, variants=("eager", "compile"), trials=2, profile_steps=0)
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert "same-math check at full size" in res.failed["compile"]
    assert list(res.comparison.timings) == ["eager"]
    assert res.math["compile"].checked and res.math["compile"].passed is False
    _no_full_size_check(monkeypatch)  # the small copy catches it where the full size cannot run
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert "failed the same-math check" in res.failed["compile"] and list(res.comparison.timings) == ["eager"]


def test_the_verdict_names_the_variants_no_check_covered():
    from profuse.verdict import decide, unchecked_variants

    rng = torch.Generator().manual_seed(3)
    times = {n: (base + 0.01 * torch.rand(8, generator=rng)).tolist() for n, base in
             (("eager", 1.0), ("fused", 0.8), ("compile", 0.7))}  # fmt: skip
    data = {
        "config": {"device": "cpu"},
        "comparison": {"baseline": "eager", "timings": {n: {"times_s": t} for n, t in times.items()}},
        "results": {n: {"host_s": None, "speedup": None} for n in times},
        "profiles": {},
        "math": {
            "eager": {"checked": True},
            "fused": {"checked": True},
            "compile": {"checked": False},
        },
    }
    assert unchecked_variants(data) == ["compile"]
    v = decide(data)
    assert v.unchecked == ["compile"] and "compile: math NOT checked" in v.text
    data["math"]["compile"]["checked"] = True
    assert decide(data).unchecked == [] and "NOT checked" not in decide(data).text
    del data["math"]  # a file from before the rows: nothing to say
    assert decide(data).unchecked == []


def test_compile_loss_is_checked_timed_and_reported_against_compile(monkeypatch):
    monkeypatch.setattr(S._compile, "compile_model", lambda model, cudagraphs=False: model)  # the seam
    names = ("eager", "compile", "compile+loss")
    cfg = S.StepConfig(model=hf_tiny(), variants=names, trials=2, profile_steps=0)
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert not res.failed and list(res.comparison.timings) == list(names)
    assert res.check is not None and res.check.passed  # fused's small check is compile+loss's gate
    assert res.math["compile+loss"].checked and res.math["compile+loss"].passed
    assert res.fusion_over_compile is None and res.loss_over_compile is not None
    data = json.loads(json.dumps(res.to_dict()))
    assert data["fused_ops"] == {"compile+loss": {"counts": {"linear_cross_entropy": 1}, "left_unfused": []}}
    text = format_step(data)
    assert "the fused loss alone on top of torch.compile (compile+loss vs compile): " in text
    assert "fusion on top of torch.compile" not in text
    assert "(linear_cross_entropy x1); the rest left to Inductor" in text
    assert not any(line.startswith("fused ops: ") for line in text.splitlines())  # no fused variant ran
    assert "compile+loss vs compile: both build their mask alike" in text


def test_a_host_bound_variant_says_where_its_cpu_time_goes():
    from profuse.report.step import HOST_OPS_SHOWN, host_lines

    ops = {f"op{i}": {"ms": 0.1 * i, "calls": 2.0 * i} for i in range(1, 9)}
    data = {
        "results": {"eager": {"host_bound": False}, "fused": {"host_bound": True}},
        "profiles": {"eager": {"host_ops": ops}, "fused": {"host_ops": ops}},
    }
    (line,) = host_lines(data)  # eager is not host-bound: nothing said of it
    head = "fused is host-bound; its most self CPU time a profiled step: op8 0.80 ms (16 calls), op7 "
    assert line.startswith(head)
    assert line.count(" ms (") == HOST_OPS_SHOWN and "op3 " not in line  # the top ones, largest first
    data["verdict"] = {"bounds": {"eager": "launch-bound", "fused": "device-bound"}}  # the table's word
    (line,) = host_lines(data)
    assert line.startswith("eager is launch-bound; its most self CPU time a profiled step: op8 0.80 ms")
    data["profiles"]["eager"] = {}  # a file from before host_ops: nothing to say
    assert host_lines(data) == []
