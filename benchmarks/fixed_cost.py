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
not timed), seven calls: a device-to-device copy of the forward's bytes (half read, half written);
a *stream* of the forward's tensors (an elementwise Triton kernel that reads three tensors and
writes one, as the forward does, with no reduction across the row); the Triton forward
(tail_triton without grad); then the same three for forward + backward (the copy; the stream
of the forward's tensors followed by one of the backward's, four read and three written; and
tail_triton, then autograd.grad). The streams are the roof of each call's access pattern: what
the same tensors cost to move when nothing waits for a row's sum. The forward's pattern is also
timed through torch's own elementwise kernel (torch.addcmul: r + g * u, three read, one
written). For the forward and the forward + backward it also records the profiler's kernel
times under the harness's flush (each kernel, their sum against the copy ceiling, and the span
from the first kernel's start to the last one's end).

    PYTHONPATH=src python benchmarks/fixed_cost.py --shapes 1024x32768,8192x4096 --out fixed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

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
STREAM_BLOCK = 4096  # elements a program: 16 a thread at 8 warps, as the one-row forward at 4096


@triton.jit
def _stream_kernel(A, B, C, D, X, Y, Z, n, FOUR_IN: tl.constexpr, THREE_OUT: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """x = a * b + c (+ d); with THREE_OUT also y = a * d and z = b * d: three or four tensors
    read once and one or three written, element by element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x = a * b + tl.load(C + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if FOUR_IN:
        d = tl.load(D + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x += d
        if THREE_OUT:
            tl.store(Y + offs, (a * d).to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")
            tl.store(Z + offs, (b * d).to(Z.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    tl.store(X + offs, x.to(X.dtype.element_ty), mask=mask, eviction_policy="evict_first")


def stream(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Read `ins` (3 or 4 tensors of one size) and write `outs` (1, or 3 with 4 inputs)."""
    n = ins[0].numel()
    a, b, c = ins[:3]
    d = ins[3] if len(ins) > 3 else a
    x, y, z = outs if len(outs) == 3 else (outs[0],) * 3  # one output: y and z are unused
    _stream_kernel[(triton.cdiv(n, STREAM_BLOCK),)](a, b, c, d, x, y, z, n, FOUR_IN=len(ins) > 3,
                                                    THREE_OUT=len(outs) == 3, BLOCK=STREAM_BLOCK,
                                                    num_warps=8)  # fmt: skip


def check_stream(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """The stream kernel against torch on these tensors (a wrong baseline is not timed either)."""
    stream(ins, outs)
    a, b, c, *d = (t.float() for t in ins)
    want = [a * b + c + (d[0] if d else 0)]
    if len(outs) == 3:
        want += [a * d[0], b * d[0]]
    return all(torch.allclose(o.float(), x.to(o.dtype).float(), rtol=1e-2, atol=1e-2)
               for o, x in zip(outs, want))  # fmt: skip


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

    y_s, dg_s, du_s, dr_s = (torch.empty_like(g) for _ in range(4))
    fwd_stream = ([g, u, r], [y_s])
    bwd_stream = ([dy, g, u, r], [dg_s, du_s, dr_s])

    calls = {
        "copy, forward's bytes": (lambda: dst_f.copy_(src_f), fwd_bytes),
        "stream, forward's tensors": (lambda: stream(*fwd_stream), fwd_bytes),
        "torch.addcmul, forward's tensors": (lambda: torch.addcmul(r, g, u, out=y_s), fwd_bytes),
        "triton forward": (lambda: tail_triton(g, u, r, w), fwd_bytes),
        "copy, forward + backward's bytes": (lambda: dst_b.copy_(src_b), both_bytes),
        "stream, forward + backward's tensors": (
            lambda: (stream(*fwd_stream), stream(*bwd_stream)),
            both_bytes,
        ),
        "triton forward + backward": (fwd_bwd, both_bytes),
    }
    entry = {"rows": rows, "cols": cols, "tensor_bytes": tensor, "calls": {}}
    entry["check"] = check(g, u, r, w, dy, leaves, fwd_bwd)
    entry["check"]["stream_passed"] = check_stream(*fwd_stream) and check_stream(*bwd_stream)
    if not entry["check"]["stream_passed"]:
        print(f"{rows}x{cols}: the stream kernel differs from torch: not timed")
        calls = {k: v for k, v in calls.items() if not k.startswith(("stream", "torch"))}
    if not entry["check"]["passed"]:
        # a wrong kernel is reported, never timed
        print(f"{rows}x{cols}: Triton differs from float64 beyond tolerance: {entry['check']['rel_err']}")
        calls = {k: v for k, v in calls.items() if not k.startswith("triton")}
    for name, (fn, nbytes) in calls.items():
        row = {"bytes": nbytes}
        for mode in FLUSHES:
            us = median_us(timers[mode], fn)
            row[mode] = {"us": us, "fraction_of_copy": nbytes / (us * 1e-6) / ceiling}
        entry["calls"][name] = row
        cells = (f"{m} {row[m]['us']:7.1f} us ({row[m]['fraction_of_copy']:.0%})" for m in FLUSHES)
        print(f"{rows}x{cols} {name:>38}: " + ", ".join(cells), flush=True)
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
