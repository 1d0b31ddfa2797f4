"""`profuse step`: Part C, the whole training step of a model in several variants."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from profuse.bench import DEFAULT_TRIALS
from profuse.cli.common import (
    Parser,
    ProgressLines,
    add_device_args,
    add_out_arg,
    add_precision_arg,
    add_threads_arg,
    check_out,
    nonnegative_int,
    positive_int,
    set_threads,
    trial_count,
    variant_keys,
)

# --------------------------------------------------------------------------------------------
# Part C: the whole training step
# --------------------------------------------------------------------------------------------

STEP_VARIANTS = (
    "eager", "fused", "moe-best", "moe-best+fused", "liger-ops", "liger", "compile", "compile-stock",
    "compile+fused", "compile+loss", "cudagraphs",
)  # fmt: skip
# The sizes --preset names: the built-in GPT's, then the Hugging Face models' (profuse.models).
GPT_STEP_PRESETS = ("lab", "small", "medium")
HF_STEP_PRESETS = (
    "tiny", "Llama-3.2-1B", "Qwen2.5-0.5B", "Qwen3-0.6B", "Gemma-3-1B", "OLMo-2-1B", "Phi-4-mini",
    "OLMoE-1B-7B", "Qwen3-30B-A3B-12L", "OLMoE-1B-7B-8L", "Qwen3-30B-A3B-4L",
)  # fmt: skip
CPU_STEP_HINT = (
    "Part C (the whole training step, eager vs fused vs torch.compile) runs here on CUDA; on a CPU run "
    "it yourself: profuse step --device cpu --preset lab --variants eager,compile (TRITON_INTERPRET=1 "
    "adds the fused variants, slowly)"
)


class _WholeNames(argparse.HelpFormatter):
    """Help lines broken between words only: a variant's name (compile-stock, moe-best+fused)
    stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_step_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="profuse step",
        formatter_class=_WholeNames,
        description="Part C: how much faster does fusing make the training step, really? Whole training "
        "steps (forward, loss, backward, AdamW) of a model (the built-in GPT, or a Hugging Face "
        "Llama-family model with random weights) as written (eager), with its block ops fused "
        "(silu_mul, add_rms_norm: profuse's Triton kernels), with Liger-Kernel's patch, under "
        "torch.compile, and both: the same math checked against float64 first, then interleaved "
        "trials with the speedup over eager and its 95% CI, peak memory, kernels per step, the gain "
        "Amdahl's law predicts from the fused ops' own speedups beside the gain measured, and a "
        "verdict. Writes step.json and a trace per variant.",
    )
    add_device_args(p)
    p.add_argument(
        "--model", default="gpt", metavar="gpt|hf:ARCH",
        help="the model: gpt, the built-in (default), or hf:ARCH, ARCH one of llama, mistral, qwen2, "
        "qwen3, gemma3_text, olmo2, phi3, olmoe, qwen3_moe (transformers' own class, random weights, "
        "nothing downloaded)",
    )  # fmt: skip
    p.add_argument(
        "--preset", default=None, choices=GPT_STEP_PRESETS + HF_STEP_PRESETS,
        help="model size. gpt: lab = 4 layers, d_model 256, 8 x 256 tokens a step (the lab's, the "
        "default); small = 8 layers, d_model 1024, 8 heads, 8 x 1024 tokens; medium = small with "
        "d_model 2048, 16 heads (the model flags override them). hf:ARCH: tiny (2 layers, width 96, "
        "2 x 64 tokens; the default) or a published model's shapes, 4 x 2048 tokens a step: "
        "Llama-3.2-1B (hf:llama), Qwen2.5-0.5B (hf:qwen2), Qwen3-0.6B (hf:qwen3), Gemma-3-1B "
        "(hf:gemma3_text, a 262,144 vocabulary), OLMo-2-1B (hf:olmo2, post-norm), Phi-4-mini (hf:phi3, "
        "3.8B parameters: bf16 fits one 141 GB card at 4 x 2048 tokens, amp may not); mixtures of experts, "
        "the router's aux loss on: OLMoE-1B-7B (hf:olmoe, 6.9B parameters, 64 experts top-8) and "
        "Qwen3-30B-A3B-12L (hf:qwen3_moe): Qwen3-30B-A3B's layer at 12 of its 48 layers, 8.1B "
        "parameters, because 48 hold 30.5B, 244 GB with AdamW in bf16, and 12 fit one 141 GB card "
        "(~100 GB with the step's activations and logits) with room for the baselines; for an 80 GB "
        "card, OLMoE-1B-7B-8L and Qwen3-30B-A3B-4L: the same layers, 8 of 16 and 4 of 48",
    )  # fmt: skip
    p.add_argument(
        "--hf-config", type=Path, default=None, metavar="PATH",
        help="with --model hf:ARCH: a local config.json (or its folder) instead of a preset; "
        "4 x 2048 tokens a step unless --batch-size and --seq-len say otherwise",
    )  # fmt: skip
    g = p.add_argument_group("the model (the built-in GPT's sizes; each overrides the preset)")
    g.add_argument("--layers", type=positive_int, default=None, help="transformer blocks")
    g.add_argument("--d-model", type=positive_int, default=None, help="hidden size")
    g.add_argument("--heads", type=positive_int, default=None, help="attention heads; must divide --d-model")
    g.add_argument("--vocab-size", type=positive_int, default=None, help="vocabulary size")
    g.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (any model)")
    g.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (any model)")
    p.add_argument(
        "--variants", type=variant_keys, default=None, metavar="LIST",
        help=f"comma-separated, from: {', '.join(STEP_VARIANTS)}. eager: the model as written; fused: "
        "profuse's fused block ops; moe-best (mixtures of experts): the unfused model with its experts "
        "run by transformers' implementation fastest on this device (grouped_mm where torch has a native "
        "grouped matmul for it, else batched_mm for a small batch or the eager loop; the run says which "
        "and why, and skips both where the model as built runs it already); moe-best+fused: fused over "
        "that same implementation; liger-ops: Liger-Kernel's "
        "RMSNorm and SwiGLU alone; liger: Liger's full patch (RoPE, RMSNorm, SwiGLU, fused linear "
        "cross-entropy; for an MoE family Liger's own patch of it); compile: torch.compile of "
        "the unfused model with the causal-mask fix profuse.fuse makes for itself (a plain causal call "
        "reaches SDPA as is_causal, no mask built while compiling), so compile+fused vs compile is the "
        "fusion alone; compile-stock: torch.compile of the model as transformers ships it (hf:ARCH); "
        "compile+fused: the fused model compiled; compile+loss (hf:ARCH, by name only): the model compiled "
        "with profuse's fused linear cross-entropy alone and its mask fix, the norms, SwiGLU and RoPE left "
        "to Inductor; cudagraphs: compile replayed as CUDA graphs. "
        "Default: for gpt eager, fused, compile, compile+fused; for hf:ARCH all but compile-stock and "
        "compile+loss (and the moe-best ones for a dense model). "
        "eager, the baseline, is always in; a variant that cannot run here is skipped with the reason: "
        "fused where no Triton kernels run, liger and liger-ops without CUDA and liger-kernel, "
        "cudagraphs without CUDA, compile-stock for gpt (no mask to fix), moe-best for a dense model",
    )  # fmt: skip
    add_precision_arg(p, "the whole run (every variant, its check, trials and profiles)")
    p.add_argument(
        "--optimizer", default="default", choices=("default", "fused"),
        help="AdamW's implementation, the same for every variant: default = torch.optim.AdamW as torch "
        "builds it (foreach on CUDA); fused = AdamW(fused=True), one kernel over every parameter, what "
        "Hugging Face's Trainer uses by default from torch 2.8 (adamw_torch_fused) (default: default)",
    )  # fmt: skip
    p.add_argument(
        "--trials",
        type=trial_count,
        default=None,
        help="interleaved timed trials, rounded up to whole carry-over-balanced designs (n trials for n "
        f"variants, 2n where n is odd) (default: {DEFAULT_TRIALS}, except on CUDA where a round of "
        "every variant's steps is long: as many whole designs as 120 s of steps holds, one at the least; "
        "on CUDA more, up to 30, where the two fastest are within 2%%, within the same 120 s; under 30 "
        "trials each CI is a distribution-free interval from order statistics, its exact coverage "
        "printed)",
    )
    p.add_argument(
        "--profile-steps", type=nonnegative_int, default=3,
        help="profiled steps per variant, for kernels per step and the Amdahl prediction; 0 skips the "
        "profiles and the prediction (default: 3)",
    )  # fmt: skip
    add_threads_arg(p)
    add_out_arg(
        p, ".", "step.json and the traces (trace-step-VARIANT.json; with --precision both "
        "trace-step-VARIANT-amp.json and -bf16.json)",
    )  # fmt: skip
    return p


