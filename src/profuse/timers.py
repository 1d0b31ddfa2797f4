"""How one call is timed: the clocks beneath the harness (bench/timing.py) and the autotuner.

A CUDA call has two costs, and each timer here measures one view of them:

    device   CudaTimer: CUDA events, each trial queued behind a short GPU sleep so the CPU runs
             ahead and the events see the GPU's time alone (the L2 flushed before each call).
    loop     LoopTimer: calls back to back with nothing queued ahead, as a training loop whose CPU
             is the bottleneck sees them, and as triton.testing.do_bench times them: each call
             costs about the larger of its host time and its device time.
    graph    GraphTimer: the call captured once in a CUDA graph and replayed: device time with no
             launch cost at all.

On a CPU every call is synchronous, so the three are one: CpuTimer, the wall clock.

Every timer times a trial two ways: `time_calls(fns)`, one clock or event pair around each call,
and `time_blocks(fns, calls, discard)`, one pair around `calls` calls back to back after `discard`
untimed ones (the time per call is the pair's time over `calls`): a step's trial, where the calls
before it have filled the queue as a training loop's do.

The other cost, the CPU's time to issue a call: `HeldIssue` issues it while the GPU is held busy,
so the CPU's time cannot include waiting for the GPU, and says when the launch queue filled all
the same (bench/host.py reads it); `host_times`, the older reading, is each call's wall time.

This module sits below the kernels (their autotuner times launch configs with CudaTimer) and
imports nothing of profuse but the device queries.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from profuse.env import l2_cache_bytes

TIMINGS = ("device", "loop", "graph")


class CpuTimer:
    """Wall-clock time of a call; CPU ops in torch return only when they are done."""

    name = "time.perf_counter"
    timing = "device"

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def time_calls(self, fns: Sequence[Callable[[], object]]) -> list[float]:
        out = []
        for fn in fns:
            t0 = self.clock()
            fn()
            out.append(self.clock() - t0)
        return out

    def time_blocks(self, fns: Sequence[Callable[[], object]], calls: int, discard: int = 0) -> list[float]:
        out = []
        for fn in fns:
            for _ in range(discard):
                fn()
            t0 = self.clock()
            for _ in range(calls):
                fn()
            out.append((self.clock() - t0) / calls)
        return out


class _Flush:
    """Zeroes a buffer twice the L2's size, so nothing of the last call survives in the cache."""

    def __init__(self, device: torch.device, enabled: bool):
        self.buffer = None
        if enabled:
            self.buffer = torch.empty(2 * l2_cache_bytes(device), dtype=torch.int8, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


class CudaTimer:
    """Device time: CUDA events around each call, the L2 flushed before it unless `flush_l2=False`.

    A trial's calls are all queued behind a short GPU sleep, so the CPU's dispatch (Python,
    autograd, kernel launches) runs ahead of the GPU and the events measure device time alone,
    as in a training step where the CPU keeps ahead. Without the sleep, the first call after each
    synchronisation would also count the time the GPU sat waiting for the CPU to launch it.
    """

    name = "cuda events"
    timing = "device"

    def __init__(self, device: torch.device, flush_l2: bool = True):
        self.device = device
        self.flush = _Flush(device, flush_l2)
        self._cycles_per_s = _calibrate_sleep(device)
        self._lead_s = 1e-3  # the CPU's time to queue one trial, learnt from the last trial

    def _queue_ahead(self) -> None:
        """Hold the GPU for twice the CPU time the last trial took to queue (1-50 ms)."""
        if self._cycles_per_s:
            lead = min(max(2 * self._lead_s, 1e-3), 50e-3)
            torch.cuda._sleep(int(lead * self._cycles_per_s))

    def time_calls(self, fns: Sequence[Callable[[], object]]) -> list[float]:
        self._queue_ahead()
        t0 = time.perf_counter()
        events = []
        for fn in fns:
            self.flush()
            start, end = _event_pair()
            start.record()
            fn()
            end.record()
            events.append((start, end))
        self._lead_s = time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]

    def time_blocks(self, fns: Sequence[Callable[[], object]], calls: int, discard: int = 0) -> list[float]:
        """One event pair around `calls` calls of each fn, after `discard` untimed ones; the L2 is
        flushed once before each block (the calls of a block find each other's data in it)."""
        self._queue_ahead()
        t0 = time.perf_counter()
        events = []
        for fn in fns:
            self.flush()
            for _ in range(discard):
                fn()
            start, end = _event_pair()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            events.append((start, end))
        self._lead_s = time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 / calls for s, e in events]


class LoopTimer:
    """Calls back to back from an idle queue, events around each: what a CPU-bound loop pays.

    Each call of a trial runs `reps` times in a row (the L2 flushed before each, as do_bench
    does) after a synchronisation, and the trial keeps the median of the `reps`. Where the host
    takes longer to issue a call than the GPU takes to run it, the GPU waits between kernels and
    the events count that wait: the time is about max(host, device).
    """

    name = "cuda events, back to back"
    timing = "loop"

    def __init__(self, device: torch.device, flush_l2: bool = True, reps: int = 3):
        self.device = device
        self.flush = _Flush(device, flush_l2)
        self.reps = reps

    def time_calls(self, fns: Sequence[Callable[[], object]]) -> list[float]:
        out = []
        for fn in fns:
            torch.cuda.synchronize(self.device)
            events = []
            for _ in range(self.reps):
                self.flush()
                start, end = _event_pair()
                start.record()
                fn()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize(self.device)
            out.append(statistics.median(s.elapsed_time(e) / 1e3 for s, e in events))
        return out

    def time_blocks(self, fns: Sequence[Callable[[], object]], calls: int, discard: int = 0) -> list[float]:
        """From an idle queue: `discard` untimed calls (they fill the queue as the steps before
        a training loop's step do), then one event pair around `calls` calls back to back. The
        calls are the repetitions: no `reps` here."""
        out = []
        for fn in fns:
            torch.cuda.synchronize(self.device)
            self.flush()
            for _ in range(discard):
                fn()
            start, end = _event_pair()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize(self.device)
            out.append(start.elapsed_time(end) / 1e3 / calls)
        return out


