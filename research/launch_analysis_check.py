"""profuse's launch-analysis memo against torch's own analysis, on a CPU, with real TTIR.

    PYTHONPATH=src python research/launch_analysis_check.py [--json FILE]     # a few seconds

`profuse.kernels.launch_analysis` answers torch's question "which arguments does this Triton
launch read and write?" from a memo per launch signature. On a CPU torch cannot answer it at all
(it builds each kernel's TTIR for the active driver's target, and there is none), so the unit
tests can only use stand-ins. Here research/launch_route.py's stand-in driver (an sm_90 target,
no GPU touched) lets torch build the TTIR of profuse's real kernels and walk it:

1. the ops research/launch_route.py covers (silu_mul pair and packed, add_rms_norm, the tail)
   and the fused Llama's and Qwen3's others (rms_norm, rope, qk_norm_rope, the fused loss),
   forward and backward, run at 4 rows, again at 4 rows (a second layer of the same model) and
   at 7 rows, each launch recorded as torch.compile would see it (kernels/autotune.traced's
   route, through torch.library.wrap_triton);
2. every recorded launch analysed by torch afresh and through the memo: the answers must be equal
   for every launch, launches of one signature must get one answer from torch itself (the memo's
   premise), and the second layer must be answered from the memo alone.

Prints one line and, with --json, writes the counts; exits 1 where any answer differs. On
torch 2.13 and triton 3.x's CPU wheel (2026-12-08): 63 launches of 12 kernels, 37 signatures,
analysed in 2.1 s, every answer the same through the memo.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

# JITFunctions, not the interpreter's: profuse's kernel modules read the switch on import.
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).parent))

import launch_route as LR  # noqa: E402
import torch  # noqa: E402

from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import launch_analysis as LA  # noqa: E402

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
PASSES = (("layer 1, 4 rows", 4), ("layer 2, 4 rows", 4), ("7 rows", 7))


class Recorder:
    """torch.library.wrap_triton's stand-in: records each launch (kernel, runtime args, meta)."""

    def __init__(self, launches: list):
        self.launches = launches

    def __call__(self, kernel):
        launches = self.launches

        class Grid:
            def __getitem__(self, grid):
                return lambda *args, **meta: launches.append((kernel, args, meta))

        return Grid()


def more_cases(rows: int, cols: int = 64) -> dict:
    """The fused Llama's and Qwen3's other ops, as launch_route.cases gives its own: rms_norm,
    rope and qk_norm_rope (one sequence of `rows` tokens, 2 heads of `cols`) and the fused loss
    (a vocabulary of 256)."""
    from profuse import blockops, crossentropy, rotary

    gen = torch.Generator().manual_seed(1)
    rnd = lambda *shape, dtype=LR.BF16: torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
    x, w = rnd(rows, cols), rnd(cols, dtype=LR.FP32)
    q, k = rnd(1, 2, rows, cols), rnd(1, 2, rows, cols)
    cos, sin = (
        torch.randn(1, rows, cols, generator=gen).bfloat16(),
        torch.randn(1, rows, cols, generator=gen).bfloat16(),
    )
    qw, kw = rnd(cols), rnd(cols)
    qt, kt = rnd(1, rows, 2, cols), rnd(1, rows, 2, cols)  # qk_norm_rope's (B, T, H, D): out (B, H, T, D)
    hidden, head = rnd(1, rows, cols), rnd(256, cols)
    labels = torch.randint(0, 256, (1, rows), generator=gen)
    dq, dk = (
        torch.randn(1, 2, rows, cols, generator=gen).bfloat16(),
        torch.randn(1, 2, rows, cols, generator=gen).bfloat16(),
    )
    return {
        "rms_norm": (lambda *a: blockops.rms_norm(*a, LR.EPS), (x, w), (torch.randn(rows, cols).bfloat16(),)),
        "rope": (lambda *a: rotary.rope(*a, cos, sin), (q, k), (dq, dk)),
        "qk_norm_rope": (lambda *a: rotary.qk_norm_rope(*a, cos, sin), (qt, kt, qw, kw), (dq, dk)),
        "linear_cross_entropy": (
            lambda *a: crossentropy.linear_cross_entropy(*a, labels),
            (hidden, head),
            (torch.ones(()),),
        ),  # fmt: skip
    }


