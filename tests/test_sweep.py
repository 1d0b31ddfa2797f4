"""profuse.sweep: Part B over several sizes, sizes that do not fit skipped, settings and progress.

Behaviour only, on the CPU at tiny sizes; never an assertion on seconds. The command that runs a
sweep and writes its files is tested in tests/test_cli.py.
"""

from __future__ import annotations

import pytest
import torch
from cases import HUGE_ROWS

from profuse import sweep as S
from profuse.errors import UsageError
from profuse.report import sweep as R

# --------------------------------------------------------------------------------------------
# Sizes that do not fit
# --------------------------------------------------------------------------------------------


def test_oversized_size_is_skipped_with_a_note():
    cfg = S.SweepConfig(rows=[64, HUGE_ROWS], cols=[96], trials=2, warmup=0, variants=("eager",))
    res = S.run_sweep(cfg)
    assert [(r.config.rows, r.config.cols) for r in res.runs] == [(64, 96)]
    [skip] = res.to_dict()["skipped"]
    assert (skip["rows"], skip["cols"]) == (HUGE_ROWS, 96)
    assert "GB" in skip["reason"] and "smaller sizes" in skip["reason"]
    text = R.format_sweep(res.to_dict())
    assert f"{HUGE_ROWS} x 96: skipped" in text and "(1 skipped)" in text


def test_out_of_memory_is_skipped_and_other_errors_are_not(monkeypatch):
    real = S.run_tail_bench

    def oom_at_128(cfg, **kwargs):
        if cfg.rows == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(cfg, **kwargs)

    monkeypatch.setattr(S, "run_tail_bench", oom_at_128)
    cfg = S.SweepConfig(rows=[64, 128], cols=[96], trials=2, warmup=0, variants=("eager",))
    res = S.run_sweep(cfg)
    assert len(res.runs) == 1
    assert res.skipped[0].rows == 128 and "out of memory" in res.skipped[0].reason

    def broken(cfg, **kwargs):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(S, "run_tail_bench", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        S.run_sweep(cfg)


# --------------------------------------------------------------------------------------------
# The sweep's settings and progress
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rows": [], "cols": [96]}, "at least one"),
        ({"rows": [64], "cols": [96], "variants": ("eager", "nope")}, "unknown variant"),
        ({"rows": [64, 0], "cols": [96]}, "positive"),
        ({"rows": [64], "cols": [96], "trials": 1}, "at least 2"),
    ],
)
def test_bad_settings_fail_before_any_size_runs(kwargs, match):
    with pytest.raises(UsageError, match=match):
        S.SweepConfig(**kwargs)


def test_config_adds_the_baseline_and_drops_repeated_sizes():
    cfg = S.SweepConfig(rows=[64, 64, 128], cols=[96], variants=("rms_norm",))
    assert cfg.sizes() == [(64, 96), (128, 96)]
    assert cfg.variants == ("eager", "rms_norm")


def test_progress_counts_over_the_whole_sweep_and_compiles_fresh_per_size(monkeypatch):
    resets = []
    monkeypatch.setattr(S._compile, "reset", lambda: resets.append(1))
    calls = []
    cfg = S.SweepConfig(rows=[64, 128], cols=[96], trials=2, warmup=0, variants=("eager", "rms_norm"))
    S.run_sweep(cfg, progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert len(resets) == 2
    assert {total for _, _, total in calls} == {2 * S.STEPS_PER_SIZE}
    dones = [done for _, done, _ in calls]
    assert dones == sorted(dones) and dones[-1] == 2 * S.STEPS_PER_SIZE
    stages = list(dict.fromkeys(stage for stage, _, _ in calls))
    assert stages == ["size 1/2: 64 x 96", "size 2/2: 128 x 96"]


def test_sweep_with_torch_compile_compiles_each_size():
    # The one test with compile (a few seconds per size on CPU): after reset() the second size
    # compiles fresh inside the bench, so its timing loop never trips no_recompiles().
    cfg = S.SweepConfig(rows=[32, 48], cols=[64], trials=2, warmup=1, variants=("eager", "compile"))
    res = S.run_sweep(cfg)
    assert res.skipped == []
    for run in res.runs:
        assert run.checks["compile"].passed
        assert "compile" in run.comparison.timings
