"""Part C's same-math checks: a variant must compute what the unfused step computes, as closely
as the unfused step computes it itself, before it is timed.

Two checks, for two questions:

small   Is the math right? On a copy of the model cut to CHECK_LAYERS layers and CHECK_BATCH x
        CHECK_SEQ_LEN tokens (ModelSpec.small), before anything is built at full size: the
        variant's loss and every gradient against float64, within max(the dtype's tolerance,
        CHECK_FACTOR x the unfused step's own error). It takes seconds, it is the only check
        that runs the model in double precision, and a variant that fails it is never built,
        compiled or timed.
full    Do the kernels that are timed compute it? At the run's own size, on the batch the steps
        are timed on, so each fused op runs the launch plan its timed calls use (a plan is picked
        per shape: profuse.kernels.autotune): the loss and every parameter's gradient, tensor by
        tensor, against a reference, the unfused model run in fp32 without autocast (float64
        where the step itself computes in fp32: fp32 against fp32 cannot tell rounding from a
        bug). Each tensor's bound is tied to the unfused step's own error for that tensor, at
        most FULL_FACTOR times it, with a floor at the compute dtype's rounding level (FLOOR).
        One gradient norm over all parameters is dominated by the largest tensor (Llama-3.2-1B's
        263M-element embedding), so a norm weight's gradient 1% off moves it by ~1e-5 and passes
        a bound of 12.5%; per tensor the same error is ~100x over its bound.

The full check's memory: the reference is computed before any variant's own steps, beside the
run's resident parameters and AdamW state only, in as few chunks of whole sequences as fit
(plan_chunks, reference_bytes: one chunk's activations in the reference dtype, the reference's
gradients, an fp32 copy of the model where the parameters are in another dtype, and the unfused
step's gradients); its gradients then wait on the host (5 GB for Llama-3.2-1B) and go back to the
device one tensor at a time as each variant is compared, so nothing of the check is resident
while a variant's memory is measured. Where even one sequence at a time cannot fit, the full
check is not run and says so in one line; the small check still gates every variant.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
from torch import nn

from profuse.env import dtype_name, free_memory_bytes
from profuse.models import ModelSpec, experts
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, UNIT_ROUNDOFF, relative_error

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

# The small check: a variant may be this many times further from float64 than the unfused step:
# two roundings of like size, summed over a whole tensor, differ by much less than 2x.
CHECK_FACTOR = 2.0

# The full check, per tensor: at most FULL_FACTOR x the unfused step's own error against the
# reference (the same reasoning as CHECK_FACTOR), never below FLOOR: one rounding of the compute
# dtype (tail.UNIT_ROUNDOFF: 3.9e-3 in bf16), for tensors the unfused step computes closer than
# that (an fp32 path, or the loss, whose errors average out over the tokens); fp32's floor is
# tail's 1e-5 (summation error over the rows). A bf16 norm weight gradient scaled by 1.01 is 1e-2
# off: over the floor, and over 2x any unfused error under 5e-3.
FULL_FACTOR = 2.0
# Triton's interpreter (the CPU stand-in for the kernels) stores fp32 into bf16 and fp16 by
# truncation, not round-to-nearest as the GPU does, even with fp_downcast_rounding="rtne"
# (triton 3.9: 508 of 1024 random values differ from torch's cast, relative error 3.3e-3 against
# 1.6e-3): every 16-bit store errs twice as much, so a kernel's tensors may be twice as far again.
INTERPRETER_FACTOR = 2.0
FLOOR = {dt: max(u, 1e-5) for dt, u in UNIT_ROUNDOFF.items()}

WORST = 3  # tensors named as the worst, nearest (or over) their bounds

LOSS = "loss"


def grad_key(name: str) -> str:
    return f"grad {name}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class Prepared(Protocol):
    """A variant made from a model (profuse.step prepares them): what its step runs."""

    model: nn.Module  # the prepared model, whose parameters these are
    net: nn.Module  # the model, or the model under torch.compile
    loss: LossFn  # what its step minimises
    ref_loss: LossFn  # the same loss in profuse's own terms, for the unfused model and the reference
    globals: contextlib.AbstractContextManager  # module globals it patches while it runs


# --------------------------------------------------------------------------------------------
# The small check: a 2-layer copy against float64
# --------------------------------------------------------------------------------------------


@dataclass
class MathCheck:
    """A variant's step against the unfused one, both against float64, on a small model."""

    model: dict  # the small model's dims (ModelSpec.dims)
    precision: str
    passed: bool
    # "loss" and every parameter's gradient -> [variant rel err, unfused rel err] vs float64
    errors: dict[str, list[float]] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)  # max(dtype tol, CHECK_FACTOR * unfused's)
    max_abs_diff: float = math.nan  # variant vs unfused, over the loss and every gradient
    worst: str = ""  # the quantity nearest its bound
    error: str = ""  # the exception, where the variant's step did not run

    def to_dict(self) -> dict:
        return asdict(self)


