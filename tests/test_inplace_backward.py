"""inplace_backward: silu_mul writing its input gradients over the saved gate and up (gate_up),
add_rms_norm and rms_norm writing dx over the incoming dy (and a dresidual of its own dtype over
dh). The same values as the out-of-place backward and within the usual bounds of float64; the
buffers really reused; a user's tensors never written by the default, nor a leaf with the flag;
a second backward refused in one line where the saved inputs are gone, correct where not;
torch.compile (functional ops there) gives the same gradients.
"""

from __future__ import annotations

import pytest
import torch

from profuse import blockops as B
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

BF16, FP32 = torch.bfloat16, torch.float32


def _randn(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _silu_grads(gate, up, dout, inplace, packed):
    """(gradient of each leaf, the intermediates handed to the op) for silu_mul of clone()d
    leaves: the clones are intermediates, as a model's projections are."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in ((gate,) if packed else (gate, up))]
    mids = [leaf * 1 if leaf.requires_grad else leaf for leaf in leaves]
    out = B.silu_mul(*mids, inplace_backward=inplace)
    out.backward(dout)
    return [leaf.grad for leaf in leaves], mids


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("shape", [(3, 7, 33), (5, 130)])
def test_silu_mul_pair_inplace_matches_out_of_place_and_float64(dtype, shape, device):
    gate, up = _randn(shape, dtype, 1, device), _randn(shape, dtype, 2, device)
    gate.requires_grad_(), up.requires_grad_()
    dout = _randn(shape, dtype, 3, device)
    plain, _ = _silu_grads(gate, up, dout, False, False)
    grads, mids = _silu_grads(gate, up, dout, True, False)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    B.silu_mul_reference(g64, u64).backward(dout.double())
    for got, want, exact in zip(grads, plain, (g64.grad, u64.grad)):
        assert torch.equal(got, want)  # the same kernel, only the destination differs
        assert T.relative_error(got, exact) <= T.BACKWARD_TOL[dtype]
    # The buffers were reused: the intermediates now hold their own gradients.
    assert torch.equal(mids[0], grads[0]) and torch.equal(mids[1], grads[1])


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_silu_mul_packed_inplace_matches_and_reuses(dtype, device):
    gu = _randn((2, 5, 2 * 37), dtype, 4, device).requires_grad_()
    dout = _randn((2, 5, 37), dtype, 5, device)
    (plain,), _ = _silu_grads(gu, None, dout, False, True)
    (grad,), (mid,) = _silu_grads(gu, None, dout, True, True)
    ref = gu.detach().double().requires_grad_()
    B.silu_mul_reference(ref).backward(dout.double())
    assert torch.equal(grad, plain)
    assert T.relative_error(grad, ref.grad) <= T.BACKWARD_TOL[dtype]
    assert torch.equal(mid, grad)


def test_silu_mul_partial_requires_grad_writes_only_what_it_differentiates(device):
    gate = _randn((4, 19), FP32, 6, device).requires_grad_()
    up = _randn((4, 19), FP32, 7, device)  # a constant: no gradient, never written
    up_before = up.clone()
    dout = _randn((4, 19), FP32, 8, device)
    (dg_plain,), _ = _silu_grads(gate, up, dout, False, False)[0][:1], None
    grads, mids = _silu_grads(gate, up, dout, True, False)
    assert torch.equal(grads[0], dg_plain)
    assert grads[1] is None and torch.equal(mids[1], up_before)


def test_default_and_leaves_are_never_written(device):
    """The default backward leaves every input as it was; with the flag, a leaf (a user's own
    tensor) is not written either, and neither are two views of one storage."""
    for inplace in (False, True):
        gate = _randn((3, 24), FP32, 9, device).requires_grad_()
        up = _randn((3, 24), FP32, 10, device).requires_grad_()
        keep = gate.detach().clone(), up.detach().clone()
        B.silu_mul(gate, up, inplace_backward=inplace).sum().backward()
        assert torch.equal(gate.detach(), keep[0]) and torch.equal(up.detach(), keep[1])
    mid = _randn((3, 48), FP32, 11, device).requires_grad_() * 1
    kept = mid.detach().clone()
    B.silu_mul(mid).sum().backward()  # default: the intermediate is left alone too
    assert torch.equal(mid.detach(), kept)
    x = _randn((3, 24), FP32, 12, device).requires_grad_()
    same = x * 1
    kept = same.detach().clone()
    B.silu_mul(same, same, inplace_backward=True).sum().backward()
    assert torch.equal(same.detach(), kept)
    want = torch.func.grad(lambda t: (torch.nn.functional.silu(t) * t).sum())(x.detach())
    assert T.relative_error(x.grad, want) <= 1e-5


def test_second_backward_refused_in_one_line_with_inplace_and_correct_without(device):
    for packed in (False, True):
        shape = (2, 3, 2 * 9) if packed else (2, 3, 9)
        leaf = _randn(shape, FP32, 13, device).requires_grad_()
        mid = leaf * 1
        args = (mid,) if packed else (mid, mid.detach().clone().requires_grad_() * 1)
        out = B.silu_mul(*args, inplace_backward=True).sum()
        out.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="inplace_backward=True") as err:
            out.backward()
        assert "\n" not in str(err.value)
    leaf = _randn((2, 3, 18), FP32, 14, device).requires_grad_()
    out = B.silu_mul(leaf * 1).sum()
    out.backward(retain_graph=True)
    first = leaf.grad.clone()
    out.backward()
    assert torch.allclose(leaf.grad, 2 * first, rtol=1e-6, atol=0)


def test_something_else_that_saved_gate_fails_loudly(device):
    """With the flag, an op outside profuse that saved gate fails autograd's version check
    rather than reading a gradient as its activation."""
    leaf = _randn((4, 10), FP32, 15, device).requires_grad_()
    gate = leaf * 1
    other = gate * gate  # saves gate
    out = B.silu_mul(gate, gate.detach().clone().requires_grad_() * 1, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other.sum()).backward()


def _norm_grads(op, inplace, x, residual, w, dy, dh):
    leaves = [t.detach().clone().requires_grad_() for t in (x, residual, w) if t is not None]
    if op == "add":
        y, h = B.add_rms_norm(*leaves, inplace_backward=inplace)
        torch.autograd.backward((y, h), (dy.clone(), dh.clone()))
    else:
        y = B.rms_norm(*leaves, inplace_backward=inplace)
        y.backward(dy.clone())
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtypes", [(FP32, FP32), (BF16, BF16), (BF16, FP32)])
def test_norms_inplace_match_out_of_place(dtypes, device):
    x_dtype, r_dtype = dtypes
    shape = (3, 5, 40)
    x, r = _randn(shape, x_dtype, 16, device), _randn(shape, r_dtype, 17, device)
    w = _randn((40,), FP32, 18, device)
    dy = _randn(shape, x_dtype, 19, device)
    dh = _randn(shape, torch.promote_types(x_dtype, r_dtype), 20, device)
    for op, args in (("add", (x, r, w)), ("rms", (x, None, w))):
        plain = _norm_grads(op, False, *args, dy, dh)
        got = _norm_grads(op, True, *args, dy, dh)
        for a, b in zip(got, plain):
            assert torch.equal(a, b)
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    y, h = B.add_rms_norm_reference(x64, r64, w64)
    torch.autograd.backward((y, h), (dy.double(), dh.double()))
    got = _norm_grads("add", True, x, r, w, dy, dh)
    for a, b in zip(got, (x64.grad, r64.grad, w64.grad)):
        assert T.relative_error(a, b) <= max(T.BACKWARD_TOL[a.dtype], T.BACKWARD_TOL[x_dtype])


def test_norm_inplace_reuses_dy_and_default_leaves_it(device):
    x = _randn((6, 32), BF16, 21, device).requires_grad_()
    r = _randn((6, 32), BF16, 22, device).requires_grad_()
    w = _randn((32,), BF16, 23, device).requires_grad_()
    for inplace in (False, True):
        dy, dh = _randn((6, 32), BF16, 24, device), _randn((6, 32), BF16, 25, device)
        kept = dy.clone()
        x.grad = r.grad = w.grad = None
        y, h = B.add_rms_norm(x, r, w, inplace_backward=inplace)
        torch.autograd.backward((y, h), (dy, dh))
        if inplace:
            assert torch.equal(dy, x.grad)  # dx was written over dy
        else:
            assert torch.equal(dy, kept)
    # A second backward through the norms stays correct: it gets new gradients.
    x.grad = None
    y, h = B.add_rms_norm(x, r, w, inplace_backward=True)
    loss = y.float().pow(2).sum() + h.float().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.allclose(x.grad.float(), 2 * first.float(), rtol=1e-2)


def test_compile_with_inplace_flag_gives_the_same_gradients(device):
    def block(gu, x, r, w):
        a = B.silu_mul(gu * 1, inplace_backward=True)
        y, h = B.add_rms_norm(x, r, w, inplace_backward=True)
        return a.sum() + (y * y).sum() + h.sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    inputs = [_randn((2, 3, 16), FP32, 26, device), _randn((2, 3, 8), FP32, 27, device),
              _randn((2, 3, 8), FP32, 28, device), _randn((8,), FP32, 29, device)]  # fmt: skip
    results = []
    for fn in (compiled, block):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).backward()
        results.append([leaf.grad for leaf in leaves])
    for c, e in zip(*results):
        assert T.relative_error(c, e) <= 1e-6
