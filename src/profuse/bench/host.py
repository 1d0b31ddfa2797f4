"""The CPU's own time to issue a call, never counting a wait for the GPU.

A CUDA call returns once its work is queued, so its wall time is the CPU's cost to issue it, as
long as the CPU never has to wait. It waits when the launch queue is full: a stream holds about a
thousand pending launches, and a Llama-3.2-1B eager step issues 2,813 kernels. The older reading
(timers.host_times: each call's wall time, the GPU free to run behind it) then counts the GPU's
time too: it read 222 ms of "host" for a 196 ms eager step on the H200 (2026-12-05), and called a
step whose GPU idled 4.3% of the time host-bound.

The measurement here (`measure_host`), in rounds of every variant in shuffled orders:

1. Held issue (timers.HeldIssue): the GPU is held by a sleep kernel while the CPU issues the
   call, and an event behind the sleep says whether the hold was still running when the call
   returned. If it was, the GPU had run none of the call's kernels, so no queue slot was freed
   and the CPU cannot have waited: the round's time is exact. The hold is twice the call's last
   exact time (2 ms at the least, HOLD_CAP_S at the most); a round whose hold ended first is
   tried once more with a hold twice its time, so a hold too short is not mistaken for a full
   queue.
2. A round whose hold still ended first is `filled`: the queue filled (or the call
   synchronised). Where most rounds of a variant filled, its host time can only be a lower
   bound: one more held issue is traced (torch.profiler, CUDA activity only) and
   `host_from_trace` reads, between the hold's launch and an end marker's, the CPU's time
   outside every CUDA runtime and driver call: time the CPU spent on its own work, which no wait
   for the GPU can hide in (waits happen inside those calls). That is "at least"; the trace's
   estimate (the window less each call's time beyond its own cost) is saved beside it.

On a CPU every call is synchronous and its wall time is host time: `cpu_host_times`.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from profuse.timers import RUNTIME_CATS, SLEEP_KERNEL

HOLD_MIN_S = 2e-3
HOLD_CAP_S = 2.0  # a call that takes longer to issue has no exact host time here
HOLD_MARGIN = 2.0  # the hold over the call's last exact host time
# A call's own cost, for the trace's estimate: the 10th percentile of the durations of the calls
# of its name in the window (its minimum where there are fewer than 10). Once the queue is full,
# every launch waits for a kernel to finish, a few microseconds each where kernels are short: a
# fixed threshold for "blocked" (say 100 us) would miss most of the waiting.
OWN_COST_PERCENTILE = 10


@dataclass(frozen=True)
class TraceHost:
    """One traced held issue: `window_s` from the hold's launch to the end marker's, `runtime_s` of
    it inside CUDA runtime and driver calls, `waiting_s` the calls' time beyond their own cost
    (OWN_COST_PERCENTILE), and `calls` runtime and driver calls in the window."""

    window_s: float
    runtime_s: float
    waiting_s: float
    calls: int

    @property
    def at_least_s(self) -> float:
        """The CPU's time outside every CUDA call: a lower bound of its own time to issue."""
        return max(self.window_s - self.runtime_s, 0.0)

    @property
    def estimate_s(self) -> float:
        """The window less each call's time beyond its own cost: the host time, where a call's
        cheapest durations are what it costs the CPU."""
        return max(self.window_s - self.waiting_s, 0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "at_least_s": self.at_least_s, "estimate_s": self.estimate_s}


def _merged(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals (a driver call nests in a runtime call)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def host_from_trace(events: Iterable[dict]) -> TraceHost | None:
    """Read a traced held issue (timers.HeldIssue.traced_issue): the window between the launch of
    the first sleep kernel (the hold) and the last (the end marker), and the runtime and driver
    calls inside it. Times in the trace are microseconds. None where the two launches cannot be
    found (the profiler recorded no CUDA activity, or no sleep kernel)."""
    events = [e for e in events if e.get("ph") == "X"]
    sleeps = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") == "kernel" and SLEEP_KERNEL in str(e.get("name", ""))
    }
    sleeps.discard(None)
    calls = sorted(
        (
            float(e["ts"]),
            float(e["ts"]) + float(e.get("dur", 0.0)),
            (e.get("args") or {}).get("correlation"),
            str(e.get("name", "")),
        )
        for e in events
        if e.get("cat") in RUNTIME_CATS
    )
    marks = [c for c in calls if c[2] in sleeps]
    if len(marks) < 2:
        return None
    start, end = marks[0][1], marks[-1][0]  # the hold's launch returns; the end marker's begins
    inside = [(max(a, start), min(b, end), name) for a, b, _, name in calls if b > start and a < end]
    inside = [c for c in inside if c[1] > c[0]]
    us = 1e-6
    runtime = _merged([(a, b) for a, b, _ in inside])
    return TraceHost((end - start) * us, runtime * us, _waiting(inside) * us, len(inside))


