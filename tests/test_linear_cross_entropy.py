"""linear_cross_entropy (profuse.crossentropy, kernels/cross_entropy.py): the loss and both
gradients against float64 and against eager in the same dtypes, with the chunks forced small so
several run (and the kernel's row loop taking several blocks), every Hugging Face option (ignored
labels, num_items_in_batch as a number and a tensor, shift on and off, shift_labels), a tied
embedding, CPU autocast over fp32 weights, odd shapes, the memory the op allocates, poisoned
allocations, torch.compile without a graph break, and the refusals.

Tolerance table: relative error ||out - ref|| / ||ref|| against float64 (profuse.tail.relative_error),
u the unit roundoff of the matmul dtype:

    dtype   u       LOSS_TOL       GRAD_TOL      why
    bf16    2^-8    2u = 7.8e-3    6u = 2.3e-2   the logits are rounded once to the matmul dtype (as
    fp16    2^-11   2u = 9.8e-4    6u = 2.9e-3   eager's are): a token's lse and z[y] move by at
    fp32    2^-24   1e-5 (floor)   1e-5 (floor)  most u/2 max|z| each, against a loss ~log V. The
                                                  gradients add dz rounded once (up to u; 2u
                                                  under the interpreter, whose fp32 -> bf16 cast
                                                  truncates), the matmul's output rounding (u/2)
                                                  and, off CUDA, a rounding of each chunk's
                                                  product before the fp32 sum (u/2 each)
Over 4 seeds x SHAPES x the 3 dtypes x both accumulators the worst was 0.05u (loss) and 1.4u
(gradients) in 16-bit, 6u (3.6e-7) in fp32: the 16-bit tables hold 4-40x that, and a chunk
dropped or counted twice is off by orders of magnitude more. No worse than eager:
err(fused) <= SLACK * max(err(eager), u); the worst ratio over the same runs was 2.3 (fp32,
sums in another order), so 3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from profuse import crossentropy as CE
from profuse import tail as T
from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from conftest import PoisonedTorch  # noqa: E402

from profuse.kernels import cross_entropy as K  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16, FP32]
U = T.UNIT_ROUNDOFF
LOSS_TOL = {dt: max(2 * u, 1e-5) for dt, u in U.items()}
GRAD_TOL = {dt: max(6 * u, 1e-5) for dt, u in U.items()}
SLACK = 3.0
# The row loop in blocks of 64 columns on a persistent grid of 3 programs: several blocks a row
# (the online lse), several rows a program, and a last block that is partial.
SMALL_BLOCKS = KernelConfig("chunked", 1, 64, 2, 1, 3, l2="keep")
# (batch, sequence, hidden, vocab): a prime vocab, one that is not a multiple of the block or of
# the chunk, hidden widths 96, 64 and odd.
SHAPES = [(2, 9, 33, 203), (1, 13, 64, 500), (3, 5, 96, 131)]


def inputs(shape, dtype, device, seed=0, ignored=3, label_dtype=torch.int64):
    """hidden ~ N(0, 1) of (batch, seq, H), weight ~ N(0, 1/H) of (V, H) (logits ~ N(0, 1)),
    labels uniform in [0, V) with `ignored` of them set to -100. Fresh values per seed."""
    b, t, h, v = shape
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn((b, t, h), generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn((v, h), generator=gen) / math.sqrt(h)).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (b, t), generator=gen)
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:ignored]] = CE.IGNORE_INDEX
    return hidden, weight, labels.to(device=device, dtype=label_dtype)


def run(fn, hidden, weight, labels, g: float = 1.0, **kw):
    """(loss, grad_hidden, grad_weight) of fn on fresh leaves; the backward of g * loss."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    (loss * g if g != 1.0 else loss).backward()
    return loss.detach(), h.grad, w.grad


