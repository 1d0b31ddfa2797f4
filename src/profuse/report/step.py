"""Part C as text: the step of every variant, and Amdahl's prediction beside the measured gain.

Everything here reads the saved JSON shape (`StepResult.to_dict()`), so `profuse report step.json`
prints a run saved on another card exactly as the run printed it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from profuse.bench.stats import FEW_TRIALS, STATISTIC, steadiness, time_ratio_ci, unsteady_warning
from profuse.bench.timing import WARMUP_BUDGET_S, warmup_warning
from profuse.env import card_name, describe
from profuse.errors import UsageError
from profuse.report.stepchecks import (
    amdahl_lines,
    first_step_in_table,
    first_step_line,
    full_check_lines,
    memory_note,
    small_check_lines,
    speedup_words,
    weights_line,
)
from profuse.report.sweep import (
    few_trials_note,
    interpreter_note,
    render_table,
    threads_flag,
    threads_note,
    warmup_line,
)
from profuse.report.units import fmt_bytes, fmt_time, speedup_terms, time_unit

W = 14  # variant column: fits "compile+fused"
KIND = "step"
FUSED_VARIANTS = ("fused", "compile+fused")  # the variants that swap in the fused block ops
# The model flags of `profuse step`, by the field of the saved model config they set.
MODEL_FLAGS = {
    "n_layer": "--layers", "d_model": "--d-model", "n_head": "--heads", "vocab_size": "--vocab-size",
    "seq_len": "--seq-len", "batch_size": "--batch-size",
}  # fmt: skip

LIGER_LOSS_NOTE = (
    "liger's loss is the model's own through Liger's fused linear cross-entropy (labels = the input "
    "tokens, shifted inside: B x (T - 1) tokens, no logits materialised); the other variants compute "
    "profuse's over B x T from the logits. Its first step is compared with eager computing that same loss"
)


def load_step(path: str | Path) -> dict | None:
    """The data of a saved Part C run, or None where `path` is anything else (unreadable, not JSON,
    another kind of results): the other readers then say what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == KIND else None


def _speedup(sp: dict | None) -> str:
    return speedup_words(sp)


def _is_hf(data: dict) -> bool:
    """A Hugging Face model's run (files written before --model are the built-in GPT's)."""
    return data["config"].get("model_arg", "gpt").startswith("hf:")


def _model_line(data: dict) -> str:
    cfg = data["config"]
    m = cfg["model"]
    tokens = data["tokens_per_step"]
    if _is_hf(data):
        tied = ", tied embeddings" if m.get("tie_weights") else ""
        return (
            f"model: {cfg['model_arg']} {cfg['preset']} (transformers' own class, random weights): "
            f"{m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads ({m['n_kv_head']} KV, "
            f"head dim {m['head_dim']}), ffn {m['ffn_hidden']}, vocab {m['vocab_size']}{tied}; "
            f"{m['batch_size']} x {m['seq_len']} = {tokens} tokens a step; "
            f"{data['n_params'] / 1e6:.1f}M parameters; {cfg['precision']}"
        )
    return (
        f"model: {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, ffn {m['ffn_hidden']}, "
        f"vocab {m['vocab_size']}; {m['batch_size']} x {m['seq_len']} = {tokens} tokens a step; "
        f"{data['n_params'] / 1e6:.1f}M parameters; {cfg['precision']}"
    )


