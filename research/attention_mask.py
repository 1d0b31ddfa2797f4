"""What a materialised causal mask costs scaled-dot-product attention, against `is_causal=True`.

    PYTHONPATH=src python research/attention_mask.py [--out DIR]

Hugging Face's SDPA path (transformers.integrations.sdpa_attention) calls attention in one of two
ways for a training step with no padding:
- mask None: `is_causal=True`, GQA through `enable_gqa` (the key/value heads as they are);
- a (B, 1, T, T) boolean causal mask (what `create_causal_mask` returns while torch.compile traces
  on torch < 2.14): `is_causal=False`, and the key/value heads repeated to the query's (repeat_kv).
Times forward and forward + backward of each at Llama-3.2-1B's shapes (4 x 2048 tokens, 32 query
heads, 8 key/value heads, head dim 64, bf16), eager and under torch.compile, CUDA events, median of
20 after 5 warm-up calls; the backward's kernel is whatever SDPA picks on the card.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

B, HQ, HKV, T, D = 4, 32, 8, 2048, 64


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def masked(q, k, v, mask):
    rep = HQ // HKV
    k = k[:, :, None].expand(B, HKV, rep, T, D).reshape(B, HQ, T, D)
    v = v[:, :, None].expand(B, HKV, rep, T, D).reshape(B, HQ, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


def timed(fn, n: int = 20) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def qkv():
        # The layouts HF hands SDPA: (B, T, H, D) projections viewed as (B, H, T, D).
        q = torch.randn(B, T, HQ, D, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn(B, T, HKV, D, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        v = torch.randn(B, T, HKV, D, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        return [t.requires_grad_() for t in (q, k, v)]

    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None].expand(B, 1, T, T)
    q, k, v = qkv()
    dout = torch.randn(B, HQ, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    a, b = causal(q, k, v), masked(q, k, v, mask)
    err = (a.float() - b.float()).abs().max().item()
    rows = {"max_abs_difference": err}
    for mode in ("eager", "compile"):
        c = causal if mode == "eager" else torch.compile(causal)
        m = masked if mode == "eager" else torch.compile(masked)
        calls = (("is_causal", lambda c=c: c(q, k, v)), ("mask", lambda m=m: m(q, k, v, mask)))
        for name, fn in calls:
            with torch.no_grad():
                fwd = timed(fn)
            fb = timed(lambda fn=fn: fn().backward(dout))
            rows[f"{mode} {name}"] = {"forward_ms": fwd, "forward_backward_ms": fb}
            print(f"{mode:8s} {name:10s} forward {fwd:6.2f} ms  forward + backward {fb:6.2f} ms", flush=True)
    print(f"outputs differ by at most {err:.2e}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attention_mask.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
