"""Does profuse's harness agree with triton.testing.do_bench? (CUDA only)

Times Part B's forward variants at one size with `profuse.compare` (interleaved trials, L2
flushed, CUDA events) and with do_bench (median, L2 flushed), in the same process, and prints
each variant's two medians and their ratio. The target: within 5% for every variant.

    PYTHONPATH=src python benchmarks/harness_vs_do_bench.py --rows 8192 --cols 4096
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench

from profuse.bench import DEFAULT_TRIALS
from profuse.bench.tail_bench import DEFAULT_VARIANTS, TailBenchConfig, make_inputs, runner, variants
from profuse.bench.timing import compare
from profuse.files import write_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = p.parse_args()
    dev = torch.device("cuda")
    cfg = TailBenchConfig(args.rows, args.cols, torch.bfloat16, dev, args.trials, backward=args.backward)
    known = variants()
    keys = [k for k in DEFAULT_VARIANTS if known[k].available]
    x = make_inputs(cfg)
    fns = {k: runner(known[k].fn, x, cfg) for k in keys}
    comp = compare(fns, "eager", trials=args.trials, device=dev)
    rows = {}
    print(f"{'variant':>16} {'profuse ms':>10} {'do_bench':>10} {'ratio':>7} {'CPU dispatch ms':>15}")
    for k in keys:
        ours = comp.median_s(k) * 1e3
        theirs = do_bench(fns[k], warmup=25, rep=200, return_mode="median")
        cpu = comp.timings[k].host_s * 1e3
        rows[k] = {"profuse_ms": ours, "do_bench_ms": theirs, "ratio": ours / theirs, "dispatch_ms": cpu}
        print(f"{k:>16} {ours:10.4f} {theirs:10.4f} {ours / theirs:7.3f} {cpu:15.4f}")
    # A copy that moves the fused variant's bytes, timed the same way: what the fixed costs of
    # one launch at this size (launch latency, ramp-up, the last wave) leave of the ceiling.
    tensors = 11 if args.backward else 4
    nbytes = tensors * args.rows * args.cols * 2 // 2  # read + write: half of it is copied
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    copy = compare({"copy": lambda: dst.copy_(src), "copy again": lambda: dst.copy_(src)}, "copy",
                   trials=args.trials, device=dev)  # fmt: skip
    copy_ms = copy.median_s("copy") * 1e3
    print(f"{'copy, same bytes':>16} {copy_ms:10.4f}  (triton / copy at equal traffic: "
          f"{copy_ms / rows['triton']['profuse_ms']:.0%})")  # fmt: skip
    rows["copy_same_bytes"] = {"profuse_ms": copy_ms}
    worst = max(abs(r["ratio"] - 1) for r in rows.values() if "ratio" in r)
    print(f"largest disagreement: {worst:.1%} (target: within 5%)")
    if args.out:
        write_json(
            args.out, {"rows": args.rows, "cols": args.cols, "backward": args.backward, "variants": rows}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
