"""Byte models of the tail and the device-to-device copy ceiling they are measured against.

Every model counts whole (rows x cols) tensors moved through device memory, each read or write
once; the per-row rstd and the (cols,) weight are under 0.1% at the lab's sizes and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from profuse.timers import CudaTimer

# Fused forward: read gate, up, residual; write the output.
FUSED_FORWARD_TENSORS = 4
# Fused forward + backward: the forward's 4, then the backward reads gate, up, residual and dy
# and writes dgate, dup and dresidual (h, silu and sigmoid are recomputed, never stored).
FUSED_BACKWARD_TENSORS = 7
FUSED_FWD_BWD_TENSORS = FUSED_FORWARD_TENSORS + FUSED_BACKWARD_TENSORS

# Eager, written out one op at a time; each op reads its inputs and writes its output:
#   silu(g)          read g,        write s    2
#   s * u            read s, u,     write p    3
#   p + r            read p, r,     write h    3
#   h.pow(2)         read h,        write h2   2
#   h2.mean(-1)      read h2                   1  (writes one value per row)
#   h * rstd         read h,        write n    2
#   n * w            read n,        write y    2
EAGER_FORWARD_TENSORS = 15


@dataclass(frozen=True)
class TailTraffic:
    rows: int
    cols: int
    itemsize: int

    @property
    def tensor_bytes(self) -> int:
        return self.rows * self.cols * self.itemsize

    def bytes_for(self, tensors: int) -> int:
        return tensors * self.tensor_bytes

    @property
    def fused_forward(self) -> int:
        return self.bytes_for(FUSED_FORWARD_TENSORS)

    @property
    def eager_forward(self) -> int:
        return self.bytes_for(EAGER_FORWARD_TENSORS)

    @property
    def fused_fwd_bwd(self) -> int:
        return self.bytes_for(FUSED_FWD_BWD_TENSORS)

    def to_dict(self) -> dict:
        return {
            "tensor_bytes": self.tensor_bytes,
            "fused_forward_bytes": self.fused_forward,
            "eager_forward_bytes": self.eager_forward,
            "fused_fwd_bwd_bytes": self.fused_fwd_bwd,
        }


def copy_ceiling(device: torch.device, nbytes: int | None = None, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy (bytes read + bytes written), median of runs.

    The buffer is 8x the L2 (at least 256 MB), so the copy streams from device memory.
    """
    if device.type != "cuda":
        raise ValueError("the copy ceiling is measured on CUDA devices only")
    timer = CudaTimer(device, flush_l2=False)
    if nbytes is None:
        nbytes = max(256 * 2**20, 8 * int(torch.cuda.get_device_properties(device).L2_cache_size or 0))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = sorted(timer.time_calls([lambda: dst.copy_(src)] * repeats))
    median = times[len(times) // 2]
    return 2 * nbytes / median
