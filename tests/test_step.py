"""Part C on the CPU: the fused GPT's plumbing, the same-math check, presets and sizes, the step
run and its report, and the command line.

The fused Triton block ops (profuse.kernels.swiglu, profuse.kernels.add_rms_norm) run here through
the interpreter where they are installed; everywhere else blockops' eager versions stand in for
them (fusion.EAGER): the same math through the same seams, so the plumbing is tested anyway.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import statistics

import pytest
import torch
from cases import assert_one_clear_line, run
from torch import nn

from profuse import blockops, fusion
from profuse import step as S
from profuse.bench.stats import FEW_TRIALS, bound, speedup_ci, tie_verdict
from profuse.errors import UsageError
from profuse.model import GPT, AddRMSNorm, GPTConfig, SwiGLU, random_batch
from profuse.report.step import format_step, load_step, trial_words, verdict_line
from profuse.tail import BACKWARD_TOL, FORWARD_TOL
from profuse.verdict import SYNCED_SOURCE, decide

TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)
# A width that is not a power of two, and a hidden size that is not a multiple of 64.
ODD = GPTConfig(n_layer=2, d_model=48, n_head=2, vocab_size=96, seq_len=8, batch_size=3, ffn_hidden=100)
CPU = torch.device("cpu")


def loss_and_grads(model, cfg, seed=1):
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(seed))
    _, loss = model(idx, targets)
    params = dict(model.named_parameters())
    return loss, dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


# --------------------------------------------------------------------------------------------
# The fused GPT: the block ops swapped from outside
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, ODD], ids=["tiny", "odd-widths"])
def test_swapped_block_ops_give_the_same_loss_and_gradients(cfg):
    torch.manual_seed(0)
    plain = GPT(cfg)
    fused = fusion.use_block_ops(
        copy.deepcopy(plain), silu_mul=blockops.silu_mul_eager, add_rms_norm=blockops.add_rms_norm_eager
    )
    want_loss, want = loss_and_grads(plain, cfg)
    got_loss, got = loss_and_grads(fused, cfg)
    # blockops' eager ops are the model's own math in the same order: equal in fp32, not just close.
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_use_block_ops_swaps_every_block_and_keeps_the_parameters():
    calls = {"silu_mul": 0, "add_rms_norm": 0}

    def counting(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    torch.manual_seed(0)
    model = GPT(TINY)
    params = {n: p for n, p in model.named_parameters()}
    out = fusion.use_block_ops(
        model,
        silu_mul=counting("silu_mul", blockops.silu_mul_eager),
        add_rms_norm=counting("add_rms_norm", blockops.add_rms_norm_eager),
    )
    assert out is model
    assert {n: p for n, p in model.named_parameters()} == params  # the very same Parameter objects
    model(*random_batch(TINY, torch.Generator().manual_seed(0)))
    # One activation a block; two adds a block (after attention, after the feed-forward) but the
    # first norm has no add: 2 L - 1 inside the blocks, and the final norm's.
    assert calls == {"silu_mul": TINY.n_layer, "add_rms_norm": 2 * TINY.n_layer}
    assert all(m.silu_mul is not None for m in model.modules() if isinstance(m, SwiGLU))
    assert sum(isinstance(m, AddRMSNorm) for m in model.modules()) == 2 * TINY.n_layer + 1


def test_use_block_ops_defaults_to_the_fused_ops_and_refuses_other_models():
    model = fusion.use_block_ops(GPT(TINY))
    mlp = next(m for m in model.modules() if isinstance(m, SwiGLU))
    norm = next(m for m in model.modules() if isinstance(m, AddRMSNorm))
    assert mlp.silu_mul is blockops.silu_mul and norm.add_rms_norm is blockops.add_rms_norm
    with pytest.raises(ValueError, match="not a profuse GPT"):
        fusion.use_block_ops(nn.Linear(4, 4))


def test_labels_leave_the_math_alone():
    torch.manual_seed(0)
    plain = GPT(TINY)
    labelled = fusion.label_block_ops(copy.deepcopy(plain))
    want_loss, want = loss_and_grads(plain, TINY)
    got_loss, got = loss_and_grads(labelled, TINY)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_real_block_ops_through_the_interpreter(monkeypatch):
    """The Triton kernels in the model: the same step as the unfused one, checked against float64."""
    pytest.importorskip("profuse.kernels.swiglu")
    pytest.importorskip("profuse.kernels.add_rms_norm")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest set it before triton was imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = S.StepConfig(model=ODD, device=device, variants=("eager", "fused"), trials=2, profile_steps=0)
    assert S.fused_unavailable(device) == ""
    check = S.check_same_math(cfg, fusion.FUSED)
    assert check.error == "" and check.passed, check
    res = S.run_step(cfg)
    assert "fused" in res.comparison.timings and not res.failed
    assert res.same_math["fused"].passed  # at the run's size, tensor by tensor


# --------------------------------------------------------------------------------------------
# The same-math check
# --------------------------------------------------------------------------------------------


def test_check_passes_the_same_math_and_names_its_bounds():
    cfg = S.StepConfig(model=ODD, variants=("eager", "fused"))
    check = S.check_same_math(cfg, fusion.EAGER)
    assert check.passed and check.error == ""
    assert check.model["n_layer"] == 2 and check.model["d_model"] == ODD.d_model  # the run's widths
    assert set(check.errors) == {"loss"} | {f"grad {n}" for n, _ in GPT(ODD).named_parameters()}
    for name, (fused, unfused) in check.errors.items():
        tol = FORWARD_TOL[torch.float32] if name == "loss" else BACKWARD_TOL[torch.float32]
        assert fused == unfused  # the same ops: the same rounding
        assert check.bounds[name] == max(tol, S.CHECK_FACTOR * unfused)
    assert check.max_abs_diff == 0.0


def _wrong_norm(x, residual, weight, eps):
    h = residual + x
    return blockops.add_rms_norm_eager(x, residual, weight, eps)[0] * 1.01, h  # 1% off


def test_check_fails_wrong_math_and_the_run_does_not_time_it():
    wrong = fusion.BlockOps(blockops.silu_mul_eager, _wrong_norm, "wrong")
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0)
    check = S.check_same_math(cfg, wrong)
    assert not check.passed
    fused_err, _ = check.errors[check.worst]
    assert fused_err > check.bounds[check.worst]
    res = S.run_step(cfg, ops=wrong)
    assert "same-math check" in res.failed["fused"] and check.worst in res.failed["fused"]
    assert list(res.comparison.timings) == ["eager"]


def test_math_that_slips_past_the_small_check_fails_at_full_size(monkeypatch):
    """Math that slips past the small model's check (here: the check is skipped) is caught at
    the real size, tensor by tensor, and is not timed."""
    wrong = fusion.BlockOps(blockops.silu_mul_eager, _wrong_norm, "wrong")
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0)
    passed = S.MathCheck(model={}, precision=cfg.precision, passed=True)
    monkeypatch.setattr(S, "check_same_math", lambda cfg, ops: passed)
    res = S.run_step(cfg, ops=wrong)
    assert "same-math check at full size" in res.failed["fused"] and "over its bound" in res.failed["fused"]
    assert list(res.comparison.timings) == ["eager"]


def test_a_reference_that_runs_out_of_memory_is_computed_again_in_smaller_chunks(monkeypatch):
    """Llama-3.2-1B's fp32 reference, sized to fit an H100 in one chunk by the estimate, ran out
    of memory there: the check then runs in smaller chunks of whole sequences, and still judges."""
    from profuse import samemath

    tried, real = [], samemath.compute_reference

    def short_of_memory(model, params, loss_fn, batch, dtype, chunks=1):
        tried.append(chunks)
        if chunks == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
        return real(model, params, loss_fn, batch, dtype, chunks)

    monkeypatch.setattr(samemath, "compute_reference", short_of_memory)
    res = S.run_step(S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0))
    assert tried == [1, 2] and res.same_math_note == ""
    assert res.same_math["fused"].passed and "fused" not in res.failed

    tried.clear()

    def never_fits(model, params, loss_fn, batch, dtype, chunks=1):
        tried.append(chunks)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")

    monkeypatch.setattr(samemath, "compute_reference", never_fits)
    res = S.run_step(S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0))
    assert tried == [1, 2] and "did not run: OutOfMemoryError" in res.same_math_note  # each chunking tried
    assert res.same_math == {} and list(res.comparison.timings) == ["eager", "fused"]


def test_check_reports_a_fused_op_that_cannot_run():
    def broken(gate_up):
        raise RuntimeError("no kernel here\nsecond line")

    ops = fusion.BlockOps(broken, blockops.add_rms_norm_eager, "broken")
    check = S.check_same_math(S.StepConfig(model=TINY), ops)
    assert not check.passed and check.error == "RuntimeError: no kernel here"


# --------------------------------------------------------------------------------------------
# Presets, sizes, what can run here
# --------------------------------------------------------------------------------------------


def test_presets_and_overrides():
    lab = S.preset_model("lab")
    assert lab == GPTConfig()  # the lab's model, unchanged
    small, medium = S.preset_model("small"), S.preset_model("medium")
    assert (small.n_layer, small.d_model, small.batch_size * small.seq_len) == (8, 1024, 8192)
    assert (medium.n_layer, medium.d_model, medium.n_head, medium.batch_size * medium.seq_len) == (
        8,
        2048,
        16,
        8192,
    )
    assert {f: getattr(small, f) for f in ("vocab_size", "seq_len")} == {"vocab_size": 8192, "seq_len": 1024}
    over = S.preset_model("medium", n_layer=2, seq_len=128, d_model=None)
    assert (over.n_layer, over.seq_len, over.d_model) == (2, 128, 2048)
    with pytest.raises(UsageError, match="unknown preset"):
        S.preset_model("huge")
    with pytest.raises(UsageError, match="divisible"):
        S.preset_model("small", n_head=7)


def test_cli_maps_preset_and_model_flags(capsys):
    from profuse.cli import build_step_parser, step_config

    args = build_step_parser().parse_args(["--preset", "small", "--layers", "3", "--batch-size", "2",
                                           "--variants", "compile,eager", "--trials", "5"])  # fmt: skip
    cfg = step_config(args, CPU, args.preset)
    m = cfg.model.config  # StepConfig.model is a ModelSpec: the built-in GPT's holds its GPTConfig
    assert (m.n_layer, m.d_model, m.batch_size, m.seq_len) == (
        3,
        1024,
        2,
        1024,
    )
    assert cfg.preset == "small" and cfg.trials == 5 and cfg.profile_steps == 3
    assert cfg.variants == ("eager", "compile")  # table order; eager always in


@pytest.mark.parametrize("cfg", [TINY, ODD, GPTConfig(), GPTConfig(tie_weights=False)])
def test_parameter_count_without_building_the_model(cfg):
    assert S.num_params(cfg) == GPT(cfg).num_params()


def test_bad_step_configs():
    for bad in (dict(variants=("fast",)), dict(trials=1), dict(profile_steps=-1), dict(preset="x")):
        with pytest.raises(UsageError):
            S.StepConfig(model=TINY, **bad)


def test_fused_variants_are_skipped_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = S.StepConfig(model=TINY)
    runs, skipped = S.plan(cfg, None)
    assert runs == ["eager", "compile"]
    assert set(skipped) == {"fused", "compile+fused"}
    assert "CUDA GPU" in skipped["fused"] and "TRITON_INTERPRET=1" in skipped["fused"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = S.fused_unavailable(CPU)
    try:  # where the kernels have landed they run; where not, the reason names the missing module
        import profuse.kernels.add_rms_norm  # noqa: F401
        import profuse.kernels.swiglu  # noqa: F401

        assert why == ""
    except ImportError:
        assert "profuse.kernels." in why
    assert S.plan(cfg, fusion.EAGER) == (list(S.VARIANTS), {})  # custom ops run anywhere


# --------------------------------------------------------------------------------------------
# The run, its JSON and its report
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager_vs_fused(tmp_path_factory):
    """eager and fused (blockops' eager ops standing in), profiled: every part but compilation."""
    out = tmp_path_factory.mktemp("step")
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=3, profile_steps=2, out_dir=out)
    stages = []
    res = S.run_step(cfg, progress=lambda stage, done, total: stages.append(stage), ops=fusion.EAGER)
    return res, stages, out


