"""Part C's prediction (profuse.amdahl): like-for-like op inputs, the shares step by step with
their spread in the interval, the in-step cross-check, and the caveat where the step is not
device-bound. Fake traces and fake figures drive the rules; one tiny run checks the wiring."""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch

from profuse import amdahl as A
from profuse import fusion
from profuse import step as S
from profuse.model import GPTConfig
from profuse.report.step import format_step
from profuse.report.stepchecks import amdahl_lines

TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)


def sp(median, low, high):
    return {"median": median, "low": low, "high": high, "verdict": "faster"}


# --------------------------------------------------------------------------------------------
# The prediction and its interval
# --------------------------------------------------------------------------------------------


def test_the_shares_spread_widens_the_interval():
    speedup = {"silu_mul": sp(2.0, 1.8, 2.2)}
    one = A.Amdahl(1.0, {"silu_mul": [0.2]}, speedup, None)
    three = A.Amdahl(1.0, {"silu_mul": [0.25, 0.15, 0.2]}, speedup, None)
    assert math.isclose(one.predict(), three.predict())  # the same median share
    assert one.interval() == pytest.approx((one.predict("low"), one.predict("high")))  # the ops' CIs alone
    low, high = three.interval()
    assert low < one.interval()[0] and high > one.interval()[1]
    assert math.isclose(low, 1 / ((1 - 0.15) + 0.15 / 1.8))  # least time in it, slowest fused
    assert math.isclose(high, 1 / ((1 - 0.25) + 0.25 / 2.2))  # most time in it, fastest fused
    d = three.to_dict()["predicted"]
    assert (d["low"], d["high"]) == (low, high) and d["ops_low"] > low and d["ops_high"] < high


def test_a_slower_op_saves_least_where_it_takes_most():
    """For an op whose speedup may be under 1, the least-saving corner is its largest share."""
    a = A.Amdahl(1.0, {"rope": [0.1, 0.3]}, {"rope": sp(1.0, 0.8, 1.25)}, None)
    low, high = a.interval()
    assert math.isclose(low, 1 / ((1 - 0.3) + 0.3 / 0.8))
    assert math.isclose(high, 1 / ((1 - 0.3) + 0.3 / 1.25))
    assert low < 1 < high


def test_the_arithmetic_of_two_ops_and_an_untimed_one():
    a = A.Amdahl(
        1.0,
        {"silu_mul": 0.2, "add_rms_norm": 0.1},
        {"silu_mul": sp(2, 1.5, 2.5), "add_rms_norm": sp(4, 2, 5)},
        None,
    )
    assert math.isclose(a.f, 0.3) and math.isclose(a.ceiling, 1 / 0.7)
    assert math.isclose(a.predict(), 1 / (0.7 + 0.1 + 0.025))
    partial = A.Amdahl(1.0, {"silu_mul": [0.2], "rope": [0.1]}, {"silu_mul": sp(2, 1.5, 2.5)}, None)
    assert partial.predict() is None and partial.interval() is None and partial.to_dict()["predicted"] is None


# --------------------------------------------------------------------------------------------
# The in-step cross-check and the caveat
# --------------------------------------------------------------------------------------------


