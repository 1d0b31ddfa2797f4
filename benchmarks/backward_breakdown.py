"""Where the Triton forward + backward spends its time (CUDA only).

Times the forward kernel alone, the backward kernel alone (with the dweight reduction), and the
whole autograd path `tail_triton(...)` then `torch.autograd.grad` (what Part B's --backward
times), each three ways: device time with the CPU kept ahead (profuse's CudaTimer, L2 flushed),
triton.testing.do_bench (median, L2 flushed; it counts the GPU's wait for the CPU when issuing
a call takes longer than running it), and the CPU time to issue one call. Device time of the
whole path minus the two kernels is what autograd adds on the GPU; the issue time is what it
costs the CPU.

    PYTHONPATH=src python benchmarks/backward_breakdown.py --rows 8192 --cols 4096
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from triton.testing import do_bench

from profuse import tail_triton
from profuse.bench.traffic import copy_ceiling
from profuse.files import write_json
from profuse.kernels.autotune import TUNER
from profuse.kernels.tail import tail_backward, tail_forward
from profuse.timers import CudaTimer


def cpu_issue_ms(fn, n: int = 20) -> float:
    """Median CPU time to issue one call while the GPU runs behind (no synchronisation)."""
    out = []
    for _ in range(n):
        torch.cuda._sleep(2_000_000)  # keep the GPU busy so launches never wait
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (args.rows, args.cols)
    g, u, r, dy = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(args.cols, device=dev, dtype=torch.bfloat16, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (g, u, r, w)]
    _, rstd = tail_forward(g, u, r, w, 1e-6)
    needs = (True, True, True, True)

    def whole():
        y = tail_triton(*leaves)
        return torch.autograd.grad(y, leaves, dy)

    parts = {
        "forward kernel": lambda: tail_forward(g, u, r, w, 1e-6),
        "backward kernel + dw reduction": lambda: tail_backward(dy, g, u, r, w, rstd, needs),
        "tail_triton + autograd.grad": whole,
    }
    ceiling = copy_ceiling(dev)
    tensor = g.numel() * g.element_size()
    model = {"forward kernel": 4, "backward kernel + dw reduction": 7, "tail_triton + autograd.grad": 11}
    res = {"rows": args.rows, "cols": args.cols, "copy_ceiling_Bps": ceiling, "parts": {}}
    timer = CudaTimer(dev)
    for name, fn in parts.items():
        fn()
        dev_ms = sorted(t for _ in range(10) for t in timer.time_calls([fn] * 5))[25] * 1e3
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        cpu = cpu_issue_ms(fn)
        frac = model[name] * tensor / (dev_ms * 1e-3) / ceiling
        res["parts"][name] = {
            "device_ms": dev_ms,
            "do_bench_ms": ms,
            "cpu_issue_ms": cpu,
            "fraction_of_copy": frac,
        }
        print(f"{name:>30}: device {dev_ms * 1e3:7.1f} us ({frac:.0%} of copy on {model[name]} tensors), "
              f"do_bench {ms * 1e3:7.1f} us, CPU issue {cpu * 1e3:7.1f} us")  # fmt: skip
    res["configs"] = TUNER.chosen_dict()
    print("configs:", res["configs"])
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
