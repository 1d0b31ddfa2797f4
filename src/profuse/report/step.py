"""Part C as text: the step of every variant, and Amdahl's prediction beside the measured gain.

Everything here reads the saved JSON shape (`StepResult.to_dict()`, or with --precision both
`both_precisions`' file of two runs), so `profuse report step.json` prints a run saved on another
card exactly as the run printed it. The verdict's decision is the run's (profuse.verdict: the
file's `verdict`); here it is put in words.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from profuse.bench.clocks import THROTTLE_BITS, ClockSample, throttle_warning
from profuse.bench.stats import (
    FEW_TRIALS,
    OVER_COMPILE,
    STATISTIC,
    Trend,
    steadiness,
    time_ratio_ci,
    trend_warning,
    unsteady_warning,
)
from profuse.bench.timing import WARMUP_BUDGET_S, TrialDesign, steady_rule, warmup_note
from profuse.compiletime import CHECK_SPLIT, CompileSplit
from profuse.env import card_name, describe
from profuse.errors import UsageError
from profuse.report.stepchecks import (
    amdahl_lines,
    first_step_in_table,
    first_step_line,
    full_check_lines,
    math_lines,
    math_mark,
    memory_note,
    small_check_lines,
    speedup_words,
    weights_line,
)
from profuse.report.sweep import (
    ci_terms,
    few_trials_note,
    interpreter_note,
    render_table,
    threads_flag,
    threads_note,
    warmup_line,
)
from profuse.report.units import fmt_bytes, fmt_time, speedup_terms, time_unit
from profuse.verdict import decide

W = 14  # variant column: fits "compile+fused"
KIND = "step"
FUSED_VARIANTS = ("fused", "compile+fused", "compile+loss")  # the variants that swap in fused block ops
SUBSET_VARIANTS = ("compile+loss",)  # those that place some of profuse.fuse's ops, not all
# What each compiled fused variant's ratio over compile (bench.stats.OVER_COMPILE) measures.
OVER_COMPILE_WORDS = {
    "compile+fused": "fusion on top of torch.compile",
    "compile+loss": "the fused loss alone on top of torch.compile",
}
# The model flags of `profuse step`, by the field of the saved model config they set.
MODEL_FLAGS = {
    "n_layer": "--layers", "d_model": "--d-model", "n_head": "--heads", "vocab_size": "--vocab-size",
    "seq_len": "--seq-len", "batch_size": "--batch-size",
}  # fmt: skip

# What Liger-Kernel's two variants patch (profuse.models.liger).
LIGER_OPS = {
    "liger-ops": "Liger-Kernel's RMSNorm and SwiGLU",
    "liger": "Liger-Kernel's default patch: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy",
}
HF_LOSS_NOTE = (
    "loss: the model's own, model(input_ids, labels=input_ids).loss (shifted inside: B x (T - 1) tokens), "
    "in every variant; a fused linear cross-entropy inside the model (Liger's, profuse's) computes it "
    "without the logits"
)


def load_step(path: str | Path) -> dict | None:
    """The data of a saved Part C run, or None where `path` is anything else (unreadable, not JSON,
    another kind of results): the other readers then say what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == KIND else None


def _idle(profile: dict) -> float | None:
    """A variant's GPU idle share: its unsynchronised steps' where they match the timed loop,
    none where they do not (steady_lines says so), the synchronised step's in older files."""
    steady = profile.get("steady")
    if steady:
        return steady["gpu_idle_pct"] if steady.get("agrees") is not False else None
    return profile["gpu_idle_pct"]


HOST_OPS_SHOWN = 5


