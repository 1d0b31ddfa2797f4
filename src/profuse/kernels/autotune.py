"""Choosing a launch config once per shape, and launching it for the cost of a launch ever after.

Two caches, each with one job:

- `Autotuner`: per tuning key (the op, rows rounded up to a power of two, cols, dtype, ...) the
  candidate config (kernels/configs.py) that ran fastest on the device. The first call of a key
  times every candidate that launches; later keys that round to it reuse the choice.
- `PlanCache`: per exact call signature, a ready plan (each kernel bound to its grid, its
  compile-time arguments and warps, as `Launch`). After the first call for a signature a call is
  one dictionary lookup and the launches: no candidate lists, no config objects copied, no
  device queries. On the H200's host, rebuilding the candidates per call was about 44% of the
  tail forward's host time (255 us a call against 32 us for a bare launch).

Before any timing, each candidate's answer is compared with the first runnable candidate's
(where the launch returns its outputs, as the tail's do): one off by more than rounding is
left out and warned about, so a fast wrong kernel is never the pick.

The timer is injected (`Autotuner(make_timer=...)`): by default profuse.timers.CudaTimer, device
time with the L2 flushed; tests give a fake. Tuning is skipped (the favourite runs, and is not
remembered as tuned) where it cannot time: autotuning off (PROFUSE_AUTOTUNE=0), not on CUDA (the
interpreter), or while a CUDA graph is being captured.

Under torch.compile on CUDA the fused ops are Triton ops (`torch.library.triton_op`, torch 2.6
and later): `traced(fn, *args)` runs a launcher with every launch recorded through
`torch.library.wrap_triton`, so Inductor puts the kernels themselves in its generated code and
launches them with its own launcher. An opaque custom op instead costs a dispatch into Python and
the launcher's host path at every call of the compiled step (about 0.18 ms a call on the H200's
host, measured at Part C's lab size). The plans the trace needs are made first, on real tensors
shaped like the traced ones, so they are tuned as an eager call's would be. With
PROFUSE_ANALYSIS_MEMO=1, torch's analysis of what each recorded launch writes is made once per
launch signature (kernels/launch_analysis.py).

A new tuning key's candidates are built at once before any is run (`Autotuner.precompile`): a
dry run of each candidate's launch collects what it would compile, and triton's AsyncCompileMode
(triton 3.6 and later) compiles them in a pool of threads, which triton's compiler lets run in
parallel (it releases the GIL in its passes and in ptxas). A cold fused Llama step compiles most
of its kernels as tuning candidates, one after another without this. PROFUSE_COMPILE_THREADS
sets the pool's size (1: one at a time, as before triton 3.6 always).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
from torch.utils._python_dispatch import _disable_current_modes

from profuse.env import interpreting, whole_number_setting
from profuse.kernels import fast_launch, launch_analysis
from profuse.kernels.configs import KernelConfig
from profuse.timers import CudaTimer

AUTOTUNE_TRIALS = 15
# Candidates within this fraction of the fastest are timed again, in a round of twice the
# trials of their own, and the second round alone picks: on the H200 (2026-12-03) the one-round
# pick at 381 x 11008 bf16, a team forward, ran 16.3-16.5 us in the grids against 15.6 us for
# the kernels without teams, which it had beaten by less than 5% in the tuner; with the runoff
# the tuner picks the chunked kernel, 15.5 us.
RUNOFF_MARGIN = 0.05

# A first fast launch's check copies its tensors twice; above this many bytes of tensors the
# copies are held in host memory instead of the device's (Launch._first_fast_launch).
CHECK_ON_DEVICE_BYTES = 64 << 20

# Set to a list to record (kind, config, registers, spills) of each launch (benchmarks do).
LAUNCH_LOG: list | None = None
# [count, seconds] of the first launches through a binding, each checked against the JIT route
# (Launch._first_fast_launch): compiletime reports what a first step spent in them.
FIRST_LAUNCH_CHECKS: list = [0, 0.0]
_clock = time.perf_counter


def autotune_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("PROFUSE_AUTOTUNE", "1") != "0"


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream? Nothing may be timed then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# torch.library.triton_op and wrap_triton (torch 2.6 and later); without them the compile route
# is the opaque custom op.
HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")

# True while `traced` runs a launcher: launches are recorded for torch.compile, not run.
_TRACING = False
# Where a Launch goes instead of running while a launcher is traced or dry-run (`_detour`):
# `route(launch, args)`. One global read on a launch's path, None there.
_DETOUR: Callable | None = None


def async_compile_mode(mode=None):
    """triton's AsyncCompileMode (warmups under it compile in an executor) where it can drop a
    failed compile (`ignore_errors`, triton 3.6 and later), else None. 3.5's raises the failure
    when it waits, and leaves itself active for every later compile, so it is not used."""
    mode = getattr(triton, "AsyncCompileMode", None) if mode is None else mode
    try:
        return mode if mode is not None and "ignore_errors" in inspect.signature(mode).parameters else None
    except (TypeError, ValueError):  # no signature to read
        return None


_ASYNC_COMPILE = async_compile_mode()
COMPILE_THREADS_ENV = "PROFUSE_COMPILE_THREADS"
MAX_COMPILE_THREADS = 16

_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_OR = operator.or_


def log_launch(launch, compiled) -> None:
    """Record a launch's kind, config, registers and spills in LAUNCH_LOG, when it is on."""
    if LAUNCH_LOG is not None:
        regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
        LAUNCH_LOG.append((launch.kind, launch.config, regs, spills))


