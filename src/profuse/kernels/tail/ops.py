"""The tail's op wiring: the custom ops torch.compile calls, the autograd.Function, `tail_fused`
(the entry point behind profuse.tail_triton) and `chosen_configs` (the configs a result names).

The tail wires its custom ops by hand (torch.library.custom_op here, the Function calling the
launchers directly outside a trace), where silu_mul and add_rms_norm register theirs through
kernels/autotune.compiled_op (an opaque op, and on CUDA a triton_op whose kernels Inductor
launches itself). One wiring for all three ops is wanted only if it costs no host time, and
that has not been measured on an H200: the host time per call of the shared wiring is unmeasured,
and this hand wiring is what the H200 host figures were measured with (2026-12-03, 16 x 4096:
27.9 us a call forward without grad, 101.4 us with grad, 479.0 us forward + backward). So the
tail keeps it until the shared wiring is timed against it on the same host.
"""

from __future__ import annotations

import torch

from profuse.env import sm_count
from profuse.kernels import configs as C
from profuse.kernels.autotune import TUNER
from profuse.kernels.rows import double_backward_error
from profuse.kernels.tail.plans import tail_backward, tail_forward

ALL_GRADS = (True, True, True, True)


def chosen_configs(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The configs that ran (or would run) for this shape: the autotuner's pick, else the
    heuristic's favourite. The backward's is the one for all four gradients."""
    fwd_key = ("fwd", C.pow2_rows(n_rows), n_cols, dtype)
    bwd_key = ("bwd", C.pow2_rows(n_rows), n_cols, dtype, ALL_GRADS)
    sms = sm_count(device)
    fwd = TUNER.chosen.get(fwd_key) or C.forward_config(n_rows, n_cols, dtype, sms)
    bwd = TUNER.chosen.get(bwd_key) or C.backward_config(n_rows, n_cols, dtype, sms)
    return {
        "forward": {**fwd.to_dict(), "autotuned": fwd_key in TUNER.chosen},
        "backward": {**bwd.to_dict(), "autotuned": bwd_key in TUNER.chosen},
    }


# --------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile: no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("profuse::tail_fwd", mutates_args=())
def tail_fwd_op(
    gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return tail_forward(gate, up, residual, weight, eps)


@tail_fwd_op.register_fake
def _(gate, up, residual, weight, eps):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("profuse::tail_bwd", mutates_args=())
def tail_bwd_op(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_gate: bool,
    need_up: bool,
    need_residual: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = tail_backward(
        grad_out, gate, up, residual, weight, rstd, (need_gate, need_up, need_residual, need_weight)
    )
    # A custom op returns tensors only: an empty one stands for "not asked for".
    return tuple(gate.new_empty(0) if t is None else t for t in grads)


@tail_bwd_op.register_fake
def _(grad_out, gate, up, residual, weight, rstd, need_gate, need_up, need_residual, need_weight):
    def like(t: torch.Tensor, flag: bool) -> torch.Tensor:
        return t.new_empty(t.shape) if flag else gate.new_empty(0)

    return like(gate, need_gate), like(up, need_up), like(residual, need_residual), like(weight, need_weight)


class TailFunction(torch.autograd.Function):
    """Saves the inputs and one fp32 rstd per row; the backward recomputes everything else.

    Eager calls go to the launchers directly; only a traced call (torch.compile) goes through
    the custom ops, whose dispatch costs ~10-20 us of host time a call. Double backward
    (create_graph=True) is refused in one line (kernels/rows.py, double_backward_error).
    """

    @staticmethod
    def forward(ctx, gate, up, residual, weight, eps):
        if torch.compiler.is_compiling():
            y, rstd = torch.ops.profuse.tail_fwd(gate, up, residual, weight, eps)
        else:
            y, rstd = tail_forward(gate, up, residual, weight, eps)
        ctx.save_for_backward(gate, up, residual, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, residual, weight, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        if torch.compiler.is_compiling():
            grads = torch.ops.profuse.tail_bwd(grad_out, gate, up, residual, weight, rstd, *needs)
            return (*(g if need else None for g, need in zip(grads, needs)), None)
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients have no grad_fn
            raise double_backward_error("tail_triton", "profuse.tail_eager")
        return (*tail_backward(grad_out, gate, up, residual, weight, rstd, needs), None)


def tail_fused(gate, up, residual, weight, eps: float) -> torch.Tensor:
    """The op on checked inputs: through autograd where a gradient is wanted, else the forward
    launch alone (no autograd node). That launch still stores rstd, into a scratch buffer:
    without the store the forward at 32768 x 4096 ran 0.6-1.1% slower on the H200 (252.3-252.9
    against 250.1-251.0 us, same config, four runs on 2026-12-03), for 4 bytes a row saved."""
    if torch.is_grad_enabled() and (
        gate.requires_grad or up.requires_grad or residual.requires_grad or weight.requires_grad
    ):
        return TailFunction.apply(gate, up, residual, weight, eps)
    if torch.compiler.is_compiling():
        return torch.ops.profuse.tail_fwd(gate, up, residual, weight, eps)[0]
    return tail_forward(gate, up, residual, weight, eps, keep_rstd=False)[0]