def test_an_op_alone_is_cross_checked_against_its_time_in_the_step():
    """The issue's figures (Llama-3.2-1B, H200): silu_mul 977 us a call alone on the packed
    input, 451 us a call in the step (7.22 ms over 16 layers), 3.71x fused alone."""
    a = A.Amdahl(
        0.1958,
        {"silu_mul": [7.22e-3]},
        {"silu_mul": sp(3.71, 3.70, 3.72)},
        None,
        calls={"silu_mul": 16},
        eager_call_s={"silu_mul": 977e-6},
    )
    c = a.in_step()["silu_mul"]
    assert math.isclose(c["in_step_s"], 7.22e-3 / 16) and math.isclose(c["ratio"], 7.22e-3 / 16 / 977e-6)
    assert a.disagree() == ["silu_mul"]
    f = 7.22e-3 / 0.1958
    s_in_step = 3.71 * c["ratio"]
    assert 1.6 < s_in_step < 1.8  # "about 1.7x, not 3.71x"
    assert math.isclose(a.predict_in_step(), 1 / ((1 - f) + f / s_in_step))
    assert a.predict_in_step() < a.predict()
    close = A.Amdahl(
        1.0, {"silu_mul": [0.16]}, {"silu_mul": sp(2, 1.9, 2.1)}, None, {"silu_mul": 16}, {"silu_mul": 0.011}
    )
    assert close.disagree() == [] and math.isclose(close.in_step()["silu_mul"]["ratio"], 0.01 / 0.011)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(gpu_idle_pct=4.3, host_s=0.17, device_s=0.19), ""),
        (dict(gpu_idle_pct=30.0, host_s=0.01, device_s=0.19), "its GPU idles 30% of it (over 10%)"),
        (dict(gpu_idle_pct=4.3, host_s=0.222, device_s=0.187), "its host time (222.0 ms) is at least"),
        (dict(gpu_idle_pct=55.0, host_s=0.3, device_s=0.1), "idles 55%"),
        (dict(), ""),  # a CPU: the step and the ops are host time alike
    ],
)
def test_the_caveat_where_the_step_is_not_device_bound(kw, words):
    a = A.Amdahl(0.2, {"silu_mul": [0.01]}, {"silu_mul": sp(2, 1.9, 2.1)}, sp(1.02, 1.01, 1.03), **kw)
    caveat = a.caveat()
    assert (caveat == "") == (words == "")
    if words:
        assert words in caveat and "not device-bound" in caveat and a.to_dict()["caveat"] == caveat


# --------------------------------------------------------------------------------------------
# The shares, step by step, from a trace
# --------------------------------------------------------------------------------------------


def _span(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}


def _fake_trace(calls_us: list[list[float]]) -> dict:
    """One ProfilerStep of 1000 us per entry, each holding labelled silu_mul calls of the given
    durations (an aten op inside each), then an unlabelled matmul."""
    events = []
    for i, calls in enumerate(calls_us):
        start = 5000.0 * i
        events.append(_span(f"ProfilerStep#{i}", "user_annotation", start, 1000.0))
        t = start + 50
        for d in calls:
            events.append(_span(A.op_range("silu_mul"), "user_annotation", t, d))
            events.append(_span("aten::mul", "cpu_op", t + 5, d - 10))
            t += d + 10
        events.append(_span("aten::mm", "cpu_op", start + 700, 200.0))
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host"}})
    return {"traceEvents": events}


def test_shares_are_read_step_by_step_from_the_trace():
    shares = A.step_shares(_fake_trace([[100, 100], [150, 150], [120, 130]]), "cpu")
    assert set(shares.ops) == {"silu_mul"}  # add_rms_norm was not labelled: not in the step
    op = shares.ops["silu_mul"]
    assert op.step_s == pytest.approx([200e-6, 300e-6, 250e-6])
    assert op.calls == 2 and op.call_s == pytest.approx(125e-6)
    assert shares.step_s == pytest.approx([1000e-6] * 3) and shares.basis == "self CPU time"
    assert shares.gpu_idle_pct == [] and shares.idle_pct is None
    with pytest.raises(ValueError, match="no ProfilerStep"):
        A.step_shares({"traceEvents": []}, "cpu")


# --------------------------------------------------------------------------------------------
# The ops as the step calls them
# --------------------------------------------------------------------------------------------

DIMS = A.OpDims(
    batch=2, seq=6, d_model=40, ffn_hidden=56, n_head=4, n_kv_head=2, head_dim=10, vocab=97, eps=1e-6
)
AMP = A.OpDtypes(stream=torch.float32, compute=torch.bfloat16, autocast=True)
BF16 = A.OpDtypes(stream=torch.bfloat16, compute=torch.bfloat16, autocast=False)
FP32 = A.OpDtypes(stream=torch.float32, compute=torch.float32, autocast=False)  # a CPU step
FP16 = A.OpDtypes(stream=torch.float32, compute=torch.float16, autocast=True)


