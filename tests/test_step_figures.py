"""Part C's figures from the steps as they were timed: the GPU idle share and the bound from
consecutive unsynchronised profiled steps set beside the timed trials, read from fake traces and
fake timings (no clock, no GPU)."""

from __future__ import annotations

import random

import pytest

from profuse.report.step import _idle, steady_lines
from profuse.stepprofile import SteadySteps, agreement, read_steady
from profuse.verdict import SYNCED_SOURCE, decide


def kernel_trace(kernels: list[tuple[float, float]], host: int = 3) -> dict:
    """A Chrome trace of device events at (start us, duration us), a few host events among them
    (which the reading must ignore), shuffled as a trace file may order them."""
    events = [
        {"ph": "X", "cat": random.choice(["kernel", "gpu_memcpy", "gpu_memset"]), "name": f"k{i}",
         "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": {}}
        for i, (ts, dur) in enumerate(kernels)
    ]  # fmt: skip
    events += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -500.0 + i, "dur": 5000.0, "pid": 1, "tid": 1,
         "args": {}}
        for i in range(host)
    ]  # fmt: skip
    random.shuffle(events)
    return {"traceEvents": events}


def test_steady_steps_read_the_gpu_timeline_between_the_first_kernel_and_the_last():
    rng = random.Random(11)
    steps, t, kernels, busy = 7, 1000.0, [], 0.0
    for _ in range(steps * 5):
        gap, dur = rng.uniform(0, 30), rng.uniform(5, 80)
        t += gap
        kernels.append((t, dur))
        kernels.append((t + dur / 3, dur / 3))  # a second stream's event inside it: counted once
        busy += dur
        t += dur
    window = t - kernels[0][0]
    s = read_steady(kernel_trace(kernels), steps, wall_s=window * 1.1e-6, trace_path="x.json")
    assert s.window_ms == pytest.approx(window / 1e3)
    assert s.busy_ms == pytest.approx(busy / 1e3)
    assert s.gpu_idle_pct == pytest.approx(100 * (window - busy) / window)
    assert s.step_ms == pytest.approx(window / 1e3 / steps) and s.device_s == pytest.approx(
        busy / steps / 1e6
    )
    assert s.to_dict()["gpu_idle_pct"] == s.gpu_idle_pct and s.trace_path == "x.json"
    with pytest.raises(ValueError, match="no kernel"):
        read_steady(kernel_trace([]), steps, 1.0)


def test_agreement_is_the_profiled_step_within_the_trials_range():
    s = SteadySteps(steps=10, window_ms=1000.0, busy_ms=950.0, wall_ms=1010.0)  # 100 ms a step
    trials = [0.099, 0.1005, 0.102, 0.0995]
    agreement(s, trials)
    assert s.agrees and s.timed_median_ms == pytest.approx(100.0) and s.timed_low_ms == pytest.approx(99.0)
    slow = agreement(SteadySteps(10, 1040.0, 950.0, 1050.0), trials)  # 104 ms: the profiler's own cost
    assert slow.agrees is False and slow.timed_high_ms == pytest.approx(102.0)
    assert agreement(SteadySteps(10, 1000.0, 950.0, 1000.0), []).agrees is None


def test_trials_closer_than_one_percent_still_agree_with_a_profile_within_one_percent():
    tight = [0.1, 0.10001, 0.09999, 0.1]  # 0.02% apart
    assert agreement(SteadySteps(10, 1003.0, 950.0, 1003.0), tight).agrees  # +0.3%
    assert agreement(SteadySteps(10, 1015.0, 950.0, 1015.0), tight).agrees is False  # +1.5%
    assert agreement(SteadySteps(10, 985.0, 950.0, 985.0), tight).agrees is False  # -1.5%


def _cuda_run(sync_idle: float, steady: SteadySteps | None, host_s: float = 0.05) -> dict:
    """A saved CUDA run of eager and fused, a profile of eager with a synchronised idle share of
    `sync_idle` and the unsynchronised `steady` beside it."""
    times = {"eager": [0.1, 0.101, 0.099, 0.1], "fused": [0.08, 0.081, 0.079, 0.08]}
    profile = {"basis": "GPU kernel time", "time_per_step_us": 60_000.0, "gpu_idle_pct": sync_idle,
               "steady": steady.to_dict() if steady else None}  # fmt: skip
    return {
        "config": {"device": "cuda:0"},
        "comparison": {"baseline": "eager", "timings": {n: {"times_s": t} for n, t in times.items()}},
        "results": {"eager": {"host_s": host_s, "speedup": None}, "fused": {"host_s": None, "speedup": None}},
        "profiles": {"eager": profile},
    }


def test_the_bound_reads_the_unsynchronised_steps_where_they_match_the_timed_loop():
    # synchronised, the GPU drained between steps: 40% idle; unsynchronised, 4%: device-bound
    steady = agreement(SteadySteps(10, 1000.0, 960.0, 1001.0), [0.099, 0.1, 0.101, 0.1])
    v = decide(_cuda_run(40.0, steady))
    assert v.bound == "device-bound"
    assert v.bound_why.startswith("10 unsynchronised profiled steps, as fast as the timed loop: ")
    assert "idles 4.0%" in v.bound_why
    data = _cuda_run(40.0, steady)
    assert _idle(data["profiles"]["eager"]) == pytest.approx(4.0)
    text = "\n".join(steady_lines(data))
    assert "from 10 consecutive unsynchronised profiled steps" in text
    want = "100 ms vs 100 ms (+0.0%), within the trials' 99-101 ms or 1% of their median; GPU idle 4.0%"
    assert want in text


