"""gelu_mul (GeGLU, tanh and erf) and clamped_swiglu (gpt-oss's experts): outputs and gradients
against float64 and eager in fp32 and bf16, the pair, packed-halves and interleaved forms, odd
shapes, inputs beyond the clamps, partial requires_grad, the eager form against transformers'
own GptOssExperts, double backward refused, torch.compile without a graph break."""

from __future__ import annotations

import types

import pytest
import torch

from profuse import blockops as B
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

BF16, FP32 = torch.bfloat16, torch.float32
SLACK = {BF16: 1.5, FP32: 3.0}  # as tests/test_blockops.py: no worse than eager, output by output


def _randn(shape, dtype, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


OPS = {
    "gelu_tanh": (lambda *a, **k: B.gelu_mul(*a, approximate="tanh", **k),
                  lambda *a, **k: B.gelu_mul_eager(*a, approximate="tanh"),
                  lambda *a, **k: B.gelu_mul_reference(*a, approximate="tanh")),
    "gelu_erf": (lambda *a, **k: B.gelu_mul(*a, approximate="none", **k),
                 lambda *a, **k: B.gelu_mul_eager(*a, approximate="none"),
                 lambda *a, **k: B.gelu_mul_reference(*a, approximate="none")),
    "clamped": (B.clamped_swiglu, B.clamped_swiglu_eager, B.clamped_swiglu_reference),
}  # fmt: skip


def _run(fn, inputs, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), [leaf.grad for leaf in leaves]


def _check(name, form, dtype, shape, device, seed):
    fused, eager, ref = OPS[name]
    scale = 4.0 if name == "clamped" else 2.0  # past the clamps at 7 for some elements
    kw = {} if name != "clamped" or form == "pair" else {"interleaved": form == "interleaved"}
    if form == "pair":
        inputs = [_randn(shape, dtype, seed, device, scale), _randn(shape, dtype, seed + 1, device, scale)]
    else:
        if name != "clamped" and form == "interleaved":
            return
        inputs = [_randn((*shape[:-1], 2 * shape[-1]), dtype, seed, device, scale)]
    dout = _randn(shape, FP32, seed + 2, device)
    out, grads = _run(fused, inputs, dout, **kw)
    out_e, grads_e = _run(eager, inputs, dout, **kw)
    out_r, grads_r = _run(ref, [t.double() for t in inputs], dout.double(), **kw)
    u = T.FORWARD_TOL[dtype] if dtype != FP32 else 1e-5
    err, err_e = T.relative_error(out, out_r), T.relative_error(out_e, out_r)
    assert err <= T.FORWARD_TOL[dtype] and err <= SLACK[dtype] * max(err_e, u / 8), (name, form, err, err_e)
    for g, ge, gr in zip(grads, grads_e, grads_r):
        assert g.shape == gr.shape and g.dtype == dtype
        err, err_e = T.relative_error(g, gr), T.relative_error(ge, gr)
        assert err <= T.BACKWARD_TOL[dtype] and err <= SLACK[dtype] * max(err_e, u / 8), (
            name,
            form,
            err,
            err_e,
        )


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_gated_ops_against_float64_and_eager(name, dtype, device):
    for seed, (form, shape) in enumerate(
        [("pair", (3, 5, 37)), ("halves", (7, 33)), ("interleaved", (2, 3, 19))]
    ):
        _check(name, form, dtype, shape, device, 10 * seed + 1)


def test_clamped_swiglu_eager_is_transformers_gpt_oss():
    """The eager form is transformers' own GptOssExperts._apply_gate (gpt-oss's activation)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gate_up = _randn((4, 2 * 24), FP32, 5, "cpu", 5.0)
    stub = types.SimpleNamespace(alpha=1.702, limit=7.0)
    want = gpt_oss.GptOssExperts._apply_gate(stub, gate_up)
    assert torch.equal(B.clamped_swiglu_eager(gate_up), want)
    cfg = gpt_oss.GptOssConfig()
    assert (cfg.swiglu_limit, B.GPT_OSS_ALPHA) == (B.GPT_OSS_LIMIT, 1.702)


def test_clamped_gradient_is_zero_past_the_clamps(device):
    gate = torch.tensor([[-9.0, 0.5, 7.0, 9.0]], device=device, requires_grad=True)
    up = torch.tensor([[-9.0, 0.5, 7.0, 9.0]], device=device, requires_grad=True)
    B.clamped_swiglu(gate, up).sum().backward()
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    B.clamped_swiglu_eager(g2, u2).sum().backward()
    assert torch.allclose(gate.grad, g2.grad, atol=1e-6) and torch.allclose(up.grad, u2.grad, atol=1e-6)
    assert gate.grad[0, 3] == 0 and up.grad[0, 0] == 0 and up.grad[0, 3] == 0


def test_partial_requires_grad_and_no_grad(device):
    gate = _randn((5, 21), FP32, 6, device).requires_grad_()
    up = _randn((5, 21), FP32, 7, device)
    B.gelu_mul(gate, up).sum().backward()
    ref = gate.detach().double().requires_grad_()
    B.gelu_mul_reference(ref, up.double()).sum().backward()
    assert T.relative_error(gate.grad, ref.grad) <= 1e-5
    with torch.no_grad():
        out = B.clamped_swiglu(gate, up)
    assert out.grad_fn is None
    assert T.relative_error(out, B.clamped_swiglu_reference(gate.detach(), up)) <= 1e-5


def test_double_backward_refused_in_one_line(device):
    for fn in (B.gelu_mul, B.clamped_swiglu):
        gu = _randn((3, 16), FP32, 8, device).requires_grad_()
        out = fn(gu).sum()
        (g,) = torch.autograd.grad(out, gu, create_graph=False)
        out = fn(gu).sum()
        with pytest.raises(RuntimeError, match="double backward") as err:
            torch.autograd.grad(out, gu, create_graph=True)
        assert "\n" not in str(err.value)


def test_bad_arguments_are_one_line_errors(device):
    x = _randn((3, 8), FP32, 9, device)
    with pytest.raises(ValueError, match="approximate"):
        B.gelu_mul(x, x, approximate="erf")
    with pytest.raises(ValueError, match="even last dimension"):
        B.clamped_swiglu(_randn((3, 7), FP32, 9, device))
    with pytest.raises(ValueError, match="limit"):
        B.clamped_swiglu(x, x, limit=0.0)


def test_compile_fullgraph(device):
    def f(gu, g, u):
        return B.clamped_swiglu(gu).sum() + B.gelu_mul(g, u).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    inputs = [_randn((2, 12), FP32, 10, device, 4.0), _randn((2, 6), FP32, 11, device),
              _randn((2, 6), FP32, 12, device)]  # fmt: skip
    results = []
    for fn in (compiled, f):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).backward()
        results.append([leaf.grad for leaf in leaves])
    for c, e in zip(*results):
        assert T.relative_error(c, e) <= 1e-6
