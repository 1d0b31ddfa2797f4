"""The fused SwiGLU tail in Triton: one pass forward, one pass backward.

    y = h * rstd * w,   h = silu(g) * u + r,   rstd = 1 / sqrt(mean(h^2) + eps)

Forward reads g, u, r once and writes y once (4 tensors; eager moves 15, see bench/traffic.py);
it also writes one fp32 rstd per row for the backward. All arithmetic is fp32 whatever the input
dtype; only the stores round (on rows of 16384 columns and more in bf16, also h, when it is kept
in y between the two passes).

Backward (x_hat = h * rstd, s = sigmoid(g), silu(g) = g * s, N = cols):
    dh  = rstd * (w * dy - x_hat * mean(x_hat * w * dy))
    dr  = dh
    du  = dh * silu(g)
    dg  = dh * u * s * (1 + g * (1 - s))
    dw  = sum over rows of dy * x_hat
It reads g, u, r, dy and writes dg, du, dr (7 tensors); h, s and x_hat are recomputed in
registers. dw is summed in fp32 per program over a persistent grid, then the (programs, N)
partials are summed in one fixed order (kernels/colsum.py; the team kernels do it themselves,
the last team to finish a column block adding that block up): no atomics on values, so
gradients are bitwise repeatable.

Rows wider than a program can hold in registers take a chunked path: pass 1 streams the row's
chunks to get the row's sum, pass 2 walks the chunks again in reverse order, so the chunks read
last (still in L2) are read first; a persistent grid keeps few rows in flight so they stay in
L2. The forward may keep h in y between the passes (one tensor re-read instead of three). The
pipelined kernels run pass 1 of a program's next row in the same chunk loop as pass 2 of its
current row, so the DRAM is read all the time. The backward can also split: a row-dot pass
(each row's sum, in column ranges when rows are few), then a grid of (row programs x column
slabs) that holds its slab of dw in registers. Or a row is shared by a team of programs that
swap partial sums (kernels/teams.py): on a persistent grid, or (forward) a team a row on a grid
of one program per share. Which path and launch shape runs is chosen per
shape: kernels/configs.py proposes the candidates, kernels/autotune.py times them once and
keeps the shape's plan, so a later call is a lookup and its launches.

Layout: the @triton.jit kernels; the launch plans (each kernel bound to its grid and
compile-time arguments); the launchers (flatten to 2-D, allocate, look up the plan, launch); the
custom ops (so torch.compile calls them without a graph break); the autograd.Function; and
`tail_fused`, the entry point behind profuse.tail_triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from profuse.env import interpreting, sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing
from profuse.kernels.colsum import col_sum_launch, sum_when_last
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import double_backward_error
from profuse.kernels.teams import (
    RowTeamLaunch,
    TeamLaunch,
    buffers_for,
    gather,
    publish,
    slots_for,
    team_size,
)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tail_fwd_kernel(
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,
    RSTD_ptr,  # (n_rows,) fp32, for the backward
    g_row_stride,  # row strides in elements; columns are contiguous
    u_row_stride,
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_M: tl.constexpr,  # rows per tile: several when rows are narrow
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row is held
    NUM_STAGES: tl.constexpr,  # pipelining of the tile loop (persistent grids)
    IN_EVICT: tl.constexpr,  # the inputs' L2 eviction hint: "evict_first" (read once) or ""
    EVEN: tl.constexpr,  # n_cols == BLOCK_N (+ BLOCK_N2) and BLOCK_M divides n_rows: no masks
    BLOCK_N2: tl.constexpr,  # 0, or a second block: the row is BLOCK_N + BLOCK_N2 columns wide
):
    """Tiles of BLOCK_M whole rows: y = h * rstd * w, h = silu(g) * u + r.

    Program p takes tiles p, p + P, ...: one tile each when the grid covers every tile, or a
    persistent loop that loads the next tile while it reduces this one. With EVEN the masks are
    constants the compiler drops, as Inductor's kernel for a static width has none. A row of
    5120 columns can be held as blocks of 4096 and 1024 (BLOCK_N2) rather than one of 8192 (the
    tuner offers it on persistent grids, configs.py).
    """
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols, col_mask = _block_cols(0, BLOCK_N, n_cols, EVEN)
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if BLOCK_N2 > 0:
        cols2, col_mask2 = _block_cols(BLOCK_N, BLOCK_N2, n_cols, EVEN)
        w2 = tl.load(W_ptr + cols2, mask=col_mask2, other=0.0, eviction_policy="evict_last").to(tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        if EVEN:
            row_mask = tl.full([BLOCK_M], 1, tl.int1)
        else:
            row_mask = rows < n_rows
        # Each input is read once: the L2 may drop it first (the weight stays).
        mask = row_mask[:, None] & col_mask[None, :]
        h = _tile_h(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols, mask,
                    IN_EVICT)  # fmt: skip
        sum_sq = tl.sum(h * h, axis=1)  # masked columns give h = 0 and leave the sum alone
        if BLOCK_N2 > 0:
            mask2 = row_mask[:, None] & col_mask2[None, :]
            h2 = _tile_h(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols2,
                         mask2, IN_EVICT)  # fmt: skip
            sum_sq += tl.sum(h2 * h2, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        out = Y_ptr + rows[:, None] * y_row_stride
        tl.store(out + cols[None, :], (h * rstd[:, None] * w[None, :]).to(Y_ptr.dtype.element_ty), mask=mask)
        if BLOCK_N2 > 0:
            y2 = h2 * rstd[:, None] * w2[None, :]
            tl.store(out + cols2[None, :], y2.to(Y_ptr.dtype.element_ty), mask=mask2)
        tl.store(RSTD_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _block_cols(START: tl.constexpr, BLOCK: tl.constexpr, n_cols, EVEN: tl.constexpr):
    """Columns START .. START + BLOCK of a row held in blocks, and which of them exist."""
    cols = START + tl.arange(0, BLOCK)
    if EVEN:
        mask = tl.full([BLOCK], 1, tl.int1)
    else:
        mask = cols < n_cols
    return cols, mask


@triton.jit
def _tile_gur(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols, mask,
              EVICT: tl.constexpr):  # fmt: skip
    """g, u, r on a tile (`rows` x `cols`), in fp32; 0 where masked."""
    c2 = cols[None, :]
    g = tl.load(G_ptr + rows[:, None] * g_row_stride + c2, mask=mask, other=0.0,
                eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    u = tl.load(U_ptr + rows[:, None] * u_row_stride + c2, mask=mask, other=0.0,
                eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    r = tl.load(R_ptr + rows[:, None] * r_row_stride + c2, mask=mask, other=0.0,
                eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    return g, u, r


@triton.jit
def _tile_h(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols, mask,
            EVICT: tl.constexpr):  # fmt: skip
    """h = silu(g) * u + r on a tile (`rows` x `cols`), in fp32; 0 where masked."""
    g, u, r = _tile_gur(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols, mask,
                        EVICT)  # fmt: skip
    return g * tl.sigmoid(g) * u + r


@triton.jit
def _row_starts(A_ptr, B_ptr, C_ptr, D_ptr, row, a_row_stride, b_row_stride, c_row_stride, d_row_stride):
    """Four tensors' pointers at the start of `row` (int64)."""
    return (A_ptr + row * a_row_stride, B_ptr + row * b_row_stride, C_ptr + row * c_row_stride,
            D_ptr + row * d_row_stride)  # fmt: skip


