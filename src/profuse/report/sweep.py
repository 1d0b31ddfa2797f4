"""Saved results for people: a sweep (or one run) as a table, a markdown table or a CSV, and two
saved runs compared size by size and variant by variant.

Everything here reads the saved JSON shape (`TailBenchResult.to_dict()`, `SweepResult.to_dict()`),
never live objects, so a file saved months ago on another card renders like a run that just ended.
"""

from __future__ import annotations

import csv
import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from profuse.bench import DEFAULT_TRIALS
from profuse.bench.stats import (
    FEW_TRIALS,
    ORDER_STATISTICS,
    ci_label,
    median_ranks,
    steadiness,
    time_ratio_ci,
    unsteady_warning,
)
from profuse.bench.timing import STEADY_CALLS, STEADY_RATIO, WARMUP_BUDGET_S, warmup_warning
from profuse.env import card_name, describe, oversubscribed
from profuse.errors import UsageError
from profuse.files import atomic_path
from profuse.report.units import fmt_bandwidth, fmt_time, speedup_terms

# The provenance each CSV row carries (the JSON beside it holds the whole of it): a table pasted
# elsewhere still names its commit, card and run.
PROVENANCE_CSV = ("commit", "dirty", "card", "card_uuid", "torch", "started_utc", "ended_utc")
CSV_FIELDS = (
    "rows", "cols", "dtype", "backward", "variant", "median_s", "speedup", "ci_low", "ci_high",
    "verdict", "achieved_GBps", "fraction_of_copy", "passed", "host_s", "host_bound", "timing", "unsteady",
    "ci_coverage", "ci_method", *PROVENANCE_CSV,
)  # fmt: skip

BASELINE_VERDICT = "baseline"
# Every kind of file `profuse report` reads, for the error on any other.
KNOWN_FILES = (
    "results.json of profuse or profuse sweep, results.partial.json of a sweep stopped part-way, "
    "profile.json or profile_ddp.json of Part A, or step.json of profuse step"
)
NOT_TIMED = "not timed"


# --------------------------------------------------------------------------------------------
# Reading a saved file into rows: one per size and variant
# --------------------------------------------------------------------------------------------


