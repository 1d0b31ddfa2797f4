"""rope and qk_norm_rope (profuse.rotary: kernels/rope.py): outputs and every gradient against
float64 and against Hugging Face's eager math in the same dtypes, at Hugging Face's strides,
GQA, odd head_dims, one token, cos per batch row or shared, cos and sin whose halves differ,
autocast, poisoned allocations, every launch candidate, torch.compile without a graph break, a
real transformers attention with the op swapped in, the refusals, and a bitwise dweight.

Tolerance table: relative error ||out - ref|| / ||ref|| against float64, in the output's dtype
(profuse.tail.FORWARD_TOL for outputs, BACKWARD_TOL for gradients):

    dtype   u       FORWARD_TOL    BACKWARD_TOL   why
    bf16    2^-8    8u = 3.1e-2    16u = 6.3e-2   the kernels compute in fp32 from the stored
    fp16    2^-11   8u = 3.9e-3    16u = 7.8e-3   inputs and round each output once (~0.5u; ~1u
    fp32    2^-24   1e-5 (floor)   1e-5 (floor)   under the interpreter, whose casts truncate);
                                                  the norm adds a row sum over D, dweight a
                                                  column sum over every token and head
                                                  (~log2(N) u each)
Over 10 seeds x the shapes below x the three dtypes, the worst error was 1.05u for an output,
1.24u for dq or dk and 1.38u for qk_norm_rope's dweight (bf16): the tables hold 6x that and
more, and a dropped or mis-signed term (a sin half swapped, a missing rstd or weight) is off by
O(1).

No worse than eager: err(triton) <= SLACK * max(err(eager), u), output by output. Eager rounds
after every op in 16-bit (q * cos, the cat, * sin, +) where the kernels round once: the worst
ratio over the same runs was 1.38 (a bf16 dweight), so 1.5, the block ops' slack. In fp32 both
are fp32 arithmetic in different orders (worst ratio 2.2, a dweight), so 3.
"""

from __future__ import annotations

import re

import pytest
import torch

from profuse import rotary as R
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from conftest import PoisonedTorch  # noqa: E402

from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import rope as K  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16, FP32]
SLACK = {BF16: 1.5, FP16: 1.5, FP32: 3.0}
EPS = 1e-6

# (B, T, Hq, Hk, D, cos batch, table): GQA 4/2 and 3/1 and none, head_dim 64, 128 and the odd
# even widths 6 and 40 (halves of 3 and 20: no power of two), one token, B = 1, cos shared by the
# batch (1) or one row a batch; "hf" is Hugging Face's rotary table (halves equal), "random"
# N(0, 1) cos and sin whose halves differ, so a kernel that reads one half for both fails.
CASES = {
    "4/2 heads, D 64": (2, 5, 4, 2, 64, 1, "hf"),
    "3/1 heads, D 128, cos per batch": (2, 3, 3, 1, 128, 2, "random"),
    "one token, D 6": (2, 1, 4, 2, 6, 2, "random"),
    "B 1, D 40, 7 tokens": (1, 7, 3, 1, 40, 1, "hf"),
    "2/2 heads, D 6, 3 tokens": (3, 3, 2, 2, 6, 1, "hf"),
}


class PoisonedRope(PoisonedTorch):
    """PoisonedTorch with torch.empty_strided poisoned too (the outputs' (B, T, H, D) storage)."""

    @staticmethod
    def empty_strided(*args, **kwargs):
        return PoisonedTorch._poison(torch.empty_strided(*args, **kwargs))


@pytest.fixture
def poisoned_rope(monkeypatch):
    """Every output, gradient and dw partial kernels/rope.py allocates comes back full of NaN."""
    monkeypatch.setattr(K, "torch", PoisonedRope())


