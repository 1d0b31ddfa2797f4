"""How profuse.fuse changes a Hugging Face model's modules, and how a fused module decides, at
each call, whether it may run its fused op at a place.

Fusion changes classes, never modules. A module to fuse (a decoder layer, the final norm, an
attention, the causal-LM head) gets a subclass made here with profuse's forward, under the same
name, qualname and module as its own class: save_pretrained's `architectures`,
`_no_split_modules` and transformers' registries keyed by class see the class they knew, and
the parameters, submodules, hooks and state_dict stay what they are. unfuse puts the class
back. A class made from a fused one by someone else (FSDP2's `FSDP<cls>`, made when a fused
model is sharded) is rebuilt on the original class the same way, and so is one made from the
original before fusing (a model sharded first).

At each call, a fused module runs its fused op at a place only when the modules it stands in
for there would compute exactly what the op computes: `runs_as(module, cls)`. The module must
still be of the class the probes checked (not replaced, not wrapped by PEFT or anyone), with no
forward of its own (kernelize's hub forward apart: it computes the same op) and no hooks that
would see its inputs or outputs. Otherwise the place calls the module: the unfused math, hooks
and all. Hooks known to pass their inputs through (FSDP2's unshard and reshard, torch's
composable activation checkpointing, transformers' output-capture hooks, which act only when
output_hidden_states or output_attentions is asked) do not count. Global module hooks
(torch.nn.modules.module.register_module_forward_hook, as profuse.profile installs) see the
modules that run, fused or not, and do not count either.

Probes run on float64 stand-ins, in eval mode and in training mode (PROBE_MODES), each pair of
forwards compared from the same RNG state (`seeded`): a module that behaves differently in
training (dropout) passes where the fused forward keeps that behaviour and fails where it would
skip it. `stand_in` builds an instance of a class around stand-in
submodules, with the real module's plain attributes (its config, sizes, flags), without copying
the module itself (an FSDP-sharded module cannot be copied).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable

import torch
from torch import nn

STATE = "_profuse_fusion"  # a fused module's state (what it calls); the decoder stack's record
FUSED_MARK = "_profuse_fused"  # a class attribute of every class made here
ORIGINAL = "_profuse_original"  # the class a fused class was made from

# Hooks that pass a module's inputs and outputs through whatever they are.
_PASS_THROUGH_MODULES = (
    "torch.distributed.fsdp.",  # FSDP2 (torch >= 2.6): unshard, reshard, casts, by tree map
    "torch.distributed._composable.fsdp.",  # FSDP2 (torch 2.5)
    "torch.distributed._composable.checkpoint_activation",
)


def _passes_through(hook: Callable) -> bool:
    fn = getattr(hook, "__func__", hook)
    fn = getattr(fn, "func", fn)  # functools.partial
    module = getattr(fn, "__module__", None) or ""
    if module.startswith(_PASS_THROUGH_MODULES):
        return True
    # transformers' capture hooks: inert unless a collector is active (output_hidden_states, which
    # a fused stack refuses, or output_attentions, which reads attention's own output)
    return module.startswith("transformers.") and getattr(fn, "__qualname__", "").endswith(
        "output_capturing_hook"
    )


def observed(module: nn.Module) -> bool:
    """True when hooks on `module` would see its inputs, outputs or their gradients."""
    for hooks in (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    ):
        for hook in hooks.values():
            if not _passes_through(hook):
                return True
    return False


def runs_as(module, cls: type) -> bool:
    """True when calling `module` runs `cls`'s forward and nothing else: its class is `cls`, it
    has no forward of its own but kernelize's, no accelerate hook, and no hook that observes it."""
    if type(module) is not cls:
        return False
    d = module.__dict__
    if ("forward" in d and "_kernel_repo" not in d) or "_hf_hook" in d:
        return False
    return not observed(module)


def forward_owner(cls: type) -> type:
    """The class in `cls`'s MRO whose own forward a call runs (FSDP<cls> -> cls)."""
    for c in cls.__mro__:
        if "forward" in c.__dict__:
            return c
    return nn.Module


# --------------------------------------------------------------------------------------------
# Fused classes: made, rebased, undone
# --------------------------------------------------------------------------------------------

_FUSED_CLASSES: dict[tuple[type, str], type] = {}
_REBASED: dict[tuple[type, type, type], type] = {}


