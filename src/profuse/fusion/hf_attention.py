"""Rotary embedding inside a Hugging Face attention, fused: rope, and Qwen3's qk_norm_rope.

The attention forward is the model's own, rebuilt once per class (hf_modules.rebuilt): the same
code and decorators, with a copy of its module's globals in which `apply_rotary_pos_emb` is
profuse's call site. Nothing of the forward is written again here, so its kwarg names, cache
handling and attention backends stay whatever the installed transformers has.

    rope(q, k, cos, sin)                                  q and k in one launch
    rope(q, k, cos, sin, interleaved=...)                 the lane pairs (x0, x1), (x2, x3), ...
                                                          rotated: GLM, GLM-4, Ernie 4.5 ("first_half"),
                                                          Cohere, Cohere 2 ("lanes")
    qk_norm_rope(q, k, w_q, w_k, cos, sin, eps)           Qwen3: q_norm and k_norm, then rope
    qk_norm_rope(..., eps, weight_offset=1.0)             Gemma 3: its (1 + w) q/k norms

For Qwen3 (and Gemma 3, whose norms run after the transpose: the same (B, H, T, D) views reach the
call site) the forward is rebuilt a second time with `self.q_norm` and `self.k_norm` renamed in
its code to a pass-through, so the per-head norms run inside qk_norm_rope instead (reading the
norm modules' weights and eps at the call).

The call site learns which attention calls it, and which op to run, from the cos it is handed:
the fused forward wraps position_embeddings' cos in a RotaryCarrier (the tensor, the module,
whether the norms are the site's to run), which the forward hands to apply_rotary_pos_emb
untouched. A carrier is made per call, so threads and torch.compile see no state. Where the
norms are not as the probe checked (replaced, wrapped, hooked), the forward rebuilt without the
rename runs (rope alone, the norms as modules); where the call is one the ops do not cover
(position_embeddings not given, extra arguments to apply_rotary_pos_emb), the model's own.

Which rotation the model's own apply_rotary_pos_emb computes (the halves, or the lane pairs with
their angles read either way) and whether it casts back to q's dtype are found by calling it on
small float64 stand-ins (_rope_form, _casts_back), never from its name; the attention's probe
then checks the whole forward with that form of rope in place.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from profuse import rotary
from profuse.errors import UnsupportedModel
from profuse.fusion.gpt import QK_NORM_ROPE, ROPE
from profuse.fusion.hf_layer import PROBE_TOL, NormSpec, probe_norm
from profuse.fusion.hf_modules import (
    ORIGINAL,
    PROBE_MODES,
    STATE,
    forward_owner,
    fused_class,
    fused_target,
    innermost,
    parameter_names,
    rebuilt,
    runs_as,
    seeded,
    stand_in,
)

ROPE_NAME = "apply_rotary_pos_emb"  # the module-level function every Llama-family attention calls
# An attention's output projection, under each name families give it (Llama, GPT-NeoX and Phi,
# GPT-J): the probe's stand-in maps the heads' width back to its small hidden size through it.
OUTPUT_PROJECTIONS = ("o_proj", "dense", "out_proj")
_PASS = "_profuse_pass"  # what q_norm and k_norm are renamed to in the qk_norm_rope forward
_ROPE_FORWARD, _QK_FORWARD = "_profuse_rope_forward", "_profuse_qk_forward"


class RotaryCarrier:
    """cos, on its way through an attention forward to profuse's apply_rotary_pos_emb, with the
    attention module and whether the site runs its q/k norms."""

    __slots__ = ("cos", "attention", "norms")

    def __init__(self, cos: torch.Tensor, attention: nn.Module, norms: bool):
        self.cos, self.attention, self.norms = cos, attention, norms


@dataclass(frozen=True)
class AttentionState:
    """What a fused attention calls: rope and qk_norm_rope (None where not fused), the q/k norm
    classes the probe checked, and where position_embeddings comes among the forward's arguments."""

    rope: Callable | None
    qk_norm_rope: Callable | None
    q_norm: NormSpec | None
    k_norm: NormSpec | None
    pe_index: int


