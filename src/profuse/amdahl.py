"""Part C's prediction: the ops fusion replaces, timed like for like, and Amdahl's law.

    gain = 1 / ((1 - sum f_i) + sum f_i / s_i)

f_i is op i's share of the eager step: its time in the labelled eager profile (forward and
backward, its backward kernels traced through autograd's sequence numbers) over the timed eager
step. s_i is its own speedup inside the step (in_step_speedups): its time in each profiled eager
step over its time in each profiled fused step, the fused step profiled through a labelled copy
(the same ranges around the fused ops: the kernels under each op's range, forward and backward).
Both sides are the op as the step runs it, in the step's caches and call forms; the interval
pairs the fastest and slowest profiled steps of each side (the two profiles' steps are not
paired), and with the shares' spread gives the prediction's interval.

Before in-step speedups, s_i came from the op timed alone like Part B (time_ops: interleaved
trials of device time, the L2 flushed), which the sections below still describe and a caller may
still use; a saved file says which (Amdahl.speedup_source).

Like for like, because a prediction from unlike inputs is wrong by more than the gains it
predicts (Llama-3.2-1B on an H200, 2026-12-05: silu_mul timed alone on one packed (n, 2F) input
took 977 us a call, inside the step, where Hugging Face calls it on two tensors, 451 us; its
speedup read 3.71x where ~1.7x was true, and the prediction 1.144x where ~1.127x was):

- Each op is timed in the call form the fused step uses, at its shapes and dtypes (op_cases):
  Hugging Face models call silu_mul(gate, up) on two (B, T, F) tensors, the built-in GPT on its
  packed (B, T, 2F) one; add_rms_norm gets x in the compute dtype and the residual stream and
  weight in the parameters' (amp: x bf16, residual and weight fp32; bf16: all bf16); rms_norm
  the embeddings entering layer 0; rope and qk_norm_rope the attention's heads; and
  linear_cross_entropy the head's hidden states and weight. Each runs under the step's autocast.
  Every op the eager profile finds labelled is timed, by name; the unfused side is the model's
  own eager math (Hugging Face's, op for op), the fused side the op's public face.
- Each op's eager time alone is cross-checked against its time inside the eager step: the
  labelled range's time per step over its calls per step. The ratio is printed; beyond
  IN_STEP_RATIO either way the op alone is not what the step runs, and the prediction with the
  in-step eager times (s_i scaled by that ratio) is printed beside the other.
- The shares come from every profiled step, one by one (step_shares): their spread (lowest to
  highest) goes into the prediction's interval with the ops' CIs, each op at the corner of
  (share, speedup) that saves least, and most.
- Amdahl over device time predicts device time. Where the eager step is not device-bound (the
  GPU idle over DEVICE_BOUND_IDLE_PCT of it, or its host time at least its kernel time), the
  step's time is not its kernels' and the prediction says nothing the user sees: a caveat says so.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from profuse import blockops, crossentropy, fusion, rotary
from profuse import model as M
from profuse.attribution import HOST_CATS, STEP_PREFIX, analyze_trace
from profuse.bench.stats import FASTER, NO_GAIN, SLOWER, Speedup
from profuse.bench.timing import Comparison, compare
from profuse.env import dtype_name

Progress = Callable[[str, int, int], None]

SILU_MUL, ADD_RMS_NORM = fusion.SILU_MUL, fusion.ADD_RMS_NORM
RMS_NORM, ROPE, QK_NORM_ROPE, LINEAR_CROSS_ENTROPY = (
    "rms_norm",
    "rope",
    "qk_norm_rope",
    "linear_cross_entropy",
)
RMS_NORM_ADD, CLAMPED_SWIGLU, LAYER_NORM = fusion.RMS_NORM_ADD, fusion.CLAMPED_SWIGLU, fusion.LAYER_NORM
# Every op fusion may replace, by the range it labels its calls with, in the order the report lists
# them: post-norm and sandwich layers' rms_norm_add (OLMo 2, Gemma 2 and 3), gpt-oss's
# clamped_swiglu and the LayerNorm layouts' layer_norm too. A GeGLU's gelu_mul runs in
# silu_mul's place and under its label (fusion's bound_gated), so its time is silu_mul's row.
OPS = (
    SILU_MUL,
    ADD_RMS_NORM,
    RMS_NORM,
    ROPE,
    QK_NORM_ROPE,
    LINEAR_CROSS_ENTROPY,
    RMS_NORM_ADD,
    CLAMPED_SWIGLU,
    LAYER_NORM,
)

# A step whose GPU idles more than this share of it is not device-bound: the Llama-3.2-1B eager
# step on an H200 idles 4.3%, the lab's GPT over 50% (launch-bound, attribution's threshold).
DEVICE_BOUND_IDLE_PCT = 10.0
# An op's eager time alone and inside the step may differ this much either way before the
# prediction is redone with the in-step time (the packed silu_mul above was 2.17x off).
IN_STEP_RATIO = 1.25


def op_range(op: str) -> str:
    """The profiler range fusion labels `op`'s calls with ("profuse.block_op: OP")."""
    return fusion.BLOCK_OP_RANGES.get(op, f"profuse.block_op: {op}")