@dataclass
class VariantRow:
    """One variant at one size, as saved."""

    rows: int
    cols: int
    dtype: str
    backward: bool
    variant: str
    label: str
    passed: bool  # its correctness check against float64
    baseline: bool
    median_s: float | None = None  # None: not timed (failed its check, or eager failed)
    speedup: dict | None = None  # the saved Speedup.to_dict(); None for the baseline
    achieved_Bps: float | None = None
    fraction_of_copy: float | None = None
    times_s: list[float] = field(default_factory=list)  # per trial, for `diff`'s bootstrap
    why_not_timed: str = ""
    host_s: float | None = None  # CUDA: CPU time to issue one call (median of interleaved rounds)
    host_bound: bool = False  # the host's time bounds the call (bench.timing.host_bound)
    host_lower_bound: bool = False  # host_s is "at least": the launch queue filled (bench/host.py)
    warmup_calls: int = 0  # untimed calls after the first (files before warm-up until steady: 0)
    warmup_steady: bool = True  # False: its warm-up ran out of budget before its calls agreed

    @property
    def size(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def unsteady(self) -> bool:
        """Its trials were unsteady (bench.stats.steadiness): its median is not to be trusted."""
        return bool(self.times_s) and steadiness(self.times_s).unsteady

    @property
    def verdict(self) -> str:
        if self.baseline and self.median_s is not None:
            return BASELINE_VERDICT
        if self.speedup is None:
            return NOT_TIMED
        return self.speedup["verdict"]


@dataclass
class SavedRun:
    """What a results file holds, whichever command wrote it."""

    kind: str  # "tail" (one size) or "sweep"
    env: dict
    dtype: str
    backward: bool
    device: str
    trials: int
    baseline: str
    copy_ceiling_Bps: float | None
    model_tensors: int | None  # the fused byte model bandwidth is computed from (4 or 11)
    variant_rows: list[VariantRow]
    skipped_sizes: list[tuple[int, int, str]]
    skipped_variants: dict[str, str]  # label -> why it did not run (the same at every size)
    statistic: str = ""
    timer: str = ""
    flush_l2: bool = False
    elements: list[int] = field(default_factory=list)  # a grid's --elements (rows = elements // cols)
    timing: str = "device"  # how calls were timed: device, loop or graph (files before it: device)
    warmup_budget_s: float = WARMUP_BUDGET_S

    @property
    def sizes(self) -> list[tuple[int, int]]:
        return list(dict.fromkeys(r.size for r in self.variant_rows))

    @property
    def card(self) -> str:
        return card_name(self.env)

    @property
    def baseline_label(self) -> str:
        """The baseline as its rows name it ('torch.compile', not the key 'compile')."""
        return next((r.label for r in self.variant_rows if r.variant == self.baseline), self.baseline)

    @property
    def what(self) -> str:
        return "forward + backward" if self.backward else "forward"


def load_results(path: str | Path) -> dict:
    """A results.json written by `profuse` or `profuse sweep`; UsageError (one line) otherwise."""
    data = read_json(path)
    parse(data, str(path))  # fail here, in one line, rather than halfway through a table
    return data


def read_json(path: str | Path):
    """The JSON in `path`; UsageError (one line) for a missing, unreadable or cut-short file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{p} is a folder: give the results.json inside it") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{p}: cannot read it ({err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{p} is not valid JSON (line {err.lineno}: {err.msg}); was it cut short?") from None
    return data


def parse(data: dict, source: str = "results") -> SavedRun:
    """The rows of a saved run; UsageError when `data` is not a profuse results file."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in ("tail", "sweep"):
        from profuse.report.profile import part_a_file

        name = part_a_file(data)
        if name is not None:
            raise UsageError(
                f"{source} is Part A's summary ({name}, from profuse or profuse profile): "
                f"`profuse report {source}` prints it again; diff, --vs and --variants read the "
                "results.json of Part B or a sweep"
            )
        if kind == "step":
            raise UsageError(
                f"{source} is Part C's step.json: `profuse report {source}` prints it again and "
                "`profuse diff` compares it with another step.json; --vs and --variants read the "
                "results.json of Part B or a sweep"
            )
        raise UsageError(f"{source} is not a file profuse writes (expected {KNOWN_FILES})")
    try:
        return _parse(data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UsageError(
            f"{source} is a malformed profuse results file ({type(err).__name__}: {err})"
        ) from None


def _parse(data: dict) -> SavedRun:
    entries = [data] if data["kind"] == "tail" else list(data["runs"])
    cfg = data["config"]
    # A sweep's "skipped" lists sizes; a single run's maps variants to reasons (read below, per entry).
    skipped_sizes = []
    if data["kind"] == "sweep":
        skipped_sizes = [(int(s["rows"]), int(s["cols"]), str(s["reason"])) for s in data.get("skipped", [])]
    rows: list[VariantRow] = []
    skipped_variants: dict[str, str] = {}
    comp0: dict = {}
    model_tensors = None
    for entry in entries:
        ecfg = entry["config"]
        comp = entry.get("comparison") or {}
        comp0 = comp0 or comp
        model_tensors = entry.get("traffic", {}).get("model_tensors", model_tensors)
        baseline = comp.get("baseline", "eager")
        results = entry.get("results") or {}
        labels = {k: v["label"] for k, v in entry.get("checks", {}).items()}
        for key, why in (entry.get("skipped") or {}).items():
            skipped_variants[labels.get(key, key)] = why
        for key, chk in entry.get("checks", {}).items():
            res = results.get(key)
            timing = (comp.get("timings") or {}).get(key, {})
            row = VariantRow(
                rows=int(ecfg["rows"]),
                cols=int(ecfg["cols"]),
                dtype=str(ecfg["dtype"]),
                backward=bool(ecfg["backward"]),
                variant=key,
                label=str(chk["label"]),
                passed=bool(chk["passed"]),
                baseline=key == baseline,
            )
            if res is not None:
                row.median_s = float(res["median_s"])
                row.speedup = res.get("speedup")
                row.achieved_Bps = res.get("achieved_Bps")
                row.fraction_of_copy = res.get("fraction_of_copy")
                row.times_s = [float(t) for t in timing.get("times_s", [])]
                # Files from before host times were measured apart kept the warm-up's dispatch time.
                host = res.get("host_s", timing.get("dispatch_s"))
                row.host_s = None if host is None else float(host)
                row.host_bound = bool(res.get("host_bound", False))
                row.host_lower_bound = bool(timing.get("host_is_lower_bound", False))
                row.warmup_calls = int(timing.get("warmup_calls", 0))
                row.warmup_steady = bool(timing.get("warmup_steady", True))
            elif chk.get("error"):
                row.why_not_timed = f"FAILED to run: {chk['error']}"
            elif not chk["passed"]:
                row.why_not_timed = f"FAILED check: rel err {chk['rel_err']:.1e} > tol {chk['tol']:.0e}"
                if chk.get("grad_rel_err"):
                    worst = max(chk["grad_rel_err"].values())
                    row.why_not_timed += f", grads up to {worst:.1e} (tol {chk.get('grad_tol') or 0:.0e})"
            else:
                row.why_not_timed = "not timed: the baseline (eager) failed its check"
            rows.append(row)
    return SavedRun(
        kind=data["kind"],
        env=data.get("env") or {},
        dtype=str(cfg["dtype"]),
        backward=bool(cfg["backward"]),
        device=str(cfg["device"]),
        trials=int(cfg["trials"]),
        baseline=comp0.get("baseline", "eager"),
        copy_ceiling_Bps=data.get("copy_ceiling_Bps"),
        model_tensors=model_tensors,
        variant_rows=rows,
        skipped_sizes=skipped_sizes,
        skipped_variants=skipped_variants,
        statistic=comp0.get("statistic", ""),
        timer=comp0.get("timer", ""),
        flush_l2=bool(comp0.get("flush_l2", False)),
        elements=[int(e) for e in cfg.get("elements") or []],  # files saved before --elements: none
        timing=str(comp0.get("timing", "device")),
        warmup_budget_s=float(comp0.get("warmup_budget_s", WARMUP_BUDGET_S)),
    )


def select_variants(run: SavedRun, keys: list[str]) -> SavedRun:
    """The run with only these variants' rows (keys as saved: eager, compile-max, triton, ...);
    the speedups stay over the run's baseline, shown or not. UsageError for a key it lacks."""
    have = list(dict.fromkeys(r.variant for r in run.variant_rows))
    unknown = [k for k in keys if k not in have]
    if unknown:
        raise UsageError(
            f"no variant {', '.join(map(repr, unknown))} in this run (it has: {', '.join(have)})"
        )
    wanted = set(keys)
    return replace(run, variant_rows=[r for r in run.variant_rows if r.variant in wanted])


# --------------------------------------------------------------------------------------------
# Tables: aligned text for a terminal, or markdown to paste in an issue or a README
# --------------------------------------------------------------------------------------------


def render_table(header: list[str], body: list[list[str]], right: set[int], markdown: bool) -> str:
    if markdown:
        esc = lambda c: c.replace("|", "\\|")
        lines = ["| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join("---:" if i in right else ":---" for i in range(len(header))) + "|")
        lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(
        c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
    )
    return "\n".join(fmt(r).rstrip() for r in [header, *body])


def _size(rows: int, cols: int) -> str:
    return f"{rows} x {cols}"


def host_note(timing: str, rounds: int) -> str:
    """What the host column and the host-bound mark mean, for the timing mode of a table."""
    what = {
        "device": "the median is device time, the CPU kept ahead",
        "graph": "the median is CUDA-graph replay, device time with no launch cost",
        "loop": "the median is calls back to back (about the larger of host and device time)",
    }.get(timing, f"timing {timing}")
    bound = (
        "host-bound: the median is within 10% of the host time, so the GPU waited for the CPU"
        if timing == "loop"
        else "host-bound: host > median, so a loop that cannot run ahead of the GPU pays the host time"
    )
    return f"{what}; host = CPU time to issue one call (median of {rounds} interleaved rounds); {bound}"


def host_cell(row: VariantRow) -> str:
    """'12.3 us', '250.1 us host-bound', 'at least 9.1 ms' (the launch queue filled), or '-'
    where no host time was measured."""
    if row.host_s is None or row.median_s is None:
        return "-"
    at_least = "at least " if row.host_lower_bound else ""
    return at_least + fmt_time(row.host_s).strip() + (" host-bound" if row.host_bound else "")


def speedup_cell(row: VariantRow) -> str:
    """'2.14x (2.11-2.16)', '2.17x slower (2.10-2.25)', or 'no measurable gain (0.98-1.03)'."""
    if row.median_s is None:
        return row.why_not_timed
    sp = row.speedup
    if sp is None:
        return BASELINE_VERDICT
    ratio, ci = speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])
    if sp["verdict"] == "no measurable gain":
        return f"no measurable gain ({ci})"
    return f"{ratio} ({ci})"


def unsteady_notes(run: SavedRun) -> list[str]:
    """One warning per size where some variant's trials were unsteady (bench.stats: over
    UNSTEADY_SHARE of them past UNSTEADY_RATIO x its fastest), with the command that times that
    size again; and one per variant whose warm-up ran out of budget before it settled."""
    notes = []
    for size in run.sizes:
        rows = [r for r in run.variant_rows if r.size == size and r.times_s]
        counts = {r.label: steadiness(r.times_s) for r in rows}
        if any(s.unsteady for s in counts.values()):
            notes.append(unsteady_warning(counts, _size(*size), again_command(run, size)))
        for r in rows:
            if not r.warmup_steady:
                notes.append(
                    f"{_size(*size)}: " + warmup_warning(r.label, r.warmup_calls, run.warmup_budget_s)
                )
    return notes


def again_command(run: SavedRun, size: tuple[int, int]) -> str:
    """The command that times one size of `run` again with the same settings (at least FEW_TRIALS
    trials), into a folder of its own so the results it came from are not replaced."""
    rows, cols = size
    keys = list(dict.fromkeys(r.variant for r in run.variant_rows if r.size == size))
    argv = ["profuse", "--skip-profile", "--rows", str(rows), "--cols", str(cols), "--dtype", run.dtype]
    argv += ["--backward"] if run.backward else []
    argv += ["--variants", ",".join(keys), "--trials", str(max(run.trials, FEW_TRIALS))]
    device = run.device.split(":", 1)[0]
    argv += ["--device", device]
    argv += ["--warm-cache"] if device == "cuda" and not run.flush_l2 else []
    argv += ["--timing", run.timing] if run.timing != "device" else []
    argv += threads_flag(run.env)
    return shlex.join([*argv, "--out", "again"])


def threads_flag(env: dict) -> list[str]:
    """['--threads', 'N'] for a command that times a CPU run again: the run's own count, or fewer
    where the CPU was oversubscribed (env.oversubscribed); [] on a GPU or for older files."""
    if env.get("gpu") or "threads" not in env:
        return []
    threads = int(env["threads"])
    if oversubscribed(env):
        cores = int(env.get("cores_available") or env.get("cpu_count") or 1)
        threads = max(1, min(threads - 1, cores - 1))
    return ["--threads", str(threads)]


def ci_terms(speedups) -> tuple[str, str, set[str]]:
    """(label, how, methods) of a table's saved speedups (dicts): '96.1% CI' where every row's
    interval has that coverage ('CI' where they differ), how it was made in words, and the
    methods as saved (files before order statistics hold 'BCa' or 'percentile' only)."""
    sps = [sp for sp in speedups if sp]
    labels = {ci_label(sp) for sp in sps}
    methods = {str(sp.get("method", "")) for sp in sps}
    label = labels.pop() if len(labels) == 1 else "CI"
    if methods and all(m.startswith(ORDER_STATISTICS) for m in methods):
        how = "from order statistics of the paired per-trial ratios (distribution-free)"
    else:
        how = "from a paired bootstrap"
    return label, how, methods


def few_trials_note(trials: int, methods: set[str] | None = None) -> list[str]:
    """What a CI of a run with fewer than FEW_TRIALS trials is (none otherwise): order statistics
    with their exact coverage, or, in a file saved before that, a bootstrap that covers less
    than it says (`methods`: the methods its CIs were made with)."""
    if trials >= FEW_TRIALS:
        return []
    if methods and not all(m.startswith(ORDER_STATISTICS) for m in methods):
        return [
            f"WARNING only {trials} trials, and this file's CIs are a bootstrap's "
            f"({', '.join(sorted(methods))}), "
            f"which at so few trials covers less than the 95% it names; `profuse report --vs BASELINE` "
            f"recomputes them from the saved trials with order statistics, or time it again with "
            f"--trials {DEFAULT_TRIALS}"
        ]
    k, coverage = median_ranks(trials, 0.95)
    return [
        f"note: {trials} trials, under {FEW_TRIALS}: each CI is the median per-trial ratio's "
        f"distribution-free interval (order statistics {k} and {trials + 1 - k} of {trials}), "
        f"{ci_label({'coverage': coverage})} as printed, not a bootstrap's; --trials {DEFAULT_TRIALS} "
        "for BCa"
    ]


INTERPRETED_VARIANTS = ("triton",)


def interpreter_note(env: dict, timed: list[str]) -> list[str]:
    """The caveat on Triton kernels timed through Triton's interpreter (none otherwise)."""
    if not env.get("triton_interpret") or not timed:
        return []
    return [
        f"WARNING {', '.join(timed)} ran through Triton's interpreter (TRITON_INTERPRET=1): its times "
        "are the interpreter's, not a kernel's; use it on a CPU to check the math, never to time"
    ]


def warmup_line(calls: dict[str, int], rule: str | None = None) -> str:
    """'warm-up until the last 5 calls agree within 1.5x: eager 5 calls, torch.compile 9 calls';
    `rule` in place of 'the last 5 calls agree within 1.5x' where the design had another."""
    counts = ", ".join(f"{label} {n} call{'s' if n != 1 else ''}" for label, n in calls.items())
    rule = rule or f"the last {STEADY_CALLS} calls agree within {STEADY_RATIO}x"
    return f"warm-up, untimed, until {rule}: {counts}"


def threads_note(env: dict) -> list[str]:
    """The note on a CPU run whose threads outnumbered the free cores (env.oversubscribed)."""
    note = oversubscribed(env)
    return [note] if note else []


def timing_warnings(run: SavedRun) -> list[str]:
    """What makes this run's numbers less than they look: too few trials, disturbed sizes, warm-ups
    out of budget, an oversubscribed CPU, Triton kernels timed through the interpreter."""
    timed = list(
        dict.fromkeys(r.variant for r in run.variant_rows if r.variant in INTERPRETED_VARIANTS and r.median_s)
    )
    return (
        few_trials_note(run.trials, ci_terms(r.speedup for r in run.variant_rows)[2])
        + unsteady_notes(run)
        + threads_note(run.env)
        + interpreter_note(run.env, timed)
    )


def _notes(run: SavedRun) -> list[str]:
    bytes_model = {4: "3 inputs read + 1 output written", 11: "forward 4 tensors + backward 7 tensors"}
    label, how, _ = ci_terms(r.speedup for r in run.variant_rows)
    notes = [
        f"speedup: median({run.baseline_label}) / median(variant), its CI ({label}) {how} "
        f"over {run.trials} interleaved trials; 'no measurable gain' where the CI holds 1.0",
    ]
    if run.model_tensors is not None:  # None: no size ran, so there is no byte model to name
        model = bytes_model.get(run.model_tensors, f"{run.model_tensors} tensors")
        notes.append(f"bandwidth: minimum fused traffic ({model}) / median time")
    if run.copy_ceiling_Bps:
        ceiling = fmt_bandwidth(run.copy_ceiling_Bps)
        notes.append(f"copy ceiling (device-to-device copy, measured in this run): {ceiling}")
    else:
        notes.append("no copy ceiling: it is measured on CUDA only")
    if run.timer:
        notes.append(f"timer: {run.timer}{', L2 flushed before each call' if run.flush_l2 else ''}")
    if any(r.host_s is not None for r in run.variant_rows):
        notes.append(host_note(run.timing, run.trials))
    warmed = {r.label: r.warmup_calls for r in run.variant_rows if r.warmup_calls}
    if warmed and run.kind == "tail":  # a sweep has a count per size: the JSON keeps them
        notes.append(warmup_line(warmed))
    for label, why in run.skipped_variants.items():
        notes.append(f"{label}: skipped ({why})")
    for rows, cols, why in run.skipped_sizes:
        notes.append(f"{_size(rows, cols)}: skipped ({why})")
    notes.append(describe(run.env))
    return notes + timing_warnings(run)


def format_run(run: SavedRun, markdown: bool = False) -> str:
    """The table of a saved run (a sweep, or one size), with its byte model and notes."""
    n = len(run.sizes)
    if run.kind == "sweep":
        title = (
            f"Sweep: fused tail {run.what}, {run.dtype} on {run.device}, {run.trials} trials per size, "
            f"{n} size{'s' if n != 1 else ''}"
            + (f" ({len(run.skipped_sizes)} skipped)" if run.skipped_sizes else "")
        )
    else:
        size = _size(*run.sizes[0]) if run.sizes else ""
        title = f"Part B: fused tail {run.what}, {size} {run.dtype} on {run.device}, {run.trials} trials"
    ceiling = bool(run.copy_ceiling_Bps)
    host = any(r.host_s is not None for r in run.variant_rows)
    header = ["size", "variant", f"median ({run.timing})" if host else "median"]
    header += ["host/call"] if host else []
    header += [f"speedup vs {run.baseline_label} ({ci_terms(r.speedup for r in run.variant_rows)[0]})"]
    header += ["bandwidth"]
    header += ["% of copy"] if ceiling else []
    body = []
    last = None
    for r in run.variant_rows:
        # In text the size is printed once per group; pasted markdown keeps it on every row.
        size = _size(*r.size) if (markdown or r.size != last) else ""
        last = r.size
        cells = [
            size,
            r.label,
            fmt_time(r.median_s).strip() if r.median_s is not None else "-",
        ]
        if host:
            cells.append(host_cell(r))
        cells += [
            speedup_cell(r),
            fmt_bandwidth(r.achieved_Bps) if r.achieved_Bps else "-",
        ]
        if ceiling:
            cells.append(f"{r.fraction_of_copy:.0%}" if r.fraction_of_copy is not None else "-")
        body.append(cells)
    right = {2, 3, 5, 6} if host else {2, 4, 5}
    table = render_table(header, body, right=right, markdown=markdown) if body else "nothing was measured"
    notes = _notes(run)
    if markdown:
        return "\n".join([f"**{title}**", "", table, "", *[f"- {note}" for note in notes]])
    return "\n".join([f"=== {title} ===", table, *notes])


def format_sweep(data: dict, markdown: bool = False) -> str:
    return format_run(parse(data, "the sweep"), markdown)


def format_report(data: dict, markdown: bool = False) -> str:
    """A saved results.json again: a single run (kind "tail") or a sweep (kind "sweep")."""
    return format_run(parse(data), markdown)


# --------------------------------------------------------------------------------------------
# CSV: one row per size and variant
# --------------------------------------------------------------------------------------------


def _provenance_columns(data: dict) -> dict:
    """The PROVENANCE_CSV columns of a saved run ('' each where it recorded none)."""
    prov = data.get("provenance") or {}
    source, card = prov.get("source") or {}, prov.get("card") or {}
    name = card.get("name") or (f"{card.get('cpu_model')} ({card.get('cpu_count')} cores)" if card else "")
    values = {
        "commit": source.get("commit"),
        "dirty": source.get("dirty"),
        "card": name,
        "card_uuid": card.get("uuid"),
        "torch": (prov.get("versions") or {}).get("torch"),
        "started_utc": prov.get("started_utc"),
        "ended_utc": prov.get("ended_utc"),
    }
    return {k: "" if v is None else v for k, v in values.items()}


def csv_rows(data: dict) -> list[dict]:
    out = []
    run = parse(data)
    provenance = _provenance_columns(data)
    timing = run.timing
    for r in run.variant_rows:
        sp = r.speedup or {}
        timed = r.median_s is not None
        out.append(
            {
                "rows": r.rows,
                "cols": r.cols,
                "dtype": r.dtype,
                "backward": r.backward,
                "variant": r.variant,
                "median_s": r.median_s if timed else "",
                # The baseline's speedup over itself is exactly 1; it has no interval.
                "speedup": sp.get("median", 1.0 if (timed and r.baseline) else ""),
                "ci_low": sp.get("low", ""),
                "ci_high": sp.get("high", ""),
                "verdict": r.verdict,
                "achieved_GBps": r.achieved_Bps / 1e9 if r.achieved_Bps else "",
                "fraction_of_copy": "" if r.fraction_of_copy is None else r.fraction_of_copy,
                "passed": r.passed,
                "host_s": "" if r.host_s is None else r.host_s,
                "host_bound": r.host_bound,
                "timing": timing,
                "unsteady": r.unsteady,
                "ci_coverage": ci_label(sp).removesuffix(" CI") if sp else "",
                "ci_method": sp.get("method", ""),
                **provenance,
            }
        )
    return out


def write_csv(path: str | Path, data: dict) -> Path:
    """Written whole or not at all (files.atomic_path)."""
    rows = csv_rows(data)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return Path(path)


# --------------------------------------------------------------------------------------------
# diff: two saved runs, size by size and variant by variant
# --------------------------------------------------------------------------------------------


def _short_speedup(r: VariantRow | None) -> str:
    if r is None or r.median_s is None:
        return "-"
    if r.speedup is None:
        return BASELINE_VERDICT
    sp = r.speedup
    if sp["verdict"] == "no measurable gain":
        return "no gain"
    return speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])[0]