def test_a_profile_slower_than_the_timed_loop_does_not_decide_the_bound():
    # 130 ms a step under the profiler against trials of 99-101 ms: its idle share is not used;
    # the held host time (50 ms) against the kernels' (96 ms a step) decides
    steady = agreement(SteadySteps(10, 1300.0, 960.0, 1301.0), [0.099, 0.1, 0.101, 0.1])
    data = _cuda_run(40.0, steady)
    v = decide(data)
    assert v.bound == "device-bound" and "outside the timed trials' 99-101 ms" in v.bound_why
    assert "idles" not in v.bound_why and "its kernels take 96 ms" in v.bound_why
    assert _idle(data["profiles"]["eager"]) is None
    assert "OUTSIDE (idle share not used)" in "\n".join(steady_lines(data))
    old = decide(_cuda_run(40.0, None))  # a file from before: the synchronised share, said so
    assert old.bound_why.startswith(SYNCED_SOURCE)
    assert "one synchronised profiled step" in steady_lines(_cuda_run(40.0, None))[0]


# --------------------------------------------------------------------------------------------
# Steady-state peak memory beside the first steps' (a fake allocator: no GPU)
# --------------------------------------------------------------------------------------------


class FakeAllocator:
    """CUDA's caching allocator as far as own_steps sees it: a step's transient stays cached
    (reserved) after it is freed, until empty_cache; the peaks reset to what is held now."""

    def __init__(self, resident: int):
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = resident
        self.steps_run = 0  # each step retries one cudaMalloc, in memory_stats' count

    def step(self, transient: int) -> None:
        self.steps_run += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated + transient)
        self.reserved = max(self.reserved, self.allocated + transient)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def install(self, monkeypatch) -> None:
        import torch

        def empty_cache():
            self.reserved = self.allocated

        def reset(device=None):
            self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

        for name, fn in {
            "synchronize": lambda device=None: None,
            "empty_cache": empty_cache,
            "reset_peak_memory_stats": reset,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak_allocated,
            "max_memory_reserved": lambda device=None: self.peak_reserved,
            "memory_stats": lambda device=None: {
                "segment.all.peak": 3,
                "inactive_split_bytes.all.peak": self.peak_reserved - self.peak_allocated,
                "requested_bytes.all.peak": self.peak_allocated,
                "num_alloc_retries": 3 + self.steps_run,  # counted since the process began
                "active.all.peak": 9,
            },
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_the_steady_state_peak_leaves_out_the_first_steps_transients(monkeypatch):
    import torch

    from profuse import stepstate

    MB = 2**20
    rng = random.Random(5)
    resident = rng.randint(50, 150) * MB
    first = [rng.randint(700, 900) * MB, rng.randint(500, 600) * MB, rng.randint(300, 400) * MB]
    steady = [rng.randint(250, 300) * MB for _ in range(stepstate.STEADY_STEPS)]
    fake = FakeAllocator(resident)
    fake.install(monkeypatch)
    transients = iter(first + steady)

    def step():
        fake.step(next(transients))
        return torch.tensor(1.0)

    own = stepstate.own_steps(step, torch.device("cuda"), steps=3, clock=iter([0.0, 2.0]).__next__)
    m = own.memory
    assert (m.reserved_bytes, m.allocated_bytes) == (resident + max(first), resident + max(first))
    assert m.steady_reserved_bytes == m.steady_allocated_bytes == resident + max(steady)
    assert m.steady_steps == stepstate.STEADY_STEPS and next(transients, None) is None  # every step ran
    assert m.steady_allocator == {  # the allocator's account of the steady steps, ALLOCATOR_STATS only
        "segment.all.peak": 3, "inactive_split_bytes.all.peak": 0,
        "requested_bytes.all.peak": resident + max(steady), "num_alloc_retries": stepstate.STEADY_STEPS,
    }  # fmt: skip
    saved = m.to_dict()
    assert saved["steady_reserved_bytes"] < saved["peak_bytes"] and saved["accounting"] == "reserved"

    from profuse.report.stepchecks import steady_memory_note

    note = steady_memory_note({"fused": saved, "liger": {**saved, "steady_reserved_bytes": None}})
    assert note.startswith(f"; steady peak = over {stepstate.STEADY_STEPS} later steps")
    assert "fused" in note and "liger" not in note  # a variant with no steady figure says none
    assert steady_memory_note({"fused": {**saved, "steady_reserved_bytes": None}}) == ""


def test_an_unsynchronised_profile_that_fails_costs_the_run_nothing_but_says_so(monkeypatch, tmp_path):
    import torch

    from profuse import stepprofile

    def no_cupti(step, device, path, steps=stepprofile.UNSYNCED_STEPS):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    monkeypatch.setattr(stepprofile, "steady_steps", no_cupti)
    steady, why = stepprofile.steady_or_why(lambda: None, torch.device("cuda"), tmp_path / "t.json")
    assert steady is None and why == "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"
    data = _cuda_run(40.0, None)
    data["profiles"]["eager"]["steady_error"] = why
    lines = steady_lines(data)
    assert "one synchronised profiled step" in lines[0] and "failed: RuntimeError: CUPTI" in lines[1]
    assert decide(data).bound_why.startswith(SYNCED_SOURCE)  # said, not hidden
