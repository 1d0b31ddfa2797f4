"""The command line's shared pieces: argument types, flag groups, the files each command writes
(checked before any work), and the progress bar."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from profuse import __version__
from profuse.bench import DEFAULT_TRIALS

SUBCOMMANDS = ("profile", "sweep", "step", "report", "diff")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (exit 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# Settings in the environment that take a value, read by the kernels at their first call (deep
# in a run): `check_settings` reads them at the start instead.
VALUE_SETTINGS = ("PROFUSE_COMPILE_THREADS", "PROFUSE_CE_CHUNK", "PROFUSE_CE_ACCUM")


def check_settings() -> None:
    """Raise UsageError (one line) where a PROFUSE_* setting in VALUE_SETTINGS has a value the
    kernels cannot read, before any work starts. Nothing to read without triton."""
    if not any(os.environ.get(name) for name in VALUE_SETTINGS):
        return
    from profuse.errors import UsageError
    from profuse.kernels import HAS_TRITON

    if not HAS_TRITON:
        return
    from profuse.kernels import autotune, cross_entropy

    try:
        autotune.compile_threads()
        cross_entropy.requested_chunk(None)
        cross_entropy.requested_accumulate(None)
    except ValueError as err:
        raise UsageError(str(err)) from None


# --------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def trial_count(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("at least 2 trials are needed for a confidence interval")
    return value


def _items(text: str, what: str) -> list[str]:
    """The comma-separated items of `text`; an empty one ('64,,128', '64,') is an error, not
    silently dropped."""
    parts = text.replace(" ", "").split(",")
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}: give a comma-separated list of {what}")
    return parts


def int_list(text: str) -> list[int]:
    """'1024,8192,32768' -> [1024, 8192, 32768]; each must be positive."""
    return [positive_int(p) for p in _items(text, "sizes")]


def element_list(text: str) -> list[int]:
    """'4M,32M,128M' -> [4194304, 33554432, 134217728] (K, M and G are powers of 1024)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    out = []
    for part in _items(text, "element counts such as 4M,32M,128M"):
        unit = scale.get(part[-1].upper(), 1)
        number = part[:-1] if unit > 1 else part
        out.append(positive_int(number) * unit)
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list such as 4M,32M,128M")
    return out


def variant_keys(text: str) -> list[str]:
    """'triton,compile-max' -> ['triton', 'compile-max'] (checked against the saved run later)."""
    keys = list(dict.fromkeys(k for k in text.replace(" ", "").split(",") if k))
    if not keys:
        raise argparse.ArgumentTypeError("expected comma-separated variant keys, e.g. triton,compile")
    return keys


def variant_text(text: str) -> str:
    """--variants of Part B and sweep: the keys as one string ('eager,triton'); an empty list is an
    error here, not a run of eager alone."""
    return ",".join(variant_keys(text))


DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32")

# profuse.models.spec.PRECISIONS and "both" (named here: the parser loads before torch does).
PRECISION_CHOICES = ("amp", "bf16", "both")


def add_precision_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--precision", default="amp", choices=PRECISION_CHOICES,
        help="how the step computes, as people train: amp = fp32 parameters and AdamW state with bf16 "
        "autocast on CUDA (fp32 on a CPU; the default); bf16 = bf16 parameters and AdamW state, no "
        f"autocast (allowed on a CPU, where it is slow); both = {what} in each, one after the other",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Shared flag groups
# --------------------------------------------------------------------------------------------


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="auto", choices=("auto", "cuda", "cpu"),
        help="where to run: auto picks cuda when a GPU is there, else cpu (default: auto)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=nonnegative_int, default=0, help="seed for inputs and the trial order (default: 0)"
    )


THREADS_HELP = (
    "CPU threads for torch's intra-op work (torch.set_num_threads), recorded in the results' "
    "environment (default: torch's own, one per core, which is fastest on a quiet machine). On a "
    "shared or busy CPU those threads wait on other processes and the trials swing (a tiny step "
    "went from 2.6 ms to 545 ms on a loaded 2-core machine, 2.9-3.5 ms on one thread): the reports "
    "then say the CPU was oversubscribed and suggest a count here"
)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def set_threads(args) -> None:
    """--threads, before any work (torch imported here, after the arguments were checked)."""
    if getattr(args, "threads", None) is not None:
        from profuse.env import set_threads as _set

        _set(args.threads)


