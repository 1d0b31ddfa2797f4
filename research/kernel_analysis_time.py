"""How much of compile+fused's longer compile is torch working out what each Triton launch writes.

    PYTHONPATH=src python research/kernel_analysis_time.py --out DIR     # about 4 minutes on an H100

On an H100 (2026-12-07, late, `benchmarks/results/h100-2026-12-07-late/llama-both/step.json`,
its `compile` phases) compile+fused's first step of Llama-3.2-1B took 12.7 s (amp) and 15.5 s
(bf16) longer in torch.compile than compile's. Dynamo's own bytecode tracing is 2.3-4.1 s of
that; the rest is downstream: AOTAutograd's joint trace (+5.3-6.5 s), Inductor's
GraphLowering.run (+7.5-8.8 s) and its pass decomposing the Triton-kernel wrappers (+2.9-3.3 s).
Under torch.compile on CUDA profuse's fused ops are Triton ops whose launches Inductor inlines
(kernels/autotune.py); for every such launch torch derives which arguments the kernel reads and
writes by compiling it to TTIR and walking the result, and it does so separately in
functionalization, in two places of Inductor's lowering and in the kernel's IR node, with no
cache between them (pytorch/pytorch#193227, open on 2026-08-12, says so). The 16 layers launch
the same kernels with the same arguments' kinds, so nearly every analysis repeats one already
made.

This probe compiles the model's training step (forward, loss, backward) cold, each variant in a
fresh process with empty Inductor and Triton caches, and times torch's analysis functions
(whichever of generate_ttir, identify_accessed_tensors, identify_mutated_tensors the torch has):
the calls that reach torch, their seconds and their distinct launch signatures. Variants:

    compile                   the model as built, torch.compile
    compile+fused, memo off   profuse.fuse, then torch.compile, PROFUSE_ANALYSIS_MEMO=0 (the
                              default): torch analyses every launch
    compile+fused, memo on    the same with profuse's memo (kernels/launch_analysis.py,
                              PROFUSE_ANALYSIS_MEMO=1): each launch signature analysed once; the
                              loss and every gradient compared with the run above

Prediction, written before a card ran it: without the memo the analysis takes at least 6 s of
compile+fused's first step in bf16, and the memo cuts that first step by at least 5 s, the loss
and every gradient bitwise the same.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("compile", "compile+fused, memo off", "compile+fused, memo on")
ANALYSIS = ("generate_ttir", "identify_accessed_tensors", "identify_mutated_tensors")


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """A launch's signature as profuse's memo reads it (kernels.launch_analysis.signature); any
    other kernel by itself: how many distinct launches torch analysed."""
    from profuse.kernels.launch_analysis import signature

    return signature(args, kwargs) or ("not profuse's", id(args[0]) if args else None)


def watch() -> dict:
    """Wrap torch's analysis functions, before profuse's memo wraps the one it answers: calls,
    seconds (inclusive: generate_ttir runs inside the others) and distinct launch signatures of
    each, counting only the calls that reach torch."""
    import torch._higher_order_ops.triton_kernel_wrap as W

    stats = {n: {"calls": 0, "seconds": 0.0, "keys": set()} for n in ANALYSIS if hasattr(W, n)}

    def wrap(name, orig):
        @functools.wraps(orig)
        def timed(*args, **kwargs):
            s = stats[name]
            s["calls"] += 1
            s["keys"].add(launch_key(args, kwargs))
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                s["seconds"] += time.perf_counter() - t0

        return timed

    for name in stats:
        setattr(W, name, wrap(name, getattr(W, name)))
    return stats


def one(variant: str, preset: str, precision: str, layers: int | None, out: Path) -> dict:
    """One variant's cold first step in this process."""
    import torch

    import profuse
    from profuse.compiletime import split_compile
    from profuse.models import model_spec

    stats = watch()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    spec = model_spec("hf:llama", preset, batch_size=4 if device.type == "cuda" else 1,
                      seq_len=2048 if device.type == "cuda" else 64)  # fmt: skip
    if layers:
        spec.config.num_hidden_layers = layers
    with torch.device(device):
        model = spec.build_for(device, 0, precision)
    if "fused" in variant:
        profuse.fuse(model)
    compiled = torch.compile(model)
    ids = torch.randint(0, spec.config.vocab_size, (spec.batch_size, spec.seq_len), device=device,
                        generator=torch.Generator(device).manual_seed(1))  # fmt: skip
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "amp")
    t0 = time.perf_counter()
    with split_compile() as split:
        with autocast:
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"loss": loss.detach().float().cpu(), "grads": grads}, out)
    phases = split[0].phases if split else {}
    return {
        "variant": variant,
        "first_step_s": first_s,
        "dynamo_s": phases.get("_compile.compile_inner"),
        "phases": {k: v for k, v in sorted(phases.items(), key=lambda kv: -kv[1])[:25]},
        "analysis": {
            name: {"calls": s["calls"], "seconds": s["seconds"], "signatures": len(s["keys"])}
            for name, s in stats.items()
        },
        "memo": memo_counts(),
        "loss": float(loss),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def memo_counts() -> dict:
    """profuse's memo (kernels/launch_analysis.py) over the run: answers it gave, answers torch made."""
    import torch._higher_order_ops.triton_kernel_wrap as W

    from profuse.kernels.launch_analysis import ANALYSIS_NAMES

    for name in ANALYSIS_NAMES:
        fn = getattr(W, name, None)
        if fn is not None and hasattr(fn, "hits"):
            return {"function": name, "hits": fn.hits, "misses": fn.misses}
    return {}


def compare(a: Path, b: Path) -> dict:
    """The loss and every gradient of two runs: bitwise equal, or the largest relative difference."""
    import torch

    x, y = torch.load(a), torch.load(b)
    worst, name_worst, equal = 0.0, "", bool(torch.equal(x["loss"], y["loss"]))
    for name, g in x["grads"].items():
        h = y["grads"][name]
        if not torch.equal(g, h):
            equal = False
            rel = float((g - h).norm() / g.norm().clamp_min(1e-30))
            if rel > worst:
                worst, name_worst = rel, name
    return {"bitwise_equal": equal, "worst_relative": worst, "worst_tensor": name_worst,
            "loss": [float(x["loss"]), float(y["loss"])]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default=None, help="hf:llama preset (default: Llama-3.2-1B on CUDA, tiny on a CPU)"
    )
    p.add_argument("--precision", default="bf16", choices=["bf16", "amp"])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--out", type=Path, required=True, help="folder for kernel_analysis.json")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one, in a child
    p.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    if args.variant:  # a child: one variant, alone in its process, its caches empty
        print(json.dumps(one(args.variant, args.preset, args.precision, args.layers, args.grads)))
        return 0
    if args.preset is None:
        import torch

        args.preset = "Llama-3.2-1B" if torch.cuda.is_available() else "tiny"
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.mkdir(parents=True, exist_ok=True)
    results, grads = [], {}
    with tempfile.TemporaryDirectory(prefix="profuse-analysis-") as tmp:
        for i, variant in enumerate(VARIANTS):
            env = dict(
                os.environ,
                TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor-{i}",
                TRITON_CACHE_DIR=f"{tmp}/triton-{i}",
                PROFUSE_ANALYSIS_MEMO="0" if variant.endswith("memo off") else "1",
            )
            grads[variant] = Path(tmp) / f"grads-{i}.pt"
            cmd = [sys.executable, __file__, "--variant", variant, "--preset", args.preset, "--precision",
                   args.precision, "--out", str(args.out), "--grads", str(grads[variant])]  # fmt: skip
            if args.layers:
                cmd += ["--layers", str(args.layers)]
            print(
                f"{variant}: compiling hf:llama {args.preset} ({args.precision}) cold, in its own process",
                flush=True,
            )
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"error: {variant} failed: {last}", file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            seen = ", ".join(
                f"{n} {a['calls']} calls, {a['seconds']:.2f} s, {a['signatures']} signatures"
                for n, a in r["analysis"].items()
            )
            if r["memo"]:
                seen += f"; profuse's memo answered {r['memo']['hits']}, torch {r['memo']['misses']}"
            dynamo = "not timed" if r["dynamo_s"] is None else f"{r['dynamo_s']:.1f} s"
            print(f"    first step {r['first_step_s']:.1f} s, Dynamo (the forward's compile within) "
                  f"{dynamo}; {seen or 'no analysis function seen'}")  # fmt: skip
        same = compare(grads["compile+fused, memo off"], grads["compile+fused, memo on"])
    print(
        "compile+fused with and without the memo: "
        + (
            "loss and every gradient bitwise equal"
            if same["bitwise_equal"]
            else f"not bitwise equal; worst {same['worst_tensor']} {same['worst_relative']:.1e} relative"
        )  # fmt: skip
    )
    from profuse.env import provenance
    from profuse.files import write_json

    data = {"preset": args.preset, "precision": args.precision, "layers": args.layers, "results": results,
            "memo_vs_plain": same, "provenance": provenance(started)}  # fmt: skip
    path = write_json(args.out / "kernel_analysis.json", data)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