def test_run_times_checks_and_profiles_every_variant(eager_vs_fused, capsys):
    res, stages, out = eager_vs_fused
    assert capsys.readouterr().out == ""  # nothing below the CLI prints
    assert res.check.passed and not res.failed and not res.skipped
    assert list(res.comparison.timings) == ["eager", "fused"]
    # 3 trials asked, rounded up to a multiple of the variants for balanced orders (REFEREE)
    assert res.comparison.trials == 4 and res.comparison.design.balanced
    assert all(len(t.times_s) == 4 for t in res.comparison.timings.values())
    same = res.same_math["fused"]  # blockops' eager ops: the model's own math, the same rounding
    assert same.passed and all(err == unfused for err, unfused, _ in same.errors.values())
    assert res.memory == {}  # CPU: not measured
    assert res.math["fused"].sizes == ["full size", "small copy"] and res.math["fused"].passed
    assert res.math["eager"].checked and not res.verdict.unchecked
    for name in ("eager", "fused"):
        p = res.profiles[name]
        assert p.launch_unit == "operators" and p.launches_per_step > 0 and 0 < p.memory_bound_pct < 100
        assert p.gpu_idle_pct is None and not p.launch_bound
        assert (out / f"trace-step-{name}.json").exists()
        assert p.host_ops and all(v["ms"] > 0 and v["calls"] > 0 for v in p.host_ops.values())
    assert {"checking the fused step against float64", "first step: eager", "steps: trials"} <= set(stages)
    assert any(s.startswith("profile: ") for s in stages)
    assert not any(s.startswith("silu_mul: ") for s in stages)  # no op timed alone: Amdahl reads the steps
    for name in ("eager", "fused"):  # each variant named as its first step, trials and profile go
        assert any(s.startswith(f"first step: {name} took ") for s in stages)
        assert any(s.startswith(f"profile: {name}: ") for s in stages)


def test_run_records_its_phases_budget_and_first_step_splits(eager_vs_fused):
    res, _, _ = eager_vs_fused
    data = res.to_dict()
    phases = data["phases"]
    top = ("check", "build", "trials", "profiles", "ops")
    each = ("first:eager", "first:fused", "profile:eager", "profile:fused")
    assert set(top + each + ("total",)) <= set(phases) and "memory" not in phases  # CPU: no memory phase
    assert all(phases[k] >= 0 for k in phases)
    firsts = phases["first:eager"] + phases["first:fused"]
    assert phases["total"] >= sum(phases[k] for k in top) + firsts - 1e-9
    assert phases["profiles"] >= phases["profile:eager"] + phases["profile:fused"] - 1e-9
    b = data["budget"]
    assert (b["variants"], b["compiles"], b["checks"], b["trial_rounds"], b["host_rounds"]) == (2, 0, 1, 4, 0)
    assert b["profiled_steps"] == 2 * 2 and b["op_timings"] == 0
    # every first step split, compiled or not, and the same-math check's
    assert set(data["compile"]) == {"eager", "fused", "check:fused"}
    assert data["compile"]["check:fused"]["seconds"] > 0
    assert data["compile"]["fused"]["tuner_configs"] == 0  # fusion.EAGER: nothing to tune
    assert data["verdict"]["winner"] in (None, "eager", "fused") and data["verdict"]["bound"] == "host-bound"


