"""The autotuner and the plan cache (kernels/autotune.py), with a fake timer injected: the
fastest config that runs wins, configs that fail to launch are skipped, the choice is kept per
key, an unrunnable shape is a clear error; and after the first call for a shape, a call builds
no candidates and looks up the plan a fresh pick would have made."""

from __future__ import annotations

import pytest
import torch
from cases import tail_inputs

from profuse.kernels import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from profuse import tail as T  # noqa: E402
from profuse.env import sm_count  # noqa: E402
from profuse.kernels import autotune as A  # noqa: E402
from profuse.kernels import configs as C  # noqa: E402
from profuse.kernels.configs import KernelConfig  # noqa: E402
from profuse.kernels.tail import plans as K  # noqa: E402

CUDA = torch.device("cuda")
CONFIGS = [KernelConfig("fused", 1, 1024, w) for w in (1, 2, 4, 8)]


class FakeTimer:
    """Each call 'takes' what `speeds` says for the config its launch ran."""

    def __init__(self, speeds, ran):
        self.speeds, self.ran = speeds, ran

    def time_calls(self, calls):
        out = []
        for call in calls:
            n = len(self.ran)
            call()
            out.append(self.speeds[self.ran[n]])
        return out


@pytest.fixture
def tuner(monkeypatch):
    """An Autotuner timing with FakeTimer, autotuning on as on a GPU. `launched` records every
    config launched; `timers` counts the timers made (one per tuning)."""
    monkeypatch.setattr(A, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(A, "capturing", lambda device: False)
    speeds: dict[KernelConfig, float] = {}
    launched: list[KernelConfig] = []
    timers = []

    def make_timer(device):
        timers.append(device)
        return FakeTimer(speeds, launched)

    t = A.Autotuner(make_timer=make_timer, trials=5)
    return t, speeds, launched, timers


@pytest.mark.parametrize("fastest", range(len(CONFIGS)))
def test_the_fastest_config_wins_and_is_kept(tuner, fastest):
    t, speeds, launched, timers = tuner
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = 1.0 + abs(i - fastest)
    key = ("fwd", 64, 1000, torch.bfloat16)
    assert t.pick(key, CONFIGS, launched.append, CUDA) == CONFIGS[fastest]
    # Every config was built (launched once) before the timing, then timed in every trial.
    assert launched[: len(CONFIGS)] == CONFIGS
    assert len(launched) == len(CONFIGS) * (1 + t.trials) and len(timers) == 1
    # Asked again, the choice is reused without timing or launching anything.
    assert t.pick(key, CONFIGS, launched.append, CUDA) == CONFIGS[fastest]
    assert len(timers) == 1 and len(launched) == len(CONFIGS) * (1 + t.trials)
    assert "fwd/64/1000/torch.bfloat16" in t.chosen_dict()


def test_configs_that_cannot_launch_are_skipped(tuner):
    t, speeds, launched, _ = tuner
    broken = CONFIGS[0]  # would be the fastest, but it does not fit (e.g. shared memory)
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = float(i)

    def launch(cfg):
        if cfg == broken:
            raise RuntimeError("out of resource: shared memory")
        launched.append(cfg)

    assert t.pick(("bwd", 8), CONFIGS, launch, CUDA) == CONFIGS[1]
    assert broken not in launched


def test_no_runnable_config_is_a_clear_error(tuner):
    t = tuner[0]

    def launch(cfg):
        raise RuntimeError("out of resource")

    with pytest.raises(RuntimeError, match="no launch config"):
        t.pick(("fwd", 1), CONFIGS, launch, CUDA)


def test_without_autotuning_the_favourite_runs_untimed(monkeypatch):
    def no_timer(device):
        raise AssertionError("timed a config with autotuning off")

    t = A.Autotuner(make_timer=no_timer)
    monkeypatch.setenv("PROFUSE_AUTOTUNE", "0")
    assert t.pick(("fwd", 1), CONFIGS, lambda c: None, CUDA) == CONFIGS[0]
    monkeypatch.delenv("PROFUSE_AUTOTUNE")
    assert t.pick(("fwd", 1), CONFIGS, lambda c: None, torch.device("cpu")) == CONFIGS[0]
    assert not t.chosen  # a favourite that was not timed is not remembered as tuned


def test_while_a_cuda_graph_is_captured_nothing_is_timed(monkeypatch):
    """A first call inside a graph capture cannot time candidates (and must not launch them):
    the favourite runs, untuned, so a later call outside the capture can still tune."""
    monkeypatch.setattr(A, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_timer(device):
        raise AssertionError("timed a config during a graph capture")

    t = A.Autotuner(make_timer=no_timer)
    launched = []
    assert t.pick(("fwd", 8), CONFIGS, launched.append, CUDA) == CONFIGS[0]
    assert launched == [] and not t.chosen


def test_a_candidate_with_a_wrong_answer_is_never_picked(tuner):
    """Each candidate's answer is compared with the first one's before the timing: one off by
    far more than rounding (or NaN) is left out however fast it is, and reported; one that
    differs by a rounding is timed as usual."""
    t, speeds, launched, _ = tuner
    gen = torch.Generator().manual_seed(torch.seed())
    ref = torch.randn(37, 301, generator=gen).to(torch.bfloat16)
    nan = ref.clone()
    nan[5, 7] = float("nan")
    rounded = (ref.float() * (1 + 2**-9)).to(torch.bfloat16)  # an ulp off in some elements
    answers = {CONFIGS[0]: ref, CONFIGS[1]: ref * 1.25, CONFIGS[2]: nan, CONFIGS[3]: rounded}
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = float(len(CONFIGS) - i)  # the later, the faster

    def launch(cfg):
        launched.append(cfg)
        return (answers[cfg].clone(), None)

    key = ("fwd", 64, 301, torch.bfloat16)
    with pytest.warns(UserWarning, match="not timed") as caught:
        assert t.pick(key, CONFIGS, launch, CUDA) == CONFIGS[3]
    assert len(caught) == 2
    assert [c for c, _ in t.rejected[key]] == [CONFIGS[1], CONFIGS[2]]
    err_wrong, err_nan = (e for _, e in t.rejected[key])
    assert 0.2 < err_wrong < 0.3 and err_nan != err_nan
    # Only the agreeing configs were timed.
    assert set(launched[len(CONFIGS) :]) == {CONFIGS[0], CONFIGS[3]}


def test_disagreement_reads_chunks_and_edge_cases():
    gen = torch.Generator().manual_seed(torch.seed())
    a = torch.randn(1001, generator=gen)
    b = a + 1e-3 * torch.randn(1001, generator=gen)
    whole = A.disagreement([a], [b])
    assert whole == pytest.approx(A.disagreement([a], [b], chunk=7), rel=1e-9)
    assert whole == pytest.approx(((a - b).norm() / b.norm()).item(), rel=1e-5)
    assert A.disagreement([a], [b[:1000]]) == float("inf")
    assert A.disagreement([a], [torch.full_like(b, float("inf"))]) == 0.0  # nothing to compare
    assert A.agreement_tolerance([a.to(torch.bfloat16)]) == 4 * 2**-7
    assert A.agreement_tolerance([a]) == 1e-4


def test_the_tail_tuner_leaves_out_a_wrong_kernel(counted, device, monkeypatch):
    """Through the real forward and backward launchers: a config whose kernel writes a wrong
    answer is never the plan, even when the timer calls it the fastest."""
    monkeypatch.setattr(A, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(A, "capturing", lambda device: False)
    shape = (6, 300)
    fwd_list, bwd_list = C.forward_candidates, C.backward_candidates
    monkeypatch.setattr(C, "forward_candidates", lambda *a: fwd_list(*a)[:3])  # three each: quick
    monkeypatch.setattr(C, "backward_candidates", lambda *a: bwd_list(*a)[:3])
    cands = C.forward_candidates(shape[0], shape[1], torch.float32, sm_count(device))
    bcands = C.backward_candidates(shape[0], shape[1], torch.float32, sm_count(device))
    assert len(cands) == 3 and len(bcands) == 3
    bad_fwd, bad_bwd = cands[-1], bcands[-1]
    real_fwd, real_plan = K._forward_launch, K._BackwardPlan.__call__

    def forward_launch(cfg, *a):
        launch = real_fwd(cfg, *a)
        if cfg != bad_fwd:
            return launch
        return lambda *args: (launch(*args), args[4].mul_(1.5))  # y scaled: wrong

    def plan_call(self, *a):
        grads = real_plan(self, *a)
        return tuple(g * 3 if g is not None and self.config == bad_bwd else g for g in grads)

    monkeypatch.setattr(K, "_forward_launch", forward_launch)
    monkeypatch.setattr(K._BackwardPlan, "__call__", plan_call)

    class LastIsFastest:
        def time_calls(self, calls):
            return [float(len(calls) - i) for i in range(len(calls))]

    monkeypatch.setattr(K, "TUNER", A.Autotuner(make_timer=lambda d: LastIsFastest(), trials=2))
    g, u, r, w = _leaves(shape, torch.float32, device, seed=torch.seed() % 2**31)
    with pytest.warns(UserWarning, match="not timed"):
        y = T.tail_triton(g, u, r, w)
        y.sum().backward()
    assert K.TUNER.chosen[("fwd", C.pow2_rows(6), 300, torch.float32)] != bad_fwd
    assert [c for c, _ in K.TUNER.rejected[("fwd", C.pow2_rows(6), 300, torch.float32)]] == [bad_fwd]
    bwd_keys = [k for k in K.TUNER.chosen if k[0] == "bwd"]
    assert bwd_keys and all(K.TUNER.chosen[k] != bad_bwd for k in bwd_keys)
    assert all([c for c, _ in K.TUNER.rejected[k]] == [bad_bwd] for k in bwd_keys)
    assert T.relative_error(y, T.tail_reference(g, u, r, w)) <= T.FORWARD_TOL[torch.float32]


# --------------------------------------------------------------------------------------------
# The plan cache, through the real launchers (the interpreter on a CPU)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """Fresh plan caches and tuner; counts the candidate lists built, per kind."""
    monkeypatch.setattr(K, "_FWD_PLANS", A.PlanCache())
    monkeypatch.setattr(K, "_BWD_PLANS", A.PlanCache())
    monkeypatch.setattr(K, "TUNER", A.Autotuner())
    built = {"fwd": 0, "bwd": 0}
    fwd, bwd = C.forward_candidates, C.backward_candidates

    def count_fwd(*a):
        built["fwd"] += 1
        return fwd(*a)

    def count_bwd(*a):
        built["bwd"] += 1
        return bwd(*a)

    monkeypatch.setattr(C, "forward_candidates", count_fwd)
    monkeypatch.setattr(C, "backward_candidates", count_bwd)
    return built


def _leaves(shape, dtype, device, seed):
    return tuple(t.requires_grad_() for t in tail_inputs(shape, dtype, device, seed))


def test_a_second_call_builds_no_candidates(counted, device):
    g, u, r, w = _leaves((5, 48), torch.float32, device, seed=1)
    for _ in range(3):
        T.tail_triton(g, u, r, w).sum().backward()
    assert counted == {"fwd": 1, "bwd": 1}
    assert K._FWD_PLANS.builds == 1 and K._BWD_PLANS.builds == 1
    # Without gradients the forward runs the same plan (it stores rstd too): nothing new built.
    with torch.no_grad():
        for _ in range(3):
            T.tail_triton(g, u, r, w)
    assert counted["fwd"] == 1 and K._FWD_PLANS.builds == 1


def test_a_forward_without_grad_stores_rstd_in_one_growing_scratch(counted, device, monkeypatch):
    """No rstd is allocated for a call that keeps none: the kernel stores it into one buffer per
    device, which a call with more rows replaces (keeping the old one alive) and a call with
    fewer reuses. Each call's y is right, and the buffer holds the rstd the grad path returns."""
    monkeypatch.setattr(K, "_RSTD_SCRATCH", {})
    monkeypatch.setattr(K, "_RSTD_OUTGROWN", [])
    seen = []
    for seed, rows in enumerate((3, 11, 5, 11, 24)):
        g, u, r, w = tail_inputs((rows, 37), torch.float32, device, seed=20 + seed)
        with torch.no_grad():
            y = T.tail_triton(g, u, r, w)
        assert T.relative_error(y, T.tail_reference(g, u, r, w)) <= T.FORWARD_TOL[torch.float32]
        buf = K._RSTD_SCRATCH[g.device]
        assert buf.numel() >= rows
        seen.append(buf.data_ptr())
        _, rstd = K.tail_forward(g, u, r, w, T.DEFAULT_EPS)
        torch.testing.assert_close(buf[:rows], rstd, rtol=1e-6, atol=0)
    # 3 rows, then 11 (a new buffer), 5 and 11 (the same one), 24 (a new one).
    assert seen[1] != seen[0] and seen[1] == seen[2] == seen[3] and seen[4] != seen[3]
    assert [t.numel() for t in K._RSTD_OUTGROWN] == [3, 11]
    y, rstd = K.tail_forward(g, u, r, w, T.DEFAULT_EPS, keep_rstd=False)
    assert rstd is None and y.shape == g.shape


@pytest.mark.parametrize(
    "change",
    ["rows", "cols", "dtype", "needs"],
)
def test_new_shapes_dtypes_and_gradients_still_plan(counted, device, change):
    g, u, r, w = _leaves((5, 48), torch.float32, device, seed=2)
    T.tail_triton(g, u, r, w).sum().backward()
    shape, dtype = {
        "rows": ((6, 48), torch.float32),
        "cols": ((5, 40), torch.float32),
        "dtype": ((5, 48), torch.bfloat16),
        "needs": ((5, 48), torch.float32),
    }[change]
    g2, u2, r2, w2 = _leaves(shape, dtype, device, seed=3)
    if change == "needs":
        u2.requires_grad_(False)
    y = T.tail_triton(g2, u2, r2, w2)
    y.sum().backward()
    # A new forward plan for a new shape or dtype; a new backward plan for anything new.
    assert counted["fwd"] == (1 if change == "needs" else 2) and counted["bwd"] == 2
    want = T.tail_reference(g2, u2, r2, w2)
    assert T.relative_error(y, want) <= T.FORWARD_TOL[dtype]
    assert u2.grad is None and g2.grad is not None if change == "needs" else u2.grad is not None


def test_the_cached_plan_is_the_one_a_fresh_pick_makes(counted, device):
    """What the cache hands back launches the config the tuner picks for the shape (the
    heuristic's where nothing is timed; on a GPU one of the shape's candidates), bound to the
    same grid and compile-time arguments as a plan built from scratch for that config."""
    g, u, r, w = _leaves((7, 33), torch.float16, device, seed=4)
    T.tail_triton(g, u, r, w).sum().backward()
    ((fwd_key, fwd),) = K._FWD_PLANS.items()
    ((bwd_key, bwd),) = K._BWD_PLANS.items()
    rows, cols = 7, 33
    sms = sm_count(g.device)
    if A.autotune_enabled(g.device):
        assert fwd.config in C.forward_candidates(rows, cols, torch.float16, sms)
        assert bwd.config in C.backward_candidates(rows, cols, torch.float16, sms)
    else:
        assert fwd.config == C.forward_config(rows, cols, torch.float16, sms)
        assert bwd.config == C.backward_config(rows, cols, torch.float16, sms)
    fresh_fwd = K._forward_launch(fwd.config, rows, cols)
    assert fwd.meta == fresh_fwd.meta and fwd.grid == fresh_fwd.grid
    assert fwd_key == (rows, cols, torch.float16, g.device)
    fresh_bwd = K._BackwardPlan(bwd.config, rows, cols, bwd_key[-1])
    assert bwd.programs == fresh_bwd.programs
    assert bwd.main.meta == fresh_bwd.main.meta


def test_plan_cache_starts_again_past_its_size():
    cache = A.PlanCache(max_size=3)
    for i in range(5):
        cache.add(i, object())
    assert cache.builds == 5 and len(cache) <= 3 and 4 in cache


class RoundTimer:
    """Times each config from a per-round table: round k of the tuning reads `rounds[k]`. A
    round is as many time_calls calls as its trials, so the table is indexed by the calls made."""

    def __init__(self, rounds, trials, ran):
        self.rounds, self.trials, self.ran, self.calls = rounds, trials, ran, 0

    def time_calls(self, calls):
        first = self.rounds[0]
        k = 0 if self.calls < self.trials else 1
        self.calls += 1
        out = []
        for call in calls:
            n = len(self.ran)
            call()
            out.append(self.rounds[k].get(self.ran[n], first.get(self.ran[n])))
        return out


@pytest.mark.parametrize("margin", [0.01, 0.04])
def test_close_candidates_are_timed_again_and_the_second_round_decides(monkeypatch, margin):
    """The first round's close pick (within RUNOFF_MARGIN) is not trusted: the close ones run a
    round of twice the trials, alone, and its fastest wins; a far slower one is not re-timed."""
    monkeypatch.setattr(A, "autotune_enabled", lambda device: True)
    monkeypatch.setattr(A, "capturing", lambda device: False)
    a, b, far = CONFIGS[0], CONFIGS[1], CONFIGS[2]
    first = {a: 1.0 + margin, b: 1.0, far: 1.0 + 3 * A.RUNOFF_MARGIN}
    second = {a: 1.0, b: 1.0 + margin}
    for cfg in CONFIGS[3:]:
        first[cfg] = 5.0
    launched = []
    t = A.Autotuner(make_timer=lambda d: RoundTimer([first, second], 3, launched), trials=3)
    assert t.pick(("fwd", 7), CONFIGS, launched.append, CUDA) == a
    timed = launched[len(CONFIGS) :]  # after each config's one build
    assert len(timed) == len(CONFIGS) * 3 + 2 * 6  # round one: all, 3 trials; round two: a and b, 6
    assert set(timed[len(CONFIGS) * 3 :]) == {a, b}


def test_a_clear_winner_is_not_timed_again(tuner):
    t, speeds, launched, _ = tuner
    for i, cfg in enumerate(CONFIGS):
        speeds[cfg] = 1.0 + (i + 1) * 2 * A.RUNOFF_MARGIN
    speeds[CONFIGS[-1]] = 1.0
    assert t.pick(("bwd", 3), CONFIGS, launched.append, CUDA) == CONFIGS[-1]
    assert len(launched) == len(CONFIGS) * (1 + t.trials)
