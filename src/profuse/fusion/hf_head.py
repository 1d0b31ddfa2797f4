"""The causal-LM head of a Hugging Face model, fused with its loss: linear_cross_entropy.

    loss = linear_cross_entropy(h, W_lm_head, labels, ignore_index, num_items_in_batch, shift_labels)

with Hugging Face's ForCausalLMLoss semantics (profuse.crossentropy): the whole (tokens, vocab)
logits are never made. A head whose forward soft-caps the logits (Gemma 2 and 3: cap *
tanh(logits / cap), cap = config.final_logit_softcapping) is rebuilt reading a view of its
config without the cap, and the loss passes the cap, read at each call, as softcap=. The
CausalLM's forward is its own, rebuilt once per class
(hf_modules.rebuilt) with `self.lm_head` renamed to a pass-through (the "logits" it makes are the
hidden states) and `self.loss_function` renamed to profuse's loss, which takes them with the
lm_head's weight. The output then has no logits.

The logits policy. The fused path runs only in training (model.train()) with labels and a
gradient wanted (torch.is_grad_enabled): there the output's logits are LOGITS_NOT_MADE, which
raises a UsageError saying why and how to get them at any use (with return_dict=False the tuple
leaves them out, as transformers does for logits=None). Evaluation (model.eval() or no_grad),
a call without labels, generate: the class's own forward, logits made. `fuse(model,
logits="always")` leaves the head unfused, so every forward makes them. The fused path needs
an lm_head that is a plain bias-free nn.Linear (not replaced, wrapped by PEFT or hooked) and the
model's loss_function is transformers' ForCausalLMLoss. Otherwise the class's own forward runs,
exactly as before. logits_to_keep passes through either way.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from profuse.errors import UnsupportedModel, UsageError
from profuse.fusion.hf_layer import PROBE_TOL
from profuse.fusion.hf_modules import (
    ORIGINAL,
    PROBE_MODES,
    STATE,
    forward_owner,
    fused_class,
    fused_target,
    parameter_names,
    rebuilt,
    runs_as,
    seeded,
    stand_in,
)
from profuse.fusion.hf_moe_head import (
    moe_cases,
    reads_router_logits,
    same_scalar,
    stack_fields,
    stack_output,
    takes_router_flag,
    tuple_logits_index,
)

_HEAD, _LOSS, _FORWARD = "_profuse_head", "_profuse_loss", "_profuse_lce_forward"
# Gemma 2 and 3 soft-cap the logits between lm_head and the loss, reading the cap from the config:
# a head class whose forward reads it is rebuilt with `config` renamed to a view without the cap,
# and its loss passes the cap to linear_cross_entropy as softcap=.
_SOFTCAP = "final_logit_softcapping"
_CONFIG, _SOFTCAPS = "_profuse_config", "_profuse_softcaps"


class _WithoutSoftcap:
    """A config as the rebuilt forward reads it: the same attributes, but no final-logit cap (the
    fused loss applies it)."""

    __slots__ = ("_config",)

    def __init__(self, config):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name):
        return None if name == _SOFTCAP else getattr(self._config, name)


def _config_without_softcap(self):
    return _WithoutSoftcap(self.config)


@dataclass(frozen=True)
class HeadState:
    """What a fused causal-LM head calls, the loss it stands for, and where labels come among the
    forward's arguments."""

    linear_cross_entropy: Callable
    loss_function: Callable  # transformers' ForCausalLMLoss
    labels_index: int


def _head(self, hidden_states):
    """lm_head, renamed in the rebuilt forward: the hidden states go on to the loss as they are."""
    return hidden_states


def _loss(
    self,
    logits,
    labels,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    **kwargs,
):
    """loss_function, renamed in the rebuilt forward: `logits` are the hidden states."""
    st: HeadState = self.__dict__[STATE]
    weight = self._modules["lm_head"].weight
    cap = getattr(self.config, _SOFTCAP, None) if getattr(type(self), _SOFTCAPS, False) else None
    return st.linear_cross_entropy(
        logits,
        weight,
        labels,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
        **({"softcap": cap} if cap else {}),
    )


def head_runs_as(model: nn.Module, st: HeadState) -> bool:
    """True when the head computes what linear_cross_entropy does: a plain bias-free Linear and
    transformers' own causal-LM loss."""
    lm_head = model._modules.get("lm_head")
    return runs_as(lm_head, nn.Linear) and lm_head.bias is None and model.loss_function is st.loss_function


_NOT_MADE = (
    "profuse: the logits were not made: in training with labels the fused head computes the loss "
    "with linear_cross_entropy and never forms the (tokens, vocab) logits; they are made in eval "
    "mode, under torch.no_grad() or without labels, or in every forward after "
    "profuse.fuse(model, logits='always')"
)


class LogitsNotMadeError(UsageError, AttributeError):
    """An attribute of LOGITS_NOT_MADE: an AttributeError too, so hasattr() answers False (as
    accelerate's output casts ask hasattr(x, "dtype")) while a use says why."""


