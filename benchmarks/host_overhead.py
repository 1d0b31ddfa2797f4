"""What a call costs the host, and what each way of timing reads (CUDA only).

Part 1, host time per call. At 16 x 4096 bf16 the GPU needs a few microseconds a call, so the
wall time of a call (it returns once its work is queued) is the CPU's cost to issue it. The
variants take turns in interleaved rounds, each round in its own shuffled order (the host is
noisy: compare within a round, take medians). Beside profuse's op, the floors it is held to:

    bare launch          one `kernel[grid](...)` of profuse's forward kernel, outputs made beforehand
    minimal Function     a torch.autograd.Function around one forward launch (and, for the
                         backward, one backward launch plus a torch sum of the dw partials)

Part 2, at --rows x --cols (default 8192 x 4096): profuse's Part B in each timing mode (device,
loop, graph) with host time beside it, and triton.testing.do_bench (median, L2 flushed) on the
same calls, forward and forward + backward.

The targets it checks (a fused op must be fast where it is called):
- forward without gradients: host time at most 1.5x the bare launch; with gradients, at most
  1.5x the minimal Function;
- forward + backward: host time at most 1.25x eager F.rms_norm's and at most 0.75x torch.compile's;
- the block ops forward + backward: silu_mul's host time no higher than F.silu(g) * u's,
  add_rms_norm's no higher than x + r then F.rms_norm's;
- at the large size, in loop timing and in do_bench: the forward within 10% of its graph-replay
  device time; forward + backward within 10% of max(device, host), and faster than
  torch.compile and eager F.rms_norm there.

    PYTHONPATH=src python benchmarks/host_overhead.py --out results/host_overhead.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch
from triton.testing import do_bench

from profuse import blockops
from profuse import tail as T
from profuse.bench.tail_bench import (
    HAS_LIGER,
    TailBenchConfig,
    make_inputs,
    run_tail_bench,
    runner,
    tail_liger,
    variants,
)
from profuse.env import environment, sm_count
from profuse.files import write_json
from profuse.kernels import configs as C
from profuse.kernels.tail import plans as K
from profuse.timers import host_times

EPS = 1e-6


def minimal_function(rows: int, cols: int, dtype: torch.dtype, dev: torch.device):
    """The floor for an autograd op: a Function over profuse's own kernels at the favourite
    configs, with nothing else around them (no checks, no plan lookup)."""
    sms = sm_count(dev)
    fwd = K._forward_launch(C.forward_config(rows, cols, dtype, sms), rows, cols)
    rstd_bare = torch.empty(rows, dtype=torch.float32, device=dev)  # made beforehand, as y
    bcfg = C.backward_config(rows, cols, dtype, sms)
    bwd = K._BackwardPlan(bcfg, rows, cols, (True, True, True, True)).main
    programs = min(bcfg.programs, -(-rows // bcfg.block_m))

    class Minimal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, u, r, w):
            y = torch.empty_like(g)
            rstd = torch.empty(g.shape[0], dtype=torch.float32, device=g.device)
            fwd.run(g, u, r, w, y, rstd, cols, cols, cols, cols, rows, cols, EPS, **fwd.meta)
            ctx.save_for_backward(g, u, r, w, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            g, u, r, w, rstd = ctx.saved_tensors
            dg, du, dr = torch.empty_like(g), torch.empty_like(u), torch.empty_like(r)
            part = torch.empty((programs, cols), dtype=torch.float32, device=g.device)
            bwd.run(dy, g, u, r, w, rstd, dg, du, dr, part, cols, cols, cols, cols, rows, cols, **bwd.meta)
            return dg, du, dr, part.sum(0).to(w.dtype)

    def bare(g, u, r, w, y):
        fwd.run(g, u, r, w, y, rstd_bare, cols, cols, cols, cols, rows, cols, EPS, **fwd.meta)

    return Minimal.apply, bare


def empty_function():
    """An autograd.Function whose forward and backward launch nothing: the engine's cost."""

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, u, r, w):
            return torch.empty_like(g)

        @staticmethod
        def backward(ctx, dy):
            return dy, dy, dy, None

    return Empty.apply


