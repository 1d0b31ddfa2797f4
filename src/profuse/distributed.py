"""Part A on N processes: the GPT under DistributedDataParallel, profiled on every rank.

    profuse profile --nproc N [flags]                  the launcher below (`launch`) starts N ranks
    torchrun --nproc-per-node N -m profuse profile     the same ranks, started by torchrun

(torchrun's parser reads a --nproc after the module as its own --nproc-per-node, abbreviated; the
CLI sends a process that `started_by_launcher` to `run_worker`, which runs it as a rank.)

Both go through PyTorch's own launcher, the elastic agent that torchrun runs
(`torch.distributed.launcher.api.elastic_launch`): it starts each rank as
`python -m profuse profile ...` with RANK, WORLD_SIZE and LOCAL_RANK set, watches them, and stops
them all when one fails. A process that finds those variables runs as a rank (`run_worker`):

1. It joins the process group, NCCL on GPUs (one GPU a rank, cuda:LOCAL_RANK) and gloo on the
   CPU, and wraps Part A's model in DistributedDataParallel. Every rank starts from the same
   weights (DDP broadcasts rank 0's) and trains on its own random batch (seed + rank).
2. It profiles the same steps as Part A (`profiling.profile_with_trace`: warm-up, then
   torch.profiler) and writes trace_rank{R}.json, whole or not at all.
3. It reads its trace, parsed once: the category table of Part A with "communication" added, and the
   communication on its timeline (`comm_timeline`): how long the all-reduce ran in each step and
   how much of that time compute ran beside it.
4. Rank 0 gathers every rank's summary (`dist.gather_object`) and writes profile_ddp.json.

The launcher (`launch`) returns the job read from that file; under torchrun rank 0's
`run_worker` returns it; the CLI prints it (report.distributed). A rank that fails makes the
launcher stop the others (within MONITOR_INTERVAL_S) and raise LaunchFailed naming it, with the
path of its log; collectives time out after COLLECTIVE_TIMEOUT_S, so a rank that hangs cannot
hold the others forever either. Nothing here prints.

What the backends put in a trace (torch 2.13, CPU; the NCCL names are PyTorch's and NCCL's):
- gloo: `c10d::allreduce_` on the thread that runs backward (it queues the work), and
  `gloo:all_reduce` on one of gloo's 2 worker threads, spanning the all-reduce itself.
- NCCL: `c10d::allreduce_`, `record_param_comms` and `nccl:all_reduce` on the host, and kernels
  named ncclDevKernel_AllReduce_... (ncclKernel_AllReduce_... in older NCCL) on NCCL's stream.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from profuse.errors import UsageError
from profuse.files import PROVENANCE, write_result
from profuse.profiling import (
    BACKWARD,
    HOST_CATS,
    STEP_PREFIX,
    Intervals,
    ProfileConfig,
    Span,
    extend_categories,
    intersect,
    profile_with_trace,
    read_spans,
    total_length,
    union,
)

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# In the environment of every rank, whoever starts it: NVLink multicast (NVLS) off, in NCCL and in
# symmetric memory; on the shared H200 hosts it can take the GPUs out of service.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# A collective that waits longer than this fails (gloo raises, NCCL's watchdog aborts the rank).
# The slowest step seen, the default model on 2 gloo ranks sharing 2 CPU cores, takes 1.6 s, so
# 120 s only ever fires on a rank that hangs.
COLLECTIVE_TIMEOUT_S = 120
# How often the elastic agent checks its ranks: a rank that dies stops the others this fast.
MONITOR_INTERVAL_S = 0.2
SUMMARY_NAME = "profile_ddp.json"
LOG_DIR_NAME = "logs"  # under --out; a run's logs are kept only when it fails

# Set to a rank number, that rank raises in the forward of its first profiled step: the others
# are then waiting in backward's all-reduce, as they would for a rank that crashed. Tests only.
FAIL_RANK_ENV = "PROFUSE_TEST_FAIL_RANK"
# Set by the launcher in its ranks: it shows the summary itself, so rank 0 does not return it.
LAUNCHER_ENV = "PROFUSE_DDP_LAUNCHER"

COMM = "communication"
# Collectives and their kernels, over lower-cased names (see the module docstring for what each
# backend emits). Not a bare "broadcast": aten::broadcast_to and broadcast_tensors are views.
COMM_PATTERN = r"c10d::|gloo:|nccl|record_param_comms|all_?reduce|all_?gather|reduce_?scatter"
COMM_RULES: tuple[tuple[str, str], ...] = ((COMM, COMM_PATTERN),)
_COMM_RE = re.compile(COMM_PATTERN)
JOB_CATEGORIES = extend_categories(COMM_RULES)  # Part A's categories, "communication" before "other"


def is_comm(name: str) -> bool:
    """Whether an op, range or kernel name is a collective (an all-reduce, for DDP)."""
    return _COMM_RE.search(name.lower()) is not None


# --------------------------------------------------------------------------------------------
# Results: plain dataclasses, rendered by profuse.report.distributed
# --------------------------------------------------------------------------------------------


@dataclass
class CommTimeline:
    """One rank's communication on its timeline, over its profiled steps."""

    steps: int
    step_us: float  # wall time of the ProfilerStep spans, summed
    comm_us: float  # union of the communication intervals inside them
    overlap_us: float  # the part of comm_us during which compute ran too
    timed: str  # what comm_us covers: "kernels" (CUDA) or "host ranges" (CPU)
    # collective op, range or kernel -> count, most first and ties by name (not the trace's order,
    # which differs between runs where two are counted alike)
    ops: dict[str, int] = field(default_factory=dict)

    @property
    def comm_pct(self) -> float:
        """% of the step's wall time with communication running."""
        return 100.0 * self.comm_us / self.step_us if self.step_us > 0 else 0.0

    @property
    def overlap_pct(self) -> float | None:
        """% of the communication time overlapped with compute; None when none ran."""
        return 100.0 * self.overlap_us / self.comm_us if self.comm_us > 0 else None

    @property
    def exposed_ms_per_step(self) -> float:
        """Communication with no compute beside it, a step: what overlap could still hide."""
        return (self.comm_us - self.overlap_us) / 1e3 / max(self.steps, 1)


