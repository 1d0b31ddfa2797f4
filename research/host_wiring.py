"""What a fused op's wiring costs the host per call, counted so that the machine's load cannot move it.

The question: on the H200's host, profuse.tail_triton's forward + backward took 479 us of CPU a
call against F.rms_norm's 328 us (docs/results-h200.md, "Host time"). How much of a fused op's
host time is its wiring (autograd.Function, custom ops, register_autograd, triton_op, the
launcher's own Python), and which wiring is cheapest?

Every wiring below runs the same stand-in kernel: each launch is one `out.zero_()` on its first
output, on tiny CPU tensors, so what differs between rows is the wiring alone. The launchers are
profuse's own (profuse.kernels.swiglu.silu_mul_forward / silu_mul_backward,
profuse.kernels.add_rms_norm.add_rms_norm_forward / add_rms_norm_backward): each builds its plan
on the first call, then looks it up and calls `Launch`. The one change to profuse: `Launch.__init__`
is wrapped so that every Launch made in this process runs the stand-in instead of its Triton
kernel (the Triton launcher's own host path is not counted; see HOST_WIRING.md).

Two counts, both deterministic for the same binary and inputs:
  * Python calls per op call (sys.setprofile: 'call' events, Python frames entered; 'c_call'
    events, builtins called from Python), and the torch.profiler op events per call (how many
    times the dispatcher's RecordFunction fired: aten ops, custom ops, autograd nodes).
  * with --callgrind: instructions per call (valgrind --tool=callgrind, instrumentation switched
    on only around the measured loops through callgrind's client requests).

Run (from the repository root):
    PYTHONPATH=src python research/host_wiring.py                 # Python calls, op events
    PYTHONPATH=src python research/host_wiring.py --callgrind     # and instructions per call
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

# Without a GPU, profuse's launchers refuse CPU tensors unless Triton's interpreter is on; the
# stand-in launch (use_stand_in) means the interpreter never runs anything. With a GPU the
# wirings below can be imported and run with profuse's real kernels (no stand-in).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import profuse.kernels.autotune as autotune  # noqa: E402
from profuse import blockops, tail  # noqa: E402
from profuse.kernels.add_rms_norm import add_rms_norm_backward, add_rms_norm_forward  # noqa: E402
from profuse.kernels.swiglu import silu_mul_backward, silu_mul_forward  # noqa: E402

ROWS, COLS, EPS = 4, 8, 1e-6

# --------------------------------------------------------------------------------------------
# The stand-in kernel: profuse's Launch, running one aten op instead of Triton
# --------------------------------------------------------------------------------------------

# Which runtime argument is the launch's first output, by Launch.kind (see each launcher's args).
OUTPUT_ARG = {
    "silu_mul fwd": 2,
    "silu_mul bwd": 3,
    "add_rms_norm fwd": 3,
    "add_rms_norm bwd": 5,
    "dw sum": 1,
    "fwd": 4,  # the tail's forward (kernels/tail/plans.py)
    "bwd": 6,  # the tail's one-pass backward
}
TRACE: dict | None = None  # set to a dict to record the Python stack at each launch


def stand_in(out_arg: int):
    def run(*args, **meta):
        if TRACE is not None:
            TRACE.setdefault("stacks", []).append(traceback.extract_stack()[:-1])
        args[out_arg].zero_()

    return run


def use_stand_in() -> None:
    """From now on every profuse Launch made runs the stand-in instead of its Triton kernel: the
    launcher's Python (plan lookup, Launch.__call__, log_launch) is kept, Triton's own launch
    path is not. Call it before the first call of any op (plans keep their Launch)."""
    original_init = autotune.Launch.__init__

    def init_with_stand_in(self, kernel, grid, config, kind, **meta):
        original_init(self, kernel, grid, config, kind, **meta)
        self.run = stand_in(OUTPUT_ARG[kind])

    autotune.Launch.__init__ = init_with_stand_in


def direct_launch(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """The floor's launch: the stand-in kernel called directly, no launcher."""
    if TRACE is not None:
        TRACE.setdefault("stacks", []).append(traceback.extract_stack()[:-1])
    out.zero_()