def _site(module_globals: dict) -> Callable:
    """profuse's apply_rotary_pos_emb for the attention classes of one modeling module."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not isinstance(cos, RotaryCarrier):
            return module_globals[ROPE_NAME](q, k, cos, sin, *args, **kwargs)
        attention, norms, cos = cos.attention, cos.norms, cos.cos
        st: AttentionState = attention.__dict__[STATE]
        if norms:  # q and k come un-normalised, (B, H, T, D) views of (B, T, H, D)
            qn, kn = attention._modules["q_norm"], attention._modules["k_norm"]
            if not args and not kwargs:
                qt, kt = q.transpose(1, 2), k.transpose(1, 2)
                eps = st.q_norm.eps(qn)
                return st.qk_norm_rope(qt, kt, qn.weight, kn.weight, cos, sin, eps, **st.q_norm.kwargs())
            q, k = qn(q.transpose(1, 2)).transpose(1, 2), kn(k.transpose(1, 2)).transpose(1, 2)
        elif not args and not kwargs:
            return st.rope(q, k, cos, sin)
        return module_globals[ROPE_NAME](q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _norms_run_as(attention: nn.Module, st: AttentionState) -> bool:
    qn, kn = attention._modules.get("q_norm"), attention._modules.get("k_norm")
    return (
        runs_as(qn, st.q_norm.cls) and runs_as(kn, st.k_norm.cls) and st.q_norm.eps(qn) == st.k_norm.eps(kn)
    )


def attention_forward(self, *args, **kwargs):
    """The fused attention: its own forward, rebuilt with profuse's rotary call site."""
    cls = type(self)
    st: AttentionState = self.__dict__[STATE]
    norms = st.qk_norm_rope is not None and _norms_run_as(self, st)
    forward = (
        getattr(cls, _QK_FORWARD) if norms else getattr(cls, _ROPE_FORWARD) if st.rope is not None else None
    )
    if forward is not None:
        if "position_embeddings" in kwargs:
            kwargs = {**kwargs, "position_embeddings": _carried(kwargs["position_embeddings"], self, norms)}
            return forward(self, *args, **kwargs)
        i = st.pe_index
        if len(args) > i:
            return forward(self, *args[:i], _carried(args[i], self, norms), *args[i + 1 :], **kwargs)
    return getattr(cls, ORIGINAL).forward(self, *args, **kwargs)


def _carried(position_embeddings, attention: nn.Module, norms: bool):
    cos, sin = position_embeddings
    return RotaryCarrier(cos, attention, norms), sin


def attention_class(owner: type) -> type:
    """Fused<owner>, with its forward rebuilt around profuse's call site (and, where it normalises
    q and k, rebuilt a second time without the norms). Raises ValueError with the reason when the
    forward cannot be rebuilt."""
    inner = innermost(owner.forward)
    site = _site(inner.__globals__)
    rope_forward = rebuilt(owner.forward, {}, {ROPE_NAME: site})
    try:
        qk_forward = rebuilt(owner.forward, {"q_norm": _PASS, "k_norm": _PASS}, {ROPE_NAME: site})
    except ValueError:
        qk_forward = None  # no q_norm / k_norm in this forward: rope alone
    attrs = {_ROPE_FORWARD: rope_forward, _QK_FORWARD: qk_forward, _PASS: staticmethod(lambda x: x)}
    return fused_class(owner, "attention", attention_forward, attrs)


# --------------------------------------------------------------------------------------------
# Planning and probing (nothing is changed here)
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionPlan:
    """What fusing the attentions would install, and what it could not: `reasons` for ops with a
    place that cannot be fused exactly, `absent` for ops with no place in this model."""

    targets: list[type] | None  # each attention's fused class; None: nothing to fuse
    state: AttentionState | None
    counts: dict[str, int]
    reasons: dict[str, str]
    absent: dict[str, str]


def _out_features(m: nn.Module) -> int | None:
    n = getattr(m, "out_features", None)
    if isinstance(n, int):
        return n
    w = getattr(m, "weight", None)
    return w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _own_rope(owner: type):
    """The attention module's own apply_rotary_pos_emb: the one its forward's module calls."""
    return innermost(owner.forward).__globals__.get(ROPE_NAME)


