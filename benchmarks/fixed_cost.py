"""What a call pays beyond its bytes at a given size, against a copy of the same bytes (CUDA only).

"% of copy" divides by one ceiling measured on a large copy (512 MB moved). A call that moves
fewer bytes also pays a fixed cost: the launch and the grid's ramp, the tail where the last
programs run alone, and, under the harness's L2 flush (a buffer of twice the L2 zeroed before
each call), the write-back of the dirty lines that flush leaves, which the call's own reads
evict. This script times, for each shape, with the L2 flushed three ways:

    zero   the harness's flush (CudaTimer): the L2 left full of dirty lines;
    read   a buffer of twice the L2 read (a sum): the L2 left full of clean lines;
    none   no flush: back to back, the last call's lines still there;

after checking the Triton forward and gradients against float64 (a wrong answer is reported and
not timed), four calls: a device-to-device copy of the forward's bytes (half read, half written), the Triton
forward (tail_triton without grad) and forward + backward (tail_triton, then autograd.grad), and
a copy of the forward + backward's bytes. For the forward and the forward + backward it also
records the profiler's kernel times under the harness's flush (each kernel, their sum against
the copy ceiling, and the span from the first kernel's start to the last one's end).

    PYTHONPATH=src python benchmarks/fixed_cost.py --shapes 1024x32768,8192x4096 --out fixed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from profuse import tail as T
from profuse import tail_triton
from profuse.bench.traffic import FUSED_FORWARD_TENSORS, FUSED_FWD_BWD_TENSORS, copy_ceiling
from profuse.env import l2_cache_bytes
from profuse.errors import UsageError
from profuse.files import check_folder, write_json
from profuse.kernels.autotune import TUNER
from profuse.timers import CudaTimer

FLUSHES = ("zero", "read", "none")
TRIALS = 15
CALLS = 5


class Flush:
    """The L2 flush of one mode (see the module)."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        if mode != "none":
            self.buffer = torch.ones(2 * l2_cache_bytes(device) // 4, dtype=torch.float32, device=device)
            self.sink = torch.empty((), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        if self.mode == "zero":
            self.buffer.zero_()
        elif self.mode == "read":
            torch.sum(self.buffer, dim=0, out=self.sink)


def median_us(timer: CudaTimer, fn) -> float:
    fn()
    times = [t for _ in range(TRIALS) for t in timer.time_calls([fn] * CALLS)]
    return statistics.median(times) * 1e6


def shape(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"rows and columns must be positive, got {text!r}")
    return rows, cols


def kernel_times(fn, flush: Flush, device: torch.device) -> dict:
    """Each kernel's device time in one call of `fn` (median of 5 profiled calls, the L2 flushed
    before each), and the span from the first kernel's start to the last one's end."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    calls = []
    for _ in range(5):
        flush()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        kernels = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        calls.append(
            {
                "kernels": [(e.name, e.time_range.end - e.time_range.start) for e in kernels],
                "span_us": kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0.0,
            }
        )
    span = statistics.median(c["span_us"] for c in calls)
    names = [n for n, _ in calls[0]["kernels"]]
    per = [statistics.median(c["kernels"][i][1] for c in calls if len(c["kernels"]) == len(names))
           for i in range(len(names))]  # fmt: skip
    return {"span_us": span, "kernels": [{"name": n[:80], "us": t} for n, t in zip(names, per)]}


def check(g, u, r, w, dy, leaves, fwd_bwd) -> dict:
    """The Triton forward and gradients against float64, within the dtype's tolerances."""
    x64 = [t.detach().double().requires_grad_() for t in (g, u, r, w)]
    y64 = T.tail_reference(*x64, T.DEFAULT_EPS)
    ref = (y64, *torch.autograd.grad(y64, x64, dy.double()))
    errs = {"y": T.relative_error(tail_triton(g, u, r, w), ref[0])}
    errs.update({f"d{n}": T.relative_error(t, x) for n, t, x in zip("gurw", fwd_bwd(), ref[1:])})
    passed = errs["y"] <= T.FORWARD_TOL[g.dtype] and all(
        e <= T.BACKWARD_TOL[g.dtype] for n, e in errs.items() if n != "y"
    )
    return {"passed": passed, "rel_err": errs}


def measure(rows: int, cols: int, timers: dict, ceiling: float, dev: torch.device) -> dict:
    """Every call of the module at one shape, under every flush; prints a line a call."""
    gen = torch.Generator(device=dev).manual_seed(0)
    g, u, r, dy = (torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(cols, device=dev, dtype=torch.bfloat16, generator=gen)
    leaves = [t.detach().clone().requires_grad_() for t in (g, u, r, w)]
    tensor = g.numel() * g.element_size()
    fwd_bytes, both_bytes = FUSED_FORWARD_TENSORS * tensor, FUSED_FWD_BWD_TENSORS * tensor
    src_f = torch.empty(fwd_bytes // 2, dtype=torch.uint8, device=dev).random_()
    dst_f = torch.empty_like(src_f)
    src_b = torch.empty(both_bytes // 2, dtype=torch.uint8, device=dev).random_()
    dst_b = torch.empty_like(src_b)

    def fwd_bwd():
        y = tail_triton(*leaves)
        return torch.autograd.grad(y, leaves, dy)

    calls = {
        "copy, forward's bytes": (lambda: dst_f.copy_(src_f), fwd_bytes),
        "triton forward": (lambda: tail_triton(g, u, r, w), fwd_bytes),
        "copy, forward + backward's bytes": (lambda: dst_b.copy_(src_b), both_bytes),
        "triton forward + backward": (fwd_bwd, both_bytes),
    }
    entry = {"rows": rows, "cols": cols, "tensor_bytes": tensor, "calls": {}}
    entry["check"] = check(g, u, r, w, dy, leaves, fwd_bwd)
    if not entry["check"]["passed"]:
        # a wrong kernel is reported, never timed
        print(f"{rows}x{cols}: Triton differs from float64 beyond tolerance: {entry['check']['rel_err']}")
        calls = {k: v for k, v in calls.items() if k.startswith("copy")}
    for name, (fn, nbytes) in calls.items():
        row = {"bytes": nbytes}
        for mode in FLUSHES:
            us = median_us(timers[mode], fn)
            row[mode] = {"us": us, "fraction_of_copy": nbytes / (us * 1e-6) / ceiling}
        entry["calls"][name] = row
        cells = (f"{m} {row[m]['us']:7.1f} us ({row[m]['fraction_of_copy']:.0%})" for m in FLUSHES)
        print(f"{rows}x{cols} {name:>34}: " + ", ".join(cells), flush=True)
    if not entry["check"]["passed"]:
        return entry
    for name, fn in (("forward", lambda: tail_triton(g, u, r, w)), ("forward + backward", fwd_bwd)):
        kernels = entry[f"{name} kernels"] = kernel_times(fn, timers["zero"].flush, dev)
        total = sum(k["us"] for k in kernels["kernels"])
        nbytes = calls[f"triton {name}"][1]
        kernels["total_us"], kernels["fraction_of_copy"] = total, nbytes / (total * 1e-6) / ceiling
        for k in kernels["kernels"]:
            print(f"    {k['us']:7.1f} us  {k['name']}")
        print(f"    {name}: kernels {total:.1f} us ({kernels['fraction_of_copy']:.0%}), "
              f"span {kernels['span_us']:.1f} us", flush=True)  # fmt: skip
    return entry


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=lambda s: [shape(v) for v in s.split(",")], default=[(1024, 32768)],
                   help="ROWSxCOLS,... (default 1024x32768)")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()
    if args.out:
        out = Path(args.out)
        try:
            check_folder(out.parent, (out.name,))
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("error: fixed_cost.py needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    ceiling = copy_ceiling(dev)
    print(f"copy ceiling {ceiling / 1e12:.3f} TB/s (512 MB moved)", flush=True)
    res = {"copy_ceiling_Bps": ceiling, "flushes": FLUSHES, "shapes": []}
    timers = {}
    for mode in FLUSHES:
        timers[mode] = CudaTimer(dev, flush_l2=False)
        timers[mode].flush = Flush(mode, dev)
    for rows, cols in args.shapes:
        res["shapes"].append(measure(rows, cols, timers, ceiling, dev))
    res["configs"] = TUNER.chosen_dict()
    if args.out:
        write_json(args.out, res)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