def test_eager_profile_finds_the_fused_ops_forward_and_backward(eager_vs_fused):
    res, _, _ = eager_vs_fused
    pct = res.profiles["eager"].block_op_pct
    assert set(pct) == {"silu_mul", "add_rms_norm"} and all(v > 0 for v in pct.values())
    assert sum(pct.values()) < 100
    # the fused step profiled through a copy labelled alike: Amdahl's in-step speedups
    assert set(res.profiles["fused"].block_op_pct) == {"silu_mul", "add_rms_norm"}


def test_amdahl_prediction_from_the_shares_and_op_speedups(eager_vs_fused):
    res, _, _ = eager_vs_fused
    a = res.amdahl
    assert res.ops == {} and a.speedup_source == "in-step"  # no op timed alone
    for op, sp in a.op_speedups.items():  # each op's time under its range, eager step over fused
        assert len(sp["eager_step_s"]) == len(sp["fused_step_s"]) == 2
        assert sp["eager_step_s"] == a.op_s[op]
        assert math.isclose(
            sp["median"], statistics.median(sp["eager_step_s"]) / statistics.median(sp["fused_step_s"])
        )
        assert sp["low"] <= sp["median"] <= sp["high"]
    fr = a.fractions
    want = 1 / ((1 - sum(fr.values())) + sum(fr[op] / a.op_speedups[op]["median"] for op in fr))
    assert math.isclose(a.predict(), want)
    assert a.predict("low") <= a.predict() <= a.predict("high")
    assert a.measured == res.comparison.speedups["fused"].to_dict()
    assert math.isclose(a.ceiling, 1 / (1 - a.f))


def test_few_trials_carry_a_caveat_in_the_step_report(eager_vs_fused):
    res, _, _ = eager_vs_fused
    data = res.to_dict()
    trials = data["comparison"]["trials"]
    caveats = [line for line in format_step(data).splitlines() if f"trials, under {FEW_TRIALS}:" in line]
    assert len(caveats) == (1 if trials < FEW_TRIALS else 0)
    assert trials < FEW_TRIALS and "order statistics" in caveats[0]
    # the table's column names the intervals' exact coverage (4 trials: the min and max, 87.5%)
    assert (
        "vs eager (87.5% CI)" in format_step(data)
        and "95% CI" not in format_step(data).split("statistic:")[0]
    )
    data["comparison"]["trials"] = FEW_TRIALS
    assert "under 30:" not in format_step(data)
    # a file saved with BCa intervals at 3 trials: said as saved, with the warning
    data["comparison"]["trials"] = 3
    for r in data["results"].values():
        if r["speedup"]:
            r["speedup"].update(method="BCa")
            r["speedup"].pop("coverage")
    assert any(line.startswith("WARNING only 3 trials") for line in format_step(data).splitlines())


def test_the_report_says_what_a_trial_is_from_the_saved_design(eager_vs_fused):
    res, _, _ = eager_vs_fused
    data = res.to_dict()
    cmp = data["comparison"]
    cmp["design"] = {**cmp["design"], "calls": 7, "discard": 2}
    text = format_step(data)
    assert (
        "each trial the mean of 7 steps back to back between two clock reads, after 2 untimed steps" in text
    )
    assert "median of 3" not in text
    cmp["device"] = "cuda"
    assert "between two CUDA events" in trial_words(cmp)


def _steady(data: dict) -> dict:
    """The saved run with every trial of the steps and ops within 10% of its fastest."""
    data = copy.deepcopy(data)
    comparisons = [data["comparison"], *(op["comparison"] for op in data["ops"].values())]
    for cmp in comparisons:
        for t in cmp["timings"].values():
            t["times_s"] = [3e-3 * (1 + 0.1 * (i % 2)) for i in range(20)]
            t["median_s"] = 3.15e-3
            t["warmup_steady"] = True
    return data


def test_unsteady_steps_are_warned_of_with_the_command_that_times_them_again(eager_vs_fused):
    """The CPU run that printed 'eager 340.143 ms' with trials from 8.7 to 552 ms said nothing;
    now the step, and Amdahl's line that reads its median, say it."""
    from profuse import cli

    data = _steady(eager_vs_fused[0].to_dict())
    data["env"].update(threads=2, cores_available=2, load_1m=0.5)
    text = format_step(data)
    assert "unsteady" not in text and "oversubscribed" not in text
    data["comparison"]["timings"]["eager"]["times_s"] = [8.7e-3] * 12 + [0.3, 0.552, 0.4] * 2 + [9e-3] * 2
    data["env"]["load_1m"] = 5.0  # other work wanted the cores too
    lines = format_step(data).splitlines()
    [warning] = [line for line in lines if "unsteady timings" in line]
    assert warning.startswith("WARNING step: unsteady timings (trials over 1.5x their fastest: eager 6/20 (")
    assert "8.7 ms to 552 ms" in warning and "fused 0/20" in warning
    command = warning.split("time it again: ", 1)[1]
    args = cli.build_step_parser().parse_args(shlex.split(command)[2:])
    assert args.device == "cpu" and args.variants == ["eager", "fused"] and args.trials >= FEW_TRIALS
    assert (args.layers, args.d_model) == (TINY.n_layer, TINY.d_model)
    assert args.threads == 1  # fewer than the 2 threads that fought for 2 busy cores
    [note] = [line for line in lines if "oversubscribed" in line]
    assert note.startswith("note: the CPU was oversubscribed (2 intra-op threads on 2 cores with a 1-minute")
    assert "--threads 1" in note
    [caveat] = [line for line in lines if "rest on unsteady medians" in line]
    assert "the eager step" in caveat
    assert lines.index(caveat) > next(i for i, line in enumerate(lines) if line.startswith("Amdahl:"))


def _with_ops_timed_alone(data: dict) -> dict:
    """A file from before the in-step speedups: silu_mul timed alone (amdahl.time_ops)."""
    from profuse import amdahl as A

    dims = A.OpDims.from_dims(S.StepConfig(model=TINY).spec.dims(), 1e-5)
    fp32 = A.OpDtypes(torch.float32, torch.float32, False)
    timed, _ = A.time_ops(A.op_cases(["silu_mul"], "gpt", dims, fp32, CPU), device=CPU, dtypes=fp32, trials=2,
                          warmup=0)  # fmt: skip
    data = copy.deepcopy(data)
    data["ops"] = {op: t.to_dict() for op, t in timed.items()}
    data["amdahl"]["speedup_source"] = "alone"
    return data


def test_unsteady_op_timings_mark_the_amdahl_prediction(eager_vs_fused):
    data = _steady(_with_ops_timed_alone(eager_vs_fused[0].to_dict()))
    data["ops"]["silu_mul"]["comparison"]["timings"]["fused"]["times_s"][:6] = [1.0] * 6
    lines = format_step(data).splitlines()
    [warning] = [line for line in lines if "unsteady timings" in line]
    assert warning.startswith("WARNING op silu_mul: unsteady timings") and "fused 6/20" in warning
    [caveat] = [line for line in lines if "rest on unsteady medians" in line]
    assert "silu_mul (fused)" in caveat and "step" not in caveat.split("(")[1]


