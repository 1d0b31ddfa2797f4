"""Rows shared by a team of programs: each holds a share of the row, and they swap partial sums.

A row too wide for one program's registers is either read twice (kernels/tail/chunked.py's
kernels: the second pass from the L2, which held them near 75-80% of the copy rate) or split
over a team of co-resident programs, each holding `BLOCK_N` columns of it in registers. Triton
has no cluster reduction, so a team swaps its partial sums through global memory:

    publish   a member stores its partial sum for the row, tagged with the row's sequence number,
              in its slot: one 64-bit word (the number in the high half, the fp32 bits in the
              low), so the value and the flag that says it is there arrive together;
    gather    a member polls the team's slots until every one carries the row's number, then
              takes the values in member order: every member adds them up in the same order and
              gets the same bits, run after run. With SPIN it waits inside one inline-assembly op,
              so a row loop around it holds no loop of its own and Triton's software pipeliner
              can stage its loads (kernels/tail/team.py's staged kernels).

Slots are double-buffered by the number's parity: a member cannot publish row i + 2 before every
member has published row i + 1, which each does only after it has read row i. A kernel that
reads row i's sums only after publishing row i + 1 (its exchange overlapped with the next row's
work) needs four buffers: row i + 4 is published after row i + 2 is read, which needs every
member's row i + 2, published after that member read row i. The numbers keep
counting across calls (each member stores where it got to, and every member of a team handles
the same rows, so a team's members agree), so the scratch is zeroed once, when it is made, and a
CUDA graph replay finds it as the last call left it.

A member waits for its partners, so the whole grid must be resident at once: `TeamLaunch` sizes
the persistent grid from the compiled kernel's registers, shared memory and warps, never more
programs than the SMs hold together. A row team (`RowTeamLaunch`, the forward) instead forms for
one row and ends with it, on a grid of one program per share: the GPU starts programs as others
end, so no last round of rows is as long as a full one, and its members are neighbours in id,
which the GPU starts together or next. A row team's slots are its row's own, and a member reads
the number its own word carries and publishes the next. Triton's interpreter runs one program
after another, so there a team has one member (nothing to wait for); teams of several run only
on a GPU.

Scratch belongs to a launch plan and a stream: calls of one shape that overlap on two streams
each have their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from profuse.env import sm_count
from profuse.kernels import autotune
from profuse.kernels.configs import KernelConfig


@triton.jit
def publish(slots, seq, member, value, SLOTS: tl.constexpr, BUFFERS: tl.constexpr):
    """Store this member's fp32 `value` for the row numbered `seq` (int32) in its slot of buffer
    seq mod BUFFERS. `slots`: the team's (BUFFERS, SLOTS) int64 words.

    Relaxed, not release: the word carries its own value, so no earlier write needs ordering
    before it, and a release would first wait for the member's outstanding stores of the
    previous row (a DRAM round trip a row; on the H200 the one-stage team forward ran at 71% of
    copy with it and 79% without, 4096 x 8192)."""
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)
    word = (seq.to(tl.int64) << 32) | bits
    tl.atomic_xchg(slots + (seq & (BUFFERS - 1)) * SLOTS + member, word, sem="relaxed")


@triton.jit
def _spin(ptrs, seq):
    """Each slot word at `ptrs` once it carries `seq` in its high half: its low half (fp32 bits).
    The polling loop is PTX inside one inline-assembly op, so the kernel around it has no loop of
    its own here and Triton's software pipeliner can still stage the row loop's loads."""
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
        @%p bra SPIN${:uid};
        }""",
        "=r,l,r", [ptrs.to(tl.int64), want], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _spin_or_trap(ptrs, seq, patience):
    """As `_spin`, but after `patience` polls of a slot that never carries `seq` the kernel stops
    with a trap (a CUDA error on the host) instead of waiting for ever."""
    want = tl.full(ptrs.shape, 0, tl.int32) + seq
    limit = tl.full(ptrs.shape, 0, tl.int32) + patience
    return tl.inline_asm_elementwise(
        """{
        .reg .pred %p;
        .reg .b32 %hi, %n;
        .reg .b64 %word;
        mov.u32 %n, 0;
        SPIN${:uid}:
        ld.relaxed.gpu.global.b64 %word, [$1];
        mov.b64 {$0, %hi}, %word;
        setp.eq.s32 %p, %hi, $2;
        @%p bra DONE${:uid};
        add.s32 %n, %n, 1;
        setp.lt.s32 %p, %n, $3;
        @%p bra SPIN${:uid};
        trap;
        DONE${:uid}:
        }""",
        "=r,l,r,r", [ptrs.to(tl.int64), want, limit], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def gather(slots, seq, n_members, SLOTS: tl.constexpr, BUFFERS: tl.constexpr, SPIN: tl.constexpr = False,
           PATIENCE: tl.constexpr = 0):  # fmt: skip
    """Wait until all `n_members` members have published row `seq`; their fp32 values summed in
    member order (the same bits in every member). SPIN polls inside inline assembly (a GPU only:
    the interpreter runs none), so the caller's loop holds no loop of its own; with PATIENCE, at
    most that many polls of a slot, then a trap."""
    members = tl.arange(0, SLOTS)
    present = members < n_members
    buffer = slots + (seq & (BUFFERS - 1)) * SLOTS
    if SPIN and PATIENCE > 0:
        values = _spin_or_trap(buffer + tl.where(present, members, 0), seq, PATIENCE).to(
            tl.float32, bitcast=True
        )
    elif SPIN:
        # An absent member's lane waits on member 0's word (there whenever the row's sums are).
        values = _spin(buffer + tl.where(present, members, 0), seq).to(tl.float32, bitcast=True)
    else:
        ptrs = buffer + members
        words = tl.load(ptrs, mask=present, other=0, volatile=True)
        missing = present & ((words >> 32).to(tl.int32) != seq)
        while tl.max(missing.to(tl.int32), axis=0) > 0:
            words = tl.load(ptrs, mask=present, other=0, volatile=True)
            missing = present & ((words >> 32).to(tl.int32) != seq)
        values = words.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(present, values, 0.0), axis=0)