def precisions(args) -> tuple[str, ...]:
    """The precisions a run of `args` covers, in order: ('amp',), ('bf16',) or both."""
    chosen = getattr(args, "precision", "amp")
    return ("amp", "bf16") if chosen == "both" else (chosen,)


def step_config(args, device, preset: str | None, precision: str | None = None):
    from profuse.models import model_spec
    from profuse.step import StepConfig

    spec = model_spec(
        getattr(args, "model", "gpt"),
        preset,
        config_path=getattr(args, "hf_config", None),
        batch_size=getattr(args, "batch_size", None),
        seq_len=getattr(args, "seq_len", None),
        n_layer=getattr(args, "layers", None),
        d_model=getattr(args, "d_model", None),
        n_head=getattr(args, "heads", None),
        vocab_size=getattr(args, "vocab_size", None),
    )
    kw = {
        name: getattr(args, name)
        for name in ("variants", "trials", "profile_steps", "optimizer")
        if hasattr(args, name)
    }
    both = getattr(args, "precision", "amp") == "both"
    precision = precision or precisions(args)[0]
    return StepConfig(
        model=spec, device=device, seed=args.seed, out_dir=args.out, precision=precision,
        trace_tag=precision if both else "", **kw,
    )  # fmt: skip


def check_step(cfg) -> None:
    """Part C's memory check, for the variants that can run here: before any long work."""
    from profuse.step import check_step_fits, plan

    check_step_fits(cfg, plan(cfg, None)[0])


