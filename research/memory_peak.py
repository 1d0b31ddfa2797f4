"""Where a training step's peak memory is, and what is live there, for each way of running it.

    PYTHONPATH=src python research/memory_peak.py --out DIR [--preset Llama-3.2-1B] [--arch llama]

For each variant (eager, profuse.fuse with its defaults and with the loss's chunk and accumulator
overridden, Liger-Kernel's full patch), on CUDA, with bf16 parameters and AdamW:
- the peak allocated above the parameters and AdamW state in each of three whole steps (step 1
  creates AdamW's state and runs any tuning; 2 and 3 are the steady steps), from torch.cuda's
  peak counters;
- for a fourth step, the allocator's own history (torch.cuda.memory._record_memory_history):
  the moment of the peak (forward, backward or optimizer, found from marker allocations), and
  the bytes live then, grouped by the innermost Python frame in profuse, Liger-Kernel,
  transformers or torch.optim that allocated them ("native" where no Python frame did: the
  autograd engine's own backward).
- at that step's end of forward (the steady peak of a training step), the allocator's segments
  as they stand: the bytes in split blocks not in use (what reserved holds above allocated), and
  which allocations, by frame, hold the segments those blocks are cut from;
- the median of 5 steps' device time (CUDA events), to see what a setting costs.

Writes DIR/memory_peak.json; prints one block a variant.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from profuse.models import liger as L
from profuse.models.hf import hf_spec

MARK = 512 * 1009  # marker allocations: MARK + 512 k bytes, k = phase index (unique small sizes)
PHASES = ("forward", "backward", "optimizer", "end")
KEEP = ("profuse/", "liger_kernel/", "transformers/", "torch/optim/")


def variants() -> list[tuple[str, dict[str, str], str]]:
    """(name, environment, how it is built)."""
    return [
        ("eager", {}, "eager"),
        ("fused", {}, "fused"),
        ("fused accum=weight", {"PROFUSE_CE_ACCUM": "weight"}, "fused"),
        ("fused chunk=2048", {"PROFUSE_CE_CHUNK": "2048"}, "fused"),
        ("fused chunk=512", {"PROFUSE_CE_CHUNK": "512"}, "fused"),
        (
            "fused chunk=1024 accum=weight",
            {"PROFUSE_CE_CHUNK": "1024", "PROFUSE_CE_ACCUM": "weight"},
            "fused",
        ),  # fmt: skip
        ("fused chunk=512 accum=weight", {"PROFUSE_CE_CHUNK": "512", "PROFUSE_CE_ACCUM": "weight"}, "fused"),
        ("liger", {}, "liger"),
    ]


def mark(k: int, device) -> None:
    torch.empty(MARK + 512 * k, dtype=torch.uint8, device=device)


def frame_of(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        for keep in KEEP:
            i = name.find(keep)
            if i >= 0:
                return f"{name[i:]}:{f.get('line')} {f.get('name')}"
    return "native (no Python frame)"


def peak_breakdown(snapshot: dict, device_index: int = 0) -> dict:
    """Replay the trace: the peak of bytes allocated during the recorded step, the phase it falls
    in, and what was live then, by allocating frame."""
    trace = snapshot["device_traces"][device_index]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    phase = "before"
    peak_phase = phase
    markers = {MARK + 512 * k: name for k, name in enumerate(PHASES)}
    for e in trace:
        action = e["action"]
        if action == "alloc":
            if e["size"] in markers:
                phase = markers[e["size"]]
                continue
            live[e["addr"]] = (e["size"], frame_of(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, peak_phase, peak_live = total, phase, dict(live)
        elif action == "free_completed":
            if e["size"] in markers:
                continue
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            else:  # allocated before the recording: its free lowers the step's total
                total -= e["size"]
    groups: dict[str, int] = {}
    for size, where in peak_live.values():
        groups[where] = groups.get(where, 0) + size
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:25]
    return {"peak_above_start_bytes": peak, "phase": peak_phase, "live_by_frame": top}


def split_blocks(snapshot: dict, device_index: int = 0, top: int = 12) -> dict:
    """The allocator's segments at one moment (torch.cuda.memory._snapshot()): reserved,
    allocated, the bytes of inactive blocks in segments that also hold a live block (split blocks,
    what the caching allocator cannot hand back or give whole to a larger request), and, for the
    largest of those, the frames of the live blocks in the same segment, each credited with the
    segment's inactive bytes in proportion to its own size."""
    segments = [s for s in snapshot["segments"] if s.get("device", device_index) == device_index]
    reserved = sum(s["total_size"] for s in segments)
    allocated = inactive_split = inactive_free = 0
    pinned: dict[str, float] = {}
    worst = []
    for seg in segments:
        blocks = seg["blocks"]
        live = [b for b in blocks if b["state"] != "inactive"]
        idle = sum(b["size"] for b in blocks if b["state"] == "inactive")
        allocated += sum(b["size"] for b in live)
        if not live:
            inactive_free += idle  # a whole free segment: empty_cache could release it
            continue
        inactive_split += idle
        if not idle:
            continue
        held = sum(b["size"] for b in live)
        for b in live:
            where = frame_of(b.get("frames", []))
            pinned[where] = pinned.get(where, 0.0) + idle * b["size"] / held
        worst.append(
            {
                "segment_bytes": seg["total_size"],
                "inactive_bytes": idle,
                "live": sorted(
                    ((b["size"], frame_of(b.get("frames", []))) for b in live), key=lambda t: -t[0]
                )[:4],
            }
        )
    worst.sort(key=lambda w: -w["inactive_bytes"])
    return {
        "segments": len(segments),
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "inactive_split_bytes": inactive_split,
        "inactive_whole_segment_bytes": inactive_free,
        "split_bytes_by_live_frame": sorted(pinned.items(), key=lambda kv: -kv[1])[:top],
        "worst_segments": worst[:top],
    }