def fused(hidden, weight, labels, *, chunk_size=4, config=SMALL_BLOCKS, accumulate=None, **kw):
    """linear_cross_entropy through the kernel-level entry, chunks of 4 tokens by default."""
    shift, shift_labels = kw.pop("shift", True), kw.pop("shift_labels", None)
    if shift_labels is not None:
        target = shift_labels.reshape(-1)
    else:
        target = (CE.shifted_labels(labels) if shift else labels).reshape(-1)
    return K.linear_cross_entropy_fused(
        hidden, weight, target, CE.IGNORE_INDEX, kw.pop("num_items_in_batch", None),
        chunk_size=chunk_size, accumulate=accumulate, config=config, softcap=kw.pop("softcap", None),
    )  # fmt: skip


def check(got, eager, ref, mm_dtype) -> None:
    """Loss and both gradients within tolerance of float64 and no worse than eager."""
    for name, a, e, r, tol in zip(("loss", "grad_hidden", "grad_weight"), got, eager, ref,
                                  (LOSS_TOL, GRAD_TOL, GRAD_TOL)):  # fmt: skip
        err, eager_err = T.relative_error(a, r), T.relative_error(e, r)
        assert err <= tol[mm_dtype], f"{name}: rel err {err:.2e} > {tol[mm_dtype]:.1e}"
        assert err <= SLACK * max(eager_err, U[mm_dtype]), f"{name}: {err:.2e} vs eager's {eager_err:.2e}"
        assert a.dtype == e.dtype and a.shape == e.shape, name


def check_all(hidden, weight, labels, mm_dtype=None, **kw):
    mm_dtype = mm_dtype or hidden.dtype
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels, **_hf(kw))
    eager = run(CE.linear_cross_entropy_eager, hidden, weight, labels, **_hf(kw))
    got = run(fused, hidden, weight, labels, **kw)
    check(got, eager, ref, mm_dtype)
    return got


def _hf(kw):
    """The keyword arguments the public ops take (the kernel-level knobs left out)."""
    return {k: v for k, v in kw.items() if k not in ("chunk_size", "config", "accumulate")}


# --------------------------------------------------------------------------------------------
# Against float64 and eager
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_and_eager(shape, dtype, device):
    check_all(*inputs(shape, dtype, device, seed=1), dtype)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_softcap(dtype, device):
    """Final-logit soft-capping (Gemma 2 and 3): the loss of cap * tanh(z / cap), with logits
    large enough (hidden x 4, cap 1.5) that the tanh bends most of them; the public entry too."""
    hidden, weight, labels = inputs((2, 9, 33, 203), dtype, device, seed=5)
    hidden = hidden * 4
    got = check_all(hidden, weight, labels, dtype, softcap=1.5)
    plain = run(fused, hidden, weight, labels)
    assert T.relative_error(got[0], plain[0]) > 0.1  # the cap changed the loss
    public = run(CE.linear_cross_entropy, hidden, weight, labels, softcap=1.5)
    for a, b in zip(public, got):
        assert T.relative_error(a, b) <= 3 * GRAD_TOL[dtype]
    with pytest.raises(ValueError, match="softcap"):
        fused(hidden, weight, labels, softcap=-1.0)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_weight_dtype_accumulator(dtype, device):
    """accumulate="weight": the gradient summed in the weight's dtype (rounded once a chunk)."""
    check_all(*inputs((2, 9, 33, 203), dtype, device, seed=2), dtype, accumulate="weight")


def test_public_entry_point(device):
    """profuse.crossentropy.linear_cross_entropy: the rule's chunk, the favourite launch."""
    hidden, weight, labels = inputs((2, 7, 40, 150), FP32, device, seed=3)
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels)
    eager = run(CE.linear_cross_entropy_eager, hidden, weight, labels)
    check(run(CE.linear_cross_entropy, hidden, weight, labels), eager, ref, FP32)


def test_autocast_over_fp32_weights(device):
    """CPU autocast to bf16 over fp32 hidden and weight: bf16 matmuls, fp32 gradients."""
    hidden, weight, labels = inputs((2, 9, 48, 203), FP32, device, seed=4)
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels)
    with torch.autocast(device.type, dtype=BF16):
        eager = run(CE.linear_cross_entropy_eager, hidden, weight, labels)
        got = run(fused, hidden, weight, labels)
    check(got, eager, ref, BF16)
    assert got[1].dtype == got[2].dtype == FP32


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_items_in_batch=23),
        dict(num_items_in_batch=torch.tensor(23)),
        dict(shift=False),
        dict(shift=False, num_items_in_batch=torch.tensor(11.0)),
    ],
    ids=["num_items_int", "num_items_tensor", "no_shift", "no_shift_num_items_float_tensor"],
)
def test_hugging_face_options(kw, device):
    check_all(*inputs((2, 9, 33, 203), BF16, device, seed=5), **kw)


