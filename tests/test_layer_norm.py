"""layer_norm (profuse.blockops.layer_norm: kernels/layer_norm.py): y and every gradient (x, weight,
bias) against float64 and against nn.LayerNorm's own F.layer_norm in the same dtypes, with and
without a bias, strided rows read in place, an fp32 weight on bf16 rows (amp), partial
requires_grad, poisoned allocations, a bitwise dweight and dbias, torch.compile without a graph
break, and the refusals.

Tolerance table: relative error ||out - ref|| / ||ref|| against float64, in the output's dtype
(profuse.tail.FORWARD_TOL for y, BACKWARD_TOL for the gradients), as tests/test_rms_norm.py:

    dtype   u       FORWARD_TOL    BACKWARD_TOL   why
    bf16    2^-8    8u = 3.1e-2    16u = 6.3e-2   fp32 inside, each output rounded once (~0.5u;
    fp16    2^-11   8u = 3.9e-3    16u = 7.8e-3   ~1u under the interpreter, whose casts
    fp32    2^-24   1e-5 (floor)   1e-5 (floor)   truncate); dx adds two row sums, dweight and
                                                  dbias a column sum (~log2(N) u each)
Over 5 seeds x these shapes x the dtype pairs, with and without a bias (CPU, interpreter), the
worst error was 1.07u (dbias, bf16) in 16-bit and 1.83u (dweight) in fp32: the tables hold 7x
that and more, and a dropped term (the mean, the bias, a row sum) is O(1) off.

No worse than eager: err(triton) <= SLACK * max(err(eager), u), output by output, the block ops'
SLACK: F.layer_norm also computes in fp32 and rounds once, so the two differ by the order of
their sums; over the same runs the worst ratio was 1.07 in 16-bit and 1.46 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from profuse import blockops as B
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from conftest import PoisonedTorch  # noqa: E402

from profuse.kernels import layer_norm as LN  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# One row, a prime width, a width that is no power of two over 3-D rows, a narrow prime width.
SHAPES = [(1, 131), (5, 760), (2, 3, 97), (7, 33)]
SLACK = {BF16: 1.5, FP16: 1.5, FP32: 3.0}
EPS = 1e-5
DTYPE_PAIRS = [(BF16, BF16), (FP16, FP16), (FP32, FP32), (BF16, FP32)]


@pytest.fixture
def poisoned_ln(monkeypatch):
    """layer_norm's launchers allocate NaN-filled: an element a kernel forgets cannot pass."""
    monkeypatch.setattr(LN, "torch", PoisonedTorch())


