"""Part B: the tail's variants (the registry, `variants()`) checked against float64, then timed
against each other.

Correctness comes first: every variant runs once on the same inputs and is compared with a
float64 reference (relative error against the dtype's tolerance) and with eager (max |diff|, as
the lab prints). A variant outside its tolerance is reported as failed and never timed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from profuse import compile as _compile
from profuse import tail as T
from profuse.bench import DEFAULT_TRIALS
from profuse.bench import traffic as B
from profuse.bench.timing import Comparison, compare, timed_call
from profuse.env import check_fits, dtype_name, environment, interpreting
from profuse.errors import UsageError
from profuse.kernels import HAS_TRITON, TRITON_MISSING
from profuse.timers import TIMINGS

try:
    from liger_kernel.transformers.functional import liger_fused_add_rms_norm, liger_swiglu

    HAS_LIGER = True
except Exception:  # ImportError, or a liger build that cannot load here
    HAS_LIGER = False


def tail_liger(gate, up, residual, weight, eps: float = T.DEFAULT_EPS):
    """What many users would pick: Liger-Kernel's SiLUMul, then its FusedAddRMSNorm (2 kernels)."""
    y, _new_residual = liger_fused_add_rms_norm(liger_swiglu(gate, up), residual, weight, eps, in_place=False)
    return y


@dataclass(frozen=True)
class Variant:
    """One way to compute the tail, as the benchmark lists it (`variants()`)."""

    key: str  # what --variants takes
    label: str  # what the table prints
    fn: Callable
    needs_cuda: bool = False
    available: bool = True
    why_unavailable: str = ""
    interpretable: bool = False  # Triton: runs on a CPU through the interpreter (TRITON_INTERPRET=1)


def variants() -> dict[str, Variant]:
    """Every variant profuse knows, by the key --variants takes, in table order."""
    return {
        v.key: v
        for v in [
            Variant("eager", "eager", T.tail_eager),
            Variant("rms_norm", "eager F.rms_norm", T.tail_rms_norm),
            Variant("compile", "torch.compile", T.tail_compiled),
            Variant("compile-max", "compile max-autotune", partial(T.tail_compiled, mode="max-autotune")),
            Variant(
                "triton", "triton", T.tail_triton, True, HAS_TRITON, TRITON_MISSING, interpretable=True
            ),
            Variant(
                "liger", "liger-kernel", tail_liger, True, HAS_LIGER,
                "liger-kernel is not installed (pip install liger-kernel)",
            ),
        ]
    }  # fmt: skip


DEFAULT_VARIANTS = ("eager", "rms_norm", "compile", "triton", "liger")
# On CPU, F.rms_norm is not one fused kernel: its row would time eager again (~0.25 s a call at
# the lab's size on 2 cores) and push the main job past its budget. Ask for it with --variants.
CPU_DEFAULT_VARIANTS = ("eager", "compile")


def default_variants(device: torch.device) -> tuple[str, ...]:
    return DEFAULT_VARIANTS if device.type == "cuda" else CPU_DEFAULT_VARIANTS


BASELINE = "eager"


@dataclass
class TailBenchConfig:
    rows: int = 8192
    cols: int = 4096
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    trials: int = DEFAULT_TRIALS
    warmup: int | None = None  # untimed calls after the first: 3 on CUDA, 1 on CPU (calls take ~0.1 s)
    seed: int = 0
    backward: bool = False  # time forward + backward instead of the forward alone
    variants: Sequence[str] = DEFAULT_VARIANTS
    flush_l2: bool = True
    eps: float = T.DEFAULT_EPS
    timing: str = "device"  # how calls are timed: device, loop or graph (profuse/timers.py)

    def __post_init__(self):
        if self.rows <= 0 or self.cols <= 0:
            raise UsageError(f"sizes must be positive, got --rows {self.rows} --cols {self.cols}")
        if self.trials < 2:
            raise UsageError(f"--trials must be at least 2 for a confidence interval, got {self.trials}")
        if self.dtype not in T.SUPPORTED_DTYPES:
            raise UsageError(f"dtype {self.dtype} is not supported: use bf16, fp16 or fp32")
        known = variants()
        unknown = [v for v in self.variants if v not in known]
        if unknown:
            raise UsageError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(known)}")
        if self.timing not in TIMINGS:
            raise UsageError(f"unknown --timing {self.timing!r}: choose from {', '.join(TIMINGS)}")
        if self.timing == "graph" and self.device.type != "cuda":
            raise UsageError(
                f"--timing graph replays CUDA graphs: it needs a CUDA GPU (this run is on {self.device})"
            )
        if BASELINE not in self.variants:
            self.variants = (BASELINE, *self.variants)
        if self.warmup is None:
            self.warmup = 3 if self.device.type == "cuda" else 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(dtype=dtype_name(self.dtype), device=str(self.device), variants=list(self.variants))
        return d