# --------------------------------------------------------------------------------------------
# The ops at the step's shapes, dtypes and call forms
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpDims:
    """The step's shapes the ops see."""

    batch: int
    seq: int
    d_model: int
    ffn_hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab: int
    eps: float

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @classmethod
    def from_dims(cls, dims: Mapping, eps: float) -> OpDims:
        """From ModelSpec.dims() (n_kv_head and head_dim default as in a model without them)."""
        n_head = int(dims["n_head"])
        return cls(
            batch=int(dims["batch_size"]),
            seq=int(dims["seq_len"]),
            d_model=int(dims["d_model"]),
            ffn_hidden=int(dims["ffn_hidden"]),
            n_head=n_head,
            n_kv_head=int(dims.get("n_kv_head") or n_head),
            head_dim=int(dims.get("head_dim") or int(dims["d_model"]) // n_head),
            vocab=int(dims["vocab_size"]),
            eps=float(eps),
        )


@dataclass(frozen=True)
class OpDtypes:
    """The step's dtypes, as its ops see them."""

    stream: torch.dtype  # the parameters' and the residual stream's (fp32 in amp)
    compute: torch.dtype  # the matmuls' outputs: what a branch hands on (bf16 in amp and in bf16)
    autocast: bool  # the step runs under autocast to `compute` (amp)

    def context(self, device: torch.device) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)


def eager_impls(family: str) -> dict[str, Callable]:
    """The model's own unfused ops: the built-in GPT's, or Hugging Face's math op for op."""
    if family == "gpt":
        return {SILU_MUL: M.silu_mul, ADD_RMS_NORM: M.add_rms_norm}
    return {
        SILU_MUL: blockops.silu_mul_eager,
        ADD_RMS_NORM: fusion.add_rms_norm_hf,
        RMS_NORM: blockops.rms_norm_eager,
        ROPE: rotary.rope_eager,
        QK_NORM_ROPE: rotary.qk_norm_rope_eager,
        LINEAR_CROSS_ENTROPY: crossentropy.linear_cross_entropy_eager,
        RMS_NORM_ADD: blockops.rms_norm_add_eager,
        CLAMPED_SWIGLU: blockops.clamped_swiglu_eager,
        LAYER_NORM: blockops.layer_norm_eager,
    }


def fused_impls(ops=None) -> dict[str, Callable]:
    """The fused side of each op: the BlockOps' own where it has one (silu_mul, add_rms_norm),
    else the op's public face."""
    faces = {
        SILU_MUL: blockops.silu_mul,
        ADD_RMS_NORM: blockops.add_rms_norm,
        RMS_NORM: blockops.rms_norm,
        ROPE: rotary.rope,
        QK_NORM_ROPE: rotary.qk_norm_rope,
        LINEAR_CROSS_ENTROPY: crossentropy.linear_cross_entropy,
        RMS_NORM_ADD: blockops.rms_norm_add,
        CLAMPED_SWIGLU: blockops.clamped_swiglu,
        LAYER_NORM: blockops.layer_norm,
    }
    return {op: getattr(ops, op, None) or face for op, face in faces.items()}


