"""Where the fused small step's extra host time goes: the backward's thread, the forward, or the Python.

On an H100 (2026-12-07, night, `benchmarks/results/h100-2026-12-07-night/main/`) Part C's small
step (the built-in GPT, 8 layers, d_model 1024, 8192 tokens, amp) issued in 23.2 ms fused
against 21.9 ms eager, though the fused step launches 111 fewer kernels; under the profiler the
fused `AddRMSNormFunction`'s own frame took 174 us a forward call. On a CPU the two steps issue in
the same time (research/FINDINGS.md). This probe times each step's host time with the GPU held
(profuse.bench.host: the CPU's time alone, no wait for the GPU counted), eager against fused
(profuse's silu_mul and add_rms_norm, as Part C fuses the GPT), in three forms:

    step            forward, loss, backward and AdamW; the backward on the autograd engine's
                    device thread, as every CUDA training loop runs it
    step, 1 thread  the same under torch.autograd.set_multithreading_enabled(False): the backward
                    on the calling thread, no hand-over of each Python backward to another thread
    forward         the forward and the loss alone (the graph built, then dropped)

in interleaved rounds, each in its own shuffled order. Then it profiles one-thread steps of each
with cProfile (which sees one thread) and keeps, per variant, the time of its own by where the
code lives and the functions with the most of it.

Prediction, written before any card ran it: if the device thread's hand-overs (the GIL taken for
each of the 24 Python backwards a step) are the gap, fused's "step, 1 thread" comes within 0.3 ms
of eager's while "step" stays 1-3 ms above it; if the forward is, the "forward" rows differ by
about the whole step's gap.

    PYTHONPATH=src python research/host_gap.py --out DIR        # about a minute on an H100

On a CPU (wall time, the kernels through Triton's interpreter) it only shows that it runs:
`TRITON_INTERPRET=1 ... --preset lab --rounds 2 --profile-steps 1`.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from profuse import fusion
from profuse.bench.host import cpu_host_times, measure_host
from profuse.env import environment, provenance
from profuse.files import write_json
from profuse.model import GPT, random_batch
from profuse.models.gpt import PRESETS, preset_model
from profuse.timers import HeldIssue

WHERE = (  # (a piece of the file name, the label), first match wins
    ("/profuse/kernels/", "profuse launchers"),
    ("/profuse/", "profuse model and ops"),
    ("/triton/", "triton (Python)"),
    ("/torch/", "torch (Python)"),
)
TOP = 15
WARMUP = 3


def where(filename: str) -> str:
    for part, label in WHERE:
        if part in filename:
            return label
    return "built-ins and C" if filename.startswith(("~", "<")) else "other Python"


def calls(name: str, model: GPT, cfg, device: torch.device) -> dict:
    """The three forms of `model`'s step, named "NAME FORM"."""
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(0), device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights through every step
    amp = device.type == "cuda"

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            return model(idx, targets)[1]

    def step():
        forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def one_thread():
        with torch.autograd.set_multithreading_enabled(False):
            step()

    return {f"{name} step": step, f"{name} step, 1 thread": one_thread, f"{name} forward": forward}


def own_time(fn, steps: int) -> dict:
    """cProfile over `steps` calls of `fn`: seconds a call of each place's own time, and the
    functions with the most own time (per call)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    by_place: dict[str, float] = {}
    rows = []
    for (filename, line, func), (_, ncalls, tottime, _, _) in stats.stats.items():
        by_place[where(filename)] = by_place.get(where(filename), 0.0) + tottime / steps
        rows.append((tottime / steps, ncalls / steps, f"{Path(filename).name}:{line} {func}"))
    rows.sort(reverse=True)
    return {
        "seconds_by_place": dict(sorted(by_place.items(), key=lambda kv: -kv[1])),
        "top": [{"seconds": s, "calls": n, "function": f} for s, n, f in rows[:TOP]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=list(PRESETS), help="the built-in GPT's size")
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds of host time")
    p.add_argument("--profile-steps", type=int, default=10, help="steps under cProfile, each variant")
    p.add_argument("--out", type=Path, required=True, help="folder for host_gap.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.profile_steps < 1:
        p.error("--rounds and --profile-steps must be at least 1")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_model(args.preset)
    torch.manual_seed(0)
    with torch.device(device):
        eager = GPT(cfg)
    fused = fusion.apply_block_ops(copy.deepcopy(eager), fusion.FUSED)
    forms = {**calls("eager", eager, cfg, device), **calls("fused", fused, cfg, device)}
    print(f"{device}, preset {args.preset}: warming up (the fused kernels tune first)", flush=True)
    for fn in forms.values():
        for _ in range(WARMUP):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        issuer = HeldIssue(device)
        if not issuer.available:
            print("error: the GPU's sleep kernel did not calibrate: no exact host time", file=sys.stderr)
            return 1
        host = measure_host(forms, issuer, args.rounds, seed=0)
    else:
        host = cpu_host_times(forms, args.rounds, seed=0)
    result = {"preset": args.preset, "rounds": args.rounds, "host": {k: v.to_dict() for k, v in host.items()}}
    print(f"host time a call ({host['eager step'].method}, median of {args.rounds} rounds):")
    for form in ("step", "step, 1 thread", "forward"):
        he, hf = host[f"eager {form}"], host[f"fused {form}"]
        e, f = he.seconds, hf.seconds
        bound = " (at least)" if he.lower_bound or hf.lower_bound else ""
        if e is None or f is None:
            print(f"  {form:15s} not measured{bound}")
            continue
        e_ms, f_ms = e * 1e3, f * 1e3
        gap = f"fused - eager {f_ms - e_ms:+7.3f} ms{bound}"
        print(f"  {form:15s} eager {e_ms:8.3f} ms  fused {f_ms:8.3f} ms  {gap}")
    result["profile"] = {}
    for name in ("eager", "fused"):
        result["profile"][name] = own_time(forms[f"{name} step, 1 thread"], args.profile_steps)
        by_place = result["profile"][name]["seconds_by_place"]
        places = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in by_place.items())
        print(f"{name}, one thread under cProfile, own time a step (ms): {places}")
        for row in result["profile"][name]["top"][:8]:
            print(f"    {row['seconds'] * 1e6:9.1f} us  {row['calls']:7.1f} calls  {row['function']}")
    result["env"] = environment(device)
    result["provenance"] = provenance(started)
    path = write_json(args.out / "host_gap.json", result)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
