"""Host time per call of profuse's fused ops, on the direct launch and on triton's JIT route,
against their eager counterparts (CUDA only).

Part 1, host time per call. At --small-rows x --cols (16 x 4096 bf16) the GPU needs a few
microseconds a call, so the wall time of a call (it returns once its work is queued) is the
CPU's cost to issue it. The variants take turns in interleaved rounds, each round in its own
shuffled order (the host is noisy: compare within a round, take medians). Per op (silu_mul on
two tensors and on the packed (rows, 2F) matmul output, add_rms_norm with a bf16 x and an fp32
residual stream and weight, the tail), forward without grad and forward + backward:

    eager                 F.silu(g) * u; x + r then F.rms_norm; the tail through F.rms_norm
    profuse               the fused op as it runs by default: after a launch's first call, straight
                          to the compiled kernel's launcher (kernels/fast_launch.py)
    profuse, JIT route    the same op, every launch through triton's JITFunction.run (the route
                          PROFUSE_FAST_LAUNCH=0 keeps; switched per call with
                          autotune.set_fast_launch, two Python calls more)

and the floors: a bare `kernel[grid](...)` launch of the tail's forward kernel, a minimal
autograd.Function over the tail's bare launches, a Function that launches nothing (the autograd
engine alone). Before any timing, each op's outputs and gradients on the two routes are compared:
the same compiled kernels launched with the same arguments must give the same bits.

Part 2 (--modes, a few minutes more): at --rows x --cols (8192 x 4096), profuse's Part B in
each timing mode (device, loop, graph) with host time beside it, and triton.testing.do_bench on
the same calls, forward and forward + backward; --compile adds torch.compile's tail to Part 1.

The targets it checks:
- forward + backward host time: silu_mul (both forms) and add_rms_norm no higher than their
  eager counterparts'; the tail at most 1.25x eager F.rms_norm's;
- the direct launch no slower than the JIT route, per op;
- forward without gradients at most 1.5x the bare launch; with --modes, the large-size targets
  (loop and do_bench within 10% of graph replay and of max(device, host)).

    PYTHONPATH=src python benchmarks/host_overhead.py --out results/host-path    # < 90 s on an H200
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from profuse import blockops
from profuse import tail as T
from profuse.bench import DEFAULT_TRIALS
from profuse.bench.tail_bench import (
    HAS_LIGER,
    TailBenchConfig,
    make_inputs,
    run_tail_bench,
    runner,
    variants,
)
from profuse.env import environment, sm_count
from profuse.files import write_json
from profuse.kernels import autotune as A
from profuse.kernels import configs as C
from profuse.kernels import fast_launch
from profuse.kernels.tail import plans as K
from profuse.timers import host_times

EPS = 1e-6


def minimal_function(rows: int, cols: int, dtype: torch.dtype, dev: torch.device):
    """The floors for an autograd op: a Function over profuse's own kernels at the favourite
    configs, launched directly (autotune.Launch after its first call), with nothing else around
    them (no checks, no plan lookup); and a bare launch of the forward kernel, on triton's JIT
    route (`kernel[grid](...)`) and directly."""
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
            fwd(g, u, r, w, y, rstd, cols, cols, cols, cols, rows, cols, EPS)
            ctx.save_for_backward(g, u, r, w, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            g, u, r, w, rstd = ctx.saved_tensors
            dg, du, dr = torch.empty_like(g), torch.empty_like(u), torch.empty_like(r)
            part = torch.empty((programs, cols), dtype=torch.float32, device=g.device)
            bwd(dy, g, u, r, w, rstd, dg, du, dr, part, cols, cols, cols, cols, rows, cols)
            return dg, du, dr, part.sum(0).to(w.dtype)

    def bare(g, u, r, w, y):
        fwd.run(g, u, r, w, y, rstd_bare, cols, cols, cols, cols, rows, cols, EPS, **fwd.meta)

    def bare_direct(g, u, r, w, y):
        fwd(g, u, r, w, y, rstd_bare, cols, cols, cols, cols, rows, cols, EPS)

    return Minimal.apply, bare, bare_direct


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


def _routes(fn):
    """(the call on the default route, the same call with every launch on triton's JIT route)."""

    def jit():
        was = A.set_fast_launch(False)
        try:
            return fn()
        finally:
            A.set_fast_launch(was)

    return fn, jit


def op_calls(rows: int, cols: int, dev: torch.device, gen) -> dict:
    """Per op: {"forward": (eager, fused), "forward + backward": (eager, fused)}, zero-argument
    calls over fixed inputs (gradients of every output, for every input, through
    torch.autograd.grad, as a model's residual stream takes both of add_rms_norm's outputs)."""
    bf = torch.bfloat16
    rnd = lambda *shape, dtype=bf: torch.randn(*shape, device=dev, dtype=dtype, generator=gen)
    g, u, gu, x, tg, tu, tr = (
        rnd(rows, cols),
        rnd(rows, cols),
        rnd(rows, 2 * cols),
        *(rnd(rows, cols) for _ in range(4)),
    )
    r, w = rnd(rows, cols, dtype=torch.float32), 1 + 0.1 * rnd(cols, dtype=torch.float32)
    tw = 1 + 0.1 * rnd(cols)
    dy, dh = rnd(rows, cols), rnd(rows, cols, dtype=torch.float32)
    leaves = lambda *ts: [t.clone().requires_grad_() for t in ts]
    ops = {
        "silu_mul (gate, up)": (blockops.silu_mul_eager, blockops.silu_mul, (g, u), (dy,)),
        "silu_mul (gate_up)": (blockops.silu_mul_eager, blockops.silu_mul, (gu,), (dy,)),
        "add_rms_norm": (lambda *a: blockops.add_rms_norm_eager(*a, EPS),
                         lambda *a: blockops.add_rms_norm(*a, EPS), (x, r, w), (dy, dh)),
        "tail": (lambda *a: T.tail_rms_norm(*a, EPS), lambda *a: T.tail_triton(*a, EPS),
                 (tg, tu, tr, tw), (dy,)),
    }  # fmt: skip
    out = {}
    for op, (eager, fused, inputs, grads) in ops.items():
        ls = leaves(*inputs)

        def fwd(fn, inputs=inputs):
            return lambda: fn(*inputs)

        def fb(fn, ls=ls, grads=grads):
            def call():
                y = fn(*ls)
                return torch.autograd.grad(y if isinstance(y, tuple) else (y,), ls, grads)

            return call

        out[op] = {
            "forward, no grad": (fwd(eager), fwd(fused)),
            "forward + backward": (fb(eager), fb(fused)),
        }
    return out


def same_bits_on_both_routes(calls: dict) -> dict:
    """Each op's outputs and gradients on the direct launch and on the JIT route: the same
    bits? (op/what -> True or False)"""
    out = {}
    for op, whats in calls.items():
        for what, (_, fused) in whats.items():
            direct, jit = _routes(fused)
            for _ in range(3):  # the first calls plan, tune, bind and check the direct launches
                direct()
            got = [t.detach() for t in _flat(direct())]
            want = [t.detach() for t in _flat(jit())]
            out[f"{op}, {what}"] = len(got) == len(want) and all(
                fast_launch.same_bits(a, b) for a, b in zip(got, want, strict=True)
            )
    return out


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def host_table(
    rows: int, cols: int, rounds: int, per_round: int, dev: torch.device, compile_too: bool
) -> tuple:
    """(median host seconds per call of each variant by group, the two routes' agreement),
    over interleaved rounds."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    calls = op_calls(rows, cols, dev, gen)
    agree = same_bits_on_both_routes(calls)
    groups = {}
    for op, whats in calls.items():
        for what, (eager, fused) in whats.items():
            direct, jit = _routes(fused)
            groups[f"{op}, {what}"] = {"eager": eager, "profuse": direct, "profuse, JIT route": jit}
    # The tail's floors, and what a Function costs with nothing to launch.
    g, u, r, dy = (torch.randn(rows, cols, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    w = 1 + 0.1 * torch.randn(cols, device=dev, dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (g, u, r, w)]
    minimal, bare, bare_direct = minimal_function(rows, cols, dtype, dev)
    y_out = torch.empty_like(g)
    groups["tail, forward, no grad"]["bare launch"] = lambda: bare(g, u, r, w, y_out)
    groups["tail, forward, no grad"]["bare launch, direct"] = lambda: bare_direct(g, u, r, w, y_out)
    groups["tail, forward + backward"]["minimal Function"] = lambda: torch.autograd.grad(
        minimal(*leaves), leaves, dy
    )
    groups["the autograd engine alone"] = {
        "Function launching nothing": lambda: torch.autograd.grad(empty_function()(*leaves), leaves[:3], dy)
    }
    if compile_too:
        groups["tail, forward, no grad"]["torch.compile"] = lambda: T.tail_compiled(g, u, r, w, EPS)
        groups["tail, forward + backward"]["torch.compile"] = lambda: torch.autograd.grad(
            T.tail_compiled(*leaves, EPS), leaves, dy
        )
    out = {}
    rng = random.Random(0)
    for group, fns in groups.items():
        names = list(fns)
        for name in names:  # first calls: compilation, tuning, kernel builds, bindings
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
                samples[name].append(statistics.median(host_times([fns[name]] * per_round, dev)))
        out[group] = {
            n: {
                "median_s": statistics.median(s),
                "p10_s": statistics.quantiles(s, n=10)[0],
                "p90_s": statistics.quantiles(s, n=10)[-1],
            }
            for n, s in samples.items()
        }
    return out, agree


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


def targets(host: dict, modes: dict | None) -> list[tuple[str, float, float, bool]]:
    """(what, measured, limit, met) per target."""
    out = []
    med = lambda group, name: host[group][name]["median_s"]
    for op in ("silu_mul (gate, up)", "silu_mul (gate_up)", "add_rms_norm", "tail"):
        group = f"{op}, forward + backward"
        out.append((f"{op} fwd+bwd host / eager", med(group, "profuse") / med(group, "eager"),
                    1.25 if op == "tail" else 1.0))  # fmt: skip
        for what in ("forward, no grad", "forward + backward"):
            group = f"{op}, {what}"
            ratio = med(group, "profuse") / med(group, "profuse, JIT route")
            out.append((f"{op} {what}: direct / JIT route", ratio, 1.0))
    fwd = "tail, forward, no grad"
    out.append(("tail forward no grad / bare launch", med(fwd, "profuse") / med(fwd, "bare launch"), 1.5))
    if modes:
        f, b = modes["forward"], modes["forward + backward"]
        graph_f = f["modes"]["graph"]["triton"]["median_s"]
        out.append(("forward loop / graph", f["modes"]["loop"]["triton"]["median_s"] / graph_f, 1.10))
        out.append(("forward do_bench / graph", f["do_bench_s"]["triton"] / graph_f, 1.10))
        dev_b = b["modes"]["device"]["triton"]
        bound = max(dev_b["median_s"], dev_b["host_s"] or 0.0)
        out.append(
            ("fwd+bwd loop / max(device, host)", b["modes"]["loop"]["triton"]["median_s"] / bound, 1.10)
        )
        out.append(("fwd+bwd do_bench / max(device, host)", b["do_bench_s"]["triton"] / bound, 1.10))
    return [(what, v, limit, v <= limit) for what, v, limit in out]


def out_path(out: str | None) -> Path | None:
    """--out: a folder (host_overhead.json is written in it), or a path ending in .json."""
    if out is None:
        return None
    path = Path(out)
    return path if path.suffix == ".json" else path / "host_overhead.json"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-rows", type=int, default=16, help="rows of the host-time shape")
    p.add_argument("--rows", type=int, default=8192, help="rows of --modes' shape")
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds of host timing")
    p.add_argument("--per-round", type=int, default=8, help="calls in a row per variant and round")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="--modes' trials")
    p.add_argument("--modes", action="store_true", help="also every timing mode and do_bench at --rows")
    p.add_argument("--compile", action="store_true", help="also torch.compile's tail in the host table")
    p.add_argument("--out", default=None, help="a folder to write host_overhead.json in (or a .json path)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    path = out_path(args.out)
    res = {"env": environment(dev), "args": vars(args), "fast_launch_on": A.fast_launch_on(),
           "triton_hooks_idle": fast_launch.hooks_idle()}  # fmt: skip
    hooks = "idle" if res["triton_hooks_idle"] else "SET (every launch takes the JIT route)"
    print(f"host time per call, {args.small_rows} x {args.cols} bf16 ({args.rounds} interleaved rounds); "
          f"direct launch {'on' if A.fast_launch_on() else 'OFF'}, triton's launch hooks {hooks}",
          flush=True)  # fmt: skip
    res["host"], res["same_bits"] = host_table(
        args.small_rows, args.cols, args.rounds, args.per_round, dev, args.compile
    )
    for what, same in res["same_bits"].items():
        print(f"  {'same bits' if same else 'DIFFERENT'} on both routes: {what}")
    for group, rows in res["host"].items():
        print(f"  {group}")
        for name, h in rows.items():
            print(f"    {name:>22}: {h['median_s'] * 1e6:7.1f} us  (p10-p90 {h['p10_s'] * 1e6:.1f}-"
                  f"{h['p90_s'] * 1e6:.1f})")  # fmt: skip
    if path:  # what is measured is kept, whatever happens next
        write_json(path, res)
    res["modes"] = None
    if args.modes:
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
                print(
                    f"    {k:>9}: " + " | ".join(cells) + f" | do_bench {entry['do_bench_s'][k] * 1e6:7.1f}"
                )
    res["targets"] = [
        dict(what=w, measured=v, limit=lim, met=ok) for w, v, lim, ok in targets(res["host"], res["modes"])
    ]
    print("targets:")
    for t in res["targets"]:
        print(f"  {'MET ' if t['met'] else 'MISS'} {t['what']}: {t['measured']:.2f} (limit {t['limit']:.2f})")
    res["fast_launch_on_at_the_end"] = A.fast_launch_on()  # off: a bound launch disagreed (warned)
    if path:
        write_json(path, res)
    return 0 if all(res["same_bits"].values()) and res["fast_launch_on_at_the_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