def host_lines(data: dict) -> list[str]:
    """Where a host-bound variant's CPU time goes: the events of its profiled steps with the most
    self CPU time (profiles.*.host_ops; under the profiler, so each figure is above the timed one)."""
    lines = []
    bounds = (data.get("verdict") or {}).get("bounds") or {}  # the table's word, where it was decided
    for name, res in (data.get("results") or {}).items():
        ops = ((data.get("profiles") or {}).get(name) or {}).get("host_ops")
        bound = bounds.get(name) or ("host-bound" if res.get("host_bound") else "")
        if not (bound in ("host-bound", "launch-bound") and ops):
            continue
        top = sorted(ops.items(), key=lambda kv: kv[1]["ms"], reverse=True)[:HOST_OPS_SHOWN]
        words = ", ".join(f"{op} {v['ms']:.2f} ms ({v['calls']:g} calls)" for op, v in top)
        lines.append(f"{name} is {bound}; its most self CPU time a profiled step: {words}")
    return lines


def steady_lines(data: dict) -> list[str]:
    """Where the GPU idle column and the bound come from, and the agreement they rest on: each
    variant's unsynchronised profiled step beside its timed median and the trials' range."""
    profiles = data.get("profiles") or {}
    steady = {n: p["steady"] for n, p in profiles.items() if p.get("steady")}
    if not data["config"]["device"].startswith("cuda") or not profiles:
        return []
    if not steady:
        return ["GPU idle and the bound: from one synchronised profiled step (this file has no "
                "unsynchronised profile; such a step runs longer than the timed loop)"] + [
            f"{n:>{W}}  the unsynchronised profile failed: {p['steady_error']}"
            for n, p in profiles.items() if p.get("steady_error")
        ]  # fmt: skip
    first = next(iter(steady.values()))
    n, floor = first["steps"], first.get("floor")
    within = "the timed trials' range" + (f" or {floor:.0%} of their median" if floor else "")
    lines = [
        f"GPU idle and the bound: from {n} consecutive unsynchronised profiled steps (GPU activity "
        f"alone), used where their step time is within {within}; profiled step vs timed median:"
    ]
    for name, p in profiles.items():
        if p.get("steady_error"):
            why = p["steady_error"]
            lines.append(f"{name:>{W}}  no unsynchronised profile ({why}); idle from its synchronised step")
    for name, st in steady.items():
        median = st.get("timed_median_ms")
        if median is None:
            lines.append(f"{name:>{W}}  {st['step_ms']:.3g} ms (no timed trials to set it beside)")
            continue
        off = st["step_ms"] / median - 1
        word = "within" if st["agrees"] else "OUTSIDE (idle share not used)"
        lines.append(
            f"{name:>{W}}  {st['step_ms']:.3g} ms vs {median:.3g} ms ({off:+.1%}), {word} the trials' "
            f"{st['timed_low_ms']:.3g}-{st['timed_high_ms']:.3g} ms"
            + (f" or {st['floor']:.0%} of their median" if st.get("floor") else "")  # saved before: the range
            + f"; GPU idle {st['gpu_idle_pct']:.1f}%"
        )
    return lines


def experts_lines(data: dict) -> list[str]:
    """Which experts implementation the moe-best variants ran, and why (a mixture of experts)."""
    cfg = data.get("config") or {}
    choice = cfg.get("experts")
    if not choice or not any(v.startswith("moe-best") for v in cfg.get("variants", ())):
        return []
    impl, built = choice["implementation"], choice.get("default")
    how = (
        "; eager and fused run it too, transformers' default" if impl == built
        else f"; eager and fused run transformers' default, {built}" if built else ""
    )  # fmt: skip
    return [f"moe-best: transformers' {impl} experts ({choice['why']}){how}"]


