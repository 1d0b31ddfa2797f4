"""Where the forward row team's time goes at wide rows (CUDA only; issue 18).

The row team forward (kernels/tail.py) runs at 88-89% of the copy ceiling at 1024 x 32768 and
512 x 65536 (32M elements, L2 zeroed before each call), where the one-row forward at 1024 columns
runs at 91-92%. This times, at each shape and share, device time with the L2 zeroed, the
variants taking turns, the median of --trials:

    team      the kernel as shipped (tail_forward with the row team config), for reference
    bare      a probe copy of it, the same work and bits, unclocked (as fast as `team`)
    probe     the copy with a clock (which costs it time: the clock's reads and stores lie on
              each program's way from its data to its publish)
    nowait    the clocked copy with no exchange: each member takes its own share's sum as the
              row's (wrong answers; the time a row team with nothing to wait for would take)
    sleep     the clocked copy with a pause of ~100 ns between polls of the partners' slots
    prefetch, prefetch-half, prefetch-quarter, prefetch-early, prefetch-2rounds, prefetch-self
              after its publish (early: after its loads) a member asks the L2 for the share
              (or its first half, quarter) that the program taking its place a resident grid
              later will load (2rounds: two grids later; self: its own, already there), one
              prefetch instruction per 128-byte line
    bulk, bulk-half, bulk-self
              the same in three bulk prefetches (one a tensor) from the program's first thread
    spread-64, spread-256, spread-1024
              member m holds the row's chunks of 64-1024 columns m, m + members, ... instead
              of one block (checked against `team` to a rounding: the sums add in another order)

and the one-row forward at --narrow columns with the same elements (the autotuner's pick), the
bandwidth the wide rows are measured against. The probe's clock (globaltimer, per program)
gives where a program's time goes: the share spent waiting for its partners, how far apart a
team's members start, and how long the grid's last programs run after the last one started.
Every variant with an exchange is checked against `team` before it is timed.

Session 17, H200, 32M elements: with no exchange the row team ran 68.6-69.2 us at 16384-65536
columns (91.4-92.3% of copy), as fast as the one-row forward at 1024 columns (68.4-69.2), where
the shipped kernel ran 69.7-75.2: the exchange is the whole of the gap, and it grows with the
members a row has. The clocked probe ran 2-6 us slower than the shipped kernel, so the waiting
shares it reports (16-21% of a program's life) bound the shipped kernel's from above.

Session 18: prefetching the next resident round's shares lost 15 us at 32M (line prefetches)
and 5.5-6.6 (bulk), a prefetch of lines already in the L2 alone cost 1.4-2.4 us, and spreading a
member's columns over the row changed nothing (benchmarks/NOTES.md). So the DRAM does not sit
idle while teams exchange, and members do not wait on partners whose blocks hit busy channels.

    PYTHONPATH=src python benchmarks/row_team_probe.py --shapes 1024x32768,512x65536 \\
        --shares 4096:4,2048:2 --variants bare,nowait,prefetch --out results/row_team_probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from fixed_cost import shape

from profuse.bench.traffic import copy_ceiling
from profuse.env import sm_count
from profuse.files import check_folder, write_json
from profuse.kernels.configs import KernelConfig
from profuse.kernels.tail import tail_forward
from profuse.kernels.tail.team import _team_h, _team_y
from profuse.kernels.teams import gather, publish, resident_per_sm, slots_for, team_size
from profuse.timers import CudaTimer


@triton.jit
def _spin_sleeping(ptrs, seq):
    """teams._spin with a ~100 ns pause after each poll that finds a slot not yet there."""
    want = tl.full(ptrs.shape, 0, tl.int32) + seq
    return tl.inline_asm_elementwise(
        """{
        .reg .pred %p;
        .reg .b32 %hi;
        .reg .b64 %word;
        SPIN${:uid}:
        ld.relaxed.gpu.global.b64 %word, [$1];
        mov.b64 {$0, %hi}, %word;
        setp.ne.s32 %p, %hi, $2;
        @!%p bra DONE${:uid};
        nanosleep.u32 100;
        bra SPIN${:uid};
        DONE${:uid}:
        }""",
        "=r,l,r", [ptrs.to(tl.int64), want], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_l2(ptrs):
    """Asks the L2 for the 128-byte line at each of `ptrs` (no registers wait for it)."""
    return tl.inline_asm_elementwise(
        """{
        prefetch.global.L2 [$1];
        mov.u32 $0, 0;
        }""",
        "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_share(G_ptr, U_ptr, R_ptr, at, end, PART: tl.constexpr):
    """The first PART columns of a share of g, u, r starting at element `at`, into the L2 (none
    past element `end`, the row's last)."""
    lines = tl.minimum(at + tl.arange(0, PART // 64) * 64, end)  # 64 bf16 columns: a 128-byte line
    done = _prefetch_l2(G_ptr + lines) + _prefetch_l2(U_ptr + lines) + _prefetch_l2(R_ptr + lines)
    return tl.sum(done, axis=0)


@triton.jit
def _bulk_prefetch_l2(g, u, r, nbytes):
    """Asks the L2 for `nbytes` bytes from each of g, u, r (16-byte aligned addresses): one bulk
    prefetch each, issued by the program's first thread alone."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred %p;
        .reg .b32 %t;
        mov.u32 %t, %tid.x;
        setp.eq.u32 %p, %t, 0;
        @%p cp.async.bulk.prefetch.L2.global [$1], $4;
        @%p cp.async.bulk.prefetch.L2.global [$2], $4;
        @%p cp.async.bulk.prefetch.L2.global [$3], $4;
        mov.u32 $0, 0;
        }""",
        "=r,l,l,l,r", [g, u, r, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _ask_l2(G_ptr, U_ptr, R_ptr, at, end, PART: tl.constexpr, BULK: tl.constexpr):
    """The first PART columns of a share of g, u, r from element `at` (none past `end`) asked
    into the L2: one prefetch a 128-byte line, or (BULK) three bulk prefetches. Returns 0."""
    if BULK:
        one = tl.full([1], 0, tl.int64) + at
        nbytes = (tl.minimum(PART, end + 1 - at) * 2).to(tl.int32) + 0 * one.to(tl.int32)
        starts = [(p + one).to(tl.int64) for p in (G_ptr, U_ptr, R_ptr)]
        return tl.sum(_bulk_prefetch_l2(*starts, nbytes), axis=0)
    else:
        return _prefetch_share(G_ptr, U_ptr, R_ptr, at, end, PART)


@triton.jit
def _probe_fwd_kernel(
    G_ptr, U_ptr, R_ptr, W_ptr, Y_ptr, RSTD_ptr, T_ptr, n_rows, n_cols, eps, SLOT_ptr, ahead,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, WAIT: tl.constexpr,
    CLOCK: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr, BULK: tl.constexpr,
    SPREAD: tl.constexpr,
):  # fmt: skip
    """The row team forward (rows contiguous, `n_cols` apart) with a clock: T_ptr gets, per
    program, its start, the time it had published, the time it had its partners' sums, and its
    end (ns). WAIT=0 skips the exchange; WAIT=2 pauses between polls. CLOCK=0: no clock.
    PREFETCH > 0: the share `ahead` rows on (the program that takes this one's place once the
    grid's resident programs have ended), its first BLOCK_N // PREFETCH columns, is asked into
    the L2 after the publish (EARLY: right after this share's own loads are issued); BULK: in
    three bulk prefetches from the program's first thread, not one per 128-byte line. SPREAD > 0:
    member m takes the row's chunks of SPREAD columns m, m + MEMBERS, ... instead of one block
    (its loads spread over the whole row; the sums add in another order, so not the same bits)."""
    if CLOCK:
        t_start = tl.extra.cuda.globaltimer()
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    row = tl.cast(pid // MEMBERS, tl.int64)
    member = pid % MEMBERS
    if SPREAD:
        i = tl.arange(0, BLOCK_N)
        cols = tl.multiple_of(((i // SPREAD) * MEMBERS + member) * SPREAD, SPREAD) + i % SPREAD
    else:
        cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    at = row * n_cols + cols
    g = tl.load(G_ptr + at, mask=col_mask, other=0.0)
    u = tl.load(U_ptr + at, mask=col_mask, other=0.0)
    r = tl.load(R_ptr + at, mask=col_mask, other=0.0)
    later_row = tl.minimum(row + ahead, n_rows - 1) * n_cols
    later, end = later_row + member * BLOCK_N, later_row + n_cols - 1
    asked = 0
    if PREFETCH and EARLY:
        asked = _ask_l2(G_ptr, U_ptr, R_ptr, later, end, BLOCK_N // PREFETCH, BULK)
    slots = SLOT_ptr + row * SLOTS
    # The number is read while the loads are in flight, as the shipped kernel does: read after
    # them, its L2 round trip lies between the data and the publish.
    seq = (tl.load(slots + member, volatile=True) >> 32).to(tl.int32) + 1
    h = _team_h(g, u, r, True)
    part = tl.sum(h * h, axis=0)
    if WAIT:
        publish(slots, seq, member, part, SLOTS, 1)
    if PREFETCH and not EARLY:
        asked = _ask_l2(G_ptr, U_ptr, R_ptr, later, end, BLOCK_N // PREFETCH, BULK)
    if CLOCK:
        t_published = tl.extra.cuda.globaltimer()
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if WAIT == 2:
        members = tl.arange(0, SLOTS)
        present = members < MEMBERS
        words = _spin_sleeping(slots + tl.where(present, members, 0), seq)
        total = tl.sum(tl.where(present, words.to(tl.float32, bitcast=True), 0.0), axis=0)
    elif WAIT:
        total = gather(slots, seq, MEMBERS, SLOTS, 1, True)
    else:
        total = part * MEMBERS
    if CLOCK:
        t_gathered = tl.extra.cuda.globaltimer()
    # `asked` is 0; adding it keeps the prefetches from being dropped as unused.
    total += asked.to(tl.float32)
    _team_y(Y_ptr, RSTD_ptr, row, n_cols, cols, col_mask, member == 0, h, w, tl.rsqrt(total / n_cols + eps))
    if CLOCK:
        clock = T_ptr + 4 * pid.to(tl.int64)
        tl.store(clock, t_start)
        tl.store(clock + 1, t_published)
        tl.store(clock + 2, t_gathered)
        tl.store(clock + 3, tl.extra.cuda.globaltimer())


def clock_summary(clock: torch.Tensor, members: int) -> dict:
    """What the probe's clock says (us): a program's median lifetime and share of it waiting,
    the median spread of a team's start times, and how long the kernel ran after its last
    program started."""
    c = clock.view(-1, 4).double().cpu()
    c -= c[:, 0].min()
    life = c[:, 3] - c[:, 0]
    waiting = c[:, 2] - c[:, 1]
    starts = c[:, 0].view(-1, members)
    return {
        "lifetime_us": float(life.median()) / 1e3,
        "wait_share": float((waiting / life.clamp(min=1)).median()),
        "wait_us": float(waiting.median()) / 1e3,
        "team_start_spread_us": float((starts.max(1).values - starts.min(1).values).median()) / 1e3,
        "span_us": float(c[:, 3].max()) / 1e3,
        "after_last_start_us": float(c[:, 3].max() - c[:, 0].max()) / 1e3,
    }


def shape_list(text: str) -> list[tuple[int, int]]:
    """ROWSxCOLS shapes separated by commas, each as fixed_cost.shape reads one."""
    shapes = [shape(s) for s in text.split(",") if s.strip()]
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS shapes separated by commas, got {text!r}")
    return shapes


def share_list(text: str) -> list[tuple[int, int]]:
    try:
        shares = [tuple(int(v) for v in s.split(":")) for s in text.split(",") if s.strip()]
    except ValueError:
        shares = []
    if not shares or any(len(s) != 2 or min(s) <= 0 or s[0] & (s[0] - 1) for s in shares):
        raise argparse.ArgumentTypeError(f"expected SHARE:WARPS pairs (SHARE a power of two), got {text!r}")
    return shares


# name -> the probe kernel's constexprs (WAIT, CLOCK, PREFETCH, EARLY) and how many of the
# grid's resident rounds ahead a prefetch reaches. The clocked ones report where time goes; the
# others are timed as they would ship.
VARIANTS = {
    "probe": dict(WAIT=1, CLOCK=1),
    "nowait": dict(WAIT=0, CLOCK=1),
    "sleep": dict(WAIT=2, CLOCK=1),
    "bare": dict(WAIT=1),
    "prefetch": dict(WAIT=1, PREFETCH=1),
    "prefetch-half": dict(WAIT=1, PREFETCH=2),
    "prefetch-early": dict(WAIT=1, PREFETCH=1, EARLY=1),
    "prefetch-2rounds": dict(WAIT=1, PREFETCH=2, ROUNDS=2),
    "prefetch-self": dict(WAIT=1, PREFETCH=1, ROUNDS=0),
    "prefetch-quarter": dict(WAIT=1, PREFETCH=4),
    "bulk": dict(WAIT=1, PREFETCH=1, BULK=1),
    "bulk-half": dict(WAIT=1, PREFETCH=2, BULK=1),
    "bulk-self": dict(WAIT=1, PREFETCH=1, BULK=1, ROUNDS=0),
    "spread-64": dict(WAIT=1, SPREAD=64),
    "spread-256": dict(WAIT=1, SPREAD=256),
    "spread-1024": dict(WAIT=1, SPREAD=1024),
}


DEFAULTS = dict(WAIT=1, CLOCK=0, PREFETCH=0, EARLY=0, BULK=0, SPREAD=0)


def variant_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected variants among {', '.join(VARIANTS)}, got {text!r}")
    return names


def same(y, rstd, y_want, rstd_want, exact: bool) -> bool:
    """The shipped kernel's answer: its bits, or (not `exact`: sums added in another order) rstd
    within 1e-6 and y within a bf16 rounding."""
    if exact:
        return torch.equal(y, y_want) and torch.equal(rstd, rstd_want)
    return torch.allclose(rstd, rstd_want, rtol=1e-6, atol=0) and torch.allclose(
        y.float(), y_want.float(), rtol=2**-7, atol=1e-6
    )


def _launch(kernel, args: tuple, meta: dict) -> None:
    kernel(*args, **meta)


def variants(g, u, r, w, shares, narrow: int, names) -> dict:
    """label -> (call, info): the one-row forward at `narrow` columns, then per share the shipped
    row team and the probe's variants `names` (each checked against the shipped kernel)."""
    (n, m), dev = g.shape, g.device
    calls = {}
    if narrow and (n * m) % narrow == 0:
        rows = [t.view(-1, narrow) for t in (g, u, r)]
        calls[f"one row at {narrow} columns"] = (partial(tail_forward, *rows, w[:narrow], 1e-6), {})
    for bn, warps in shares:
        if bn >= m:
            continue
        members = team_size(m, bn)
        cfg = KernelConfig("team", 1, bn, warps, 1, 0, members, l2="plain")
        want = tail_forward(g, u, r, w, 1e-6, config=cfg)
        calls[f"{bn}:{warps} team"] = (partial(tail_forward, g, u, r, w, 1e-6, config=cfg), {})
        for name in names:
            spec = dict(VARIANTS[name])
            rounds = spec.pop("ROUNDS", 1)
            y, rstd = torch.empty_like(g), torch.empty(n, device=dev)
            clock = torch.zeros(4 * n * members, dtype=torch.int64, device=dev)
            slots = torch.zeros((n, slots_for(members)), dtype=torch.int64, device=dev)
            meta = dict(MEMBERS=members, SLOTS=slots_for(members), BLOCK_N=bn, num_warps=warps,
                        **{**DEFAULTS, **spec})  # fmt: skip
            # A program's place is taken by the one a resident grid's worth of programs later.
            compiled = _probe_fwd_kernel.warmup(g, u, r, w, y, rstd, clock, n, m, 1e-6, slots, 1,
                                                grid=(n * members,), **meta)  # fmt: skip
            _ = compiled.run
            resident = resident_per_sm(compiled.n_regs, warps, compiled.metadata.shared, dev) * sm_count(dev)
            ahead = rounds * resident // members
            args = (g, u, r, w, y, rstd, clock, n, m, 1e-6, slots, ahead)
            call = partial(_launch, _probe_fwd_kernel[(n * members,)], args, meta)
            call()
            info = {"members": members, "ahead_rows": ahead, "regs": compiled.n_regs}
            if meta["CLOCK"]:
                info["clock"] = clock
            if meta["WAIT"] and not same(y, rstd, *want, exact=not meta["SPREAD"]):
                info["failed"] = "the probe's answer differs from the shipped kernel's"
            calls[f"{bn}:{warps} {name}"] = (call, info)
    return calls


def measure(n: int, m: int, shares, narrow: int, names, trials: int, timer: CudaTimer, ceiling: float, dev):
    """Every variant at n x m, taking turns over `trials` trials (each starts with another)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    g, u, r = (torch.randn(n, m, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    w = 1 + 0.1 * torch.randn(m, device=dev, dtype=torch.bfloat16, generator=gen)
    floor_s = 4 * n * m * 2 / ceiling
    calls = variants(g, u, r, w, shares, narrow, names)
    for call, _info in calls.values():
        call()  # builds (and for the one-row forward, tunes) outside the timing
    labels = list(calls)
    times = {label: [] for label in labels}
    for i in range(trials):
        order = labels[i % len(labels) :] + labels[: i % len(labels)]
        for label, t in zip(order, timer.time_calls([calls[label][0] for label in order]), strict=True):
            times[label].append(t)
        print(f"\r{n}x{m}: trial {i + 1}/{trials}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = []
    for label in labels:
        t = statistics.median(times[label])
        info = calls[label][1]
        row = {"rows": n, "cols": m, "variant": label, "us": t * 1e6, "frac": floor_s / t}
        if "clock" in info:
            row.update(clock_summary(info["clock"], info["members"]))
        row.update({k: info[k] for k in ("ahead_rows", "regs", "failed") if k in info})
        rows.append(row)
        print(f"{n:>6}x{m:<6} {label:>28}: {t * 1e6:7.1f} us {floor_s / t:6.1%}{describe(row)}", flush=True)
    return rows


def describe(row: dict) -> str:
    out = ""
    if "wait_share" in row:
        out = (f"  life {row['lifetime_us']:5.2f} us, waiting {row['wait_share']:5.1%}, team starts "
               f"{row['team_start_spread_us']:5.2f} us apart, {row['after_last_start_us']:5.2f} us after the "
               "last start")  # fmt: skip
    return out + (f"  FAILED: {row['failed']}" if "failed" in row else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=shape_list, default=shape_list("2048x16384,1024x32768,512x65536"),
                   help="ROWSxCOLS,... (default 2048x16384,1024x32768,512x65536)")  # fmt: skip
    p.add_argument(
        "--shares",
        type=share_list,
        default=share_list("4096:4,2048:2"),
        help="SHARE:WARPS,... of the row team (default 4096:4,2048:2)",
    )
    p.add_argument("--narrow", type=int, default=1024,
                   help="the one-row forward's columns to compare with (0: none)")  # fmt: skip
    p.add_argument("--variants", type=variant_list, default=variant_list("probe,nowait,sleep"),
                   help=f"the probe's, comma-separated, of {', '.join(VARIANTS)} (default "
                   "probe,nowait,sleep: session 17's)")  # fmt: skip
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--out", default=None, help="write every figure to this JSON file")
    a = p.parse_args(argv)
    if a.out:
        check_folder(Path(a.out).parent, (Path(a.out).name,))
    if not torch.cuda.is_available():
        print("error: row_team_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    ceiling = copy_ceiling(dev)
    timer = CudaTimer(dev)
    results = []
    for n, m in a.shapes:
        results += measure(n, m, a.shares, a.narrow, a.variants, a.trials, timer, ceiling, dev)
    if a.out:
        print(f"wrote {write_json(a.out, {'copy_ceiling_Bps': ceiling, 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