def _table(data: dict) -> list[str]:
    cmp = data["comparison"]
    results = data["results"]
    cuda = data["config"]["device"].startswith("cuda")
    profiles, memory, firsts = data["profiles"], data["memory"], data["first_steps"]
    unit = time_unit(results[cmp["baseline"]]["median_s"])
    launches = next((p["launch_unit"] for p in profiles.values()), "kernels")
    header = f"{'variant':>{W}}  {'median':>10}  {'vs eager (95% CI)':<38}"
    if cuda:
        header += f"  {'host':>10}"
    old_first = first_step_in_table(data)  # dropped since the full-size check (first_step_line)
    if old_first:
        header += f"  {'first step':>10}"
    if cuda:
        header += f"  {'peak memory':>11}"
    if profiles:
        header += f"  {launches + '/step':>14}  {'memory-bound':>12}"
        if cuda:
            header += f"  {'GPU idle':>8}"
    lines = [header]
    for name, r in results.items():
        row = f"{name:>{W}}  {fmt_time(r['median_s'], unit):>10}  "
        row += f"{_speedup(r['speedup']) if r['speedup'] else 'baseline':<38}"
        if cuda:
            host = r["host_s"]
            row += f"  {fmt_time(host, unit) if host is not None else '-':>10}"
        if old_first:
            row += f"  {fmt_time(firsts[name]['seconds']).strip():>10}"
        if cuda:
            mem = memory.get(name)
            row += f"  {fmt_bytes(mem['peak_bytes']) if mem else '-':>11}"
        p = profiles.get(name)
        if profiles:
            row += (
                f"  {p['launches_per_step']:>14.0f}  {p['memory_bound_pct']:>11.1f}%" if p else f"  {'-':>14}"
            )
            if cuda and p and p["gpu_idle_pct"] is not None:
                row += f"  {p['gpu_idle_pct']:>7.1f}%"
        if r["host_bound"]:
            row += "  host-bound"
        lines.append(row.rstrip())
    return lines


def again_command(data: dict) -> str:
    """The `profuse step` command that times a saved Part C run again (at least FEW_TRIALS trials,
    into a folder of its own), with a thread count that suits the CPU it ran on."""
    cfg = data.get("config") or {}
    argv = ["profuse", "step", "--device", str(cfg.get("device", "auto")).split(":", 1)[0]]
    if cfg.get("preset"):
        argv += ["--preset", str(cfg["preset"])]
    if cfg.get("resized"):
        for field, flag in MODEL_FLAGS.items():
            if field in (cfg.get("model") or {}):
                argv += [flag, str(cfg["model"][field])]
    if cfg.get("variants"):
        argv += ["--variants", ",".join(cfg["variants"])]
    argv += ["--trials", str(max(int(cfg.get("trials", FEW_TRIALS)), FEW_TRIALS))]
    argv += ["--seed", str(cfg["seed"])] if cfg.get("seed") else []
    argv += threads_flag(data.get("env") or {})
    return shlex.join([*argv, "--out", "again"])


def _counts(comparison: dict | None) -> dict:
    """variant -> Steadiness of a saved comparison's trials."""
    timings = (comparison or {}).get("timings") or {}
    return {name: steadiness(t["times_s"]) for name, t in timings.items() if t.get("times_s")}


def _unsteady(comparison: dict | None) -> list[str]:
    return [name for name, st in _counts(comparison).items() if st.unsteady]


def step_warnings(data: dict) -> list[str]:
    """What makes the step's numbers less than they look: unsteady trials (of the steps, or of
    the ops Amdahl reads), warm-ups out of budget, an oversubscribed CPU."""
    cmp = data.get("comparison")
    out = []
    counts = _counts(cmp)
    if any(st.unsteady for st in counts.values()):
        out.append(unsteady_warning(counts, "step", again_command(data)))
    for op, timing in (data.get("ops") or {}).items():
        op_counts = _counts(timing.get("comparison"))
        if any(st.unsteady for st in op_counts.values()):
            out.append(unsteady_warning(op_counts, f"op {op}", again_command(data)))
    budget = (cmp or {}).get("warmup_budget_s", WARMUP_BUDGET_S)
    for name, t in ((cmp or {}).get("timings") or {}).items():
        if not t.get("warmup_steady", True):
            out.append(warmup_warning(name, t.get("warmup_calls", 0), budget))
    return out + threads_note(data.get("env") or {})