@dataclass
class RankProfile:
    """What one rank measured, as it travels to rank 0 (gather_object) and into the JSON."""

    rank: int
    host: str
    device: str
    step_ms: float  # median wall time of a profiled step, synchronised
    step_times_ms: list[float]
    basis: str  # what the category times are: "self CPU time" or "GPU kernel time"
    time_by_category_us: dict[str, float]  # JOB_CATEGORIES -> us, over the profiled steps
    launches_per_step: float
    launch_unit: str  # "kernels" or "operators"
    comm: CommTimeline
    trace_path: str
    trace_bytes: int
    top_operators: list[dict] = field(default_factory=list)  # Part A's operator rows, largest first
    # Part A's fusion candidates by structure (attribution.Candidate as dicts), largest first, and
    # the phases; absent from files written before them
    candidates: list[dict] = field(default_factory=list)
    phase_pct: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> RankProfile:
        return cls(**{**d, "comm": CommTimeline(**d["comm"])})


@dataclass
class DDPProfile:
    """The whole job: every rank's profile, in rank order."""

    world_size: int
    backend: str
    device: str  # "cpu" or "cuda"
    precision: str
    torch_version: str
    config: dict  # Part A's ProfileConfig, rank 0's
    run_id: str  # the elastic agent's; the launcher checks it, so it never reads an old file
    ranks: list[RankProfile]

    @property
    def steps(self) -> int:
        return self.ranks[0].comm.steps if self.ranks else 0

    @property
    def slowest(self) -> RankProfile:
        return max(self.ranks, key=lambda r: r.step_ms)

    @property
    def fastest(self) -> RankProfile:
        return min(self.ranks, key=lambda r: r.step_ms)

    @property
    def category_shares(self) -> dict[str, float]:
        """% of the job's time (all ranks' summed) in each category, JOB_CATEGORIES order."""
        totals = {c: sum(r.time_by_category_us.get(c, 0.0) for r in self.ranks) for c in JOB_CATEGORIES}
        whole = sum(totals.values())
        return {c: 100.0 * t / whole if whole > 0 else 0.0 for c, t in totals.items()}

    @property
    def comm_pct(self) -> float:
        """% of the step's wall time in communication, the mean over ranks."""
        return statistics.fmean(r.comm.comm_pct for r in self.ranks) if self.ranks else 0.0

    @property
    def overlap_pct(self) -> float | None:
        """% of all ranks' communication time that overlapped with compute; None when none ran."""
        comm = sum(r.comm.comm_us for r in self.ranks)
        return 100.0 * sum(r.comm.overlap_us for r in self.ranks) / comm if comm > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["job"] = {  # derived, for a reader of the JSON; from_dict ignores it
            "slowest_rank": self.slowest.rank,
            "comm_pct": self.comm_pct,
            "overlap_pct": self.overlap_pct,
            "category_shares": self.category_shares,
        }
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DDPProfile:
        # "job" is derived; the provenance is the file's (files.write_result), not the profile's
        fields = {k: v for k, v in d.items() if k not in ("job", PROVENANCE)}
        return cls(**{**fields, "ranks": [RankProfile.from_dict(r) for r in d["ranks"]]})


