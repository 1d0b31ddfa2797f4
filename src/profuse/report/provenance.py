"""Where a saved run came from, as text: the block `profuse report` prints under any saved file,
and the lines `profuse diff` prints where two runs differ in it.

Reads the saved `provenance` dict (env.provenance, added by files.write_result); files saved
before it was recorded say so and load as they always did.
"""

from __future__ import annotations

import shlex

NONE_RECORDED = "provenance: no provenance recorded (saved before profuse recorded commit, card and command)"
# Fields every two runs differ in: said once, in the lines' head, never as a difference.
TIMES = ("started_utc", "ended_utc")


def provenance_lines(data: dict) -> list[str]:
    """The short block: commit and dirty flag, versions, card, host, command, start and end."""
    prov = data.get("provenance") if isinstance(data, dict) else None
    if not prov:
        return [NONE_RECORDED]
    return [
        "provenance:",
        f"  source: {source_words(prov.get('source') or {})}",
        f"  versions: {versions_words(prov.get('versions') or {})}",
        f"  card: {card_words(prov.get('card') or {})}",
        f"  host: {prov.get('host') or '?'}",
        f"  command: {command_words(prov.get('command') or {})}",
        f"  run: {prov.get('started_utc') or '?'} to {prov.get('ended_utc') or '?'}",
    ]


def source_words(source: dict) -> str:
    """'commit 1a2b3c4d5e6f' or 'commit 1a2b3c4d5e6f with uncommitted changes', or what is not known."""
    commit = source.get("commit")
    if not commit:
        return f"not a git checkout ({source.get('path') or 'path not recorded'}): no commit recorded"
    dirty = source.get("dirty")
    state = " with uncommitted changes" if dirty else "" if dirty is False else " (clean or not: unknown)"
    told = f" (as {source['told_by']} says: a copy without .git)" if source.get("told_by") else ""
    return f"commit {commit[:12]}{state}{told}"


_VERSION_NAMES = {"cuda_runtime": "CUDA", "cudnn": "cuDNN", "liger-kernel": "liger-kernel"}


def versions_words(versions: dict) -> str:
    """'python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, transformers 5.25.0, liger-kernel not
    installed, ..., CUDA 13.0, cuDNN 91002, driver 580.82'."""
    parts = []
    for key, value in versions.items():
        name = _VERSION_NAMES.get(key, key)
        parts.append(f"{name} {value}" if value is not None else f"{name} -")
    return ", ".join(parts) or "?"


def card_words(card: dict) -> str:
    """'NVIDIA H100 80GB HBM3 (GPU-5f...), 132 SMs, 79.6 GiB, SM 1980 MHz of 1980 MHz, memory
    2619 MHz of 2619 MHz, power limit 700.00 W' or 'CPU: Intel Xeon (16 cores)'."""
    if card.get("kind") == "cpu":
        return f"CPU: {card.get('cpu_model') or '?'} ({card.get('cpu_count')} cores)"
    if not card:
        return "?"
    parts = [f"{card.get('name') or '?'}" + (f" ({card['uuid']})" if card.get("uuid") else "")]
    if card.get("sm_count"):
        parts.append(f"{card['sm_count']} SMs")
    if card.get("memory_bytes"):
        parts.append(f"{card['memory_bytes'] / 2**30:.1f} GiB")
    for label, now, most in (
        ("SM", "sm_clock", "max_sm_clock"),
        ("memory", "memory_clock", "max_memory_clock"),
    ):
        if card.get(now) or card.get(most):
            parts.append(f"{label} {card.get(now) or '?'} of {card.get(most) or '?'}")
    if card.get("power_limit"):
        parts.append(f"power limit {card['power_limit']}")
    if card.get("source") == "torch":
        parts.append("clocks and power not read (no nvidia-smi)")
    return ", ".join(parts)


def command_words(command: dict) -> str:
    """The command line as a shell would take it, with the environment that changed behaviour."""
    args = command.get("profuse_args")
    line = shlex.join(["profuse", *args]) if args is not None else shlex.join(command.get("argv") or [])
    env = command.get("env") or {}
    if env:
        line = f"{' '.join(f'{k}={shlex.quote(str(v))}' for k, v in env.items())} {line}"
    return line or "?"


def flatten(prov: dict, prefix: str = "") -> dict[str, object]:
    """{'versions.torch': '2.11.0', 'card.name': ..., 'command.env.TRITON_INTERPRET': '1'}."""
    out: dict[str, object] = {}
    for key, value in prov.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def provenance_diff(a: dict, b: dict) -> list[str]:
    """One line per provenance field that differs between runs A and B (start and end times
    are said in the head, never as a difference); one line where either recorded none."""
    pa, pb = (d.get("provenance") if isinstance(d, dict) else None for d in (a, b))
    if not pa or not pb:
        which = " and ".join(n for n, p in (("A", pa), ("B", pb)) if not p)
        return [f"provenance: {which} recorded none, so what else differs between the runs is not known"]
    fa, fb = flatten(pa), flatten(pb)
    keys = [k for k in dict.fromkeys([*fa, *fb]) if k not in TIMES]
    head = (
        f"provenance: A ran {pa.get('started_utc') or '?'} to {pa.get('ended_utc') or '?'}, "
        f"B ran {pb.get('started_utc') or '?'} to {pb.get('ended_utc') or '?'}"
    )
    lines = [
        f"  {k}: {_shown(fa.get(k))} (A) vs {_shown(fb.get(k))} (B)" for k in keys if fa.get(k) != fb.get(k)
    ]
    if not lines:
        return [f"{head}; the same in every other field"]
    noun = "field" if len(lines) == 1 else "fields"
    return [f"{head}; they differ in {len(lines)} {noun}:", *lines]


def _shown(value: object) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, list):
        return shlex.join(str(v) for v in value)
    return str(value)
