"""The tail's forward, every variant, against a float64 oracle (and against eager in the same dtype).

Tolerance table: relative error ||y - y64|| / ||y64|| (profuse.tail.FORWARD_TOL, derived there)

    dtype   u = unit roundoff   FORWARD_TOL          why
    bf16    2^-8  = 3.9e-3      8u = 3.1e-2          eager rounds after each of ~8 ops: <= 8u
    fp16    2^-11 = 4.9e-4      8u = 3.9e-3          same
    fp32    2^-24 = 6.0e-8      1e-5 (floor)         mean over N adds ~log2(N) u; the floor is
                                                     still ~100x below the error of any real bug

Two tighter checks on top of the table:
- No worse than eager: err(variant) <= SLACK * max(err(eager), u). In bf16/fp16 the fused
  variants compute in fp32 and round once (~0.4u, or up to 1 ulp = 2u per element under the
  Triton interpreter, whose fp32 -> bf16 cast truncates instead of rounding to nearest), while
  eager rounds after every op (~1u): over 20 seeds x 6 shapes the worst ratio seen was 1.13, so
  1.5. In fp32 both are the same fp32 arithmetic in different orders (errors of 1-2u, ratio up to
  1.9 seen), so 3. The floor u keeps a lucky eager (an error below one rounding) from failing
  a correct kernel. A wrong term or a wrong mean costs orders of magnitude more than either.
- Triton, element by element: |y - y64| <= 2u |y64| (one rounding, even a truncating one, is
  under 1 ulp <= 2u relative) + 64 * 2^-24 * max|y64 in the row| (fp32 arithmetic: h = silu(g)
  * u + r can cancel, so its error scales with the row, not the element) + 2u * finfo.tiny (fp16
  subnormals have a fixed spacing). A single element the kernel forgot to write (left NaN by the
  poisoned allocation) or wrote from the wrong row fails it, where a norm over the tensor might
  not.
"""

from __future__ import annotations

import math

import pytest
import torch
from cases import DTYPES, EPS, SHAPES, tail_inputs

import profuse
from profuse import tail as T
from profuse.kernels import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

SLACK = {torch.bfloat16: 1.5, torch.float16: 1.5, torch.float32: 3.0}