@dataclass
class OpCase:
    """One op as the step calls it: its differentiable inputs, and the two sides on them."""

    op: str
    shape: str  # e.g. "gate, up 4 x 2048 x 8192 bf16 each"
    leaves: list[torch.Tensor]
    eager: Callable  # (*leaves) -> output(s)
    fused: Callable


def op_cases(
    ops: Iterable[str],
    family: str,
    dims: OpDims,
    dtypes: OpDtypes,
    device: torch.device,
    seed: int = 0,
    fused: Mapping[str, Callable] | None = None,
) -> dict[str, OpCase]:
    """Fresh random inputs for each op in `ops`, in the call form, shapes and dtypes the step
    uses, with its unfused (eager_impls) and fused (`fused`, default fused_impls()) sides."""
    eager = eager_impls(family)
    fused = dict(fused or fused_impls())
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, dtype):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    B, T, d, F, eps = dims.batch, dims.seq, dims.d_model, dims.ffn_hidden, dims.eps
    Hq, Hk, D = dims.n_head, dims.n_kv_head, dims.head_dim
    cd, sd = dtypes.compute, dtypes.stream
    cn, sn = dtype_name(cd), dtype_name(sd)
    out = {}
    for op in ops:
        if op not in eager:
            raise ValueError(f"{op} has no unfused form in a {family} model")
        if op not in fused:
            raise ValueError(f"no fused implementation of {op} was given")
        e, f = eager[op], fused[op]
        if op == SILU_MUL and family == "gpt":  # the GPT's packed matmul output
            leaves, shape = [rand(B, T, 2 * F, dtype=cd)], f"gate_up {B} x {T} x {2 * F} {cn} (packed)"
        elif op == SILU_MUL:  # Hugging Face: gate_proj(y) and up_proj(y), two tensors
            leaves, shape = (
                [rand(B, T, F, dtype=cd), rand(B, T, F, dtype=cd)],
                f"gate, up {B} x {T} x {F} {cn} each",
            )
        elif op == ADD_RMS_NORM:  # a branch's output onto the residual stream, then the norm's weight
            leaves = [rand(B, T, d, dtype=cd), rand(B, T, d, dtype=sd), 1 + 0.1 * rand(d, dtype=sd)]
            shape = f"x {B} x {T} x {d} {cn}, residual {sn}, weight {sn}"
            e, f = _with_eps(e, eps), _with_eps(f, eps)
        elif op == RMS_NORM:  # layer 0's input norm, on the embeddings
            leaves, shape = [rand(B, T, d, dtype=sd), 1 + 0.1 * rand(d, dtype=sd)], f"x {B} x {T} x {d} {sn}"
            e, f = _with_eps(e, eps), _with_eps(f, eps)
        elif op == ROPE:  # q and k as the projections' (B, T, H, D) views, transposed to (B, H, T, D)
            cos, sin = _rotation(B, T, D, sd, rand)
            leaves = [rand(B, T, Hq, D, dtype=cd), rand(B, T, Hk, D, dtype=cd)]
            shape = f"q {B} x {Hq} x {T} x {D}, k {Hk} heads, {cn}; cos, sin {sn}"
            e, f = _rope_call(e, cos, sin), _rope_call(f, cos, sin)
        elif op == QK_NORM_ROPE:  # Qwen3: each head normalised, then rotated
            cos, sin = _rotation(B, T, D, sd, rand)
            leaves = [
                rand(B, T, Hq, D, dtype=cd),
                rand(B, T, Hk, D, dtype=cd),
                1 + 0.1 * rand(D, dtype=sd),
                1 + 0.1 * rand(D, dtype=sd),
            ]
            shape = f"q {B} x {T} x {Hq} x {D}, k {Hk} heads, {cn}; weights, cos, sin {sn}"
            e, f = _qk_call(e, cos, sin, eps), _qk_call(f, cos, sin, eps)
        elif op == RMS_NORM_ADD:  # post-norm: a sublayer's output normalised, then onto the stream
            leaves = [rand(B, T, d, dtype=cd), rand(B, T, d, dtype=sd), 1 + 0.1 * rand(d, dtype=sd)]
            shape = f"x {B} x {T} x {d} {cn}, residual {sn}, weight {sn}"
            e, f = _with_eps(e, eps), _with_eps(f, eps)
        elif op == CLAMPED_SWIGLU:  # gpt-oss: the experts' packed, interleaved gate_up, one row a token
            leaves = [rand(B * T, 2 * F, dtype=cd)]
            shape = f"gate_up {B * T} x {2 * F} {cn} (interleaved; the experts' rows at the MLP's width)"
        elif op == LAYER_NORM:  # a LayerNorm on the residual stream, with its weight and bias
            leaves = [rand(B, T, d, dtype=sd), 1 + 0.1 * rand(d, dtype=sd), 0.1 * rand(d, dtype=sd)]
            shape = f"x {B} x {T} x {d} {sn}, weight and bias {sn}"
            e, f = _with_eps(e, eps), _with_eps(f, eps)
        else:  # LINEAR_CROSS_ENTROPY: the head's matmul and the loss (labels shifted inside)
            labels = torch.randint(dims.vocab, (B, T), generator=gen, device=device)
            leaves = [rand(B, T, d, dtype=cd), 0.02 * rand(dims.vocab, d, dtype=sd)]
            shape = f"hidden {B} x {T} x {d} {cn}, weight {dims.vocab} x {d} {sn}"
            e, f = _lce_call(e, labels), _lce_call(f, labels)
        out[op] = OpCase(op, shape, [t.detach() for t in leaves], e, f)
    return out