def block_op_groups(rows: int, cols: int, dtype: torch.dtype, dev: torch.device, gen) -> dict:
    """The block ops forward + backward, profuse's fused op beside its eager counterpart:
    silu_mul against F.silu(g) * u, add_rms_norm against x + r then F.rms_norm (gradients of
    both outputs, as a model's residual stream uses both)."""
    g, u, x, dy = (torch.randn(rows, cols, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    r, dh = (torch.randn(rows, cols, device=dev, generator=gen) for _ in range(2))  # fp32 stream
    w = 1 + 0.1 * torch.randn(cols, device=dev, generator=gen)
    gu = [t.clone().requires_grad_() for t in (g, u)]
    xrw = [t.clone().requires_grad_() for t in (x, r, w)]

    def fb_silu(fn):
        return lambda: torch.autograd.grad(fn(*gu), gu, dy)

    def fb_norm(fn):
        return lambda: torch.autograd.grad(fn(*xrw, EPS), xrw, (dy, dh))

    return {
        "silu_mul, forward + backward": {
            "eager F.silu(g) * u": fb_silu(blockops.silu_mul_eager),
            "profuse silu_mul": fb_silu(blockops.silu_mul),
        },
        "add_rms_norm, forward + backward": {
            "eager x + r, F.rms_norm": fb_norm(blockops.add_rms_norm_eager),
            "profuse add_rms_norm": fb_norm(blockops.add_rms_norm),
        },
    }


def host_table(rows: int, cols: int, rounds: int, per_round: int, dev: torch.device) -> dict:
    """Median host seconds per call of each variant, forward (no grad), forward (grad) and
    forward + backward, over interleaved rounds."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    g, u, r, dy = (torch.randn(rows, cols, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(cols, device=dev, dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (g, u, r, w)]
    y_out = torch.empty_like(g)
    minimal, bare = minimal_function(rows, cols, dtype, dev)
    empty = empty_function()
    compiled = T.tail_compiled

    def fb(fn, threads: bool = True):
        def call():
            # threads=False: the backward on the calling thread, not autograd's device thread,
            # to show what the hand-off between the two threads costs.
            with torch.autograd.set_multithreading_enabled(threads):
                y = fn(*leaves, EPS) if fn is not minimal else fn(*leaves)
                return torch.autograd.grad(y, leaves, dy)

        return call

    groups = {
        "forward, no grad": {
            "bare launch": lambda: bare(g, u, r, w, y_out),
            "eager F.rms_norm": lambda: T.tail_rms_norm(g, u, r, w, EPS),
            "torch.compile": lambda: compiled(g, u, r, w, EPS),
            "profuse triton": lambda: T.tail_triton(g, u, r, w, EPS),
        },
        "forward, with grad": {
            "minimal Function": lambda: minimal(*leaves),
            "eager F.rms_norm": lambda: T.tail_rms_norm(*leaves, EPS),
            "torch.compile": lambda: compiled(*leaves, EPS),
            "profuse triton": lambda: T.tail_triton(*leaves, EPS),
        },
        "forward + backward": {
            "minimal Function": fb(minimal),
            "eager F.rms_norm": fb(T.tail_rms_norm),
            "torch.compile": fb(compiled),
            "profuse triton": fb(T.tail_triton),
        },
        "forward + backward, backward on the calling thread": {
            "minimal Function": fb(minimal, threads=False),
            "eager F.rms_norm": fb(T.tail_rms_norm, threads=False),
            "torch.compile": fb(compiled, threads=False),
            "profuse triton": fb(T.tail_triton, threads=False),
        },
        "the autograd engine alone": {
            "Function launching nothing": lambda: torch.autograd.grad(empty(*leaves), leaves[:3], dy),
        },
    }
    groups.update(block_op_groups(rows, cols, dtype, dev, gen))
    if HAS_LIGER:
        groups["forward, no grad"]["liger-kernel"] = lambda: tail_liger(g, u, r, w, EPS)
        groups["forward, with grad"]["liger-kernel"] = lambda: tail_liger(*leaves, EPS)
        groups["forward + backward"]["liger-kernel"] = fb(tail_liger)
    out = {}
    rng = random.Random(0)
    for group, fns in groups.items():
        names = list(fns)
        for name in names:  # first calls: compilation, tuning, kernel builds
            for _ in range(3):
                fns[name]()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        samples: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(rounds):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                # `per_round` calls in a row; the round's sample is their median.
                times = host_times([fns[name]] * per_round, dev)
                samples[name].append(statistics.median(times))
        out[group] = {
            n: {
                "median_s": statistics.median(s),
                "p10_s": statistics.quantiles(s, n=10)[0],
                "p90_s": statistics.quantiles(s, n=10)[-1],
            }
            for n, s in samples.items()
        }
    return out


def modes_table(rows: int, cols: int, trials: int, dev: torch.device) -> dict:
    """Part B at the large size in every timing mode, and do_bench on the same calls."""
    out = {}
    for backward in (False, True):
        what = "forward + backward" if backward else "forward"
        keys = ("eager", "rms_norm", "compile", "triton") + (("liger",) if HAS_LIGER else ())
        entry: dict = {"modes": {}, "do_bench_s": {}}
        for timing in ("device", "loop", "graph"):
            cfg = TailBenchConfig(rows, cols, torch.bfloat16, dev, trials, backward=backward,
                                  variants=keys, timing=timing)  # fmt: skip
            res = run_tail_bench(cfg)
            comp = res.comparison
            entry["modes"][timing] = {
                k: {"median_s": t.median_s, "host_s": t.host_s, "host_bound": comp.host_bound(k)}
                for k, t in comp.timings.items()
            }
            entry["modes"][timing]["_skipped"] = res.skipped
            print(f"  {what}, {timing} timing: done", flush=True)
        cfg = TailBenchConfig(rows, cols, torch.bfloat16, dev, trials, backward=backward, variants=keys)
        x = make_inputs(cfg)
        known = variants()
        for k in keys:
            fn = runner(known[k].fn, x, cfg)
            entry["do_bench_s"][k] = do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
        out[what] = entry
        del x
        torch.cuda.empty_cache()
    return out


def targets(host: dict, modes: dict) -> list[tuple[str, float, float, bool]]:
    """(what, measured, limit, met) per target."""
    out = []
    fwd, fwdg, fb = host["forward, no grad"], host["forward, with grad"], host["forward + backward"]
    ours = lambda grp: grp["profuse triton"]["median_s"]
    out.append(("forward no grad / bare launch", ours(fwd) / fwd["bare launch"]["median_s"], 1.5))
    out.append(
        ("forward with grad / minimal Function", ours(fwdg) / fwdg["minimal Function"]["median_s"], 1.5)
    )
    out.append(("fwd+bwd host / eager F.rms_norm", ours(fb) / fb["eager F.rms_norm"]["median_s"], 1.25))
    out.append(("fwd+bwd host / torch.compile", ours(fb) / fb["torch.compile"]["median_s"], 0.75))
    silu, norm = host["silu_mul, forward + backward"], host["add_rms_norm, forward + backward"]
    for grp, eager, fused in ((silu, "eager F.silu(g) * u", "profuse silu_mul"),
                              (norm, "eager x + r, F.rms_norm", "profuse add_rms_norm")):  # fmt: skip
        out.append((f"fwd+bwd host: {fused} / {eager}", grp[fused]["median_s"] / grp[eager]["median_s"], 1.0))
    f, b = modes["forward"], modes["forward + backward"]
    graph_f = f["modes"]["graph"]["triton"]["median_s"]
    out.append(("forward loop / graph", f["modes"]["loop"]["triton"]["median_s"] / graph_f, 1.10))
    out.append(("forward do_bench / graph", f["do_bench_s"]["triton"] / graph_f, 1.10))
    dev_b = b["modes"]["device"]["triton"]
    bound = max(dev_b["median_s"], dev_b["host_s"] or 0.0)
    out.append(("fwd+bwd loop / max(device, host)", b["modes"]["loop"]["triton"]["median_s"] / bound, 1.10))
    out.append(("fwd+bwd do_bench / max(device, host)", b["do_bench_s"]["triton"] / bound, 1.10))
    for rival in ("compile", "rms_norm"):
        loop = b["modes"]["loop"]
        out.append(
            (f"fwd+bwd loop: triton / {rival}", loop["triton"]["median_s"] / loop[rival]["median_s"], 1.0)
        )
        db = b["do_bench_s"]
        out.append((f"fwd+bwd do_bench: triton / {rival}", db["triton"] / db[rival], 1.0))
    return [(what, v, limit, v <= limit) for what, v, limit in out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-rows", type=int, default=16)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds of host timing")
    p.add_argument("--per-round", type=int, default=8, help="calls in a row per variant and round")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--out", default=None, help="write every figure to this JSON file")
    args = p.parse_args()
    dev = torch.device("cuda")
    res = {"env": environment(dev), "args": vars(args)}
    print(f"host time per call, {args.small_rows} x {args.cols} bf16 ({args.rounds} interleaved rounds)")
    res["host"] = host_table(args.small_rows, args.cols, args.rounds, args.per_round, dev)
    for group, rows in res["host"].items():
        print(f"  {group}")
        for name, h in rows.items():
            print(f"    {name:>18}: {h['median_s'] * 1e6:7.1f} us  (p10-p90 {h['p10_s'] * 1e6:.1f}-"
                  f"{h['p90_s'] * 1e6:.1f})")  # fmt: skip
    if args.out:  # what is measured is kept, whatever happens next
        write_json(args.out, res)
    print(f"timing modes and do_bench, {args.rows} x {args.cols} bf16 ({args.trials} trials)", flush=True)
    res["modes"] = modes_table(args.rows, args.cols, args.trials, dev)
    for what, entry in res["modes"].items():
        print(f"  {what}: median us (host us) per mode; do_bench us")
        for k in entry["do_bench_s"]:
            cells = []
            for timing, rows in entry["modes"].items():
                row = rows.get(k)
                if row is None:
                    cells.append(f"{timing} -")
                    continue
                flag = " host-bound" if row["host_bound"] else ""
                cells.append(
                    f"{timing} {row['median_s'] * 1e6:7.1f} ({(row['host_s'] or 0) * 1e6:6.1f}){flag}"
                )
            print(f"    {k:>9}: " + " | ".join(cells) + f" | do_bench {entry['do_bench_s'][k] * 1e6:7.1f}")
    if args.out:
        write_json(args.out, res)
    res["targets"] = [
        dict(what=w, measured=v, limit=lim, met=ok) for w, v, lim, ok in targets(res["host"], res["modes"])
    ]
    print("targets:")
    for t in res["targets"]:
        print(f"  {'MET ' if t['met'] else 'MISS'} {t['what']}: {t['measured']:.2f} (limit {t['limit']:.2f})")
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