def mask_lines(data: dict) -> list[str]:
    """How each compiled variant's plain causal call reaches attention, and what compile+fused vs
    compile then measures: the fusion alone where both take the same route."""
    masks = data.get("masks") or {}
    if not masks:
        return []
    fixed = [n for n, m in masks.items() if m["fixed"]]
    own = {n: m["note"] for n, m in masks.items() if not m["fixed"]}
    lines = []
    if fixed:
        lines.append(
            f"causal mask under torch.compile: {', '.join(fixed)} with profuse's fix (a plain causal call "
            "reaches SDPA as is_causal, no (B, 1, T, T) mask built while compiling)"
        )
    for name, note in own.items():
        lines.append(f"causal mask under torch.compile: {name} as the model builds it ({note})")
    for name, key in OVER_COMPILE.items():
        pair = [masks.get(n) for n in ("compile", name)]
        if not (data.get(key) and all(pair)):
            continue
        if pair[0]["fixed"] == pair[1]["fixed"]:
            lines.append(f"{name} vs compile: both build their mask alike, so the ratio is the fusion alone")
        else:
            lines.append(f"{name} vs compile: NOT the fusion alone: one has the mask fix and the other not")
    return lines


def _placed_words(placed: dict) -> str:
    """'silu_mul x16, ...; 2 op(s) left unfused, ...': one variant's profuse.fuse summary."""
    ops = ", ".join(f"{op} x{n}" for op, n in placed["counts"].items())
    left = len(placed["left_unfused"])
    why = f"; {left} op(s) left unfused, each with its reason in step.json's fused_ops"
    return ops + (why if left else "")


def _speedup(sp: dict | None) -> str:
    return speedup_words(sp)


def _is_hf(data: dict) -> bool:
    """A Hugging Face model's run (files written before --model are the built-in GPT's)."""
    return data["config"].get("model_arg", "gpt").startswith("hf:")


def precision_words(cfg: dict) -> str:
    """The run's precision in words: 'amp: bf16 autocast over fp32 parameters and AdamW state';
    files written before --precision hold the words themselves ('bf16 autocast', 'fp32')."""
    return cfg.get("precision_text") or cfg.get("precision", "")


def optimizer_words(cfg: dict) -> str:
    """'; AdamW fused (fused=True), every variant' where the run asked for it; '' for torch's
    default AdamW (and files written before --optimizer, which all used it)."""
    return "; AdamW fused (fused=True), every variant" if cfg.get("optimizer") == "fused" else ""


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
            f"{data['n_params'] / 1e6:.1f}M parameters; {precision_words(cfg)}{optimizer_words(cfg)}"
        )
    return (
        f"model: {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, ffn {m['ffn_hidden']}, "
        f"vocab {m['vocab_size']}; {m['batch_size']} x {m['seq_len']} = {tokens} tokens a step; "
        f"{data['n_params'] / 1e6:.1f}M parameters; {precision_words(cfg)}{optimizer_words(cfg)}"
    )


