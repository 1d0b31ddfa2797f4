"""Reading a torch.profiler trace: where a step's time went, by category and by structure.

`analyze_trace` reads a Chrome trace written by torch.profiler (any step, any model) and returns
a `TraceSummary`:

1. Time by category (`CATEGORY_RULES`, over op and kernel names, first match wins): over the
   self CPU time of every host range on CPU, over kernel time on CUDA. An operator or kernel
   run inside an attention, loss or matmul operator (SDPA's math path, a matmul's copy of a
   non-contiguous input) takes that operator's category. Anything inside the optimizer's ranges
   is optimizer work whatever its name: torch's own `Optimizer.step#...` and
   `Optimizer.zero_grad#...` ranges, which every torch optimizer opens, or a range the user
   named `optimizer`. A CUDA kernel whose name matches no rule takes the category of the
   operator that launched it (through the launch's correlation id).
2. The step's phases: backward is what autograd's engine runs (its
   `autograd::engine::evaluate_function: ...` nodes), optimizer as above, forward the rest.
3. Fusion candidates by structure: each memory-bound operator or kernel is attributed to the
   module that issued it, through the `profuse.module: ROLE` ranges profuse.structure opens
   (forward), and through autograd sequence numbers for the backward node a forward operator
   made. So an aten::mul is a norm's, SwiGLU's gate x up, RoPE's rotation or AdamW's, by where it
   ran, not by its name. Gradient accumulation (AccumulateGrad, the engine's add_ into a
   gradient buffer) is its own. Each candidate carries its share of the step, the Amdahl
   ceiling were it free (1 / (1 - f)) and the profuse op that fuses it, if one does.
4. Operators or kernels per step and, on CUDA, the GPU's idle share (launch-bound above
   LAUNCH_BOUND_IDLE_PCT).

A mixture of experts' routing is its own category, found by structure: the work of its router
(the scores' softmax, top-k, the weights' normalisation) and of its MoE block and experts modules
that moves tokens rather than computing on them (the sort or one-hot by expert, the gathers,
index, scatter, index_add, histc and cumsum that take the tokens to their experts and back, the
copies between), forward and backward (`profuse.module: router / experts / moe` ranges). The
experts' elementwise math (act(gate) x up, the routing weights' product) is memory-bound work of
its own candidate, EXPERTS_ACTIVATION; their grouped or per-expert matmuls stay matmul. Where no
module range is open (a compiled step, a trace from elsewhere), top-k, histc, one_hot and
bincount are routing by name.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field

from profuse.structure import MOE_ROLES, NORM_ROLES, RANGE_PREFIX, role_of_range

# The ranges each of Part A's built-in steps is cut into; a user's own ranges of these names are
# read the same way (an `optimizer` range is optimizer work). The analysis needs none of them.
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
STEP_PREFIX = "ProfilerStep#"

CATEGORIES = ("matmul", "attention", "memory_bound", "routing", "loss", "optimizer", "other")
# Shown only where the step has some: a dense model has no routing.
OPTIONAL_CATEGORIES = ("routing",)
CATEGORY_LABELS = {
    "matmul": "matmul",
    "attention": "attention",
    "memory_bound": "elementwise + norm (memory-bound)",
    "routing": "MoE routing (top-k, permutes)",
    "loss": "loss",
    "optimizer": "optimizer",
    "other": "other",
}

# Elementwise ops, reductions and normalisations: a few flops per byte, bound by memory traffic.
_MEMORY_BOUND_OPS = (
    "silu|gelu|relu|sigmoid|tanh|threshold|mul|add|sub|div|neg|reciprocal|pow|rsqrt|sqrt|exp|abs"
    "|clamp|maximum|minimum|where|masked_fill|mean|sum|norm|rms_norm|fused_rms_norm|layer_norm"
    "|native_layer_norm|copy|to_copy|to|type_as|clone|contiguous|fill|zero|zeros|ones|zeros_like"
    "|ones_like|cat|lerp|addcmul|addcdiv"
)

# (category, pattern) over the lower-cased name of an operator or kernel; the first match wins,
# whatever does not match is "other" (views, allocation, embedding gathers, framework overhead).
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    # AdamW in any form: the for-loop's ranges, foreach ops, the multi-tensor and fused kernels.
    ("optimizer", r"optimizer|adam|_foreach_|multi_tensor_apply"),
    # cross_entropy = log_softmax + nll_loss, forward and backward; CUDA names its kernel
    # cunn_SoftMaxForward<..LogSoftMaxForwardEpilogue>, Inductor triton_..__log_softmax_..
    ("loss", r"log_?softmax|nll_?loss|cross_?entropy"),
    # SDPA and its backends: flash (pytorch_flash::), memory-efficient (fmha_cutlass), cuDNN (sdpa)
    ("attention", r"scaled_?dot_?product|flash|fmha|sdpa|attention|attn"),
    # aten matmuls and their autograd nodes; cuBLAS/cuBLASLt kernels (gemm, nvjet on Hopper,
    # sm90_xmma, cutlass, split-K reductions); Inductor's matmul templates (triton_tem_)
    (
        "matmul",
        r"(?<![a-z])(add|b|baddb)?mm(?![a-z])|mmbackward|matmul|aten::linear|gemm|gemv|cublas|cutlass"
        r"|nvjet|xmma|wgmma|splitk|triton_tem",
    ),
    # Kernels Inductor generates: pointwise (poi), reductions (red, per); on CPU the compiled
    # graph's fused C++ code runs inside the '## Call CompiledFxGraph ##' range, which carries its
    # self time (the matmuls and SDPA it calls still show as aten ops).
    ("memory_bound", r"triton_(poi|red|per)_|cpp_fused|compiledfxgraph"),
    # A mixture of experts' routing where no module range says so (a compiled step): the ops only
    # routing uses. Gathers, sorts and scatters are routing only inside the MoE's modules (below).
    # (not index_add: a CPU embedding's backward runs one)
    ("routing", r"topk|histc|one_hot|bincount"),
    # Gathers and scatters (embedding forward and backward, sorts of token ids): memory-bound,
    # but no fusion of the tail removes them.
    ("other", r"embedding|index_?select|indexselect|scatter|gather|sort|segment"),
    (
        "memory_bound",
        rf"aten::_?({_MEMORY_BOUND_OPS})(_backward|_backward_data|_)?$"
        rf"|({_MEMORY_BOUND_OPS.replace('_', '')})backward"  # autograd nodes: MulBackward0, ...
        r"|elementwise|reduce_kernel|layer_norm|rms_?norm|silu|copy_kernel|fillfunctor",
    ),
)
_RULES = tuple((cat, re.compile(pat)) for cat, pat in CATEGORY_RULES)
Rules = tuple[tuple[str, "re.Pattern[str]"], ...]

HOST_CATS = ("cpu_op", "user_annotation")  # trace categories of host-side ranges
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernel (Triton)
_DEVICE_BUSY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

# Above this share of the step with no kernel, memcpy or memset running, the GPU spends more of
# the step waiting for the CPU to launch work than doing it: the step is launch-bound, and making
# kernels faster (fusion's bytes saved) cannot shorten it. On an H200: ~90% idle at the
# lab's d_model 256 (launch-bound), 4% at d_model 2048 (bound by the GPU's work).
LAUNCH_BOUND_IDLE_PCT = 50.0

# Autograd's backward nodes run as this range, carrying the sequence number of the forward op
# that made them: how a backward kernel is traced to the forward op it belongs to.
_BACKWARD_NODE = "autograd::engine::evaluate_function: "

# The ranges torch's optimizers open themselves (Optimizer.step#AdamW.step, ...zero_grad): the
# optimizer's work is found in any step, labelled by its author or not.
_TORCH_OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")


def categorize(name: str, rules: Rules = _RULES) -> str:
    """The category of an operator, autograd node or kernel name, by CATEGORY_RULES (or `rules`)."""
    low = name.lower()
    for cat, pattern in rules:
        if pattern.search(low):
            return cat
    return "other"


# Categories an operator passes on to everything run inside it (an aten op, not a range): SDPA's
# math path and cross_entropy's parts are attention and loss whatever their names. Not matmul:
# the copies inside an aten::linear are autocast's casts of its weight, memory-bound work.
_INHERITED = ("attention", "loss")

# --- fusion candidates, by the structure that issued the work -------------------------------------

RESIDUAL_NORM = "residual add + norm"
ACTIVATION_MUL = "activation x mul"
EXPERTS_ACTIVATION = "experts' activation x mul"  # and the routing weights' product, in the experts
ROUTING = "MoE routing (top-k, permutes)"
ROTARY = "rotary embedding"
QK_NORM = "q/k norm (in attention)"
COPIES = "copies and casts"  # autocast's weight casts, .contiguous() and dtype casts outside norms
ATTENTION_ELEMENTWISE = "attention elementwise"  # outside its matmuls and SDPA, no RoPE seen
LOSS = "softmax / cross-entropy"
OPTIMIZER_WORK = "optimizer"
GRAD_ACCUMULATION = "gradient accumulation"
UNPLACED = "other memory-bound"  # in no module profuse.structure recognises

# Copies and casts: a layout change (.contiguous()) or a dtype cast (autocast's bf16 weights).
_COPY_OPS = re.compile(r"copy|clone|contiguous|_to_copy|aten::to$|copybackward|clonebackward|tobackward")
# What marks rotary embedding where no module holds it: rotate_half's neg, the cos / sin tables.
_ROPE_OPS = ("aten::neg", "aten::cos", "aten::sin")
_ENGINE_ADD = ("aten::add_", "aten::add")  # the engine summing two gradients of one tensor
# What marks a loss as a cross-entropy (the work linear_cross_entropy replaces): its ops or kernels.
_CROSS_ENTROPY = re.compile(r"log_?softmax|nll_?loss|cross_?entropy")


@dataclass
class Candidate:
    """Work of one structure that fusion could shorten, as a share of the step's time."""

    name: str  # RESIDUAL_NORM, ACTIVATION_MUL, ...
    pct: float  # % of the summary's basis (self CPU time, or GPU kernel time)
    covered_by: str | None  # the profuse op that fuses it (silu_mul, rope, ...), None if none yet
    ops: dict[str, float] = field(default_factory=dict)  # its largest ops -> % of the basis
    note: str = ""  # what else covers it, where profuse does not

    @property
    def ceiling(self) -> float:
        """Amdahl: how much faster the counted time would be were this work free, 1 / (1 - f)."""
        f = min(self.pct / 100.0, 0.999999)
        return 1.0 / (1.0 - f)


