"""The tail forward as thread-block clusters (Triton's num_ctas): built here, timed where it runs.

With num_ctas > 1 on Hopper a program runs as a cluster of CTAs that split its row and reduce
across each other through distributed shared memory. The H200's triton 3.6 cannot build
tail_fwd_kernel that way, so the experiment is split in two:

    build   (a triton that compiles num_ctas > 1 for sm_90, such as 3.9; no GPU needed) compiles
            CONFIGS into NAME.cubin, with NAME.json: what `time` needs to launch it, and the
            registers and spills ptxas reports.
    time    (CUDA, torch only) launches the cubins through the driver API as Triton 3.9 does,
            checks them and profuse's tuned forward against float64 (a wrong one is reported,
            not timed), and times them interleaved under the harness's L2 flush (CudaTimer).
            It also times benchmarks/cluster_cuda.py's builds, whose NAME.json may name a
            cluster_dim (1: a plain grid) and mark a build timing_only (wrong by design: timed,
            and reported as such).

    PYTHONPATH=src python benchmarks/cluster_probe.py build --out cubins --cols 4096,16384
    PYTHONPATH=src python benchmarks/cluster_probe.py time --cubins cubins --shapes 8192x4096 --out c.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import io
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_uint, c_uint64, c_void_p
from pathlib import Path

import torch

from profuse.bench.traffic import FUSED_FORWARD_TENSORS, copy_ceiling
from profuse.cli import int_list
from profuse.errors import UsageError
from profuse.files import check_folder, write_json
from profuse.timers import CudaTimer

# (n_cols, BLOCK_N, num_ctas, num_warps); EVEN is BLOCK_N == n_cols.
CONFIGS = [
    (4096, 4096, 2, 8), (4096, 4096, 4, 4),
    (8192, 8192, 2, 16), (8192, 8192, 2, 8), (8192, 8192, 4, 8), (8192, 8192, 4, 4), (8192, 8192, 8, 4),
    (11008, 16384, 4, 8), (11008, 16384, 8, 4), (14336, 16384, 4, 8), (14336, 16384, 8, 4),
    (16384, 16384, 2, 16), (16384, 16384, 4, 8), (16384, 16384, 4, 4), (16384, 16384, 8, 8),
    (16384, 16384, 8, 4), (32768, 32768, 4, 16), (32768, 32768, 8, 8), (32768, 32768, 8, 4),
    (65536, 65536, 8, 16), (65536, 65536, 8, 8),
]  # fmt: skip
# The kernel's runtime arguments in order, with their Triton types; all but n_rows and eps get
# tt.divisibility=16, as the JIT gives torch's pointers and multiples of 16.
ARGS = {"G_ptr": "*bf16", "U_ptr": "*bf16", "R_ptr": "*bf16", "W_ptr": "*bf16", "Y_ptr": "*bf16",
        "RSTD_ptr": "*fp32", "g_row_stride": "i32", "u_row_stride": "i32", "r_row_stride": "i32",
        "y_row_stride": "i32", "n_rows": "i32", "n_cols": "i32", "eps": "fp32"}  # fmt: skip
CTYPES = {"*bf16": c_uint64, "*fp32": c_uint64, "i32": ctypes.c_int32, "fp32": ctypes.c_float}
# Triton 3.9 appends two pointers to the kernel's parameters, NULL when their size is 0.
SCRATCH = ("global_scratch", "profile_scratch")
EPS = 1e-6
SHAPES = [(8192, 4096), (4096, 8192), (3048, 11008), (2340, 14336), (2048, 16384), (1024, 32768),
          (512, 65536), (8192, 16384), (2048, 65536)]  # fmt: skip
TRIALS, CALLS = 30, 2


# --- build -----------------------------------------------------------------------------------
def compile_config(n_cols: int, block_n: int, ctas: int, warps: int) -> tuple[bytes, dict]:
    """One config's cubin for sm_90a and what `time` needs to launch it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from profuse.kernels.tail import tail_fwd_kernel as kernel

    even = block_n == n_cols
    constexprs = dict(BLOCK_M=1, BLOCK_N=block_n, NUM_STAGES=1, IN_EVICT="", EVEN=even, BLOCK_N2=0)
    if list(kernel.arg_names) != [*ARGS, *constexprs]:
        raise RuntimeError(f"the kernel's arguments changed: {kernel.arg_names}")
    signature = {**ARGS, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(ARGS) if n not in ("n_rows", "eps")}
    options = {"num_warps": warps, "num_ctas": ctas, "enable_fp_fusion": True}
    src = ASTSource(kernel, signature, constexprs, attrs)
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(io.StringIO()) as log:
        os.environ["TRITON_CACHE_DIR"] = cache  # empty: ptxas runs even where two widths share a binary
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # and Triton prints its -v log
        stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # MLIR prints its diagnostics there; build reports a failure in one line
        try:
            c = triton.compile(src, GPUTarget("cuda", 90, 32), options)
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
            os.close(devnull)
    md, log = c.metadata, log.getvalue()
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", c.asm["ptx"], re.S)
    if entry is None or entry.group(1).count(".param") != len(ARGS) + len(SCRATCH):
        raise RuntimeError(f"the PTX entry does not take {len(ARGS)} arguments + {len(SCRATCH)} scratch")
    meta = dict(kernel=md.name, shared=md.shared, num_warps=md.num_warps, num_ctas=md.num_ctas, cols=n_cols,
                block_n=block_n, even=even, triton=triton.__version__)  # fmt: skip
    meta.update(ptxas_usage(log))
    for s in SCRATCH:
        meta[f"{s}_size"], meta[f"{s}_align"] = getattr(md, f"{s}_size"), getattr(md, f"{s}_align")
    return c.asm["cubin"], meta