def _table(data: dict) -> list[str]:
    cmp = data["comparison"]
    results = data["results"]
    cuda = data["config"]["device"].startswith("cuda")
    profiles, memory, firsts = data["profiles"], data["memory"], data["first_steps"]
    bounds = (verdict_of(data) or {}).get("bounds") or {}  # the run's decision (profuse.verdict)
    unit = time_unit(results[cmp["baseline"]]["median_s"])
    launches = next((p["launch_unit"] for p in profiles.values()), "kernels")
    ci = ci_terms(r["speedup"] for r in results.values())[0]  # '95% CI', or order statistics' coverage
    header = f"{'variant':>{W}}  {'median':>10}  {f'vs eager ({ci})':<38}  {'per trial':>9}"
    checked = bool(data.get("math"))  # the math column: full, small or NO (math_lines says how)
    if checked:
        header += f"  {'math':>5}"
    if cuda:
        header += f"  {'host':>17}"
    old_first = first_step_in_table(data)  # dropped since the full-size check (first_step_line)
    if old_first:
        header += f"  {'first step':>10}"
    if cuda:
        header += f"  {'peak memory':>11}"
    steady = cuda and any(m.get("steady_reserved_bytes") is not None for m in memory.values())
    if steady:  # the steady state's peak reserved, beside the first steps' (memory_note says how)
        header += f"  {'steady peak':>11}"
    if profiles:
        header += f"  {launches + '/step':>14}  {'memory-bound':>12}"
        if cuda:
            header += f"  {'GPU idle':>8}"
    lines = [header]
    for name, r in results.items():
        row = f"{name:>{W}}  {fmt_time(r['median_s'], unit):>10}  "
        row += f"{_speedup(r['speedup']) if r['speedup'] else 'baseline':<38}"
        pt = (r["speedup"] or {}).get("per_trial")  # the paired statistic beside the ratio of medians
        paired = "-"
        if pt:  # a slowdown as the table's other column says it: "473x slower", never "0.00x"
            m = pt["median"]
            paired = f"{m:.2f}x" if m >= 0.5 else f"{1 / m:.3g}x slower" if m > 0 else "-"
        row += f"  {paired:>9}"
        if checked:
            row += f"  {math_mark(data, name) or '-':>5}"
        if cuda:
            host, timing = r["host_s"], cmp["timings"].get(name) or {}
            shown = fmt_time(host, unit).strip() if host is not None else "-"
            if host is not None and timing.get("host_is_lower_bound"):
                shown = f"at least {shown}"  # the launch queue filled while the CPU issued it
            row += f"  {shown:>17}"
        if old_first:
            row += f"  {fmt_time(firsts[name]['seconds']).strip():>10}"
        if cuda:
            mem = memory.get(name)
            row += f"  {fmt_bytes(mem['peak_bytes']) if mem else '-':>11}"
            if steady:
                value = (mem or {}).get("steady_reserved_bytes")
                row += f"  {fmt_bytes(value) if value is not None else '-':>11}"
        p = profiles.get(name)
        if profiles:
            row += (
                f"  {p['launches_per_step']:>14.0f}  {p['memory_bound_pct']:>11.1f}%" if p else f"  {'-':>14}"
            )
            idle = _idle(p) if cuda and p else None
            if idle is not None:
                row += f"  {idle:>7.1f}%"
        if cuda and bounds.get(name):
            row += f"  {bounds[name]}"
        lines.append(row.rstrip())
    return lines


def trial_words(cmp: dict) -> str:
    """What one trial of a saved comparison is, from its saved design: 'each trial the mean of 3
    steps back to back between two CUDA events, after 1 untimed step'. Files saved before the
    design was recorded say what their timer did."""
    design = TrialDesign.from_dict(cmp.get("design"))
    cuda = str(cmp.get("device", "")).startswith("cuda")
    if design is not None and design.blocks:
        between = "two CUDA events" if cuda else "two clock reads"
        discard = design.discard
        after = f", after {discard} untimed step{'s' if discard != 1 else ''}" if discard else ""
        return f"each trial the mean of {design.calls} steps back to back between {between}{after}"
    if cmp.get("timing") == "loop":  # timers.LoopTimer: each trial the median of its `reps` calls
        return "steps back to back as a training loop runs them, each trial the median of 3 single steps"
    return "one step a trial, wall clock"


def again_command(data: dict) -> str:
    """The `profuse step` command that times a saved Part C run again (at least FEW_TRIALS trials,
    into a folder of its own), with a thread count that suits the CPU it ran on."""
    cfg = data.get("config") or {}
    argv = ["profuse", "step", "--device", str(cfg.get("device", "auto")).split(":", 1)[0]]
    if cfg.get("model_arg", "gpt") != "gpt":
        argv += ["--model", str(cfg["model_arg"])]
    if cfg.get("precision") == "bf16":
        argv += ["--precision", "bf16"]
    if cfg.get("preset"):
        argv += ["--preset", str(cfg["preset"])]
    if cfg.get("resized"):
        for field, flag in MODEL_FLAGS.items():
            if field in (cfg.get("model") or {}):
                argv += [flag, str(cfg["model"][field])]
    if cfg.get("variants"):
        argv += ["--variants", ",".join(cfg["variants"])]
    if cfg.get("optimizer", "default") != "default":
        argv += ["--optimizer", str(cfg["optimizer"])]
    argv += ["--trials", str(max(int(cfg.get("trials") or FEW_TRIALS), FEW_TRIALS))]
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
    design = TrialDesign.from_dict((cmp or {}).get("design"))
    for name, t in ((cmp or {}).get("timings") or {}).items():
        steady, calls, drifting = (
            t.get("warmup_steady", True),
            t.get("warmup_calls", 0),
            (t.get("trend") or {}).get("drifting"),
        )
        note = warmup_note(name, steady, calls, budget, design, drifting)
        if note:
            out.append(note)
    out += design_warnings(data)
    return out + threads_note(data.get("env") or {})


