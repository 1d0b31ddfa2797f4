"""Part A on N processes as text: step time per rank, the all-reduce's share and overlap, the categories."""

from __future__ import annotations

import os
import signal

from profuse.distributed import JOB_CATEGORIES, DDPProfile
from profuse.errors import UsageError
from profuse.profiling import CATEGORY_LABELS
from profuse.report.profile import PERFETTO, category_line, step_time_warnings
from profuse.report.units import fmt_bytes

LABELS = {**CATEGORY_LABELS, "communication": "communication (all-reduce)"}


def _shown(path: str) -> str:
    """A path relative to the current folder when it is below it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive, on Windows
        return path
    return path if rel.startswith("..") else rel


def _what_is_timed(job: DDPProfile) -> str:
    if job.device == "cuda":
        return "collective kernels on the GPU, overlapped with any other kernel running"
    return (
        f"the all-reduce's host ranges ({job.backend}'s worker thread and the op queuing it, up to the "
        "end of backward), overlapped with operators running on any thread"
    )


def format_ddp_profile(job: DDPProfile, summary_path: str | None = None) -> str:
    """The job in one block: a row a rank, the slowest rank, communication, the category table."""
    steps = job.steps
    lines = [
        f"=== Part A on {job.world_size} process{'es' if job.world_size != 1 else ''}: "
        f"DistributedDataParallel over {job.backend} ({job.device}, {job.precision}), "
        f"{steps} profiled step{'s' if steps != 1 else ''} a rank ===",
        f"{'rank':>4}  {'step time':>11}  {'all-reduce':>11}  {'of the step':>11}  {'overlapped':>10}  "
        f"{'exposed':>11}  trace",
    ]
    for r in job.ranks:
        c = r.comm
        comm_ms = c.comm_us / 1e3 / max(c.steps, 1)
        overlap = "-" if c.overlap_pct is None else f"{c.overlap_pct:.1f}%"
        lines.append(
            f"{r.rank:>4}  {r.step_ms:8.3f} ms  {comm_ms:8.3f} ms  {c.comm_pct:10.1f}%  {overlap:>10}  "
            f"{c.exposed_ms_per_step:8.3f} ms  {_shown(r.trace_path)} ({fmt_bytes(r.trace_bytes, digits=1)})"
        )
    lines.append(
        "(step time: median, synchronised; all-reduce, overlapped, exposed: a step, on the rank's timeline)"
    )
    lines += step_time_warnings({f"rank {r.rank}": r for r in job.ranks})
    slow, fast = job.slowest, job.fastest
    if job.world_size > 1:
        spread = 100.0 * (slow.step_ms - fast.step_ms) / fast.step_ms if fast.step_ms > 0 else 0.0
        lines.append(
            f"slowest rank: {slow.rank}, {slow.step_ms:.3f} ms a step, {spread:.1f}% slower than "
            f"the fastest (rank {fast.rank}); every all-reduce waits for the slowest rank"
        )
    else:
        lines.append(f"slowest rank: {slow.rank} (the only one), {slow.step_ms:.3f} ms a step")

    overlap = job.overlap_pct
    if overlap is None:
        # NCCL's one-rank path launches no kernel for an in-place sum (it only copies when the
        # buffers differ), so --nproc 1 on a GPU is expected to land here; to confirm on an H200.
        single = job.world_size == 1 and job.device == "cuda"
        why = " (a single rank: NCCL has nothing to move)" if single else ""
        lines.append(f"communication: none ran on the timeline in the profiled steps{why}")
    else:
        exposed = sum(r.comm.exposed_ms_per_step for r in job.ranks) / len(job.ranks)
        lines.append(
            f"communication: {job.comm_pct:.1f}% of each step (mean over the ranks), "
            f"{overlap:.1f}% of it overlapped with compute, {exposed:.3f} ms a step exposed"
        )
    lines.append(f"  timed: {_what_is_timed(job)}")
    for r in job.ranks:
        ops = ", ".join(f"{name} x{count}" for name, count in r.comm.ops.items()) or "none"
        lines.append(f"  rank {r.rank}'s collectives in its trace: {ops}")

    shares = job.category_shares
    per_step_ms = sum(sum(r.time_by_category_us.values()) for r in job.ranks) / 1e3 / max(steps, 1)
    basis = job.ranks[0].basis if job.ranks else ""
    lines.append(
        f"time by category, whole job ({basis}, all ranks: {per_step_ms:.3f} ms a step"
        f"{', every thread' if job.device == 'cpu' else ''}):"
    )
    for cat in JOB_CATEGORIES:
        pct = shares.get(cat, 0.0)
        lines.append(category_line(LABELS.get(cat, cat), pct))
    first = job.ranks[0] if job.ranks else None
    if first is not None and first.candidates:
        found = ", ".join(
            f"{c['name']} {c['pct']:.1f}% ({c.get('covered_by') or 'none yet'})" for c in first.candidates[:4]
        )
        lines.append(f"fusion candidates on rank {first.rank}, by structure (share; profuse op): {found}")
    if summary_path:
        lines.append(f"summary: {_shown(summary_path)}; open the traces at {PERFETTO}")
    return "\n".join(lines)


def format_saved_ddp_profile(data: dict, source: str) -> str:
    """A saved profile_ddp.json as its run printed it; UsageError if malformed."""
    try:
        return format_ddp_profile(DDPProfile.from_dict(data), summary_path=source)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UsageError(f"{source} is a malformed Part A summary ({type(err).__name__}: {err})") from None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def format_rank_failure(
    rank: int,
    world_size: int,
    exitcode: int,
    error: str,
    log: str,
    log_empty: bool = False,
    raised: bool = False,
) -> str:
    """One line: which rank failed, how, what to try where the cause is plain, and where its log is.

    `raised`: the rank raised `error` and a signal ended it only afterwards, while it exited.
    """
    if exitcode < 0 and raised:
        how = f"failed ({error}; a {_signal_name(-exitcode)} then ended it while it exited)"
    elif exitcode < 0:
        how = f"was {error}" if error else f"died of signal {-exitcode}"
        if -exitcode == signal.SIGKILL:
            # Nothing in profuse or torch sends SIGKILL: on a machine short of memory it is the
            # kernel's out-of-memory killer, which leaves no word in the rank's log.
            how += (
                f", most likely by the system's out-of-memory killer ({world_size} ranks each hold "
                "the model, its gradients, AdamW's state and the activations): try fewer ranks "
                "(--nproc) or a smaller model (--layers, --d-model, --seq-len, --batch-size)"
            )
    else:
        how = f"failed (exit code {exitcode}{': ' + error if error else ''})"
    where = f"Its log{' (empty)' if log_empty else ''}: {_shown(log)}"
    return f"rank {rank} of {world_size} {how}; the other ranks were stopped. {where}"
