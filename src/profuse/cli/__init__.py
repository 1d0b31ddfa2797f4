"""The command line: argparse -> configs -> run -> report.

profuse [flags]              the lab's main job: Part A (profile a training step), then Part B
profuse profile [flags]      Part A alone (also: profuse --profile-only)
profuse sweep [flags]        Part B over several sizes, with CSV and plots
profuse step [flags]         Part C: whole training steps, eager vs fused vs torch.compile
profuse report RESULTS.json  print a saved run again (--markdown for a table to paste)
profuse diff A.json B.json   compare two saved runs variant by variant
profuse fuse [--model hf:F]  what profuse.fuse does to each causal-LM family, checked on tiny models
"""

from __future__ import annotations

import os
import sys

from profuse.cli.common import (
    DDP_FILES,
    NATIVE_NOISE,
    PLOTS,
    TRACE_JSON,
    Progress,
    build_parser,
    build_profile_parser,
    check_settings,
    part_a_files,
)
from profuse.cli.fuse import build_fuse_parser, cmd_fuse
from profuse.cli.parts import cmd_main, cmd_profile, worker_argv
from profuse.cli.results import (
    build_diff_parser,
    build_report_parser,
    build_sweep_parser,
    cmd_diff,
    cmd_report,
    cmd_sweep,
    sizes_left_commands,
)
from profuse.cli.step import build_step_parser, cmd_step, step_config
from profuse.errors import UsageError
from profuse.files import mark_run

__all__ = [
    "DDP_FILES",
    "NATIVE_NOISE",
    "PLOTS",
    "TRACE_JSON",
    "Progress",
    "build_diff_parser",
    "build_fuse_parser",
    "build_parser",
    "build_profile_parser",
    "build_report_parser",
    "build_step_parser",
    "build_sweep_parser",
    "main",
    "part_a_files",
    "sizes_left_commands",
    "step_config",
    "worker_argv",
]

COMMANDS = {
    "profile": cmd_profile,
    "sweep": cmd_sweep,
    "step": cmd_step,
    "report": cmd_report,
    "diff": cmd_diff,
    "fuse": cmd_fuse,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    mark_run(argv)  # the start and command line every file this run writes records
    command = cmd_main
    if argv and argv[0] in COMMANDS:
        command, argv = COMMANDS[argv[0]], argv[1:]
    try:
        if not {"-h", "--help"} & set(argv):
            check_settings()
        return command(argv)
    except UsageError as err:
        print(f"profuse: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # a command may say what it kept (KeyboardInterrupt(text))
        print(f"profuse: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `profuse ... | head`: the reader left; nothing more to say
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SystemExit as exit_:  # argparse (--help, a bad flag): a code, for callers of main()
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
