"""The tail's two-pass kernels, for rows too wide for one program's registers: KernelConfig.kernel
"chunked", "pipelined" and "split". The fallback: in the H200 grids since the team kernels
(2026-12-03 and 2026-12-04) the tuner picked whole-row (kernels/tail/fused.py) and team
(kernels/tail/team.py) kernels at every shape but one, the forward at 381 x 11008 bf16 (few
rows: the chunked kernel with h kept in y, 15.5 us, the same 15.5 us as with teams off). These
kernels run with PROFUSE_TEAMS=0, where no team is offered, and where no whole-row kernel fits
(fp32 rows wider than configs.FWD_MAX_FUSED forward, BWD_MAX_FUSED backward).

Pass 1 streams a row's chunks to get the row's sum, pass 2 walks the chunks again in reverse
order, so the chunks read last (still in L2) are read first; a persistent grid keeps few rows in
flight so they stay in L2. The chunked forward may keep h in y between the passes (one tensor
re-read instead of three). The pipelined kernels run pass 1 of a program's next row in the same
chunk loop as pass 2 of its current row, so the DRAM is read all the time. The split backward
takes a row-dot pass (each row's sum, in column ranges when rows are few), then a grid of (row
programs x column slabs) that holds its slab of dw in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from profuse.kernels.tail.fused import store_input_grads


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
def tail_fwd_chunked_kernel(
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
def tail_fwd_pipelined_kernel(
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
    if (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR:
        dh = (w * dy - x_hat * c) * rstd
        store_input_grads(DG_ptr, DU_ptr, DR_ptr, out_row + cols, mask, dh, g, u, s, silu,
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
def tail_bwd_chunked_kernel(
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
    NEED_DH: tl.constexpr = (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR
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
def tail_bwd_pipelined_kernel(
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
    NEED_DH: tl.constexpr = (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR
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
def tail_bwd_rowdot_kernel(
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
def tail_bwd_slab_kernel(
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
    NEED_DH: tl.constexpr = (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR
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