# --------------------------------------------------------------------------------------------
# silu_mul: a = silu(g) * u, wired six ways
# --------------------------------------------------------------------------------------------


def silu_eager(g, u):
    return F.silu(g) * u


# (b) autograd.Function over two custom ops: the shape of profuse's traced branch
# (SiluMulFunction under torch.compile), here called eagerly.
@torch.library.custom_op("hostpath::silu_fwd", mutates_args=())
def silu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_forward(gate, up)


@torch.library.custom_op("hostpath::silu_bwd", mutates_args=())
def silu_bwd_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, need_gate: bool, need_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = silu_mul_backward(grad, gate, up, (need_gate, need_up))
    return (gate.new_empty(0) if dg is None else dg), (gate.new_empty(0) if du is None else du)


class SiluOverOps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        a = torch.ops.hostpath.silu_fwd(gate, up)
        ctx.save_for_backward(gate, up)
        return a

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad
        dg, du = torch.ops.hostpath.silu_bwd(grad, gate, up, need_g, need_u)
        return (dg if need_g else None), (du if need_u else None)


def silu_over_ops(g, u):
    blockops.check_silu_mul_args(g, u)
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return SiluOverOps.apply(g, u)
    return torch.ops.hostpath.silu_fwd(g, u)


# (c) one custom op whose autograd is registered (torch.library.register_autograd); its
# backward is another custom op (the one (b) uses).
@torch.library.custom_op("hostpath::silu_ra", mutates_args=())
def silu_ra_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_forward(gate, up)


def silu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def silu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    need_g, need_u = ctx.needs_input_grad
    dg, du = torch.ops.hostpath.silu_bwd(grad, gate, up, need_g, need_u)
    return (dg if need_g else None), (du if need_u else None)


silu_ra_op.register_autograd(silu_backward, setup_context=silu_setup)


def silu_registered(g, u):
    blockops.check_silu_mul_args(g, u)
    return torch.ops.hostpath.silu_ra(g, u)


# (c') the same with torch.library.triton_op (whose eager call is a custom op's, inside a
# context that turns wrap_triton's tracing off).
def silu_tr_body(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_forward(gate, up)


silu_tr_op = torch.library.triton_op("hostpath::silu_tr", silu_tr_body, mutates_args=())
silu_tr_op.register_autograd(silu_backward, setup_context=silu_setup)


def silu_triton_op(g, u):
    blockops.check_silu_mul_args(g, u)
    return torch.ops.hostpath.silu_tr(g, u)


# (d') a bare Function over profuse's launchers: no argument check, no branches.
class SiluBareLaunchers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return silu_mul_backward(grad, gate, up, ctx.needs_input_grad)


# (d) the floor: a bare Function, the stand-in called directly (allocation as the launcher does).
class SiluFloor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        a = torch.empty_like(gate)
        direct_launch(a, gate)
        return a

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        direct_launch(dg, grad)
        return dg, du


# --------------------------------------------------------------------------------------------
# add_rms_norm: (y, h) = (rms_norm(x + r) * w, x + r), wired the same six ways
# --------------------------------------------------------------------------------------------


def add_rms_eager(x, r, w):
    return blockops.add_rms_norm_eager(x, r, w, EPS)


@torch.library.custom_op("hostpath::arn_fwd", mutates_args=())
def arn_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps)


