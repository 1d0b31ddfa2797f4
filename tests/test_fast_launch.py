"""The direct launch (kernels/fast_launch.py, autotune.Launch) against a fake compiled kernel.

The fake's parameters are a real triton JITFunction's (the kernel's signature as triton reads
it: constexprs, defaults); its JIT route and its launcher each compute y = x * alpha + SHIFT in
torch, the launcher from the arguments it is handed in the order the fast route hands them.
So a binding that drops, adds or misplaces an argument gives a wrong y, and the tests see it.
Checked: the arguments the launcher gets (both conventions: constexprs kept, triton 3.3 on, or
dropped, 3.2), the specialisation guard (alignment, dtype, scalars: the JIT route, and a new
binding where one can be made), the switches, the hooks, the first-launch check that turns the
fast route off on a disagreement, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import fast_launch as FL  # noqa: E402


def _axpy_kernel(X_ptr, Y_ptr, n_cols, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3):
    pass  # the fake below computes what this kernel would: y = x * alpha + SHIFT


def _axpy_late_kernel(X_ptr, n_cols, alpha, Y_ptr, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3):
    pass  # the same, y after the scalars (as a team launch appends its scratch tensors)


PARAMS = JITFunction(_axpy_kernel).params
LATE_PARAMS = JITFunction(_axpy_late_kernel).params
STREAM = 77


def _axpy(values: dict) -> None:
    n = values["n_cols"]
    values["Y_ptr"][:n] = values["X_ptr"][:n] * values["alpha"] + values["SHIFT"]


class FakeCompiled:
    """A compiled kernel: its launcher records what it is handed and computes from it."""

    n_regs, n_spills = 32, 0

    def __init__(self, kernel, constants: dict):
        self.kernel = kernel
        self.constants = constants  # what the kernel was compiled with (its constexprs)
        self.function = object()
        self.packed_metadata = ("packed", constants["BLOCK"])
        self.wrong = False

    @property
    def run(self):
        return self.launcher

    def launcher(self, g0, g1, g2, stream, function, packed, metadata, enter, leave, *kernel_args):
        self.kernel.fast.append(((g0, g1, g2), stream, function, packed, metadata, enter, leave, kernel_args))
        assert function is self.function and packed is self.packed_metadata
        names = [p.name for p in self.kernel.params if FL.KEEPS_CONSTEXPRS or not p.is_constexpr]
        assert len(kernel_args) == len(names)
        values = {**self.constants, **dict(zip(names, kernel_args, strict=True))}
        # The real launcher skips the constexprs it is handed: they must be the compiled ones.
        assert all(values[k] == v for k, v in self.constants.items())
        if self.wrong:
            values["alpha"] += 1
        _axpy(values)


class FakeKernel:
    """kernel[grid](*args, **meta): the JIT route; compiles (once per specialisation) and runs."""

    __name__ = "_axpy_kernel"

    def __init__(self, params=PARAMS):
        self.params = params
        self.jit, self.fast, self.compiled = [], [], {}
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.jit.append(args)
            values = {p.name: p.default for p in self.params if p.has_default}
            values.update(zip((p.name for p in self.params), args))
            values.update((k, v) for k, v in meta.items() if k in values or k in ("BLOCK",))
            spec = tuple((a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args)
            constants = {p.name: values[p.name] for p in self.params if p.is_constexpr}
            key = (spec, tuple(constants.items()))
            compiled = self.compiled.setdefault(key, FakeCompiled(self, constants))
            _axpy(values)
            return compiled

        return run


@pytest.fixture
def fast(monkeypatch):
    """The fast route on, for CPU tensors (the fake kernel's), with a fixed stream handle."""
    monkeypatch.setattr(A, "_FAST", True)
    monkeypatch.setattr(A, "_FAST_FAILED", False)
    monkeypatch.setattr(FL, "VERIFIED", True)
    monkeypatch.setattr(FL, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(FL, "current_device", lambda: 0)
    monkeypatch.setattr(FL, "stream_getter", lambda: lambda index: STREAM)
    monkeypatch.setattr(A, "capturing", lambda device: False)


def _xy(n=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n + 5, generator=gen).to(dtype), torch.full((n + 5,), float("nan"), dtype=dtype)


def _check(x, y, n, alpha):
    assert FL.same_bits(y[:n], x[:n] * alpha + 3)  # the fake's own arithmetic, in x's dtype


@pytest.mark.parametrize("keeps_constexprs", [True, False], ids=["triton>=3.3", "triton3.2"])
def test_the_bound_launch_hands_the_launcher_what_the_jit_route_would(fast, monkeypatch, keeps_constexprs):
    monkeypatch.setattr(FL, "KEEPS_CONSTEXPRS", keeps_constexprs)
    kernel = FakeKernel()
    launch = A.Launch(kernel, (3,), None, "axpy", BLOCK=64, num_warps=4)
    for call in range(4):
        x, y = _xy(seed=call)
        launch(x, y, 37, 0.5)
        _check(x, y, 37, 0.5)
    # Call 1: the JIT route (and the bind); call 2: the JIT route, then the checked fast launch;
    # calls 3 and 4: the fast route alone.
    assert len(kernel.jit) == 2 and len(kernel.fast) == 3
    grid, stream, function, packed, metadata, enter, leave, kernel_args = kernel.fast[-1]
    assert grid == (3, 1, 1) and stream == STREAM and (metadata, enter, leave) == (None, None, None)
    assert kernel_args[2:] == ((37, 0.5, 64, 3) if keeps_constexprs else (37, 0.5))
    assert kernel_args[0] is x and kernel_args[1] is y
    (b,) = launch.bound.values()
    assert b.checked and (b.grid_0, b.grid_1, b.grid_2) == (3, 1, 1)
    assert b.dtypes == (torch.float32, torch.float32)


def test_a_call_the_binding_does_not_cover_takes_the_jit_route_and_binds_anew(fast):
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    x, y = _xy()
    launch(x, y, 37, 2.0)
    launch(x, y, 37, 2.0)  # checked
    jit = len(kernel.jit)
    # A tensor 4 bytes off a 16-byte boundary: compiled without the divisibility, never bound.
    xs, ys = _xy(41)
    launch(xs[1:], ys[1:], 37, 2.0)
    _check(xs[1:], ys[1:], 37, 2.0)
    assert len(kernel.jit) == jit + 1 and len(launch.bound) == 1
    launch(xs[1:], ys[1:], 37, 2.0)
    assert len(kernel.jit) == jit + 2  # again the JIT route: misaligned calls never go fast
    # Another dtype, another value of a scalar (n == 1 or n % 16 == 0 are other kernels): each
    # the JIT route, then bound beside the first.
    for args in ((*_xy(dtype=torch.float16), 37, 2.0), (*_xy(), 32, 2.0), (*_xy(), 1, 2.0)):
        before = len(kernel.jit)
        launch(*args)
        launch(*args)
        _check(args[0], args[1], args[2], 2.0)
        assert len(kernel.jit) == before + 2
    assert len(launch.bound) == 4
    # The first binding still launches fast, with the first compiled kernel, whatever the float
    # (triton never specialises one: it is an fp32 argument of any value).
    fast_before, jit_before = len(kernel.fast), len(kernel.jit)
    for alpha in (2.0, -0.75):
        x, y = _xy(seed=9)
        launch(x, y, 37, alpha)
        _check(x, y, 37, alpha)
    assert len(kernel.fast) == fast_before + 2 and len(kernel.jit) == jit_before


def test_an_int_that_changes_every_call_ends_the_bindings(fast):
    """Each new int value is a binding with a checked first launch; past MAX_BINDINGS the launch
    keeps the JIT route rather than bind (and check) again on every call."""
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    for n in range(2, 2 + A.MAX_BINDINGS + 3):
        x, y = _xy(seed=n)
        launch(x, y, n, 1.0)
        launch(x, y, n, 1.0)
        _check(x, y, n, 1.0)
    assert launch.bound is None
    jit = len(kernel.jit)
    launch(x, y, 5, 1.0)
    assert len(kernel.jit) == jit + 1


def test_the_switches_keep_every_launch_on_the_jit_route(fast, monkeypatch):
    monkeypatch.setenv("PROFUSE_FAST_LAUNCH", "0")
    assert not FL.enabled_by_environment()
    monkeypatch.delenv("PROFUSE_FAST_LAUNCH")
    assert FL.enabled_by_environment()
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    assert A.set_fast_launch(False) is True and not A.fast_launch_on()
    x, y = _xy()
    for _ in range(3):
        launch(x, y, 37, 1.5)
    assert len(kernel.jit) == 3 and not kernel.fast and not launch.bound
    assert A.set_fast_launch(True) is False and A.fast_launch_on()
    for _ in range(3):
        launch(x, y, 37, 1.5)
    assert len(kernel.jit) == 5 and len(kernel.fast) == 2
    monkeypatch.setattr(FL, "VERIFIED", False)  # a triton version whose launch path was not read
    monkeypatch.setattr(A, "_FAST", False)
    A.set_fast_launch(True)
    assert not A.fast_launch_on()


@pytest.mark.parametrize("copies", ["device", "host"])
def test_a_first_fast_launch_that_disagrees_turns_the_fast_route_off(fast, copies, monkeypatch):
    if copies == "host":  # tensors over the bound: the check's copies are held in host memory
        monkeypatch.setattr(A, "CHECK_ON_DEVICE_BYTES", 0)
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    x, y = _xy()
    launch(x, y, 37, 0.25)
    for compiled in kernel.compiled.values():
        compiled.wrong = True  # the launcher computes with alpha + 1
    x, y = _xy(seed=1)
    with pytest.warns(UserWarning, match="disagreed with triton's JIT route"):
        launch(x, y, 37, 0.25)
    _check(x, y, 37, 0.25)  # the JIT route's answer is the one kept
    assert len(kernel.fast) == 1 and not A.fast_launch_on()
    assert A.set_fast_launch(True) is False and not A.fast_launch_on()  # off for the process
    launch(x, y, 37, 0.25)
    assert len(kernel.fast) == 1 and len(kernel.jit) == 3


@pytest.mark.parametrize("copies", ["device", "host"])
def test_a_first_fast_launch_that_agrees_keeps_the_fast_route(fast, copies, monkeypatch):
    if copies == "host":
        monkeypatch.setattr(A, "CHECK_ON_DEVICE_BYTES", 0)
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    for seed in range(4):
        x, y = _xy(seed=seed)
        launch(x, y, 37, 0.75)
        _check(x, y, 37, 0.75)
    # the JIT route binds, then checks the first fast launch (twice on the JIT route), then fast
    assert len(kernel.jit) == 2 and len(kernel.fast) == 3 and A.fast_launch_on()
    assert all(b.checked for b in launch.bound.values())


def test_a_launcher_that_raises_on_its_first_call_turns_the_fast_route_off(fast):
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    x, y = _xy()
    launch(x, y, 37, 0.25)

    def refuse(*args):
        raise TypeError("function takes 9 positional arguments")

    for b in launch.bound.values():
        b.launcher = refuse
    x, y = _xy(seed=2)
    with pytest.warns(UserWarning, match="failed on its first call"):
        launch(x, y, 37, 0.25)
    _check(x, y, 37, 0.25)
    assert not A.fast_launch_on()


def test_launch_hooks_send_launches_down_the_jit_route(fast, monkeypatch):
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Hooks:
        launch_enter_hook = Chain([])
        launch_exit_hook = Chain([])

    monkeypatch.setattr(FL, "_HOOKS", Hooks)
    assert FL.hooks_idle()
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    x, y = _xy()
    for _ in range(3):
        launch(x, y, 37, 1.0)
    assert len(kernel.fast) == 2
    Hooks.launch_enter_hook = Chain([print])  # a profiler hooked the launches
    assert not FL.hooks_idle()
    launch(x, y, 37, 1.0)
    assert len(kernel.fast) == 2 and len(kernel.jit) == 3
    Hooks.launch_enter_hook, Hooks.launch_exit_hook = None, print  # 3.2-3.4: None or a function
    assert not FL.hooks_idle()
    Hooks.launch_exit_hook = None
    Hooks.add_stages_inspection_hook = print  # 3.7-3.9: enters the kernel's cache key
    assert not FL.hooks_idle()


def test_inside_a_graph_capture_the_first_fast_launch_waits(fast, monkeypatch):
    """Nothing can be compared during a capture: the JIT route runs, and the binding is checked
    on its first fast launch outside one."""
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    x, y = _xy()
    launch(x, y, 37, 1.0)
    monkeypatch.setattr(A, "capturing", lambda device: True)
    launch(x, y, 37, 1.0)
    assert len(kernel.jit) == 2 and not kernel.fast
    monkeypatch.setattr(A, "capturing", lambda device: False)
    launch(x, y, 37, 1.0)
    launch(x, y, 37, 1.0)
    assert len(kernel.jit) == 3 and len(kernel.fast) == 2


def test_what_is_never_bound():
    kernel = FakeKernel()
    x, y = _xy()
    compiled = FakeCompiled(kernel, {"BLOCK": 64, "SHIFT": 3})
    bind = lambda args, c=compiled: FL.bind(kernel, (1,), {"BLOCK": 64}, args, c)
    assert "CUDA" in bind((x, y, 37, 1.0))  # CPU tensors (DEVICE_TYPES is CUDA alone)
    assert "no compiled kernel" in bind((x, y, 37, 1.0), c=None)  # the interpreter


@pytest.mark.parametrize(
    "case", ["bool scalar", "misaligned", "no tensors", "unplaced parameter", "other layout"]
)
def test_bind_refuses_what_it_cannot_place(fast, case):
    kernel = FakeKernel()
    x, y = _xy()
    meta = {"BLOCK": 64}
    compiled = FakeCompiled(kernel, {"BLOCK": 64, "SHIFT": 3})
    first = FL.bind(kernel, (1,), meta, (x, y, 37, 1.0), compiled)
    assert isinstance(first, FL.Bound) and first.layout.tensor_positions == (0, 1)
    layout = None
    call = {
        "bool scalar": (x, y, True, 1.0),
        "misaligned": (x[1:], y, 37, 1.0),
        "no tensors": (1, 2, 37, 1.0),
        "unplaced parameter": (x, y, 37, 1.0),
        "other layout": (x, 37, y, 1.0),
    }[case]
    if case == "unplaced parameter":
        meta = {}  # BLOCK has no default and was not given
    if case == "other layout":
        layout = first.layout
    why = FL.bind(kernel, (1,), meta, call, compiled, layout)
    assert isinstance(why, str)
    assert (why == FL.MISALIGNED) == (case == "misaligned")


def test_tensors_after_scalars_bind_and_launch(fast):
    """A team launch passes its scratch tensors after the scalars: the guard picks tensors and
    scalars by position, and the launcher still gets every argument in the kernel's order."""
    kernel = FakeKernel(LATE_PARAMS)
    launch = A.Launch(kernel, (2,), None, "axpy", BLOCK=64)
    for call in range(3):
        x, y = _xy(seed=call)
        launch(x, 37, 0.5, y)
        _check(x, y, 37, 0.5)
    assert len(kernel.jit) == 2 and len(kernel.fast) == 2
    assert launch.layout.tensor_positions == (0, 3)
    *_, kernel_args = kernel.fast[-1]
    assert kernel_args[1:3] == (37, 0.5) and kernel_args[3] is y


def test_a_launch_that_can_never_bind_stops_trying(fast, monkeypatch):
    """Only a misaligned tensor is worth another bind on a later call; a refusal that holds for
    every call (here: no compiled kernel, as under the interpreter) ends the attempts."""
    calls = []
    real = FL.bind

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(FL, "bind", counting)
    kernel = FakeKernel()
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    xs, ys = _xy(41)
    for _ in range(3):
        launch(xs[1:], ys[1:], 37, 1.0)  # misaligned: tried each time
    assert len(calls) == 3 and launch.bound == {}
    x, y = _xy()
    launch(x, y, 37, 1.0)
    assert len(calls) == 4 and len(launch.bound) == 1
    launch = A.Launch(kernel, (1,), None, "axpy", BLOCK=64)
    launch.run = lambda *args, **meta: None  # the interpreter's launch returns no compiled kernel
    for _ in range(3):
        launch(x, y, 37, 1.0)
    assert len(calls) == 5 and launch.bound is None


def test_same_bits_reads_bits_not_values():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert FL.same_bits(a, a.clone())
    assert not FL.same_bits(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0 and 0 differ in bits
    assert not FL.same_bits(a, a.double())
    b = torch.arange(6, dtype=torch.bfloat16).view(2, 3)[:, 1:]  # a strided view
    assert FL.same_bits(b, b.clone()) and not FL.same_bits(b, b + 1)


def test_the_version_read_and_the_conventions():
    assert FL.VERSION >= (3, 2)
    assert FL.KEEPS_CONSTEXPRS == (FL.VERSION >= (3, 3))
    assert FL.VERIFIED == ((3, 2) <= FL.VERSION <= (3, 9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels' launchers need a GPU")
@pytest.mark.parametrize("op", ["silu_mul", "add_rms_norm", "tail"])
def test_on_a_gpu_real_ops_launch_directly_and_agree_with_the_jit_route(op, monkeypatch):
    """The real launchers: after the first calls every launch of the op's plans is bound and
    checked, a later call launches directly (the JIT route is not entered), and its outputs and
    gradients are the JIT route's bits."""
    from profuse import blockops as B
    from profuse import tail as T
    from profuse.kernels import add_rms_norm as ARN
    from profuse.kernels import swiglu as S
    from profuse.kernels.tail import plans as P

    if not A.fast_launch_on():
        pytest.skip("the direct launch is off in this process (PROFUSE_FAST_LAUNCH=0)")
    dev, bf = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(11)
    rnd = lambda *s, dtype=bf: torch.randn(*s, device=dev, dtype=dtype, generator=gen).requires_grad_()
    rows, n = 37, 1000
    if op == "silu_mul":
        fn, args, grads, module = B.silu_mul, (rnd(rows, 2 * n),), (rnd(rows, n).detach(),), S
    elif op == "add_rms_norm":
        fn = lambda *a: B.add_rms_norm(*a, 1e-6)
        args = (rnd(rows, n), rnd(rows, n, dtype=torch.float32), rnd(n, dtype=torch.float32))
        grads, module = (rnd(rows, n).detach(), rnd(rows, n, dtype=torch.float32).detach()), ARN
    else:
        fn = lambda *a: T.tail_triton(*a, 1e-6)
        args, grads, module = tuple(rnd(rows, n) for _ in range(3)) + (rnd(n),), (rnd(rows, n).detach(),), P

    for plans in ("_FWD_PLANS", "_BWD_PLANS"):  # this test's plans alone
        monkeypatch.setattr(module, plans, A.PlanCache())

    def run():
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        return [t.detach() for t in (*out, *torch.autograd.grad(out, args, grads))]

    for _ in range(3):
        run()
    launches = []
    for plans in (module._FWD_PLANS, module._BWD_PLANS):
        for plan in plans.values():
            for launch in (plan, getattr(plan, "main", None), getattr(plan, "col_sum", None)):
                if isinstance(launch, A.Launch):
                    launches.append(launch)
    checked = [launch.bound and any(b.checked for b in launch.bound.values()) for launch in launches]
    assert launches and all(checked)
    entered = []
    for launch in launches:
        real = launch.run
        launch.run = lambda *a, real=real, **k: entered.append(1) or real(*a, **k)
    direct = run()
    assert not entered, "a launch took the JIT route after its binding was checked"
    A.set_fast_launch(False)
    try:
        jit = run()
    finally:
        A.set_fast_launch(True)
    assert entered and all(FL.same_bits(a, b) for a, b in zip(direct, jit, strict=True))
