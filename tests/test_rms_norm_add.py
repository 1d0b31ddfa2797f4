"""rms_norm_add, the post-norm layouts' h = residual + rms_norm(x) * w (OLMo 2 and 3): output
and every gradient against float64 and against eager in OLMo 2's order (which is checked against
transformers' Olmo2RMSNorm), fp32, bf16 and a bf16 branch on an fp32 stream, the (1 + w) offset,
partial requires_grad, double backward refused (torch.compile: tests/test_gated.py)."""

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


def _run(fn, inputs, dh, needs=(True, True, True)):
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip(inputs, needs)]
    h = fn(*leaves)
    h.backward(dh.to(h.dtype))
    return h.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtypes", [(FP32, FP32), (BF16, BF16), (BF16, FP32)], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_against_float64_and_eager(dtypes, offset, device):
    x_dtype, r_dtype = dtypes
    shape = (3, 5, 67)
    x, r = _randn(shape, x_dtype, 1, device, 3.0), _randn(shape, r_dtype, 2, device)
    w = _randn((67,), FP32, 3, device, 0.5)
    dh = _randn(shape, FP32, 4, device)
    inputs = (x, r, w)
    h, grads = _run(lambda *a: B.rms_norm_add(*a, weight_offset=offset), inputs, dh)
    h_e, grads_e = _run(lambda *a: B.rms_norm_add_eager(*a, 1e-6, offset), inputs, dh)
    h_r, grads_r = _run(lambda *a: B.rms_norm_add_reference(*a, 1e-6, offset), [t.double() for t in inputs],
                        dh.double())  # fmt: skip
    assert h.dtype == h_e.dtype == torch.promote_types(x_dtype, r_dtype)
    for got, eager, ref in ((h, h_e, h_r), *zip(grads, grads_e, grads_r)):
        err, err_e = T.relative_error(got, ref), T.relative_error(eager, ref)
        assert err <= T.BACKWARD_TOL[x_dtype], err
        assert err <= SLACK[x_dtype] * max(err_e, T.UNIT_ROUNDOFF[x_dtype]), (err, err_e)


def test_eager_is_olmo2():
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    norm = olmo2.Olmo2RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x, r = _randn((3, 40), BF16, 5, "cpu", 2.0), _randn((3, 40), BF16, 6, "cpu")
    assert torch.equal(B.rms_norm_add_eager(x, r, norm.weight), r + norm(x))


def test_partial_requires_grad_and_refusals(device):
    x, r, w = (
        _randn((4, 24), FP32, 7, device),
        _randn((4, 24), FP32, 8, device),
        _randn((24,), FP32, 9, device),
    )
    dh = _randn((4, 24), FP32, 10, device)
    for needs in ((False, True, False), (True, False, False), (False, False, True)):
        _, grads = _run(B.rms_norm_add, (x, r, w), dh, needs)
        _, want = _run(B.rms_norm_add_reference, (x.double(), r.double(), w.double()), dh.double(), needs)
        for g, e, n in zip(grads, want, needs):
            assert (g is None) == (not n)
            if n:
                assert T.relative_error(g, e) <= 1e-5
    xx = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="double backward") as err:
        torch.autograd.grad(B.rms_norm_add(xx, r, w).sum(), xx, create_graph=True)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="residual has shape"):
        B.rms_norm_add(x, r[:2], w)
