"""Part B over several sizes: the same checked, interleaved comparison at every (rows, cols).

The lab's first exercise. At small sizes fixed costs (kernel launches on a GPU, Python dispatch
and thread start-up on a CPU) are most of the time and fusion mainly saves launches; at large
sizes memory traffic dominates and the speedup tends to eager traffic / fused traffic (about
15 / 4 tensors forward, bench/traffic.py). A sweep shows where between the two each size sits.

Every size is a full `run_tail_bench` (correctness first, then interleaved trials); the copy
ceiling is measured once and shared, so every size's "% of copy" divides by the same roof.
A size that does not fit in memory is recorded in `skipped` with the reason, and the sweep goes on.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from profuse import __version__
from profuse import compile as _compile
from profuse.bench import DEFAULT_TRIALS
from profuse.bench import traffic as B
from profuse.bench.tail_bench import DEFAULT_VARIANTS, TailBenchConfig, TailBenchResult, run_tail_bench
from profuse.env import dtype_name, environment
from profuse.errors import UsageError
from profuse.tail import DEFAULT_EPS

# Progress units per size, split by phase. The trials get most of the bar because they are most
# of the time once compilation is done (30 trials x every variant, against one checked call each).
STEPS_PER_SIZE = 100
_PHASES = {"checking": (0, 10), "warm-up": (10, 20), "host time": (20, 25), "trials": (25, 100)}


def _settings(cfg) -> dict:
    """Every TailBenchConfig field but the size, read from `cfg`."""
    return {f.name: getattr(cfg, f.name) for f in fields(TailBenchConfig) if f.name not in ("rows", "cols")}


@dataclass
class SweepConfig:
    rows: Sequence[int] = (1024, 8192, 32768)  # the lab's exercise
    cols: Sequence[int] = (4096,)  # every rows value is run with every cols value
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    trials: int = DEFAULT_TRIALS  # interleaved trials per size
    warmup: int | None = None  # as TailBenchConfig: 3 on CUDA, 1 on CPU
    seed: int = 0  # the same seed at every size: inputs and trial orders differ only by shape
    backward: bool = False  # time forward + backward instead of the forward alone
    variants: Sequence[str] = DEFAULT_VARIANTS
    flush_l2: bool = True
    eps: float = DEFAULT_EPS
    timing: str = "device"  # how calls are timed: device, loop or graph (profuse/timers.py)

    # Elements per tensor: with these, each cols value gets rows = elements // cols (the --rows
    # list is not used), so a grid over hidden sizes holds the same amounts of data.
    elements: Sequence[int] = ()

    def __post_init__(self):
        self.elements = tuple(dict.fromkeys(int(e) for e in self.elements))
        if any(e <= 0 for e in self.elements):
            raise UsageError(f"--elements must be positive, got {list(self.elements)}")
        # Repeated sizes would be timed twice and plotted on top of each other: keep the first.
        self.rows = tuple(dict.fromkeys(int(r) for r in self.rows))
        self.cols = tuple(dict.fromkeys(int(c) for c in self.cols))
        if not self.rows or not self.cols:
            raise UsageError("a sweep needs at least one --rows and one --cols value")
        short = [(e, c) for e in self.elements for c in self.cols if e < c]
        if short:
            e, c = short[0]
            raise UsageError(
                f"--elements {e} is fewer than --cols {c}: each size needs at least one row of {c} "
                "elements (rows = elements // cols)"
            )
        # Building every size's config checks the settings (sizes, trials, dtype, variants) before
        # the first size runs: a typo fails at once, and a UsageError raised later by a size can
        # only mean that the size does not fit.
        configs = [self.bench_config(r, c) for r, c in self.sizes()]
        self.variants = tuple(configs[0].variants)  # with the baseline added where it was left out

    @classmethod
    def from_bench(
        cls, bench: TailBenchConfig, rows: Sequence[int], cols: Sequence[int], elements: Sequence[int] = ()
    ) -> SweepConfig:
        """The settings of one bench config (as the CLI builds it), over lists of sizes."""
        return cls(rows=rows, cols=cols, elements=elements, **_settings(bench))

    def sizes(self) -> list[tuple[int, int]]:
        if self.elements:
            return list(dict.fromkeys((e // c, c) for c in self.cols for e in self.elements))
        return [(r, c) for r in self.rows for c in self.cols]

    def rounding(self) -> list[str]:
        """One line per --elements value that --cols does not divide: the size it becomes."""
        return [
            f"--elements {e} with --cols {c}: timed as {e // c} x {c} = {e // c * c} elements "
            f"(rows = elements // cols; {e % c} left over)"
            for c in self.cols
            for e in self.elements
            if e % c
        ]

    def bench_config(self, rows: int, cols: int) -> TailBenchConfig:
        return TailBenchConfig(rows=rows, cols=cols, **_settings(self))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            rows=list(self.rows),
            cols=list(self.cols),
            elements=list(self.elements),
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            variants=list(self.variants),
        )
        return d


@dataclass
class SkippedSize:
    rows: int
    cols: int
    reason: str  # one line: what did not fit, and how much it needed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SweepResult:
    config: SweepConfig
    env: dict
    copy_ceiling_Bps: float | None  # CUDA only, measured once before the first size
    runs: list[TailBenchResult]  # in the order the sizes ran
    skipped: list[SkippedSize]

    def to_dict(self) -> dict:
        runs = []
        for run in self.runs:
            d = run.to_dict()
            d.pop("env", None)  # the environment is stored once, at the top
            runs.append(d)
        return {
            "kind": "sweep",
            "profuse": __version__,
            "config": self.config.to_dict(),
            "env": self.env,
            "copy_ceiling_Bps": self.copy_ceiling_Bps,
            "runs": runs,
            "skipped": [s.to_dict() for s in self.skipped],
        }


def _size_progress(
    progress: Callable[[str, int, int], None] | None, stage: str, index: int, n_sizes: int
) -> Callable[[str, int, int], None] | None:
    """Map one size's (stage, done, total) callbacks onto one count over the whole sweep."""
    if progress is None:
        return None
    start = index * STEPS_PER_SIZE
    total = n_sizes * STEPS_PER_SIZE

    def report(inner: str, done: int, inner_total: int) -> None:
        phase = next((p for p in _PHASES if inner.startswith(p)), None)
        if phase is None:
            return
        lo, hi = _PHASES[phase]
        frac = done / inner_total if inner_total else 1.0
        progress(stage, start + lo + int((hi - lo) * frac), total)

    return report


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))):
        return True
    # The CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory").
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _release(device: torch.device) -> None:
    """Hand back what the last size held, so the next size's memory check sees it as free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_sweep(
    cfg: SweepConfig,
    progress: Callable[[str, int, int], None] | None = None,
    on_size: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """Run the tail benchmark at every size of `cfg`; sizes that do not fit are skipped, not fatal.

    `progress(stage, done, total)` counts over the whole sweep; `stage` names the size
    ("size 2/3: 8192 x 4096"). `on_size(result so far)` runs after each size (the CLI saves the
    sizes done, so a sweep stopped part-way keeps them).
    """
    dev = cfg.device
    ceiling = B.copy_ceiling(dev) if dev.type == "cuda" else None
    env = environment(dev)
    sizes = cfg.sizes()
    runs: list[TailBenchResult] = []
    skipped: list[SkippedSize] = []
    for i, (rows, cols) in enumerate(sizes):
        stage = f"size {i + 1}/{len(sizes)}: {rows} x {cols}"
        if progress:
            progress(stage, i * STEPS_PER_SIZE, len(sizes) * STEPS_PER_SIZE)
        # Each size compiles fresh: Dynamo never reaches its recompile limit and falls back to
        # eager mid-sweep, and no size is timed with a graph specialised for another.
        _compile.reset()
        try:
            runs.append(
                run_tail_bench(
                    cfg.bench_config(rows, cols),
                    progress=_size_progress(progress, stage, i, len(sizes)),
                    copy_ceiling_Bps=ceiling,
                )
            )
        except UsageError as err:  # the memory check: the settings were validated in SweepConfig
            skipped.append(SkippedSize(rows, cols, str(err)))
        except (RuntimeError, MemoryError) as err:
            if not _is_out_of_memory(err):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            skipped.append(SkippedSize(rows, cols, f"out of memory on {dev}: {first}"))
        finally:
            _release(dev)
        if on_size is not None:
            on_size(SweepResult(cfg, env, ceiling, list(runs), list(skipped)))
    return SweepResult(cfg, env, ceiling, runs, skipped)