def add_bench_args(p: argparse.ArgumentParser, sizes_are_lists: bool = False) -> None:
    size = int_list if sizes_are_lists else positive_int
    what = "comma-separated list of " if sizes_are_lists else ""
    g = p.add_argument_group("Part B: the fused tail benchmark")
    g.add_argument("--rows", type=size, default=[8192] if sizes_are_lists else 8192,
                   help=f"{what}rows of the tail's tensors (default: 8192)")  # fmt: skip
    g.add_argument("--cols", type=size, default=[4096] if sizes_are_lists else 4096,
                   help=f"{what}columns, the hidden size N (default: 4096)")  # fmt: skip
    g.add_argument(
        "--trials", type=trial_count, default=DEFAULT_TRIALS,
        help=f"interleaved timed trials (default: {DEFAULT_TRIALS}; under 30 each CI is a distribution-free "
        "interval from order statistics, its exact coverage printed)",
    )  # fmt: skip
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="input dtype; auto is bf16 on CUDA, fp32 on CPU (default: auto)")  # fmt: skip
    g.add_argument("--backward", action="store_true",
                   help="time forward + backward (gradients of gate, up, residual and weight)")  # fmt: skip
    g.add_argument(
        "--variants", type=variant_text, default=None,
        help="comma-separated variants to run, from: eager, rms_norm, compile, compile-max, triton, "
        "liger (default on CUDA: all but compile-max; on CPU: eager, compile; eager, the "
        "baseline, is always in)",
    )  # fmt: skip
    g.add_argument("--warm-cache", action="store_true",
                   help="do not flush the L2 cache before each timed call (CUDA)")  # fmt: skip
    g.add_argument(
        "--timing", default="device", choices=("device", "loop", "graph"),
        help="how calls are timed on CUDA: device = device time, the CPU kept ahead (default); "
        "loop = calls back to back with nothing queued ahead, as a CPU-bound training loop and "
        "do_bench see them (about the larger of host and device time); graph = CUDA-graph replay, "
        "device time with no launch cost. Host time per call is measured in every mode",
    )  # fmt: skip
    add_threads_arg(g)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Part A: the profiled GPT training step")
    g.add_argument("--layers", type=int, default=None, help="transformer blocks (default: 4)")
    g.add_argument("--d-model", type=int, default=None, help="hidden size (default: 256)")
    g.add_argument(
        "--heads", type=int, default=None, help="attention heads; must divide --d-model (default: 4)"
    )
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default: 8192)")
    g.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: 256 for the GPT; a Hugging Face preset's)",
    )
    g.add_argument("--batch-size", type=int, default=None,
                   help="sequences per step (default: 8 for the GPT; a Hugging Face preset's)")  # fmt: skip
    g.add_argument(
        "--profile-steps", type=positive_int, default=4, help="profiled training steps (default: 4)"
    )
    g.add_argument("--compile-step", action="store_true",
                   help="also profile the step with the model under torch.compile, side by side")  # fmt: skip


