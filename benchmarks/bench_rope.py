"""RoPE, Qwen3's q/k norm + RoPE, and a plain RMSNorm: profuse's Triton kernels against Hugging
Face's eager math, torch.compile of that math, and Liger-Kernel's kernels (where importable).

Cases (B 4, T 2048 tokens; bf16, and "amp": bf16 q and k with fp32 cos, sin and norm weights
under bf16 autocast, as an fp32 model trains under amp):
    rope          Llama-3.2-1B (32 / 8 heads, D 64), Qwen2.5-0.5B (14 / 2, D 64)
    qk_norm_rope  Qwen3-0.6B (16 / 8, D 128); Liger: its RMSNorm on q and k, then its rope
    rms_norm      8192 x 2048 and 8192 x 1024, bf16; Liger: LigerRMSNorm's function
Variants: eager (profuse.rotary / blockops' eager ops: Hugging Face's math op for op), compile
(torch.compile of it, profuse's settings), liger, profuse. Inputs as a model passes them: q and k
are views of (B, T, H*D) projections (transposed for rope), the gradients arrive stored as
(B, T, H, D) (SDPA's backward); each variant has its own copies (Liger writes in place).

Each variant is first checked against float64 (outputs within profuse.tail.FORWARD_TOL,
gradients within BACKWARD_TOL, of the output's dtype); a wrong one is reported failed and never
timed. Then profuse.bench.timing.compare: device time (CUDA events, L2 flushed, interleaved
trials), host time per call beside it, forward (no grad) and forward + backward.

Byte model (the minimum traffic of the op, every tensor read or written once, in profuse's
dtypes; the norm weights, rstd and dw partials are left out, < 0.2%):
    rope          fwd: read q, k, cos, sin; write q_out, k_out.  bwd: read dq_out, dk_out, cos,
                  sin; write dq, dk   (cos and sin (1, T, D): once, not once per batch row)
    qk_norm_rope  fwd: as rope.  bwd: read dq_out, dk_out, q, k, cos, sin; write dq, dk
    rms_norm      fwd: read x; write y.  bwd: read dy, x; write dx
Bandwidth = those bytes / median time; % of copy = that over a device-to-device copy measured
in the same run (profuse.bench.traffic.copy_ceiling). Every variant is measured on the same
model, so the % compares variants at equal work.

    PYTHONPATH=src python benchmarks/bench_rope.py --out benchmarks/results/h200-DATE-rope
    PYTHONPATH=src python benchmarks/bench_rope.py --ops rope --small --device cpu --out /tmp/r
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from profuse import blockops as B
from profuse import rotary as R
from profuse import tail as T
from profuse.bench import DEFAULT_TRIALS
from profuse.bench.stats import speedup_ci
from profuse.bench.timing import compare
from profuse.bench.traffic import copy_ceiling
from profuse.compile import compile_fn
from profuse.env import environment
from profuse.errors import UsageError
from profuse.files import check_folder, write_json

try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    HAS_LIGER = True
except Exception:  # ImportError, or a liger build that cannot load here
    HAS_LIGER = False
LIGER_MISSING = "liger-kernel is not installed (pip install liger-kernel)"

EPS = 1e-6
BF16, FP32 = torch.bfloat16, torch.float32
VARIANTS = ("eager", "compile", "liger", "profuse")
OPS = ("rope", "qk_norm_rope", "rms_norm")


def results_name(ops: list[str]) -> str:
    """bench_rope.json for every op; a run of some ops names them (two runs share a folder)."""
    return "bench_rope.json" if set(ops) == set(OPS) else f"bench_rope-{'-'.join(ops)}.json"


@dataclass(frozen=True)
class Case:
    op: str  # rope, qk_norm_rope, rms_norm
    model: str  # whose shapes
    shape: tuple[int, ...]  # (B, T, Hq, Hk, D), or (rows, cols) for rms_norm
    amp: bool = False  # fp32 cos, sin and weights, bf16 autocast

    @property
    def name(self) -> str:
        return f"{self.op} {self.model} {'x'.join(map(str, self.shape))} {'amp' if self.amp else 'bf16'}"


CASES = [
    Case("rope", "Llama-3.2-1B", (4, 2048, 32, 8, 64)),
    Case("rope", "Llama-3.2-1B", (4, 2048, 32, 8, 64), amp=True),
    Case("rope", "Qwen2.5-0.5B", (4, 2048, 14, 2, 64)),
    Case("rope", "Qwen2.5-0.5B", (4, 2048, 14, 2, 64), amp=True),
    Case("qk_norm_rope", "Qwen3-0.6B", (4, 2048, 16, 8, 128)),
    Case("qk_norm_rope", "Qwen3-0.6B", (4, 2048, 16, 8, 128), amp=True),
    Case("rms_norm", "Llama-3.2-1B hidden", (8192, 2048)),
    Case("rms_norm", "Qwen3-0.6B hidden", (8192, 1024)),
]


def small(case: Case) -> Case:
    """The same case at a few tokens (a smoke run on a CPU, through Triton's interpreter)."""
    if case.op == "rms_norm":
        return Case(case.op, case.model, (16, case.shape[1] // 16), case.amp)
    _, _, hq, hk, d = case.shape
    return Case(case.op, case.model, (1, 8, hq, hk, d), case.amp)


# --------------------------------------------------------------------------------------------
# The variants: each op's functions, and its inputs as a model passes them
# --------------------------------------------------------------------------------------------


def liger_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """Liger's own pieces for Qwen3's attention: its RMSNorm on q and k, then its rope."""
    qn = LigerRMSNormFunction.apply(q, q_weight, eps)
    kn = LigerRMSNormFunction.apply(k, k_weight, eps)
    return liger_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)


def op_functions(op: str) -> dict:
    """name -> the op's function for each variant available here (liger only where importable)."""
    eager, fused = {
        "rope": (R.rope_eager, R.rope),
        "qk_norm_rope": (R.qk_norm_rope_eager, R.qk_norm_rope),
        "rms_norm": (B.rms_norm_eager, B.rms_norm),
    }[op]
    fns = {"eager": eager, "compile": compile_fn(eager), "profuse": fused}
    if HAS_LIGER:
        fns["liger"] = {
            "rope": lambda q, k, c, s: liger_rotary_pos_emb(q, k, c, s),
            "qk_norm_rope": liger_qk_norm_rope,
            "rms_norm": lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps),
        }[op]
    return fns


def reference(op: str):
    return {
        "rope": R.rope_reference,
        "qk_norm_rope": R.qk_norm_rope_reference,
        "rms_norm": B.rms_norm_reference,
    }[op]


@dataclass
class Inputs:
    """One variant's own copies: the leaves (projections, weights or x), the constants (cos and
    sin), and the incoming gradients of each output in bf16 and fp32 (the same values)."""

    leaves: list[torch.Tensor]
    consts: list[torch.Tensor]
    grads: list[dict[torch.dtype, torch.Tensor]]

    def copy(self) -> Inputs:
        leaves = [t.detach().clone().requires_grad_() for t in self.leaves]
        return Inputs(
            leaves,
            [t.clone() for t in self.consts],
            [{k: v.clone() for k, v in g.items()} for g in self.grads],
        )


def rotary_table(t: int, d: int, dtype: torch.dtype, dev: torch.device):
    """Hugging Face's default rope (theta 10000) at positions 0..t-1: (cos, sin), each (1, t, d)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d))
    freqs = torch.arange(t, dtype=torch.float64, device=dev)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_inputs(case: Case, dev: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape, dtype=BF16, mean=0.0, std=1.0):
        return (mean + std * torch.randn(*shape, device=dev, generator=gen)).to(dtype)

    def both(t):  # one gradient in bf16 and fp32, the same values
        return {BF16: t, FP32: t.float()}

    w_dtype = FP32 if case.amp else BF16
    if case.op == "rms_norm":
        rows, cols = case.shape
        return Inputs([randn(rows, cols), randn(cols, dtype=w_dtype, mean=1.0, std=0.1)], [],
                      [both(randn(rows, cols))])  # fmt: skip
    b, t, hq, hk, d = case.shape
    leaves = [randn(b, t, hq * d), randn(b, t, hk * d)]
    if case.op == "qk_norm_rope":
        leaves += [randn(d, dtype=w_dtype, mean=1.0, std=0.1), randn(d, dtype=w_dtype, mean=1.0, std=0.1)]
    grads = [both(randn(b, t, h, d).transpose(1, 2)) for h in (hq, hk)]  # (B, H, T, D) as SDPA's
    return Inputs(leaves, list(rotary_table(t, d, FP32 if case.amp else BF16, dev)), grads)


def arguments(case: Case, x: Inputs) -> tuple:
    """The op's arguments from the leaves, as the model makes them (views of the projections)."""
    if case.op == "rms_norm":
        return (*x.leaves, EPS)
    b, t, hq, hk, d = case.shape
    q, k = x.leaves[0].view(b, t, hq, d), x.leaves[1].view(b, t, hk, d)
    if case.op == "rope":
        return q.transpose(1, 2), k.transpose(1, 2), *x.consts
    return q, k, *x.leaves[2:], *x.consts, EPS


def calls(case: Case, fn, x: Inputs, dev: torch.device):
    """(forward without gradients, forward + backward): zero-argument callables."""
    amp = (lambda: torch.autocast(dev.type, dtype=BF16)) if case.amp else contextlib.nullcontext

    def forward():
        with torch.no_grad(), amp():
            return fn(*arguments(case, x))

    def forward_backward():
        with amp():
            outs = fn(*arguments(case, x))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return outs, torch.autograd.grad(outs, x.leaves, [g[o.dtype] for g, o in zip(x.grads, outs)])

    return forward, forward_backward


def check(case: Case, fn, x: Inputs, ref: tuple, dev: torch.device) -> dict:
    """Relative errors of one call on fresh copies against float64, and whether each is in
    tolerance: that of the output's dtype, or of bf16 where wider (every case's q, k and x are
    bf16, so an fp32 output, as eager's under amp, carries bf16's rounding of its inputs).
    `ref` is (outputs, gradients) in float64."""
    outs, grads = calls(case, fn, x.copy(), dev)[1]()
    errors, ok = {}, True
    for kind, got, want, tol in (
        ("out", outs, ref[0], T.FORWARD_TOL),
        ("grad", grads, ref[1], T.BACKWARD_TOL),
    ):
        for i, (g, w) in enumerate(zip(got, want)):
            err = T.relative_error(g, w)
            errors[f"{kind}{i}"] = err
            ok &= g.shape == w.shape and err <= max(tol[g.dtype], tol[BF16])
    return {"ok": bool(ok), "errors": errors}


def reference_results(case: Case, x: Inputs) -> tuple:
    """float64 outputs and gradients of the leaves."""
    ref = Inputs([t.detach().double().requires_grad_() for t in x.leaves], [t.double() for t in x.consts],
                 [{torch.float64: g[FP32].double()} for g in x.grads])  # fmt: skip
    outs = reference(case.op)(*arguments(case, ref))
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, ref.leaves, [g[torch.float64] for g in ref.grads])
    return [o.detach() for o in outs], list(grads)


