"""Double backward: every fused op refuses create_graph=True in one line, never a silent answer.

The fused ops' gradients come out of Triton kernels that autograd cannot see into. Before the
refusal, backward(create_graph=True) returned them without a grad_fn, so a gradient penalty
sum(y^2) + sum((dL/dx)^2) was taken as sum(y^2) alone (add_rms_norm, fp32, 4 x 48, N(0, 1)
inputs: the penalty's gradient off from float64's by up to 6.0). Now the backward raises a
RuntimeError that starts with "profuse:" and names the op and the eager op to use instead; a
first-order backward on the same graph still matches float64.

The ops: tail_triton, silu_mul (two tensors and packed), add_rms_norm, rms_norm, rope,
qk_norm_rope, gelu_mul, clamped_swiglu (packed), rms_norm_add and linear_cross_entropy, on tiny
odd shapes (primes, one key head under three query heads, a vocab of 13 with ignored labels)
under the interpreter on a CPU.

Tolerances: profuse.tail.BACKWARD_TOL, relative error against float64 autograd in the gradient's
dtype (16u in bf16, a floor of 1e-5 in fp32; derived in tests/test_kernels_backward.py,
tests/test_blockops.py, tests/test_rms_norm.py and tests/test_rope.py, which compare every gradient
of these ops at more shapes; tests/test_linear_cross_entropy.py derives 6u for its gradients, so
16u holds there too).
"""

from __future__ import annotations

import pytest
import torch

from profuse import blockops as B
from profuse import crossentropy as CE
from profuse import rotary as R
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

EPS = 1e-6
FP32, BF16 = torch.float32, torch.bfloat16
# Odd widths (a prime, one that is not a power of two), 2-D and 3-D; N = 1 and 2 are left out
# (the norm's gradient is a cancellation there: see tests/test_kernels_backward.py).
SHAPE = {FP32: (3, 37), BF16: (2, 3, 29)}
# The attention ops: (batch, positions, query heads, key heads, head_dim), head_dim even.
HEADS = {FP32: (1, 5, 3, 1, 6), BF16: (2, 3, 4, 2, 10)}
VOCAB = 13
NOT_DIFFERENTIABLE = ("cos", "sin", "labels")  # the ops return no gradient for these

# op -> (fused, float64 reference, input names, the eager op the refusal names). Each callable
# takes the inputs and returns a list of outputs.
OPS = {
    "tail_triton": (
        lambda g, u, r, w: [T.tail_triton(g, u, r, w, EPS)],
        lambda g, u, r, w: [T.tail_reference(g, u, r, w, EPS)],
        ("gate", "up", "residual", "weight"),
        "profuse.tail_eager",
    ),
    "add_rms_norm": (
        lambda x, r, w: list(B.add_rms_norm(x, r, w, EPS)),
        lambda x, r, w: list(B.add_rms_norm_reference(x, r, w, EPS)),
        ("x", "residual", "weight"),
        "profuse.blockops.add_rms_norm_eager",
    ),
    "silu_mul": (
        lambda g, u: [B.silu_mul(g, u)],
        lambda g, u: [B.silu_mul_reference(g, u)],
        ("gate", "up"),
        "profuse.blockops.silu_mul_eager",
    ),
    "silu_mul packed": (
        lambda gu: [B.silu_mul(gu)],
        lambda gu: [B.silu_mul_reference(gu)],
        ("gate_up",),
        "profuse.blockops.silu_mul_eager",
    ),
    "rms_norm": (
        lambda x, w: [B.rms_norm(x, w, EPS)],
        lambda x, w: [B.rms_norm_reference(x, w, EPS)],
        ("x", "weight"),
        "profuse.blockops.rms_norm_eager",
    ),
    "rope": (
        lambda q, k, c, s: list(R.rope(q, k, c, s)),
        lambda q, k, c, s: list(R.rope_reference(q, k, c, s)),
        ("q", "k", "cos", "sin"),
        "profuse.rotary.rope_eager",
    ),
    "qk_norm_rope": (
        lambda q, k, qw, kw, c, s: list(R.qk_norm_rope(q, k, qw, kw, c, s, EPS)),
        lambda q, k, qw, kw, c, s: list(R.qk_norm_rope_reference(q, k, qw, kw, c, s, EPS)),
        ("q_bthd", "k_bthd", "q_weight", "k_weight", "cos", "sin"),
        "profuse.rotary.qk_norm_rope_eager",
    ),
    "gelu_mul": (
        lambda g, u: [B.gelu_mul(g, u)],
        lambda g, u: [B.gelu_mul_reference(g, u)],
        ("gate", "up"),
        "profuse.blockops.gelu_mul_eager",
    ),
    "clamped_swiglu packed": (
        lambda gu: [B.clamped_swiglu(gu)],
        lambda gu: [B.clamped_swiglu_reference(gu)],
        ("gate_up",),
        "profuse.blockops.clamped_swiglu_eager",
    ),
    "rms_norm_add": (
        lambda x, r, w: [B.rms_norm_add(x, r, w, EPS)],
        lambda x, r, w: [B.rms_norm_add_reference(x, r, w, EPS)],
        ("x", "residual", "weight"),
        "profuse.blockops.rms_norm_add_eager",
    ),
    "linear_cross_entropy": (
        lambda h, w, y: [CE.linear_cross_entropy(h, w, y)],
        lambda h, w, y: [CE.linear_cross_entropy_reference(h, w, y)],
        ("hidden", "head", "labels"),
        "profuse.crossentropy.linear_cross_entropy_eager",
    ),
}

