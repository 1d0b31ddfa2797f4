"""Time every candidate launch config of the Triton tail kernels per shape (CUDA only).

For each column count, rows are chosen so the tensors hold --elements elements; every candidate
config is checked (forward: against fp32 eager; backward: against the narrowest chunked
config, which the tests check against float64), then timed as the autotuner times them (device
time, L2 flushed, the configs taking turns over 30 trials; the median). This shows how far the
heuristic's favourite (and the runtime autotuner's pick) is from the best candidate per shape.

    PYTHONPATH=src python benchmarks/tune_tail.py --out results/tune.json

Team shapes not in the lists can be tried beside them (as configs.FWD_TEAM_SHARES writes them),
e.g. the row teams and staged shape tried on 2026-12-04 and not kept (research/FINDINGS.md):

    PYTHONPATH=src python benchmarks/tune_tail.py --kinds team --which fwd --cols 16384,32768 \\
        --fwd-shares 1024:1:0:1,8192:16:0:1,2048:4:16:2:96:3 --out results/tune_more.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace
from functools import partial

import torch
import triton

from profuse import tail as T
from profuse.bench.traffic import copy_ceiling
from profuse.env import DTYPES, sm_count
from profuse.files import write_json
from profuse.kernels import autotune as A
from profuse.kernels.configs import (
    KernelConfig,
    backward_candidates,
    backward_config,
    forward_candidates,
    forward_config,
    team_candidates,
    teams_enabled,
    two_blocks,
)
from profuse.kernels.tail import tail_backward, tail_forward

GRID = [1024, 2048, 4096, 5120, 8192, 11008, 14336, 16384, 32768, 65536]
TRIALS = 30


def explore(cands: list[KernelConfig], n_rows: int, sms: int) -> list[KernelConfig]:
    """Each candidate again with other pipelining depths and persistent grid sizes."""
    out = list(cands)
    for c in cands:
        if c.kernel != "fused":
            continue
        tiles = triton.cdiv(n_rows, c.block_m)
        for stages, per_sm in itertools.product((1, 2, 3), (1, 2, 3, 4)):
            programs = min(tiles, sms * per_sm)
            cfg = replace(c, num_stages=stages, programs=programs)
            if cfg not in out:
                out.append(cfg)
    return out


def two_block_variants(cands: list[KernelConfig], n_cols: int, sms: int) -> list[KernelConfig]:
    """Each one-row fused candidate also with its row in two blocks (configs.two_blocks), as
    launched and on persistent grids of 1-2 programs an SM at 2-3 stages."""
    blocks = two_blocks(n_cols)
    out = list(cands)
    if not blocks:
        return out
    for c in cands:
        if c.kernel != "fused" or c.block_m != 1 or c.block_n2:
            continue
        two = replace(c, block_n=blocks[0], block_n2=blocks[1])
        grids = [(two.num_stages, two.programs)] + [(st, sms * per_sm) for st in (2, 3) for per_sm in (1, 2)]
        for stages, programs in grids:
            v = replace(two, num_stages=stages, programs=programs)
            if v not in out:
                out.append(v)
    return out


def l2_variants(cands: list[KernelConfig]) -> list[KernelConfig]:
    """Each candidate also with the other L2 hints its kernel takes."""
    out = list(cands)
    for c in cands:
        for l2 in ("stream", "plain"):
            if c.kernel == "fused" and replace(c, l2=l2) not in out:
                out.append(replace(c, l2=l2))
    return out


def team_variants(
    cands: list[KernelConfig], caps: list[int], depths: list[int], sms: int
) -> list[KernelConfig]:
    """Each persistent team candidate also with each register cap and each software-pipelining
    depth (the staged team kernels), its grid allowed up to 8 programs an SM (the launch fits
    what the compiled kernel lets share an SM). Row teams (programs 0) are left as they are:
    their kernel has no staged form (a capped row team is tried by naming it in --fwd-shares,
    SHARE:WARPS:0:1:MAXNREG)."""
    out = list(cands)
    for c in cands:
        if c.kernel != "team" or not c.programs or c.maxnreg or c.pipeline:
            continue
        for cap, depth in itertools.product([0, *caps], [0, *depths]):
            v = replace(c, maxnreg=cap, pipeline=depth, programs=8 * sms if cap or depth else c.programs)
            if v not in out:
                out.append(v)
    return out


def with_shares(cands: list[KernelConfig], shares: list, n_cols: int, sms: int) -> list[KernelConfig]:
    """The candidates, then the team launches of `shares` (--fwd-shares, --bwd-shares) that they
    lack, built as configs builds its own lists (none when teams are off)."""
    more = team_candidates(n_cols, sms, shares) if teams_enabled() else []
    return cands + [c for c in more if c not in cands]


def forward_error(ref, out) -> float:
    return T.relative_error(out[0], ref)


def backward_error(ref, out) -> float:
    return max(T.relative_error(a, b) for a, b in zip(out, ref))


def time_candidates(kind, cands, default, run, error, floor_s, device) -> list[dict]:
    """Each config: one checked call (with its registers and spills), then its median device
    time over interleaved trials (Autotuner.time_configs, as the autotuner times them); fastest first.
    `floor_s`: the kernel's bytes at the copy ceiling, so frac = floor / time."""
    checked = []
    for cfg in cands:
        try:
            A.LAUNCH_LOG = []
            err = error(run(cfg))  # the first call also builds the kernel, outside the timing
            # the main kernel's (the backward's column sum launches after it)
            regs, spills = ([e for e in A.LAUNCH_LOG if e[1] == cfg] or A.LAUNCH_LOG)[-1][2:]
        except Exception as e:  # noqa: BLE001 - a config that cannot compile is just skipped
            print(f"  {kind} {cfg} failed: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        finally:
            A.LAUNCH_LOG = None
        checked.append((cfg, {"rel_err": err, "regs": regs, "spills": spills}))
    times = A.Autotuner(trials=TRIALS).time_configs(run, [cfg for cfg, _ in checked], device)
    rows = []
    for (cfg, info), t in zip(checked, times):
        row = {"ms": t * 1e3, "frac": floor_s / t, **info}
        rows.append({**cfg.to_dict(), **row, "default": cfg == default})
    return sorted(rows, key=lambda c: c["ms"])


def show(what: str, rows: list[dict]) -> None:
    """The fastest candidate of each kernel kind, fastest first."""
    seen = set()
    for row in rows:
        if row["kernel"] in seen:
            continue
        seen.add(row["kernel"])
        blocks = f"{row['block_n']}+{row['block_n2']}" if row.get("block_n2") else f"{row['block_n']}"
        launch = f"{row['kernel']} {row['block_m']}x{blocks} w{row['num_warps']} s{row['num_stages']}"
        launch += f" p{row['programs']} x{row['splits']}{' stash' if row['stash_h'] else ''}"
        launch += f" maxnreg {row['maxnreg']}" if row.get("maxnreg") else ""
        launch += f" pipeline {row['pipeline']}" if row.get("pipeline") else ""
        print(f"{what}: {row['ms'] * 1e3:8.1f} us {row['frac']:6.1%}  {launch}  regs {row['regs']}"
              f" spills {row['spills']} err {row['rel_err']:.1e}", flush=True)  # fmt: skip


def share_list(text: str) -> list[tuple[int, ...]]:
    """Team shapes as configs.FWD_TEAM_SHARES lists them, SHARE:WARPS:PER_SM:STAGES[:MAXNREG[:DEPTH]]
    separated by commas (argparse type: bad input is a one-line error)."""
    shares = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            values = tuple(int(v) for v in item.split(":"))
        except ValueError:
            values = ()
        if not 4 <= len(values) <= 6 or any(v < 0 for v in values) or min(values[:2]) < 1:
            raise argparse.ArgumentTypeError(
                f"expected SHARE:WARPS:PER_SM:STAGES[:MAXNREG[:DEPTH]] of non-negative integers, got {item!r}"
            )
        shares.append(values)
    return shares


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers (argparse type: bad input is a one-line error)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cols", default=",".join(map(str, GRID)))
    p.add_argument("--elements", type=int, default=32 * 2**20, help="rows x cols per tensor")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--which", default="fwd,bwd")
    p.add_argument("--budget-s", type=float, default=300, help="stop starting new shapes after this")
    p.add_argument("--explore", action="store_true", help="also try pipelining depths and grid sizes")
    p.add_argument("--two-blocks", action="store_true", help="also try one-row fused configs in two blocks")
    p.add_argument("--l2", action="store_true", help="also try each candidate's other L2 hints")
    p.add_argument("--kinds", default="", help="only these kernels, e.g. team,pipelined (default: all)")
    p.add_argument(
        "--maxnreg",
        type=int_list,
        default=[],
        help="also try each team candidate with these register caps, e.g. 96,80",
    )
    p.add_argument(
        "--pipeline", type=int_list, default=[], help="also try staged team kernels at these depths, e.g. 2,3"
    )
    p.add_argument(
        "--fwd-shares",
        type=share_list,
        default=[],
        help="also try these team shapes for the forward, as configs.FWD_TEAM_SHARES lists them: "
        "SHARE:WARPS:PER_SM:STAGES[:MAXNREG[:DEPTH]], e.g. 4096:4:0:1 (PER_SM 0: a row team)",
    )
    p.add_argument("--bwd-shares", type=share_list, default=[], help="the same for the backward")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if any(share[2] == 0 for share in args.bwd_shares):
        p.error("--bwd-shares: PER_SM 0 is a row team, which only the forward has")
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    sms = sm_count(dev)
    ceiling = copy_ceiling(dev)
    print(f"copy ceiling {ceiling / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    results = {"dtype": args.dtype, "copy_ceiling_Bps": ceiling, "shapes": []}
    t_start = time.time()
    for n_cols in map(int, args.cols.split(",")):
        if time.time() - t_start > args.budget_s:
            print(f"budget spent, stopping before cols={n_cols}", flush=True)
            break
        n_rows = max(1, args.elements // n_cols)
        gen = torch.Generator(device=dev).manual_seed(0)
        g, u, r, dy = (torch.randn(n_rows, n_cols, device=dev, dtype=dtype, generator=gen) for _ in range(4))
        w = 1 + 0.1 * torch.randn(n_cols, device=dev, dtype=dtype, generator=gen)
        nbytes = g.numel() * g.element_size()
        ref_y = T.tail_eager(g.float(), u.float(), r.float(), w.float())
        shape = {"rows": n_rows, "cols": n_cols, "fwd": [], "bwd": []}

        def widen(cands: list, shares: list, n_rows: int = n_rows, n_cols: int = n_cols) -> list:
            cands = with_shares(cands, shares, n_cols, sms)
            if args.kinds:
                cands = [c for c in cands if c.kernel in args.kinds.split(",")]
            cands = explore(cands, n_rows, sms) if args.explore else cands
            cands = two_block_variants(cands, n_cols, sms) if args.two_blocks else cands
            if args.maxnreg or args.pipeline:
                cands = team_variants(cands, args.maxnreg, args.pipeline, sms)
            return l2_variants(cands) if args.l2 else cands

        if "fwd" in args.which:
            shape["fwd"] = time_candidates(
                "fwd",
                widen(forward_candidates(n_rows, n_cols, dtype, sms), args.fwd_shares),
                forward_config(n_rows, n_cols, dtype),
                partial(tail_forward, g, u, r, w, 1e-6),
                partial(forward_error, ref_y),
                4 * nbytes / ceiling,
                dev,
            )
            show(f"{n_rows}x{n_cols} fwd", shape["fwd"])
        if "bwd" in args.which:
            _, rstd = tail_forward(g, u, r, w, 1e-6)
            needs = (True, True, True, True)
            # A cross-check against the narrowest chunked config (the tests check it against float64).
            ref = tail_backward(dy, g, u, r, w, rstd, needs, KernelConfig("chunked", 1, 1024, 4, 1, 4 * sms))
            shape["bwd"] = time_candidates(
                "bwd",
                widen(backward_candidates(n_rows, n_cols, dtype, sms), args.bwd_shares),
                backward_config(n_rows, n_cols, dtype, sms),
                partial(tail_backward, dy, g, u, r, w, rstd, needs),
                partial(backward_error, ref),
                7 * nbytes / ceiling,
                dev,
            )
            show(f"{n_rows}x{n_cols} bwd", shape["bwd"])
        results["shapes"].append(shape)
        write_json(args.out, results)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