def add_out_arg(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument("--out", type=Path, default=Path(default), help=f"folder for {what} (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="profuse",
        description="Profile a GPT training step (Part A), then fuse its memory-bound tail "
        "rms_norm(silu(gate) * up + residual) * weight with torch.compile and Triton and time it "
        "against eager with bootstrap confidence intervals (Part B). "
        f"Other commands: {', '.join(SUBCOMMANDS)} (profuse COMMAND --help).",
    )
    p.add_argument("--version", action="version", version=f"profuse {__version__}")
    p.add_argument("--skip-profile", action="store_true", help="skip Part A, run Part B only")
    p.add_argument("--profile-only", action="store_true", help="run Part A only")
    add_device_args(p)
    add_bench_args(p)
    _add_model_args(p)
    add_out_arg(
        p,
        ".",
        "Part A's trace.json and profile.json, and Part B's results.json; files of "
        "an earlier run there are replaced, and the output says so",
    )
    return p


def build_profile_parser() -> argparse.ArgumentParser:
    from profuse.loader import STEP_HELP

    p = Parser(
        prog="profuse profile",
        description="Part A: profile a few training steps - the built-in GPT (default), a Hugging Face "
        "model (--model hf:llama) or your own step (--step FILE.py:FUNC) - and name its fusion "
        "candidates by the module that issued the work.",
    )
    add_device_args(p)
    add_threads_arg(p)  # what the busy-CPU warning advises
    _add_model_args(p)
    g = p.add_argument_group("what to profile")
    g.add_argument(
        "--model", default=None,
        help="gpt (the built-in, default) or hf:ARCH, ARCH one of llama, mistral, qwen2, qwen3, olmoe, "
        "qwen3_moe (a Hugging Face model with random weights: pip install 'profuse[hf]')",
    )  # fmt: skip
    g.add_argument(
        "--preset", default=None,
        help="the model's size: for hf:ARCH tiny (default), Llama-3.2-1B, Qwen2.5-0.5B, Qwen3-0.6B; for "
        "gpt lab (default), small, medium",
    )  # fmt: skip
    g.add_argument(
        "--hf-config", type=Path, default=None,
        help="a Hugging Face config.json (or its folder) to build hf:ARCH from, not --preset",
    )  # fmt: skip
    g.add_argument("--step", default=None, help=f"{STEP_HELP}; --device auto asks the step where it runs")
    g.add_argument("--warmup", type=nonnegative_int, default=2,
                   help="unprofiled steps first, so first-call costs stay out (default: 2)")  # fmt: skip
    add_precision_arg(g, "the profile (and --compile-step's) once in each, each printed")
    add_out_arg(
        p,
        ".",
        "trace.json and profile.json (with --nproc: trace_rank{R}.json, profile_ddp.json, "
        "and logs/ when a rank fails); files of an earlier run there are replaced",
    )
    p.add_argument(
        "--nproc", type=positive_int, default=None,
        help="profile data-parallel training of the built-in GPT on N processes (DDP; NCCL on GPUs, "
        "gloo on CPU)",
    )  # fmt: skip
    return p


# --------------------------------------------------------------------------------------------
# What each command writes, checked before any work (files.check_folder)
# --------------------------------------------------------------------------------------------

# The modules that write these files import torch or matplotlib; the names are here so --out can
# be checked before those load (tests/test_cli.py checks that they agree).
TRACE_JSON = "trace.json"  # profiling.ProfileConfig.trace_name
PROFILE_JSON = "profile.json"
RESULTS_JSON = "results.json"
PARTIAL_JSON = "results.partial.json"
RESULTS_CSV = "results.csv"
PLOTS = ("speedup.png", "bandwidth.png")  # report.plots.SPEEDUP_PNG, BANDWIDTH_PNG
DDP_FILES = ("trace_rank0.json", "profile_ddp.json")  # distributed.SUMMARY_NAME (and a folder, logs/)


def tagged(name: str, tag: str) -> str:
    """'trace.json' -> 'trace-bf16.json': one run's file where a folder holds a run per precision."""
    if not tag:
        return name
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}-{tag}.{suffix}" if dot else f"{name}-{tag}"


def part_a_files(compile_step: bool, precision: str = "amp") -> tuple[str, ...]:
    tags = ("amp", "bf16") if precision == "both" else ("",)
    traces = [tagged(TRACE_JSON, tag) for tag in tags]
    if compile_step:
        traces += [tagged("trace-compiled.json", tag) for tag in tags]
    return (*traces, PROFILE_JSON)


def replaced_note(path: Path) -> str:
    """' (replaced the results.json of an earlier run, written 2026-12-02 18:41)' where `path`
    exists, to print once the new file is written; '' where it does not."""
    try:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    except OSError:
        return ""
    return f" (replaced the {path.name} of an earlier run, written {when})"


