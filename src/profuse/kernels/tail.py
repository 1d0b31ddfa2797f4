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
partials are summed in one fixed order (_col_sum_kernel): no atomics, so gradients are bitwise
repeatable.

Rows wider than a program can hold in registers take a chunked path: pass 1 streams the row's
chunks to get the row's sum, pass 2 walks the chunks again in reverse order, so the chunks read
last (still in L2) are read first; a persistent grid keeps few rows in flight so they stay in
L2. The forward may keep h in y between the passes (one tensor re-read instead of three). The
pipelined kernels run pass 1 of a program's next row in the same chunk loop as pass 2 of its
current row, so the DRAM is read all the time. The backward can also split: a row-dot pass
(each row's sum, in column ranges when rows are few), then a grid of (row programs x column
slabs) that holds its slab of dw in registers. Which path and launch shape runs is chosen per
shape by timing the candidates (see _pick).

Layout: the @triton.jit kernels, their launchers (flatten to 2-D, allocate, pick a config,
launch), the custom ops (so torch.compile calls them without a graph break), the
autograd.Function, and `tail_triton`.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl

from profuse.env import sm_count

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
    STORE_RSTD: tl.constexpr,
    IN_EVICT: tl.constexpr,  # the inputs' L2 eviction hint: "evict_first" (read once) or ""
    EVEN: tl.constexpr,  # n_cols == BLOCK_N and BLOCK_M divides n_rows: every mask is all-true
):
    """Tiles of BLOCK_M whole rows: y = h * rstd * w, h = silu(g) * u + r.

    Program p takes tiles p, p + P, ...: one tile each when the grid covers every tile, or a
    persistent loop that loads the next tile while it reduces this one. With EVEN the masks are
    constants the compiler drops, as Inductor's kernel for a static width has none.
    """
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    if EVEN:
        col_mask = tl.full([BLOCK_N], 1, tl.int1)
    else:
        col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        if EVEN:
            row_mask = tl.full([BLOCK_M], 1, tl.int1)
        else:
            row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        c2 = cols[None, :]
        # Each input is read once: the L2 may drop it first (the weight stays).
        g = tl.load(G_ptr + rows[:, None] * g_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        u = tl.load(U_ptr + rows[:, None] * u_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        r = tl.load(R_ptr + rows[:, None] * r_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        h = g * tl.sigmoid(g) * u + r  # masked columns give h = 0 and leave the sum alone
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        y = h * rstd[:, None] * w[None, :]
        tl.store(Y_ptr + rows[:, None] * y_row_stride + c2, y.to(Y_ptr.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD_ptr + rows, rstd, mask=row_mask)


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
    STORE_RSTD: tl.constexpr,
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
        if STORE_RSTD:
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
    STORE_RSTD: tl.constexpr,
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
        if STORE_RSTD:
            tl.store(RSTD_ptr + row, rstd)
        row = nxt64
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for k in range(0, n_chunks):
        cols = k * BLOCK_N + tl.arange(0, BLOCK_N)
        _finish_chunk(Y_ptr + row * y_row_stride, W_ptr, cols, cols < n_cols, rstd)
    if STORE_RSTD:
        tl.store(RSTD_ptr + row, rstd)


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
):
    """Persistent grid: program p takes row tiles p, p + P, ... and, per row,

    x_hat = (silu(g) * u + r) * rstd          (recomputed; s = sigmoid(g), silu = g * s)
    dh    = rstd * (w * dy - x_hat * mean(x_hat * w * dy))
    dr    = dh,   du = dh * silu,   dg = dh * u * s * (1 + g * (1 - s))
    dw   += dy * x_hat                          (fp32, this program's rows only)
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        c2 = cols[None, :]
        dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + c2, mask=mask, other=0.0,
                     eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        g = tl.load(G_ptr + rows[:, None] * g_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        u = tl.load(U_ptr + rows[:, None] * u_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        r = tl.load(R_ptr + rows[:, None] * r_row_stride + c2, mask=mask, other=0.0,
                    eviction_policy=IN_EVICT).to(tl.float32)  # fmt: skip
        rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)
        s = tl.sigmoid(g)
        silu = g * s
        x_hat = (silu * u + r) * rstd[:, None]
        if COMPUTE_DW:
            dw_acc += dy * x_hat
        if COMPUTE_DG or COMPUTE_DU or COMPUTE_DR:
            wdy = w[None, :] * dy
            c = tl.sum(x_hat * wdy, axis=1) / n_cols
            dh = (wdy - x_hat * c[:, None]) * rstd[:, None]
            out = rows[:, None] * n_cols + c2
            _store_input_grads(DG_ptr, DU_ptr, DR_ptr, out, mask, dh, g, u, s, silu,
                               COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "")  # fmt: skip
    if COMPUTE_DW:
        tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


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


@triton.jit
def _col_sum_kernel(
    P_ptr,  # (n_parts, n_cols) fp32, contiguous
    OUT_ptr,  # (n_cols,) in the weight's dtype
    n_parts,
    n_cols,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dw = the sum of the programs' fp32 partial rows, in one fixed order (the same bits every
    run), rounded once. Narrow column blocks give every SM work: torch's sum over dim 0 ran
    132 x 16384 partials on 4 warps per SM (9.6 us for 8.6 MB on the H200)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        acc += tl.load(P_ptr + parts[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT_ptr + cols, tl.sum(acc, axis=0).to(OUT_ptr.dtype.element_ty), mask=col_mask)


def _sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n_parts, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    grid = (triton.cdiv(n_cols, 64),)  # 256 programs at 16384 columns
    _col_sum_kernel[grid](partial, out, n_parts, n_cols, BLOCK_P=32, BLOCK_N=64)
    return out


# --------------------------------------------------------------------------------------------
# Configurations: measured heuristics per shape and dtype
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """How one launch is shaped. Recorded with every result, so a timing names its config."""

    # "fused" (whole rows in registers), "chunked" (rows in chunks, two passes each),
    # "pipelined" (chunked, with pass 1 of a program's next row overlapping pass 2 of its
    # current one) or "split" (backward: a row-dot pass, then the gradients in column slabs)
    kernel: str
    block_m: int  # rows per tile (fused; chunked backward: 1 or 2); 1 for the others
    block_n: int  # whole row (fused), chunk (chunked, pipelined) or slab (split): a power of two
    num_warps: int
    num_stages: int = 1  # pipelining depth of the tile loop of a persistent program
    programs: int = 0  # persistent grid size; 0 = one program per tile (forward only)
    splits: int = 1  # split backward: programs per row in its row-dot pass (when rows are few)
    # The fused kernels' hint on their read-once inputs: "stream" marks them evict_first in L2,
    # "plain" gives none (the chunked and split kernels take no choice).
    l2: str = "stream"
    # Chunked forward: h kept in y between the passes (STASH_H) instead of re-reading g, u, r.
    stash_h: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


# Widest row (elements) held whole in registers; wider rows take the chunked kernels.
FWD_MAX_FUSED = 32768
BWD_MAX_FUSED = 16384


def _pow2_rows(n_rows: int) -> int:
    return triton.next_power_of_2(max(n_rows, 1))


def forward_candidates(n_rows: int, n_cols: int, dtype: torch.dtype, n_sms: int = 132) -> list[KernelConfig]:
    """Launch shapes worth trying for the forward, the heuristic's favourite first."""
    bn = triton.next_power_of_2(n_cols)
    out = []
    if bn <= FWD_MAX_FUSED:
        # Narrow rows: several rows per tile, so a program moves at least ~4K elements.
        for bm in (1, 2, 4, 8, 16):
            tile = bm * bn
            if bm > _pow2_rows(n_rows) or tile > max(bn, 8192) or (bm > 1 and tile < 2048):
                continue
            # 8 to 32 elements per thread: one or more 16-byte loads per input, no spills.
            for w in (1, 2, 4, 8, 16, 32):
                if 8 <= tile // (32 * w) <= 32:
                    out.append(KernelConfig("fused", bm, bn, w))
        if not out:  # few, narrow rows: whatever fits, a warp or more
            bm = min(_pow2_rows(n_rows), max(1, 4096 // bn))
            out.append(KernelConfig("fused", bm, bn, max(1, min(32, bm * bn // 512))))
        # favourite: ~16 elements per thread, the smallest tile that has >= 4K elements
        out.sort(key=lambda c: (abs(c.block_m * c.block_n // (32 * c.num_warps) - 16),
                                abs(c.block_m * c.block_n - max(bn, 4096))))  # fmt: skip
        # Persistent versions of the two favourites: fewer, longer programs that load the next
        # tile while they reduce this one.
        for c in out[:2]:
            per_sm = max(1, 2048 // (32 * c.num_warps) // 2)
            programs = n_sms * per_sm
            if programs < triton.cdiv(n_rows, c.block_m):
                out += [replace(c, num_stages=st, programs=programs) for st in (2, 3)]
    # The same launches without the evict_first hint on the inputs: at 131072 x 1024 (bf16) the
    # hint cost 4% (262 against 250 us, 97% against 101% of copy).
    out += [replace(c, l2="plain") for c in out]
    if bn >= 16384:
        # One program per row, or a persistent grid of 1-2 per SM whose rows stay in L2
        # between the two passes; at 64K columns 132 rows in flight (52 MB) crowd the L2, so
        # also fewer programs. A persistent program must keep enough bytes in flight by itself:
        # big chunks at 32 warps, or 2-3 stages (the next chunks' loads issued early, through
        # shared memory).
        for chunk, w, per_sm, st in (
            (16384, 32, 1, 1), (16384, 32, 0.75, 1), (8192, 32, 1, 1), (4096, 16, 1, 2),
            (4096, 16, 1, 3), (4096, 8, 2, 2), (4096, 8, 0, 1),
        ):  # fmt: skip
            if chunk <= bn:
                out.append(KernelConfig("chunked", 1, chunk, w, st, int(n_sms * per_sm)))
        if dtype != torch.float16:
            # h kept in y between the passes: pass 2 re-reads one tensor from L2 instead of
            # three (512 x 65536 bf16: 108.6 -> 90.4 us). Not in fp16: an h beyond 65504 would
            # be stored as inf where y is finite (bf16 has fp32's range).
            out += [replace(c, stash_h=True) for c in out if c.kernel == "chunked"]
            # The same, with pass 2 of each row overlapped with pass 1 of the next (87.0 us).
            for chunk, w, per_sm in ((16384, 32, 1), (8192, 32, 1), (8192, 16, 2)):
                out.append(KernelConfig("pipelined", 1, chunk, w, 1, n_sms * per_sm, l2="plain"))
    if FWD_MAX_FUSED < bn <= 2 * FWD_MAX_FUSED and torch.finfo(dtype).bits <= 16:
        # 16-bit rows up to 64K: 32 warps hold h (64 fp32 values per thread) once g, u, r are
        # folded into it; worth a try against the two-pass chunked kernel.
        out.append(KernelConfig("fused", 1, bn, 32))
    return out


def backward_candidates(n_rows: int, n_cols: int, dtype: torch.dtype, n_sms: int) -> list[KernelConfig]:
    """Launch shapes worth trying for the backward, the heuristic's favourite first."""
    bn = triton.next_power_of_2(n_cols)
    out = []
    if bn <= BWD_MAX_FUSED:
        shapes = []  # (rows per tile, warps)
        for bm in (1, 2, 4, 8):
            tile = bm * bn
            if bm > _pow2_rows(n_rows) or tile > max(bn, 2048) or (bm > 1 and tile < 1024):
                continue
            # ~8 live fp32 values per element: 4 to 16 elements per thread keep them in registers.
            shapes += [(bm, w) for w in (4, 8, 16, 32) if 4 <= tile // (32 * w) <= 16]
        # favourites: ~8 elements per thread, tiles of ~2K elements
        shapes.sort(key=lambda s: (abs(s[0] * bn // (32 * s[1]) - 8), abs(s[0] * bn - max(bn, 2048))))
        for bm, w in shapes[:3]:
            n_tiles = triton.cdiv(n_rows, bm)
            # Persistent grid: about 1024 resident threads per SM (at ~64 registers each, what
            # the register file holds), the row loop pipelined (the next tile's loads issued
            # early) or not; or half the programs with 2-3 tiles in flight each, which gives
            # each thread twice the registers for the prefetched tiles.
            base = max(1, 1024 // (32 * w))
            half = max(1, base // 2)
            for stages, per_sm in ((2, base), (1, base), (2, half), (3, half)):
                programs = max(1, min(n_tiles, n_sms * per_sm))
                cfg = KernelConfig("fused", bm, bn, w, stages, programs, l2="plain")
                if cfg not in out:
                    out.append(cfg)
        if not out:  # few, narrow rows
            bm = min(_pow2_rows(n_rows), max(1, 2048 // bn))
            warps = max(1, min(32, bm * bn // 256))
            out.append(KernelConfig("fused", bm, bn, warps, 1, triton.cdiv(n_rows, bm), l2="plain"))
    if bn >= 8192:
        # Persistent, one row in flight per program: pass 2 re-reads the row from L2. Fewer
        # programs keep wide rows (4 inputs x 128 KB each at 64K bf16) inside the L2.
        # 2-3 stages keep the next chunks' loads in flight (through shared memory); 1024-column
        # chunks waste no lanes on widths such as 5120.
        # A persistent program must keep enough bytes in flight by itself: big chunks at 32
        # warps, or 2-3 stages (the next chunks' loads issued early, through shared memory).
        for chunk, w, per_sm, st in (
            (8192, 32, 1, 1), (16384, 32, 1, 1), (16384, 32, 0.5, 1), (8192, 32, 0.75, 1),
            (4096, 16, 1, 1), (2048, 8, 2, 1), (4096, 16, 1, 2), (1024, 4, 4, 2), (8192, 32, 0.5, 2),
        ):  # fmt: skip
            if chunk <= bn:
                programs = max(1, min(n_rows, int(n_sms * per_sm)))
                out.append(KernelConfig("chunked", 1, chunk, w, st, programs))
        # Two rows per program share each chunk of w and of the dw partial: ~8 instead of 14
        # bytes of L2 traffic per element for those two (the L2 was 74% busy, ncu), at the
        # same 8 elements per thread.
        for chunk, w, per_sm in ((2048, 16, 1), (1024, 8, 2), (4096, 32, 1)):
            programs = max(1, min(triton.cdiv(n_rows, 2), n_sms * per_sm))
            out.append(KernelConfig("chunked", 2, chunk, w, 1, programs))
        # Pass 1 of each program's next row overlapped with pass 2 of its current one.
        for chunk, w, per_sm in ((4096, 32, 1), (2048, 8, 2)):
            programs = max(1, min(n_rows, n_sms * per_sm))
            out.append(KernelConfig("pipelined", 1, chunk, w, 1, programs, l2="plain"))
        # Split: a row-dot pass, then (row programs x column slabs) with dw in registers.
        for slab, w, per_sm in ((2048, 8, 2), (4096, 16, 1)):
            n_slabs = triton.cdiv(n_cols, slab)
            programs = max(1, min(n_rows, triton.cdiv(n_sms * per_sm, n_slabs)))
            out.append(KernelConfig("split", 1, slab, w, 2, programs, l2="plain"))
        if n_rows < 4 * n_sms:
            # Few rows: one row-dot program per row would leave most SMs idle while each walks
            # a whole wide row; split every row's dot into column ranges (~4 programs per SM).
            splits = min(triton.next_power_of_2(triton.cdiv(4 * n_sms, n_rows)), triton.cdiv(n_cols, 2048))
            if splits > 1:
                # The slab pass with ~2 or ~8 programs per SM: more programs walk fewer rows each
                # but leave more dw partial rows to sum.
                n_slabs = triton.cdiv(n_cols, 2048)
                for per_sm in (2, 8):
                    programs = max(1, min(n_rows, triton.cdiv(per_sm * n_sms, n_slabs)))
                    cfg = KernelConfig("split", 1, 2048, 8, 2, programs, splits, l2="plain")
                    if cfg not in out:
                        out.append(cfg)
    if BWD_MAX_FUSED < bn <= 2 * BWD_MAX_FUSED and torch.finfo(dtype).bits <= 16:
        # 32K 16-bit columns: 32 elements per thread at 32 warps, if the compiler keeps the live
        # values (x_hat, w * dy, g, u) in registers.
        out.append(KernelConfig("fused", 1, bn, 32, 1, max(1, min(n_rows, n_sms)), l2="plain"))
    return out


def forward_config(n_rows: int, n_cols: int, dtype: torch.dtype, n_sms: int = 132) -> KernelConfig:
    """The heuristic's choice (what runs when autotuning is off, and in the interpreter)."""
    return forward_candidates(n_rows, n_cols, dtype, n_sms)[0]


def backward_config(n_rows: int, n_cols: int, dtype: torch.dtype, n_sms: int) -> KernelConfig:
    return backward_candidates(n_rows, n_cols, dtype, n_sms)[0]


# Autotuning: on CUDA, the first call of each (kernel, rows rounded up to a power of two, cols,
# dtype) times every candidate (time_configs) and keeps the fastest; later calls reuse it. A
# benchmark's warm-up makes that first call, so tuning never lands in a timing.
# PROFUSE_AUTOTUNE=0 turns it off (the heuristic's favourite runs).
AUTOTUNE_TRIALS = 15
_TUNED: dict[tuple, KernelConfig] = {}


# Set to a list to record (kernel, config, registers, spills) of each launch (benchmarks do).
LAUNCH_LOG: list | None = None


def _log_launch(kind: str, cfg: KernelConfig, compiled) -> None:
    if LAUNCH_LOG is not None:
        regs = getattr(compiled, "n_regs", None)
        spills = getattr(compiled, "n_spills", None)
        LAUNCH_LOG.append((kind, cfg, regs, spills))


def autotune_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("PROFUSE_AUTOTUNE", "1") != "0"


def tuned_configs() -> dict[str, dict]:
    """Every config chosen so far in this process, for the results file."""
    return {"/".join(map(str, k)): v.to_dict() for k, v in _TUNED.items()}


ALL_GRADS = (True, True, True, True)


def chosen_configs(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The configs that ran (or would run) for this shape: the autotuner's pick, else the
    heuristic's favourite. The backward's is the one for all four gradients."""
    fwd_key = ("fwd", _pow2_rows(n_rows), n_cols, dtype)
    bwd_key = ("bwd", _pow2_rows(n_rows), n_cols, dtype, ALL_GRADS)
    sms = sm_count(device)
    fwd = _TUNED.get(fwd_key) or forward_config(n_rows, n_cols, dtype, sms)
    bwd = _TUNED.get(bwd_key) or backward_config(n_rows, n_cols, dtype, sms)
    return {
        "forward": {**fwd.to_dict(), "autotuned": fwd_key in _TUNED},
        "backward": {**bwd.to_dict(), "autotuned": bwd_key in _TUNED},
    }


def time_configs(launch, configs: list[KernelConfig], device: torch.device, trials: int) -> list[float]:
    """Median device seconds of `launch(cfg)` per config, L2 flushed before each call.

    The configs take turns within each trial, so a drift in clocks or temperature touches them
    all alike; each trial is queued behind a GPU sleep (bench.timing.CudaTimer), so the time is
    the device's alone. do_bench would count the host's time to launch instead wherever that
    is longer than the kernel (few rows: the backward's several launches take ~50 us of host
    time, the kernels ~20 us), and rank the configs by their launch overhead.
    """
    from profuse.bench.timing import CudaTimer

    timer = CudaTimer(device)
    calls = [lambda c=cfg: launch(c) for cfg in configs]
    runs = [timer.time_calls(calls) for _ in range(trials)]
    return [statistics.median(run[i] for run in runs) for i in range(len(configs))]


def _pick(key: tuple, candidates: list[KernelConfig], launch, device: torch.device) -> KernelConfig:
    if key in _TUNED:
        return _TUNED[key]
    if len(candidates) == 1 or not autotune_enabled(device):
        return candidates[0]
    runnable = []
    for cfg in candidates:
        try:
            launch(cfg)  # builds the kernel outside the timing
            runnable.append(cfg)
        except Exception:  # e.g. out of resources: that shape is not a candidate here
            continue
    if not runnable:
        raise RuntimeError(f"no launch config of the Triton tail kernel runs for {key}")
    times = time_configs(launch, runnable, device, AUTOTUNE_TRIALS)
    _TUNED[key] = runnable[times.index(min(times))]
    return _TUNED[key]


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _stream_hint(cfg: KernelConfig) -> str:
    """The fused kernels' input load hint for this config."""
    return "evict_first" if cfg.l2 == "stream" else ""


def _as_rows(x: torch.Tensor, n_cols: int) -> torch.Tensor:
    """x as (rows, n_cols) with contiguous columns and one row stride, copying only if it must."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n_cols)
    except RuntimeError:  # leading dims that no single row stride can describe
        return x.reshape(-1, n_cols)


def _check_runnable(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"tail_triton needs CUDA tensors (got {t.device}); "
            "set TRITON_INTERPRET=1 to run it on CPU tensors through the interpreter"
        )


def tail_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on (..., N) inputs; returns y shaped like gate and fp32 rstd per row."""
    n_cols = gate.shape[-1]
    g, u, r = (_as_rows(t, n_cols) for t in (gate, up, residual))
    n_rows = g.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=gate.device)
    if n_rows == 0:
        return y.view(gate.shape), rstd.view(gate.shape[:-1])
    w = weight.contiguous()
    args = (g, u, r, w, y, rstd, g.stride(0), u.stride(0), r.stride(0), y.stride(0), n_rows, n_cols, eps)

    def launch(cfg: KernelConfig) -> None:
        if cfg.kernel == "fused":
            n_tiles = triton.cdiv(n_rows, cfg.block_m)
            grid = (min(cfg.programs, n_tiles) if cfg.programs else n_tiles,)
            k = _tail_fwd_kernel[grid](
                *args,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                NUM_STAGES=cfg.num_stages,
                STORE_RSTD=True,
                IN_EVICT=_stream_hint(cfg),
                EVEN=n_cols == cfg.block_n and n_rows % cfg.block_m == 0,
                num_warps=cfg.num_warps,
            )
        elif cfg.kernel == "pipelined":
            k = _tail_fwd_pipelined_kernel[(min(cfg.programs, n_rows),)](
                *args, BLOCK_N=cfg.block_n, STORE_RSTD=True, num_warps=cfg.num_warps
            )
        else:
            grid = (min(cfg.programs, n_rows) if cfg.programs else n_rows,)
            k = _tail_fwd_chunked_kernel[grid](
                *args,
                BLOCK_N=cfg.block_n,
                NUM_STAGES=cfg.num_stages,
                STORE_RSTD=True,
                STASH_H=cfg.stash_h,
                IN_EVICT="evict_first" if cfg.stash_h else "",
                num_warps=cfg.num_warps,
            )
        _log_launch("fwd", cfg, k)

    if config is None:
        key = ("fwd", _pow2_rows(n_rows), n_cols, gate.dtype)
        cands = forward_candidates(n_rows, n_cols, gate.dtype, sm_count(gate.device))
        config = _pick(key, cands, launch, gate.device)
    launch(config)
    return y.view(gate.shape), rstd.view(gate.shape[:-1])


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
    """Gradients (dgate, dup, dresidual, dweight); None where `needs` says no (and no work)."""
    need_g, need_u, need_r, need_w = needs
    n_cols = gate.shape[-1]
    dy, g, u, r = (_as_rows(t, n_cols) for t in (grad_out, gate, up, residual))
    n_rows = g.shape[0]
    dev = gate.device

    def out(flag: bool) -> torch.Tensor | None:
        return torch.empty((n_rows, n_cols), dtype=gate.dtype, device=dev) if flag else None

    dg, du, dr = out(need_g), out(need_u), out(need_r)
    if n_rows == 0 or not any(needs):
        dw = torch.zeros_like(weight) if need_w else None
        return tuple(t if t is None else t.view(gate.shape) for t in (dg, du, dr)) + (dw,)
    placeholder = g  # any tensor: an output pointer the kernel never touches
    w = weight.contiguous()
    flags = dict(COMPUTE_DG=need_g, COMPUTE_DU=need_u, COMPUTE_DR=need_r, COMPUTE_DW=need_w)

    def launch(cfg: KernelConfig) -> torch.Tensor | None:
        """Runs the config; returns dw (the partials summed: a part of each config's cost)."""
        # Every program has a tile, so every row of the dw partials gets written.
        programs = min(cfg.programs, triton.cdiv(n_rows, cfg.block_m))
        partial = torch.empty((programs, n_cols), dtype=torch.float32, device=dev) if need_w else None
        args = (
            dy, g, u, r, w, rstd.reshape(-1),
            dg if need_g else placeholder, du if need_u else placeholder, dr if need_r else placeholder,
            partial if need_w else placeholder, dy.stride(0), g.stride(0), u.stride(0), r.stride(0),
            n_rows, n_cols,
        )  # fmt: skip
        if cfg.kernel == "fused":
            k = _tail_bwd_kernel[(programs,)](
                *args,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                NUM_STAGES=cfg.num_stages,
                IN_EVICT=_stream_hint(cfg),
                num_warps=cfg.num_warps,
                **flags,
            )
        elif cfg.kernel == "chunked":
            k = _tail_bwd_chunked_kernel[(programs,)](
                *args,
                ROWS=cfg.block_m,
                BLOCK_N=cfg.block_n,
                NUM_STAGES=cfg.num_stages,
                num_warps=cfg.num_warps,
                **flags,
            )
        elif cfg.kernel == "pipelined":
            k = _tail_bwd_pipelined_kernel[(programs,)](
                *args, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **flags
            )
        else:  # split
            # Each row's columns in `splits` spans of whole chunks (the last may be short).
            span = triton.cdiv(triton.cdiv(n_cols, cfg.splits), cfg.block_n) * cfg.block_n
            n_splits = triton.cdiv(n_cols, span)
            c = torch.empty((n_rows, n_splits), dtype=torch.float32, device=dev)
            if need_g or need_u or need_r:
                _tail_bwd_rowdot_kernel[(n_rows, n_splits)](
                    dy, g, u, r, w, rstd.reshape(-1), c,
                    dy.stride(0), g.stride(0), u.stride(0), r.stride(0), n_cols, span,
                    BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                )  # fmt: skip
            grid = (programs, triton.cdiv(n_cols, cfg.block_n))
            k = _tail_bwd_slab_kernel[grid](
                *args[:6], c, *args[6:], n_splits, SPLITS=triton.next_power_of_2(n_splits),
                BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, **flags,
            )  # fmt: skip
        _log_launch("bwd", cfg, k)
        # One reduction over the programs' partials, in a fixed order: the same bits every run.
        return _sum_partials(partial, weight.dtype) if need_w else None

    if config is None:
        key = ("bwd", _pow2_rows(n_rows), n_cols, gate.dtype, needs)
        cands = backward_candidates(n_rows, n_cols, gate.dtype, sm_count(dev))
        config = _pick(key, cands, launch, dev)
    dw = launch(config)
    return tuple(t if t is None else t.view(gate.shape) for t in (dg, du, dr)) + (dw,)


# --------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile: no graph break) and the autograd.Function
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("profuse::tail_fwd", mutates_args=())
def tail_fwd_op(
    gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_runnable(gate)
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
    _check_runnable(gate)
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
    """Saves the inputs and one fp32 rstd per row; the backward recomputes everything else."""

    @staticmethod
    def forward(ctx, gate, up, residual, weight, eps):
        if torch.compiler.is_compiling():  # traced: the opaque op goes into the graph
            y, rstd = torch.ops.profuse.tail_fwd(gate, up, residual, weight, eps)
        else:  # eager: the launcher directly, skipping ~20 us of custom-op dispatch per call
            _check_runnable(gate)
            y, rstd = tail_forward(gate, up, residual, weight, eps)
        ctx.save_for_backward(gate, up, residual, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, residual, weight, rstd = ctx.saved_tensors
        needs = tuple(bool(n) for n in ctx.needs_input_grad[:4])
        if torch.compiler.is_compiling():
            grads = torch.ops.profuse.tail_bwd(grad_out, gate, up, residual, weight, rstd, *needs)
            return tuple(g if need else None for g, need in zip(grads, needs)) + (None,)
        return tail_backward(grad_out, gate, up, residual, weight, rstd, needs) + (None,)
