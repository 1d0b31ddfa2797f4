"""The block ops (profuse.blockops: kernels/swiglu.py, kernels/add_rms_norm.py): outputs and every
gradient against float64 and against eager in the same dtypes, strided and packed gate/up,
mixed dtypes, gradients through either output, partial requires_grad, bitwise dweight, every
launch candidate, torch.compile without a graph break, argument errors, and the plan cache.

Tolerance table: relative error ||out - ref|| / ||ref|| against float64, in the output's dtype
(profuse.tail.FORWARD_TOL for outputs, BACKWARD_TOL for gradients):

    dtype   u       FORWARD_TOL    BACKWARD_TOL   why
    bf16    2^-8    8u = 3.1e-2    16u = 6.3e-2   the kernels round each output once from fp32
    fp16    2^-11   8u = 3.9e-3    16u = 7.8e-3   (~0.5u; ~1u under the interpreter, whose
    fp32    2^-24   1e-5 (floor)   1e-5 (floor)   fp32 -> bf16 cast truncates); h is rounded once
                                                  more before the norm, dh_total adds a row sum
                                                  and dweight a column sum (~log2 N u each)
Over 10 seeds x these 4 shapes x the dtype mixes below, the worst error was 2.1u (dweight, bf16
x with fp32 residual): the tables hold 4-8x that, and a dropped term is orders of magnitude off.

No worse than eager: err(triton) <= SLACK * max(err(eager), u), output by output. In 16-bit
eager rounds after each op (silu, then *; add, then the norm, then the cast) where Triton
rounds once: the worst ratio over the same runs was 1.25 (1.44 for an fp32 dweight from bf16
dy), so 1.5. In fp32 both are fp32 arithmetic in different orders (worst 1.93), so 3. These are
the same SLACK values as tests/test_kernels_backward.py.
N = 1 and 2 are left out of the norm's gradient checks (see tests/test_kernels_backward.py: the
true gradient is a cancellation there).
"""

from __future__ import annotations

import collections

import pytest
import torch

from profuse import blockops as B
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse.kernels import add_rms_norm as ARN  # noqa: E402
from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import configs as C  # noqa: E402
from profuse.kernels import swiglu as S  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16, FP32]
SHAPES = [(1, 131), (5, 760), (2, 3, 97), (7, 33)]
SLACK = {BF16: 1.5, FP16: 1.5, FP32: 3.0}
EPS = 1e-6
# (x, residual, weight) dtypes: one each, bf16 x on an fp32 stream (autocast), and all different.
DTYPE_MIXES = [(BF16, BF16, BF16), (FP16, FP16, FP16), (FP32, FP32, FP32),
               (BF16, FP32, FP32), (FP32, BF16, FP16)]  # fmt: skip


def _name(dtypes) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