def _covered_by(name: str, ops: Iterable[str], norm_roles: set[str]) -> tuple[str | None, str]:
    if name == RESIDUAL_NORM:
        if "rms_norm" in norm_roles:
            return "add_rms_norm", ""
        return None, "a LayerNorm: profuse's add_rms_norm fuses RMSNorm only"
    if name == ACTIVATION_MUL:
        if any("silu" in op.lower() for op in ops):
            return "silu_mul", ""
        return None, "not SiLU: profuse's silu_mul fuses silu(gate) * up only"
    if name == EXPERTS_ACTIVATION:
        low = [op.lower() for op in ops]
        if any("clamped_swiglu" in op or "clamp" in op for op in low):
            return "clamped_swiglu", "gpt-oss's clamped gate"
        if any("silu" in op for op in low):
            return "silu_mul", "in every experts implementation (profuse.fusion.hf_experts)"
        return None, "not SiLU: profuse fuses the experts' silu(gate) * up and gpt-oss's clamped gate only"
    if name == ROUTING:
        return None, (
            "no profuse op yet: a permute / combine kernel is built only where a card's profile shows it pays"
        )
    if name == ROTARY:
        return "rope", ""
    if name == QK_NORM:
        if "rms_norm" in norm_roles:
            return "qk_norm_rope", ""
        return None, "not RMSNorm: profuse's qk_norm_rope fuses a per-head RMSNorm and RoPE only"
    if name == LOSS:
        if any(_CROSS_ENTROPY.search(op.lower()) for op in ops):
            return "linear_cross_entropy", "with the LM head's matmul (profuse.fuse on Hugging Face models)"
        return None, "not a cross-entropy: profuse's linear_cross_entropy fuses the LM head's loss only"
    if name == OPTIMIZER_WORK:
        return None, "torch's own torch.optim.AdamW(fused=True) fuses it"
    return None, ""