def design_warnings(data: dict) -> list[str]:
    """The referee design's warnings from the saved run: a GPU that throttled in any trial (its
    NVML readings), a variant whose times drifted through the trials, and trial noise over the
    smallest difference the verdict calls (the verdict's own)."""
    cmp = data.get("comparison") or {}
    fields = set(ClockSample.__dataclass_fields__)
    samples = [ClockSample(**{k: v for k, v in c.items() if k in fields}) for c in cmp.get("clocks") or []]
    # a saved sample keeps its reasons' names, not their bits: its `throttled` is the run's reading
    for sample, c in zip(samples, cmp.get("clocks") or []):
        if c.get("throttled") and not sample.throttled:
            sample.reason_bits = THROTTLE_BITS
    out = [throttle_warning(samples)] if samples and throttle_warning(samples) else []
    if (cmp.get("design") or {}).get("checks"):
        for name, t in (cmp.get("timings") or {}).items():
            tr = t.get("trend")
            if tr and tr.get("drifting"):
                out.append(
                    trend_warning(name, Trend(*(tr[k] for k in ("r", "p", "trials", "first_s", "last_s"))))
                )
        out += (verdict_of(data) or {}).get("warnings") or []
    return out


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
    """Part C's block (the setup, the same-math check, the step table, the Amdahl prediction, the
    verdict); for a file of two precisions, one block each, then the ranks that moved."""
    if data.get("runs"):
        return format_both(data)
    cfg = data["config"]
    kind = cfg["device"].split(":", 1)[0]
    where = f"{kind}, {cfg['precision']}" if "precision_text" in cfg else kind
    if _is_hf(data):
        title = (
            f"=== Part C: the whole training step of {cfg['model_arg']} {cfg['preset']}, eager vs fused vs "
            f"Liger-Kernel vs torch.compile ({where}) ==="
        )
    else:
        resized = ", resized by the model flags" if cfg.get("resized") else ""
        title = (
            "=== Part C: the whole training step, eager vs fused vs torch.compile "
            f"({where}, preset {cfg['preset']}{resized}) ==="
        )
    lines = [
        title,
        _model_line(data),
    ]
    asked = cfg.get("variants") or list(data.get("results") or {})
    if any(name in FUSED_VARIANTS for name in asked):  # none asked for: nothing fused to name
        ops = (
            "silu_mul on the packed gate/up, add_rms_norm"
            if not _is_hf(data)
            else "every op profuse.fuse places: silu_mul, add_rms_norm, rms_norm, "
            "rope (Qwen3: qk_norm_rope), linear_cross_entropy"
        )
        placements = data.get("fused_ops") or {}
        placed = next((p for n, p in placements.items() if n not in SUBSET_VARIANTS), None)
        if placed is not None:  # what profuse.fuse placed in this model, from its summary
            ops = _placed_words(placed)
        if any(name in FUSED_VARIANTS and name not in SUBSET_VARIANTS for name in asked):
            lines.append(f"fused ops: {data['block_ops']} ({ops})")
        for name in SUBSET_VARIANTS:  # a subset variant's own placement
            if name in placements:
                words = _placed_words(placements[name])
                lines.append(f"fused ops in {name}: {data['block_ops']} ({words}); the rest left to Inductor")
    lines += small_check_lines(data)
    for name, c in data.get("checks", {}).items():
        lines += small_check_lines(data, c, name)
    lines += full_check_lines(data)
    lines += math_lines(data)
    for name, why in data["skipped"].items():
        lines.append(f"{name:>{W}}: skipped ({why})")
    for name, why in data["failed"].items():
        lines.append(f"{name:>{W}}: FAILED, not timed ({why})")
    cmp = data["comparison"]
    lines.append("")
    if cmp is None:
        lines.append("nothing timed: the eager step did not run")
        return "\n".join(lines)
    how = trial_words(cmp)
    lines.append(f"step time: {cmp['trials']} interleaved trials, {how} ({cmp['timer']})")
    lines += _table(data)
    for name, key in OVER_COMPILE.items():
        if data.get(key):
            lines.append(f"{'':>{W}}  {OVER_COMPILE_WORDS[name]} ({name} vs compile): {_speedup(data[key])}")
    lines += mask_lines(data)
    lines += experts_lines(data)
    notes = [f"statistic: {STATISTIC}"]
    if kind == "cuda":
        notes.append("host = CPU time to issue one step; " + memory_note(data))
    else:
        notes.append("peak memory: not measured on a CPU (torch.cuda.max_memory_allocated is CUDA's)")
    if data["profiles"]:
        basis = next(iter(data["profiles"].values()))["basis"]
        notes.append(f"per step and memory-bound share: from a short profile of each variant ({basis})")
    notes += steady_lines(data)
    notes += host_lines(data)
    triton_ops = "Triton" in data["block_ops"]  # not the eager stand-ins (fusion.EAGER)
    fused_timed = [n for n in FUSED_VARIANTS if triton_ops and n in data["results"]]
    warmed = {name: t["warmup_calls"] for name, t in cmp["timings"].items() if "warmup_calls" in t}
    if warmed:
        rule = steady_rule(TrialDesign.from_dict(cmp.get("design")), "agree")
        if rule:
            rule = f"the {rule}, or {cmp.get('warmup_budget_s', WARMUP_BUDGET_S):g} s of them"
        notes.append(warmup_line(warmed, rule).replace("calls", "steps"))
    notes += [line for line in (first_step_line(data), weights_line(data)) if line]
    if _is_hf(data) and "precision_text" in cfg:  # files before the model's own loss computed profuse's
        notes.append(HF_LOSS_NOTE)
    methods = ci_terms(r["speedup"] for r in data["results"].values())[2]
    lines += notes + few_trials_note(cmp["trials"], methods) + interpreter_note(data["env"], fused_timed)
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
    lines += time_lines(data)
    if data.get("interrupted"):
        cut = data["interrupted"]
        lines += ["", f"INTERRUPTED: {cut}; the trials above had finished, and the verdict is theirs"]
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
    ratio of step medians B/A with a bootstrap CI over each run's saved trials. Files of two
    precisions (--precision both) are compared precision by precision."""
    if a.get("runs") or b.get("runs"):
        by_a, by_b = runs_by_precision(a), runs_by_precision(b)
        common = [p for p in by_a if p in by_b]
        if not common:
            raise UsageError(
                f"{names[0]} ({', '.join(by_a)}) and {names[1]} ({', '.join(by_b)}) share no precision: "
                "nothing to compare"
            )
        return "\n\n".join(
            format_step_diff(by_a[p], by_b[p], names=(f"{names[0]} [{p}]", f"{names[1]} [{p}]"))
            for p in common
        )
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


def verdict_of(data: dict) -> dict | None:
    """The run's verdict as it decided it (step.json's `verdict`); decided now (profuse.verdict)
    for files written before it was saved, or before it held the tie test's words."""
    saved = data.get("verdict")
    if saved is not None and "text" in saved:
        return saved
    decided = decide(data)
    return decided.to_dict() if decided else None