def traffic(case: Case, x: Inputs) -> dict[str, int]:
    """The byte model's bytes, forward and backward (see the module docstring)."""
    if case.op == "rms_norm":
        n = x.leaves[0].numel() * x.leaves[0].element_size()
        return {"forward": 2 * n, "backward": 3 * n}
    qk = sum(t.numel() * t.element_size() for t in x.leaves[:2])  # q and k, out in the same dtype
    cs = sum(t.numel() * t.element_size() for t in x.consts)
    return {"forward": 2 * qk + cs, "backward": (3 if case.op == "qk_norm_rope" else 2) * qk + cs}


# --------------------------------------------------------------------------------------------
# A case: check every variant, time those that pass
# --------------------------------------------------------------------------------------------


def run_case(case: Case, variants: list[str], dev: torch.device, trials: int, ceiling: float | None) -> dict:
    fns = op_functions(case.op)
    base = make_inputs(case, dev)
    ref = reference_results(case, base)
    nbytes = traffic(case, base)
    out: dict = {"case": case.name, "op": case.op, "model": case.model, "shape": case.shape, "amp": case.amp,
                 "bytes": nbytes, "variants": {}, "modes": {}}  # fmt: skip
    runnable = {}
    for name in variants:
        if name not in fns:
            out["variants"][name] = {"ok": False, "skipped": LIGER_MISSING}
            continue
        t0 = time.perf_counter()
        try:
            result = check(case, fns[name], base, ref, dev)
        except Exception as err:  # a variant that cannot run this case is reported, not timed
            result = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
        result["check_s"] = time.perf_counter() - t0
        out["variants"][name] = result
        if result["ok"]:
            runnable[name] = (fns[name], base.copy())
    both = nbytes["forward"] + nbytes["backward"]
    for mode, index, model_bytes in (("forward", 0, nbytes["forward"]), ("forward+backward", 1, both)):
        fs = {n: calls(case, fn, x, dev)[index] for n, (fn, x) in runnable.items()}
        if "eager" not in fs:
            continue
        comp = compare(fs, "eager", trials=trials, device=dev, timing="device")
        rows = {}
        for n in fs:
            median = comp.median_s(n)
            gbs = model_bytes / median / 1e9
            rows[n] = {"median_s": median, "host_s": comp.timings[n].host_s, "gb_per_s": gbs,
                       "of_copy": gbs * 1e9 / ceiling if ceiling else None,
                       "vs_eager": comp.speedups[n].to_dict() if n in comp.speedups else None}  # fmt: skip
        times = {n: comp.timings[n].times_s for n in fs}
        for other in ("liger", "compile"):
            if "profuse" in times and other in times:
                rows["profuse"][f"vs_{other}"] = speedup_ci(times[other], times["profuse"]).to_dict()
        out["modes"][mode] = {"rows": rows, "bytes": model_bytes, "warnings": comp.warnings,
                              "comparison": comp.to_dict()}  # fmt: skip
    return out


