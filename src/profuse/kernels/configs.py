"""Launch configs of the Triton kernels: what a launch looks like, and which ones are worth trying.

Policy apart from mechanism: the kernels and their launchers (kernels/tail/) run whatever
config they are given; this module proposes the candidates for a shape and dtype, the
heuristic's favourite first, each choice with the measurement behind it. The autotuner
(kernels/autotune.py) times the candidates on the device and keeps the fastest.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch
import triton


@dataclass(frozen=True)
class KernelConfig:
    """How one launch is shaped. Recorded with every result, so a timing names its config."""

    # "fused" (whole rows in registers), "chunked" (rows in chunks, two passes each),
    # "pipelined" (chunked, with pass 1 of a program's next row overlapping pass 2 of its
    # current one) or "split" (backward: a row-dot pass, then the gradients in column slabs);
    # "team" (a row shared by `splits` co-resident programs of block_n columns each, which swap
    # partial sums through global memory: kernels/teams.py; GPU only; with programs 0 a row
    # team, the forward's grid of one program per share of a row);
    # "tiled" (elementwise: block_m rows x block_n columns, no whole row needed; silu_mul)
    kernel: str
    block_m: int  # rows per tile (fused; chunked backward: 1 or 2); 1 for the others
    block_n: (
        int  # whole row (fused), chunk (chunked, pipelined), slab (split) or share (team): a power of two
    )
    num_warps: int
    num_stages: int = 1  # pipelining depth of the tile loop of a persistent program
    programs: int = 0  # persistent grid size; 0 = one program per tile, or per share (forward only)
    splits: int = 1  # programs per row: the split backward's row-dot pass (when rows are few), a team
    # The fused kernels' hint on their read-once inputs: "stream" marks them evict_first in L2,
    # "plain" gives none (the chunked and split kernels take no choice).
    l2: str = "stream"
    # Chunked forward: h kept in y between the passes (STASH_H) instead of re-reading g, u, r.
    stash_h: bool = False
    # Team kernels: registers a thread at most, handed to ptxas (0: its own choice). A lower cap
    # lets more programs share an SM (kernels/teams.py sizes the grid from the compiled kernel),
    # so more of each row is in flight while a team waits, at the cost of some spills.
    maxnreg: int = 0
    # Team kernels: 0 loads the next row into registers before the wait (and num_stages 2 lags
    # the wait a row); n >= 2 lets Triton's software pipeliner load rows n - 1 ahead into shared
    # memory instead (tl.range's num_stages), so the DRAM keeps reading during the wait without
    # registers held for it (kernels/tail/team.py's staged kernels).
    pipeline: int = 0
    # Fused kernels: 0, or a second block of columns (a power of two) after block_n, the row
    # held as block_n + block_n2 lanes: 5120 columns as 4096 + 1024 rather than 8192.
    block_n2: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


# Widest row (elements) held whole in registers; wider rows take the chunked kernels.
FWD_MAX_FUSED = 32768
BWD_MAX_FUSED = 16384


def pow2_rows(n_rows: int) -> int:
    return triton.next_power_of_2(max(n_rows, 1))


# Narrower rows are never split into two blocks: there several rows share a tile instead.
TWO_BLOCKS_MIN_COLS = 2048


def two_blocks(n_cols: int) -> tuple[int, int] | None:
    """A row of `n_cols` as two power-of-two blocks, the wider first, where they take fewer lanes
    than one block: 5120 as 4096 + 1024 (not 8192), 11008 as 8192 + 4096 (not 16384); None where
    they would not (a power of two, 14336) or the row is narrower than TWO_BLOCKS_MIN_COLS."""
    if n_cols < TWO_BLOCKS_MIN_COLS:
        return None
    whole = triton.next_power_of_2(n_cols)
    first = whole // 2
    second = triton.next_power_of_2(n_cols - first)
    return (first, second) if first + second < whole else None


# Team launches (kernels/teams.py), as (share of the row, warps, programs per SM, stages[,
# register cap[, pipelining depth]]). A share is held in registers at 8-16 columns a thread; two
# stages lag a row's exchange behind the next row's work. With a pipelining depth (the staged
# kernels) the next rows load into shared memory through Triton's software pipeliner, so the DRAM
# keeps reading during a team's wait without registers held for it; the grid is then as many
# programs as the compiled kernel lets share an SM (at most the programs per SM given). Programs
# an SM 0: row teams, a team a row on a grid of one program per share (the forward only;
# kernels/tail/team.py's row team kernel).
# Evidence, H200, bf16, kernel time at 32M elements unless said (benchmarks/NOTES.md):
# - Staged, lagged shapes won at every width from 5120 to 65536 (2026-12-03): forward 84-87% of
#   copy, backward kernel 77-80%. The unstaged shapes that won before them stay for the tuner.
# - Backward shares of 512 columns at 2 warps (8 programs an SM at 127 registers) beat 1024 at 4
#   warps by 1.6-2.4% (2026-12-03: 138.2 against 140.5 us at 6553 x 5120, 134.8 against 138.1 at
#   1024 x 32768); a register cap of 96 on the latter (5 programs an SM, with spills) never won
#   the tuner's pick. Finer lost: 256-column shares at 1 warp (16 programs an SM) took 175-233 us
#   against 136-139 for the best, 512 columns at 4 warps 163-165 us (2026-12-03). Shares of
#   2048-4096 columns at 8-16 warps, a pipelining depth of 4, and caps of 80-112 registers on the
#   512-column backward (spills: 192-206 us against 135) never won (2026-12-04).
# - Row teams (2026-12-03): forward 70.2 us at 4096 x 8192 (the best launch before, 72.4-72.9),
#   72.1-72.6 at 3048 x 11008 (74.1-74.4), 72.1 at 2048 x 16384 (72.8-73.2); at 128M elements
#   2-4% faster from 5120 to 32768 columns. With more members a team waits longer for its last
#   one: at 32768-65536 columns the staged teams still win. Row team shares of 8192 columns at 16
#   warps, 2048 at 8 and 1024 at 4 never came within 5%.
# - Row teams of 32 columns a thread (4096 at 4 warps, 2048 at 2; 62-64 registers, 8-16 programs
#   an SM) won the pick at 14336-32768 columns (2026-12-04): forward 71.3-71.5 -> 70.4-70.5 us at
#   2048 x 16384, 72.0-72.2 -> 71.4 at 1024 x 32768.
# - What a row team loses at 32768-65536 columns is its exchange: without it the same kernel
#   runs as fast as the one-row forward (benchmarks/row_team_probe.py, 2026-12-04). Register caps
#   that fit more members an SM (32-56) and teams of 2-4 rows in turn did not win it back.
FWD_TEAM_SHARES = (
    (8192, 8, 0, 1),
    (4096, 8, 0, 1),
    (4096, 4, 0, 1),
    (2048, 4, 0, 1),
    (2048, 2, 0, 1),
    (1024, 2, 0, 1),
    (2048, 4, 8, 2, 128, 3),
    (2048, 4, 8, 2, 0, 3),
    (4096, 8, 8, 2, 0, 3),
    (2048, 4, 4, 2),
    (2048, 4, 4, 1),
)
BWD_TEAM_SHARES = (
    (512, 2, 16, 2, 0, 3),
    (1024, 4, 8, 2, 0, 3),
    (1024, 4, 8, 2, 128, 3),
    (1024, 4, 8, 1, 0, 3),
    (1024, 4, 4, 1),
    (1024, 4, 4, 2),
)


def teams_enabled() -> bool:
    """Team launches are autotune candidates unless PROFUSE_TEAMS=0. A team's members wait for
    each other, so a persistent team grid must run at once (kernels/teams.py sizes it to what
    the GPU holds at once) and a row team relies on the GPU starting programs in id order; the
    switch is there for a GPU shared with another kernel that waits too."""
    return os.environ.get("PROFUSE_TEAMS", "1") != "0"


# Rows up to this wide are never shared by a team: one program holds a whole row at 16 elements
# a thread or fewer. On the H200 (2026-12-03) at 1024 x 4096 the team forward won the tuner's
# draw but lost 5% in the grid to the kernels without teams, timed in the same run (14.6 against
# 13.9 us), and at 8192 and 32768 rows the fused kernels won the pick.
TEAM_MIN_COLS = 4097


def team_candidates(n_cols: int, n_sms: int, shares) -> list[KernelConfig]:
    """Team launches for rows of `n_cols` of at least TEAM_MIN_COLS, each share narrower than
    the row; the grid is at most `per_sm` programs an SM (fewer where the compiled kernel does
    not fit that many: kernels/teams.py sizes it)."""
    out = []
    if n_cols < TEAM_MIN_COLS:
        return out
    for share, warps, per_sm, stages, *extra in shares:
        maxnreg, pipeline = (*extra, 0, 0)[:2]
        if share < n_cols:
            members = triton.cdiv(n_cols, share)
            out.append(KernelConfig(
                "team", 1, share, warps, stages, n_sms * per_sm, members, l2="plain", maxnreg=maxnreg,
                pipeline=pipeline,
            ))  # fmt: skip
    return out


def forward_candidates(n_rows: int, n_cols: int, dtype: torch.dtype, n_sms: int = 132) -> list[KernelConfig]:
    """Launch shapes worth trying for the forward, the heuristic's favourite first."""
    bn = triton.next_power_of_2(n_cols)
    out = []
    if bn <= FWD_MAX_FUSED:
        # Narrow rows: several rows per tile, so a program moves at least ~4K elements.
        for bm in (1, 2, 4, 8, 16):
            tile = bm * bn
            if bm > pow2_rows(n_rows) or tile > max(bn, 8192) or (bm > 1 and tile < 2048):
                continue
            # 8 to 32 elements per thread: one or more 16-byte loads per input, no spills.
            for w in (1, 2, 4, 8, 16, 32):
                if 8 <= tile // (32 * w) <= 32:
                    out.append(KernelConfig("fused", bm, bn, w))
        if not out:  # few, narrow rows: whatever fits, a warp or more
            bm = min(pow2_rows(n_rows), max(1, 4096 // bn))
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
        # The row in two blocks (5120 as 4096 + 1024), on a persistent grid of 2 programs an SM
        # at 3 stages. At 6553 x 5120 on the H200: 72.9 us at 8 warps against 76.1 for the best
        # one-block launch in the same run; the same blocks one program a row took 76.6-80.8.
        blocks = two_blocks(n_cols)
        if blocks:
            programs = n_sms * 2
            for w in (8, 16, 32):
                if 8 <= sum(blocks) // (32 * w) <= 32 and programs < n_rows:
                    out.append(KernelConfig("fused", 1, blocks[0], w, 3, programs, block_n2=blocks[1]))
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
    if teams_enabled():
        out += team_candidates(n_cols, n_sms, FWD_TEAM_SHARES)
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
            if bm > pow2_rows(n_rows) or tile > max(bn, 2048) or (bm > 1 and tile < 1024):
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
            bm = min(pow2_rows(n_rows), max(1, 2048 // bn))
            warps = max(1, min(32, bm * bn // 256))
            out.append(KernelConfig("fused", bm, bn, warps, 1, triton.cdiv(n_rows, bm), l2="plain"))
        # The row in two blocks (5120 as 4096 + 1024), persistent as the one-block kernel that
        # runs 4096 columns at 95% of copy (16 warps, 3 stages, a program an SM). At 6553 x 5120
        # on the H200 it took 128.8 us against 138.8 for the best team launch (one 8192 block
        # spills: 185-208 us); forward + backward 213.5 -> 198.2 us, 82% -> 88% of copy.
        blocks = two_blocks(n_cols)
        if blocks:
            lanes = sum(blocks)
            for w in (8, 16, 32):
                if 4 <= lanes // (32 * w) <= 16:
                    base = max(1, 1024 // (32 * w))
                    for stages, per_sm in ((3, max(1, base // 2)), (2, base), (1, base)):
                        programs = max(1, min(n_rows, n_sms * per_sm))
                        out.append(KernelConfig("fused", 1, blocks[0], w, stages, programs, l2="plain",
                                                block_n2=blocks[1]))  # fmt: skip
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
    if teams_enabled():
        out += team_candidates(n_cols, n_sms, BWD_TEAM_SHARES)
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


# --------------------------------------------------------------------------------------------
# The block's own ops (profuse.blockops): silu_mul (kernels/swiglu.py) and add_rms_norm
# (kernels/add_rms_norm.py). Not yet timed on a GPU: each choice below says what it is borrowed
# from; the autotuner times the candidates on first use of a shape.
#
# Byte floors, per element of one (rows, F) or (rows, N) tensor, each tensor in its own dtype:
#   silu_mul forward       reads gate, up; writes a                    3 tensors (bf16: 6 B)
#                          eager: silu (2), then * (3)                 5 tensors
#   silu_mul backward      reads da, gate, up; writes dgate, dup       5 tensors (bf16: 10 B)
#                          eager: da * up, da * silu, silu's backward  9 tensors, plus 4 to
#                          concatenate the halves into the matmul's gradient (the packed form
#                          writes that one (rows, 2F) gradient itself)
#   add_rms_norm forward   reads x, residual; writes y, h              4 tensors + 4 B a row
#                          (bf16 x, fp32 residual: 2 + 4 + 2 + 4 = 12 B; all bf16: 8 B)
#   add_rms_norm backward  reads dy, dh, h; writes dx, dresidual       5 tensors, 4 when x and
#                          residual share a dtype (one gradient serves both, as add's backward
#                          hands one gradient to both inputs), 3 + 1 without dh; plus the fp32
#                          dweight partials, (programs, N), written and read once more
# --------------------------------------------------------------------------------------------

# Widest add_rms_norm row (elements) held whole in registers, forward and backward alike (one
# limit, so a width whose forward runs never fails in its backward). At 16384 columns and 32
# warps a backward thread holds 16 columns x ~5 live fp32 values (dy, x_hat, w, dh, the dw
# partial): ~80 registers, where the tail's backward holds ~8 per column at the same limit.
ADD_RMS_NORM_MAX_COLS = 16384


def silu_mul_candidates(n_rows: int, n_cols: int, backward: bool = False) -> list[KernelConfig]:
    """Tiles worth trying for silu_mul (elementwise: no whole row needed), the favourite first."""
    bn = triton.next_power_of_2(n_cols)
    # Elements per thread: 16 forward (two 16-byte loads of each bf16 input; the tail's forward
    # rule), 8 backward (five tensors live per element, as the tail's backward rule).
    per_thread = 8 if backward else 16
    out = []
    # Column blocks: 1024 (2 KB of a bf16 row per tile row: whole 128-byte lines, and at most
    # 1023 idle lanes a row); 256 where 1024 fits a width badly (11008 = 43 x 256: none idle,
    # 10.75 x 1024: 2% idle); 4096, fewer and longer rows per tile for wide rows. Grid axis 1
    # (cdiv(F, block_n) <= 65535) holds F up to 16.7M at 256.
    for block_n in dict.fromkeys(min(bn, b) for b in (1024, 256, 4096)):
        # Elements per program: 4096 first (the tail forward's favourite tile size), then
        # half and twice that.
        for tile in (4096, 2048, 8192):
            block_m = max(1, min(tile // block_n, pow2_rows(n_rows)))
            warps = max(1, min(32, block_m * block_n // (32 * per_thread)))
            cfg = KernelConfig("tiled", block_m, block_n, warps, l2="plain")
            if cfg not in out:
                out.append(cfg)
    return out


def add_rms_norm_forward_candidates(n_rows: int, n_cols: int, n_sms: int) -> list[KernelConfig]:
    """Whole-row launches worth trying for add_rms_norm's forward, the favourite first.

    The kernel moves 2 reads and 2 writes per element where the tail's forward moves 3 and 1:
    the same bytes in flight per element, so the tail forward's rules (H200) until this kernel
    is tuned on its own.
    """
    bn = triton.next_power_of_2(n_cols)
    out = []
    for bm in (1, 2, 4, 8, 16):
        tile = bm * bn
        # Narrow rows: several rows per tile, so a program moves at least ~2-4K elements.
        if bm > pow2_rows(n_rows) or tile > max(bn, 8192) or (bm > 1 and tile < 2048):
            continue
        # 8 to 32 elements per thread: one or more 16-byte loads per input, no spills.
        out += [KernelConfig("fused", bm, bn, w, l2="plain") for w in (1, 2, 4, 8, 16, 32)
                if 8 <= tile // (32 * w) <= 32]  # fmt: skip
    if not out:  # few, narrow rows: whatever fits, a warp or more
        bm = min(pow2_rows(n_rows), max(1, 4096 // bn))
        out.append(KernelConfig("fused", bm, bn, max(1, min(32, bm * bn // 512)), l2="plain"))
    # favourite: ~16 elements per thread, the smallest tile that has >= 4K elements
    out.sort(key=lambda c: (abs(c.block_m * c.block_n // (32 * c.num_warps) - 16),
                            abs(c.block_m * c.block_n - max(bn, 4096))))  # fmt: skip
    # Persistent versions of the two favourites: fewer, longer programs that load the next tile
    # while they reduce this one (the tail's forward keeps the same pair).
    for c in out[:2]:
        programs = n_sms * max(1, 2048 // (32 * c.num_warps) // 2)
        if programs < triton.cdiv(n_rows, c.block_m):
            out += [replace(c, num_stages=st, programs=programs) for st in (2, 3)]
    return out


def add_rms_norm_backward_candidates(n_rows: int, n_cols: int, n_sms: int) -> list[KernelConfig]:
    """Whole-row launches on a persistent grid for add_rms_norm's backward, the favourite first
    (the tail backward's fused rules: ~8 elements per thread, tiles of ~2K elements)."""
    bn = triton.next_power_of_2(n_cols)
    shapes = []  # (rows per tile, warps)
    for bm in (1, 2, 4, 8):
        tile = bm * bn
        if bm > pow2_rows(n_rows) or tile > max(bn, 2048) or (bm > 1 and tile < 1024):
            continue
        # 4 to 16 elements per thread keep ~5 live fp32 values per element in registers.
        shapes += [(bm, w) for w in (4, 8, 16, 32) if 4 <= tile // (32 * w) <= 16]
    shapes.sort(key=lambda s: (abs(s[0] * bn // (32 * s[1]) - 8), abs(s[0] * bn - max(bn, 2048))))
    out = []
    for bm, w in shapes[:2]:
        n_tiles = triton.cdiv(n_rows, bm)
        # About 1024 resident threads per SM, the row loop pipelined (the next tile's loads
        # issued early) or not; or half the programs, two tiles in flight each.
        base = max(1, 1024 // (32 * w))
        for stages, per_sm in ((2, base), (1, base), (2, max(1, base // 2))):
            cfg = KernelConfig("fused", bm, bn, w, stages, max(1, min(n_tiles, n_sms * per_sm)), l2="plain")
            if cfg not in out:
                out.append(cfg)
    if not out:  # few, narrow rows
        bm = min(pow2_rows(n_rows), max(1, 2048 // bn))
        warps = max(1, min(32, bm * bn // 256))
        out.append(KernelConfig("fused", bm, bn, warps, 1, triton.cdiv(n_rows, bm), l2="plain"))
    return out