def test_warm_up_steps_are_counted_and_a_budget_run_out_is_named(eager_vs_fused):
    data = _steady(eager_vs_fused[0].to_dict())
    assert all(t["warmup_calls"] >= 5 for t in data["comparison"]["timings"].values())
    assert any(line.startswith("warm-up, untimed, until the last 5 steps agree") for line in
               format_step(data).splitlines())  # fmt: skip
    data["comparison"]["timings"]["fused"].update(warmup_steady=False, warmup_calls=4)
    [w] = [line for line in format_step(data).splitlines() if "warm-up stopped" in line]
    assert w.startswith("WARNING fused: warm-up stopped at its 5 s budget after 4 calls")


def test_a_warm_up_out_of_budget_is_said_in_the_rule_applied_unless_the_trials_show_no_drift(eager_vs_fused):
    data = _steady(eager_vs_fused[0].to_dict())
    cmp = data["comparison"]
    cmp["design"].update(checks=True, steady_spread=0.01, warmup_block=3)
    fused = cmp["timings"]["fused"]
    fused.update(warmup_steady=False, warmup_calls=40)
    warned = lambda: [line for line in format_step(data).splitlines() if "warm-up stopped" in line]
    fused["trend"] = {"r": 0.1, "p": 0.7, "trials": 20, "first_s": 3e-3, "last_s": 3e-3, "drifting": False}
    assert warned() == []
    [rule] = [line for line in format_step(data).splitlines() if line.startswith("warm-up, untimed")]
    assert rule.startswith(
        "warm-up, untimed, until the last 6 blocks of 3 steps agree within 1.0% with no drift"
    )
    fused["trend"].update(r=0.8, p=1e-4, drifting=True)
    [w] = warned()
    assert "blocks of 3 calls agreed within 1.0% with no drift" in w and "1.5x" not in w


def test_no_fused_variant_asked_for_no_fused_block_ops_line(eager_vs_fused):
    data = copy.deepcopy(eager_vs_fused[0].to_dict())
    assert any(line.startswith("fused ops:") for line in format_step(data).splitlines())
    data["config"]["variants"] = ["eager", "compile"]
    data["results"].pop("fused")
    assert not any(line.startswith("fused ops:") for line in format_step(data).splitlines())


def test_a_slowdown_reads_as_how_many_times_slower():
    """As in every report: '1.33x slower (1.27-1.37)', its CI turned round, never '0.75x slower'."""
    from profuse.report.step import _speedup

    slow = {"median": 0.75, "low": 0.73, "high": 0.79, "verdict": "slower"}
    assert _speedup(slow) == "1.33x slower (1.27-1.37)"
    fast = {"median": 1.14, "low": 1.13, "high": 1.15, "verdict": "faster"}
    assert _speedup(fast) == "1.14x (1.13-1.15) faster"
    flat = {"median": 1.02, "low": 0.99, "high": 1.06, "verdict": "no measurable gain"}
    assert _speedup(flat) == "1.02x (0.99-1.06) no measurable gain"


def test_fused_triton_steps_timed_in_the_interpreter_carry_a_warning(eager_vs_fused):
    res, _, _ = eager_vs_fused
    data = res.to_dict()
    data["env"]["triton_interpret"] = True
    assert "Triton's interpreter" not in format_step(data)  # the eager stand-ins run no Triton
    data["block_ops"] = "profuse Triton kernels"
    [warning] = [line for line in format_step(data).splitlines() if "Triton's interpreter" in line]
    assert warning.startswith("WARNING fused ran through")
    data["env"]["triton_interpret"] = False
    assert "Triton's interpreter" not in format_step(data)


def test_amdahl_arithmetic():
    sp = lambda m, lo, hi: {"median": m, "low": lo, "high": hi}
    a = S.Amdahl(
        1.0,
        {"silu_mul": 0.2, "add_rms_norm": 0.1},
        {"silu_mul": sp(2, 1.5, 2.5), "add_rms_norm": sp(4, 2, 5)},
        None,
    )
    assert math.isclose(a.f, 0.3) and math.isclose(a.ceiling, 1 / 0.7)
    assert math.isclose(a.predict(), 1 / (0.7 + 0.1 + 0.025))
    assert math.isclose(a.predict("low"), 1 / (0.7 + 0.2 / 1.5 + 0.05))
    no_ops = S.Amdahl(1.0, {"silu_mul": 0.2}, {}, None)
    assert no_ops.predict() is None and no_ops.to_dict()["predicted"] is None


def test_results_round_trip_through_json_and_the_report(eager_vs_fused, tmp_path, capsys):
    res, _, _ = eager_vs_fused
    data = res.to_dict()
    path = tmp_path / "step.json"
    path.write_text(json.dumps(data))
    saved = load_step(path)
    assert saved["kind"] == "step" and saved["results"]["fused"]["speedup"]["verdict"]
    text = format_step(saved)
    assert text == format_step(data)
    lines = text.splitlines()
    # TINY is not the lab preset's model: the header says the preset was resized.
    assert lines[0] == (
        "=== Part C: the whole training step, eager vs fused vs torch.compile "
        "(cpu, amp, preset lab, resized by the model flags) ==="
    )
    assert lines[-1].startswith("CPU: ")
    data["config"]["resized"] = False  # files written before the field, and runs at the preset
    assert format_step(data).splitlines()[0].endswith("(cpu, amp, preset lab) ===")
    assert any(line.startswith("same math (blockops eager") and line.endswith("ok") for line in lines)
    # eager stand-ins: about 1.0x, so the verdict may go either way ("1.02x (..." or "1.02x slower (...")
    assert any(
        line.strip().startswith("fused ") and re.search(r"\d\.\d\dx (slower )?\(", line) for line in lines
    )
    assert any("predicted step gain" in line for line in lines)
    assert any("measured step gain (fused vs eager)" in line for line in lines)
    assert "peak memory: not measured on a CPU" in text
    code, out, err = run(["report", str(path)], capsys)
    assert code == 0, err
    # the run's own text, then where it came from (this file was saved without provenance)
    assert (
        out.rstrip("\n")
        == text
        + "\n\nprovenance: no provenance recorded (saved before profuse recorded commit, card and command)"
    )


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------

TINY_FLAGS = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64",
              "--seq-len", "8", "--batch-size", "2", "--trials", "2"]  # fmt: skip