# The fast route (kernels/fast_launch.py) is on unless PROFUSE_FAST_LAUNCH=0, the triton version
# is not one whose launch path was read, `set_fast_launch(False)` turned it off, or a bound
# launch once disagreed with the JIT route (then it stays off for the process).
_FAST = fast_launch.VERIFIED and fast_launch.enabled_by_environment()
_FAST_FAILED = False
# Bindings a Launch keeps (one per set of int arguments and dtypes). A launch that needs more
# (an int that changes every call) stops binding and keeps the JIT route: each new binding costs
# a checked first launch.
MAX_BINDINGS = 8


def fast_launch_on() -> bool:
    return _FAST


def set_fast_launch(on: bool) -> bool:
    """Turn the fast route on or off for this process (benchmarks time both routes in one
    process); returns whether it was on. It cannot come on where it was never verified (the
    triton version) or after a bound launch disagreed with the JIT route."""
    global _FAST
    was = _FAST
    _FAST = bool(on) and fast_launch.VERIFIED and not _FAST_FAILED
    return was


def _fast_launch_failed(launch, error: str) -> None:
    global _FAST, _FAST_FAILED
    _FAST, _FAST_FAILED = False, True
    warnings.warn(
        f"profuse: the direct launch of {launch.kind} ({getattr(launch.kernel, '__name__', launch.kernel)}) "
        f"{error}; every launch takes triton's JIT route from now on (PROFUSE_FAST_LAUNCH=0 does so "
        "from the start)",
        stacklevel=3,
    )


