"""The command line: argparse -> configs -> run -> report.

profuse [flags]              the lab's main job: Part A (profile a training step), then Part B
profuse profile [flags]      Part A alone (also: profuse --profile-only)
profuse sweep [flags]        Part B over several sizes, with CSV and plots
profuse step [flags]         Part C: whole training steps, eager vs fused vs torch.compile
profuse report RESULTS.json  print a saved run again (--markdown for a table to paste)
profuse diff A.json B.json   compare two saved runs variant by variant
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from profuse import __version__
from profuse.errors import UsageError

SUBCOMMANDS = ("profile", "sweep", "step", "report", "diff")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (exit 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


# --------------------------------------------------------------------------------------------
# Shared flag groups
# --------------------------------------------------------------------------------------------


def _add_device_args(p: argparse.ArgumentParser) -> None:
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


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def set_threads(args) -> None:
    """--threads, before any work (torch imported here, after the arguments were checked)."""
    if getattr(args, "threads", None) is not None:
        from profuse.env import set_threads as _set

        _set(args.threads)


def _add_bench_args(p: argparse.ArgumentParser, sizes_are_lists: bool = False) -> None:
    size = int_list if sizes_are_lists else positive_int
    what = "comma-separated list of " if sizes_are_lists else ""
    g = p.add_argument_group("Part B: the fused tail benchmark")
    g.add_argument("--rows", type=size, default=[8192] if sizes_are_lists else 8192,
                   help=f"{what}rows of the tail's tensors (default: 8192)")  # fmt: skip
    g.add_argument("--cols", type=size, default=[4096] if sizes_are_lists else 4096,
                   help=f"{what}columns, the hidden size N (default: 4096)")  # fmt: skip
    g.add_argument("--trials", type=trial_count, default=30, help="interleaved timed trials (default: 30)")
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
    _add_threads_arg(g)


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


def _add_out_arg(p: argparse.ArgumentParser, default: str, what: str) -> None:
    p.add_argument("--out", type=Path, default=Path(default), help=f"folder for {what} (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="profuse",
        description="Profile a GPT training step (Part A), then fuse its memory-bound tail "
        "rms_norm(silu(gate) * up + residual) * weight with torch.compile and Triton and time it "
        "against eager with bootstrap confidence intervals (Part B). "
        f"Other commands: {', '.join(SUBCOMMANDS)} (profuse COMMAND --help).",
    )
    p.add_argument("--version", action="version", version=f"profuse {__version__}")
    p.add_argument("--skip-profile", action="store_true", help="skip Part A, run Part B only")
    p.add_argument("--profile-only", action="store_true", help="run Part A only")
    _add_device_args(p)
    _add_bench_args(p)
    _add_model_args(p)
    _add_out_arg(
        p,
        ".",
        "Part A's trace.json and profile.json, and Part B's results.json; files of "
        "an earlier run there are replaced, and the output says so",
    )
    return p


def build_profile_parser() -> argparse.ArgumentParser:
    from profuse.loader import STEP_HELP

    p = _Parser(
        prog="profuse profile",
        description="Part A: profile a few training steps - the built-in GPT (default), a Hugging Face "
        "model (--model hf:llama) or your own step (--step FILE.py:FUNC) - and name its fusion "
        "candidates by the module that issued the work.",
    )
    _add_device_args(p)
    _add_model_args(p)
    g = p.add_argument_group("what to profile")
    g.add_argument(
        "--model", default=None,
        help="gpt (the built-in, default) or hf:ARCH, ARCH one of llama, mistral, qwen2, qwen3 (a Hugging "
        "Face model with random weights: pip install 'profuse[hf]')",
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
    _add_out_arg(
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


def part_a_files(compile_step: bool) -> tuple[str, ...]:
    return (TRACE_JSON, "trace-compiled.json", PROFILE_JSON) if compile_step else (TRACE_JSON, PROFILE_JSON)


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


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _bench_config(args, device, rows: int, cols: int):
    from profuse.bench.tail_bench import TailBenchConfig, default_variants
    from profuse.env import resolve_dtype

    names = (
        default_variants(device)
        if args.variants is None
        else tuple(v.strip() for v in args.variants.split(",") if v.strip())
    )
    return TailBenchConfig(
        rows=rows,
        cols=cols,
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        trials=args.trials,
        seed=args.seed,
        backward=args.backward,
        variants=names,
        flush_l2=not args.warm_cache,
        timing=args.timing,
    )


_GPT_SIZE_FLAGS = (("--layers", "layers"), ("--d-model", "d_model"), ("--heads", "heads"),
                   ("--vocab-size", "vocab_size"))  # fmt: skip


def _profile_spec(args):
    """The model `profuse profile` builds (profuse.models' spec), or None for the user's --step;
    every flag that does not apply is a one-line error here, before any work."""
    from profuse.models import model_spec

    model, preset, hf_config = (getattr(args, k, None) for k in ("model", "preset", "hf_config"))
    if getattr(args, "step", None) is not None:
        sizes = [*_GPT_SIZE_FLAGS, ("--seq-len", "seq_len"), ("--batch-size", "batch_size")]
        flags = [("--model", model), ("--preset", preset), ("--hf-config", hf_config),
                 ("--compile-step", args.compile_step or None),
                 *((f, getattr(args, k)) for f, k in sizes)]  # fmt: skip
        given = [flag for flag, value in flags if value is not None]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise UsageError(f"--step profiles your own step as it is: {', '.join(given)} {verb} not apply")
        return None
    gpt = {
        "n_layer": args.layers,
        "d_model": args.d_model,
        "n_head": args.heads,
        "vocab_size": args.vocab_size,
    }
    return model_spec(model or "gpt", preset, config_path=hf_config, batch_size=args.batch_size,
                      seq_len=args.seq_len, **gpt)  # fmt: skip


def _profile_config(args, device):
    """The built-in GPT's Part A config, for the data-parallel ranks (profuse.distributed)."""
    from profuse.profiling import ProfileConfig

    spec = _profile_spec(args)
    if spec is None or spec.family != "gpt":
        raise UsageError("--nproc profiles the built-in GPT only: leave out --step and --model hf:ARCH")
    return ProfileConfig(
        model=spec.config, device=device, steps=args.profile_steps, warmup=getattr(args, "warmup", 2),
        out_dir=args.out, seed=args.seed,
    )  # fmt: skip


def run_part_a(args, device) -> None:
    """Part A: the built-in GPT, a Hugging Face model or the user's --step, through
    profuse.profiling.profile; eager, and compiled beside it with --compile-step."""
    from profuse.env import check_fits
    from profuse.files import write_json
    from profuse.profiling import SUMMARY_KIND, compiled_trace_name, profile, spec_precision, spec_step
    from profuse.report.profile import format_profile, format_profile_comparison

    spec = _profile_spec(args)
    warmup = getattr(args, "warmup", 2)
    if spec is not None:
        check_fits(spec.train_bytes(), device, f"Part A's step of {spec.describe()}")
        about = {"model": spec.to_dict(), "describe": spec.describe()}
        step = spec_step(spec, device, seed=args.seed)
        where, precision = device, spec_precision(device)
    else:
        from profuse.loader import load_step

        step = load_step(args.step)
        about = {"step": args.step, "describe": f"your step, {args.step}"}
        where = None if getattr(args, "device", "auto") == "auto" else device  # None: ask the step
        precision = None  # as the user's step runs it
    progress = Progress()
    say = lambda text: progress(text, 0, 1)
    common = dict(steps=args.profile_steps, out=args.out, progress=say, summary_name=None, about=about,
                  precision=precision)  # fmt: skip
    eager = profile(step, warmup=warmup, device=where, **common)
    progress.close()
    print(format_profile(eager))
    summary = {"kind": SUMMARY_KIND, "eager": eager.to_dict()}
    if args.compile_step:
        del step  # the eager model's memory back before the compiled one is built
        compiled_step = spec_step(spec, device, seed=args.seed, compile=True)
        compiled = profile(compiled_step, warmup=max(warmup, 1), device=device, compiled=True,
                           trace_name=compiled_trace_name(TRACE_JSON), **common)  # fmt: skip
        progress.close()
        print()
        print(format_profile_comparison(eager, compiled))
        summary["compiled"] = compiled.to_dict()
    path = Path(args.out) / PROFILE_JSON
    earlier = replaced_note(path)
    write_json(path, summary)
    print(f"summary: {path}{earlier}; profuse report {path} prints it again")
    print()


def triton_note(args, device) -> str:
    """Why the CPU's default Part B has no Triton variant, and how to check it here ('' where the
    user chose the variants, or where it runs by default)."""
    from profuse.bench.tail_bench import default_variants
    from profuse.kernels import HAS_TRITON, TRITON_MISSING

    if args.variants is not None or "triton" in default_variants(device):
        return ""
    if not HAS_TRITON:
        return f"triton variant skipped: {TRITON_MISSING}"
    return (
        "triton variant skipped: its kernels need a CUDA GPU to be timed; TRITON_INTERPRET=1 with "
        "--variants eager,compile,triton runs them on this CPU through Triton's interpreter to check "
        "their math (slow: its times are the interpreter's, never a kernel's)"
    )


def run_part_b(args, cfg) -> None:
    from profuse.bench.tail_bench import run_tail_bench
    from profuse.files import write_json
    from profuse.report.bench import format_tail_bench

    progress = Progress()
    try:
        res = run_tail_bench(cfg, progress=progress)
    finally:
        progress.close()
    print(format_tail_bench(res))
    note = triton_note(args, cfg.device)
    if note:
        print(note)
    path = Path(args.out) / RESULTS_JSON
    earlier = replaced_note(path)
    write_json(path, res.to_dict())
    print(f"results: {path}{earlier}")


def cmd_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.skip_profile and args.profile_only:
        raise UsageError("--skip-profile and --profile-only leave nothing to run: pick one")
    names = () if args.skip_profile else part_a_files(args.compile_step)
    check_out(args, names + (() if args.profile_only else (RESULTS_JSON,)))
    set_threads(args)
    from profuse.env import resolve_device

    device = resolve_device(args.device)
    # Part B's settings are checked before Part A runs: a bad one fails at once, not minutes in.
    bench = None if args.profile_only else _bench_config(args, device, args.rows, args.cols)
    # Part C ends the whole job (neither flag): the small preset on CUDA, its size checked up front.
    whole_job = not (args.skip_profile or args.profile_only)
    step = None
    if whole_job and device.type == "cuda":
        step = _step_config(argparse.Namespace(seed=args.seed, out=args.out), device, "small")
        check_step(step)
    if not args.skip_profile:
        run_part_a(args, device)
    if bench is not None:
        try:
            run_part_b(args, bench)
        except KeyboardInterrupt:
            if args.skip_profile:
                raise
            summary = Path(args.out) / PROFILE_JSON
            raise KeyboardInterrupt(
                f"Part A had finished: its files are kept ({summary} and the trace beside it; "
                f"profuse report {summary} prints it again)"
            ) from None
    if step is not None:
        print()
        run_part_c(step)
    elif whole_job:
        print()
        print(CPU_STEP_HINT)
    return 0


def cmd_profile(argv: list[str]) -> int:
    args = build_profile_parser().parse_args(argv)
    from profuse.distributed import started_by_launcher
    from profuse.env import resolve_device

    if started_by_launcher():
        # A rank: the others check the same folder at the same moment, so it is made for good
        # first (a folder the check made and removed could vanish under another rank's probe).
        with contextlib.suppress(OSError):
            Path(args.out).mkdir(parents=True, exist_ok=True)
    check_out(args, DDP_FILES if args.nproc is not None else part_a_files(args.compile_step))
    # --nproc N launches N ranks; a process that torchrun started is one of them already
    # (torchrun would read a --nproc after the module name as its own flag, so none is given).
    if args.nproc is not None or started_by_launcher():
        _profile_config(args, "cpu")  # the flags checked before any rank starts
        return run_part_a_ddp(args)
    run_part_a(args, resolve_device(args.device))
    return 0


def run_part_a_ddp(args) -> int:
    """`profuse profile --nproc N`: run as a rank when torch's launcher started us, else launch N."""
    from profuse import distributed as D
    from profuse.env import resolve_device
    from profuse.report.distributed import format_ddp_profile, format_rank_failure

    if D.started_by_launcher():
        make_config = lambda device: _profile_config(args, device)
        job = D.run_worker(make_config, args.device, args.nproc, args.compile_step)
        if job is not None:  # rank 0 under torchrun; under profuse's launcher the launcher shows it
            print(format_ddp_profile(job, summary_path=str(Path(args.out) / D.SUMMARY_NAME)))
        D.end_rank()
    if args.compile_step:
        raise UsageError("--compile-step is not supported with --nproc: profile it on one process")
    device = resolve_device(args.device)
    out = Path(args.out).resolve()
    try:
        job = D.launch(worker_argv(args, device, out), args.nproc, device, out)
    except D.LaunchFailed as err:
        f = err.failure
        why = (
            str(err)
            if f is None
            else format_rank_failure(f.rank, f.world_size, f.exitcode, f.error, f.log, f.log_empty)
        )
        print(f"profuse: error: {why}", file=sys.stderr)
        return 1
    print(format_ddp_profile(job, summary_path=str(out / D.SUMMARY_NAME)))
    return 0


def worker_argv(args, device, out: Path) -> list[str]:
    """The flags each rank gets: the user's, with the device resolved and --out made absolute."""
    argv: list[str] = []
    for action in build_profile_parser()._actions:
        if not action.option_strings or action.dest in ("help", "device", "out", "nproc"):
            continue
        value = getattr(args, action.dest, action.default)
        if value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        argv += [flag] if action.nargs == 0 else [flag, str(value)]
    return [*argv, "--device", device.type, "--out", str(out), "--nproc", str(args.nproc)]


SWEEP_ROWS = [1024, 8192, 32768]  # the lab's first exercise: --rows 1024,8192,32768 --cols 4096


def build_sweep_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="profuse sweep",
        description="Part B at several sizes (every --rows with every --cols): correctness first, "
        "then interleaved trials, at each size. Writes results.json, results.csv, speedup.png and "
        "bandwidth.png under --out. Sizes that do not fit in memory are skipped with a note.",
    )
    _add_device_args(p)
    _add_bench_args(p, sizes_are_lists=True)
    # The shared flags default to the one-size run; a sweep defaults to the lab's three sizes.
    rows = p._option_string_actions["--rows"]
    rows.default = SWEEP_ROWS
    rows.help = f"comma-separated rows of the tail's tensors (default: {','.join(map(str, SWEEP_ROWS))})"
    p.add_argument(
        "--elements", type=element_list, default=(),
        help="comma-separated elements per tensor, e.g. 4M,32M,128M: each --cols value then gets "
        "rows = elements / cols (instead of --rows), for a grid over hidden sizes",
    )  # fmt: skip
    _add_out_arg(
        p,
        "profuse-sweep",
        "results.json, results.csv, speedup.png and bandwidth.png, and "
        "results.partial.json while it runs; files of an earlier sweep there are replaced",
    )
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="profuse report", description="Print a saved run of profuse or profuse sweep again.")
    p.add_argument(
        "results", type=Path,
        help="a file profuse wrote: results.json (profuse, profuse sweep), results.partial.json, "
        "profile.json or profile_ddp.json (Part A), step.json (profuse step)",
    )  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="a markdown table, for an issue or a README")
    p.add_argument("--vs", default=None, metavar="VARIANT",
                   help="speedups over this variant (e.g. compile, compile-max) instead of eager, "
                   "from the saved per-trial times")  # fmt: skip
    p.add_argument("--variants", type=variant_keys, default=None, metavar="LIST",
                   help="comma-separated variant keys as saved (e.g. triton,compile-max): only their "
                   "rows in the table and lines in --plots; speedups stay over the baseline")  # fmt: skip
    p.add_argument("--plots", type=Path, default=None, metavar="DIR",
                   help="also write speedup.png and bandwidth.png for this data (after --vs and --variants) "
                   "into DIR (needs matplotlib)")  # fmt: skip
    return p


