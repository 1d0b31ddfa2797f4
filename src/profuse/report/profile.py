"""Part A as text: the lab's operator table, then its reading, and eager beside compiled."""

from __future__ import annotations

from pathlib import Path

from profuse.attribution import BACKWARD, FORWARD, OPTIMIZER
from profuse.bench.stats import bound, steadiness, unsteady_warning
from profuse.errors import UsageError
from profuse.profiling import CATEGORIES, CATEGORY_LABELS, OPTIONAL_CATEGORIES, SUMMARY_KIND, ProfileResult
from profuse.report.units import fmt_bytes

PERFETTO = "https://ui.perfetto.dev"
W = 34  # label column: fits "elementwise + norm (memory-bound)"
# The saved Part A summaries (part_a_file): one process's, and a DDP job's (distributed.SUMMARY_NAME).
PROFILE_SUMMARY, DDP_SUMMARY = "profile.json", "profile_ddp.json"


def category_line(label: str, pct: float) -> str:
    """One row of the time-by-category table: the label, its share, a bar of one # per 2%."""
    return f"{label:>{W}}  {pct:5.1f}%  {'#' * round(pct / 2)}"


def _shown_path(path: str) -> str:
    """'./trace.json' for a path relative to the current folder, as the lab prints it."""
    p = Path(path)
    return str(p) if p.is_absolute() or str(p).startswith(".") else f"./{p}"


def _steps(n: int) -> str:
    return f"{n} training step" + ("" if n == 1 else "s")


def _device_label(r: ProfileResult) -> str:
    """'cuda', 'cuda, torch.compile', 'cuda, bf16' (the precision where profuse built the step)."""
    kind = r.device.split(":", 1)[0]
    parts = [kind, "torch.compile"] if r.compiled else [kind]
    precision = r.about.get("precision")
    return ", ".join(parts + ([precision] if precision else []))


def _per_step(r: ProfileResult) -> str:
    s = r.summary
    if s.launch_unit == "kernels":
        return f"{s.launches_per_step:.0f} kernels launched per step"
    return f"{s.launches_per_step:.0f} aten operator calls per step (the CPU's stand-in for kernels)"


def step_time_warnings(results: dict[str, ProfileResult]) -> list[str]:
    """The unsteady-timings warning (bench.stats's one rule) on the profiled steps' median, where
    their times swung; none where they held."""
    counts = {name: steadiness([t / 1e3 for t in r.step_times_ms]) for name, r in results.items()}
    counts = {name: st for name, st in counts.items() if st is not None}
    if not any(st.unsteady for st in counts.values()):
        return []
    return [
        unsteady_warning(counts, "Part A step time")
        + ". On a quiet machine (or with --threads 1 on a busy CPU), profile it again, with more "
        "--profile-steps"
    ]


def format_profile(r: ProfileResult, saved: bool = False) -> str:
    """The lab's 'Part A' block, then step time, category and phase shares, launches, idle share,
    the launch-bound verdict, and the fusion candidates by structure. `saved`: printed again from
    profile.json, so the trace was written then, not now."""
    s = r.summary
    lines = [f"=== Part A: top operators over {_steps(r.steps)} ({_device_label(r)}) ==="]
    what = r.about.get("describe")
    if what:
        lines.append(f"profiled: {what}")
    lines += [
        r.table.rstrip(),
        "",
        f"step time: median {r.step_ms:.3f} ms over {r.steps} steps ({r.precision}, synchronised, "
        "under the profiler)",
        *step_time_warnings({"step": r}),
        f"time by category ({s.basis}, {s.total_us / 1e3 / max(s.steps, 1):.3f} ms per step):",
    ]
    for cat in CATEGORIES:
        if cat in OPTIONAL_CATEGORIES and not s.shares.get(cat):  # a dense model's, or an older file's
            continue
        lines.append(category_line(CATEGORY_LABELS[cat], s.shares[cat]))
    if s.phase_pct:
        phases = ", ".join(f"{p} {s.phase_pct.get(p, 0.0):.1f}%" for p in (FORWARD, BACKWARD, OPTIMIZER))
        lines.append(f"phases: {phases} (backward: autograd's nodes; optimizer: torch's Optimizer ranges)")
    if s.label_pct:
        lines.append("your ranges: " + ", ".join(f"{name} {pct:.1f}%" for name, pct in s.label_pct.items()))
    lines.append(_per_step(r))
    if s.gpu_idle_pct is not None:
        lines.append(f"GPU idle: {s.gpu_idle_pct:.1f}% of the step (no kernel, memcpy or memset running)")
    if s.launch_bound:
        lines.append(f"launch-bound: {s.launch_bound_reading()}")
    elif s.gpu_idle_pct is not None:  # the one rule of bench.stats.bound; a profile has no held host time
        b = bound(s.gpu_idle_pct, None, False, None)
        lines.append(
            f"bound: {b.word} ({b.why})" if b.word else f"bound: not known from the profile ({b.why})"
        )
    if s.candidates and not r.compiled:
        lines += format_candidates(r)
    lines.append(f"hot spot: {r.hotspot}")
    size = fmt_bytes(r.trace_bytes, digits=1)
    what = "trace (written by that run)" if saved else "trace written"
    lines.append(f"{what}: {_shown_path(r.trace_path)} ({size}) - open it at {PERFETTO}")
    return "\n".join(lines)


