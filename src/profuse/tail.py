"""The SwiGLU tail, y = rms_norm(silu(gate) * up + residual) * weight, in every variant.

    y = h * rstd * w,   h = silu(g) * u + r,   rstd = 1 / sqrt(mean(h^2) + eps)

Each variant takes (gate, up, residual, weight, eps=1e-6): three (..., N) tensors and a (N,)
weight, and returns y shaped like gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from profuse import compile as _compile
from profuse.env import interpreting
from profuse.kernels import HAS_TRITON, TRITON_MISSING

DEFAULT_EPS = 1e-6
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tail_eager(gate, up, residual, weight, eps: float = DEFAULT_EPS):
    """The math one op at a time, in the input dtype: silu, mul, add, square, mean, rsqrt, mul, mul."""
    h = F.silu(gate) * up + residual
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd * weight


def tail_rms_norm(gate, up, residual, weight, eps: float = DEFAULT_EPS):
    """Eager as many users write it: the norm through torch.nn.functional.rms_norm."""
    h = F.silu(gate) * up + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def tail_reference(gate, up, residual, weight, eps: float = DEFAULT_EPS):
    """The oracle: the same math in float64."""
    g, u, r, w = (t.double() for t in (gate, up, residual, weight))
    return tail_eager(g, u, r, w, eps)


_compiled: dict[str, Callable] = {}  # compile mode -> tail_eager compiled in it


def tail_compiled(gate, up, residual, weight, eps: float = DEFAULT_EPS, *, mode: str = "default"):
    """tail_eager under torch.compile: Inductor fuses the chain. `mode` is a key of
    profuse.compile.MODES ("default", "max-autotune"); each is compiled once, on first use."""
    fn = _compiled.get(mode)
    if fn is None:
        fn = _compiled[mode] = _compile.compile_fn(tail_eager, mode)
    return fn(gate, up, residual, weight, eps)


def check_tail_args(gate, up, residual, weight) -> None:
    """Raise ValueError naming the argument whose type, shape, dtype or device is off.

    Every call of tail_triton pays this, so inputs that are right pass one chain of comparisons;
    only wrong ones are looked at one by one, for the message.
    """
    try:
        shape, dtype, device = gate.shape, gate.dtype, gate.device
        ok = (
            up.shape == shape and residual.shape == shape and weight.shape == shape[-1:]
            and shape[-1] > 0 and dtype in SUPPORTED_DTYPES
            and up.dtype == dtype and residual.dtype == dtype and weight.dtype == dtype
            and up.device == device and residual.device == device and weight.device == device
            and isinstance(gate, torch.Tensor)
        )  # fmt: skip
    except (AttributeError, IndexError, TypeError):
        ok = False
    if not ok:
        _explain_tail_args(gate, up, residual, weight)


def _explain_tail_args(gate, up, residual, weight) -> None:
    named = {"gate": gate, "up": up, "residual": residual, "weight": weight}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if gate.dim() < 1 or gate.shape[-1] == 0:
        raise ValueError(f"gate must have a non-empty last dimension, got shape {tuple(gate.shape)}")
    if gate.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate has dtype {gate.dtype}; supported: bfloat16, float16, float32")
    for name in ("up", "residual"):
        if named[name].shape != gate.shape:
            raise ValueError(f"{name} has shape {tuple(named[name].shape)}, gate has {tuple(gate.shape)}")
    if weight.shape != (gate.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({gate.shape[-1]},)")
    for name in ("up", "residual", "weight"):
        t = named[name]
        if t.dtype != gate.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, gate has {gate.dtype}")
        if t.device != gate.device:
            raise ValueError(f"{name} is on {t.device}, gate is on {gate.device}")
    raise ValueError("gate, up, residual and weight do not fit together")  # a safety net


def tail_triton(gate, up, residual, weight, eps: float = DEFAULT_EPS):
    """The hand-written Triton kernels: one pass forward, one pass backward, fp32 inside.

    Differentiable in gate, up, residual and weight; a custom op, so torch.compile calls it
    without a graph break. Inputs may be strided (columns are copied contiguous if they are not).
    """
    check_tail_args(gate, up, residual, weight)
    return (_FUSED or _load_fused())(gate, up, residual, weight, float(eps))


# The kernels' entry point, imported on the first call: importing the kernels builds their
# Triton wrappers (and must follow TRITON_INTERPRET's setting), so `import profuse` stays light.
_FUSED = None


def _load_fused():
    global _FUSED
    if not HAS_TRITON:
        raise RuntimeError(TRITON_MISSING)
    from profuse.kernels.tail import tail_fused

    _FUSED = tail_fused
    return _FUSED


class FusedTail(torch.nn.Module):
    """y = rms_norm(silu(gate) * up + residual) * weight, with the weight as a parameter.

    `impl` picks the variant: "triton", "eager", "rms_norm" or "compile"; left out, "auto": the
    Triton kernels for CUDA inputs (where triton is installed), eager for CPU inputs (the kernels
    run on a CPU only through Triton's interpreter, TRITON_INTERPRET=1, which "auto" then uses).
    An impl that cannot run on this machine is refused here, not at the first call.
    """

    def __init__(self, dim: int, eps: float = DEFAULT_EPS, impl: str | None = None, dtype=None, device=None):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.impl = impl or "auto"
        if self.impl != "auto" and self.impl not in _MODULE_IMPLS:
            raise ValueError(f"impl must be auto or one of {sorted(_MODULE_IMPLS)}, got {self.impl!r}")
        if self.impl == "triton" and not HAS_TRITON:
            raise ValueError(f"impl='triton' cannot run: {TRITON_MISSING}")
        if self.impl == "triton" and not (torch.cuda.is_available() or interpreting()):
            raise ValueError(
                "impl='triton' cannot run here: its kernels need a CUDA GPU (or TRITON_INTERPRET=1 set "
                "before triton is imported, slow); leave impl out to run eager on a CPU"
            )
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps
        # "auto", chosen once: the per-call choice is one attribute read (gate.is_cuda).
        self._auto = {
            True: "triton" if HAS_TRITON else "eager",
            False: "triton" if HAS_TRITON and interpreting() else "eager",
        }

    def impl_for(self, device: torch.device | str) -> str:
        """The variant a call with inputs on `device` runs."""
        return self._auto[torch.device(device).type == "cuda"] if self.impl == "auto" else self.impl

    def forward(self, gate, up, residual):
        impl = self._auto[gate.is_cuda] if self.impl == "auto" else self.impl
        return _MODULE_IMPLS[impl](gate, up, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}, impl={self.impl!r}"


_MODULE_IMPLS = {
    "triton": tail_triton,
    "eager": tail_eager,
    "rms_norm": tail_rms_norm,
    "compile": tail_compiled,
}


# --------------------------------------------------------------------------------------------
# Tolerances: relative error ||out - ref|| / ||ref|| against float64
# --------------------------------------------------------------------------------------------

# Unit roundoff u of each dtype. One rounding of the output costs at most u per element; eager
# rounds after each of its ~8 ops, so its error can reach ~8u in the worst case (sqrt(8)u ~ 3u
# typical). A variant within 8u is as good as eager can be; beyond it something is wrong.
# fp32: the mean over N columns adds ~log2(N) u of summation error, and the reference rounds
# nothing, so it gets a floor of 1e-5 (at u = 6e-8, that is far below any real bug).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
FORWARD_TOL = {dt: max(8 * u, 1e-5) for dt, u in UNIT_ROUNDOFF.items()}
# Gradients pass through ~twice the ops, and the row reduction in dh and the column sum in dw
# add summation error: 16u, with the same fp32 floor.
BACKWARD_TOL = {dt: max(16 * u, 1e-5) for dt, u in UNIT_ROUNDOFF.items()}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out holds NaN or Inf."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    den = torch.linalg.vector_norm(r).item()
    return torch.linalg.vector_norm(o - r).item() / (den if den > 0 else 1.0)
