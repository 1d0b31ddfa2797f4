"""The user's own training step, from `--step FILE.py:FUNC`: FUNC() returns the step callable.

The file is loaded by path (importlib), as `python FILE.py` would run it, with its folder first on
sys.path so that it can import its neighbours. Every way this can go wrong is one line
(UsageError) before any profiling starts: no such file, not Python, an import that raises, no
such function, a function that needs arguments, raises, or returns something that is not a
zero-argument callable.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from profuse.errors import UsageError

STEP_HELP = (
    "FILE.py:FUNC - profile your own training step: FUNC() builds the model, optimizer and batch "
    "and returns a zero-argument callable that runs one whole step"
)


def _where(err: BaseException, path: Path) -> str:
    """' (FILE.py, line N)': the last frame of the traceback in the user's file, if any."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == path]
    return f" ({path.name}, line {frames[-1].lineno})" if frames else ""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def parse_step_arg(text: str) -> tuple[Path, str]:
    """'train.py:make_step' -> (Path('train.py'), 'make_step')."""
    path, sep, func = text.rpartition(":")
    if not sep or not path or not func.isidentifier():
        raise UsageError(
            f"--step {text!r}: expected FILE.py:FUNC, a Python file and the function in it that "
            "returns the step"
        )
    return Path(path), func


def load_step(text: str) -> Callable[[], object]:
    """Import FILE.py, call FUNC() and return the step it returns; UsageError (one line) otherwise."""
    path, func_name = parse_step_arg(text)
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise UsageError(f"--step {path}: {what}")
    if path.suffix != ".py":
        raise UsageError(f"--step {path}: not a Python file (.py)")
    path = path.resolve()
    name = f"profuse_user_step_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
        raise UsageError(f"--step {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise UsageError(
            f"--step {path.name}: importing it raised {_one_line(err)}{_where(err, path)}"
        ) from None
    finally:
        sys.path.remove(str(path.parent))
    func = getattr(module, func_name, None)
    if func is None:
        funcs = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        has = f" (it defines: {', '.join(funcs)})" if funcs else ""
        raise UsageError(f"--step {text}: {path.name} has no function {func_name!r}{has}")
    if not callable(func):
        raise UsageError(f"--step {text}: {func_name} is a {type(func).__name__}, not a function")
    try:
        inspect.signature(func).bind()
    except TypeError:
        raise UsageError(
            f"--step {text}: {func_name}() must take no arguments; it returns the step"
        ) from None
    except ValueError:  # pragma: no cover - a builtin without a signature: call it and see
        pass
    try:
        step = func()
    except Exception as err:
        raise UsageError(f"--step {text}: {func_name}() raised {_one_line(err)}{_where(err, path)}") from None
    if not callable(step):
        raise UsageError(
            f"--step {text}: {func_name}() returned {type(step).__name__}, not the step: it must "
            "return a zero-argument callable that runs one training step"
        )
    return step
