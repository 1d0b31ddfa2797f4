"""A fused model's places write input gradients over buffers they own (blockops'
inplace_backward), and only those: the projections' outputs of the MLP, the gradients autograd
hands the layers' norms; never a tensor a hook holds, never the final norm's incoming gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from fusion_cases import has_kernel, labels_for, loss_and_grads, tiny, tokens  # noqa: E402

from profuse import fusion  # noqa: E402
from profuse.fusion import hf_ops  # noqa: E402


def _spying(seen: list, monkeypatch) -> fusion.BlockOps:
    """FUSED's layer ops, each recording whether it was asked to write over its inputs, counted as
    profuse's kernels (so bound_op passes the flag) while running the eager math."""

    def spy(op, fn):
        def call(*args, inplace_backward=False, **kwargs):
            seen.append((op, inplace_backward))
            return fn(*args, **kwargs)

        monkeypatch.setitem(hf_ops._KERNEL_MODULES, call, "profuse.blockops")
        return call

    eager = fusion.EAGER
    return dataclasses.replace(
        eager,
        silu_mul=spy(fusion.SILU_MUL, eager.silu_mul),
        add_rms_norm=spy(fusion.ADD_RMS_NORM, eager.add_rms_norm),
        rms_norm=spy(fusion.RMS_NORM, eager.rms_norm),
        name="spying",
    )


def test_layer_places_own_their_buffers_and_the_final_norm_does_not(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spies stand for kernels, which run here
    seen: list = []
    model = tiny("llama", layers=2)
    fusion.fuse(model, impl=_spying(seen, monkeypatch))
    ids = tokens(0)
    model(ids, labels=ids).loss.backward()
    layers = 2
    assert seen.count((fusion.SILU_MUL, True)) == layers
    assert seen.count((fusion.RMS_NORM, True)) == 1  # layer 0's input norm
    # 2 norms a layer after an add, less layer 0's input norm; the final norm's is not owned
    assert seen.count((fusion.ADD_RMS_NORM, True)) == 2 * layers - 1
    assert seen.count((fusion.ADD_RMS_NORM, False)) == 1


def test_a_hook_holding_a_projection_output_keeps_silu_mul_out_of_place(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen: list = []
    model = tiny("llama", layers=2)
    fusion.fuse(model, impl=_spying(seen, monkeypatch))
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, out: None)
    ids = tokens(1)
    model(ids, labels=ids).loss.backward()
    assert [flag for op, flag in seen if op == fusion.SILU_MUL] == [True, False]


@pytest.mark.skipif(not has_kernel(fusion.SILU_MUL), reason="needs the Triton kernels")
def test_with_the_kernels_a_held_output_survives_the_backward_and_gradients_match():
    """The real kernels through the interpreter: what a hook kept is the forward's value after the
    backward, and the fused model's loss and gradients match the unfused model's."""
    model = tiny("llama", layers=2)
    reference = tiny("llama", layers=2)
    ids = tokens(2)
    labels = labels_for(ids, 2)
    want_loss, want = loss_and_grads(reference, ids, labels)
    fusion.fuse(model)
    kept = {}

    def keep(module, args, out):
        kept["held"], kept["copy"] = out, out.detach().clone()

    model.model.layers[0].mlp.gate_proj.register_forward_hook(keep)
    loss, grads = loss_and_grads(model, ids, labels)
    assert torch.equal(kept["held"], kept["copy"])
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
