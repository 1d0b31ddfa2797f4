"""Part C's prediction: the ops fusion replaces, timed alone at the model's shapes, and Amdahl.

The eager profile gives the share f_i of the step in each op fusion replaces (forward and
backward, traced through autograd's sequence numbers); each op's own speedup s_i, fused vs the
model's own unfused op, is timed like Part B (interleaved trials of device time, the L2
flushed); the step's gain is then predicted as 1 / ((1 - sum f_i) + sum f_i / s_i), and printed
beside the gain measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from profuse import fusion
from profuse import model as M
from profuse.bench.stats import Speedup
from profuse.bench.timing import Comparison, compare
from profuse.env import dtype_name
from profuse.models.spec import ModelSpec

Progress = Callable[[str, int, int], None]


class StepConfig(Protocol):
    """What the op timings read of a run's settings (profuse.step.StepConfig has them all):
    plain values, so this module needs nothing of profuse.step, which imports it."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype  # the branches' dtype (the precision's)
    seed: int
    trials: int
    warmup: int


@dataclass
class OpTiming:
    """One block op at the model's shapes, fused vs eager, forward + backward, timed like Part B."""

    op: str
    shape: str  # e.g. "8192 x 5504 (gate_up 8192 x 11008) bf16"
    comparison: Comparison

    @property
    def speedup(self) -> Speedup:
        return self.comparison.speedups["fused"]

    def to_dict(self) -> dict:
        return {"op": self.op, "shape": self.shape, "comparison": self.comparison.to_dict()}


def _op_inputs(cfg: StepConfig) -> dict[str, tuple[list[torch.Tensor], str]]:
    """Fresh random inputs of each op as the model calls it (ModelSpec.op_shapes): (leaves, shape text)."""
    shapes, dev, dt = cfg.spec.op_shapes(), cfg.device, cfg.dtype
    n, d, f = shapes.tokens, shapes.d_model, shapes.ffn_hidden
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    rand = lambda *shape, dtype=dt: torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    stream = torch.float32  # the residual stream and the weights stay fp32 under autocast
    weight = 1 + 0.1 * rand(d, dtype=stream)
    return {
        fusion.SILU_MUL: ([rand(n, 2 * f)], f"{n} x {f} (gate_up {n} x {2 * f}) {dtype_name(dt)}"),
        fusion.ADD_RMS_NORM: (
            [rand(n, d), rand(n, d, dtype=stream), weight],
            f"{n} x {d}, x {dtype_name(dt)}, residual {dtype_name(stream)}",
        ),
    }


def _fwd_bwd(fn: Callable, leaves: list[torch.Tensor], douts: list[torch.Tensor]) -> Callable[[], object]:
    """A call of `fn` forward and backward, the output gradients `douts` in its outputs' dtypes."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    with torch.no_grad():
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    douts = [g.to(o.dtype) for g, o in zip(douts, outs)]  # cast once here, not in every timed call

    def run():
        outs = fn(*leaves)
        # autograd.grad returns fresh gradients: nothing accumulates between calls.
        return torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), leaves, douts)

    return run


def time_block_ops(
    cfg: StepConfig, ops: fusion.BlockOps, progress: Progress | None = None
) -> dict[str, OpTiming]:
    """Each block op, the fused one vs the model's own unfused one, forward + backward, in
    interleaved trials of device time with the L2 flushed (Part B's way)."""
    eps = cfg.spec.op_shapes().eps
    # The unfused side: the built-in GPT's own ops; for Hugging Face models their own eager math
    # (fusion.HF_EAGER), which the labelled eager profile runs and whose share f is.
    silu_mul, add_rms_norm = M.silu_mul, M.add_rms_norm
    if cfg.spec.family != "gpt":
        silu_mul, add_rms_norm = fusion.HF_EAGER.silu_mul, fusion.HF_EAGER.add_rms_norm
    impls = {
        fusion.SILU_MUL: (silu_mul, ops.silu_mul),
        fusion.ADD_RMS_NORM: (
            lambda x, r, w: add_rms_norm(x, r, w, eps),
            lambda x, r, w: ops.add_rms_norm(x, r, w, eps),
        ),
    }
    out = {}
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    for op, (leaves, shape) in _op_inputs(cfg).items():
        eager, fused = impls[op]
        with torch.no_grad():
            outs = eager(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        douts = [torch.randn(o.shape, generator=gen, device=cfg.device, dtype=o.dtype) for o in outs]
        say = (
            (lambda stage, done, total, op=op: progress(f"{op}: {stage}", done, total)) if progress else None
        )
        comparison = compare(
            {"eager": _fwd_bwd(eager, leaves, douts), "fused": _fwd_bwd(fused, leaves, douts)},
            "eager",
            trials=cfg.trials,
            device=cfg.device,
            warmup=cfg.warmup,
            flush_l2=True,
            seed=cfg.seed,
            progress=say,
            timing="device",
        )
        out[op] = OpTiming(op, shape, comparison)
        del leaves, douts, outs
    return out


@dataclass
class Amdahl:
    """The step's gain predicted from the ops fusion replaces, beside the gain measured."""

    eager_step_s: float  # the timed eager step: the denominator of every share
    op_s: dict[str, float]  # op -> its time per eager step in the profile, forward and backward
    op_speedups: dict[str, dict]  # op -> Speedup.to_dict(): fused op vs eager op (empty: not timed)
    measured: dict | None  # Speedup.to_dict() of the fused step over eager, as timed

    @property
    def fractions(self) -> dict[str, float]:
        return {op: min(t / self.eager_step_s, 1.0) for op, t in self.op_s.items()}

    @property
    def f(self) -> float:
        return min(sum(self.fractions.values()), 1.0)

    @property
    def ceiling(self) -> float:
        """The gain if those ops took no time at all: 1 / (1 - f)."""
        return 1.0 / (1.0 - self.f) if self.f < 1.0 else math.inf

    def predict(self, which: str = "median") -> float | None:
        """1 / ((1 - sum f) + sum f_i / s_i), with each op's speedup median, low or high."""
        if set(self.op_speedups) != set(self.op_s):
            return None
        fr = self.fractions
        rest = 1.0 - sum(fr.values())
        return 1.0 / (max(rest, 0.0) + sum(fr[op] / self.op_speedups[op][which] for op in fr))

    def to_dict(self) -> dict:
        return {
            "eager_step_s": self.eager_step_s,
            "op_s": self.op_s,
            "fractions": self.fractions,
            "f": self.f,
            "ceiling": self.ceiling,
            "op_speedups": self.op_speedups,
            "predicted": None
            if self.predict() is None
            else {"median": self.predict(), "low": self.predict("low"), "high": self.predict("high")},
            "measured": self.measured,
        }
