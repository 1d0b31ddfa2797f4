"""The lab's commands: the main job (Part A, then Part B, and on CUDA Part C) and `profuse
profile` (Part A alone, on one process or under DDP)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from profuse.cli.common import (
    DDP_FILES,
    PROFILE_JSON,
    RESULTS_JSON,
    TRACE_JSON,
    ProgressLines,
    TrackedStages,
    build_parser,
    build_profile_parser,
    check_out,
    part_a_files,
    replaced_note,
    set_threads,
    tagged,
)
from profuse.cli.step import CPU_STEP_HINT, check_step, precisions, run_part_c, step_config
from profuse.errors import UsageError

# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def bench_config(args, device, rows: int, cols: int):
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
        precision = getattr(args, "precision", "amp")
        flags = [("--model", model), ("--preset", preset), ("--hf-config", hf_config),
                 ("--compile-step", args.compile_step or None),
                 ("--precision", None if precision == "amp" else precision),
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
    if getattr(args, "precision", "amp") != "amp":
        raise UsageError(f"--precision {args.precision} with --nproc: data-parallel profiles run in amp only")
    return ProfileConfig(
        model=spec.config, device=device, steps=args.profile_steps, warmup=getattr(args, "warmup", 2),
        out_dir=args.out, seed=args.seed,
    )  # fmt: skip


def run_part_a(args, device, progress: TrackedStages) -> None:
    """Part A: the built-in GPT, a Hugging Face model or the user's --step, through
    profuse.profiling.profile; eager, and compiled beside it with --compile-step; in each
    precision --precision names (both: one after the other, each its own model)."""
    from profuse.env import check_fits
    from profuse.files import write_result
    from profuse.models.spec import compute_dtype
    from profuse.profiling import SUMMARY_KIND

    spec = _profile_spec(args)
    chosen = precisions(args)
    if spec is not None:
        for precision in chosen:
            need = spec.train_bytes(compute_dtype(device, precision), precision)
            check_fits(need, device, f"Part A's step of {spec.describe()} ({precision})")
    runs = {p: _part_a_run(args, device, spec, p, p if len(chosen) > 1 else "", progress) for p in chosen}
    summary = {"kind": SUMMARY_KIND, **(runs[chosen[0]] if len(chosen) == 1 else {"runs": runs})}
    path = Path(args.out) / PROFILE_JSON
    earlier = replaced_note(path)
    write_result(path, summary)
    print(f"summary: {path}{earlier}; profuse report {path} prints it again")
    print()


def _part_a_run(args, device, spec, precision: str, tag: str, progress: TrackedStages) -> dict:
    """One precision's Part A, printed as it finishes; its part of profile.json."""
    from profuse.profiling import compiled_trace_name, profile, spec_precision, spec_step
    from profuse.report.profile import format_profile, format_profile_comparison

    warmup = getattr(args, "warmup", 2)
    if spec is not None:
        about = {"model": spec.to_dict(), "describe": spec.describe(), "precision": precision}
        step = spec_step(spec, device, seed=args.seed, precision=precision)
        where, how = device, spec_precision(device, precision)
    else:
        from profuse.loader import load_step

        step = load_step(args.step)
        about = {"step": args.step, "describe": f"your step, {args.step}"}
        where = None if getattr(args, "device", "auto") == "auto" else device  # None: ask the step
        how = None  # as the user's step runs it
    label = f"Part A: {precision}: " if tag else "Part A: "
    say = lambda text: progress(label + text, 0, 1)
    common = dict(steps=args.profile_steps, out=args.out, progress=say, summary_name=None, about=about,
                  precision=how)  # fmt: skip
    trace = tagged(TRACE_JSON, tag)
    eager = profile(step, warmup=warmup, device=where, trace_name=trace, **common)
    progress.close()
    print(format_profile(eager))
    run = {"eager": eager.to_dict()}
    if args.compile_step:
        del step  # the eager model's memory back before the compiled one is built
        compiled_step = spec_step(spec, device, seed=args.seed, compile=True, precision=precision)
        compiled = profile(compiled_step, warmup=max(warmup, 1), device=device, compiled=True,
                           trace_name=compiled_trace_name(trace), **common)  # fmt: skip
        progress.close()
        print()
        print(format_profile_comparison(eager, compiled))
        run["compiled"] = compiled.to_dict()
    if tag:
        print()
    return run


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


def run_part_b(args, cfg, progress: TrackedStages) -> None:
    from profuse.bench.tail_bench import run_tail_bench
    from profuse.files import write_result
    from profuse.report.bench import format_tail_bench

    say = lambda stage, done, total: progress(f"Part B: {stage}", done, total)
    try:
        res = run_tail_bench(cfg, progress=say)
    finally:
        progress.close()
    print(format_tail_bench(res))
    note = triton_note(args, cfg.device)
    if note:
        print(note)
    path = Path(args.out) / RESULTS_JSON
    earlier = replaced_note(path)
    write_result(path, res.to_dict())
    print(f"results: {path}{earlier}")


def cmd_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.skip_profile and args.profile_only:
        raise UsageError("--skip-profile and --profile-only leave nothing to run: pick one")
    names = () if args.skip_profile else part_a_files(args.compile_step)
    check_out(args, names + (() if args.profile_only else (RESULTS_JSON,)))
    # One stream of progress lines on stderr through Parts A, B and C, from the start: importing
    # torch and starting the device took about 15 s on a card's host before Part A's first line
    # (H100, 2026-12-08), and a log or pipe shows no terminal's bars.
    progress = ProgressLines()
    try:
        progress.quietly("starting: torch and the device")
        set_threads(args)
        return _main_job(args, progress)
    finally:
        progress.close()


def _main_job(args, progress: ProgressLines) -> int:
    from profuse.env import resolve_device

    device = resolve_device(args.device)
    # Part B's settings are checked before Part A runs: a bad one fails at once, not minutes in.
    bench = None if args.profile_only else bench_config(args, device, args.rows, args.cols)
    # Part C ends the whole job (neither flag): the small preset on CUDA, its size checked up front.
    whole_job = not (args.skip_profile or args.profile_only)
    step = None
    if whole_job and device.type == "cuda":
        step = step_config(argparse.Namespace(seed=args.seed, out=args.out), device, "small")
        check_step(step)
    if not args.skip_profile:
        run_part_a(args, device, TrackedStages(progress))
    if bench is not None:
        progress.quietly("Part B: starting")
        try:
            run_part_b(args, bench, TrackedStages(progress))
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
        progress.quietly("Part C: starting")
        try:
            run_part_c(step, progress)
        except KeyboardInterrupt as err:
            kept = f"Parts A and B had finished: their files are kept in {args.out}"
            raise KeyboardInterrupt(f"{err}; {kept}" if str(err) else kept) from None
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
    check_out(args, DDP_FILES if args.nproc is not None else part_a_files(args.compile_step, args.precision))
    set_threads(args)
    # --nproc N launches N ranks; a process that torchrun started is one of them already
    # (torchrun would read a --nproc after the module name as its own flag, so none is given).
    if args.nproc is not None or started_by_launcher():
        _profile_config(args, "cpu")  # the flags checked before any rank starts
        return run_part_a_ddp(args)
    progress = ProgressLines()
    try:
        progress.quietly("starting: torch and the device")
        run_part_a(args, resolve_device(args.device), TrackedStages(progress))
    finally:
        progress.close()
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
            else format_rank_failure(f.rank, f.world_size, f.exitcode, f.error, f.log, f.log_empty, f.raised)
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