CANDIDATE_W = 30  # the candidate column: fits "q/k norm (in attention)"
SHOWN_PCT = 0.05  # candidates under this share of the step are counted, not listed
_NODE_PREFIX = "autograd::engine::evaluate_function: "


def _op_name(op: str) -> str:
    """An op as the table shows it: autograd's engine range as its node ('MulBackward0 (engine)')."""
    return f"{op.removeprefix(_NODE_PREFIX)} (engine)" if op.startswith(_NODE_PREFIX) else op


def format_candidates(r: ProfileResult) -> list[str]:
    """The fusion candidates as a table: share, Amdahl ceiling, the profuse op, the largest ops."""
    s = r.summary
    where = "the module that issued the work" if s.structured else "op names (no module ranges in the trace)"
    lines = [
        f"fusion candidates, by {where} (share of the {s.basis}; ceiling = 1 / (1 - share), that "
        "time's speed-up were the work free):"
    ]
    if s.launch_bound:
        lines.append("  (launch-bound: these shorten the kernels' time, not the step's)")
    lines.append(
        f"  {'candidate':<{CANDIDATE_W}}  {'share':>6}  {'ceiling':>7}  {'profuse op':<20}  largest ops"
    )
    notes = []
    shown = [c for c in s.candidates if c.pct >= SHOWN_PCT]
    for c in shown:
        name = c.name if len(c.name) <= CANDIDATE_W else c.name[: CANDIDATE_W - 3] + "..."
        ops = ", ".join(f"{_op_name(op)} {pct:.1f}%" for op, pct in list(c.ops.items())[:3])
        op = c.covered_by or "none yet"
        lines.append(f"  {name:<{CANDIDATE_W}}  {c.pct:5.1f}%  {c.ceiling:6.2f}x  {op:<20}  {ops}")
        if c.note:
            notes.append(f"  {c.name}: {c.note}")
    rest = s.candidates[len(shown) :]
    if rest:
        names = ", ".join(c.name for c in rest)
        lines.append(f"  (under {SHOWN_PCT}% each: {names})")
    return lines + notes


def format_profile_comparison(eager: ProfileResult, compiled: ProfileResult) -> str:
    """Eager and torch.compile side by side: step time, kernels (operators) per step, shares."""
    unit = eager.summary.launch_unit
    lines = [
        f"=== Part A: eager vs torch.compile, {_steps(eager.steps)} ({eager.device}) ===",
        f"{'':>{W}}  {'eager':>12}  {'torch.compile':>14}",
    ]

    def row(label: str, a: str, b: str, note: str = "") -> None:
        lines.append(f"{label:>{W}}  {a:>12}  {b:>14}{note}")

    ratio = eager.step_ms / compiled.step_ms if compiled.step_ms > 0 else float("nan")
    row(
        "step time (median)",
        f"{eager.step_ms:.3f} ms",
        f"{compiled.step_ms:.3f} ms",
        f"   eager / compiled = {ratio:.2f}x",
    )
    lines += step_time_warnings({"eager": eager, "compiled": compiled})
    row(
        f"{unit} per step",
        f"{eager.summary.launches_per_step:.0f}",
        f"{compiled.summary.launches_per_step:.0f}",
    )
    if eager.summary.gpu_idle_pct is not None and compiled.summary.gpu_idle_pct is not None:
        row(
            "GPU idle, % of the step",
            f"{eager.summary.gpu_idle_pct:.1f}%",
            f"{compiled.summary.gpu_idle_pct:.1f}%",
        )
        bound = [name for name, r in (("eager", eager), ("compiled", compiled)) if r.summary.launch_bound]
        if bound:
            lines.append(
                f"{'':>{W}}  launch-bound ({' and '.join(bound)}): the GPU waits for the CPU most of "
                "the step; fewer launches help it, faster kernels do not"
            )
    lines.append(f"{'share of ' + eager.summary.basis:>{W}}")
    for cat in CATEGORIES:
        if cat in OPTIONAL_CATEGORIES and not (eager.shares.get(cat) or compiled.shares.get(cat)):
            continue
        row(CATEGORY_LABELS[cat], f"{eager.shares[cat]:.1f}%", f"{compiled.shares[cat]:.1f}%")
    traces = f"{_shown_path(eager.trace_path)}, {_shown_path(compiled.trace_path)}"
    lines.append(why_compiled_differs(eager, compiled, ratio))
    lines.append(f"traces: {traces} - open them at {PERFETTO}")
    return "\n".join(lines)


