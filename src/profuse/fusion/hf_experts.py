"""The MLP places of a mixture-of-experts Hugging Face model, fused by structure: the experts'
act(gate) * up, and every dense SiLU MLP beside them (Qwen2-MoE's shared expert, the dense layers
of a dense-then-MoE stack).

In transformers 5.x an MoE layer's experts are one module holding 3-D weights,

    gate_up_proj  (experts, 2I, H)   [gate; up] concatenated along 2I (transposed: (experts, H, 2I))
    down_proj     (experts, H, I)                                     (transposed: (experts, I, H))

whose forward (transformers' `use_experts_implementation`) runs the implementation the config
names: "eager", a loop over the experts hit, or "batched_mm" / "grouped_mm", one gathered or
grouped matmul over every (token, expert) pair. Each computes, per pair,

    out = down_e(act(g) * u),   [g | u] = gate_up_e(x)              (a = act(g) * u: one pass fused)

and batched_mm and grouped_mm call the class's `_apply_gate(gate_up)` for the activation. Fused,
the experts module's class is a subclass whose `_apply_gate` is silu_mul on the packed (S, 2I)
matmul output (its gradient comes back as one (S, 2I) tensor, as the matmul wants it), and whose
forward runs, for "eager", the same loop as transformers' with `_apply_gate` in place of the
inlined `act_fn(gate) * up`; for the other implementations probed, the class's own forward (which
calls the fused `_apply_gate`). The router is not touched: it computes top-k and the weights as
the model does, so the same experts are chosen. An implementation not probed here (deepgemm,
sonicmoe, one registered by the user) runs the class's own math: the fused `_apply_gate` hands
back to the original for it.

A dense MLP that the decoder layer does not call as its `mlp` (a shared expert inside the MoE
block, or a dense layer's MLP in a stack whose other layers are MoE) gets a fused class whose
forward is down(silu_mul(gate(x), up(x))). A packed one, one Linear H -> 2I beside one I -> H and
an activation module (GraniteMoeShared's shared_mlp: input_linear, activation, output_linear),
gets out(silu_mul(in(x))) on the packed [gate | up] halves, once a float64 stand-in of its class
is seen to compute exactly that, in train and eval mode; otherwise it is left unfused, in one line.

Probes, on float64 stand-ins (CPU, small widths, the module's own expert count and flags): the
experts class's `_apply_gate` must compute silu(g) * u on the concatenated halves (gpt-oss's
interleaved, clamped, biased `(u + 1) * g * sigmoid(alpha * g)` does not: blockops.clamped_swiglu
computes it, and its place waits for a fuse op of its own); then, for each implementation, the
fused forward against the class's own, in eval mode under no_grad and in train mode with the
gradients of the input, the routing weights and the expert weights. A dense MLP passes
hf_layer.probe_mlp. A place that fails is left unfused with its reason. At each call a place runs
fused only where its act_fn is still the one probed (hf_modules.runs_as); else the class's own
math.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from profuse import blockops
from profuse.errors import UnsupportedModel
from profuse.fusion.gpt import CLAMPED_SWIGLU, SILU_MUL
from profuse.fusion.hf_layer import PROBE_TOL, probe_mlp
from profuse.fusion.hf_modules import STATE, forward_owner, fused_class, fused_target, runs_as, stand_in

# The implementations whose forward is probed here: "eager" runs profuse's loop, the others their
# own forward with the fused `_apply_gate` (transformers 5.x's integrations.moe calls it in both).
PROBED_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
_EAGER = "eager"


@dataclass(frozen=True)
class ExpertsState:
    """What a fused experts module calls: its gate's op (silu_mul, or clamped_swiglu with the
    module's alpha and limit), the classes probed, the implementations whose forward was seen to
    give the class's own output with it."""

    gate: Callable
    kind: str  # SILU_MUL or CLAMPED_SWIGLU: which op `gate` is
    owner: type  # the experts class, whose forward and _apply_gate are the unfused math
    act_cls: type | None  # the act_fn's class (silu_mul); None for clamped_swiglu (no act_fn)
    implementations: tuple[str, ...]
    not_fused: tuple[str, ...] = ()  # "implementation: why" for each probed one that runs unfused


@dataclass(frozen=True)
class MlpState:
    """What a fused dense MLP calls."""

    silu_mul: Callable
    owner: type
    act_cls: type


@dataclass(frozen=True)
class PackedMlpState:
    """What a fused packed MLP calls: its children's names (the H -> 2I and I -> H Linears, the
    activation module) and the activation's class probed."""

    silu_mul: Callable
    owner: type
    act_cls: type
    up: str
    down: str
    act: str


