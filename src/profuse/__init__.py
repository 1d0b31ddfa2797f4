"""profuse: where does a training step spend its time, and how much does fusing the
memory-bound tail rms_norm(silu(gate) * up + residual) * weight really save?

Public API:
    tail_eager, tail_rms_norm, tail_compiled, tail_triton   the tail's variants
    tail_reference                                          the float64 oracle
    FusedTail                                               an nn.Module around them
    compare, Comparison, Speedup                            the timing harness
    silu_mul, add_rms_norm                                  the block's own ops, fused (profuse.blockops)
"""

__version__ = "0.1.0"

from profuse.bench.stats import Speedup
from profuse.bench.timing import Comparison, compare
from profuse.blockops import add_rms_norm, silu_mul
from profuse.tail import FusedTail, tail_compiled, tail_eager, tail_reference, tail_rms_norm, tail_triton

__all__ = [
    "Comparison",
    "FusedTail",
    "Speedup",
    "add_rms_norm",
    "compare",
    "silu_mul",
    "tail_compiled",
    "tail_eager",
    "tail_reference",
    "tail_rms_norm",
    "tail_triton",
]
