"""profuse.profile on any step: a user's own model from Python and from a file (--step FILE.py:FUNC),
Hugging Face models (--model hf:ARCH) at their tiny size, and every bad input one line, exit 2.

Behaviour only: shares are compared with each other and with what the structure implies, never
with seconds.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from cases import assert_one_clear_line, run

import profuse
import profuse.errors
from profuse import attribution as A
from profuse.report.profile import format_profile

# A user's own model as a new user writes it: an embedding, blocks of RMSNorm + SwiGLU with a
# residual add, a final norm, a head; AdamW, not labelled by any range.
USER_MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


    class SwiGLU(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.gate = nn.Linear(dim, hidden, bias=False)
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))


    class Block(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.norm = RMSNorm(dim)
            self.ffn = SwiGLU(dim, hidden)

        def forward(self, x):
            return x + self.ffn(self.norm(x))


    class Net(nn.Module):
        def __init__(self, vocab=97, dim=40, hidden=104, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.norm = RMSNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx):
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))


    def make_step():
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(97, (3, 33))
        targets = torch.randint(97, (3, 33))

        def step():
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()

        return step


    NOT_A_FUNCTION = 3


    def returns_none():
        return None


    def needs_args(size):
        return make_step


    def raises():
        raise ValueError("no data here")
    """
)


@pytest.fixture(scope="module")
def step_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "train.py"
    path.write_text(USER_MODEL, encoding="utf-8")
    return path


def _user_step():
    namespace: dict = {}
    exec(compile(USER_MODEL, "<user model>", "exec"), namespace)
    return namespace["make_step"]()


def _found(result) -> dict:
    return {c.name: c for c in result.candidates}


def test_a_users_step_from_python(tmp_path):
    """profuse.profile(step): the files Part A writes, the device found from the step, and the
    candidates named by the user's own modules, with no range in the user's code."""
    result = profuse.profile(_user_step(), steps=2, warmup=1, out=tmp_path)
    assert result.device == "cpu" and result.steps == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json", "trace.json"]
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["kind"] == "part_a" and saved["eager"]["candidates"]
    s = result.summary
    assert s.structured and s.label_pct == {}
    found = _found(result)
    assert found[A.RESIDUAL_NORM].covered_by == "add_rms_norm"  # the norms and the blocks' adds
    assert found[A.ACTIVATION_MUL].covered_by == "silu_mul"
    assert found[A.OPTIMIZER_WORK].pct > 0 and s.phase_pct["optimizer"] > 0  # unlabelled AdamW
    assert A.ROTARY not in found
    memory = sum(c.pct for c in result.candidates if c.name not in (A.LOSS, A.OPTIMIZER_WORK))
    assert math.isclose(memory, s.shares["memory_bound"], rel_tol=1e-9)
    assert "fusion candidates, by the module that issued the work" in format_profile(result)


