"""Where a compiled variant's first step goes: torch.compile's own timers and profuse's autotuner.

Part C times each variant's first step whole, compilation included. On the H200 (2026-12-05,
Llama-3.2-1B, 4 x 2048 tokens) `compile+fused` took 37.1 s to its first step against `compile`'s
5.2 s. This module splits such a step as far as torch and profuse let it be seen:

- torch's timed phases (torch._dynamo.utils.compilation_time_metrics: seconds per phase function,
  accumulated over the process; the split is the growth over the step). They nest: Dynamo's whole
  compile of a frame (`_compile.compile_inner`) holds the backend's (`call_user_compiler`: AOT
  autograd and Inductor), which holds Inductor's forward and backward compilers and the wait for
  Triton kernels compiled in worker processes (`async_compile.wait`); so they are not summed.
- the graphs compiled, graph breaks and Inductor's FX-graph cache hits and misses
  (torch._dynamo.utils.counters), which say whether the compile started cold;
- profuse's autotuner (kernels/autotune.TUNER): the seconds spent in its `pick` and the launch
  configs it compiled and timed for shapes it had not seen, and of those seconds the ones spent
  building the candidates (compiling them, then each one's first launch) before their timing.
  The hypothesis this tests: under torch.compile, autotune.traced runs profuse's launchers on
  real tensors while Dynamo traces, so every candidate config of every new shape is compiled
  and timed cold inside the compile;
- the first launches through a binding, each checked against triton's JIT route
  (autotune.Launch): how many, and their seconds, waits for the device included (their copies
  of large tensors go through host memory).

The same split is kept for each variant's same-math check (profuse.step), where a cold process
compiles most of profuse's kernels.

Nothing here changes what runs: the tuner is watched by wrapping its `pick` on the instance for
the length of one step, then unwrapped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

# The phases a report line names, where torch timed them (they nest: Dynamo's holds the
# forward's compile; the backward is compiled at the first backward, outside it). Seen in torch
# 2.13's timers on a cold compile: 44.6 s Dynamo, 41.7 s Inductor forward, 6.6 s backward, 9.4 s
# waiting for kernels, 36.4 s code generation (the CPU's C++ compiles).
NAMED_PHASES = {
    "_compile.compile_inner": "Dynamo (the forward's compile within)",
    "compile_fx.<locals>.fw_compiler_base": "Inductor forward",
    "compile_fx.<locals>.bw_compiler": "Inductor backward",
    "GraphLowering.codegen": "code generation",
    "async_compile.wait": "waiting for compiled kernels",
    "PyCodeCache.load_by_key_path": "loading compiled code",
}
SHOWN_PHASES = 4  # where torch has none of NAMED_PHASES: its largest, by name
CHECK_SPLIT = "check:"  # a run's splits: "check:NAME" is NAME's same-math check, NAME its first step


def _metrics() -> dict[str, float]:
    """torch's compile phases so far in this process: name -> seconds ({} where torch has none)."""
    try:
        from torch._dynamo import utils
    except Exception:  # a torch without Dynamo
        return {}
    metrics = getattr(utils, "compilation_time_metrics", None) or {}
    return {str(k): float(sum(v)) for k, v in metrics.items() if isinstance(v, (list, tuple))}


def _counters() -> dict[str, float]:
    """Dynamo's counters that say what was compiled: graphs, graph breaks, FX-graph cache use."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    out = {
        "graphs": float(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": float(sum(counters["graph_break"].values())),
    }
    for key, value in counters["inductor"].items():
        if "cache" in key:
            out[f"inductor {key}"] = float(value)
    return out


@dataclass
class TunerWatch:
    """What profuse's autotuner did while it was watched."""

    seconds: float = 0.0  # inside Autotuner.pick: compiling and timing candidates, lookups
    picks: int = 0  # calls of pick
    tuned: int = 0  # shapes (tuning keys) tuned for the first time
    configs: int = 0  # launch configs those shapes offered: each compiled and timed once
    build_s: float = 0.0  # of `seconds`, building the candidates before their timing
    checks: int = 0  # first launches through a binding, checked against the JIT route
    checks_s: float = 0.0  # their seconds


