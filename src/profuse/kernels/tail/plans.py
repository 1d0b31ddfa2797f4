"""The tail's launch policy: each KernelConfig bound to its kernel, grid and compile-time
arguments (a plan), the plan caches, and the launchers tail_forward and tail_backward.

A launcher flattens its inputs to 2-D, allocates the outputs and scratch, looks up the plan for
the call's signature and launches it. The first call of a signature builds the plan: the tuned
config for its tuning key (kernels/configs.py proposes the candidates, kernels/autotune.py times
them once), bound to this shape's grid; a later call is a lookup and its launches. The backward
plan also sums the dw partials of the whole-row and two-pass kernels in one fixed order
(kernels/colsum.py): no atomics on values, so gradients are bitwise repeatable.
"""

from __future__ import annotations

import torch
import triton

from profuse.env import interpreting, sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER, Launch, PlanCache, capturing, scratch_key
from profuse.kernels.colsum import col_sum_launch
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import check_runnable
from profuse.kernels.tail.chunked import (
    tail_bwd_chunked_kernel,
    tail_bwd_pipelined_kernel,
    tail_bwd_rowdot_kernel,
    tail_bwd_slab_kernel,
    tail_fwd_chunked_kernel,
    tail_fwd_pipelined_kernel,
)
from profuse.kernels.tail.fused import tail_bwd_kernel, tail_fwd_kernel
from profuse.kernels.tail.team import (
    tail_bwd_team_kernel,
    tail_bwd_team_staged_kernel,
    tail_fwd_row_team_kernel,
    tail_fwd_team_kernel,
    tail_fwd_team_staged_kernel,
)
from profuse.kernels.teams import RowTeamLaunch, TeamLaunch, buffers_for, slots_for, team_size

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


