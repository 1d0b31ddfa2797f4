"""The GPT of Part A: its config, its shapes, causality, and that it really learns."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from profuse.errors import UsageError
from profuse.model import GPT, FallbackRMSNorm, GPTConfig, random_batch

TINY = dict(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=32, batch_size=4)


def test_defaults_are_the_labs():
    cfg = GPTConfig()
    assert (cfg.n_layer, cfg.d_model) == (4, 256)  # the lab's model
    assert cfg.hidden == 704  # 8/3 * 256 = 682.7, rounded up to a multiple of 64
    assert cfg.head_dim == 64
    # The hidden size follows d_model through dataclasses.replace: 8/3 * 512 = 1365.3 -> 1408.
    assert replace(cfg, d_model=512).hidden == 1408
    assert GPTConfig(ffn_hidden=96).hidden == 96


@pytest.mark.parametrize(
    "bad",
    [
        dict(n_layer=0),
        dict(n_layer=-2),
        dict(d_model=250, n_head=4),  # not divisible
        dict(n_head=0),
        dict(d_model=0),
        dict(vocab_size=0),
        dict(seq_len=-1),
        dict(batch_size=0),
        dict(ffn_hidden=0),
        dict(norm_eps=0.0),
    ],
)
def test_bad_config_raises_one_clear_sentence(bad):
    with pytest.raises(UsageError) as info:
        GPTConfig(**bad)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert msg and "\n" not in msg
    assert str(next(iter(bad.values()))) in msg  # it names the value that is wrong


def test_forward_shapes_and_initial_loss():
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets)
    assert logits.shape == (cfg.batch_size, cfg.seq_len, cfg.vocab_size)
    # Small initial weights make the logits near zero, so the loss is that of a uniform guess.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    logits_only, no_loss = model(idx)
    assert no_loss is None
    torch.testing.assert_close(logits_only, logits)


def test_attention_is_causal():
    """Changing a late token must leave the logits of every earlier position as they were."""
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx, _ = random_batch(cfg, torch.Generator().manual_seed(2))
    t = cfg.seq_len // 2
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4  # and the changed position itself does move


def test_loss_falls_on_a_fixed_batch():
    """20 AdamW steps on one batch: the model memorises it, well below a uniform guess."""
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * math.log(cfg.vocab_size)  # 4.85 at the start
    assert losses[-1] < losses[0] - 2.0


def test_random_batch_is_reproducible_next_token_pairs():
    cfg = GPTConfig(**TINY)
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(7))
    idx2, targets2 = random_batch(cfg, torch.Generator().manual_seed(7))
    assert torch.equal(idx, idx2) and torch.equal(targets, targets2)
    assert idx.shape == targets.shape == (cfg.batch_size, cfg.seq_len)
    assert idx.dtype == torch.long and 0 <= int(idx.min()) and int(idx.max()) < cfg.vocab_size
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # targets are the next tokens
    other, _ = random_batch(cfg, torch.Generator().manual_seed(8))
    assert not torch.equal(idx, other)


def test_head_is_tied_to_the_embedding():
    model = GPT(GPTConfig(**TINY))
    assert model.head.weight is model.embed.weight
    untied = GPT(GPTConfig(**TINY, tie_weights=False))
    assert untied.num_params() == model.num_params() + TINY["vocab_size"] * TINY["d_model"]


def test_too_long_a_sequence_is_refused():
    cfg = GPTConfig(**TINY)
    with pytest.raises(UsageError):
        GPT(cfg)(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 7, 64), (5, 64)])
def test_fallback_rmsnorm_matches_float64(shape):
    """The fallback against the formula in float64 (and nn.RMSNorm where torch has it)."""
    x = torch.randn(shape)
    norm = FallbackRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x64, w64 = x.double(), norm.weight.detach().double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    got = norm(x)
    # fp32 rounding of a mean over 64 values and a rsqrt: a few ulps of fp32.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if hasattr(nn, "RMSNorm"):
        ref = nn.RMSNorm(64, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(norm.weight)
        torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-6)


# --- the restructure into AddRMSNorm(x, residual) -> (y, h): the same model as before -----------


class _OldBlock(nn.Module):
    """The block as it was written before the residual stream was carried apart (the oracle)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        from profuse.model import CausalSelfAttention

        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = nn.Module()
        self.ffn.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.ffn.w_down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        gate, up = self.ffn.w_gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.ffn.w_down(torch.nn.functional.silu(gate) * up)


class _OldGPT(nn.Module):
    """GPT before the restructure: modules created in the same order, initialised the same way."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(_OldBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight
        self.apply(GPT._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


needs_nn_rmsnorm = pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="the old model used nn.RMSNorm")


@needs_nn_rmsnorm
def test_restructure_keeps_names_init_and_outputs():
    """Parameter names, seeded initial values, logits, loss and every gradient as before."""
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    old = _OldGPT(cfg)
    torch.manual_seed(0)
    new = GPT(cfg)
    old_sd, new_sd = old.state_dict(), new.state_dict()
    assert list(new_sd) == list(old_sd)  # names (and their order) unchanged: checkpoints still load
    for name in old_sd:
        assert torch.equal(new_sd[name], old_sd[name]), name  # the same seeded initialisation
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(4))
    old_logits, old_loss = old(idx, targets)
    new_logits, new_loss = new(idx, targets)
    # The same ops in the same order (residual + x is x + residual exactly): equal, not just close.
    assert torch.equal(new_logits, old_logits) and torch.equal(new_loss, old_loss)
    old_loss.backward()
    new_loss.backward()
    for (name, p_old), (_, p_new) in zip(old.named_parameters(), new.named_parameters()):
        assert torch.equal(p_new.grad, p_old.grad), name


@needs_nn_rmsnorm
def test_old_checkpoint_loads_into_the_new_model():
    cfg = GPTConfig(**TINY)
    torch.manual_seed(1)
    old = _OldGPT(cfg)
    new = GPT(cfg)  # a different initialisation, then the old weights
    new.load_state_dict(old.state_dict(), strict=True)
    idx, targets = random_batch(cfg, torch.Generator().manual_seed(5))
    torch.testing.assert_close(new(idx, targets)[1], old(idx, targets)[1], rtol=0, atol=0)


def test_first_norm_is_plain_and_the_others_add_then_norm():
    """AddRMSNorm: x None -> (rms_norm(residual) * w, residual); else h = residual + x, y = norm(h)."""
    from profuse.model import AddRMSNorm

    norm = AddRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x, r = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    w64 = norm.weight.detach().double()
    ref = lambda h: h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    y, h = norm(None, r)
    assert h is r
    torch.testing.assert_close(y.double(), ref(r.double()), rtol=1e-5, atol=1e-6)
    y, h = norm(x, r)
    torch.testing.assert_close(h, r + x, rtol=0, atol=0)
    torch.testing.assert_close(y.double(), ref(r.double() + x.double()), rtol=1e-5, atol=1e-6)
