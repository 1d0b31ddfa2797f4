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

import pytest
import torch
from cases import assert_one_clear_line, run
from torch import nn

from profuse import blockops, fusion
from profuse import step as S
from profuse.bench.stats import FEW_TRIALS
from profuse.errors import UsageError
from profuse.model import GPT, AddRMSNorm, GPTConfig, SwiGLU, random_batch
from profuse.report.step import format_step, load_step
from profuse.tail import BACKWARD_TOL, FORWARD_TOL

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
    assert res.first_steps["fused"].grad_rel_diff < BACKWARD_TOL[cfg.dtype]


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


def test_a_first_step_far_from_eagers_fails_the_variant(monkeypatch):
    """Math that slips past the small model's check (here: the check is skipped) is caught at
    the real size by the first step's distance from eager's, and is not timed."""
    wrong = fusion.BlockOps(blockops.silu_mul_eager, _wrong_norm, "wrong")
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0)
    passed = S.MathCheck(model={}, precision=cfg.precision, passed=True)
    monkeypatch.setattr(S, "check_same_math", lambda cfg, ops: passed)
    res = S.run_step(cfg, ops=wrong)
    assert "first step" in res.failed["fused"] and "over the bound" in res.failed["fused"]
    assert list(res.comparison.timings) == ["eager"]


def test_first_step_bounds():
    ok = S.FirstStep(seconds=1.0, loss=1.0, loss_rel_diff=1e-3, grad_rel_diff=0.1)
    S._check_first_step(ok, torch.bfloat16)  # inside 2 x 16 u of bf16 (0.125)
    for field_, value in (("grad_rel_diff", 0.2), ("loss_rel_diff", 0.1), ("grad_rel_diff", float("nan"))):
        bad = S.FirstStep(**{**ok.__dict__, field_: value})
        with pytest.raises(ValueError, match="over the bound"):
            S._check_first_step(bad, torch.bfloat16)
    with pytest.raises(ValueError, match="in the loss"):
        S._check_first_step(ok, torch.float32)  # 1e-3 is far outside fp32's bound


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
    from profuse.cli import _step_config, build_step_parser

    args = build_step_parser().parse_args(["--preset", "small", "--layers", "3", "--batch-size", "2",
                                           "--variants", "compile,eager", "--trials", "5"])  # fmt: skip
    cfg = _step_config(args, CPU, args.preset)
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
    assert all(len(t.times_s) == 3 for t in res.comparison.timings.values())
    assert res.first_steps["fused"].loss_rel_diff == 0.0 and res.first_steps["fused"].grad_rel_diff == 0.0
    assert res.memory == {}  # CPU: not measured
    for name in ("eager", "fused"):
        p = res.profiles[name]
        assert p.launch_unit == "operators" and p.launches_per_step > 0 and 0 < p.memory_bound_pct < 100
        assert p.gpu_idle_pct is None and not p.launch_bound
        assert (out / f"trace-step-{name}.json").exists()
    assert {"checking the fused step against float64", "first step: eager", "steps: trials"} <= set(stages)
    assert any(s.startswith("profiling ") for s in stages) and any(s.startswith("silu_mul: ") for s in stages)


def test_eager_profile_finds_the_fused_ops_forward_and_backward(eager_vs_fused):
    res, _, _ = eager_vs_fused
    pct = res.profiles["eager"].block_op_pct
    assert set(pct) == {"silu_mul", "add_rms_norm"} and all(v > 0 for v in pct.values())
    assert sum(pct.values()) < 100
    assert res.profiles["fused"].block_op_pct == {}  # only the eager profile is labelled


def test_amdahl_prediction_from_the_shares_and_op_speedups(eager_vs_fused):
    res, _, _ = eager_vs_fused
    a = res.amdahl
    assert set(res.ops) == {"silu_mul", "add_rms_norm"}
    assert res.ops["silu_mul"].shape.startswith(f"{TINY.batch_size * TINY.seq_len} x {TINY.hidden}")
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
    caveats = [line for line in format_step(data).splitlines() if "trials: a bootstrap over so few" in line]
    assert len(caveats) == (1 if trials < FEW_TRIALS else 0)
    data["comparison"]["trials"] = FEW_TRIALS
    assert "a bootstrap over so few" not in format_step(data)
    data["comparison"]["trials"] = 3
    assert any(line.startswith("WARNING only 3 trials") for line in format_step(data).splitlines())


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
        "(cpu, preset lab, resized by the model flags) ==="
    )
    assert lines[-1].startswith("CPU: ")
    data["config"]["resized"] = False  # files written before the field, and runs at the preset
    assert format_step(data).splitlines()[0].endswith("(cpu, preset lab) ===")
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
    assert out.rstrip("\n") == text


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
    assert err == ""  # no progress bar off a terminal
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0].startswith("=== Part C:")
    assert any(line.startswith("fused: skipped (needs a CUDA GPU") for line in lines)
    assert any(line.startswith("compile+fused: skipped (") for line in lines)
    assert any(line.startswith("first step vs eager") and "compile: loss" in line for line in lines)
    assert lines[-1] == f"results: {tmp_path / 'step.json'}"
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["kind"] == "step" and list(data["results"]) == ["eager", "compile"]
    assert data["results"]["compile"]["speedup"]["low"] <= data["results"]["compile"]["speedup"]["high"]
    assert data["first_steps"]["compile"]["grad_rel_diff"] < 1e-4  # the same step, compiled (fp32)
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