@dataclass
class VariantCheck:
    """What one variant's single checked call gave."""

    label: str
    passed: bool
    rel_err: float  # ||y - y64|| / ||y64||
    tol: float
    max_diff_vs_eager: float
    grad_rel_err: dict[str, float] = field(default_factory=dict)  # backward only
    grad_tol: float | None = None
    first_call_s: float = 0.0
    error: str = ""  # an exception message, when the call itself failed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TailBenchResult:
    config: TailBenchConfig
    env: dict
    traffic: B.TailTraffic
    model_tensors: int  # tensors the fused variant must move (4 forward, 11 forward + backward)
    copy_ceiling_Bps: float | None  # CUDA only, measured in the same run
    checks: dict[str, VariantCheck]
    skipped: dict[str, str]  # variant key -> why it did not run
    labels: dict[str, str]
    comparison: Comparison | None
    kernel_configs: dict = field(default_factory=dict)

    @property
    def model_bytes(self) -> int:
        return self.traffic.bytes_for(self.model_tensors)

    def achieved_Bps(self, key: str) -> float:
        return self.model_bytes / self.comparison.median_s(key)

    def to_dict(self) -> dict:
        rows = {}
        if self.comparison is not None:
            for key in self.comparison.timings:
                sp = self.comparison.speedups.get(key)
                bw = self.achieved_Bps(key)
                rows[key] = {
                    "label": self.labels[key],
                    "median_s": self.comparison.median_s(key),
                    "host_s": self.comparison.timings[key].host_s,
                    "host_bound": self.comparison.host_bound(key),
                    "speedup": sp.to_dict() if sp else None,
                    "achieved_Bps": bw,
                    "fraction_of_copy": bw / self.copy_ceiling_Bps if self.copy_ceiling_Bps else None,
                }
        return {
            "kind": "tail",
            "config": self.config.to_dict(),
            "env": self.env,
            "traffic": {
                **self.traffic.to_dict(),
                "model_tensors": self.model_tensors,
                "model_bytes": self.model_bytes,
            },
            "copy_ceiling_Bps": self.copy_ceiling_Bps,
            "checks": {k: v.to_dict() for k, v in self.checks.items()},
            "skipped": self.skipped,
            "timing": self.config.timing,
            "results": rows,
            "comparison": self.comparison.to_dict() if self.comparison else None,
            "kernel_configs": self.kernel_configs,
        }


def make_inputs(cfg: TailBenchConfig) -> dict[str, torch.Tensor]:
    """Fresh random inputs (never zeros): gate, up, residual ~ N(0, 1), weight ~ 1 + N(0, 0.1^2)."""
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    shape = (cfg.rows, cfg.cols)
    kw = dict(generator=gen, device=cfg.device, dtype=cfg.dtype)
    out = {name: torch.randn(shape, **kw) for name in ("gate", "up", "residual")}
    out["weight"] = 1 + 0.1 * torch.randn(cfg.cols, **kw)
    if cfg.backward:
        out["dy"] = torch.randn(shape, **kw)
    return out


def estimated_bytes(cfg: TailBenchConfig) -> int:
    """A generous estimate of the peak memory of one run (inputs, reference, eager's temporaries;
    with graph timing, every variant's captured outputs and temporaries kept in its graph's pool)."""
    elems = cfg.rows * cfg.cols
    s = torch.empty(0, dtype=cfg.dtype).element_size()
    graphs = len(cfg.variants) if cfg.timing == "graph" else 0
    if cfg.backward:
        # inputs + dy + saved activations and grads of eager (~14) + each variant's y and grads;
        # float64 reference: inputs, output, grads and autograd's saved tensors (~14).
        return elems * (s * 22 + 8 * 14 + s * 18 * graphs)
    return elems * (s * 10 + 8 * 6 + s * 8 * graphs)


def _label(key: str) -> str:
    return variants()[key].label


def runner(fn: Callable, x: dict, cfg: TailBenchConfig) -> Callable[[], object]:
    """One call of a tail variant as Part B times it: the forward, or forward + backward with
    fresh gradients (autograd.grad) against the bench's dy."""
    g, u, r, w = x["gate"], x["up"], x["residual"], x["weight"]
    if not cfg.backward:
        return lambda: fn(g, u, r, w, cfg.eps)
    leaves = [t.detach().requires_grad_() for t in (g, u, r, w)]
    dy = x["dy"]

    def fwd_bwd():
        y = fn(*leaves, cfg.eps)
        # autograd.grad returns fresh gradients: nothing accumulates into .grad between calls.
        # y goes back detached: a result kept (the checks keep eager's) must not keep its graph
        # alive, whose leaf nodes would hold the stream of their first call and break a later
        # CUDA-graph capture ("operation would make the legacy stream depend on a capturing ...").
        return (y.detach(), *torch.autograd.grad(y, leaves, dy))

    return fwd_bwd


def _reference(x: dict, cfg: TailBenchConfig) -> tuple[torch.Tensor, ...]:
    leaves = [
        x[k].detach().double().requires_grad_(cfg.backward) for k in ("gate", "up", "residual", "weight")
    ]
    y = T.tail_reference(*leaves, cfg.eps)
    if not cfg.backward:
        return (y.detach(),)
    grads = torch.autograd.grad(y, leaves, x["dy"].double())
    return (y.detach(), *grads)


