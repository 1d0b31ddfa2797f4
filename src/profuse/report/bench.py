"""Part B as text: the lab's lines, then bandwidth, copy ceiling and the CI of every speedup."""

from __future__ import annotations

import math

from profuse.bench.stats import STATISTIC
from profuse.bench.traffic import EAGER_FORWARD_TENSORS
from profuse.env import describe, dtype_name
from profuse.report.sweep import host_note, parse, timing_warnings, warmup_line
from profuse.report.units import fmt_bandwidth, fmt_bytes, fmt_speedup, fmt_time, time_unit

W = 22  # label column, right-aligned as in the lab's output


def format_checks(res) -> str:
    """The lab's 'max |diff| vs eager' lines, with the float64 check beside them."""
    lines = []
    for chk in res.checks.values():
        if chk.error:
            lines.append(f"{chk.label:>{W}}: FAILED to run: {chk.error}")
            continue
        status = "ok" if chk.passed else "FAILED (outside tolerance: not timed)"
        line = (
            f"{chk.label:>{W}}: max |diff| vs eager = {chk.max_diff_vs_eager:.2e}"
            f"   rel err vs float64 {chk.rel_err:.1e} (tol {chk.tol:.0e}) {status}"
        )
        if chk.grad_rel_err:
            worst = max(chk.grad_rel_err.values())
            grads = " ".join(f"{k} {v:.1e}" for k, v in chk.grad_rel_err.items())
            line += f"\n{'':>{W}}  grads rel err vs float64: {grads} (tol {chk.grad_tol:.0e})"
            if not math.isfinite(worst):
                line += " non-finite"
        lines.append(line)
    for key, why in res.skipped.items():
        lines.append(f"{res.labels[key]:>{W}}: skipped ({why})")
    return "\n".join(lines)


def format_tail_bench(res) -> str:
    cfg = res.config
    what = "forward + backward" if cfg.backward else "fused tail"
    timing = f", {cfg.timing} timing" if cfg.device.type == "cuda" else ""
    head = (
        f"=== Part B: {what}, {cfg.rows} x {cfg.cols} {dtype_name(cfg.dtype)} on {cfg.device.type}, "
        f"{cfg.trials} trials{timing} ==="
    )
    tr = res.traffic
    lines = [head, format_checks(res), ""]
    if cfg.backward:
        lines.append(
            f"minimum traffic if fused: forward 3 inputs + 1 output, backward 4 inputs + 3 outputs "
            f"= {fmt_bytes(res.model_bytes)}"
        )
    else:
        lines.append(f"minimum traffic if fused: 3 inputs + 1 output = {fmt_bytes(tr.fused_forward)}")
        lines.append(
            f"eager traffic (estimate): {EAGER_FORWARD_TENSORS} tensor reads and writes, each "
            f"intermediate written and re-read = {fmt_bytes(tr.eager_forward)}"
        )
    ceiling = res.copy_ceiling_Bps
    if ceiling:
        lines.append(
            f"copy ceiling (device-to-device copy, this run): {fmt_bandwidth(ceiling)}"
            f" -> floor {fmt_time(res.model_bytes / ceiling).strip()} for the fused traffic"
        )
    comp = res.comparison
    if comp is None:
        eager = res.checks.get("eager")
        if eager is None or not eager.passed:
            lines.append("nothing timed: the baseline (eager) failed its check")
        else:
            lines.append("nothing timed: no variant besides eager ran and passed its check")
        return "\n".join(lines)
    base_label = res.labels[comp.baseline]
    unit = time_unit(comp.median_s(comp.baseline))
    for key, timing in comp.timings.items():
        label = res.labels[key]
        row = f"{label:>{W}}: median {fmt_time(timing.median_s, unit)}"
        if timing.host_s is not None:
            row += f"  host {fmt_time(timing.host_s, unit)}"
        sp = comp.speedups.get(key)
        row += f"   {fmt_speedup(sp, base_label) if sp else '':<45}"
        bw = res.achieved_Bps(key)
        row += f"  {fmt_bandwidth(bw):>10}"
        if ceiling:
            row += f" ({bw / ceiling:.0%} of copy)"
        if comp.host_bound(key):
            row += "  host-bound"
        lines.append(row.rstrip())
    lines.append(
        f"statistic: {STATISTIC}; bandwidth = minimum fused traffic / median time; "
        f"timer: {comp.timer}{', L2 flushed before each call' if comp.flush_l2 else ''}"
    )
    if any(t.host_s is not None for t in comp.timings.values()):
        lines.append(host_note(comp.timing, comp.trials))
    firsts = ", ".join(f"{res.labels[k]} {t.first_call_s:.2f} s" for k, t in comp.timings.items())
    lines.append(f"first call (compilation, kernel builds): {firsts}")
    lines.append(warmup_line({res.labels[k]: t.warmup_calls for k, t in comp.timings.items()}))
    lines.append(describe(res.env))
    # The warnings `profuse report` gives for this run's file, read the same way from its data.
    lines += timing_warnings(parse(res.to_dict(), "this run"))
    return "\n".join(lines)