def _amdahl_caveat(data: dict) -> list[str]:
    """The line under Amdahl's prediction where a median it rests on was unsteady."""
    shaky = [f"the {name} step" for name in _unsteady(data.get("comparison")) if name in ("eager", "fused")]
    for op, timing in (data.get("ops") or {}).items():
        shaky += [f"{op} ({name})" for name in _unsteady(timing.get("comparison"))]
    if not shaky:
        return []
    return [
        f"  the prediction and the measured gain rest on unsteady medians ({', '.join(shaky)}): "
        "see the WARNING above; time it again before reading them"
    ]


def format_step(data: dict) -> str:
    """Part C's block: the setup, the same-math check, the step table, the Amdahl prediction."""
    cfg = data["config"]
    kind = cfg["device"].split(":", 1)[0]
    if _is_hf(data):
        title = (
            f"=== Part C: the whole training step of {cfg['model_arg']} {cfg['preset']}, eager vs fused vs "
            f"Liger-Kernel vs torch.compile ({kind}) ==="
        )
    else:
        resized = ", resized by the model flags" if cfg.get("resized") else ""
        title = (
            "=== Part C: the whole training step, eager vs fused vs torch.compile "
            f"({kind}, preset {cfg['preset']}{resized}) ==="
        )
    lines = [
        title,
        _model_line(data),
    ]
    asked = cfg.get("variants") or list(data.get("results") or {})
    if any(name in FUSED_VARIANTS for name in asked):  # none asked for: nothing fused to name
        lines.append(f"fused block ops: {data['block_ops']} (silu_mul on the packed gate/up, add_rms_norm)")
    lines += small_check_lines(data)
    for name, c in data.get("checks", {}).items():
        lines += small_check_lines(data, c, name)
    lines += full_check_lines(data)
    for name, why in data["skipped"].items():
        lines.append(f"{name:>{W}}: skipped ({why})")
    for name, why in data["failed"].items():
        lines.append(f"{name:>{W}}: FAILED, not timed ({why})")
    cmp = data["comparison"]
    lines.append("")
    if cmp is None:
        lines.append("nothing timed: the eager step did not run")
        return "\n".join(lines)
    how = (
        "steps back to back as a training loop runs them, each trial the median of 3"
        if cmp["timing"] == "loop"
        else "wall clock"
    )
    lines.append(f"step time: {cmp['trials']} interleaved trials, {how} ({cmp['timer']})")
    lines += _table(data)
    over = data.get("fusion_over_compile")
    if over:
        lines.append(
            f"{'':>{W}}  fusion on top of torch.compile (compile+fused vs compile): {_speedup(over)}"
        )
    notes = [f"statistic: {STATISTIC}"]
    if kind == "cuda":
        notes.append("host = CPU time to issue one step; " + memory_note(data))
    else:
        notes.append("peak memory: not measured on a CPU (torch.cuda.max_memory_allocated is CUDA's)")
    if data["profiles"]:
        basis = next(iter(data["profiles"].values()))["basis"]
        notes.append(f"per step and memory-bound share: from a short profile of each variant ({basis})")
    triton_ops = "Triton" in data["block_ops"]  # not the eager stand-ins (fusion.EAGER)
    fused_timed = [n for n in ("fused", "compile+fused") if triton_ops and n in data["results"]]
    warmed = {name: t["warmup_calls"] for name, t in cmp["timings"].items() if "warmup_calls" in t}
    if warmed:
        notes.append(warmup_line(warmed).replace("calls", "steps"))
    notes += [line for line in (first_step_line(data), weights_line(data)) if line]
    if "liger" in data["results"]:
        notes.append(LIGER_LOSS_NOTE)
    lines += notes + few_trials_note(cmp["trials"]) + interpreter_note(data["env"], fused_timed)
    lines += step_warnings(data)
    amdahl = amdahl_lines(data)
    if amdahl:
        lines.append("")
        lines += amdahl + _amdahl_caveat(data)
    elif data.get("amdahl_note"):
        lines += ["", data["amdahl_note"]]
    traces = [p["trace_path"] for p in data["profiles"].values()]
    if traces:
        lines.append(f"traces: {', '.join(traces)} - open them at https://ui.perfetto.dev")
    lines += ["", verdict_line(data)]
    env = data["env"]
    lines.append(describe(env))
    return "\n".join(line.rstrip() if line else line for line in lines)