# --------------------------------------------------------------------------------------------
# The fused forwards
# --------------------------------------------------------------------------------------------


def _implementation(module: nn.Module) -> str:
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return _EAGER if impl is None else impl


def _act_runs_as(module: nn.Module, act_cls: type) -> bool:
    act = getattr(module, "act_fn", None)
    return type(act) is act_cls and (not isinstance(act, nn.Module) or runs_as(act, act_cls))


def _fuses(module: nn.Module, st: ExpertsState) -> bool:
    if _implementation(module) not in st.implementations:
        return False
    if st.kind == CLAMPED_SWIGLU:  # alpha and limit are read at each call
        return all(isinstance(getattr(module, k, None), (int, float)) for k in ("alpha", "limit"))
    return _act_runs_as(module, st.act_cls)


def apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """The fused experts' activation from the packed (S, 2I) gate_up, one pass: silu(g) * u on
    its halves, or gpt-oss's (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(g, limit), on its interleaved columns."""
    st: ExpertsState = self.__dict__[STATE]
    if _fuses(self, st):
        # gate_up is the up projection's own output in every probed implementation, saved by
        # nothing (a matmul's backward reads its input and weight): the backward may write its
        # gradient over it (owned), one (S, 2I) buffer fewer at the step's peak.
        if st.kind == CLAMPED_SWIGLU:
            return st.gate(
                gate_up,
                alpha=float(self.alpha),
                limit=float(self.limit),
                interleaved=not getattr(self, "is_concatenated", True),
                owned=True,
            )
        return st.gate(gate_up, owned=True)
    return st.owner._apply_gate(self, gate_up)


def experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """The fused experts: transformers' eager loop with the fused `_apply_gate` for "eager", the
    class's own forward (which calls it) for the others."""
    st: ExpertsState = self.__dict__[STATE]
    if _implementation(self) == _EAGER and _fuses(self, st) and not args and not kwargs:
        return eager_experts(self, hidden_states, top_k_index, top_k_weights)
    return st.owner.forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:  # w is (in, out)
        out = x @ w
        return out if b is None else out + b
    return F.linear(x, w, b)