def test_shift_labels_given(device):
    """shift_labels: the targets already shifted, used as they are."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=6)
    shifted = CE.shifted_labels(labels)
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels)
    got = run(fused, hidden, weight, None, shift_labels=shifted)
    for name, a, r in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        assert T.relative_error(a, r) <= 1e-5, name


def test_int32_labels_and_incoming_gradient(device):
    """int32 labels; the backward of 3 * loss scales both gradients (the scale kernel's pass)."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=7, label_dtype=torch.int32)
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels.long(), g=3.0)
    got = run(fused, hidden, weight, labels, g=3.0)
    for name, a, r in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        assert T.relative_error(a, r) <= 1e-5, name


def test_scale_kernel_skips_one(device):
    """scale_: g == 1 leaves the gradient as it was; g == 2 doubles it exactly."""
    x = torch.randn(1000, device=device).to(BF16)
    before = x.clone()
    K.scale_(x, torch.ones((), device=device))
    assert torch.equal(x, before)
    K.scale_(x, torch.full((), 2.0, device=device))
    assert torch.equal(x, before * 2)


def test_tied_embedding(device):
    """The head's weight is also an nn.Embedding's: its gradient is the sum of both uses."""
    vocab, width = 203, 40
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, vocab, (2, 9), generator=gen, device=device)
    labels = ids.clone()
    labels[0, 2] = CE.IGNORE_INDEX
    init = torch.randn(vocab, width, generator=gen) / math.sqrt(width)
    scale = 1 + 0.1 * torch.randn(width, generator=gen)
    grads = {}
    for name, fn, dtype in (("fused", fused, FP32), ("eager", CE.linear_cross_entropy_eager, FP32),
                            ("ref", CE.linear_cross_entropy_reference, torch.float64)):  # fmt: skip
        emb = torch.nn.Embedding(vocab, width, device=device, dtype=dtype)
        with torch.no_grad():
            emb.weight.copy_(init)
        hidden = emb(ids) * scale.to(device=device, dtype=dtype)
        fn(hidden, emb.weight, labels).backward()
        grads[name] = emb.weight.grad
    assert T.relative_error(grads["fused"], grads["ref"]) <= 1e-5
    assert T.relative_error(grads["eager"], grads["ref"]) <= 1e-5


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------


def test_one_token(device):
    """One token with shift off: one row, one chunk."""
    check_all(*inputs((1, 1, 64, 131), FP32, device, seed=9, ignored=0), shift=False)


@pytest.mark.filterwarnings("ignore:divide by zero")  # 1 / 0 tokens, in the interpreter's numpy
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_all_ignored_is_nan_as_eager(dtype, device):
    """Every label ignored (and one token with shift on: its only label is shifted out): eager's
    mean over no tokens is NaN and its gradients are zeros; so are these."""
    for shape, ignored in (((2, 5, 33, 131), 10), ((1, 1, 33, 131), 0)):
        hidden, weight, labels = inputs(shape, dtype, device, seed=10, ignored=ignored)
        eager = run(CE.linear_cross_entropy_eager, hidden, weight, labels)
        got = run(fused, hidden, weight, labels)
        assert math.isnan(eager[0].item()) and math.isnan(got[0].item())
        for e, a in zip(eager[1:], got[1:]):
            assert torch.equal(e, torch.zeros_like(e)) and torch.equal(a, torch.zeros_like(a))