# --------------------------------------------------------------------------------------------
# diff: two saved Part C runs, variant by variant
# --------------------------------------------------------------------------------------------


def _setup(data: dict) -> str:
    cfg, env = data.get("config") or {}, data.get("env") or {}
    triton = env.get("triton") or "not installed"
    trials = (data.get("comparison") or {}).get("trials", cfg.get("trials"))
    return (
        f"{card_name(env)}, torch {env.get('torch')}, triton {triton}, preset {cfg.get('preset')}, "
        f"{cfg.get('precision')}, {cfg.get('device')}, {trials} trials"
    )


def _short(sp: dict | None) -> str:
    if not sp:
        return "baseline"
    if sp["verdict"] == "no measurable gain":
        return "no gain"
    return speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])[0]


def format_step_diff(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two saved Part C runs (two cards, or before and after a change) variant by variant: the
    ratio of step medians B/A with a bootstrap CI over each run's saved trials."""
    for data, name in ((a, names[0]), (b, names[1])):
        if not (data.get("comparison") or {}).get("timings"):
            raise UsageError(f"{name} timed no step (its eager step did not run): nothing to compare")
    lines = [
        "=== diff: step time ratio B/A per variant (below 1: B is faster) ===",
        f"A: {names[0]} ({_setup(a)})",
        f"B: {names[1]} ({_setup(b)})",
    ]
    ca, cb = a.get("config") or {}, b.get("config") or {}
    differs = [
        what
        for what, key in (("model", "model"), ("device", "device"), ("precision", "precision"))
        if ca.get(key) != cb.get(key)
    ]
    if differs:
        lines.append(f"note: A and B differ in {', '.join(differs)}: the steps are not like for like")
    ta, tb = a["comparison"]["timings"], b["comparison"]["timings"]
    ra, rb = a.get("results") or {}, b.get("results") or {}
    unit = time_unit(ta[next(iter(ta))]["median_s"])
    header = ["variant", "median A", "median B", "B/A (95% CI)", "verdict", "vs eager A -> B"]
    body = []
    for name in [n for n in ta if n in tb]:
        x, y = ta[name], tb[name]
        cells = [name, fmt_time(x["median_s"], unit).strip(), fmt_time(y["median_s"], unit).strip()]
        if len(x.get("times_s", [])) >= 2 and len(y.get("times_s", [])) >= 2:
            r = time_ratio_ci(x["times_s"], y["times_s"])
            cells += [f"{r.median:.2f}x ({r.low:.2f}-{r.high:.2f})", r.verdict]
        else:
            cells += [f"{y['median_s'] / x['median_s']:.2f}x", "no per-trial times saved: cannot tell"]
        sa, sb = (ra.get(name) or {}).get("speedup"), (rb.get(name) or {}).get("speedup")
        cells.append(f"{_short(sa)} -> {_short(sb)}")
        body.append(cells)
    lines.append(render_table(header, body, right={1, 2}, markdown=False) if body else "no variant in common")
    for side, only in (("A", [n for n in ta if n not in tb]), ("B", [n for n in tb if n not in ta])):
        if only:
            lines.append(f"only in {side}: {', '.join(only)}")
    lines.append(
        "B/A: median(B) / median(A) of whole steps, 95% CI from a bootstrap resampling each run's trials "
        "on its own; the two runs were not interleaved, so drift between them (clocks, heat, other "
        "work) is not in the CI: treat a small measurable difference with care"
    )
    for side, data in (("A", a), ("B", b)):
        lines += [f"{side}: {warning}" for warning in step_warnings(data)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The verdict: which variant wins this step, and why
# --------------------------------------------------------------------------------------------


def step_bound(data: dict) -> tuple[str, str]:
    """What bounds the eager step: ('device-bound' | 'host-bound' | 'launch-bound' | '', the
    evidence). From the eager profile's GPU idle share (over profiling.LAUNCH_BOUND_IDLE_PCT:
    launch-bound) and the harness's host time per step against the profile's kernel time per step
    (host over device: host-bound); '' where neither was measured."""
    eager = data["results"][data["comparison"]["baseline"]]
    profile = data["profiles"].get("eager")
    if not data["config"]["device"].startswith("cuda"):
        return "host-bound", "on a CPU the whole step is host time"
    if profile and profile["launch_bound"]:
        return "launch-bound", f"the GPU idles {profile['gpu_idle_pct']:.0f}% of it, waiting for launches"
    host = eager["host_s"]
    device = profile["time_per_step_us"] * 1e-6 if profile and profile["basis"] == "GPU kernel time" else None
    if host is not None and device is not None:
        terms = f"the CPU issues it in {fmt_time(host).strip()}, its kernels take {fmt_time(device).strip()}"
        return ("host-bound", terms) if host >= device else ("device-bound", terms)
    if eager["host_bound"]:
        return "host-bound", "its host time is within 10% of its time a step"
    if profile and profile["gpu_idle_pct"] is not None:
        return "device-bound", f"the GPU idles only {profile['gpu_idle_pct']:.0f}% of it"
    return "", "no profile to say what bounds it (--profile-steps 0)"


def _how(data: dict, winner: str, bound: str) -> str:
    """What the winner changes that matters for a step so bound."""
    if winner == "cudagraphs":
        return "it replays the step's kernels from CUDA graphs, so the CPU no longer issues them one by one"
    p, e = data["profiles"].get(winner), data["profiles"].get("eager")
    if not (p and e):
        return "no profile of it to say how (--profile-steps 0)"
    unit = e["launch_unit"]
    launches = f"{e['launches_per_step']:.0f} -> {p['launches_per_step']:.0f} {unit} a step"
    if bound in ("launch-bound", "host-bound"):
        return f"it issues less a step ({launches}), which is what shortens a {bound} step"
    before, after = (fmt_time(x["time_per_step_us"] * 1e-6).strip() for x in (e, p))
    work = f"{before} -> {after}"
    return (
        f"its kernels take less time ({work} of {e['basis']} a step; memory-bound share "
        f"{e['memory_bound_pct']:.0f}% -> {p['memory_bound_pct']:.0f}%; {launches})"
    )


def verdict_line(data: dict) -> str:
    """'VERDICT: compile wins this step, 1.31x (1.28-1.35) faster than eager; the step is
    device-bound (...): ...', or 'no measurable difference' where every CI straddles 1."""
    if data.get("comparison") is None:
        return ""
    speedups = {n: r["speedup"] for n, r in data["results"].items() if r["speedup"]}
    if not speedups:
        return "VERDICT: only eager was timed: nothing to referee"
    bound, evidence = step_bound(data)
    step = (
        f"the eager step is {bound} ({evidence})"
        if bound
        else f"what bounds the eager step is not known ({evidence})"
    )
    faster = {n: sp for n, sp in speedups.items() if sp["low"] > 1.0}
    if faster:
        winner = max(faster, key=lambda n: faster[n]["median"])
        sp = faster[winner]
        ratio, ci = speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])
        others = [f"{n} {s['median']:.2f}x" for n, s in sorted(faster.items(), key=lambda x: -x[1]["median"])]
        runner = f" (next: {', '.join(others[1:])})" if len(others) > 1 else ""
        return (
            f"VERDICT: {winner} wins this step, {ratio} ({ci}) faster than eager{runner}; {step}; "
            f"{_how(data, winner, bound)}"
        )
    slower = sorted(n for n, sp in speedups.items() if sp["high"] < 1.0)
    level = sorted(n for n in speedups if n not in slower)
    if not level:
        return (
            f"VERDICT: eager wins this step: every other variant is measurably slower ({', '.join(slower)}); "
            + step
        )
    tail = f"; {', '.join(slower)} measurably slower" if slower else ""
    return (
        f"VERDICT: no measurable difference: the CIs of {', '.join(level)} against eager straddle 1{tail}; "
        + step
    )
