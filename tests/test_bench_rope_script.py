"""benchmarks/bench_rope.py's own logic on a CPU, eager variants only (no Triton, no compile): every
op has cases, each case's byte model counts what its op reads and writes, the float64 check
passes the eager op and fails a wrong one (a scaled output, a norm that drops the case's (1 + w)
offset), and the partial rotary case rotates only its first R lanes. The kernels themselves are
tested in their own files; the script's timings mean nothing here."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_rope.py"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_rope", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rope"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("bench_rope", None)
    return module


def small_cases(script):
    return [script.small(c) for c in script.CASES]


def eager_outputs(script, case, x):
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if case.amp else contextlib.nullcontext()
    with torch.no_grad(), amp:
        outs = script.FUNCTIONS[case.op][0](*script.arguments(case, x))
    return outs if isinstance(outs, tuple) else (outs,)


def test_every_op_has_cases_functions_and_a_byte_model(script):
    ops = {c.op for c in script.CASES}
    assert ops == set(script.OPS) == set(script.FUNCTIONS)
    assert {o for o in ops if o not in script.ROPE_OPS} == set(script.ROW_TENSORS)
    assert script.results_name(list(script.OPS)) == "bench_rope.json"
    assert script.results_name(["gelu_mul", "layer_norm"]) == "bench_rope-gelu_mul-layer_norm.json"
    assert len({c.name for c in script.CASES}) == len(script.CASES)  # names key the results


def test_forward_bytes_are_the_inputs_read_and_the_outputs_written(script):
    """The forward's byte model is every activation (not the 1-D weights) read once, cos and sin
    once, and every output written once in the activations' dtype (profuse's, under amp too)."""
    for case in small_cases(script):
        x = script.make_inputs(case, CPU)
        acts = [t for t in x.leaves if t.dim() > 1]
        read = sum(t.numel() * t.element_size() for t in acts + x.consts)
        written = sum(o.numel() for o in eager_outputs(script, case, x)) * acts[0].element_size()
        want = read + written
        assert script.traffic(case, x)["forward"] == want, case.name


def test_the_check_passes_eager_and_fails_a_wrong_op(script):
    for case in small_cases(script):
        x = script.make_inputs(case, CPU, seed=1)
        ref = script.reference_results(case, x)
        eager = script.FUNCTIONS[case.op][0]
        assert script.check(case, eager, x, ref, CPU)["ok"], case.name

        def scaled(*args, eager=eager):  # 10% off: over bf16's tolerance (8u = 3%)
            outs = eager(*args)
            return tuple(o * 1.1 for o in outs) if isinstance(outs, tuple) else outs * 1.1

        assert not script.check(case, scaled, x, ref, CPU)["ok"], case.name
        if case.offset:  # the case's (1 + w) reaches the op: without it, w near 0 scales y to ~0

            def no_offset(*args, eager=eager):
                return eager(*args[:-1], 0.0)

            assert not script.check(case, no_offset, x, ref, CPU)["ok"], case.name


def test_partial_rope_rotates_its_first_r_lanes_and_passes_the_rest(script):
    case = next(script.small(c) for c in script.CASES if c.op == "partial_rope" and not c.amp)
    b, t, hq, hk, d, r = case.shape
    assert r < d
    x = script.make_inputs(case, CPU)
    assert all(c.shape == (1, t, r) for c in x.consts)
    q, k = script.arguments(case, x)[:2]
    qo, ko = eager_outputs(script, case, x)
    assert torch.equal(qo[..., r:], q[..., r:]) and torch.equal(ko[..., r:], k[..., r:])
    assert not torch.allclose(qo[..., :r].float(), q[..., :r].float(), atol=1e-2)