def let_run_on_cpu() -> None:
    """Every profuse kernel module's device check off, its scratch kept as on CUDA (launch_route
    does it for the modules it covers)."""
    import importlib
    import pkgutil

    import profuse.kernels as K

    for info in pkgutil.iter_modules(K.__path__):
        module = importlib.import_module(f"profuse.kernels.{info.name}")
        if hasattr(module, "check_runnable"):
            module.check_runnable = lambda device, op: None
        if hasattr(module, "scratch_key") and module is not A:
            module.scratch_key = lambda device: 0


def recorded_launches() -> dict[str, list]:
    """Each pass's launches as torch.compile would see them, the plans made first as `traced`
    makes them (an eager call of the same launcher)."""
    out = {}
    for name, rows in PASSES:
        launches: list = []
        for fn, args, grads in [*LR.cases(rows=rows, cols=64).values(), *more_cases(rows).values()]:
            call = LR.calls(fn, args, grads)["fwd_bwd"]
            call()  # the plans, built and compiled (the stand-in driver) as an eager call makes them
            wrap, torch.library.wrap_triton = torch.library.wrap_triton, Recorder(launches)
            try:
                with A.recording():
                    call()
            finally:
                torch.library.wrap_triton = wrap
        out[name] = launches
    return out


def analysis_args(kernel, args: tuple, meta: dict) -> dict:
    """The kwargs torch's analysis is given for a launch: runtime arguments by name, then the
    compile-time ones (launch options left out, as torch leaves them out of the TTIR)."""
    kwargs = dict(zip(kernel.arg_names, args))
    kwargs.update({k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS})
    return kwargs


def check() -> dict:
    import torch._higher_order_ops.triton_kernel_wrap as W

    name = next((n for n in LA.ANALYSIS_NAMES if hasattr(W, n)), None)
    if name is None:
        return {"skipped": "this torch has no Triton-launch analysis to wrap"}
    LR.install()
    let_run_on_cpu()
    fresh_fn = getattr(W, name)
    if getattr(fresh_fn, LA._MARK, False):  # wrapped already: torch's own underneath
        fresh_fn = fresh_fn.__wrapped__
    memo = LA.memoized(fresh_fn)
    answers: dict = collections.defaultdict(list)
    differ, hits_by_pass, kernels = [], {}, set()
    t0 = time.perf_counter()
    passes = recorded_launches()
    recorded_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for pass_name, launches in passes.items():
        before = memo.hits
        for kernel, args, meta in launches:
            kwargs = analysis_args(kernel, args, meta)
            W.generate_ttir(kernel, kwargs, {})  # raises where torch cannot build the TTIR
            fresh = fresh_fn(kernel, kwargs, {})
            if memo(kernel, kwargs, {}) != fresh:
                differ.append(f"{pass_name}: {kernel.fn.__name__}")
            answers[LA.signature((kernel, kwargs, {}), {})].append(fresh)
            kernels.add(kernel.fn.__name__)
        hits_by_pass[pass_name] = {"launches": len(launches), "from_memo": memo.hits - before}
    return {
        "analysis": name,
        "kernels": sorted(kernels),
        "launches": sum(len(v) for v in passes.values()),
        "signatures": len(answers),
        "passes": hits_by_pass,
        "memo_differs": differ,
        "one_answer_a_signature": all(all(a == g[0] for a in g) for g in answers.values()),
        "recorded_s": recorded_s,
        "analysed_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the counts here")
    args = p.parse_args(argv)
    result = check()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if "skipped" in result:
        print(f"skipped: {result['skipped']}")
        return 0
    layer2 = result["passes"]["layer 2, 4 rows"]
    ok = not result["memo_differs"] and result["one_answer_a_signature"]
    differ = result["memo_differs"]
    memo = f"differ: {differ}" if differ else "equal torch's for every launch"
    print(
        f"{'ok' if ok else 'FAILED'}: {result['launches']} launches of {len(result['kernels'])} kernels, "
        f"{result['signatures']} signatures, analysed by torch ({result['analysis']}) in "
        f"{result['analysed_s']:.1f} s; the memo's answers {memo}; the second layer's "
        f"{layer2['launches']} launches answered from the memo: {layer2['from_memo']}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
