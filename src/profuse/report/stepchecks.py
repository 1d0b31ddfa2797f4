"""Part C's checks as text: the same math (small and full size), memory, the weights, the first
step, and Amdahl's prediction beside the measured gain.

Everything here reads the saved JSON shape (`StepResult.to_dict()`); files written before a field
existed print what they hold.
"""

from __future__ import annotations

from profuse.report.units import fmt_bytes, fmt_time, speedup_terms

W = 14  # variant column: fits "compile+fused"

# What Liger-Kernel's two variants patch (profuse.models.liger).
LIGER_OPS = {
    "liger-ops": "Liger-Kernel's RMSNorm and SwiGLU",
    "liger": "Liger-Kernel's default patch: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy",
}


def speedup_words(sp: dict | None) -> str:
    """'1.03x (1.02-1.04) faster', '1.33x slower (1.27-1.37)' (the factor it takes longer, its
    interval turned round with it, as every report says a slowdown), or 'no measurable gain'."""
    if not sp:
        return ""
    ratio, ci = speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])
    if sp["verdict"] == "slower":
        return f"{ratio} ({ci})"  # the ratio says it: '1.33x slower'
    return f"{ratio} ({ci}) {sp['verdict']}"


# --------------------------------------------------------------------------------------------
# Same math
# --------------------------------------------------------------------------------------------


def small_check_lines(data: dict, c: dict | None = None, name: str = "") -> list[str]:
    """The small float64 check of the fused variants (or of Liger's variant `name`)."""
    c = c or data.get("check")
    if not c:
        return []
    m = c["model"]
    what = f"{name} ({LIGER_OPS[name]})" if name in LIGER_OPS else name or data["block_ops"]
    head = (
        f"same math ({what} vs the unfused step, both against float64, on a "
        f"{m['n_layer']}-layer copy, {m['batch_size']} x {m['seq_len']} tokens):"
    )
    if c["error"]:
        return [f"{head} FAILED to run: {c['error']}"]
    worst = c["worst"]
    fused, unfused = c["errors"][worst]
    loss_f, loss_u = c["errors"]["loss"]
    status = "ok" if c["passed"] else f"FAILED ({'it is' if name else 'the fused variants are'} not timed)"
    return [
        f"{head} {status}",
        f"{'':>4}worst: {worst} rel err {fused:.1e} (unfused {unfused:.1e}, bound {c['bounds'][worst]:.1e}); "
        f"loss {loss_f:.1e} (unfused {loss_u:.1e}); max |fused - unfused| {c['max_abs_diff']:.1e}",
    ]


def _tensor(c: dict, key: str) -> str:
    err, unfused, bound = c["errors"][key]
    return f"{key} {err:.1e} (unfused {unfused:.1e}, bound {bound:.1e})"


def full_check_lines(data: dict) -> list[str]:
    """The full-size check: one line per variant, its worst tensors against their bounds."""
    checks = data.get("same_math") or {}
    note = data.get("same_math_note") or ""
    if not checks:
        return [note] if note else []
    first = next(iter(checks.values()))
    tokens = data.get("tokens_per_step")
    lines = [
        f"same math at full size ({tokens} tokens, the timed kernels' launch plans): the loss and each "
        f"gradient against the unfused model in {first['reference']}, no autocast; bound per tensor "
        f"max({first['factor']:g} x the unfused step's own error, {first['floor']:.1e})"
    ]
    for name, c in checks.items():
        if c["error"]:
            lines.append(f"{name:>{W}}  FAILED to run: {c['error']}")
            continue
        worst = "; ".join(_tensor(c, k) for k in c["worst"])
        glob = f"all gradients as one vector {c['global_error']:.1e}"
        if name == "eager":
            key = c["worst"][0] if c["worst"] else "loss"
            lines.append(
                f"{name:>{W}}  the unfused step's own: largest {key} {c['errors'][key][0]:.1e}; {glob}"
            )
        else:
            status = "ok" if c["passed"] else "FAILED, not timed"
            lines.append(f"{name:>{W}}  {status}: worst {worst}; {glob}")
    if note:
        lines.append(note)
    return lines


