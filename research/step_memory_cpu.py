"""The CPU proxy for a training step's peak memory: the peak of live tensor bytes over one forward
and backward, and what is live at that moment, for eager, profuse.fuse and Liger-Kernel's patch.

    PYTHONPATH=src python research/step_memory_cpu.py [--dtype bf16|fp32] [--layers 2] [--top 12]

A TorchDispatchMode sees every op below autograd, the backward's included, and each output's
untyped storage: a storage is counted once (keyed by its data pointer, so views are not counted
again) from the op that made it until Python's finalizer on the storage object runs (torch keeps
one Python object per storage, so the finalizer fires when the bytes are freed, not when a view
dies). Parameters, and anything made before the step, are not counted: the figure is the step's
memory above the resident weights, what a card's allocator adds at its peak less its rounding
and caching. Triton kernels run through the interpreter; their outputs are the torch tensors
their launchers allocate.

"fused" is profuse.fuse as it is (its layers' places own their buffers: silu_mul's and the
norms' input gradients written over gate/up and dy, inplace_backward); "fused out-of-place" the
same model with every input gradient a new tensor, as before.

The model is a Llama with Llama-3.2-1B's proportions, shrunk (hidden 256, ffn 1024 = 4x, 8 heads
of 32, 2 KV heads, vocabulary 4096, tied embeddings), 4 x 256 tokens, labels given: the loss is
the model's own. Liger-Kernel's patch runs through the interpreter too where it can; a variant
that cannot run prints why.

On a CPU (torch 2.13, transformers 5.25, liger-kernel 0.8.5, 2026-12-07), bf16: eager 80.3 MB
(in the backward); fused 31.6 MB (at the end of the forward; backward 27.4); fused out-of-place
31.6 (backward 29.0); fused accum=weight chunk=256 25.8 (backward; forward 25.8); liger not run
(its kernels fail under the interpreter: AttributeError, 'float' object has no attribute 'to').
Since the head's gradient is cast in place (same day, later; the chunk rule's 1024-token floor
now takes all 1024 tokens here): fused 32.64 MB (forward; backward 28.97), fused out-of-place
32.64, chunk=256 (C = H) 26.35, chunk=128 (C = H / 2) 25.30, accum=weight chunk=256 23.73
(backward).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import time
import weakref
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import profuse  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages made by ops under the mode; the peak, and what was live then."""

    def __init__(self, resident: set[int]):
        super().__init__()
        self.resident = resident  # data pointers of storages made before the step (parameters)
        self.live: dict[int, tuple[int, str]] = {}  # data_ptr -> (bytes, what made it)
        self.total = self.peak = 0
        self.peak_live: dict[int, tuple[int, str]] = {}
        self.phase = "forward"
        self.peak_phase = ""
        self.phase_peak: dict[str, int] = {}  # the peak within each phase

    def _free(self, ptr: int) -> None:
        entry = self.live.pop(ptr, None)
        if entry is not None:
            self.total -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.live or ptr in self.resident:
                continue
            what = f"{func.__name__.split('.')[0]} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            self.live[ptr] = (nbytes, f"{self.phase}: {what}")
            self.total += nbytes
            weakref.finalize(storage, self._free, ptr)
            self.phase_peak[self.phase] = max(self.phase_peak.get(self.phase, 0), self.total)
            if self.total > self.peak:
                self.peak, self.peak_phase, self.peak_live = self.total, self.phase, dict(self.live)
        return out

    def at_peak(self, top: int) -> list[tuple[str, int, int]]:
        """(what, count, bytes) live at the peak, the largest first."""
        count, size = Counter(), Counter()
        for nbytes, what in self.peak_live.values():
            count[what] += 1
            size[what] += nbytes
        return [(w, count[w], size[w]) for w, _ in size.most_common(top)]


def llama(layers: int, dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=512,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def step_peak(model, ids: torch.Tensor, context=None) -> LiveBytes:
    """One forward (labels given) and backward under the mode: the peak and what made it."""
    resident = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    mode = LiveBytes(resident)
    with context if context is not None else contextlib.nullcontext():
        with mode:
            loss = model(input_ids=ids, labels=ids).loss
            mode.phase = "backward"
            loss.backward()
            del loss
    return mode


def out_of_place(model) -> None:
    """The fused model's places calling the block ops without inplace_backward (every input
    gradient a new tensor), as before the places owned their buffers: the "before" of the
    in-place backward."""
    from profuse.fusion.hf_modules import STATE

    def drop_owned(op):
        return lambda *args, owned=False, **kwargs: op(*args, **kwargs)

    for module in model.modules():
        st = module.__dict__.get(STATE)
        if not dataclasses.is_dataclass(st):
            continue
        changes = {
            name: drop_owned(getattr(st, name))
            for name in ("silu_mul", "add_rms_norm", "rms_norm")
            if getattr(st, name, None) is not None
        }
        if changes:
            module.__dict__[STATE] = dataclasses.replace(st, **changes)


@contextlib.contextmanager
def environ(**values: str):
    """The environment variables set for the duration of a step."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def variants(layers: int, dtype: torch.dtype):
    """(name, model, context or None), or (name, None, why not)."""
    torch.manual_seed(0)
    base = llama(layers, dtype)
    yield "eager", base, None
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)  # both before any step runs
    profuse.fuse(fused)
    profuse.fuse(plain)
    out_of_place(plain)
    yield "fused", fused, None
    yield "fused out-of-place", plain, None
    # The chunk in the card's proportions (the rule's floor of 1024 tokens takes every token here):
    # C = H, the rule until 2026-12-07, and C = H / 2, the rule since.
    yield "fused chunk=256 (C = H)", fused, environ(PROFUSE_CE_CHUNK="256")
    yield "fused chunk=128 (C = H / 2)", fused, environ(PROFUSE_CE_CHUNK="128")
    # The loss's chunk and accumulator, as research/memory_peak.py overrides them on the card:
    # a quarter of the tokens a chunk, the weight's gradient in bf16.
    yield "fused accum=weight chunk=256", fused, environ(PROFUSE_CE_ACCUM="weight", PROFUSE_CE_CHUNK="256")
    try:
        from profuse.models import liger as L

        liger = copy.deepcopy(base)
        ctx = L.patch(liger, "llama")
    except Exception as err:  # no liger-kernel, or its patch fails here
        yield "liger", None, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        return
    yield "liger", liger, ctx


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated variants (default all)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    only = {s for s in args.only.split(",") if s}
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    for name, model, ctx in variants(args.layers, dtype):
        if only and name not in only:
            continue
        if model is None:
            print(f"{name}: not run ({ctx})")
            continue
        try:
            t0 = time.time()
            mode = step_peak(model, ids, ctx)
        except Exception as err:
            print(f"{name}: failed ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})")
            continue
        took = time.time() - t0
        phases = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in mode.phase_peak.items())
        print(f"{name}: peak {mode.peak / 1e6:.2f} MB, in the {mode.peak_phase} ({phases}; {took:.0f} s)")
        for what, n, size in mode.at_peak(args.top):
            print(f"  {size / 1e6:8.3f} MB  {n:3d} x {what}")
        model.zero_grad(set_to_none=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
