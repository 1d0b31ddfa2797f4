"""What Part C's variants share (profuse.stepstate): the weights held fixed at lr 0 through the
timed steps, AdamW's state made first, finiteness after the trials, and each variant's memory
from an emptied allocator (its CUDA figures on a GPU only)."""

from __future__ import annotations

import pytest
import torch

from profuse import fusion, stepstate
from profuse import step as S
from profuse.model import GPTConfig

TINY = GPTConfig(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=16, batch_size=2)
CUDA = torch.cuda.is_available()


def _variant_and_optimizer(lr: float = 1e-2):
    cfg = S.StepConfig(model=TINY, variants=("eager",), trials=2, profile_steps=0, lr=lr)
    variants, optimizer = S._build_variants(cfg, ["eager"], fusion.EAGER, {})
    batch = cfg.spec.batch(cfg.device, 0)
    return S._train_step(variants[0], optimizer, batch, cfg.device), optimizer


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def test_lr_0_leaves_the_weights_bitwise_unchanged_through_the_steps():
    step, optimizer = _variant_and_optimizer()
    params = _params(optimizer)
    before = [p.detach().clone() for p in params]
    with stepstate.zero_lr(optimizer):
        stepstate.make_state(optimizer)
        assert all(torch.equal(a, b) for a, b in zip(params, before))  # making the state moved nothing
        state = optimizer.state[params[0]]
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        mark = stepstate.fingerprint(params)
        for _ in range(5):
            step()
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert stepstate.fingerprint(params) == mark
        assert any(optimizer.state[p]["exp_avg"].any() for p in params)  # AdamW did run
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2]  # restored
    step()  # at the real lr the same step moves them, and the fingerprint sees it
    assert not all(torch.equal(a, b) for a, b in zip(params, before))
    assert stepstate.fingerprint(params) != mark


def test_the_fingerprint_sees_one_element_and_nans():
    w = torch.randn(7, 5)
    mark = stepstate.fingerprint([w])
    w[3, 2] = torch.nextafter(w[3, 2], torch.tensor(float("inf")))  # one ulp
    assert stepstate.fingerprint([w]) != mark
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(11).to(dtype)
        assert stepstate.fingerprint([x]) == stepstate.fingerprint([x.clone()])
    nan = torch.full((3,), float("nan"))
    assert stepstate.fingerprint([nan]) != stepstate.fingerprint([torch.zeros(3)])
    assert stepstate.fingerprint([]) == []


def test_the_run_times_the_same_weights_and_says_so(monkeypatch, tmp_path):
    """run_step's variants, first steps and trials leave the shared weights bitwise as built."""
    seen = []
    build = S._build_variants

    def spy(*args, **kwargs):
        variants, optimizer = build(*args, **kwargs)
        seen.append((_params(optimizer), [p.detach().clone() for p in _params(optimizer)]))
        return variants, optimizer

    monkeypatch.setattr(S, "_build_variants", spy)
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=3, profile_steps=0, out_dir=tmp_path)
    res = S.run_step(cfg, ops=fusion.EAGER)
    [(params, before)] = seen
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert res.weights.unchanged and res.weights.finite and res.weights.nonfinite == []
    assert res.weights.lr == 0.0 and not res.failed
    assert res.to_dict()["weights"]["unchanged"] is True
    from profuse.report.step import format_step

    assert "so each timed the same weights: unchanged bitwise, finite" in format_step(res.to_dict())


def _nan_after(flag: dict):
    """A loss made NaN (its gradients untouched) once `flag['on']` is set."""

    def wrap(loss_fn):
        def loss(net, batch):
            value = loss_fn(net, batch)
            if flag["on"]:
                value = value + torch.tensor(float("nan"))  # a constant: no gradient through it
            return value

        return loss

    return wrap