def test_no_grad_and_frozen_weight(device):
    """No gradient wanted: the loss alone. A frozen head (LoRA): the hidden gradient alone."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=11)
    ref = CE.linear_cross_entropy_reference(hidden, weight, labels)
    with torch.no_grad():
        assert T.relative_error(fused(hidden, weight, labels), ref) <= 1e-5
    h = hidden.clone().requires_grad_()
    fused(h, weight, labels).backward()
    h64 = hidden.double().requires_grad_()
    CE.linear_cross_entropy_reference(h64, weight, labels).backward()
    assert weight.grad is None and T.relative_error(h.grad, h64.grad) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 18, 1000])
def test_chunk_sizes(chunk, device):
    """One token a chunk, a chunk that does not divide the tokens, exactly one chunk, and a
    chunk larger than the tokens give the same answer."""
    check_all(*inputs((2, 9, 33, 203), FP32, device, seed=12), chunk_size=chunk)


def test_launch_candidates(device):
    """Every candidate launch of the cross-entropy kernel, at the interpreter's grid."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=13)
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels)
    for cfg in K.ce_candidates(203, 4):
        got = run(fused, hidden, weight, labels, config=cfg)
        for name, a, r in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
            assert T.relative_error(a, r) <= 1e-5, (cfg, name)


def test_chunk_rule():
    """The chunk rule: half the hidden size in tokens (the logits take half the weight's bytes),
    within the floor and the cap, then free memory and the token count; multiples of 128 above 128."""
    assert K.chunk_rows(8192, 2048, 128256, 2, None) == 1024  # Llama-3.2-1B
    assert K.chunk_rows(8192, 3072, 128256, 2, None) == 1536  # Llama-3.2-3B
    assert K.chunk_rows(8192, 1024, 151936, 2, None) == K.CHUNK_FLOOR  # Qwen3-0.6B
    assert K.chunk_rows(8192, 256, 32000, 2, None) == K.CHUNK_FLOOR
    assert K.chunk_rows(8192, 8192, 32000, 2, None) == K.CHUNK_CAP
    assert K.chunk_rows(100, 2048, 128256, 2, None) == 100
    assert K.chunk_rows(8192, 2048, 128256, 2, 4 * 300 * 128256 * 2) == 256  # 300 fit: 256
    assert K.chunk_rows(8192, 2048, 128256, 2, 0) == 1


