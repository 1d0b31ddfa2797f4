"""Files written whole or not at all: write to a temporary file beside the target, then rename.

A run killed halfway leaves the old file (or none), never half of a new one; os.replace is atomic
on POSIX and Windows when source and target are on the same file system. `check_folder` finds a
folder that cannot be written before a run measures anything, rather than after.

Every result file (step.json, results.json and its partial file, profile.json, profile_ddp.json)
is written through `write_result`, which adds the run's provenance (env.provenance: commit,
versions, card, command, start and end), so no command can forget it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from profuse.errors import UsageError

PROVENANCE = "provenance"


# When this run began and how profuse was called: set by the CLI as a command starts
# (mark_run); for a library user, when profuse.files was first imported.
def _utc_now() -> str:  # env.utc_now's format; here so that marking a run loads no torch
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_RUN: dict = {"started_utc": _utc_now(), "command": None}


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp makes the file private (0600); give it the mode a plain open() would have.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def mark_run(command: list[str] | None = None) -> None:
    """Note that a run starts now, called as `command` (profuse's own arguments)."""
    _RUN.update(started_utc=_utc_now(), command=None if command is None else list(command))


def with_provenance(data: Any) -> Any:
    """`data` (a result's dict) with its provenance added, unless it has one already (a sweep's
    JSON and CSV share one); anything but a dict is returned as it is."""
    if not isinstance(data, dict) or PROVENANCE in data:
        return data
    from profuse.env import provenance

    return {**data, PROVENANCE: provenance(_RUN["started_utc"], _RUN["command"])}


def write_result(path: str | os.PathLike, data: Any) -> Path:
    """A result file: `data` with its provenance (with_provenance), as JSON, written whole."""
    return write_json(path, with_provenance(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):  # numpy and torch scalars
        return obj.item()
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def check_folder(folder: str | os.PathLike, names: tuple[str, ...] = (), flag: str = "--out") -> None:
    """UsageError (one line) unless the files `names` can be written into `folder`.

    It writes and removes a probe file there, making any missing folders on the way and removing
    them again, so a folder that cannot be written (a file, a read-only place, a name the file
    system refuses) fails before the work, and a check that passes leaves nothing behind.
    """
    path = Path(folder)
    what = f"{flag} {path}"
    try:
        _check_folder(path, names, flag, what)
    except UsageError:
        raise
    except ValueError as err:  # a NUL byte in the name, say
        raise UsageError(f"{what}: not a usable path ({err})") from None


def _check_folder(path: Path, names: tuple[str, ...], flag: str, what: str) -> None:
    made: list[Path] = []
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(
                f"{what} is a file, not a folder: {flag} takes the folder to write {_listed(names)} into"
            )
        for name in names:
            if (path / name).is_dir():
                raise UsageError(f"{path / name} is a folder, so {name} cannot be written there")
        missing = []
        parent = path
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        if not parent.is_dir():
            raise UsageError(f"{what}: {parent} is a file, so no folder can be made under it")
        for part in reversed(missing):
            part.mkdir()
            made.append(part)
        fd, probe = tempfile.mkstemp(prefix=".profuse-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise UsageError(f"{what}: cannot write there ({why}): choose a folder you can write to") from None
    finally:
        for part in reversed(made):
            with contextlib.suppress(OSError):
                part.rmdir()


def _listed(names: tuple[str, ...]) -> str:
    if not names:
        return "its files"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
