"""Triton's JIT route against profuse's direct launch, run on a CPU with any installed triton.

A stand-in driver (triton.runtime.driver.set_active) lets triton do everything but touch a GPU:
it compiles profuse's kernels for real (sm_90, ptxas runs offline), JITFunction.run runs every
line of its own, and the compiled kernel's launcher, made by the driver, is a stand-in that
records what it is handed and runs nothing. CPU tensors stand in for CUDA ones (profuse's check
that a device can run Triton is switched off, its direct launch is let bind CPU tensors, and its
scratch is kept as on CUDA, per plan). So, for the triton on the path:

  --check    every launch of silu_mul (pair and packed), add_rms_norm and the tail, forward and
             backward, hands the launcher the same arguments on the direct route as on the JIT
             route (tensors by dtype, shape and strides, scalars and constexprs by value), the
             launch metadata and hooks apart: None on the direct route, and on the JIT route
             None (3.2-3.4) or a dict and two empty hook chains (3.5-3.9);
  (default)  per call: Python calls, op events, and with --callgrind instructions, of eager, the
             JIT route (PROFUSE_FAST_LAUNCH off) and the direct route, each op forward without
             grad, forward, and forward + backward (as research/host_wiring.py counts them).

What it leaves out, as host_wiring.py's stand-in does: the launcher's own C (argument parsing,
each pointer's data_ptr, cuLaunchKernel), which both routes pay alike; the CUDA allocator; the
autograd engine's device thread.

    PYTHONPATH=src python research/launch_route.py --check
    PYTHONPATH=src python research/launch_route.py --callgrind --json research/launch_route-3.9.json
    PYTHONPATH=/tmp/site-3.6.0:src python research/launch_route.py --check   # triton 3.6, unzipped
    PYTHONPATH=/tmp/before/src:/tmp/site-3.6.0 python research/launch_route.py --callgrind  # a tree before
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The kernels must be JITFunctions, not the interpreter's: profuse's kernel modules read the
# switch when they are imported (host_wiring.py, imported for its counters, would turn it on).
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns where it is unset

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import host_wiring as HW  # noqa: E402

from profuse import blockops, tail  # noqa: E402
from profuse.kernels import add_rms_norm as ARN  # noqa: E402
from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import swiglu as S  # noqa: E402
from profuse.kernels.tail import plans as P  # noqa: E402

try:  # the direct launch: absent from a tree before it
    from profuse.kernels import fast_launch as FL
except ImportError:
    FL = None

VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
RECORD: list | None = None  # set to a list to record each launcher call's arguments


class StandInLauncher:
    """The compiled kernel's launcher: records what it is handed, launches nothing."""

    def __init__(self, src, metadata):
        self.name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")

    def __call__(self, *args):
        if RECORD is not None:
            RECORD.append((self.name, args))


class StandInUtils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills[, max threads]): 3.4 on return five
        return (1, 2, 32, 0, 1024) if VERSION >= (3, 4) else (1, 2, 32, 0)

    def unload_module(self, module):
        pass


class StandInDriver:
    """What JITFunction.run and CompiledKernel ask of the active driver, for an H100/H200."""

    def __init__(self):
        self.utils = StandInUtils()
        self.launcher_cls = StandInLauncher

    def get_current_device(self):
        return 0

    def get_current_stream(self, index):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


def install() -> None:
    """The stand-in driver, and profuse let run its launchers on CPU tensors as on CUDA ones."""
    driver.set_active(StandInDriver())
    for module in (S, ARN, P):
        module.check_runnable = lambda device, op: None
    if FL is not None:
        FL.DEVICE_TYPES = ("cuda", "cpu")
    if hasattr(A, "scratch_key"):  # scratch kept per plan, as on CUDA (one stream)
        for module in (ARN, P):
            module.scratch_key = lambda device: 0  # one stream; nothing here is traced


def set_route(direct: bool) -> None:
    if hasattr(A, "set_fast_launch"):
        A.set_fast_launch(direct)


EPS = 1e-6
BF16, FP32 = torch.bfloat16, torch.float32