def math_lines(data: dict) -> list[str]:
    """Each variant's row: its math checked or not before it was timed, at which size, against
    what (samemath.MathStatus); files written before the rows existed print nothing here."""
    rows = data.get("math") or {}
    if not rows:
        return []
    lines = [
        "math checked before timing (full size: the timed shapes and batch; small copy: a 2-layer copy):"
    ]
    for name, r in rows.items():
        if not r["checked"]:
            lines.append(
                f"{name:>{W}}  NOT checked ({r['note']})" if r["note"] else f"{name:>{W}}  NOT checked"
            )
            continue
        how = "; ".join(f"{s} against {a}" for s, a in zip(r["sizes"], r["against"]))
        word = "passed" if r["passed"] else "FAILED"
        lines.append(f"{name:>{W}}  {how}: {word}" + (f" ({r['note']})" if r["note"] else ""))
    return lines


def math_mark(data: dict, name: str) -> str:
    """The table's short word for a variant's check: 'full', 'small', 'NO' ('' for old files)."""
    r = (data.get("math") or {}).get(name)
    if not r:
        return ""
    if not r["checked"]:
        return "NO"
    return "full" if "full size" in r["sizes"] else "small"


# --------------------------------------------------------------------------------------------
# First step, memory, weights
# --------------------------------------------------------------------------------------------


def first_step_line(data: dict) -> str:
    """Each variant's first whole step, compilation included: information, not a column."""
    firsts = data.get("first_steps") or {}
    if not firsts:
        return ""
    if first_step_in_table(data):  # a file from before the full-size check: its first-step check
        parts = [
            f"{name}: loss {f['loss_rel_diff']:.1e}, gradients {f['grad_rel_diff']:.1e}"
            for name, f in firsts.items()
            if f.get("grad_rel_diff") is not None
        ]
        return "first step vs eager at this size (relative differences): " + "; ".join(parts) if parts else ""
    order = ", ".join(f"{name} {fmt_time(f['seconds']).strip()}" for name, f in firsts.items())
    return (
        f"first step, compilation included, in run order: {order} (not compared: each variant finds "
        "the caches the ones before it warmed, and the first pays CUDA's start-up)"
    )


def first_step_in_table(data: dict) -> bool:
    """Files from before the first-step column was dropped still show it."""
    return any("grad_rel_diff" in f for f in (data.get("first_steps") or {}).values())


def reserved_accounting(data: dict) -> bool:
    memory = data.get("memory") or {}
    return bool(memory) and all(m.get("accounting") == "reserved" for m in memory.values())


def memory_note(data: dict) -> str:
    """What the peak memory column is (CUDA)."""
    memory = data.get("memory") or {}
    if not reserved_accounting(data):
        note = (
            "peak memory = parameters and AdamW state + the most one step allocates above them "
            "(torch.cuda.max_memory_allocated)"
        )
        if "cudagraphs" in (data.get("results") or {}):
            note += "; cudagraphs' leaves out its CUDA graphs' memory pool, held between steps"
        return note
    m = next(iter(memory.values()))
    allocated = ", ".join(f"{n} {fmt_bytes(v['allocated_bytes'])}" for n, v in memory.items())
    return (
        f"peak memory = the most the allocator reserved (max_memory_reserved, CUDA graph pools included) "
        f"over each variant's own {m['steps']} first whole steps (warm-up, capture, steady), each from an "
        f"emptied allocator (empty_cache, reset_peak_memory_stats) with the shared parameters and AdamW "
        f"state resident ({fmt_bytes(m['resident_bytes'])}, in every figure alike); allocated at peak: "
        f"{allocated}"
    )


def weights_line(data: dict) -> str:
    w = data.get("weights")
    if not w:
        return ""
    held = "unchanged bitwise" if w["unchanged"] else "CHANGED (not bitwise the same)"
    fin = "finite" if w["finite"] else "NOT finite"
    line = (
        f"weights: AdamW at lr 0 through the variants' steps, so each timed the same weights: {held}, {fin}"
    )
    if w["nonfinite"]:
        line += f"; non-finite loss: {', '.join(w['nonfinite'])}"
    return line


# --------------------------------------------------------------------------------------------
# Amdahl
# --------------------------------------------------------------------------------------------