@pytest.mark.parametrize("dtypes", [AMP, BF16, FP32, FP16], ids=["amp", "bf16", "fp32", "fp16-autocast"])
def test_each_op_takes_the_call_form_shapes_and_dtypes_the_step_uses(dtypes):
    cpu = torch.device("cpu")
    cases = A.op_cases(A.OPS, "qwen3", DIMS, dtypes, cpu, fused=A.eager_impls("qwen3"))
    dt = lambda case: [t.dtype for t in case.leaves]  # noqa: E731
    shapes = lambda case: [tuple(t.shape) for t in case.leaves]  # noqa: E731
    cd, sd = dtypes.compute, dtypes.stream
    assert shapes(cases["silu_mul"]) == [(2, 6, 56), (2, 6, 56)] and dt(cases["silu_mul"]) == [cd, cd]
    assert dt(cases["add_rms_norm"]) == [cd, sd, sd]  # amp: x bf16, residual and weight fp32
    assert dt(cases["rms_norm"]) == [sd, sd]  # layer 0's norm reads the embeddings
    assert shapes(cases["rope"]) == [(2, 6, 4, 10), (2, 6, 2, 10)]
    assert shapes(cases["qk_norm_rope"])[2:] == [(10,), (10,)] and dt(cases["qk_norm_rope"])[2:] == [sd, sd]
    assert shapes(cases["linear_cross_entropy"]) == [(2, 6, 40), (97, 40)]
    assert dt(cases["rms_norm_add"]) == [cd, sd, sd]  # a sublayer's output onto the stream
    assert shapes(cases["clamped_swiglu"]) == [(12, 112)]  # packed gate_up, one row a token
    assert shapes(cases["layer_norm"]) == [(2, 6, 40), (40,), (40,)] and dt(cases["layer_norm"]) == [sd] * 3
    for op, case in cases.items():
        with dtypes.context(cpu):
            out = case.eager(*case.leaves)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(torch.isfinite(o.float()).all() for o in outs), op
    q, k = cases["rope"].eager(*cases["rope"].leaves)
    assert q.shape == (2, 4, 6, 10) and k.shape == (2, 2, 6, 10)  # transposed to (B, H, T, D) inside


def test_the_gpt_calls_silu_mul_on_its_packed_matmul_output():
    cases = A.op_cases(["silu_mul"], "gpt", DIMS, A.OpDtypes(torch.float32, torch.float32, False), "cpu")
    assert [tuple(t.shape) for t in cases["silu_mul"].leaves] == [(2, 6, 112)]
    assert "packed" in cases["silu_mul"].shape
    with pytest.raises(ValueError, match="no unfused form"):
        A.op_cases(["rope"], "gpt", DIMS, AMP, torch.device("cpu"))


def test_an_op_whose_fused_side_cannot_run_is_named_and_the_others_timed():
    def broken(*args):
        raise RuntimeError("no kernel for this op here\nmore")

    fused = {**A.eager_impls("llama"), "rope": broken}
    cases = A.op_cases(["silu_mul", "rope"], "llama", DIMS, BF16, torch.device("cpu"), fused=fused)
    timed, not_timed = A.time_ops(cases, device=torch.device("cpu"), dtypes=BF16, trials=2, warmup=0)
    assert set(timed) == {"silu_mul"} and not_timed == {"rope": "RuntimeError: no kernel for this op here"}
    assert timed["silu_mul"].eager_s > 0 and timed["silu_mul"].speedup.low <= timed["silu_mul"].speedup.high
    assert set(A.fused_impls(fusion.EAGER)) == set(A.OPS)
    assert A.fused_impls(fusion.EAGER)["silu_mul"] is fusion.EAGER.silu_mul


# --------------------------------------------------------------------------------------------
# In a run
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = S.StepConfig(
        model=TINY,
        variants=("eager", "fused"),
        trials=3,
        profile_steps=2,
        out_dir=tmp_path_factory.mktemp("a"),
    )
    return S.run_step(cfg, ops=fusion.EAGER)