class Launch:
    """One kernel bound to its grid and compile-time arguments: calling it with the runtime
    arguments launches it. `config` and `kind` name what runs, for results and logs.

    A call goes through triton's JIT route (`run`: kernel[grid], JITFunction.run) the first
    time, and after that straight to the compiled kernel's launcher (kernels/fast_launch.py)
    wherever the call looks as the bound one did: the same int arguments and tensor dtypes,
    every pointer 16-byte aligned (floats may change). The first launch through each binding is
    checked: run on the JIT route too, from the same inputs, it must leave every tensor argument
    with the same bits (else the fast route is turned off for the process, with one warning, and
    the JIT route's answer kept). While torch.compile traces (`traced`), the launch is recorded
    through wrap_triton instead, and neither route runs.

    Runtime arguments are the kernel's leading parameters, tensors and ints and floats (every
    profuse launcher's); the compile-time ones and the launch options are `meta`.
    """

    __slots__ = ("run", "kernel", "grid", "meta", "config", "kind", "bound", "layout")

    def __init__(self, kernel, grid: tuple[int, ...], config: KernelConfig | None, kind: str, **meta):
        self.run = kernel[grid]  # the JIT route: triton binds the grid once here, not per call
        self.kernel = kernel
        self.grid = grid
        self.meta = meta
        self.config = config
        self.kind = kind
        # (int arguments, tensor dtypes) -> fast_launch.Bound; None: this launch never binds
        self.bound: dict | None = {}
        self.layout = None  # where the tensors are among the runtime arguments, once bound

    def __call__(self, *args) -> None:
        if _DETOUR is not None:
            _DETOUR(self, args)
            return
        bound = self.bound
        if _FAST and bound and fast_launch.hooks_idle():
            layout = self.layout
            tensors = layout.tensors(args)
            b = bound.get((layout.ints(args), tuple(map(_DTYPE, tensors))))
            if b is not None and not functools.reduce(_OR, map(_DATA_PTR, tensors)) & 15:
                if b.checked:  # Bound.launch, inline: one Python frame fewer a launch
                    b.launcher(b.grid_0, b.grid_1, b.grid_2, b.stream(b.device), b.function, b.packed,
                               None, None, None, *args, *b.tail)  # fmt: skip
                    if LAUNCH_LOG is not None:
                        log_launch(self, b.compiled)
                    return
                t0 = _clock()
                checked = self._first_fast_launch(b, args)
                FIRST_LAUNCH_CHECKS[0] += 1
                FIRST_LAUNCH_CHECKS[1] += _clock() - t0
                if checked:
                    return
        compiled = self.run(*args, **self.meta)
        log_launch(self, compiled)
        if _FAST and bound is not None:
            self._bind(args, compiled)

    def _bind(self, args: tuple, compiled) -> None:
        """Bind launches like this one (just made on the JIT route) to `compiled`'s launcher;
        where that can never hold for this launch, stop trying (only a misaligned tensor is
        worth another try, on a later call)."""
        b = fast_launch.bind(self.kernel, self.grid, self.meta, args, compiled, self.layout)
        if isinstance(b, str):
            if b != fast_launch.MISALIGNED:
                self.bound = None
            return
        if len(self.bound) >= MAX_BINDINGS:
            self.bound = None
            return
        self.layout = b.layout
        self.bound[(b.layout.ints(args), b.dtypes)] = b

    def _first_fast_launch(self, b, args: tuple) -> bool:
        """The first launch through binding `b`, checked: the JIT route runs first and its
        answer is kept aside; every tensor argument it changed is put back; then the fast route
        runs, and every tensor argument must hold the same bits as after the JIT route. False
        (the caller takes the JIT route, unchecked) inside a CUDA-graph capture, where nothing
        can be compared; where the copies do not fit in memory, this launch stops binding.

        A kernel that skips an output whose memory already held the JIT route's answer passes;
        one that writes wrong values, or in the wrong place, does not.

        Where the tensors hold more than CHECK_ON_DEVICE_BYTES the copies are kept in host memory
        (slower, once per binding): on the device they would sit on top of the step at its
        fullest (Llama-3.2-1B's loss chunk: two copies of 525 MB in its first forward)."""
        tensors = list({id(t): t for t in b.layout.tensors(args)}.values())
        if capturing(tensors[0].device):
            return False
        on_host = sum(t.numel() * t.element_size() for t in tensors) > CHECK_ON_DEVICE_BYTES
        copy = (lambda t: t.to("cpu", copy=True)) if on_host else torch.clone
        held = (lambda t: t.cpu()) if on_host else (lambda t: t)
        try:
            before = [copy(t) for t in tensors]
            self.run(*args, **self.meta)
            jit = [copy(t) for t in tensors]
        except torch.cuda.OutOfMemoryError:
            self.bound = None
            return False
        for t, old, new in zip(tensors, before, jit, strict=True):
            if not fast_launch.same_bits(old, new):
                t.copy_(old)
        try:
            b.launch(args)
            agree = all(fast_launch.same_bits(held(t), new) for t, new in zip(tensors, jit, strict=True))
            error = "disagreed with triton's JIT route on its first call"
        except Exception as e:  # a launcher that refuses the arguments: the JIT route is right
            agree, error = False, f"failed on its first call ({type(e).__name__}: {e})"
        if agree:
            b.checked = True
        else:
            for t, new in zip(tensors, jit, strict=True):
                if not fast_launch.same_bits(held(t), new):
                    t.copy_(new)
            _fast_launch_failed(self, error)
        log_launch(self, b.compiled)
        return True


