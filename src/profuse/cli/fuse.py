"""`profuse fuse`: what profuse.fuse does to each causal-LM family, from the real probes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from profuse.cli.common import Parser, ProgressLines, check_out
from profuse.errors import UsageError

COVERAGE_FILES = ("coverage.json", "coverage.md")


def build_fuse_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="profuse fuse",
        description="What profuse.fuse does to each causal-LM family of the installed transformers: a tiny "
        "model of the family from its own config class (random weights, every size shrunk), fused with "
        "the real probes; the ops placed and how often, what is left unfused and why, or why the model "
        "is refused. Unless --dry-run, the fused model is then checked against the unfused one on a "
        "random batch: the train-mode loss and every gradient, the eval-mode logits (fp32). No download.",
    )
    p.add_argument(
        "--model", default="hf:all", metavar="hf:FAMILY[,FAMILY...]|hf:all",
        help="the families, by model type (llama, gemma3, qwen3_moe, ...; default hf:all, every "
        "causal-LM family of the installed transformers: --list names them)",
    )  # fmt: skip
    p.add_argument(
        "--hf-config", type=Path, default=None, metavar="PATH",
        help="a local config.json (or its folder) instead: its family and layout, at tiny sizes",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="plan only: no check against the unfused model")
    p.add_argument(
        "--impl", choices=("eager", "fused"), default="eager",
        help="the ops the check runs: eager, profuse's ops one at a time in plain torch (checks the "
        "structure; default), or fused, the Triton kernels (a GPU, or TRITON_INTERPRET=1: slow)",
    )  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="print the table as markdown, for a page")
    p.add_argument("--list", action="store_true", help="list the causal-LM families and exit")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for coverage.json and coverage.md (default: print only)",
    )
    return p


def _families(args) -> list[str] | None:
    model = args.model.strip()
    if not model.startswith("hf:"):
        raise UsageError(f"--model {model}: profuse fuse takes hf:FAMILY or hf:all (Hugging Face models)")
    names = [n.strip() for n in model[3:].split(",")]
    if any(not n for n in names):
        raise UsageError(f"--model {model}: an empty family name")
    return None if names == ["all"] else names


def cmd_fuse(argv: list[str]) -> int:
    args = build_fuse_parser().parse_args(argv)  # before torch is imported: --help stays quick
    from profuse.models.hf import read_config_json, require_transformers

    require_transformers()
    from profuse import coverage as C
    from profuse import fusion
    from profuse.models import hf_families

    if args.list:
        print("\n".join(hf_families.families()))
        return 0
    if args.out is not None:
        check_out(args, COVERAGE_FILES)
    impl = fusion.FUSED if args.impl == "fused" else fusion.EAGER
    if args.hf_config is not None:
        data = read_config_json(args.hf_config)
        cov = C.config_coverage(data, impl=impl, dry_run=args.dry_run)
    else:
        names = _families(args)
        progress = ProgressLines() if sys.stderr.isatty() or names is None or len(names) > 3 else None
        try:
            cov = C.coverage(names, impl=impl, dry_run=args.dry_run, progress=progress)
        finally:
            if progress is not None:
                progress.close()
    from profuse.report.coverage import coverage_markdown, coverage_text

    print(coverage_markdown(cov) if args.markdown else coverage_text(cov))
    if args.out is not None:
        from profuse.files import write_result, write_text

        out = Path(args.out)
        write_result(out / "coverage.json", cov.to_dict())  # with its provenance
        write_text(out / "coverage.md", coverage_markdown(cov) + "\n")
        print(f"results: {out / 'coverage.json'}, {out / 'coverage.md'}")
    return 0
