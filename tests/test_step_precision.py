"""Part C and Part A in the precisions people train in: amp (fp32 parameters, bf16 autocast on
CUDA; fp32 on a CPU) and bf16 (bf16 parameters and AdamW state), one or both in a run; the
float64 check in each; the tables of a run in both precisions and the ranks that moved, read
off the variants' profiles.

bf16 on a CPU is slow: the models here are the smallest that still have every part.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cases import assert_one_clear_line, run

from profuse import blockops, fusion
from profuse import step as S
from profuse.errors import UsageError
from profuse.model import GPTConfig
from profuse.report.step import both_precisions, format_step, format_step_diff, rank_changes
from profuse.tail import BACKWARD_TOL, FORWARD_TOL

TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)
GPT_FLAGS = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64",
             "--seq-len", "8", "--batch-size", "2", "--trials", "2", "--variants", "eager"]  # fmt: skip
HF_FLAGS = ["--device", "cpu", "--model", "hf:llama", "--preset", "tiny", "--batch-size", "2",
            "--seq-len", "16", "--trials", "2", "--variants", "eager"]  # fmt: skip


def hf_tiny(**kw):
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'profuse[hf]'")
    from profuse.models import model_spec

    return model_spec("hf:llama", "tiny", **kw)


# --------------------------------------------------------------------------------------------
# The configuration
# --------------------------------------------------------------------------------------------


def test_precision_is_amp_unless_asked_and_names_its_dtypes():
    amp = S.StepConfig(model=TINY)
    assert amp.precision == "amp" and amp.param_dtype == torch.float32 and amp.dtype == torch.float32
    bf16 = S.StepConfig(model=TINY, precision="bf16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.dtype == torch.bfloat16
    cuda = S.StepConfig(model=TINY, device="cuda")  # the device is only read here
    assert cuda.dtype == torch.bfloat16 and cuda.param_dtype == torch.float32  # autocast's branches
    d = bf16.to_dict()
    assert d["precision"] == "bf16" and d["precision_text"].startswith("bf16: bf16 parameters")
    with pytest.raises(UsageError, match="unknown precision 'fp16'") as err:
        S.StepConfig(model=TINY, precision="fp16")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The float64 check, in each precision
# --------------------------------------------------------------------------------------------


def _scaled_norm(scale):
    def add_rms_norm(x, residual, weight, eps):
        y, h = blockops.add_rms_norm_eager(x, residual, weight, eps)
        return y * scale, h

    return fusion.BlockOps(blockops.silu_mul_eager, add_rms_norm, f"norm x {scale}")


@pytest.mark.parametrize("precision", ["amp", "bf16"])
@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_the_float64_check_covers_each_precision(precision, model):
    spec = TINY if model == "gpt" else hf_tiny(batch_size=2, seq_len=16)
    cfg = S.StepConfig(model=spec, precision=precision, variants=("eager", "fused"))
    check = S.check_same_math(cfg, fusion.EAGER)
    assert check.passed and check.error == "" and check.precision == precision
    dt = cfg.dtype  # fp32 for amp on a CPU, bf16 for bf16: the bounds are that dtype's
    assert check.bounds["loss"] >= FORWARD_TOL[dt]
    assert min(b for k, b in check.bounds.items() if k != "loss") >= BACKWARD_TOL[dt]
    if precision == "bf16":  # bf16 parameters round: its own error is of bf16's size, not fp32's
        assert max(u for _, u in check.errors.values()) > FORWARD_TOL[torch.float32]
    wrong = S.check_same_math(cfg, _scaled_norm(1.25))  # a norm 25% off fails in either precision
    assert not wrong.passed and wrong.errors[wrong.worst][0] > wrong.bounds[wrong.worst]


def test_a_bf16_step_runs_on_the_cpu_with_bf16_parameters_and_state(tmp_path):
    cfg = S.StepConfig(model=TINY, precision="bf16", variants=("eager", "fused"), trials=2, profile_steps=1,
                       out_dir=tmp_path, trace_tag="bf16")  # fmt: skip
    seen = {}

    def watch(stage, done, total):
        seen.setdefault(stage, (done, total))

    res = S.run_step(cfg, progress=watch, ops=fusion.EAGER)
    assert not res.failed and res.check.passed and res.check.precision == "bf16"
    assert list(res.comparison.timings) == ["eager", "fused"]
    same = res.same_math["fused"]  # eager's math: bitwise eager's, in bf16 too, against fp32
    assert same.passed and same.reference == "float32"
    assert all(err == unfused for err, unfused, _ in same.errors.values())
    assert res.weights.finite and res.weights.unchanged  # lr 0 holds bf16 weights bitwise too
    data = res.to_dict()
    assert data["config"]["precision"] == "bf16"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "trace-step-eager-bf16.json",
        "trace-step-fused-bf16.json",
    ]
    assert "build: eager, fused over one set of parameters (bf16)" in seen


# --------------------------------------------------------------------------------------------
# Both precisions: one table each, and the ranks that moved, from the profiles
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """A real run of eager and fused (the eager stand-ins), profiled: the shape of a saved run."""
    out = tmp_path_factory.mktemp("both")
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=3, profile_steps=1, out_dir=out)
    return S.run_step(cfg, ops=fusion.EAGER).to_dict()


def _as(run: dict, precision: str, medians: dict[str, float], categories: dict[str, dict], ops=None) -> dict:
    """`run` made into a run in `precision` with these step medians and profiles' categories
    (ms a step) and top operators: what the rank lines read."""
    data = copy.deepcopy(run)
    data["config"].update(precision=precision, precision_text=f"{precision}: as the test says")
    base = medians["eager"]
    for name, median in medians.items():
        data["results"][name]["median_s"] = median
        if name != "eager":
            r = base / median
            verdict = "faster" if r > 1.02 else "slower" if r < 0.98 else "no measurable gain"
            data["results"][name]["speedup"] = {
                "median": r,
                "low": r * 0.99,
                "high": r * 1.01,
                "verdict": verdict,
            }
        data["profiles"][name]["category_ms"] = categories[name]
        data["profiles"][name]["top_ops"] = (ops or {}).get(name, {})
    data.pop("verdict")
    return data


def test_the_ranks_that_moved_say_what_their_profiles_moved(one_run):
    amp = _as(one_run, "amp", {"eager": 0.20, "fused": 0.21},
              {"eager": {"matmul": 100.0, "loss": 30.0}, "fused": {"matmul": 100.0, "loss": 40.0}},
              {"fused": {"aten::copy_": 12.0, "aten::mm": 50.0}})  # fmt: skip
    bf16 = _as(one_run, "bf16", {"eager": 0.18, "fused": 0.15},
               {"eager": {"matmul": 95.0, "loss": 28.0}, "fused": {"matmul": 96.0, "loss": 10.0}},
               {"fused": {"aten::copy_": 2.0, "aten::mm": 49.5}})  # fmt: skip
    lines = rank_changes(amp, bf16)
    assert len(lines) == 2  # fused moved up, so eager moved down
    [fused] = [line for line in lines if line.startswith("fused: ")]
    assert fused.startswith("fused: 2nd in amp -> 1st in bf16; 1.05x slower -> 1.20x vs eager")
    # the categories that moved most, largest first, with eager's beside them; then the operators
    assert "a step, amp -> bf16: loss 40.00 -> 10.00 ms, matmul 100.00 -> 96.00 ms" in fused
    assert "(eager's: matmul 100.00 -> 95.00 ms, loss 30.00 -> 28.00 ms)" in fused
    assert fused.endswith("top operators: aten::copy_ 12.00 -> 2.00 ms, aten::mm 50.00 -> 49.50 ms")
    amp["profiles"]["fused"]["launch_unit"] = "kernels"  # a CUDA profile's rows are its kernels
    [fused] = [line for line in rank_changes(amp, bf16) if line.startswith("fused: ")]
    assert fused.endswith("top kernels: aten::copy_ 12.00 -> 2.00 ms, aten::mm 50.00 -> 49.50 ms")
    [eager] = [line for line in lines if line.startswith("eager: ")]
    assert eager.startswith("eager: 1st in amp -> 2nd in bf16; its ")
    same = _as(one_run, "bf16", {"eager": 0.18, "fused": 0.19}, {"eager": {}, "fused": {}})
    assert rank_changes(amp, same) == []
    no_profiles = copy.deepcopy(bf16)
    del no_profiles["profiles"]["fused"]["category_ms"]
    assert any("no profiles of it in both" in line for line in rank_changes(amp, no_profiles))


def test_a_file_of_both_precisions_prints_a_table_each_then_the_moves(one_run, tmp_path, capsys):
    amp = _as(
        one_run, "amp", {"eager": 0.20, "fused": 0.21}, {"eager": {"loss": 3.0}, "fused": {"loss": 4.0}}
    )
    bf16 = _as(
        one_run, "bf16", {"eager": 0.18, "fused": 0.15}, {"eager": {"loss": 3.0}, "fused": {"loss": 1.0}}
    )
    data = both_precisions([amp, bf16])
    text = format_step(data)
    titles = [line for line in text.splitlines() if line.startswith("=== Part C")]
    assert len(titles) == 3 and "(cpu, amp," in titles[0] and "(cpu, bf16," in titles[1]
    assert titles[2].startswith("=== Part C: amp vs bf16, the ranks that moved")
    assert sum(line.startswith("VERDICT: ") for line in text.splitlines()) == 2  # one a precision
    assert text.rstrip().splitlines()[-2].startswith("eager: 1st in amp -> 2nd in bf16")
    path = tmp_path / "step.json"
    path.write_text(json.dumps(data))
    code, out, err = run(["report", str(path)], capsys)
    from profuse.report.provenance import provenance_lines

    assert code == 0 and out.rstrip("\n") == "\n".join(
        [text, "", *provenance_lines(data)]
    )  # and the provenance
    code, out, err = run(["diff", str(path), str(path)], capsys)  # precision by precision
    assert code == 0, err
    assert f"A: {path} [amp] (" in out and f"B: {path} [bf16] (" in out
    single = tmp_path / "amp.json"
    single.write_text(json.dumps(amp))
    assert "[amp]" in format_step_diff(amp, data) and "[bf16]" not in format_step_diff(amp, data)
    other = copy.deepcopy(amp)
    other["config"]["precision"] = "fp32"  # a file from before --precision: nothing in common
    with pytest.raises(UsageError, match="share no precision"):
        format_step_diff(other, data)


# --------------------------------------------------------------------------------------------
# The command line: --precision for step and profile, the built-in GPT and Hugging Face models
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, precisions",
    [(GPT_FLAGS, ["amp"]), (GPT_FLAGS + ["--precision", "bf16"], ["bf16"]),
     (GPT_FLAGS + ["--precision", "both"], ["amp", "bf16"]),
     (HF_FLAGS, ["amp"]), (HF_FLAGS + ["--precision", "bf16"], ["bf16"]),
     (HF_FLAGS + ["--precision", "both"], ["amp", "bf16"])],
    ids=["gpt-amp", "gpt-bf16", "gpt-both", "hf-amp", "hf-bf16", "hf-both"],
)  # fmt: skip
def test_step_runs_and_records_each_precision(flags, precisions, tmp_path, capsys):
    if "hf:llama" in flags:
        hf_tiny()
    code, out, err = run(["step", *flags, "--profile-steps", "1", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "step.json").read_text())
    runs = data["runs"] if len(precisions) > 1 else [data]
    assert [r["config"]["precision"] for r in runs] == precisions
    for r in runs:  # each precision's own full-size check, held weights and verdict
        ref = "float64" if r["config"]["precision"] == "amp" else "float32"  # amp on a CPU computes in fp32
        assert r["same_math"]["eager"]["passed"] and r["same_math"]["eager"]["reference"] == ref
        assert r["weights"]["finite"] and r["weights"]["unchanged"]
        timed = set(r["comparison"]["timings"])
        assert r["verdict"]["winner"] in timed and set(r["verdict"]["tied_with"]) <= timed - {
            r["verdict"]["winner"]
        }
    assert data.get("precision", precisions[0]) == ("both" if len(precisions) > 1 else precisions[0])
    titles = [line for line in out.splitlines() if line.startswith("=== Part C: the whole training step")]
    assert [t.split("(cpu, ")[1].split(")")[0].split(",")[0] for t in titles] == precisions
    tags = [f"-{p}" for p in precisions] if len(precisions) > 1 else [""]
    assert sorted(p.name for p in tmp_path.glob("trace-*")) == sorted(
        f"trace-step-eager{t}.json" for t in tags
    )
    if len(precisions) > 1:
        assert "=== Part C: amp vs bf16, the ranks that moved" in out
        assert any(line.startswith("[") and "bf16: first step: eager" in line for line in err.splitlines())
    assert "first step: eager" not in out  # progress stays on stderr


@pytest.mark.parametrize("precision", ["amp", "bf16"])
def test_fused_adamw_steps_every_variant_and_the_file_says_so(precision, tmp_path, capsys, monkeypatch):
    """--optimizer fused: the run's one AdamW is torch's fused kernel (seen by what the step
    builds), the weights stay bitwise the same at lr 0 through every variant's steps, and the
    config, the report's model line and the command that times it again say so."""
    built = []
    real = S.make_optimizer

    def spy(params, lr, kind="default"):
        opt = real(params, lr, kind)
        built.append(opt.defaults.get("fused"))
        return opt

    monkeypatch.setattr(S, "make_optimizer", spy)
    argv = ["step", *GPT_FLAGS, "--precision", precision, "--optimizer", "fused", "--profile-steps", "0",
            "--trials", "2", "--out", str(tmp_path)]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert built == [True]
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["config"]["optimizer"] == "fused"
    assert data["weights"]["unchanged"] and data["weights"]["finite"]
    assert "AdamW fused (fused=True), every variant" in out
    from profuse.report.step import again_command

    assert "--optimizer fused" in again_command(data)
    data["config"]["optimizer"] = "default"
    assert "--optimizer" not in again_command(data)