def test_step_command_eager_and_compile(tmp_path, capsys, monkeypatch):
    """The one compile test: torch.compile on the CPU takes ~10 s a graph."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["step", *TINY_FLAGS, "--profile-steps", "0", "--out", str(tmp_path)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    # progress as lines on stderr, off a terminal too, naming each variant; none on stdout
    progress = err.splitlines()
    assert all(re.match(r"\[ *\d+:\d\d\] ", line) for line in progress), err
    for name in ("eager", "compile"):
        assert any(f"first step: {name}" in line for line in progress)
        assert not any(f"first step: {name}" in line for line in out.splitlines())
    assert any("steps: trials: 2/2" in line for line in progress)
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0].startswith("=== Part C:")
    assert any(line.startswith("fused: skipped (needs a CUDA GPU") for line in lines)
    assert any(line.startswith("compile+fused: skipped (") for line in lines)
    assert any(line.startswith("first step, compilation included") and "compile " in line for line in lines)
    assert lines[-1] == f"results: {tmp_path / 'step.json'}"
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["kind"] == "step" and list(data["results"]) == ["eager", "compile"]
    assert data["provenance"]["command"]["profuse_args"][0] == "step"  # files.write_result
    assert data["results"]["compile"]["speedup"]["low"] <= data["results"]["compile"]["speedup"]["high"]
    assert data["same_math"]["compile"]["passed"]  # the same step, compiled (fp32, against float64)
    assert data["check"] is None and data["amdahl"] is None and data["profiles"] == {}
    assert set(data["skipped"]) == {"fused", "compile+fused"}
    assert data["config"]["model"]["d_model"] == 32 and data["tokens_per_step"] == 16


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--d-model", "16384", "--layers", "64", "--heads", "128"], "needs about"),
        (["--variants", "eager,turbo"], "unknown variant"),
        (["--preset", "huge"], "invalid choice"),
        (["--heads", "3"], "divisible"),
        (["--trials", "1"], "at least 2"),
        (["--profile-steps", "-1"], "0 or more"),
        (["--variants", ""], "variant keys"),  # not a run of eager alone
        (["--threads", "0"], "must be positive"),
    ],
)
def test_bad_step_input_exits_2_with_one_line_before_any_work(flags, words, tmp_path, capsys):
    code, out, err = run(["step", *TINY_FLAGS, *flags, "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert words in err
    assert out == "" and not list(tmp_path.iterdir())


def test_report_of_a_step_file_takes_no_options(eager_vs_fused, tmp_path, capsys):
    path = tmp_path / "step.json"
    path.write_text(json.dumps(eager_vs_fused[0].to_dict()))
    code, _, err = run(["report", str(path), "--markdown"], capsys)
    assert_one_clear_line(code, err)
    assert "Part C" in err


def test_main_job_on_a_cpu_ends_with_how_to_run_part_c(tmp_path, capsys):
    argv = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64",
            "--seq-len", "8", "--batch-size", "2", "--profile-steps", "1", "--rows", "4", "--cols", "8",
            "--trials", "2", "--variants", "eager", "--out", str(tmp_path)]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("Part C") and "profuse step --device cpu --preset lab" in last
    assert not (tmp_path / "step.json").exists()
    code, out, _ = run([*argv, "--skip-profile"], capsys)
    assert code == 0 and "Part C" not in out  # Part B only, as the flag says


# --------------------------------------------------------------------------------------------
# diff of two step.json
# --------------------------------------------------------------------------------------------


def test_diff_compares_two_step_files_variant_by_variant(eager_vs_fused, tmp_path, capsys):
    """Two Part C runs: the ratio of step medians B/A per variant with a CI from the saved trials."""
    a = _steady(eager_vs_fused[0].to_dict())
    b = copy.deepcopy(a)
    fused_b = b["comparison"]["timings"]["fused"]
    fused_b["times_s"] = [x / 2 for x in fused_b["times_s"]]  # B's fused step takes half the time
    fused_b["median_s"] /= 2
    del b["comparison"]["timings"]["eager"]["times_s"][:-1]  # one trial left: no CI from it
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    code, out, err = run(["diff", str(pa), str(pb)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("=== diff: step time ratio B/A per variant")
    assert lines[1].startswith(f"A: {pa} (") and "preset lab" in lines[1]
    [fused] = [line for line in lines if line.startswith("fused ")]
    assert "3.150 ms" in fused and "1.575 ms" in fused
    low, high = map(float, re.search(r"0\.50x \((\d\.\d\d)-(\d\.\d\d)\)", fused).groups())
    assert low <= 0.5 <= high and "B faster (-50%)" in fused
    [eager] = [line for line in lines if line.startswith("eager ")]
    assert "no per-trial times saved" in eager
    code, out, err = run(["diff", str(pa), str(pa)], capsys)
    assert code == 0 and "no measurable difference" in out
    b["config"]["model"]["d_model"] *= 2
    b["comparison"]["timings"]["eager"]["times_s"] = [3e-3] * 12 + [1.0] * 8  # unsteady
    pb.write_text(json.dumps(b))
    code, out, err = run(["diff", str(pa), str(pb)], capsys)
    assert "note: A and B differ in model" in out
    assert any(line.startswith("B: WARNING step: unsteady timings") for line in out.splitlines())


# --------------------------------------------------------------------------------------------
# Any model spec: Hugging Face models, Liger-Kernel, CUDA graphs, one shared set of parameters
# --------------------------------------------------------------------------------------------

HF_TINY = ["--device", "cpu", "--model", "hf:llama", "--preset", "tiny", "--trials", "3"]


def hf_tiny(**kw):
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'profuse[hf]'")
    from profuse.models import model_spec

    return model_spec("hf:llama", "tiny", **kw)


def test_variants_share_one_set_of_parameters():
    cfg = S.StepConfig(model=hf_tiny(), variants=("eager", "compile"), trials=2)
    failed: dict = {}
    variants, optimizer = S._build_variants(cfg, ["eager", "compile"], fusion.EAGER, failed)
    eager, compiled = variants
    assert not failed and eager.net is eager.model and compiled.net is not compiled.model
    assert compiled.model is not eager.model  # its own modules ...
    for (n, p), (m, q) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        assert n == m and p is q  # ... over the very same Parameter objects
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(eager.model.parameters())


def test_default_variants_by_model():
    assert S.StepConfig(model=TINY).variants == S.VARIANTS
    hf = S.StepConfig(model=hf_tiny())
    assert hf.variants == S.HF_VARIANTS and hf.preset == "tiny"
    runs, skipped = S.plan(hf, None)
    assert runs[0] == "eager" and "compile" in runs
    assert skipped["liger"].startswith("needs CUDA and liger-kernel")
    assert skipped["liger-ops"].startswith("needs CUDA and liger-kernel")
    assert skipped["cudagraphs"].startswith("needs CUDA")
    gpt = S.StepConfig(model=TINY, variants=("liger",))
    assert S.plan(gpt, None)[1]["liger"].startswith("Liger-Kernel patches Hugging Face models")


def test_memory_estimate_counts_the_shared_state_once():
    from profuse.models import model_spec

    spec = model_spec("hf:llama", "Llama-3.2-1B")
    cuda = torch.device("cuda")  # only the dtype is read: bf16 under autocast
    cfg = S.StepConfig(model=spec, device=cuda)
    p, act = spec.param_count(), spec.activation_bytes(torch.bfloat16)
    two = S.estimated_bytes(cfg, ["eager", "compile"])
    assert two == S.estimated_bytes(cfg, ["eager", "fused", "compile", "compile+fused"]) == 22 * p + act
    assert S.estimated_bytes(cfg, ["eager", "liger"]) == two  # every variant pays the same loss
    assert S.estimated_bytes(cfg, ["eager", "cudagraphs"]) == two + act  # the graphs' memory pool
    every = S.estimated_bytes(cfg, list(S.ALL_VARIANTS))
    assert every < 0.9 * 139e9 < len(S.ALL_VARIANTS) * 16 * p + act  # fits an H200 shared, not copied
    bf16 = S.StepConfig(model=spec, device=cuda, precision="bf16")  # bf16 weights, gradients, moments
    assert S.estimated_bytes(bf16, ["eager", "compile"]) == 8 * p + 2 * p + act


def test_a_step_that_will_not_fit_is_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("profuse.env.free_memory_bytes", lambda device: 8e9)
    argv = [
        "step",
        "--device",
        "cpu",
        "--model",
        "hf:llama",
        "--preset",
        "Llama-3.2-1B",
        "--out",
        str(tmp_path),
    ]
    code, out, err = run(argv, capsys)
    assert_one_clear_line(code, err)
    assert "1236M parameters" in err and "needs about" in err and "shared" in err
    assert out == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--layers", "3"], "--layers: sizes of the built-in GPT"),
        (["--preset", "lab"], "unknown preset 'lab' for hf:llama"),
        (["--model", "hf:bert"], "unknown Hugging Face architecture"),
        (["--hf-config", "nowhere.json", "--preset", "tiny"], "give one"),
        (["--seq-len", "5000"], "longer than the model's"),
    ],
)
def test_bad_hf_step_input_exits_2_with_one_line(flags, words, tmp_path, capsys):
    hf_tiny()
    argv = ["step", *HF_TINY, "--out", str(tmp_path)]
    argv = [a for a in argv if a not in ("--preset", "tiny")] if "--preset" in flags else argv
    code, out, err = run([*argv, *flags], capsys)
    assert_one_clear_line(code, err)
    assert words in err and out == ""


def test_hf_step_command(tmp_path, capsys, monkeypatch):
    """eager and compile of a tiny Llama through the command line; Liger and CUDA graphs skipped
    here with their reasons."""
    hf_tiny()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["step", *HF_TINY, "--variants", "eager,compile,liger,liger-ops,cudagraphs",
            "--profile-steps", "1", "--out", str(tmp_path)]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0] == (
        "=== Part C: the whole training step of hf:llama tiny, eager vs fused vs Liger-Kernel vs "
        "torch.compile (cpu, amp) ==="
    )
    assert lines[1].startswith(
        "model: hf:llama tiny (transformers' own class, random weights): 2 layers, d_model 96"
    )
    assert "liger: skipped (needs CUDA and liger-kernel; this run is on the CPU)" in lines
    assert "liger-ops: skipped (needs CUDA and liger-kernel; this run is on the CPU)" in lines
    assert any(line.startswith("cudagraphs: skipped (needs CUDA") for line in lines)
    [verdict] = [line for line in lines if line.startswith("VERDICT: ")]
    # Which variant wins is the clock's to say; what bounds a CPU step is not.
    assert "the eager step is host-bound (on a CPU the whole step is host time)" in verdict
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["config"]["model_arg"] == "hf:llama" and data["config"]["spec"]["model"] == "hf:llama"
    assert list(data["results"]) == ["eager", "compile"] and set(data["profiles"]) == {"eager", "compile"}
    assert data["same_math"]["compile"]["passed"]  # the same step, compiled (fp32, against float64)
    assert data["tokens_per_step"] == 128 and data["n_params"] == hf_tiny().param_count()
    code, again, _ = run(["report", str(tmp_path / "step.json")], capsys)
    again, provenance = again.split("\n\nprovenance:\n")  # the run's text, then where it came from
    assert code == 0 and again.rstrip("\n") == out.rstrip("\n").rsplit("\n", 1)[0]  # all but 'results:'
    assert "profuse step --device cpu --model hf:llama" in provenance


def test_hf_fused_step_with_eager_ops(tmp_path):
    """The plumbing of a fused Hugging Face model: fusion.fuse's structure with plain-torch ops."""
    cfg = S.StepConfig(
        model=hf_tiny(), variants=("eager", "fused"), trials=2, profile_steps=1, out_dir=tmp_path
    )
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert res.check.passed and not res.failed, (res.check, res.failed)
    assert res.same_math["fused"].passed
    # every op the labelled llama has (qk_norm_rope is Qwen3's), each in the Amdahl line
    ops = {"silu_mul", "add_rms_norm", "rms_norm", "rope", "linear_cross_entropy"}
    assert set(res.profiles["eager"].block_op_pct) == ops
    assert all(v > 0 for v in res.profiles["eager"].block_op_pct.values())
    assert set(res.amdahl.op_s) == ops
    assert res.amdahl is not None and res.amdahl.predict() is not None
    # what fuse placed is the run's record, and the report's "fused ops" line says it
    placed = res.to_dict()["fused_ops"]["fused"]
    assert set(placed["counts"]) == ops and placed["counts"]["add_rms_norm"] == 2 * 2
    from profuse.report.step import format_step

    [line] = [x for x in format_step(res.to_dict()).splitlines() if x.startswith("fused ops: ")]
    assert "add_rms_norm x4" in line and "rope x2" in line


