"""What `profuse.fuse` does to each causal-LM family of the installed transformers (`profuse fuse`).

For each family (profuse.models.hf_families): a tiny model from its own config class with random
weights (every norm's weight drawn away from its init, so a norm that ignored its weight or its
offset would show), then `profuse.fuse` on a copy, with the real probes: the ops it places and
where, what it leaves unfused and why, or why it refuses the model. Unless `dry_run`, the fused
copy is then run against the unfused model on the same random batch (labels with ignored tokens):
in train mode the loss and every gradient, in eval mode the logits, each as the relative error
|fused - unfused| / |unfused|, fp32. With profuse.fusion.EAGER (the default) that checks the
structure (every op in its place, nothing skipped or added); the kernels have their own checks
against float64 (tests/, benchmarks/check_fuse.py); `impl=FUSED` runs them here too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from profuse.errors import UsageError
from profuse.fusion import EAGER, BlockOps, fuse
from profuse.models import hf_families

# Relative error of a fused fp32 forward or gradient against the unfused model's that passes: the
# fused ops round in another order (a sum of squares in one pass, an add folded into a norm), about
# 1e-7 a value; 1e-4 leaves room for a deep chain of them and none for a skipped or misplaced op.
CHECK_TOLERANCE = 1e-4
CHECK_SHAPE = (2, 24)  # batch x tokens of the check's random batch


@dataclass
class FamilyCoverage:
    """One family: its tiny model, what fuse placed, left or refused, and the check."""

    family: str
    model: str | None = None  # the causal-LM class
    params: int | None = None
    counts: dict[str, int] = field(default_factory=dict)  # op -> places in the tiny model
    layers: int | None = None
    left_unfused: list[str] = field(default_factory=list)  # "op: why"
    refused: str | None = None  # why fuse refused the model, one line
    unbuilt: str | None = None  # why no tiny model could be built from the family's config
    check: dict[str, float] | None = None  # loss, gradients (worst tensor), logits: relative errors
    check_error: str | None = None  # the fused model's step raised where the unfused one ran
    unchecked: str | None = None  # why no check was made (the unfused tiny model does not run)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.unbuilt:
            return "not built"
        if self.refused:
            return "refused"
        if self.check_error or (self.check and not self.passed):
            return "check failed"
        if self.unchecked:
            return "not checked"
        return "fused" if self.counts else "nothing fused"

    @property
    def passed(self) -> bool | None:
        if self.check is None:
            return None
        return all(v <= CHECK_TOLERANCE for v in self.check.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status, "passed": self.passed}


@dataclass
class Coverage:
    """Every family asked for, with the versions and the implementation they ran under."""

    rows: list[FamilyCoverage]
    transformers: str
    impl: str
    dry_run: bool
    tolerance: float = CHECK_TOLERANCE

    def to_dict(self) -> dict:
        return {
            "transformers": self.transformers,
            "impl": self.impl,
            "dry_run": self.dry_run,
            "tolerance": self.tolerance,
            "families": [r.to_dict() for r in self.rows],
        }


class UnfusedFails(RuntimeError):
    """The unfused tiny model's own step raised: its shrunk config does not run, fused or not."""


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _perturb_norms(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _rel(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


def _run(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, seed: int):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return loss.detach(), grads, logits


def _vocab(config) -> int:
    """The vocabulary the tokens are drawn from: the config's, or its text model's."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    return int(vocab or hf_families.TINY_SIZES["vocab_size"])


def check_fused(unfused: nn.Module, fused: nn.Module, vocab: int, seed: int = 0) -> dict[str, float]:
    """Relative errors of the fused model against the unfused one on one random batch: the
    train-mode loss, the worst gradient, the eval-mode logits."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, CHECK_SHAPE, generator=g)
    labels = ids.clone()
    labels[0, : CHECK_SHAPE[1] // 4] = -100  # ignored tokens, as padding leaves them
    try:
        loss_u, grads_u, logits_u = _run(unfused, ids, labels, seed)
    except Exception as err:  # the tiny model itself does not run: nothing to hold the fused one to
        raise UnfusedFails(_line(err)) from err
    loss_f, grads_f, logits_f = _run(fused, ids, labels, seed)
    worst = max((_rel(grads_f.get(n), grads_u[n]) for n in grads_u), default=0.0)
    return {"loss": _rel(loss_f, loss_u), "gradients": worst, "logits": _rel(logits_f, logits_u)}


def family_coverage(
    family: str, *, impl: BlockOps = EAGER, dry_run: bool = False, seed: int = 0, fields: dict | None = None
) -> FamilyCoverage:
    """One family's row (see the module's docstring); `fields`, a config.json's, in place of the
    family's defaults."""
    row = FamilyCoverage(family)
    t0 = time.perf_counter()
    try:
        try:
            config = hf_families.tiny_config(family, fields)
            row.params = hf_families.param_count(config)
            if row.params > hf_families.MAX_TINY_PARAMS:
                row.unbuilt = (
                    f"{row.params / 1e6:.0f}M parameters after shrinking the known size fields: "
                    "its sizes are under other names"
                )
                return row
            model = hf_families.build_tiny(config, seed)
        except UsageError:
            raise
        except Exception as err:  # transformers refuses the shrunk config: its reason is the row
            row.unbuilt = _line(err)
            return row
        row.model = type(model).__name__
        _perturb_norms(model, seed)
        fused = model if dry_run else copy.deepcopy(model)
        try:
            summary = fuse(fused, impl=impl, dry_run=dry_run)
        except UsageError as err:  # UnsupportedModel: fuse's one line
            row.refused = str(err)
            return row
        row.counts, row.layers = dict(summary.counts), summary.layers
        row.left_unfused = list(summary.left_unfused)
        if not dry_run:
            try:
                row.check = check_fused(model, fused, _vocab(config), seed)
            except UnfusedFails as err:
                row.unchecked = f"the unfused tiny model's own step fails: {err}"
            except Exception as err:  # the fused model fails where the unfused one ran
                row.check_error = _line(err)
        return row
    finally:
        row.seconds = time.perf_counter() - t0


def coverage(
    families: Sequence[str] | None = None,
    *,
    impl: BlockOps = EAGER,
    dry_run: bool = False,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> Coverage:
    """Rows for `families` (default: every causal-LM family of the installed transformers)."""
    names = list(hf_families.families() if families is None else families)
    known = set(hf_families.families())
    unknown = [f for f in names if f not in known]
    if unknown:
        raise UsageError(
            f"not a causal-LM model type of the installed transformers: {', '.join(unknown)} "
            "(profuse fuse --list names them)"
        )
    rows = []
    for i, name in enumerate(names):
        if progress is not None:
            progress(f"families ({name})", i, len(names))
        rows.append(family_coverage(name, impl=impl, dry_run=dry_run, seed=seed))
    return Coverage(rows, hf_families.transformers.__version__, impl.name, dry_run)


def config_coverage(
    fields: dict, *, impl: BlockOps = EAGER, dry_run: bool = False, seed: int = 0
) -> Coverage:
    """The row of one config.json's model (a dict with its model_type), at tiny sizes."""
    family = fields["model_type"]
    hf_families.families()  # transformers is there
    if family not in hf_families.families():
        raise UsageError(f"model type {family!r} is not a causal-LM family of the installed transformers")
    row = family_coverage(family, impl=impl, dry_run=dry_run, seed=seed, fields=fields)
    return Coverage([row], hf_families.transformers.__version__, impl.name, dry_run)