def buffers_for(lag: int) -> int:
    """Slot buffers a team needs when a member may read row i - lag after publishing row i: a
    member overwrites row i's buffer only once every member has read row i (see the module)."""
    return 2 if lag == 0 else 4


def balanced(teams: int, n_rows: int) -> int:
    """The fewest teams that finish `n_rows` rows in as many rounds as `teams` teams would (team t
    takes rows t, t + teams, ...), so the last round is as full as it can be: at 1024 rows, 32
    teams of 32 rows rather than 33 teams, one of which works its 32nd row alone while the rest
    of the grid has finished."""
    rounds = triton.cdiv(n_rows, max(teams, 1))
    return triton.cdiv(n_rows, max(rounds, 1))


def team_size(n_cols: int, block_n: int) -> int:
    """Members per row: one per `block_n` columns."""
    return triton.cdiv(n_cols, block_n)


def slots_for(members: int) -> int:
    """Slot words per parity: the team size rounded up to a power of two (a Triton range)."""
    return triton.next_power_of_2(members)


def resident_per_sm(n_regs: int, num_warps: int, shared: int, device: torch.device) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers are given out per
    warp in blocks of 256; 1 KB of shared memory per block is the runtime's)."""
    props = torch.cuda.get_device_properties(device)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs_per_warp = triton.cdiv(max(n_regs, 1) * 32, 256) * 256
    fits = min(regs_per_sm // (regs_per_warp * num_warps), threads_per_sm // (32 * num_warps), 32)
    if shared:
        fits = min(fits, shared_per_sm // (shared + 1024))
    return fits


class TeamLaunch:
    """A team kernel bound to its persistent grid: teams of `members` programs, as many teams
    as fit on the device at once (at most `config.programs` programs, at most one team per row).

    The grid is sized per input dtype and device on the first call there (or `prepare`), from
    the compiled kernel; each stream gets its scratch on its first call there: (teams, buffers,
    slots) int64 slot words, one int32 count per program, then one per member (the arrivals at
    that member's columns of a backward's dw sum, kernels/colsum.sum_when_last; 0 between
    calls). Runtime arguments: the kernel's own without its two scratch pointers, which come
    last.
    """

    __slots__ = ("kernel", "config", "kind", "members", "n_rows", "meta", "constants", "sized")

    def __init__(self, kernel, config: KernelConfig, kind: str, members: int, n_rows: int, **constants):
        self.kernel = kernel
        self.config = config
        self.kind = kind
        self.members = members
        self.n_rows = n_rows
        self.meta = {}  # the call site passes launch.meta back: everything is bound already
        # The config's register cap goes to ptxas with every launch (and the compile that sizes
        # the grid): a lower cap lets more members share an SM.
        self.constants = {**constants, "maxnreg": config.maxnreg} if config.maxnreg else constants
        # (dtype, device) -> [grid, the kernel bound to it, {stream: scratch}]
        self.sized: dict[tuple, list] = {}

    def prepare(self, args) -> int:
        """The teams for calls like `args`, sizing the grid (one compile) the first time."""
        return self._sized(args)[0][0] // self.members

    def _sized(self, args, device: torch.device | None = None) -> list:
        key = (args[0].dtype, args[0].device if device is None else device)
        sized = self.sized.get(key)
        if sized is None:
            grid = (balanced(self._teams(args), self.n_rows) * self.members,)
            # A Launch: after its first call, a call goes straight to the compiled kernel's launcher.
            sized = self.sized[key] = [grid, autotune.Launch(self.kernel, grid, self.config, self.kind,
                                                             **self.constants), {}]  # fmt: skip
        return sized

    def _teams(self, args) -> int:
        device = args[0].device
        teams = min(max(1, self.config.programs // self.members), max(self.n_rows, 1))
        if device.type != "cuda":
            if self.members > 1:
                raise ValueError("a team of several programs waits for its partners: it needs a GPU")
            return teams
        probe = (*args, *self._new_scratch(1, device))
        compiled = self.kernel.warmup(*probe, grid=(self.members,), **self.constants)
        _ = compiled.run  # loads the binary: its registers are known from here on
        fits = resident_per_sm(compiled.n_regs, self.constants["num_warps"], compiled.metadata.shared, device)
        teams = min(teams, fits * sm_count(device) // self.members)
        if teams < 1:
            raise RuntimeError(f"a team of {self.members} programs does not fit on {device} at once")
        return teams

    def _new_scratch(self, teams: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self.constants.get("BUFFERS", 2)
        slots = torch.zeros((teams, buffers, slots_for(self.members)), dtype=torch.int64, device=device)
        return slots, torch.zeros((teams + 1) * self.members, dtype=torch.int32, device=device)

    def scratch(self, args) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots and counts for calls like `args` on the current stream."""
        return self._scratch(self._sized(args), args[0].device)

    def _scratch(self, sized: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        grid, _bound, by_stream = sized
        # The raw handle, as Triton's own launch reads it: torch.cuda.current_stream builds a
        # Stream object each call (a few microseconds of host time a launch).
        stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else None
        scratch = by_stream.get(stream)
        if scratch is None:
            scratch = by_stream[stream] = self._new_scratch(grid[0] // self.members, device)
        return scratch

    def run(self, *args, **_bound) -> None:
        """Launch on `args` (as the call site's `launch.run(*args, **launch.meta)`): one lookup of
        the sized grid, one of the stream's scratch, the launch."""
        device = args[0].device  # read once: a tensor builds its device object on every read
        sized = self._sized(args, device)
        sized[1](*args, *self._scratch(sized, device))

    __call__ = run


class RowTeamLaunch(TeamLaunch):
    """A team kernel on a grid of one program per share of a row (`config.programs` 0): a team
    forms for one row and ends with it, its members neighbours in program id. A GPU starts a
    one-dimensional grid's programs in id order, so a member's partners are running or next to
    start, and only one team's members need to be resident at once, not the whole grid. A member
    that polls for ~1 s without seeing them stops the kernel with a trap rather than hang
    (kernels/tail/team.py's row team kernel). Scratch per stream: (n_rows, slots) int64 words, each
    carrying the last call's number."""

    __slots__ = ()

    def _teams(self, args) -> int:
        if args[0].device.type != "cuda" and self.members > 1:
            raise ValueError("a team of several programs waits for its partners: it needs a GPU")
        return self.n_rows  # a team a row (balanced keeps it so)

    def _new_scratch(self, teams: int, device: torch.device) -> tuple[torch.Tensor]:
        return (
            torch.zeros((max(self.n_rows, 1), slots_for(self.members)), dtype=torch.int64, device=device),
        )