def against_eager(sp: dict) -> str:
    """'1.31x (1.28-1.35) faster than eager, per trial 1.30x (1.29-1.32)': the ratio of medians
    and its CI, the paired statistic (median of per-trial ratios) beside it where it was computed."""
    ratio, ci = speedup_terms(sp["median"], sp["low"], sp["high"], sp["verdict"])
    text = f"{ratio} ({ci}) than eager" if sp["verdict"] == "slower" else f"{ratio} ({ci}) faster than eager"
    if sp["verdict"] == "no measurable gain":
        text = f"{ratio} ({ci}) against eager, no measurable gain"
    pt = sp.get("per_trial")
    if pt:
        text += f", per trial {pt['median']:.2f}x ({pt['low']:.2f}-{pt['high']:.2f})"
    return text


def verdict_line(data: dict) -> str:
    """'VERDICT: compile wins; next: fused, 3.1% slower (...); compile 1.31x (1.28-1.35) faster
    than eager, per trial 1.30x (...); the eager step is device-bound (...); ...'. Every word of
    who wins or ties is the run's verdict's (verdict_of: bench.stats.tie_verdict over the paired
    trials); the ratios over eager are the results' own."""
    v = verdict_of(data)
    if v is None:
        return ""
    speedups = {n: r["speedup"] for n, r in data["results"].items() if r["speedup"]}
    if not speedups:
        return "VERDICT: only eager was timed: nothing to referee"
    bound, evidence = v["bound"], v["bound_why"]
    step = (
        f"the eager step is {bound} ({evidence})"
        if bound
        else f"what bounds the eager step is not known ({evidence})"
    )
    winner = v["winner"]
    parts = [f"VERDICT: {v['text']}"]
    if winner in speedups:
        parts.append(f"{winner} {against_eager(speedups[winner])}")
    parts.append(step)
    if winner in speedups and speedups[winner]["verdict"] == "faster":
        parts.append(_how(data, winner, bound))
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Where the run's time went
# --------------------------------------------------------------------------------------------

