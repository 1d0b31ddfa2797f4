"""RMSNorm with a (1 + w) offset, Gemma's: rms_norm and add_rms_norm with weight_offset=1.0,
outputs and every gradient against float64 and against eager in Gemma's order (fp32 throughout,
one cast), which is transformers' GemmaRMSNorm itself; fp32 and bf16, odd widths, a bf16 branch
on an fp32 stream, partial requires_grad."""

from __future__ import annotations

import pytest
import torch

from profuse import blockops as B
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

BF16, FP32 = torch.bfloat16, torch.float32
SLACK = {BF16: 1.5, FP32: 3.0}


def _randn(shape, dtype, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def _grads(fn, inputs, douts):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [d.to(o.dtype) for o, d in zip(outs, douts)])
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _assert_close(got, eager, ref, dtype, what):
    err, err_e = T.relative_error(got, ref), T.relative_error(eager, ref)
    tol = T.BACKWARD_TOL[dtype]
    assert err <= tol and err <= SLACK[dtype] * max(err_e, T.UNIT_ROUNDOFF[dtype]), (what, err, err_e)


@pytest.mark.parametrize("dtypes", [(FP32, FP32, FP32), (BF16, BF16, BF16), (BF16, FP32, FP32)])
@pytest.mark.parametrize("shape", [(3, 5, 67), (4, 256)])
def test_offset_norms_against_float64_and_gemma_order(dtypes, shape, device):
    x_dtype, r_dtype, w_dtype = dtypes
    x, r = _randn(shape, x_dtype, 1, device), _randn(shape, r_dtype, 2, device)
    w = _randn(shape[-1:], w_dtype, 3, device, 0.3)  # Gemma's weights sit near 0: (1 + w) near 1
    dy, dh = _randn(shape, FP32, 4, device), _randn(shape, FP32, 5, device)
    kw = dict(weight_offset=1.0)
    cases = [
        ("rms_norm", (x, w), (dy,), lambda *a: B.rms_norm(*a, **kw),
         lambda *a: B.rms_norm_eager(*a, 1e-6, 1.0), lambda *a: B.rms_norm_reference(*a, 1e-6, 1.0)),
        ("add_rms_norm", (x, r, w), (dy, dh), lambda *a: B.add_rms_norm(*a, **kw),
         lambda *a: B.add_rms_norm_eager(*a, 1e-6, 1.0), lambda *a: B.add_rms_norm_reference(*a, 1e-6, 1.0)),
    ]  # fmt: skip
    for name, inputs, douts, fused, eager, ref in cases:
        outs, grads = _grads(fused, inputs, douts)
        outs_e, grads_e = _grads(eager, inputs, douts)
        outs_r, grads_r = _grads(ref, [t.double() for t in inputs], [d.double() for d in douts])
        for o, oe, orf in zip(outs, outs_e, outs_r):
            _assert_close(o, oe, orf, x_dtype, f"{name} out")
        for g, ge, gr in zip(grads, grads_e, grads_r):
            _assert_close(g, ge, gr, x_dtype, f"{name} grad")


def test_offset_eager_is_transformers_gemma_rmsnorm():
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    norm = gemma.GemmaRMSNorm(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = _randn((3, 40), BF16, 6, "cpu", 3.0)
    assert torch.equal(B.rms_norm_eager(x, norm.weight, 1e-6, 1.0), norm(x))
    fused = B.rms_norm(x, norm.weight.detach(), 1e-6, weight_offset=1.0)
    assert T.relative_error(fused, B.rms_norm_reference(x, norm.weight.detach(), 1e-6, 1.0)) <= 2**-7


def test_offset_zero_is_the_plain_norm_and_weight_only_gradient(device):
    x = _randn((4, 48), FP32, 7, device)
    w = _randn((48,), FP32, 8, device).requires_grad_()
    assert torch.equal(B.rms_norm(x, w.detach(), weight_offset=0.0), B.rms_norm(x, w.detach()))
    y = B.rms_norm(x, w, weight_offset=1.0)  # x needs no gradient: dweight alone
    y.backward(torch.ones_like(y))
    ref = w.detach().double().requires_grad_()
    B.rms_norm_reference(x.double(), ref, 1e-6, 1.0).sum().backward()
    assert T.relative_error(w.grad, ref.grad) <= 1e-5
