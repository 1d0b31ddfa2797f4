"""torch's analysis of each of profuse's Triton launches under torch.compile, made once a signature.

Under torch.compile on CUDA profuse's ops are Triton ops whose launches Inductor inlines
(kernels/autotune.py). For every launch torch works out which arguments the kernel reads and
writes by compiling the kernel to TTIR and walking the result, and it does so separately in
functionalization, in Inductor's lowering and in the kernel's IR node, keeping nothing between
them (pytorch/pytorch#193227, open on 2026-08-12, describes it). A fused Llama's 16 layers launch
the same kernels with the same kinds of arguments, so nearly every analysis repeats one already
made: on an H100 compile+fused's first step of Llama-3.2-1B took 12.7-15.5 s longer in
torch.compile than compile's, most of it in AOTAutograd's joint trace and Inductor's lowering
(2026-12-07, `benchmarks/results/h100-2026-12-07-late/`; research/kernel_analysis_time.py
measures the analysis itself).

`install()` wraps torch's analysis function (identify_accessed_tensors; identify_mutated_tensors
in the releases before it) so that a launch of one of profuse's kernels is analysed once per
signature: the kernel, and for each argument its kind (a real, fake or functional tensor, an
Inductor buffer) with a tensor's dtype or any other value itself. The answer is a function of
those alone: the kernel's source is fixed, a pointer's TTIR type is its dtype, and an int's
specialization follows from its value. So the memo changes how often an answer is worked out,
never the answer; each caller gets its own copy. Every other kernel's launch goes to torch as
before. Where torch has neither function, nothing is wrapped.

On a CPU, research/launch_analysis_check.py lets torch build real TTIR (a stand-in driver) for
the launches of every op a fused Llama or Qwen3 step uses, forward and backward: the memo's
answer equals torch's for every one. Off unless PROFUSE_ANALYSIS_MEMO=1: what it saves has not been
measured on a card yet (research/kernel_analysis_time.py measures it, on and off, with the loss
and gradients of the two compiled steps compared), and a patch of torch's internals is on by
default only once it has.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable

# torch's analysis entry points, newest first: the one found is wrapped (the others call it or
# are gone).
ANALYSIS_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
MAX_ENTRIES = 4096  # signatures kept before the memo starts again (a model has a few dozen)
_MARK = "_profuse_memo"


def enabled_by_environment() -> bool:
    return os.environ.get("PROFUSE_ANALYSIS_MEMO", "0") == "1"


def is_profuse_kernel(kernel) -> bool:
    """A JITFunction (or anything wrapping one as `.fn`) whose Python function is profuse's."""
    fn = getattr(kernel, "fn", kernel)
    return str(getattr(fn, "__module__", "") or "").startswith("profuse.")


def _argument(value) -> tuple:
    """What one argument contributes to the kernel's TTIR, with its kind kept apart: a tensor's
    type and dtype (a fake tensor, a real one, an Inductor TensorBox alike), any other value."""
    kind = type(value).__qualname__
    dtype = getattr(value, "dtype", None)
    if dtype is None and callable(getattr(value, "get_dtype", None)):
        try:
            dtype = value.get_dtype()
        except Exception:  # an IR node without one: a key of its own, never shared
            return (kind, "no dtype", id(value))
    if dtype is not None:
        return (kind, str(dtype))
    if isinstance(value, (bool, int, float, str, type(None))):
        return (kind, value)
    return (kind, repr(value))


def signature(args: tuple, kwargs: dict) -> tuple | None:
    """The memo's key for a call of torch's analysis (kernel, kwargs[, tma metadata, ...]), or
    None where the call is not one of profuse's launches or not in a form this reads."""
    if not args or not is_profuse_kernel(args[0]):
        return None
    named = args[1] if len(args) > 1 else kwargs.get("kwargs")
    if not isinstance(named, dict):
        return None
    rest = tuple(repr(a) for a in args[2:])
    rest += tuple(f"{k}={v!r}" for k, v in sorted(kwargs.items()) if k != "kwargs")
    return id(args[0]), tuple(sorted((str(k), _argument(v)) for k, v in named.items())), rest


def memoized(analyse: Callable, max_entries: int = MAX_ENTRIES) -> Callable:
    """`analyse` answering profuse's launches from a memo per signature (a copy each call)."""
    memo: dict = {}
    kernels: dict = {}  # id -> kernel: kept alive, so an id in a key is never reused

    @functools.wraps(analyse)
    def wrapped(*args, **kwargs):
        key = signature(args, kwargs)
        if key is None:
            return analyse(*args, **kwargs)
        if key in memo:
            wrapped.hits += 1
            return copy.deepcopy(memo[key])
        answer = analyse(*args, **kwargs)
        if len(memo) >= max_entries:
            memo.clear()
            kernels.clear()
        memo[key] = copy.deepcopy(answer)
        kernels[key[0]] = args[0]
        wrapped.misses += 1
        return answer

    wrapped.hits = wrapped.misses = 0
    setattr(wrapped, _MARK, True)
    return wrapped


def install(module=None) -> str | None:
    """Wrap torch's analysis function in `module` (torch._higher_order_ops.triton_kernel_wrap)
    once; returns the name wrapped, or None (not turned on, or nothing there to wrap)."""
    if not enabled_by_environment():
        return None
    if module is None:
        try:
            import torch._higher_order_ops.triton_kernel_wrap as module
        except ImportError:  # a torch without user-defined Triton kernels under compile
            return None
    for name in ANALYSIS_NAMES:
        analyse = getattr(module, name, None)
        if callable(analyse):
            if not getattr(analyse, _MARK, False):
                setattr(module, name, memoized(analyse))
            return name
    return None