def build(spec, how: str, device):
    model = spec.build_for(device, 0, "bf16")
    ctx = None
    if how == "fused":
        spec.fuse(model)
    elif how == "liger":
        ctx = L.patch(model, spec.family)
    return model, ctx


def run_variant(spec, name: str, env: dict, how: str, device) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model, ctx = build(spec, how, device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        batch = spec.batch(device)

        at_peak: dict = {}

        def step(marks: bool = False) -> None:
            import contextlib

            with ctx if ctx is not None else contextlib.nullcontext():
                if marks:
                    mark(0, device)
                loss = spec.loss(model, batch)
                if marks:
                    mark(1, device)
                    at_peak.update(split_blocks(torch.cuda.memory._snapshot(), device.index or 0))
                loss.backward()
            if marks:
                mark(2, device)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if marks:
                mark(3, device)

        out: dict = {"env": env}
        base = torch.cuda.memory_allocated(device)
        peaks = []
        for i in range(3):
            torch.cuda.synchronize(device)
            if i == 1:  # AdamW's state exists from the first step on
                base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        out["resident_bytes"] = base
        out["step_peak_above_resident_bytes"] = peaks  # step 1 against the parameters alone
        out["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        step(marks=True)
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["recorded_step"] = peak_breakdown(snap, device.index or 0)
        out["end_of_forward_segments"] = at_peak
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        out["step_ms"] = statistics.median(times)
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="llama")
    p.add_argument("--preset", default="Llama-3.2-1B")
    p.add_argument("--only", default="", help="comma-separated variant names (default all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    spec = hf_spec(args.arch, args.preset)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    results = {}
    out_path = Path(args.out) / "memory_peak.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for name, env, how in variants():
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            r = run_variant(spec, name, env, how, device)
        except Exception as err:  # one variant's failure is a row, not the end of the run
            r = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"}
        gc.collect()  # the variant's model and AdamW state, before the next is built
        torch.cuda.empty_cache()
        results[name] = r
        gb = 1e9
        if "error" in r:
            print(f"{name}: {r['error']}", flush=True)
        else:
            rec = r["recorded_step"]
            print(
                f"{name} ({time.time() - t0:.0f} s): {r['step_ms']:.1f} ms; peak above resident per step "
                + ", ".join(f"{b / gb:.2f}" for b in r["step_peak_above_resident_bytes"])
                + f" GB; reserved {r['reserved_bytes'] / gb:.2f} GB; recorded peak "
                f"{rec['peak_above_start_bytes'] / gb:.2f} GB in {rec['phase']}",
                flush=True,
            )
            for where, size in rec["live_by_frame"][:12]:
                print(f"    {size / 1e6:9.1f} MB  {where}", flush=True)
            seg = r["end_of_forward_segments"]
            print(
                f"  end of forward: reserved {seg['reserved_bytes'] / gb:.2f} GB in {seg['segments']} "
                f"segments, allocated {seg['allocated_bytes'] / gb:.2f}, in split blocks not in use "
                f"{seg['inactive_split_bytes'] / gb:.2f}, whole free segments "
                f"{seg['inactive_whole_segment_bytes'] / gb:.2f}; the split bytes by the live blocks "
                "that hold their segments:",
                flush=True,
            )
            for where, size in seg["split_bytes_by_live_frame"][:8]:
                print(f"    {size / 1e6:9.1f} MB  {where}", flush=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"preset": args.preset, "arch": args.arch, "results": results}, indent=1))
        tmp.replace(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
