"""profuse: where does a training step spend its time, and how much does fusing the
memory-bound tail rms_norm(silu(gate) * up + residual) * weight really save?

Public API:
    tail_eager, tail_rms_norm, tail_compiled, tail_triton   the tail's variants
    tail_reference                                          the float64 oracle
    FusedTail                                               an nn.Module around them
    compare, Comparison, Speedup                            the timing harness
    silu_mul, add_rms_norm, rms_norm                        the block's own ops, fused (profuse.blockops)
    rope, qk_norm_rope                                      rotary embedding of q and k, and Qwen3's
                                                            q/k norms with it (profuse.rotary)
    linear_cross_entropy                                    the LM head and its loss, never the whole
                                                            logits (profuse.crossentropy)
    profile                                                 any training step under torch.profiler
    fuse, unfuse, FuseSummary                               fuse a Hugging Face Llama-family model in
                                                            place, and undo it (profuse.fusion.hf)

The fused ops import without triton; called without it, they raise RuntimeError saying how to
install it (their *_eager versions, in the same modules, run anywhere).

The names are loaded on first use (PEP 562): importing torch, scipy and triton takes seconds,
and `profuse --help` or a mistyped flag should not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "Comparison": "profuse.bench.timing",
    "compare": "profuse.bench.timing",
    "Speedup": "profuse.bench.stats",
    "FusedTail": "profuse.tail",
    "tail_compiled": "profuse.tail",
    "tail_eager": "profuse.tail",
    "tail_reference": "profuse.tail",
    "tail_rms_norm": "profuse.tail",
    "tail_triton": "profuse.tail",
    "silu_mul": "profuse.blockops",
    "profile": "profuse.profiling",
    "add_rms_norm": "profuse.blockops",
    "rms_norm": "profuse.blockops",
    "rope": "profuse.rotary",
    "qk_norm_rope": "profuse.rotary",
    "linear_cross_entropy": "profuse.crossentropy",
    "fuse": "profuse.fusion.hf",
    "unfuse": "profuse.fusion.hf",
    "FuseSummary": "profuse.fusion.hf",
}

__all__ = [
    "Comparison",
    "FuseSummary",
    "FusedTail",
    "Speedup",
    "add_rms_norm",
    "compare",
    "fuse",
    "linear_cross_entropy",
    "profile",
    "qk_norm_rope",
    "rms_norm",
    "rope",
    "silu_mul",
    "tail_compiled",
    "tail_eager",
    "tail_reference",
    "tail_rms_norm",
    "tail_triton",
    "unfuse",
]

if TYPE_CHECKING:  # for type checkers and editors: the names as if imported eagerly
    from profuse.bench.stats import Speedup
    from profuse.bench.timing import Comparison, compare
    from profuse.blockops import add_rms_norm, rms_norm, silu_mul
    from profuse.crossentropy import linear_cross_entropy
    from profuse.fusion.hf import FuseSummary, fuse, unfuse
    from profuse.profiling import profile
    from profuse.rotary import qk_norm_rope, rope
    from profuse.tail import FusedTail, tail_compiled, tail_eager, tail_reference, tail_rms_norm, tail_triton


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        # AttributeError, not ImportError: `from profuse import compile` then finds the submodule.
        raise AttributeError(f"module 'profuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