def _spread(op_s) -> tuple[float, float, float]:
    """(median, lowest, highest) of an op's time a profiled step (one float in older files)."""
    ts = op_s if isinstance(op_s, list) else [op_s]
    ts = sorted(ts)
    n = len(ts)
    median = ts[n // 2] if n % 2 else (ts[n // 2 - 1] + ts[n // 2]) / 2
    return median, ts[0], ts[-1]


def amdahl_lines(data: dict) -> list[str]:
    a = data.get("amdahl")
    if not a:
        return []
    eager_profile = data["profiles"].get("eager", {})
    basis = eager_profile.get("basis", "time")
    cuda = data["config"]["device"].startswith("cuda")
    fr = a["fractions"]
    T = a["eager_step_s"]
    steps = max((len(t) for t in a["op_s"].values() if isinstance(t, list)), default=1)
    parts = []
    for op, f in fr.items():
        _, low, high = _spread(a["op_s"][op])
        spread = f" ({100 * low / T:.1f}-{100 * high / T:.1f}%)" if steps > 1 else ""
        parts.append(f"{op} {100 * f:.1f}%{spread}")
    over = f"the median of {steps} profiled eager steps" if steps > 1 else "the eager profile"
    lines = [
        f"Amdahl: the ops fusion replaces take f = {100 * a['f']:.1f}% of the eager step "
        f"({', '.join(parts)}; forward and backward, their {basis} in {over} over the timed eager step)",
    ]
    clock = "device time" if cuda else "wall clock"
    if a["op_speedups"]:
        lines.append(
            f"  their speedups, fused vs eager in the step's call forms, shapes and dtypes, forward + "
            f"backward, {clock}:"
        )
        for op, sp in a["op_speedups"].items():
            shape = data["ops"].get(op, {}).get("shape", "")
            lines.append(f"  {op:>20}  {shape:<48}  {speedup_words(sp)}")
    for op, why in (a.get("not_timed") or {}).items():
        lines.append(f"  {op:>20}  not timed: {why}")
    check = a.get("in_step_check") or {}
    if check:
        each = "; ".join(
            f"{op} {fmt_time(c['alone_s']).strip()} alone, {fmt_time(c['in_step_s']).strip()} in the step "
            f"({c['ratio']:.2f}x)"
            for op, c in check.items()
        )
        lines.append(f"  the eager ops a call, alone vs inside the eager step (its trace): {each}")
    pred = a["predicted"]
    if pred:
        ops_only = ""
        if "ops_low" in pred:
            ops_only = f"; {pred['ops_low']:.3f}-{pred['ops_high']:.3f} over the ops' CIs alone"
        spread = (
            "the ops' CIs and the shares' spread over the profiled steps"
            if "ops_low" in pred
            else "the ops' CIs"
        )
        lines.append(
            f"  predicted step gain 1 / ((1 - f) + sum f_i / s_i) = {pred['median']:.3f}x "
            f"({pred['low']:.3f}-{pred['high']:.3f} over {spread}{ops_only}); "
            f"at most {a['ceiling']:.3f}x were they free"
        )
        if a.get("disagree") and pred.get("in_step") is not None:
            ops, ratio = ", ".join(a["disagree"]), a["thresholds"]["in_step_ratio"]
            lines.append(
                f"  {ops} alone did not time as in the step (beyond {ratio:g}x): with "
                f"the eager side at its in-step time, s_i x (in-step / alone), the prediction is "
                f"{pred['in_step']:.3f}x"
            )
    else:
        lines.append(
            f"  no op speedups (no fused variant was timed, or an op could not be): at most 1 / (1 - f) = "
            f"{a['ceiling']:.3f}x were those ops free"
        )
    measured = a["measured"]
    if measured:
        lines.append(f"  measured step gain (fused vs eager): {speedup_words(measured)}")
    if pred and measured:
        gap = measured["median"] / pred["median"]
        if measured["high"] < pred["low"]:
            lines.append(
                f"  the step gained less than predicted ({gap:.3f} of it): fusion's savings in device time "
                "do not all reach the step (launches, host time, what else the step waits for)"
            )
        elif measured["low"] > pred["high"]:
            lines.append(
                "  the step gained more than predicted: the fused ops also save what lies outside them "
                "(the dtype casts around them, allocations, launches)"
            )
        else:
            lines.append("  measured and predicted agree within their intervals")
    if a.get("caveat"):
        lines.append(f"  CAVEAT: {a['caveat']}")
    if eager_profile.get("launch_bound"):
        fused_profile = data["profiles"].get("fused")
        saved = ""
        if fused_profile:
            fewer = eager_profile["launches_per_step"] - fused_profile["launches_per_step"]
            saved = f" ({fewer:.0f} fewer kernels a step fused)"
        lines.append(
            f"  the eager step is launch-bound (GPU idle {eager_profile['gpu_idle_pct']:.0f}% of it): its "
            "time is the CPU's launches, not the kernels, so Amdahl on kernel time does not describe it; "
            f"fusion changes it only through the launches it saves{saved}; CUDA graphs or a bigger batch "
            "help more"
        )
    return lines
