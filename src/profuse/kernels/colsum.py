"""The fixed-order column sum that makes every fused backward's dweight bitwise repeatable.

A backward on a persistent grid sums dy * x_hat over its own rows into one fp32 partial row per
program; this kernel then adds the (programs, N) partials up column by column, always in the
same order, and rounds once to the weight's dtype. No atomics on the values: the same bits every
run. Shared by kernels/tail/ and kernels/add_rms_norm.py.

A team backward (kernels/teams.py) sums its partials itself instead, with no launch of its own:
`sum_when_last` stores each program's partial and lets the last of the programs that share a
column block add that block up, in the same fixed order whoever is last.
"""

from __future__ import annotations

import triton
import triton.language as tl

from profuse.kernels.autotune import Launch


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


@triton.jit
def sum_when_last(
    P_ptr, OUT_ptr, ARRIVED_ptr, part, value, n_parts, n_cols, cols, mask,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Called by each of the `n_parts` programs that share `cols`: stores its fp32 partial `value`
    as row `part` of the (n_parts, n_cols) partials P (where `mask`); the last to arrive sums the
    n_parts rows at these columns in part order (BLOCK_P rows at a time, then across the tiles: the same
    bits whoever is last) and rounds once into OUT. `ARRIVED_ptr`: this column block's int32 count of
    arrivals, 0 before the call and put back to 0 by the last arrival (so a CUDA graph replay
    finds it ready).

    The count is the usual cross-program handshake: a barrier (every thread's partial stored),
    then one acq_rel increment at GPU scope; the last arrival's increment acquires every other's
    release, and it reads the partials from the L2 (.cg), never a stale L1 line."""
    tl.store(P_ptr + part.to(tl.int64) * n_cols + cols, value, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVED_ptr, 1, sem="acq_rel")
    if arrived == n_parts - 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # One stage: a software-pipelined loop would take shared memory, and with it programs off
        # the SM (teams.TeamLaunch sizes the grid from the compiled kernel's shared memory).
        for start in tl.range(0, n_parts, BLOCK_P, num_stages=1):
            parts = start + tl.arange(0, BLOCK_P)
            m = (parts < n_parts)[:, None] & mask[None, :]
            tile = tl.load(P_ptr + parts[:, None].to(tl.int64) * n_cols + cols[None, :], mask=m, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            acc += tl.sum(tile, axis=0)
        tl.store(OUT_ptr + cols, acc.to(OUT_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(ARRIVED_ptr, 0, sem="relaxed")


# 64-column blocks: 256 programs at 16384 columns, every SM busy.
COL_SUM_BLOCK_N = 64


def col_sum_launch(n_cols: int) -> Launch:
    """The column sum for rows of `n_cols`, bound to its grid. Runtime arguments:
    (partials (n_parts, n_cols) fp32, out (n_cols,), n_parts, n_cols)."""
    return Launch(
        _col_sum_kernel, (triton.cdiv(n_cols, COL_SUM_BLOCK_N),), None, "dw sum",
        BLOCK_P=32, BLOCK_N=COL_SUM_BLOCK_N,
    )  # fmt: skip