def _waiting(calls: list[tuple[float, float, str]]) -> float:
    """The calls' time beyond their own cost (OWN_COST_PERCENTILE of their name's durations),
    over the outermost calls only (a driver call inside a runtime call is the same wait)."""
    outer, end = [], float("-inf")
    for a, b, name in calls:  # sorted by start
        if b <= end:
            continue  # nested in the call before
        outer.append((b - a, name))
        end = max(end, b)
    by_name: dict[str, list[float]] = {}
    for dur, name in outer:
        by_name.setdefault(name, []).append(dur)
    own = {
        name: (min(d) if len(d) < 10 else float(np.percentile(d, OWN_COST_PERCENTILE)))
        for name, d in by_name.items()
    }
    return sum(max(dur - own[name], 0.0) for dur, name in outer)


@dataclass
class HostTime:
    """One variant's host time per call: each round's time and whether its hold ended before the
    CPU finished (`filled`), and where most rounds filled, the traced issue's reading."""

    times_s: list[float] = field(default_factory=list)
    filled: list[bool] = field(default_factory=list)
    trace: TraceHost | None = None
    method: str = "held"  # "held" (CUDA: the GPU held), "wall" (CPU: every call is synchronous)

    @property
    def lower_bound(self) -> bool:
        """Most rounds filled the queue: the figure is 'at least'."""
        return 2 * sum(self.filled) > len(self.filled)

    @property
    def seconds(self) -> float | None:
        """The median exact round; where most rounds filled, the trace's lower bound (None where
        there is no trace to read)."""
        if self.lower_bound:
            return self.trace.at_least_s if self.trace else None
        exact = [t for t, f in zip(self.times_s, self.filled) if not f]
        return statistics.median(exact) if exact else None

    def to_dict(self) -> dict:
        return {
            "host_s": self.seconds,
            "lower_bound": self.lower_bound,
            "method": self.method,
            "times_s": list(self.times_s),
            "filled": list(self.filled),
            "trace": self.trace.to_dict() if self.trace else None,
        }


class Issuer:
    """What measure_host needs of the GPU (timers.HeldIssue on CUDA; a fake in the tests)."""

    def issue(self, fn: Callable[[], object], hold_s: float) -> tuple[float, bool]:  # pragma: no cover
        raise NotImplementedError

    def traced_issue(self, fn: Callable[[], object], hold_s: float) -> list[dict] | None:  # pragma: no cover
        raise NotImplementedError


def _hold(last_exact: float | None) -> float:
    return min(max(HOLD_MARGIN * last_exact if last_exact else HOLD_MIN_S, HOLD_MIN_S), HOLD_CAP_S)


def measure_host(
    calls: Mapping[str, Callable[[], object]],
    issuer,
    rounds: int,
    seed: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, HostTime]:
    """Each variant's host time per call, in `rounds` rounds each in its own shuffled order (the
    module's docstring says how)."""
    rng = random.Random(seed)
    names = list(calls)
    out = {n: HostTime() for n in names}
    last: dict[str, float | None] = dict.fromkeys(names)
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            hold = _hold(last[name])
            sec, filled = issuer.issue(calls[name], hold)
            if filled and hold < HOLD_CAP_S:  # perhaps only a hold too short: once more, longer
                sec, filled = issuer.issue(calls[name], min(HOLD_MARGIN * sec, HOLD_CAP_S))
            out[name].times_s.append(sec)
            out[name].filled.append(filled)
            if not filled:
                last[name] = sec
        if progress:
            progress("host time", r + 1, rounds)
    for name, host in out.items():
        if host.lower_bound:
            # Any hold will do: waiting happens inside CUDA calls, which the reading leaves out.
            events = issuer.traced_issue(calls[name], _hold(last[name]))
            host.trace = host_from_trace(events) if events else None
    return out


def cpu_host_times(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, HostTime]:
    """On a CPU: each call's wall time, in `rounds` shuffled rounds (nothing is ever queued)."""
    rng = random.Random(seed)
    names = list(calls)
    out = {n: HostTime(method="wall") for n in names}
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            t0 = clock()
            calls[name]()
            out[name].times_s.append(clock() - t0)
            out[name].filled.append(False)
        if progress:
            progress("host time", r + 1, rounds)
    return out