class LogitsNotMade:
    """The `logits` of a fused head's output where linear_cross_entropy made none: any use of it
    (indexing, an attribute, a torch function, truth) raises a UsageError that says why and how
    to get them, where None would give a bare TypeError. `repr`, `is None` and hasattr() work."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<logits not made: profuse's fused head, in training with labels>"

    def _refuse(self, *args, **kwargs):
        raise UsageError(_NOT_MADE)

    def __getattr__(self, name):
        if name.startswith("__"):  # protocols probed by copy, pickle, numpy: absent, as on None
            raise AttributeError(name)
        raise LogitsNotMadeError(_NOT_MADE)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise UsageError(_NOT_MADE)

    __getitem__ = __len__ = __iter__ = __bool__ = __float__ = __int__ = __array__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _refuse
    __matmul__ = __rmatmul__ = __neg__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


LOGITS_NOT_MADE = LogitsNotMade()


def without_logits(out):
    """The model's output without its logits (the hidden states, in the rebuilt forward): a
    ModelOutput's logits are LOGITS_NOT_MADE; a tuple leaves them out, as transformers does for
    logits=None."""
    if isinstance(out, tuple):  # (loss, logits, ...) or MoE's (loss, aux_loss, logits, ...): probed
        i = tuple_logits_index(out)
        return out[:i] + out[i + 1 :]
    return type(out)(**{k: LOGITS_NOT_MADE if k == "logits" else v for k, v in out.items()})


def head_forward(self, *args, **kwargs):
    """The fused causal LM: linear_cross_entropy in training with labels and gradients on (the
    logits are then not made); else its own forward, logits and all."""
    cls = type(self)
    st: HeadState = self.__dict__[STATE]
    labels = kwargs.get("labels")
    if labels is None and len(args) > st.labels_index:
        labels = args[st.labels_index]
    if labels is not None and self.training and torch.is_grad_enabled() and head_runs_as(self, st):
        return without_logits(getattr(cls, _FORWARD)(self, *args, **kwargs))
    return getattr(cls, ORIGINAL).forward(self, *args, **kwargs)


def softcaps(owner: type) -> bool:
    """Whether the head class's forward reads the config's final_logit_softcapping (Gemma 2, 3)."""
    code = getattr(inspect.unwrap(owner.forward), "__code__", None)
    return code is not None and _SOFTCAP in code.co_names


def head_class(owner: type) -> type:
    """Fused<owner>, its forward rebuilt with lm_head and loss_function renamed (and, where it
    soft-caps the logits, config renamed to a view without the cap). Raises ValueError with the
    reason when the forward cannot be rebuilt."""
    names = {"lm_head": _HEAD, "loss_function": _LOSS}
    attrs = {_HEAD: _head, _LOSS: _loss}
    if softcaps(owner):
        names["config"] = _CONFIG
        attrs.update({_CONFIG: property(_config_without_softcap), _SOFTCAPS: True})
    forward = rebuilt(owner.forward, names, {})
    return fused_class(owner, "head", head_forward, {_FORWARD: forward, **attrs})


# --------------------------------------------------------------------------------------------
# Planning and probing (nothing is changed here)
# --------------------------------------------------------------------------------------------


def causal_lm_loss() -> Callable | None:
    """transformers' ForCausalLMLoss, where this transformers has it."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


@dataclass
class HeadPlan:
    """What fusing the head would install (the module and its fused class), or why not."""

    head: nn.Module | None
    target: type | None
    state: HeadState | None
    reason: str | None  # a head that cannot be fused exactly
    absent: str | None  # no causal-LM head in this model


def plan_head(model: nn.Module, stack: nn.Module, op: Callable | None, probe: bool = True) -> HeadPlan:
    """Find the module that holds lm_head above the decoder stack and check that its forward,
    rebuilt, computes the loss it computes; change nothing. `probe=False` only finds it."""
    plan = HeadPlan(None, None, None, None, None)
    if op is None:
        return plan
    heads = [
        m for m in model.modules() if isinstance(m._modules.get("lm_head"), nn.Module) and _holds(m, stack)
    ]
    if len(heads) != 1:
        plan.absent = f"{type(model).__name__} has no causal-LM head (an lm_head above the decoder stack)"
        return plan
    head = heads[0]
    if not probe:
        plan.head = head
        return plan
    name = type(head).__name__
    loss = causal_lm_loss()
    lm_head = head._modules["lm_head"]
    if loss is None or getattr(head, "loss_function", None) is not loss:
        plan.reason = f"{name}'s loss_function is not transformers' ForCausalLMLoss"
    elif not runs_as(lm_head, nn.Linear) or lm_head.bias is not None:
        plan.reason = f"{name}'s lm_head is a {type(lm_head).__name__}, not a plain bias-free nn.Linear"
    if plan.reason:
        return plan
    owner = forward_owner(type(head))
    params = parameter_names(owner.forward)
    if "labels" not in params:
        plan.reason = f"{name}.forward takes no labels"
        return plan
    try:
        fused = head_class(owner)
    except ValueError as e:
        plan.reason = f"{name}.forward cannot be rebuilt with linear_cross_entropy: {e}"
        return plan
    target = fused_target(head, owner, fused)
    if target is None:
        plan.reason = f"{name} is derived from {owner.__name__} by a class with a forward of its own"
        return plan
    state = HeadState(op, loss, params.index("labels"))
    try:
        _probe(head, fused, stack, state, name)
    except UnsupportedModel as e:
        plan.reason = str(e)
        return plan
    plan.head, plan.target, plan.state = head, target, state
    return plan