def _ms_per_step(r: ProfileResult, category: str) -> float:
    s = r.summary
    return s.total_us * s.shares.get(category, 0.0) / 100.0 / 1e3 / max(s.steps, 1)


def why_compiled_differs(eager: ProfileResult, compiled: ProfileResult, ratio: float) -> str:
    """What the eager / compiled ratio comes with, read off the two profiles: the launches and the
    memory-bound work, in time a step and as a share of each step's own time."""
    unit = eager.summary.launch_unit
    fewer = f"{eager.summary.launches_per_step:.0f} -> {compiled.summary.launches_per_step:.0f} {unit} a step"
    before, after = _ms_per_step(eager, "memory_bound"), _ms_per_step(compiled, "memory_bound")
    share_before, share_after = eager.shares["memory_bound"], compiled.shares["memory_bound"]
    memory = (
        f"memory-bound work {before:.3f} -> {after:.3f} ms a step ({share_before:.1f}% -> "
        f"{share_after:.1f}% of each step's {eager.summary.basis})"
    )
    if after < before and share_after > share_before:
        memory += ": it shrank, but less than the rest of the step did"
    elif after >= before:
        memory += ": fusion did not shrink it here"
    if ratio >= 1.0:
        return f"why: torch.compile fused the step into fewer kernels ({fewer}); {memory}"
    # Slower compiled: the compiled step pays for guard checks, runtime wrappers and graph breaks
    # around each compiled graph, which at a small size outweigh what fusion saves.
    where = "on a CPU" if eager.device.startswith("cpu") else "on this GPU"
    model = eager.about.get("model", {}).get("model", "gpt")
    sizes = "--d-model, --seq-len, --batch-size" if model == "gpt" else "--preset, --seq-len, --batch-size"
    return (
        f"why slower: torch.compile fused the step into fewer kernels ({fewer}); {memory}; the "
        "compiled step adds costs of its own (guard checks and runtime wrappers around each compiled "
        f"graph, forward and backward, and any graph breaks); {where} at this model size they can "
        f"outweigh what fusion saves, and a larger model ({sizes}) gives fusion more to save"
    )


# --------------------------------------------------------------------------------------------
# A saved summary, printed again by `profuse report`
# --------------------------------------------------------------------------------------------


def part_a_file(data) -> str | None:
    """'profile.json' or 'profile_ddp.json' when `data` is a saved Part A summary, else None.

    By shape as well as by kind: files written before profile.json had a kind are read too.
    """
    if not isinstance(data, dict):
        return None
    eager = data.get("eager")
    if data.get("kind") == SUMMARY_KIND or (isinstance(eager, dict) and "table" in eager):
        return PROFILE_SUMMARY
    if "ranks" in data and "world_size" in data:
        return DDP_SUMMARY
    return None


def format_saved_profile(data: dict, source: str) -> str:
    """A saved profile.json as its run printed it; UsageError if malformed (a profile_ddp.json:
    report.distributed.format_saved_ddp_profile)."""
    try:
        runs = data["runs"].values() if "runs" in data else [data]  # --precision both: one a precision
        texts = []
        for run in runs:
            eager = ProfileResult.from_dict(run["eager"])
            text = format_profile(eager, saved=True)
            if run.get("compiled"):
                text += "\n\n" + format_profile_comparison(eager, ProfileResult.from_dict(run["compiled"]))
            texts.append(text)
        return "\n\n".join(texts)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UsageError(f"{source} is a malformed Part A summary ({type(err).__name__}: {err})") from None