def build_diff_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="profuse diff",
        description="Compare two saved runs (two cards, or before and after a change) size by size and "
        "variant by variant: the ratio of medians B/A with a bootstrap CI, and where it is measurable. "
        "Two results.json (Part B or a sweep), or two step.json (Part C, step by step).",
    )
    p.add_argument("a", type=Path, help="results.json or step.json of run A (the reference)")
    p.add_argument("b", type=Path, help="the same kind of file of run B (compared with A)")
    return p


def cmd_sweep(argv: list[str]) -> int:
    args = build_sweep_parser().parse_args(argv)
    check_out(args, (RESULTS_JSON, RESULTS_CSV, PARTIAL_JSON, *PLOTS))
    set_threads(args)
    from profuse.env import resolve_device
    from profuse.files import write_json
    from profuse.report import plots
    from profuse.report.sweep import format_sweep, write_csv
    from profuse.sweep import SweepConfig, run_sweep

    device = resolve_device(args.device)
    # The one-size config maps the shared flags (dtype, variants, --warm-cache) as Part B does.
    first = _bench_config(args, device, args.rows[0], args.cols[0])
    cfg = SweepConfig.from_bench(first, args.rows, args.cols, args.elements)
    for line in cfg.rounding():
        print(f"note: {line}")
    out = Path(args.out)
    partial = out / PARTIAL_JSON

    done: list = []  # the sweep so far, as last saved

    def save_partial(res) -> None:
        # The sizes done so far, rewritten whole after each size: a sweep stopped part-way (a
        # time limit, Ctrl-C) keeps them in a file `profuse report` reads, and leaves any
        # earlier complete results.json alone. A finished sweep removes it.
        if res.runs:
            write_json(partial, {**res.to_dict(), "partial": True})
            done[:] = [res]

    progress = Progress()
    try:
        res = run_sweep(cfg, progress=progress, on_size=save_partial)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_stopped_sweep(args, cfg, done[0] if done else None, partial)) from None
    except Exception:
        if done:  # a crash in a later size: say what is kept before the traceback
            progress.close()
            print(f"profuse: {_stopped_sweep(args, cfg, done[0], partial)}", file=sys.stderr)
        raise
    finally:
        progress.close()
    data = res.to_dict()
    print(format_sweep(data))
    if not res.runs:
        raise UsageError("no size fitted in memory, so nothing was written: choose smaller sizes")
    earlier = {out / name: replaced_note(out / name) for name in (RESULTS_JSON, RESULTS_CSV, *PLOTS)}
    # JSON first: it holds every timing, and the CSV and plots can be made again from it.
    written = [write_json(out / RESULTS_JSON, data), write_csv(out / RESULTS_CSV, data)]
    if plots.HAS_MATPLOTLIB:
        written += plots.write_plots(data, out)
    partial.unlink(missing_ok=True)
    print()
    for path in written:
        print(f"wrote {path}{earlier.get(path, '')}")
    if not plots.HAS_MATPLOTLIB:
        print(f"no plots: {plots.MATPLOTLIB_MISSING}")
    return 0