def test_a_variant_whose_loss_turns_non_finite_in_the_trials_is_reported_failed(monkeypatch, tmp_path):
    flag = {"on": False}
    prepare = S._prepare

    def prepared(spec, name, model, ops, autocast, *rest):
        v = prepare(spec, name, model, ops, autocast, *rest)
        if name == "fused":
            v.loss = _nan_after(flag)(v.loss)
        return v

    def progress(stage, done, total):
        if stage == "steps: trials":
            flag["on"] = True

    monkeypatch.setattr(S, "_prepare", prepared)
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=3, profile_steps=0, out_dir=tmp_path)
    res = S.run_step(cfg, progress=progress, ops=fusion.EAGER)
    assert res.failed == {"fused": "its loss was not finite after the timed steps"}
    assert list(res.comparison.timings) == ["eager"] and "fused" not in res.comparison.speedups
    assert res.weights.finite and res.weights.unchanged and res.weights.nonfinite == ["fused"]


def test_a_variant_whose_loss_is_not_finite_from_the_start_is_never_timed(monkeypatch, tmp_path):
    prepare = S._prepare

    def prepared(spec, name, model, ops, autocast, *rest):
        v = prepare(spec, name, model, ops, autocast, *rest)
        if name == "fused":
            v.loss = _nan_after({"on": True})(v.loss)
        return v

    monkeypatch.setattr(S, "_prepare", prepared)
    monkeypatch.setattr(S, "check_same_math", lambda cfg, ops: S.MathCheck({}, "fp32", passed=True))
    cfg = S.StepConfig(model=TINY, variants=("eager", "fused"), trials=2, profile_steps=0, out_dir=tmp_path)
    res = S.run_step(cfg, ops=fusion.EAGER)
    assert "FloatingPointError" in res.failed["fused"] and "nan" in res.failed["fused"]
    assert list(res.comparison.timings) == ["eager"]


def test_non_finite_weights_fail_every_variant():
    ok = stepstate.WeightsCheck(0.0, True, True, ["fused"])
    assert stepstate.failures(ok, ["eager", "fused"]) == {
        "fused": "its loss was not finite after the timed steps"
    }
    bad = stepstate.WeightsCheck(0.0, False, False, ["fused"])
    fails = stepstate.failures(bad, ["eager", "fused"])
    assert set(fails) == {"eager", "fused"} and "shared weights were not finite" in fails["eager"]
    assert fails["fused"] == "its loss was not finite after the timed steps"  # its own reason first
    params = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    check = stepstate.after_trials(params, stepstate.fingerprint(params), {"a": torch.tensor(float("nan"))})
    assert check.unchanged and not check.finite and check.nonfinite == ["a"]


def test_own_steps_runs_the_steps_and_measures_memory_only_on_cuda():
    calls = []

    def step():
        calls.append(1)
        return torch.tensor(1.0)

    ticks = iter([10.0, 12.5])
    own = stepstate.own_steps(step, torch.device("cpu"), steps=3, clock=lambda: next(ticks))
    assert len(calls) == 3 and own.first_s == 2.5 and own.memory is None and own.loss.item() == 1.0
    with pytest.raises(ValueError, match="at least 1"):
        stepstate.own_steps(step, torch.device("cpu"), steps=0)


@pytest.mark.skipif(not CUDA, reason="the allocator's peaks are CUDA's")
def test_memory_from_an_emptied_allocator_counts_what_the_steps_reserve():
    dev = torch.device("cuda")
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)  # 64 MB resident, like the shared state

    def step():
        scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MB, freed at once
        return scratch[:1].float().sum()

    junk = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    del junk  # cached, not allocated: emptied before the variant's steps
    own = stepstate.own_steps(step, dev)
    m = own.memory
    assert m.resident_bytes >= keep.numel() and m.steps == stepstate.MEMORY_STEPS
    assert m.allocated_bytes >= m.resident_bytes + 256 * 2**20
    assert m.reserved_bytes >= m.allocated_bytes and m.peak_bytes == m.reserved_bytes
    assert m.reserved_bytes < m.resident_bytes + 512 * 2**20 + 256 * 2**20  # the old cache was emptied
    assert m.to_dict()["accounting"] == "reserved"