@contextlib.contextmanager
def watch_tuner(tuner=None, clock: Callable[[], float] = time.perf_counter) -> Iterator[TunerWatch]:
    """Count and time `tuner.pick` (default kernels.autotune.TUNER, where Triton is installed)
    inside the block; the tuner is left as it was after it."""
    watch = TunerWatch()
    try:
        from profuse.kernels import autotune
    except Exception:  # no triton: no first launches to count, and no tuner unless one is given
        autotune = None
    if tuner is None:
        if autotune is None:
            yield watch
            return
        tuner = autotune.TUNER
    launch_checks = autotune.FIRST_LAUNCH_CHECKS if autotune is not None else [0, 0.0]
    build_s = getattr(tuner, "build_s", 0.0)
    checks = list(launch_checks)
    had_own = "pick" in vars(tuner)
    own = vars(tuner).get("pick")
    original = tuner.pick

    def pick(key, candidates, launch, device):
        new = key not in tuner.chosen
        t0 = clock()
        try:
            return original(key, candidates, launch, device)
        finally:
            watch.seconds += clock() - t0
            watch.picks += 1
            if new and key in tuner.chosen:
                watch.tuned += 1
                watch.configs += len(candidates)

    tuner.pick = pick
    try:
        yield watch
    finally:
        if had_own:
            tuner.pick = own
        else:
            del tuner.pick
        watch.build_s = getattr(tuner, "build_s", 0.0) - build_s
        watch.checks = launch_checks[0] - checks[0]
        watch.checks_s = launch_checks[1] - checks[1]


@dataclass
class CompileSplit:
    """A compiled variant's first step, split as far as torch and profuse's tuner show it."""

    seconds: float  # the first step, wall clock
    phases: dict[str, float] = field(default_factory=dict)  # torch's phase -> seconds in it (nested)
    counts: dict[str, float] = field(default_factory=dict)  # graphs, graph_breaks, cache hits/misses
    tuner_s: float = 0.0  # in profuse's autotuner
    tuner_shapes: int = 0  # new shapes it tuned
    tuner_configs: int = 0  # launch configs it compiled and timed for them
    tuner_build_s: float = 0.0  # of tuner_s, building those configs before their timing
    launch_checks: int = 0  # first launches through a binding, checked against the JIT route
    launch_checks_s: float = 0.0  # their seconds, waits for the device included

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def compiled_anything(self) -> bool:
        """Did torch.compile or profuse's autotuner work in this step, or a first launch?"""
        return bool(self.phases or self.tuner_configs or self.counts.get("graphs") or self.launch_checks)

    def summary(self) -> str:
        """'Dynamo/Inductor: _compile.compile_inner 4.1 s, ...; 2 graphs; autotuner 30.2 s (12
        shapes, 140 configs)': the largest phases, then the tuner."""
        parts = []
        named = [(label, self.phases[key]) for key, label in NAMED_PHASES.items() if key in self.phases]
        shown = named or list(self.phases.items())[:SHOWN_PHASES]
        if shown:
            parts.append("torch.compile: " + ", ".join(f"{k} {v:.1f} s" for k, v in shown))
        graphs = int(self.counts.get("graphs", 0))
        breaks = int(self.counts.get("graph_breaks", 0))
        if graphs or breaks:
            parts.append(f"{graphs} graph(s), {breaks} graph break(s)")
        built = f", built in {self.tuner_build_s:.1f} s" if self.tuner_configs else ""
        parts.append(
            f"profuse's autotuner {self.tuner_s:.1f} s ({self.tuner_shapes} new shape(s), "
            f"{self.tuner_configs} launch config(s) compiled and timed{built})"
        )
        if self.launch_checks:
            parts.append(
                f"{self.launch_checks} first launch(es) checked against triton's JIT route "
                f"{self.launch_checks_s:.1f} s"
            )
        return "; ".join(parts)


@contextlib.contextmanager
def split_compile(clock: Callable[[], float] = time.perf_counter, tuner=None) -> Iterator[list[CompileSplit]]:
    """Measure the block (one first step): yields a list that holds its CompileSplit after it."""
    out: list[CompileSplit] = []
    before, counts = _metrics(), _counters()
    t0 = clock()
    with watch_tuner(tuner, clock) as watch:
        yield out
    seconds = clock() - t0
    after, counts_after = _metrics(), _counters()
    grown = {k: after[k] - before.get(k, 0.0) for k in after}
    phases = dict(sorted(((k, v) for k, v in grown.items() if v > 0), key=lambda kv: -kv[1]))
    delta = {k: counts_after[k] - counts.get(k, 0.0) for k in counts_after}
    out.append(
        CompileSplit(
            seconds=seconds,
            phases=phases,
            counts={k: v for k, v in delta.items() if v},
            tuner_s=watch.seconds,
            tuner_shapes=watch.tuned,
            tuner_configs=watch.configs,
            tuner_build_s=watch.build_s,
            launch_checks=watch.checks,
            launch_checks_s=watch.checks_s,
        )
    )