# --------------------------------------------------------------------------------------------
# Reading a rank's trace: communication on the timeline
# --------------------------------------------------------------------------------------------


def _self_intervals(spans: list[Span]) -> Intervals:
    """Where a host thread ran a compute op itself: each non-collective cpu_op's time minus its children's.

    Self time, not the whole span: DDP queues its all-reduce from inside autograd's AccumulateGrad
    node, so that node's span covers the all-reduce's without computing during it.
    """
    children: dict[int, list] = defaultdict(list)
    for s in spans:
        if s.parents:
            children[id(s.parents[0])].append(s)
    out: Intervals = []
    for s in spans:
        if s.cat != "cpu_op" or is_comm(s.name):
            continue
        t = s.ts
        for child in sorted(children[id(s)], key=lambda c: c.ts):
            if child.ts > t:
                out.append((t, child.ts))
            t = max(t, child.end)
        if s.end > t:
            out.append((t, s.end))
    return union(out)


def comm_timeline(trace: dict | list, device: str = "cpu") -> CommTimeline:
    """How long collectives ran in each profiled step, and how much of it beside compute.

    device "cuda": collective kernels against every other kernel, on the GPU's timeline.
    device "cpu": collective host ranges (gloo's worker thread, the op that queues the work)
    against the self time of every other operator, on any thread.
    """
    spans = read_spans(trace)
    host = [s for s in spans if s.cat in HOST_CATS]
    steps = sorted((s for s in host if s.name.startswith(STEP_PREFIX)), key=lambda s: s.ts)
    if not steps:
        raise RuntimeError("the trace holds no ProfilerStep span: was prof.step() called?")
    step_windows = union((s.ts, s.end) for s in steps)

    def in_steps(t: float) -> bool:
        return any(start <= t <= end for start, end in step_windows)

    if device == "cuda":
        timed = "kernels"
        kernels = [s for s in spans if s.cat == "kernel"]
        comm = union((k.ts, k.end) for k in kernels if is_comm(k.name))
        compute = union((k.ts, k.end) for k in kernels if not is_comm(k.name))
        comm_windows = step_windows
        counted = host + kernels
    else:
        timed = "host ranges"
        comm = union((s.ts, s.end) for s in host if is_comm(s.name))
        compute = _self_intervals(host)
        # DDP waits for every bucket's all-reduce inside backward() (the reducer's finalize runs as
        # autograd's final callback), so none runs past the step's last `backward` range. gloo's
        # worker thread closes its range only after it has woken that wait: on the 2-core machine
        # a 26 ms gloo:all_reduce range ended 12 ms into the optimizer.
        comm_windows = []
        for step in steps:
            ends = [s.end for s in host if s.name == BACKWARD and step.ts <= s.ts <= step.end]
            comm_windows.append((step.ts, max(ends) if ends else step.end))
        comm_windows = union(comm_windows)
        counted = host
    comm_in_steps = intersect(comm, comm_windows)
    ops = Counter(s.name for s in counted if is_comm(s.name) and in_steps(s.ts))
    return CommTimeline(
        steps=len(steps),
        step_us=sum(s.end - s.ts for s in steps),
        comm_us=total_length(comm_in_steps),
        overlap_us=total_length(intersect(comm_in_steps, compute)),
        timed=timed,
        ops=dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),  # most first, ties by name
    )


# --------------------------------------------------------------------------------------------
# One rank: profile the DDP step (no printing here)
# --------------------------------------------------------------------------------------------


def _raise_at_call(model: torch.nn.Module, call: int, rank: int) -> None:
    """The test hook: the model's forward raises at its `call`-th call (1-based)."""
    calls = 0

    def hook(_module, _inputs):
        nonlocal calls
        calls += 1
        if calls >= call:
            raise RuntimeError(f"{FAIL_RANK_ENV}={rank} made rank {rank} raise in training step {calls}")

    model.register_forward_pre_hook(hook)