def check_out(args, names: tuple[str, ...]) -> None:
    from profuse.files import check_folder

    check_folder(args.out, names)


# --------------------------------------------------------------------------------------------
# Progress: a bar on an interactive terminal, nothing in logs and pipes
# --------------------------------------------------------------------------------------------


BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}"

# Lines that native code writes straight to the process's stderr, each of which would break a bar
# on screen: torch's profiler (Kineto) at every start and stop, and a CUDA build of torch on a
# machine without a GPU. While a bar is shown they are held back and dropped; any other line
# comes out when the bar closes. (env.NATIVE_NOISE: the same pattern; cli keeps torch unimported.)
NATIVE_NOISE = re.compile(r"^(USDT|STAGE):|gpuGetDeviceCount failed|No CUDA runtime is found")
CUDA_BUILD_NOISE = re.compile(r"gpuGetDeviceCount failed|No CUDA runtime is found")
CPU_BUILD_HINT = (
    "profuse: note: this torch is a CUDA build on a machine without a usable GPU; the CPU build is "
    "smaller and quiet: pip install torch --index-url https://download.pytorch.org/whl/cpu"
)


class Progress:
    """Feeds `progress(stage, done, total)` callbacks into tqdm bars on stderr (TTY only)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        self._stage = None
        self._held = None  # (the terminal's fd, a stream on it, the file holding fd 2) while a bar is shown
        self._hinted = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self._stage:
            self.close()
            self._stage = stage
            # No rate: the counts are steps of work (per size, per trial), not items, and a jump
            # of many at once read as '19972876.19it/s'.
            stream = self._hold_stderr()
            self._bar = tqdm(total=total, desc=stage, leave=False, file=stream, dynamic_ncols=True,
                             bar_format=BAR_FORMAT)  # fmt: skip
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._stage = None
        self._release_stderr()

    def _hold_stderr(self):
        """The stream for the bar: the terminal, with fd 2 itself pointed at a temporary file, so
        that native code writing there cannot break the bar. Where sys.stderr is not fd 2 (tests,
        an embedding program), sys.stderr as it is."""
        try:
            if sys.stderr.fileno() != 2:
                return sys.stderr
        except (AttributeError, OSError, ValueError):
            return sys.stderr
        sys.stderr.flush()
        terminal = os.dup(2)
        held = tempfile.TemporaryFile()
        os.dup2(held.fileno(), 2)
        stream = open(terminal, "w", encoding="utf-8", errors="replace", closefd=False)
        self._held = (terminal, stream, held)
        return stream

    def _release_stderr(self) -> None:
        """fd 2 back to the terminal, and what was written there meanwhile, less the noise."""
        if self._held is None:
            return
        terminal, stream, held = self._held
        self._held = None
        sys.stderr.flush()
        stream.close()  # closefd=False: flushes, and leaves the descriptor to the lines below
        os.dup2(terminal, 2)
        os.close(terminal)
        held.seek(0)
        lines = held.read().decode("utf-8", errors="replace").splitlines(keepends=True)
        held.close()
        kept = [line for line in lines if not NATIVE_NOISE.search(line)]
        if any(CUDA_BUILD_NOISE.search(line) for line in lines) and not self._hinted:
            kept.append(CPU_BUILD_HINT + "\n")
            self._hinted = True
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def _clock_text(seconds: float) -> str:
    """'0:07', '3:15', '1:02:03'."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class TrackedStages:
    """The progress of the main job's Parts A and B and of a sweep: a terminal's bars (Progress),
    or elsewhere (a log, a pipe) their stages kept silently by `lines` (ProgressLines.track),
    whose heartbeat names a stage only where it runs past it: a quick part prints nothing, a slow
    one never goes quiet for more than about 10 s."""

    def __init__(self, lines: ProgressLines, bars: Progress | None = None):
        self.lines = lines
        self.bars = bars if bars is not None else Progress()
        self.shown = getattr(self.bars, "enabled", True)  # a stand-in without the flag takes every call
        if self.shown:
            lines.pause()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.shown:
            self.bars(stage, done, total)
        else:
            self.lines.track(stage, done, total)

    def close(self) -> None:
        self.bars.close()


