"""A fused norm's output made again in the backward (kernels/norm_recompute.py,
fusion/hf_recompute.py): bitwise the forward's value; in a fused model the same loss and every
gradient bitwise as with autograd's own saving, y dropped after the forward, made once a norm
however many projections saved it; and nothing changes where it cannot be exact or would take
someone else's saving (outer saved-tensor hooks, activation checkpointing)."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from fusion_cases import labels_for, loss_and_grads, tiny, tokens  # noqa: E402

import profuse  # noqa: E402
from profuse.errors import UsageError  # noqa: E402
from profuse.kernels import HAS_TRITON  # noqa: E402

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse import blockops as B  # noqa: E402
from profuse.kernels import norm_recompute as R  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_recipe_makes_the_forwards_y_bitwise(dtype, offset, device):
    shape = (3, 5, 77)
    x, r = _randn(shape, dtype, 1, device).requires_grad_(), _randn(shape, dtype, 2, device)
    w = (1 + 0.3 * _randn((77,), dtype, 3, device)).requires_grad_()
    y, h = B.add_rms_norm(x, r, w, 1e-6, weight_offset=offset)
    z = B.rms_norm(h, w, 1e-5, weight_offset=offset)
    for out in (y, z):
        made = R.norm_output(*R.recipe(out), out.dtype)
        assert made.shape == out.shape and torch.equal(made, out)
    assert R.recipe(h) is None  # add_rms_norm's other output is the sum, not a norm
    assert R.recipe(x * 2) is None
    with torch.no_grad():
        y.mul_(1)  # written since: the recipe would not give what a reader saw
    assert R.recipe(y) is None


def _fused_pair(dtype, seed):
    model = tiny("llama", seed=seed, layers=2).to(dtype)
    held, made = copy.deepcopy(model), copy.deepcopy(model)
    profuse.fuse(held, recompute=False)
    summary = profuse.fuse(made)
    return held, made, summary


def _inputs_seen(module):
    refs = []
    module.register_forward_hook(lambda mod, args, out: refs.append(weakref.ref(args[0])))
    return refs


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_fused_model_drops_y_and_gives_the_same_loss_and_gradients_bitwise(dtype, monkeypatch):
    held, made, summary = _fused_pair(dtype, seed=5)
    assert summary.recompute and "norm outputs" in str(summary)
    calls = []
    real = R.norm_output
    monkeypatch.setattr(R, "norm_output", lambda *a: calls.append(1) or real(*a))
    ids = tokens(6, seq=7)
    labels = labels_for(ids, 7)
    seen = {
        name: _inputs_seen(m.model.layers[1].mlp.gate_proj) for name, m in (("held", held), ("made", made))
    }
    loss_h, grads_h = loss_and_grads(held, ids, labels)
    assert not calls
    loss_m, grads_m = loss_and_grads(made, ids, labels)
    assert torch.equal(loss_h, loss_m)
    assert grads_h.keys() == grads_m.keys()
    assert all(torch.equal(grads_h[k], grads_m[k]) for k in grads_h)
    # each layer's two norm outputs made once in the backward, however many projections saved them
    assert len(calls) == 2 * len(made.model.layers)
    # y held by the graph until the backward where autograd saves it; gone after the forward here
    held.zero_grad()
    out_h = held(ids, labels=labels)
    out_m = made(ids, labels=labels)
    assert seen["held"][-1]() is not None
    assert seen["made"][-1]() is None
    del out_h, out_m


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5.x renames the switch
def test_outer_saved_tensor_hooks_and_checkpointing_see_every_tensor():
    held, made, _ = _fused_pair(torch.float32, seed=8)
    ids = tokens(9, seq=7)
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    seen = _inputs_seen(made.model.layers[0].self_attn.q_proj)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = made(ids, labels=ids).loss
    assert seen[-1]() is not None and seen[-1]().data_ptr() in saved  # the outer hook saw y
    loss.backward()
    _, want = loss_and_grads(held, ids)
    assert all(torch.equal(p.grad, want[n]) for n, p in made.named_parameters())
    made.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    made.train()
    _, got = loss_and_grads(made, ids)
    assert all(torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6) for n in want)


def test_recompute_takes_a_bool_and_the_model_s_own_math_never_recomputes():
    model = tiny("llama", seed=1)
    with pytest.raises(UsageError, match="recompute takes True or False"):
        profuse.fuse(model, recompute="yes")
    assert not profuse.fuse(copy.deepcopy(model), impl=profuse.fusion.HF_EAGER).recompute