def randn(shape, dtype, gen, device, mean=0.0, std=1.0) -> torch.Tensor:
    """Fresh N(mean, std^2) values, never zeros."""
    return (mean + std * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


def check(name, out, eager, ref, tol) -> None:
    """out within `tol` of float64 and no worse than eager, in out's dtype."""
    dtype = out.dtype
    err, eager_err = T.relative_error(out, ref), T.relative_error(eager, ref)
    assert err <= tol[dtype], f"{name}: rel err {err:.2e} > tol {tol[dtype]:.0e}"
    assert err <= SLACK[dtype] * max(eager_err, T.UNIT_ROUNDOFF[dtype]), (
        f"{name}: rel err {err:.2e} vs eager's {eager_err:.2e}: worse than eager in {dtype}"
    )


# --------------------------------------------------------------------------------------------
# silu_mul
# --------------------------------------------------------------------------------------------


def silu_inputs(shape, dtype, device, seed=0, packed=False):
    """(gate, up) or (gate_up,), and da: N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    *lead, n = shape
    if packed:
        xs = (randn((*lead, 2 * n), dtype, gen, device),)
    else:
        xs = (randn(shape, dtype, gen, device), randn(shape, dtype, gen, device))
    return xs, randn(shape, dtype, gen, device)


def silu_run(fn, xs, da, requires=None, dtype=None):
    """(a, gradient of each input) of fn at xs (cast to `dtype` first); None where an input
    does not require grad."""
    requires = requires or (True,) * len(xs)
    leaves = [(x.detach().to(dtype) if dtype else x.detach().clone()).requires_grad_(req)
              for x, req in zip(xs, requires)]  # fmt: skip
    a = fn(*leaves)
    a.backward(da.to(a.dtype))
    return a.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("form", ["pair", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_mul_matches_float64_and_eager(shape, dtype, form, device, poisoned_blockops):
    xs, da = silu_inputs(shape, dtype, device, packed=form == "packed")
    a, grads = silu_run(B.silu_mul, xs, da)
    a_e, grads_e = silu_run(B.silu_mul_eager, xs, da)
    a_r, grads_r = silu_run(B.silu_mul_reference, xs, da, dtype=torch.float64)
    assert a.shape == shape and a.dtype == dtype
    check("a", a, a_e, a_r, T.FORWARD_TOL)
    for name, g, e, r in zip(("d" + form if form == "packed" else "dgate", "dup"), grads, grads_e, grads_r):
        assert g.shape == r.shape and g.dtype == dtype, name
        check(name, g, e, r, T.BACKWARD_TOL)


def test_silu_mul_pair_reads_strided_halves_in_place(device, monkeypatch):
    """gate and up as the two halves of one (B, T, 2F) leaf: the kernel gets views into it (row
    stride 2F, no copy), and the gradient lands in the right halves."""
    n = 37
    (gu,), da = silu_inputs((2, 3, n), torch.float32, device, seed=1, packed=True)
    seen = []
    forward = S._forward

    def spy(g, u, u_offset, *rest):
        seen.append((g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), u_offset))
        return forward(g, u, u_offset, *rest)

    monkeypatch.setattr(S, "_forward", spy)
    gu.requires_grad_()
    g, u = gu.chunk(2, -1)
    B.silu_mul(g, u).backward(da)
    assert seen == [(gu.data_ptr(), 2 * n, gu.data_ptr() + n * gu.element_size(), 2 * n, 0)]
    _, (want,) = silu_run(B.silu_mul_reference, (gu,), da, dtype=torch.float64)
    assert gu.grad.shape == (2, 3, 2 * n)
    assert T.relative_error(gu.grad, want) <= T.BACKWARD_TOL[torch.float32]


def test_silu_mul_packed_gradient_is_one_tensor(device, poisoned_blockops):
    """The packed form's backward writes the (..., 2F) gradient itself: autograd goes from the op
    straight to the leaf, with no split and no concatenation in between."""
    (gu,), da = silu_inputs((2, 3, 45), torch.bfloat16, device, seed=2, packed=True)
    gu.requires_grad_()
    a = B.silu_mul(gu)
    ((node, _),) = a.grad_fn.next_functions
    assert type(node).__name__ == "AccumulateGrad" and node.variable is gu
    a.backward(da)
    direct = S.silu_mul_packed_backward(da, gu.detach())
    assert direct.shape == gu.shape and torch.equal(direct, gu.grad)
    _, (want,) = silu_run(B.silu_mul_reference, (gu.detach(),), da, dtype=torch.float64)
    assert T.relative_error(gu.grad, want) <= T.BACKWARD_TOL[torch.bfloat16]


@pytest.mark.parametrize("requires", [(True, False), (False, True)], ids=["only gate", "only up"])
def test_silu_mul_partial_requires_grad(requires, device, poisoned_blockops):
    xs, da = silu_inputs((5, 97), torch.bfloat16, device, seed=3)
    _, grads = silu_run(B.silu_mul, xs, da, requires)
    _, want = silu_run(B.silu_mul_reference, xs, da, dtype=torch.float64)
    for name, req, got, ref in zip(("gate", "up"), requires, grads, want):
        if not req:
            assert got is None, f"{name} does not require grad but got one"
        else:
            assert T.relative_error(got, ref) <= T.BACKWARD_TOL[torch.bfloat16], name
    # The launcher itself allocates and computes nothing that is not asked for.
    g, u = xs
    assert S.silu_mul_backward(da, g, u, (False, False)) == (None, None)
    dg, du = S.silu_mul_backward(da, g, u, requires)
    assert (dg is None) != (du is None)


# (rows, F, config): tiles that cover neither the rows nor the columns evenly.
SILU_CONFIGS = {
    "2x16 tiles, 5 x 40": (5, 40, KernelConfig("tiled", 2, 16, num_warps=1)),
    "1x64 tiles, 3 x 37": (3, 37, KernelConfig("tiled", 1, 64, num_warps=2)),
    "8x8 tiles, 3 x 11": (3, 11, KernelConfig("tiled", 8, 8, num_warps=1)),
}


@pytest.mark.parametrize("case", SILU_CONFIGS)
def test_silu_mul_tiles_with_explicit_configs(case, device, poisoned_blockops):
    rows, n, cfg = SILU_CONFIGS[case]
    (g, u), da = silu_inputs((rows, n), torch.float32, device, seed=4)
    gu = torch.cat([g, u], -1)
    ref = B.silu_mul_reference(g, u)
    _, (dg_r, du_r) = silu_run(B.silu_mul_reference, (g, u), da, dtype=torch.float64)
    tol_f, tol_b = T.FORWARD_TOL[torch.float32], T.BACKWARD_TOL[torch.float32]
    for a in (S.silu_mul_forward(g, u, config=cfg), S.silu_mul_packed_forward(gu, config=cfg)):
        assert T.relative_error(a, ref) <= tol_f
    dg, du = S.silu_mul_backward(da, g, u, config=cfg)
    assert T.relative_error(dg, dg_r) <= tol_b and T.relative_error(du, du_r) <= tol_b
    dgu = S.silu_mul_packed_backward(da, gu, config=cfg)
    assert torch.equal(dgu, torch.cat([dg, du], -1))


def test_silu_mul_no_grad_and_zero_rows(device):
    (g, u), _ = silu_inputs((3, 20), torch.float32, device, seed=5)
    a = B.silu_mul(g, u)
    assert not a.requires_grad and a.grad_fn is None
    empty = torch.randn(2, 0, 32, device=device).requires_grad_()
    out = B.silu_mul(empty)
    assert out.shape == (2, 0, 16)
    out.sum().backward()
    assert empty.grad.shape == (2, 0, 32)


# --------------------------------------------------------------------------------------------
# add_rms_norm
# --------------------------------------------------------------------------------------------


def norm_inputs(shape, dtypes, device, seed=0):
    """x, residual ~ N(0, 1), weight ~ 1 + N(0, 0.1^2), each in its dtype; dy in x's dtype and
    dh in h's dtype ~ N(0, 1)."""
    x_dtype, r_dtype, w_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    x, r = randn(shape, x_dtype, gen, device), randn(shape, r_dtype, gen, device)
    w = randn(shape[-1], w_dtype, gen, device, mean=1.0, std=0.1)
    dy = randn(shape, x_dtype, gen, device)
    dh = randn(shape, torch.promote_types(x_dtype, r_dtype), gen, device)
    return (x, r, w), dy, dh


def norm_run(fn, xs, dy, dh, requires=(True, True, True), dtype=None):
    """(y, h, dx, dresidual, dweight) of fn at xs (cast to `dtype` first), gradients flowing in
    through y (dy) and h (dh), either None; a gradient is None where its input does not require
    one (or gets none)."""
    leaves = [(x.detach().to(dtype) if dtype else x.detach().clone()).requires_grad_(req)
              for x, req in zip(xs, requires)]  # fmt: skip
    y, h = fn(*leaves, EPS)
    outs = [(o, g.to(o.dtype)) for o, g in ((y, dy), (h, dh)) if g is not None]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return (y.detach(), h.detach(), *(leaf.grad for leaf in leaves))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # eager's F.rms_norm
@pytest.mark.parametrize("dtypes", DTYPE_MIXES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm_matches_float64_and_eager(shape, dtypes, device, poisoned_blockops):
    xs, dy, dh = norm_inputs(shape, dtypes, device)
    got = norm_run(B.add_rms_norm, xs, dy, dh)
    eager = norm_run(B.add_rms_norm_eager, xs, dy, dh)
    ref = norm_run(B.add_rms_norm_reference, xs, dy, dh, dtype=torch.float64)
    x_dtype, r_dtype, w_dtype = dtypes
    want_dtypes = (x_dtype, torch.promote_types(x_dtype, r_dtype), x_dtype, r_dtype, w_dtype)
    for name, t, e, r, dt in zip(("y", "h", "dx", "dresidual", "dweight"), got, eager, ref, want_dtypes):
        assert t.shape == r.shape and t.dtype == dt, (name, t.dtype)
        check(name, t, e, r, T.FORWARD_TOL if name in ("y", "h") else T.BACKWARD_TOL)


@pytest.mark.parametrize("x_dtype", [FP32, BF16], ids=str)
def test_add_rms_norm_h_is_the_residual_add(x_dtype, device):
    """h is the new residual stream: in fp32 the same bits as eager's x + residual."""
    (x, r, w), _, _ = norm_inputs((4, 50), (x_dtype, FP32, FP32), device, seed=6)
    _, h = B.add_rms_norm(x, r, w)
    assert h.dtype == FP32 and torch.equal(h, x + r)


@pytest.mark.parametrize("through", ["y", "h"])
@pytest.mark.parametrize("dtypes", [(BF16, FP32, FP32), (FP32, FP32, FP32)], ids=_name)
def test_add_rms_norm_gradient_through_one_output(through, dtypes, device, poisoned_blockops):
    xs, dy, dh = norm_inputs((5, 131), dtypes, device, seed=7)
    dy, dh = (dy, None) if through == "y" else (None, dh)
    got = norm_run(B.add_rms_norm, xs, dy, dh)
    ref = norm_run(B.add_rms_norm_reference, xs, dy, dh, dtype=torch.float64)
    for name, t, r in zip(("dx", "dresidual", "dweight"), got[2:], ref[2:]):
        if through == "h" and name == "dweight":
            assert t is None, "h alone does not depend on the weight"
            continue
        assert T.relative_error(t, r) <= T.BACKWARD_TOL[t.dtype], name
    if through == "h":  # the add's backward: dh itself, in each input's dtype
        assert torch.equal(got[3], dh) and torch.equal(got[2], dh.to(dtypes[0]))


PARTIAL = {
    "only weight": (False, False, True),
    "only x": (True, False, False),
    "only residual": (False, True, False),
    "x and residual": (True, True, False),
}


@pytest.mark.parametrize("dtypes", [(BF16, BF16, BF16), (BF16, FP32, FP32)], ids=_name)
@pytest.mark.parametrize("case", PARTIAL)
def test_add_rms_norm_partial_requires_grad(case, dtypes, device, poisoned_blockops):
    requires = PARTIAL[case]
    xs, dy, dh = norm_inputs((5, 97), dtypes, device, seed=8)
    got = norm_run(B.add_rms_norm, xs, dy, dh, requires)
    ref = norm_run(B.add_rms_norm_reference, xs, dy, dh, dtype=torch.float64)
    for name, req, t, r, dt in zip(("x", "residual", "weight"), requires, got[2:], ref[2:], dtypes):
        if not req:
            assert t is None, f"{name} does not require grad but got one"
        else:
            assert t.dtype == dt and T.relative_error(t, r) <= T.BACKWARD_TOL[dt], name
    if requires[:2] == (True, True):  # dx = dresidual: the same values, each rounded once
        dx, dr = got[2:4]
        same = torch.equal(dx, dr) if dx.dtype == dr.dtype else None
        assert same or (same is None and T.relative_error(dx, dr) <= T.UNIT_ROUNDOFF[dx.dtype])


# (rows, N, config): persistent grids with several tiles per program, partial last tiles.
NORM_CONFIGS = {
    "4 rows per tile, 10 x 37": (10, 37, KernelConfig("fused", 4, 64, num_warps=4, programs=3)),
    "persistent, 7 rows in tiles of 2 over 2 programs": (
        7, 37, KernelConfig("fused", 2, 64, num_warps=2, num_stages=2, programs=2)),
    "one row per tile over 3 programs": (8, 33, KernelConfig("fused", 1, 64, num_warps=1, programs=3)),
    "whole tiles": (8, 64, KernelConfig("fused", 4, 64, num_warps=2, num_stages=3, programs=1)),
}  # fmt: skip


@pytest.mark.parametrize("dtypes", [(BF16, FP32, FP32), (FP16, FP16, FP16)], ids=_name)
@pytest.mark.parametrize("case", NORM_CONFIGS)
def test_add_rms_norm_explicit_configs(case, dtypes, device, poisoned_blockops):
    rows, n, cfg = NORM_CONFIGS[case]
    (x, r, w), dy, dh = norm_inputs((rows, n), dtypes, device, seed=9)
    ref = norm_run(B.add_rms_norm_reference, (x, r, w), dy, dh, dtype=torch.float64)
    y, h, rstd = ARN.add_rms_norm_forward(x, r, w, EPS, config=cfg)
    assert T.relative_error(y, ref[0]) <= T.FORWARD_TOL[y.dtype]
    assert T.relative_error(h, ref[1]) <= T.FORWARD_TOL[h.dtype]
    want_rstd = torch.rsqrt(h.double().pow(2).mean(-1) + EPS)
    assert rstd.shape == (rows,) and T.relative_error(rstd, want_rstd) <= 1e-5
    runs = [ARN.add_rms_norm_backward(dy, dh, h, w, rstd, *dtypes[:2], (True, True, True), config=cfg)
            for _ in range(2)]  # fmt: skip
    for name, t, t2, want in zip(("dx", "dresidual", "dweight"), *runs, ref[2:]):
        assert T.relative_error(t, want) <= T.BACKWARD_TOL[t.dtype], name
        assert torch.equal(t, t2), f"{name} differs between two runs"


@pytest.mark.parametrize("dtypes", [(BF16, BF16, BF16), (BF16, FP32, FP32)], ids=_name)
def test_add_rms_norm_dweight_is_bitwise_repeatable(dtypes, device):
    """Through autograd, with the default plan: the same bits every run (no atomics)."""
    xs, dy, dh = norm_inputs((9, 131), dtypes, device, seed=10)
    runs = [norm_run(B.add_rms_norm, xs, dy, dh) for _ in range(3)]
    for name, *outs in zip(("y", "h", "dx", "dresidual", "dweight"), *runs):
        assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{name} differs between runs"


def test_add_rms_norm_broadcast_dy_and_zero_rows(device):
    """y.sum().backward() hands the kernel a stride-0 dy; no rows gives a zero dweight."""
    xs, _, _ = norm_inputs((4, 50), (FP32, FP32, FP32), device, seed=11)
    leaves = [t.clone().requires_grad_() for t in xs]
    y, _ = B.add_rms_norm(*leaves, EPS)
    y.sum().backward()
    ones = torch.ones(4, 50, device=device)
    ref = norm_run(B.add_rms_norm_reference, xs, ones, None, dtype=torch.float64)
    for name, leaf, want in zip(("x", "residual", "weight"), leaves, ref[2:]):
        assert T.relative_error(leaf.grad, want) <= T.BACKWARD_TOL[FP32], name
    x0, r0 = (torch.randn(2, 0, 16, device=device).requires_grad_() for _ in range(2))
    w0 = torch.randn(16, device=device).requires_grad_()
    y0, h0 = B.add_rms_norm(x0, r0, w0)
    (y0.sum() + h0.sum()).backward()
    assert x0.grad.shape == (2, 0, 16) and torch.equal(w0.grad, torch.zeros_like(w0))


def test_add_rms_norm_no_grad_gives_plain_tensors(device):
    xs, _, _ = norm_inputs((3, 20), (BF16, FP32, FP32), device, seed=12)
    y, h = B.add_rms_norm(*xs)
    assert y.grad_fn is None and h.grad_fn is None and y.dtype == BF16 and h.dtype == FP32


def test_add_rms_norm_tunes_with_and_without_rstd_apart(device, monkeypatch):
    """A forward that stores rstd and one that does not are different kernels: each is tuned
    under its own key, so the pick for one never launches the other."""
    monkeypatch.setattr(ARN, "_FWD_PLANS", A.PlanCache())
    keys = []
    real_pick = ARN.TUNER.pick

    def pick(key, candidates, launch, dev):
        keys.append(key)
        return real_pick(key, candidates, launch, dev)

    monkeypatch.setattr(ARN.TUNER, "pick", pick)
    xs, _, _ = norm_inputs((5, 48), (BF16, FP32, FP32), device, seed=13)
    with torch.no_grad():
        B.add_rms_norm(*xs)
    x, r, w = (t.detach().requires_grad_() for t in xs)
    y, h = B.add_rms_norm(x, r, w)
    (y.float().sum() + h.sum()).backward()
    fwd = [k for k in keys if k[0] == "add_rms_norm_fwd"]
    assert len(fwd) == 2 and fwd[0][:-1] == fwd[1][:-1] and fwd[0] != fwd[1]


# --------------------------------------------------------------------------------------------
# Every launch config the autotuner may pick on a GPU, at real widths but a few rows: the
# autotuner keeps the fastest candidate without checking it, so each one must be right.
# --------------------------------------------------------------------------------------------

CANDIDATE_SHAPES = [(3, 1000), (3, 5120), (2, C.ADD_RMS_NORM_MAX_COLS)]


def _cfg_id(shape, c: KernelConfig) -> str:
    return (f"{shape[0]}x{shape[1]}-{c.kernel}-{c.block_m}x{c.block_n}-w{c.num_warps}-s{c.num_stages}"
            f"-p{c.programs}")  # fmt: skip


def _candidates(which):
    params = []
    for rows, n in CANDIDATE_SHAPES:
        if which == "silu_mul fwd":
            configs = C.silu_mul_candidates(rows, n)
        elif which == "silu_mul bwd":
            configs = C.silu_mul_candidates(rows, n, backward=True)
        elif which == "norm fwd":
            configs = C.add_rms_norm_forward_candidates(rows, n, 132)
        else:
            configs = C.add_rms_norm_backward_candidates(rows, n, 132)
        params += [pytest.param((rows, n), c, id=_cfg_id((rows, n), c)) for c in dict.fromkeys(configs)]
    return params


@pytest.mark.parametrize("shape, cfg", _candidates("silu_mul fwd"))
def test_every_silu_mul_forward_candidate_is_right(shape, cfg, device, poisoned_blockops):
    (gu,), _ = silu_inputs(shape, BF16, device, seed=13, packed=True)
    a = S.silu_mul_packed_forward(gu, config=cfg)
    assert T.relative_error(a, B.silu_mul_reference(gu)) <= T.FORWARD_TOL[BF16]


@pytest.mark.parametrize("shape, cfg", _candidates("silu_mul bwd"))
def test_every_silu_mul_backward_candidate_is_right(shape, cfg, device, poisoned_blockops):
    (gu,), da = silu_inputs(shape, BF16, device, seed=14, packed=True)
    _, (want,) = silu_run(B.silu_mul_reference, (gu,), da, dtype=torch.float64)
    assert T.relative_error(S.silu_mul_packed_backward(da, gu, config=cfg), want) <= T.BACKWARD_TOL[BF16]


@pytest.mark.parametrize("shape, cfg", _candidates("norm fwd"))
def test_every_add_rms_norm_forward_candidate_is_right(shape, cfg, device, poisoned_blockops):
    (x, r, w), _, _ = norm_inputs(shape, (BF16, FP32, FP32), device, seed=15)
    y, h, rstd = ARN.add_rms_norm_forward(x, r, w, EPS, config=cfg)
    y_ref, h_ref = B.add_rms_norm_reference(x, r, w, EPS)
    assert T.relative_error(y, y_ref) <= T.FORWARD_TOL[BF16]
    assert T.relative_error(h, h_ref) <= T.FORWARD_TOL[FP32]
    assert T.relative_error(rstd, torch.rsqrt(h_ref.pow(2).mean(-1) + EPS)) <= 1e-5


@pytest.mark.parametrize("shape, cfg", _candidates("norm bwd"))
def test_every_add_rms_norm_backward_candidate_is_right(shape, cfg, device, poisoned_blockops):
    xs, dy, dh = norm_inputs(shape, (BF16, FP32, FP32), device, seed=16)
    ref = norm_run(B.add_rms_norm_reference, xs, dy, dh, dtype=torch.float64)
    _, h, rstd = ARN.add_rms_norm_forward(*xs, EPS)
    got = ARN.add_rms_norm_backward(dy, dh, h, xs[2], rstd, BF16, FP32, (True, True, True), config=cfg)
    for name, t, want in zip(("dx", "dresidual", "dweight"), got, ref[2:]):
        assert T.relative_error(t, want) <= T.BACKWARD_TOL[t.dtype], name


def test_candidates_are_valid_launches():
    """Whole rows that fit, powers of two, a sensible grid; the favourite first and the tail's
    candidate lists untouched by the block ops' section."""
    for rows in (1, 3, 8192):
        for n in (1, 97, 760, 4096, C.ADD_RMS_NORM_MAX_COLS):
            for cfg in (*C.add_rms_norm_forward_candidates(rows, n, 132),
                        *C.add_rms_norm_backward_candidates(rows, n, 132)):  # fmt: skip
                assert cfg.kernel == "fused" and cfg.block_n >= n and cfg.block_n & (cfg.block_n - 1) == 0
                assert 1 <= cfg.num_warps <= 32 and cfg.programs <= max(1, -(-rows // cfg.block_m)) * 8
            for cfg in C.silu_mul_candidates(rows, n) + C.silu_mul_candidates(rows, n, backward=True):
                assert cfg.kernel == "tiled" and cfg.block_n & (cfg.block_n - 1) == 0
                assert cfg.block_m <= C.pow2_rows(rows) and 1 <= cfg.num_warps <= 32
            for cfg in C.add_rms_norm_backward_candidates(rows, n, 132):
                assert 1 <= cfg.programs <= -(-rows // cfg.block_m)  # every program has a tile


# --------------------------------------------------------------------------------------------
# torch.compile: the custom ops keep the graph whole
# --------------------------------------------------------------------------------------------


def _block_loss(gu, x, r, w, dy, dh):
    """The three entry points as a block uses them, with ops on both sides, in one graph."""
    a = B.silu_mul(gu)  # packed
    b = B.silu_mul(*gu.chunk(2, -1))  # the same halves as two strided views
    y, h = B.add_rms_norm(x, r, w)
    return (a * b).sum() + (y * dy).sum() + (h * dh).sum()


def test_compile_fullgraph_calls_the_custom_ops(device):
    """Dynamo traces through the autograd.Functions without a break (fullgraph=True raises on
    one), AOTAutograd's graphs call profuse's ops, and the result matches the eager call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: dict[str, set] = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind] |= {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch._dynamo.reset()
    compiled = torch.compile(_block_loss, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(17)
    gu = randn((2, 3, 2 * 20), FP32, gen, device)
    (x, r, w), dy, dh = norm_inputs((2, 3, 24), (BF16, FP32, FP32), device, seed=18)
    results = []
    for fn in (compiled, _block_loss):
        leaves = [t.clone().requires_grad_() for t in (gu, x, r, w)]
        loss = fn(*leaves, dy, dh)
        loss.backward()
        results.append((loss.detach(), *(leaf.grad for leaf in leaves)))
    for name, c, e in zip(("loss", "gate_up", "x", "residual", "weight"), *results):
        assert T.relative_error(c, e) <= 1e-6, name
    if device.type == "cuda" and A.HAS_TRITON_OP:
        # Triton ops: AOTAutograd's graphs hold their kernels (for Inductor to launch), no op call.
        for kind in ("forward", "backward"):
            assert any("triton_kernel_wrapper" in t for t in seen[kind]), (kind, seen[kind])
            assert not any("profuse." in t for t in seen[kind]), (kind, seen[kind])
        return
    for op in ("silu_mul_packed_fwd", "silu_mul_fwd", "add_rms_norm_fwd"):
        assert any(f"profuse.{op}" in t for t in seen["forward"]), (op, seen["forward"])
    for op in ("silu_mul_packed_bwd", "silu_mul_bwd", "add_rms_norm_bwd"):
        assert any(f"profuse.{op}" in t for t in seen["backward"]), (op, seen["backward"])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and A.HAS_TRITON_OP), reason="Triton ops under Inductor: CUDA"
)
def test_inductor_launches_the_kernels_itself():
    """On CUDA, Inductor's generated code launches the fused kernels directly (no call into
    profuse's Python per op), with the autotuner's configs, and matches the eager call."""
    from torch._inductor.utils import run_and_get_code

    dev = torch.device("cuda")
    torch._dynamo.reset()
    compiled = torch.compile(_block_loss, fullgraph=True)
    gen = torch.Generator().manual_seed(23)
    gu = randn((4, 33, 2 * 136), BF16, gen, dev)
    (x, r, w), dy, dh = norm_inputs((4, 33, 520), (BF16, FP32, FP32), dev, seed=24)
    results, code = [], []
    for fn in (compiled, _block_loss):
        leaves = [t.clone().requires_grad_() for t in (gu, x, r, w)]

        def run(fn=fn, leaves=leaves):
            loss = fn(*leaves, dy, dh)
            loss.backward()
            return loss

        if fn is compiled:
            loss, code = run_and_get_code(run)
        else:
            loss = run()
        results.append((loss.detach().float(), *(leaf.grad.float() for leaf in leaves)))
    for name, c, e in zip(("loss", "gate_up", "x", "residual", "weight"), *results):
        assert T.relative_error(c, e) <= 1e-2, name
    text = "\n".join(code)
    assert "torch.ops.profuse" not in text
    for kernel in ("_silu_mul_fwd_kernel", "_add_rms_norm_fwd_kernel", "_add_rms_norm_bwd_kernel"):
        assert kernel in text, kernel


# --------------------------------------------------------------------------------------------
# Argument errors: one line, naming the argument
# --------------------------------------------------------------------------------------------


WIDE = C.ADD_RMS_NORM_MAX_COLS + 1  # one column past the whole-row limit


def _t(*shape, dtype=FP32, device="cpu"):
    return torch.randn(*shape).to(dtype=dtype, device=device)


BAD_CALLS = {
    "silu_mul up shape": (lambda: B.silu_mul(_t(3, 8), _t(3, 9)), "up has shape"),
    "silu_mul up dtype": (lambda: B.silu_mul(_t(3, 8), _t(3, 8, dtype=BF16)), "up has dtype"),
    "silu_mul up device": (lambda: B.silu_mul(_t(3, 8), _t(3, 8, device="meta")), "up is on meta"),
    "silu_mul gate dtype": (lambda: B.silu_mul(_t(3, 8, dtype=torch.float64)), "gate has dtype"),
    "silu_mul packed odd": (lambda: B.silu_mul(_t(3, 7)), "even last dimension"),
    "silu_mul not a tensor": (lambda: B.silu_mul(_t(3, 8), 2.0), "up must be a torch.Tensor"),
    "add_rms_norm residual shape": (lambda: B.add_rms_norm(_t(3, 8), _t(4, 8), _t(8)), "residual has shape"),
    "add_rms_norm weight shape": (lambda: B.add_rms_norm(_t(3, 8), _t(3, 8), _t(7)), "weight has shape"),
    "add_rms_norm weight dtype": (
        lambda: B.add_rms_norm(_t(3, 8), _t(3, 8), _t(8, dtype=torch.float64)), "weight has dtype"),
    "add_rms_norm residual device": (
        lambda: B.add_rms_norm(_t(3, 8), _t(3, 8, device="meta"), _t(8)), "residual is on meta"),
    "add_rms_norm weight device": (
        lambda: B.add_rms_norm(_t(3, 8), _t(3, 8), _t(8, device="meta")), "weight is on meta"),
    "add_rms_norm too wide": (
        lambda: B.add_rms_norm(_t(1, WIDE), _t(1, WIDE), _t(WIDE)), f"at most {WIDE - 1} columns"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_raise_one_line_value_error(case):
    call, match = BAD_CALLS[case]
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The plan cache: after the first call for a signature, a call is a lookup and its launches
# --------------------------------------------------------------------------------------------

CANDIDATE_FNS = ("silu_mul_candidates", "add_rms_norm_forward_candidates", "add_rms_norm_backward_candidates")


@pytest.fixture
def counted(monkeypatch):
    """Fresh plan caches and tuners in both kernel modules; counts the candidate lists built."""
    for module in (S, ARN):
        monkeypatch.setattr(module, "_FWD_PLANS", A.PlanCache())
        monkeypatch.setattr(module, "_BWD_PLANS", A.PlanCache())
        monkeypatch.setattr(module, "TUNER", A.Autotuner())
    built = collections.Counter()

    def counting(name):
        fn = getattr(C, name)

        def count(*args, **kwargs):
            built[name] += 1
            return fn(*args, **kwargs)

        return count

    for name in CANDIDATE_FNS:
        monkeypatch.setattr(C, name, counting(name))
    return built


def _one_step(device, seed=19):
    """silu_mul (packed, then the pair form on the same shape) and add_rms_norm, fwd + bwd."""
    (gu,), da = silu_inputs((6, 40), FP32, device, seed=seed, packed=True)
    gu.requires_grad_()
    B.silu_mul(gu).backward(da)
    B.silu_mul(*gu.chunk(2, -1)).backward(da)
    xs, dy, dh = norm_inputs((6, 48), (BF16, FP32, FP32), device, seed=seed)
    leaves = [t.requires_grad_() for t in xs]
    torch.autograd.backward(B.add_rms_norm(*leaves), [dy, dh])


def test_a_second_call_builds_no_candidates(counted, device):
    for _ in range(3):
        _one_step(device)
    # silu_mul: the pair and packed forms share the forward plan; their backwards differ (the
    # packed gradient is written through one pointer), so two backward plans, three lists.
    assert counted == {"silu_mul_candidates": 3, CANDIDATE_FNS[1]: 1, CANDIDATE_FNS[2]: 1}
    assert S._FWD_PLANS.builds == 1 and S._BWD_PLANS.builds == 2
    assert ARN._FWD_PLANS.builds == 1 and ARN._BWD_PLANS.builds == 1
    # Without gradients add_rms_norm stores no rstd: its own plan, made once.
    xs, _, _ = norm_inputs((6, 48), (BF16, FP32, FP32), device)
    with torch.no_grad():
        for _ in range(3):
            B.add_rms_norm(*xs)
    assert counted[CANDIDATE_FNS[1]] == 2 and ARN._FWD_PLANS.builds == 2


def test_plans_made_during_a_graph_capture_are_not_kept(counted, device, monkeypatch):
    """A plan made inside a CUDA-graph capture is untuned: the next call plans again."""
    for module in (S, ARN):
        monkeypatch.setattr(module, "capturing", lambda device: True)
    _one_step(device)
    _one_step(device)
    assert counted == {"silu_mul_candidates": 8, CANDIDATE_FNS[1]: 2, CANDIDATE_FNS[2]: 2}
    for module in (S, ARN):
        assert module._FWD_PLANS.builds == 0 and module._BWD_PLANS.builds == 0


# --------------------------------------------------------------------------------------------
# The compile route: opaque custom ops everywhere, Triton ops on CUDA
# --------------------------------------------------------------------------------------------


def test_compiled_ops_route_by_device():
    """A CPU tensor (the interpreter, which Inductor cannot trace into) gets the opaque custom
    op; a CUDA tensor gets the Triton op where torch has them."""
    cpu, cuda = torch.empty(1), torch.empty(1, device="meta")
    cuda_like = type("CudaLike", (), {"is_cuda": True})()
    for route, name in (
        (ARN._forward_compiled, "add_rms_norm_fwd"),
        (S._packed_backward_compiled, "silu_mul_packed_bwd"),
    ):
        assert route(cpu) is getattr(torch.ops.profuse, name)
        assert route(cuda) is getattr(torch.ops.profuse, name)  # meta: not CUDA
        expected = f"{name}_triton" if A.HAS_TRITON_OP else name
        assert route(cuda_like) is getattr(torch.ops.profuse, expected)


def test_traced_on_real_tensors_runs_the_launcher_once():
    """Called on plain tensors, `traced` is the launcher itself: one call, nothing recorded."""
    calls = []

    def launcher(t, k):
        calls.append((type(t), k, A._TRACING))
        return t * k

    out = A.traced(launcher, torch.ones(3), 2.0)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert calls == [(torch.Tensor, 2.0, False)]


def test_traced_on_fake_tensors_plans_on_real_ones_then_records():
    """Under a fake mode (as torch.compile traces) the launcher runs once on real tensors of
    the same shape, stride and dtype (its plans are made there), then once more with launches
    recorded; the flag is off again afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []

    def launcher(t):
        calls.append((type(t).__name__, tuple(t.shape), t.stride(), t.dtype, A._TRACING))
        return t.new_empty(t.shape)

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(4, 6, dtype=BF16)[:, ::2])
        A.traced(launcher, fake)
    assert calls == [("Tensor", (4, 3), (6, 2), BF16, False), ("FakeTensor", (4, 3), (6, 2), BF16, True)]
    assert A._TRACING is False


def test_compiled_op_without_triton_op_is_the_custom_op_everywhere(monkeypatch):
    """torch before 2.6 has no triton_op: every device gets the opaque custom op, which runs
    the launcher and keeps its fake's shapes."""
    monkeypatch.setattr(A, "HAS_TRITON_OP", False)

    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    route = A.compiled_op("test_twice_no_triton_op", twice, lambda x: x.new_empty(x.shape))
    op = torch.ops.profuse.test_twice_no_triton_op
    assert route(torch.empty(1)) is op
    assert route(type("CudaLike", (), {"is_cuda": True})()) is op
    assert not hasattr(torch.ops.profuse, "test_twice_no_triton_op_triton")
    x = torch.randn(5)
    assert torch.equal(op(x), x * 2)
