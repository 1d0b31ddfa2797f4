"""Without a GPU, Triton kernels run on CPU tensors through the interpreter.

The variable must be set before triton decorates the kernels, so before profuse.kernels.tail is
imported: conftest runs first. Fixtures several test files use live here; the input makers,
shape lists and CLI runners they share are in tests/cases.py.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


class PoisonedTorch:
    """Stands in for `torch` inside a kernels module: torch.empty and torch.empty_like come back
    full of NaN (or -1 for integers), so an element a kernel forgets to write (an output, a
    gradient, a dw partial row) cannot pass for a right answer."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return PoisonedTorch._poison(torch.empty(*args, **kwargs))

    @staticmethod
    def empty_like(*args, **kwargs):
        return PoisonedTorch._poison(torch.empty_like(*args, **kwargs))

    @staticmethod
    def _poison(t):
        return t.fill_(math.nan if t.is_floating_point() else -1)


@pytest.fixture
def poisoned(monkeypatch):
    """The tail's launchers allocate through PoisonedTorch for the test's duration: every
    output, gradient, rstd and dw partial the tail allocates comes from
    profuse.kernels.tail.plans (the kernel modules allocate nothing; ops.py only calls the
    launchers, or makes fake tensors for torch.compile)."""
    from profuse.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from profuse.kernels.tail import plans

    monkeypatch.setattr(plans, "torch", PoisonedTorch())


@pytest.fixture
def poisoned_blockops(monkeypatch):
    """The block ops' kernel modules (profuse.kernels.swiglu, profuse.kernels.add_rms_norm)
    allocate through PoisonedTorch for the test's duration."""
    from profuse.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import profuse.kernels.add_rms_norm as karn
    import profuse.kernels.swiglu as kswiglu

    for module in (kswiglu, karn):
        monkeypatch.setattr(module, "torch", PoisonedTorch())


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Two tiny sweeps, A and B, saved through the CLI (shared: each run costs a second or two)."""
    from cases import TINY_SWEEP, run_cli

    root = tmp_path_factory.mktemp("sweeps")
    runs = {}
    for name, seed in (("a", "0"), ("b", "1")):
        out = root / name
        code, stdout, stderr = run_cli("sweep", *TINY_SWEEP, "--seed", seed, "--out", str(out))
        assert code == 0, stderr
        runs[name] = (out, stdout)
    return runs