def assert_elementwise(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element within one rounding of the float64 value (bound derived in the docstring)."""
    assert out.shape == ref.shape
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} non-finite elements"
    u = T.UNIT_ROUNDOFF[dtype]
    err = (out.double() - ref).abs()
    row_scale = ref.abs().amax(dim=-1, keepdim=True) if ref.numel() else ref
    bound = 2 * u * ref.abs() + 64 * 2.0**-24 * row_scale + 2 * u * torch.finfo(dtype).tiny
    bad = err > bound
    assert not bad.any(), (
        f"{bad.sum().item()} of {out.numel()} elements off, first at {bad.nonzero()[0].tolist()}: "
        f"got {out.double()[bad][0].item()}, expected {ref[bad][0].item()}"
    )


def test_poisoned_allocation_is_poisoned(poisoned):
    """The poison works: otherwise the element-wise checks below would prove less than they say."""
    from profuse.kernels.tail import plans

    assert torch.isnan(plans.torch.empty((2, 3), dtype=torch.bfloat16)).all()
    assert (plans.torch.empty(4, dtype=torch.int32) == -1).all()
    assert torch.isnan(plans.torch.empty_like(torch.ones(2, 3))).all()


# --------------------------------------------------------------------------------------------
# Every variant against float64
# --------------------------------------------------------------------------------------------

FAST_VARIANTS = {"rms_norm": T.tail_rms_norm, "triton": T.tail_triton}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_eager_within_tolerance(shape, dtype, device):
    g, u, r, w = tail_inputs(shape, dtype, device)
    y = T.tail_eager(g, u, r, w, EPS)
    assert y.shape == g.shape and y.dtype == dtype
    err = T.relative_error(y, T.tail_reference(g, u, r, w, EPS))
    assert err <= T.FORWARD_TOL[dtype], f"eager rel err {err:.2e} > {T.FORWARD_TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", FAST_VARIANTS)
def test_variant_matches_float64_and_eager(variant, shape, dtype, device):
    if variant == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    g, u, r, w = tail_inputs(shape, dtype, device, seed=1)
    ref = T.tail_reference(g, u, r, w, EPS)
    y = FAST_VARIANTS[variant](g, u, r, w, EPS)
    assert y.shape == g.shape and y.dtype == dtype
    err = T.relative_error(y, ref)
    eager_err = T.relative_error(T.tail_eager(g, u, r, w, EPS), ref)
    assert err <= T.FORWARD_TOL[dtype], f"rel err {err:.2e} > tol {T.FORWARD_TOL[dtype]:.0e}"
    bound = SLACK[dtype] * max(eager_err, T.UNIT_ROUNDOFF[dtype])
    assert err <= bound, f"rel err {err:.2e}, eager's {eager_err:.2e}: worse than eager in {dtype}"


# torch.compile takes ~5-8 s per new shape on a CPU: two shapes, the 3-D one and the single row.
@pytest.mark.parametrize(
    ("shape", "dtype"), [((2, 3, 97), torch.float32), ((1, 131), torch.bfloat16)], ids=str
)
def test_compiled_matches_float64_and_eager(shape, dtype, device):
    g, u, r, w = tail_inputs(shape, dtype, device, seed=2)
    ref = T.tail_reference(g, u, r, w, EPS)
    y = T.tail_compiled(g, u, r, w, EPS)
    assert y.shape == g.shape and y.dtype == dtype
    err = T.relative_error(y, ref)
    eager_err = T.relative_error(T.tail_eager(g, u, r, w, EPS), ref)
    assert err <= T.FORWARD_TOL[dtype]
    assert err <= SLACK[dtype] * max(eager_err, T.UNIT_ROUNDOFF[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(37, 33)], ids=str)
def test_triton_every_element_written_and_right(shape, dtype, device, poisoned):
    """Outputs allocated full of NaN: every element must be written, and written right."""
    g, u, r, w = tail_inputs(shape, dtype, device, seed=3)
    y = T.tail_triton(g, u, r, w, EPS)
    assert_elementwise(y, T.tail_reference(g, u, r, w, EPS), dtype)


@needs_triton
def test_eps_is_used(device):
    """A large eps changes the answer exactly as the reference says (the kernel does not drop it)."""
    g, u, r, w = tail_inputs((3, 50), torch.float32, device, seed=4)
    scale = 0.01  # small h, so eps = 1e-2 dominates mean(h^2)
    g, u, r = g * scale, u * scale, r * scale
    y_small, y_big = T.tail_triton(g, u, r, w, 1e-6), T.tail_triton(g, u, r, w, 1e-2)
    assert T.relative_error(y_big, T.tail_reference(g, u, r, w, 1e-2)) <= T.FORWARD_TOL[torch.float32]
    assert T.relative_error(y_big, y_small) > 0.5


# --------------------------------------------------------------------------------------------
# Strided inputs: the right answer or a clear error, never a wrong answer
# --------------------------------------------------------------------------------------------


def _strided_cases(n: int, rows: int, gen: torch.Generator, dtype, device):
    """(name, gate, up, residual, weight) with the layouts a caller really passes."""
    kw = dict(dtype=dtype, device=device)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(**kw)

    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(**kw)
    gu = rnd(rows, 2 * n)
    g_chunk, u_chunk = gu.chunk(2, -1)  # row stride 2N, as a fused gate/up projection gives
    yield "chunked gate/up", g_chunk, u_chunk, rnd(rows, n), w
    yield "transposed residual", rnd(rows, n), rnd(rows, n), rnd(n, rows).t(), w
    yield "every other column", rnd(rows, 2 * n)[:, ::2], rnd(rows, n), rnd(rows, n), w
    # Leading dims that no single row stride describes: (2, 3, N)[:, :2] has strides (3N, N, 1).
    yield "3-D slice", rnd(2, 3, n)[:, :2], rnd(2, 2, n), rnd(2, 3, n)[:, 1:], w
    yield "broadcast residual", rnd(rows, n), rnd(rows, n), rnd(1, n).expand(rows, n), w
    yield "strided weight", rnd(rows, n), rnd(rows, n), rnd(rows, n), rnd(2 * n)[::2]
    yield "row-reversed", rnd(rows, n).flip(0), rnd(rows, n), rnd(rows, n), w


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_strided_inputs(dtype, device, poisoned):
    gen = torch.Generator().manual_seed(5)
    for name, g, u, r, w in _strided_cases(97, 4, gen, dtype, device):
        # tail_triton promises these work (non-contiguous columns are copied), so no error either.
        y = T.tail_triton(g, u, r, w, EPS)
        try:
            assert_elementwise(y, T.tail_reference(g, u, r, w, EPS), dtype)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


@needs_triton
def test_triton_does_not_touch_its_inputs(device):
    g, u, r, w = tail_inputs((4, 97), torch.float32, device, seed=6)
    before = [t.clone() for t in (g, u, r, w)]
    T.tail_triton(g, u, r, w, EPS)
    for t, b in zip((g, u, r, w), before, strict=True):
        assert torch.equal(t, b)


# --------------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument
# --------------------------------------------------------------------------------------------

ARG_NAMES = ("gate", "up", "residual", "weight")


def _bad_cases(device):
    n = 8

    def t(*shape, dtype=torch.float32, dev=device):
        return torch.randn(shape).to(device=dev, dtype=dtype)

    ok = lambda: (t(3, n), t(3, n), t(3, n), t(n))  # noqa: E731
    g, u, r, w = ok()
    yield "up shape", "up", (g, t(3, n + 1), r, w)
    yield "residual shape", "residual", (g, u, t(2, 3, n), w)
    yield "weight shape", "weight", (g, u, r, t(n + 1))
    yield "weight 2-D", "weight", (g, u, r, t(1, n))
    yield "up dtype", "up", (g, t(3, n, dtype=torch.bfloat16), r, w)
    yield "residual dtype", "residual", (g, u, t(3, n, dtype=torch.float16), w)
    yield "weight dtype", "weight", (g, u, r, t(n, dtype=torch.bfloat16))
    yield "residual device", "residual", (g, u, torch.empty(3, n, device="meta"), w)
    yield "weight device", "weight", (g, u, r, torch.empty(n, device="meta"))
    f64 = [x.double() for x in ok()]
    yield "float64 everywhere", "gate", tuple(f64)
    ints = [torch.randint(1, 5, (3, n), device=device) for _ in range(3)]
    yield "integer inputs", "gate", (*ints, torch.randint(1, 5, (n,), device=device))
    yield "zero-size last dim", "gate", (t(3, 0), t(3, 0), t(3, 0), t(0))
    yield "0-d gate", "gate", (t(), t(), t(), t(1))
    yield "weight not a tensor", "weight", (g, u, r, [1.0] * n)


def _first_name(message: str) -> str | None:
    """The argument the message is about: the first of the four names it mentions."""
    import re

    hits = [(m.start(), name) for name in ARG_NAMES if (m := re.search(rf"\b{name}\b", message))]
    return min(hits)[1] if hits else None


@needs_triton
@pytest.mark.parametrize("case", [c[0] for c in _bad_cases("cpu")])
def test_bad_input_raises_value_error_naming_the_argument(case, device):
    _, culprit, args = next(c for c in _bad_cases(device) if c[0] == case)
    with pytest.raises(ValueError) as info:
        T.tail_triton(*args, EPS)
    assert _first_name(str(info.value)) == culprit, f"{case}: message {str(info.value)!r}"


def test_check_tail_args_accepts_good_input(device):
    T.check_tail_args(*tail_inputs((2, 3, 5), torch.bfloat16, device))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_cpu_tensors_without_interpreter_give_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g, u, r, w = tail_inputs((2, 16), torch.float32, "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        T.tail_triton(g, u, r, w, EPS)


# --------------------------------------------------------------------------------------------
# Zero rows, the module, the public API
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)], ids=str)
@pytest.mark.parametrize("variant", ["eager", "rms_norm", "triton"])
def test_zero_rows_give_empty_result(variant, shape, device):
    if variant == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    fn = {"eager": T.tail_eager, "rms_norm": T.tail_rms_norm, "triton": T.tail_triton}[variant]
    g, u, r = (torch.randn(shape, device=device) for _ in range(3))
    w = torch.randn(shape[-1], device=device)
    y = fn(g, u, r, w, EPS)
    assert y.shape == shape and y.dtype == g.dtype and y.numel() == 0


@pytest.mark.parametrize("impl", ["eager", "rms_norm", "triton"])
def test_fused_tail_module_matches_functional(impl, device):
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    n = 97
    mod = T.FusedTail(n, eps=EPS, impl=impl, device=device)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(7)))
    g, u, r, _ = tail_inputs((2, 3, n), torch.float32, device, seed=8)
    y = mod(g, u, r)
    ref = T.tail_reference(g, u, r, mod.weight.detach(), EPS)
    assert y.shape == g.shape
    assert T.relative_error(y, ref) <= T.FORWARD_TOL[torch.float32]


def test_fused_tail_weight_is_learnable(device):
    """The weight is a parameter, gets the right gradient, and a step on it lowers a loss."""
    n = 40
    mod = T.FusedTail(n, eps=EPS, device=device)  # default impl: auto, triton where it can run
    assert mod.impl == "auto" and mod.impl_for(device) == ("triton" if HAS_TRITON else "eager")
    params = dict(mod.named_parameters())
    assert list(params) == ["weight"] and params["weight"].requires_grad
    assert "weight" in mod.state_dict()
    assert f"dim={n}" in repr(mod)
    g, u, r, _ = tail_inputs((6, n), torch.float32, device, seed=9)
    target = torch.randn(6, n, generator=torch.Generator().manual_seed(10)).to(device)

    def loss_fn():
        return ((mod(g, u, r) - target) ** 2).sum()

    loss = loss_fn()
    loss.backward()
    w64 = mod.weight.detach().double().requires_grad_()
    ((T.tail_reference(g, u, r, w64, EPS) - target.double()) ** 2).sum().backward()
    assert T.relative_error(mod.weight.grad, w64.grad) <= T.BACKWARD_TOL[torch.float32]
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    before = mod.weight.detach().clone()
    opt.step()
    assert not torch.equal(mod.weight.detach(), before)
    assert loss_fn().item() < loss.item()


def test_fused_tail_dtype_and_bad_arguments():
    assert T.FusedTail(8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dim"):
        T.FusedTail(0)
    with pytest.raises(ValueError, match="impl"):
        T.FusedTail(8, impl="nope")


def test_fused_tail_on_a_cpu_without_the_interpreter_runs_eager_or_refuses(monkeypatch):
    """FusedTail(64) on a CPU picked triton and failed only at its first call. Now "auto" runs
    eager on CPU inputs (triton on CUDA ones), and an explicit impl="triton" that cannot run here
    is refused at construction, in one line."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mod = T.FusedTail(64, eps=EPS)
    assert mod.impl_for("cpu") == "eager" and mod.impl_for("cuda") == ("triton" if HAS_TRITON else "eager")
    g, u, r, _ = tail_inputs((3, 64), torch.float32, "cpu", seed=11)
    ref = T.tail_reference(g, u, r, mod.weight.detach(), EPS)
    assert T.relative_error(mod(g, u, r), ref) <= T.FORWARD_TOL[torch.float32]
    with pytest.raises(ValueError, match="^impl='triton' cannot run") as err:
        T.FusedTail(64, impl="triton")
    assert "\n" not in str(err.value)


def test_public_api():
    for name in (
        "tail_eager",
        "tail_rms_norm",
        "tail_compiled",
        "tail_triton",
        "tail_reference",
        "FusedTail",
    ):
        assert callable(getattr(profuse, name))


def test_relative_error_flags_non_finite():
    ref = torch.randn(4, 8, dtype=torch.float64)
    bad = ref.clone()
    bad[1, 2] = math.nan
    assert T.relative_error(bad, ref) == math.inf
    assert T.relative_error(ref, ref) == 0.0


def test_tolerances_are_ordered():
    """Tolerances follow the unit roundoff: bf16 loosest, fp32 tightest; backward >= forward."""
    f = T.FORWARD_TOL
    assert f[torch.bfloat16] > f[torch.float16] > f[torch.float32]
    for dt in DTYPES:
        assert T.BACKWARD_TOL[dt] >= f[dt] >= T.UNIT_ROUNDOFF[dt]
