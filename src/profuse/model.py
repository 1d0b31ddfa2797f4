"""The GPT whose training step Part A profiles, all of it in this one file (after nanoGPT).

token embedding -> n_layer pre-norm blocks -> RMSNorm -> output head, each block being

    x = x + attn(rms_norm(x))                    # causal SDPA
    x = x + w_down(silu(gate) * up)              # SwiGLU, gate/up = split(w_gate_up(rms_norm(x)))

written in plain torch ops. The memory-bound tail the lab fuses, rms_norm(silu(gate) * up +
residual) * w, is spread over this code: silu and the product end one block's feed-forward, the
residual add follows w_down, and the RMSNorm is the next block's (or the final) norm.

The code carries the residual stream apart from the branch outputs (vLLM and LLaMA do the same),
so each residual add sits in the norm that follows it:

    AddRMSNorm(x, residual) -> (y, h)    h = residual + x (the new stream), y = rms_norm(h) * w
                                         x is None for the very first norm: a plain norm of residual
    SwiGLU: w_down(silu_mul(w_gate_up(y)))   silu_mul(gate_up) = silu(gate) * up on the halves

    block(x, residual): y, residual = attn_norm(x, residual); x = attn(y)
                        y, residual = ffn_norm(x, residual);  return ffn(y), residual

The same math, in the same order, as the two lines above (a + b is b + a in floating point), and
the same parameters under the same names. Under bf16 autocast (CUDA) the residual stream h is
fp32 (the embedding's dtype; fp32 + bf16 adds to fp32) and every branch output x is bf16 (the
matmuls' dtype); here y comes out fp32 and autocast casts it to bf16 in the next matmul.

The model never learns how it is optimised: torch.compile or fused kernels are applied from
outside. `AddRMSNorm.add_rms_norm` and `SwiGLU.silu_mul` hold the plain-torch functions below;
profuse.fusion.use_block_ops swaps in the fused ones (profuse.blockops), which take the autocast
mix as it is (x bf16, residual fp32 -> h fp32, y bf16).

Trained on random tokens (`random_batch`): no data set, no download.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profuse.errors import UsageError


def _default_ffn_hidden(d_model: int) -> int:
    """8/3 * d_model (SwiGLU's three matrices then cost what a 4x GELU MLP's two do), rounded up to 64.

    256 -> 704; a multiple of 64 keeps the matmul tiles full (LLaMA rounds the same way, to 256).
    """
    return 64 * math.ceil(8 * d_model / 3 / 64)


@dataclass
class GPTConfig:
    """The lab's model: 4 layers of d_model 256; the rest are choices, each with its reason."""

    n_layer: int = 4  # the lab's
    d_model: int = 256  # the lab's
    n_head: int = 4  # head dim 64: a size every SDPA backend (flash, cuDNN, CPU) has kernels for
    # A multiple of 64 for the head's matmul tiles, and small: the tied embedding/head (8192 x 256 =
    # 2.1M weights) is 40% of the 5.3M parameters, not most of them as with GPT-2's 50257 tokens.
    vocab_size: int = 8192
    # Attention's 4*B*T^2*C = 2.1 GFLOP a forward stays a tenth of the matmuls' 2*5.3M*B*T = 22 GFLOP.
    seq_len: int = 256
    batch_size: int = 8  # 2048 tokens a step: 0.1 s on the lab's M4 laptop, about 0.7 s on 2 x86 cores
    ffn_hidden: int | None = None  # None: 8/3 * d_model rounded up to a multiple of 64 (see `hidden`)
    norm_eps: float = 1e-6  # RMSNorm's epsilon, as LLaMA; it matters only for rows near zero
    tie_weights: bool = True  # the head reuses the embedding (GPT-2, nanoGPT): 2.1M fewer weights

    def __post_init__(self) -> None:
        if self.n_layer <= 0:
            raise UsageError(f"the model needs at least one layer, not {self.n_layer}")
        for name in ("d_model", "n_head", "vocab_size", "seq_len", "batch_size", "ffn_hidden"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"{name} must be a positive number, not {value}")
        if self.d_model % self.n_head:
            raise UsageError(
                f"d_model {self.d_model} is not divisible by {self.n_head} heads: "
                "choose a head count that divides it"
            )
        if self.norm_eps <= 0:
            raise UsageError(f"norm eps must be positive, not {self.norm_eps}")

    @property
    def hidden(self) -> int:
        """The feed-forward's hidden size: ffn_hidden, or 704 for d_model 256 when that is None.

        Resolved here rather than stored, so dataclasses.replace(cfg, d_model=512) gets 1408, not 704.
        """
        return self.ffn_hidden if self.ffn_hidden is not None else _default_ffn_hidden(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def param_count(self) -> int:
        """GPT(self).num_params() without building it: embedding (+ head if untied), per layer the
        four attention and three feed-forward matrices and two norms, and the final norm."""
        d, f = self.d_model, self.hidden
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        return self.vocab_size * d * (1 if self.tie_weights else 2) + self.n_layer * per_layer + d

    def activation_bytes(self) -> int:
        """A generous bound on one training step's activations: ~16 d + 4 F fp32 numbers a token
        and layer kept for the backward (bf16 ones count half: this is the fp32 bound), the
        logits with their log-softmax and gradients (~4 V a token), and attention's scores where
        a backend writes them out (B x heads x T^2 fp32 a layer, CPU's math path)."""
        per_token = self.n_layer * (16 * self.d_model + 4 * self.hidden) + 4 * self.vocab_size
        scores = self.batch_size * self.n_head * self.seq_len**2
        return (self.tokens * per_token + scores) * 4

    def train_bytes(self) -> int:
        """A generous bound on the memory of training one copy: fp32 parameters, gradients and
        AdamW's two moments (16 bytes a parameter), autocast's bf16 weight copies (2), and one
        step's activations."""
        return 18 * self.param_count() + self.activation_bytes()


class FallbackRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dimension: nn.RMSNorm for torch < 2.4."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# torch >= 2.4 has nn.RMSNorm; the fallback, the same math, keeps older ones working.
RMSNorm = getattr(nn, "RMSNorm", FallbackRMSNorm)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = h / sqrt(mean(h^2) + eps) * w: what nn.RMSNorm computes, F.rms_norm where torch has it."""
    if hasattr(F, "rms_norm"):
        return F.rms_norm(h, (h.shape[-1],), weight, eps)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight  # pragma: no cover - torch < 2.4


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = residual + x, y = rms_norm(h) * weight, in plain torch (the unfused baseline)."""
    h = residual + x  # (B, T, C); fp32 under autocast: the stream is fp32, x bf16
    return rms_norm(h, weight, eps), h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on the two halves of the packed (..., 2F) matmul output, in plain torch."""
    gate, up = gate_up.chunk(2, dim=-1)  # each (B, T, F), views
    return F.silu(gate) * up


class AddRMSNorm(nn.Module):
    """The residual add and the norm after it: (x, residual) -> (y, h), h = residual + x the new
    residual stream, y = rms_norm(h) * weight. x is None for the first norm: y = rms_norm(residual).

    `add_rms_norm` is the function that does the add and the norm, (x, residual, weight, eps) ->
    (y, h): plain torch here; profuse.fusion swaps in a fused one from outside. The first norm has
    no add to fuse and stays plain. The parameter is `weight`, as nn.RMSNorm names it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # nn.RMSNorm's init: ones
        self.add_rms_norm = add_rms_norm

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x is None:
            return rms_norm(residual, self.weight, self.eps), residual
        return self.add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # One (C, 3C) matmul for q, k and v instead of three: one launch, full tiles.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # each (B, T, C)
        # (B, T, C) -> (B, H, T, D), the layout SDPA expects
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):
    """w_down(silu(gate) * up), gate and up the two halves of one (C, 2F) matmul's output.

    `silu_mul` is the activation on that packed output, (..., 2F) -> (..., F): plain torch here;
    profuse.fusion swaps in a fused one from outside.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.w_down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.silu_mul(self.w_gate_up(x)))  # (B, T, 2F) -> (B, T, F) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = AddRMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ffn_norm = AddRMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual): x the last branch's output (None before the first
        block, whose norm is then a plain one), residual the stream before it is added."""
        y, residual = self.attn_norm(x, residual)  # the last block's residual add, then this norm
        x = self.attn(y)
        y, residual = self.ffn_norm(x, residual)
        # The lab's tail, unfused: silu and * inside ffn; its + and norm are the next AddRMSNorm.
        return self.ffn(y), residual


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = AddRMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.embed.weight
        self.apply(self._init_weights)
        # GPT-2's scaling: each residual branch's last matmul gets std 0.02 / sqrt(2 * n_layer), so
        # the residual stream's variance stays about 1 whatever the depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, V), and the mean cross-entropy when targets are given."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise UsageError(f"a sequence of {T} tokens is longer than the model's {self.cfg.seq_len}")
        x, residual = None, self.embed(idx)  # (B, T, C): the stream starts as the embedding
        for block in self.blocks:
            x, residual = block(x, residual)
        y, _ = self.norm(x, residual)  # the last residual add, then the final norm
        logits = self.head(y)  # (B, T, V)
        if targets is None:
            return logits, None
        # The loss in fp32 even under bf16 autocast (autocast runs cross_entropy in fp32).
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def random_batch(
    cfg: GPTConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), each (batch_size, seq_len): random tokens, targets the next ones (nanoGPT).

    Drawn on the CPU from `generator` (a CPU generator draws the same tokens on every machine), then
    moved to `device`. Random text has nothing to learn beyond memorising a batch, which is all a
    profiled step needs and all the model test checks.
    """
    tokens = torch.randint(
        cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=generator, dtype=torch.long
    )
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
