"""Where torch.compile's Dynamo stage spends its time on a Hugging Face model, plain and fused.

    PYTHONPATH=src python research/dynamo_time.py [--arch llama] [--layers 16] [--out DIR]

On an H100 (2026-12-07, late, `benchmarks/results/h100-2026-12-07-late/llama-both/`) the first
step of compile+fused spent 37.8 s in Dynamo (the forward's compile within) against compile's
22.3 s, Llama-3.2-1B in bf16, in each precision of `--precision both`. This probe measures the
same thing where it can be seen without a card: the model's tiny preset widened to `--layers`
decoder layers, compiled with `backend="eager"` (Dynamo alone: no AOTAutograd, no Inductor), one
forward. For each of plain (the model as built) and fused (`profuse.fuse`) it reports Dynamo's
own compile time (torch's phase timers, as profuse.compiletime reads them) and, by timing every
frame Dynamo inlines (`InliningInstructionTranslator.inline_call_`), each frame's own time and
the files that hold it.

The frame timing patches a private Dynamo method; where a torch release has renamed it, the
breakdown is left out and the totals still print.

On a CPU (torch 2.13, 2026-12-07, 16 layers): Dynamo 3.1-3.7 s plain, 5.9-6.0 s fused (the
frame timing on or off, three runs), about 2 minutes in all with the Triton interpreter.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TOP = 20


def frame_timer():
    """Patch Dynamo's inline_call_ to time each inlined frame; returns the stats dict
    ("file:line name" -> [calls, inclusive s, own s]) or None where it cannot."""
    try:
        import torch._dynamo.symbolic_convert as SC
    except ImportError:
        return None
    cls = getattr(SC, "InliningInstructionTranslator", None)
    orig = getattr(cls, "inline_call_", None)
    if orig is None:
        return None
    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    stack: list[float] = []

    def timed(self):
        code = self.f_code
        key = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} {code.co_name}"
        t0 = time.perf_counter()
        stack.append(0.0)
        try:
            return orig(self)
        finally:
            dt = time.perf_counter() - t0
            inner = stack.pop()
            s = stats[key]
            s[0] += 1
            s[1] += dt
            s[2] += dt - inner
            if stack:
                stack[-1] += dt

    cls.inline_call_ = timed
    return stats


def one(arch: str, layers: int, fused: bool) -> dict:
    """One variant in this process: Dynamo's compile time and, where it can, the breakdown."""
    import torch

    import profuse
    from profuse.compiletime import split_compile
    from profuse.models import model_spec

    stats = frame_timer()
    torch.manual_seed(0)
    spec = model_spec(f"hf:{arch}", "tiny", batch_size=1, seq_len=64)
    spec.config.num_hidden_layers = layers
    model = spec.build_for(torch.device("cpu"), 0, "amp")  # fp32 parameters
    if fused:
        profuse.fuse(model)
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, spec.config.vocab_size, (1, 64))
    with split_compile() as split:
        compiled(input_ids=ids, labels=ids)
    out = {"dynamo_s": split[0].phases.get("_compile.compile_inner", float("nan"))}
    if stats is not None:
        by_file: collections.Counter = collections.Counter()
        for key, (_, _, own) in stats.items():
            by_file[key.split(":")[0]] += own
        out["files_own_s"] = dict(by_file.most_common(TOP))
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP]
        out["frames"] = [
            {"frame": k, "calls": c, "inclusive_s": inc, "own_s": own} for k, (c, inc, own) in top
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", help="a Hugging Face architecture profuse builds (hf:ARCH)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B has 16)")
    p.add_argument("--out", type=Path, help="folder for dynamo_time.json")
    p.add_argument("--variant", choices=["plain", "fused"], help=argparse.SUPPRESS)  # one, in a child
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be at least 1")
    if args.variant:  # a child: one variant, alone in its process (Dynamo's counters are global)
        print(json.dumps(one(args.arch, args.layers, args.variant == "fused")))
        return 0
    results = {}
    for variant in ("plain", "fused"):
        print(f"{variant}: compiling {args.layers} layers of hf:{args.arch} tiny, Dynamo only", flush=True)
        cmd = [sys.executable, __file__, "--arch", args.arch, "--layers", str(args.layers)]
        cmd += ["--variant", variant]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"error: the {variant} run failed: {last}", file=sys.stderr)
            return 1
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    for variant, r in results.items():
        print(f"{variant}: Dynamo {r['dynamo_s']:.2f} s")
        for name, own in list(r.get("files_own_s", {}).items())[:8]:
            print(f"    {own:6.2f} s own  {name}")
    if args.out:
        from profuse.env import provenance
        from profuse.files import write_json

        args.out.mkdir(parents=True, exist_ok=True)
        data = {"arch": args.arch, "layers": args.layers, "results": results, "provenance": provenance()}
        write_json(args.out / "dynamo_time.json", data)
        print(f"results: {args.out / 'dynamo_time.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
