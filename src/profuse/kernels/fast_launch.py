"""A bound kernel's launch straight through its compiled launcher, not JITFunction.run.

`kernel[grid](*args, **meta)` goes through triton's JITFunction.run on every call: it reads the
current device and stream, binds the arguments to the kernel's parameters, specialises each one
(its type; an int's equality to 1, divisibility by 16 and width; a tensor's dtype and the 16-byte
alignment of its data_ptr), builds the cache key (in 3.5-3.9 with `str(options)` each call),
looks the compiled kernel up, checks the kernel's globals, builds the launch metadata (3.5-3.9:
a dict each call, since the launch hooks are HookChain objects that are never None) and calls
the compiled kernel's launcher, which calls the two hook chains back into Python. A CPU profile
of the fused d_model 1024 step put 9.5% of the step in that route (64 launches a step).

Once a launch through that route has returned its CompiledKernel, `bind` records what the
launch assumed, and `Bound.launch(args)` calls the same launcher with the arguments
JITFunction.run would have passed it, read in the wheels of triton 3.2.0, 3.3.1, 3.4.0, 3.5.1,
3.6.0, 3.7.1, 3.8.0 and 3.9.0 (runtime/jit.py, compiler/compiler.py, backends/nvidia/driver.py):

    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *kernel_args)

- kernel_args: every parameter's value in the kernel's order, constexprs included (the
  launcher skips them), in 3.3-3.9; only the non-constexpr ones in 3.2.
- launch_metadata and the hooks: None here, which the launcher reads as "no hook" (its C code
  tests each against Py_None). The fast route runs only while the hooks are idle: None (3.2-3.4:
  CompiledKernel's class attributes, then knobs.runtime's) or empty HookChains (3.5-3.9), and no
  add_stages_inspection_hook (3.7-3.9, which enters the cache key); otherwise the JIT route runs,
  so a profiler that hooks launches (proton) sees every launch.
- `compiled.run` is the launcher object, made on the first launch (CompiledKernel._init_handles:
  the module loaded, the function handle, the launcher compiled); in 3.2-3.4 an attribute read
  through a __getattribute__ override, so it is read once, at the bind. From 3.3 the launcher
  object allocates the kernel's global (and 3.6-3.9 profile) scratch itself, per call, as the
  JIT route does.
- the stream: triton's `driver.active.get_current_stream(index)` (torch's current raw stream)
  for the device of the tensors, which is the current device at the bind.

What a bound launch assumes of a call, checked per call (else the JIT route runs, and binds
anew): the int arguments equal those bound (that covers every int specialisation: == 1, % 16,
i32/i64/u64), the tensors' dtypes equal those bound, every tensor's data_ptr 16-byte aligned (a
launch is bound only where all were, so all were specialised as divisible by 16), the hooks
idle. A float argument may take any value (triton passes every float as fp32, unspecialised);
an int where a float was bound is converted by the launcher, as the value it is. Assumed for the
process, not checked per call: triton's compile options from the environment (TRITON_DEBUG,
instrumentation) unchanged since the bind; the kernel's non-constexpr globals unchanged
(profuse's kernels read constexpr globals only); no pre-run hooks on the kernel (checked at the
bind); Python bools never passed at run time (profuse passes flags as constexprs; a bool
compares equal to 0 or 1).

The JIT route stays for a launch's first call, under the interpreter (TRITON_INTERPRET=1: no
CompiledKernel comes back), under torch.compile (autotune.Launch records the launch through
wrap_triton instead), for triton versions not read above, where PROFUSE_FAST_LAUNCH=0, and for
calls the guard above turns away. `autotune.Launch` verifies each bound launch once against the
JIT route's answer (`same_bits`) before trusting it. research/launch_route.py runs both routes
through each of the eight versions' own code on a CPU (a stand-in driver; triton compiles for
sm_90 offline): every launch of silu_mul, add_rms_norm and the tail hands the launcher the same
arguments on both (2026-12-05).
"""

from __future__ import annotations

import functools
import operator
import os
import re

import torch
import triton

# triton's version as (major, minor); "3.6.0+git1234" reads as (3, 6).
VERSION = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
# The versions whose JITFunction.run and launchers were read (see the module's docstring).
VERIFIED = (3, 2) <= VERSION <= (3, 9)
# Whether JITFunction.run hands the launcher the constexprs' values too (3.3 on) or not (3.2).
KEEPS_CONSTEXPRS = VERSION >= (3, 3)

# Where the launch hooks live: CompiledKernel's class attributes before 3.4, knobs.runtime after.
if VERSION < (3, 4):
    from triton.compiler import CompiledKernel as _HOOKS
else:
    from triton import knobs

    _HOOKS = knobs.runtime


def enabled_by_environment() -> bool:
    """PROFUSE_FAST_LAUNCH=0 keeps every launch on triton's JIT route."""
    return os.environ.get("PROFUSE_FAST_LAUNCH", "1") != "0"


def hooks_idle() -> bool:
    """No launch hook is set (None, or an empty HookChain) and no pipeline hook changes the
    kernel's cache key: a launch needs no launch metadata and no call back into Python."""
    h = _HOOKS
    enter, leave = h.launch_enter_hook, h.launch_exit_hook
    # getattr(x, "calls", x): a HookChain's list of hooks; None, or a hook function, itself.
    return (
        not getattr(enter, "calls", enter)
        and not getattr(leave, "calls", leave)
        and getattr(h, "add_stages_inspection_hook", None) is None
    )