def ptxas_usage(log: str) -> dict:
    """Registers and spill bytes from ptxas's -v log (None where it does not say)."""
    patterns = {"registers": r"Used (\d+) registers", "spill_store_bytes": r"(\d+) bytes spill stores",
                "spill_load_bytes": r"(\d+) bytes spill loads"}  # fmt: skip
    found = {key: re.search(pattern, log) for key, pattern in patterns.items()}
    return {key: int(m.group(1)) if m else None for key, m in found.items()}


def write_build(out: Path, name: str, cubin: bytes, meta: dict) -> str:
    """NAME.cubin and NAME.json into `out`, as `time` reads them; a line that says what was built."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.cubin").write_bytes(cubin)
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return (f"{name:46} {meta['registers']!s:>3} registers, spills {meta['spill_store_bytes']} st / "
            f"{meta['spill_load_bytes']} ld, {meta['shared']} B of shared memory at launch")  # fmt: skip


def build(args: argparse.Namespace) -> int:
    """The `build` command: every config of --cols (default all) into --out."""
    try:
        import triton
    except ImportError:
        print("error: build needs triton (3.9 compiles num_ctas > 1 for sm_90): none found", file=sys.stderr)
        return 2
    out, configs = Path(args.out), [c for c in CONFIGS if args.cols is None or c[0] in args.cols]
    try:
        check_folder(out)
        if not configs:
            raise UsageError(f"--cols {args.cols}: no configs of these widths (see CONFIGS)")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for n_cols, block_n, ctas, warps in configs:
        name = f"tail_fwd_n{n_cols}_b{block_n}_{'even' if block_n == n_cols else 'mask'}_c{ctas}_w{warps}"
        try:
            cubin, meta = compile_config(n_cols, block_n, ctas, warps)
        except Exception as err:
            first = (str(err).strip() or type(err).__name__).splitlines()[0]
            print(f"error: triton {triton.__version__} cannot compile {name} (num_ctas={ctas}) "
                  f"for sm_90: {first}", file=sys.stderr)  # fmt: skip
            return 2
        print(write_build(out, name, cubin, meta), flush=True)
    print(f"wrote {len(configs)} cubins (triton {triton.__version__}) into {out}")
    return 0


# --- the CUDA driver API through ctypes (layouts from cuda.h, LP64) ---------------------------
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class CUlaunchAttributeValue(ctypes.Union):  # 64 bytes, 8-byte aligned (some members are pointers)
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", c_uint * 3), ("align", c_uint64)]


class CUlaunchAttribute(Structure):
    _fields_ = [("id", c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(Structure):
    _fields_ = [(f, c_uint) for f in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                      "blockDimZ", "sharedMemBytes")]  # fmt: skip
    _fields_ += [("hStream", c_void_p), ("attrs", POINTER(CUlaunchAttribute)), ("numAttrs", c_uint)]


assert ctypes.sizeof(CUlaunchAttributeValue) == 64 and ctypes.alignment(CUlaunchAttributeValue) == 8
assert ctypes.sizeof(CUlaunchAttribute) == 72 and CUlaunchAttribute.value.offset == 8
assert ctypes.sizeof(CUlaunchConfig) == 56 and CUlaunchConfig.hStream.offset == 32
assert CUlaunchConfig.attrs.offset == 40 and CUlaunchConfig.numAttrs.offset == 48


@functools.cache
def driver() -> ctypes.CDLL:
    """libcuda; every call passes its pointers as ctypes objects and returns a CUresult (an int)."""
    return ctypes.CDLL("libcuda.so.1")


def cu(name: str, *args: object) -> None:
    """Call the driver function `name`; RuntimeError with cuGetErrorString's text unless it succeeds."""
    code = getattr(driver(), name)(*args)
    if code != 0:
        text = c_char_p()
        driver().cuGetErrorString(code, byref(text))
        raise RuntimeError(f"{name}: CUresult {code}: {text.value.decode() if text.value else 'unknown'}")