def cases(rows: int = 4, cols: int = 64):
    """(op, fn, args, grads): the ops as benchmarks/host_overhead.py calls them (bf16
    activations; add_rms_norm's residual stream and weight fp32)."""
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape, dtype=BF16: torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
    g, u = rnd(rows, cols), rnd(rows, cols)
    gu = rnd(rows, 2 * cols)
    x, r, w = rnd(rows, cols), rnd(rows, cols, dtype=FP32), rnd(cols, dtype=FP32)
    tg, tu, tr, tw = rnd(rows, cols), rnd(rows, cols), rnd(rows, cols), rnd(cols)
    dy, dh = torch.randn(rows, cols, generator=gen).to(BF16), torch.randn(rows, cols, generator=gen)
    return {
        "silu_mul pair": (blockops.silu_mul, (g, u), (dy,)),
        "silu_mul packed": (blockops.silu_mul, (gu,), (dy,)),
        "add_rms_norm": (lambda *a: blockops.add_rms_norm(*a, EPS), (x, r, w), (dy, dh)),
        "tail": (lambda *a: tail.tail_triton(*a, EPS), (tg, tu, tr, tw), (dy,)),
    }


EAGER = {
    "silu_mul pair": blockops.silu_mul_eager,
    "silu_mul packed": blockops.silu_mul_eager,
    "add_rms_norm": lambda *a: blockops.add_rms_norm_eager(*a, EPS),
    "tail": lambda *a: tail.tail_rms_norm(*a, EPS),
}


def calls(fn, args, grads) -> dict:
    def fwd():
        fn(*args)

    def fwd_bwd():
        out = fn(*args)
        torch.autograd.grad(out if isinstance(out, tuple) else (out,), args, grads)

    return {"fwd_nograd": fwd, "fwd": fwd, "fwd_bwd": fwd_bwd}


def warm(call, mode: str) -> None:
    with HW.grad_mode(mode):
        for _ in range(3):
            call()


def shape_of(a):
    """A launcher argument as compared between the routes: a tensor by dtype, shape, strides."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, tuple(a.shape), a.stride())
    return a


def recorded(call, mode: str) -> list:
    global RECORD
    RECORD = []
    try:
        with HW.grad_mode(mode):
            call()
        return RECORD
    finally:
        RECORD = None


def check() -> list[str]:
    """Each launch's arguments on both routes, compared; returns the mismatches (none wanted)."""
    problems, launches = [], 0
    for op, (fn, args, grads) in cases().items():
        for mode, call in calls(fn, args, grads).items():
            set_route(True)
            warm(call, mode)  # plans made, launches bound and checked
            direct = recorded(call, mode)
            set_route(False)
            jit = recorded(call, mode)
            set_route(True)
            if len(direct) != len(jit):
                problems.append(f"{op} {mode}: {len(direct)} launches direct, {len(jit)} on the JIT route")
                continue
            for (name, d), (name_j, j) in zip(direct, jit, strict=True):
                launches += 1
                # (grid x3, stream, function, packed metadata, launch metadata, enter, exit, args...)
                d_key = [shape_of(a) for a in (*d[:6], *d[9:])]
                j_key = [shape_of(a) for a in (*j[:6], *j[9:])]
                if name != name_j or d_key != j_key:
                    problems.append(f"{op} {mode} {name}: direct {d_key} != JIT {j_key}")
                if d[6:9] != (None, None, None):
                    problems.append(f"{op} {mode} {name}: direct route metadata/hooks {d[6:9]}")
                enter, leave = j[7], j[8]
                if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
                    problems.append(f"{op} {mode} {name}: JIT route hooks not idle")
    print(f"triton {triton.__version__}: {launches} launches compared, {len(problems)} mismatches")
    return problems


def all_cases():
    for op, (fn, args, grads) in cases().items():
        for mode, call in calls(EAGER[op], args, grads).items():
            yield op, "eager", mode, call, None
        for route, direct in (("jit", False), ("direct", True)):
            if direct and FL is None:
                continue
            for mode, call in calls(fn, args, grads).items():
                yield op, route, mode, call, direct


