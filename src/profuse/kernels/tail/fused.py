"""The tail's whole-row kernels (KernelConfig.kernel "fused"): a program holds whole rows in
registers, several rows a tile where rows are narrow, and reads each input once.

    forward    y = h * rstd * w,   h = silu(g) * u + r,   rstd = 1 / sqrt(mean(h^2) + eps)
    backward   dh = rstd * (w * dy - x_hat * mean(x_hat * w * dy)), x_hat = h * rstd;
               dr = dh, du = dh * silu(g), dg = dh * u * s * (1 + g * (1 - s)), s = sigmoid(g);
               dw = sum over rows of dy * x_hat (one fp32 partial row per program)

Rows up to configs.FWD_MAX_FUSED columns forward and BWD_MAX_FUSED backward (twice those in
16-bit, at 32 warps, as a candidate the tuner may reject); a row can be held as two
power-of-two blocks (5120 as 4096 + 1024, configs.two_blocks) rather than one of 8192. Grids
are one program a tile, or persistent: a program loads its next tile while it reduces this one.
The launch policy that binds them to a grid is kernels/tail/plans.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tail_fwd_kernel(
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
def store_input_grads(
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
def tail_bwd_kernel(
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
        if (COMPUTE_DG or COMPUTE_DU) or COMPUTE_DR:
            wdy = w[None, :] * dy
            dot = tl.sum(x_hat * wdy, axis=1)
            if BLOCK_N2 > 0:
                wdy2 = w2[None, :] * dy2
                dot += tl.sum(x_hat2 * wdy2, axis=1)
            c = dot / n_cols
            dh = (wdy - x_hat * c[:, None]) * rstd[:, None]
            store_input_grads(DG_ptr, DU_ptr, DR_ptr, rows[:, None] * n_cols + cols[None, :], mask, dh, g,
                               u, s, silu, COMPUTE_DG, COMPUTE_DU, COMPUTE_DR, "")  # fmt: skip
            if BLOCK_N2 > 0:
                dh2 = (wdy2 - x_hat2 * c[:, None]) * rstd[:, None]
                out2 = rows[:, None] * n_cols + cols2[None, :]
                store_input_grads(DG_ptr, DU_ptr, DR_ptr, out2, mask2, dh2, g2, u2, s2, silu2,
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