def test_a_run_reads_every_profiled_step_and_counts_the_calls(run):
    a = run.amdahl
    assert a.calls == {"silu_mul": TINY.n_layer, "add_rms_norm": 2 * TINY.n_layer}  # fusion's places
    assert all(len(ts) == 2 for ts in a.op_s.values())  # one time per profiled step
    assert a.speedup_source == "in-step" and run.ops == {} and a.eager_call_s == {}  # none timed alone
    assert set(a.op_speedups) == {"silu_mul", "add_rms_norm"}
    assert a.gpu_idle_pct is None and a.caveat() == ""  # a CPU run
    text = format_step(run.to_dict())
    assert "their speedups inside the step: each op's self CPU time under its range" in text
    assert "in 2 profiled eager steps over 2 profiled fused steps" in text
    assert "over the ops' in-step intervals and the shares' spread over the profiled steps" in text


def test_a_file_from_before_the_step_by_step_shares_still_reads(run):
    data = copy.deepcopy(run.to_dict())
    a = data["amdahl"]
    a["op_s"] = {op: ts[0] for op, ts in a["op_s"].items()}
    for key in ("in_step_check", "disagree", "caveat", "thresholds", "not_timed", "calls", "eager_call_s",
                "speedup_source"):  # fmt: skip
        del a[key]
    for key in ("ops_low", "ops_high", "in_step"):
        del a["predicted"][key]
    text = format_step(data)
    assert "predicted step gain" in text and "over the ops' CIs)" in text


def _fake_ops_trace(op_us: dict[str, float], steps: int = 3) -> dict:
    """ProfilerSteps of 1000 us, each holding one labelled call of every op in `op_us`
    ("profuse.block_op: OP", as fusion's labels) for its duration, an aten op inside each."""
    events = []
    for i in range(steps):
        start = 5000.0 * i
        events.append(_span(f"ProfilerStep#{i}", "user_annotation", start, 1000.0))
        t = start + 10
        for op, d in op_us.items():
            events.append(_span(A.op_range(op), "user_annotation", t, d))
            events.append(_span("aten::mul", "cpu_op", t + 2, d - 4))
            t += d + 5
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host"}})
    return {"traceEvents": events}


@pytest.mark.parametrize(
    "positional, ops",
    [
        ("rope", {"rms_norm": 20, "rope": 30, "silu_mul": 80, "add_rms_norm": 40,
                  "linear_cross_entropy": 120}),
        ("qk_norm_rope", {"rms_norm": 20, "qk_norm_rope": 50, "silu_mul": 80, "add_rms_norm": 40,
                          "linear_cross_entropy": 120}),
        ("rms_norm_add", {"rms_norm": 30, "qk_norm_rope": 50, "silu_mul": 90, "rms_norm_add": 60,
                          "linear_cross_entropy": 110}),
        ("clamped_swiglu", {"rms_norm": 20, "rope": 30, "clamped_swiglu": 70, "add_rms_norm": 40,
                            "linear_cross_entropy": 120}),
        ("layer_norm", {"layer_norm": 45, "rope": 30, "linear_cross_entropy": 120}),
    ],
    ids=["llama", "qwen3", "gemma3-sandwich", "gpt-oss", "starcoder2"],
)  # fmt: skip
def test_every_labelled_op_gets_its_share_and_its_own_speedup_in_the_amdahl_rows(positional, ops):
    """Each op fusion replaces, found by its range in the labelled eager profile, has its own row:
    its share of the step and its own speedup (Qwen3: qk_norm_rope in place of rope)."""
    shares = A.step_shares(_fake_ops_trace(ops), "cpu")
    assert set(shares.ops) == set(ops) and positional in shares.ops
    for op, us in ops.items():
        assert shares.ops[op].step_s == pytest.approx([us * 1e-6] * 3) and shares.ops[op].calls == 1
    speedups = {op: sp(1.5 + i / 10, 1.4 + i / 10, 1.6 + i / 10) for i, op in enumerate(ops)}
    a = A.Amdahl(
        eager_step_s=1000e-6,
        op_s={op: s.step_s for op, s in shares.ops.items()},
        op_speedups=speedups,
        measured=None,
        calls={op: s.calls for op, s in shares.ops.items()},
    )
    assert a.fractions == pytest.approx({op: us / 1000 for op, us in ops.items()})
    want = 1 / (
        (1 - sum(ops.values()) / 1000) + sum(us / 1000 / speedups[op]["median"] for op, us in ops.items())
    )
    assert a.predict() == pytest.approx(want)
    shapes = {op: {"shape": f"{op} at the step's shapes"} for op in ops}
    data = {"amdahl": a.to_dict(), "profiles": {}, "config": {"device": "cpu"}, "ops": shapes}
    lines = amdahl_lines(data)
    for op, us in ops.items():
        assert f"{op} {us / 10:.1f}%" in lines[0]  # its share of the step
        [row] = [
            line for line in lines if line.strip().startswith(f"{op} ") and "at the step's shapes" in line
        ]
        assert f"{speedups[op]['median']:.2f}x" in row  # and its own speedup


