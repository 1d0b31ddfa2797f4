"""The public names: every name in profuse.__all__ loads, with triton and without it.

Documented (profuse/__init__.py): the names load on first use; the fused ops import without
triton and, called without it, raise a one-line RuntimeError that says how to install it; with
triton (here through the interpreter, TRITON_INTERPRET=1 from tests/conftest.py) they run and
agree with their eager versions. The comparisons here only check that the public name is the op
(fresh N(0, 1) fp32 inputs, odd sizes, FORWARD_TOL[fp32]); every dtype, shape and gradient is
compared against float64 in each op's own test file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import profuse
from profuse import blockops as B
from profuse import crossentropy as CE
from profuse import rotary as R
from profuse import tail as T
from profuse.kernels import HAS_TRITON

ROOT = Path(__file__).resolve().parent.parent
SRC = str(ROOT / "src")

# public name -> the module that defines it (what `from profuse import NAME` must give)
HOMES = {
    "Comparison": "profuse.bench.timing",
    "compare": "profuse.bench.timing",
    "Speedup": "profuse.bench.stats",
    "FusedTail": "profuse.tail",
    "tail_compiled": "profuse.tail",
    "tail_eager": "profuse.tail",
    "tail_reference": "profuse.tail",
    "tail_rms_norm": "profuse.tail",
    "tail_triton": "profuse.tail",
    "silu_mul": "profuse.blockops",
    "add_rms_norm": "profuse.blockops",
    "rms_norm": "profuse.blockops",
    "rope": "profuse.rotary",
    "qk_norm_rope": "profuse.rotary",
    "linear_cross_entropy": "profuse.crossentropy",
    "profile": "profuse.profiling",
    "fuse": "profuse.fusion.hf",
    "unfuse": "profuse.fusion.hf",
    "FuseSummary": "profuse.fusion.hf",
}


def calls() -> dict:
    """The Triton-backed public ops: name -> (a call on fresh tiny fp32 CPU inputs, the op's eager
    version). Odd sizes: 3 rows of 37; head_dim 6 with 3 query heads and 1 key head over 5
    positions; a vocab of 11."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    g, u, r, w = randn(3, 37), randn(3, 37), randn(3, 37), 1 + 0.1 * randn(37)
    q, k, cos, sin = randn(2, 3, 5, 6), randn(2, 1, 5, 6), randn(2, 5, 6), randn(2, 5, 6)
    qt, kt, qw, kw = randn(2, 5, 3, 6), randn(2, 5, 1, 6), 1 + 0.1 * randn(6), 1 + 0.1 * randn(6)
    hidden, head, labels = randn(2, 5, 8), randn(11, 8), torch.randint(0, 11, (2, 5), generator=gen)
    return {
        "tail_triton": (lambda f: f(g, u, r, w), T.tail_eager),
        "silu_mul": (lambda f: f(g, u), B.silu_mul_eager),
        "add_rms_norm": (lambda f: f(g, r, w), B.add_rms_norm_eager),
        "rms_norm": (lambda f: f(g, w), B.rms_norm_eager),
        "rope": (lambda f: f(q, k, cos, sin), R.rope_eager),
        "qk_norm_rope": (lambda f: f(qt, kt, qw, kw, cos, sin), R.qk_norm_rope_eager),
        "linear_cross_entropy": (lambda f: f(hidden, head, labels), CE.linear_cross_entropy_eager),
    }


FUSED_OPS = sorted(calls())


def test_all_is_the_documented_set():
    assert sorted(profuse.__all__) == sorted(HOMES)
    assert len(set(profuse.__all__)) == len(profuse.__all__)


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_name_is_its_modules_own(name):
    module = sys.modules.get(HOMES[name]) or __import__(HOMES[name], fromlist=[name])
    assert getattr(profuse, name) is getattr(module, name)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", FUSED_OPS)
def test_with_triton_each_fused_op_runs_and_matches_eager(name):
    call, eager = calls()[name]
    got, want = call(getattr(profuse, name)), call(eager)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert T.relative_error(a, b) <= T.FORWARD_TOL[torch.float32]


WITHOUT_TRITON = f"""
import sys
sys.modules["triton"] = None  # `import triton` fails, as on a machine without it
sys.path.insert(0, {str(ROOT / "tests")!r})
import profuse
import test_public_api as api
from profuse.kernels import HAS_TRITON
assert not HAS_TRITON
for name in profuse.__all__:
    assert getattr(profuse, name) is not None, name
for name, (call, eager) in api.calls().items():
    call(eager)  # the eager version runs without triton
    try:
        call(getattr(profuse, name))
    except RuntimeError as err:
        message = str(err)
        assert "triton is not installed" in message and "pip install triton" in message, message
        assert "\\n" not in message, message
    else:
        raise SystemExit(f"{{name}} ran without triton")
try:
    profuse.FusedTail(37, impl="triton")
except ValueError as err:
    assert "pip install triton" in str(err), err
else:
    raise SystemExit("FusedTail(impl='triton') was built without triton")
assert profuse.FusedTail(37).impl_for("cpu") == "eager"
print("OK", len(profuse.__all__), len(api.calls()))
"""


def test_without_triton_every_name_imports_and_the_fused_ops_refuse_in_one_line():
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"OK {len(HOMES)} {len(FUSED_OPS)}"