def test_chunk_from_environment(monkeypatch, device):
    """PROFUSE_CE_CHUNK sets the chunk (a plan per value); a bad value is one line."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=14)
    monkeypatch.setenv(K.CHUNK_ENV, "5")
    target = CE.shifted_labels(labels).reshape(-1)
    K.linear_cross_entropy_fused(hidden, weight, target, CE.IGNORE_INDEX, None)
    assert any(key[7] == 5 and plan.chunk == 5 for key, plan in K.PLANS.items())
    monkeypatch.setenv(K.CHUNK_ENV, "many")
    with pytest.raises(ValueError, match=K.CHUNK_ENV):
        K.linear_cross_entropy_fused(hidden, weight, target, CE.IGNORE_INDEX, None)


# --------------------------------------------------------------------------------------------
# Memory: never the whole logits; every allocation written before it is read
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("vocab, hidden", [(1, 3), (2, 1), (7, 33), (203, 5), (1000, 17), (4099, 2)])
def test_cast_in_place(vocab, hidden, dtype, device):
    """The accumulator's two blocks cast to a 16-bit dtype in the first block's memory: every
    element as `.to` rounds it (values spread over magnitudes so rounding shows, ties included),
    whatever the rows, odd ones too, and the pieces' count."""
    gen = torch.Generator().manual_seed(vocab * 31 + hidden)
    full = torch.randn((vocab, hidden), generator=gen, dtype=torch.float64)
    full = (full * torch.exp2(torch.randint(-8, 9, (vocab, hidden), generator=gen))).float()
    full.view(-1)[::5] = 1 + U[dtype]  # halfway between two values of dtype: rounds to even
    full = full.to(device)
    for lo_rows in {vocab - vocab // 2, min(vocab, -(-(vocab - vocab // 2) // 8) * 8)}:  # half; aligned
        lo, hi = full[:lo_rows].clone(), full[lo_rows:].clone()
        address = lo.data_ptr()
        out = K.cast_in_place(lo, hi, dtype)
        assert out.shape == (vocab, hidden) and out.dtype == dtype
        assert out.data_ptr() == address  # in the first block's memory
        assert torch.equal(out.cpu(), full.cpu().to(dtype)), lo_rows


def test_cast_in_place_refusals(device):
    lo, hi = torch.zeros((3, 4), device=device), torch.zeros((4, 4), device=device)
    with pytest.raises(ValueError, match="larger block first"):
        K.cast_in_place(lo, hi, BF16)
    with pytest.raises(ValueError, match="half its element size"):
        K.cast_in_place(hi, lo, FP32)


@pytest.mark.parametrize("weight_dtype", [BF16, FP32])
def test_head_gradient_in_the_accumulator(weight_dtype, device):
    """The weight's gradient is the accumulator's memory: with 16-bit weights and fp32 sums it
    is cast in place (storage of the first block's fp32 rows, V / 2 rounded up to 8, no V x H
    tensor of its own); with fp32 weights it is the accumulator itself."""
    vocab, hidden = 203, 33
    h, w, labels = inputs((2, 9, hidden, vocab), weight_dtype, device, seed=21)
    _, _, gw = K.linear_cross_entropy_forward(
        h.view(-1, hidden), w, labels.view(-1), None, -1.0, CE.IGNORE_INDEX, weight_dtype, 4, "fp32",
        True, True, SMALL_BLOCKS,
    )  # fmt: skip
    assert gw.shape == (vocab, hidden) and gw.dtype == weight_dtype
    fp32_rows = 104 if weight_dtype == BF16 else vocab  # half the rows, rounded up to 8
    assert gw.untyped_storage().nbytes() == fp32_rows * hidden * 4


class Allocations(TorchDispatchMode):
    """The largest floating-point tensor any op returns while it is on, in elements. (The
    interpreter's copies of kernel arguments to and from the host are uint8 byte views.)"""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def test_largest_allocation_is_chunk_sized(device):
    """64 tokens x 500 vocab, chunks of 8: no tensor of the op holds more than a chunk's logits,
    the weight or the hidden states (the largest of 8 x 500, 500 x 32, 64 x 32) — never the
    tokens x vocab logits eager makes."""
    shape = (2, 32, 32, 500)
    hidden, weight, labels = inputs(shape, BF16, device, seed=15)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with Allocations() as seen:
        loss = fused(h, w, labels, chunk_size=8)
        loss.backward()
    assert seen.largest <= max(8 * 500, 500 * 32, 64 * 32) < 64 * 500, seen.largest
    with Allocations() as eager_seen:
        CE.linear_cross_entropy_eager(h, w, labels)
    assert eager_seen.largest >= 64 * 500  # the count sees what it is meant to


@pytest.mark.parametrize("accumulate", ["fp32", "weight"])
def test_poisoned_allocations(accumulate, monkeypatch, device):
    """Every tensor the op allocates comes back NaN-filled: an element left unwritten (a chunk's
    gradient rows, the accumulator's first chunk) would show."""
    monkeypatch.setattr(K, "torch", PoisonedTorch())
    hidden, weight, labels = inputs((2, 9, 33, 203), BF16, device, seed=16)
    got = run(fused, hidden, weight, labels, accumulate=accumulate)
    assert all(torch.isfinite(t).all() for t in got)
    monkeypatch.undo()
    ref = run(CE.linear_cross_entropy_reference, hidden.double(), weight.double(), labels)
    eager = run(CE.linear_cross_entropy_eager, hidden, weight, labels)
    check(got, eager, ref, BF16)


# --------------------------------------------------------------------------------------------
# torch.compile and the refusals
# --------------------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """An embedding, one layer, and the tied head through linear_cross_entropy."""

    def __init__(self, vocab, width):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, ids, labels, num_items):
        hidden = F.silu(self.proj(self.emb(ids)))
        return CE.linear_cross_entropy(hidden, self.emb.weight, labels, num_items_in_batch=num_items)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_compile_fullgraph_matches_eager(dtype, device):
    """torch.compile(fullgraph=True) of a model using the op: no graph break (fullgraph raises on
    one), the custom ops in AOTAutograd's graphs, the same loss and gradients as the eager call;
    in bf16 with an odd vocabulary, the head's gradient cast in place into the larger of the
    accumulator's two blocks (80 fp32 rows of 151: storage 9 bf16 rows longer than the gradient)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: dict[str, set] = {"forward": set(), "backward": set()}

    def recorder(kind):
        def compiler(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    # A mutating op is functionalised: auto_functionalized(op, ...), re-inplaced
                    # by Inductor (no copy of the gradients).
                    target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
                    seen[kind].add(str(target))
            return make_boxed_func(gm.forward)

        return compiler

    torch.manual_seed(17)
    model = TinyLM(151, 48).to(device=device, dtype=dtype)
    ids = torch.randint(0, 151, (2, 11), device=device)
    labels = ids.clone()
    labels[1, :3] = CE.IGNORE_INDEX
    num_items = torch.tensor(17, device=device)
    results = []
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    for fn in (
        torch.compile(model, backend=backend, fullgraph=True),
        torch.compile(model, fullgraph=True),
        model,
    ):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels, num_items)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for compiled in results[:2]:
        for c, e in zip(compiled, results[2]):
            # bf16: Inductor may fuse the silu and round where eager does not
            assert T.relative_error(c, e) <= (1e-6 if dtype == FP32 else 4 * U[BF16])
    assert any("profuse.linear_cross_entropy" in t for t in seen["forward"]), seen["forward"]
    assert any("profuse.linear_cross_entropy_scale_" in t for t in seen["backward"]), seen["backward"]


def test_compile_under_autocast(device):
    """Compiled under autocast over fp32 weights (amp): the matmul dtype is read while tracing,
    no graph break, and the result is the eager fused op's."""
    hidden, weight, labels = inputs((2, 9, 48, 203), FP32, device, seed=24)
    compiled = torch.compile(CE.linear_cross_entropy, fullgraph=True)
    with torch.autocast(device.type, dtype=BF16):
        got = run(compiled, hidden, weight, labels)
        eager = run(CE.linear_cross_entropy, hidden, weight, labels)
    for name, c, e in zip(("loss", "grad_hidden", "grad_weight"), got, eager):
        assert c.dtype == e.dtype == FP32 and T.relative_error(c, e) <= 1e-6, name


