"""transformers' experts implementations: which one a card runs fastest, and setting it on a model.

A transformers 5.x mixture-of-experts model computes its experts by the implementation its config
names (`use_experts_implementation`; `model.set_experts_implementation(name)`):

    eager        a loop over the experts hit: per expert, its tokens gathered, two matmuls, the
                 weighted rows index_add-ed back (a host sync per layer to find the experts hit)
    batched_mm   every (token, expert) pair at once: each pair's expert weights gathered, then one
                 bmm; S = tokens x top-k pairs read S / experts times the experts' own weights
    grouped_mm   the pairs sorted by expert, one grouped matmul over them (torch.nn.functional.
                 grouped_mm, or torch._grouped_mm before it), each expert's weights read once

Part C's moe-best variants run the one that is fastest where the step runs, decided from
what torch and the card offer (`best_implementation`), not timed:

    grouped_mm   where torch has a native grouped matmul for the device: on CUDA
                 F.grouped_mm (torch >= 2.10) or torch._grouped_mm on torch >= 2.9 need SM80+,
                 older torch._grouped_mm Hopper (SM90); on a CPU, torch >= 2.9. Its fast kernel is
                 bf16 (bf16 parameters); over fp32 parameters (amp) transformers casts the input to
                 the weights' fp32 and torch runs its fp32 path, still one call a projection.
    batched_mm   otherwise, where its gathered weights are no more than the experts' own (S <=
                 experts: a small batch), one bmm instead of a loop
    eager        otherwise: batched_mm would gather S / experts times the experts' weights (a
                 training step's 8192 tokens x top-8 over 64 experts: 1024 times, terabytes)

transformers' own default is grouped_mm wherever the class supports it, on every card: where
torch has no native kernel its grouped_mm runs a per-expert loop of its own (one host sync).

float64 (the same-math check's reference) is taken by eager and batched_mm only: grouped_mm's
kernels take fp32, bf16 and fp16 (`for_dtype`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

EAGER, BATCHED_MM, GROUPED_MM = "eager", "batched_mm", "grouped_mm"
# The dtypes torch's grouped matmul takes (its CPU and CUDA kernels alike).
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpertsChoice:
    """The experts implementation a step runs, and why that one."""

    implementation: str
    why: str
    default: str = ""  # what transformers builds the model with ('' where not known)

    @property
    def same_as_built(self) -> bool:
        """Whether the model as transformers builds it runs this implementation already."""
        return self.implementation == self.default

    def to_dict(self) -> dict:
        return asdict(self)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def native_grouped_mm(device: torch.device | str) -> str:
    """'' where torch has a native grouped matmul for `device`, else why not (one line)."""
    device = torch.device(device)
    functional = hasattr(torch.nn.functional, "grouped_mm")
    private = hasattr(torch, "_grouped_mm")
    version = ".".join(map(str, _torch_version()))
    if not (functional or private):
        return f"torch {version} has no grouped matmul (torch.nn.functional.grouped_mm, torch._grouped_mm)"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        sm = f"SM{capability[0]}{capability[1]}"
        if functional or _torch_version() >= (2, 9):
            return "" if capability >= (8, 0) else f"torch's grouped matmul needs SM80 or newer, not {sm}"
        return "" if capability[0] == 9 else f"torch {version}'s _grouped_mm runs on SM90 only, not {sm}"
    if device.type == "cpu":
        return "" if _torch_version() >= (2, 9) else f"torch {version}'s _grouped_mm has no CPU kernel"
    return f"profuse does not know torch's grouped matmul on {device.type}"


def best_implementation(
    device: torch.device | str,
    *,
    pairs: int,
    num_experts: int,
    dtype: torch.dtype = torch.float32,
    default: str = "",
) -> ExpertsChoice:
    """The experts implementation fastest on `device` for a step of `pairs` (token, expert) pairs
    a layer over `num_experts` experts, the parameters in `dtype` (module docstring); `default`
    the one transformers builds the model with, recorded beside it."""
    no_grouped = native_grouped_mm(device)
    if not no_grouped:
        kernel = (
            "its bf16 kernel"
            if dtype == torch.bfloat16
            else f"over {str(dtype).removeprefix('torch.')} parameters torch's own path for that dtype"
        )
        return ExpertsChoice(
            GROUPED_MM,
            f"torch's native grouped matmul runs here ({kernel}): one call a projection, each expert's "
            "weights read once",
            default,
        )
    if pairs <= num_experts:
        return ExpertsChoice(
            BATCHED_MM,
            f"{no_grouped}; batched_mm's gathered weights ({pairs} pairs over {num_experts} experts) are "
            "no more than the experts' own: one bmm instead of a loop",
            default,
        )
    return ExpertsChoice(
        EAGER,
        f"{no_grouped}; batched_mm would gather {pairs / num_experts:,.0f} times the experts' weights "
        f"({pairs} pairs over {num_experts} experts): the loop over the experts hit",
        default,
    )


def implementation_of(model: nn.Module) -> str | None:
    """The experts implementation `model`'s config names ('eager' for a dense transformers model;
    None for a model that cannot set one)."""
    if not callable(getattr(model, "set_experts_implementation", None)):
        return None
    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    return impl if isinstance(impl, str) else None


def has_experts(model: nn.Module) -> bool:
    """Whether `model` computes experts through transformers' use_experts_implementation."""
    from profuse.fusion.hf_experts import is_experts

    return implementation_of(model) is not None and any(is_experts(m) for m in model.modules())


def set_implementation(model: nn.Module, implementation: str) -> nn.Module:
    """`model` (in place) running its experts by `implementation` (and every sub-model's)."""
    model.set_experts_implementation(implementation)
    return model


def for_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` (in place), its experts run by an implementation that takes `dtype`: grouped_mm's
    kernels take no float64, so a float64 copy runs transformers' eager loop, the same math."""
    if dtype not in GROUPED_MM_DTYPES and implementation_of(model) == GROUPED_MM:
        set_implementation(model, EAGER)
    return model


__all__ = [
    "BATCHED_MM",
    "EAGER",
    "GROUPED_MM",
    "ExpertsChoice",
    "best_implementation",
    "for_dtype",
    "has_experts",
    "implementation_of",
    "native_grouped_mm",
    "set_implementation",
]