@torch.library.custom_op("hostpath::arn_bwd", mutates_args=())
def arn_bwd_op(
    dy: torch.Tensor,
    dh: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    has_dh: bool,
    need_x: bool,
    need_residual: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # As profuse's op: an empty tensor where not asked for, and where dresidual is dx itself.
    dx, dr, dw = add_rms_norm_backward(
        dy,
        dh if has_dh else None,
        h,
        weight,
        rstd,
        x_dtype,
        residual_dtype,
        (need_x, need_residual, need_weight),
    )
    return (
        h.new_empty(0) if dx is None else dx,
        h.new_empty(0) if dr is None or dr is dx else dr,
        h.new_empty(0) if dw is None else dw,
    )


def arn_grads_from_op(ctx, dy, dh):
    """The backward through the custom op, as profuse's traced branch calls it."""
    h, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_w = ctx.needs_input_grad[:3]
    x_dtype, r_dtype = ctx.dtypes
    if dy is None:
        if dh is None:
            return None, None, None
        return (dh.to(x_dtype) if need_x else None), (dh.to(r_dtype) if need_r else None), None
    has_dh = dh is not None
    dx, dr, dw = torch.ops.hostpath.arn_bwd(
        dy, dh if has_dh else h, h, weight, rstd, x_dtype, r_dtype, has_dh, need_x, need_r, need_w
    )
    if need_x and need_r and x_dtype == r_dtype:
        dr = dx
    return (dx if need_x else None), (dr if need_r else None), (dw if need_w else None)


class ArnOverOps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        ctx.set_materialize_grads(False)
        y, h, rstd = torch.ops.hostpath.arn_fwd(x, residual, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        return (*arn_grads_from_op(ctx, dy, dh), None)


def arn_over_ops(x, r, w):
    blockops.check_add_rms_norm_args(x, r, w)
    if torch.is_grad_enabled() and (x.requires_grad or r.requires_grad or w.requires_grad):
        return ArnOverOps.apply(x, r, w, EPS)
    y, h, _ = torch.ops.hostpath.arn_fwd(x, r, w, EPS)
    return y, h


@torch.library.custom_op("hostpath::arn_ra", mutates_args=())
def arn_ra_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps)


def arn_setup(ctx, inputs, output):
    x, residual, weight, _ = inputs
    _, h, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(h, weight, rstd)
    ctx.dtypes = (x.dtype, residual.dtype)


def arn_backward(ctx, dy, dh, drstd):
    return (*arn_grads_from_op(ctx, dy, dh), None)


arn_ra_op.register_autograd(arn_backward, setup_context=arn_setup)


def arn_registered(x, r, w):
    blockops.check_add_rms_norm_args(x, r, w)
    y, h, _ = torch.ops.hostpath.arn_ra(x, r, w, EPS)
    return y, h


def arn_tr_body(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps)


arn_tr_op = torch.library.triton_op("hostpath::arn_tr", arn_tr_body, mutates_args=())
arn_tr_op.register_autograd(arn_backward, setup_context=arn_setup)


def arn_triton_op(x, r, w):
    blockops.check_add_rms_norm_args(x, r, w)
    y, h, _ = torch.ops.hostpath.arn_tr(x, r, w, EPS)
    return y, h


class ArnBareLaunchers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, h, rstd = add_rms_norm_forward(x, residual, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        grads = add_rms_norm_backward(dy, dh, h, weight, rstd, *ctx.dtypes, ctx.needs_input_grad[:3])
        return (*grads, None)


class ArnFloor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, h = torch.empty_like(x), torch.empty_like(residual)  # h: the (fp32) residual's dtype
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
        direct_launch(y, x)
        ctx.save_for_backward(h, weight, rstd)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        dx, dr = torch.empty_like(dy), torch.empty_like(h)  # x's dtype, the residual's
        partial = torch.empty((1, h.shape[-1]), dtype=torch.float32)
        direct_launch(dx, dy, h, dr, partial)  # the gradient kernel, with the dw partials
        dw = torch.empty_like(weight)
        direct_launch(dw, partial)  # the dw column sum's launch
        return dx, dr, dw, None


# --------------------------------------------------------------------------------------------
# The cases and the three calls each is counted for
# --------------------------------------------------------------------------------------------

WIRINGS = [
    ("eager", "a: eager torch ops (the bar; the tail's: F.rms_norm)"),
    ("profuse", "e: profuse today (Function -> launcher, eager branch)"),
    ("over_ops", "b: Function over custom ops (profuse's traced branch, called eagerly)"),
    ("registered", "c: custom_op + register_autograd (backward a custom op)"),
    ("triton_op", "c': triton_op + register_autograd (backward a custom op)"),
    ("bare_launchers", "d': bare Function -> profuse launchers"),
    ("floor", "d: bare Function -> stand-in directly (the floor)"),
]

SILU = {
    "eager": silu_eager,
    "profuse": blockops.silu_mul,
    "over_ops": silu_over_ops,
    "registered": silu_registered,
    "triton_op": silu_triton_op,
    "bare_launchers": SiluBareLaunchers.apply,
    "floor": SiluFloor.apply,
}
TAIL = {
    "eager": lambda g, u, r, w: tail.tail_rms_norm(g, u, r, w, EPS),
    "profuse": lambda g, u, r, w: tail.tail_triton(g, u, r, w, EPS),
}
ARN = {
    "eager": add_rms_eager,
    "profuse": lambda x, r, w: blockops.add_rms_norm(x, r, w, EPS),
    "over_ops": arn_over_ops,
    "registered": arn_registered,
    "triton_op": arn_triton_op,
    "bare_launchers": lambda x, r, w: ArnBareLaunchers.apply(x, r, w, EPS),
    "floor": lambda x, r, w: ArnFloor.apply(x, r, w, EPS),
}


# Dtypes as benchmarks/host_overhead.py has them on the H200: bf16 activations, and for
# add_rms_norm an fp32 residual stream and weight (h and dh fp32).
BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = {
    "silu_mul": ((BF16, BF16), (BF16,)),
    "add_rms_norm": ((BF16, FP32, FP32), (BF16, FP32)),
    "tail": ((BF16, BF16, BF16, BF16), (BF16,)),
}


FAMILIES = {"silu_mul": SILU, "add_rms_norm": ARN, "tail": TAIL}


def make_calls(op: str, fn):
    """(forward, forward + backward) for one wiring: zero-argument callables over fixed tiny CPU
    tensors, leaves that need gradients; the backward is torch.autograd.grad of every output
    for every input, as benchmarks/host_overhead.py calls it. The no-grad forward is `forward`
    counted with grad mode off around the whole loop (no context manager counted per call)."""
    torch.manual_seed(0)
    in_dtypes, grad_dtypes = DTYPES[op]
    args = [torch.randn(ROWS, COLS, dtype=d).requires_grad_() for d in in_dtypes]
    if op != "silu_mul":  # the weight: one row
        args[-1] = torch.randn(COLS, dtype=in_dtypes[-1]).requires_grad_()
    grads = [torch.randn(ROWS, COLS, dtype=d) for d in grad_dtypes]

    def fwd():
        fn(*args)

    def fwd_bwd():
        torch.autograd.grad(fn(*args), args, grads)

    return {"fwd_nograd": fwd, "fwd": fwd, "fwd_bwd": fwd_bwd}


def grad_mode(mode: str):
    """Grad mode for a case's whole loop: off for the no-grad forward."""
    return torch.set_grad_enabled(mode != "fwd_nograd")


# The pieces, each counted alone with grad mode off (the stand-in's tensors, 4 x 8 fp32).
@torch.library.custom_op("hostpath::fill", mutates_args=())
def fill_op(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out.zero_()
    return out


def fill(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out.zero_()
    return out


def pieces() -> dict:
    torch.manual_seed(0)
    g, u, a = (torch.randn(ROWS, COLS) for _ in range(3))
    w = torch.randn(COLS)
    launch = autotune.Launch({(1,): None}, (1,), None, "silu_mul fwd")  # runs the stand-in (above)
    return {
        "stand-in kernel: out.zero_()": lambda: a.zero_(),
        "torch.empty(shape, dtype=, device=)": lambda: torch.empty(g.shape, dtype=g.dtype, device=g.device),
        "torch.empty_like(t)": lambda: torch.empty_like(g),
        "torch.empty_like(t, memory_format=torch.contiguous_format)": lambda: torch.empty_like(
            g, memory_format=torch.contiguous_format
        ),
        "t.new_empty(shape)": lambda: g.new_empty(g.shape),
        "t.device (a torch.device made)": lambda: g.device,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "blockops.check_silu_mul_args": lambda: blockops.check_silu_mul_args(g, u),
        "blockops.check_add_rms_norm_args": lambda: blockops.check_add_rms_norm_args(g, u, w),
        "profuse Launch(...)(*args), stand-in run": lambda: launch(g, u, a),
        "Python fn: empty_like + zero_": lambda: fill(g),
        "custom_op: empty_like + zero_": lambda: torch.ops.hostpath.fill(g),
    }


def cases():
    for op, table in FAMILIES.items():
        for wiring in table:
            for mode, call in make_calls(op, table[wiring]).items():
                yield op, wiring, mode, call
    for name, call in pieces().items():
        yield "piece", name, "fwd_nograd", call


def empty_call():
    return None


def check_against_eager() -> list[tuple[str, str, float]]:
    """With profuse's real kernels (no stand-in; Triton's interpreter on CPU): each wiring's
    outputs and gradients against the eager row's, as (op, wiring, largest relative error of
    any output or gradient). The floor runs the stand-in whatever happens, so it is left out."""
    torch.manual_seed(1)
    rows = []
    for op, table in FAMILIES.items():
        in_dtypes, grad_dtypes = DTYPES[op]
        args = [torch.randn(5, 24, dtype=d).requires_grad_() for d in in_dtypes]
        if op != "silu_mul":
            args[-1] = (1 + 0.1 * torch.randn(24, dtype=in_dtypes[-1])).requires_grad_()
        grads = [torch.randn(5, 24, dtype=d) for d in grad_dtypes]
        ref = None
        for wiring, fn in table.items():
            if wiring == "floor":
                continue
            out = fn(*args)
            outs = out if isinstance(out, tuple) else (out,)
            vals = [t.float() for t in (*outs, *torch.autograd.grad(outs, args, grads))]
            if ref is None:
                ref = vals
                continue
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(vals, ref, strict=True))
            rows.append((op, wiring, err))
    return rows


def check_wirings() -> None:
    """Every wiring runs and hands back gradients shaped like its inputs (the values are the
    stand-in's, not the op's: this checks the wiring, not the math)."""
    for op, table in FAMILIES.items():
        for wiring in table:
            calls = make_calls(op, table[wiring])
            with torch.no_grad():
                calls["fwd_nograd"]()
            calls["fwd_bwd"]()


# --------------------------------------------------------------------------------------------
# Count 1: Python calls (sys.setprofile), op events (torch.profiler), the stack at the launch
# --------------------------------------------------------------------------------------------


def python_calls(call, mode: str, n: int) -> tuple[float, float]:
    """('call' events, 'c_call' events) per call of `call`, over n calls after 3 warm-ups, less
    an empty call's."""
    counts = collections.Counter()

    def hook(frame, event, arg):
        counts[event] += 1

    def run(fn):
        with grad_mode(mode):
            for _ in range(3):
                fn()
            counts.clear()
            gc.disable()
            sys.setprofile(hook)
            for _ in range(n):
                fn()
            sys.setprofile(None)
            gc.enable()
        return counts["call"] / n, counts["c_call"] / n

    base = run(empty_call)
    got = run(call)
    return got[0] - base[0], got[1] - base[1]


def op_events(call, mode: str) -> dict:
    """The torch.profiler events of one call after warm-up: how many, and by name."""
    with grad_mode(mode):
        for _ in range(3):
            call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    names = collections.Counter(e.name for e in prof.events())
    return {"total": sum(names.values()), "by_name": dict(sorted(names.items()))}


def launch_stacks(call, mode: str) -> list[list[str]]:
    """The Python frames between the harness's call and each launch (outermost first)."""
    global TRACE
    with grad_mode(mode):
        for _ in range(3):
            call()
        TRACE = {}
        try:
            call()
        finally:
            stacks, TRACE = TRACE.get("stacks", []), None
    out = []
    for stack in stacks:
        names = [f"{Path(f.filename).name}:{f.name}" for f in stack]
        start = max(i for i, n in enumerate(names) if n.endswith((":fwd", ":fwd_bwd")))
        out.append(names[start + 1 :])
    return out


# --------------------------------------------------------------------------------------------
# Count 2: instructions (callgrind, switched on around each loop by client requests)
# --------------------------------------------------------------------------------------------

CLIENT_C = r"""
#include <valgrind/callgrind.h>
void hp_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void hp_zero(void) { CALLGRIND_ZERO_STATS; }
void hp_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
int hp_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def build_client(folder: Path) -> ctypes.CDLL:
    src, lib = folder / "hp_client.c", folder / "hp_client.so"
    src.write_text(CLIENT_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def callgrind_child(folder: Path, n: int) -> None:
    """Run under valgrind: each case's n calls between a zero and a dump of the counters."""
    client = build_client(folder)
    if not client.hp_on_valgrind():
        raise SystemExit("--callgrind-child runs under valgrind only")
    all_cases = [("empty", "empty", "empty", empty_call), *cases()]
    for *_, mode, call in all_cases:  # warm: plans built, code paths seen, before counting starts
        with grad_mode(mode):
            for _ in range(3):
                call()
    client.hp_start()
    for op, wiring, mode, call in all_cases:
        with grad_mode(mode):
            for _ in range(2):
                call()
            gc.collect()
            gc.disable()
            client.hp_zero()
            for _ in range(n):
                call()
            client.hp_dump(f"{op}|{wiring}|{mode}".encode())
            gc.enable()


def run_callgrind(n: int) -> dict:
    """Instructions per call for every case, from a child process under callgrind."""
    if shutil.which("valgrind") is None or shutil.which("gcc") is None:
        raise SystemExit("--callgrind needs valgrind and gcc (with valgrind/callgrind.h)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        cmd = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={folder}/cg.out", sys.executable, __file__,
            "--callgrind-child", str(folder), "--n", str(n),
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        totals = {}
        for path in folder.glob("cg.out*"):
            label, total = None, None
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split("Client Request: ", 1)[1].strip()
                elif line.startswith(("totals:", "summary:")):
                    total = int(line.split()[1])
            if label is not None and total is not None:
                totals[label] = total / n
    empty = totals.pop("empty|empty|empty")
    return {label: round(ir - empty) for label, ir in totals.items()}


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def ir_cell(case: dict) -> str:
    ir = case.get("instructions")
    return "-" if ir is None else f"{ir:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="calls counted per case")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions under callgrind")
    parser.add_argument("--json", type=Path, help="write every count here")
    parser.add_argument(
        "--check", action="store_true", help="only compare each wiring with eager, real kernels (slow on CPU)"
    )
    parser.add_argument("--callgrind-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.check:
        for op, wiring, err in check_against_eager():
            print(f"{op} {wiring}: largest relative error against eager {err:.2e}")
        return
    use_stand_in()
    if args.callgrind_child:
        callgrind_child(args.callgrind_child, args.n)
        return
    check_wirings()
    results = {"machine": machine(), "n": args.n, "cases": {}}
    for op, wiring, mode, call in cases():
        calls, c_calls = python_calls(call, mode, args.n)
        results["cases"][f"{op}|{wiring}|{mode}"] = {
            "py_calls": round(calls, 2),
            "c_calls": round(c_calls, 2),
            "op_events": op_events(call, mode),
            "launch_stacks": launch_stacks(call, mode) if op != "piece" and wiring != "eager" else [],
        }
    if args.callgrind:
        for label, ir in run_callgrind(args.n).items():
            results["cases"][label]["instructions"] = ir
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"# {results['machine']}, {args.n} calls a case; per call, less an empty call's")
    modes = ("fwd_nograd", "fwd", "fwd_bwd")
    for op, table in FAMILIES.items():
        print(f"\n## {op}\n")
        head = " | ".join(f"{m} Ir | {m} py calls | {m} op events" for m in modes)
        print(f"| wiring | {head} |")
        print("|---" * (1 + 3 * len(modes)) + "|")
        for wiring, label in WIRINGS:
            if wiring not in table:
                continue
            cells = []
            for m in modes:
                c = results["cases"][f"{op}|{wiring}|{m}"]
                cells += [ir_cell(c), f"{c['py_calls']:g}", str(c["op_events"]["total"])]
            print(f"| {label} | " + " | ".join(cells) + " |")
    print("\n## Pieces, each alone, grad mode off\n")
    print("| piece | Ir | py calls | op events |\n|---|---|---|---|")
    for name in pieces():
        c = results["cases"][f"piece|{name}|fwd_nograd"]
        print(f"| {name} | {ir_cell(c)} | {c['py_calls']:g} | {c['op_events']['total']} |")
    print("\n## Python frames from the call to each launch (forward + backward, with grad)\n")
    for op, table in FAMILIES.items():
        for wiring in list(table)[1:]:
            for stack in results["cases"][f"{op}|{wiring}|fwd_bwd"]["launch_stacks"]:
                print(f"- {op} {wiring} ({len(stack)} frames): {' > '.join(stack)}")


if __name__ == "__main__":
    main()
