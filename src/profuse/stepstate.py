"""What Part C's variants share, kept the same for each: one set of weights, held fixed while
they are timed, and one allocator, emptied before each variant's own steps.

Every variant steps the same Parameter objects with the same AdamW (a 1B model's weights,
gradients and moments stay resident once, not once a variant). Sharing is fair only where no
variant leaves the others something different:

- Weights. AdamW runs at lr 0 while the variants are timed (`zero_lr`): its kernels are the
  same at any lr (decoupled weight decay multiplies by 1 - lr * wd = 1, the update adds
  -lr * m / (sqrt(v) + eps) = 0), so each step costs what it costs in training, and every
  variant times the same weights, bitwise (`fingerprint` before and after says so). Without it
  each variant's ~300 steps moved them on one batch, with nothing checking they stayed finite.
  After the trials the weights and each variant's last loss must be finite (`after_trials`): a
  variant whose loss is not is reported failed; weights that are not fail every variant (a
  non-finite gradient reaches them through 0 x NaN, and later steps then ran on them).
- AdamW's state. Made before any variant runs (`make_state`: one step of zero gradients at lr 0:
  both moments zero, the weights unchanged), so it is resident for every variant alike.
- Memory. Each variant's own steps start from an emptied allocator (gc, empty_cache,
  reset_peak_memory_stats); its peak is what the allocator reserved over them
  (max_memory_reserved: the segments it took from the driver, CUDA graph pools included, which
  is what runs out), with the peak allocated beside it as information (`own_steps`). What is
  resident when they start, the shared parameters and AdamW state, is in every variant's peak
  alike. A variant's CUDA graph pool lives as long as its graphs, so graph variants go last.
  That peak holds the first steps' transients (compilation, autotuning, a first launch's checks,
  graph capture); the steady state is measured beside it: after them the allocator's cache is
  emptied again and the peaks reset, and STEADY_STEPS more steps give the peak reserved and
  allocated of steps as a training loop runs them once started (what a memory target is set on).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch

# A variant's own steps, from an emptied allocator: the first (compilation; a CUDA-graph
# variant's warm-up run), the second (its graphs captured), the third (replayed, as every later
# step): its memory over warm-up, capture and steady state.
MEMORY_STEPS = 3
# Steps after those, from an emptied cache: the steady-state peak (a step's own high-water mark,
# twice, so a step that frees what the previous one left counts too).
STEADY_STEPS = 2

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def zero_lr(optimizer: torch.optim.Optimizer):
    """Inside, every param group's lr is 0 (the weights do not move); restored after."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def make_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments made now, before any variant's steps: one step on zero gradients at lr 0
    (the moments stay zero, the weights do not move). Gradients are cleared after."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with zero_lr(optimizer):
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def fingerprint(params: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's bit patterns summed as integers: a change to any one element changes it
    (NaNs included, where a value comparison would not)."""
    sums = [p.detach().reshape(-1).view(_BITS[p.element_size()]).sum(dtype=torch.int64) for p in params]
    return torch.stack(sums).tolist() if sums else []


def finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


@dataclass
class StepMemory:
    """A variant's memory over its own steps (CUDA), from an emptied allocator."""

    resident_bytes: int  # allocated as its steps began: the shared parameters and AdamW state
    reserved_bytes: int  # peak max_memory_reserved over its steps: what can run out
    allocated_bytes: int  # peak max_memory_allocated over them: tensors alone, for information
    steps: int  # its steps measured (MEMORY_STEPS)
    # over STEADY_STEPS later steps, from an emptied cache and reset peaks (None: not measured)
    steady_reserved_bytes: int | None = None
    steady_allocated_bytes: int | None = None
    steady_steps: int = 0
    # the allocator's own account of those steady steps (ALLOCATOR_STATS, peaks unless said): where
    # reserved exceeds allocated, the split blocks left inactive and the segments say why
    steady_allocator: dict | None = None

    @property
    def peak_bytes(self) -> int:
        """What the report shows as the variant's peak memory: reserved."""
        return self.reserved_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes, "accounting": "reserved"}


@dataclass
class OwnSteps:
    """What a variant's own first steps gave: the first one's time, memory, the last loss."""

    first_s: float  # the first step, synchronised, compilation included
    memory: StepMemory | None  # CUDA only
    loss: torch.Tensor | None


