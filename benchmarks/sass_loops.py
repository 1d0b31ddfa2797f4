"""The instructions in a tail kernel's loops, counted offline from its SASS (no GPU needed).

Nsight Compute tells when a kernel issues more than it waits (its schedulers busy on most
cycles); this tells which loop and what is in it, before a change and after, so the change's
instruction budget can be predicted. It compiles a kernel of profuse.kernels.tail for sm_90
with the installed triton (pointers, row strides and n_cols taken as 16-byte aligned, as the
launches specialise them, so the software pipeliner stages the loads as it does on the device),
disassembles it with the cuobjdump that Triton ships, and prints its registers, spills and
shared memory, then every loop (a backward branch): its length in instructions and, for the
longest, the commonest opcodes.

    python benchmarks/sass_loops.py team-backward       # staged, lagged, 512-column shares
    python benchmarks/sass_loops.py one-row-backward    # the fused backward at 4096 columns
    python benchmarks/sass_loops.py row-team-forward
    python benchmarks/sass_loops.py team-backward --set BLOCK_N=1024 --set MEMBERS=8 --warps 4

Session 15, triton 3.6: the team backward's row loop was 620 instructions a turn with
tl.sigmoid and is 495 with the approximate one; the one-row backward's is 401. Per warp a turn
is one row: 256 columns in both. Run it with the triton of the machine the kernel is timed on:
another version schedules and pipelines differently.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from profuse.errors import UsageError

# kernel, constexprs, warps: the launches the tuner picks at 32M elements (session 15)
PRESETS = {
    "team-backward": ("tail_bwd_team_staged_kernel", dict(
        MEMBERS=16, SLOTS=16, BLOCK_N=512, LAG=1, BUFFERS=4, COMPUTE_DG=True, COMPUTE_DU=True,
        COMPUTE_DR=True, COMPUTE_DW=True, DW_ROWS=8, STAGES=3, SPIN=True, APPROX=True), 2),
    "one-row-backward": ("tail_bwd_kernel", dict(
        BLOCK_M=1, BLOCK_N=4096, NUM_STAGES=3, COMPUTE_DG=True, COMPUTE_DU=True, COMPUTE_DR=True,
        COMPUTE_DW=True, IN_EVICT="", BLOCK_N2=0), 16),
    "row-team-forward": ("tail_fwd_row_team_kernel", dict(
        MEMBERS=2, SLOTS=2, BLOCK_N=4096, SPIN=True, PATIENCE=1 << 20, APPROX=True), 8),
}  # fmt: skip

# Pointers are bf16 but for these (kernels/tail.py's fp32 rstd and dw partials, the team scratch).
POINTER_TYPES = {"RSTD_ptr": "*fp32", "DW_ptr": "*fp32", "SLOT_ptr": "*i64", "SEQ_ptr": "*i32"}


def constant(text: str) -> tuple[str, object]:
    """NAME=VALUE from --set: an int, true/false, or a string."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value, 0)
    except ValueError:
        return name, value


def compile_kernel(name: str, constexprs: dict, warps: int):
    """The kernel compiled for sm_90: Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from profuse.kernels import tail

    kernel = getattr(tail, name)
    unknown = set(constexprs) - set(kernel.arg_names)
    if unknown:
        raise UsageError(f"{name} has no argument {', '.join(sorted(unknown))}")
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = POINTER_TYPES.get(arg, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "eps":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if "stride" in arg or arg == "n_cols":
                attrs[(i,)] = [["tt.divisibility", 16]]
    need = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if need:
        raise UsageError(f"{name} needs a value for {', '.join(need)} (--set NAME=VALUE)")
    src = ASTSource(kernel, signature, constexprs, attrs)
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(io.StringIO()):
        os.environ["TRITON_CACHE_DIR"] = cache  # empty: a fresh build, never a cached one
        try:
            return triton.compile(src, GPUTarget("cuda", 90, 32), {"num_warps": warps})
        finally:
            if before is None:
                del os.environ["TRITON_CACHE_DIR"]
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def cuobjdump() -> Path:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise UsageError(f"no cuobjdump at {tool}: this triton does not ship one")
    return tool


def sass(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump()), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction) of each line of cuobjdump -sass."""
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]+);", text)]  # fmt: skip


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index of each loop: a conditional branch back to an address at or before
    its own (an unconditional one back is a join, such as a divergent path's return)."""
    index = {addr: i for i, (addr, _) in enumerate(code)}
    out = []
    for i, (addr, ins) in enumerate(code):
        m = re.search(r"^@\S+\s+BRA(?:\.\w+)*\s+(?:\w+,\s*)?0x([0-9a-f]+)", ins)
        target = int(m.group(1), 16) if m else None
        if target is not None and target <= addr and target in index:
            out.append((index[target], i))
    return out


def opcode(ins: str) -> str:
    """SASS opcode without its predicate and modifiers: '@!P5 FMUL.FTZ R1, ...' -> 'FMUL'."""
    words = ins.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=sorted(PRESETS), help="the kernel and launch to build")
    p.add_argument("--set", type=constant, action="append", default=[], metavar="NAME=VALUE",
                   help="override one of the preset's constexprs (repeatable)")  # fmt: skip
    p.add_argument("--warps", type=int, help="num_warps (default: the preset's)")
    args = p.parse_args()
    try:
        import triton
    except ImportError:
        print("error: sass_loops needs triton (pip install triton)", file=sys.stderr)
        return 2
    name, constexprs, warps = PRESETS[args.preset]
    constexprs = {**constexprs, **dict(args.set)}
    warps = args.warps or warps
    try:
        compiled = compile_kernel(name, constexprs, warps)
        usage = sass(compiled.asm["cubin"], "-res-usage")
        code = instructions(sass(compiled.asm["cubin"], "-sass"))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{name}, {warps} warps, triton {triton.__version__}, sm_90")
    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    print(f"registers {res.get('REG', '?')}, stack {res.get('STACK', '?')} B, local (spills) "
          f"{res.get('LOCAL', '?')} B, shared {compiled.metadata.shared} B; "
          f"{len(code)} instructions")  # fmt: skip
    found = loops(code)
    if not found:
        print("no loops")
        return 0
    for first, last in found:
        span = f"0x{code[first][0]:04x}-0x{code[last][0]:04x}"
        print(f"  loop at {span}: {last - first + 1} instructions a turn")
    first, last = max(found, key=lambda f: f[1] - f[0])
    counts = collections.Counter(opcode(ins) for _, ins in code[first : last + 1])
    print("  longest: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