def _varying_ops_trace(op_us: dict[str, list[float]]) -> dict:
    """One ProfilerStep a profiled step, each op's labelled call taking its step's duration."""
    events = []
    steps = len(next(iter(op_us.values())))
    for i in range(steps):
        start = 5000.0 * i
        events.append(_span(f"ProfilerStep#{i}", "user_annotation", start, 1000.0))
        t = start + 10
        for op, ds in op_us.items():
            events.append(_span(A.op_range(op), "user_annotation", t, ds[i]))
            events.append(_span("aten::mul", "cpu_op", t + 2, ds[i] - 4))
            t += ds[i] + 5
    return {"traceEvents": events}


def test_the_ops_speedups_come_from_their_own_time_inside_the_eager_and_the_fused_step():
    """s_i from the kernels (here operators) under each op's range in the eager steps over the
    fused ones, its interval the least and most favourable pairing of steps; the prediction's
    interval then carries both sides' spread and the shares'."""
    rng = torch.Generator().manual_seed(23)
    jitter = lambda: (1 + 0.05 * torch.rand(3, generator=rng)).tolist()  # noqa: E731
    eager_us = {"silu_mul": [80 * j for j in jitter()], "add_rms_norm": [60 * j for j in jitter()],
                "rope": [30 * j for j in jitter()]}  # fmt: skip
    fused_us = {"silu_mul": [40 * j for j in jitter()], "add_rms_norm": [50 * j for j in jitter()]}
    eager = A.step_shares(_varying_ops_trace(eager_us), "cpu")
    fused = A.step_shares(_varying_ops_trace(fused_us), "cpu")
    speedups, missing = A.in_step_speedups(eager, fused)
    assert set(speedups) == {"silu_mul", "add_rms_norm"} and "rope" in missing  # not in the fused step
    for op, s in speedups.items():
        e = [u * 1e-6 for u in eager_us[op]]
        f = [u * 1e-6 for u in fused_us[op]]
        assert s["median"] == pytest.approx(statistics.median(e) / statistics.median(f))
        assert s["low"] == pytest.approx(min(e) / max(f)) and s["high"] == pytest.approx(max(e) / min(f))
        assert s["low"] < s["median"] < s["high"]
    assert speedups["silu_mul"]["verdict"] == "faster"  # 1.9x-2.1x: the whole interval over 1
    a = A.Amdahl(
        eager_step_s=1000e-6,
        op_s={op: sh.step_s for op, sh in eager.ops.items() if op in speedups},
        op_speedups=speedups,
        measured=None,
        speedup_source="in-step",
    )
    low, high = a.interval()
    assert low < a.predict("low") <= a.predict() <= a.predict("high") < high  # the shares' spread too
    text = "\n".join(amdahl_lines({"amdahl": a.to_dict(), "profiles": {}, "config": {"device": "cpu"}}))
    assert "their speedups inside the step" in text and "3 profiled eager steps over 3 profiled fused" in text