def profile_rank(cfg: ProfileConfig, rank: int, fail: bool = False) -> RankProfile:
    """Profile Part A's step on this rank, the model under DDP; the process group is joined."""
    from torch.nn.parallel import DistributedDataParallel

    on_cuda = cfg.device.type == "cuda"

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if fail:  # the first profiled step: the warm-up steps' all-reduces have run
            _raise_at_call(model, cfg.warmup + 1, rank)
        return DistributedDataParallel(model, device_ids=[cfg.device.index] if on_cuda else None)

    result, trace = profile_with_trace(cfg, wrap=wrap, batch_seed=cfg.seed + rank, extra_rules=COMM_RULES)
    s = result.summary
    return RankProfile(
        rank=rank,
        host=socket.gethostname(),
        device=result.device,
        step_ms=result.step_ms,
        step_times_ms=result.step_times_ms,
        basis=s.basis,
        time_by_category_us={c: s.total_us * s.shares.get(c, 0.0) / 100.0 for c in JOB_CATEGORIES},
        launches_per_step=s.launches_per_step,
        launch_unit=s.launch_unit,
        comm=comm_timeline(trace, cfg.device.type),
        trace_path=result.trace_path,
        trace_bytes=result.trace_bytes,
        top_operators=[asdict(r) for r in result.rows],
        candidates=[asdict(c) for c in s.candidates],
        phase_pct=dict(s.phase_pct),
    )


def started_by_launcher() -> bool:
    """Whether torch's launcher (torchrun, or profuse's own) started this process as a rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _rank_env() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) when torch's launcher started us."""
    env = os.environ
    if not started_by_launcher():
        return None
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers") from None
    return rank, world, local, local_world


def _rank_device(name: str, local_rank: int) -> torch.device:
    from profuse.env import resolve_device

    device = resolve_device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UsageError(f"local rank {local_rank} needs a GPU of its own, but this machine has {count}")
    return torch.device("cuda", local_rank)


# --------------------------------------------------------------------------------------------
# The rank's entry (the CLI calls it, shows what it returns, then calls end_rank)
# --------------------------------------------------------------------------------------------


@record  # torch's: a rank's exception goes to the error file (error.json) its launcher reads
def run_worker(
    make_config: Callable[[torch.device], ProfileConfig],
    device: str,
    nproc: int | None = None,
    compile_step: bool = False,
) -> DDPProfile | None:
    """One rank of `profuse profile --nproc N`, started by `launch` below or by torchrun.

    `make_config` builds Part A's config for this rank's device (the CLI maps its flags onto
    it); `device`, `nproc` and `compile_step` are the user's --device, --nproc, --compile-step.
    Returns the job on rank 0 when torchrun started the ranks, for the caller to show; None on
    the other ranks, and under profuse's own launcher, which shows the job itself. The caller
    then ends the process with `end_rank`.
    """
    import torch.distributed as dist

    rank, world, local_rank, local_world = _rank_env()
    os.environ.update(SAFE_ENV)  # NCCL reads them when its communicator starts, after this
    if nproc is not None and nproc != local_world:
        raise UsageError(f"--nproc {nproc} does not match the {local_world} processes started here")
    if compile_step:
        raise UsageError("--compile-step is not supported with --nproc: profile it on one process")
    rank_device = _rank_device(device, local_rank)
    cfg = replace(make_config(rank_device), trace_name=f"trace_rank{rank}.json")
    backend = BACKENDS[rank_device.type]
    init = {"backend": backend, "timeout": timedelta(seconds=COLLECTIVE_TIMEOUT_S)}
    if rank_device.type == "cuda":
        torch.cuda.set_device(rank_device)
        init["device_id"] = rank_device  # binds the communicator to this rank's GPU up front
    dist.init_process_group(**init)
    fail = os.environ.get(FAIL_RANK_ENV, "") == str(rank)
    mine = profile_rank(cfg, rank, fail=fail)
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(asdict(mine), gathered, dst=0)
    job = None
    if rank == 0:
        job = DDPProfile(
            world_size=world,
            backend=backend,
            device=rank_device.type,
            precision="bf16 autocast" if rank_device.type == "cuda" else "fp32",
            torch_version=torch.__version__,
            config=cfg.to_dict(),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            ranks=[RankProfile.from_dict(d) for d in gathered],
        )
        write_result(cfg.out_dir / SUMMARY_NAME, job.to_dict())
    dist.destroy_process_group()
    return job if os.environ.get(LAUNCHER_ENV) != "1" else None


