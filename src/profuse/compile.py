"""Every torch.compile setting profuse uses, in one place, each with its reason."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

# Part B compiles one function per shape: the lab's question is what Inductor makes of a fixed
# shape, so no dynamic shapes (they trade specialisation for fewer recompiles).
DYNAMIC = False

# A sweep compiles the tail once per size. Dynamo's default of 8 cached graphs per function
# would silently fall back to eager after the 8th size; sweeps also reset Dynamo per size.
RECOMPILE_LIMIT = 64

MODES = {
    "default": None,
    # Autotunes Inductor's reduction configs; no CUDA graphs, so timings stay comparable with
    # the other variants (graphs would hide launch overhead).
    "max-autotune": "max-autotune-no-cudagraphs",
}


def _configure() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))


def compile_fn(fn: Callable, mode: str = "default", fullgraph: bool = True) -> Callable:
    """torch.compile with profuse's settings. `mode` is a key of MODES."""
    _configure()
    return torch.compile(fn, mode=MODES[mode], dynamic=DYNAMIC, fullgraph=fullgraph)


def compile_model(model: torch.nn.Module, *, cudagraphs: bool = False) -> torch.nn.Module:
    """The whole training model (Part A's --compile-step): default mode, graph breaks allowed.
    `cudagraphs`: mode "reduce-overhead", the compiled forward and backward replayed as CUDA
    graphs (Part C's variant for launch-bound steps: a replay costs one launch, not hundreds)."""
    _configure()
    return torch.compile(model, mode="reduce-overhead" if cudagraphs else None)


def reset() -> None:
    """Forget compiled graphs (a sweep calls this between sizes)."""
    torch._dynamo.reset()


@contextlib.contextmanager
def no_recompiles():
    """Inside, a recompile raises instead of quietly timing the compiler."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
