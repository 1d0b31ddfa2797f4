"""Host time of a forward without grad against a bare launch, for one tree (CUDA only).

`host_overhead.py` times every variant of one tree. This times just the pair its first target
is about (profuse.tail_triton under no_grad, and one launch of the same tree's forward kernel
with its outputs made beforehand), in interleaved rounds in one process, so that trees can be
put side by side: run it once per tree, the trees taking turns, each with its own PYTHONPATH.
It prints one JSON line. Trees from before the tail's forward always stored rstd (their
`_forward_launch` takes `store_rstd`) launch it with the store on.

    for t in /tmp/old .; do PYTHONPATH=$t/src python benchmarks/host_ab.py --label $t; done
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import torch

from profuse import tail_triton
from profuse.env import sm_count
from profuse.kernels import configs as C

try:
    from profuse.kernels.tail import plans as K
except ImportError:  # a tree from before kernels/tail/ was a package
    from profuse.kernels import tail as K

EPS = 1e-6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    p.add_argument("--per-round", type=int, default=20, help="calls in a row per round (default 20)")
    p.add_argument("--label", default="", help="names the tree in the JSON line")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: host_ab.py times CUDA launches: no CUDA device here", file=sys.stderr)
        return 2
    dev, rows, cols = torch.device("cuda"), args.rows, args.cols
    g, u, r = (torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(3))
    w = torch.ones(cols, device=dev, dtype=torch.bfloat16)
    y, rstd = torch.empty_like(g), torch.empty(rows, device=dev, dtype=torch.float32)
    cfg = C.forward_config(rows, cols, torch.bfloat16, sm_count(dev))
    store = (True,) if "store_rstd" in inspect.signature(K._forward_launch).parameters else ()
    fwd = K._forward_launch(cfg, rows, cols, *store)

    def bare() -> None:
        fwd.run(g, u, r, w, y, rstd, cols, cols, cols, cols, rows, cols, EPS, **fwd.meta)

    def op() -> None:
        tail_triton(g, u, r, w)

    times: dict[str, list[float]] = {"bare": [], "op": []}
    with torch.no_grad():
        for fn in (bare, op):  # compiled, tuned and warm before any round
            for _ in range(50):
                fn()
        torch.cuda.synchronize()
        for i in range(args.rounds):
            pair = [("bare", bare), ("op", op)]
            for name, fn in pair if i % 2 else pair[::-1]:
                t0 = time.perf_counter()
                for _ in range(args.per_round):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.per_round * 1e6)
            torch.cuda.synchronize()
    bare_us, op_us = (statistics.median(times[k]) for k in ("bare", "op"))
    print(json.dumps({"tree": args.label, "bare_us": round(bare_us, 2), "ours_us": round(op_us, 2),
                      "ratio": round(op_us / bare_us, 3)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