def _versions(run: SavedRun) -> str:
    triton = run.env.get("triton")
    return f"torch {run.env.get('torch')}, triton {triton if triton else 'not installed'}"


def _describe(run: SavedRun) -> str:
    return f"{run.card}, {_versions(run)}, {run.dtype}, {run.what}, {run.device}, {run.trials} trials"


def format_diff(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Compare two saved runs (two cards, or before and after a change) size by size, variant by
    variant: the ratio of medians B/A with a bootstrap CI, and whether the difference is measurable."""
    ra, rb = parse(a, names[0]), parse(b, names[1])
    lines = [
        "=== diff: time ratio B/A per size and variant (below 1: B is faster) ===",
        f"A: {names[0]} ({_describe(ra)})",
        f"B: {names[1]} ({_describe(rb)})",
    ]
    differs = [
        f"{what} ({x} vs {y})"
        for what, x, y in [
            ("dtype", ra.dtype, rb.dtype),
            ("pass", ra.what, rb.what),
            ("device", ra.device, rb.device),
            ("timing", ra.timing, rb.timing),
        ]
        if x != y
    ]
    if differs:
        lines.append(f"note: A and B differ in {', '.join(differs)}: the times are not like for like")
    changed = [f"{x} -> {y}" for x, y in [(ra.card, rb.card), (_versions(ra), _versions(rb))] if x != y]
    if changed:
        lines.append(f"from A to B: {'; '.join(changed)}")
    index_a = {(r.size, r.variant): r for r in ra.variant_rows}
    index_b = {(r.size, r.variant): r for r in rb.variant_rows}
    keys = list(dict.fromkeys([*index_a, *index_b]))
    header = ["size", "variant", "median A", "median B", "B/A (95% CI)", "verdict", "speedup A -> B"]
    body = []
    only: dict[str, dict[str, list[str]]] = {"A": {}, "B": {}}  # side -> size -> labels
    last = None
    for key in keys:
        x, y = index_a.get(key), index_b.get(key)
        if x is None or y is None:
            side, r = ("A", x) if y is None else ("B", y)
            only[side].setdefault(_size(*r.size), []).append(r.label)
            continue
        cells = [
            _size(*x.size) if x.size != last else "",
            x.label,
            fmt_time(x.median_s).strip() if x.median_s is not None else "-",
            fmt_time(y.median_s).strip() if y.median_s is not None else "-",
        ]
        last = x.size
        if x.median_s is None or y.median_s is None:
            cells += ["-", "not timed in both runs"]
        elif len(x.times_s) >= 2 and len(y.times_s) >= 2:
            ratio = time_ratio_ci(x.times_s, y.times_s)
            cells += [f"{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f})", ratio.verdict]
        else:
            cells += [f"{y.median_s / x.median_s:.2f}x", "no per-trial times saved: cannot tell"]
        cells.append(f"{_short_speedup(x)} -> {_short_speedup(y)}")
        body.append(cells)
    lines.append(
        render_table(header, body, right={2, 3}, markdown=False) if body else "no size and variant in common"
    )
    for side, items in only.items():
        if items:
            lines.append(
                f"only in {side}: "
                + "; ".join(f"{size} ({', '.join(labels)})" for size, labels in items.items())
            )
    lines.append(
        "B/A: median(B) / median(A), 95% CI from a bootstrap resampling each run's trials on its own; "
        "the two runs were not interleaved, so drift between them (clocks, heat, other work) is not in "
        "the CI: treat a small measurable difference with care"
    )
    for side, run in (("A", ra), ("B", rb)):
        lines += [f"{side}: {warning}" for warning in timing_warnings(run)]
    return "\n".join(lines)