def test_double_backward_refused(device):
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=18)
    h = hidden.clone().requires_grad_()
    loss = fused(h, weight.clone().requires_grad_(), labels)
    with pytest.raises(RuntimeError, match="profuse: linear_cross_entropy does not support double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_second_backward_refused(device):
    """retain_graph=True, then a second backward: the gradients were handed out already."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=19)
    h = hidden.clone().requires_grad_()
    loss = fused(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="hands them out once"):
        loss.backward()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(chunk_size=0), "chunk_size must be a positive"),
        (dict(accumulate="bf16"), "accumulate must be one of"),
        (dict(num_items_in_batch=-1), "num_items_in_batch must be 0 or more"),
        (dict(num_items_in_batch="8"), "num_items_in_batch must be a number or a tensor"),
    ],
)
def test_bad_arguments(kw, match, device):
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=20)
    with pytest.raises(ValueError, match=match):
        fused(hidden, weight, labels, **kw)


def test_target_out_of_range(device):
    """A target outside the vocabulary (not ignore_index) is one line where the targets are on
    the CPU; on CUDA its row's loss is NaN (kernels/cross_entropy.py says why)."""
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=21)
    labels[1, 4] = 203
    with pytest.raises(ValueError, match="target 203 at token 12 is outside the vocabulary"):
        fused(hidden, weight, labels.cpu())


def test_mixed_dtypes_outside_autocast(device):
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, device, seed=22)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused(hidden.to(BF16), weight, labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="targets on the device: CUDA")
def test_target_out_of_range_on_device_is_nan():
    """On CUDA a target outside the vocabulary is not checked (a host read would wait for the
    device): its row's loss and the gradients come out NaN, never a quietly wrong number."""
    dev = torch.device("cuda")
    hidden, weight, labels = inputs((2, 9, 33, 203), FP32, dev, seed=23)
    labels[1, 4] = 203
    loss, gh, gw = run(fused, hidden, weight, labels)
    assert math.isnan(loss.item()) and gh.isnan().any() and gw.isnan().any()