def _rope_parameters(owner: type) -> str | None:
    """The parameters of the attention module's own apply_rotary_pos_emb where they show it rotates
    one tensor, not q and k: GPT-J's and CodeGen's (tensor, sin, cos), interleaved pairs, Gemma
    3n's (x, cos, sin); None where it may take (q, k, cos, sin, ...) (a hub-kernel wrapper's
    (*args, **kwargs) included: the probe decides), or the module has none (the rebuild says so)."""
    fn = _own_rope(owner)
    try:
        params = list(inspect.signature(inspect.unwrap(fn)).parameters.values()) if callable(fn) else None
    except (TypeError, ValueError):
        return None
    if not params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[:4]):
        return None
    names = [p.name for p in params[:4]]
    if len(names) == 4 and not {"cos", "sin"} & set(names[:2]):
        return None
    return ", ".join(p.name for p in params)


def plan_attention(
    attentions: list[nn.Module],
    rope: Callable | None,
    qk: Callable | None,
    what: str,
    rotary_dim: int | None = None,
    qk_offset: str | None = None,
    rope_keeps_dtype: bool = True,
    rope_pairs: bool = False,
) -> AttentionPlan:
    """Check what fusing rope (and qk_norm_rope) into `attentions` needs; change nothing.
    `rope`, `qk`: the ops to install, or None where not asked for. `rotary_dim`: the width of the
    cos the model's rotary module makes (below the head dim for partial rotary); None: the head dim.
    `qk_offset`: why `qk` cannot take (1 + w) norms (it takes no weight_offset), or None where it can.
    `rope_keeps_dtype`: whether `rope` takes keep_dtype=True (else a model whose rotation casts
    back to q's dtype gets rope's result cast, one pass more). `rope_pairs`: whether `rope` takes
    interleaved= (else a model that rotates lane pairs keeps its own rotation, with the reason)."""
    plan = AttentionPlan(None, None, {}, {}, {})
    wanted = [op for op, fn in ((ROPE, rope), (QK_NORM_ROPE, qk)) if fn is not None]
    if not wanted:
        return plan
    classes = {type(a) for a in attentions}
    name = "/".join(sorted(c.__name__ for c in classes))

    def refuse_all(reason: str) -> AttentionPlan:
        plan.reasons.update({op: reason for op in wanted})
        return plan

    if len(classes) != 1:
        return refuse_all(f"{what} mixes attention classes {name}")
    owner = forward_owner(classes.pop())
    params = parameter_names(owner.forward)
    if "position_embeddings" not in params:
        return refuse_all(f"{name}.forward takes no position_embeddings: not a Llama-family attention")
    takes = _rope_parameters(owner)
    if takes is not None:
        return refuse_all(f"{name}'s {ROPE_NAME} takes ({takes}), not rope's (q, k, cos, sin)")
    try:
        fused = attention_class(owner)
    except ValueError as e:
        return refuse_all(f"{name}.forward cannot be rebuilt with profuse's {ROPE_NAME}: {e}")
    targets = [fused_target(a, owner, fused) for a in attentions]
    if any(t is None for t in targets):
        return refuse_all(f"{name} is derived from {owner.__name__} by a class with a forward of its own")
    plan.targets = targets
    form = _rope_form(owner) if rope is not None or qk is not None else None
    if rope is not None and form not in (None, _HALVES):
        if rope_pairs:
            rope = _rotating_pairs(rope, form)
        else:
            plan.reasons[ROPE] = (
                f"{name}'s {ROPE_NAME} {_ROTATES_PAIRS}: this op set's rope takes no interleaved"
            )
            rope = None
    if rope is not None and (keep := _casts_back(owner, form)):
        rope = _keeping_dtype(rope, rope_keeps_dtype, keep)
    specs: tuple[NormSpec | None, NormSpec | None] = (None, None)
    if qk is not None:
        if getattr(fused, _QK_FORWARD) is None or not all(
            hasattr(a, "q_norm") and hasattr(a, "k_norm") for a in attentions
        ):
            plan.absent[QK_NORM_ROPE] = f"{name} has no per-head q_norm and k_norm"
            qk = None
        elif form not in (None, _HALVES):
            plan.reasons[QK_NORM_ROPE] = (
                f"{name}'s {ROPE_NAME} {_ROTATES_PAIRS}, where qk_norm_rope rotates each head's halves"
            )
            qk = None
        elif (whole := _whole_projection_norms(attentions)) is not None:
            plan.reasons[QK_NORM_ROPE] = (
                f"{name}'s q_norm and k_norm normalise the whole projection ({whole} lanes), not each "
                "head: qk_norm_rope normalises each head (rope still fuses after them)"
            )
            qk = None
        else:
            try:
                specs = _probe_qk_norms(attentions, name, qk_offset)
                _probe(
                    attentions[0],
                    fused,
                    params,
                    AttentionState(None, qk, *specs, params.index("position_embeddings")),
                    name,
                    rotary_dim,
                )
            except UnsupportedModel as e:
                plan.reasons[QK_NORM_ROPE] = str(e)
                qk, specs = None, (None, None)
    if rope is not None:
        try:
            _probe(
                attentions[0],
                fused,
                params,
                AttentionState(rope, None, None, None, params.index("position_embeddings")),
                name,
                rotary_dim,
            )
        except UnsupportedModel as e:
            plan.reasons[ROPE] = str(e)
            rope = None
    if rope is None and qk is None:
        plan.targets = None
        return plan
    plan.state = AttentionState(rope, qk, *specs, params.index("position_embeddings"))
    plan.counts = {QK_NORM_ROPE if qk is not None else ROPE: len(attentions)}
    return plan


