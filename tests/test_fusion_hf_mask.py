"""profuse.fuse's causal mask (profuse.fusion.hf_mask): a plain causal call reaches SDPA with
is_causal=True and no mask, in eager and under torch.compile; every other call builds its mask as
transformers does. Graphs are read from a recording torch.compile backend on the CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusion_cases import ARCHS, labels_for, tiny, tokens  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.errors import UsageError  # noqa: E402
from profuse.fusion.hf import fuse, unfuse  # noqa: E402

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def sdpa_calls(model, **kwargs) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of each attention call in the graph torch.compile traces of a
    forward with `kwargs` (fullgraph: one graph, no breaks)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(**kwargs)
    calls = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in SDPA:
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask is not None, bool(node.kwargs.get("is_causal", False))))
    torch._dynamo.reset()
    return calls


@pytest.mark.parametrize("older_torch", [False, True], ids=["this-torch", "torch-before-2.14"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_plain_causal_call_compiles_to_causal_attention_without_a_mask(arch, older_torch, monkeypatch):
    if older_torch:
        # What transformers sees while compiling on torch < 2.14: every trace looks like an export,
        # and it builds the mask.
        masking_utils = pytest.importorskip("transformers.masking_utils")
        if not hasattr(masking_utils, "is_torchdynamo_exporting"):
            pytest.skip("this transformers does not ask is_torchdynamo_exporting")
        monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling)
    model = tiny(arch, seed=3)
    ids = tokens(3)
    layers = model.config.num_hidden_layers
    own = sdpa_calls(model, input_ids=ids)
    assert len(own) == layers
    if older_torch:
        assert own == [(True, False)] * layers  # the premise: unfused, attention runs masked
    summary = fuse(model, impl=fusion.EAGER)
    assert summary.causal_mask and "causal mask" in str(summary)
    assert sdpa_calls(model, input_ids=ids) == [(False, True)] * layers


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_causal_mask_change_keeps_loss_and_gradients(arch):
    model = tiny(arch, seed=5, tie=True, layers=2)
    ids = tokens(5, batch=3, seq=13)
    labels = labels_for(ids, 5)
    want = model(input_ids=ids, labels=labels).loss
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fuse(model, impl=fusion.HF_EAGER)  # the model's own math: only the mask's route differs
    # aot_eager: dynamo's trace (where the mask's route is decided) and AOT autograd's backward,
    # without inductor's code generation (minutes of C++ builds on 2 cores)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(input_ids=ids, labels=labels).loss
    got.backward()
    torch._dynamo.reset()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip((p.grad for p in model.parameters()), want_grads):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_a_call_with_a_padding_mask_or_positions_builds_its_mask():
    model = tiny("llama", seed=7)
    ids = tokens(7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
    calls = [{"attention_mask": mask}, {"position_ids": positions}]
    with torch.no_grad():
        want = [model(input_ids=ids, **kw).logits for kw in calls]
    want_graphs = [sdpa_calls(model, input_ids=ids, **kw) for kw in calls]
    assert all(masked for masked, _ in want_graphs[0])
    fuse(model, impl=fusion.HF_EAGER)
    with torch.no_grad():
        for kw, logits in zip(calls, want):
            assert torch.equal(model(input_ids=ids, **kw).logits, logits)
    # The same attention calls as transformers' own under torch.compile (its mask, or its choice).
    assert [sdpa_calls(model, input_ids=ids, **kw) for kw in calls] == want_graphs


def test_the_causal_mask_is_left_alone_where_asked_or_where_attention_is_not_sdpa():
    model = tiny("llama", seed=8)
    assert not fuse(model, impl=fusion.EAGER, causal_mask=False).causal_mask
    unfuse(model)
    assert not fuse(model, "silu_mul", impl=fusion.EAGER).causal_mask  # a subset measures that subset
    unfuse(model)
    assert fuse(model, "silu_mul", impl=fusion.EAGER, causal_mask=True).causal_mask
    unfuse(model)
    eager_attention = tiny("llama", seed=8, attn_implementation="eager")
    assert not fuse(eager_attention, impl=fusion.EAGER).causal_mask
    with pytest.raises(UsageError, match="causal_mask takes True or False"):
        fuse(tiny("llama"), impl=fusion.EAGER, causal_mask="yes")


def test_switching_attention_after_fusing_builds_the_mask_again():
    model = tiny("llama", seed=9)
    ids = tokens(9)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    fuse(model, impl=fusion.HF_EAGER)
    model.set_attn_implementation("eager")  # eager attention needs its mask: the own forward runs
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    unfuse(model)
    assert type(model.model) is transformers.LlamaModel
