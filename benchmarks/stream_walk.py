"""How a Triton program's walk over its bytes sets an elementwise kernel's bandwidth (CUDA only).

At 32M elements the tail forward (three tensors in, one out, a reduction over each row) runs at
85-90% of the copy ceiling under the harness's L2 flush, where torch.addcmul moves the same
three-in, one-out bytes at 93% and a plain Triton kernel at 86% (fixed_cost.py). This script
asks which part of a Triton kernel's walk makes that difference, with no reduction in the way:
it times x = a * b + c over flat tensors for each of

    block      elements a program (and warps: elements a thread)
    hints      the loads' L2 eviction hint: evict_first (read once) or none, as torch's kernel
    grid       one block a program, or a persistent grid looping over blocks (with stages)

beside torch.addcmul, under the flushes of fixed_cost.py (zero: the L2 left full of dirty
lines, as the harness's timer leaves it; read: left clean). Every kernel's result is checked
against torch.addcmul before it is timed; one that disagrees is reported as failed.

    PYTHONPATH=src python benchmarks/stream_walk.py --elements 32M,128M --out walk.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from fixed_cost import Flush, median_us

from profuse.bench.traffic import copy_ceiling
from profuse.cli import element_list
from profuse.files import check_folder, write_json
from profuse.timers import CudaTimer


@triton.jit
def _walk_block(A, B, C, X, blk, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """x = a * b + c on block `blk` of BLOCK elements."""
    offs = tl.cast(blk, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    c = tl.load(C + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    tl.store(X + offs, (a * b + c).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _walk_kernel(A, B, C, X, n, BLOCK: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
                 PERSISTENT: tl.constexpr):  # fmt: skip
    """x = a * b + c, BLOCK elements at a time: block pid, or blocks pid, pid + P, ... ."""
    if PERSISTENT:
        for blk in tl.range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0), num_stages=STAGES):
            _walk_block(A, B, C, X, blk, n, BLOCK, EVICT)
    else:
        _walk_block(A, B, C, X, tl.program_id(0), n, BLOCK, EVICT)


def flush_list(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    if not names or not set(names) <= {"zero", "read", "none"}:
        raise argparse.ArgumentTypeError(f"expected names among zero,read,none, got {text!r}")
    return names


def variants(sms: int) -> list[dict]:
    """The walks to time: (block, warps) from 4 to 32 elements a thread, each hint, and
    persistent grids of 4 and 8 programs an SM."""
    out = []
    for evict in ("evict_first", ""):
        for block, warps in ((512, 2), (1024, 4), (1024, 2), (2048, 4), (2048, 8), (4096, 4), (4096, 8),
                             (8192, 8), (8192, 16)):  # fmt: skip
            out.append(dict(block=block, warps=warps, evict=evict, programs=0, stages=1))
        for block, warps, per_sm in ((2048, 4, 8), (4096, 8, 4), (1024, 4, 16)):
            for stages in (1, 3):
                out.append(dict(block=block, warps=warps, evict=evict, programs=per_sm * sms, stages=stages))
    return out


def name(v: dict) -> str:
    grid = f"persistent {v['programs']} x{v['stages']}" if v["programs"] else "one block a program"
    return f"block {v['block']}, {v['warps']} warps, {v['evict'] or 'no hint'}, {grid}"


def launcher(v: dict, a, b, c, x):
    n = a.numel()
    blocks = triton.cdiv(n, v["block"])
    grid = (min(v["programs"], blocks) if v["programs"] else blocks,)
    meta = dict(BLOCK=v["block"], EVICT=v["evict"], STAGES=v["stages"], PERSISTENT=bool(v["programs"]),
                num_warps=v["warps"])  # fmt: skip
    return lambda: _walk_kernel[grid](a, b, c, x, n, **meta)


def measure(n: int, flushes: list[str], sms: int, ceiling: float, dev: torch.device) -> dict:
    """Every walk at `n` elements (checked first) and torch.addcmul, under each flush."""
    a, b, c = (torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(3))
    x, want = torch.empty_like(a), torch.addcmul(c, a, b)
    nbytes = 4 * a.numel() * a.element_size()
    runs = {"torch.addcmul": lambda: torch.addcmul(c, a, b, out=x)}
    failed = []
    for v in variants(sms):
        run = launcher(v, a, b, c, x)
        x.zero_()
        run()
        if torch.allclose(x.float(), want.float(), rtol=1e-2, atol=1e-2):
            runs[name(v)] = run
        else:
            failed.append(name(v))
    size = {"bytes": nbytes, "failed": failed}
    for mode in flushes:
        timer = CudaTimer(dev, flush_l2=False)
        timer.flush = Flush(mode, dev)
        row = size[mode] = {}
        for i, (label, run) in enumerate(runs.items()):
            t = median_us(timer, run)
            row[label] = {"us": t, "pct_copy": 100 * nbytes / (t * 1e-6) / ceiling}
            print(f"\r{n} {mode}: {i + 1}/{len(runs)}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        for label, r in sorted(row.items(), key=lambda kv: kv[1]["us"]):
            print(f"{n:>10} {mode:5} {r['us']:8.1f} us {r['pct_copy']:5.1f}%  {label}", flush=True)
    return size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=element_list, default=[32 * 2**20, 128 * 2**20],
                   help="tensor sizes, e.g. 32M,128M (default)")  # fmt: skip
    p.add_argument("--flushes", type=flush_list, default=["zero", "read"],
                   help="L2 flushes among zero,read,none (default zero,read)")  # fmt: skip
    p.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = p.parse_args()
    if args.out:
        check_folder(Path(args.out).parent, (Path(args.out).name,))
    if not torch.cuda.is_available():
        print("error: stream_walk.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling = copy_ceiling(dev)
    result = {"copy_ceiling_Bps": ceiling, "sizes": {}}
    for n in args.elements:
        result["sizes"][str(n)] = measure(n, args.flushes, sms, ceiling, dev)
    if args.out:
        print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
