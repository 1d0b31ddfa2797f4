"""Commands over sizes and saved runs: `profuse sweep` (Part B at several sizes), `profuse
report` (a saved run printed again) and `profuse diff` (two saved runs compared)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from profuse.cli.common import (
    PARTIAL_JSON,
    PLOTS,
    RESULTS_CSV,
    RESULTS_JSON,
    Parser,
    Progress,
    ProgressLines,
    TrackedStages,
    add_bench_args,
    add_device_args,
    add_out_arg,
    check_out,
    element_list,
    replaced_note,
    set_threads,
    variant_keys,
)
from profuse.cli.parts import bench_config
from profuse.errors import UsageError

SWEEP_ROWS = [1024, 8192, 32768]  # the lab's first exercise: --rows 1024,8192,32768 --cols 4096


def build_sweep_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="profuse sweep",
        description="Part B at several sizes (every --rows with every --cols): correctness first, "
        "then interleaved trials, at each size. Writes results.json, results.csv, speedup.png and "
        "bandwidth.png under --out. Sizes that do not fit in memory are skipped with a note.",
    )
    add_device_args(p)
    add_bench_args(p, sizes_are_lists=True)
    # The shared flags default to the one-size run; a sweep defaults to the lab's three sizes.
    rows = p._option_string_actions["--rows"]
    rows.default = SWEEP_ROWS
    rows.help = f"comma-separated rows of the tail's tensors (default: {','.join(map(str, SWEEP_ROWS))})"
    p.add_argument(
        "--elements", type=element_list, default=(),
        help="comma-separated elements per tensor, e.g. 4M,32M,128M: each --cols value then gets "
        "rows = elements / cols (instead of --rows), for a grid over hidden sizes",
    )  # fmt: skip
    add_out_arg(
        p,
        "profuse-sweep",
        "results.json, results.csv, speedup.png and bandwidth.png, and "
        "results.partial.json while it runs; files of an earlier sweep there are replaced",
    )
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = Parser(prog="profuse report", description="Print a saved run of profuse or profuse sweep again.")
    p.add_argument(
        "results", type=Path,
        help="a file profuse wrote: results.json (profuse, profuse sweep), results.partial.json, "
        "profile.json or profile_ddp.json (Part A), step.json (profuse step)",
    )  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="a markdown table, for an issue or a README")
    p.add_argument("--refit", action="store_true",
                   help="every CI recomputed from the saved paired trials by the method that fits their "
                   "count (order statistics with their exact coverage under 30 trials, BCa from 30), for "
                   "files saved when every count got a bootstrap; the report says so")  # fmt: skip
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
    p = Parser(
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
    # Progress lines from the start where no terminal shows the bars: a sweep in a log is named by
    # the heartbeat wherever a stage runs long, from torch's start on (main job's TrackedStages).
    lines = ProgressLines()
    try:
        lines.quietly("starting: torch and the device")
        set_threads(args)
        return _sweep(args, lines)
    finally:
        lines.close()


def _sweep(args, lines: ProgressLines) -> int:
    from profuse.env import resolve_device
    from profuse.files import with_provenance, write_result
    from profuse.report import plots
    from profuse.report.sweep import format_sweep, write_csv
    from profuse.sweep import SweepConfig, run_sweep

    device = resolve_device(args.device)
    # The one-size config maps the shared flags (dtype, variants, --warm-cache) as Part B does.
    first = bench_config(args, device, args.rows[0], args.cols[0])
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
            write_result(partial, {**res.to_dict(), "partial": True})
            done[:] = [res]

    progress = TrackedStages(lines, Progress())
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
    data = with_provenance(res.to_dict())  # one provenance for the JSON and the CSV
    print(format_sweep(data))
    if not res.runs:
        raise UsageError("no size fitted in memory, so nothing was written: choose smaller sizes")
    earlier = {out / name: replaced_note(out / name) for name in (RESULTS_JSON, RESULTS_CSV, *PLOTS)}
    # JSON first: it holds every timing, and the CSV and plots can be made again from it.
    written = [write_result(out / RESULTS_JSON, data), write_csv(out / RESULTS_CSV, data)]
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
    from profuse.report.provenance import provenance_lines
    from profuse.report.step import format_step, load_step

    step = load_step(args.results)  # Part C's step.json prints as the run printed it
    if step is not None:
        if args.markdown or args.vs or args.variants or args.plots is not None:
            raise UsageError(
                f"{args.results} is a Part C step file: it prints as it is, with --refit as its only option"
            )
        refitted = _refit(step) if args.refit else step
        print(format_step(refitted))
        if args.refit:
            print(_refit_note(step))
        print("\n".join(["", *provenance_lines(step)]))
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
        print("\n".join(["", *provenance_lines(data)]))
        return 0
    parse(data, str(args.results))  # one line for a file that is not a results file, before any work
    original = data
    if args.refit:
        data = _refit(data)
    if args.vs:
        data = rebase(data, args.vs, only=args.variants)
    run = parse(data, str(args.results))
    if args.variants:
        run = select_variants(run, args.variants)
    print(format_run(run, markdown=args.markdown))
    if data.get("partial"):
        done = len(data.get("runs", [])) + len(data.get("skipped", []))
        print(f"(a partial sweep: it stopped after {done} sizes)")
    if args.refit:
        print(_refit_note(original))
    print("\n".join(["", *provenance_lines(data)]))
    if args.plots is not None:
        written = plots.write_plots(run, args.plots)
        print()
        for path in written:
            print(f"wrote {path}")
        if not written:
            print("no plots: nothing was timed")
    return 0


def _refit(data: dict) -> dict:
    from profuse.bench.stats import refit

    return refit(data)[0]


def _refit_note(data: dict) -> str:
    """What --refit did: the CIs recomputed, and the methods the file itself had used."""
    from profuse.bench.stats import BCA_LEAST_TRIALS, refit

    methods = refit(data)[1] if isinstance(data, dict) else []
    saved = ", ".join(methods) if methods else "none recorded"
    return (
        f"CIs recomputed from the saved paired trials (profuse report --refit): order statistics with "
        f"their exact coverage under {BCA_LEAST_TRIALS} trials, BCa from {BCA_LEAST_TRIALS}; the file's "
        f"own CIs were made by: {saved}"
    )


def _print_part_a(data, args) -> bool:
    """Print a saved Part A summary (profile.json, profile_ddp.json); False for anything else."""
    from profuse.report.profile import DDP_SUMMARY, format_saved_profile, part_a_file

    name = part_a_file(data)
    if name is None:
        return False
    flags = {"--vs": args.vs, "--variants": args.variants, "--plots": args.plots, "--markdown": args.markdown,
             "--refit": args.refit}  # fmt: skip
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
    from profuse.report.provenance import provenance_diff
    from profuse.report.step import format_step_diff, load_step
    from profuse.report.sweep import format_diff, load_results

    names = (str(args.a), str(args.b))
    steps = load_step(args.a), load_step(args.b)
    if all(s is not None for s in steps):  # two Part C runs
        print(format_step_diff(*steps, names=names))
        print("\n".join(["", *provenance_diff(*steps)]))
        return 0
    if any(s is not None for s in steps):
        step, other = (args.a, args.b) if steps[0] is not None else (args.b, args.a)
        raise UsageError(
            f"{step} is Part C's step.json and {other} is not: diff compares two step.json files, "
            "or two results.json of Part B or a sweep"
        )
    a, b = load_results(args.a), load_results(args.b)
    print(format_diff(a, b, names=names))
    print("\n".join(["", *provenance_diff(a, b)]))
    return 0