@triton.jit
def _load_h(G_row, U_row, R_row, cols, mask, EVICT: tl.constexpr):
    """h = silu(g) * u + r at one row's `cols` (pointers at its start), in fp32; 0 where masked."""
    g = tl.load(G_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    u = tl.load(U_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    r = tl.load(R_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return g * tl.sigmoid(g) * u + r


@triton.jit
def _store_y(Y_row, W_ptr, cols, mask, h, rstd):
    """y = h * rstd * w at one row's `cols`, rounded once; nothing reads it again (evict_first)."""
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        Y_row + cols, (h * rstd * w).to(Y_row.dtype.element_ty), mask=mask, eviction_policy="evict_first"
    )


@triton.jit
def _tail_fwd_chunked_kernel(
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,
    RSTD_ptr,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,  # a chunk of the row; the row is n_cols / BLOCK_N chunks
    NUM_STAGES: tl.constexpr,  # chunks in flight: the next chunks' loads issue early
    STASH_H: tl.constexpr,  # pass 1 writes h into y and pass 2 reads it back (see below)
    IN_EVICT: tl.constexpr,  # pass 1's hint on g, u, r: "evict_first" when they are read once
):
    """Rows in chunks: pass 1 sums h^2, pass 2 (chunks in reverse) writes y.

    Program p takes rows p, p + P, ...: with a persistent grid (P ~ the SMs) only P rows are
    in flight, so pass 2's re-reads find the row still in L2 (132 rows x 3 x 128 KB = 50 MB at
    65536 bf16 columns, under the H200's 60 MB); with one program per row they would not.
    With STASH_H, pass 1 also stores h (rounded to y's dtype) where y goes, and pass 2 re-reads
    that one tensor instead of g, u and r: a third of the bytes held in L2 between the passes.
    The price is one more rounding of h in bf16 (eager rounds h several times); fp16, whose
    range an h can exceed where y does not, never stashes (see forward_candidates).
    """
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in range(pid, n_rows, n_programs):
        row64 = tl.cast(row, tl.int64)
        g_row, u_row, r_row, y_row = _row_starts(G_ptr, U_ptr, R_ptr, Y_ptr, row64, g_row_stride,
                                                 u_row_stride, r_row_stride, y_row_stride)  # fmt: skip
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            h = _load_h(g_row, u_row, r_row, cols, mask, IN_EVICT)
            acc += h * h
            if STASH_H:
                tl.store(y_row + cols, h.to(Y_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        if STASH_H:
            # Each thread reads back only what it stored itself (the same layout), and the row
            # sum above has its barrier; this one makes the order explicit.
            tl.debug_barrier()
        for i in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            cols = (n_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            if STASH_H:
                h = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                h = _load_h(g_row, u_row, r_row, cols, mask, "evict_first")
            _store_y(y_row, W_ptr, cols, mask, h, rstd)
        tl.store(RSTD_ptr + row64, rstd)


@triton.jit
def _stash_chunk(G_row, U_row, R_row, Y_row, cols, mask):
    """Pass 1 of the pipelined forward on one chunk of a row (pointers at its start): stores h
    where y goes, rounded to y's dtype, and returns h^2 for the row's sum."""
    h = _load_h(G_row, U_row, R_row, cols, mask, "evict_first")
    tl.store(Y_row + cols, h.to(Y_row.dtype.element_ty), mask=mask)
    return h * h


@triton.jit
def _finish_chunk(Y_row, W_ptr, cols, mask, rstd):
    """Pass 2 of the pipelined forward: y = h * rstd * w over the h that pass 1 stashed."""
    _store_y(Y_row, W_ptr, cols, mask, tl.load(Y_row + cols, mask=mask, other=0.0).to(tl.float32), rstd)


@triton.jit
def _tail_fwd_pipelined_kernel(
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,
    RSTD_ptr,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,  # a chunk of the row
):
    """Wide rows, persistent grid, h stashed in y: program p takes rows p, p + P, ..., and one
    chunk loop does pass 1 of its next row (read g, u, r from DRAM, store h, sum h^2) and pass 2
    of its current row (read h back from L2, write y).

    Two passes per row in turn would leave the DRAM idle while every program reads from L2 (the
    programs start together and stay in step); overlapped, the reads never stop. In flight per
    program: two rows of h (at 65536 bf16 columns, 132 programs hold 34 MB of the L2). The price
    is one more rounding of h in bf16, as in the chunked kernel's STASH_H (not run in fp16).
    """
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    row = tl.cast(pid, tl.int64)  # the launcher gives every program a row
    g_0, u_0, r_0, y_0 = _row_starts(G_ptr, U_ptr, R_ptr, Y_ptr, row, g_row_stride, u_row_stride,
                                     r_row_stride, y_row_stride)  # fmt: skip
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, n_chunks):
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        acc += _stash_chunk(g_0, u_0, r_0, y_0, cols, cols < n_cols)
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for nxt in range(pid + n_programs, n_rows, n_programs):
        nxt64 = tl.cast(nxt, tl.int64)
        g_n, u_n, r_n, y_n = _row_starts(G_ptr, U_ptr, R_ptr, Y_ptr, nxt64, g_row_stride, u_row_stride,
                                         r_row_stride, y_row_stride)  # fmt: skip
        y_row = Y_ptr + row * y_row_stride
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, n_chunks):
            cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            acc += _stash_chunk(g_n, u_n, r_n, y_n, cols, mask)
            _finish_chunk(y_row, W_ptr, cols, mask, rstd)
        tl.store(RSTD_ptr + row, rstd)
        row = nxt64
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for k in range(0, n_chunks):
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        _finish_chunk(Y_ptr + row * y_row_stride, W_ptr, cols, cols < n_cols, rstd)
    tl.store(RSTD_ptr + row, rstd)


@triton.jit
def _team_loads(G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols, n_rows, n_cols):
    """A member's share of row `row` of g, u, r (zeros past the last row)."""
    # A vector compare: the interpreter rejects a vector mask and-ed with a scalar.
    mask = cols < tl.where(row < n_rows, n_cols, 0)
    g = tl.load(G_ptr + row * g_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    u = tl.load(U_ptr + row * u_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    r = tl.load(R_ptr + row * r_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    return g, u, r


@triton.jit
def _sigmoid(x, APPROX: tl.constexpr):
    """sigmoid(x) of fp32 x. APPROX (a GPU: inline assembly) takes 1 / (1 + 2^(-x log2(e))) from
    the hardware's approximate exp2 and reciprocal: 4 instructions against ~12 for tl.sigmoid
    (its range checks), within a few ulp of it; 0 and 1 at the far ends, as tl.sigmoid."""
    if APPROX:
        return tl.inline_asm_elementwise(
            """{
            .reg .f32 %t;
            mul.f32 %t, $1, 0fBFB8AA3B;
            ex2.approx.ftz.f32 %t, %t;
            add.f32 %t, %t, 0f3F800000;
            rcp.approx.ftz.f32 $0, %t;
            }""",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.sigmoid(x)


@triton.jit
def _team_h(g, u, r, APPROX: tl.constexpr):
    """h = silu(g) * u + r in fp32 (APPROX: `_sigmoid`'s)."""
    gf = g.to(tl.float32)
    return gf * _sigmoid(gf, APPROX) * u.to(tl.float32) + r.to(tl.float32)


@triton.jit
def _team_row_y(
    Y_ptr, RSTD_ptr, slots, seq, row, y_row_stride, cols, col_mask, member, h, w, n_cols, eps,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BUFFERS: tl.constexpr,
):  # fmt: skip
    """A team forward's second half of a row: the team's sum of squares (waiting for it), then
    this member's share of y, and rstd (member 0)."""
    rstd = tl.rsqrt(gather(slots, seq, MEMBERS, SLOTS, BUFFERS) / n_cols + eps)
    _team_y(Y_ptr, RSTD_ptr, row, y_row_stride, cols, col_mask, member == 0, h, w, rstd)


@triton.jit
def _team_y(Y_ptr, RSTD_ptr, row, y_row_stride, cols, mask, rstd_mask, h, w, rstd):
    """A member's share of row `row` of y = h * rstd * w (where `mask`), and the row's rstd
    (where `rstd_mask`: one member's)."""
    tl.store(Y_ptr + row * y_row_stride + cols, (h * rstd * w).to(Y_ptr.dtype.element_ty), mask=mask,
             eviction_policy="evict_first")  # fmt: skip
    tl.store(RSTD_ptr + row, rstd, mask=rstd_mask)


@triton.jit
def _tail_fwd_team_kernel(
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    Y_ptr,
    RSTD_ptr,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    SLOT_ptr,  # (teams, BUFFERS, SLOTS) int64: kernels/teams.py
    SEQ_ptr,  # (programs,) int32: rows each program has published, over all calls
    MEMBERS: tl.constexpr,  # programs per row: cdiv(n_cols, BLOCK_N)
    SLOTS: tl.constexpr,  # MEMBERS rounded up to a power of two
    BLOCK_N: tl.constexpr,  # each member's share of the row
    LAG: tl.constexpr,  # 1: a row's sums are read after the next row's are published
    BUFFERS: tl.constexpr,  # slot buffers: teams.buffers_for(LAG)
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):
    """Wide rows read once: a team of MEMBERS co-resident programs shares each row, member m
    holding columns [m * BLOCK_N, (m + 1) * BLOCK_N) of it in registers. Each member sums its
    share's h^2, swaps the partial sums with its team (kernels/teams.py), and writes its share
    of y; the next row's loads are issued before the wait, so the DRAM keeps reading while the
    team waits. With LAG the wait for a row's sums comes one row later, after the next row's
    sums are published: the exchange's latency is hidden behind a row of work, for twice the
    registers (two rows of h). Team t takes rows t, t + T, ... (T teams: a persistent grid that
    is resident at once). Moves the 4 tensors once, plus 8 bytes per member per row of L2
    traffic."""
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_teams = tl.num_programs(0) // MEMBERS
    team = pid // MEMBERS
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    slots = SLOT_ptr + team.to(tl.int64) * (BUFFERS * SLOTS)
    seq = tl.load(SEQ_ptr + pid)
    row = tl.cast(team, tl.int64)  # every team has a row: the launch makes at most n_rows teams
    g, u, r = _team_loads(
        G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols, n_rows, n_cols
    )
    if LAG:
        # The first row is peeled off the loop and the last row's y follows it, so the loop has
        # no branch: each turn publishes row i, issues row i + 1's loads, then finishes row i - 1.
        h_prev = _team_h(g, u, r, APPROX)
        seq += 1
        publish(slots, seq, member, tl.sum(h_prev * h_prev, axis=0), SLOTS, BUFFERS)
        prev = row
        row = row + n_teams
        g, u, r = _team_loads(G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols,
                              n_rows, n_cols)  # fmt: skip
        for _ in range(team + n_teams, n_rows, n_teams):
            h = _team_h(g, u, r, APPROX)
            seq += 1
            publish(slots, seq, member, tl.sum(h * h, axis=0), SLOTS, BUFFERS)
            nxt = row + n_teams
            g, u, r = _team_loads(G_ptr, U_ptr, R_ptr, nxt, g_row_stride, u_row_stride, r_row_stride, cols,
                                  n_rows, n_cols)  # fmt: skip
            _team_row_y(Y_ptr, RSTD_ptr, slots, seq - 1, prev, y_row_stride, cols, col_mask, member, h_prev,
                        w, n_cols, eps, MEMBERS, SLOTS, BUFFERS)  # fmt: skip
            h_prev = h
            prev = row
            row = nxt
        _team_row_y(Y_ptr, RSTD_ptr, slots, seq, prev, y_row_stride, cols, col_mask, member, h_prev, w,
                    n_cols, eps, MEMBERS, SLOTS, BUFFERS)  # fmt: skip
    else:
        for _ in range(team, n_rows, n_teams):
            h = _team_h(g, u, r, APPROX)
            seq += 1
            publish(slots, seq, member, tl.sum(h * h, axis=0), SLOTS, BUFFERS)
            # The next row's loads go out before the wait.
            nxt = row + n_teams
            g, u, r = _team_loads(G_ptr, U_ptr, R_ptr, nxt, g_row_stride, u_row_stride, r_row_stride, cols,
                                  n_rows, n_cols)  # fmt: skip
            _team_row_y(Y_ptr, RSTD_ptr, slots, seq, row, y_row_stride, cols, col_mask, member, h, w, n_cols,
                        eps, MEMBERS, SLOTS, BUFFERS)  # fmt: skip
            row = nxt
    tl.store(SEQ_ptr + pid, seq)


@triton.jit
def _tail_fwd_team_staged_kernel(
    G_ptr, U_ptr, R_ptr, W_ptr, Y_ptr, RSTD_ptr, g_row_stride, u_row_stride, r_row_stride, y_row_stride,
    n_rows, n_cols, eps, SLOT_ptr, SEQ_ptr,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, LAG: tl.constexpr,
    BUFFERS: tl.constexpr,
    STAGES: tl.constexpr,  # tl.range's num_stages: rows STAGES - 1 ahead load into shared memory
    SPIN: tl.constexpr,  # wait in inline assembly (a GPU); the interpreter takes `gather`'s loop
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):  # fmt: skip
    """The team forward (arguments as `_tail_fwd_team_kernel`'s) with its row loop left to
    Triton's software pipeliner: each turn loads its row, publishes, waits and writes y, while
    the loads of the next STAGES - 1 rows land in shared memory. A loop inside the loop (the
    wait's polling) would stop the pipeliner, so the wait polls in inline assembly. The bytes in
    flight during a wait no longer cost registers."""
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_teams = tl.num_programs(0) // MEMBERS
    team = pid // MEMBERS
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    slots = SLOT_ptr + team.to(tl.int64) * (BUFFERS * SLOTS)
    seq = tl.load(SEQ_ptr + pid)
    if LAG:
        # One turn more than the team's rows, and no branch: each turn publishes its row's part
        # (the extra turn's row is past the end: a zero part, published by every member alike)
        # and finishes the row before. The first turn's row before is none (its stores masked
        # off) and the sums it waits for are the last number the previous call published.
        h_p = tl.zeros([BLOCK_N], dtype=tl.float32)
        row_p = tl.cast(team, tl.int64) - n_teams
        for i in tl.range(team, n_rows + n_teams, n_teams, num_stages=STAGES):
            row = tl.cast(i, tl.int64)
            g, u, r = _team_loads(G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols,
                                  n_rows, n_cols)  # fmt: skip
            h = _team_h(g, u, r, APPROX)
            seq += 1
            publish(slots, seq, member, tl.sum(h * h, axis=0), SLOTS, BUFFERS)
            rstd = tl.rsqrt(gather(slots, seq - 1, MEMBERS, SLOTS, BUFFERS, SPIN) / n_cols + eps)
            mask = cols < tl.where(row_p >= 0, n_cols, 0)
            _team_y(Y_ptr, RSTD_ptr, row_p, y_row_stride, cols, mask, (member == 0) & (row_p >= 0), h_p, w,
                    rstd)  # fmt: skip
            h_p = h
            row_p = row
    else:
        for i in tl.range(team, n_rows, n_teams, num_stages=STAGES):
            row = tl.cast(i, tl.int64)
            g, u, r = _team_loads(G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols,
                                  n_rows, n_cols)  # fmt: skip
            h = _team_h(g, u, r, APPROX)
            seq += 1
            publish(slots, seq, member, tl.sum(h * h, axis=0), SLOTS, BUFFERS)
            rstd = tl.rsqrt(gather(slots, seq, MEMBERS, SLOTS, BUFFERS, SPIN) / n_cols + eps)
            _team_y(Y_ptr, RSTD_ptr, row, y_row_stride, cols, col_mask, member == 0, h, w, rstd)
    tl.store(SEQ_ptr + pid, seq)


@triton.jit
def _tail_fwd_row_team_kernel(
    G_ptr, U_ptr, R_ptr, W_ptr, Y_ptr, RSTD_ptr, g_row_stride, u_row_stride, r_row_stride, y_row_stride,
    n_rows, n_cols, eps,
    SLOT_ptr,  # (n_rows, SLOTS) int64 slot words, one buffer: kernels/teams.py
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPIN: tl.constexpr,  # wait in inline assembly (a GPU); the interpreter takes `gather`'s loop
    PATIENCE: tl.constexpr,  # with SPIN: polls of a partner's slot before the kernel traps
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):  # fmt: skip
    """Wide rows read once, on a grid of one program per share of a row: a team forms for one
    row and ends with it, and the GPU starts the next programs as these end, as it does for a
    one-block elementwise kernel (a persistent grid's last round of rows takes as long as a full
    one, and all its programs must be resident at once). Program p holds share p mod MEMBERS of
    row p // MEMBERS: partners are neighbours in id, which the GPU starts together or next.
    Each (row, member) slot word carries the number of the last call that published it: a
    member reads its own word and publishes the next number, so nothing needs zeroing between
    calls. No L2 hints on the inputs: one-block walks of this pattern ran 1-4 points faster
    without them (benchmarks/stream_walk.py)."""
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    row = tl.cast(pid // MEMBERS, tl.int64)
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    g = tl.load(G_ptr + row * g_row_stride + cols, mask=col_mask, other=0.0)
    u = tl.load(U_ptr + row * u_row_stride + cols, mask=col_mask, other=0.0)
    r = tl.load(R_ptr + row * r_row_stride + cols, mask=col_mask, other=0.0)
    slots = SLOT_ptr + row * SLOTS
    seq = (tl.load(slots + member, volatile=True) >> 32).to(tl.int32) + 1
    h = _team_h(g, u, r, APPROX)
    publish(slots, seq, member, tl.sum(h * h, axis=0), SLOTS, 1)
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    rstd = tl.rsqrt(gather(slots, seq, MEMBERS, SLOTS, 1, SPIN, PATIENCE) / n_cols + eps)
    _team_y(Y_ptr, RSTD_ptr, row, y_row_stride, cols, col_mask, member == 0, h, w, rstd)


@triton.jit
def _store_input_grads(
    DG_ptr, DU_ptr, DR_ptr, out, mask, dh, g, u, s, silu,
    COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """dr = dh, du = dh * silu(g), dg = dh * u * s * (1 + g * (1 - s)): each rounded once, stored
    at `out` (EVICT: the stores' L2 eviction policy, "" for the default)."""
    if COMPUTE_DR:
        tl.store(DR_ptr + out, dh.to(DR_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
    if COMPUTE_DU:
        tl.store(DU_ptr + out, (dh * silu).to(DU_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
    if COMPUTE_DG:
        dg = dh * u * s * (1.0 + g * (1.0 - s))
        tl.store(DG_ptr + out, dg.to(DG_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)


@triton.jit
def _tail_bwd_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    DG_ptr,  # outputs, contiguous (n_rows, n_cols); unused when their COMPUTE_ flag is off
    DU_ptr,
    DR_ptr,
    DW_ptr,  # (programs, n_cols) fp32 partial sums of dy * x_hat, one row per program
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # whole row
    NUM_STAGES: tl.constexpr,  # software pipelining of the row loop: the next tile loads early
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    IN_EVICT: tl.constexpr,  # the inputs' L2 eviction hint: "evict_first" (read once) or ""
    BLOCK_N2: tl.constexpr,  # 0, or a second block: the row is BLOCK_N + BLOCK_N2 columns wide
):
    """Persistent grid: program p takes row tiles p, p + P, ... and, per row,

    x_hat = (silu(g) * u + r) * rstd          (recomputed; s = sigmoid(g), silu = g * s)
    dh    = rstd * (w * dy - x_hat * mean(x_hat * w * dy))
    dr    = dh,   du = dh * silu,   dg = dh * u * s * (1 + g * (1 - s))
    dw   += dy * x_hat                          (fp32, this program's rows only)

    The row is one block of BLOCK_N columns, or two (BLOCK_N + BLOCK_N2: 5120 as 4096 + 1024).
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols, col_mask = _block_cols(0, BLOCK_N, n_cols, False)
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_N2 > 0:
        cols2, col_mask2 = _block_cols(BLOCK_N, BLOCK_N2, n_cols, False)
        w2 = tl.load(W_ptr + cols2, mask=col_mask2, other=0.0).to(tl.float32)
        dw_acc2 = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy, g, u, s, silu, h = _bwd_tile(DY_ptr, G_ptr, U_ptr, R_ptr, rows, dy_row_stride, g_row_stride,
                                         u_row_stride, r_row_stride, cols, mask, IN_EVICT)  # fmt: skip
        if BLOCK_N2 > 0:
            mask2 = row_mask[:, None] & col_mask2[None, :]
            dy2, g2, u2, s2, silu2, h2 = _bwd_tile(
                DY_ptr, G_ptr, U_ptr, R_ptr, rows, dy_row_stride, g_row_stride, u_row_stride, r_row_stride,
                cols2, mask2, IN_EVICT,
            )  # fmt: skip
        rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
        x_hat = h * rstd[:, None]
        if BLOCK_N2 > 0:
            x_hat2 = h2 * rstd[:, None]
        if COMPUTE_DW:
            dw_acc += dy * x_hat
            if BLOCK_N2 > 0:
                dw_acc2 += dy2 * x_hat2
        if COMPUTE_DG or COMPUTE_DU or COMPUTE_DR:
            wdy = w[None, :] * dy
            dot = tl.sum(x_hat * wdy, axis=1)
            if BLOCK_N2 > 0:
                wdy2 = w2[None, :] * dy2
                dot += tl.sum(x_hat2 * wdy2, axis=1)
            c = dot / n_cols
            dh = (wdy - x_hat * c[:, None]) * rstd[:, None]
            _store_input_grads(DG_ptr, DU_ptr, DR_ptr, rows[:, None] * n_cols + cols[None, :], mask, dh, g,
                               u, s, silu, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "")  # fmt: skip
            if BLOCK_N2 > 0:
                dh2 = (wdy2 - x_hat2 * c[:, None]) * rstd[:, None]
                out2 = rows[:, None] * n_cols + cols2[None, :]
                _store_input_grads(DG_ptr, DU_ptr, DR_ptr, out2, mask2, dh2, g2, u2, s2, silu2,
                                   COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "")  # fmt: skip
    if COMPUTE_DW:
        tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if BLOCK_N2 > 0:
            tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols2, tl.sum(dw_acc2, axis=0), mask=col_mask2)


@triton.jit
def _bwd_tile(DY_ptr, G_ptr, U_ptr, R_ptr, rows, dy_row_stride, g_row_stride, u_row_stride, r_row_stride,
              cols, mask, EVICT: tl.constexpr):  # fmt: skip
    """A tile's dy, g, u, s = sigmoid(g), silu = g * s and h = silu * u + r, in fp32; 0 where masked."""
    dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0,
                 eviction_policy=EVICT).to(tl.float32)  # fmt: skip
    g, u, r = _tile_gur(G_ptr, U_ptr, R_ptr, rows, g_row_stride, u_row_stride, r_row_stride, cols, mask,
                        EVICT)  # fmt: skip
    s = tl.sigmoid(g)
    silu = g * s
    return dy, g, u, s, silu, silu * u + r


@triton.jit
def _load_row_chunk(DY_row, G_row, U_row, R_row, cols, mask, EVICT: tl.constexpr):
    """dy, g, u, r of one row (pointers at its start) at `cols`, in fp32; masked lanes are 0."""
    dy = tl.load(DY_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(G_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    u = tl.load(U_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    r = tl.load(R_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return dy, g, u, r


@triton.jit
def _row_dot_chunk(DY_row, G_row, U_row, R_row, cols, mask, w):
    """h * w * dy at one row's `cols` (summed over the row and times rstd / N, it is c)."""
    dy, g, u, r = _load_row_chunk(DY_row, G_row, U_row, R_row, cols, mask, "")
    return (g * tl.sigmoid(g) * u + r) * w * dy


@triton.jit
def _row_chunk_grads(
    DY_row, G_row, U_row, R_row, DG_ptr, DU_ptr, DR_ptr, out_row, cols, mask, w, rstd, c,
    COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """The gradients at one row's `cols` (input pointers at the row's start; the contiguous
    outputs' row starts at offset `out_row`), given its rstd and c: stores dg, du, dr (those
    asked for) and returns dy * x_hat, the chunk's share of dw. EVICT: the L2 hint on its loads
    and stores ("evict_first" where nothing reads them again)."""
    dy, g, u, r = _load_row_chunk(DY_row, G_row, U_row, R_row, cols, mask, EVICT)
    s = tl.sigmoid(g)
    silu = g * s
    x_hat = (silu * u + r) * rstd
    if COMPUTE_DG or COMPUTE_DU or COMPUTE_DR:
        dh = (w * dy - x_hat * c) * rstd
        _store_input_grads(DG_ptr, DU_ptr, DR_ptr, out_row + cols, mask, dh, g, u, s, silu,
                           COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, EVICT)  # fmt: skip
    return dy * x_hat


@triton.jit
def _add_to_dw(dw_row, cols, mask, dwc, first):
    """The program's fp32 dw partial row += dwc at `cols`. Its first row (`first`) starts the
    partial, so nothing zero-fills it: what that row loads (not yet written) is discarded. A
    branch around the load instead made it wait until after the math (7% slower at
    12192 x 11008 on the H200)."""
    dw = tl.load(dw_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    dw = tl.where(first, 0.0, dw)
    tl.store(dw_row + cols, dw + dwc, mask=mask, eviction_policy="evict_last")


@triton.jit
def _tail_bwd_chunked_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    DG_ptr,
    DU_ptr,
    DR_ptr,
    DW_ptr,  # (programs, n_cols) fp32; program p adds into its own row: no races
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,  # rows walked together, 1 or 2: each chunk of w and dw serves both
    BLOCK_N: tl.constexpr,  # a chunk of the row
    NUM_STAGES: tl.constexpr,  # chunks in flight: the next chunks' loads issue early
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """Wide rows, persistent grid, ROWS rows at a time: pass 1 gets each row's
    c = mean(x_hat * w * dy), pass 2 (chunks in reverse) writes dg, du, dr and adds dy * x_hat
    into the program's dw row.

    Pass 2 reads the dw row and writes it back per chunk: with one row that is 8 bytes of L2
    traffic per element on top of w's 2 and the inputs' 8 re-read, and the L2 was the busy unit
    (74% at 2048 x 16384, ncu). Two rows share each chunk of w and of the dw row.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    dw_row = DW_ptr + pid.to(tl.int64) * n_cols
    NEED_DH: tl.constexpr = COMPUTE_DG or COMPUTE_DU or COMPUTE_DR
    for tile in range(pid, tl.cdiv(n_rows, ROWS), n_programs):
        row = tl.cast(tile, tl.int64) * ROWS
        # Rows a and b (ROWS = 2: the next row, absent in a last odd tile).
        dy_a, g_a, u_a, r_a = _row_starts(DY_ptr, G_ptr, U_ptr, R_ptr, row, dy_row_stride, g_row_stride,
                                          u_row_stride, r_row_stride)  # fmt: skip
        dy_b, g_b, u_b, r_b = _row_starts(dy_a, g_a, u_a, r_a, 1, dy_row_stride, g_row_stride,
                                          u_row_stride, r_row_stride)  # fmt: skip
        rstd_a = tl.load(RSTD_ptr + row)
        # Row b's columns: none without a row b (a vector compare; the interpreter rejects a
        # vector mask and-ed with a scalar one).
        n_cols_b = tl.where(row + 1 < n_rows, n_cols, 0)
        rstd_b = 0.0
        if ROWS == 2:  # without a row b, any rstd will do: its loads are masked to zeros
            rstd_b = tl.load(RSTD_ptr + tl.minimum(row + 1, n_rows - 1))
        c_a = 0.0
        c_b = 0.0
        if NEED_DH:
            acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k in tl.range(0, n_chunks, num_stages=NUM_STAGES):
                cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = cols < n_cols
                w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                acc_a += _row_dot_chunk(dy_a, g_a, u_a, r_a, cols, mask, w)
                if ROWS == 2:
                    acc_b += _row_dot_chunk(dy_b, g_b, u_b, r_b, cols, cols < n_cols_b, w)
            c_a = tl.sum(acc_a, axis=0) * rstd_a / n_cols
            if ROWS == 2:
                c_b = tl.sum(acc_b, axis=0) * rstd_b / n_cols
        for i in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            cols = (n_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dwc = _row_chunk_grads(dy_a, g_a, u_a, r_a, DG_ptr, DU_ptr, DR_ptr, row * n_cols, cols, mask,
                                   w, rstd_a, c_a,
                                   COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "evict_first")  # fmt: skip
            if ROWS == 2:
                dwc += _row_chunk_grads(dy_b, g_b, u_b, r_b, DG_ptr, DU_ptr, DR_ptr, (row + 1) * n_cols,
                                        cols, cols < n_cols_b, w, rstd_b, c_b,
                                        COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "evict_first")  # fmt: skip
            if COMPUTE_DW:
                _add_to_dw(dw_row, cols, mask, dwc, tile == pid)


@triton.jit
def _finish_row_chunk(
    DY_row, G_row, U_row, R_row, DG_ptr, DU_ptr, DR_ptr, out_row, dw_row, cols, mask, w, rstd, c, first,
    COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr, COMPUTE_DW: tl.constexpr,
):  # fmt: skip
    """Pass 2 of the pipelined backward on one chunk of a row: its gradients, and its dy * x_hat
    added into the program's dw row (`first`: the program's first row, which starts it)."""
    dwc = _row_chunk_grads(DY_row, G_row, U_row, R_row, DG_ptr, DU_ptr, DR_ptr, out_row, cols, mask, w,
                           rstd, c, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "evict_first")  # fmt: skip
    if COMPUTE_DW:
        _add_to_dw(dw_row, cols, mask, dwc, first)


@triton.jit
def _tail_bwd_pipelined_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    DG_ptr,
    DU_ptr,
    DR_ptr,
    DW_ptr,  # (programs, n_cols) fp32; program p adds into its own row
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_rows,
    n_cols,
    BLOCK_N: tl.constexpr,
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """Wide rows, persistent grid: one chunk loop does pass 1 of the program's next row (its c,
    reading dy, g, u, r from DRAM) and pass 2 of its current row (re-reading them from L2,
    writing dg, du, dr and the dw partial), so the DRAM reads of the one overlap the writes and
    L2 traffic of the other instead of every program taking its turn at each. In flight per
    program: two rows of four inputs (at 16384 bf16 columns, 132 programs hold 34 MB)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    dw_row = DW_ptr + pid.to(tl.int64) * n_cols
    NEED_DH: tl.constexpr = COMPUTE_DG or COMPUTE_DU or COMPUTE_DR
    row = tl.cast(pid, tl.int64)  # the launcher gives every program a row
    dy_r, g_r, u_r, r_r = _row_starts(DY_ptr, G_ptr, U_ptr, R_ptr, row, dy_row_stride, g_row_stride,
                                      u_row_stride, r_row_stride)  # fmt: skip
    rstd = tl.load(RSTD_ptr + row)
    c = rstd * 0.0
    if NEED_DH:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, n_chunks):
            cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            acc += _row_dot_chunk(dy_r, g_r, u_r, r_r, cols, mask, w)
        c = tl.sum(acc, axis=0) * rstd / n_cols
    for nxt in range(pid + n_programs, n_rows, n_programs):
        nxt64 = tl.cast(nxt, tl.int64)
        dy_n, g_n, u_n, r_n = _row_starts(DY_ptr, G_ptr, U_ptr, R_ptr, nxt64, dy_row_stride, g_row_stride,
                                          u_row_stride, r_row_stride)  # fmt: skip
        rstd_next = tl.load(RSTD_ptr + nxt64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, n_chunks):
            cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if NEED_DH:
                acc += _row_dot_chunk(dy_n, g_n, u_n, r_n, cols, mask, w)
            _finish_row_chunk(dy_r, g_r, u_r, r_r, DG_ptr, DU_ptr, DR_ptr, row * n_cols, dw_row, cols, mask,
                              w, rstd, c, row == pid,
                              COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, COMPUTE_DW)  # fmt: skip
        if NEED_DH:
            c = tl.sum(acc, axis=0) * rstd_next / n_cols
        row, rstd = nxt64, rstd_next
        dy_r, g_r, u_r, r_r = dy_n, g_n, u_n, r_n
    for k in range(0, n_chunks):
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        _finish_row_chunk(dy_r, g_r, u_r, r_r, DG_ptr, DU_ptr, DR_ptr, row * n_cols, dw_row, cols, mask,
                          w, rstd, c, row == pid, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, COMPUTE_DW)  # fmt: skip


@triton.jit
def _team_bwd_loads(
    DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride, g_row_stride, u_row_stride, r_row_stride, cols,
    n_rows, n_cols,
):  # fmt: skip
    """A member's share of row `row` for the backward: raw dy, g, u, r and the row's rstd (zeros
    past the last row; rstd of the last row). Nothing here waits for the loads to land."""
    mask = cols < tl.where(row < n_rows, n_cols, 0)
    dy = tl.load(DY_ptr + row * dy_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    g, u, r = _team_loads(
        G_ptr, U_ptr, R_ptr, row, g_row_stride, u_row_stride, r_row_stride, cols, n_rows, n_cols
    )
    rstd = tl.load(RSTD_ptr + tl.minimum(row, n_rows - 1))
    return dy, g, u, r, rstd


@triton.jit
def _team_row_grads(
    DG_ptr, DU_ptr, DR_ptr, slots, seq, row, cols, col_mask, dy, g, u, x_hat, w, rstd, n_cols,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BUFFERS: tl.constexpr,
    COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    """A team backward's second half of a row: the team's sum of x_hat * w * dy (waiting for the
    team's parts), then this member's share of dg, du, dr."""
    total = gather(slots, seq, MEMBERS, SLOTS, BUFFERS)
    _team_grads(DG_ptr, DU_ptr, DR_ptr, row, cols, col_mask, dy, g, u, x_hat, w, rstd, total, n_cols,
                COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, APPROX)  # fmt: skip


@triton.jit
def _team_grads(
    DG_ptr, DU_ptr, DR_ptr, row, cols, mask, dy, g, u, x_hat, w, rstd, total, n_cols,
    COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    """A member's share of dg, du, dr for row `row` from its raw dy, g, u, its x_hat and the
    team's sum of x_hat * w * dy (`total`); APPROX: `_sigmoid`'s."""
    gf = g.to(tl.float32)
    s = _sigmoid(gf, APPROX)
    dh = (w * dy.to(tl.float32) - x_hat * (total / n_cols)) * rstd
    _store_input_grads(DG_ptr, DU_ptr, DR_ptr, row * n_cols + cols, mask, dh, gf, u.to(tl.float32), s, gf * s,
                       COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "evict_first")  # fmt: skip


@triton.jit
def _tail_bwd_team_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    DG_ptr,
    DU_ptr,
    DR_ptr,
    DW_ptr,  # (teams, n_cols) fp32: team t's sum of dy * x_hat over its rows
    DWSUM_ptr,  # (n_cols,) in the weight's dtype: dw, the teams' partials summed (the last to finish)
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_rows,
    n_cols,
    SLOT_ptr,  # (teams, BUFFERS, SLOTS) int64: kernels/teams.py
    SEQ_ptr,  # (programs,) int32
    MEMBERS: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # each member's share of the row
    LAG: tl.constexpr,  # 1: a row's c is read after the next row's parts are published
    BUFFERS: tl.constexpr,
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    DW_ROWS: tl.constexpr,  # partial rows the dw sum adds at a time (kernels/colsum.sum_when_last)
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one (the team backward issues more than it waits)
):
    """Wide rows read once, as the team forward: member m of a team holds columns
    [m * BLOCK_N, (m + 1) * BLOCK_N) of each of its team's rows, sums its share of
    x_hat * w * dy, swaps it with its team for the row's c, and writes its share of dg, du, dr.
    A member always holds the same columns, so its dw partial is BLOCK_N wide and stays in
    registers over all its rows: the partials are (teams, N), written once at the end, and the
    last team to finish a member's columns sums them into dw (no column-sum launch). The next
    row's loads are issued before the wait; with LAG the wait comes a row later (the previous
    row's raw dy, g, u and x_hat held meanwhile)."""
    pid = tl.program_id(0)
    n_teams = tl.num_programs(0) // MEMBERS
    team = pid // MEMBERS
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    NEED_DH: tl.constexpr = COMPUTE_DG or COMPUTE_DU or COMPUTE_DR
    slots = SLOT_ptr + team.to(tl.int64) * (BUFFERS * SLOTS)
    seq = tl.load(SEQ_ptr + pid)
    row = tl.cast(team, tl.int64)  # every team has a row: the launch makes at most n_rows teams
    dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride,
                                        g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                        n_cols)  # fmt: skip
    if LAG and NEED_DH:
        # As the lagged forward: the first row peeled off, the last row's grads after the loop.
        x_hat = _team_h(g, u, r, APPROX) * rstd
        seq += 1
        publish(slots, seq, member, tl.sum(x_hat * w * dy.to(tl.float32), axis=0), SLOTS, BUFFERS)
        if COMPUTE_DW:
            dw_acc += dy.to(tl.float32) * x_hat
        dy_p, g_p, u_p, xh_p, rstd_p, prev = dy, g, u, x_hat, rstd, row
        row = row + n_teams
        dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride,
                                            g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                            n_cols)  # fmt: skip
        for _ in range(team + n_teams, n_rows, n_teams):
            x_hat = _team_h(g, u, r, APPROX) * rstd
            seq += 1
            publish(slots, seq, member, tl.sum(x_hat * w * dy.to(tl.float32), axis=0), SLOTS, BUFFERS)
            if COMPUTE_DW:
                dw_acc += dy.to(tl.float32) * x_hat
            dy_c, g_c, u_c, rstd_c = dy, g, u, rstd
            nxt = row + n_teams
            dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, nxt, dy_row_stride,
                                                g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                                n_cols)  # fmt: skip
            _team_row_grads(DG_ptr, DU_ptr, DR_ptr, slots, seq - 1, prev, cols, col_mask, dy_p, g_p, u_p,
                            xh_p, w, rstd_p, n_cols, MEMBERS, SLOTS, BUFFERS, COMPUTE_DG, COMPUTE_DU,
                            COMPUTE_DR, APPROX)  # fmt: skip
            dy_p, g_p, u_p, xh_p, rstd_p, prev = dy_c, g_c, u_c, x_hat, rstd_c, row
            row = nxt
        _team_row_grads(DG_ptr, DU_ptr, DR_ptr, slots, seq, prev, cols, col_mask, dy_p, g_p, u_p, xh_p,
                        w, rstd_p, n_cols, MEMBERS, SLOTS, BUFFERS, COMPUTE_DG, COMPUTE_DU,
                        COMPUTE_DR, APPROX)  # fmt: skip
    else:
        for _ in range(team, n_rows, n_teams):
            x_hat = _team_h(g, u, r, APPROX) * rstd
            if NEED_DH:
                seq += 1
                publish(slots, seq, member, tl.sum(x_hat * w * dy.to(tl.float32), axis=0), SLOTS, BUFFERS)
            if COMPUTE_DW:
                dw_acc += dy.to(tl.float32) * x_hat
            dy_c, g_c, u_c, rstd_c = dy, g, u, rstd
            # The next row's loads go out before the wait.
            nxt = row + n_teams
            dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, nxt, dy_row_stride,
                                                g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                                n_cols)  # fmt: skip
            if NEED_DH:
                _team_row_grads(DG_ptr, DU_ptr, DR_ptr, slots, seq, row, cols, col_mask, dy_c, g_c, u_c,
                                x_hat, w, rstd_c, n_cols, MEMBERS, SLOTS, BUFFERS, COMPUTE_DG,
                                COMPUTE_DU, COMPUTE_DR, APPROX)  # fmt: skip
            row = nxt
    if COMPUTE_DW:
        # The counts after the programs' own: one per member, the arrivals at its columns' sum.
        sum_when_last(DW_ptr, DWSUM_ptr, SEQ_ptr + tl.num_programs(0) + member, team, dw_acc, n_teams, n_cols,
                      cols, col_mask, DW_ROWS, BLOCK_N)  # fmt: skip
    tl.store(SEQ_ptr + pid, seq)


@triton.jit
def _tail_bwd_team_staged_kernel(
    DY_ptr, G_ptr, U_ptr, R_ptr, W_ptr, RSTD_ptr, DG_ptr, DU_ptr, DR_ptr, DW_ptr, DWSUM_ptr,
    dy_row_stride, g_row_stride, u_row_stride, r_row_stride, n_rows, n_cols, SLOT_ptr, SEQ_ptr,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, LAG: tl.constexpr,
    BUFFERS: tl.constexpr, COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr, DW_ROWS: tl.constexpr,
    STAGES: tl.constexpr,  # tl.range's num_stages: rows STAGES - 1 ahead load into shared memory
    SPIN: tl.constexpr,  # wait in inline assembly (a GPU); the interpreter takes `gather`'s loop
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):  # fmt: skip
    """The team backward (arguments as `_tail_bwd_team_kernel`'s) with its row loop left to
    Triton's software pipeliner, as the staged team forward: each turn loads its row, publishes
    its part of the row's dot, waits and writes its share of dg, du, dr, while the next rows'
    loads land in shared memory."""
    pid = tl.program_id(0)
    n_teams = tl.num_programs(0) // MEMBERS
    team = pid // MEMBERS
    member = pid % MEMBERS
    cols = member * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    NEED_DH: tl.constexpr = COMPUTE_DG or COMPUTE_DU or COMPUTE_DR
    slots = SLOT_ptr + team.to(tl.int64) * (BUFFERS * SLOTS)
    seq = tl.load(SEQ_ptr + pid)
    if LAG and NEED_DH:
        # As the staged forward's lag: one turn more than the team's rows, the row before
        # finished after this row's part is published.
        dy_p = tl.zeros([BLOCK_N], dtype=DY_ptr.dtype.element_ty)
        g_p = tl.zeros([BLOCK_N], dtype=G_ptr.dtype.element_ty)
        u_p = tl.zeros([BLOCK_N], dtype=U_ptr.dtype.element_ty)
        xh_p = tl.zeros([BLOCK_N], dtype=tl.float32)
        rstd_p = tl.zeros([], dtype=tl.float32)
        row_p = tl.cast(team, tl.int64) - n_teams
        for i in tl.range(team, n_rows + n_teams, n_teams, num_stages=STAGES):
            row = tl.cast(i, tl.int64)
            dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride,
                                                g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                                n_cols)  # fmt: skip
            x_hat = _team_h(g, u, r, APPROX) * rstd
            dyf = dy.to(tl.float32)
            if COMPUTE_DW:
                dw_acc += dyf * x_hat
            seq += 1
            publish(slots, seq, member, tl.sum(x_hat * w * dyf, axis=0), SLOTS, BUFFERS)
            total = gather(slots, seq - 1, MEMBERS, SLOTS, BUFFERS, SPIN)
            mask = cols < tl.where(row_p >= 0, n_cols, 0)
            _team_grads(DG_ptr, DU_ptr, DR_ptr, row_p, cols, mask, dy_p, g_p, u_p, xh_p, w, rstd_p,
                        total, n_cols, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, APPROX)  # fmt: skip
            dy_p, g_p, u_p, xh_p, rstd_p, row_p = dy, g, u, x_hat, rstd, row
    else:
        for i in tl.range(team, n_rows, n_teams, num_stages=STAGES):
            row = tl.cast(i, tl.int64)
            dy, g, u, r, rstd = _team_bwd_loads(DY_ptr, G_ptr, U_ptr, R_ptr, RSTD_ptr, row, dy_row_stride,
                                                g_row_stride, u_row_stride, r_row_stride, cols, n_rows,
                                                n_cols)  # fmt: skip
            x_hat = _team_h(g, u, r, APPROX) * rstd
            dyf = dy.to(tl.float32)
            if COMPUTE_DW:
                dw_acc += dyf * x_hat
            if NEED_DH:
                seq += 1
                publish(slots, seq, member, tl.sum(x_hat * w * dyf, axis=0), SLOTS, BUFFERS)
                total = gather(slots, seq, MEMBERS, SLOTS, BUFFERS, SPIN)
                _team_grads(DG_ptr, DU_ptr, DR_ptr, row, cols, col_mask, dy, g, u, x_hat, w, rstd,
                            total, n_cols, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, APPROX)  # fmt: skip
    if COMPUTE_DW:
        # The counts after the programs' own: one per member, the arrivals at its columns' sum.
        sum_when_last(DW_ptr, DWSUM_ptr, SEQ_ptr + tl.num_programs(0) + member, team, dw_acc, n_teams, n_cols,
                      cols, col_mask, DW_ROWS, BLOCK_N)  # fmt: skip
    tl.store(SEQ_ptr + pid, seq)


@triton.jit
def _tail_bwd_rowdot_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    C_ptr,  # (n_rows, n_splits) fp32 out: each column range's share of mean(x_hat * w * dy)
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_cols,
    span,  # columns per split, a multiple of BLOCK_N
    BLOCK_N: tl.constexpr,  # a chunk of the row
    NUM_STAGES: tl.constexpr,
):
    """Split backward, pass 1: program (row, k) sums rstd * h * w * dy / N over the k-th span of
    the row's columns. With one split this is the row's c; with several (few rows, so every SM
    gets work) the launcher adds the splits up in a fixed order."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    dy_row, g_row, u_row, r_row = _row_starts(DY_ptr, G_ptr, U_ptr, R_ptr, row, dy_row_stride, g_row_stride,
                                              u_row_stride, r_row_stride)  # fmt: skip
    for offset in tl.range(0, span, BLOCK_N, num_stages=NUM_STAGES):
        cols = split * span + offset + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc += _row_dot_chunk(dy_row, g_row, u_row, r_row, cols, mask, w)
    rstd = tl.load(RSTD_ptr + row)
    tl.store(C_ptr + row * n_splits + split, tl.sum(acc, axis=0) * rstd / n_cols)


@triton.jit
def _tail_bwd_slab_kernel(
    DY_ptr,
    G_ptr,
    U_ptr,
    R_ptr,
    W_ptr,
    RSTD_ptr,
    C_ptr,  # (n_rows, n_splits) fp32 from pass 1; unused when no dh is needed
    DG_ptr,
    DU_ptr,
    DR_ptr,
    DW_ptr,  # (row programs, n_cols) fp32: program (p, s) owns row p's columns of slab s
    dy_row_stride,
    g_row_stride,
    u_row_stride,
    r_row_stride,
    n_rows,
    n_cols,
    n_splits,  # column ranges of pass 1: a row's c is the sum of its n_splits parts
    SPLITS: tl.constexpr,  # n_splits rounded up to a power of two
    BLOCK_N: tl.constexpr,  # columns of one slab
    NUM_STAGES: tl.constexpr,
    COMPUTE_DG: tl.constexpr,
    COMPUTE_DU: tl.constexpr,
    COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    """Split backward, pass 2, for rows too wide for one program: a 2-D grid of (row programs,
    column slabs). Program (p, s) takes rows p, p + P, ... of slab s, with the row's c from
    pass 1, so its slab of dw stays in registers. Moves 11 tensors (pass 1 reads 4) where the
    fused kernel moves 7, but never re-reads a row that L2 may have dropped."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    parts = tl.arange(0, SPLITS)
    NEED_DH: tl.constexpr = COMPUTE_DG or COMPUTE_DU or COMPUTE_DR
    for row in tl.range(pid, n_rows, n_programs, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)
        c = 0.0
        if NEED_DH:  # the parts summed in one fixed order: the same bits every run
            c = tl.sum(tl.load(C_ptr + row64 * n_splits + parts, mask=parts < n_splits, other=0.0), axis=0)
        dy_row, g_row, u_row, r_row = _row_starts(DY_ptr, G_ptr, U_ptr, R_ptr, row64, dy_row_stride,
                                                  g_row_stride, u_row_stride, r_row_stride)  # fmt: skip
        dw_acc += _row_chunk_grads(dy_row, g_row, u_row, r_row, DG_ptr, DU_ptr, DR_ptr, row64 * n_cols, cols,
                                   mask, w, tl.load(RSTD_ptr + row64), c,
                                   COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "")  # fmt: skip
    if COMPUTE_DW:
        tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=mask)


# --------------------------------------------------------------------------------------------
# Launch plans: built on the first call of a signature, then looked up
# --------------------------------------------------------------------------------------------

# Forward plans by (rows, cols, dtype, device); backward plans by (rows, cols,
# dtype, device, gradients asked for). A plan is what the autotuner chose for the shape, bound
# to its grid: a call looks it up and launches.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _stream_hint(cfg: KernelConfig) -> str:
    """The fused kernels' input load hint for this config."""
    return "evict_first" if cfg.l2 == "stream" else ""


def _rows(x: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int]:
    """(x as (rows, n_cols) with contiguous columns, its row stride), copying only if it must.

    Every call pays this for each input: a 2-D tensor with contiguous columns (the usual case,
    and the halves of one matmul output) passes on one stride read.
    """
    strides = x.stride()
    if len(strides) == 2 and strides[1] == 1:
        return x, strides[0]
    if strides and strides[-1] != 1:
        x = x.contiguous()
    try:
        x = x.view(-1, n_cols)
    except RuntimeError:  # leading dims that no single row stride can describe
        x = x.reshape(-1, n_cols)
    return x, x.stride(0)


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor shaped like `t` (torch.empty_like parses its arguments
    in half the time of torch.empty(shape, dtype=, device=): ~1.5 against ~3.3 us a call)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# Where a forward without grad stores rstd: the kernel stores it either way (tail_fused says
# why), and a call that keeps none need not allocate it. One buffer per device, as long as the
# most rows seen (the kernel writes the first n_rows); a buffer outgrown is kept, not freed, so
# that no kernel still queued on another stream writes into memory handed out again.
_RSTD_SCRATCH: dict[torch.device, torch.Tensor] = {}
_RSTD_OUTGROWN: list[torch.Tensor] = []


def _scratch_rstd(n_rows: int, device: torch.device) -> torch.Tensor:
    buf = _RSTD_SCRATCH.get(device)
    if buf is not None and buf.numel() >= n_rows:
        return buf
    if capturing(device):  # memory of the graph's pool: not kept past this capture's calls
        return torch.empty(n_rows, dtype=torch.float32, device=device)
    size = n_rows
    if buf is not None:
        _RSTD_OUTGROWN.append(buf)
        size = max(n_rows, 2 * buf.numel())
    buf = _RSTD_SCRATCH[device] = torch.empty(size, dtype=torch.float32, device=device)
    return buf


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"tail_triton needs CUDA tensors (got {device}); "
            "set TRITON_INTERPRET=1 to run it on CPU tensors through the interpreter"
        )


# Team launches by (kernel, config, shape, compile-time arguments): the autotuner builds a
# candidate's launch once per timed call, and a team launch keeps its grid and scratch.
_TEAM_LAUNCHES = PlanCache(max_size=256)

# Polls of a partner's slot before a row team member gives up and traps (kernels/teams.py): each
# is an L2 round trip (~0.5-1 us), so ~0.5-1 s, against the few us partners take.
ROW_TEAM_PATIENCE = 1 << 20


def _team_launch(kernel, cfg: KernelConfig, kind: str, n_rows: int, n_cols: int, **constants) -> TeamLaunch:
    """The team kernel `kernel` for this shape, made once (see kernels/teams.py)."""
    key = (id(kernel), cfg, n_rows, n_cols, tuple(sorted(constants.items())))
    launch = _TEAM_LAUNCHES.get(key)
    if launch is None:
        members = team_size(n_cols, cfg.block_n)
        lag = 1 if cfg.num_stages > 1 else 0  # two stages: a row's exchange overlaps the next row
        if cfg.pipeline:
            # The staged kernels: a spinning wait in inline assembly, which the interpreter lacks.
            constants.update(STAGES=cfg.pipeline, SPIN=not interpreting())
        # Every team kernel takes `_sigmoid`'s approximate one on a GPU (the interpreter runs no
        # inline assembly): their loops issue more than they wait, the backward's most.
        launch = _TEAM_LAUNCHES.add(key, TeamLaunch(
            kernel, cfg, kind, members, n_rows, MEMBERS=members, SLOTS=slots_for(members),
            BLOCK_N=cfg.block_n, LAG=lag, BUFFERS=buffers_for(lag), APPROX=not interpreting(), **constants,
        ))  # fmt: skip
    return launch


def _row_team_launch(cfg: KernelConfig, n_rows: int, n_cols: int) -> RowTeamLaunch:
    """The forward in teams that form for one row each (kernels/teams.py), made once a shape."""
    key = ("row team", cfg, n_rows, n_cols)
    launch = _TEAM_LAUNCHES.get(key)
    if launch is None:
        members = team_size(n_cols, cfg.block_n)
        launch = _TEAM_LAUNCHES.add(key, RowTeamLaunch(
            _tail_fwd_row_team_kernel, cfg, "fwd", members, n_rows, MEMBERS=members,
            SLOTS=slots_for(members), BLOCK_N=cfg.block_n, SPIN=not interpreting(),
            PATIENCE=ROW_TEAM_PATIENCE, APPROX=not interpreting(), num_warps=cfg.num_warps,
        ))  # fmt: skip
    return launch


def _forward_launch(cfg: KernelConfig, n_rows: int, n_cols: int) -> Launch | TeamLaunch:
    """The forward kernel of `cfg`, bound to its grid for this shape. Runtime arguments:
    (g, u, r, w, y, rstd, g/u/r/y row strides, n_rows, n_cols, eps)."""
    if cfg.kernel == "fused":
        n_tiles = triton.cdiv(n_rows, cfg.block_m)
        grid = (min(cfg.programs, n_tiles) if cfg.programs else n_tiles,)
        return Launch(
            _tail_fwd_kernel, grid, cfg, "fwd",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, IN_EVICT=_stream_hint(cfg),
            BLOCK_N2=cfg.block_n2,
            EVEN=n_cols == cfg.block_n + cfg.block_n2 and n_rows % cfg.block_m == 0, num_warps=cfg.num_warps,
        )  # fmt: skip
    if cfg.kernel == "team" and not cfg.programs:
        return _row_team_launch(cfg, n_rows, n_cols)
    if cfg.kernel == "team":
        kernel = _tail_fwd_team_staged_kernel if cfg.pipeline else _tail_fwd_team_kernel
        return _team_launch(kernel, cfg, "fwd", n_rows, n_cols, num_warps=cfg.num_warps)
    if cfg.kernel == "pipelined":
        return Launch(
            _tail_fwd_pipelined_kernel, (min(cfg.programs, n_rows),), cfg, "fwd",
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
    grid = (min(cfg.programs, n_rows) if cfg.programs else n_rows,)
    return Launch(
        _tail_fwd_chunked_kernel, grid, cfg, "fwd",
        BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, STASH_H=cfg.stash_h,
        IN_EVICT="evict_first" if cfg.stash_h else "", num_warps=cfg.num_warps,
    )  # fmt: skip


def _backward_launch(
    cfg: KernelConfig, programs: int, n_rows: int, n_cols: int, needs: tuple[bool, ...], n_splits: int
) -> Launch | TeamLaunch:
    """The gradient kernel of `cfg` on `programs` row programs (the split path: times the column
    slabs), computing the gradients `needs` asks for. Runtime arguments: (dy, g, u, r, w, rstd,
    [the split path's row dots,] dg, du, dr, dw partials, dy/g/u/r row strides, n_rows, n_cols
    [, n_splits])."""
    need_g, need_u, need_r, need_w = needs
    flags = dict(COMPUTE_DG=need_g, COMPUTE_DU=need_u, COMPUTE_DR=need_r, COMPUTE_DW=need_w)
    kw = dict(BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    if cfg.kernel == "fused":
        return Launch(
            _tail_bwd_kernel, (programs,), cfg, "bwd", BLOCK_M=cfg.block_m, NUM_STAGES=cfg.num_stages,
            IN_EVICT=_stream_hint(cfg), BLOCK_N2=cfg.block_n2, **kw, **flags,
        )  # fmt: skip
    if cfg.kernel == "chunked":
        return Launch(
            _tail_bwd_chunked_kernel, (programs,), cfg, "bwd",
            ROWS=cfg.block_m, NUM_STAGES=cfg.num_stages, **kw, **flags,
        )  # fmt: skip
    if cfg.kernel == "pipelined":
        return Launch(_tail_bwd_pipelined_kernel, (programs,), cfg, "bwd", **kw, **flags)
    if cfg.kernel == "team":
        kernel = _tail_bwd_team_staged_kernel if cfg.pipeline else _tail_bwd_team_kernel
        # The dw sum's tile: 64 fp32 a thread (8 partial rows of a 1024-column share at 4 warps):
        # four L2 round trips for 32 teams, and the kernel's registers stay the row loop's (ptxas,
        # sm_90a: 128 capped, 124 uncapped; a 16-row tile takes 158 uncapped).
        rows = max(1, 64 * 32 * cfg.num_warps // cfg.block_n)
        return _team_launch(
            kernel, cfg, "bwd", n_rows, n_cols, num_warps=cfg.num_warps, DW_ROWS=rows, **flags
        )  # fmt: skip
    return Launch(
        _tail_bwd_slab_kernel, (programs, triton.cdiv(n_cols, cfg.block_n)), cfg, "bwd",
        SPLITS=triton.next_power_of_2(n_splits), NUM_STAGES=cfg.num_stages, **kw, **flags,
    )  # fmt: skip


class _BackwardPlan:
    """The backward for one shape and set of gradients: its launches and buffer sizes, fixed.

    Calling it allocates what the math needs (the gradients asked for, one fp32 dw partial row
    per program, and for the split path each row's dot parts) and launches: the gradient kernel
    (the split path: its row-dot pass first), then the column sum of the dw partials (the team
    kernels sum theirs themselves).
    """

    __slots__ = ("config", "needs", "programs", "main", "rowdot", "span", "n_splits", "col_sum")

    def __init__(self, cfg: KernelConfig, n_rows: int, n_cols: int, needs: tuple[bool, ...]):
        need_g, need_u, need_r, need_w = needs
        self.config = cfg
        self.needs = needs
        # Every program has a tile, so every row of the dw partials gets written.
        self.programs = min(cfg.programs, triton.cdiv(n_rows, cfg.block_m))
        self.rowdot = None
        self.span = self.n_splits = 0
        if cfg.kernel == "split":
            # Each row's columns in `splits` spans of whole chunks (the last may be short).
            self.span = triton.cdiv(triton.cdiv(n_cols, cfg.splits), cfg.block_n) * cfg.block_n
            self.n_splits = triton.cdiv(n_cols, self.span)
            if need_g or need_u or need_r:
                self.rowdot = Launch(
                    _tail_bwd_rowdot_kernel, (n_rows, self.n_splits), cfg, "bwd row dot",
                    BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                )  # fmt: skip
        self.main = _backward_launch(cfg, self.programs, n_rows, n_cols, needs, self.n_splits)
        if cfg.kernel == "team":
            self.programs = 0  # the teams: one dw partial row each, known once the grid is sized
        self.col_sum = col_sum_launch(n_cols) if need_w and cfg.kernel != "team" else None

    def __call__(self, rows, w, rstd, gate) -> tuple[torch.Tensor | None, ...]:
        """Gradients (dgate, dup, dresidual shaped like `gate`, dweight); None where not asked
        for. `rows`: (tensor, row stride) of dy, g, u, r as 2-D (see _rows)."""
        need_g, need_u, need_r, need_w = self.needs
        (dy, dy_stride), (g, g_stride), (u, u_stride), (r, r_stride) = rows
        n_rows, n_cols = g.shape
        dg = _contiguous_like(gate) if need_g else None
        du = _contiguous_like(gate) if need_u else None
        dr = _contiguous_like(gate) if need_r else None
        strides = (dy_stride, g_stride, u_stride, r_stride)
        # Outputs not asked for get any tensor: their COMPUTE_ flag is off, the kernel never touches it.
        dgur = (g if dg is None else dg, g if du is None else du, g if dr is None else dr)
        team = self.config.kernel == "team"
        if team and not self.programs:  # its grid (one compile) gives the dw rows
            partials, sums = (torch.empty(1, dtype=t, device=g.device) for t in (torch.float32, w.dtype))
            args = (dy, g, u, r, w, rstd, *dgur, partials, sums, *strides, n_rows, n_cols)
            self.programs = self.main.prepare(args)
        partial = dw = None
        if need_w:
            partial = torch.empty((self.programs, n_cols), dtype=torch.float32, device=g.device)
            dw = torch.empty_like(w)
        outs = (*dgur, g if partial is None else partial)
        if self.n_splits:
            c = torch.empty((n_rows, self.n_splits), dtype=torch.float32, device=g.device)
            if self.rowdot is not None:
                self.rowdot(dy, g, u, r, w, rstd, c, *strides, n_cols, self.span)
            self.main(dy, g, u, r, w, rstd, c, *outs, *strides, n_rows, n_cols, self.n_splits)
        elif team:  # the team kernels sum their partials into dw themselves
            self.main(dy, g, u, r, w, rstd, *outs, g if dw is None else dw, *strides, n_rows, n_cols)
        else:  # the fused, chunked and pipelined kernels take the same arguments
            self.main(dy, g, u, r, w, rstd, *outs, *strides, n_rows, n_cols)
        if need_w and not team:
            # One reduction over the programs' partials, in a fixed order: the same bits every run.
            self.col_sum(partial, dw, self.programs, n_cols)
        return dg, du, dr, dw


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def tail_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: KernelConfig | None = None,
    keep_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward on (..., N) inputs: y shaped like gate, and the fp32 rstd per row the
    backward needs (shaped gate.shape[:-1]). With `keep_rstd` off (no gradient wanted) the
    kernel still stores rstd (tail_fused says why), into a scratch buffer, and None comes back.

    `config` runs that launch shape; without it the shape's plan runs (tuned on its first call).
    """
    n_cols = gate.shape[-1]
    (g, g_stride), (u, u_stride), (r, r_stride) = (
        _rows(gate, n_cols),
        _rows(up, n_cols),
        _rows(residual, n_cols),
    )
    n_rows = g.shape[0]
    device = gate.device
    y = _contiguous_like(gate)
    if keep_rstd:
        rstd = out_rstd = torch.empty(gate.shape[:-1], dtype=torch.float32, device=device)
    else:  # ~3-4 us less host time a call than the allocation
        rstd, out_rstd = _scratch_rstd(n_rows, device), None
    if n_rows == 0:
        return y, out_rstd
    # y is contiguous: its row stride is n_cols.
    args = (g, u, r, weight.contiguous(), y, rstd, g_stride, u_stride, r_stride, n_cols, n_rows, n_cols, eps)
    if config is not None:
        _forward_launch(config, n_rows, n_cols)(*args)
        return y, out_rstd
    key = (n_rows, n_cols, gate.dtype, device)
    launch = _FWD_PLANS.get(key)
    if launch is None:
        launch = _forward_plan(n_rows, n_cols, gate.dtype, device, args)
        if not capturing(device):  # a plan made inside a graph capture is untuned: not kept
            _FWD_PLANS.add(key, launch)
    launch.run(*args, **launch.meta)  # the bound launch itself: no wrapper frame on the hot path
    return y, out_rstd


def _forward_plan(n_rows, n_cols, dtype, device, args) -> Launch:
    """The forward's launch for a new signature: the tuned config (timed now if its tuning key
    is new), bound to this shape's grid."""
    _check_runnable(device)
    candidates = C.forward_candidates(n_rows, n_cols, dtype, sm_count(device))
    key = ("fwd", C.pow2_rows(n_rows), n_cols, dtype)

    def run(c: KernelConfig) -> tuple[torch.Tensor, ...]:
        _forward_launch(c, n_rows, n_cols)(*args)
        return args[4:6]  # y and rstd: the tuner compares them

    return _forward_launch(TUNER.pick(key, candidates, run, device), n_rows, n_cols)


def tail_backward(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    needs: tuple[bool, bool, bool, bool],
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients (dgate, dup, dresidual, dweight); None where `needs` says no (and no work).

    `config` runs that launch shape; without it the shape's plan runs (tuned on its first call).
    """
    n_cols = gate.shape[-1]
    rows = (_rows(grad_out, n_cols), _rows(gate, n_cols), _rows(up, n_cols), _rows(residual, n_cols))
    n_rows = rows[1][0].shape[0]
    if n_rows == 0 or not any(needs):
        grads = (_contiguous_like(gate) if n else None for n in needs[:3])
        return (*grads, torch.zeros_like(weight) if needs[3] else None)
    w = weight.contiguous()
    if config is not None:
        if config.kernel == "team" and not config.programs:
            raise ValueError("row teams (a team config with programs 0) are forward only")
        return _BackwardPlan(config, n_rows, n_cols, needs)(rows, w, rstd, gate)
    key = (n_rows, n_cols, gate.dtype, gate.device, needs)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        plan = _backward_plan(rows, w, rstd, gate, needs)
        if not capturing(gate.device):  # a plan made inside a graph capture is untuned: not kept
            _BWD_PLANS.add(key, plan)
    return plan(rows, w, rstd, gate)


def _backward_plan(rows, w, rstd, gate, needs) -> _BackwardPlan:
    """The backward's plan for a new signature: the tuned config (timed now if its tuning key
    is new; each candidate's run includes its dw column sum, and returns the gradients the tuner
    compares), for this shape and `needs`."""
    device = gate.device
    _check_runnable(device)
    n_rows, n_cols = rows[1][0].shape
    candidates = C.backward_candidates(n_rows, n_cols, gate.dtype, sm_count(device))
    key = ("bwd", C.pow2_rows(n_rows), n_cols, gate.dtype, needs)
    run = lambda c: _BackwardPlan(c, n_rows, n_cols, needs)(rows, w, rstd, gate)
    return _BackwardPlan(TUNER.pick(key, candidates, run, device), n_rows, n_cols, needs)


ALL_GRADS = (True, True, True, True)


def chosen_configs(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The configs that ran (or would run) for this shape: the autotuner's pick, else the
    heuristic's favourite. The backward's is the one for all four gradients."""
    fwd_key = ("fwd", C.pow2_rows(n_rows), n_cols, dtype)
    bwd_key = ("bwd", C.pow2_rows(n_rows), n_cols, dtype, ALL_GRADS)
    sms = sm_count(device)
    fwd = TUNER.chosen.get(fwd_key) or C.forward_config(n_rows, n_cols, dtype, sms)
    bwd = TUNER.chosen.get(bwd_key) or C.backward_config(n_rows, n_cols, dtype, sms)
    return {
        "forward": {**fwd.to_dict(), "autotuned": fwd_key in TUNER.chosen},
        "backward": {**bwd.to_dict(), "autotuned": bwd_key in TUNER.chosen},
    }


# --------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile: no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("profuse::tail_fwd", mutates_args=())
def tail_fwd_op(
    gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return tail_forward(gate, up, residual, weight, eps)


@tail_fwd_op.register_fake
def _(gate, up, residual, weight, eps):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("profuse::tail_bwd", mutates_args=())
def tail_bwd_op(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_gate: bool,
    need_up: bool,
    need_residual: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = tail_backward(
        grad_out, gate, up, residual, weight, rstd, (need_gate, need_up, need_residual, need_weight)
    )
    # A custom op returns tensors only: an empty one stands for "not asked for".
    return tuple(gate.new_empty(0) if t is None else t for t in grads)


@tail_bwd_op.register_fake
def _(grad_out, gate, up, residual, weight, rstd, need_gate, need_up, need_residual, need_weight):
    def like(t: torch.Tensor, flag: bool) -> torch.Tensor:
        return t.new_empty(t.shape) if flag else gate.new_empty(0)

    return like(gate, need_gate), like(up, need_up), like(residual, need_residual), like(weight, need_weight)


class TailFunction(torch.autograd.Function):
    """Saves the inputs and one fp32 rstd per row; the backward recomputes everything else.

    Eager calls go to the launchers directly; only a traced call (torch.compile) goes through
    the custom ops, whose dispatch costs ~10-20 us of host time a call. Double backward
    (create_graph=True) is refused in one line (kernels/rows.py, double_backward_error).
    """

    @staticmethod
    def forward(ctx, gate, up, residual, weight, eps):
        if torch.compiler.is_compiling():
            y, rstd = torch.ops.profuse.tail_fwd(gate, up, residual, weight, eps)
        else:
            y, rstd = tail_forward(gate, up, residual, weight, eps)
        ctx.save_for_backward(gate, up, residual, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, residual, weight, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        if torch.compiler.is_compiling():
            grads = torch.ops.profuse.tail_bwd(grad_out, gate, up, residual, weight, rstd, *needs)
            return (*(g if need else None for g, need in zip(grads, needs)), None)
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
            raise double_backward_error("tail_triton", "profuse.tail_eager")
        return (*tail_backward(grad_out, gate, up, residual, weight, rstd, needs), None)


def tail_fused(gate, up, residual, weight, eps: float) -> torch.Tensor:
    """The op on checked inputs: through autograd where a gradient is wanted, else the forward
    launch alone (no autograd node). That launch still stores rstd, into a scratch buffer:
    without the store the forward at 32768 x 4096 ran 0.6-1.1% slower on the H200 (252.3-252.9
    against 250.1-251.0 us, same config, four same-day runs over two sessions), for 4 bytes a
    row saved."""
    if torch.is_grad_enabled() and (
        gate.requires_grad or up.requires_grad or residual.requires_grad or weight.requires_grad
    ):
        return TailFunction.apply(gate, up, residual, weight, eps)
    if torch.compiler.is_compiling():
        return torch.ops.profuse.tail_fwd(gate, up, residual, weight, eps)[0]
    return tail_forward(gate, up, residual, weight, eps, keep_rstd=False)[0]