def fused_class(owner: type, kind: str, forward: Callable, attrs: dict | None = None) -> type:
    """`owner` with `forward` (and class attributes `attrs`), made once per (owner, kind), under
    owner's own names.

    The forward is set after the class is made, so transformers' GradientCheckpointingLayer does
    not wrap it in a checkpoint of its own, and __call__ is nn.Module's (transformers before 5.x
    checkpointed in GradientCheckpointingLayer.__call__). A class made from this one later (FSDP2's
    FSDP<cls>) gets the same forward back after GradientCheckpointingLayer's wrap: the fused
    forward checkpoints itself, with the (x, residual) pair as two tensor arguments."""
    key = (owner, kind)
    cls = _FUSED_CLASSES.get(key)
    if cls is not None:
        return cls
    namespace = {
        "__module__": owner.__module__,
        "__qualname__": owner.__qualname__,
        "__doc__": owner.__doc__,
        FUSED_MARK: True,
        ORIGINAL: owner,
        **(attrs or {}),
    }

    forward = with_signature(forward, owner)

    def __init_subclass__(sub, **kwargs):
        super(cls, sub).__init_subclass__(**kwargs)
        if getattr(sub.__dict__.get("forward"), "__wrapped__", None) is forward:
            sub.forward = forward  # a checkpointing wrap of the fused forward, undone

    namespace["__init_subclass__"] = classmethod(__init_subclass__)
    namespace["__reduce_ex__"] = _refuse_pickle
    namespace["__deepcopy__"] = _deepcopy
    namespace["__copy__"] = _copy
    cls = type(owner.__name__, (owner,), namespace)
    cls.forward = forward
    cls.__call__ = nn.Module.__call__
    _FUSED_CLASSES[key] = cls
    return cls


def with_signature(forward: Callable, owner: type) -> Callable:
    """`forward` (self, *args, **kwargs) as `owner`'s class's forward: the same signature for
    everything that reads it (Trainer's dataset columns and label names, generate's attention
    mask, position ids and logits_to_keep, PEFT, accelerate), the same name and docstring. The
    fused forwards take arguments by position in the order of the original's."""
    signature = inspect.signature(owner.forward)

    def fused_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    fused_forward.__signature__ = signature
    fused_forward.__name__ = "forward"
    fused_forward.__qualname__ = f"{owner.__qualname__}.forward"
    fused_forward.__module__ = owner.__module__
    fused_forward.__doc__ = getattr(owner.forward, "__doc__", None)
    fused_forward._profuse_forward = forward  # what it calls
    return fused_forward


def _refuse_pickle(self, protocol):
    """A fused model does not pickle (torch.save(model)): its classes are made at fuse time."""
    from profuse.errors import UsageError

    raise UsageError(
        f"a model fused by profuse does not pickle ({type(self).__name__} is a class made at fuse time): "
        "save its state_dict() or save_pretrained(), or profuse.unfuse(model) before torch.save(model)"
    )


def _deepcopy(self, memo):
    """copy.deepcopy as Python's default makes it (pickling is refused, copying is not)."""
    import copy

    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__dict__, memo))
    return new


def _copy(self):
    new = type(self).__new__(type(self))
    new.__setstate__(dict(self.__dict__))
    return new


def _rebase(cls: type, old: type, new: type) -> type | None:
    """`cls`, a class made from `old` with `old` among its direct bases and no forward of its
    own, made again from `new`; None when `cls` is not such a class."""
    if old not in cls.__bases__:
        return None
    fwd = cls.__dict__.get("forward")
    if fwd is not None and fwd is not old.forward and getattr(fwd, "__wrapped__", None) is not old.forward:
        return None  # a forward of its own: rebasing would change what it runs
    key = (cls, old, new)
    made = _REBASED.get(key)
    if made is None:
        skip = {"__dict__", "__weakref__", "forward"}
        namespace = {k: v for k, v in cls.__dict__.items() if k not in skip}
        bases = tuple(new if b is old else b for b in cls.__bases__)
        made = _REBASED[key] = type(cls.__name__, bases, namespace)
        _REBASED[(made, new, old)] = cls  # undone, it is the very class it was
    return made


def fused_target(module: nn.Module, owner: type, fused: type) -> type | None:
    """The class `module` takes when fused: `fused`, or its own class rebased on it."""
    cls = type(module)
    return fused if cls is owner else _rebase(cls, owner, fused)


def is_fused(module: nn.Module) -> bool:
    return getattr(type(module), FUSED_MARK, False)