# The phases of a run (step.json's `phases`), in the order they run; "first:NAME" and
# "profile:NAME" are each variant's share of "first steps" and "profiles".
# "memory" is older files' (a step apart per variant; now inside each variant's own first steps).
PHASES = (("check", "check"), ("build", "build"), ("reference", "reference"), ("first", "first steps"),
          ("trials", "trials"), ("memory", "memory"), ("profiles", "profiles"),
          ("ops", "Amdahl"))  # fmt: skip


def time_lines(data: dict) -> list[str]:
    """Where the run's minutes went (its phases' wall time) and, for each variant whose first
    step compiled or tuned anything, how that first step splits (profuse.compiletime)."""
    phases = data.get("phases") or {}
    if not phases:
        return []
    firsts = {k.split(":", 1)[1]: v for k, v in phases.items() if k.startswith("first:")}
    shown = []
    for key, label in PHASES:
        seconds = sum(firsts.values()) if key == "first" else phases.get(key)
        if seconds:
            shown.append(f"{label} {seconds:.1f} s")
    total = f"; total {phases['total']:.1f} s" if "total" in phases else ""
    lines = [f"run time: {', '.join(shown)}{total}"]
    for name, split in (data.get("compile") or {}).items():
        cs = CompileSplit(**split)
        if cs.compiled_anything:
            checked = name.removeprefix(CHECK_SPLIT)
            what = f"same-math check of {checked}" if checked != name else f"first step of {name}"
            lines.append(f"{'':>4}{what}: {cs.seconds:.1f} s; {cs.summary()}")
    return lines


# --------------------------------------------------------------------------------------------
# Two precisions: one run each, and the ranks that moved between them
# --------------------------------------------------------------------------------------------

SHOWN_MOVES = 3  # categories, and top operators, named for a rank that moved