def run_part_c(cfgs, progress: ProgressLines | None = None) -> None:
    """Part C in each config (one per precision, one after the other), its progress as lines on
    stderr (`progress`, or lines of its own); one table each, then (two precisions) the ranks that
    moved; step.json holds it all."""
    from profuse.files import write_result
    from profuse.report.step import both_precisions, format_step
    from profuse.step import StepInterrupted, run_step

    cfgs = cfgs if isinstance(cfgs, (list, tuple)) else [cfgs]
    progress = progress or ProgressLines()
    runs, cut, stopped = [], "", None
    try:
        for cfg in cfgs:
            progress.prefix = f"{cfg.precision}: " if len(cfgs) > 1 else ""
            runs.append(run_step(cfg, progress=progress).to_dict())
    except StepInterrupted as err:  # after its timed trials: they are saved, marked
        runs.append(err.result.to_dict())
        cut = f"{err.result.config.precision} was {err.result.interrupted}, after its timed trials"
    except KeyboardInterrupt:
        if not runs:
            raise
        stopped = cfgs[len(runs)].precision  # --precision both, in its second run: the first is whole
    finally:
        progress.close()
    data = runs[0] if len(runs) == 1 else both_precisions(runs)
    print(format_step(data))
    path = write_result(Path(cfgs[0].out_dir) / "step.json", data)
    if cut:
        unrun = [c.precision for c in cfgs[len(runs) :]]
        raise KeyboardInterrupt(
            f"{cut}: what it finished is kept in {path} (its trials, memory and checks; no Amdahl)"
            + (f"; {', '.join(unrun)} did not run" if unrun else "")
        )
    if stopped is not None:
        done = cfgs[0].precision
        raise KeyboardInterrupt(
            f"{done} had finished: its results are kept in {path} (a run of {done} alone); {stopped} "
            "did not finish and is not saved"
        )
    print(f"results: {path}")


def cmd_step(argv: list[str]) -> int:
    args = build_step_parser().parse_args(argv)  # before torch is imported: --help stays quick
    # Heartbeats from the start: importing torch, transformers and triton and checking the size
    # took 12-16 s on a card's host before the run's first stage (H100, 2026-12-07).
    progress = ProgressLines()
    try:
        progress.quietly("starting: torch, the model's sizes and the memory check")
        from profuse.env import resolve_device

        check_out(args, ())  # a folder that cannot be written fails now, not after the measuring
        set_threads(args)
        device = resolve_device(args.device)
        cfgs = [step_config(args, device, args.preset, p) for p in precisions(args)]
        for cfg in cfgs:
            check_step(cfg)
        run_part_c(cfgs, progress)
    finally:
        progress.close()
    return 0
