"""profuse.fuse with the real Triton kernels on a GPU: every op, checked (no timing). CUDA only.

Llama, Mistral, Qwen2 and Qwen3 models with random weights (4 layers, hidden 1024, head_dim 64
or 128, vocab 32768, 2 x 512 tokens a step), each fused whole with profuse.fusion.FUSED:

    counts        the ops fused and their places (Qwen3: qk_norm_rope in place of rope)
    fp32, amp, bf16
                  loss and every gradient (labels with ignored tokens) of the fused and the
                  unfused model against float64 (Hugging Face's norms and loss written out in
                  float64): the fused within twice the unfused model's error, or the dtype's
                  tolerance (profuse.tail); amp is fp32 parameters under bf16 autocast
    compile       torch.compile(fullgraph=True) of the fused model, amp, the same bound
    generate      greedy tokens, fp32, fused against unfused (the count that differ)
    logits        in training with labels, not made; without labels, the logits (amp)
                  against float64 within twice the unfused model's error, or bf16's tolerance
    float64       the fused model moved to float64: bitwise the unfused one (the kernels take
                  bf16, fp16 and fp32; float64 runs Hugging Face's own math)

    PYTHONPATH=src python benchmarks/check_fuse.py --out results/h200-DATE-fuse-check

writes check_fuse.json under --out and prints one line a check; exit status 1 if any fails.
About a minute on an H200, most of it compiling (--compile qwen3 by default; add llama for
the rope path under compile, ~40 s more).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

from profuse import crossentropy, fusion
from profuse.env import environment
from profuse.errors import UsageError
from profuse.files import check_folder, write_json
from profuse.fusion.hf_head import LOGITS_NOT_MADE
from profuse.tail import BACKWARD_TOL, FORWARD_TOL, relative_error

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
BATCH, SEQ, VOCAB, LAYERS = 2, 512, 32768, 4
DEVICE = torch.device("cuda")


def build(arch: str, seed: int):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    head_dim = 128 if arch == "qwen3" else 64
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=LAYERS,
        num_attention_heads=1024 // head_dim,
        num_key_value_heads=1024 // head_dim // 2,
        head_dim=head_dim,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=arch == "qwen3",
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.to(DEVICE)


def oracle(model):
    """The unfused model in float64 all through (norms and loss written out in float64)."""
    m = copy.deepcopy(model).double()
    for mod in m.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = lambda x, mod=mod: F.rms_norm(
                x.double(), (x.shape[-1],), mod.weight, mod.variance_epsilon
            )

    def loss(logits, labels, vocab_size, ignore_index=-100, **kwargs):
        target = crossentropy.shifted_labels(labels)
        return F.cross_entropy(
            logits.double().reshape(-1, vocab_size), target.reshape(-1), ignore_index=ignore_index
        )

    m._loss_function = loss
    return m


def step(model, ids, labels, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads


def errors(got, want) -> dict[str, float]:
    loss, grads = got
    out = {"loss": relative_error(loss, want[0])}
    out.update({n: relative_error(g, want[1][n]) for n, g in grads.items()})
    return out


def bounded(fused: dict, unfused: dict, dtype) -> tuple[bool, str]:
    """Fused within twice unfused's error or the dtype's tolerance, key by key; the worst ratio."""
    worst, where = 0.0, ""
    for key, err in fused.items():
        tol = FORWARD_TOL[dtype] if key == "loss" else BACKWARD_TOL[dtype]
        bound = max(2 * unfused[key], tol)
        if err / bound > worst:
            worst, where = err / bound, key
    return worst <= 1, f"worst {worst:.2f} of its bound ({where})"


def check_arch(arch: str, rows: list, compiled: list[str]) -> None:
    base = build(arch, seed=ARCHS.index(arch))
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEVICE, generator=gen)
    labels = ids.clone()
    labels[torch.rand(ids.shape, device=DEVICE, generator=gen) < 0.25] = -100
    f64 = oracle(base)
    want = step(f64, ids, labels, autocast=False)
    with torch.no_grad():
        want_logits = f64(input_ids=ids).logits
    del f64

    def record(check, ok, detail, **extra):
        rows.append({"arch": arch, "check": check, "ok": bool(ok), "detail": detail, **extra})
        print(f"{arch:8} {check:9} {'ok  ' if ok else 'FAIL'} {detail}", flush=True)

    fused = copy.deepcopy(base)
    summary = fusion.fuse(fused)
    attention = "qk_norm_rope" if arch == "qwen3" else "rope"
    expected = {
        "silu_mul": LAYERS,
        "add_rms_norm": 2 * LAYERS,
        "rms_norm": 1,
        attention: LAYERS,
        "linear_cross_entropy": 1,
    }
    record(
        "counts",
        summary.counts == expected and not summary.left_unfused,
        str(summary.counts),
        summary=str(summary),
    )

    for check, dtype, autocast in (
        ("fp32", torch.float32, False),
        ("amp", torch.bfloat16, True),
        ("bf16", torch.bfloat16, False),
    ):
        u, f = copy.deepcopy(base), copy.deepcopy(fused)
        if check == "bf16":
            u, f = u.to(torch.bfloat16), f.to(torch.bfloat16)
        eu, ef = errors(step(u, ids, labels, autocast), want), errors(step(f, ids, labels, autocast), want)
        ok, detail = bounded(ef, eu, dtype)
        record(
            check,
            ok,
            f"loss err fused {ef['loss']:.1e} unfused {eu['loss']:.1e}; {detail}",
            fused=ef,
            unfused=eu,
        )
        del u, f

    if arch in compiled:
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(fused), fullgraph=True)
        start = time.perf_counter()
        ec = errors(step(compiled, ids, labels, True), want)
        eu = errors(step(copy.deepcopy(base), ids, labels, True), want)
        ok, detail = bounded(ec, eu, torch.bfloat16)
        record(
            "compile", ok, f"{detail}; first step {time.perf_counter() - start:.0f} s", fused=ec, unfused=eu
        )
        torch._dynamo.reset()
        del compiled

    prompt = ids[:, :32]
    with torch.no_grad():
        a = base.eval().generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False
        )
        b = fused.eval().generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False
        )
    base.train(), fused.train()
    differ = int((a != b).sum())
    record(
        "generate",
        a.shape == b.shape,
        f"{differ} of {a[:, 32:].numel()} greedy tokens differ (fp32)",
        differ=differ,
    )

    with torch.autocast(DEVICE.type, torch.bfloat16):
        out = fused(input_ids=ids, labels=labels)
        with torch.no_grad():
            ef = relative_error(fused(input_ids=ids).logits, want_logits)
            eu = relative_error(base(input_ids=ids).logits, want_logits)
    skipped = out.logits is LOGITS_NOT_MADE
    ok = skipped and ef <= max(2 * eu, FORWARD_TOL[torch.bfloat16])
    detail = f"not made in training with labels: {skipped}; without, fused {ef:.1e} unfused {eu:.1e} (amp)"
    record("logits", ok, detail, fused=ef, unfused=eu)

    f64, u64 = copy.deepcopy(fused).double(), copy.deepcopy(base).double()
    (lf, gf), (lu, gu) = step(f64, ids, labels, False), step(u64, ids, labels, False)
    same = torch.equal(lf, lu) and gf.keys() == gu.keys() and all(torch.equal(gf[n], gu[n]) for n in gu)
    record("float64", same, "bitwise the unfused model" if same else "differs from the unfused model")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for check_fuse.json (made if missing)")
    p.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, from {', '.join(ARCHS)}")
    p.add_argument("--compile", default="qwen3", help="the archs also checked under torch.compile")
    args = p.parse_args()
    archs = [a for a in args.archs.split(",") if a]
    compiled = [a for a in args.compile.split(",") if a]
    if not torch.cuda.is_available() or any(a not in ARCHS for a in archs + compiled):
        print("check_fuse: needs CUDA and --archs from " + ", ".join(ARCHS), file=sys.stderr)
        return 2
    try:
        check_folder(args.out, ("check_fuse.json",))
    except UsageError as err:
        print(f"check_fuse: {err}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    for arch in archs:
        check_arch(arch, rows, compiled)
    env = environment(DEVICE)
    write_json(os.path.join(args.out, "check_fuse.json"), {"environment": env, "checks": rows})
    failed = [f"{r['arch']} {r['check']}" for r in rows if not r["ok"]]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} checks ok"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
