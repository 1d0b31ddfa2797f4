"""The LM head and its loss, fused, against eager, torch.compile and Liger-Kernel (CUDA only).

Per shape (tokens x hidden x vocab) and precision:
- bf16: bf16 hidden and weight, no autocast (gradients bf16);
- amp:  fp32 hidden and weight under torch.autocast("cuda", bfloat16) (bf16 matmuls, fp32 gradients),
every variant is first checked: its loss and both gradients against float64
(profuse.crossentropy.linear_cross_entropy_reference, the whole batch), the relative errors
recorded; one off by more than CHECK_TOL is reported as failed and not timed. Then forward +
backward (torch.autograd.grad of the loss: no .grad accumulation in the timing) in interleaved
trials, device time with the L2 flushed (profuse.bench.timing.compare, timing="device"), host
time per call beside it; then each variant's peak memory above the inputs, measured alone
(torch.cuda.max_memory_allocated after a reset, less what was allocated before: its transient
buffers and the gradients it returns, the same accounting for all). TFLOP/s counts 6NHV flops
(2NHV forward alone).

Variants (forward + backward):
    eager           F.linear, then Hugging Face's loss over the whole fp32 logits (the baseline)
    compile         torch.compile(eager), profuse's settings (fullgraph, static shapes)
    liger           Liger-Kernel's LigerFusedLinearCrossEntropyLoss (where importable)
    profuse         profuse.crossentropy.linear_cross_entropy (its chunk rule, fp32 accumulation)
    profuse-lowmem  profuse at Liger's chunk (tokens / ceil(V / H), to a power of two) and, in bf16,
                    Liger's accumulator (the weight's dtype): Liger's memory, for the time there
    profuse-compile torch.compile of profuse's op (the custom ops, no graph break)
Forward alone (inputs without grad): eager, liger, profuse. The chunk sweep (--sweep): profuse
at each of --chunks tokens, and in bf16 with each accumulator. --ce-configs: the
cross-entropy kernel alone at each launch candidate on one chunk's logits.

    PYTHONPATH=src python benchmarks/bench_linear_cross_entropy.py --out results/lce

Writes DIR/results.json (every timing, CI, check and peak, the environment) and prints a short
table last. About 2-3 minutes on an H200 (most of it torch.compile's first calls); --variants,
--shapes, --precisions and --no-sweep cut it down.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time

import torch

from profuse import crossentropy as CE
from profuse.bench.stats import speedup_ci
from profuse.bench.timing import compare
from profuse.compile import compile_fn
from profuse.env import environment
from profuse.errors import UsageError
from profuse.files import check_folder, write_json
from profuse.kernels import cross_entropy as K

try:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    HAS_LIGER = True
except Exception:  # ImportError, or a build that cannot load here
    HAS_LIGER = False

SHAPES = {  # name: (hidden, vocab)
    "llama-3.2-1b": (2048, 128256),
    "qwen3-0.6b": (1024, 151936),
    "h2048-v32000": (2048, 32000),
    "h2048-v262144": (2048, 262144),
}
DEFAULT_SHAPES = "llama-3.2-1b,qwen3-0.6b"
VARIANTS = ("eager", "compile", "liger", "profuse", "profuse-lowmem", "profuse-compile")
FORWARD_VARIANTS = ("eager", "liger", "profuse")
CHUNKS = "512,1024,2048,4096,8192"
# A variant whose loss or gradient is further than this from float64 (relative norm) is wrong,
# not merely rounded: 16 unit roundoffs of bf16 (profuse.tail.BACKWARD_TOL's bf16 figure).
CHECK_TOL = 16 * 2.0**-8
SEQ = 2048  # tokens a sequence; the batch is tokens / SEQ sequences, labels shifted inside
INIT_STD = 0.02  # Hugging Face's initializer_range: logits ~ N(0, 0.02^2 H)


def liger_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """Liger-Kernel 0.8.5's chunk: tokens / ceil(V / H), up to a power of two."""
    inc = -(-vocab // hidden)
    c = 1 << max(0, math.ceil(math.log2(-(-tokens // inc))))
    return min(c, tokens)


def make_inputs(tokens: int, hidden: int, vocab: int, precision: str, dev: torch.device, seed: int = 0):
    """hidden ~ N(0, 1) (a final norm's output), weight ~ N(0, INIT_STD^2), labels uniform with
    5% ignored; bf16 or fp32 (amp)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    h = torch.randn((tokens // SEQ, SEQ, hidden), generator=gen, device=dev).to(dtype)
    w = (INIT_STD * torch.randn((vocab, hidden), generator=gen, device=dev)).to(dtype)
    labels = torch.randint(0, vocab, (tokens // SEQ, SEQ), generator=gen, device=dev)
    labels[torch.rand(labels.shape, generator=gen, device=dev) < 0.05] = CE.IGNORE_INDEX
    return h, w, labels


def loss_fns(variants, tokens, hidden, vocab, precision) -> dict:
    """name -> loss(h, w, labels) for each variant asked for (and available)."""
    fns = {}
    lowmem = dict(chunk_size=liger_chunk(tokens, hidden, vocab),
                  accumulate="weight" if precision == "bf16" else "fp32")  # fmt: skip
    for name in variants:
        if name == "eager":
            fns[name] = CE.linear_cross_entropy_eager
        elif name == "compile":
            fns[name] = compile_fn(CE.linear_cross_entropy_eager)
        elif name == "liger" and HAS_LIGER:
            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=CE.IGNORE_INDEX)

            def liger_loss(h, w, labels, liger=liger):
                target = CE.shifted_labels(labels).reshape(-1)
                return liger(w, h.reshape(-1, h.shape[-1]), target)

            fns[name] = liger_loss
        elif name == "profuse":
            fns[name] = CE.linear_cross_entropy
        elif name == "profuse-lowmem":
            fns[name] = fused_with(**lowmem)
        elif name == "profuse-compile":
            fns[name] = compile_fn(CE.linear_cross_entropy)
    return fns


def fused_with(**knobs):
    """profuse's op with the kernel-level knobs (chunk_size, accumulate) set."""

    def loss(h, w, labels):
        target = CE.shifted_labels(labels).reshape(-1)
        return K.linear_cross_entropy_fused(h, w, target, CE.IGNORE_INDEX, None, **knobs)

    return loss


def autocast(precision: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if precision == "amp" else contextlib.nullcontext()


def fwd_bwd(fn, h, w, labels, precision):
    """A zero-argument call: the loss, then its gradients towards h and w."""

    def call():
        with autocast(precision):
            loss = fn(h, w, labels)
        return torch.autograd.grad(loss, (h, w))

    return call


def fwd_only(fn, h, w, labels, precision):
    def call():
        with torch.no_grad(), autocast(precision):
            return fn(h, w, labels)

    return call


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64 (inf if a is not finite)."""
    a64 = a.double()
    if not torch.isfinite(a64).all():
        return math.inf
    return float(torch.linalg.vector_norm(a64 - ref) / torch.linalg.vector_norm(ref))


def reference(h, w, labels) -> tuple[torch.Tensor, ...]:
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss = CE.linear_cross_entropy_reference(h64, w64, labels)
    gh, gw = torch.autograd.grad(loss, (h64, w64))
    return loss.detach(), gh, gw


def check(fns, h, w, labels, precision, dev) -> tuple[dict, dict]:
    """Each variant's first call, timed, and its errors against float64: ({name: check}, {name:
    first-call seconds}) for those that ran."""
    ref = reference(h, w, labels)
    checks, first = {}, {}
    for name, fn in fns.items():
        try:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with autocast(precision):
                loss = fn(h, w, labels)
            grads = torch.autograd.grad(loss, (h, w))
            torch.cuda.synchronize(dev)
            first[name] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 (out of memory, a build that fails: recorded)
            checks[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        errs = [rel_err(loss.detach(), ref[0]), rel_err(grads[0], ref[1]), rel_err(grads[1], ref[2])]
        checks[name] = {"ok": max(errs) <= CHECK_TOL, "loss_err": errs[0], "grad_hidden_err": errs[1],
                        "grad_weight_err": errs[2]}  # fmt: skip
        del loss, grads
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    return checks, first


def peak_bytes(call, dev) -> int:
    """The most `call` allocates above what was allocated before it (its outputs included)."""
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    out = call()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del out
    return int(peak)


def timed(calls, baseline, trials, dev, first=None) -> dict:
    """compare() of `calls`, then each one's peak memory, as a dict for the JSON."""
    if baseline not in calls:
        baseline = next(iter(calls))
    cmp = compare(calls, baseline, trials=trials, device=dev, timing="device", first_calls=first)
    out = cmp.to_dict()
    out["peak_bytes"] = {n: peak_bytes(c, dev) for n, c in calls.items()}
    out["warnings"] = cmp.warnings
    return out


def versus(result: dict, base: str, name: str) -> dict | None:
    """base time / name time with its paired CI, from one comparison's trials."""
    t = result["timings"]
    if base not in t or name not in t:
        return None
    sp = speedup_ci(t[base]["times_s"], t[name]["times_s"])
    return {"median": sp.median, "low": sp.low, "high": sp.high, "verdict": sp.verdict}


def sweep_calls(h, w, labels, precision, chunks) -> dict:
    calls = {}
    for c in chunks:
        for acc in ("fp32", "weight") if precision == "bf16" else ("fp32",):
            calls[f"chunk {c} {acc}"] = fwd_bwd(
                fused_with(chunk_size=c, accumulate=acc), h, w, labels, precision
            )
    return calls


def ce_config_calls(vocab: int, rows: int, dev) -> tuple[dict, int]:
    """The cross-entropy kernel alone on one chunk's bf16 logits, at each launch candidate (in
    place: later calls read the gradients, the same bytes). Returns (calls, bytes a call)."""
    z = torch.randn((rows, vocab), device=dev).to(torch.bfloat16)
    y = torch.randint(0, vocab, (rows,), device=dev)
    loss = torch.empty(rows, device=dev)
    count = torch.tensor(float(rows), device=dev)
    calls = {}
    for cfg in K.ce_candidates(vocab, torch.cuda.get_device_properties(dev).multi_processor_count):
        launch = K.ce_launch(cfg, rows, True)
        name = f"block {cfg.block_n} warps {cfg.num_warps} programs {cfg.programs or rows} l2 {cfg.l2}"
        calls[name] = lambda launch=launch: launch(
            z, y, loss, count, z.stride(0), rows, vocab, CE.IGNORE_INDEX, 0.0
        )
    return calls, 3 * rows * vocab * 2


def run_config(args, shape: str, precision: str, dev) -> dict:
    hidden, vocab = SHAPES[shape]
    tokens = args.tokens
    out: dict = {"shape": shape, "tokens": tokens, "hidden": hidden, "vocab": vocab, "precision": precision,
                 "liger_chunk": liger_chunk(tokens, hidden, vocab)}  # fmt: skip
    h, w, labels = make_inputs(tokens, hidden, vocab, precision, dev, seed=args.seed)
    h.requires_grad_()
    w.requires_grad_()
    flops = 6 * tokens * hidden * vocab
    fns = loss_fns(args.variants, tokens, hidden, vocab, precision)
    if "liger" in args.variants and not HAS_LIGER:
        out["liger"] = "liger-kernel is not importable here (pip install liger-kernel)"
    checks, first = check(fns, h, w, labels, precision, dev)
    out["check"] = checks
    ok = {n: fn for n, fn in fns.items() if checks[n]["ok"]}
    out["profuse_chunk"] = chosen_chunk(tokens, hidden, vocab)
    calls = {n: fwd_bwd(fn, h, w, labels, precision) for n, fn in ok.items()}
    if calls:
        res = timed(calls, "eager", args.trials, dev, {n: first[n] for n in calls})
        res["tflops"] = {n: flops / t["median_s"] / 1e12 for n, t in res["timings"].items()}
        res["vs_liger"] = {n: versus(res, "liger", n) for n in calls if n.startswith("profuse")}
        out["fwd_bwd"] = res
    if args.forward:
        hd, wd = h.detach(), w.detach()
        fcalls = {n: fwd_only(ok[n], hd, wd, labels, precision) for n in FORWARD_VARIANTS if n in ok}
        if fcalls:
            res = timed(fcalls, "eager", args.trials, dev)
            res["tflops"] = {n: flops / 3 / t["median_s"] / 1e12 for n, t in res["timings"].items()}
            res["vs_liger"] = {"profuse": versus(res, "liger", "profuse")}
            out["forward"] = res
    if args.sweep:
        scalls = sweep_calls(h, w, labels, precision, [c for c in args.chunks if c <= tokens])
        res = timed(scalls, next(iter(scalls)), args.trials, dev)
        res["tflops"] = {n: flops / t["median_s"] / 1e12 for n, t in res["timings"].items()}
        out["sweep"] = res
    if args.ce_configs and precision == "bf16":
        ccalls, nbytes = ce_config_calls(vocab, min(tokens, 2048), dev)
        res = timed(ccalls, next(iter(ccalls)), args.trials, dev)
        res["bytes_per_call"] = nbytes
        res["gbps"] = {n: nbytes / t["median_s"] / 1e9 for n, t in res["timings"].items()}
        out["ce_configs"] = res
    del h, w, labels, fns, calls
    gc.collect()
    torch.cuda.empty_cache()
    return out


def chosen_chunk(tokens: int, hidden: int, vocab: int) -> list[int]:
    """The chunks profuse's plans chose at this shape (by the rule: requested chunk 0)."""
    return sorted({p.chunk for k, p in K.PLANS.items() if k[:3] == (tokens, hidden, vocab) and k[7] == 0})


def table(results: list[dict]) -> str:
    """The short table: per shape, precision and variant, forward + backward."""
    lines = [
        f"{'shape':<14} {'prec':<5} {'variant':<16} {'fwd+bwd':>10} {'host':>9} {'vs eager':>15} "
        f"{'vs liger':>15} {'peak':>9} {'TFLOP/s':>8} {'dW err':>8}"
    ]
    for r in results:
        res = r.get("fwd_bwd", {})
        for name, chk in r["check"].items():
            head = f"{r['shape']:<14} {r['precision']:<5} {name:<16}"
            if not chk["ok"]:
                lines.append(f"{head} FAILED: {chk.get('error') or _errs(chk)}")
                continue
            t = res["timings"][name]
            sp = res["speedups"].get(name)
            vs_e = f"{sp['median']:.2f}x ({sp['low']:.2f}-{sp['high']:.2f})" if sp else "baseline"
            vl = (res.get("vs_liger") or {}).get(name)
            vs_l = f"{vl['median']:.2f}x ({vl['low']:.2f}-{vl['high']:.2f})" if vl else ""
            host = f"{t['host_s'] * 1e3:.2f} ms" if t["host_s"] is not None else "-"
            lines.append(
                f"{head} {t['median_s'] * 1e3:7.2f} ms {host:>9} {vs_e:>15} {vs_l:>15} "
                f"{res['peak_bytes'][name] / 1e9:6.2f} GB {res['tflops'][name]:8.1f} "
                f"{chk['grad_weight_err']:8.1e}"
            )
        if "sweep" in r:
            s = r["sweep"]
            cells = [f"{n.removeprefix('chunk ')}: {s['timings'][n]['median_s'] * 1e3:.2f} ms "
                     f"{s['peak_bytes'][n] / 1e9:.2f} GB" for n in s["timings"]]  # fmt: skip
            lines.append(f"  sweep {r['shape']} {r['precision']}: " + "; ".join(cells))
    return "\n".join(lines)


def _errs(chk: dict) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in chk.items() if k.endswith("_err"))


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def names(allowed):
    def parse(text: str) -> list[str]:
        out = [x for x in text.split(",") if x]
        bad = [x for x in out if x not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return out

    return parse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--tokens", type=int, default=8192, help="tokens a batch (a multiple of 2048)")
    p.add_argument("--shapes", type=names(tuple(SHAPES)), default=DEFAULT_SHAPES.split(","),
                   help=f"of {', '.join(SHAPES)} (default {DEFAULT_SHAPES})")  # fmt: skip
    p.add_argument("--precisions", type=names(("bf16", "amp")), default=["bf16", "amp"], help="bf16, amp")
    p.add_argument("--variants", type=names(VARIANTS), default=list(VARIANTS), help=", ".join(VARIANTS))
    p.add_argument("--trials", type=int, default=10, help="interleaved trials per comparison")
    p.add_argument("--chunks", type=int_list, default=int_list(CHUNKS), help="the sweep's chunks, in tokens")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the chunk sweep")
    p.add_argument("--no-forward", dest="forward", action="store_false", help="skip the forward-alone timing")
    p.add_argument(
        "--ce-configs", action="store_true", help="also time the cross-entropy kernel's candidates"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_linear_cross_entropy: needs a CUDA device", file=sys.stderr)
        return 2
    if args.tokens % SEQ or args.trials < 2:
        print(f"bench_linear_cross_entropy: --tokens must be a multiple of {SEQ}, --trials at least 2",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        check_folder(args.out, ("results.json",))
    except UsageError as err:
        print(f"bench_linear_cross_entropy: {err}", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    results = []
    for shape in args.shapes:
        for precision in args.precisions:
            results.append(run_config(args, shape, precision, dev))
            print(f"{shape} {precision}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    data = {"environment": environment(dev), "args": vars(args), "check_tol": CHECK_TOL,
            "has_liger": HAS_LIGER, "results": results, "wall_s": time.perf_counter() - t0}  # fmt: skip
    write_json(f"{args.out}/results.json", data)
    for r in results:
        for part in ("fwd_bwd", "forward", "sweep", "ce_configs"):
            for line in r.get(part, {}).get("warnings", []):
                print(f"{r['shape']} {r['precision']} {part}: {line}")
    print(table(results))
    print("device time, L2 flushed; peak = memory above the inputs; dW err = ||dW - float64|| / ||float64||")
    print(f"{time.perf_counter() - t0:.0f} s; {args.out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
