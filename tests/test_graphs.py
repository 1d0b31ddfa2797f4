"""The fused tail inside a CUDA graph (needs a GPU; on a CPU the rule it rests on, that nothing is
tuned during a capture, is tested in test_autotune.py).

A graph replays the kernels it recorded with the pointers it recorded: new values copied into the
captured inputs must give the right outputs, dweight must come out bitwise the same on every
replay, and a first call made inside the capture (no plan yet) must run untuned, not time
candidates mid-capture.
"""

from __future__ import annotations

import pytest
import torch

from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not (torch.cuda.is_available() and HAS_TRITON):
    pytest.skip("CUDA graphs need a CUDA GPU and triton", allow_module_level=True)

from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels.tail import plans as K  # noqa: E402

DEV = torch.device("cuda")
EPS = 1e-6


def _fill(ts, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    for t in ts:
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, device=DEV, generator=gen, dtype=t.dtype))


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("shape", [(257, 4096), (3, 1000, 1024), (64, 20000)])
def test_forward_and_backward_replay_right_and_repeatable(shape):
    dtype = torch.bfloat16
    g, u, r, dy = (torch.empty(shape, device=DEV, dtype=dtype) for _ in range(4))
    w = torch.empty(shape[-1], device=DEV, dtype=dtype)
    leaves = [t.requires_grad_() for t in (g, u, r, w)]

    def step():
        y = T.tail_triton(*leaves, EPS)
        return (y, *torch.autograd.grad(y, leaves, dy))

    _fill([g, u, r, w, dy], 0)
    step()  # plans made (and tuned) outside the capture
    graph, outs = _capture(step)
    for seed in (1, 2):
        _fill([g, u, r, w, dy], seed)
        graph.replay()
        torch.cuda.synchronize()
        xs = [t.detach().double().requires_grad_() for t in leaves]
        y64 = T.tail_reference(*xs, EPS)
        ref = (y64, *torch.autograd.grad(y64, xs, dy.double()))
        assert T.relative_error(outs[0], ref[0]) <= T.FORWARD_TOL[dtype]
        for got, want in zip(outs[1:], ref[1:]):
            assert T.relative_error(got, want) <= T.BACKWARD_TOL[dtype]
        dw = outs[4].clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dw, outs[4]), "dweight changed between two replays of the same inputs"


def test_forward_without_gradients_replays():
    shape = (1000, 2048)
    g, u, r = (torch.empty(shape, device=DEV, dtype=torch.float16) for _ in range(3))
    w = torch.empty(shape[-1], device=DEV, dtype=torch.float16)
    _fill([g, u, r, w], 3)
    graph, y = _capture(lambda: T.tail_triton(g, u, r, w, EPS))
    _fill([g, u, r, w], 4)
    graph.replay()
    torch.cuda.synchronize()
    assert T.relative_error(y, T.tail_reference(g, u, r, w, EPS)) <= T.FORWARD_TOL[torch.float16]


def test_a_first_call_inside_a_capture_runs_untuned(monkeypatch):
    """A shape seen for the first time inside a capture: no candidate is timed (the tuner's timer
    would fail mid-capture), the favourite runs, and the plan is not kept, so a later call
    outside the capture tunes as usual."""
    monkeypatch.setattr(K, "_FWD_PLANS", A.PlanCache())
    monkeypatch.setattr(K, "_BWD_PLANS", A.PlanCache())
    timed = []
    tuner = A.Autotuner(make_timer=lambda d: timed.append(d) or A.CudaTimer(d))
    monkeypatch.setattr(K, "TUNER", tuner)
    shape = (333, 3000)
    g, u, r = (torch.empty(shape, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    w = torch.empty(shape[-1], device=DEV, dtype=torch.bfloat16)
    _fill([g, u, r, w], 5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = T.tail_triton(g, u, r, w, EPS)
    graph.replay()
    torch.cuda.synchronize()
    assert not timed and not K._FWD_PLANS
    assert T.relative_error(y, T.tail_reference(g, u, r, w, EPS)) <= T.FORWARD_TOL[torch.bfloat16]
    T.tail_triton(g, u, r, w, EPS)
    assert len(K._FWD_PLANS) == 1


def test_part_b_graph_timing_times_every_variant():
    from profuse.bench.tail_bench import TailBenchConfig, run_tail_bench

    cfg = TailBenchConfig(
        rows=512, cols=1024, dtype=torch.bfloat16, device=DEV, trials=3, backward=True,
        variants=("eager", "rms_norm", "triton"), timing="graph",
    )  # fmt: skip
    res = run_tail_bench(cfg)
    d = res.to_dict()
    assert d["timing"] == "graph" and d["comparison"]["timing"] == "graph"
    assert set(d["results"]) == {"eager", "rms_norm", "triton"}, d["skipped"]
    for row in d["results"].values():
        assert row["host_s"] > 0 and row["median_s"] > 0


def _bindings(*modules):
    """Every checked direct-launch binding of the forward and backward plans in `modules`."""
    out = []
    for module in modules:
        for plans in (module._FWD_PLANS, module._BWD_PLANS):
            for plan in plans.values():
                for launch in (plan, getattr(plan, "main", None), getattr(plan, "col_sum", None)):
                    bound = getattr(launch, "bound", None) or {}
                    out += [b for b in bound.values() if b.checked]
    return out


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)], ids=str)
def test_block_ops_replay_through_direct_launches(dtypes):
    """silu_mul (packed) and add_rms_norm, forward + backward, captured after their launches are
    bound and checked: the graph records the direct launches, replays give right answers for new
    inputs, and dweight the same bits on every replay."""
    from profuse import blockops as B
    from profuse.kernels import add_rms_norm as ARN
    from profuse.kernels import swiglu as S

    act, stream_dtype = dtypes
    rows, n = 300, 1024
    gu = torch.empty(rows, 2 * n, device=DEV, dtype=act)
    x, da, dy = (torch.empty(rows, n, device=DEV, dtype=act) for _ in range(3))
    r, dh = (torch.empty(rows, n, device=DEV, dtype=stream_dtype) for _ in range(2))
    w = torch.empty(n, device=DEV, dtype=stream_dtype)
    leaves = [t.requires_grad_() for t in (gu, x, r, w)]

    def step():
        a = B.silu_mul(leaves[0])
        y, h = B.add_rms_norm(leaves[1], leaves[2], leaves[3], EPS)
        return (a, y, h, *torch.autograd.grad((a, y, h), leaves, (da, dy, dh)))

    _fill([gu, x, r, w, da, dy, dh], 6)
    step()  # plans made and launches bound
    step()  # each binding's first direct launch, checked against the JIT route
    assert _bindings(S, ARN), "no direct launch was bound"
    graph, outs = _capture(step)
    for seed in (7, 8):
        _fill([gu, x, r, w, da, dy, dh], seed)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for got, ref in zip(outs, want, strict=True):
            assert torch.equal(got, ref)  # the same kernels on the same inputs: the same bits
        dw = outs[-1].clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dw, outs[-1]), "dweight changed between two replays of the same inputs"
