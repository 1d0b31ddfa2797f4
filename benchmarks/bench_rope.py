"""RoPE, Qwen3's q/k norm + RoPE, RMSNorm, and the ops the structural fuser places in the dense
families past Llama (Gemma 3, OLMo 2, Phi-4-mini, LayerNorm models): profuse's Triton kernels
against Hugging Face's eager math, torch.compile of that math, and Liger-Kernel's kernels (where
importable). The name is the first cases' (rope); it is kept so links to it hold.

Cases (B 4, T 2048 tokens = 8192 rows; bf16, and "amp": bf16 q and k with fp32 cos, sin and norm
weights under bf16 autocast, as an fp32 model trains under amp):
    rope             Llama-3.2-1B (32 / 8 heads, D 64), Qwen2.5-0.5B (14 / 2, D 64)
    qk_norm_rope     Qwen3-0.6B (16 / 8, D 128); Liger: its RMSNorm on q and k, then its rope
    rms_norm         8192 x 2048 and 8192 x 1024, bf16; Liger: LigerRMSNorm's function
    gelu_mul         Gemma-3-1B's GeGLU, gelu_tanh(gate) * up, gate and up 8192 x 6912 each (two
                     projections' outputs), bf16; Liger: LigerGELUMulFunction (liger_kernel.ops.geglu)
    rms_norm_offset  Gemma's RMSNorm, x * rstd * (1 + w) in fp32 and one cast, 8192 x 1152
                     (Gemma-3-1B's hidden), bf16; Liger: its RMSNorm, offset 1.0, casting_mode gemma
    rms_norm_add     post-norm, h = residual + rms_norm(x) * w: OLMo-2-1B 8192 x 2048 and Gemma-3-1B's
                     sandwich norms with (1 + w), 8192 x 1152, bf16; Liger: its RMSNorm (as its OLMo 2
                     and Gemma 3 patches set it: in_place off), then torch's add
    add_rms_norm     h = x + residual, y = rms_norm(h) * (1 + w): Gemma's layout at Gemma-3-1B's width,
                     8192 x 1152, bf16; Liger: LigerFusedAddRMSNormFunction, offset 1.0, gemma casting
    partial_rope     Phi-4-mini (24 / 8 heads, D 128, rotary dim 96: cos and sin 96 wide, the last 32
                     lanes of each head passed through), bf16 and amp; Liger: its rope (rotary dim from
                     cos's width)
    layer_norm       nn.LayerNorm with a bias, 8192 x 2048, bf16 (eps 1e-5); eager F.layer_norm;
                     Liger: LigerLayerNormFunction
Variants: eager (profuse.rotary / blockops' eager ops: Hugging Face's math op for op), compile
(torch.compile of it, profuse's settings), liger, profuse. Inputs as a model passes them: q and k
are views of (B, T, H*D) projections (transposed for rope), the gradients arrive stored as
(B, T, H, D) (SDPA's backward); each variant has its own copies (Liger writes in place).
Norm weights are drawn near 1 (near 0 where the norm scales by 1 + w, as Gemma's are stored).

Each variant is first checked against float64 (outputs within profuse.tail.FORWARD_TOL,
gradients within BACKWARD_TOL, of the output's dtype); a wrong one is reported failed and never
timed. Then profuse.bench.timing.compare: device time (CUDA events, L2 flushed, interleaved
trials), host time per call beside it, forward (no grad) and forward + backward.

Byte model (the minimum traffic of the op, every tensor read or written once, in profuse's
dtypes; the norm weights and biases, per-row statistics and dw partials are left out, < 0.2%):
    rope          fwd: read q, k, cos, sin; write q_out, k_out.  bwd: read dq_out, dk_out, cos,
                  sin; write dq, dk   (cos and sin (1, T, D): once, not once per batch row)
    partial_rope  as rope, cos and sin R wide; q_out and k_out whole (the D - R lanes are copied)
    qk_norm_rope  fwd: as rope.  bwd: read dq_out, dk_out, q, k, cos, sin; write dq, dk
    rms_norm, rms_norm_offset, layer_norm
                  fwd: read x; write y.  bwd: read dy, x; write dx                 (2 + 3 tensors)
    rms_norm_add  fwd: read x, residual; write h.  bwd: read dh, x; write dx (dresidual is dh
                  itself)                                                          (3 + 3)
    add_rms_norm  fwd: read x, residual; write y, h.  bwd: read dy, dh, h; write dx (one tensor
                  for dx and dresidual: one dtype)                                 (4 + 4)
    gelu_mul      fwd: read gate, up; write out.  bwd: read dout, gate, up; write dgate, dup
                                                                                   (3 + 5)
Bandwidth = those bytes / median time; % of copy = that over a device-to-device copy measured
in the same run (profuse.bench.traffic.copy_ceiling). Every variant is measured on the same
model, so the % compares variants at equal work.

Wall time of the default run (every op, 16 cases) on an H200: about 4-5 min, by estimate (two
torch.compile calls a case, a float64 check of four variants, two timed modes); `--ops` splits it
(rope, qk_norm_rope and rms_norm alone, 8 cases: about 2 min, by estimate).

    PYTHONPATH=src python benchmarks/bench_rope.py --out benchmarks/results/h200-DATE-rope
    PYTHONPATH=src python benchmarks/bench_rope.py --ops NEW --out benchmarks/results/h200-DATE-rope
    (NEW = gelu_mul,rms_norm_offset,rms_norm_add,add_rms_norm,partial_rope,layer_norm: the dense
    families' ops alone, in bench_rope-OPS.json beside a run of the others)
    PYTHONPATH=src python benchmarks/bench_rope.py --ops rope --small --device cpu --out /tmp/r
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
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


def liger_op(module: str, name: str):
    """liger_kernel.ops.<module>.<name>, or None where this liger-kernel has no such thing."""
    if not HAS_LIGER:
        return None
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)
    except Exception:  # an older liger-kernel without the op, or one that cannot load here
        return None


LIGER_GEGLU = liger_op("geglu", "LigerGELUMulFunction")
LIGER_ADD_RMS_NORM = liger_op("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
LIGER_LAYER_NORM = liger_op("layer_norm", "LigerLayerNormFunction")
# Gemma's (1 + w) RMSNorm: where its function takes offset and casting_mode
LIGER_RMS_NORM_OFFSET = HAS_LIGER and {"offset", "casting_mode"} <= set(
    inspect.signature(LigerRMSNormFunction.forward).parameters
)

EPS = 1e-6
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default
GEMMA_OFFSET = 1.0  # Gemma's RMSNorm scales by (1 + w)
BF16, FP32 = torch.bfloat16, torch.float32
VARIANTS = ("eager", "compile", "liger", "profuse")
OPS = ("rope", "qk_norm_rope", "rms_norm", "gelu_mul", "rms_norm_offset", "rms_norm_add", "add_rms_norm",
       "partial_rope", "layer_norm")  # fmt: skip
ROPE_OPS = ("rope", "qk_norm_rope", "partial_rope")  # (B, T, Hq, Hk, D[, R]) shapes; the rest (rows, cols)


def results_name(ops: list[str]) -> str:
    """bench_rope.json for every op; a run of some ops names them (two runs share a folder)."""
    return "bench_rope.json" if set(ops) == set(OPS) else f"bench_rope-{'-'.join(ops)}.json"


@dataclass(frozen=True)
class Case:
    op: str  # one of OPS
    model: str  # whose shapes
    shape: tuple[int, ...]  # (B, T, Hq, Hk, D), (B, T, Hq, Hk, D, R) for partial_rope, else (rows, cols)
    amp: bool = False  # fp32 cos, sin and weights, bf16 autocast
    offset: float = 0.0  # the norm scales by (offset + w): Gemma's 1.0

    @property
    def name(self) -> str:
        return f"{self.op} {self.model} {'x'.join(map(str, self.shape))} {'amp' if self.amp else 'bf16'}"

    @property
    def rotary(self) -> bool:
        return self.op in ROPE_OPS


CASES = [
    Case("rope", "Llama-3.2-1B", (4, 2048, 32, 8, 64)),
    Case("rope", "Llama-3.2-1B", (4, 2048, 32, 8, 64), amp=True),
    Case("rope", "Qwen2.5-0.5B", (4, 2048, 14, 2, 64)),
    Case("rope", "Qwen2.5-0.5B", (4, 2048, 14, 2, 64), amp=True),
    Case("qk_norm_rope", "Qwen3-0.6B", (4, 2048, 16, 8, 128)),
    Case("qk_norm_rope", "Qwen3-0.6B", (4, 2048, 16, 8, 128), amp=True),
    Case("rms_norm", "Llama-3.2-1B hidden", (8192, 2048)),
    Case("rms_norm", "Qwen3-0.6B hidden", (8192, 1024)),
    Case("gelu_mul", "Gemma-3-1B MLP", (8192, 6912)),
    Case("rms_norm_offset", "Gemma-3-1B hidden", (8192, 1152), offset=GEMMA_OFFSET),
    Case("rms_norm_add", "OLMo-2-1B hidden", (8192, 2048)),
    Case("rms_norm_add", "Gemma-3-1B 1+w", (8192, 1152), offset=GEMMA_OFFSET),
    Case("add_rms_norm", "Gemma-3-1B 1+w", (8192, 1152), offset=GEMMA_OFFSET),
    Case("partial_rope", "Phi-4-mini", (4, 2048, 24, 8, 128, 96)),
    Case("partial_rope", "Phi-4-mini", (4, 2048, 24, 8, 128, 96), amp=True),
    Case("layer_norm", "with bias", (8192, 2048)),
]


def small(case: Case) -> Case:
    """The same case at a few tokens (a smoke run on a CPU, through Triton's interpreter)."""
    if not case.rotary:
        return Case(case.op, case.model, (16, case.shape[1] // 16), case.amp, case.offset)
    return Case(case.op, case.model, (1, 8, *case.shape[2:]), case.amp, case.offset)


# --------------------------------------------------------------------------------------------
# The variants: each op's functions, and its inputs as a model passes them
# --------------------------------------------------------------------------------------------


def liger_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    """Liger's own pieces for Qwen3's attention: its RMSNorm on q and k, then its rope."""
    qn = LigerRMSNormFunction.apply(q, q_weight, eps)
    kn = LigerRMSNormFunction.apply(k, k_weight, eps)
    return liger_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)


def casting(offset: float) -> str:
    """Liger's casting mode for a norm: Gemma's (fp32 throughout) where it scales by (1 + w)."""
    return "gemma" if offset else "llama"


def liger_rms_norm_add(x, residual, weight, eps, offset):
    """What Liger's OLMo 2 and Gemma 3 patches run for a post-norm: its RMSNorm (in_place off, as
    both set it), then torch's add."""
    return residual + LigerRMSNormFunction.apply(x, weight, eps, offset, casting(offset), False)


def liger_functions() -> dict:
    """op -> Liger's function for it, for the ops this liger-kernel has (see liger_missing)."""
    if not HAS_LIGER:
        return {}
    fns = {
        "rope": lambda q, k, c, s: liger_rotary_pos_emb(q, k, c, s),
        "partial_rope": lambda q, k, c, s: liger_rotary_pos_emb(q, k, c, s),  # rotary dim: cos's width
        "qk_norm_rope": liger_qk_norm_rope,
        "rms_norm": lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps),
    }
    if LIGER_RMS_NORM_OFFSET:  # Gemma 3's patch: offset 1.0, gemma casting, in_place off
        fns["rms_norm_offset"] = lambda x, w, eps, off: LigerRMSNormFunction.apply(
            x, w, eps, off, casting(off), False
        )
        fns["rms_norm_add"] = liger_rms_norm_add
    if LIGER_GEGLU is not None:
        fns["gelu_mul"] = lambda gate, up: LIGER_GEGLU.apply(gate, up)
    if LIGER_ADD_RMS_NORM is not None:  # (y, h), as profuse's
        fns["add_rms_norm"] = lambda x, r, w, eps, off: LIGER_ADD_RMS_NORM.apply(
            x, r, w, eps, off, casting(off)
        )
    if LIGER_LAYER_NORM is not None:
        fns["layer_norm"] = lambda x, w, b, eps: LIGER_LAYER_NORM.apply(x, w, b, eps)
    return fns


def liger_missing(op: str) -> str:
    """Why there is no liger variant of `op` here."""
    if not HAS_LIGER:
        return LIGER_MISSING
    wanted = {"rms_norm_offset": "LigerRMSNormFunction with offset and casting_mode",
              "rms_norm_add": "LigerRMSNormFunction with offset and casting_mode",
              "gelu_mul": "liger_kernel.ops.geglu.LigerGELUMulFunction",
              "add_rms_norm": "liger_kernel.ops.fused_add_rms_norm.LigerFusedAddRMSNormFunction",
              "layer_norm": "liger_kernel.ops.layer_norm.LigerLayerNormFunction"}  # fmt: skip
    return f"this liger-kernel has no {wanted.get(op, op)} (pip install -U liger-kernel)"


# op -> (eager, profuse, float64 reference), each called with arguments(case, inputs); a norm's
# weight offset is the last argument where the op takes one (profuse's by keyword)
FUNCTIONS = {
    "rope": (R.rope_eager, R.rope, R.rope_reference),
    "partial_rope": (R.rope_eager, R.rope, R.rope_reference),
    "qk_norm_rope": (R.qk_norm_rope_eager, R.qk_norm_rope, R.qk_norm_rope_reference),
    "rms_norm": (B.rms_norm_eager, B.rms_norm, B.rms_norm_reference),
    "rms_norm_offset": (B.rms_norm_eager, lambda x, w, eps, off: B.rms_norm(x, w, eps, weight_offset=off),
                        B.rms_norm_reference),
    "rms_norm_add": (B.rms_norm_add_eager,
                     lambda x, r, w, eps, off: B.rms_norm_add(x, r, w, eps, weight_offset=off),
                     B.rms_norm_add_reference),
    "add_rms_norm": (B.add_rms_norm_eager,
                     lambda x, r, w, eps, off: B.add_rms_norm(x, r, w, eps, weight_offset=off),
                     B.add_rms_norm_reference),
    "gelu_mul": (B.gelu_mul_eager, B.gelu_mul, B.gelu_mul_reference),  # approximate "tanh": Gemma's
    "layer_norm": (B.layer_norm_eager, B.layer_norm, B.layer_norm_reference),
}  # fmt: skip


def op_functions(op: str) -> dict:
    """name -> the op's function for each variant available here (liger only where importable)."""
    eager, fused, _ = FUNCTIONS[op]
    fns = {"eager": eager, "compile": compile_fn(eager), "profuse": fused}
    liger = liger_functions().get(op)
    if liger is not None:
        fns["liger"] = liger
    return fns


def reference(op: str):
    return FUNCTIONS[op][2]


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
    w_mean = 0.0 if case.offset else 1.0  # (offset + w) near 1 either way
    if not case.rotary:
        rows, cols = case.shape
        x, weight = randn(rows, cols), randn(cols, dtype=w_dtype, mean=w_mean, std=0.1)
        grads = [both(randn(rows, cols))]
        if case.op == "gelu_mul":  # gate, up: two projections' outputs
            return Inputs([x, randn(rows, cols)], [], grads)
        if case.op == "layer_norm":
            return Inputs([x, weight, randn(cols, dtype=w_dtype, std=0.1)], [], grads)
        if case.op in ("rms_norm_add", "add_rms_norm"):  # x, residual, weight
            grads += [both(randn(rows, cols))] if case.op == "add_rms_norm" else []  # y's, then h's
            return Inputs([x, randn(rows, cols), weight], [], grads)
        return Inputs([x, weight], [], grads)
    b, t, hq, hk, d = case.shape[:5]
    leaves = [randn(b, t, hq * d), randn(b, t, hk * d)]
    if case.op == "qk_norm_rope":
        leaves += [randn(d, dtype=w_dtype, mean=1.0, std=0.1), randn(d, dtype=w_dtype, mean=1.0, std=0.1)]
    grads = [both(randn(b, t, h, d).transpose(1, 2)) for h in (hq, hk)]  # (B, H, T, D) as SDPA's
    rot = case.shape[5] if len(case.shape) > 5 else d  # partial rotary: cos and sin R wide
    return Inputs(leaves, list(rotary_table(t, rot, FP32 if case.amp else BF16, dev)), grads)


def arguments(case: Case, x: Inputs) -> tuple:
    """The op's arguments from the leaves, as the model makes them (views of the projections)."""
    if case.op == "rms_norm":
        return (*x.leaves, EPS)
    if case.op == "gelu_mul":
        return tuple(x.leaves)
    if case.op == "layer_norm":
        return (*x.leaves, LAYER_NORM_EPS)
    if not case.rotary:  # the norms that take an offset: rms_norm_offset, rms_norm_add, add_rms_norm
        return (*x.leaves, EPS, case.offset)
    b, t, hq, hk, d = case.shape[:5]
    q, k = x.leaves[0].view(b, t, hq, d), x.leaves[1].view(b, t, hk, d)
    if case.op in ("rope", "partial_rope"):
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


# op -> (forward, backward) tensors of x's size moved, for the (rows, cols) ops (the docstring's
# byte model; gelu_mul's tensor is gate's)
ROW_TENSORS = {"rms_norm": (2, 3), "rms_norm_offset": (2, 3), "layer_norm": (2, 3), "rms_norm_add": (3, 3),
               "add_rms_norm": (4, 4), "gelu_mul": (3, 5)}  # fmt: skip


def traffic(case: Case, x: Inputs) -> dict[str, int]:
    """The byte model's bytes, forward and backward (see the module docstring)."""
    if not case.rotary:
        n = x.leaves[0].numel() * x.leaves[0].element_size()
        fwd, bwd = ROW_TENSORS[case.op]
        return {"forward": fwd * n, "backward": bwd * n}
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
    if case.offset:  # the norm scales by (offset + w); the key only where there is one
        out["weight_offset"] = case.offset
    runnable = {}
    for name in variants:
        if name not in fns:
            out["variants"][name] = {"ok": False, "skipped": liger_missing(case.op)}
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
    width = max([44] + [len(r["case"]) for r in results])
    head = f"{'case':<{width}} {'mode':<7}" + "".join(f"{v:>21}" for v in VARIANTS)
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
            lines.append(
                f"{r['case']:<{width}} {mode_name:<7}" + "".join(cells) + f"{text[0]:>22}{text[1]:>22}"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", required=True, help="folder for bench_rope.json (bench_rope-OPS.json for some ops)"
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops to run, of {', '.join(OPS)}")
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
