"""Run one tail kernel, or torch.compile's, inside an NVTX range for Nsight Compute to read.

Where the time of one kernel goes is a question for the hardware counters: how many bytes
came from DRAM (against the bytes the kernel must move), how often the L2 hit. This script
warms the kernel up (builds, autotunes) outside the range, then runs it --repeat times inside
`probe`, so ncu profiles only those launches:

    ncu --clock-control none --nvtx --nvtx-include "probe/" \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python benchmarks/ncu_probe.py --rows 2048 --cols 16384 --which bwd \\
            --config '{"kernel": "chunked", "block_m": 1, "block_n": 8192, "num_warps": 32,
                       "programs": 132}'

--variant compile or compile-max runs Inductor's kernel(s) for the same shape instead. Without
ncu it prints each launch's time from CUDA events, so a bare run is a quick check.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from profuse import tail as T
from profuse.env import DTYPES
from profuse.kernels.configs import KernelConfig
from profuse.kernels.tail import tail_backward, tail_forward


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--cols", type=int, required=True)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--which", default="fwd", choices=("fwd", "bwd"))
    p.add_argument("--variant", default="triton", choices=("triton", "compile", "compile-max"))
    p.add_argument("--config", help="triton: a KernelConfig as JSON (default: the autotuner's pick)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: ncu_probe needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (args.rows, args.cols)
    g, u, r, dy = (torch.randn(shape, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(args.cols, device=dev, dtype=dtype, generator=gen)
    cfg = KernelConfig(**json.loads(args.config)) if args.config else None

    if args.variant == "triton":
        _, rstd = tail_forward(g, u, r, w, 1e-6)
        if args.which == "fwd":
            step = lambda: tail_forward(g, u, r, w, 1e-6, cfg)  # noqa: E731
        else:
            step = lambda: tail_backward(dy, g, u, r, w, rstd, (True,) * 4, cfg)  # noqa: E731
    else:
        mode = "max-autotune" if args.variant == "compile-max" else "default"
        fn = lambda *a: T.tail_compiled(*a, mode=mode)  # noqa: E731
        if args.which == "fwd":
            step = lambda: fn(g, u, r, w, 1e-6)  # noqa: E731
        else:
            leaves = [t.detach().requires_grad_() for t in (g, u, r, w)]
            y = fn(*leaves, 1e-6)
            step = lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)  # noqa: E731

    for _ in range(3):  # build, autotune and warm up outside the profiled range
        step()
    torch.cuda.synchronize()
    for i in range(args.repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.nvtx.range_push("probe")
        start.record()
        step()
        end.record()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"launch {i}: {start.elapsed_time(end) * 1e3:.1f} us (L2 warm; ncu's own timing flushes it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