# Where a bound launch may run: CUDA tensors (the tests widen it to run a fake kernel on CPU).
DEVICE_TYPES = ("cuda",)


def current_device() -> int:
    """The device JITFunction.run compiles and launches for: triton's current device."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device()


@functools.cache
def stream_getter():
    """index -> the raw handle of device `index`'s current stream, as JITFunction.run reads it
    (triton's driver.active.get_current_stream: torch's _cuda_getCurrentRawStream)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream


def picker(positions: tuple[int, ...]):
    """args -> the tuple of args at `positions`, in C (operator.itemgetter) where it can."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class Layout:
    """Where a launch's runtime arguments hold tensors and where ints: `tensors(args)` and
    `ints(args)` pick them (profuse's launchers pass tensors, then ints and floats, and a team
    launch its scratch tensors last). Floats are neither: triton never specialises a float (it
    is an fp32 argument whatever its value), so a binding holds for any value of one."""

    __slots__ = ("tensor_positions", "int_positions", "tensors", "ints")

    def __init__(self, tensor_positions: tuple[int, ...], int_positions: tuple[int, ...]):
        self.tensor_positions = tensor_positions
        self.int_positions = int_positions
        self.tensors = picker(tensor_positions)
        self.ints = picker(int_positions)


class Bound:
    """One compiled kernel's launch, bound: its launcher, function handle and packed metadata,
    the grid, the compile-time arguments appended to each call's runtime ones, and the dtypes of
    the tensors it was bound with (autotune.Launch finds a binding by the call's ints and
    dtypes, then checks the alignment). `checked` once a launch through it was compared with
    the JIT route's (autotune.Launch does it)."""

    __slots__ = ("compiled", "launcher", "function", "packed", "grid_0", "grid_1", "grid_2", "stream",
                 "device", "layout", "dtypes", "tail", "checked")  # fmt: skip

    def __init__(self, compiled, grid, device: int, layout: Layout, dtypes: tuple, tail: tuple):
        self.compiled = compiled
        self.launcher = compiled.run  # made on the first launch; read once (a getattr override in 3.2-3.4)
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.grid_0, self.grid_1, self.grid_2 = grid
        self.stream = stream_getter()  # device index -> its current stream's raw handle
        self.device = device
        self.layout = layout
        self.dtypes = dtypes
        self.tail = tail  # the parameters after the runtime arguments: values as bound
        self.checked = False

    def launch(self, args: tuple) -> None:
        """The launch JITFunction.run would make for `args`, made directly (autotune.Launch
        makes the same call inline on its hot path)."""
        self.launcher(self.grid_0, self.grid_1, self.grid_2, self.stream(self.device), self.function,
                      self.packed, None, None, None, *args, *self.tail)  # fmt: skip


# Why `bind` made no binding: only a misaligned tensor is worth binding again for (another call
# of the same launch may be aligned); the rest hold for every call of the launch.
MISALIGNED = "a tensor argument not 16-byte aligned"


def bind(kernel, grid: tuple, meta: dict, args: tuple, compiled, layout: Layout | None = None) -> Bound | str:
    """A Bound for launches like this one, which JITFunction.run has just made (`compiled`: what
    it returned), or why the fast route cannot hold: a version not read, no CompiledKernel (the
    interpreter; an asynchronous compile), pre-run hooks, a runtime argument neither a tensor
    nor an int or float, a tensor not 16-byte aligned or not on the current device, a keyword it
    cannot place, or (given `layout`, the launch's first binding's) tensors in other places."""
    if not VERIFIED:
        return "a triton version whose launch path was not read"
    if compiled is None or hasattr(compiled, "result"):
        return "no compiled kernel (the interpreter, or a compile still running)"
    if not all(hasattr(compiled, a) for a in ("function", "packed_metadata")):
        return "not a CompiledKernel"
    if getattr(kernel, "pre_run_hooks", None):
        return "pre-run hooks"
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    ints = tuple(i for i, a in enumerate(args) if type(a) is int)
    if not positions or len(positions) + len(ints) + sum(type(a) is float for a in args) != len(args):
        return "a runtime argument neither a tensor nor an int or float"
    if layout is not None and (positions, ints) != (layout.tensor_positions, layout.int_positions):
        return "tensors or ints where the launch's first binding had other arguments"
    tensors = [args[i] for i in positions]
    device = tensors[0].device
    if device.type not in DEVICE_TYPES or any(t.device != device for t in tensors):
        return "tensors not on one CUDA device"
    if any(t.data_ptr() % 16 for t in tensors):
        return MISALIGNED
    index = current_device()
    if device.type == "cuda" and device.index != index:
        return "tensors not on the current device"
    params = kernel.params
    if len(args) > len(params):
        return "more arguments than parameters"
    if not KEEPS_CONSTEXPRS and any(p.is_constexpr for p in params[: len(args)]):
        return "a constexpr passed by position (triton 3.2 drops them)"
    tail = []
    for p in params[len(args) :]:
        if p.name in meta:
            value = meta[p.name]
        elif p.has_default:
            value = p.default
        else:
            return f"no value for parameter {p.name}"
        if KEEPS_CONSTEXPRS or not p.is_constexpr:
            tail.append(value)
    g = (*grid, 1, 1)[:3]
    layout = layout or Layout(positions, ints)
    return Bound(compiled, g, index, layout, tuple(t.dtype for t in tensors), tuple(tail))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two tensors of one shape and dtype hold the same bits (NaN payloads and all)?"""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = _INT_OF_SIZE.get(a.element_size())
    if as_int is None or a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(as_int), b.view(as_int))