# (op, the inputs that require grad): all of them, and one alone (only x, only weight, ...).
CASES = [
    ("tail_triton", ("gate", "up", "residual", "weight")),
    ("tail_triton", ("gate",)),
    ("tail_triton", ("residual",)),
    ("tail_triton", ("weight",)),
    ("add_rms_norm", ("x", "residual", "weight")),
    ("add_rms_norm", ("x",)),
    ("add_rms_norm", ("residual",)),
    ("add_rms_norm", ("weight",)),
    ("silu_mul", ("gate", "up")),
    ("silu_mul", ("gate",)),
    ("silu_mul", ("up",)),
    ("silu_mul packed", ("gate_up",)),
    ("rms_norm", ("x", "weight")),
    ("rms_norm", ("x",)),
    ("rms_norm", ("weight",)),
    ("rope", ("q", "k")),
    ("rope", ("q",)),
    ("rope", ("k",)),
    ("qk_norm_rope", ("q_bthd", "k_bthd", "q_weight", "k_weight")),
    ("qk_norm_rope", ("q_bthd",)),
    ("qk_norm_rope", ("k_weight",)),
    ("gelu_mul", ("gate", "up")),
    ("clamped_swiglu packed", ("gate_up",)),
    ("rms_norm_add", ("x", "residual", "weight")),
    ("rms_norm_add", ("weight",)),
    ("linear_cross_entropy", ("hidden", "head")),
    ("linear_cross_entropy", ("hidden",)),
    ("linear_cross_entropy", ("head",)),
]


def refusal(op: str) -> str:
    """The start of the one-line refusal, as a regex."""
    name = op.removesuffix(" packed")
    return rf"^profuse: {name} does not support double backward \(create_graph=True\)"


def shapes(op: str, shape, dtype) -> dict[str, tuple[int, ...]]:
    """The shape of each input of `op`: the row ops take (..., N) rows (`shape`) and a (N,)
    weight; the attention ops HEADS[dtype]; linear_cross_entropy `shape`'s rows as tokens."""
    *lead, n = shape
    b, t, hq, hk, d = HEADS[dtype]
    return {
        "weight": (n,),
        "gate_up": (*lead, 2 * n),
        "q": (b, hq, t, d),
        "k": (b, hk, t, d),
        "q_bthd": (b, t, hq, d),
        "k_bthd": (b, t, hk, d),
        "q_weight": (d,),
        "k_weight": (d,),
        "cos": (b, t, d),
        "sin": (b, t, d),
        "hidden": (*lead, n),
        "head": (VOCAB, n),
        "labels": tuple(lead),
    }


