"""The autotuner's choice (kernels.tail._pick), with the device timing replaced by a fake one:
the fastest config that runs wins, configs that fail to launch are skipped, the choice is kept
per key, and an unrunnable shape is a clear error."""

from __future__ import annotations

import pytest
import torch

from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse.kernels import tail as K  # noqa: E402
from profuse.kernels.tail import KernelConfig  # noqa: E402

CUDA = torch.device("cuda")
CONFIGS = [KernelConfig("fused", 1, 1024, w) for w in (1, 2, 4, 8)]


@pytest.fixture
def fake_device_timing(monkeypatch):
    """Autotuning on, as on a GPU; each config's 'time' is looked up in `speeds`."""
    speeds: dict[KernelConfig, float] = {}
    timed: list[list[KernelConfig]] = []

    def fake_time_configs(launch, configs, device, trials):
        assert trials >= 5, "too few trials to rank configs"
        timed.append(list(configs))
        for cfg in configs:
            launch(cfg)
        return [speeds[c] for c in configs]

    monkeypatch.setattr(K, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(K, "time_configs", fake_time_configs)
    monkeypatch.setattr(K, "_TUNED", {})
    return speeds, timed


@pytest.mark.parametrize("fastest", range(len(CONFIGS)))
def test_the_fastest_config_wins_and_is_kept(fake_device_timing, fastest):
    speeds, timed = fake_device_timing
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = 1.0 + abs(i - fastest)
    launched = []
    key = ("fwd", 64, 1000, torch.bfloat16)
    assert K._pick(key, CONFIGS, launched.append, CUDA) == CONFIGS[fastest]
    # Every config was built (launched once) before the timing, and timed once.
    assert launched[: len(CONFIGS)] == CONFIGS and timed == [CONFIGS]
    # Asked again, the choice is reused without timing anything.
    assert K._pick(key, CONFIGS, launched.append, CUDA) == CONFIGS[fastest]
    assert len(timed) == 1
    assert "fwd/64/1000/torch.bfloat16" in K.tuned_configs()


def test_configs_that_cannot_launch_are_skipped(fake_device_timing):
    speeds, timed = fake_device_timing
    broken = CONFIGS[0]  # would be the fastest, but it does not fit (e.g. shared memory)
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = float(i)

    def launch(cfg):
        if cfg == broken:
            raise RuntimeError("out of resource: shared memory")

    assert K._pick(("bwd", 8), CONFIGS, launch, CUDA) == CONFIGS[1]
    assert timed == [CONFIGS[1:]]


def test_no_runnable_config_is_a_clear_error(fake_device_timing):
    def launch(cfg):
        raise RuntimeError("out of resource")

    with pytest.raises(RuntimeError, match="no launch config"):
        K._pick(("fwd", 1), CONFIGS, launch, CUDA)


def test_without_autotuning_the_favourite_runs_untimed(monkeypatch):
    monkeypatch.setattr(K, "_TUNED", {})

    def no_timing(*args):
        raise AssertionError("timed a config with autotuning off")

    monkeypatch.setattr(K, "time_configs", no_timing)
    monkeypatch.setenv("PROFUSE_AUTOTUNE", "0")
    assert K._pick(("fwd", 1), CONFIGS, lambda c: None, CUDA) == CONFIGS[0]
    assert K._pick(("fwd", 1), CONFIGS, lambda c: None, torch.device("cpu")) == CONFIGS[0]