def scratch_key(device: torch.device) -> int | None:
    """Where a plan may keep scratch (dw partials, counters) between calls: the raw handle of
    `device`'s current stream, as triton launches on it. Calls on one stream run in order, so a
    buffer a call wrote and read is free again for the next call on that stream; calls on two
    streams get a buffer each. None (allocate afresh) off CUDA and while torch.compile traces,
    where a kept buffer would become a constant of the graph.

    A buffer first used inside a CUDA-graph capture is baked into that graph; graphs captured on
    one stream share it, so their replays must not overlap (replays on one stream do not)."""
    if _TRACING or device.type != "cuda":
        return None
    return fast_launch.stream_getter()(device.index)


def _real_like(a):
    """A real tensor shaped, strided and typed like `a` (a fake or functional tensor while
    torch.compile traces), filled with ones; anything else as it is."""
    if not isinstance(a, torch.Tensor):
        return a
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).fill_(1)


@contextlib.contextmanager
def _detour(route: Callable, tracing: bool = False) -> Iterator[None]:
    """Every Launch called inside the block goes to `route(launch, args)` and does not run;
    `tracing`: torch.compile is tracing (scratch is then never kept: scratch_key)."""
    global _DETOUR, _TRACING
    saved = _DETOUR, _TRACING
    _DETOUR, _TRACING = route, tracing
    try:
        yield
    finally:
        _DETOUR, _TRACING = saved


def _to_wrap_triton(launch: Launch, args: tuple) -> None:
    torch.library.wrap_triton(launch.kernel)[launch.grid](*args, **launch.meta)


def recording() -> contextlib.AbstractContextManager:
    """Launches inside the block are recorded through torch.library.wrap_triton, as `traced`
    records them (research/launch_analysis_check.py replays a step through it)."""
    return _detour(_to_wrap_triton, tracing=True)


def traced(fn: Callable, *args):
    """`fn(*args)` (a launcher) with its launches recorded through torch.library.wrap_triton:
    the body of a triton_op. Its plans are made first by an eager call on real tensors like
    `args` (tuned there if new, and kept), so the recorded launches are the tuned ones."""
    if all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor)):
        return fn(*args)  # called on real tensors: nothing is traced
    launch_analysis.install()  # PROFUSE_ANALYSIS_MEMO=1: torch's analysis once a launch signature
    with _disable_current_modes():
        fn(*[_real_like(a) for a in args])
    with recording():
        return fn(*args)


def compile_threads() -> int:
    """Threads that build a tuning key's candidates at once: PROFUSE_COMPILE_THREADS, else this
    process's CPUs up to MAX_COMPILE_THREADS; 1 (one at a time) where triton has no usable
    AsyncCompileMode (before 3.6: async_compile_mode) or interprets its kernels (nothing is
    compiled)."""
    asked = whole_number_setting(COMPILE_THREADS_ENV, "threads")
    if _ASYNC_COMPILE is None or interpreting():
        return 1
    if asked is not None:
        return max(asked, 1)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_COMPILE_THREADS))


class _DryRun(Exception):
    """A tuner asked to pick inside another's dry run: that candidate's collection stops there."""


def _placeholder(a):
    """A launch argument as a warmup takes it: a tensor by its dtype (triton specialises a
    16-byte-aligned pointer as the placeholder's), anything else as it is."""
    return a.dtype if isinstance(a, torch.Tensor) else a


def dry_run(calls: Sequence[Callable[[], object]]) -> list[tuple]:
    """(kernel, grid, arguments, meta) of every launch `calls` would make, none of them run;
    a call that raises is left at that point (its compile is left to the real run)."""
    jobs: list[tuple] = []
    route = lambda launch, args: jobs.append((launch.kernel, launch.grid, tuple(map(_placeholder, args)),
                                              launch.meta))  # fmt: skip
    with _detour(route):
        for call in calls:
            try:
                call()
            except Exception:
                continue
    return jobs


def build_at_once(jobs: Sequence[tuple], threads: int) -> None:
    """Compile the kernels of `jobs` (dry_run's) in `threads` threads, through triton's
    AsyncCompileMode, and wait for them: the compiled kernels land in each kernel's own cache,
    where the launches that follow find them. A compile that fails is dropped here; the launch
    that needs it compiles it again and fails there, as it would have."""
    if _ASYNC_COMPILE is None or threads < 2 or len(jobs) < 2:
        return
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="profuse-compile") as pool:
        mode = _ASYNC_COMPILE(pool, ignore_errors=True)
        try:
            with mode:
                for kernel, grid, args, meta in jobs:
                    try:
                        kernel.warmup(*args, grid=grid, **meta)
                    except Exception:
                        continue
        except Exception:  # another AsyncCompileMode active: the launches compile, as before
            pass
        finally:
            _leave(mode)