def randn(shape, dtype, gen, device, mean=0.0, std=1.0) -> torch.Tensor:
    """Fresh N(mean, std^2) values, never zeros."""
    return (mean + std * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


def rotary_table(b, t, d, table, gen, device, dtype=FP32):
    """(cos, sin), each (b, t, d): Hugging Face's default rope at random positions, or N(0, 1)."""
    if table == "random":
        return randn((b, t, d), dtype, gen, device), randn((b, t, d), dtype, gen, device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.randint(0, 4096, (b, 1), generator=gen) + torch.arange(t)  # (b, t)
    freqs = pos[..., None].double() * inv_freq  # (b, t, d / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def inputs(case, dtype, device, seed=0, cos_dtype=None, norm=False):
    """(q projection (B, T, Hq*D), k projection, cos, sin, dq_out, dk_out[, q_weight, k_weight]):
    the gradients (B, H, T, D) stored as (B, T, H, D), as SDPA's backward returns them, in
    `dtype` (so float64's reference sees the same values)."""
    b, t, hq, hk, d, cos_b, table = case
    gen = torch.Generator().manual_seed(seed)
    pq, pk = randn((b, t, hq * d), dtype, gen, device), randn((b, t, hk * d), dtype, gen, device)
    cos, sin = rotary_table(cos_b, t, d, table, gen, device, cos_dtype or dtype)
    dq = randn((b, t, hq, d), dtype, gen, device).transpose(1, 2)
    dk = randn((b, t, hk, d), dtype, gen, device).transpose(1, 2)
    out = (pq, pk, cos, sin, dq, dk)
    if norm:
        out += (randn(d, dtype, gen, device, 1.0, 0.1), randn(d, dtype, gen, device, 1.0, 0.1))
    return out


def run(op, case, xs, dtype=None, requires=None):
    """(q_out, k_out, gradient of each leaf) of `op` ("rope" or "qk_norm_rope", through
    `xs[0]` = the function): the projections (and weights) are the leaves, q and k their views
    as Hugging Face makes them; `dtype` casts every input first (float64 for the reference)."""
    fn, pq, pk, cos, sin, dq, dk, *ws = xs
    b, t, hq, hk, d = case[:5]
    cast = (lambda x: x.detach().to(dtype)) if dtype else (lambda x: x.detach().clone())
    requires = requires or (True,) * (2 + len(ws))
    leaves = [cast(x).requires_grad_(r) for x, r in zip((pq, pk, *ws), requires)]
    cos, sin = (cos.to(dtype), sin.to(dtype)) if dtype else (cos, sin)
    if op == "rope":
        q, k = leaves[0].view(b, t, hq, d).transpose(1, 2), leaves[1].view(b, t, hk, d).transpose(1, 2)
        qo, ko = fn(q, k, cos, sin)
    else:
        qo, ko = fn(leaves[0].view(b, t, hq, d), leaves[1].view(b, t, hk, d), *leaves[2:], cos, sin, EPS)
    torch.autograd.backward([qo, ko], [dq.to(qo.dtype), dk.to(ko.dtype)])
    return qo.detach(), ko.detach(), [leaf.grad for leaf in leaves]


def check(name, out, eager, ref, tol) -> None:
    """out within `tol` of float64 and no worse than eager, in out's dtype."""
    dtype = out.dtype
    err, eager_err = T.relative_error(out, ref), T.relative_error(eager, ref)
    assert err <= tol[dtype], f"{name}: rel err {err:.2e} > tol {tol[dtype]:.0e}"
    assert err <= SLACK[dtype] * max(eager_err, T.UNIT_ROUNDOFF[dtype]), (
        f"{name}: rel err {err:.2e} vs eager's {eager_err:.2e}: worse than eager in {dtype}"
    )


OPS = {
    "rope": (R.rope, R.rope_eager, R.rope_reference),
    "qk_norm_rope": (R.qk_norm_rope, R.qk_norm_rope_eager, R.qk_norm_rope_reference),
}
GRAD_NAMES = ("q", "k", "q_weight", "k_weight")


def heads_major(x: torch.Tensor) -> bool:
    """Is x (B, H, T, D) stored as (B, T, H, D)?"""
    b, h, t, d = x.shape
    return x.stride() == (t * h * d, d, h * d, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("op", OPS)
def test_matches_float64_and_eager(op, case, dtype, device, poisoned_rope):
    shape = CASES[case]
    fused, eager, reference = OPS[op]
    xs = inputs(shape, dtype, device, seed=1, norm=op != "rope")
    qo, ko, grads = run(op, shape, (fused, *xs))
    qe, ke, grads_e = run(op, shape, (eager, *xs))
    qr, kr, grads_r = run(op, shape, (reference, *xs), dtype=torch.float64)
    for name, out, e, r in (("q_out", qo, qe, qr), ("k_out", ko, ke, kr)):
        assert out.shape == r.shape and out.dtype == dtype and heads_major(out), name
        check(name, out, e, r, T.FORWARD_TOL)
    for name, g, e, r in zip(GRAD_NAMES, grads, grads_e, grads_r):
        assert g.shape == r.shape and g.dtype == dtype, name
        check("d" + name, g, e, r, T.BACKWARD_TOL)


@pytest.mark.parametrize("op", OPS)
def test_gradients_come_back_in_the_projections_layout(op, device):
    """dq and dk reach the projections' view and transpose stored as they are (no copy in
    autograd's view backward): (B, T, H, D) storage for rope's (B, H, T, D) gradient, a
    contiguous (B, T, H, D) for qk_norm_rope's."""
    shape = CASES["4/2 heads, D 64"]
    b, t, hq, hk, d = shape[:5]
    pq, pk, cos, sin, dq, dk, *ws = inputs(shape, FP32, device, seed=2, norm=op != "rope")
    pq.requires_grad_()
    seen = []
    if op == "rope":
        q = pq.view(b, t, hq, d).transpose(1, 2)
        q.register_hook(lambda g: seen.append(heads_major(g)))
        qo, ko = R.rope(q, pk.view(b, t, hk, d).transpose(1, 2), cos, sin)
    else:
        q = pq.view(b, t, hq, d)
        q.register_hook(lambda g: seen.append(g.is_contiguous()))
        qo, ko = R.qk_norm_rope(q, pk.view(b, t, hk, d), *ws, cos, sin, EPS)
    torch.autograd.backward([qo], [dq])
    assert seen == [True]


# --------------------------------------------------------------------------------------------
# Strides, dtypes, autocast
# --------------------------------------------------------------------------------------------


def test_rope_reads_any_strides_in_place(device, poisoned_rope):
    """q a slice of one fused qkv projection (not dense), k contiguous (B, H, T, D), cos a
    broadcast (expand) over the batch and sin a strided slice: all read in place."""
    b, t, hq, hk, d = 2, 5, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    qkv = randn((b, t, (hq + 2 * hk) * d), FP32, gen, device)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = randn((b, hk, t, d), FP32, gen, device)
    cos = randn((1, t, d), FP32, gen, device).expand(b, t, d)
    sin = randn((b, t, 2 * d), FP32, gen, device)[..., ::2]  # not a unit last stride: copied
    assert not q.is_contiguous() and cos.stride(0) == 0
    qo, ko = R.rope(q, k, cos, sin)
    qr, kr = R.rope_reference(q, k, cos, sin)
    assert T.relative_error(qo, qr) <= T.FORWARD_TOL[FP32] and T.relative_error(ko, kr) <= T.FORWARD_TOL[FP32]


@pytest.mark.parametrize("op", OPS)
def test_autocast_returns_q_dtype_and_promotes_without_it(op, device, poisoned_rope):
    """bf16 q and k with fp32 cos and sin (an fp32 model under bf16 autocast, CPU autocast
    here): under autocast the outputs are bf16 (what attention reads); without it fp32, the
    promotion Hugging Face's math gives. Both within bf16's tolerance of float64, gradients
    in bf16 either way."""
    shape = CASES["4/2 heads, D 64"]
    fused, eager, reference = OPS[op]
    xs = inputs(shape, BF16, device, seed=4, cos_dtype=FP32, norm=op != "rope")
    ref = run(op, shape, (reference, *xs), dtype=torch.float64)
    with torch.autocast(device.type, dtype=BF16):
        qa, ka, grads_a = run(op, shape, (fused, *xs))
        qe, ke, _ = run(op, shape, (eager, *xs))
    assert qe.dtype == FP32  # Hugging Face's own result: fp32, cast again by attention
    qp, kp, grads_p = run(op, shape, (fused, *xs))
    assert (qa.dtype, ka.dtype, qp.dtype, kp.dtype) == (BF16, BF16, FP32, FP32)
    for out, r in ((qa, ref[0]), (ka, ref[1]), (qp, ref[0]), (kp, ref[1])):
        assert T.relative_error(out, r) <= T.FORWARD_TOL[BF16]
    for grads in (grads_a, grads_p):
        for name, g, r in zip(GRAD_NAMES, grads, ref[2]):
            assert g.dtype == BF16 and T.relative_error(g, r) <= T.BACKWARD_TOL[BF16], name


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_keep_dtype_stores_q_dtype_as_olmo2s_cast_back(dtype, device, poisoned_rope):
    """OLMo 2's rotation: fp32 cos and sin, the result cast back to q's dtype. keep_dtype=True
    stores it so without a cast after: the fused op equals the eager one bitwise or within an ulp
    of the dtype, both within its tolerance of float64, the gradients in q's dtype."""
    shape = CASES["3/1 heads, D 128, cos per batch"]
    xs = inputs(shape, dtype, device, seed=12, cos_dtype=FP32)
    ref = run("rope", shape, (R.rope_reference, *xs), dtype=torch.float64)
    keep = lambda f: lambda q, k, c, s_: f(q, k, c, s_, keep_dtype=True)  # noqa: E731
    qf, kf, grads_f = run("rope", shape, (keep(R.rope), *xs))
    qe, ke, grads_e = run("rope", shape, (keep(R.rope_eager), *xs))
    assert (qf.dtype, kf.dtype, qe.dtype, ke.dtype) == (dtype,) * 4
    for name, out, eager, r in (("q", qf, qe, ref[0]), ("k", kf, ke, ref[1])):
        check(name, out, eager, r.to(dtype), T.FORWARD_TOL)
    for name, g, e, r in zip(GRAD_NAMES, grads_f, grads_e, ref[2]):
        assert g.dtype == dtype
        check(f"d{name}", g, e, r.to(dtype), T.BACKWARD_TOL)


def test_qk_norm_rope_output_dtype_promotes_with_the_weight(device):
    """bf16 q and k with fp32 norm weights, no autocast: fp32 out, as Hugging Face's weight * x."""
    shape = CASES["2/2 heads, D 6, 3 tokens"]
    pq, pk, cos, sin, _, _, qw, kw = inputs(shape, BF16, device, seed=5, norm=True)
    b, t, hq, hk, d = shape[:5]
    q, k = pq.view(b, t, hq, d), pk.view(b, t, hk, d)
    qo, ko = R.qk_norm_rope(q, k, qw.float(), kw.float(), cos, sin, EPS)
    qe, ke = R.qk_norm_rope_eager(q, k, qw.float(), kw.float(), cos, sin, EPS)
    assert qo.dtype == qe.dtype == FP32 and ko.dtype == ke.dtype == FP32


# --------------------------------------------------------------------------------------------
# Every launch candidate; partial gradients; no grad; no tokens
# --------------------------------------------------------------------------------------------


def _heads(x, case):
    b, t, hq, hk, d = case[:5]
    return x.view(b, t, -1, d)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_rope_every_tokens_per_program(rows, device, poisoned_rope):
    """1, 2 and 4 tokens a program, over 7 tokens (the last program's tokens partly past the
    end), forward and backward of both ops: the kernels' row loop and its masks."""
    shape = CASES["B 1, D 40, 7 tokens"]
    pq, pk, cos, sin, dq, dk, qw, kw = inputs(shape, FP32, device, seed=6, norm=True)
    q, k = _heads(pq, shape), _heads(pk, shape)
    cfg = KernelConfig("rope", rows, 32, 1, l2="plain")
    qr, kr = R.rope_reference(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    qo, ko = K.rope_forward(q.transpose(1, 2), k.transpose(1, 2), cos, sin, config=cfg)
    gq, gk = K.rope_backward(dq, dk, cos, sin, (FP32, FP32), config=cfg)
    leaves = [t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k)]
    torch.autograd.backward(list(R.rope_reference(*leaves, cos, sin)), [dq.double(), dk.double()])
    nq, nk = K.qk_norm_rope_forward(q, k, qw, kw, cos, sin, EPS, config=cfg)
    nqr, nkr = R.qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS)
    tol_f, tol_b = T.FORWARD_TOL[FP32], T.BACKWARD_TOL[FP32]
    for out, r in ((qo, qr), (ko, kr), (nq, nqr), (nk, nkr)):
        assert T.relative_error(out, r) <= tol_f
    for g, leaf in ((gq, leaves[0]), (gk, leaves[1])):
        assert T.relative_error(g, leaf.grad) <= tol_b


def norm_grads_reference(q, k, qw, kw, cos, sin, dq, dk):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    outs = R.qk_norm_rope_reference(*leaves, cos, sin, EPS)
    torch.autograd.backward(list(outs), [dq.double(), dk.double()])
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("stages", [1, 2])
def test_qk_norm_rope_backward_persistent_grids(programs, stages, device, poisoned_rope):
    """The backward on grids of 1, 3 and 7 programs over 7 tokens (a program takes several, or
    one each), its token loop pipelined or not: every gradient and the dw partials summed."""
    shape = CASES["B 1, D 40, 7 tokens"]
    pq, pk, cos, sin, dq, dk, qw, kw = inputs(shape, FP32, device, seed=7, norm=True)
    q, k = _heads(pq, shape), _heads(pk, shape)
    cfg = KernelConfig("rope", 1, 32, 1, stages, programs, l2="plain")
    gq, gk, dw = K.qk_norm_rope_backward(dq, dk, q, k, qw, kw, cos, sin, EPS, config=cfg)
    want = norm_grads_reference(q, k, qw, kw, cos, sin, dq, dk)
    for name, g, r in zip(GRAD_NAMES, (gq, gk, dw[0], dw[1]), want):
        assert T.relative_error(g, r) <= T.BACKWARD_TOL[FP32], name


def test_candidates_cover_the_models_shapes():
    """Each candidate list is non-empty and its favourite holds whole tokens in 8-32 (forward)
    or 4-16 (the norm's backward) elements a thread at the models' shapes."""
    for hq, hk, d in ((32, 8, 64), (14, 2, 64), (16, 8, 128), (3, 1, 6)):
        for norm in (False, True):
            cands = K.rope_candidates(8192, hq, hk, d // 2, norm)
            assert cands and all(c.block_n >= d // 2 for c in cands)
        bwd = K.norm_backward_candidates(8192, hq, hk, d // 2, 132)
        assert bwd and all(1 <= c.programs <= 8192 for c in bwd)
    lanes = K.token_lanes(32, 8, 32)
    assert 8 <= lanes // (32 * K.rope_candidates(8192, 32, 8, 32, False)[0].num_warps) <= 32


@pytest.mark.parametrize("requires", [(True, False, False, False), (False, False, True, False),
                                      (False, True, False, True)], ids=["only q", "only q_weight",
                                                                        "k and k_weight"])  # fmt: skip
def test_qk_norm_rope_partial_requires_grad(requires, device, poisoned_rope):
    shape = CASES["4/2 heads, D 64"]
    xs = inputs(shape, BF16, device, seed=8, norm=True)
    _, _, grads = run("qk_norm_rope", shape, (R.qk_norm_rope, *xs), requires=requires)
    _, _, want = run("qk_norm_rope", shape, (R.qk_norm_rope_reference, *xs), dtype=torch.float64)
    for name, req, g, r in zip(GRAD_NAMES, requires, grads, want):
        if req:
            assert T.relative_error(g, r) <= T.BACKWARD_TOL[BF16], name
        else:
            assert g is None, name


def test_rope_only_k_requires_grad(device, poisoned_rope):
    shape = CASES["4/2 heads, D 64"]
    xs = inputs(shape, FP16, device, seed=9)
    _, _, (gq, gk) = run("rope", shape, (R.rope, *xs), requires=(False, True))
    _, _, (_, want) = run("rope", shape, (R.rope_reference, *xs), dtype=torch.float64)
    assert gq is None and T.relative_error(gk, want) <= T.BACKWARD_TOL[FP16]


def test_no_grad_gives_plain_tensors_and_no_tokens_work(device):
    shape = CASES["one token, D 6"]
    pq, pk, cos, sin, *_, qw, kw = inputs(shape, FP32, device, seed=10, norm=True)
    q, k = _heads(pq, shape), _heads(pk, shape)
    qo, ko = R.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert qo.grad_fn is None and not qo.requires_grad
    with torch.no_grad():
        qo, _ = R.qk_norm_rope(q.requires_grad_(), k, qw, kw, cos, sin)
    assert qo.grad_fn is None
    # No tokens: empty outputs and gradients, no launch.
    q0 = torch.randn(2, 4, 0, 6, device=device, requires_grad=True)
    k0 = torch.randn(2, 2, 0, 6, device=device, requires_grad=True)
    c0 = torch.randn(1, 0, 6, device=device)
    qo, ko = R.rope(q0, k0, c0, c0)
    (qo.sum() + ko.sum()).backward()
    assert qo.shape == q0.shape and q0.grad.shape == q0.shape


# --------------------------------------------------------------------------------------------
# dweight bitwise repeatable; refusals
# --------------------------------------------------------------------------------------------


def test_qk_norm_rope_dweight_is_bitwise_repeatable(device):
    shape = CASES["3/1 heads, D 128, cos per batch"]
    xs = inputs(shape, BF16, device, seed=11, norm=True)
    runs = [run("qk_norm_rope", shape, (R.qk_norm_rope, *xs))[2] for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(GRAD_NAMES, runs[0], other):
            assert torch.equal(a, b), name


def test_cos_or_sin_requiring_grad_is_refused(device):
    shape = CASES["one token, D 6"]
    pq, pk, cos, sin, *_, qw, kw = inputs(shape, FP32, device, seed=12, norm=True)
    q, k = _heads(pq, shape), _heads(pk, shape)
    for c, s in ((cos.requires_grad_(), sin), (cos.detach(), sin.requires_grad_())):
        with pytest.raises(ValueError, match="no gradient for cos and sin") as info:
            R.rope(q.transpose(1, 2).requires_grad_(), k.transpose(1, 2), c, s)
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError, match="no gradient for cos and sin"):
            R.qk_norm_rope(q, k, qw, kw, c, s)
    with torch.no_grad():  # no gradient is computed at all: nothing to drop
        R.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


@pytest.mark.parametrize("op", OPS)
def test_double_backward_is_refused(op, device):
    shape = CASES["one token, D 6"]
    xs = inputs(shape, FP32, device, seed=13, norm=op != "rope")
    pq, pk = xs[0].requires_grad_(), xs[1]
    b, t, hq, hk, d = shape[:5]
    if op == "rope":
        qo, _ = R.rope(pq.view(b, t, hq, d).transpose(1, 2), pk.view(b, t, hk, d).transpose(1, 2), *xs[2:4])
    else:
        qo, _ = R.qk_norm_rope(pq.view(b, t, hq, d), pk.view(b, t, hk, d), *xs[6:], *xs[2:4])
    eager = "profuse.rotary." + op + "_eager"
    with pytest.raises(
        RuntimeError, match=f"^profuse: {op} does not support double backward.*{re.escape(eager)}"
    ):
        torch.autograd.grad((qo * xs[4]).sum(), pq, create_graph=True)
    (g,) = torch.autograd.grad((qo * xs[4]).sum(), pq)  # first order still works
    assert torch.isfinite(g).all()


def test_bad_arguments_are_one_line_value_errors(device):
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 3, 8)
    bad = {
        "head_dim must be even": (
            torch.randn(1, 4, 3, 7),
            torch.randn(1, 2, 3, 7),
            cos[..., :7],
            cos[..., :7],
        ),
        "not a multiple": (q, torch.randn(1, 3, 3, 8), cos, cos),
        "cos has shape": (q, k, torch.randn(2, 3, 8), cos),
        "contiguous last dimension": (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, cos, cos),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            R.rope(*args)
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# torch.compile, and a real transformers attention
# --------------------------------------------------------------------------------------------


def _attention_like(pq, pk, qw, kw, cos, sin, dq, dk):
    """Both ops as an attention uses them, with torch ops around them, in one graph."""
    b, t = pq.shape[:2]
    q, k = (pq * 1.5).view(b, t, -1, 6), (pk + 0.25).view(b, t, -1, 6)
    r1, r2 = R.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    n1, n2 = R.qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    return (r1 * dq).sum() + (r2 * dk).sum() + (n1 * n2.repeat_interleave(2, 1)).sum()


def test_compile_fullgraph_calls_the_custom_ops(device):
    """Dynamo traces through both autograd.Functions without a break (fullgraph=True raises on
    one), AOTAutograd's graphs call profuse's ops, and the result matches the eager call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: dict[str, set] = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind] |= {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    compiled = torch.compile(_attention_like, backend=backend, fullgraph=True)
    shape = CASES["one token, D 6"]
    pq, pk, cos, sin, dq, dk, qw, kw = inputs(shape, FP32, device, seed=14, norm=True)
    results = []
    for fn in (compiled, _attention_like):
        leaves = [x.clone().requires_grad_() for x in (pq, pk, qw, kw)]
        loss = fn(*leaves, cos, sin, dq, dk)
        loss.backward()
        results.append((loss.detach(), *(leaf.grad for leaf in leaves)))
    for name, c, e in zip(("loss", *GRAD_NAMES), *results):
        assert T.relative_error(c, e) <= 1e-6, name
    if device.type == "cuda" and A.HAS_TRITON_OP:
        for kind in ("forward", "backward"):
            assert any("triton_kernel_wrapper" in t for t in seen[kind]), (kind, seen[kind])
        return
    for op in ("rope_fwd", "qk_norm_rope_fwd"):
        assert any(f"profuse.{op}" in t for t in seen["forward"]), (op, seen["forward"])
    for op in ("rope_bwd", "qk_norm_rope_bwd"):
        assert any(f"profuse.{op}" in t for t in seen["backward"]), (op, seen["backward"])


@pytest.mark.skipif(not (torch.cuda.is_available() and A.HAS_TRITON_OP), reason="Inductor: CUDA")
def test_inductor_launches_the_kernels_itself():
    """On CUDA, Inductor's code launches the rope kernels directly, and matches the eager call."""
    from torch._inductor.utils import run_and_get_code

    dev = torch.device("cuda")
    torch._dynamo.reset()
    compiled = torch.compile(_attention_like, fullgraph=True)
    shape = (2, 33, 4, 2, 6, 1, "hf")
    pq, pk, cos, sin, dq, dk, qw, kw = inputs(shape, BF16, dev, seed=15, norm=True)
    results, code = [], []
    for fn in (compiled, _attention_like):
        leaves = [x.clone().requires_grad_() for x in (pq, pk, qw, kw)]

        def go(fn=fn, leaves=leaves):
            loss = fn(*leaves, cos, sin, dq, dk)
            loss.backward()
            return loss

        loss, code = run_and_get_code(go) if fn is compiled else (go(), code)
        results.append((loss.detach().float(), *(leaf.grad.float() for leaf in leaves)))
    for name, c, e in zip(("loss", *GRAD_NAMES), *results):
        assert T.relative_error(c, e) <= 1e-2, name
    text = "\n".join(code)
    assert "torch.ops.profuse" not in text
    for kernel in ("_rope_kernel", "_norm_rope_bwd_kernel"):
        assert kernel in text, kernel


def _tiny(arch):
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        from transformers.models.llama import modeling_llama as M

        config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=12, intermediate_size=64, num_hidden_layers=1,
                                          vocab_size=32, attn_implementation="sdpa")  # fmt: skip
        return M, M.LlamaAttention(config, 0), M.LlamaRotaryEmbedding(config)
    from transformers.models.qwen3 import modeling_qwen3 as M

    config = transformers.Qwen3Config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                                      head_dim=16, intermediate_size=64, num_hidden_layers=1,
                                      vocab_size=32, attn_implementation="sdpa")  # fmt: skip
    return M, M.Qwen3Attention(config, 0), M.Qwen3RotaryEmbedding(config)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_swapped_into_a_transformers_attention(arch, device, monkeypatch):
    """A tiny Llama (rope) or Qwen3 (q/k norm + rope) attention with profuse's op swapped in for
    Hugging Face's, fed exactly what the model passes (projection views, its rotary module's cos
    and sin): the attention's output and every gradient match the unswapped module's (fp32)."""
    torch.manual_seed(16)
    M, attn, rotary = _tiny(arch)
    attn = attn.to(device)
    with torch.no_grad():  # norm weights other than ones, so a dropped weight shows
        for p in attn.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    x = torch.randn(2, 7, 48, device=device)
    cos, sin = rotary.to(device)(x, torch.arange(7, device=device)[None])
    dy = torch.randn(2, 7, 48, device=device)

    def step():
        attn.zero_grad()
        leaf = x.clone().requires_grad_()
        out, _ = attn(leaf, (cos, sin), None)
        out.backward(dy)
        return [out.detach(), leaf.grad, *(p.grad for p in attn.parameters())]

    want = step()
    if arch == "llama":
        monkeypatch.setattr(M, "apply_rotary_pos_emb", lambda q, k, c, s, *a, **kw: R.rope(q, k, c, s))
    else:
        # q_norm and k_norm pass their input through; the rope takes it back as (B, T, H, D)
        # (the transpose of the transpose: the projection's own view) and does both.
        eps = attn.q_norm.variance_epsilon
        monkeypatch.setattr(attn.q_norm, "forward", lambda h: h)
        monkeypatch.setattr(attn.k_norm, "forward", lambda h: h)

        def fused(q, k, c, s, *a, **kw):
            weights = (attn.q_norm.weight, attn.k_norm.weight)
            return R.qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), *weights, c, s, eps)

        monkeypatch.setattr(M, "apply_rotary_pos_emb", fused)
    got = step()
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and T.relative_error(g, w) <= 1e-5, i


# --------------------------------------------------------------------------------------------
# Partial rotary (Phi-3/4, GLM-4): cos and sin narrower than head_dim
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("dims", [(24, 16), (34, 10)], ids=str)
def test_partial_rotary_against_float64_eager_and_phi3(dims, dtype, device, poisoned_rope):
    """The first R lanes of each head rotated, the other D - R passed through: outputs and
    gradients against float64 and eager, and eager against transformers' Phi3 function."""
    d, rot = dims
    gen = torch.Generator().manual_seed(41)
    q = randn((2, 4, 5, d), dtype, gen, device)
    k = randn((2, 2, 5, d), dtype, gen, device)
    angles = torch.rand((1, 5, rot // 2), generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(device)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(device)
    # Gradients that q's dtype holds exactly, so the passed-through lanes' can be compared bitwise.
    dq, dk = (randn(x.shape, dtype, gen, device).float() for x in (q, k))
    results = []
    for fn, cast in ((R.rope, None), (R.rope_eager, None), (R.rope_reference, torch.float64)):
        qq, kk = (t.detach().clone().to(cast or t.dtype).requires_grad_() for t in (q, k))
        qo, ko = fn(qq, kk, cos, sin)
        torch.autograd.backward((qo, ko), (dq.to(qo.dtype), dk.to(ko.dtype)))
        results.append((qo.detach(), ko.detach(), qq.grad, kk.grad))
    tol = T.BACKWARD_TOL[dtype]
    for got, eager, ref in zip(*results):
        err, err_e = T.relative_error(got, ref), T.relative_error(eager, ref)
        assert err <= tol and err <= 3 * max(err_e, T.UNIT_ROUNDOFF[dtype]), (err, err_e)
    # The passed-through lanes are q's own, bit for bit, and their gradient dq's.
    assert torch.equal(results[0][0][..., rot:], q[..., rot:].to(results[0][0].dtype))
    assert torch.equal(results[0][2][..., rot:], dq[..., rot:].to(dtype))
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    want = phi3.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(R.rope_eager(q, k, cos, sin), want):
        assert torch.equal(a, b)


def test_partial_rotary_refusals(device):
    q = torch.randn(1, 2, 3, 8, device=device)
    with pytest.raises(ValueError, match="rotary dim"):
        R.rope(q, q, torch.ones(1, 3, 5, device=device), torch.ones(1, 3, 5, device=device))


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_qk_norm_rope_partial_rotary(dtype, offset, device, poisoned_rope):
    """qk_norm_rope with cos narrower than head_dim: the norm over the whole head, the first R
    lanes rotated; outputs and every gradient (q, k, both weights) against float64 and eager;
    with Gemma 3's (1 + w) offset too (the lanes passed through scaled by it as well)."""
    d, rot = 20, 12
    gen = torch.Generator().manual_seed(43)
    q = randn((2, 5, 4, d), dtype, gen, device)
    k = randn((2, 5, 2, d), dtype, gen, device)
    w_mean = 1.0 - offset  # (offset + w) about 1 either way, w itself far from 0 and from 1
    qw, kw = randn((d,), dtype, gen, device, w_mean, 0.3), randn((d,), dtype, gen, device, w_mean, 0.3)
    angles = torch.rand((2, 5, rot // 2), generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(device)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(device)
    dq, dk = randn((2, 4, 5, d), FP32, gen, device), randn((2, 2, 5, d), FP32, gen, device)
    results = []
    for fn, cast in (
        (R.qk_norm_rope, None),
        (R.qk_norm_rope_eager, None),
        (R.qk_norm_rope_reference, torch.float64),
    ):
        leaves = [t.detach().clone().to(cast or t.dtype).requires_grad_() for t in (q, k, qw, kw)]
        qo, ko = fn(*leaves, cos, sin, weight_offset=offset)
        torch.autograd.backward((qo, ko), (dq.to(qo.dtype), dk.to(ko.dtype)))
        results.append((qo.detach(), ko.detach(), *(t.grad for t in leaves)))
    tol = T.BACKWARD_TOL[dtype]
    for got, eager, ref in zip(*results):
        err, err_e = T.relative_error(got, ref), T.relative_error(eager, ref)
        assert err <= tol and err <= 3 * max(err_e, T.UNIT_ROUNDOFF[dtype]), (err, err_e)


OFFSET_CASES = ["3/1 heads, D 128, cos per batch", "one token, D 6", "B 1, D 40, 7 tokens"]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
@pytest.mark.parametrize("case", OFFSET_CASES)
def test_qk_norm_rope_with_gemma3s_offset_against_float64_and_eager(case, dtype, device, poisoned_rope):
    """Gemma 3's q/k norms scale by (1 + w): weights drawn about 0 (Gemma's init), so an offset
    dropped anywhere, forward or backward, is off by O(1); outputs and all four gradients."""
    shape = CASES[case]
    d = shape[4]
    pq, pk, cos, sin, dq, dk = inputs(shape, dtype, device, seed=5)
    gen = torch.Generator().manual_seed(6)
    ws = (randn((d,), dtype, gen, device, 0.0, 0.3), randn((d,), dtype, gen, device, 0.0, 0.3))
    xs = (pq, pk, cos, sin, dq, dk, *ws)
    with_offset = [lambda *a, fn=fn: fn(*a, weight_offset=1.0) for fn in OPS["qk_norm_rope"]]
    qo, ko, grads = run("qk_norm_rope", shape, (with_offset[0], *xs))
    qe, ke, grads_e = run("qk_norm_rope", shape, (with_offset[1], *xs))
    qr, kr, grads_r = run("qk_norm_rope", shape, (with_offset[2], *xs), dtype=torch.float64)
    qn, _, _ = run("qk_norm_rope", shape, (OPS["qk_norm_rope"][2], *xs), dtype=torch.float64)
    assert T.relative_error(qr, qn) > 0.5  # the offset changes the answer: the test can tell
    for name, out, e, r in (("q_out", qo, qe, qr), ("k_out", ko, ke, kr)):
        assert out.shape == r.shape and out.dtype == dtype and heads_major(out), name
        check(name, out, e, r, T.FORWARD_TOL)
    for name, g, e, r in zip(GRAD_NAMES, grads, grads_e, grads_r):
        assert g.shape == r.shape and g.dtype == dtype, name
        check("d" + name, g, e, r, T.BACKWARD_TOL)


def test_qk_norm_rope_with_an_offset_keeps_q_dtype_as_gemma3s_norm_casts(device):
    """Gemma3RMSNorm casts its output to x's dtype: bf16 q and k with fp32 weights (no autocast)
    come out bf16, where Qwen3's order (weight * normalised) promotes them to fp32."""
    gen = torch.Generator().manual_seed(7)
    q, k = randn((1, 3, 2, 8), BF16, gen, device), randn((1, 3, 1, 8), BF16, gen, device)
    w = randn((8,), FP32, gen, device, 0.0, 0.3)
    cos, sin = rotary_table(1, 3, 8, "hf", gen, device, dtype=BF16)
    for fn in (R.qk_norm_rope, R.qk_norm_rope_eager):
        qo, ko = fn(q, k, w, w, cos, sin, EPS, weight_offset=1.0)
        assert qo.dtype == ko.dtype == BF16
        assert fn(q, k, w, w, cos, sin, EPS)[0].dtype == FP32


# --------------------------------------------------------------------------------------------
# Interleaved lane pairs (GLM, GLM-4, Ernie 4.5: cos's first half; Cohere, Cohere 2: by lane)
# --------------------------------------------------------------------------------------------

# (case, rotary dim R or None for D): GQA 3/1 at D 40 with cos per batch row, and partial rotary
# at the odd D 14 (R 6: three pairs, no power of two; eight lanes passed through, no power of
# two either). The "random" table's halves and lanes all differ: a kernel reading cos's second
# half for "first_half", or a lane's neighbour for "lanes", is off by O(1).
PAIR_CASES = {
    "3/1 heads, D 40, cos per batch": ((2, 3, 3, 1, 40, 2, "random"), None),
    "partial R 6 of D 14, 4 tokens": ((1, 4, 2, 2, 14, 1, "random"), 6),
}


def pair_inputs(case, rot, dtype, device, seed, cos_dtype=None):
    """inputs() with cos and sin narrowed to the rotary dim R (a strided view, as a slice of a
    wider table is)."""
    pq, pk, cos, sin, dq, dk = inputs(case, dtype, device, seed=seed, cos_dtype=cos_dtype)
    return pq, pk, cos[..., : rot or cos.shape[-1]], sin[..., : rot or sin.shape[-1]], dq, dk


def with_form(fn, interleaved, **kwargs):
    return lambda q, k, cos, sin: fn(q, k, cos, sin, interleaved=interleaved, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAIR_CASES)
@pytest.mark.parametrize("form", R.INTERLEAVED)
def test_interleaved_matches_float64_and_eager(form, case, dtype, device, poisoned_rope):
    """Outputs and both gradients of the pairs' forms against float64 and eager; the lanes past a
    partial rotary dim are q's own, bit for bit, and their gradient the output's."""
    shape, rot = PAIR_CASES[case]
    xs = pair_inputs(shape, rot, dtype, device, seed=21)
    qo, ko, grads = run("rope", shape, (with_form(R.rope, form), *xs))
    qe, ke, grads_e = run("rope", shape, (with_form(R.rope_eager, form), *xs))
    qr, kr, grads_r = run("rope", shape, (with_form(R.rope_reference, form), *xs), dtype=torch.float64)
    for name, out, e, r in (("q_out", qo, qe, qr), ("k_out", ko, ke, kr)):
        assert out.shape == r.shape and out.dtype == dtype and heads_major(out), name
        check(name, out, e, r, T.FORWARD_TOL)
    for name, g, e, r in zip(GRAD_NAMES, grads, grads_e, grads_r):
        assert g.shape == r.shape and g.dtype == dtype, name
        check("d" + name, g, e, r, T.BACKWARD_TOL)
    if rot is not None:
        b, t, hq, _, d = shape[:5]
        q = xs[0].view(b, t, hq, d).transpose(1, 2)
        assert torch.equal(qo[..., rot:], q[..., rot:])
        assert torch.equal(grads[0].view(b, t, hq, d).transpose(1, 2)[..., rot:], xs[4][..., rot:])


def test_the_pairs_forms_are_the_families_own_rotations_and_differ_from_the_halves(device):
    """rope_eager's pairs, op for op, are GLM-4's, Ernie 4.5's and Cohere's apply_rotary_pos_emb
    bitwise, outputs and gradients (bf16 q and k; Ernie's fp32 cos, Cohere's bf16), partial
    rotary with GLM-4; the halves, and the other pairs' form, give something else."""
    glm4, ernie, cohere = (
        pytest.importorskip(f"transformers.models.{m}.modeling_{m}") for m in ("glm4", "ernie4_5", "cohere")
    )
    gen = torch.Generator().manual_seed(23)
    q, k = randn((2, 3, 4, 16), BF16, gen, device), randn((2, 1, 4, 16), BF16, gen, device)
    angles = 6 * torch.rand((1, 4, 4), generator=gen)
    half_table = torch.cat((angles, angles), -1)  # Llama's [f, f], R 8 of D 16
    by_lane = torch.cat((angles, angles + 1), -1).repeat_interleave(2, -1)  # Cohere's, D 16
    cases = [
        (glm4, half_table, BF16, False, "first_half"),
        (ernie, torch.cat((half_table, half_table + 2), -1), FP32, True, "first_half"),
        (cohere, by_lane, BF16, "float", "lanes"),
    ]
    dq, dk = randn(q.shape, BF16, gen, device), randn(k.shape, BF16, gen, device)

    def outputs_and_grads(fn, cos, sin):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = fn(qq, kk, cos, sin)
        torch.autograd.backward((qo, ko), (dq, dk))
        return qo.detach(), ko.detach(), qq.grad, kk.grad

    for module, table, cos_dtype, keep, form in cases:
        cos, sin = table.cos().to(device, cos_dtype), table.sin().to(device, cos_dtype)
        want = outputs_and_grads(module.apply_rotary_pos_emb, cos, sin)
        got = outputs_and_grads(with_form(R.rope_eager, form, keep_dtype=keep), cos, sin)
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)), module.__name__
        other = "lanes" if form == "first_half" else "first_half"
        for wrong in (R.rope_eager(q, k, cos, sin, keep), R.rope_eager(q, k, cos, sin, keep, other)):
            assert not torch.allclose(wrong[0].float(), want[0].float(), atol=0.1), module.__name__


@pytest.mark.parametrize(("form", "keep"), [("first_half", True), ("lanes", "float")])
def test_interleaved_keep_dtype_rotates_in_fp32_and_stores_q_dtype(form, keep, device, poisoned_rope):
    """Ernie 4.5's and Cohere's q.float(): bf16 q and k with bf16 cos rotated in fp32, cast back.
    The fused op stores bf16, within an ulp of the eager op's cast and of float64's rounding, and
    the gradients come back in bf16."""
    shape, rot = PAIR_CASES["3/1 heads, D 40, cos per batch"]
    xs = pair_inputs(shape, rot, BF16, device, seed=24)
    qf, kf, grads_f = run("rope", shape, (with_form(R.rope, form, keep_dtype=keep), *xs))
    qe, ke, grads_e = run("rope", shape, (with_form(R.rope_eager, form, keep_dtype=keep), *xs))
    qr, kr, grads_r = run("rope", shape, (with_form(R.rope_reference, form), *xs), dtype=torch.float64)
    assert (qf.dtype, kf.dtype, qe.dtype, ke.dtype) == (BF16,) * 4
    for out, eager, ref in ((qf, qe, qr), (kf, ke, kr)):
        ulp = 2 * T.UNIT_ROUNDOFF[BF16] * ref.abs()  # one bf16 ulp at each element, at most
        assert ((out.double() - ref).abs() <= ulp).all() and ((eager.double() - ref).abs() <= ulp).all()
    for g, e, r in zip(grads_f, grads_e, grads_r):
        assert g.dtype == BF16
        check("grad", g, e, r.to(BF16), T.BACKWARD_TOL)


def test_interleaved_refusals_are_one_line_value_errors(device):
    q = torch.randn(1, 2, 3, 8, device=device)
    cos = torch.ones(1, 3, 8, device=device)
    for kwargs, message in (({"interleaved": "halves"}, "interleaved is 'halves'"),
                            ({"keep_dtype": "fp32"}, "keep_dtype is 'fp32'")):  # fmt: skip
        with pytest.raises(ValueError, match=message) as info:
            R.rope(q, q, cos, cos, **kwargs)
        assert "\n" not in str(info.value)


def test_interleaved_compiles_without_a_graph_break_to_its_own_ops(device):
    """fullgraph=True through RopeFunction with the pairs: AOTAutograd's graphs call the pairs'
    ops (not the halves'), and the result matches the eager call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: set = set()

    def compiler(gm, example_inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    def step(pq, pk, cos, sin, dq, dk):
        b, t = pq.shape[:2]
        q, k = pq.view(b, t, -1, 6).transpose(1, 2), (pk * 2).view(b, t, -1, 6).transpose(1, 2)
        qo, ko = R.rope(q, k, cos, sin, interleaved="first_half")
        return (qo * dq).sum() + (ko * dk).sum()

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    pq, pk, cos, sin, dq, dk = inputs(CASES["one token, D 6"], FP32, device, seed=25)
    results = []
    for fn in (compiled, step):
        leaves = [x.clone().requires_grad_() for x in (pq, pk)]
        loss = fn(*leaves, cos, sin, dq, dk)
        loss.backward()
        results.append((loss.detach(), *(leaf.grad for leaf in leaves)))
    for c, e in zip(*results):
        assert T.relative_error(c, e) <= 1e-6
    if device.type == "cuda" and A.HAS_TRITON_OP:
        assert any("triton_kernel_wrapper" in t for t in seen), seen
        return
    for op in ("rope_pairs_fwd", "rope_pairs_bwd"):
        assert any(f"profuse.{op}" in t for t in seen), (op, seen)
    assert not any("profuse.rope_fwd" in t for t in seen), seen


@pytest.mark.parametrize(("form", "rows"), [("lanes", 4), ("first_half", 2)])
def test_interleaved_tokens_per_program_and_plans_of_their_own(form, rows, device, poisoned_rope):
    """2 or 4 tokens a program over 7 (the last program's partly past the end), forward and
    backward of the pairs; and a call with no config plans the pairs apart from the halves (the
    halves' plan key and launch as they were: INTERLEAVED 0, name rope_fwd)."""
    shape = CASES["B 1, D 40, 7 tokens"]
    pq, pk, cos, sin, dq, dk = inputs(shape, FP32, device, seed=26)
    gen = torch.Generator().manual_seed(27)  # every lane its own angle: no half or pair repeats
    cos, sin = randn(cos.shape, FP32, gen, device), randn(sin.shape, FP32, gen, device)
    q, k = (_heads(x, shape).transpose(1, 2) for x in (pq, pk))
    code = K.INTERLEAVED_FORMS[form]
    cfg = KernelConfig("rope", rows, 32, 1, l2="plain")
    qo, ko = K.rope_forward(q, k, cos, sin, config=cfg, interleaved=code)
    gq, gk = K.rope_backward(dq, dk, cos, sin, (FP32, FP32), config=cfg, interleaved=code)
    leaves = [t.detach().double().requires_grad_() for t in (q, k)]
    qr, kr = R.rope_reference(*leaves, cos, sin, interleaved=form)
    torch.autograd.backward([qr, kr], [dq.double(), dk.double()])
    for out, r in ((qo, qr), (ko, kr)):
        assert T.relative_error(out, r.detach()) <= T.FORWARD_TOL[FP32]
    for g, leaf in ((gq, leaves[0]), (gk, leaves[1])):
        assert T.relative_error(g, leaf.grad) <= T.BACKWARD_TOL[FP32]
    K._PLANS.clear()
    K.rope_forward(q, k, cos, sin)
    K.rope_forward(q, k, cos, sin, interleaved=code)
    plans = {key[0]: plan for key, plan in K._PLANS.items()}
    assert set(plans) == {"rope_fwd", f"rope_fwd_pairs{code}"}
    assert plans["rope_fwd"].meta["INTERLEAVED"] == 0 and plans["rope_fwd"].kind == "rope fwd"
    assert plans[f"rope_fwd_pairs{code}"].meta["INTERLEAVED"] == code