def inputs(op: str, shape, dtype, seed: int = 0) -> list[torch.Tensor]:
    """Fresh inputs of `op` on the CPU: N(0, 1) in `dtype`, a norm weight ~ 1 + N(0, 0.1^2),
    labels uniform over the vocab with every third one ignore_index (-100)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = shapes(op, shape, dtype)
    out = []
    for name in OPS[op][2]:
        size = sizes.get(name, shape)
        if name == "labels":
            labels = torch.randint(0, VOCAB, size, generator=gen)
            labels.view(-1)[::3] = CE.IGNORE_INDEX
            out.append(labels)
        elif name in ("weight", "q_weight", "k_weight"):
            out.append((1 + 0.1 * torch.randn(size, generator=gen)).to(dtype))
        else:
            out.append(torch.randn(size, generator=gen).to(dtype))
    return out


def loss_of(outs: list[torch.Tensor], seed: int = 1) -> torch.Tensor:
    """sum(out * dy) over every output, dy ~ N(0, 1) of the output's shape, the same values for
    every run with the same seed (cast to the output's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    dys = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    return sum((o * dy.to(o.dtype)).sum() for o, dy in zip(outs, dys, strict=True))


def run(op: str, xs, requires, dtype=None):
    """(leaves, loss) of op at xs (floating inputs cast to `dtype` first), only the inputs in
    `requires` leaves that require grad."""
    fn = OPS[op][1] if dtype == torch.float64 else OPS[op][0]
    leaves = [
        (x.detach().to(dtype) if dtype and x.is_floating_point() else x.detach().clone()).requires_grad_(
            name in requires
        )
        for x, name in zip(xs, OPS[op][2], strict=True)
    ]
    return leaves, loss_of(fn(*leaves))


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("op, requires", CASES, ids=lambda c: c if isinstance(c, str) else "+".join(c))
def test_create_graph_refused_and_first_order_right(op, requires, dtype):
    xs = inputs(op, SHAPE[dtype], dtype)
    leaves, loss = run(op, xs, requires)
    wanted = [leaf for leaf in leaves if leaf.requires_grad]

    grads = torch.autograd.grad(loss, wanted, retain_graph=True)
    with pytest.raises(RuntimeError, match=refusal(op)) as info:
        torch.autograd.grad(loss, wanted, create_graph=True)
    message = str(info.value)
    assert "\n" not in message and OPS[op][3] in message

    ref_leaves, ref_loss = run(op, xs, requires, torch.float64)
    refs = torch.autograd.grad(ref_loss, [leaf for leaf in ref_leaves if leaf.requires_grad])
    for name, grad, ref in zip([n for n in OPS[op][2] if n in requires], grads, refs, strict=True):
        assert grad.grad_fn is None and grad.dtype == dtype
        err = T.relative_error(grad, ref)
        assert err <= T.BACKWARD_TOL[dtype], f"d{name}: rel err {err:.2e} > {T.BACKWARD_TOL[dtype]:.0e}"


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("op", list(OPS))
def test_gradient_penalty_is_refused_not_dropped(op):
    """The case that came back wrong: loss = sum(y^2) + sum((dL/dx)^2), then loss.backward()."""
    xs = inputs(op, (4, 48), FP32)
    leaves = [
        x.requires_grad_(name not in NOT_DIFFERENTIABLE) for x, name in zip(xs, OPS[op][2], strict=True)
    ]
    y = OPS[op][0](*leaves)[0]
    first = y.square().sum()
    with pytest.raises(RuntimeError, match=refusal(op)):
        (dx,) = torch.autograd.grad(first, leaves[:1], create_graph=True)
        (first + dx.square().sum()).backward()
    with pytest.raises(RuntimeError, match=refusal(op)):
        first.backward(create_graph=True)


@pytest.mark.parametrize("op", list(OPS))
def test_plain_backward_under_enable_grad_is_not_refused(op):
    """Grad mode around backward() is not create_graph: the engine runs the backward with grad
    mode off unless create_graph=True, so a plain backward inside torch.enable_grad() runs."""
    xs = inputs(op, (3, 37), FP32)
    leaves = [
        x.requires_grad_(name not in NOT_DIFFERENTIABLE) for x, name in zip(xs, OPS[op][2], strict=True)
    ]
    with torch.enable_grad():
        OPS[op][0](*leaves)[0].sum().backward()
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    assert wanted and all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in wanted)


def test_add_rms_norm_second_derivative_through_h_alone():
    """Where y gets no gradient, dh passes back through in torch ops (no kernel): autograd
    differentiates that, so a penalty through h alone is allowed, and right."""
    xs = inputs("add_rms_norm", (3, 37), FP32)
    gen = torch.Generator().manual_seed(2)
    c = torch.randn(3, 37, generator=gen)

    def penalty(fn, dtype):
        x, r, w = (t.detach().to(dtype) for t in xs)
        x.requires_grad_()
        _, h = fn(x, r, w, EPS)
        (dx,) = torch.autograd.grad((c.to(dtype) * h.square()).sum(), x, create_graph=True)
        dx.square().sum().backward()
        return x.grad

    got = penalty(B.add_rms_norm, FP32)
    ref = penalty(B.add_rms_norm_reference, torch.float64)
    assert T.relative_error(got, ref) <= T.BACKWARD_TOL[FP32]


def test_compiled_double_backward_is_refused_by_torch():
    """Under torch.compile the backward is AOTAutograd's, which refuses a second derivative
    itself: at the second backward where the graph was first compiled for create_graph=True,
    at the first where a plain backward ran before (its buffers are donated). The first-order
    gradient of the compiled op, only x requiring grad, is right."""
    x, r, w = inputs("add_rms_norm", (3, 37), FP32)

    def compile_loss():
        torch._dynamo.reset()
        return torch.compile(lambda x: B.add_rms_norm(x, r, w, EPS)[0].square().sum(),
                             backend="aot_eager", fullgraph=True)  # fmt: skip

    compiled = compile_loss()
    leaf = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(compiled(leaf), leaf)
    ref_leaf = x.double().requires_grad_()
    ref_y, _ = B.add_rms_norm_reference(ref_leaf, r, w, EPS)
    (ref,) = torch.autograd.grad(ref_y.square().sum(), ref_leaf)
    assert T.relative_error(dx, ref) <= T.BACKWARD_TOL[FP32]
    with pytest.raises(RuntimeError, match="create_graph=False"):
        torch.autograd.grad(compiled(leaf), leaf, create_graph=True)

    compiled = compile_loss()
    leaf = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(compiled(leaf), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        dx.square().sum().backward()