def test_hf_fused_step_through_the_interpreter(monkeypatch):
    """profuse's Triton kernels in a Hugging Face model: checked against float64, then timed."""
    pytest.importorskip("profuse.kernels.swiglu")
    pytest.importorskip("profuse.kernels.add_rms_norm")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = S.StepConfig(model=hf_tiny(batch_size=2, seq_len=16), device=device, variants=("eager", "fused"),
                       trials=2, profile_steps=0)  # fmt: skip
    res = S.run_step(cfg)
    assert res.check.error == "" and res.check.passed, res.check
    assert "fused" in res.comparison.timings and not res.failed
    assert res.same_math["fused"].passed


def test_liger_variants_with_a_stand_in_liger(monkeypatch, tmp_path):
    """liger-kernel runs on CUDA only; a stand-in with its entry point (the same math, and a
    patched module global as Liger's RoPE is) runs the variants' plumbing here: the same-math
    checks, liger's first step against eager's (the same loss: the model's own), the timed steps
    and profiles, and the modeling module left as it was."""
    from test_models import fake_liger

    from profuse.models import liger as L

    calls: list = []
    fake, rope = fake_liger(calls)
    monkeypatch.setattr(L, "liger_transformers", fake)
    monkeypatch.setattr(L, "unavailable", lambda device, family: "")
    cfg = S.StepConfig(
        model=hf_tiny(seq_len=24),
        variants=("eager", "liger-ops", "liger"),
        trials=2,
        profile_steps=1,
        out_dir=tmp_path,
    )
    res = S.run_step(cfg)
    assert not res.failed and not res.skipped, res.failed
    assert set(res.checks) == {"liger-ops", "liger"} and all(c.passed for c in res.checks.values())
    assert list(res.comparison.timings) == ["eager", "liger-ops", "liger"]
    ops_only = res.same_math["liger-ops"]  # the stand-in's math is the model's
    assert ops_only.passed and all(err == unfused for err, unfused, _ in ops_only.errors.values())
    assert res.same_math["liger"].passed  # against float64 of the model's own loss
    for name in ("liger-ops", "liger"):  # the stand-in's math is the model's, and so is the loss
        assert res.first_steps[name].loss == res.first_steps["eager"].loss
    assert calls and L.modeling_module("llama").apply_rotary_pos_emb is rope
    text = format_step(res.to_dict())
    assert "same math (liger (Liger-Kernel's default patch" in text
    assert "loss: the model's own, model(input_ids, labels=input_ids).loss" in text


def _trials(median: float, n: int = 12, spread: float = 0.002) -> list[float]:
    """n paired trials around `median`, the same small wobble in every variant's (a shared drift)."""
    return [median * (1 + spread * math.sin(i)) for i in range(n)]