def end_rank() -> NoReturn:
    """End a rank that finished: all it owes is written and the process group is gone.

    It leaves without the interpreter's teardown. One finished run in about 50 on the 2-core
    machine (torch 2.13, gloo) had rank 0 abort there ("terminate called without an active
    exception": a C++ thread destroyed unjoined), and its launcher then reported a failed rank for
    a profile that was complete.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# The launcher: `profuse profile --nproc N` starts its ranks here
# --------------------------------------------------------------------------------------------


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the TCPStore does: a port left in TIME_WAIT by a finished run is free to it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port() -> int:
    """MASTER_PORT when it is set (and free), else a port the system says is free."""
    text = os.environ.get("MASTER_PORT", "").strip()
    if text:
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise UsageError(f"MASTER_PORT={text!r} is not a port number (1 to 65535)")
        port = int(text)
        if not _port_is_free(port):
            raise UsageError(
                f"port {port} (MASTER_PORT) is already in use: choose another, "
                "or unset MASTER_PORT and profuse picks a free one"
            )
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ with `extra` set (the agent copies it into every rank), restored afterwards."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _agent_logs_to(path: Path) -> Iterator[None]:
    """The elastic agent's log lines (failed ranks, SIGTERMs sent) go to `path`, not the terminal."""
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (propagate, level) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.propagate, lg.level = propagate, level
        handler.close()


def _package_root() -> str:
    import profuse

    return str(Path(profuse.__file__).resolve().parents[1])


def _rank_log(log_dir: Path, run_id: str, local_rank: int) -> Path | None:
    """stderr.log of a rank: DefaultLogsSpecs writes <log_dir>/<run_id>_*/attempt_0/<rank>/."""
    hits = sorted(glob.glob(str(log_dir / f"{run_id}_*" / "attempt_*" / str(local_rank) / "stderr.log")))
    return Path(hits[-1]) if hits else None


def _raised(failure) -> bool:
    """Whether the rank wrote an error file: its @record saw it raise, whatever ended its process."""
    try:
        return os.path.isfile(failure.error_file)
    except TypeError:
        return False


def _failure_text(failure) -> str:
    """The rank's exception as its @record wrote it, or how it died.

    A rank that raised can still end by a signal: while its interpreter shuts down, a peer that
    lost its connection to it may exit first, and the agent then stops every rank left with a
    SIGTERM. Its exception is the cause, so it is what is named.
    """
    if failure.exitcode < 0 and not _raised(failure):
        return f"killed by {failure.signal_name()}"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message.startswith("To enable traceback"):
        return ""  # the agent's stock text when the rank left no error file
    first = message.strip().splitlines()[0] if message.strip() else ""  # "RuntimeError: ..."
    return first if len(first) <= 300 else first[:297] + "..."  # the whole of it is in the log


# What a rank raises when another one died first: gloo's and NCCL's words for a peer that went
# away, and timeouts. Such a rank is a casualty, not the cause.
_CASUALTY = re.compile(
    r"closed by peer|reset by peer|broken pipe|remote (process|worker|end)|timed? ?out|watchdog"
    r"|abort|DistBackendError|DistNetworkError",
    re.IGNORECASE,
)


def root_failure(failures: dict) -> tuple[int, object]:
    """(rank, ProcessFailure) of the rank that failed first, among ChildFailedError.failures.

    The agent's own choice (get_first_failure) sorts by whole seconds, so a rank that raised and
    the rank that then lost its connection to it tie, and the lower rank wins the tie. Here a rank
    whose error reads as a consequence (connection closed by peer, a timeout) comes after one that
    failed on its own, then the error file's modification time orders them: a rank writes its
    error file before its process exits, and its peers lose their connection only at that exit.
    """

    def key(item: tuple[int, object]) -> tuple[bool, float, int]:
        rank, failure = item
        try:
            when = os.stat(failure.error_file).st_mtime
        except (OSError, TypeError):
            when = float(failure.timestamp)  # no error file: when the agent saw it die
        return (_CASUALTY.search(_failure_text(failure)) is not None, when, rank)

    return min(failures.items(), key=key)


@dataclass
class RankFailure:
    """The rank that failed first, as the launcher saw it (report.distributed words it)."""

    rank: int
    world_size: int
    exitcode: int  # negative: killed by that signal
    error: str  # its exception's first line as its @record wrote it, or how it died
    log: str  # its stderr.log (the launcher's log where it has none)
    log_empty: bool = False
    raised: bool = False  # it wrote an error file: `error` is its exception even if a signal ended it


