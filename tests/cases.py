"""What several test files share: input makers, shape and dtype lists, and ways to run the CLI.

Tail inputs are fresh random values, never zeros: gate, up, residual (and dy) ~ N(0, 1),
weight ~ 1 + N(0, 0.1^2), drawn in that order from a seeded CPU generator so each test file
sees the same values for the same seed.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from profuse import cli

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One row with a prime N; several rows with N not a power of two (5 rows: the last row tile is
# partial); 3-D input with a prime N; N = 1 (a one-element block).
SHAPES = [(1, 131), (5, 760), (2, 3, 97), (3, 1)]
# The gradient checks leave N = 1 out (see tests/test_kernels_backward.py) and take 7 x 33.
GRAD_SHAPES = [(1, 131), (5, 760), (2, 3, 97), (7, 33)]
EPS = 1e-6
GRADS = ("gate", "up", "residual", "weight")


def tail_inputs(shape, dtype, device, seed: int = 0, dy: bool = False):
    """(gate, up, residual, weight); with `dy`, ((gate, up, residual, weight), dy)."""
    gen = torch.Generator().manual_seed(seed)
    g, u, r = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=dtype)
    if not dy:
        return g, u, r, w
    return (g, u, r, w), torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """profuse's main() on `argv`: (exit status, stdout, stderr), through pytest's capsys."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's errors and --help
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv: str) -> tuple[int, str, str]:
    """profuse's main() on `argv`, its output caught here (for module-scoped fixtures too)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_one_clear_line(code: int, err: str) -> None:
    """Exit status 2 and one line on stderr that says it is an error, no traceback."""
    assert code == 2, f"exit status {code}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert "error" in lines[0], lines[0]


# --------------------------------------------------------------------------------------------
# Saved sweeps (profuse sweep, report, diff)
# --------------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# An empty 8x5 inch canvas at 120 dpi compresses to about 3 KB; axes, ticks, text and markers
# push a real plot well past 5 KB.
MIN_DRAWN_PNG_BYTES = 5_000
# Tiny sizes and two eager variants: the sweep mechanics without compile's ~2-8 s per size.
TINY_SWEEP = "--rows 64,128 --cols 96 --trials 3 --variants eager,rms_norm --device cpu".split()
# rows x cols that no machine has memory for: the memory check rejects it before any allocation.
HUGE_ROWS = 2**40


def part_files(folder) -> list:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".part")]


class InterruptAtSecondSize:
    """Stands in for the CLI's Progress: Ctrl-C arrives while the second size runs."""

    def __init__(self, *args, **kwargs):
        self.stages = []

    def __call__(self, stage, done, total):
        self.stages.append(stage)
        if stage.startswith("size 2/"):
            raise KeyboardInterrupt

    def close(self):
        pass


def has_matplotlib() -> bool:
    from profuse.report import plots

    return plots.HAS_MATPLOTLIB


needs_matplotlib = pytest.mark.skipif(not has_matplotlib(), reason="matplotlib is not installed")