def unfused_class(cls: type) -> type | None:
    """The class a fused module takes back: the original, or its own rebased on the original;
    None when profuse cannot rebuild it (a class derived from the fused one with a forward of
    its own)."""
    if cls.__dict__.get(FUSED_MARK, False):
        return cls.__dict__[ORIGINAL]
    for base in cls.__bases__:
        if base.__dict__.get(FUSED_MARK, False):
            return _rebase(cls, base, base.__dict__[ORIGINAL])
    return None


# --------------------------------------------------------------------------------------------
# Probes: stand-ins, and forwards rebuilt with other names
# --------------------------------------------------------------------------------------------


def stand_in(module: nn.Module, cls: type, children: dict[str, nn.Module], **attrs) -> nn.Module:
    """An instance of `cls` (no __init__) with `module`'s plain attributes, `children` as its
    submodules and no parameters of its own but those `attrs` name; in eval mode."""
    fresh = nn.Module.__new__(cls)
    nn.Module.__init__(fresh)
    internal = set(fresh.__dict__)
    fresh.__dict__.update({k: v for k, v in module.__dict__.items() if k not in internal and k != STATE})
    fresh.__dict__.pop("forward", None)
    for name, child in children.items():
        fresh._modules[name] = child
    for name, value in attrs.items():
        setattr(fresh, name, value)
    return fresh.train(False)


PROBE_MODES = (False, True)  # every probe runs in eval mode, then in training mode


@contextlib.contextmanager
def seeded(seed: int):
    """The global RNG at `seed` inside, as it was outside: a probe's two forwards draw the same
    dropout masks, so behaviour that only training has (dropout, anything stochastic) compares
    equal where the fused forward keeps it, and unequal where it skips it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def innermost(func: Callable) -> Callable:
    """The function under `func`'s decorators (functools.wraps' __wrapped__ chain)."""
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func


def parameter_names(func: Callable) -> list[str]:
    """The innermost function's parameters after self, in order."""
    return list(inspect.signature(innermost(func)).parameters)[1:]


def rebuilt(func: Callable, names: dict[str, str], globals_: dict[str, object]) -> Callable:
    """`func` with the function under its decorators made again: the attribute and global names
    `names` maps renamed in its code, and `globals_` over a copy of its module's globals. Each
    decorator is rebuilt around the new function through its closure cell (the one holding the
    function it wraps). Raises ValueError when a decorator does not hold what it wraps that way,
    or the function does not use every name to rename."""
    chain = []
    while hasattr(func, "__wrapped__"):
        inner = func.__wrapped__
        cells = [i for i, c in enumerate(func.__closure__ or ()) if _cell(c) is inner]
        if not isinstance(func, types.FunctionType) or len(cells) != 1:
            raise ValueError(
                f"its decorator {func.__qualname__} holds the forward in a way profuse cannot rebuild"
            )
        chain.append((func, cells[0]))
        func = inner
    if not isinstance(func, types.FunctionType):
        raise ValueError(f"its forward is a {type(func).__name__}, not a function")
    code = func.__code__
    missing = sorted((set(names) | set(globals_)) - set(code.co_names))
    if missing:
        raise ValueError(f"its forward does not use {', '.join(missing)}")
    code = code.replace(co_names=tuple(names.get(n, n) for n in code.co_names))
    g = dict(func.__globals__)
    g.update(globals_)
    new = _function_like(func, code, g, func.__closure__)
    for wrapper, i in reversed(chain):
        cells = tuple(types.CellType(new) if j == i else c for j, c in enumerate(wrapper.__closure__))
        outer = _function_like(wrapper, wrapper.__code__, wrapper.__globals__, cells)
        outer.__wrapped__ = new
        new = outer
    return new


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _function_like(func: types.FunctionType, code, globals_: dict, closure) -> types.FunctionType:
    new = types.FunctionType(code, globals_, func.__name__, func.__defaults__, closure)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__ = func.__qualname__
    new.__doc__ = func.__doc__
    new.__dict__.update(func.__dict__)
    return new


__all__ = [
    "FUSED_MARK",
    "ORIGINAL",
    "PROBE_MODES",
    "STATE",
    "forward_owner",
    "fused_class",
    "fused_target",
    "innermost",
    "is_fused",
    "observed",
    "parameter_names",
    "rebuilt",
    "runs_as",
    "seeded",
    "stand_in",
    "unfused_class",
]
