"""Where a training step's CPU time goes, eager vs fused (Python's cProfile, CUDA or CPU).

Part C found the fused step host-bound at d_model 1024 on the H200: 19.8 ms of CPU a step against
eager's 15.3. This script runs whole steps of both models (a preset of profuse.step, bf16
autocast on CUDA) under cProfile and prints, per variant, the CPU time a step, the share of it
by where the code lives (profuse, torch's Python, triton's Python, built-ins and C), and the
functions with the most time of their own. Steps are not synchronised: the CPU issues them as a
training loop does, so where the GPU is the slower side the queue fills and the waiting shows
as time in the call that blocked. The step time is measured first without the profiler; then,
for the profile, the backward runs on the calling thread (cProfile sees one thread; on CUDA the
autograd engine otherwise runs the backward on a thread of its own).

    PYTHONPATH=src python benchmarks/step_host.py --preset small --steps 20 --out step_host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch

from profuse import fusion
from profuse.model import GPT, random_batch
from profuse.step import preset_model

WHERE = (
    ("/profuse/kernels/", "profuse launchers"),
    ("/profuse/", "profuse model, ops"),
    ("/triton/", "triton (Python)"),
    ("/torch/", "torch (Python)"),
)


def _where(filename: str) -> str:
    for part, name in WHERE:
        if part in filename:
            return name
    return "built-ins and C" if filename.startswith("~") or filename.startswith("<") else "other Python"


def profile_steps(model: GPT, device: torch.device, steps: int, warmup: int) -> tuple[float, pstats.Stats]:
    """Seconds of wall time a step (unsynchronised, as a loop issues them) and the profile."""
    cfg = model.cfg
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(0), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None

    def step():
        if autocast is None:
            _, loss = model(idx, targets)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t0) / steps
    sync()
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
    sync()
    return wall, pstats.Stats(prof)


def report(name: str, wall: float, stats: pstats.Stats, steps: int, top: int) -> str:
    by_where: dict[str, float] = defaultdict(float)
    total = 0.0
    for (filename, _line, _fn), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
        by_where[_where(filename)] += tottime
        total += tottime
    profiled = total / steps
    lines = [f"== {name}: {wall * 1e3:.2f} ms a step issued; {profiled * 1e3:.2f} ms under cProfile:"]
    for where, t in sorted(by_where.items(), key=lambda kv: -kv[1]):
        lines.append(f"   {where:>20}: {t / steps * 1e3:7.2f} ms a step ({t / total:5.1%})")
    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("tottime").print_stats(top)
    lines.append(buf.getvalue())
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="a profuse step preset (lab, small, medium)")
    p.add_argument("--steps", type=int, default=20, help="profiled steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (tuning, caches)")
    p.add_argument("--top", type=int, default=25, help="functions listed per variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = GPT(preset_model(args.preset)).to(device)
    texts = []
    for name in ("eager", "fused"):
        model = GPT(base.cfg).to(device)
        model.load_state_dict(base.state_dict())
        if name == "fused":
            fusion.use_block_ops(model)
        wall, stats = profile_steps(model, device, args.steps, args.warmup)
        texts.append(report(name, wall, stats, args.steps, args.top))
        print(texts[-1], flush=True)
        del model
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(texts))


if __name__ == "__main__":
    main()
