"""Liger-Kernel's patch of a Hugging Face model, applied as its users apply it, kept to one model.

`liger_kernel.transformers.apply_liger_kernel_to_<arch>(model=...)` does two things: on the built
model it rebinds instance forwards (each RMSNorm's, each MLP's; with fused linear cross-entropy,
the CausalLM's forward), and in the transformers modeling module it assigns globals that every
model of the family then uses (`apply_rotary_pos_emb = liger_rotary_pos_emb`, the RMSNorm and
MLP classes). A referee that runs eager and Liger side by side in one process cannot leave those
globals set: the eager step would run Liger's RoPE. `patch` applies Liger to one model, puts the
module's globals back as they were, and returns a context that sets Liger's globals for the
duration of that model's step only (a few setattrs a step).

Two ways of applying it, as Part C's variants:

    liger       Liger's defaults: RoPE, RMSNorm, SwiGLU and fused linear cross-entropy. The last
                replaces the CausalLM forward, and in training with labels it computes the loss
                from the last hidden state without materialising the logits.
    liger-ops   RMSNorm and SwiGLU alone (rope, cross-entropy and fused linear cross-entropy
                off): the ops profuse's fused variant fuses, op for op.

Both train on the model's own loss, `model(input_ids, labels=...).loss` (ModelSpec.loss), as
every other variant does: the loss a Hugging Face training loop computes.

A mixture of experts takes the family's own patch too, found by the same name: liger-kernel 0.8.5
has one for qwen3_moe and mixtral (on transformers 5 their experts' forward becomes LigerExperts',
Liger's fused MoE op: the tokens gathered by expert, gate_up, SiLU-mul and down, and the weighted
combine, in its own Triton kernels; its CausalLM forward adds the router's aux loss to the fused
linear cross-entropy's loss) and for gpt_oss (its clamped experts left as transformers computes
them: Liger's SwiGLU is off for it); none for olmoe, whose liger variants are refused in one
line (`no_patch`). With swiglu on, the whole experts computation is Liger's, so for an MoE
liger-ops is not op for op with profuse's fused, which fuses the activation alone.

liger-kernel is optional and runs on CUDA only (Triton GPU kernels).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

# Found without importing it: liger-kernel loads Triton and transformers, which a run that never
# asks for Liger should not pay for. Imported on first use (`_liger`).
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
liger_transformers = None

LIGER_NEEDS = "needs CUDA and liger-kernel"
LIGER_MISSING = "liger-kernel is not installed: pip install liger-kernel"

# liger-ops: the ops profuse fuses, and nothing else Liger's default patches.
OPS_ONLY = dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True)

_ABSENT = object()


def unavailable(device: torch.device, family: str) -> str:
    """Why Liger cannot run a `family` model on `device` ('' where it can)."""
    if family == "gpt":
        return "Liger-Kernel patches Hugging Face models, not the built-in GPT: use --model hf:ARCH"
    if torch.device(device).type != "cuda":
        return f"{LIGER_NEEDS}; this run is on the CPU"
    if not HAS_LIGER:
        return f"{LIGER_NEEDS}; {LIGER_MISSING}"
    try:
        _liger()
    except Exception as err:  # a build that fails to load here
        return f"{LIGER_NEEDS}: liger_kernel.transformers does not load ({type(err).__name__}: {err})".split(
            "\n"
        )[0]
    return no_patch(family)


def no_patch(family: str) -> str:
    """'' where the installed liger-kernel has a patch for `family`, else why not in one line naming
    the family (liger-kernel 0.8.5 patches qwen3_moe, mixtral and gpt_oss, not olmoe)."""
    if hasattr(_liger(), f"apply_liger_kernel_to_{family}"):
        return ""
    return (
        f"liger-kernel {_version()} has no patch for {family} (no apply_liger_kernel_to_{family}): "
        "nothing of Liger's to compare with"
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return "(version unknown)"


def _liger():
    """liger_kernel.transformers, imported the first time it is needed."""
    global liger_transformers
    if liger_transformers is None:
        import liger_kernel.transformers

        liger_transformers = liger_kernel.transformers
    return liger_transformers


@dataclass
class ModuleGlobals:
    """Globals of a module to set while one model runs, and what they were (reusable context)."""

    module: ModuleType
    patched: dict[str, object] = field(default_factory=dict)
    original: dict[str, object] = field(default_factory=dict)  # _ABSENT where there was none

    def _set(self, values: dict[str, object]) -> None:
        for name, value in values.items():
            if value is _ABSENT:
                delattr(self.module, name)
            else:
                setattr(self.module, name, value)

    def __enter__(self) -> ModuleGlobals:
        self._set(self.patched)
        return self

    def __exit__(self, *exc) -> None:
        self._set(self.original)


def modeling_module(family: str, model: nn.Module | None = None) -> ModuleType:
    """The module whose globals Liger's patch for `family` changes: the model's own class's
    (gemma3_text's classes live in transformers.models.gemma3), else the family's by name."""
    if model is not None and type(model).__module__.startswith("transformers.models."):
        return importlib.import_module(type(model).__module__)
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _ops_only(apply) -> dict:
    """OPS_ONLY as `apply` takes it: a family whose MLP is GeGLU names its switch geglu."""
    params = inspect.signature(apply).parameters
    out = {k: v for k, v in OPS_ONLY.items() if k in params}
    if "swiglu" not in params and "geglu" in params:
        out["geglu"] = OPS_ONLY["swiglu"]
    return out


def patch(model: nn.Module, family: str, *, ops_only: bool = False) -> ModuleGlobals:
    """Apply Liger to the built `model` (in place) as its users do; the family's modeling module
    is left as it was, and the returned context sets Liger's globals for `model`'s step."""
    apply = getattr(_liger(), f"apply_liger_kernel_to_{family}")
    module = modeling_module(family, model)
    before = dict(vars(module))
    try:
        apply(model=model, **(_ops_only(apply) if ops_only else {}))
    finally:
        after = dict(vars(module))
        names = after.keys() | before.keys()
        changed = {k for k in names if after.get(k, _ABSENT) is not before.get(k, _ABSENT)}
        globals_ = ModuleGlobals(
            module,
            {k: after.get(k, _ABSENT) for k in changed},
            {k: before.get(k, _ABSENT) for k in changed},
        )
        globals_.__exit__()
    return globals_