def test_a_step_file_from_the_command_line(step_file, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:  # --threads, which profile's busy-CPU warning advises
        code, out, err = run(
            ["profile", "--step", f"{step_file}:make_step", "--profile-steps", "1", "--warmup", "1",
             "--threads", "1", "--out", str(tmp_path)], capsys,
        )  # fmt: skip
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert f"profiled: your step, {step_file}:make_step" in out
    assert "fusion candidates" in out and "silu_mul" in out and "add_rms_norm" in out
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["eager"]["about"]["step"] == f"{step_file}:make_step"
    assert saved["eager"]["device"] == "cpu"
    code, again, err = run(["report", str(tmp_path / "profile.json")], capsys)
    assert code == 0, err
    # the same block, but for the trace's line: the report wrote no trace, that run did
    printed = out.split("\nsummary: ")[0].strip().replace("trace written:", "trace (written by that run):")
    again, provenance = again.split("\n\nprovenance:", 1)  # then where the file came from
    assert again.strip() == printed
    assert "--step" in provenance and f"{step_file}:make_step" in provenance


# --- Hugging Face models ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_each_hf_architecture_at_its_tiny_size(arch, tmp_path):
    """RoPE's mul / neg / cat in attention are rotary embedding, the engine's add_ of two
    gradients is gradient accumulation: neither is counted as SwiGLU's gate x up."""
    pytest.importorskip("transformers")
    from profuse.models import model_spec
    from profuse.profiling import spec_step

    spec = model_spec(f"hf:{arch}")
    result = profuse.profile(spec_step(spec, "cpu"), steps=1, warmup=1, out=tmp_path, summary_name=None)
    found = _found(result)
    assert found[A.ACTIVATION_MUL].covered_by == "silu_mul"
    assert found[A.RESIDUAL_NORM].covered_by == "add_rms_norm"
    assert A.ROTARY in found and A.GRAD_ACCUMULATION in found
    assert not {"aten::neg", "aten::cat", "aten::add_"} & set(found[A.ACTIVATION_MUL].ops)
    assert (A.QK_NORM in found) == (arch == "qwen3")  # Qwen3 norms q and k inside attention
    assert not (tmp_path / "profile.json").exists()  # summary_name=None: the caller saves


def test_an_hf_model_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    code, out, err = run(
        ["profile", "--model", "hf:llama", "--preset", "tiny", "--profile-steps", "1", "--warmup", "1",
         "--out", str(tmp_path)], capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "profiled: hf:llama tiny" in out and A.ROTARY in out
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["eager"]["about"]["model"]["model"] == "hf:llama"


# --- bad input: one line, exit 2, nothing written --------------------------------------------------


def _bad_steps(step_file: Path, tmp_path: Path) -> dict[str, list[str]]:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\nx = 1 / 0\n", encoding="utf-8")
    text = tmp_path / "notes.txt"
    text.write_text("not python\n", encoding="utf-8")
    return {
        "no function named": ["--step", str(step_file)],
        "no such file": ["--step", f"{tmp_path / 'missing.py'}:make_step"],
        "a folder": ["--step", f"{tmp_path}:make_step"],
        "not python": ["--step", f"{text}:make_step"],
        "no such function": ["--step", f"{step_file}:make_stp"],
        "not a function": ["--step", f"{step_file}:NOT_A_FUNCTION"],
        "returns no callable": ["--step", f"{step_file}:returns_none"],
        "takes arguments": ["--step", f"{step_file}:needs_args"],
        "raises": ["--step", f"{step_file}:raises"],
        "import raises": ["--step", f"{broken}:make_step"],
        "step with a model": ["--step", f"{step_file}:make_step", "--model", "hf:llama"],
        "step with sizes": ["--step", f"{step_file}:make_step", "--layers", "3"],
        "unknown hf arch": ["--model", "hf:unknown"],
        "unknown model": ["--model", "bert"],
        "unknown preset": ["--model", "hf:llama", "--preset", "huge"],
        "a preset of another family": ["--model", "hf:llama", "--preset", "Qwen3-0.6B"],
        "gpt sizes on hf": ["--model", "hf:llama", "--d-model", "64"],
        "hf model on several ranks": ["--model", "hf:llama", "--nproc", "2"],
        "too big": ["--model", "hf:llama", "--preset", "Llama-3.2-1B", "--batch-size", "512",
                    "--seq-len", "131072"],
    }  # fmt: skip


BAD = [
    "no function named", "no such file", "a folder", "not python", "no such function", "not a function",
    "returns no callable", "takes arguments", "raises", "import raises", "step with a model",
    "step with sizes", "unknown hf arch", "unknown model", "unknown preset", "a preset of another family",
    "gpt sizes on hf", "hf model on several ranks", "too big",
]  # fmt: skip
WHAT = {
    "no such function": "no function 'make_stp' (it defines: make_step, needs_args, raises, returns_none)",
    "returns no callable": "returned NoneType, not the step",
    "takes arguments": "must take no arguments",
    "raises": "raises() raised ValueError: no data here (train.py, line",
    "import raises": "importing it raised ZeroDivisionError: division by zero (broken.py, line 3)",
    "unknown hf arch": "unknown Hugging Face architecture 'unknown'",
    "too big": "Part A's step of hf:llama Llama-3.2-1B",
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_work(case, step_file, tmp_path, capsys):
    if case in ("unknown preset", "a preset of another family", "gpt sizes on hf", "too big"):
        pytest.importorskip("transformers")
    out = tmp_path / "out"
    code, _stdout, err = run(["profile", *_bad_steps(step_file, tmp_path)[case], "--out", str(out)], capsys)
    assert_one_clear_line(code, err)
    if case in WHAT:
        assert WHAT[case] in err, err
    assert not out.exists() or not any(out.iterdir())


def test_without_transformers_an_hf_model_is_one_line(monkeypatch, tmp_path, capsys):
    import profuse.models.hf as hf

    monkeypatch.setattr(hf, "HAS_TRANSFORMERS", False)
    code, _out, err = run(["profile", "--model", "hf:qwen3", "--out", str(tmp_path)], capsys)
    assert_one_clear_line(code, err)
    assert "pip install 'profuse[hf]'" in err
    assert not (tmp_path / "trace.json").exists()


def test_the_device_is_asked_of_the_step():
    """A step whose module parameters are on the CPU runs on the CPU, whatever the machine has."""
    from profuse.profiling import _step_device

    assert _step_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert _step_device(None) == torch.device("cpu")  # no module seen, no CUDA memory in use


def test_profile_refuses_a_bad_out_before_running_the_step(tmp_path):
    (tmp_path / "a file").write_text("x\n")
    calls = []
    with pytest.raises(profuse.errors.UsageError, match="out .*a file"):
        profuse.profile(lambda: calls.append(1), out=tmp_path / "a file")
    with pytest.raises(profuse.errors.UsageError, match="plain file name"):
        profuse.profile(lambda: calls.append(1), out=tmp_path, summary_name="a/b.json")
    assert calls == []


def test_without_the_operator_table_the_rows_come_from_the_trace(tmp_path):
    """profile(operator_table=False), as Part C calls it: no table, the rows read off the trace
    (work and host alike on a CPU), largest first."""
    result = profuse.profile(_user_step(), steps=2, warmup=1, out=tmp_path, operator_table=False)
    assert result.table == "" and result.sort_by == "self_cpu_time_total"
    for rows in (result.rows, result.host_rows):
        times = [r.self_us for r in rows]
        assert rows and times == sorted(times, reverse=True) and all(t > 0 for t in times)
    assert [r.name for r in result.rows] == [r.name for r in result.host_rows]
    assert any(r.name == "ProfilerStep*" for r in result.host_rows)  # the steps' ranges, grouped


def test_the_traces_rows_are_the_profilers_own_self_times(tmp_path):
    """attribution.event_rows over the exported trace against key_averages of the same profile:
    each host row's self CPU time agrees (same events, nested the same way); on CUDA the work rows
    are the kernels' own device time, by name."""
    from torch.profiler import ProfilerActivity, profile, schedule

    step = _user_step()
    step()
    with profile(
        activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1)
    ) as p:
        for _ in range(3):
            step()
            p.step()
    path = tmp_path / "trace.json"
    p.export_chrome_trace(str(path))
    work, host = A.event_rows(A.read_spans(json.loads(path.read_text())), "cpu", 12)
    assert work == host and len(host) == 12
    theirs = {a.key: a.self_cpu_time_total for a in p.key_averages()}
    for name, us, _calls in host:
        assert us == pytest.approx(theirs[name], rel=1e-3, abs=0.5), name
    # CUDA: kernels by name, device time summed; host rows still the host's
    spans = [
        A.Span("k1", "kernel", 0.0, 5.0, {}),
        A.Span("k1", "kernel", 10.0, 13.0, {}),
        A.Span("k2", "kernel", 20.0, 21.0, {}),
        A.Span("Memcpy HtoD", "gpu_memcpy", 30.0, 36.0, {}),
        A.Span("aten::mm", "cpu_op", 0.0, 4.0, {}, child_us=1.0),
        A.Span("cudaLaunchKernel", "cuda_runtime", 1.0, 2.0, {}),
    ]
    work, host = A.event_rows(spans, "cuda", 3)
    assert work == [("k1", 8.0, 2), ("Memcpy HtoD", 6.0, 1), ("k2", 1.0, 1)]
    assert host == [("aten::mm", 3.0, 1), ("cudaLaunchKernel", 1.0, 1)]