def make_context_current() -> None:
    """Make torch's primary context current on this thread for the driver calls."""
    torch.empty(1, device="cuda")  # torch creates its context lazily
    cu("cuInit", 0)
    ctx = c_void_p()
    cu("cuCtxGetCurrent", byref(ctx))
    if not ctx.value:
        dev = c_int()
        cu("cuDeviceGet", byref(dev), torch.cuda.current_device())
        cu("cuDevicePrimaryCtxRetain", byref(ctx), dev)
        cu("cuCtxSetCurrent", ctx)


def cluster_launch(meta_path: Path, g: torch.Tensor, u: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                   eps: float) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """One of build's cubins, loaded into the current context, and a launch of it on these (rows, cols)
    inputs, packed once; the launch returns y and rstd (NaN until it runs)."""
    meta = json.loads(meta_path.read_text())
    module, function, image = c_void_p(), c_void_p(), meta_path.with_suffix(".cubin").read_bytes()
    cu("cuModuleLoadData", byref(module), image)  # the driver copies the image
    cu("cuModuleGetFunction", byref(function), module, meta["kernel"].encode())
    rows, cols = g.shape
    assert cols == meta["cols"] and all(t.is_contiguous() for t in (g, u, r, w))
    ctas, dev = meta["num_ctas"], g.device
    y = torch.full_like(g, float("nan"))
    rstd = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev)
    values = [t.data_ptr() for t in (g, u, r, w, y, rstd)] + [t.stride(0) for t in (g, u, r, y)]
    values += [rows, cols, eps]
    scratch = []  # as Triton 3.9 allocates it: size x programs x CTAs bytes, aligned
    for s in SCRATCH:
        size, align = meta[f"{s}_size"], max(1, meta[f"{s}_align"])
        if size:
            scratch.append(torch.empty(rows * ctas * size + align, dtype=torch.uint8, device=dev))
        values.append((scratch[-1].data_ptr() + align - 1) // align * align if size else 0)
    types = [CTYPES[t] for t in ARGS.values()] + [c_uint64] * len(SCRATCH)
    params = [t(v) for t, v in zip(types, values, strict=True)]
    argv = (c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
    cluster = CUlaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    cluster.value.clusterDim[:] = (meta.get("cluster_dim", ctas), 1, 1)  # 1: a plain grid
    cfg = CUlaunchConfig(rows * ctas, 1, 1, 32 * meta["num_warps"], 1, 1, meta["shared"],
                         torch.cuda.current_stream(dev).cuda_stream, ctypes.pointer(cluster), 1)  # fmt: skip

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        cu("cuLaunchKernelEx", byref(cfg), function, argv, None)
        return y, rstd

    launch.keep = (params, scratch)  # argv points into these
    launch.meta = meta
    return launch


# --- time ------------------------------------------------------------------------------------
def measure(rows: int, cols: int, metas: list[Path], timer: CudaTimer, ceiling: float) -> dict:
    """profuse's forward and each cubin in `metas` at one shape: checked, then timed interleaved."""
    from profuse import tail as T
    from profuse.kernels import tail as K

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows + cols)
    g, u, r = (torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    w = (1 + 0.1 * torch.randn(cols, device=dev, generator=gen)).to(torch.bfloat16)
    y_ref = T.tail_reference(g, u, r, w, EPS)  # float64
    h = torch.nn.functional.silu(g.double()) * u.double() + r.double()
    rstd_ref = torch.rsqrt(h.pow(2).mean(dim=1) + EPS)
    del h
    rec = {"rows": rows, "cols": cols, "results": {}, "failed": {}}
    runs = {"profuse": lambda: K.tail_forward(g, u, r, w, EPS)}
    errs = {}
    for path in [None, *metas]:
        name = path.stem if path else "profuse"
        try:
            if path:
                runs[name] = cluster_launch(path, g, u, r, w, EPS)
            y, rstd = runs[name]()
            torch.cuda.synchronize()
        except RuntimeError as err:
            rec["failed"][name] = str(err)
            runs.pop(name, None)
            continue
        errs[name] = (T.relative_error(y, y_ref), ((rstd.double() - rstd_ref).abs() / rstd_ref).max().item())
        if path and (why := runs[name].meta.get("timing_only")):
            rec.setdefault("wrong_by_design", {})[name] = why  # timed, never counted as a result
        elif not (errs[name][0] < 5e-3 and errs[name][1] < 1e-4):  # NaN fails too
            rec["failed"][name] = "wrong: y rel err {:.1e}, rstd max rel err {:.1e}".format(*errs[name])
            del runs[name]
    rec["profuse_config"] = K.chosen_configs(rows, cols, torch.bfloat16, dev)["forward"]
    print(f"{rows}x{cols}: timing {len(runs)} forwards", file=sys.stderr, flush=True)
    times = {n: [] for n in runs}
    for trial in range(TRIALS):
        order = list(runs) if trial % 2 else list(runs)[::-1]
        res = timer.time_calls([runs[n] for n in order for _ in range(CALLS)])
        for i, n in enumerate(order):
            times[n] += res[CALLS * i : CALLS * (i + 1)]
    nbytes = FUSED_FORWARD_TENSORS * g.numel() * g.element_size()
    for n, ts in times.items():
        us = statistics.median(ts) * 1e6
        rec["results"][n] = {"us": us, "pct_copy": 100 * nbytes / (us * 1e-6) / ceiling,
                             "y_rel_err": errs[n][0], "rstd_rel_err": errs[n][1]}  # fmt: skip
    return rec


def time_forwards(args: argparse.Namespace) -> int:
    """The `time` command: each shape's forwards, a table a shape, and the JSON of --out."""
    try:
        if args.out:
            check_folder(Path(args.out).parent, (Path(args.out).name,))
        metas = sorted(Path(args.cubins).glob("*.json"))
        if not metas:
            raise UsageError(f"--cubins {args.cubins}: no NAME.json there (run build first)")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: cluster_probe.py time launches CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    make_context_current()
    timer, ceiling = CudaTimer(dev), copy_ceiling(dev)
    print(f"{torch.cuda.get_device_name(dev)}, copy ceiling {ceiling / 1e12:.3f} TB/s", flush=True)
    res = {"copy_ceiling_Bps": ceiling, "shapes": []}
    for rows, cols in args.shapes:
        mine = [p for p in metas if json.loads(p.read_text())["cols"] == cols]
        rec = measure(rows, cols, mine, timer, ceiling)
        res["shapes"].append(rec)
        print(f"{rows} x {cols}: profuse's pick {rec['profuse_config']}")
        for name, r in sorted(rec["results"].items(), key=lambda kv: kv[1]["us"]):
            wrong = "  WRONG BY DESIGN, timing only" if name in rec.get("wrong_by_design", {}) else ""
            print(f"  {r['us']:7.1f} us {r['pct_copy']:5.1f}%  {name}  "
                  f"(y err {r['y_rel_err']:.1e}, rstd err {r['rstd_rel_err']:.1e}){wrong}")  # fmt: skip
        for name, why in rec["failed"].items():
            print(f"  FAILED  {name}: {why}")
        sys.stdout.flush()
    if args.out:
        print(f"wrote {write_json(args.out, res)}")
    return 0


def shape_list(text: str) -> list[tuple[int, int]]:
    """ROWSxCOLS,... of positive sizes."""
    try:
        shapes = [(int(a), int(b)) for a, b in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        shapes = []
    if not shapes or min(min(s) for s in shapes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ROWSxCOLS,..., got {text!r}")
    return shapes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the configs to cubins (a triton that builds clusters; no GPU)")
    b.add_argument("--out", required=True, help="folder for NAME.cubin and NAME.json")
    b.add_argument("--cols", type=int_list, default=None,
                   help="only the configs of these widths, e.g. 4096,8192 (default all)")  # fmt: skip
    t = sub.add_parser("time", help="check and time the cubins against profuse's forward (CUDA)")
    t.add_argument("--cubins", required=True, help="a folder written by build")
    t.add_argument("--shapes", type=shape_list, default=SHAPES,
                   help="ROWSxCOLS,... (default: 32M elements at 4096-65536 columns, then 128M)")  # fmt: skip
    t.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()
    return build(args) if args.command == "build" else time_forwards(args)


if __name__ == "__main__":
    sys.exit(main())