def both_precisions(runs: list[dict]) -> dict:
    """One file for `profuse step --precision both`: each precision's run as it saved it."""
    return {"kind": KIND, "precision": "both", "runs": runs}


def _ranks(data: dict) -> dict[str, int]:
    """variant -> its place by median step time among the timed variants (1: the fastest)."""
    results = data.get("results") or {}
    order = sorted(results, key=lambda n: results[n]["median_s"])
    return {name: i + 1 for i, name in enumerate(order)}


def _moves(a: dict[str, float], b: dict[str, float], labels: dict[str, str] | None = None) -> list[str]:
    """The largest changes a -> b in ms a step, named: 'loss 12.10 -> 3.20 ms'."""
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))
    out = []
    for k in keys[:SHOWN_MOVES]:
        x, y = a.get(k, 0.0), b.get(k, 0.0)
        if abs(y - x) < 0.005:
            break
        out.append(f"{(labels or {}).get(k, k)} {x:.2f} -> {y:.2f} ms")
    return out


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def rank_changes(a: dict, b: dict) -> list[str]:
    """A line per variant whose place differs between run `a` and run `b` (two precisions), with
    what its profiles say moved: the categories and the kernels (on a CPU the operators) that grew
    or shrank most, in ms a step, eager's same categories beside them."""
    from profuse.profiling import CATEGORY_LABELS

    pa, pb = precision_words(a["config"]).split(":")[0], precision_words(b["config"]).split(":")[0]
    ra, rb = _ranks(a), _ranks(b)
    lines = []
    for name in ra:
        if name not in rb or ra[name] == rb[name]:
            continue
        sa, sb = (x["results"][name]["speedup"] for x in (a, b))
        vs = f"; {_short(sa)} -> {_short(sb)} vs eager" if name != "eager" else ""
        head = f"{name}: {_ordinal(ra[name])} in {pa} -> {_ordinal(rb[name])} in {pb}{vs}"
        fa, fb = (x.get("profiles", {}).get(name) for x in (a, b))
        if not (fa and fb and "category_ms" in fa and "category_ms" in fb):
            lines.append(f"{head}; no profiles of it in both to say why (--profile-steps 0?)")
            continue
        cats = _moves(fa["category_ms"], fb["category_ms"], CATEGORY_LABELS)
        ops = _moves(fa.get("top_ops", {}), fb.get("top_ops", {}))
        why = f"its {fa['basis']} a step, {pa} -> {pb}: " + (", ".join(cats) or "no category moved")
        ea, eb = (x.get("profiles", {}).get("eager") for x in (a, b))
        if name != "eager" and ea and eb and "category_ms" in ea and "category_ms" in eb:
            eager = _moves(ea["category_ms"], eb["category_ms"], CATEGORY_LABELS)
            why += f" (eager's: {', '.join(eager) or 'none moved'})"
        if ops:
            what = "kernels" if fa.get("launch_unit") == "kernels" else "operators"
            why += f"; top {what}: {', '.join(ops)}"
        lines.append(f"{head}; {why}")
    return lines


def format_both(data: dict) -> str:
    """`--precision both`: each precision's block, then a line per variant whose rank moved."""
    runs = data["runs"]
    blocks = [format_step(run) for run in runs]
    a, b = runs[0], runs[1]
    pa, pb = (precision_words(x["config"]).split(":")[0] for x in (a, b))
    head = f"=== Part C: {pa} vs {pb}, the ranks that moved (by median step time; 1st = the fastest) ==="
    moved = rank_changes(a, b) if a.get("results") and b.get("results") else []
    return "\n\n".join([*blocks, "\n".join([head, *(moved or ["no variant changed its place"])])])


def runs_by_precision(data: dict) -> dict[str, dict]:
    """A step file's runs by precision: one for a plain run, two for --precision both."""
    runs = data.get("runs") or [data]
    return {str(run["config"].get("precision")): run for run in runs}
