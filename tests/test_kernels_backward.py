"""The Triton kernels: every gradient against float64 autograd, the chunked and persistent paths
at small sizes (explicit configs), determinism, partial requires_grad and torch.compile.

Tolerance table: relative error ||grad - grad64|| / ||grad64|| (profuse.tail.BACKWARD_TOL)

    dtype   u       BACKWARD_TOL   why
    bf16    2^-8    16u = 6.3e-2   ~twice the forward's ops, plus the row sum in dh and the
    fp16    2^-11   16u = 7.8e-3   column sum in dw: twice the forward's 8u
    fp32    2^-24   1e-5 (floor)   summation over N and over rows: ~log2 u each, far below 1e-5

No worse than eager: err(triton) <= SLACK * max(err(eager), u), gradient by gradient. In
bf16/fp16 Triton rounds each gradient once from fp32 (~0.4u; ~0.85u under the interpreter, whose
fp32 -> bf16 cast truncates) while eager rounds after each of ~20 ops (~1u): the worst ratio over
20 seeds x 4 shapes was 1.13, so 1.5. In fp32 both are fp32 arithmetic in different orders
(1-2u each; the ratio reached 1.9), so 3. A dropped term in dh or dg is orders of magnitude off.
N = 1 and 2 are left out of the gradient checks: there the normalised output barely depends on
h (d(h/|h|)/dh = 0 for N = 1 up to eps), so the true gradient is the cancellation of nearly equal
terms and its relative error is meaningless for any implementation.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from cases import DTYPES, EPS, GRAD_SHAPES, GRADS, tail_inputs

from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse.kernels import configs as C  # noqa: E402
from profuse.kernels import tail as K  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402

SLACK = {torch.bfloat16: 1.5, torch.float16: 1.5, torch.float32: 3.0}


def grads_of(fn, xs, dy, requires=(True, True, True, True), dtype=None):
    """(y, d gate, d up, d residual, d weight) of fn at xs (cast to `dtype` first); None where an
    input does not require grad."""
    leaves = [
        (x.detach().to(dtype) if dtype else x.detach().clone()).requires_grad_(req)
        for x, req in zip(xs, requires, strict=True)
    ]
    y = fn(*leaves, EPS)
    y.backward(dy.to(y.dtype))
    return (y.detach(), *(leaf.grad for leaf in leaves))


def reference_grads(xs, dy, requires=(True, True, True, True)):
    return grads_of(T.tail_reference, xs, dy, requires, torch.float64)


def reference_rstd(g, u, r):
    h = torch.nn.functional.silu(g.double()) * u.double() + r.double()
    return torch.rsqrt(h.pow(2).mean(-1) + EPS)


# --------------------------------------------------------------------------------------------
# Every gradient against float64, and against eager in the same dtype
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_every_gradient_matches_float64_and_eager(shape, dtype, device, poisoned):
    xs, dy = tail_inputs(shape, dtype, device, dy=True)
    ref = reference_grads(xs, dy)
    tri = grads_of(T.tail_triton, xs, dy)
    eager = grads_of(T.tail_eager, xs, dy)
    u = T.UNIT_ROUNDOFF[dtype]
    for name, t, e, r in zip(("y",) + GRADS, tri, eager, ref, strict=True):
        assert t.shape == r.shape and t.dtype == dtype, name
        err, eager_err = T.relative_error(t, r), T.relative_error(e, r)
        tol = T.FORWARD_TOL[dtype] if name == "y" else T.BACKWARD_TOL[dtype]
        assert err <= tol, f"d{name}: rel err {err:.2e} > tol {tol:.0e}"
        assert err <= SLACK[dtype] * max(eager_err, u), (
            f"d{name}: rel err {err:.2e} vs eager's {eager_err:.2e}: worse than eager in {dtype}"
        )


def test_gradient_through_a_sum_broadcast_dy(device):
    """y.sum().backward() hands the kernel a stride-0 dy: it must still read every row right."""
    xs, _ = tail_inputs((4, 50), torch.float32, device, seed=1, dy=True)
    ones = torch.ones(4, 50, dtype=torch.float32, device=device)
    leaves = [x.clone().requires_grad_() for x in xs]
    T.tail_triton(*leaves, EPS).sum().backward()
    ref = reference_grads(xs, ones)
    for name, leaf, r in zip(GRADS, leaves, ref[1:], strict=True):
        assert T.relative_error(leaf.grad, r) <= T.BACKWARD_TOL[torch.float32], name


def test_gradient_into_strided_views(device):
    """gate and up as the two halves of one (rows, 2N) leaf: the gradient lands in the right half."""
    n = 37
    gen = torch.Generator().manual_seed(2)
    gu = torch.randn(3, 2 * n, generator=gen).to(device).requires_grad_()
    r = torch.randn(n, 3, generator=gen).to(device).t().requires_grad_()  # non-contiguous columns
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device).requires_grad_()
    dy = torch.randn(3, n, generator=gen).to(device)
    g, u = gu.chunk(2, -1)
    T.tail_triton(g, u, r, w, EPS).backward(dy)
    gu64, r64, w64 = (t.detach().double().requires_grad_() for t in (gu, r, w))
    T.tail_reference(*gu64.chunk(2, -1), r64, w64, EPS).backward(dy.double())
    tol = T.BACKWARD_TOL[torch.float32]
    for name, got, want in (
        ("gate|up", gu.grad, gu64.grad),
        ("residual", r.grad, r64.grad),
        ("weight", w.grad, w64.grad),
    ):
        assert got.shape == want.shape
        assert T.relative_error(got, want) <= tol, name


# --------------------------------------------------------------------------------------------
# Partial requires_grad: no gradient (and no work) for inputs that do not need one
# --------------------------------------------------------------------------------------------

PARTIAL = {
    "only weight": (False, False, False, True),
    "only gate": (True, False, False, False),
    "no residual": (True, True, False, True),
    "no weight": (True, True, True, False),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", PARTIAL)
def test_partial_requires_grad(case, dtype, device, poisoned):
    requires = PARTIAL[case]
    xs, dy = tail_inputs((5, 97), dtype, device, seed=3, dy=True)
    ref = reference_grads(xs, dy)
    tri = grads_of(T.tail_triton, xs, dy, requires)
    for name, req, got, want in zip(GRADS, requires, tri[1:], ref[1:], strict=True):
        if not req:
            assert got is None, f"{name} does not require grad but got one"
        else:
            assert got is not None and got.shape == want.shape and got.dtype == dtype, name
            assert T.relative_error(got, want) <= T.BACKWARD_TOL[dtype], name


def test_no_input_requires_grad_gives_plain_tensor(device):
    xs, _ = tail_inputs((3, 20), torch.float32, device, seed=4, dy=True)
    y = T.tail_triton(*xs, EPS)
    assert not y.requires_grad and y.grad_fn is None


SKIP_CONFIGS = {
    "fused": None,
    "chunked": KernelConfig("chunked", 1, 16, num_warps=4, programs=3),
    "split": KernelConfig("split", 1, 16, num_warps=4, num_stages=2, programs=2),
    "split, row dot in 3 column ranges": KernelConfig("split", 1, 16, num_warps=4, programs=2, splits=3),
    "team of one": KernelConfig("team", 1, 64, num_warps=2, programs=3),
    "fused, two blocks": KernelConfig("fused", 1, 32, num_warps=2, programs=2, block_n2=8),
}


@pytest.mark.parametrize("kernel", SKIP_CONFIGS)
def test_tail_backward_skips_what_is_not_needed(kernel, device, poisoned):
    """The launcher itself returns None (allocates nothing) for gradients not asked for, and the
    ones it returns are complete (every element written over the NaN poison)."""
    xs, dy = tail_inputs((5, 40), torch.float32, device, seed=5, dy=True)
    g, u, r, w = xs
    _, rstd = K.tail_forward(g, u, r, w, EPS)
    cfg = SKIP_CONFIGS[kernel]
    ref = reference_grads(xs, dy)[1:]
    for needs in [(True, False, True, False), (False, True, False, True), (False, False, False, False)]:
        out = K.tail_backward(dy, g, u, r, w, rstd, needs, config=cfg)
        assert len(out) == 4
        for name, need, got, want in zip(GRADS, needs, out, ref, strict=True):
            if not need:
                assert got is None, name
            else:
                assert T.relative_error(got, want) <= T.BACKWARD_TOL[torch.float32], (needs, name)


# --------------------------------------------------------------------------------------------
# Determinism: no atomics, a fixed reduction order
# --------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "default": None,
    # 7 rows in tiles of 2 (the last one partial) over 2 programs: each program adds 2 tiles.
    "persistent fused": KernelConfig("fused", 2, 64, num_warps=2, num_stages=2, programs=2),
    "chunked": KernelConfig("chunked", 1, 16, num_warps=4, programs=3),
    # 7 rows in tiles of 2 rows over 3 programs: the last tile holds one row.
    "chunked, 2 rows per tile": KernelConfig("chunked", 2, 16, num_warps=4, programs=3),
    "pipelined": KernelConfig("pipelined", 1, 16, num_warps=4, programs=3),
    # 7 rows over 2 row programs x 3 column slabs (16 + 16 + 5): each dw slab sums 3-4 rows.
    "split": KernelConfig("split", 1, 16, num_warps=4, num_stages=2, programs=2),
    # The same with each row's dot in 3 column ranges, summed in a fixed order.
    "split, row dot in column ranges": KernelConfig("split", 1, 16, num_warps=4, programs=2, splits=3),
    # 7 rows over 3 teams of one program: each team's dw partial sums 2-3 rows.
    "team of one": KernelConfig("team", 1, 64, num_warps=2, programs=3),
    "team of one, two stages": KernelConfig("team", 1, 64, num_warps=2, num_stages=2, programs=3),
    # 37 columns in blocks of 32 and 8 over 2 programs, the row loop pipelined.
    "fused, two blocks": KernelConfig("fused", 1, 32, num_warps=2, num_stages=2, programs=2, block_n2=8),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_backward_is_bitwise_deterministic(case, device):
    xs, dy = tail_inputs((7, 37), torch.bfloat16, device, seed=6, dy=True)
    g, u, r, w = xs
    _, rstd = K.tail_forward(g, u, r, w, EPS)
    runs = [
        K.tail_backward(dy, g, u, r, w, rstd, (True, True, True, True), config=CONFIG_CASES[case])
        for _ in range(2)
    ]
    for name, a, b in zip(GRADS, *runs, strict=True):
        assert torch.equal(a, b), f"d{name} differs between two runs"
    # Through autograd as well: the whole path, not only the launcher.
    autograd_runs = [grads_of(T.tail_triton, xs, dy) for _ in range(2)]
    for name, a, b in zip(("y",) + GRADS, *autograd_runs, strict=True):
        assert torch.equal(a, b), f"{name} differs between two autograd runs"


# --------------------------------------------------------------------------------------------
# Paths a small default shape never takes: chunked rows, several rows per tile, persistent grids
# --------------------------------------------------------------------------------------------

# (rows, N, config). N = 40 with 16-wide chunks: 2 full chunks and a partial one of 8.
FORWARD_CONFIGS = {
    "chunked, N not a multiple of the chunk": (5, 40, KernelConfig("chunked", 1, 16, num_warps=4)),
    "chunked, N a multiple of the chunk": (3, 48, KernelConfig("chunked", 1, 16, num_warps=4)),
    "chunked, N smaller than the chunk": (3, 11, KernelConfig("chunked", 1, 16, num_warps=4)),
    # 10 rows in tiles of 4: the last tile holds 2 rows; N = 37 in a 64-wide block.
    "fused, 4 rows per tile": (10, 37, KernelConfig("fused", 4, 64, num_warps=4)),
    "fused, 1 row per tile": (3, 37, KernelConfig("fused", 1, 64, num_warps=1)),
    # Whole tiles (N = the block, 4 rows per tile divide 8): the kernel drops its masks.
    "fused, whole tiles": (8, 64, KernelConfig("fused", 4, 64, num_warps=2)),
    "fused, whole tiles, persistent": (
        8, 32, KernelConfig("fused", 2, 32, num_warps=1, num_stages=2, programs=3)),
    # h kept in y between the passes: pass 2 reads y back instead of g, u, r.
    "chunked, h stashed in y, 5 rows over 2 programs": (
        5, 40, KernelConfig("chunked", 1, 16, num_warps=4, programs=2, stash_h=True)),
    "chunked, h stashed in y, N smaller than the chunk": (
        3, 11, KernelConfig("chunked", 1, 16, num_warps=4, stash_h=True)),
    # Pipelined: pass 1 of a program's next row in the chunk loop of pass 2 of its current one.
    "pipelined, 7 rows over 3 programs": (7, 40, KernelConfig("pipelined", 1, 16, num_warps=4, programs=3)),
    "pipelined, one row per program": (3, 11, KernelConfig("pipelined", 1, 16, num_warps=2, programs=3)),
    "pipelined, one program": (4, 48, KernelConfig("pipelined", 1, 16, num_warps=4, programs=1)),
    # The row in two blocks: 37 columns as 32 + 8 (3 masked); 40 as exactly 32 + 8 in whole
    # tiles of 2 rows (no masks); persistent.
    "fused, two blocks, N = 37": (5, 37, KernelConfig("fused", 1, 32, num_warps=1, block_n2=8)),
    "fused, two blocks, whole tiles": (4, 40, KernelConfig("fused", 2, 32, num_warps=2, block_n2=8)),
    "fused, two blocks, persistent": (
        7, 40, KernelConfig("fused", 2, 32, num_warps=2, num_stages=2, programs=2, block_n2=8)),
    # A persistent forward: 7 rows in tiles of 2 (4 tiles) over 2 programs looping over them.
    "fused, persistent, 4 tiles over 2 programs": (
        7, 37, KernelConfig("fused", 2, 64, num_warps=2, num_stages=2, programs=2)),
    # Teams of one program (teams of several need a GPU: test_teams.py): 7 rows over 3 teams,
    # N = 37 in a 64-wide share; more teams than rows.
    "team of one, 7 rows over 3 teams": (7, 37, KernelConfig("team", 1, 64, num_warps=2, programs=3)),
    "team of one, more teams than rows": (2, 40, KernelConfig("team", 1, 64, num_warps=4, programs=5)),
    # Two stages: a row's exchange is read after the next row's is published.
    "team of one, two stages, 7 rows over 3 teams": (
        7, 37, KernelConfig("team", 1, 64, num_warps=2, num_stages=2, programs=3)),
    "team of one, two stages, one row per team": (
        3, 37, KernelConfig("team", 1, 64, num_warps=2, num_stages=2, programs=3)),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FORWARD_CONFIGS)
def test_forward_paths_with_explicit_configs(case, dtype, device, poisoned):
    rows, n, cfg = FORWARD_CONFIGS[case]
    (g, u, r, w), _ = tail_inputs((rows, n), dtype, device, seed=7, dy=True)
    y, rstd = K.tail_forward(g, u, r, w, EPS, config=cfg)
    ref = T.tail_reference(g, u, r, w, EPS)
    assert y.shape == g.shape and y.dtype == dtype
    assert torch.isfinite(y).all(), "an output element was never written"
    assert T.relative_error(y, ref) <= T.FORWARD_TOL[dtype]
    # rstd is computed in fp32 from the same inputs: within a few fp32 roundings of float64.
    assert rstd.shape == (rows,) and rstd.dtype == torch.float32
    assert T.relative_error(rstd, reference_rstd(g, u, r)) <= 1e-5
    # The same answer as the default config, to within one rounding of y per element (two when
    # h is stashed in y's dtype; a rounding is up to 2u under the interpreter, which truncates).
    y_default, _ = K.tail_forward(g, u, r, w, EPS)
    ulp = (4 if cfg.stash_h or cfg.kernel == "pipelined" else 2) * T.UNIT_ROUNDOFF[dtype]
    assert ((y.double() - y_default.double()).abs() <= ulp * ref.abs() + 1e-6).all()


# (rows, N, config): persistent grids with fewer programs than tiles, and uneven shares.
BACKWARD_CONFIGS = {
    "chunked, 5 rows over 3 programs, N = 40 (chunks 16 + 16 + 8)": (
        5, 40, KernelConfig("chunked", 1, 16, num_warps=4, programs=3)),
    "chunked, 1 program for every row": (4, 33, KernelConfig("chunked", 1, 16, num_warps=4, programs=1)),
    "chunked, more programs than rows": (2, 40, KernelConfig("chunked", 1, 16, num_warps=4, programs=3)),
    # Two rows per tile: 5 rows in 3 tiles (the last holds one row) over 2 programs.
    "chunked, 2 rows per tile, odd rows over 2 programs": (
        5, 40, KernelConfig("chunked", 2, 16, num_warps=4, programs=2)),
    "chunked, 2 rows per tile, more programs than tiles": (
        3, 33, KernelConfig("chunked", 2, 16, num_warps=4, programs=4)),
    "chunked, 2 rows per tile, one row": (1, 40, KernelConfig("chunked", 2, 16, num_warps=4, programs=2)),
    # Pipelined: each program's next row's pass 1 in the chunk loop of its current row's pass 2.
    "pipelined, 7 rows over 3 programs, N = 40": (
        7, 40, KernelConfig("pipelined", 1, 16, num_warps=4, programs=3)),
    "pipelined, one row per program": (3, 11, KernelConfig("pipelined", 1, 16, num_warps=2, programs=3)),
    "pipelined, one program": (4, 48, KernelConfig("pipelined", 1, 16, num_warps=4, programs=1)),
    "fused, 2 rows per tile, 4 tiles over 2 programs": (
        7, 37, KernelConfig("fused", 2, 64, num_warps=2, num_stages=2, programs=2)),
    "fused, 4 rows per tile, 3 tiles over 1 program": (
        9, 37, KernelConfig("fused", 4, 64, num_warps=4, num_stages=1, programs=1)),
    "fused, more programs than tiles": (
        3, 20, KernelConfig("fused", 2, 32, num_warps=1, num_stages=2, programs=4)),
    # The row in two blocks: 37 columns as 32 + 8 over 2 programs; 40 as exactly 32 + 8, two
    # rows a tile, the last tile partial.
    "fused, two blocks, 7 rows over 2 programs": (
        7, 37, KernelConfig("fused", 1, 32, num_warps=2, num_stages=2, programs=2, block_n2=8)),
    "fused, two blocks, 2 rows per tile": (
        5, 40, KernelConfig("fused", 2, 32, num_warps=2, num_stages=1, programs=2, block_n2=8)),
    # Split: a row-dot pass, then (row programs x column slabs); the last slab is partial.
    "split, 5 rows over 2 row programs x 3 slabs, N = 40": (
        5, 40, KernelConfig("split", 1, 16, num_warps=4, num_stages=2, programs=2)),
    "split, one slab wider than N": (
        4, 11, KernelConfig("split", 1, 16, num_warps=2, num_stages=1, programs=1)),
    "split, more row programs than rows": (
        2, 33, KernelConfig("split", 1, 16, num_warps=4, num_stages=2, programs=3)),
    # The row-dot pass in column ranges (few rows): N = 70 in 2 ranges of 3 chunks (48 + 22).
    "split, row dot in 2 column ranges": (
        3, 70, KernelConfig("split", 1, 16, num_warps=4, num_stages=2, programs=2, splits=2)),
    # Teams of one program: each team's dw partial is one row; more teams than rows.
    "team of one, 7 rows over 3 teams": (7, 37, KernelConfig("team", 1, 64, num_warps=2, programs=3)),
    "team of one, more teams than rows": (2, 40, KernelConfig("team", 1, 64, num_warps=4, programs=5)),
    "team of one, two stages, 7 rows over 3 teams": (
        7, 37, KernelConfig("team", 1, 64, num_warps=2, num_stages=2, programs=3)),
    "team of one, two stages, one row per team": (
        3, 37, KernelConfig("team", 1, 64, num_warps=2, num_stages=2, programs=3)),
    # 5 ranges asked, but N = 40 holds 3 chunks: 3 ranges of one chunk, the last short.
    "split, row dot in more ranges than chunks": (
        2, 40, KernelConfig("split", 1, 16, num_warps=4, num_stages=1, programs=1, splits=5)),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", BACKWARD_CONFIGS)
def test_backward_paths_with_explicit_configs(case, dtype, device, poisoned):
    rows, n, cfg = BACKWARD_CONFIGS[case]
    xs, dy = tail_inputs((rows, n), dtype, device, seed=8, dy=True)
    g, u, r, w = xs
    _, rstd = K.tail_forward(g, u, r, w, EPS)
    ref = reference_grads(xs, dy)[1:]
    eager = grads_of(T.tail_eager, xs, dy)[1:]
    got = K.tail_backward(dy, g, u, r, w, rstd, (True, True, True, True), config=cfg)
    for name, t, e, want in zip(GRADS, got, eager, ref, strict=True):
        assert t.shape == want.shape and t.dtype == dtype, name
        err = T.relative_error(t, want)
        assert err <= T.BACKWARD_TOL[dtype], f"d{name}: rel err {err:.2e}"
        assert err <= SLACK[dtype] * max(T.relative_error(e, want), T.UNIT_ROUNDOFF[dtype]), f"d{name}"
    # Only dweight: the chunked and split kernels skip their row pass (no dh needed); the dw
    # sums must not change.
    dw_only = K.tail_backward(dy, g, u, r, w, rstd, (False, False, False, True), config=cfg)[3]
    assert torch.equal(dw_only, got[3])


# Every launch config the autotuner may pick on a GPU, at real widths but a few rows: the
# autotuner keeps the fastest candidate without checking it, so each one must be right.
CANDIDATE_SHAPES = [(3, 1000), (3, 5120), (2, 65536)]


def _candidate_ids(kind):
    def make(shape):
        rows, n = shape
        pick = C.forward_candidates if kind == "fwd" else C.backward_candidates
        # A team of several programs waits for its partners: the interpreter, which runs one
        # program after another, cannot run it (test_teams.py runs them on a GPU).
        return [(shape, cfg) for cfg in dict.fromkeys(pick(rows, n, torch.bfloat16, 132))
                if torch.cuda.is_available() or not (cfg.kernel == "team" and cfg.splits > 1)]  # fmt: skip

    def name(shape, c):
        blocks = f"{c.block_n}+{c.block_n2}" if c.block_n2 else f"{c.block_n}"
        launch = f"{c.kernel}-{c.block_m}x{blocks}-w{c.num_warps}-s{c.num_stages}-p{c.programs}"
        launch += f"-x{c.splits}-{c.l2}"
        return f"{shape[0]}x{shape[1]}-{launch}"

    return [pytest.param(s, c, id=name(s, c)) for shape in CANDIDATE_SHAPES for s, c in make(shape)]


@pytest.mark.parametrize("shape, cfg", _candidate_ids("fwd"))
def test_every_forward_candidate_is_right(shape, cfg, device, poisoned):
    (g, u, r, w), _ = tail_inputs(shape, torch.bfloat16, device, seed=11, dy=True)
    y, rstd = K.tail_forward(g, u, r, w, EPS, config=cfg)
    assert torch.isfinite(y).all(), "an output element was never written"
    assert T.relative_error(y, T.tail_reference(g, u, r, w, EPS)) <= T.FORWARD_TOL[torch.bfloat16]
    assert T.relative_error(rstd, reference_rstd(g, u, r)) <= 1e-5


@pytest.mark.parametrize("shape, cfg", _candidate_ids("bwd"))
def test_every_backward_candidate_is_right(shape, cfg, device, poisoned):
    xs, dy = tail_inputs(shape, torch.bfloat16, device, seed=12, dy=True)
    g, u, r, w = xs
    _, rstd = K.tail_forward(g, u, r, w, EPS)
    ref = reference_grads(xs, dy)[1:]
    got = K.tail_backward(dy, g, u, r, w, rstd, (True, True, True, True), config=cfg)
    for name, t, want in zip(GRADS, got, ref, strict=True):
        err = T.relative_error(t, want)
        assert err <= T.BACKWARD_TOL[torch.bfloat16], f"d{name}: rel err {err:.2e}"


def test_fp16_forward_never_keeps_h_in_y(device):
    """An fp16 h can overflow where y does not (h = 90000 normalises to a finite y): no fp16
    candidate stashes h in y, and the chunked kernel without it gets such rows right."""
    for rows, n in ((2, 16384), (64, 40000), (4096, 65536)):
        fp16 = C.forward_candidates(rows, n, torch.float16, 132)
        assert fp16 and not any(c.stash_h or c.kernel == "pipelined" for c in fp16)
        bf16 = C.forward_candidates(rows, n, torch.bfloat16, 132)
        assert any(c.stash_h for c in bf16) and any(c.kernel == "pipelined" for c in bf16)
    (g, u, r, w), _ = tail_inputs((3, 40), torch.float16, device, seed=13, dy=True)
    g[:, ::7], u[:, ::7] = 300.0, 300.0  # h = silu(300) * 300 + r ~ 90000 > fp16 max
    y, _ = K.tail_forward(g, u, r, w, EPS, config=KernelConfig("chunked", 1, 16, num_warps=4, programs=2))
    assert torch.isfinite(y).all()
    assert T.relative_error(y, T.tail_reference(g, u, r, w, EPS)) <= T.FORWARD_TOL[torch.float16]


def test_configs_choose_paths_by_width():
    """The launch heuristics: whole rows up to the limits, chunks beyond; valid configs always."""
    fwd_limit, bwd_limit = C.FWD_MAX_FUSED, C.BWD_MAX_FUSED
    assert C.forward_config(4, fwd_limit, torch.bfloat16).kernel == "fused"
    assert C.forward_config(4, fwd_limit + 1, torch.bfloat16).kernel == "chunked"
    assert C.backward_config(4, bwd_limit, torch.bfloat16, 132).kernel == "fused"
    assert C.backward_config(4, bwd_limit + 1, torch.bfloat16, 132).kernel == "chunked"
    for rows in (1, 3, 8192):
        for n in (1, 97, 760, 4096, 20000):
            for cfg in (
                C.forward_config(rows, n, torch.bfloat16),
                C.backward_config(rows, n, torch.bfloat16, 132),
            ):
                assert cfg.block_n & (cfg.block_n - 1) == 0, cfg  # a power of two
                assert cfg.block_m >= 1 and 1 <= cfg.num_warps <= 32
                if cfg.kernel == "fused":
                    assert cfg.block_n + cfg.block_n2 >= n, cfg  # the whole row fits
            bwd = C.backward_config(rows, n, torch.bfloat16, 132)
            tiles = math.ceil(rows / bwd.block_m)
            assert 1 <= bwd.programs <= max(tiles, 1), bwd
            assert set(bwd.to_dict()) >= {"kernel", "block_m", "block_n", "num_warps", "programs"}


def test_zero_rows_backward(device):
    leaves = [torch.randn(2, 0, 16, device=device).requires_grad_() for _ in range(3)]
    w = torch.randn(16, device=device).requires_grad_()
    T.tail_triton(*leaves, w, EPS).sum().backward()
    for leaf in leaves:
        assert leaf.grad.shape == (2, 0, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))  # a sum over no rows


# --------------------------------------------------------------------------------------------
# torch.compile: the custom ops keep the graph whole
# --------------------------------------------------------------------------------------------


def _loss_fn(g, u, r, w, dy):
    y = T.tail_triton(g, u, r, w, EPS)
    return (y * dy).sum() + y.abs().mean()  # ops on both sides of the tail, in one graph


def _compiled_grads_match(compiled, device):
    xs, dy = tail_inputs((2, 3, 45), torch.float32, device, seed=9, dy=True)
    leaves = [x.clone().requires_grad_() for x in xs]
    loss = compiled(*leaves, dy)
    loss.backward()
    leaves64 = [x.double().requires_grad_() for x in xs]
    y64 = T.tail_reference(*leaves64, EPS)
    loss64 = (y64 * dy.double()).sum() + y64.abs().mean()
    loss64.backward()
    assert abs(loss.item() - loss64.item()) <= 1e-5 * max(1.0, abs(loss64.item()))
    for name, a, b in zip(GRADS, leaves, leaves64, strict=True):
        assert T.relative_error(a.grad, b.grad) <= T.BACKWARD_TOL[torch.float32], name


def test_compile_fullgraph_aot_eager_calls_the_custom_ops(device):
    """Dynamo traces through the autograd.Function without a break (fullgraph=True raises on
    one), and AOTAutograd's forward and backward graphs call profuse's ops, not a decomposition."""
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
    _compiled_grads_match(torch.compile(_loss_fn, backend=backend, fullgraph=True), device)
    assert any("profuse.tail_fwd" in t for t in seen["forward"]), seen["forward"]
    assert any("profuse.tail_bwd" in t for t in seen["backward"]), seen["backward"]


def test_compile_partial_requires_grad_and_strided_views(device):
    """Under torch.compile too: gradients only where asked for, and into chunk views of one leaf."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    torch._dynamo.reset()
    fn = torch.compile(lambda g, u, r, w: T.tail_triton(g, u, r, w, EPS), backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(10)
    n = 20
    gu = torch.randn(2, 3, 2 * n, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_()
    r = torch.randn(2, 3, n, generator=gen).to(device=device, dtype=torch.bfloat16)  # no grad
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(2, 3, n, generator=gen).to(device=device, dtype=torch.bfloat16)
    fn(*gu.chunk(2, -1), r, w).backward(dy)
    gu64, w64 = (t.detach().double().requires_grad_() for t in (gu, w))
    T.tail_reference(*gu64.chunk(2, -1), r.double(), w64, EPS).backward(dy.double())
    assert r.grad is None
    tol = T.BACKWARD_TOL[torch.bfloat16]
    assert T.relative_error(gu.grad, gu64.grad) <= tol
    assert T.relative_error(w.grad, w64.grad) <= tol


def _has_cxx() -> bool:
    import os

    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


@pytest.mark.skipif(
    not torch.cuda.is_available() and not _has_cxx(),
    reason="Inductor on CPU needs a C++ compiler (none of c++, g++, clang++ found)",
)
def test_compile_fullgraph_inductor(device):
    torch._dynamo.reset()
    _compiled_grads_match(torch.compile(_loss_fn, fullgraph=True), device)


@pytest.mark.parametrize("n", [2048, 3000, 4096, 5120, 6144, 9000, 11008, 14336, 16384, 32768])
def test_two_blocks_hold_the_row_in_fewer_lanes(n):
    """Two power-of-two blocks, the wider first, exactly where they cover the row in fewer lanes
    than one; each width's fused candidates then include them (the forward's on a persistent
    grid only, where there are more rows than programs)."""
    blocks = C.two_blocks(n)
    whole = 1 << (n - 1).bit_length()
    fwd = [c for c in C.forward_candidates(4096, n, torch.bfloat16) if c.block_n2]
    if blocks is None:
        assert n == whole or n - whole // 2 > whole // 4
        assert not fwd
    else:
        first, second = blocks
        assert first == whole // 2 and second & (second - 1) == 0 and second <= first
        assert n <= first + second < whole and n > first + second // 2
        bwd = C.backward_candidates(4096, n, torch.bfloat16, 132)
        assert any(c.kernel == "fused" and (c.block_n, c.block_n2) == blocks for c in bwd)
        assert fwd and all((c.kernel, c.block_n, c.block_n2) == ("fused", *blocks) for c in fwd)
        assert all(0 < c.programs < 4096 and c.num_stages > 1 for c in fwd)
    assert not any(c.block_n2 for c in C.forward_candidates(100, 5120, torch.bfloat16))  # grid > rows
    assert C.two_blocks(1000) is None and C.two_blocks(40) is None  # narrow rows: never


@pytest.mark.parametrize("n", [5120, 11008])
def test_every_two_block_forward_candidate_is_right(n, device, poisoned):
    """The forward's two-block candidates, as offered for a GPU of 2 SMs (a persistent grid of 4
    programs over 7 rows: each program takes 1-2 rows), at their real width."""
    cands = [c for c in C.forward_candidates(7, n, torch.bfloat16, 2) if c.block_n2]
    assert cands
    (g, u, r, w), _ = tail_inputs((7, n), torch.bfloat16, device, seed=14, dy=True)
    want = T.tail_reference(g, u, r, w, EPS)
    # as close to float64 as eager's bf16 result is (within SLACK), not just within tolerance
    bound = SLACK[torch.bfloat16] * max(
        T.relative_error(T.tail_eager(g, u, r, w), want), T.UNIT_ROUNDOFF[torch.bfloat16]
    )
    for cfg in cands:
        y, rstd = K.tail_forward(g, u, r, w, EPS, config=cfg)
        assert torch.isfinite(y).all(), f"{cfg}: an output element was never written"
        assert T.relative_error(y, want) <= min(bound, T.FORWARD_TOL[torch.bfloat16]), cfg
        assert T.relative_error(rstd, reference_rstd(g, u, r)) <= 1e-5, cfg