def run_cases(client=None, n: int = 50) -> dict:
    out = {}
    for op, route, mode, call, direct in all_cases():
        if direct is not None:
            set_route(direct)
        warm(call, mode)
        label = f"{op}|{route}|{mode}"
        if client is None:
            py, c_calls = HW.python_calls(call, mode, n)
            out[label] = {"py_calls": round(py, 2), "c_calls": round(c_calls, 2),
                          "op_events": HW.op_events(call, mode)["total"]}  # fmt: skip
        else:
            with HW.grad_mode(mode):
                gc.collect()
                gc.disable()
                client.hp_zero()
                for _ in range(n):
                    call()
                client.hp_dump(label.encode())
                gc.enable()
    set_route(True)
    return out


def run_callgrind(n: int) -> dict:
    if shutil.which("valgrind") is None or shutil.which("gcc") is None:
        raise SystemExit("--callgrind needs valgrind and gcc (with valgrind/callgrind.h)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/cg.out",
               sys.executable, __file__, "--callgrind-child", str(folder), "--n", str(n)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        totals = {}
        for path in folder.glob("cg.out*"):
            label = total = None
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split("Client Request: ", 1)[1].strip()
                elif line.startswith(("totals:", "summary:")):
                    total = int(line.split()[1])
            if label is not None and total is not None:
                totals[label] = total / n
    empty = totals.pop("empty|empty|empty")
    return {label: round(ir - empty) for label, ir in totals.items()}


def callgrind_child(folder: Path, n: int) -> None:
    client = HW.build_client(folder)
    for _, _, mode, call, direct in all_cases():  # compiled kernels come from triton's disk cache
        if direct is not None:
            set_route(direct)
        warm(call, mode)
    client.hp_start()
    client.hp_zero()
    for _ in range(n):
        HW.empty_call()
    client.hp_dump(b"empty|empty|empty")
    run_cases(client, n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare each launch's arguments on both routes")
    p.add_argument("--callgrind", action="store_true", help="also count instructions under callgrind")
    p.add_argument("--n", type=int, default=50, help="calls counted per case")
    p.add_argument("--json", type=Path, help="write every count here")
    p.add_argument("--callgrind-child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    install()
    if args.callgrind_child:
        callgrind_child(args.callgrind_child, args.n)
        return
    if args.check:
        problems = check()
        for line in problems:
            print("MISMATCH", line)
        raise SystemExit(1 if problems else 0)
    for _, _, mode, call, direct in all_cases():  # compile everything once, outside valgrind
        if direct is not None:
            set_route(direct)
        warm(call, mode)
    counts = run_cases(n=args.n)
    if args.callgrind:
        for label, ir in run_callgrind(args.n).items():
            counts[label]["instructions"] = ir
    result = {"triton": triton.__version__, "torch": torch.__version__, "machine": HW.machine(),
              "direct_route": FL is not None, "n": args.n, "cases": counts}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"# triton {triton.__version__}, torch {torch.__version__}; per call, less an empty call's")
    rows = collections.defaultdict(dict)
    for label, c in counts.items():
        op, route, mode = label.split("|")
        rows[(op, route)][mode] = c
    print("| op | route | Ir fwd, no grad | Ir fwd | Ir fwd + bwd | py calls | op events |")
    print("|---|---|---:|---:|---:|---|---|")
    for (op, route), modes in rows.items():
        ir = [f"{modes[m].get('instructions', '-'):,}" if "instructions" in modes[m] else "-"
              for m in ("fwd_nograd", "fwd", "fwd_bwd")]  # fmt: skip
        py = " / ".join(f"{modes[m]['py_calls']:g}" for m in ("fwd_nograd", "fwd", "fwd_bwd"))
        ev = " / ".join(str(modes[m]["op_events"]) for m in ("fwd_nograd", "fwd", "fwd_bwd"))
        print(f"| {op} | {route} | {' | '.join(ir)} | {py} | {ev} |")


if __name__ == "__main__":
    main()
