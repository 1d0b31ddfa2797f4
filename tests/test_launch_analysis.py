"""profuse's memo of torch's per-launch Triton analysis (kernels/launch_analysis.py): one analysis
per launch signature of profuse's own kernels, a copy of it to each caller, every other kernel
passed through, and nothing wrapped unless it is turned on (PROFUSE_ANALYSIS_MEMO=1) or where
torch has no such function."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from profuse.kernels import launch_analysis as LA


def _kernel(module: str):
    """A stand-in for a JITFunction: `.fn`, a function living in `module`."""

    def body():
        pass

    body.__module__ = module
    return types.SimpleNamespace(fn=body)


class Torch:
    """A stand-in for torch._higher_order_ops.triton_kernel_wrap: counts the analyses it makes
    and answers each with a fresh, mutable object naming the arguments it 'writes'."""

    def __init__(self, name: str = "identify_accessed_tensors"):
        self.made = 0

        def analyse(kernel, kwargs, tma_descriptor_metadata=None):
            self.made += 1
            return {"writes": sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))}

        setattr(self, name, analyse)


def _args(dtype=torch.bfloat16, rows=7, n_cols=96, block=64):
    return {"X": torch.empty(rows, n_cols, dtype=dtype), "Y": torch.empty(rows, n_cols, dtype=dtype),
            "n_cols": n_cols, "BLOCK": block}  # fmt: skip


def test_a_signature_is_analysed_once_and_each_caller_gets_its_own_copy(monkeypatch):
    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    fake = Torch()
    assert LA.install(fake) == "identify_accessed_tensors"
    analyse, kernel = fake.identify_accessed_tensors, _kernel("profuse.kernels.fake")
    first = analyse(kernel, _args(rows=7), {})
    again = analyse(kernel, _args(rows=4099), {})  # other tensors, other rows: the same signature
    assert fake.made == 1 and first == again == {"writes": ["X", "Y"]}
    again["writes"].append("Z")  # a caller that changes its answer changes no one else's
    assert analyse(kernel, _args(rows=1), {}) == {"writes": ["X", "Y"]} and fake.made == 1
    assert (analyse.hits, analyse.misses) == (2, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": torch.float32},  # a pointer's TTIR type
        {"n_cols": 97},  # an int's value (its specialization follows from it)
        {"block": 128},  # a compile-time argument
    ],
)
def test_what_changes_a_kernels_ttir_is_analysed_again(monkeypatch, change):
    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    fake = Torch()
    LA.install(fake)
    kernel = _kernel("profuse.kernels.fake")
    fake.identify_accessed_tensors(kernel, _args(), {})
    fake.identify_accessed_tensors(kernel, _args(**change), {})
    assert fake.made == 2


def test_a_tensors_kind_and_the_tma_metadata_are_part_of_the_signature(monkeypatch):
    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    fake = Torch()
    LA.install(fake)
    kernel = _kernel("profuse.kernels.fake")

    class Buffer:  # an Inductor buffer: a dtype through get_dtype, not an attribute
        def get_dtype(self):
            return torch.bfloat16

    fake.identify_accessed_tensors(kernel, _args(), {})
    fake.identify_accessed_tensors(kernel, {**_args(), "X": Buffer()}, {})
    fake.identify_accessed_tensors(kernel, _args(), {"X": ("stable", ([64, 64],))})
    assert fake.made == 3


def test_other_kernels_and_unread_forms_reach_torch_every_time(monkeypatch):
    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    fake = Torch()
    LA.install(fake)
    theirs = _kernel("mypackage.kernels")
    for _ in range(3):
        fake.identify_accessed_tensors(theirs, _args(), {})
    assert fake.made == 3
    ours = _kernel("profuse.kernels.fake")
    with pytest.raises(AttributeError):  # not a dict of arguments: torch's own answer (here, its error)
        fake.identify_accessed_tensors(ours, ["not", "a", "dict"], {})
    assert LA.signature((ours, ["x"]), {}) is None and LA.signature((), {}) is None


def test_install_wraps_once_the_newest_function_torch_has_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    fake = Torch()
    LA.install(fake)
    wrapped = fake.identify_accessed_tensors
    assert LA.install(fake) == "identify_accessed_tensors" and fake.identify_accessed_tensors is wrapped
    older = Torch("identify_mutated_tensors")  # torch releases before identify_accessed_tensors
    assert LA.install(older) == "identify_mutated_tensors"
    assert LA.install(types.SimpleNamespace()) is None
    for setting in ("0", None):  # off, and off by default until a card has measured it
        if setting is None:
            monkeypatch.delenv("PROFUSE_ANALYSIS_MEMO")
        else:
            monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", setting)
        off = Torch()
        original = off.identify_accessed_tensors
        assert LA.install(off) is None and off.identify_accessed_tensors is original


def test_the_memo_starts_again_past_its_size(monkeypatch):
    fake = Torch()
    analyse = LA.memoized(fake.identify_accessed_tensors, max_entries=2)
    kernel = _kernel("profuse.kernels.fake")
    for n_cols in (16, 32, 48, 16):  # the third clears the first two: 16 is analysed again
        analyse(kernel, _args(n_cols=n_cols), {})
    assert fake.made == 4


def test_on_this_torch_the_wrapped_analysis_answers_as_torch_does(monkeypatch, caplog):
    """torch's own function, wrapped, with one of profuse's kernels: the same answer as unwrapped
    (on a CPU torch cannot build the TTIR and answers 'every argument written', which still
    shows the real call form and that its answer copies), and from the memo the second time."""
    W = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    from profuse.kernels import add_rms_norm

    monkeypatch.setenv("PROFUSE_ANALYSIS_MEMO", "1")
    name = next(n for n in LA.ANALYSIS_NAMES if hasattr(W, n))
    original = getattr(W, name)
    if getattr(original, LA._MARK, False):  # wrapped already by a compile earlier in this process
        original = original.__wrapped__
    monkeypatch.setattr(W, name, original)  # torch's own for the test; as it was after it
    kernel = next(
        getattr(add_rms_norm, n) for n in dir(add_rms_norm) if hasattr(getattr(add_rms_norm, n), "arg_names")
    )
    kwargs = {n: torch.empty(3, 64, dtype=torch.bfloat16) for n in kernel.arg_names}
    with caplog.at_level(logging.CRITICAL, logger=W.__name__):
        expected = original(kernel, kwargs, {})
        assert LA.install() == name
        wrapped = getattr(W, name)
        assert wrapped(kernel, kwargs, {}) == expected == wrapped(kernel, kwargs, {})
    assert (wrapped.hits, wrapped.misses) == (1, 1)


def test_with_real_ttir_the_memo_answers_as_torch_does_and_a_second_layer_from_the_memo(tmp_path):
    """research/launch_analysis_check.py: a stand-in driver (an sm_90 target, no GPU) lets torch
    build the TTIR of profuse's real kernels and walk it. Every launch of silu_mul (pair and
    packed), add_rms_norm, the tail, rms_norm, rope, qk_norm_rope and the fused loss, forward and
    backward, at 4 rows twice and at 7 rows,
    analysed afresh and through the memo: the same answer for every launch, one answer a
    signature from torch itself, and the second layer's launches all from the memo."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from profuse.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(root / "src"), os.environ.get("PYTHONPATH")))),
    }
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(root / "research" / "launch_analysis_check.py"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["memo_differs"] == [] and result["one_answer_a_signature"]
    wanted = {"_silu_mul_fwd_kernel", "_silu_mul_bwd_kernel", "_add_rms_norm_fwd_kernel",
              "_add_rms_norm_bwd_kernel", "_rms_norm_fwd_kernel", "_rope_kernel", "_norm_rope_bwd_kernel",
              "_cross_entropy_kernel"}  # fmt: skip
    assert wanted <= set(result["kernels"])
    layer1, layer2 = result["passes"]["layer 1, 4 rows"], result["passes"]["layer 2, 4 rows"]
    assert layer1["from_memo"] < layer1["launches"] == layer2["launches"] == layer2["from_memo"] > 0
    assert result["signatures"] < result["launches"]
