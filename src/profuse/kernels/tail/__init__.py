"""The fused SwiGLU tail in Triton: one pass forward, one pass backward.

    y = h * rstd * w,   h = silu(g) * u + r,   rstd = 1 / sqrt(mean(h^2) + eps)

Forward reads g, u, r once and writes y once (4 tensors; eager moves 15, see bench/traffic.py);
it also writes one fp32 rstd per row for the backward. All arithmetic is fp32 whatever the input
dtype; only the stores round (on rows of 16384 columns and more in bf16, also h, when it is kept
in y between the two passes).

Backward (x_hat = h * rstd, s = sigmoid(g), silu(g) = g * s, N = cols):
    dh  = rstd * (w * dy - x_hat * mean(x_hat * w * dy))
    dr  = dh
    du  = dh * silu(g)
    dg  = dh * u * s * (1 + g * (1 - s))
    dw  = sum over rows of dy * x_hat
It reads g, u, r, dy and writes dg, du, dr (7 tensors); h, s and x_hat are recomputed in
registers. dw is summed in fp32 per program, then the partials in one fixed order: gradients
are bitwise repeatable.

One module per kernel family, named for KernelConfig.kernel (kernels/configs.py), then the
launch policy and the op wiring:

    fused.py     "fused": whole rows in registers (several rows a tile where rows are narrow)
    chunked.py   "chunked", "pipelined", "split": rows read in two passes (the fallback)
    team.py      "team": a row shared by a team of programs that swap partial sums
    plans.py     each config bound to its kernel and grid, the plan caches, the launchers
                 tail_forward and tail_backward
    ops.py       the custom ops, TailFunction, tail_fused (behind profuse.tail_triton) and
                 chosen_configs

Which kernel and launch shape runs is chosen per shape: kernels/configs.py proposes the
candidates, kernels/autotune.py times them once and keeps the shape's plan, so a later call is
a lookup and its launches.

The kernels are public (tail_fwd_kernel, ...): plans.py launches every family's, and the house
takes no private name across modules; so is store_input_grads, which all three families call.
Helpers kept to one module keep their underscore. The public names are re-exported here, so
`from profuse.kernels.tail import tail_fused` and the like need no module path; the launch
policy's private pieces (_forward_launch, _BackwardPlan, ...) are imported from
profuse.kernels.tail.plans, and a test that monkeypatches the plan caches, the tuner or `torch`
(poisoned allocations) patches them there, where they are read.
"""

from profuse.kernels.tail.chunked import (
    tail_bwd_chunked_kernel,
    tail_bwd_pipelined_kernel,
    tail_bwd_rowdot_kernel,
    tail_bwd_slab_kernel,
    tail_fwd_chunked_kernel,
    tail_fwd_pipelined_kernel,
)
from profuse.kernels.tail.fused import store_input_grads, tail_bwd_kernel, tail_fwd_kernel
from profuse.kernels.tail.ops import ALL_GRADS, TailFunction, chosen_configs, tail_fused
from profuse.kernels.tail.plans import ROW_TEAM_PATIENCE, tail_backward, tail_forward
from profuse.kernels.tail.team import (
    tail_bwd_team_kernel,
    tail_bwd_team_staged_kernel,
    tail_fwd_row_team_kernel,
    tail_fwd_team_kernel,
    tail_fwd_team_staged_kernel,
)

__all__ = [
    "ALL_GRADS",
    "ROW_TEAM_PATIENCE",
    "TailFunction",
    "chosen_configs",
    "tail_backward",
    "tail_forward",
    "tail_fused",
    # the kernels, by family (benchmarks/sass_loops.py compiles one by name)
    "store_input_grads",
    "tail_fwd_kernel",
    "tail_bwd_kernel",
    "tail_fwd_chunked_kernel",
    "tail_fwd_pipelined_kernel",
    "tail_bwd_chunked_kernel",
    "tail_bwd_pipelined_kernel",
    "tail_bwd_rowdot_kernel",
    "tail_bwd_slab_kernel",
    "tail_fwd_team_kernel",
    "tail_fwd_team_staged_kernel",
    "tail_fwd_row_team_kernel",
    "tail_bwd_team_kernel",
    "tail_bwd_team_staged_kernel",
]