def eager_experts(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' eager experts loop, its activation through `self._apply_gate`:
    out[t] = sum over the k experts e of t of w[t, k] * down_e(gate(gate_up_e(x[t])))."""
    n = self.num_experts
    transposed = bool(getattr(self, "is_transposed", False))
    bias = bool(getattr(self, "has_bias", False))
    out = torch.zeros_like(hidden_states)  # (T, H)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)  # (experts + 1, k, T)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == n:  # the expert-parallel sentinel: no expert here
            continue
        k_pos, token = torch.where(mask[e])
        x = hidden_states[token]  # (tokens of e, H)
        gate_up = _linear(x, self.gate_up_proj[e], self.gate_up_proj_bias[e] if bias else None, transposed)
        y = _linear(
            self._apply_gate(gate_up), self.down_proj[e], self.down_proj_bias[e] if bias else None, transposed
        )
        y = y * top_k_weights[token, k_pos, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def packed_mlp_forward(self, x):
    """A fused packed MLP: down(silu_mul(up(x))) on the [gate | up] halves, or its own forward
    where its activation module changed."""
    st: PackedMlpState = self.__dict__[STATE]
    act = self._modules.get(st.act)
    if type(act) is st.act_cls and runs_as(act, st.act_cls):
        return self._modules[st.down](st.silu_mul(self._modules[st.up](x)))
    return st.owner.forward(self, x)


def mlp_forward(self, x):
    """A fused dense MLP: down(silu_mul(gate(x), up(x))), or its own forward where its act_fn
    changed."""
    st: MlpState = self.__dict__[STATE]
    if _act_runs_as(self, st.act_cls):
        return self.down_proj(st.silu_mul(self.gate_proj(x), self.up_proj(x)))
    return st.owner.forward(self, x)


# --------------------------------------------------------------------------------------------
# Planning and probing (nothing is changed here)
# --------------------------------------------------------------------------------------------


def is_experts(module: nn.Module) -> bool:
    """An experts module by structure: 3-D gate_up_proj and down_proj parameters."""
    p = module._parameters
    return all(isinstance(p.get(k), torch.Tensor) and p[k].dim() == 3 for k in ("gate_up_proj", "down_proj"))


def _is_dense_mlp(module: nn.Module) -> bool:
    return all(isinstance(module._modules.get(k), nn.Linear) for k in ("gate_proj", "up_proj", "down_proj"))


def packed_mlp_children(module: nn.Module) -> tuple[str, str, str] | None:
    """(up, down, activation) children's names of a packed gated MLP by structure: exactly one
    Linear H -> 2I, one Linear I -> H and one module without parameters; None otherwise."""
    kids = dict(module.named_children())
    linears = {k: m for k, m in kids.items() if isinstance(m, nn.Linear)}
    others = [k for k, m in kids.items() if k not in linears and not any(True for _ in m.parameters())]
    if len(kids) != 3 or len(linears) != 2 or len(others) != 1:
        return None
    (a, la), (b, lb) = linears.items()
    for (up, lu), (down, ld) in (((a, la), (b, lb)), ((b, lb), (a, la))):
        if lu.out_features == 2 * ld.in_features and ld.out_features == lu.in_features:
            return up, down, others[0]
    return None


@dataclass
class ExpertsPlan:
    """The MLP places of an MoE stack: (module, fused class, state) to install, places by op, and
    the reasons for places left unfused, by op (one line per kind of failure)."""

    installs: list[tuple[nn.Module, type, object]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, list[str]] = field(default_factory=dict)

    def refuse(self, op: str, why: str) -> None:
        self.reasons.setdefault(op, []).append(why)


class _Refused(UnsupportedModel):
    """A place that cannot be fused, and the op it is the place of."""

    def __init__(self, op: str, why: str):
        super().__init__(why)
        self.op = op


def has_experts(stack: nn.Module) -> bool:
    return any(is_experts(m) for m in stack.modules())


def has_clamped_experts(stack: nn.Module) -> bool:
    """Experts with gpt-oss's clamped gate (an alpha and a limit): clamped_swiglu's places."""
    return any(is_experts(m) and hasattr(m, "alpha") and hasattr(m, "limit") for m in stack.modules())


def plan_experts(stack: nn.Module, silu_mul: Callable | None, clamped_swiglu: Callable | None) -> ExpertsPlan:
    """The experts modules and the dense MLPs of the stack's layers, each probed by class, for the
    ops given (None: not asked for); the layer's own MLP place (hf_layer) is not fused here."""
    plan = ExpertsPlan()
    ops = {SILU_MUL: silu_mul, CLAMPED_SWIGLU: clamped_swiglu}
    checked: dict[type, object] = {}  # class -> (op, target, state), None (not asked) or _Refused
    first_of: dict[type, nn.Module] = {}  # class -> its first module (where its notes are said)
    for name, module in stack.layers.named_modules():
        if is_experts(module):
            kind = "experts"
        elif _is_dense_mlp(module) and silu_mul is not None:
            kind = "mlp"
        elif silu_mul is not None and not isinstance(module, nn.Linear) and packed_mlp_children(module):
            kind = "packed"
        else:
            continue
        cls = type(module)
        first_of.setdefault(cls, module)
        if cls not in checked:
            try:
                if kind == "experts":
                    found = _probe_experts(module, ops, f"layer {name}")
                elif kind == "packed":
                    found = _probe_packed_mlp(module, silu_mul, f"layer {name}")
                else:
                    owner, act, activation = probe_mlp(module, f"layer {name}")
                    if activation != "silu":
                        raise UnsupportedModel(
                            f"layer {name} ({cls.__name__}) is a {activation} MLP: beside experts, "
                            "dense MLPs fuse SiLU only"
                        )
                    found = SILU_MUL, owner, MlpState(silu_mul, owner, act)
                if found is not None:
                    op, owner, state = found
                    make = {"experts": _experts_class, "mlp": _mlp_class, "packed": _packed_mlp_class}[kind]
                    target = fused_target(module, owner, make(owner))
                    if target is None:
                        raise _Refused(
                            op, f"{cls.__name__} is derived from {owner.__name__} with a forward of its own"
                        )
                    found = op, target, state
                checked[cls] = found
            except UnsupportedModel as e:
                checked[cls] = e if isinstance(e, _Refused) else _Refused(SILU_MUL, str(e))
                plan.refuse(checked[cls].op, str(e))
        found = checked[cls]
        if found is None or isinstance(found, _Refused):
            continue
        op, target, state = found
        if "forward" in module.__dict__:
            plan.refuse(op, f"layer {name} ({cls.__name__}) has a forward of its own")
            continue
        if kind == "experts" and state.not_fused and module is first_of[cls]:
            plan.refuse(
                op, f"layer {name} ({cls.__name__}) runs its own math under " + "; ".join(state.not_fused)
            )
        plan.installs.append((module, target, state))
        plan.counts[op] = plan.counts.get(op, 0) + 1
    return plan


def _experts_class(owner: type) -> type:
    return fused_class(owner, "experts", experts_forward, {"_apply_gate": apply_gate})


def _mlp_class(owner: type) -> type:
    return fused_class(owner, "mlp", mlp_forward)


def _packed_mlp_class(owner: type) -> type:
    return fused_class(owner, "packed_mlp", packed_mlp_forward)


def _probe_packed_mlp(mlp: nn.Module, silu_mul: Callable, where: str):
    """(SILU_MUL, class, state) once the packed MLP's class computes down(silu(g) * u),
    [g | u] = up(x), on a float64 stand-in in eval and train mode; UnsupportedModel otherwise."""
    up, down, act_name = packed_mlp_children(mlp)
    cls = forward_owner(type(mlp))
    name = type(mlp).__name__
    if type(mlp) is not cls or "forward" in mlp.__dict__:
        raise UnsupportedModel(f"{where} ({name}) runs a forward other than its class's")
    act = mlp._modules[act_name]
    h, i = 8, 11
    with torch.random.fork_rng():
        torch.manual_seed(3)
        lu, ld = nn.Linear(h, 2 * i, dtype=torch.float64), nn.Linear(i, h, dtype=torch.float64)
        x = 2 * torch.randn(5, h, dtype=torch.float64)
    want = ld(blockops.silu_mul_eager(lu(x)))
    model = stand_in(mlp, cls, {up: lu, down: ld, act_name: act})
    try:
        with torch.no_grad():
            got = [cls.forward(model.train(training), x) for training in (False, True)]
    except Exception as e:
        raise UnsupportedModel(f"{where} ({name}) could not be checked: {e}") from None
    if not all(_close(y, want.detach()) for y in got):
        raise UnsupportedModel(
            f"{where} ({name}) is a packed MLP ({up} -> {act_name} -> {down}) that does not compute "
            f"{down}(silu(gate) * up) on [gate | up] halves: only that fuses"
        )
    return SILU_MUL, cls, PackedMlpState(silu_mul, cls, type(act), up, down, act_name)


def _probe_experts(experts: nn.Module, ops: dict[str, Callable | None], where: str):
    """Check the experts class's activation (silu_mul's or clamped_swiglu's) and, per
    implementation, its forward fused against its own (float64 stand-ins, eval and train, with
    gradients); return (op, class, state), or None where that op was not asked for."""
    name = type(experts).__name__
    owner = forward_owner(type(experts))
    if type(experts) is not owner or "forward" in experts.__dict__:
        raise UnsupportedModel(f"{where} ({name}) run a forward other than their class's")
    gate = getattr(owner, "_apply_gate", None)
    config = getattr(experts, "config", None)
    if gate is None or not hasattr(config, "_experts_implementation"):
        raise UnsupportedModel(
            f"{where} ({name}) are not transformers' use_experts_implementation experts "
            "(transformers >= 5): profuse cannot tell which implementation runs"
        )
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        raise UnsupportedModel(f"{where} ({name}) are not gated experts without a post-expert norm")
    act = getattr(experts, "act_fn", None)
    n, h, i = experts.num_experts, 8, 12  # rows of 16-byte multiples in fp32: grouped_mm needs them
    transposed = bool(getattr(experts, "is_transposed", False))
    bias = bool(getattr(experts, "has_bias", False))
    k, tokens = min(2, n), 7
    shapes = {
        "gate_up_proj": (n, h, 2 * i) if transposed else (n, 2 * i, h),
        "down_proj": (n, i, h) if transposed else (n, h, i),
        **({"gate_up_proj_bias": (n, 2 * i), "down_proj_bias": (n, h)} if bias else {}),
    }
    with torch.random.fork_rng():
        torch.manual_seed(5)
        gate_up = torch.randn(5, 2 * i, dtype=torch.float64) * 3
        weights = {k: torch.randn(s, dtype=torch.float64) / 2 for k, s in shapes.items()}
        top_k_index = torch.stack([torch.randperm(n)[:k] for _ in range(tokens)])  # (T, k), distinct
        top_k_weights = torch.rand(tokens, k, dtype=torch.float64).softmax(-1)
        x = torch.randn(tokens, h, dtype=torch.float64)
    children = {"act_fn": act} if isinstance(act, nn.Module) else {}
    plain = stand_in(experts, owner, children, **{k: nn.Parameter(w) for k, w in weights.items()})
    try:
        with torch.no_grad():
            want = gate(plain, gate_up)
        kind = next((k for k, math in _gate_math(experts).items() if _close(want, math(gate_up))), None)
    except Exception as e:
        raise UnsupportedModel(f"{where} ({name}) could not be checked: {e}") from None
    if kind is None:
        raise UnsupportedModel(
            f"{where} ({name}) do not compute silu(gate) * up on [gate | up] halves, nor gpt-oss's "
            f"clamped gate (its act_fn is {type(act).__name__}): only those fuse"
        )
    if ops[kind] is None:
        return None
    act_cls = type(act) if kind == SILU_MUL else None

    fused = _experts_class(owner)
    implementations, failures = [], []
    for impl in PROBED_IMPLEMENTATIONS:
        cfg = copy.copy(config)
        cfg.__dict__["_experts_implementation_internal"] = impl  # the copy only: no sub-configs touched
        # float64, or float32 where the implementation takes no float64 (grouped_mm on the CPU)
        for dtype in (torch.float64, torch.float32):
            try:
                ok = _same_forward(
                    experts, owner, fused, cfg, children, weights, x, top_k_index, top_k_weights, dtype, kind
                )
                break
            except Exception as e:  # an implementation this torch or card cannot run: not fused for it
                ok = f"{impl}: {type(e).__name__}: {e}"
        if ok is True:
            implementations.append(impl)
        else:
            failures.append(ok or f"{impl}: differs")
    if not implementations:
        raise _Refused(
            kind,
            f"{where} ({name}) fused do not compute their own forward ({'; '.join(failures)}): "
            "profuse cannot fuse them exactly",
        )
    state = ExpertsState(ops[kind], kind, owner, act_cls, tuple(implementations), tuple(failures))
    return kind, owner, state


def _gate_math(experts: nn.Module) -> dict[str, Callable]:
    """The gates profuse fuses, as eager math on a packed gate_up: by op."""
    math = {SILU_MUL: blockops.silu_mul_eager}
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and limit > 0:
        interleaved = not getattr(experts, "is_concatenated", True)
        math[CLAMPED_SWIGLU] = lambda gu: blockops.clamped_swiglu_eager(
            gu, alpha=float(alpha), limit=float(limit), interleaved=interleaved
        )
    return math


def _same_forward(
    experts, owner, fused, cfg, children, weights, x, top_k_index, top_k_weights, dtype, kind
) -> bool:
    """The fused class's forward against the owner's on one stand-in of each, eval under no_grad
    and train with the gradients of (out * out).sum() for the input, the routing weights and every
    expert weight; the fused `_apply_gate` (eager math) must run."""
    calls = []

    math = _gate_math(experts)[kind]

    def counted(gate_up, owned=False, **kwargs):  # the module's alpha and limit: in `math` already
        calls.append(1)
        return math(gate_up)

    for train in (False, True):
        results = []
        for cls in (owner, fused):
            params = {k: nn.Parameter(w.to(dtype)) for k, w in weights.items()}
            module = stand_in(experts, cls, children, **params).train(train)
            module.config = cfg
            act_cls = type(getattr(experts, "act_fn", None)) if kind == SILU_MUL else None
            module.__dict__[STATE] = ExpertsState(
                counted, kind, owner, act_cls, (cfg._experts_implementation,)
            )
            xs = x.to(dtype).requires_grad_(train)
            ws = top_k_weights.to(dtype).requires_grad_(train)
            calls.clear()
            with torch.set_grad_enabled(train):
                out = module(xs, top_k_index, ws)
                got = [out.detach()]
                if train:
                    leaves = [xs, ws, *params.values()]
                    grads = torch.autograd.grad((out * out).sum(), leaves, allow_unused=True)
                    got += [torch.zeros_like(p) if d is None else d for p, d in zip(leaves, grads)]
            results.append(got)
        if not calls or not all(_close(a, b) for a, b in zip(results[1], results[0])):
            return False
    return True


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= PROBE_TOL * want.abs().max().clamp_min(1)
    )


__all__ = [
    "PROBED_IMPLEMENTATIONS",
    "ExpertsPlan",
    "ExpertsState",
    "MlpState",
    "PackedMlpState",
    "apply_gate",
    "eager_experts",
    "experts_forward",
    "has_clamped_experts",
    "has_experts",
    "is_experts",
    "mlp_forward",
    "packed_mlp_children",
    "packed_mlp_forward",
    "plan_experts",
]