def _loss_and_grads(
    net: nn.Module, model: nn.Module, batch: Batch, autocast, loss_fn: LossFn, module_globals=None
) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    with module_globals or contextlib.nullcontext(), autocast():
        loss = loss_fn(net, batch)
    with module_globals or contextlib.nullcontext():
        grads = torch.autograd.grad(loss, list(params.values()))
    return {LOSS: loss.detach(), **{grad_key(name): g for name, g in zip(params, grads)}}


def check_small(
    spec: ModelSpec,
    prepare: Callable[[ModelSpec, nn.Module], Prepared],
    *,
    device: torch.device,
    seed: int,
    precision: str,
    dtype: torch.dtype,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> MathCheck:
    """Loss and gradients of one step of `spec`'s small copy: the variant `prepare` makes of it,
    the unfused model, and float64. `dtype`: what the step computes in (its tolerances);
    `autocast`: the step's autocast; the parameters in `precision`'s dtype (ModelSpec.build_for).
    The variant and the unfused model compute the model's own loss (ModelSpec.loss), float64 its
    math from the logits (the variant's ref_loss, ModelSpec.reference_loss)."""
    small = spec.small()
    base = small.build_for(device, seed, precision)
    batch = small.batch(device, seed)
    check = MathCheck(model=small.dims(), precision=precision, passed=False)
    try:
        v = prepare(small, copy.deepcopy(base))
        ref_loss = v.ref_loss
        got = _loss_and_grads(v.net, v.model, batch, autocast, v.loss, v.globals)
    except Exception as err:  # a variant that cannot run here is a failed check, not a crash
        check.error = _first_line(err)
        return check
    ref_model = experts.for_dtype(copy.deepcopy(base).double(), torch.float64)
    ref = _loss_and_grads(ref_model, ref_model, batch, contextlib.nullcontext, ref_loss)
    unfused = _loss_and_grads(base, base, batch, autocast, small.loss)
    if got.keys() != ref.keys():
        check.error = "the variant changed the model's parameters: they no longer match the unfused model's"
        return check
    worst_ratio = -1.0
    for key, r in ref.items():
        v_err, u_err = relative_error(got[key], r), relative_error(unfused[key], r)
        tol = (FORWARD_TOL if key == LOSS else BACKWARD_TOL)[dtype]
        bound = max(tol, CHECK_FACTOR * u_err)
        check.errors[key], check.bounds[key] = [v_err, u_err], bound
        ratio = v_err / bound if math.isfinite(v_err) else math.inf
        if ratio > worst_ratio:
            worst_ratio, check.worst = ratio, key
    check.passed = worst_ratio <= 1.0
    check.max_abs_diff = max((got[k].float() - unfused[k].float()).abs().max().item() for k in ref)
    return check


# --------------------------------------------------------------------------------------------
# The full check: the run's size, tensor by tensor, against fp32 (or float64)
# --------------------------------------------------------------------------------------------


def reference_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """fp32 for a step that computes in bf16 or fp16; float64 for one that computes in fp32."""
    return torch.float64 if compute_dtype == torch.float32 else torch.float32


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def reference_bytes(
    n_params: int,
    param_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    activation_bytes: int,
    chunks: int = 1,
) -> int:
    """What computing the reference needs beside the run's resident state: its gradients, a copy
    of the model in the reference dtype where the parameters are in another, one chunk's
    activations in the reference dtype (`activation_bytes`: ModelSpec.activation_bytes of the
    whole batch in it, over `chunks`), and the unfused step's gradients compared with it."""
    ref = reference_dtype(compute_dtype)
    copy_bytes = n_params * _bytes(ref) if param_dtype != ref else 0
    return (
        n_params * _bytes(ref) + copy_bytes + -(-activation_bytes // chunks) + n_params * _bytes(param_dtype)
    )


def plan_chunks(batch_size: int, need: Callable[[int], int], device: torch.device) -> tuple[int, str]:
    """The fewest chunks of whole sequences (a divisor of `batch_size`) whose reference fits on
    `device` now: (chunks, ''), or (0, why not) in one line where not even one sequence at a time fits."""
    free = free_memory_bytes(device)
    for k in (k for k in range(1, batch_size + 1) if batch_size % k == 0):
        if free is None or need(k) <= 0.9 * free:
            return k, ""
    return 0, (
        f"the fp32 reference needs about {need(batch_size) / 1e9:.1f} GB beside the run even one sequence "
        f"at a time, and only {free / 1e9:.1f} GB is free"
    )


@contextlib.contextmanager
def _exact_matmuls():
    """fp32 matmuls in fp32, not TF32 (whose 10-bit mantissa is bf16's error, not a reference's)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@dataclass
class Reference:
    """The unfused model's loss and gradients in the reference dtype, at the run's size."""

    dtype: torch.dtype
    loss: float
    names: list[str]  # the parameters', in the optimizer's order
    grads: list[torch.Tensor | None]  # None: the loss does not reach that parameter
    chunks: int = 1  # computed this many sequences' chunks at a time, gradients summed

    @property
    def kind(self) -> str:
        return dtype_name(self.dtype)

    def to(self, device: torch.device | str) -> Reference:
        """The same reference with its gradients on `device` (the host, while the variants run)."""
        grads = [g.to(device) if g is not None else None for g in self.grads]
        return Reference(self.dtype, self.loss, self.names, grads, self.chunks)


def compute_reference(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    loss_fn: LossFn,
    batch: Batch,
    dtype: torch.dtype,
    chunks: int = 1,
) -> Reference:
    """The unfused `model`'s loss and gradients in `dtype`, with no autocast and no TF32.

    `params`: the model's parameters in the order the variants' gradients come in. Where they
    are in `dtype` already, the model itself runs (nothing copied; .grad is not touched);
    otherwise a copy of it in `dtype`. `chunks`: the batch's sequences split into this many equal
    chunks, one at a time, the loss their mean and the gradients their sum over `chunks` (the
    step's loss is a mean over equal-length sequences, and a causal LM's sequences do not see
    each other), so that only one chunk's activations are held."""
    named = list(model.named_parameters())
    if [id(p) for _, p in named] != [id(p) for p in params]:
        raise ValueError("params must be the model's own parameters, in model.parameters() order")
    size = batch[0].shape[0]
    if chunks < 1 or size % chunks:
        raise ValueError(f"chunks must divide the batch's {size} sequences, got {chunks}")
    ref = model if all(p.dtype == dtype for p in params) else copy.deepcopy(model).to(dtype)
    if ref is not model:  # grouped_mm experts take no float64: the copy runs the eager loop's same math
        experts.for_dtype(ref, dtype)
    ref_params = list(ref.parameters())
    device_type = params[0].device.type if params else "cpu"
    per = size // chunks
    total = 0.0
    grads: list[torch.Tensor | None] = [None] * len(ref_params)
    with _exact_matmuls(), torch.autocast(device_type, enabled=False):
        for i in range(chunks):
            part = tuple(t[i * per : (i + 1) * per] for t in batch)
            loss = loss_fn(ref, part) / chunks
            for j, g in enumerate(torch.autograd.grad(loss, ref_params, allow_unused=True)):
                if g is not None:
                    grads[j] = g.detach() if grads[j] is None else grads[j].add_(g)
            total += loss.item()
            del loss
    return Reference(dtype, total, [n for n, _ in named], grads, chunks)


def _norms(x: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, float]:
    """(||x - ref||, ||ref||) in the reference's dtype, ref moved to x's device; a missing
    gradient is zero; (inf, ...) where x holds NaN or Inf."""
    if ref is None:
        return (0.0 if x is None else torch.linalg.vector_norm(x).item()), 0.0
    if x is None:
        den = torch.linalg.vector_norm(ref).item()
        return den, den
    if not bool(torch.isfinite(x).all()):
        return math.inf, 0.0
    r = ref.to(x.device)
    return torch.linalg.vector_norm(x.to(r.dtype) - r).item(), torch.linalg.vector_norm(r).item()


def _rel_scalar(x: float, ref: float) -> float:
    if not math.isfinite(x):
        return math.inf
    return abs(x - ref) / abs(ref) if ref != 0 else abs(x)


def compare_to(
    loss: float, grads: Sequence[torch.Tensor | None], ref: Reference
) -> tuple[dict[str, float], float]:
    """One step against the reference: ({"loss": rel err, "grad NAME": rel err, ...}, the
    gradients' error as one vector, what a global-norm check reads). The reference's gradients
    are moved to the step's device one at a time."""
    if len(grads) != len(ref.grads):
        raise ValueError(f"{len(grads)} gradients for the reference's {len(ref.grads)} parameters")
    out = {LOSS: _rel_scalar(loss, ref.loss)}
    num2 = den2 = 0.0
    for name, g, r in zip(ref.names, grads, ref.grads):
        num, den = _norms(g, r)
        out[grad_key(name)] = num / den if den > 0 else num
        num2, den2 = num2 + num * num, den2 + den * den
    glob = math.sqrt(num2 / den2) if den2 > 0 else math.sqrt(num2)
    return out, glob


@dataclass
class FullCheck:
    """A variant's loss and gradients at the run's size, each against the reference, each
    within its bound: max(FULL_FACTOR x the unfused step's error for that tensor, FLOOR)."""

    reference: str  # the reference's dtype: "float32" or "float64"
    passed: bool
    # "loss" and "grad NAME" -> [this variant's rel err, the unfused step's, the bound]
    errors: dict[str, list[float]] = field(default_factory=dict)
    worst: list[str] = field(default_factory=list)  # nearest (or over) their bounds, worst first
    global_error: float = math.nan  # every gradient as one vector: what a global-norm check reads
    unfused_global_error: float = math.nan
    factor: float = FULL_FACTOR
    floor: float = math.nan
    error: str = ""  # why the variant could not be checked

    def ratio(self, key: str) -> float:
        err, _, bound = self.errors[key]
        return err / bound if math.isfinite(err) else math.inf

    def reason(self) -> str:
        """One line: the worst tensor over its bound (empty where it passed)."""
        if self.error:
            return self.error
        if self.passed or not self.worst:
            return ""
        key = self.worst[0]
        err, unfused, bound = self.errors[key]
        return (
            f"its {key} is {err:.1e} (relative) from {self.reference}, over its bound {bound:.1e} "
            f"(the unfused step's {unfused:.1e} x {self.factor:g}, floor {self.floor:.1e})"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def judge(
    errors: dict[str, float],
    unfused: dict[str, float],
    dtype: torch.dtype,
    reference: str,
    *,
    global_err: float = math.nan,
    unfused_global_err: float = math.nan,
    interpreted: bool = False,
) -> FullCheck:
    """Each tensor's error against its bound, max(FULL_FACTOR x `unfused`'s, FLOOR[dtype]);
    `dtype` is what the step computes in. `interpreted`: the variant's kernels ran in Triton's
    interpreter, whose 16-bit stores truncate (the factor grows by INTERPRETER_FACTOR)."""
    if errors.keys() != unfused.keys():
        raise ValueError("the variant's tensors are not the unfused step's")
    floor = FLOOR[dtype]
    factor = FULL_FACTOR * (INTERPRETER_FACTOR if interpreted and dtype.itemsize == 2 else 1.0)
    check = FullCheck(reference, passed=False, factor=factor, floor=floor)
    check.global_error, check.unfused_global_error = global_err, unfused_global_err
    for key, err in errors.items():
        check.errors[key] = [err, unfused[key], max(factor * unfused[key], floor)]
    ranked = sorted(check.errors, key=check.ratio, reverse=True)
    check.worst = ranked[:WORST]
    check.passed = all(check.ratio(k) <= 1.0 for k in ranked)
    return check


def failed_check(reference: str, why: str) -> FullCheck:
    """A variant whose step could not be run for the check."""
    return FullCheck(reference, passed=False, error=why)


# --------------------------------------------------------------------------------------------
# Each variant's row: checked or not, at which size, against what
# --------------------------------------------------------------------------------------------

FULL, SMALL = "full size", "small copy"


@dataclass
class MathStatus:
    """Whether a variant's math was checked before its figures were timed, and how: `sizes` the
    checks it passed through ("full size": the timed shapes and batch, per tensor; "small copy":
    CHECK_LAYERS layers and CHECK_BATCH x CHECK_SEQ_LEN tokens), `against` what each compared
    with, `passed` (None where nothing checked it), `note` why not, where not."""

    checked: bool
    passed: bool | None
    sizes: list[str] = field(default_factory=list)
    against: list[str] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """'full size against the unfused model in float64, passed' or 'NOT checked (why)'."""
        if not self.checked:
            return f"NOT checked ({self.note})" if self.note else "NOT checked"
        how = "; ".join(f"{s} against {a}" for s, a in zip(self.sizes, self.against))
        word = "passed" if self.passed else "FAILED"
        return f"{how}, {word}" + (f" ({self.note})" if self.note else "")


def status(
    name: str,
    small: MathCheck | None,
    full: FullCheck | None,
    *,
    baseline: bool = False,
    why_not: str = "",
) -> MathStatus:
    """Variant `name`'s row from its own checks: `small` (check_small's), `full` (judge's), or
    neither (`why_not`). The baseline's full-size errors are the bounds' own (it passes by
    definition), so its row says what it was compared with and that it sets the bounds."""
    sizes, against, passed = [], [], []
    if full is not None and not full.error:
        sizes.append(FULL)
        against.append(f"the unfused model in {full.reference}, per tensor")
        passed.append(full.passed)
    if small is not None and not small.error:
        sizes.append(SMALL)
        against.append("float64" if not baseline else "float64 (the unfused step)")
        passed.append(small.passed)
    if not sizes:
        errors = [c.error for c in (full, small) if c is not None and c.error]
        return MathStatus(False, None, note=errors[0] if errors else why_not)
    note = "the baseline: its own error sets each bound" if baseline else ""
    return MathStatus(True, all(passed), sizes, against, note)