def _verdict_data(
    eager_vs_fused, fused_s, *, cuda=False, idle=None, host_s=None, kernel_s=None, at_least=False
):
    """The saved run with its trials replaced: eager 1.0 s a step and fused `fused_s` (paired),
    the speedup recomputed from them, and (cuda) a profile and held host time for the bound."""
    data = copy.deepcopy(eager_vs_fused[0].to_dict())
    times = {
        "eager": _trials(1.0),
        "fused": [t * (1 + 0.001 * (i % 3 - 1)) for i, t in enumerate(_trials(fused_s))],
    }
    for name, ts in times.items():
        data["comparison"]["timings"][name]["times_s"] = ts
    data["results"]["fused"]["speedup"] = speedup_ci(times["eager"], times["fused"]).to_dict()
    if cuda:
        data["config"]["device"] = "cuda:0"
        for p in data["profiles"].values():
            p.update(
                basis="GPU kernel time", gpu_idle_pct=idle, launch_bound=idle > 50, launch_unit="kernels"
            )
        data["profiles"]["eager"]["time_per_step_us"] = kernel_s * 1e6
        data["results"]["eager"]["host_s"] = host_s
        data["comparison"]["timings"]["eager"]["host_is_lower_bound"] = at_least
    data["verdict"] = decide(data).to_dict()  # as the run decides it from what it measured
    return data


@pytest.mark.parametrize(
    "fused_s, winner, tied, words",
    [
        (0.77, "fused", [], r"VERDICT: fused wins; next: eager, 30% slower"),
        (1.0005, "eager", ["fused"], r"VERDICT: (eager and fused|fused and eager) tie \(within"),
        (1.25, "eager", [], r"VERDICT: eager wins; next: fused, 25% slower"),
    ],
)
def test_the_verdict_is_tie_verdict_over_the_saved_trials(eager_vs_fused, fused_s, winner, tied, words):
    data = _verdict_data(eager_vs_fused, fused_s)
    v = data["verdict"]
    assert {v["winner"], *v["tied_with"]} == {winner, *tied}  # a tie: either may lead by a hair
    want = tie_verdict({n: t["times_s"] for n, t in data["comparison"]["timings"].items()})
    assert (v["text"], v["winner"], v["tied_with"]) == (want.text, want.winner, want.tied_with)
    line = verdict_line(data)
    assert re.match(words, line) and "\n" not in line
    assert "the eager step is host-bound (on a CPU the whole step is host time)" in line
    if winner == "fused":  # the ratio of medians and the paired statistic, side by side
        assert "fused 1.30x (" in line and "faster than eager, per trial 1.30x (" in line
    assert [x for x in format_step(data).splitlines() if x.startswith("VERDICT: ")] == [line]


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"idle": 85.0, "host_s": 0.02, "kernel_s": 0.004},
         "the eager step is launch-bound (the GPU idles 85.0% of the step, waiting for launches"),
        ({"idle": 5.0, "host_s": 0.05, "kernel_s": 0.01},
         "the eager step is device-bound (the GPU idles 5.0% of the step: the CPU keeps ahead of it)"),
        ({"idle": 30.0, "host_s": 0.05, "kernel_s": 0.01},
         "the eager step is host-bound (the GPU idles 30.0% of the step; the CPU issues it in 50 ms, its "
         "kernels take 10 ms)"),
        ({"idle": 30.0, "host_s": 0.005, "kernel_s": 0.01},
         "the eager step is device-bound (the GPU idles 30.0% of the step; the CPU issues it in 5 ms"),
        ({"idle": 30.0, "host_s": 0.005, "kernel_s": 0.01, "at_least": True},
         "what bounds the eager step is not known (the GPU idles 30.0% of the step; the CPU issues it in "
         "at least 5 ms, its kernels take 10 ms: the launch queue filled"),
    ],
)  # fmt: skip
def test_the_bound_is_bench_bound_from_the_saved_profile_and_host_time(eager_vs_fused, kw, words):
    data = _verdict_data(eager_vs_fused, 0.77, cuda=True, **kw)
    line = verdict_line(data).replace(SYNCED_SOURCE, "")  # a file with no unsynchronised profile
    assert words in line, line
    b = bound(kw["idle"], kw["host_s"], kw.get("at_least", False), kw["kernel_s"])
    assert data["verdict"]["bound"] == b.word
    assert data["verdict"]["bound_why"] == SYNCED_SOURCE + b.why


def test_old_step_files_still_read(eager_vs_fused):
    """A step.json written before --model (no model_arg, spec, checks or amdahl_note) and before
    --precision (its precision in words; no verdict, phases, compile splits or budget): the
    verdict is decided as the run would have."""
    data = eager_vs_fused[0].to_dict()
    want = verdict_line(data)
    for key in ("model_arg", "spec", "precision_text"):
        del data["config"][key]
    data["config"]["precision"] = "fp32"
    for key in ("checks", "amdahl_note", "verdict", "phases", "compile", "budget"):
        del data[key]
    text = format_step(data)
    assert text.splitlines()[0].startswith(
        "=== Part C: the whole training step, eager vs fused vs torch.compile (cpu, preset"
    )
    assert text.splitlines()[1].endswith("parameters; fp32")
    assert [line for line in text.splitlines() if line.startswith("VERDICT: ")] == [want]
    assert not any(line.startswith("run time: ") for line in text.splitlines())


def test_a_variant_that_replaces_the_parameters_is_refused(monkeypatch):
    """The variants share one set of Parameter objects; one whose preparation makes new ones
    (the same values) cannot be timed against the others from the same weights: failed, in a line."""
    from profuse.models.gpt import GPTSpec

    def fuse_with_new_parameters(self, model, ops=None, *, label=False):
        fusion.apply_block_ops(model, ops)
        mlp = next(m for m in model.modules() if isinstance(m, SwiGLU))
        mlp.w_down.weight = nn.Parameter(mlp.w_down.weight.detach().clone())
        return model

    monkeypatch.setattr(GPTSpec, "fuse", fuse_with_new_parameters)
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0)
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert "replaced the model's parameters" in res.failed["fused"]
    assert list(res.comparison.timings) == ["eager"]


def test_a_model_fusion_cannot_label_is_profiled_unlabelled(monkeypatch, tmp_path):
    from profuse.models.gpt import GPTSpec

    def refuse(self, model):
        raise ValueError("no block ops this fusion knows\nsecond line")

    monkeypatch.setattr(GPTSpec, "label", refuse)
    cfg = S.StepConfig(model=TINY, variants=("eager",), trials=2, profile_steps=1, out_dir=tmp_path)
    res = S.run_step(cfg)
    assert res.profiles["eager"].block_op_pct == {} and res.amdahl is None
    assert res.amdahl_note.endswith("(ValueError: no block ops this fusion knows)")
    assert res.amdahl_note in format_step(res.to_dict()).splitlines()


def test_step_json_holds_the_verdict_of_its_own_paired_trials(eager_vs_fused):
    """step.json's verdict.winner and tied_with are tie_verdict's over the trials the same file
    saves, and the report prints its words once, from that field."""
    res, _, _ = eager_vs_fused
    data = json.loads(json.dumps(res.to_dict()))  # as written and read back
    v, cmp = data["verdict"], data["comparison"]
    want = tie_verdict(
        {n: t["times_s"] for n, t in cmp["timings"].items()}, band=cmp["design"]["band"], seed=cmp["seed"]
    )
    assert (v["winner"], v["tied_with"], v["text"]) == (want.winner, want.tied_with, want.text)
    assert {v["winner"], *v["tied_with"]} <= set(cmp["timings"])
    assert cmp["design"]["balanced"] and all(sorted(o) == sorted(cmp["timings"]) for o in cmp["orders"])
    [line] = [x for x in format_step(data).splitlines() if x.startswith("VERDICT: ")]
    assert line.startswith(f"VERDICT: {v['text']}")


