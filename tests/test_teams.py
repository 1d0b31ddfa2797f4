"""Rows shared by a team of programs (profuse.kernels.teams, the tail's team kernels).

On a CPU the interpreter runs one program after another, so a team has one member there: the
tests below check the bookkeeping (sequence numbers kept across calls, the grid's size, the
candidates) and the kernels with teams of one. Teams of several, whose members wait for each
other, are tested on a GPU: every team candidate at odd shapes against float64 and eager, bitwise
repeatable, inside a CUDA graph, and on two streams at once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cases import DTYPES, EPS, GRADS, tail_inputs

from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from profuse.kernels import (
    autotune,  # noqa: E402
    teams,  # noqa: E402
)
from profuse.kernels import configs as C  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402
from profuse.kernels.tail import plans as K  # noqa: E402
from profuse.kernels.tail import team as KT  # noqa: E402

CUDA = torch.cuda.is_available()
ALL = (True, True, True, True)


def _reference(xs, dy):
    x64 = [t.detach().double().requires_grad_() for t in xs]
    y = T.tail_reference(*x64, EPS)
    return (y, *torch.autograd.grad(y, x64, dy.double()))


def _check(xs, dy, cfg, dtype):
    """The team config's forward and gradients against float64, within the dtype's tolerance."""
    g, u, r, w = xs
    y, rstd = K.tail_forward(g, u, r, w, EPS, config=cfg)
    got = K.tail_backward(dy, g, u, r, w, rstd, ALL, config=cfg)
    ref = _reference(xs, dy)
    assert torch.isfinite(y).all(), "an output element was never written"
    assert T.relative_error(y, ref[0]) <= T.FORWARD_TOL[dtype]
    for name, t, want in zip(GRADS, got, ref[1:], strict=True):
        assert t.shape == want.shape and t.dtype == dtype, name
        assert T.relative_error(t, want) <= T.BACKWARD_TOL[dtype], f"d{name}"
    return y, got


# --------------------------------------------------------------------------------------------
# Anywhere (teams of one on a CPU)
# --------------------------------------------------------------------------------------------


def test_team_candidates_split_only_wide_rows(monkeypatch):
    for n in (100, 2048, 4096):
        assert not C.team_candidates(n, 132, C.FWD_TEAM_SHARES)
        assert not C.team_candidates(n, 132, C.BWD_TEAM_SHARES)
    for n in (4097, 5120, 11008, 65536):
        for shares in (C.FWD_TEAM_SHARES, C.BWD_TEAM_SHARES):
            cands = C.team_candidates(n, 132, shares)
            assert cands
            for c in cands:
                assert c.kernel == "team" and c.block_n < n and c.block_n & (c.block_n - 1) == 0
                # splits names the members: every column has one, no member is idle
                assert c.splits == -(-n // c.block_n) and (c.splits - 1) * c.block_n < n
                assert c.programs % 132 == 0
    # Out of the autotuner's lists with PROFUSE_TEAMS=0; by default in every wide-row list,
    # after the favourite.
    monkeypatch.setenv("PROFUSE_TEAMS", "0")
    assert not any(c.kernel == "team" for c in C.forward_candidates(2048, 65536, torch.bfloat16, 132))
    assert not any(c.kernel == "team" for c in C.backward_candidates(2048, 65536, torch.bfloat16, 132))
    monkeypatch.delenv("PROFUSE_TEAMS")
    for n in (8192, 65536):
        fwd = C.forward_candidates(2048, n, torch.bfloat16, 132)
        bwd = C.backward_candidates(2048, n, torch.bfloat16, 132)
        assert fwd[0].kernel != "team" and any(c.kernel == "team" for c in fwd)
        assert bwd[0].kernel != "team" and any(c.kernel == "team" for c in bwd)


def test_slots_and_members():
    assert teams.team_size(65536, 4096) == 16 and teams.team_size(5120, 2048) == 3
    assert teams.slots_for(3) == 4 and teams.slots_for(16) == 16 and teams.slots_for(1) == 1


@pytest.mark.parametrize("teams_max", [1, 2, 3, 7, 33, 64, 66, 352, 1000])
@pytest.mark.parametrize("n_rows", [1, 5, 10, 1024, 6553])
def test_balanced_teams_take_as_many_rounds_with_the_last_as_full_as_it_can_be(teams_max, n_rows):
    got = teams.balanced(teams_max, n_rows)
    rounds = -(-n_rows // teams_max)
    assert 1 <= got <= teams_max
    assert -(-n_rows // got) == rounds  # no more rounds than the most teams would take
    assert got == 1 or -(-n_rows // (got - 1)) > rounds  # and one team fewer would take more


def test_balanced_teams_at_the_grid_sizes():
    assert teams.balanced(33, 1024) == 32  # not one team working a 32nd row alone
    assert teams.balanced(66, 2048) == 64
    assert teams.balanced(352, 6553) == 345


def test_registers_and_threads_bound_the_programs_an_sm_holds(monkeypatch):
    class Props:
        regs_per_multiprocessor = 65536
        max_threads_per_multi_processor = 2048
        shared_memory_per_multiprocessor = 233472

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    dev = torch.device("cuda")
    assert teams.resident_per_sm(32, 8, 0, dev) == 8  # threads: 2048 / 256
    assert teams.resident_per_sm(64, 8, 0, dev) == 4  # registers: 65536 / (64 x 256)
    assert teams.resident_per_sm(65, 8, 0, dev) == 3  # 72 registers a thread, in blocks of 8
    assert teams.resident_per_sm(128, 16, 0, dev) == 1
    assert teams.resident_per_sm(32, 4, 100_000, dev) == 2  # shared memory
    assert teams.resident_per_sm(255, 32, 0, dev) == 0  # cannot be resident at all


@pytest.mark.skipif(CUDA, reason="on a GPU teams of several run")
def test_a_team_of_several_needs_a_gpu(device):
    xs = tail_inputs((3, 40), torch.float32, device)
    with pytest.raises(ValueError, match="needs a GPU"):
        K.tail_forward(*xs, EPS, config=KernelConfig("team", 1, 16, num_warps=1, programs=6, splits=3))


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_numbers_carry_over_between_calls(dtype, stages, device):
    """A team launch keeps its scratch: each call's numbers start where the last call's ended,
    so every call (forward and backward, different values each time) is right, and the
    counts grow by each team's rows."""
    cfg = KernelConfig("team", 1, 64, num_warps=2, num_stages=stages, programs=4)  # 4 teams of one, 10 rows
    shape = (10, 50)
    for seed in range(3):
        xs, dy = tail_inputs(shape, dtype, device, seed=seed, dy=True)
        _check(xs, dy, cfg, dtype)
    fwd = K._team_launch(K.tail_fwd_team_kernel, cfg, "fwd", 10, 50, num_warps=2)
    slots, counts = fwd.scratch(xs)
    assert slots.shape == (4, 2 * stages, 1)  # teams, buffers (4 with two stages), slots
    assert fwd.prepare(xs) == 4
    # rows 0,4,8 / 1,5,9 / 2,6 / 3,7, three calls; then the dw sum's arrivals, back at 0
    assert counts.tolist() == [3 * 3, 3 * 3, 3 * 2, 3 * 2, 0]
    bwd = K._backward_launch(cfg, 0, 10, 50, ALL, 0)
    _, bwd_counts = bwd.scratch(xs)
    # the backward's numbers, then its one member's arrivals at the dw sum: back at 0 for the next call
    assert bwd_counts.tolist() == [3 * 3, 3 * 3, 3 * 2, 3 * 2, 0]