def test_an_unknown_optimizer_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(UsageError, match="unknown optimizer 'sgd'"):
        S.StepConfig(device=torch.device("cpu"), optimizer="sgd")
    code, out, err = run(["step", *GPT_FLAGS, "--optimizer", "sgd", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "--optimizer" in err and out == ""


def test_both_stopped_in_bf16_keeps_amp_whole_and_says_so(tmp_path, capsys, monkeypatch):
    """An interrupt (Ctrl-C, timeout -s INT) in --precision both's second run: the first run's
    step.json is written whole, as a run of amp alone, and the one line says what was kept."""
    real = S.run_step

    def stopped_in_bf16(cfg, progress=None):
        if cfg.precision == "bf16":
            raise KeyboardInterrupt
        return real(cfg, progress=progress)

    monkeypatch.setattr(S, "run_step", stopped_in_bf16)
    argv = ["step", *GPT_FLAGS, "--precision", "both", "--profile-steps", "0", "--out", str(tmp_path)]
    code, out, err = run(argv, capsys)
    assert code == 130
    line = err.strip().splitlines()[-1]
    assert line.startswith("profuse: interrupted; amp had finished") and str(tmp_path / "step.json") in line
    assert "bf16 did not finish" in line
    data = json.loads((tmp_path / "step.json").read_text())
    assert "runs" not in data and data["config"]["precision"] == "amp" and data["results"]["eager"]
    assert "=== Part C: the whole training step" in out


TWO_VARIANTS = [*GPT_FLAGS[:-1], "eager,fused", "--profile-steps", "1"]


@pytest.mark.parametrize("precision", ["amp", "both"])
def test_an_interrupt_in_the_profiles_keeps_the_timed_trials(precision, tmp_path, capsys, monkeypatch):
    """Ctrl-C (or a time limit's SIGINT) once the trials are done: step.json keeps them, with the
    profiles finished before it, marked interrupted; the report says so; --precision both's
    second precision is named as not run. Nothing measured is lost."""
    real, profiled = S.profile_variant, []

    def stopped_at_fused(step, name, **kw):
        if name == "fused":
            raise KeyboardInterrupt
        profiled.append(name)
        return real(step, name, **kw)

    monkeypatch.setattr(S, "profile_variant", stopped_at_fused)
    code, out, err = run(["step", *TWO_VARIANTS, "--precision", precision, "--out", str(tmp_path)], capsys)
    assert code == 130 and profiled == ["eager"]
    line = err.strip().splitlines()[-1]
    assert line.startswith("profuse: interrupted; amp was interrupted in the profiles (fused not profiled)")
    assert str(tmp_path / "step.json") in line
    assert ("bf16 did not run" in line) == (precision == "both")
    data = json.loads((tmp_path / "step.json").read_text())
    assert "runs" not in data and data["config"]["precision"] == "amp"
    assert data["interrupted"] == "interrupted in the profiles (fused not profiled)"
    assert set(data["results"]) == {"eager", "fused"}
    assert len(data["comparison"]["timings"]["fused"]["times_s"]) >= 2
    assert list(data["profiles"]) == ["eager"] and data["amdahl"] is None and data["verdict"]
    assert "INTERRUPTED: interrupted in the profiles (fused not profiled)" in out and "VERDICT:" in out
    assert "INTERRUPTED" in format_step(data)  # profuse report prints it again


def test_an_interrupt_in_amdahl_keeps_every_profile(tmp_path, capsys, monkeypatch):
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "_amdahl_stage", stopped)
    code, out, err = run(["step", *TWO_VARIANTS, "--out", str(tmp_path)], capsys)
    assert code == 130 and "amp was interrupted in Amdahl's prediction, after its timed trials" in err
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["interrupted"] == "interrupted in Amdahl's prediction"
    assert set(data["profiles"]) == {"eager", "fused"} and data["amdahl"] is None


def test_an_interrupt_before_the_trials_end_saves_nothing(tmp_path, capsys, monkeypatch):
    """Trials cut short are no measurement: no step.json, the plain interrupted line."""

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "_timed_steps", stopped)
    code, out, err = run(["step", *TWO_VARIANTS, "--out", str(tmp_path)], capsys)
    assert code == 130 and err.strip().splitlines()[-1] == "profuse: interrupted"
    assert not (tmp_path / "step.json").exists()