def _stopped_sweep(args, cfg, res, partial: Path) -> str:
    """What a sweep stopped part-way kept: the file, the command that reads it, and the
    commands that time the sizes it did not reach."""
    if res is None:
        return "no size had finished, so nothing was saved"
    finished = {(r.config.rows, r.config.cols) for r in res.runs} | {(s.rows, s.cols) for s in res.skipped}
    n_done, n_all = len(finished), len(cfg.sizes())
    lines = [
        f"the sizes that had finished ({n_done} of {n_all}) are saved in {partial}",
        f"read them: profuse report {partial}",
    ]
    rest = sizes_left_commands(args, cfg, finished)
    if rest:
        n_left = n_all - n_done
        lines.append(f"time the {n_left} size{'s' if n_left != 1 else ''} left: {'; '.join(rest)}")
    return "\n  ".join(lines)


def sizes_left_commands(args, cfg, finished: set[tuple[int, int]]) -> list[str]:
    """`profuse sweep` commands, with the user's settings, over the sizes of `cfg` not in `finished`.

    The sizes left are grouped into lists that --rows (or --elements) and --cols can give: one
    command where they form one such grid, else one per group. Each writes into a folder of its
    own under --out, so the partial file stays as it is.
    """
    left = [size for size in cfg.sizes() if size not in finished]
    axis, values = ("--elements", cfg.elements) if cfg.elements else ("--rows", cfg.rows)
    per_cols: dict[int, tuple[int, ...]] = {}
    for c in cfg.cols:
        sizes = [v for v in values if ((v // c if cfg.elements else v), c) in left]
        if sizes:
            per_cols[c] = tuple(sizes)
    groups: dict[tuple[int, ...], list[int]] = {}
    for c, sizes in per_cols.items():
        groups.setdefault(sizes, []).append(c)
    settings = ["--trials", str(args.trials), "--device", args.device]
    settings += [] if args.dtype == "auto" else ["--dtype", args.dtype]
    settings += [] if args.variants is None else ["--variants", args.variants.replace(" ", "")]
    settings += ["--backward"] if args.backward else []
    settings += ["--warm-cache"] if args.warm_cache else []
    settings += ["--seed", str(args.seed)] if args.seed else []
    settings += ["--threads", str(args.threads)] if getattr(args, "threads", None) else []
    out = Path(args.out)
    commands = []
    for i, (sizes, cols) in enumerate(groups.items()):
        folder = out / ("rest" if i == 0 else f"rest-{i + 1}")
        size_flags = [axis, ",".join(map(str, sizes)), "--cols", ",".join(map(str, cols))]
        commands.append(shlex.join(["profuse", "sweep", *size_flags, *settings, "--out", str(folder)]))
    return commands


def cmd_report(argv: list[str]) -> int:
    args = build_report_parser().parse_args(argv)
    from profuse.report.step import format_step, load_step

    step = load_step(args.results)  # Part C's step.json prints as the run printed it
    if step is not None:
        if args.markdown or args.vs or args.variants or args.plots is not None:
            raise UsageError(f"{args.results} is a Part C step file: it prints as it is, without options")
        print(format_step(step))
        return 0
    from profuse.bench.stats import rebase
    from profuse.report.sweep import format_run, parse, read_json, select_variants

    if args.plots is not None:
        from profuse.files import check_folder
        from profuse.report import plots

        if not plots.HAS_MATPLOTLIB:
            raise UsageError(plots.MATPLOTLIB_MISSING)  # before the table, not after it
        check_folder(args.plots, PLOTS, flag="--plots")
    data = read_json(args.results)
    if _print_part_a(data, args):
        return 0
    parse(data, str(args.results))  # one line for a file that is not a results file, before any work
    if args.vs:
        data = rebase(data, args.vs, only=args.variants)
    run = parse(data, str(args.results))
    if args.variants:
        run = select_variants(run, args.variants)
    print(format_run(run, markdown=args.markdown))
    if data.get("partial"):
        done = len(data.get("runs", [])) + len(data.get("skipped", []))
        print(f"(a partial sweep: it stopped after {done} sizes)")
    if args.plots is not None:
        written = plots.write_plots(run, args.plots)
        print()
        for path in written:
            print(f"wrote {path}")
        if not written:
            print("no plots: nothing was timed")
    return 0


def _print_part_a(data, args) -> bool:
    """Print a saved Part A summary (profile.json, profile_ddp.json); False for anything else."""
    from profuse.report.profile import DDP_SUMMARY, format_saved_profile, part_a_file

    name = part_a_file(data)
    if name is None:
        return False
    flags = {"--vs": args.vs, "--variants": args.variants, "--plots": args.plots, "--markdown": args.markdown}
    given = ", ".join(flag for flag, value in flags.items() if value)
    if given:
        verb = "applies" if "," not in given else "apply"
        raise UsageError(f"{args.results} is Part A's summary ({name}): {given} {verb} to Part B's results")
    if name == DDP_SUMMARY:
        from profuse.report.distributed import format_saved_ddp_profile

        print(format_saved_ddp_profile(data, str(args.results)))
    else:
        print(format_saved_profile(data, str(args.results)))
    return True


def cmd_diff(argv: list[str]) -> int:
    args = build_diff_parser().parse_args(argv)
    from profuse.report.step import format_step_diff, load_step
    from profuse.report.sweep import format_diff, load_results

    names = (str(args.a), str(args.b))
    steps = load_step(args.a), load_step(args.b)
    if all(s is not None for s in steps):  # two Part C runs
        print(format_step_diff(*steps, names=names))
        return 0
    if any(s is not None for s in steps):
        step, other = (args.a, args.b) if steps[0] is not None else (args.b, args.a)
        raise UsageError(
            f"{step} is Part C's step.json and {other} is not: diff compares two step.json files, "
            "or two results.json of Part B or a sweep"
        )
    print(format_diff(load_results(args.a), load_results(args.b), names=names))
    return 0


# --------------------------------------------------------------------------------------------
# Part C: the whole training step
# --------------------------------------------------------------------------------------------

STEP_VARIANTS = ("eager", "fused", "liger-ops", "liger", "compile", "compile+fused", "cudagraphs")
# The sizes --preset names: the built-in GPT's, then the Hugging Face models' (profuse.models).
GPT_STEP_PRESETS = ("lab", "small", "medium")
HF_STEP_PRESETS = ("tiny", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B")
CPU_STEP_HINT = (
    "Part C (the whole training step, eager vs fused vs torch.compile) runs here on CUDA; on a CPU run "
    "it yourself: profuse step --device cpu --preset lab --variants eager,compile (TRITON_INTERPRET=1 "
    "adds the fused variants, slowly)"
)


def build_step_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="profuse step",
        description="Part C: how much faster does fusing make the training step, really? Whole training "
        "steps (forward, loss, backward, AdamW) of a model (the built-in GPT, or a Hugging Face "
        "Llama-family model with random weights) as written (eager), with its block ops fused "
        "(silu_mul, add_rms_norm: profuse's Triton kernels), with Liger-Kernel's patch, under "
        "torch.compile, and both: the same math checked against float64 first, then interleaved "
        "trials with the speedup over eager and its 95% CI, peak memory, kernels per step, the gain "
        "Amdahl's law predicts from the fused ops' own speedups beside the gain measured, and a "
        "verdict. Writes step.json and a trace per variant.",
    )
    _add_device_args(p)
    p.add_argument(
        "--model", default="gpt", metavar="gpt|hf:ARCH",
        help="the model: gpt, the built-in (default), or hf:ARCH, ARCH one of llama, mistral, qwen2, "
        "qwen3 (transformers' own class, random weights, nothing downloaded)",
    )  # fmt: skip
    p.add_argument(
        "--preset", default=None, choices=GPT_STEP_PRESETS + HF_STEP_PRESETS,
        help="model size. gpt: lab = 4 layers, d_model 256, 8 x 256 tokens a step (the lab's, the "
        "default); small = 8 layers, d_model 1024, 8 heads, 8 x 1024 tokens; medium = small with "
        "d_model 2048, 16 heads (the model flags override them). hf:ARCH: tiny (2 layers, width 96, "
        "2 x 64 tokens; the default) or a published model's shapes, 4 x 2048 tokens a step: "
        "Llama-3.2-1B (hf:llama), Qwen2.5-0.5B (hf:qwen2), Qwen3-0.6B (hf:qwen3)",
    )  # fmt: skip
    p.add_argument(
        "--hf-config", type=Path, default=None, metavar="PATH",
        help="with --model hf:ARCH: a local config.json (or its folder) instead of a preset; "
        "4 x 2048 tokens a step unless --batch-size and --seq-len say otherwise",
    )  # fmt: skip
    g = p.add_argument_group("the model (the built-in GPT's sizes; each overrides the preset)")
    g.add_argument("--layers", type=positive_int, default=None, help="transformer blocks")
    g.add_argument("--d-model", type=positive_int, default=None, help="hidden size")
    g.add_argument("--heads", type=positive_int, default=None, help="attention heads; must divide --d-model")
    g.add_argument("--vocab-size", type=positive_int, default=None, help="vocabulary size")
    g.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (any model)")
    g.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (any model)")
    p.add_argument(
        "--variants", type=variant_keys, default=None, metavar="LIST",
        help=f"comma-separated, from: {', '.join(STEP_VARIANTS)} (default: for gpt eager, fused, "
        "compile, compile+fused; for hf:ARCH all. eager, the baseline, is always in; a variant that "
        "cannot run here is skipped with the reason: fused where no Triton kernels run, liger and "
        "liger-ops without CUDA and liger-kernel, cudagraphs without CUDA)",
    )  # fmt: skip
    p.add_argument("--trials", type=trial_count, default=30, help="interleaved timed trials (default: 30)")
    p.add_argument(
        "--profile-steps", type=nonnegative_int, default=3,
        help="profiled steps per variant, for kernels per step and the Amdahl prediction; 0 skips the "
        "profiles and the prediction (default: 3)",
    )  # fmt: skip
    _add_threads_arg(p)
    _add_out_arg(p, ".", "step.json and the traces (trace-step-VARIANT.json)")
    return p


def _step_config(args, device, preset: str | None):
    from profuse.models import model_spec
    from profuse.step import StepConfig

    spec = model_spec(
        getattr(args, "model", "gpt"),
        preset,
        config_path=getattr(args, "hf_config", None),
        batch_size=getattr(args, "batch_size", None),
        seq_len=getattr(args, "seq_len", None),
        n_layer=getattr(args, "layers", None),
        d_model=getattr(args, "d_model", None),
        n_head=getattr(args, "heads", None),
        vocab_size=getattr(args, "vocab_size", None),
    )
    kw = {
        name: getattr(args, name) for name in ("variants", "trials", "profile_steps") if hasattr(args, name)
    }
    return StepConfig(model=spec, device=device, seed=args.seed, out_dir=args.out, **kw)


def check_step(cfg) -> None:
    """Part C's memory check, for the variants that can run here: before any long work."""
    from profuse.step import check_step_fits, plan

    check_step_fits(cfg, plan(cfg, None)[0])


def run_part_c(cfg) -> None:
    from profuse.files import write_json
    from profuse.report.step import format_step
    from profuse.step import run_step

    progress = Progress()
    try:
        res = run_step(cfg, progress=progress)
    finally:
        progress.close()
    data = res.to_dict()
    print(format_step(data))
    path = write_json(Path(cfg.out_dir) / "step.json", data)
    print(f"results: {path}")


def cmd_step(argv: list[str]) -> int:
    args = build_step_parser().parse_args(argv)  # before torch is imported: --help stays quick
    from profuse.env import resolve_device

    check_out(args, ())  # a folder that cannot be written fails now, not after the measuring
    set_threads(args)
    cfg = _step_config(args, resolve_device(args.device), args.preset)
    check_step(cfg)
    run_part_c(cfg)
    return 0


COMMANDS = {
    "profile": cmd_profile,
    "sweep": cmd_sweep,
    "step": cmd_step,
    "report": cmd_report,
    "diff": cmd_diff,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = cmd_main
    if argv and argv[0] in COMMANDS:
        command, argv = COMMANDS[argv[0]], argv[1:]
    try:
        return command(argv)
    except UsageError as err:
        print(f"profuse: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # a command may say what it kept (KeyboardInterrupt(text))
        print(f"profuse: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `profuse ... | head`: the reader left; nothing more to say
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as exit_:  # argparse (--help, a bad flag): a code, for callers of main()
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