class GraphError(RuntimeError):
    """A call that cannot be captured in a CUDA graph (it synchronises, or reads a host value)."""


class GraphTimer(CudaTimer):
    """Device time of a call replayed from a CUDA graph: the kernels back to back, no launch cost.

    `capture(fn)` records the call once (after it has run eagerly, so compilation, autotuning and
    the allocator's growth are done) and returns the replay; time the replays like any call. The
    L2 is flushed before each replay, outside the graph.
    """

    name = "cuda events, CUDA-graph replay"
    timing = "graph"

    def capture(self, fn: Callable[[], object]) -> Callable[[], object]:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                fn()  # one more warm-up on the capture stream (cuBLAS workspaces, allocator)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.cuda.graph(graph):
                keep = fn()  # the outputs stay alive: the replays write into them
        except Exception as err:
            torch.cuda.synchronize(self.device)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise GraphError(f"cannot be captured in a CUDA graph ({type(err).__name__}: {first})") from err
        torch.cuda.synchronize(self.device)

        def replay(graph=graph, keep=keep) -> object:
            graph.replay()
            return keep

        return replay


def _event_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _calibrate_sleep(device: torch.device) -> float | None:
    """GPU clock cycles per second of torch.cuda._sleep, or None where torch has no such call."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    cycles = 1_000_000
    sleep(cycles)  # the first call can be slower (clocks ramping up)
    start, end = _event_pair()
    start.record()
    sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


def make_timer(timing: str, device: torch.device, flush_l2: bool = True):
    """The timer for a timing mode on a device. On a CPU, 'device' and 'loop' are the wall clock
    and 'graph' is an error (ValueError: the caller turns it into a usage error)."""
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}: choose from {', '.join(TIMINGS)}")
    if device.type != "cuda":
        if timing == "graph":
            raise ValueError("--timing graph replays CUDA graphs: it needs a CUDA GPU")
        return CpuTimer()
    return {"device": CudaTimer, "loop": LoopTimer, "graph": GraphTimer}[timing](device, flush_l2)


def host_times(
    fns: Sequence[Callable[[], object]], device: torch.device, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Seconds the CPU takes to issue each call (one round: each call once, then a sync).

    A CUDA call returns once its work is queued, so its wall time is what a loop pays to issue
    it, whatever the GPU is doing. Run rounds in shuffled orders and take medians: the host is
    noisy (a bare launch read 19-39 us across rounds of one run on the H200's host).
    """
    out = []
    for fn in fns:
        t0 = clock()
        fn()
        out.append(clock() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


# --------------------------------------------------------------------------------------------
# The CPU's time to issue a call, the GPU held
# --------------------------------------------------------------------------------------------

# The CUDA runtime and driver calls in a torch.profiler trace (the launches among them).
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
# torch.cuda._sleep's kernel, as the trace names it: the hold and the end marker of a traced issue.
SLEEP_KERNEL = "spin_kernel"


class HeldIssue:
    """The CPU's time to issue one call while the GPU is held busy.

    `issue(fn, hold_s)`: after a synchronisation, a `torch.cuda._sleep` of `hold_s` seconds holds
    the GPU, an event is recorded behind it, and the CPU issues the call under its wall clock. If
    the event has not completed when the call returns, the GPU had run none of the call's work, so
    no launch queue slot had been freed and the CPU cannot have waited for one: the time is the
    CPU's alone. If it has (`filled`), the CPU may have waited: the launch queue (about a thousand
    launches) filled before the hold ended, the call synchronised, or the hold was too short.

    `traced_issue(fn, hold_s)`: the same under torch.profiler with CUDA activity only (runtime
    and driver calls, kernels; no CPU operators, whose recording would add host time), the
    call bracketed by two sleep kernels; returns the trace's events for bench.host.host_from_trace.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cycles_per_s = _calibrate_sleep(device)
        self._released = torch.cuda.Event()

    @property
    def available(self) -> bool:
        return bool(self.cycles_per_s)

    def issue(self, fn: Callable[[], object], hold_s: float) -> tuple[float, bool]:
        torch.cuda.synchronize(self.device)
        torch.cuda._sleep(max(int(hold_s * self.cycles_per_s), 1))
        self._released.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        filled = self._released.query()
        torch.cuda.synchronize(self.device)
        return t1 - t0, bool(filled)

    def traced_issue(self, fn: Callable[[], object], hold_s: float) -> list[dict] | None:
        """The trace events of one held issue, or None where torch.profiler records no CUDA
        activity here."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        torch.cuda.synchronize(self.device)
        try:
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(max(int(hold_s * self.cycles_per_s), 1))
                self._released.record()
                fn()
                torch.cuda._sleep(1)  # the end marker: its launch closes the window
                torch.cuda.synchronize(self.device)
            fd, path = tempfile.mkstemp(suffix=".json", prefix="profuse-host-")
            os.close(fd)
            try:
                prof.export_chrome_trace(path)
                with open(path, encoding="utf-8") as f:
                    return list(json.load(f).get("traceEvents", []))
            finally:
                os.unlink(path)
        except (RuntimeError, OSError, ValueError):
            return None