# torch.cuda.memory_stats keys read after the steady steps: segments held from the driver, bytes in
# split blocks not in use (fragmentation), what tensors asked for before the allocator's rounding
# (peaks, which reset_peak_memory_stats restarts), and the times it freed its cache to retry a
# cudaMalloc (a count since the process began, so read before and after: the steps' own).
ALLOCATOR_STATS = (
    "segment.all.peak",
    "inactive_split_bytes.all.peak",
    "requested_bytes.all.peak",
    "num_alloc_retries",
)
COUNTED_STATS = ("num_alloc_retries",)


def allocator_stats(device: torch.device, before: dict | None = None) -> dict | None:
    """ALLOCATOR_STATS from torch.cuda.memory_stats (None where the allocator gives none: a
    backend without them, an allocator other than the caching one); with `before` (this
    function's earlier reading) the COUNTED_STATS as the difference since then."""
    try:
        stats = torch.cuda.memory_stats(device)
    except (RuntimeError, AssertionError, AttributeError):
        return None
    out = {k: int(stats[k]) for k in ALLOCATOR_STATS if k in stats}
    for k in COUNTED_STATS:
        if before and k in out and k in before:
            out[k] -= before[k]
    return out or None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_allocator(device: torch.device) -> None:
    """Drop unreferenced tensors and the allocator's cached blocks; the peaks start again here."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def own_steps(
    step: Callable[[], torch.Tensor],
    device: torch.device,
    steps: int = MEMORY_STEPS,
    clock: Callable[[], float] = time.perf_counter,
    steady: int = STEADY_STEPS,
) -> OwnSteps:
    """`steps` whole steps of one variant from an emptied allocator (CUDA): the first timed
    alone, the peak memory over all of them; then (CUDA) `steady` more from an emptied cache,
    their peak the steady state's."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    cuda = device.type == "cuda"
    empty_allocator(device)
    resident = torch.cuda.memory_allocated(device) if cuda else 0
    _sync(device)
    t0 = clock()
    loss = step()
    _sync(device)
    first_s = clock() - t0
    for _ in range(steps - 1):
        loss = step()
    _sync(device)
    memory = None
    if cuda:
        memory = StepMemory(
            resident_bytes=resident,
            reserved_bytes=torch.cuda.max_memory_reserved(device),
            allocated_bytes=torch.cuda.max_memory_allocated(device),
            steps=steps,
        )
        if steady > 0:  # the cache emptied of the first steps' transients, the peaks reset
            loss = None
            empty_allocator(device)
            before = allocator_stats(device)
            for _ in range(steady):
                loss = step()
            _sync(device)
            memory.steady_reserved_bytes = torch.cuda.max_memory_reserved(device)
            memory.steady_allocated_bytes = torch.cuda.max_memory_allocated(device)
            memory.steady_steps = steady
            memory.steady_allocator = allocator_stats(device, before)
    return OwnSteps(first_s, memory, loss)


class LastLoss:
    """Steps that remember the loss each variant last returned (a reference, no copy and no sync:
    a CUDA-graph replay's output stays valid until that graph's next replay)."""

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] = {}

    def wrap(self, name: str, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            out = step()
            self.last[name] = out
            return out

        return call


@dataclass
class WeightsCheck:
    """The shared weights through the timed steps."""

    lr: float  # AdamW's lr while timing: 0
    unchanged: bool  # bitwise the same after the trials as before (fingerprint)
    finite: bool  # every weight finite after the trials
    nonfinite: list[str]  # variants whose last loss was not finite

    def to_dict(self) -> dict:
        return asdict(self)


def after_trials(
    params: Iterable[torch.Tensor], before: list[int], last: Mapping[str, torch.Tensor]
) -> WeightsCheck:
    """The weights against their fingerprint from before, their finiteness, and each variant's
    last loss."""
    params = list(params)
    nonfinite = [name for name, loss in last.items() if not finite([loss])]
    return WeightsCheck(0.0, fingerprint(params) == before, finite(params), nonfinite)


def failures(check: WeightsCheck, timed: Iterable[str]) -> dict[str, str]:
    """variant -> why it fails, from `check`: the ones whose loss was not finite; every one where
    the weights are not."""
    out = {name: "its loss was not finite after the timed steps" for name in check.nonfinite}
    if not check.finite:
        why = (
            "the shared weights were not finite after the timed steps (a non-finite gradient reaches "
            "them even at lr 0, and every later step ran on them)"
        )
        out = {name: out.get(name, why) for name in timed}
    return out
