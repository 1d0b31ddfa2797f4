"""A new shape's tuning candidates built at once: the same kernels, the same picks, less waiting.

    PYTHONPATH=src python research/parallel_build_check.py [--json FILE]    # about a minute here

The first fused step of a cold process compiles most of profuse's kernels as tuning candidates
(kernels/autotune.Autotuner.pick), one after another: Llama-3.2-1B's same-math check, a 2-layer
copy at 2 x 64 tokens, took 21 s amp and 17 s bf16 on an H100 (2026-12-07, late,
`h100-2026-12-07-late/llama-both/`), most of `--precision both`'s cold start before a compile.
`Autotuner.precompile` now dry-runs every candidate first and has triton's AsyncCompileMode build
what they launch in threads. What a CPU can show, with research/launch_route.py's stand-in
driver (an sm_90 target: triton compiles for real, ptxas included, and nothing is launched):

1. the ops of a fused Llama step at the check's size (128 rows: add_rms_norm and rms_norm at
   2048 columns, silu_mul pair and packed at 8192, rope at 32 and 8 heads of 64, the fused loss),
   forward and backward (`--only tail`: the default job's Part B instead, the tail at 8192 x
   4096), tuned as on an H100 (132 SMs, autotuning on, a timer that ranks the candidates in
   their order), each in a fresh process with an empty triton cache, once with
   PROFUSE_COMPILE_THREADS=1 (one at a time, as before) and once with this machine's CPUs;
2. both must compile the same number of kernels (a dry run's build that a launch did not find
   would be compiled twice) and pick the same config for every tuning key.

Prints one line and, with --json, writes both runs; exits 1 where they differ. `--quick` (a test
runs it, a few seconds): add_rms_norm alone, only the run with threads, which must have built
every kernel its launches then needed. Needs triton 3.6 or later (an AsyncCompileMode that can
drop a failed compile): with an older one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).parent
ROWS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 2048, 8192, 32, 8, 64, 4096
SMS = 132
TAIL, PART_B = "tail", (8192, 4096)  # the default job's Part B: the lab's tail, bf16 (--only tail)


def ops(part_b: bool = False):
    """(name, fn, inputs, output gradients) of a fused Llama step at the check's size: bf16
    activations, fp32 residual stream and norm weights, as amp runs them; or (`part_b`) the
    default job's Part B, the tail in bf16."""
    import torch

    from profuse import blockops, crossentropy, rotary, tail

    gen = torch.Generator().manual_seed(0)
    bf16, fp32 = torch.bfloat16, torch.float32

    def leaf(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    def grad(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen).to(dtype)

    if part_b:
        rows_b, cols_b = PART_B
        args = (leaf(rows_b, cols_b), leaf(rows_b, cols_b), leaf(rows_b, cols_b), leaf(cols_b))
        return [(TAIL, lambda *a: tail.tail_triton(*a, 1e-6), args, (grad(rows_b, cols_b),))]
    x, r, w = leaf(ROWS, HIDDEN), leaf(ROWS, HIDDEN, dtype=fp32), leaf(HIDDEN, dtype=fp32)
    g, u, gu = leaf(ROWS, FFN), leaf(ROWS, FFN), leaf(ROWS, 2 * FFN)
    q, k = leaf(1, HEADS, ROWS, HEAD_DIM), leaf(1, KV_HEADS, ROWS, HEAD_DIM)
    cos, sin = grad(1, ROWS, HEAD_DIM), grad(1, ROWS, HEAD_DIM)
    hidden, head = leaf(1, ROWS, HIDDEN), leaf(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (1, ROWS), generator=gen)
    eps = 1e-5
    return [
        ("add_rms_norm", lambda *a: blockops.add_rms_norm(*a, eps), (x, r, w),
         (grad(ROWS, HIDDEN), grad(ROWS, HIDDEN, dtype=fp32))),
        ("rms_norm", lambda *a: blockops.rms_norm(*a, eps), (x, w), (grad(ROWS, HIDDEN),)),
        ("silu_mul pair", blockops.silu_mul, (g, u), (grad(ROWS, FFN),)),
        ("silu_mul packed", blockops.silu_mul, (gu,), (grad(ROWS, FFN),)),
        ("rope", lambda *a: rotary.rope(*a, cos, sin), (q, k),
         (grad(1, HEADS, ROWS, HEAD_DIM), grad(1, KV_HEADS, ROWS, HEAD_DIM))),
        ("linear_cross_entropy", lambda *a: crossentropy.linear_cross_entropy(*a, labels), (hidden, head),
         (torch.ones(()),)),
    ]  # fmt: skip


class FirstIsFastest:
    """The tuner's timer here: candidates ranked in their order, so the picks repeat exactly."""

    def time_calls(self, calls):
        for call in calls:
            call()
        return [float(i + 1) for i in range(len(calls))]


def child(threads: int, out: Path, only: str | None = None) -> None:
    """One cold run in this process: the ops forward and backward, tuned; what was compiled."""
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="profuse-build-")
    os.environ["PROFUSE_COMPILE_THREADS"] = str(threads)
    sys.path.insert(0, str(HERE))
    import launch_analysis_check as LAC
    import launch_route as LR
    import torch
    from triton import knobs

    import profuse.kernels as K
    from profuse.kernels import autotune as A

    LR.install()
    LAC.let_run_on_cpu()
    for info in __import__("pkgutil").iter_modules(K.__path__):
        module = sys.modules.get(f"profuse.kernels.{info.name}")
        if module is not None and hasattr(module, "sm_count"):
            module.sm_count = lambda device: SMS  # the candidates an H100 gets
    A.autotune_enabled = lambda device: True
    A.TUNER.make_timer = lambda device: FirstIsFastest()
    A.disagreement = lambda outputs, reference: 0.0  # nothing ran: every answer is unwritten memory

    compiled = {"built at once": 0, "on a launch": 0}

    def count(*, is_manual_warmup=False, **_):
        compiled["built at once" if is_manual_warmup else "on a launch"] += 1

    knobs.runtime.jit_post_compile_hook = count
    warnings.simplefilter("ignore")  # triton's and torch's notes on a CPU run of CUDA kernels
    seconds = {}
    t_all = time.perf_counter()
    for name, fn, args, grads in ops(part_b=only == TAIL):
        if only and name != only:
            continue
        t0 = time.perf_counter()
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(outs, args, grads, allow_unused=True)
        seconds[name] = round(time.perf_counter() - t0, 2)
    result = {
        "threads": A.compile_threads(),
        "seconds": round(time.perf_counter() - t_all, 2),
        "by_op": seconds,
        "compiled": compiled,
        "chosen": A.TUNER.chosen_dict(),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")


def run_child(threads: int, only: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, __file__, "--child", str(threads), str(out), *([only] if only else [])]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write both runs here")
    p.add_argument("--quick", action="store_true", help="add_rms_norm alone, built at once only")
    p.add_argument("--only", help="one op (add_rms_norm, rope, ...), or tail: Part B's tail at 8192 x 4096")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(int(args.child[0]), Path(args.child[1]), *args.child[2:])
        return 0
    import triton

    from profuse.kernels.autotune import async_compile_mode

    if async_compile_mode() is None:
        print(f"skipped: triton {triton.__version__} has no AsyncCompileMode profuse uses (3.6 and later)")
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.quick:
        run = run_child(max(cpus, 2), "add_rms_norm")
        built, on_launch = run["compiled"]["built at once"], run["compiled"]["on a launch"]
        ok = built > 0 and on_launch == 0
        print(f"{'ok' if ok else 'FAILED'}: add_rms_norm, {run['threads']} threads: {built} kernels built "
              f"at once, {on_launch} compiled on a launch, {len(run['chosen'])} tuning keys")  # fmt: skip
        return 0 if ok else 1
    one, many = run_child(1, args.only), run_child(max(cpus, 2), args.only)
    total = lambda r: sum(r["compiled"].values())
    same_picks = one["chosen"] == many["chosen"]
    ok = same_picks and total(one) == total(many) and many["compiled"]["built at once"] > 0
    if args.json:
        args.json.write_text(json.dumps({"one_at_a_time": one, "at_once": many}, indent=1) + "\n")
    print(
        f"{'ok' if ok else 'FAILED'}: one at a time {total(one)} kernels compiled in {one['seconds']:.1f} s; "
        f"{many['threads']} threads {total(many)} ({many['compiled']['built at once']} built at once, "
        f"{many['compiled']['on a launch']} on a launch) in {many['seconds']:.1f} s; "
        f"{len(one['chosen'])} tuning keys, the picks {'the same' if same_picks else 'DIFFER'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