def _leave(mode) -> None:
    """Make sure `mode` is no longer triton's active AsyncCompileMode (its exit clears it; this
    covers an exit that raised), leaving any other mode as it is."""
    active = getattr(getattr(triton.runtime, "_async_compile", None), "active_mode", None)
    if active is not None and active.get() is mode:
        active.set(None)


def compiled_op(name: str, fn: Callable, fake: Callable) -> Callable[[torch.Tensor], object]:
    """Register launcher `fn` (annotated: its schema is inferred) as the ops torch.compile calls.

    `profuse::NAME` is an opaque custom op whose shapes come from `fake`: it runs anywhere (the
    CPU through Triton's interpreter, torch before 2.6). Where torch has triton_op, also
    `profuse::NAME_triton`, whose kernels Inductor launches itself (CUDA). Returns
    `route(tensor)`: the op to call for that tensor's device, for an autograd.Function's traced
    branch.
    """
    custom = torch.library.custom_op(f"profuse::{name}", fn, mutates_args=())
    custom.register_fake(fake)
    opaque = getattr(torch.ops.profuse, name)
    if not HAS_TRITON_OP:
        return lambda t: opaque

    @functools.wraps(fn)
    def body(*args):
        return traced(fn, *args)

    torch.library.triton_op(f"profuse::{name}_triton", body, mutates_args=())
    inlined = getattr(torch.ops.profuse, f"{name}_triton")
    return lambda t: inlined if t.is_cuda else opaque


class PlanCache(dict):
    """Plans by exact call signature. `builds` counts the plans made (a test counts them); past
    `max_size` signatures (shapes that never repeat) the cache starts again rather than grow."""

    def __init__(self, max_size: int = 4096):
        super().__init__()
        self.max_size = max_size
        self.builds = 0

    def add(self, key, plan):
        if len(self) >= self.max_size:
            self.clear()
        self.builds += 1
        self[key] = plan
        return plan