def _required(f) -> bool:
    """Is dataclass field `f` one without a default?"""
    return f.default is MISSING and f.default_factory is MISSING


@dataclass
class TraceSummary:
    """What `analyze_trace` reads from a trace: where the step's time went."""

    steps: int  # ProfilerStep spans found
    basis: str  # "self CPU time" or "GPU kernel time": what the shares divide
    total_us: float  # that time summed over the steps
    shares: dict[str, float]  # category -> % of total_us, CATEGORIES (+ extra_rules') order, adding to 100
    launches_per_step: float  # kernels on CUDA, aten operator calls on CPU
    launch_unit: str  # "kernels" or "operators"
    gpu_idle_pct: float | None  # % of the step spans with no kernel, memcpy or memset running; CUDA only
    memory_bound_groups: dict[str, float]  # op (or kernel) -> % of total_us, memory-bound only, largest first
    # the part of the step in the candidates a profuse op fuses (silu_mul, add_rms_norm); files
    # written before the candidates existed hold the share of ops named like the SwiGLU tail's
    tail_pct: float
    # region (a profiler range name given to analyze_trace) -> % of total_us in it, forward and
    # backward: its operators and kernels, and the backward nodes its forward operators made
    region_pct: dict[str, float] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)  # largest first
    phase_pct: dict[str, float] = field(default_factory=dict)  # forward, backward, optimizer -> %
    # the user's own ranges -> %, largest first, forward and backward as region_pct; a range
    # inside another counts for the inner one
    label_pct: dict[str, float] = field(default_factory=dict)
    structured: bool = False  # whether the trace held profuse.module ranges (the candidates' source)

    def __post_init__(self) -> None:
        self.candidates = [c if isinstance(c, Candidate) else Candidate(**c) for c in self.candidates]

    @property
    def launch_bound(self) -> bool:
        """GPU idle over LAUNCH_BOUND_IDLE_PCT of the step (CUDA only): derived, so not a field."""
        return self.gpu_idle_pct is not None and self.gpu_idle_pct > LAUNCH_BOUND_IDLE_PCT

    def launch_bound_reading(self) -> str:
        """What a launch-bound step means and what helps it (empty when the GPU is busy)."""
        if not self.launch_bound:
            return ""
        return (
            f"the GPU sat idle {self.gpu_idle_pct:.0f}% of the step (over {LAUNCH_BOUND_IDLE_PCT:.0f}%): "
            "the step is launch-bound, the CPU cannot issue kernels as fast as the GPU runs them. "
            f"Fusion helps here only by launching fewer kernels ({self.launches_per_step:.0f} per step "
            "now), not by moving fewer bytes; what helps: CUDA graphs (torch.compile "
            'mode="reduce-overhead") or a bigger batch, so each launch carries more work'
        )

    def hotspot(self, compiled: bool = False) -> str:
        """One line: the launch-bound verdict where it applies, else the largest candidate."""
        mb = self.shares.get("memory_bound", 0.0)
        if self.launch_bound:  # no kernel is the bottleneck: naming one to fuse would mislead
            return (
                f"none named: the step is launch-bound (GPU idle {self.gpu_idle_pct:.0f}%), so shorter "
                f"kernels do not shorten it (memory-bound work is {mb:.1f}% of the {self.basis})"
            )
        top = ", ".join(f"{n} {pct:.1f}%" for n, pct in list(self.memory_bound_groups.items())[:2])
        if compiled:
            return (
                f"memory-bound work is {mb:.1f}% of the compiled step's {self.basis}"
                f"{f' ({top})' if top else ''}; Inductor's kernels each hold several modules' "
                "work, so the candidates are named from the eager step"
            )
        if not self.candidates:
            return f"no memory-bound, loss or optimizer work in the {self.basis}: nothing to fuse"
        c = self.candidates[0]
        head = f"{c.name}, {c.pct:.1f}% of the {self.basis} (at most {c.ceiling:.2f}x were it free)"
        if c.covered_by:
            return f"{head} -> profuse's {c.covered_by} fuses it"
        return f"{head}: no profuse op covers it yet" + (f" ({c.note})" if c.note else "")