# Where a forward without grad stores rstd: the kernel stores it either way (ops.tail_fused says
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
            tail_fwd_row_team_kernel, cfg, "fwd", members, n_rows, MEMBERS=members,
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
            tail_fwd_kernel, grid, cfg, "fwd",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, IN_EVICT=_stream_hint(cfg),
            BLOCK_N2=cfg.block_n2,
            EVEN=n_cols == cfg.block_n + cfg.block_n2 and n_rows % cfg.block_m == 0, num_warps=cfg.num_warps,
        )  # fmt: skip
    if cfg.kernel == "team" and not cfg.programs:
        return _row_team_launch(cfg, n_rows, n_cols)
    if cfg.kernel == "team":
        kernel = tail_fwd_team_staged_kernel if cfg.pipeline else tail_fwd_team_kernel
        return _team_launch(kernel, cfg, "fwd", n_rows, n_cols, num_warps=cfg.num_warps)
    if cfg.kernel == "pipelined":
        return Launch(
            tail_fwd_pipelined_kernel, (min(cfg.programs, n_rows),), cfg, "fwd",
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
    grid = (min(cfg.programs, n_rows) if cfg.programs else n_rows,)
    return Launch(
        tail_fwd_chunked_kernel, grid, cfg, "fwd",
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
            tail_bwd_kernel, (programs,), cfg, "bwd", BLOCK_M=cfg.block_m, NUM_STAGES=cfg.num_stages,
            IN_EVICT=_stream_hint(cfg), BLOCK_N2=cfg.block_n2, **kw, **flags,
        )  # fmt: skip
    if cfg.kernel == "chunked":
        return Launch(
            tail_bwd_chunked_kernel, (programs,), cfg, "bwd",
            ROWS=cfg.block_m, NUM_STAGES=cfg.num_stages, **kw, **flags,
        )  # fmt: skip
    if cfg.kernel == "pipelined":
        return Launch(tail_bwd_pipelined_kernel, (programs,), cfg, "bwd", **kw, **flags)
    if cfg.kernel == "team":
        kernel = tail_bwd_team_staged_kernel if cfg.pipeline else tail_bwd_team_kernel
        # The dw sum's tile: 64 fp32 a thread (8 partial rows of a 1024-column share at 4 warps):
        # four L2 round trips for 32 teams, and the kernel's registers stay the row loop's (ptxas,
        # sm_90a: 128 capped, 124 uncapped; a 16-row tile takes 158 uncapped).
        rows = max(1, 64 * 32 * cfg.num_warps // cfg.block_n)
        return _team_launch(
            kernel, cfg, "bwd", n_rows, n_cols, num_warps=cfg.num_warps, DW_ROWS=rows, **flags
        )  # fmt: skip
    return Launch(
        tail_bwd_slab_kernel, (programs, triton.cdiv(n_cols, cfg.block_n)), cfg, "bwd",
        SPLITS=triton.next_power_of_2(n_splits), NUM_STAGES=cfg.num_stages, **kw, **flags,
    )  # fmt: skip


class _BackwardPlan:
    """The backward for one shape and set of gradients: its launches and buffer sizes, fixed.

    Calling it allocates the gradients asked for and launches: the gradient kernel (the split
    path: its row-dot pass first), then the column sum of the dw partials (the team kernels sum
    theirs themselves). The fp32 dw partials, one row per program, and the split path's row dot
    parts are scratch: kept per stream (autotune.scratch_key), not allocated per call.
    """

    __slots__ = ("config", "needs", "programs", "main", "rowdot", "span", "n_splits", "col_sum", "scratch")

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
                    tail_bwd_rowdot_kernel, (n_rows, self.n_splits), cfg, "bwd row dot",
                    BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                )  # fmt: skip
        self.main = _backward_launch(cfg, self.programs, n_rows, n_cols, needs, self.n_splits)
        if cfg.kernel == "team":
            self.programs = 0  # the teams: one dw partial row each, known once the grid is sized
        self.col_sum = col_sum_launch(n_cols) if need_w and cfg.kernel != "team" else None
        self.scratch: dict = {}  # (scratch_key, what) -> buffer

    def _scratch(self, what: str, shape: tuple, device: torch.device) -> torch.Tensor:
        """An fp32 scratch buffer of `shape`, kept per stream where it may be (see scratch_key)."""
        key = scratch_key(device)
        buf = self.scratch.get((key, what)) if key is not None else None
        if buf is None:
            buf = torch.empty(shape, dtype=torch.float32, device=device)
            if key is not None:
                self.scratch[(key, what)] = buf
        return buf

    def __call__(self, rows, w, rstd, gate) -> tuple[torch.Tensor | None, ...]:
        """Gradients (dgate, dup, dresidual shaped like `gate`, dweight); None where not asked
        for. `rows`: (tensor, row stride) of dy, g, u, r as 2-D (see _rows)."""
        need_g, need_u, need_r, need_w = self.needs
        (dy, dy_stride), (g, g_stride), (u, u_stride), (r, r_stride) = rows
        n_rows, n_cols = g.shape
        cf = torch.contiguous_format  # empty_like: see _contiguous_like (inline: a frame fewer each)
        dg = torch.empty_like(gate, memory_format=cf) if need_g else None
        du = torch.empty_like(gate, memory_format=cf) if need_u else None
        dr = torch.empty_like(gate, memory_format=cf) if need_r else None
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
            partial = self._scratch("dw partials", (self.programs, n_cols), g.device)
            dw = torch.empty_like(w)
        outs = (*dgur, g if partial is None else partial)
        if self.n_splits:
            c = self._scratch("row dots", (n_rows, self.n_splits), g.device)
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
    kernel still stores rstd (ops.tail_fused says why), into a scratch buffer, and None comes back.

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
    y = torch.empty_like(gate, memory_format=torch.contiguous_format)  # _contiguous_like, inline
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
    launch(*args)
    return y, out_rstd


def _forward_plan(n_rows, n_cols, dtype, device, args) -> Launch:
    """The forward's launch for a new signature: the tuned config (timed now if its tuning key
    is new), bound to this shape's grid."""
    check_runnable(device, "tail_triton")
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
    check_runnable(device, "tail_triton")
    n_rows, n_cols = rows[1][0].shape
    candidates = C.backward_candidates(n_rows, n_cols, gate.dtype, sm_count(device))
    key = ("bwd", C.pow2_rows(n_rows), n_cols, gate.dtype, needs)
    run = lambda c: _BackwardPlan(c, n_rows, n_cols, needs)(rows, w, rstd, gate)
    return _BackwardPlan(TUNER.pick(key, candidates, run, device), n_rows, n_cols, needs)
