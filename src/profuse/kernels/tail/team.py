"""The tail's team kernels (KernelConfig.kernel "team"): a row too wide for one program is
shared by a team of co-resident programs, each holding its share of the row in registers, that
swap partial sums through global memory (kernels/teams.py: slots, publish, gather). Each input is
read once, as in the whole-row kernels.

On a persistent grid (forward and backward; the staged kernels load the next rows through
Triton's software pipeliner into shared memory while a team waits), or, forward only, as row
teams: a team a row on a grid of one program per share. The backward's teams sum their dw
partials themselves, the last team to finish a column block adding that block up
(kernels/colsum.sum_when_last), so no column-sum launch follows. On a GPU the kernels take
`_sigmoid`'s approximate sigmoid (inline assembly; the interpreter runs tl.sigmoid). The shapes
and the measurements behind them are in kernels/configs.py (FWD_TEAM_SHARES, BWD_TEAM_SHARES).
"""

from __future__ import annotations

import triton
import triton.language as tl

from profuse.kernels.colsum import sum_when_last
from profuse.kernels.tail.fused import store_input_grads
from profuse.kernels.teams import gather, publish


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
def tail_fwd_team_kernel(
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
def tail_fwd_team_staged_kernel(
    G_ptr, U_ptr, R_ptr, W_ptr, Y_ptr, RSTD_ptr, g_row_stride, u_row_stride, r_row_stride, y_row_stride,
    n_rows, n_cols, eps, SLOT_ptr, SEQ_ptr,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, LAG: tl.constexpr,
    BUFFERS: tl.constexpr,
    STAGES: tl.constexpr,  # tl.range's num_stages: rows STAGES - 1 ahead load into shared memory
    SPIN: tl.constexpr,  # wait in inline assembly (a GPU); the interpreter takes `gather`'s loop
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):  # fmt: skip
    """The team forward (arguments as `tail_fwd_team_kernel`'s) with its row loop left to
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
def tail_fwd_row_team_kernel(
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
    store_input_grads(DG_ptr, DU_ptr, DR_ptr, row * n_cols + cols, mask, dh, gf, u.to(tl.float32), s, gf * s,
                       COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "evict_first")  # fmt: skip


@triton.jit
def tail_bwd_team_kernel(
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
    NEED_DH: tl.constexpr = (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR
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
def tail_bwd_team_staged_kernel(
    DY_ptr, G_ptr, U_ptr, R_ptr, W_ptr, RSTD_ptr, DG_ptr, DU_ptr, DR_ptr, DW_ptr, DWSUM_ptr,
    dy_row_stride, g_row_stride, u_row_stride, r_row_stride, n_rows, n_cols, SLOT_ptr, SEQ_ptr,
    MEMBERS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, LAG: tl.constexpr,
    BUFFERS: tl.constexpr, COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr, COMPUTE_DR: tl.constexpr,
    COMPUTE_DW: tl.constexpr, DW_ROWS: tl.constexpr,
    STAGES: tl.constexpr,  # tl.range's num_stages: rows STAGES - 1 ahead load into shared memory
    SPIN: tl.constexpr,  # wait in inline assembly (a GPU); the interpreter takes `gather`'s loop
    APPROX: tl.constexpr,  # a GPU: `_sigmoid`'s approximate one
):  # fmt: skip
    """The team backward (arguments as `tail_bwd_team_kernel`'s) with its row loop left to
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
    NEED_DH: tl.constexpr = (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR
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