def _with_eps(fn: Callable, eps: float) -> Callable:
    return lambda *leaves: fn(*leaves, eps)


def _rotation(B, T, D, dtype, rand) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, T, D) of random angles, each half repeated (Hugging Face's layout)."""
    angle = rand(B, T, D // 2, dtype=torch.float32)
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _rope_call(fn: Callable, cos: torch.Tensor, sin: torch.Tensor) -> Callable:
    return lambda q, k: fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _qk_call(fn: Callable, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> Callable:
    return lambda q, k, qw, kw: fn(q, k, qw, kw, cos, sin, eps)


def _lce_call(fn: Callable, labels: torch.Tensor) -> Callable:
    return lambda hidden, weight: fn(hidden, weight, labels)


def _outputs(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _fwd_bwd(
    fn: Callable, leaves: list[torch.Tensor], douts: list[torch.Tensor], ctx: Callable
) -> Callable[[], object]:
    """A call of `fn` forward (under the step's autocast) and backward, the output gradients
    `douts` cast once to its outputs' dtypes."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    with torch.no_grad(), ctx():
        outs = _outputs(fn(*leaves))
    douts = [g.to(o.dtype) for g, o in zip(douts, outs)]  # cast once here, not in every timed call

    def run():
        with ctx():
            outs = _outputs(fn(*leaves))
        # autograd.grad returns fresh gradients: nothing accumulates between calls.
        return torch.autograd.grad(outs, leaves, douts)

    return run


@dataclass
class OpTiming:
    """One op at the step's shapes, fused vs eager, forward + backward, timed like Part B."""

    op: str
    shape: str
    comparison: Comparison

    @property
    def speedup(self) -> Speedup:
        return self.comparison.speedups["fused"]

    @property
    def eager_s(self) -> float:
        """The eager op alone, forward + backward, a call (the median trial)."""
        return self.comparison.median_s("eager")

    def to_dict(self) -> dict:
        return {"op": self.op, "shape": self.shape, "comparison": self.comparison.to_dict()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def time_ops(
    cases: Mapping[str, OpCase],
    *,
    device: torch.device,
    dtypes: OpDtypes,
    trials: int,
    warmup: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[dict[str, OpTiming], dict[str, str]]:
    """Each op, fused vs eager, forward + backward, in interleaved trials of device time with
    the L2 flushed (Part B's way). Returns (timings, {op: why not timed}) : an op whose fused
    side cannot run here is not timed, and the prediction then has no value."""
    ctx = lambda: dtypes.context(device)  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    timed, not_timed = {}, {}
    for op, case in cases.items():
        say = (
            (lambda stage, done, total, op=op: progress(f"{op}: {stage}", done, total)) if progress else None
        )
        try:
            with torch.no_grad(), ctx():
                outs = _outputs(case.eager(*case.leaves))
            douts = [torch.randn(o.shape, generator=gen, device=device, dtype=o.dtype) for o in outs]
            comparison = compare(
                {
                    "eager": _fwd_bwd(case.eager, case.leaves, douts, ctx),
                    "fused": _fwd_bwd(case.fused, case.leaves, douts, ctx),
                },
                "eager",
                trials=trials,
                device=device,
                warmup=warmup,
                flush_l2=True,
                seed=seed,
                progress=say,
                timing="device",
            )
        except Exception as err:  # a fused op that cannot run here: no prediction, not a crash
            not_timed[op] = _first_line(err)
            continue
        timed[op] = OpTiming(op, case.shape, comparison)
    return timed, not_timed


# --------------------------------------------------------------------------------------------
# The shares: every profiled step of the labelled eager step, one by one
# --------------------------------------------------------------------------------------------


@dataclass
class OpShare:
    """One op in the labelled eager profile: its time in each profiled step, and its calls."""

    op: str
    step_s: list[float]  # its time in each profiled step, forward and backward
    calls: float  # calls a step (its labelled ranges)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def call_s(self) -> float:
        """Its time a call inside the step (median step)."""
        return self.median_s / self.calls if self.calls else math.nan


@dataclass
class StepShares:
    """What the labelled eager profile says, step by step."""

    basis: str  # "GPU kernel time" or "self CPU time"
    step_s: list[float]  # that time in each profiled step
    gpu_idle_pct: list[float]  # the GPU's idle share of each step (CUDA; empty on a CPU)
    ops: dict[str, OpShare]  # the ops found labelled, in OPS order

    @property
    def idle_pct(self) -> float | None:
        return statistics.median(self.gpu_idle_pct) if self.gpu_idle_pct else None

    @property
    def device_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else math.nan


def _step_windows(events: list[dict]) -> list[tuple[float, float]]:
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS and str(e.get("name", "")).startswith(STEP_PREFIX)
    ]
    return sorted(spans)


def step_shares(trace: dict | list, device: str, ops: Sequence[str] = OPS) -> StepShares:
    """Read a labelled eager trace step by step: each ProfilerStep read alone (analyze_trace on
    its own events), each op's time in it (its range, forward and backward) and its calls."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    events = [e for e in events if e.get("ph") == "X" and "ts" in e]
    windows = _step_windows(events)
    if not windows:
        raise ValueError("the trace holds no ProfilerStep span")
    ranges = {op: op_range(op) for op in ops}
    basis, step_s, idle = "", [], []
    per_op: dict[str, list[float]] = {op: [] for op in ops}
    calls: dict[str, list[int]] = {op: [] for op in ops}
    for i, (start, end) in enumerate(windows):
        until = windows[i + 1][0] if i + 1 < len(windows) else math.inf
        mine = [
            e
            for e in events
            if start <= float(e["ts"]) < until
            and not (str(e.get("name", "")).startswith(STEP_PREFIX) and float(e["ts"]) != start)
        ]
        summary = analyze_trace({"traceEvents": mine}, device=device, regions=tuple(ranges.values()))
        basis = summary.basis
        total_s = summary.total_us * 1e-6
        step_s.append(total_s)
        if summary.gpu_idle_pct is not None:
            idle.append(summary.gpu_idle_pct)
        for op, name in ranges.items():
            per_op[op].append(summary.region_pct.get(name, 0.0) / 100.0 * total_s)
            calls[op].append(
                sum(
                    1
                    for e in mine
                    if e.get("name") == name and e.get("cat") in HOST_CATS and float(e["ts"]) <= end
                )
            )
    found = {
        op: OpShare(op, per_op[op], statistics.median(calls[op]))
        for op in ops
        if any(calls[op]) and any(t > 0 for t in per_op[op])
    }
    return StepShares(basis, step_s, idle, found)


def in_step_speedups(eager: StepShares, fused: StepShares) -> tuple[dict[str, dict], dict[str, str]]:
    """Each op's speedup inside the step: its time in the profiled eager steps over its time in
    the profiled fused steps (the kernels under its range, forward and backward), as a
    Speedup.to_dict()-shaped dict: the medians' ratio, and from the least favourable pairing
    (fastest eager step over slowest fused) to the most (slowest eager over fastest fused).
    Returns (op -> speedup, op -> why none)."""
    speedups: dict[str, dict] = {}
    missing: dict[str, str] = {}
    for op, e in eager.ops.items():
        f = fused.ops.get(op)
        if f is None or not all(t > 0 for t in f.step_s):
            missing[op] = "the labelled fused step's profile holds no time under its range"
            continue
        low, high = min(e.step_s) / max(f.step_s), max(e.step_s) / min(f.step_s)
        verdict = FASTER if low > 1.0 else SLOWER if high < 1.0 else NO_GAIN
        speedups[op] = {
            "median": e.median_s / f.median_s,
            "low": low,
            "high": high,
            "verdict": verdict,
            "eager_step_s": list(e.step_s),  # the op's time in each profiled step, each side
            "fused_step_s": list(f.step_s),
            "eager_calls": e.calls,
            "fused_calls": f.calls,
        }
    return speedups, missing


def read_step_shares(path: str, device: str, ops: Sequence[str] = OPS) -> StepShares:
    """step_shares of a trace file (the eager profile's)."""
    import json

    with open(path, encoding="utf-8") as f:
        return step_shares(json.load(f), device, ops)


# --------------------------------------------------------------------------------------------
# The prediction
# --------------------------------------------------------------------------------------------


def _gain(fractions: Mapping[str, float], speedups: Mapping[str, float]) -> float:
    rest = 1.0 - sum(fractions.values())
    return 1.0 / (max(rest, 0.0) + sum(f / speedups[op] for op, f in fractions.items()))


@dataclass
class Amdahl:
    """The step's gain predicted from the ops fusion replaces, beside the gain measured."""

    eager_step_s: float  # the timed eager step: the denominator of every share
    op_s: dict[str, list[float]]  # op -> its time in each profiled eager step (a float: one step)
    op_speedups: dict[str, dict]  # op -> Speedup.to_dict(): fused op vs eager op (empty: not timed)
    measured: dict | None  # Speedup.to_dict() of the fused step over eager, as timed
    calls: dict[str, float] = field(default_factory=dict)  # op -> calls a step
    eager_call_s: dict[str, float] = field(default_factory=dict)  # op -> the eager op alone, a call
    gpu_idle_pct: float | None = None  # the eager step's GPU idle share (median profiled step; CUDA)
    host_s: float | None = None  # the eager step's host time (the harness's)
    device_s: float | None = None  # the eager step's kernel time (median profiled step; CUDA)
    not_timed: dict[str, str] = field(default_factory=dict)  # op -> why its speedup is missing
    # where op_speedups come from: "in-step" (in_step_speedups: the ops' own time inside the eager
    # and the fused step) or "alone" (time_ops: each op timed by itself, the L2 flushed)
    speedup_source: str = "alone"

    def __post_init__(self) -> None:
        self.op_s = {
            op: [float(t)] if isinstance(t, int | float) else [float(x) for x in t]
            for op, t in self.op_s.items()
        }

    def _t(self, op: str, which: str = "median") -> float:
        ts = self.op_s[op]
        return {"median": statistics.median(ts), "low": min(ts), "high": max(ts)}[which]

    def _fraction(self, t: float) -> float:
        return min(t / self.eager_step_s, 1.0)

    @property
    def fractions(self) -> dict[str, float]:
        return {op: self._fraction(self._t(op)) for op in self.op_s}

    @property
    def f(self) -> float:
        return min(sum(self.fractions.values()), 1.0)

    @property
    def ceiling(self) -> float:
        """The gain if those ops took no time at all: 1 / (1 - f)."""
        return 1.0 / (1.0 - self.f) if self.f < 1.0 else math.inf

    @property
    def complete(self) -> bool:
        return set(self.op_speedups) == set(self.op_s)

    def predict(self, which: str = "median") -> float | None:
        """1 / ((1 - sum f) + sum f_i / s_i), the shares at their median step, each op's speedup
        its median, low or high: the interval over the ops' CIs alone."""
        if not self.complete:
            return None
        return _gain(self.fractions, {op: sp[which] for op, sp in self.op_speedups.items()})

    def interval(self) -> tuple[float, float] | None:
        """The prediction's interval over the ops' CIs and the shares' spread over the profiled
        steps: each op at the corner of (its lowest to highest time a step) x (its CI) that saves
        the step least, then most."""
        if not self.complete:
            return None
        picks: dict[str, list[tuple[float, float]]] = {}
        for op, sp in self.op_speedups.items():
            corners = [
                (self._fraction(self._t(op, t)), sp[s]) for t in ("low", "high") for s in ("low", "high")
            ]
            saved = sorted(corners, key=lambda c: c[0] * (1.0 - 1.0 / c[1]))
            picks[op] = [saved[0], saved[-1]]
        ends = []
        for end in (0, 1):
            ends.append(
                _gain({op: p[end][0] for op, p in picks.items()}, {op: p[end][1] for op, p in picks.items()})
            )
        return min(ends), max(ends)

    def in_step(self) -> dict[str, dict]:
        """op -> the eager op's time a call inside the step and alone, and their ratio."""
        out = {}
        for op, alone in self.eager_call_s.items():
            calls = self.calls.get(op)
            if not calls or op not in self.op_s or not alone > 0:
                continue
            inside = self._t(op) / calls
            out[op] = {"in_step_s": inside, "alone_s": alone, "ratio": inside / alone}
        return out

    def disagree(self) -> list[str]:
        """The ops whose time alone is more than IN_STEP_RATIO from their time in the step."""
        return [
            op for op, c in self.in_step().items() if not 1 / IN_STEP_RATIO <= c["ratio"] <= IN_STEP_RATIO
        ]

    def predict_in_step(self) -> float | None:
        """The prediction with each op's eager side as the step runs it: s_i x (in-step / alone)."""
        checks = self.in_step()
        if not self.complete or set(checks) != set(self.op_s):
            return None
        return _gain(
            self.fractions, {op: sp["median"] * checks[op]["ratio"] for op, sp in self.op_speedups.items()}
        )

    def caveat(self) -> str:
        """Why the prediction says nothing the user sees, where the eager step is not device-bound
        ('' where it is, or on a CPU, where the step and the ops are host time alike)."""
        why = []
        if self.gpu_idle_pct is not None and self.gpu_idle_pct > DEVICE_BOUND_IDLE_PCT:
            why.append(f"its GPU idles {self.gpu_idle_pct:.0f}% of it (over {DEVICE_BOUND_IDLE_PCT:.0f}%)")
        if self.host_s is not None and self.device_s is not None and self.host_s >= self.device_s:
            why.append(
                f"its host time ({self.host_s * 1e3:.1f} ms) is at least its kernel time "
                f"({self.device_s * 1e3:.1f} ms)"
            )
        if not why:
            return ""
        return (
            f"the eager step is not device-bound ({'; '.join(why)}): Amdahl over device time predicts "
            "its kernels' time, not the step's"
        )

    def to_dict(self) -> dict:
        median = self.predict()
        predicted = None
        if median is not None:
            low, high = self.interval()
            predicted = {
                "median": median,
                "low": low,  # the ops' CIs and the shares' spread
                "high": high,
                "ops_low": self.predict("low"),  # the ops' CIs alone
                "ops_high": self.predict("high"),
                "in_step": self.predict_in_step(),
            }
        return {
            **{k: v for k, v in asdict(self).items()},
            "fractions": self.fractions,
            "f": self.f,
            "ceiling": self.ceiling,
            "predicted": predicted,
            "in_step_check": self.in_step(),
            "disagree": self.disagree(),
            "caveat": self.caveat(),
            "thresholds": {"device_bound_idle_pct": DEVICE_BOUND_IDLE_PCT, "in_step_ratio": IN_STEP_RATIO},
        }