@pytest.mark.parametrize(
    "command, flags",
    [("step", GPT_FLAGS), ("profile", ["--device", "cpu", "--profile-steps", "1"])],
)
def test_an_unknown_precision_is_one_line_exit_2(command, flags, tmp_path, capsys):
    code, out, err = run([command, *flags, "--precision", "fp16", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "--precision" in err and "invalid choice: 'fp16'" in err and out == ""


@pytest.mark.parametrize(
    "flags, precisions",
    [(["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64", "--seq-len", "8",
       "--batch-size", "2", "--precision", "bf16"], ["bf16"]),
     (["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab-size", "64", "--seq-len", "8",
       "--batch-size", "2", "--precision", "both"], ["amp", "bf16"]),
     (["--model", "hf:qwen3", "--preset", "tiny", "--batch-size", "1", "--seq-len", "16",
       "--precision", "bf16"], ["bf16"]),
     (["--model", "hf:qwen3", "--preset", "tiny", "--batch-size", "1", "--seq-len", "16",
       "--precision", "both"], ["amp", "bf16"])],
    ids=["gpt-bf16", "gpt-both", "hf-bf16", "hf-both"],
)  # fmt: skip
def test_profile_runs_in_each_precision(flags, precisions, tmp_path, capsys):
    if "hf:qwen3" in flags:
        hf_tiny()
    argv = [
        "profile",
        "--device",
        "cpu",
        "--profile-steps",
        "1",
        "--warmup",
        "0",
        *flags,
        "--out",
        str(tmp_path),
    ]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    titles = [line for line in out.splitlines() if line.startswith("=== Part A: top operators")]
    assert [t.rsplit(", ", 1)[1].rstrip(") =") for t in titles] == precisions
    data = json.loads((tmp_path / "profile.json").read_text())
    runs = data["runs"] if len(precisions) > 1 else {precisions[0]: data}
    assert list(runs) == precisions
    for precision, r in runs.items():
        assert r["eager"]["precision"].startswith(f"{precision}: ")
        assert r["eager"]["about"]["precision"] == precision
    names = sorted(p.name for p in tmp_path.glob("trace*.json"))
    assert names == (["trace-amp.json", "trace-bf16.json"] if len(precisions) > 1 else ["trace.json"])
    code, again, _ = run(["report", str(tmp_path / "profile.json")], capsys)
    assert code == 0 and [line for line in again.splitlines() if line.startswith("=== Part A")] == titles


@pytest.mark.parametrize(
    "flags, words",
    [(["--step", "x.py:make_step", "--precision", "bf16"], "--precision does not apply"),
     (["--nproc", "2", "--precision", "bf16"], "data-parallel profiles run in amp only")],
)  # fmt: skip
def test_profile_precision_that_does_not_apply_is_one_line(flags, words, tmp_path, capsys):
    code, out, err = run(["profile", "--device", "cpu", *flags, "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert words in err and out == ""