def inputs(shape, x_dtype, w_dtype, device, seed=0):
    """(x, weight, bias, dy): x ~ N(0.5, 1) (a mean to subtract), dy ~ N(0, 1), weight ~ 1 + N(0,
    0.1^2), bias ~ N(0, 0.3^2); never zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = (0.5 + torch.randn(shape, generator=gen)).to(device=device, dtype=x_dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=w_dtype)
    b = (0.3 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=w_dtype)
    return x, w, b, torch.randn(shape, generator=gen).to(device=device, dtype=x_dtype)


def run(fn, x, w, b, dy, requires=(True, True, True), dtype=None):
    """(y, dx, dweight, dbias) of fn; None for a gradient not required (or no bias)."""
    leaves = [None if t is None else (t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_(r)
              for t, r in zip((x, w, b), requires)]  # fmt: skip
    y = fn(*leaves, EPS)
    y.backward(dy.to(y.dtype))
    return y.detach(), *(None if leaf is None else leaf.grad for leaf in leaves)


def check(name, out, eager, ref, tol) -> None:
    dtype = out.dtype
    err, eager_err = T.relative_error(out, ref), T.relative_error(eager, ref)
    assert err <= tol[dtype], f"{name}: rel err {err:.2e} > tol {tol[dtype]:.0e}"
    assert err <= SLACK[dtype] * max(eager_err, T.UNIT_ROUNDOFF[dtype]), (
        f"{name}: rel err {err:.2e} vs eager's {eager_err:.2e}: worse than eager in {dtype}"
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_and_eager(shape, dtypes, bias, device, poisoned_ln):
    x, w, b, dy = inputs(shape, *dtypes, device, seed=1)
    b = b if bias else None
    got = run(B.layer_norm, x, w, b, dy)
    eager = run(B.layer_norm_eager, x, w, b, dy)
    ref = run(B.layer_norm_reference, x, w, b, dy, dtype=torch.float64)
    y = got[0]
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert got[1].dtype == x.dtype and got[2].dtype == w.dtype
    tols = (T.FORWARD_TOL, T.BACKWARD_TOL, T.BACKWARD_TOL, T.BACKWARD_TOL)
    for name, g, e, r, tol in zip(("y", "dx", "dweight", "dbias"), got, eager, ref, tols):
        if r is None:
            assert g is None, name
            continue
        check(name, g, e, r, tol)


def test_strided_rows_and_a_broadcast_gradient(device, poisoned_ln):
    """x the first 37 columns of (3, 4, 50) rows (row stride 50, read in place) and dy a stride-0
    broadcast (made contiguous for the kernel): y and every gradient still match float64."""
    base = torch.randn(3, 4, 50, device=device) + 0.5
    _, w, b, _ = inputs((3, 4, 37), FP32, FP32, device, seed=2)
    dy = torch.randn(37, device=device).expand(3, 4, 37)
    x = base[..., :37]
    assert not x.is_contiguous()
    got = run(B.layer_norm, x, w, b, dy)
    ref = run(B.layer_norm_reference, x, w, b, dy, dtype=torch.float64)
    for g, r in zip(got, ref):
        assert T.relative_error(g, r) <= 1e-5


@pytest.mark.parametrize(
    "requires",
    [(True, False, False), (False, True, False), (False, False, True)],
    ids=["x", "weight", "bias"],
)
def test_partial_requires_grad(requires, device, poisoned_ln):
    x, w, b, dy = inputs((4, 24), FP32, FP32, device, seed=3)
    got = run(B.layer_norm, x, w, b, dy, requires)
    ref = run(B.layer_norm_reference, x, w, b, dy, requires, dtype=torch.float64)
    for g, r, wanted in zip(got[1:], ref[1:], requires):
        assert (g is not None) == wanted
        if wanted:
            assert T.relative_error(g, r) <= 1e-5


def test_dweight_and_dbias_are_bitwise_repeatable(device):
    x, w, b, dy = inputs((37, 64), BF16, FP32, device, seed=4)
    first, second = run(B.layer_norm, x, w, b, dy), run(B.layer_norm, x, w, b, dy)
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


def test_no_grad_gives_a_plain_tensor_and_no_rows_work(device):
    x, w, b, _ = inputs((3, 40), FP32, FP32, device, seed=5)
    with torch.no_grad():
        y = B.layer_norm(x.requires_grad_(), w, b, EPS)
    assert y.grad_fn is None and torch.allclose(y, B.layer_norm_eager(x.detach(), w, b, EPS), atol=1e-6)
    empty = torch.randn(0, 40, device=device, requires_grad=True)
    out = B.layer_norm(empty, w, b, EPS)
    out.sum().backward()
    assert out.shape == (0, 40) and empty.grad.shape == (0, 40)


def test_bad_arguments_and_double_backward_are_one_line_errors(device):
    x, w, b, _ = inputs((3, 40), FP32, FP32, device, seed=6)
    for args, says in (
        ((x, w[:39], b), "weight has shape"),
        ((x, w, b[:39]), "bias must be (40,)"),
        ((x.double(), w, b), "x has dtype"),
        ((x, w, "b"), "bias must be a torch.Tensor or None"),
    ):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            B.layer_norm(*args, EPS)
    with pytest.raises(ValueError, match="at most"):
        wide = LN.MAX_COLS + 1
        B.layer_norm(torch.randn(1, wide, device=device), torch.ones(wide, device=device), None, EPS)
    xg = x.clone().requires_grad_()
    y = B.layer_norm(xg, w, b, EPS)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.pow(2).sum(), xg, create_graph=True)


def test_compile_fullgraph_calls_the_custom_ops(device):
    x, w, b, dy = inputs((3, 40), FP32, FP32, device, seed=7)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w, b):
        return B.layer_norm(x, w, b, EPS)

    y = f(*leaves)
    y.backward(dy)
    ref = run(B.layer_norm_reference, x, w, b, dy, dtype=torch.float64)
    assert T.relative_error(y.detach(), ref[0]) <= 1e-5
    for leaf, r in zip(leaves, ref[1:]):
        assert T.relative_error(leaf.grad, r) <= 1e-5