def test_the_referee_designs_warnings_reach_the_report(eager_vs_fused):
    """Throttled trials (NVML's saved readings), a drifting variant and the verdict's noise
    warning print under the table; a run without them prints none of them."""
    from profuse.report.step import design_warnings

    data = copy.deepcopy(eager_vs_fused[0].to_dict())
    data["verdict"]["warnings"] = []
    for t in data["comparison"]["timings"].values():
        t["trend"] = None
    assert design_warnings(data) == []
    data["comparison"]["clocks"] = [
        {"sm_mhz": 1980, "reasons": [], "throttled": False},
        {"sm_mhz": 1410, "reasons": ["sw_power_cap"], "throttled": True, "power_violation_s": 0.2},
    ]
    data["comparison"]["timings"]["fused"]["trend"] = {
        "r": 0.8, "p": 0.001, "trials": 12, "first_s": 0.1, "last_s": 0.12, "drifting": True,
    }  # fmt: skip
    data["verdict"]["warnings"] = ["WARNING: trial noise (eager's trials vary 3%) exceeds ..."]
    lines = design_warnings(data)
    assert len(lines) == 3 and lines[0].startswith("WARNING: the GPU throttled in 1 of 2 trials")
    assert "SM clock 1410-1980 MHz" in lines[0] and "held back 0.2 s" in lines[0]
    assert lines[1].startswith("WARNING fused: its times drifted") and lines[2].startswith(
        "WARNING: trial noise"
    )
    assert all(line in format_step(data).splitlines() for line in lines)


def test_the_trial_design_fits_the_step_and_bounds_the_run():
    """A long step gets fewer steps a trial (never under MIN_CALLS) and no more trial rounds than
    TRIALS_BUDGET_S holds; a short one keeps the referee's 10 and its 30; a CPU one step a trial."""
    cuda = torch.device("cuda")
    long = S.trial_design(cuda, 0.166, 7)  # Llama-3.2-1B on the H200, every variant
    assert long.calls == math.ceil(S.TRIAL_SPAN_S / 0.166) >= S.MIN_CALLS
    assert long.max_trials == int(S.TRIALS_BUDGET_S // (7 * (long.calls + long.discard) * 0.166)) < 30
    assert long.max_trials * 7 * (long.calls + long.discard) * 0.166 <= S.TRIALS_BUDGET_S
    # host time's own rounds: HOST_BUDGET_S of them for a long step, never under HOST_MIN_ROUNDS
    assert long.host_rounds == S.HOST_MIN_ROUNDS < 30
    mid = S.trial_design(cuda, 0.08, 3)
    assert mid.host_rounds == int(S.HOST_BUDGET_S // (3 * S.HOST_ROUND_STEPS * 0.08)) > S.HOST_MIN_ROUNDS
    short = S.trial_design(cuda, 0.024, 4)  # the small GPT
    assert (short.calls, short.max_trials) == (S.REFEREE.calls, S.REFEREE.max_trials)
    assert short.host_rounds is None  # a round a trial, where the host can bound the step
    huge = S.trial_design(cuda, 5.0, 2)
    assert huge.calls == S.MIN_CALLS and huge.max_trials < 12  # the asked trials still run (compare)
    assert S.trial_design(cuda) == S.REFEREE
    cpu = S.trial_design(torch.device("cpu"), 0.5, 3)
    assert cpu.calls == 1 and cpu.max_trials == 0 and cpu.balanced


def test_trials_left_unnamed_fit_a_long_step_in_whole_designs():
    """--trials left out: a long step's trial rounds fit TRIALS_BUDGET_S in whole balanced designs,
    one design at the least; a short step, a CPU or an unknown step keep DEFAULT_TRIALS (rounded
    up to whole designs, as asking for them gives)."""
    from profuse.bench import DEFAULT_TRIALS
    from profuse.bench.timing import balanced_trials, design_rows

    cuda = torch.device("cuda")
    for n, step_s in ((7, 0.15), (7, 0.19), (5, 0.166), (4, 0.3), (6, 0.11)):
        design = S.trial_design(cuda, step_s, n)
        round_s = n * (design.calls + design.discard) * step_s
        got = S.fitted_trials(cuda, step_s, n)
        assert got % design_rows(n) == 0 and got >= design_rows(n)
        assert got * round_s <= S.TRIALS_BUDGET_S or got == design_rows(n)
        most = balanced_trials(n, DEFAULT_TRIALS)
        assert (got + design_rows(n)) * round_s > S.TRIALS_BUDGET_S or got == most
    assert S.fitted_trials(cuda, 0.15, 7) == 14 < DEFAULT_TRIALS  # Llama-3.2-1B, every default variant
    assert S.fitted_trials(cuda, 30.0, 3) == 6  # one whole design however long the step
    assert S.fitted_trials(cuda, 0.01, 4) == balanced_trials(4, DEFAULT_TRIALS) == 32
    assert S.fitted_trials(cuda, None, 5) == S.fitted_trials(torch.device("cpu"), 0.5, 5) == 30
    cfg = S.StepConfig(device=torch.device("cpu"), variants=["eager"])
    assert cfg.trials is None and cfg.to_dict()["trials"] is None
    counted = S.budget(cfg, ["eager"])
    assert counted["trials_fitted"] == 1 and counted["trial_rounds"] == balanced_trials(1, DEFAULT_TRIALS)
    asked = S.budget(S.StepConfig(device=torch.device("cpu"), variants=["eager"], trials=4), ["eager"])
    assert asked["trials_fitted"] == 0 and asked["trial_rounds"] == 4
    # the plan line counts fitted trials at their most on CUDA, and says so; asked ones as asked
    on_cuda = S.StepConfig(device=torch.device("cuda"), variants=["eager", "fused"])
    line = S.plan_line(on_cuda, ["eager", "fused"], S.budget(on_cuda, ["eager", "fused"]))
    assert "up to 30 trial rounds (fewer where a round of steps is long)" in line
    named = S.StepConfig(device=torch.device("cuda"), variants=["eager", "fused"], trials=6)
    line = S.plan_line(named, ["eager", "fused"], S.budget(named, ["eager", "fused"]))
    assert ", 6 trial rounds," in line and "up to" not in line


def test_graph_variants_that_would_not_fit_are_skipped_with_the_reason_and_the_rest_run(monkeypatch):
    """Llama-3.2-1B's 7 default variants on an 80 GB card: the graphs' pool is what does not fit."""
    from profuse.models import model_spec

    cfg = S.StepConfig(model=model_spec("hf:llama", "Llama-3.2-1B"), device=torch.device("cuda"))
    graphs = [n for n in cfg.variants if n in S.GRAPH_VARIANTS]
    assert graphs  # the default has them
    need_all = S.estimated_bytes(cfg, list(cfg.variants))
    rest = [n for n in cfg.variants if n not in graphs]
    need_rest = S.estimated_bytes(cfg, rest)
    assert need_rest < need_all
    free = (need_rest + need_all) / 2 / 0.9  # between the two
    monkeypatch.setattr("profuse.env.free_memory_bytes", lambda device: free)
    runs, skipped = S.plan(cfg, fusion.EAGER)
    assert not set(graphs) & set(runs) and set(graphs) <= set(skipped)
    assert all("graphs' memory pool would not fit" in skipped[n] for n in graphs)
    S.check_step_fits(cfg, runs)  # the rest fits: no error
    monkeypatch.setattr("profuse.env.free_memory_bytes", lambda device: need_all / 0.9 + 1)  # room for all
    assert set(graphs) <= set(S.plan(cfg, fusion.EAGER)[0])
