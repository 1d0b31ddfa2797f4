"""The LM head and its causal-LM loss in chunks of tokens: gradients made in the forward, the
whole (tokens, vocab) logits never held.

    loss = sum_t [ lse_t - z_t[y_t] ] / n,   z_t = x_t W^T,   lse_t = log sum_v exp(z_tv)

over the tokens t whose target y_t is not ignore_index; n is their count (counted on the device)
or num_items_in_batch. With p_t = softmax(z_t) and s = 1/n:

    dz_t = (p_t - onehot(y_t)) * s   (0 for ignored tokens)
    grad_x = dz W,   grad_W = dz^T x

Per chunk of C tokens (C x V logits; V vocab, H hidden, b bytes of the matmul dtype):
1. z_c = x_c W^T                 cuBLAS, matmul dtype            2CHV flops, writes C V b bytes
2. one Triton kernel over the chunk's rows: lse (online over blocks of the vocab, fp32), the row's
   loss, and dz_c written over z_c in place                      reads C V b twice (the second
                                                                 time mostly from L2), writes C V b
3. grad_x[c] = dz_c W            cuBLAS                          2CHV flops, reads C V b
4. grad_W (+)= dz_c^T x_c        cuBLAS, accumulated in fp32     2CHV flops, reads C V b, and
                                                                 reads + writes the V x H
                                                                 accumulator (8 VH bytes in fp32)
Three matmuls in all (6NHV flops for N tokens); recomputing the logits in the backward would
cost a fourth (~1/3 more flops). What chunking adds is step 4's pass over the accumulator,
(N / C) x 8VH bytes: at Llama-3.2-1B's head (V = 128256, H = 2048) 2.1 GB a chunk. The GEMM of
step 4 is compute-bound when its flops per byte of accumulator, 2C / 8, pass the card's ridge
(H200: 989 TFLOP/s over 4.8 TB/s, ~206 flop/B): C >= ~820 tokens in fp32 (~410 with a bf16
accumulator). Below that each chunk pays a memory-bound pass over V x H, which is where a chunk
of 256 tokens (Liger-Kernel's rule at this shape: 32 passes) loses its time.

The chunk rule (`chunk_rows`): C = H / 2 tokens, so the chunk's logits (C x V in the matmul
dtype) take half the bytes of the weight in that dtype. With 16-bit weights the op's transient
memory at its peak is then the fp32 accumulator (two weights' bytes), cast in place at the end
(`cast_in_place`: no third weight's bytes for the cast), and half a weight of logits; under amp,
the fp32 gradient, the weight's 16-bit cast and half a weight of logits (Liger-Kernel then holds
its bf16 cast of the weight that autocast caches and casts the weight again for every chunk's
logits, `weight.t()` being a view autocast does not cache). Clamped to [CHUNK_FLOOR, CHUNK_CAP]
tokens, then cut to what a quarter of the device's free memory holds, to the token count, and
down to a multiple of 128. At 8192 tokens: Llama-3.2-1B 1024 (8 chunks, 263 MB of bf16 logits),
Qwen3-0.6B 1024 (8 chunks, 311 MB). An argument of `linear_cross_entropy_fused` or the
environment variable PROFUSE_CE_CHUNK overrides it; the bounds await the H200 sweep
(docs/kernels.md).

The weight's gradient is accumulated in fp32 (`accumulate="fp32"`, the default): where the
weight is fp32 (amp, or fp32 training) the accumulator is the gradient itself; with 16-bit
weights it is a V x H fp32 buffer, cast once at the end (2 extra bytes an element of memory over
a 16-bit accumulator). `accumulate="weight"` (or PROFUSE_CE_ACCUM=weight) accumulates in the
weight's dtype instead, rounding once a chunk, as Liger-Kernel does by default: less memory,
less accuracy. On CUDA with torch >= 2.8 the accumulation is cuBLAS's bf16 x bf16 -> fp32
(`addmm(out_dtype=float32)`); elsewhere (CPU, older torch) each chunk's product is rounded to the
matmul dtype before its fp32 sum.

Under autocast the matmuls run in the autocast dtype: the weight is cast to it once per call (an
fp32 weight under amp: one V x H bf16 copy, held for the call), the hidden states a chunk at a
time. Gradients come back in the inputs' dtypes.

No host synchronisation: the divisor n is a device tensor the kernel loads (counted with torch
on the device, or num_items_in_batch); the loss is summed and divided on the device. What is not
checked, for that reason: a target out of [0, V) other than ignore_index, on CUDA. Its row's loss
and gradient come out NaN (the kernel masks the read), so the loss is NaN rather than quietly
wrong. Targets on the CPU are checked there, in one line.

The backward multiplies both gradients by the loss's incoming gradient g in place, with a kernel
that reads g and leaves the tensor untouched when g == 1 (no pass over V x H for the usual
g = 1.0, and no host read of g). The gradients are handed to autograd once: a second backward
through the same graph (retain_graph=True) is refused in one line, as double backward is.

Under torch.compile the chunked forward is one opaque custom op (profuse::linear_cross_entropy,
with a fake implementation), so Inductor neither materialises the logits nor reorders the chunks;
the backward's scaling is a second one that mutates the saved gradients
(profuse::linear_cross_entropy_scale_).

Layout: the @triton.jit kernels; the launch configs and the chunk rule; the plans (PlanCache);
the launchers; the custom ops; the autograd.Function; the entry point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from profuse.env import free_memory_bytes, sm_count, whole_number_setting
from profuse.kernels.autotune import Launch, PlanCache
from profuse.kernels.configs import KernelConfig
from profuse.kernels.rows import check_runnable, double_backward_error

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _cross_entropy_kernel(
    X_ptr,  # (n_rows, n_cols) a chunk's logits, matmul dtype; with WRITE_GRAD overwritten by dz
    Y_ptr,  # (n_rows,) targets, int32 or int64
    Loss_ptr,  # (n_rows,) fp32 out: lse - z[y]; 0 where y == ignore_index; NaN where y is out of range
    Count_ptr,  # () the divisor n (any numeric dtype): dz = (softmax - onehot) / n
    x_row_stride,
    n_rows,
    n_cols,
    ignore_index,
    softcap,  # the cap of final-logit soft-capping (SOFTCAP only)
    BLOCK_SIZE: tl.constexpr,  # columns per step of the row loops
    WRITE_GRAD: tl.constexpr,  # write dz over the logits (False: the loss alone)
    KEEP_L2: tl.constexpr,  # pass 1 marks the row evict_last so pass 2 re-reads it from L2
    SOFTCAP: tl.constexpr,  # the loss is of c = softcap * tanh(z / softcap), not of z
):
    """Rows row = program, program + programs, ... of a persistent grid. Per row:
    pass 1: m, s = the running max and sum of exp(z - m) over blocks of the row (fp32), so
            lse = m + log(s);  loss = lse - z[y]  (one more element read)
    pass 2: dz = exp(z - lse) / n, minus 1/n at column y, stored over z.
    An ignored row reads nothing and writes zeros; a row whose target lies outside [0, n_cols)
    gets NaN loss and NaN gradient (nothing is read out of bounds).
    With SOFTCAP (Gemma 2 and 3's final-logit soft-capping) every z read is first made
    c = softcap * tanh(z / softcap) in fp32, the softmax is over c, and pass 2 stores
    dz = dc * (1 - (c / softcap)^2), the tanh's derivative, over z.
    Bytes a row: reads 2 x n_cols (pass 2 from L2 when the grid's rows in flight fit it), writes
    n_cols, in the logits' dtype."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    inv_n = 1.0 / tl.load(Count_ptr).to(tl.float32)
    for row in range(pid, n_rows, n_programs):
        x_row = X_ptr + tl.cast(row, tl.int64) * x_row_stride
        y = tl.load(Y_ptr + row).to(tl.int64)
        counted = y != ignore_index
        in_range = (y >= 0) & (y < n_cols)
        # Columns read: the whole row, none for an ignored row (pass 1 takes no step; pass 2
        # writes zeros).
        n_read = tl.where(counted, n_cols, 0)
        m = float("-inf")
        s = 0.0
        for start in range(0, n_read, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            if KEEP_L2:
                z = tl.load(
                    x_row + cols, mask=cols < n_cols, other=float("-inf"), eviction_policy="evict_last"
                )
            else:
                z = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf"))
            z = z.to(tl.float32)
            if SOFTCAP:
                z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0)  # -inf -> -softcap
                z = tl.where(cols < n_cols, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        # An ignored row's lse is 0 (not -inf), so pass 2 computes nothing undefined.
        lse = tl.where(counted, m, 0.0) + tl.log(tl.where(counted, s, 1.0))
        z_y = tl.load(x_row + y, mask=counted & in_range, other=0.0).to(tl.float32)
        if SOFTCAP:
            z_y = softcap * (2.0 * tl.sigmoid(2.0 * z_y / softcap) - 1.0)
        loss = tl.where(counted, lse - z_y, 0.0)
        loss = tl.where(counted & (~in_range), float("nan"), loss)
        tl.store(Loss_ptr + row, loss)
        if WRITE_GRAD:
            # 1/n for a counted row, 0 for an ignored one (whose reads are masked off), NaN for a
            # target out of range.
            g_row = tl.where(counted, inv_n, 0.0)
            g_row = tl.where(counted & (~in_range), float("nan"), g_row)
            for start in range(0, n_cols, BLOCK_SIZE):
                cols = start + tl.arange(0, BLOCK_SIZE)
                z = tl.load(x_row + cols, mask=cols < n_read, other=0.0, eviction_policy="evict_first")
                z = z.to(tl.float32)
                if SOFTCAP:
                    t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
                    z = softcap * t
                p = tl.exp(z - lse) * g_row
                dz = tl.where(counted, tl.where(cols == y, p - g_row, p), 0.0)
                if SOFTCAP:
                    dz = dz * (1.0 - t * t)
                tl.store(x_row + cols, dz.to(X_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_kernel(
    X_ptr,  # (n_elements,) a gradient, scaled in place
    G_ptr,  # () the incoming gradient g
    n_elements,
    BLOCK_SIZE: tl.constexpr,
):
    """x *= g, in fp32, rounded once; nothing is read or written when g == 1 (each program loads
    g and skips its loop). Persistent grid: blocks program, program + programs, ..."""
    g = tl.load(G_ptr).to(tl.float32)
    if g != 1.0:
        pid = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64) * BLOCK_SIZE
        for start in range(pid * BLOCK_SIZE, n_elements, step):
            offs = start + tl.arange(0, BLOCK_SIZE)
            mask = offs < n_elements
            x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(X_ptr + offs, (x * g).to(X_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configs and the chunk rule (policy)
# --------------------------------------------------------------------------------------------

# The cross-entropy kernel is memory-bound (~6 bytes and 2 exps a logit in bf16, about 8% of the
# op's time at Llama-3.2-1B's head by the model above), so its launch is a fixed heuristic, not
# tuned per call; `benchmarks/bench_linear_cross_entropy.py --ce-configs` times the candidates
# below at the benchmark's shapes (not yet run on a GPU).
# Favourite: one persistent program of 32 warps an SM, 16 elements a thread a step. With one
# row in flight an SM the rows being read (132 x 256 KB at V = 128256 bf16, 34 MB) fit the
# H200's 60 MB L2, so pass 2 re-reads them from L2 (KEEP_L2) and the DRAM moves ~4 bytes a logit,
# not 6; one program's 1024 threads keep ~32 KB of loads in flight, about what an SM needs
# (4.8 TB/s x ~1 us latency / 132 SMs).
CE_CANDIDATES = (
    # (block, warps, programs an SM (0: one program a row), l2)
    (16384, 32, 1, "keep"),
    (8192, 16, 2, "keep"),
    (8192, 32, 1, "keep"),
    (4096, 8, 4, "plain"),
    (8192, 16, 0, "plain"),
)

# Chunk rule bounds, in tokens. The floor keeps step 4's accumulator pass under its GEMM's
# compute in fp32 (~820 tokens on the H200, see the module docstring); the cap is a first guess
# until the H200 sweep (benchmarks/bench_linear_cross_entropy.py --sweep) measures it.
CHUNK_FLOOR = 1024
CHUNK_CAP = 2048
CHUNK_ENV = "PROFUSE_CE_CHUNK"
ACCUM_ENV = "PROFUSE_CE_ACCUM"
ACCUMULATE = ("fp32", "weight")
# At most this share of the free device memory goes to a chunk's logits.
CHUNK_MEMORY_SHARE = 0.25


def ce_candidates(n_cols: int, n_sms: int) -> list[KernelConfig]:
    """Launch shapes for the cross-entropy kernel at a vocabulary of `n_cols`, the favourite
    first. A block never exceeds the row (rounded up to a power of two)."""
    out = []
    for block, warps, per_sm, l2 in CE_CANDIDATES:
        b = min(block, triton.next_power_of_2(n_cols))
        w = max(1, min(warps, b // 256))  # at least 8 elements a thread
        cfg = KernelConfig("chunked", 1, b, w, 1, n_sms * per_sm, l2=l2)
        if cfg not in out:
            out.append(cfg)
    return out


def chunk_rows(n_tokens: int, hidden: int, vocab: int, mm_bytes: int, free_bytes: int | None) -> int:
    """Tokens per chunk (module docstring): `hidden` / 2, within [CHUNK_FLOOR, CHUNK_CAP], at most
    CHUNK_MEMORY_SHARE of `free_bytes` in logits of `mm_bytes` an element, at most `n_tokens`, a
    multiple of 128 where above it."""
    c = max(CHUNK_FLOOR, min(CHUNK_CAP, hidden // 2))
    if free_bytes is not None:
        c = min(c, int(CHUNK_MEMORY_SHARE * free_bytes) // (vocab * mm_bytes))
    c = max(1, min(c, n_tokens))
    return c - c % 128 if c > 128 else c


def requested_chunk(chunk_size: int | None) -> int:
    """The chunk asked for: the argument, else PROFUSE_CE_CHUNK, else 0 (the rule decides)."""
    if chunk_size is None:
        chunk_size = whole_number_setting(CHUNK_ENV, "tokens")
        if chunk_size is None:
            return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive whole number of tokens, got {chunk_size!r}")
    return chunk_size


def requested_accumulate(accumulate: str | None) -> str:
    """The accumulator asked for: the argument, else PROFUSE_CE_ACCUM, else "fp32"."""
    value = accumulate if accumulate is not None else os.environ.get(ACCUM_ENV) or "fp32"
    if value not in ACCUMULATE:
        what = "accumulate" if accumulate is not None else ACCUM_ENV
        raise ValueError(f"{what} must be one of {', '.join(ACCUMULATE)}; got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# Plans: built on the first call of a signature, then looked up
# --------------------------------------------------------------------------------------------


def _has_out_dtype() -> bool:
    """torch.mm / torch.addmm with out_dtype (torch 2.8 and later)."""
    return all("dtype_out" in getattr(torch.ops.aten, op).overloads() for op in ("mm", "addmm"))


HAS_OUT_DTYPE = _has_out_dtype()
_OUT_DTYPE_WORKS: dict[tuple, bool] = {}


def out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does cuBLAS take `dtype` x `dtype` -> fp32 here (mm and addmm with out_dtype, into an
    out= tensor)? Tried once per device and dtype on 16 x 16 tensors: where the build or the
    card refuses, the fallback (a product in `dtype`, summed in fp32) runs instead of an error."""
    key = (device, dtype)
    if key not in _OUT_DTYPE_WORKS:
        ok = HAS_OUT_DTYPE and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        if ok:
            try:
                a = torch.ones((16, 16), dtype=dtype, device=device)
                out = torch.zeros((16, 16), dtype=torch.float32, device=device)
                torch.mm(a, a, out_dtype=torch.float32, out=out)
                torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _OUT_DTYPE_WORKS[key] = ok
    return _OUT_DTYPE_WORKS[key]


def ce_launch(cfg: KernelConfig, n_rows: int, write_grad: bool, softcap: bool = False) -> Launch:
    programs = min(n_rows, cfg.programs) if cfg.programs else n_rows
    return Launch(
        _cross_entropy_kernel, (max(1, programs),), cfg, "cross_entropy",
        BLOCK_SIZE=cfg.block_n, WRITE_GRAD=write_grad, KEEP_L2=cfg.l2 == "keep", SOFTCAP=softcap,
        num_warps=cfg.num_warps,
    )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Everything a call of one signature needs decided: the chunk, the accumulator's dtype, how
    a 16-bit product lands in an fp32 tensor, and the kernel launches for a full and a last chunk."""

    chunk: int
    acc_dtype: torch.dtype | None  # None: the weight's gradient is not wanted
    out_dtype_mm: bool  # cuBLAS's 16-bit x 16-bit -> fp32 (mm / addmm out_dtype) is used
    ce_full: Launch
    ce_last: Launch | None  # the last chunk's launch where its rows differ


PLANS = PlanCache()


def _plan(
    key: tuple,
    hidden2d,
    weight,
    mm_dtype,
    need_gh: bool,
    need_gw: bool,
    requested: int,
    accumulate: str,
    config,
    softcap: bool = False,
) -> Plan:
    """The plan for a new signature: the chunk (`requested`, else the rule, which reads the free
    memory once here), the accumulator, the kernel launches; kept under `key`."""
    n_tokens, hidden = hidden2d.shape
    vocab = weight.shape[0]
    device = hidden2d.device
    check_runnable(device, "linear_cross_entropy")
    mm_bytes = torch.finfo(mm_dtype).bits // 8
    if requested:
        chunk = max(1, min(requested, n_tokens))
    else:
        free = free_memory_bytes(device) if device.type == "cuda" else None
        chunk = chunk_rows(n_tokens, hidden, vocab, mm_bytes, free)
    acc = None
    if need_gw:
        acc = torch.float32 if accumulate == "fp32" or weight.dtype == torch.float32 else weight.dtype
    out_dtype_mm = out_dtype_works(device, mm_dtype)
    cfg = config or ce_candidates(vocab, sm_count(device))[0]
    write_grad = need_gh or need_gw
    last = n_tokens % chunk
    plan = Plan(
        chunk, acc, out_dtype_mm, ce_launch(cfg, min(chunk, n_tokens), write_grad, softcap),
        ce_launch(cfg, last, write_grad, softcap) if last and n_tokens > chunk else None,
    )  # fmt: skip
    return PLANS.add(key, plan)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype_mm: bool) -> None:
    """out = a @ b, out in its own dtype (a and b share the matmul dtype)."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    elif out_dtype_mm and out.dtype == torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        out.copy_(torch.mm(a, b))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype_mm: bool) -> None:
    """acc += a @ b, the sum in acc's dtype."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif out_dtype_mm and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


def _accumulator(
    vocab: int, hidden: int, acc_dtype: torch.dtype | None, weight_dtype: torch.dtype, device
) -> list[tuple[torch.Tensor, slice]]:
    """The weight gradient's accumulator, as row blocks, each with the logits' columns it sums:
    none where that gradient is not wanted; one (V, H) block where it is the gradient or its cast
    needs room of its own; two, rows [0, L) and the rest (L at least V / 2, a multiple of 8 so the
    second block's columns of the logits start 16-byte aligned for cuBLAS), where the cast is to
    half the element size (fp32 into a 16-bit weight's dtype), so that cast_in_place lands the
    gradient in the first block's memory: the op never holds the accumulator and its cast at once
    (the cast's 0.53 GB at Llama-3.2-1B's head). A vocabulary of 8 rows or fewer keeps one block."""
    if acc_dtype is None:
        return []
    lo = -(-(vocab - vocab // 2) // 8) * 8
    if acc_dtype.itemsize != 2 * weight_dtype.itemsize or lo >= vocab:
        return [(torch.empty((vocab, hidden), dtype=acc_dtype, device=device), slice(None))]
    return [
        (torch.empty((lo, hidden), dtype=acc_dtype, device=device), slice(0, lo)),
        (torch.empty((vocab - lo, hidden), dtype=acc_dtype, device=device), slice(lo, None)),
    ]


def cast_in_place(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [0, L) and [L, V) of a (V, H) matrix, `lo` and `hi` (L >= V - L, an element twice
    the size of `dtype`'s), as one (V, H) tensor of `dtype` in `lo`'s memory, each element
    rounded as `.to(dtype)` rounds it. `lo` is cast from its first row in pieces that double:
    rows [s, e) with e <= 2s land in bytes [2sH, 2eH) (in units of `dtype`'s size, halved),
    below their own fp32 bytes [4sH, 4eH) and over rows already cast; the first piece overlaps
    its own source and goes through a copy of ceil(L / 64) rows. `hi` then lands in the back
    half, whose rows of `lo` are cast by then."""
    rows, hidden = lo.shape
    vocab = rows + hi.shape[0]
    if lo.element_size() != 2 * dtype.itemsize or not lo.is_contiguous():
        raise ValueError(
            f"cast_in_place casts a contiguous tensor to half its element size, not {lo.dtype} to {dtype}"
        )
    if hi.shape[0] > rows or hi.shape[1:] != lo.shape[1:]:
        raise ValueError(
            f"cast_in_place needs the larger block first: {tuple(lo.shape)} then {tuple(hi.shape)}"
        )
    out = torch.empty(0, dtype=dtype, device=lo.device).set_(lo.untyped_storage(), 0, (vocab, hidden))
    s = min(rows, -(-rows // 64))
    out[:s].copy_(lo[:s].to(dtype))
    while s < rows:
        e = min(2 * s, rows)
        out[s:e].copy_(lo[s:e])
        s = e
    out[rows:].copy_(hi)
    return out


def _divisor(target, ignore_index, num_items, num_items_value, device) -> torch.Tensor:
    """n as a 0-d device tensor, made without a host synchronisation: the count of counted
    targets, num_items_in_batch's tensor (a CPU one read on the host, which waits for nothing),
    or its number."""
    if num_items is not None:
        if num_items.device == device:
            return num_items.reshape(())
        if num_items.device.type != "cpu":
            return num_items.to(device).reshape(())
        num_items_value = float(num_items.item())  # a CPU tensor: no device to wait for
    if num_items_value >= 0:
        return torch.full((), num_items_value, dtype=torch.float32, device=device)
    return (target != ignore_index).sum()


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """On the CPU, where it costs no synchronisation: every target in [0, vocab) or ignored."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target {int(target[i])} at token {i} is outside the vocabulary [0, {vocab}) "
            f"and is not ignore_index ({ignore_index})"
        )


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    num_items: torch.Tensor | None,
    num_items_value: float,
    ignore_index: int,
    mm_dtype: torch.dtype,
    chunk_size: int,
    accumulate: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    config: KernelConfig | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, grad_hidden, grad_weight) for g = 1, chunk by chunk (module docstring); a gradient
    not asked for is None and costs nothing. `hidden` is (N, H), `target` (N,); `num_items`, a
    tensor, or `num_items_value` >= 0 divides instead of the count; `chunk_size` 0 lets the rule
    choose; `config` runs that cross-entropy launch."""
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    if target.device.type == "cpu":
        _check_targets(target, vocab, ignore_index)
    target = target.to(device)
    key = (n_tokens, hidden_size, vocab, hidden.dtype, weight.dtype, mm_dtype, device, chunk_size,
           accumulate, config, need_grad_hidden, need_grad_weight, softcap > 0)  # fmt: skip
    plan = PLANS.get(key)
    if plan is None:
        plan = _plan(
            key, hidden, weight, mm_dtype, need_grad_hidden, need_grad_weight, chunk_size, accumulate, config,
            softcap > 0,
        )  # fmt: skip
    with torch.autocast(device.type, enabled=False):
        count = _divisor(target, ignore_index, num_items, num_items_value, device)
        w = weight.to(mm_dtype)  # once a call: under amp, the one V x H copy in the matmul dtype
        chunk = plan.chunk
        logits_buf = torch.empty((min(chunk, n_tokens), vocab), dtype=mm_dtype, device=device)
        loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=device)
        grad_hidden = (
            torch.empty((n_tokens, hidden_size), dtype=hidden.dtype, device=device)
            if need_grad_hidden
            else None
        )
        parts = _accumulator(vocab, hidden_size, plan.acc_dtype, weight.dtype, device)
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            x = hidden[start:end].to(mm_dtype)  # (C, H)
            z = logits_buf[: end - start]  # (C, V)
            torch.mm(x, w.t(), out=z)
            ce = plan.ce_last if plan.ce_last is not None and end - start < chunk else plan.ce_full
            ce(
                z,
                target[start:end],
                loss_rows[start:end],
                count,
                z.stride(0),
                end - start,
                vocab,
                ignore_index,
                softcap,
            )
            if grad_hidden is not None:
                _product_into(grad_hidden[start:end], z, w, plan.out_dtype_mm)
            for part, cols in parts:
                if start == 0:
                    _product_into(part, z[:, cols].t(), x, plan.out_dtype_mm)
                else:
                    _accumulate(part, z[:, cols].t(), x, plan.out_dtype_mm)
        # The chunk's logits go before the accumulator's cast; z, a view of them, would keep them
        # alive.
        z = x = logits_buf = w = None
        grad_weight = None
        blocks = [part for part, _ in parts]
        del parts
        if blocks:
            if n_tokens == 0:
                for part in blocks:
                    part.zero_()
            if len(blocks) == 2:
                grad_weight = cast_in_place(*blocks, weight.dtype)
            else:
                grad_weight = blocks[0] if blocks[0].dtype == weight.dtype else blocks[0].to(weight.dtype)
            del blocks
        loss = loss_rows.sum() / count
    return loss, grad_hidden, grad_weight


def _scale_launch(n_elements: int, device: torch.device) -> Launch:
    block = 4096
    programs = max(1, min(triton.cdiv(n_elements, block), 4 * sm_count(device)))
    return Launch(_scale_kernel, (programs,), None, "scale", BLOCK_SIZE=block, num_warps=8)


_SCALE_PLANS = PlanCache()


def scale_(grad: torch.Tensor, g: torch.Tensor) -> None:
    """grad *= g in place, skipped on the device when g == 1 (no host read of g)."""
    n = grad.numel()
    if n == 0:
        return
    key = (n, grad.device)
    launch = _SCALE_PLANS.get(key)
    if launch is None:
        check_runnable(grad.device, "linear_cross_entropy")
        launch = _SCALE_PLANS.add(key, _scale_launch(n, grad.device))
    launch(grad, g, n)


# --------------------------------------------------------------------------------------------
# The ops torch.compile calls (no graph break), the autograd.Function, the entry point
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("profuse::linear_cross_entropy", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    num_items: torch.Tensor | None,
    num_items_value: float,
    ignore_index: int,
    mm_dtype: torch.dtype,
    chunk_size: int,
    accumulate: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, gh, gw = linear_cross_entropy_forward(
        hidden, weight, target, num_items, num_items_value, ignore_index, mm_dtype, chunk_size, accumulate,
        need_grad_hidden, need_grad_weight, softcap=softcap,
    )  # fmt: skip
    # An op returns tensors only: an empty one stands for "not asked for".
    return loss, (hidden.new_empty(0) if gh is None else gh), (weight.new_empty(0) if gw is None else gw)


@_forward_op.register_fake
def _forward_fake(hidden, weight, target, num_items, num_items_value, ignore_index, mm_dtype, chunk_size,
                  accumulate, need_grad_hidden, need_grad_weight, softcap):  # fmt: skip
    loss = hidden.new_empty((), dtype=torch.float32)
    gh = hidden.new_empty(hidden.shape) if need_grad_hidden else hidden.new_empty(0)
    gw = weight.new_empty(weight.shape) if need_grad_weight else weight.new_empty(0)
    return loss, gh, gw


@torch.library.custom_op("profuse::linear_cross_entropy_scale_", mutates_args=("grad_hidden", "grad_weight"))
def _scale_op(grad_hidden: torch.Tensor, grad_weight: torch.Tensor, g: torch.Tensor) -> None:
    scale_(grad_hidden, g)
    scale_(grad_weight, g)


@_scale_op.register_fake
def _scale_fake(grad_hidden, grad_weight, g) -> None:
    return None


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward: the loss, with both gradients made on the way and saved. Backward: those
    gradients times g, in place. Eager calls go to the launcher; a traced call, to the custom
    ops. Double backward, and a second backward of one graph, are refused in one line."""

    @staticmethod
    def forward(ctx, hidden, weight, target, num_items, num_items_value, ignore_index, mm_dtype, chunk_size,
                accumulate, config, softcap=0.0):  # fmt: skip
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        args = (hidden, weight, target, num_items, num_items_value, ignore_index, mm_dtype, chunk_size,
                accumulate, need_gh, need_gw)  # fmt: skip
        if torch.compiler.is_compiling():
            loss, gh, gw = torch.ops.profuse.linear_cross_entropy(*args, softcap)
        else:
            loss, gh, gw = linear_cross_entropy_forward(*args, config, softcap)
            gh = hidden.new_empty(0) if gh is None else gh
            gw = weight.new_empty(0) if gw is None else gw
            ctx.spent = False
        ctx.save_for_backward(gh, gw)
        return loss

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.compiler.is_compiling():
            torch.ops.profuse.linear_cross_entropy_scale_(gh, gw, g)
        else:
            if torch.is_grad_enabled():  # create_graph=True: these gradients have no grad_fn
                raise double_backward_error(
                    "linear_cross_entropy", "profuse.crossentropy.linear_cross_entropy_eager"
                )
            if ctx.spent:
                raise RuntimeError(
                    "profuse: linear_cross_entropy makes its gradients in the forward and hands them out "
                    "once; run the forward again rather than a second backward (retain_graph=True)"
                )
            ctx.spent = True
            scale_(gh, g)
            scale_(gw, g)
        return (gh if need_gh else None), (gw if need_gw else None), *([None] * 9)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) computes in here: autocast's where it is on for the
    device, else the inputs' own (which must then agree, as F.linear's must)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} and weight is {weight.dtype}: outside autocast they must share a dtype"
        )
    return hidden.dtype


def linear_cross_entropy_fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_flat: torch.Tensor,
    ignore_index: int,
    num_items_in_batch: torch.Tensor | int | None,
    *,
    chunk_size: int | None = None,
    accumulate: str | None = None,
    config: KernelConfig | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The loss of profuse.crossentropy.linear_cross_entropy on checked inputs: hidden (..., H),
    weight (V, H), target_flat (N,) with N = hidden's leading elements. Differentiable once,
    towards hidden and weight. `chunk_size` (tokens a chunk; else PROFUSE_CE_CHUNK, else the
    rule), `accumulate` ("fp32" or "weight"; else PROFUSE_CE_ACCUM, else "fp32") and `config`
    (the cross-entropy kernel's launch; eager calls only) are for tests and benchmarks.
    `softcap`: the loss is of softcap * tanh(logits / softcap) (Gemma 2 and 3), None or 0 for none."""
    hidden_size = hidden.shape[-1]
    hidden2d = hidden.reshape(-1, hidden_size)
    if target_flat.shape != (hidden2d.shape[0],):
        raise ValueError(
            f"target_flat has shape {tuple(target_flat.shape)}, expected ({hidden2d.shape[0]},): "
            "one target per token of hidden"
        )
    mm_dtype = matmul_dtype(hidden, weight)
    chunk = requested_chunk(chunk_size)
    acc = requested_accumulate(accumulate)
    num_items, num_value = None, -1.0
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items = num_items_in_batch
    elif num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
            raise ValueError(
                f"num_items_in_batch must be a number or a tensor, got {type(num_items_in_batch).__name__}"
            )
        if not num_items_in_batch >= 0:
            raise ValueError(f"num_items_in_batch must be 0 or more, got {num_items_in_batch}")
        num_value = float(num_items_in_batch)
    cap = float(softcap or 0.0)
    if not cap >= 0:
        raise ValueError(f"softcap must be a positive number (or None), got {softcap!r}")
    compiling = torch.compiler.is_compiling()
    if config is not None and compiling:
        raise ValueError("config picks the launch of eager calls only; under torch.compile leave it out")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = LinearCrossEntropyFunction.apply(
            hidden2d,
            weight,
            target_flat,
            num_items,
            num_value,
            ignore_index,
            mm_dtype,
            chunk,
            acc,
            config,
            cap,
        )
    elif compiling:
        loss = torch.ops.profuse.linear_cross_entropy(
            hidden2d,
            weight,
            target_flat,
            num_items,
            num_value,
            ignore_index,
            mm_dtype,
            chunk,
            acc,
            False,
            False,
            cap,
        )[0]
    else:
        loss = linear_cross_entropy_forward(
            hidden2d, weight, target_flat, num_items, num_value, ignore_index, mm_dtype, chunk, acc,
            False, False, config, cap,
        )[0]  # fmt: skip
    return loss
