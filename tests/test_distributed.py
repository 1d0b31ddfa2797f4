"""profuse profile --nproc N on the CPU: two gloo ranks of a tiny model, a rank that fails, bad set-ups.

The launches run `python -m profuse` in a subprocess with a timeout, so a hang fails the test
instead of stalling the suite: on the 2-core machine a 2-rank run takes about 11 s, most of it
three Python processes importing torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import profuse
from profuse.cli import main
from profuse.distributed import (
    COMM,
    FAIL_RANK_ENV,
    JOB_CATEGORIES,
    SAFE_ENV,
    SUMMARY_NAME,
    comm_timeline,
    is_comm,
    rendezvous_port,
    root_failure,
)

# Two layers of d_model 64, vocabulary 256: a step is milliseconds, a trace a few hundred kB.
TINY = ["--layers", "2", "--d-model", "64", "--heads", "2", "--vocab-size", "256",
        "--seq-len", "32", "--batch-size", "2", "--profile-steps", "2"]  # fmt: skip
STEPS = 2
RUN_TIMEOUT_S = 120  # a run that works: about 11 s here, so ten times that means a hang
FAIL_TIMEOUT_S = 60  # the bound: a rank that dies stops the whole job within this
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and k != FAIL_RANK_ENV}
    src = str(Path(profuse.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _launch(out: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "profuse", "profile", "--nproc", "2", "--device", "cpu", *TINY]
    return subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=timeout, env=_env(**env)
    )


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = _launch(out, RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return proc, out


def _events(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


# --- two gloo ranks ------------------------------------------------------------------------------


def test_both_traces_exist_and_hold_the_all_reduce(ddp_run):
    _, out = ddp_run
    for rank in (0, 1):
        names = [e["name"] for e in _events(out / f"trace_rank{rank}.json")]
        assert sum(n.startswith("ProfilerStep#") for n in names) == STEPS
        # gloo: the op that queues the all-reduce, and the all-reduce on gloo's worker thread
        assert names.count("c10d::allreduce_") >= STEPS
        assert names.count("gloo:all_reduce") >= STEPS


def test_summary_has_every_rank_and_a_comm_share_strictly_between_0_and_100(ddp_run):
    _, out = ddp_run
    data = json.loads((out / SUMMARY_NAME).read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["device"] == "cpu"
    assert data["provenance"]["versions"]["torch"] and data["provenance"]["card"]  # files.write_result
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert len(r["step_times_ms"]) == STEPS and r["step_ms"] > 0
        comm = r["comm"]
        assert comm["steps"] == STEPS
        assert 0 < comm["comm_us"] < comm["step_us"]
        assert 0 <= comm["overlap_us"] <= comm["comm_us"]
        assert comm["ops"]["gloo:all_reduce"] == comm["ops"]["c10d::allreduce_"] == STEPS
        assert Path(r["trace_path"]) == (out / f"trace_rank{r['rank']}.json").resolve()
        assert set(r["time_by_category_us"]) == set(JOB_CATEGORIES)
    job = data["job"]
    assert 0 < job["comm_pct"] < 100
    assert 0 < job["category_shares"][COMM] < 100
    assert sum(job["category_shares"].values()) == pytest.approx(100.0)
    assert job["slowest_rank"] == max(data["ranks"], key=lambda r: r["step_ms"])["rank"]


def test_printed_summary_names_ranks_slowest_communication_and_categories(ddp_run):
    proc, _ = ddp_run
    text = proc.stdout
    assert "DistributedDataParallel over gloo" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[0] for r in rows] == ["0", "1"]
    assert "slowest rank:" in text
    # the same order every run: most first, ties by name (the trace's order differed between runs)
    assert "rank 0's collectives in its trace: c10d::allreduce_ x2, gloo:all_reduce x2" in text
    assert "rank 1's collectives in its trace: c10d::allreduce_ x2, gloo:all_reduce x2" in text
    pct = float(text.split("communication: ", 1)[1].split("%", 1)[0])
    assert 0 < pct < 100
    assert "communication (all-reduce)" in text and "matmul" in text
    assert proc.stderr.strip() == ""  # the agent's logs and the ranks' output stay off the terminal


def test_a_run_that_worked_keeps_no_logs(ddp_run):
    _, out = ddp_run
    assert sorted(p.name for p in out.iterdir()) == [SUMMARY_NAME, "trace_rank0.json", "trace_rank1.json"]


def test_report_prints_the_saved_job_again(ddp_run, capsys):
    proc, out = ddp_run
    assert main(["report", str(out / SUMMARY_NAME)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == next(
        ln for ln in proc.stdout.splitlines() if ln.startswith("=== Part A on 2")
    )
    assert "rank 1's collectives in its trace: c10d::allreduce_ x2, gloo:all_reduce x2" in text
    assert "fusion candidates on rank 0, by structure" in text and "add_rms_norm" in text


def test_a_job_saved_before_the_candidates_reads_back(ddp_run, capsys, tmp_path):
    """A profile_ddp.json written before ranks carried candidates and phases prints without them."""
    _, out = ddp_run
    data = json.loads((out / SUMMARY_NAME).read_text())
    assert data["ranks"][0]["candidates"] and set(data["ranks"][0]["phase_pct"]) == {
        "forward", "backward", "optimizer"
    }  # fmt: skip
    for r in data["ranks"]:
        del r["candidates"], r["phase_pct"]
    old = tmp_path / SUMMARY_NAME
    old.write_text(json.dumps(data))
    assert main(["report", str(old)]) == 0
    text = capsys.readouterr().out
    assert "rank 1's collectives in its trace" in text and "fusion candidates" not in text


def test_unsteady_rank_step_times_are_warned_of(ddp_run):
    from profuse.report.distributed import format_saved_ddp_profile

    data = json.loads((ddp_run[1] / SUMMARY_NAME).read_text())
    for rank in data["ranks"]:
        rank["step_times_ms"] = [3.0, 3.1, 3.0, 3.2]
    assert "unsteady" not in format_saved_ddp_profile(data, "job")
    data["ranks"][1]["step_times_ms"] = [3.0, 3.1, 545.0, 3.2]
    [warning] = [ln for ln in format_saved_ddp_profile(data, "job").splitlines() if "unsteady" in ln]
    assert warning.startswith("WARNING Part A step time: unsteady timings")
    assert "rank 0 0/4, rank 1 1/4 (" in warning


def test_ctrl_c_leaves_no_logs_of_the_run(no_rank_env, tmp_path, monkeypatch, capsys):
    """The launcher's logs/ under --out is kept for a rank that failed (its message names the
    log); a run stopped with Ctrl-C has nothing to look into there, so it leaves none."""
    import profuse.distributed as D

    earlier = tmp_path / D.LOG_DIR_NAME / "profuse-earlier_x" / "attempt_0" / "0"
    earlier.mkdir(parents=True)  # another run's logs, which stay

    def interrupted(config, argv, launcher_log):
        ranks = launcher_log.parent / f"{config.run_id}_abc" / "attempt_0" / "0"
        ranks.mkdir(parents=True)
        (ranks / "stderr.log").write_text("a rank's output\n")
        launcher_log.write_text("the agent's lines\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "_run_agent", interrupted)
    assert main(["profile", "--nproc", "2", "--device", "cpu", "--out", str(tmp_path)]) == 130
    assert [p.name for p in (tmp_path / D.LOG_DIR_NAME).iterdir()] == ["profuse-earlier_x"]
    earlier.parents[1].rename(tmp_path / "kept")
    assert main(["profile", "--nproc", "2", "--device", "cpu", "--out", str(tmp_path)]) == 130
    assert not (tmp_path / D.LOG_DIR_NAME).exists()  # no logs at all: no logs/ folder either
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("exitcode, oom", [(-signal.SIGKILL, True), (-signal.SIGTERM, False), (1, False)])
def test_a_rank_killed_by_sigkill_is_said_to_be_likely_out_of_memory(exitcode, oom):
    from profuse.report.distributed import format_rank_failure

    error = f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else "RuntimeError: boom"
    line = format_rank_failure(14, 64, exitcode, error, "/tmp/logs/14/stderr.log", log_empty=True)
    assert "\n" not in line and line.startswith("rank 14 of 64 ")
    assert ("out-of-memory" in line) == oom
    assert ("--nproc" in line and "smaller model" in line) == oom
    assert "Its log (empty): " in line


def test_under_torchrun_the_ranks_run_as_workers_and_rank_0_prints(tmp_path):
    # torchrun's own parser takes --nproc for an abbreviation of its --nproc-per-node, so a script
    # hands it to profuse; `torchrun -m profuse profile` needs the CLI to route started ranks here.
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys\nfrom profuse.cli import main\n"
        'sys.exit(main(["profile", "--nproc", "2", *sys.argv[1:]]))\n'
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", *TINY, "--out", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("=== Part A on 2 processes: DistributedDataParallel over gloo") == 1
    assert sorted(p.name for p in out.iterdir()) == [SUMMARY_NAME, "trace_rank0.json", "trace_rank1.json"]


# --- a rank that fails ---------------------------------------------------------------------------


def test_a_rank_that_raises_fails_the_run_naming_it(tmp_path):
    proc = _launch(tmp_path, FAIL_TIMEOUT_S, **{FAIL_RANK_ENV: "1"})  # a hang raises TimeoutExpired
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # one line, no traceback
    line = lines[0]
    # Rank 1 raises; if rank 0 loses its connection and exits while rank 1's interpreter is still
    # shutting down, the agent ends rank 1 with a SIGTERM. Either way rank 1's exception is named.
    assert line.startswith(
        (
            "profuse: error: rank 1 of 2 failed (exit code 1: RuntimeError:",
            "profuse: error: rank 1 of 2 failed (RuntimeError:",
        )
    )
    assert f"{FAIL_RANK_ENV}=1" in line
    log = Path(line.split("Its log: ", 1)[1])
    log = log if log.is_absolute() else Path.cwd() / log
    assert log.name == "stderr.log" and log.exists()
    assert "made rank 1 raise" in log.read_text()
    assert not (tmp_path / SUMMARY_NAME).exists()


def _failure(tmp_path: Path, rank: int, message: str, mtime: float) -> SimpleNamespace:
    error_file = tmp_path / f"error{rank}.json"
    error_file.write_text("{}")
    os.utime(error_file, (mtime, mtime))
    return SimpleNamespace(
        local_rank=rank,
        exitcode=1,
        error_file=str(error_file),
        message={"message": message},
        timestamp=int(mtime),
        signal_name=lambda: "N/A",
    )


def test_a_rank_that_raised_and_was_then_sigtermed_is_named_by_its_exception(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from profuse.distributed import _failure_text, _raised
    from profuse.report.distributed import format_rank_failure

    error_file = tmp_path / "error.json"
    record = {"message": "RuntimeError: made rank 1 raise", "extraInfo": {"timestamp": "1700000000"}}
    error_file.write_text(json.dumps({"message": record}))
    raised = ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGTERM, error_file=str(error_file))
    killed = ProcessFailure(
        local_rank=0, pid=4243, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none.json")
    )
    assert (_raised(raised), _raised(killed)) == (True, False)
    assert _failure_text(raised) == "RuntimeError: made rank 1 raise"
    assert _failure_text(killed) == "killed by SIGTERM"
    line = format_rank_failure(1, 2, -signal.SIGTERM, _failure_text(raised), "log", raised=True)
    assert line.startswith("rank 1 of 2 failed (RuntimeError: made rank 1 raise; a SIGTERM then ended it")
    line = format_rank_failure(0, 2, -signal.SIGTERM, _failure_text(killed), "log")
    assert line.startswith("rank 0 of 2 was killed by SIGTERM;")


def test_the_rank_that_failed_first_is_named_not_the_one_that_lost_it(tmp_path):
    now = time.time()
    cause = _failure(tmp_path, 1, "RuntimeError: out of memory", now + 0.5)
    casualty = _failure(tmp_path, 0, "RuntimeError: [pair.cc:553] Connection closed by peer", now + 0.1)
    assert root_failure({0: casualty, 1: cause})[0] == 1
    earlier = _failure(tmp_path, 3, "ValueError: bad", now)
    assert root_failure({1: cause, 3: earlier})[0] == 3  # same second: the file's mtime decides


# --- bad set-ups: one line, exit 2, nothing launched -------------------------------------------


@pytest.fixture
def no_rank_env(monkeypatch):
    for k in RANK_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("profuse: error: ")
    return err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpus_is_one_line_and_exit_2(no_rank_env, capsys, tmp_path):
    line = _one_line_exit_2(capsys, ["profile", "--nproc", "2", "--device", "cuda", "--out", str(tmp_path)])
    assert "no CUDA GPU" in line
    assert list(tmp_path.iterdir()) == []


def test_more_ranks_than_gpus_is_one_line_and_exit_2(no_rank_env, capsys, tmp_path):
    no_rank_env.setattr(torch.cuda, "is_available", lambda: True)
    no_rank_env.setattr(torch.cuda, "device_count", lambda: 1)
    line = _one_line_exit_2(capsys, ["profile", "--nproc", "2", "--device", "cuda", "--out", str(tmp_path)])
    assert "--nproc 2 needs 2 GPUs" in line and "this machine has 1" in line


def test_master_port_in_use_is_one_line_and_exit_2(no_rank_env, capsys, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        no_rank_env.setenv("MASTER_PORT", str(port))
        line = _one_line_exit_2(
            capsys, ["profile", "--nproc", "2", "--device", "cpu", "--out", str(tmp_path)]
        )
    assert f"port {port} (MASTER_PORT) is already in use" in line


def test_free_master_port_is_honoured_and_a_free_one_picked_otherwise(no_rank_env):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    no_rank_env.setenv("MASTER_PORT", str(port))
    assert rendezvous_port() == port
    no_rank_env.delenv("MASTER_PORT")
    assert 0 < rendezvous_port() < 65536


def test_compile_step_with_nproc_is_refused(no_rank_env, capsys, tmp_path):
    line = _one_line_exit_2(
        capsys, ["profile", "--nproc", "2", "--device", "cpu", "--compile-step", "--out", str(tmp_path)]
    )
    assert "--compile-step" in line


def test_nvlink_multicast_stays_off_in_every_rank():
    assert SAFE_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# --- reading communication off a trace -----------------------------------------------------------


def _x(name: str, cat: str, ts: float, end: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": end - ts, "pid": 1, "tid": tid}


def test_names_that_are_collectives_and_names_that_are_not():
    for name in ("gloo:all_reduce", "c10d::allreduce_", "nccl:all_reduce", "record_param_comms",
                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                 "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"):  # fmt: skip
        assert is_comm(name), name
    for name in ("aten::broadcast_to", "aten::mm", "DistributedDataParallel.forward", "aten::sum"):
        assert not is_comm(name), name


def test_cpu_timeline_clips_at_backward_and_counts_self_time_as_compute():
    trace = [
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("forward", "user_annotation", 0, 40),
        _x("aten::mm", "cpu_op", 5, 35),
        _x("backward", "user_annotation", 40, 90),
        _x("aten::mm", "cpu_op", 45, 60),
        # autograd's AccumulateGrad node queues the all-reduce (DDP's hook) and computes around it
        _x("autograd::engine::evaluate_function: AccumulateGrad", "cpu_op", 60, 75),
        _x("c10d::allreduce_", "cpu_op", 62, 64),
        # gloo's worker thread closes its range late: past the end of backward
        _x("gloo:all_reduce", "user_annotation", 64, 95, tid=2),
        _x("optimizer", "user_annotation", 90, 100),
        _x("aten::add_", "cpu_op", 91, 99),
    ]
    tl = comm_timeline(trace, "cpu")
    assert tl.steps == 1 and tl.step_us == 100
    assert tl.comm_us == pytest.approx(28)  # [62, 95] clipped at backward's end, 90
    assert tl.overlap_us == pytest.approx(11)  # the node's own time after the queuing, [64, 75]
    assert tl.comm_pct == pytest.approx(28) and tl.overlap_pct == pytest.approx(100 * 11 / 28)
    assert tl.exposed_ms_per_step == pytest.approx(17e-3)
    assert list(tl.ops.items()) == [("c10d::allreduce_", 1), ("gloo:all_reduce", 1)]  # ties by name
    # the order printed does not follow the order the trace lists its events in
    assert list(comm_timeline(trace[::-1], "cpu").ops) == list(tl.ops)


def test_cuda_timeline_overlaps_collective_kernels_with_compute_kernels():
    trace = [
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("ampere_sgemm_128x64_nn", "kernel", 10, 50, tid=7),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 40, 70, tid=8),
        _x("vectorized_elementwise_kernel", "kernel", 60, 65, tid=7),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 120, 130, tid=8),  # another step's
    ]
    tl = comm_timeline(trace, "cuda")
    assert tl.comm_us == pytest.approx(30)
    assert tl.overlap_us == pytest.approx(15)  # [40, 50] beside the gemm, [60, 65] beside the add
    assert tl.overlap_pct == pytest.approx(50)
    assert tl.ops == {"ncclDevKernel_AllReduce_Sum_f32_RING_LL": 1}


def test_no_collective_means_no_overlap_figure():
    trace = [_x("ProfilerStep#1", "user_annotation", 0, 100), _x("aten::mm", "cpu_op", 5, 35)]
    tl = comm_timeline(trace, "cpu")
    assert tl.comm_us == 0 and tl.comm_pct == 0 and tl.overlap_pct is None and tl.ops == {}
