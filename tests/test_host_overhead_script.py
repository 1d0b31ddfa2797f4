"""benchmarks/host_overhead.py end to end on a CPU (Triton's interpreter, a tiny shape, two
rounds): every group and variant it times runs, the two routes agree, the targets are read from
its table, and --out takes a folder or a .json path. Its numbers here mean nothing (the
interpreter); on a GPU it is the card's one call."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "host_overhead.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("host_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_host_table_runs_every_variant_and_both_routes_agree(script, device):
    host, same = script.host_table(2, 24, rounds=2, per_round=1, dev=device, compile_too=False)
    ops = ("silu_mul (gate, up)", "silu_mul (gate_up)", "add_rms_norm", "tail")
    for op in ops:
        for what in ("forward, no grad", "forward + backward"):
            group = host[f"{op}, {what}"]
            assert {"eager", "profuse", "profuse, JIT route"} <= set(group)
            assert all(v["median_s"] > 0 for v in group.values())
            assert same[f"{op}, {what}"] is True
    assert {"bare launch", "bare launch, direct"} <= set(host["tail, forward, no grad"])
    names = [t[0] for t in script.targets(host, None)]
    assert "add_rms_norm fwd+bwd host / eager" in names and "tail forward no grad / bare launch" in names
    assert len(names) == len(ops) * 3 + 1


def test_out_is_a_folder_or_a_json_path(script):
    assert script.out_path("results/host") == Path("results/host/host_overhead.json")
    assert script.out_path("results/host.json") == Path("results/host.json")
    assert script.out_path(None) is None


def test_without_a_gpu_it_says_so(script, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["host_overhead.py"])
    assert script.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