def _tensors(out) -> list[torch.Tensor]:
    """The tensors a launch returned: none, one, or those in a tuple."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def agreement_tolerance(outputs: Sequence[torch.Tensor]) -> float:
    """How far two launch configs' answers may differ (relative, the norm of the difference over
    the norm): a few roundings in the widest-rounding output dtype, at least 1e-4 (fp32 sums in
    another order). A kernel that skips or mixes up rows is off by far more."""
    return max(max(4 * torch.finfo(t.dtype).eps for t in outputs if t.is_floating_point()), 1e-4)


def disagreement(
    outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], chunk: int = 1 << 24
) -> float:
    """The largest relative difference ||a - b|| / ||b|| between matching tensors, in float32
    chunks of `chunk` elements (no full-size temporaries). Infinite where the shapes differ;
    0 where the reference itself is not finite (nothing to compare against)."""
    worst = 0.0
    for a, b in zip(outputs, reference, strict=True):
        if a.shape != b.shape:
            return math.inf
        a, b = a.reshape(-1), b.reshape(-1)
        diff = ref = torch.zeros((), dtype=torch.float64, device=b.device)
        finite = torch.ones((), dtype=torch.bool, device=b.device)
        for i in range(0, b.numel(), chunk):
            bf = b[i : i + chunk].float()
            finite &= torch.isfinite(bf).all()
            diff = diff + (a[i : i + chunk].float() - bf).square().sum(dtype=torch.float64)
            ref = ref + bf.square().sum(dtype=torch.float64)
        if not bool(finite):
            continue
        err = math.sqrt(diff.item()) / max(math.sqrt(ref.item()), 1e-30)
        if math.isnan(err):  # a NaN in the answer: nothing after it can make it agree
            return err
        worst = max(worst, err)
    return worst


class Autotuner:
    """The fastest candidate per tuning key, timed on the device with an injected timer."""

    def __init__(
        self, make_timer: Callable[[torch.device], object] = CudaTimer, trials: int = AUTOTUNE_TRIALS
    ) -> None:
        self.make_timer = make_timer  # device -> an object with time_calls(list of calls) -> seconds
        self.trials = trials
        self.chosen: dict[tuple, KernelConfig] = {}
        # seconds building new keys' candidates (the builds at once, then each one's first
        # launch and answer) before their timing: compiletime splits the tuner's time by it
        self.build_s = 0.0
        # key -> [(config, relative error)] of the candidates whose answer disagreed
        self.rejected: dict[tuple, list[tuple[KernelConfig, float]]] = {}

    def time_configs(
        self, launch, configs: Sequence[KernelConfig], device: torch.device, trials: int = 0
    ) -> list[float]:
        """Median seconds of `launch(cfg)` per config over `trials` trials (the tuner's own count
        where 0).

        The configs take turns within each trial, so a drift in clocks or temperature touches
        them all alike. The default timer keeps the CPU ahead (profuse.timers.CudaTimer), so the
        time is the device's alone: do_bench would count the host's time to launch wherever that
        is longer than the kernel, and rank configs by their launch overhead.
        """
        timer = self.make_timer(device)
        calls = [lambda c=cfg: launch(c) for cfg in configs]
        runs = [timer.time_calls(calls) for _ in range(trials or self.trials)]
        return [statistics.median(run[i] for run in runs) for i in range(len(configs))]

    def pick(
        self, key: tuple, candidates: Sequence[KernelConfig], launch, device: torch.device
    ) -> KernelConfig:
        """The config for `key`: the one chosen before, else the fastest candidate that launches
        (each is built before the timing) and agrees with the first one's answer, else the
        favourite where nothing can be timed. Where several are within RUNOFF_MARGIN of the
        fastest, a second round of twice the trials, those alone, decides between them.

        Where `launch(cfg)` returns its outputs (a tensor or a tuple with tensors), each
        candidate's are compared with the first runnable candidate's before any timing: one off
        by more than rounding (`agreement_tolerance`) is left out, warned about and kept in
        `rejected`, never picked for its speed. The comparison holds a copy of the first
        answer while the candidates run."""
        if key in self.chosen:
            return self.chosen[key]
        if len(candidates) == 1 or not autotune_enabled(device) or capturing(device):
            return candidates[0]
        if _DETOUR is not None and not _TRACING:
            raise _DryRun(key)
        t0 = _clock()
        self.precompile(candidates, launch)
        runnable, reference = [], None
        for cfg in candidates:
            try:
                out = _tensors(launch(cfg))  # builds the kernel outside the timing
            except Exception:  # e.g. out of resources: that shape is not a candidate here
                continue
            if out and reference is None:
                reference = [t.clone() for t in out]  # the first that runs: the favourite, mostly
            elif out:
                err = disagreement(out, reference)
                if not err <= agreement_tolerance(out):  # NaN disagrees too
                    self.rejected.setdefault(key, []).append((cfg, err))
                    warnings.warn(
                        f"profuse: launch config {cfg} of {key} is off by {err:.2g} (relative) from the "
                        "first config's answer; it is not timed",
                        stacklevel=2,
                    )
                    continue
            runnable.append(cfg)
        if not runnable:
            raise RuntimeError(f"no launch config of the Triton kernel runs for {key}")
        self.build_s += _clock() - t0
        times = self.time_configs(launch, runnable, device)
        fastest = min(times)
        close = [c for c, t in zip(runnable, times, strict=True) if t <= fastest * (1 + RUNOFF_MARGIN)]
        if len(close) > 1:
            again = self.time_configs(launch, close, device, trials=2 * self.trials)
            close = [close[again.index(min(again))]]
        self.chosen[key] = close[0]
        return self.chosen[key]

    def precompile(self, candidates: Sequence[KernelConfig], launch) -> int:
        """Build every candidate's kernels at once (compile_threads threads) before `pick` runs
        them one by one, each then finding its kernels built. Returns the launches collected."""
        threads = compile_threads()
        if threads < 2:
            return 0
        jobs = dry_run([functools.partial(launch, cfg) for cfg in candidates])
        build_at_once(jobs, threads)
        return len(jobs)

    def chosen_dict(self) -> dict[str, dict]:
        """Every config chosen so far in this process, for a results file."""
        return {"/".join(map(str, k)): v.to_dict() for k, v in self.chosen.items()}


# The process's tuner: every op's launchers share it.
TUNER = Autotuner()