class LaunchFailed(Exception):
    """The ranks did not all finish: `failure` names the rank that failed first; where no rank
    did (the rendezvous, a signal, no summary written), the message says what went wrong."""

    def __init__(self, message: str = "", failure: RankFailure | None = None):
        super().__init__(message)
        self.failure = failure


def _run_agent(config, argv: list[str], launcher_log: Path) -> None:
    """Run the elastic agent over the ranks until all of them finished; LaunchFailed otherwise."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    try:
        with _agent_logs_to(launcher_log):
            elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as err:
        rank, failure = root_failure(err.failures)
        log = _rank_log(launcher_log.parent, config.run_id, failure.local_rank) or launcher_log
        try:
            log_empty = log.stat().st_size == 0
        except OSError:
            log_empty = False
        failed = RankFailure(
            rank,
            config.nproc_per_node,
            failure.exitcode,
            _failure_text(failure),
            str(log),
            log_empty,
            _raised(failure),
        )
        raise LaunchFailed(failure=failed) from None
    except RendezvousError as err:
        raise LaunchFailed(
            f"the ranks could not meet on {config.rdzv_endpoint} ({type(err).__name__}): another "
            "program may have taken the port since it was checked; run again, or set MASTER_PORT "
            "to a free one"
        ) from None
    except SignalException as err:
        if err.sigval == signal.SIGINT:  # Ctrl-C: the CLI reports an interruption
            raise KeyboardInterrupt from None
        raise LaunchFailed(f"stopped by {err.sigval.name}; the ranks were stopped") from None


def _remove_logs(log_dir: Path, run_id: str, launcher_log: Path) -> None:
    """This run's logs: its ranks' folder and the launcher's file (another run's stay)."""
    for folder in log_dir.glob(f"{run_id}_*"):
        shutil.rmtree(folder, ignore_errors=True)
    launcher_log.unlink(missing_ok=True)


def launch(rank_argv: list[str], nproc: int, device: torch.device, out: Path) -> DDPProfile:
    """Start `nproc` ranks of `python -m profuse profile *rank_argv` and wait for them all.

    `rank_argv` is what the CLI gives each rank (the user's flags, with --device and --out
    resolved); `out` the absolute --out, where rank 0 writes the summary. Returns the job as rank
    0 saved it; LaunchFailed when a rank failed, naming it (its log stays in out/logs).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    n = nproc
    if device.type == "cuda" and n > torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UsageError(
            f"--nproc {n} needs {n} GPUs, one a rank, but this machine has {count}: "
            f"use --nproc {count} or fewer, or --device cpu"
        )
    port = rendezvous_port()
    log_dir = out / LOG_DIR_NAME
    log_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"profuse-{uuid.uuid4().hex[:12]}"
    env = {
        **SAFE_ENV,
        LAUNCHER_ENV: "1",
        "PYTHONUNBUFFERED": "1",  # a rank's log is complete up to the moment it dies
        # The ranks run `python -m profuse`: find this very package, however it was imported.
        "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH")) if p),
    }
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; N ranks share the cores instead
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=run_id,
        rdzv_backend="c10d",  # as torchrun --standalone, on a port we chose
        rdzv_endpoint=f"127.0.0.1:{port}",
        # We host the rendezvous store. Without this, a port taken since rendezvous_port() checked it
        # makes the agent connect to whatever listens there as a client, and wait: over 120 s here.
        rdzv_configs={"is_host": True},
        max_restarts=0,  # a profile that failed once fails again: report it, do not retry
        monitor_interval=MONITOR_INTERVAL_S,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee=Std.NONE),
    )
    launcher_log = log_dir / f"{run_id}-launcher.log"
    argv = ["-m", "profuse", "profile", *rank_argv]
    data: dict = {}
    try:
        with _environment(env):  # the agent copies os.environ into every rank's
            _run_agent(config, argv, launcher_log)
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((out / SUMMARY_NAME).read_text(encoding="utf-8"))
        if data.get("run_id") != run_id:
            raise LaunchFailed(f"the ranks finished but rank 0 wrote no {out / SUMMARY_NAME}")
        _remove_logs(log_dir, run_id, launcher_log)  # a run that worked keeps no logs
    except KeyboardInterrupt:
        _remove_logs(log_dir, run_id, launcher_log)  # nor does one stopped with Ctrl-C
        raise
    finally:
        with contextlib.suppress(OSError):
            log_dir.rmdir()  # when empty: no run, this one or another, left its logs there
    return DDPProfile.from_dict(data)