# --- reading the trace ----------------------------------------------------------------------------


@dataclass(eq=False)
class Span:
    """A complete ('X') event of the Chrome trace, with what nesting tells about it."""

    name: str
    cat: str
    ts: float  # us
    end: float  # us
    args: dict
    child_us: float = 0.0
    parents: tuple[Span, ...] = ()  # the host ranges open around it, innermost first

    @property
    def self_us(self) -> float:
        return max(self.end - self.ts - self.child_us, 0.0)


class _Windows:
    """Sorted, non-overlapping time windows; `find(t)` is the index of the one holding t, or -1."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: s.ts)
        self._starts = [s.ts for s in self.spans]

    def find(self, t: float) -> int:
        i = bisect.bisect_right(self._starts, t) - 1
        return i if i >= 0 and t <= self.spans[i].end else -1

    def __len__(self) -> int:
        return len(self.spans)


class _Covered:
    """The union of some spans' time (nested or overlapping); `holds(t)` is whether t is in it."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.intervals = union((s.ts, s.end) for s in spans)
        self._starts = [a for a, _ in self.intervals]

    def holds(self, t: float) -> bool:
        i = bisect.bisect_right(self._starts, t) - 1
        return i >= 0 and t <= self.intervals[i][1]


def _nest(spans: list[Span]) -> None:
    """Fill child_us and parents for host-side spans, thread by thread, as the profiler nests them."""
    by_thread: dict[tuple, list[Span]] = defaultdict(list)
    for s in spans:
        if s.cat in HOST_CATS or s.cat in _LAUNCH_CATS:
            by_thread[(s.args.get("_pid"), s.args.get("_tid"))].append(s)
    for thread_spans in by_thread.values():
        thread_spans.sort(key=lambda s: (s.ts, -(s.end - s.ts)))
        stack: list[Span] = []
        for s in thread_spans:
            while stack and stack[-1].end <= s.ts:
                stack.pop()
            if stack:
                parent = stack[-1]
                parent.child_us += min(s.end, parent.end) - s.ts
                s.parents = tuple(reversed(stack))
            stack.append(s)