def table(results: list[dict]) -> str:
    """The short table: per case and mode, each variant's device time in us, its % of the copy
    ceiling, its host time per call (h, us); profuse's speedup over Liger and over compile
    (ratio of medians, 95% CI)."""
    head = f"{'case':<44} {'mode':<7}" + "".join(f"{v:>21}" for v in VARIANTS)
    lines = [head + f"{'profuse/liger':>22}{'profuse/compile':>22}"]
    for r in results:
        for mode, m in r["modes"].items():
            cells = []
            for v in VARIANTS:
                row = m["rows"].get(v)
                if row is None:
                    ok = r["variants"].get(v, {}).get("ok", True)
                    cells.append(f"{'-' if ok or 'skipped' in r['variants'][v] else 'FAILED':>21}")
                    continue
                pct = f"{row['of_copy']:4.0%}" if row["of_copy"] else "   -"
                host = f"h{row['host_s'] * 1e6:4.0f}" if row["host_s"] else "     "
                cells.append(f"{row['median_s'] * 1e6:9.1f} {pct} {host}")
            p = m["rows"].get("profuse", {})
            ratios = [p.get(f"vs_{o}") for o in ("liger", "compile")]
            text = [f"{s['median']:.2f}x ({s['low']:.2f}-{s['high']:.2f})" if s else "-" for s in ratios]
            mode_name = "fwd" if mode == "forward" else "fwd+bwd"
            lines.append(f"{r['case']:<44} {mode_name:<7}" + "".join(cells) + f"{text[0]:>22}{text[1]:>22}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", required=True, help="folder for bench_rope.json (bench_rope-OPS.json for some ops)"
    )
    p.add_argument("--ops", default="rope,qk_norm_rope,rms_norm", help="comma-separated ops to run")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (eager always)")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="interleaved timed trials per mode")
    p.add_argument("--no-amp", action="store_true", help="leave out the amp cases")
    p.add_argument("--small", action="store_true", help="a few tokens a case: a smoke run")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (Triton's interpreter)")
    args = p.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    variants = list(dict.fromkeys(["eager", *[v for v in args.variants.split(",") if v]]))
    unknown = [o for o in ops if o not in OPS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"bench_rope.py: error: unknown op or variant {unknown}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    try:
        check_folder(args.out, (results_name(ops),))
    except UsageError as err:
        print(f"bench_rope.py: error: {err}", file=sys.stderr)
        return 2
    cases = [c for c in CASES if c.op in ops and not (args.no_amp and c.amp)]
    cases = [small(c) for c in cases] if args.small else cases
    ceiling = copy_ceiling(dev) if dev.type == "cuda" else None
    results, t0 = [], time.perf_counter()
    for case in cases:
        results.append(run_case(case, variants, dev, args.trials, ceiling))
        print(f"[{time.perf_counter() - t0:6.1f} s] {case.name}", file=sys.stderr, flush=True)
    saved = {"environment": environment(dev), "copy_ceiling_bytes_per_s": ceiling, "has_liger": HAS_LIGER,
             "cases": results}  # fmt: skip
    path = write_json(Path(args.out) / results_name(ops), saved)
    for r in results:
        bad = {v: res for v, res in r["variants"].items() if not res["ok"]}
        for v, res in bad.items():
            print(f"{r['case']}: {v} not timed: {res.get('skipped') or res.get('error') or res['errors']}")
        for m in r["modes"].values():
            for w in m["warnings"]:
                print(f"{r['case']}: {w}")
    ceiling_text = f"{ceiling / 1e12:.2f} TB/s" if ceiling else "not measured (CPU)"
    print(f"copy ceiling {ceiling_text}; device time (h = host time per call, us); {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