def _whole_projection_norms(attentions: list[nn.Module]) -> int | None:
    """The q_norm's width where it normalises more than one head (OLMo 2's, over every head of
    the projection at once), else None."""
    for a in attentions:
        w = getattr(a.q_norm, "weight", None)
        try:
            d = _head_dim(a)
        except ValueError:
            return None
        if isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() != d:
            return w.numel()
    return None


def _probe_qk_norms(
    attentions: list[nn.Module], name: str, offset_why: str | None
) -> tuple[NormSpec, NormSpec]:
    """The q and k norms' specs, one class each across layers, one eps and one weight offset
    (Gemma 3's (1 + w) where the op takes it: `offset_why` says why not, else None)."""
    specs = set()
    for i, a in enumerate(attentions):
        q = probe_norm(a.q_norm, f"layer {i}'s q_norm")
        k = probe_norm(a.k_norm, f"layer {i}'s k_norm")
        if (q.offset or k.offset) and offset_why is not None:
            raise UnsupportedModel(f"{name}'s q_norm and k_norm scale by (1 + weight): {offset_why}")
        if q.offset != k.offset:
            raise UnsupportedModel(f"{name}'s q_norm and k_norm scale by different weight offsets")
        if q.eps(a.q_norm) != k.eps(a.k_norm):
            raise UnsupportedModel(f"{name}'s q_norm and k_norm use different eps: qk_norm_rope takes one")
        specs.add((q, k))
    if len(specs) != 1:
        raise UnsupportedModel(f"{name}'s q_norm and k_norm differ from layer to layer")
    return specs.pop()


def _projections(attention: nn.Module, c: int) -> dict[str, nn.Linear]:
    """float64 stand-ins for the attention's projections at hidden size `c`: the output projection
    (Llama's o_proj, GPT-NeoX's and Phi's dense, GPT-J's out_proj) maps the heads' width to c,
    every other Linear (q/k/v, or GPT-NeoX's packed query_key_value) c to its own width."""
    out = {}
    for key, m in attention.named_children():
        if not isinstance(m, nn.Linear):
            continue
        if key in OUTPUT_PROJECTIONS:
            out[key] = nn.Linear(_in_features(m), c, dtype=torch.float64)
        else:
            out[key] = nn.Linear(c, _out_features(m), dtype=torch.float64)
    if not any(key in OUTPUT_PROJECTIONS for key in out):
        raise ValueError(f"no output projection ({'/'.join(OUTPUT_PROJECTIONS)}) among its Linears")
    return out


def _in_features(m: nn.Module) -> int:
    w = m.weight
    return m.in_features if isinstance(getattr(m, "in_features", None), int) else w.shape[1]