def read_spans(trace: dict | list) -> list[Span]:
    """The complete events of a Chrome trace, host ranges nested thread by thread."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = []
    for e in events:  # keep pid and tid with the args, for nesting
        if e.get("ph") != "X" or "ts" not in e:
            continue
        ts = float(e["ts"])
        args = dict(e.get("args") or {})
        args["_pid"], args["_tid"] = e.get("pid"), e.get("tid")
        spans.append(
            Span(str(e.get("name", "")), str(e.get("cat", "")), ts, ts + float(e.get("dur", 0.0)), args)
        )
    _nest(spans)
    return spans


def event_rows(
    spans: list[Span], device: str, limit: int
) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    """(work rows, host rows), each (name, self us, calls) over every profiled step, most first,
    read from the trace's spans without the profiler's own grouping (key_averages, the costliest
    part of reading a profile). Work: on "cuda" each kernel, copy and fill by name and its device
    time; on "cpu" the host rows. Host: each host range, op and runtime call by name and its self
    CPU time (its own less what nests inside it: the Python between a range's ops lands on it);
    the steps' ranges are grouped as one, "ProfilerStep*", as key_averages groups them."""
    host: dict[str, list[float]] = {}
    work: dict[str, list[float]] = {}
    for s in spans:
        if s.cat in HOST_CATS or s.cat in _LAUNCH_CATS:
            name = "ProfilerStep*" if s.name.startswith(STEP_PREFIX) else s.name
            row = host.setdefault(name, [0.0, 0])
            row[0] += s.self_us
            row[1] += 1
        elif s.cat in _DEVICE_BUSY_CATS:
            row = work.setdefault(s.name, [0.0, 0])
            row[0] += s.end - s.ts
            row[1] += 1

    def top(rows: dict[str, list[float]]) -> list[tuple[str, float, int]]:
        ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
        return [(name, us, int(n)) for name, (us, n) in ranked[:limit] if us > 0]

    host_rows = top(host)
    return (top(work) if device == "cuda" else host_rows), host_rows


@dataclass
class _Place:
    """Where a piece of work ran: the module roles around it (innermost first), its phase, and
    whether it is autograd summing gradients."""

    roles: tuple[str, ...] = ()
    backward: bool = False
    accumulation: bool = False


class _Structure:
    """Places work by the profuse.module ranges around it, or around the forward op that made
    the backward node it runs in (matched by autograd's sequence number)."""

    def __init__(self, host: list[Span]) -> None:
        self.found = any(s.name.startswith(RANGE_PREFIX) for s in host)
        self.made_by: dict[object, tuple[str, ...]] = {}  # sequence number -> the forward op's roles
        self.rope = False
        # The op that made a node is the last to report its sequence number: the counter moves on
        # when the node is made, and ops that make none report the number the next one will take.
        for s in sorted(host, key=lambda s: s.ts):
            seq = s.args.get("Sequence number")
            if s.cat != "cpu_op" or seq is None or s.name.startswith(_BACKWARD_NODE):
                continue
            roles = _roles(s.parents)
            if any(p.name.startswith(_BACKWARD_NODE) for p in s.parents):
                continue  # an op run by a backward node (double backward): not a forward op
            self.made_by[seq] = roles
            if roles and (roles[0] == "rotary" or (roles[0] == "attention" and s.name in _ROPE_OPS)):
                self.rope = True
        self.rope = self.rope or any(role_of_range(s.name) == "rotary" for s in host)

    def place(self, chain: tuple[Span, ...]) -> _Place:
        """`chain`: a host op and the ranges open around it, innermost first."""
        for i, s in enumerate(chain):
            if s.name.startswith(_BACKWARD_NODE):
                accumulation = "AccumulateGrad" in s.name or (i == 1 and chain[0].name in _ENGINE_ADD)
                roles = self.made_by.get(s.args.get("Sequence number"), ())
                return _Place(roles, backward=True, accumulation=accumulation)
            if s.name.startswith(RANGE_PREFIX):
                return _Place(_roles(chain[i:]))
            if s.name == BACKWARD:
                return _Place(backward=True)
        return _Place()

    def candidate(self, place: _Place, op: str) -> str:
        """The candidate memory-bound work of `op` (an op name) at `place` belongs to."""
        if place.accumulation:
            return GRAD_ACCUMULATION
        copy = _COPY_OPS.search(op.lower()) is not None
        role = place.roles[0] if place.roles else None
        if role in NORM_ROLES:  # a norm's casts are its own (HF norms compute in fp32)
            return QK_NORM if "attention" in place.roles[1:] else RESIDUAL_NORM
        if role == "rotary":
            return ROTARY
        if role == "experts" and not copy:  # data movement is routing (_moe_category)
            return EXPERTS_ACTIVATION
        if copy:
            return COPIES
        if role == "layer":  # elementwise work of a decoder layer outside its modules: the residual adds
            return RESIDUAL_NORM
        if role == "mlp":
            return ACTIVATION_MUL
        if role == "attention":
            return ROTARY if self.rope else ATTENTION_ELEMENTWISE
        return UNPLACED


# Inside an MoE's experts: the ops that move tokens (to their experts and back) rather than compute
# on them.
_MOVES_TOKENS = re.compile(
    r"index|gather|scatter|sort|histc|cumsum|one_hot|nonzero|where|bincount|copy|clone|contiguous"
    r"|_to_copy|aten::to$|cat|stack|repeat|expand|permute|zero|fill|empty|select|slice|split|view"
    r"|aten::sum$"  # the combine: each token's k weighted outputs summed (and the eager loop's hit count)
)


def _moe_category(cat: str, place: _Place, op: str) -> str:
    """`cat`, or routing where `op` at `place` is a mixture of experts' routing: all of its
    router's work and its MoE block's own (but matmuls), its experts' token moves."""
    role = next((r for r in place.roles if r in MOE_ROLES or r in ("mlp", "attention")), None)
    if role not in MOE_ROLES or cat in ("matmul", "optimizer", "attention", "loss") or place.accumulation:
        return cat
    if role == "experts" and not _MOVES_TOKENS.search(op.lower()):
        return "memory_bound" if cat == "routing" else cat  # the experts' elementwise math
    return "routing"


def _roles(spans: Iterable[Span]) -> tuple[str, ...]:
    return tuple(r for r in (role_of_range(s.name) for s in spans) if r is not None)


def analyze_trace(
    trace: dict | list,
    device: str = "cpu",
    extra_rules: tuple[tuple[str, str], ...] = (),
    regions: Iterable[str] = (),
) -> TraceSummary:
    """Where the profiled steps' time went, read from a Chrome trace written by torch.profiler.

    device "cpu": self CPU time of every host range inside a ProfilerStep span (aten operators,
    autograd nodes, and the Python between them, which lands on the ranges around it: the step,
    a module's or the user's). device "cuda": device time of every kernel launched inside a
    ProfilerStep span, matched to its launch through the correlation id.

    extra_rules: (category, pattern) pairs tried before CATEGORY_RULES; their categories join the
    shares before "other" (profuse.distributed adds "communication").

    regions: names of record_function ranges (profuse.fusion labels the block ops so); the summary's
    region_pct gives each one's share of the same time, forward and backward: what runs inside the
    range, and the backward nodes made by the operators inside it (matched by sequence number).
    The user's own ranges are found without asking (label_pct).
    """
    return analyze_spans(read_spans(trace), device, extra_rules, regions)


def analyze_spans(
    spans: list[Span],
    device: str = "cpu",
    extra_rules: tuple[tuple[str, str], ...] = (),
    regions: Iterable[str] = (),
) -> TraceSummary:
    """analyze_trace over a trace's spans as read_spans gives them (read once, read for more)."""
    extra = tuple((cat, re.compile(pat)) for cat, pat in extra_rules)
    rules = extra + _RULES
    categories = extend_categories(extra_rules)

    host = [s for s in spans if s.cat in HOST_CATS]
    steps = _Windows(s for s in host if s.name.startswith(STEP_PREFIX))
    if not steps:
        raise RuntimeError("the trace holds no ProfilerStep span: was prof.step() called?")
    optimizer = _Covered(s for s in host if s.name == OPTIMIZER or s.name.startswith(_TORCH_OPTIMIZER_RANGES))
    structure = _Structure(host)
    labels = _user_labels(host, steps)
    region_of = _regions(host, tuple(dict.fromkeys((*regions, *labels))))

    time_by_region: dict[str, float] = dict.fromkeys((*regions, *labels), 0.0)
    time_by_cat: dict[str, float] = dict.fromkeys(categories, 0.0)
    time_by_phase = dict.fromkeys((FORWARD, BACKWARD, OPTIMIZER), 0.0)
    memory_groups: Counter[str] = Counter()
    by_candidate: dict[str, Counter[str]] = defaultdict(Counter)
    norm_roles: set[str] = set()
    launches = 0
    gpu_idle_pct = None

    def count(
        us: float, cat: str, chain: tuple[Span, ...], op: str, t: float, engine_us: float = 0.0
    ) -> None:
        """`engine_us`: the part of `us` autograd's engine spent between backward nodes."""
        place = structure.place(chain)
        cat = _moe_category(cat, place, op)
        time_by_cat[cat] += us
        phase = OPTIMIZER if optimizer.holds(t) else BACKWARD if place.backward else FORWARD
        time_by_phase[phase] += us - engine_us
        time_by_phase[BACKWARD] += engine_us
        if cat == "memory_bound":
            memory_groups[op] += us
            name = structure.candidate(place, op)
            by_candidate[name][op] += us
            if name == RESIDUAL_NORM:  # which norms: add_rms_norm fuses RMSNorm only
                norm_roles.update(r for r in place.roles if r in NORM_ROLES)
        elif cat == "loss":
            by_candidate[LOSS][op] += us
        elif cat == "routing":
            by_candidate[ROUTING][op] += us
        elif cat == "optimizer":
            by_candidate[OPTIMIZER_WORK][op] += us
        region = _region(chain, region_of) if region_of else None
        if region is not None:
            time_by_region[region] += us

    if device == "cuda":
        basis, unit = "GPU kernel time", "kernels"
        launch_of: dict = {}
        for s in spans:
            if s.cat in _LAUNCH_CATS and "correlation" in s.args:
                launch_of.setdefault(s.args["correlation"], s)
        for k in spans:
            if k.cat != "kernel":
                continue
            launch = launch_of.get(k.args.get("correlation"))
            t_launch = launch.ts if launch is not None else k.ts
            if steps.find(t_launch) < 0:
                continue
            launches += 1
            ops = tuple(p for p in launch.parents if p.cat in HOST_CATS) if launch is not None else ()
            cat = _kernel_category(k.name, list(ops), optimizer.holds(t_launch), rules)
            count(k.end - k.ts, cat, ops, _kernel_group(k.name, list(ops)), t_launch)
        gpu_idle_pct = _idle_pct(steps, [s for s in spans if s.cat in _DEVICE_BUSY_CATS])
    else:
        basis, unit = "self CPU time", "operators"
        engine = _engine_time(host)
        for s in host:
            if steps.find(s.ts) < 0:
                continue
            launches += s.name.startswith("aten::")
            if optimizer.holds(s.ts):
                cat = "optimizer"
            elif s.cat != "cpu_op":  # a range's own time is Python's: not any op's
                cat = categorize(s.name, extra) if extra else "other"
            else:
                cat = _inherited(s.parents, rules) or categorize(s.name, rules)
            count(s.self_us, cat, (s, *s.parents), s.name, s.ts, engine.get(id(s), 0.0))

    total = sum(time_by_cat.values())
    if total <= 0:
        raise RuntimeError(f"the trace holds no {basis} inside its ProfilerStep spans")
    pct = lambda us: 100.0 * us / total
    candidates = []
    for name, ops in by_candidate.items():
        covered, note = _covered_by(name, ops, norm_roles)
        top = {op: pct(us) for op, us in ops.most_common(5)}
        candidates.append(Candidate(name, pct(sum(ops.values())), covered, top, note))
    candidates = sorted((c for c in candidates if c.pct > 0), key=lambda c: c.pct, reverse=True)
    label_pct = {r: pct(time_by_region[r]) for r in labels}
    return TraceSummary(
        steps=len(steps),
        basis=basis,
        total_us=total,
        shares={c: pct(time_by_cat[c]) for c in categories},
        launches_per_step=launches / len(steps),
        launch_unit=unit,
        gpu_idle_pct=gpu_idle_pct,
        memory_bound_groups={name: pct(t) for name, t in memory_groups.most_common()},
        tail_pct=sum(c.pct for c in candidates if c.covered_by),
        region_pct={r: pct(time_by_region[r]) for r in regions},
        candidates=candidates,
        phase_pct={p: pct(us) for p, us in time_by_phase.items()},
        label_pct=dict(sorted(label_pct.items(), key=lambda kv: kv[1], reverse=True)),
        structured=structure.found,
    )


# Ranges that are not the user's labels: the profiler's steps, torch's, profuse's own.
_NOT_LABELS = (
    STEP_PREFIX,
    RANGE_PREFIX,
    "Optimizer.",
    "profuse.",
    "##",
    "autograd::",
    "DistributedDataParallel",
)
MAX_LABELS = 8  # the user's ranges reported, largest first


def _user_labels(host: list[Span], steps: _Windows) -> tuple[str, ...]:
    """The names of the user's own record_function ranges inside the steps (not the phases')."""
    names: Counter[str] = Counter()
    for s in host:
        if s.cat != "user_annotation" or s.name.startswith(_NOT_LABELS) or steps.find(s.ts) < 0:
            continue
        if s.name in (FORWARD, BACKWARD, OPTIMIZER):
            continue
        names[s.name] += s.end - s.ts
    return tuple(name for name, _ in names.most_common(MAX_LABELS))


def _engine_time(host: list[Span]) -> dict[int, float]:
    """id(span) -> the part of its self time autograd's engine spent between the backward nodes
    it runs (the span that called backward(): a step's own, or a range around it), so that the
    backward's phase holds the engine's time whether or not a range names it."""
    nodes: dict[int, list[Span]] = defaultdict(list)
    by_id: dict[int, Span] = {}
    for s in host:
        if (
            s.name.startswith(_BACKWARD_NODE)
            and s.parents
            and not s.parents[0].name.startswith(_BACKWARD_NODE)
        ):
            nodes[id(s.parents[0])].append(s)
            by_id[id(s.parents[0])] = s.parents[0]
    if not nodes:
        return {}
    children: dict[int, list[Span]] = defaultdict(list)
    for s in host:
        if s.parents and id(s.parents[0]) in nodes:
            children[id(s.parents[0])].append(s)
    out = {}
    for key, run in nodes.items():
        window = [(min(n.ts for n in run), max(n.end for n in run))]
        busy = union((c.ts, c.end) for c in children[key])
        out[key] = total_length(window) - total_length(intersect(window, busy))
    return out


def _inherited(parents: Iterable[Span], rules: Rules) -> str | None:
    """The category the outermost aten operator around an op passes on to it (see _INHERITED)."""
    found = None
    for p in parents:
        if p.cat == "cpu_op" and p.name.startswith("aten::"):
            cat = categorize(p.name, rules)
            if cat in _INHERITED:
                found = cat
    return found


def _regions(host: list[Span], names: tuple[str, ...]) -> dict[int, str]:
    """id(span) -> region, for the spans that open a region: the named ranges themselves, and the
    backward nodes whose sequence number is that of an operator run inside one of them."""
    if not names:
        return {}
    wanted = set(names)
    roots = {id(s): s.name for s in host if s.name in wanted}
    made_by: dict[object, str | None] = {}  # sequence number -> the region of the op that made its node
    for s in sorted(host, key=lambda s: s.ts):  # the last op to report a number made the node
        seq = s.args.get("Sequence number")
        if seq is None or s.name.startswith(_BACKWARD_NODE) or s.cat != "cpu_op":
            continue
        if any(p.name.startswith(_BACKWARD_NODE) for p in s.parents):
            continue
        made_by[seq] = _region((s, *s.parents), roots)
    for s in host:
        if s.name.startswith(_BACKWARD_NODE):
            region = made_by.get(s.args.get("Sequence number"))
            if region is not None:
                roots[id(s)] = region
    return roots


def _region(spans: Iterable[Span], roots: dict[int, str]) -> str | None:
    """The region of the innermost of `spans` (a span, then the ranges open around it) that opens one."""
    for s in spans:
        region = roots.get(id(s))
        if region is not None:
            return region
    return None


def extend_categories(extra_rules: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """CATEGORIES with the categories of `extra_rules` that are new, in their order, before "other"."""
    new = tuple(dict.fromkeys(cat for cat, _ in extra_rules if cat not in CATEGORIES))
    return CATEGORIES[:-1] + new + CATEGORIES[-1:]


def _kernel_category(kernel: str, ops: list[Span], in_optimizer: bool, rules: Rules = _RULES) -> str:
    if in_optimizer:
        return "optimizer"
    inherited = _inherited(ops[1:], rules) if ops else None  # the launching op's own name comes below
    if inherited is not None:
        return inherited
    cat = categorize(kernel, rules)
    if cat != "other":
        return cat
    for op in ops:  # innermost first: the operator that launched it, then the ones around that
        cat = categorize(op.name, rules)
        if cat != "other":
            return cat
    return "other"


def _kernel_group(kernel: str, ops: list[Span]) -> str:
    """Group kernels by the aten op that launched them (aten::mul); else by the kernel's short name."""
    for op in ops:
        if op.name.startswith("aten::"):
            return op.name
    short = kernel.removeprefix("void ").split("<", 1)[0].split("(", 1)[0]
    return short[:60]


def _idle_pct(steps: _Windows, busy: list[Span]) -> float:
    """% of the step spans during which no kernel, memcpy or memset ran on the GPU."""
    window_us = sum(s.end - s.ts for s in steps.spans)
    busy_us = 0.0
    for step in steps.spans:
        inside = (
            (max(b.ts, step.ts), min(b.end, step.end)) for b in busy if b.end > step.ts and b.ts < step.end
        )
        for start, end in union(inside):
            busy_us += end - start
    return 100.0 * max(window_us - busy_us, 0.0) / window_us if window_us > 0 else 0.0


# --- time intervals on a timeline -------------------------------------------------------------

Intervals = list[tuple[float, float]]  # sorted, disjoint (start, end) in us


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """The union of (start, end) intervals, as sorted disjoint ones; empty ones are dropped."""
    merged: Intervals = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Where two lists of sorted, disjoint intervals overlap."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total_length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)
