"""What a fused Llama keeps for the backward, against the unfused one: every tensor autograd saves
in one training forward (labels given), counted once per storage, parameters left out, grouped by
shape and dtype.

    python research/saved_tensors.py

Runs on a CPU through Triton's interpreter (tiny bf16 Llama: 2 layers, width 64, ffn 192, 4 heads,
2 KV heads, vocabulary 320, tied embeddings, 2 x 24 tokens). On torch 2.13, transformers 5.25
(2026-12-05): eager saves 44 tensors, 373 KB; fused 35, 254 KB. Per layer both keep the norms'
inputs, the projections' inputs, q, k, v, attention's output, gate, up and their product; eager
adds silu(gate), its fp32 norm intermediates (a (B, T, d) and a (B, T, 1) per norm) and the loss's
fp32 logits, the fused model the norms' fp32 rstd, the loss's two gradients (the head's in bf16)
and cos and sin. So the fused step's extra memory over Liger-Kernel's at the 1B size is not in
what it keeps (docs/results-h100.md).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import profuse  # noqa: E402


def saved(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[tuple, torch.dtype, int]]:
    """(shape, dtype, bytes) of each storage the forward saves for the backward, parameters left out."""
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(
            (t.untyped_storage().data_ptr(), t.dtype), (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return [v for (ptr, _), v in seen.items() if ptr not in params]


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    fused = copy.deepcopy(base)
    profuse.fuse(fused)
    for name, model in (("eager", base), ("fused", fused)):
        rows = saved(model, ids)
        print(f"{name}: {len(rows)} tensors, {sum(r[2] for r in rows)} bytes")
        for (shape, dtype), n in sorted(Counter((r[0], r[1]) for r in rows).items(), key=lambda x: -x[1]):
            print(f"  {n} x {shape} {str(dtype).removeprefix('torch.')}")


if __name__ == "__main__":
    main()