class ProgressLines:
    """Progress of a run that takes minutes, as lines on stderr (a terminal, a log or a pipe
    alike): a line as each stage starts, a counted stage's progress (trials 12/30) at most every
    `every_s` with the time left at its pace so far, and a heartbeat where nothing was said for
    `heartbeat_s` (a compile, a long first step), so a run never goes quiet for more than about
    10 s. Off stdout, never in a saved file.

    Feeds on `progress(stage, done, total)` callbacks, like Progress. A background thread calls
    `beat()` once a second; `thread=False` and a fake `clock` let a test call it by hand.
    """

    def __init__(
        self,
        stream=None,
        *,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = 5.0,
        heartbeat_s: float = 8.0,
        thread: bool = True,
        prefix: str = "",
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.every_s = every_s
        self.heartbeat_s = heartbeat_s
        self.prefix = prefix  # before every stage: e.g. "bf16: " while the bf16 run goes
        self.start = clock()
        self.stage: str | None = None
        self.stage_start = self.start
        self.done = self.total = 0
        self._paced: tuple[float, int] | None = None  # (time, done) at the stage's first count
        self.last_line = self.start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="profuse-progress", daemon=True)
            self._thread.start()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            now = self.clock()
            stage = self.prefix + stage
            if stage != self.stage:
                self.stage, self.stage_start, self._paced = stage, now, None
                self.done, self.total = done, total
                self._say(now, self._text(now))
                return
            if self._paced is None and done > self.done:
                self._paced = (now, done)  # the pace is measured from here: the first count seen
            self.done, self.total = done, total
            if done >= total or now - self.last_line >= self.every_s:
                self._say(now, self._text(now))

    def track(self, stage: str, done: int, total: int) -> None:
        """As a call, but silent: the stage and its count are kept for the heartbeat alone, so a
        stage says something only where it outlasts `heartbeat_s` (TrackedStages, in a log)."""
        with self._lock:
            now = self.clock()
            stage = self.prefix + stage
            if stage != self.stage:
                self.stage, self.stage_start, self._paced = stage, now, None
            elif self._paced is None and done > self.done:
                self._paced = (now, done)
            self.done, self.total = done, total

    def pause(self) -> None:
        """No stage, so no heartbeat, until the next call (a terminal's bar speaks meanwhile)."""
        with self._lock:
            self.stage = None

    def quietly(self, stage: str) -> None:
        """Enter `stage` without a line: it is named only if it lasts past the heartbeat (a start
        that fails at once on bad input leaves its one error line alone)."""
        with self._lock:
            self.stage, self.stage_start, self._paced = self.prefix + stage, self.clock(), None
            self.done = self.total = 0

    def _text(self, now: float) -> str:
        text = self.stage or ""
        if self.total > 1 and self.done > 0:
            text += f": {self.done}/{self.total}"
            left = self.time_left(now)
            if left is not None:
                text += f", about {_clock_text(left)} left"
        return text

    def time_left(self, now: float) -> float | None:
        """The counted stage's remaining time at its pace since its first count (None: no pace yet)."""
        if self._paced is None or self.done >= self.total:
            return None
        t0, d0 = self._paced
        if self.done <= d0:
            return None
        return (now - t0) / (self.done - d0) * (self.total - self.done)

    def beat(self) -> None:
        """A heartbeat line where nothing was said for `heartbeat_s`: the stage and how long it
        has run ('first step: compile+fused (compiling), 35 s so far')."""
        with self._lock:
            now = self.clock()
            if self.stage is None or now - self.last_line < self.heartbeat_s:
                return
            self._say(now, f"{self._text(now)}, {now - self.stage_start:.0f} s so far")

    def _say(self, now: float, text: str) -> None:
        self.stream.write(f"[{_clock_text(now - self.start):>5}] {text}\n")
        self.stream.flush()
        self.last_line = now

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.beat()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