def _head_dim(attention: nn.Module) -> int:
    """The attention's head dim, as Llama (head_dim) or GPT-NeoX (head_size) holds it."""
    for key in ("head_dim", "head_size"):
        d = getattr(attention, key, None)
        if isinstance(d, int):
            return d
    raise ValueError("it holds no head_dim")


def _probe(
    attention: nn.Module,
    fused: type,
    params: list[str],
    st: AttentionState,
    name: str,
    rotary_dim: int | None = None,
) -> None:
    """Run the attention class's own forward and the fused one on a float64 stand-in (small
    hidden size, the real heads and head_dim, the rotary width the model's rotary module makes,
    eager attention): raise unless the outputs agree and the fused op ran once a call."""
    owner = getattr(fused, ORIGINAL)
    norms = st.qk_norm_rope is not None
    op = "qk_norm_rope" if norms else "rope"
    calls = []

    def counted(fn):
        def call(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)

        return call

    try:
        c, f64 = 8, torch.float64
        d = _head_dim(attention)
        with torch.random.fork_rng():
            torch.manual_seed(3)
            children = dict(attention.named_children())
            children.update(_projections(attention, c))
            for key in ("q_norm", "k_norm"):  # float64 stand-ins, norms or not, wherever the model is
                if key in children:
                    real = children[key]  # per head (Qwen3) or over the whole projection (OLMo 2)
                    w = getattr(real, "weight", None)
                    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else (d,)
                    weight = nn.Parameter(1 + torch.randn(shape, dtype=f64) / 4)
                    children[key] = stand_in(real, forward_owner(type(real)), {}, weight=weight)
            x = torch.randn(2, 5, c, dtype=f64)
            angle = 3 * torch.randn(2, 5, rotary_dim or d, dtype=f64)
        attrs = {}
        config = getattr(attention, "config", None)
        if config is not None:
            config = copy.copy(config)
            config._attn_implementation = "eager"  # CPU and float64, whatever the model runs
            attrs["config"] = config
        model = stand_in(attention, fused, children, **attrs)
        probe_state = AttentionState(
            counted(st.rope) if st.rope else None,
            counted(st.qk_norm_rope) if norms else None,
            st.q_norm,
            st.k_norm,
            st.pe_index,
        )
        model.__dict__[STATE] = probe_state
        kwargs = {"hidden_states": x, "position_embeddings": (angle.cos(), angle.sin())}
        if "attention_mask" in params:
            kwargs["attention_mask"] = None
        ok, n = True, 0
        for training in PROBE_MODES:  # dropout in training: the same masks, kept by the rebuilt forward
            model.train(training)
            with torch.no_grad():
                with seeded(7):
                    want = owner.forward(model, **kwargs)[0]
                with seeded(7):
                    got = [attention_forward(model, **kwargs)[0]]
                if params[:2] == ["hidden_states", "position_embeddings"]:  # by position too
                    rest = {k: v for k, v in kwargs.items() if k not in params[:2]}
                    with seeded(7):
                        got.append(attention_forward(model, x, kwargs["position_embeddings"], **rest)[0])
            n += len(got)
            ok = ok and all(
                g.shape == want.shape and (g - want).abs().max() <= PROBE_TOL * want.abs().max() for g in got
            )
        ok = ok and len(calls) == n
    except Exception as e:  # a layout the stand-in does not fit
        raise UnsupportedModel(f"{name} could not be checked with {op} fused: {e}") from None
    if not ok:
        reached = "never called it" if not calls else "computed something else"
        raise UnsupportedModel(
            f"{name}'s forward rebuilt with {op} {reached}: profuse cannot fuse it exactly"
        )


def _casts_back(owner: type, form: str | None = None) -> bool | str:
    """Whether the attention module's own apply_rotary_pos_emb returns q in q's dtype where cos
    is wider (OLMo 2's, whose cos and sin stay fp32 under bf16 weights), where Llama's promotes:
    False, or the keep_dtype whose roundings are its own (_cast_back_order)."""
    fn = _own_rope(owner)
    q = torch.ones(1, 1, 2, 4, dtype=torch.bfloat16)
    cos = torch.ones(1, 2, 4)
    try:
        if fn(q, q, cos, cos)[0].dtype != torch.bfloat16:
            return False
    except Exception:  # not the (q, k, cos, sin) it was taken for: the probe says why
        return False
    return _cast_back_order(fn, None if form == _HALVES else form)