GRAD_NAMES = ("gate", "up", "residual", "weight")


def check_variant(key: str, outs, ref, eager_outs, cfg: TailBenchConfig, first_s: float) -> VariantCheck:
    outs = outs if isinstance(outs, tuple) else (outs,)
    tol = T.FORWARD_TOL[cfg.dtype]
    rel = T.relative_error(outs[0], ref[0])
    diff = (outs[0].float() - eager_outs[0].float()).abs().max().item()
    check = VariantCheck(_label(key), rel <= tol, rel, tol, diff, first_call_s=first_s)
    if cfg.backward:
        check.grad_tol = T.BACKWARD_TOL[cfg.dtype]
        check.grad_rel_err = {n: T.relative_error(o, r) for n, o, r in zip(GRAD_NAMES, outs[1:], ref[1:])}
        check.passed = check.passed and all(e <= check.grad_tol for e in check.grad_rel_err.values())
    return check


def run_tail_bench(
    cfg: TailBenchConfig,
    progress: Callable[[str, int, int], None] | None = None,
    copy_ceiling_Bps: float | None = None,
) -> TailBenchResult:
    """Check every variant, then time the ones that passed in interleaved trials.

    `progress(stage, done, total)` reports work as it goes. `copy_ceiling_Bps`, if given, is
    reused instead of measured (a sweep measures it once).
    """
    dev = cfg.device
    known = variants()
    skipped: dict[str, str] = {}
    keys = []
    for key in cfg.variants:
        v = known[key]
        if not v.available:
            skipped[key] = v.why_unavailable
        elif v.needs_cuda and dev.type != "cuda" and not (v.interpretable and interpreting()):
            skipped[key] = "needs a CUDA GPU" + (
                "; TRITON_INTERPRET=1 runs it on the CPU through Triton's interpreter (slow)"
                if v.interpretable
                else ""
            )
        else:
            keys.append(key)
    check_fits(estimated_bytes(cfg), dev, f"{cfg.rows} x {cfg.cols} {dtype_name(cfg.dtype)}")

    x = make_inputs(cfg)
    ref = _reference(x, cfg)
    runners = {k: runner(known[k].fn, x, cfg) for k in keys}
    checks: dict[str, VariantCheck] = {}
    eager_outs = None
    for i, key in enumerate(keys):  # eager first: it is the baseline and the max-|diff| reference
        if progress:
            progress(f"checking {_label(key)}", i, len(keys))
        try:
            first_s, outs = timed_call(runners[key], dev)
        except Exception as err:  # a variant that cannot run here is a failed row, not a crash
            first_line = str(err).splitlines()[0] if str(err) else ""
            nan, tol = float("nan"), T.FORWARD_TOL[cfg.dtype]
            error = f"{type(err).__name__}: {first_line}"
            checks[key] = VariantCheck(_label(key), False, nan, tol, nan, error=error)
            continue
        outs = outs if isinstance(outs, tuple) else (outs,)
        if eager_outs is None:
            eager_outs = outs
        checks[key] = check_variant(key, outs, ref, eager_outs, cfg, first_s)
        del outs
    del ref

    passed = [k for k in keys if checks[k].passed]
    comparison = None
    if BASELINE in passed:
        with _compile.no_recompiles():
            comparison = compare(
                {k: runners[k] for k in passed},
                BASELINE,
                trials=cfg.trials,
                device=dev,
                warmup=cfg.warmup,
                flush_l2=cfg.flush_l2,
                seed=cfg.seed,
                progress=progress,
                timing=cfg.timing,
                first_calls={k: checks[k].first_call_s for k in passed},
            )
        for key, why in comparison.not_timed.items():
            skipped[key] = why
    if dev.type == "cuda" and copy_ceiling_Bps is None:
        copy_ceiling_Bps = B.copy_ceiling(dev)
    itemsize = torch.empty(0, dtype=cfg.dtype).element_size()
    return TailBenchResult(
        config=cfg,
        env=environment(dev),
        traffic=B.TailTraffic(cfg.rows, cfg.cols, itemsize),
        model_tensors=B.FUSED_FWD_BWD_TENSORS if cfg.backward else B.FUSED_FORWARD_TENSORS,
        copy_ceiling_Bps=copy_ceiling_Bps if dev.type == "cuda" else None,
        checks=checks,
        skipped=skipped,
        labels={k: _label(k) for k in cfg.variants},
        comparison=comparison,
        kernel_configs=_kernel_configs(cfg) if "triton" in keys else {},
    )


def _kernel_configs(cfg: TailBenchConfig) -> dict:
    from profuse.kernels.tail import chosen_configs

    out = chosen_configs(cfg.rows, cfg.cols, cfg.dtype, cfg.device)
    if not cfg.backward:
        del out["backward"]
    return out