def _row_team(n_cols: int, block_n: int, warps: int = 2) -> KernelConfig:
    return KernelConfig("team", 1, block_n, warps, 1, 0, -(-n_cols // block_n), l2="plain")


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_teams_are_right_and_keep_their_numbers(dtype, case, device):
    """Row teams (a team a row, one program a share): right against float64 and the same bits
    on every call; each (row, member) slot ends a call carrying the number of calls so far, and
    the padding slots stay untouched. Teams of one on a CPU; of 2 to 64 on a GPU (a last
    member with a few columns, more members than a power of two holds, one row)."""
    if device == "cuda":
        shape, block_n, warps = [((37, 5000), 2048, 4), ((301, 11008), 4096, 8), ((3, 9000), 1024, 2),
                                 ((1, 65536), 1024, 4)][case]  # fmt: skip
    else:
        shape, block_n, warps = [((7, 50), 64, 2), ((5, 33), 64, 1), ((1, 200), 256, 4), ((9, 8), 8, 1)][case]
    cfg = _row_team(shape[1], block_n, warps)
    xs = tail_inputs(shape, dtype, device, seed=41 + case)
    ref = T.tail_reference(*xs, EPS)
    first = None
    for _ in range(3):
        y, rstd = K.tail_forward(*xs, EPS, config=cfg)
        assert torch.isfinite(y).all(), "an output element was never written"
        assert T.relative_error(y, ref) <= T.FORWARD_TOL[dtype]
        if first is None:
            first = (y, rstd)
        assert torch.equal(y, first[0]) and torch.equal(rstd, first[1])
    (slots,) = K._row_team_launch(cfg, *shape).scratch(xs)
    members = cfg.splits
    assert slots.shape == (shape[0], teams.slots_for(members))
    assert ((slots[:, :members] >> 32) == 3).all()  # three calls
    assert (slots[:, members:] == 0).all()


def test_a_row_team_takes_its_register_cap(device):
    """A row team's register cap reaches ptxas (a config that names one is not run without it)
    and changes no bit of the answer."""
    if device == "cuda":
        shape, free = (37, 5000), _row_team(5000, 2048, 4)
    else:
        shape, free = (7, 50), _row_team(50, 64, 2)
    capped = KernelConfig(**{**free.to_dict(), "maxnreg": 32})
    xs = tail_inputs(shape, torch.bfloat16, device, seed=27)
    y, rstd = K.tail_forward(*xs, EPS, config=free)
    autotune.LAUNCH_LOG = []
    try:
        y_cap, rstd_cap = K.tail_forward(*xs, EPS, config=capped)
        regs = [e[2] for e in autotune.LAUNCH_LOG if e[1] == capped]
    finally:
        autotune.LAUNCH_LOG = None
    assert torch.equal(y, y_cap) and torch.equal(rstd, rstd_cap)
    if device == "cuda":
        assert regs and max(regs) <= 32, regs


@pytest.mark.skipif(CUDA, reason="on a GPU teams of several run")
def test_a_row_team_of_several_needs_a_gpu(device):
    xs = tail_inputs((3, 40), torch.float32, device)
    with pytest.raises(ValueError, match="needs a GPU"):
        K.tail_forward(*xs, EPS, config=_row_team(40, 16))


@pytest.mark.parametrize("n_cols", [4097, 11008, 65536])
def test_row_team_candidates_are_forward_only_and_run_a_program_a_share(n_cols):
    rows = [c for c in C.team_candidates(n_cols, 132, C.FWD_TEAM_SHARES) if not c.programs]
    assert rows, "the forward's lists offer row teams at wide rows"
    assert all(c.num_stages == 1 and not c.pipeline for c in rows)
    assert not [c for c in C.team_candidates(n_cols, 132, C.BWD_TEAM_SHARES) if not c.programs]


def test_a_row_team_config_is_refused_by_the_backward(device):
    xs, dy = tail_inputs((4, 40), torch.float32, device, seed=42, dy=True)
    _, rstd = K.tail_forward(*xs, EPS)
    with pytest.raises(ValueError, match="forward only"):
        K.tail_backward(dy, *xs, rstd, ALL, config=_row_team(40, 16))


# --------------------------------------------------------------------------------------------
# Teams of several: a GPU
# --------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="a team of several programs waits for its partners: needs a GPU")

# Odd shapes: a last member with a few columns, teams with one row more than others, fewer rows
# than teams.
GPU_SHAPES = [(37, 5000), (301, 11008), (5, 65536)]


def _check_forward(xs, cfg, dtype):
    y, rstd = K.tail_forward(*xs, EPS, config=cfg)
    assert torch.isfinite(y).all(), f"{cfg}: an output element was never written"
    assert T.relative_error(y, T.tail_reference(*xs, EPS)) <= T.FORWARD_TOL[dtype], cfg
    y2, rstd2 = K.tail_forward(*xs, EPS, config=cfg)
    assert torch.equal(y, y2) and torch.equal(rstd, rstd2), f"{cfg}: y differs between two runs"


def _check_backward(xs, dy, cfg, dtype):
    _, rstd = K.tail_forward(*xs, EPS)
    got = K.tail_backward(dy, *xs, rstd, ALL, config=cfg)
    for name, t, want in zip(GRADS, got, _reference(xs, dy)[1:], strict=True):
        assert T.relative_error(t, want) <= T.BACKWARD_TOL[dtype], f"{cfg}: d{name}"
    again = K.tail_backward(dy, *xs, rstd, ALL, config=cfg)
    for name, a, b in zip(GRADS, got, again, strict=True):
        assert torch.equal(a, b), f"{cfg}: d{name} differs between two runs"


@triton.jit
def _sigmoid_probe(X_ptr, Y_ptr, n, APPROX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y_ptr + i, KT._sigmoid(tl.load(X_ptr + i, mask=i < n), APPROX), mask=i < n)


@gpu
def test_the_approximate_sigmoid_is_within_a_few_ulp_of_the_exact_one_and_saturates():
    """The team kernels' sigmoid (the hardware's exp2 and reciprocal, flushing subnormals)
    against tl.sigmoid: within 4 fp32 ulp, or both below the smallest normal. Both against
    float64 within the rounding of x * log2(e) (|x| ulp) and a few more; 0 and 1 at the far ends."""
    ends = [0.0, -0.0, 15.0, -15.0, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30, float("inf"), float("-inf")]
    x = torch.cat([torch.randn(1 << 18, device="cuda") * 12, torch.tensor(ends, device="cuda")])
    got = {}
    for approx in (True, False):
        got[approx] = torch.empty_like(x)
        _sigmoid_probe[(triton.cdiv(x.numel(), 1024),)](x, got[approx], x.numel(), APPROX=approx, BLOCK=1024)
    fast, exact = got[True].double(), got[False].double()
    tiny = 2.0**-126
    apart = (fast - exact).abs()
    assert (apart <= 4 * 2.0**-24 * exact + tiny).all(), x[apart > 4 * 2.0**-24 * exact + tiny][:5]
    want = torch.sigmoid(x.double())
    bound = (x.double().abs().clamp_max(200) + 8) * 2.0**-24 * want + tiny
    for name, y in (("approximate", fast), ("exact", exact)):
        bad = (y - want).abs() > bound
        assert not bad.any(), (name, x[bad][:5])
    assert got[True][-2].item() == 1.0 and got[True][-1].item() == 0.0


@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_every_team_candidate_is_right_and_repeatable(shape):
    xs, dy = tail_inputs(shape, torch.bfloat16, "cuda", seed=21, dy=True)
    for cfg in C.team_candidates(shape[1], 132, C.FWD_TEAM_SHARES):
        _check_forward(xs, cfg, torch.bfloat16)
    for cfg in C.team_candidates(shape[1], 132, C.BWD_TEAM_SHARES):
        _check_backward(xs, dy, cfg, torch.bfloat16)


@gpu
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_teams_in_every_dtype(dtype, stages):
    """fp32 rows take more registers (the grid is sized per dtype); one row per team."""
    shape = (40, 9000)
    xs, dy = tail_inputs(shape, dtype, "cuda", seed=25, dy=True)
    _check_forward(xs, KernelConfig("team", 1, 2048, 8, stages, 264, 5), dtype)
    _check_backward(xs, dy, KernelConfig("team", 1, 2048, 8, stages, 264, 5), dtype)


@pytest.mark.parametrize("depth, stages", [(2, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_staged_team_kernels_match_the_unstaged_ones(dtype, depth, stages, device):
    """The staged team kernels (rows loaded ahead by Triton's software pipeliner, the wait in
    inline assembly on a GPU) compute what the unstaged ones do: the same sums in the same order,
    so the same bits; right against float64; the same again on a second call (whose first wait is
    for the last number the first call published). Two stages: the lagged exchange."""
    if device == "cuda":
        shape, plain = (301, 11008), KernelConfig("team", 1, 1024, 4, stages, 132 * 8, 11)
    else:
        shape, plain = (9, 50), KernelConfig("team", 1, 64, num_warps=2, num_stages=stages, programs=4)
    staged = KernelConfig(**{**plain.to_dict(), "pipeline": depth})
    xs, dy = tail_inputs(shape, dtype, device, seed=27, dy=True)
    y, grads = _check(xs, dy, plain, dtype)
    for _ in range(2):
        y_st, grads_st = _check(xs, dy, staged, dtype)
        assert torch.equal(y, y_st)
        for name, a, b in zip(GRADS, grads, grads_st, strict=True):
            assert torch.equal(a, b), f"d{name}"


@pytest.mark.parametrize("stages", [1, 2])
def test_a_register_cap_changes_where_values_live_not_the_answer(stages, device):
    """A capped team kernel computes what the uncapped one does, bit for bit (only ptxas's
    register allocation differs; on a GPU some values spill), and its compiled kernel keeps
    under the cap."""
    if device == "cuda":
        shape, free = (301, 11008), KernelConfig("team", 1, 1024, 4, stages, 132 * 8, 11)
    else:
        shape, free = (9, 50), KernelConfig("team", 1, 64, num_warps=2, num_stages=stages, programs=4)
    capped = KernelConfig(**{**free.to_dict(), "maxnreg": 64})
    xs, dy = tail_inputs(shape, torch.bfloat16, device, seed=26, dy=True)
    y, grads = _check(xs, dy, free, torch.bfloat16)
    autotune.LAUNCH_LOG = []
    try:
        y_cap, grads_cap = _check(xs, dy, capped, torch.bfloat16)
        regs = [e[2] for e in autotune.LAUNCH_LOG if e[1] == capped]
    finally:
        autotune.LAUNCH_LOG = None
    assert torch.equal(y, y_cap)
    for name, a, b in zip(GRADS, grads, grads_cap, strict=True):
        assert torch.equal(a, b), f"d{name}"
    if device == "cuda":
        assert regs and max(regs) <= 64, regs


@gpu
def test_a_row_team_member_whose_partner_never_runs_stops_the_kernel_instead_of_hanging():
    """A launch whose grid leaves out the last member of the last row: its partners poll
    PATIENCE times, then trap. In a process of its own, as a trap ends the CUDA context."""
    script = """
import torch
from profuse.kernels import tail as K
from profuse.kernels.configs import KernelConfig
from profuse.kernels.teams import slots_for
n_rows, n_cols, block_n = 4, 8192, 2048
cfg = KernelConfig("team", 1, block_n, 4, 1, 0, 4, l2="plain")
x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
y, rstd = torch.empty_like(x), torch.empty(n_rows, device="cuda")
slots = torch.zeros(n_rows, slots_for(4), dtype=torch.int64, device="cuda")
grid = (n_rows * 4 - 1,)
args = (x, x, x, x[0], y, rstd, n_cols, n_cols, n_cols, n_cols, n_rows, n_cols, 1e-6, slots)
K.tail_fwd_row_team_kernel[grid](*args, MEMBERS=4, SLOTS=4, BLOCK_N=block_n, SPIN=True, PATIENCE=1000,
                                  APPROX=True, num_warps=4)
torch.cuda.synchronize()
print("no error")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert proc.returncode != 0 and "no error" not in proc.stdout, proc.stdout + proc.stderr


@gpu
def test_teams_match_float64_as_closely_as_the_chunked_kernels():
    """At a real width the team kernels' error against float64 is no worse than the chunked
    kernels' (which read a row twice) by more than two roundings."""
    shape, dtype = (64, 32768), torch.bfloat16
    xs, dy = tail_inputs(shape, dtype, "cuda", seed=22, dy=True)
    ref = _reference(xs, dy)
    unit = T.UNIT_ROUNDOFF[dtype]
    old = KernelConfig("chunked", 1, 4096, 16, programs=132)
    y_old, rstd = K.tail_forward(*xs, EPS, config=old)
    grads_old = K.tail_backward(dy, *xs, rstd, ALL, config=old)
    for cfg in C.team_candidates(shape[1], 132, C.FWD_TEAM_SHARES):
        y = K.tail_forward(*xs, EPS, config=cfg)[0]
        assert T.relative_error(y, ref[0]) <= T.relative_error(y_old, ref[0]) + 2 * unit, cfg
    for cfg in C.team_candidates(shape[1], 132, C.BWD_TEAM_SHARES):
        got = K.tail_backward(dy, *xs, rstd, ALL, config=cfg)
        for name, a, b, want in zip(GRADS, got, grads_old, ref[1:], strict=True):
            assert T.relative_error(a, want) <= T.relative_error(b, want) + 2 * unit, f"{cfg}: d{name}"


@gpu
def test_teams_replay_in_a_cuda_graph_and_beside_eager_calls():
    """A graph replays the team kernels with the scratch it captured; eager calls on the same
    stream between replays keep the sequence numbers in step."""
    shape, dtype = (300, 16384), torch.bfloat16
    cfg = C.team_candidates(shape[1], 132, C.FWD_TEAM_SHARES)[0]
    bcfg = C.team_candidates(shape[1], 132, C.BWD_TEAM_SHARES)[0]
    xs, dy = tail_inputs(shape, dtype, "cuda", seed=23, dy=True)
    g, u, r, w = xs

    def step():
        y, rstd = K.tail_forward(g, u, r, w, EPS, config=cfg)
        return (y, *K.tail_backward(dy, g, u, r, w, rstd, ALL, config=bcfg))

    step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2, 3):
        new, new_dy = tail_inputs(shape, dtype, "cuda", seed=seed, dy=True)
        for t, v in zip((g, u, r, w, dy), (*new, new_dy)):
            t.copy_(v)
        graph.replay()
        eager = step()  # on the default stream, between replays
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(xs, dy)
        assert T.relative_error(outs[0], ref[0]) <= T.FORWARD_TOL[dtype]
        for got, want in zip(outs[1:], ref[1:]):
            assert T.relative_error(got, want) <= T.BACKWARD_TOL[dtype]
        for a, b in zip(outs, eager):
            assert torch.equal(a, b)


@gpu
def test_two_streams_at_once_each_have_their_own_scratch():
    shape, dtype = (2000, 16384), torch.bfloat16
    cfg = C.team_candidates(shape[1], 132, C.FWD_TEAM_SHARES)[0]
    inputs = [tail_inputs(shape, dtype, "cuda", seed=s) for s in (31, 32)]
    want = [K.tail_forward(*xs, EPS, config=cfg)[0] for xs in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(5):
        for s, xs in zip(streams, inputs):
            with torch.cuda.stream(s):
                outs.append((s, K.tail_forward(*xs, EPS, config=cfg)[0]))
    torch.cuda.synchronize()
    for i, (_s, y) in enumerate(outs):
        assert torch.equal(y, want[i % 2])


@gpu
def test_the_tuned_path_through_autograd_is_right_at_wide_rows():
    """Whatever the autotuner picks at a wide shape (a team kernel or not) is right."""
    shape, dtype = (512, 24576), torch.bfloat16
    xs, dy = tail_inputs(shape, dtype, "cuda", seed=24, dy=True)
    leaves = [t.clone().requires_grad_() for t in xs]
    y = T.tail_triton(*leaves, EPS)
    got = (y, *torch.autograd.grad(y, leaves, dy))
    ref = _reference(xs, dy)
    assert T.relative_error(got[0], ref[0]) <= T.FORWARD_TOL[dtype]
    for name, a, want in zip(GRADS, got[1:], ref[1:], strict=True):
        assert T.relative_error(a, want) <= T.BACKWARD_TOL[dtype], name