def _cast_back_order(fn: Callable, interleaved: str | None) -> bool | str:
    """Where a rotation that casts back rounds: keep_dtype=True, each product upcast (OLMo 2's
    promotion, Ernie 4.5's x.float() * cos + rotate(x).float() * sin), or "float", q and k upcast
    first (Cohere's). The forwards agree; the gradients do not (the two terms' gradients summed in
    bf16, or in fp32 and cast once), so bf16 q, k, cos and sin are run through `fn` and rope_eager
    both ways, forward and backward, bit for bit. True where neither matches (the probe then
    checks the values)."""

    def run(rotate):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = rotate(qq, kk, cos, sin)[:2]
        torch.autograd.backward((qo, ko), (dq, dk))
        return qo, ko, qq.grad, kk.grad

    try:
        # Gradients wherever fuse is called from (under no_grad or inference_mode too)
        with torch.inference_mode(False), torch.enable_grad():
            gen = torch.Generator().manual_seed(10)
            q, k = (torch.randn(shape, generator=gen).bfloat16() for shape in ((1, 2, 3, 8), (1, 1, 3, 8)))
            angle = 3 * torch.randn(1, 3, 8, generator=gen)
            cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
            dq, dk = (torch.randn(x.shape, generator=gen).bfloat16() for x in (q, k))
            want = run(fn)
            for keep in (True, "float"):
                got = run(
                    lambda *a, keep=keep: rotary.rope_eager(*a, keep_dtype=keep, interleaved=interleaved)
                )
                if all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)):
                    return keep
    except Exception:  # a rotation autograd cannot run back, or not of this shape
        pass
    return True


def _keeping_dtype(rope: Callable, takes_keyword: bool, keep: bool | str = True) -> Callable:
    """`rope` returning q's and k's own dtypes: through its keep_dtype (stored so by the kernel;
    `keep`, the model's own rounding order, for an eager rope), or cast after."""

    if takes_keyword:

        def call(q, k, cos, sin):
            return rope(q, k, cos, sin, keep_dtype=keep)

    else:

        def call(q, k, cos, sin):
            qo, ko = rope(q, k, cos, sin)
            return qo.to(q.dtype), ko.to(k.dtype)

    return call


_HALVES = "halves"  # _rope_form's name for Llama's rotate_half
_ROTATES_PAIRS = "rotates interleaved lane pairs (x0, x1), (x2, x3), ..."


def _rope_form(owner: type) -> str | None:
    """Which rotation the attention module's own apply_rotary_pos_emb computes, called on float64
    stand-ins whose cos and sin differ in every lane: _HALVES (Llama's rotate_half), a lane pairs'
    form of profuse.rotary.INTERLEAVED (cos by lane, Cohere's; its first half repeated, GLM's), or
    None where it is none of them or not (q, k, cos, sin) (the probe then says what it does)."""
    fn = _own_rope(owner)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 8, generator=gen, dtype=torch.float64)
    angle = 3 * torch.randn(1, 3, 8, generator=gen, dtype=torch.float64)
    cos, sin = angle.cos(), angle.sin()
    try:
        got = fn(q, k, cos, sin)
        got = [t.double() for t in got[:2]]
    except Exception:  # not the (q, k, cos, sin) it was taken for: the probe says why
        return None
    for form in (None, *rotary.INTERLEAVED):
        want = rotary.rope_eager(q, k, cos, sin, interleaved=form)
        # fp32's rounding: Cohere's and Ernie 4.5's rotation runs in fp32 (q.float()) even on float64;
        # a wrong form is off by O(1)
        if all(g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)):
            return form or _HALVES
    return None


def _rotating_pairs(rope: Callable, interleaved: str) -> Callable:
    """`rope` rotating the lane pairs in `interleaved`'s form (its other keywords passed on)."""

    def call(q, k, cos, sin, **kwargs):
        return rope(q, k, cos, sin, interleaved=interleaved, **kwargs)

    return call


__all__ = [
    "ROPE_NAME",
    "AttentionPlan",
    "AttentionState",
    "RotaryCarrier",
    "attention_class",
    "attention_forward",
    "plan_attention",
]
