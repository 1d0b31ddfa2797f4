"""Where the backward team kernel's time goes (CUDA only; issue 18).

Times variants of a probe copy of the backward team kernel (kernels/tail.py) at one shape,
device time with the L2 flushed, the variants taking turns, the median of --trials:

    team      the kernel as shipped (one stage), for reference
    probe     the probe copy, the same work: must time as `team`
    nowait    no exchange: each member takes its own part as the row's (wrong answers; the time
              an exchange-free kernel would take)
    rows2     two rows per exchange (each member holds a share of two rows, one exchange for both)
    nodw      no dw partial accumulated (what dw's registers and its store cost)

and the probe's own clock: the share of each program's time spent waiting in the exchange
(globaltimer, per program, the median over programs). Every variant that computes the right
answer is checked against the shipped kernel first.

    PYTHONPATH=src python benchmarks/team_probe.py --rows 4096 --cols 8192 --out results/probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
import triton
import triton.language as tl

from profuse.bench.traffic import copy_ceiling
from profuse.files import write_json
from profuse.kernels.configs import KernelConfig
from profuse.kernels.tail import tail_backward, tail_forward
from profuse.kernels.tail.fused import store_input_grads as _store_input_grads
from profuse.kernels.tail.plans import _backward_launch
from profuse.kernels.tail.team import _team_h
from profuse.kernels.teams import TeamLaunch, buffers_for, gather, publish, slots_for, team_size
from profuse.tail import relative_error
from profuse.timers import CudaTimer


@triton.jit
def _rows(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride, g_row_stride, u_row_stride, r_row_stride,
          cols, col_mask, n_rows):  # fmt: skip
    """Columns `cols` of rows `row` (a vector) of dy, g, u, r, read once, and the rows' rstd."""
    mask = (row[:, None] < n_rows) & col_mask[None, :]
    at = row[:, None] * dy_row_stride + cols[None, :]
    dy = tl.load(DY_ptr + at, mask=mask, other=0.0, eviction_policy="evict_first")
    at = row[:, None] * g_row_stride + cols[None, :]
    g = tl.load(G_ptr + at, mask=mask, other=0.0, eviction_policy="evict_first")
    at = row[:, None] * u_row_stride + cols[None, :]
    u = tl.load(U_ptr + at, mask=mask, other=0.0, eviction_policy="evict_first")
    at = row[:, None] * r_row_stride + cols[None, :]
    r = tl.load(R_ptr + at, mask=mask, other=0.0, eviction_policy="evict_first")
    return dy, g, u, r, tl.load(RSTD_ptr + tl.minimum(row, n_rows - 1)), mask


@triton.jit
def _probe_bwd_kernel(
    DY_ptr, G_ptr, U_ptr, R_ptr, W_ptr, RSTD_ptr, DG_ptr, DU_ptr, DR_ptr, DW_ptr, T_ptr,
    dy_row_stride, g_row_stride, u_row_stride, r_row_stride, n_rows, n_cols, SLOT_ptr, SEQ_ptr,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, LAG: tl.constexpr,
    BUFFERS: tl.constexpr, ROWS: tl.constexpr, WAIT: tl.constexpr, DW: tl.constexpr,
):  # fmt: skip
    """The one-stage backward team kernel on ROWS rows at a time (one exchange word each, all
    published before the first wait); WAIT=0 skips the exchange; T_ptr gets (ns waiting, ns in
    all) per program."""
    pid = tl.program_id(0)
    n_teams = tl.num_programs(0) // MEMBERS
    team = pid // MEMBERS
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    slots = SLOT_ptr + team.to(tl.int64) * (BUFFERS * SLOTS)
    seq = tl.load(SEQ_ptr + pid)
    rr = tl.arange(0, ROWS)
    step = n_teams * ROWS
    row = (team * ROWS + rr).to(tl.int64)
    dy, g, u, r, rstd, mask = _rows(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride, g_row_stride,
                                    u_row_stride, r_row_stride, cols, col_mask, n_rows)  # fmt: skip
    waited = tl.zeros([], dtype=tl.int64)
    t_start = tl.extra.cuda.globaltimer()
    for _ in range(team * ROWS, n_rows, step):
        x_hat = _team_h(g, u, r) * rstd[:, None]
        parts = tl.sum(x_hat * w[None, :] * dy.to(tl.float32), axis=1)
        if WAIT:
            for j in tl.static_range(ROWS):
                publish(
                    slots, seq + 1 + j, member, tl.sum(tl.where(rr == j, parts, 0.0), axis=0), SLOTS, BUFFERS
                )
        if DW:
            dw_acc += tl.sum(dy.to(tl.float32) * x_hat, axis=0)
        dy_c, g_c, u_c, rstd_c, row_c, mask_c = dy, g, u, rstd, row, mask
        row = row + step
        dy, g, u, r, rstd, mask = _rows(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride,
                                        g_row_stride, u_row_stride, r_row_stride, cols, col_mask,
                                        n_rows)  # fmt: skip
        t0 = tl.extra.cuda.globaltimer()
        if WAIT:
            c = tl.zeros([ROWS], dtype=tl.float32)
            for j in tl.static_range(ROWS):
                c += tl.where(rr == j, gather(slots, seq + 1 + j, MEMBERS, SLOTS, BUFFERS), 0.0)
            seq += ROWS
        else:
            c = parts * MEMBERS
        waited += tl.extra.cuda.globaltimer() - t0
        c = c / n_cols
        gf = g_c.to(tl.float32)
        s = tl.sigmoid(gf)
        silu = gf * s
        dh = (w[None, :] * dy_c.to(tl.float32) - x_hat * c[:, None]) * rstd_c[:, None]
        out = row_c[:, None] * n_cols + cols[None, :]
        _store_input_grads(DG_ptr, DU_ptr, DR_ptr, out, mask_c, dh, gf, u_c.to(tl.float32), s, silu,
                           True, True, True, "evict_first")  # fmt: skip
    tl.store(T_ptr + 2 * pid, waited)
    tl.store(T_ptr + 2 * pid + 1, tl.extra.cuda.globaltimer() - t_start)
    if DW:
        tl.store(DW_ptr + team.to(tl.int64) * n_cols + cols, dw_acc, mask=col_mask)
    tl.store(SEQ_ptr + pid, seq)