def _holds(module: nn.Module, target: nn.Module) -> bool:
    return any(m is target for m in module.modules())


class _Base(nn.Module):
    """The decoder stack's stand-in: its output is a fixed last hidden state (and, for an MoE
    head, fixed router logits: profuse.fusion.hf_moe_head)."""

    def __init__(self, hidden: torch.Tensor, fields: dict):
        super().__init__()
        self.hidden, self.fields = hidden, fields

    def forward(self, *args, **kwargs):
        return stack_output(self.hidden, self.fields)


def _probe(head: nn.Module, fused: type, stack: nn.Module, st: HeadState, name: str) -> None:
    """Run the head class's own forward and the rebuilt one on a float64 stand-in (hidden 8,
    vocab 13): labels with ignored tokens, num_items_in_batch, shift_labels, return_dict=False.
    Raise unless the losses agree, the op ran once a call, and the rest of the output is the
    same objects, logits apart."""
    owner = getattr(fused, ORIGINAL)
    c, v, f64 = 8, 13, torch.float64
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return st.linear_cross_entropy(*args, **kwargs)

    try:
        base = next(n for n, m in head.named_children() if _holds(m, stack))
        with torch.random.fork_rng():
            torch.manual_seed(4)
            hidden = torch.randn(2, 5, c, dtype=f64)
            lm_head = nn.Linear(c, v, bias=False, dtype=f64)
            labels = torch.randint(0, v, (2, 5))
        labels[0, 1] = labels[1, 3] = -100
        config = copy.copy(head.config)
        config.vocab_size = v
        if getattr(config, _SOFTCAP, None):  # a cap the stand-in's logits reach, so a dropped one shows
            setattr(config, _SOFTCAP, 0.5)
        attrs = {"config": config, **({"vocab_size": v} if "vocab_size" in head.__dict__ else {})}
        moe = takes_router_flag(parameter_names(owner.forward))
        reads = reads_router_logits(owner.forward)
        fields = stack_fields(head, hidden) if reads else {}
        model = stand_in(head, fused, {base: _Base(hidden, fields), "lm_head": lm_head}, **attrs)
        model.__dict__[STATE] = HeadState(counted, st.loss_function, st.labels_index)
        shifted = torch.cat((labels[:, 1:], torch.full((2, 1), -100)), dim=1)
        cases = [
            {"labels": labels},
            {"labels": labels, "num_items_in_batch": torch.tensor(7)},
            {"labels": labels, "shift_labels": shifted.roll(1, dims=1)},
            {"labels": labels, "return_dict": False},
            *(moe_cases(labels) if moe else ()),
        ]
        ok = True
        with torch.no_grad():
            for training in PROBE_MODES:
                model.train(training)
                for kwargs in cases:
                    with seeded(8):
                        want = owner.forward(model, **kwargs)
                    with seeded(8):
                        got = without_logits(getattr(fused, _FORWARD)(model, **kwargs))
                    ok = ok and _same(got, want)
        ok = ok and len(calls) == len(PROBE_MODES) * len(cases)
    except Exception as e:
        raise UnsupportedModel(f"{name} could not be checked with linear_cross_entropy fused: {e}") from None
    if not ok:
        raise UnsupportedModel(
            f"{name}'s forward rebuilt with linear_cross_entropy does not compute its own loss: "
            "profuse cannot fuse it exactly"
        )


def _same(got, want) -> bool:
    """got (logits dropped) against want: the loss within PROBE_TOL, the rest the same objects."""
    if isinstance(want, tuple):
        rest = without_logits(want)
        pairs, loss_got, loss_want = list(zip(got[1:], rest[1:])), got[0], want[0]
        if len(got) != len(rest):
            return False
    else:
        if list(got.keys()) != list(want.keys()) or got.get("logits") is not LOGITS_NOT_MADE:
            return False
        keys = [k for k in want.keys() if k != "logits"]
        pairs = [(got[k], want[k]) for k in keys if k != "loss"]
        loss_got, loss_want = got.loss, want.loss
    if any(a is not b and not same_scalar(a, b, PROBE_TOL) for a, b in pairs):
        return False
    return loss_got.shape == loss_want.shape and bool(
        (loss_got - loss_want).abs() <= PROBE_TOL * loss_want.abs()
    )


__all__ = [
    "LOGITS_NOT_MADE",
    "HeadPlan",
    "HeadState",
    "LogitsNotMade",
    "LogitsNotMadeError",
    "causal_lm_loss",
    "head_class",
    "head_forward",
    "head_runs_as",
    "plan_head",
    "softcaps",
]