def probe_launch(cfg: KernelConfig, n_rows: int, n_cols: int, rows: int, wait: bool, dw: bool) -> TeamLaunch:
    members = team_size(n_cols, cfg.block_n)
    buffers = 4 if rows > 1 else buffers_for(0)
    return TeamLaunch(
        _probe_bwd_kernel, cfg, "probe", members, triton.cdiv(n_rows, rows), num_warps=cfg.num_warps,
        MEMBERS=members, SLOTS=slots_for(members), BLOCK_N=cfg.block_n, LAG=0, BUFFERS=buffers, ROWS=rows,
        WAIT=wait, DW=dw,
    )  # fmt: skip


VARIANTS = (
    ("probe", 1, True, True),
    ("nowait", 1, False, True),
    ("rows2", 2, True, True),
    ("nodw", 1, True, False),
)


def median_time(timer: CudaTimer, call, trials: int) -> float:
    return statistics.median(timer.time_calls([call])[0] for _ in range(trials))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--shares", default="1024:4,2048:8", help="BLOCK_N:warps,... (default %(default)s)")
    p.add_argument("--per-sm", type=int, default=8, help="at most this many programs an SM")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        shares = [tuple(int(x) for x in share.split(":")) for share in a.shares.split(",")]
    except ValueError:
        p.error(f"--shares: expected BLOCK_N:warps pairs separated by commas, got {a.shares!r}")
    if any(len(s) != 2 or min(s) <= 0 for s in shares):
        p.error(f"--shares: expected BLOCK_N:warps pairs of positive integers, got {a.shares!r}")
    if not torch.cuda.is_available():
        print("error: team_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n, m = a.rows, a.cols
    gen = torch.Generator(device=dev).manual_seed(0)
    g, u, r, dy = (torch.randn(n, m, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(m, device=dev, dtype=torch.bfloat16, generator=gen)
    _, rstd = tail_forward(g, u, r, w, 1e-6)
    ref = tail_backward(dy, g, u, r, w, rstd, (True, True, True, True))
    floor_s = 7 * n * m * 2 / copy_ceiling(dev)
    timer = CudaTimer(dev)
    strides = (m, m, m, m, n, m)
    results = []
    for bn, warps in shares:
        share = f"{bn}:{warps}"
        cfg = KernelConfig("team", 1, bn, warps, 1, sms * a.per_sm)
        outs = [torch.empty_like(g) for _ in range(3)]
        args = (dy, g, u, r, w, rstd, *outs)
        one = torch.empty(1, device=dev)
        dw_out = torch.empty_like(w)
        # the kernel as shipped (its partials summed into dw by the last team), for reference
        team = _backward_launch(cfg, 0, n, m, (True, True, True, True), 0)
        part = torch.empty((team.prepare((*args, one, dw_out, *strides)), m), dtype=torch.float32, device=dev)
        t = median_time(timer, partial(team, *args, part, dw_out, *strides), a.trials)
        results.append(dict(share=share, variant="team", us=t * 1e6, frac=floor_s / t))
        print(f"{share:>8}    team: {t * 1e6:7.1f} us  {floor_s / t:5.1%} of copy", flush=True)
        for name, rows, wait, dw in VARIANTS:
            launch = probe_launch(cfg, n, m, rows, wait, dw)
            try:
                teams = launch.prepare((*args, one, one, *strides))
            except Exception as e:  # noqa: BLE001 -- a variant that cannot compile or fit is reported
                results.append(dict(share=share, variant=name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{share:>8} {name:>7}: failed: {e}", file=sys.stderr)
                continue
            part = torch.empty((teams, m), dtype=torch.float32, device=dev)
            clock = torch.zeros(2 * teams * launch.members, dtype=torch.int64, device=dev)
            call = partial(launch, *args, part, clock, *strides)
            call()
            row = dict(share=share, variant=name, teams=teams, members=launch.members)
            if wait:
                row["rel_err"] = max(relative_error(o, x) for o, x in zip(outs, ref[:3]))
                if dw:
                    row["dw_rel_err"] = relative_error(part.sum(0), ref[3])
            t = median_time(timer, call, a.trials)
            c = clock.view(-1, 2).double()
            row.update(us=t * 1e6, frac=floor_s / t, wait_share=float((c[:, 0] / c[:, 1]).median()))
            results.append(row)
            err = row.get("rel_err", float("nan"))
            print(f"{share:>8} {name:>7}: {t * 1e6:7.1f} us  {floor_s / t:5.1%} of copy  waiting "
                  f"{row['wait_share']:5.1%}  err {err:.1e}", flush=True)  # fmt: skip
    if a.out:
        write_json(a.out, dict(rows=n, cols=m, floor_us=floor_s * 1e6, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
