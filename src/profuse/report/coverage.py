"""`profuse fuse`'s coverage of each causal-LM family as text or markdown."""

from __future__ import annotations

from collections import Counter

from profuse.coverage import Coverage, FamilyCoverage


def _ops(row: FamilyCoverage) -> str:
    return ", ".join(f"{op} x{n}" for op, n in row.counts.items()) or "-"


def _check(row: FamilyCoverage) -> str:
    if row.check_error:
        return f"FAILED: the fused step raised {row.check_error}"
    if row.unchecked:
        return "not checked"
    if row.check is None:
        return "-"
    worst = max(row.check.values())
    return f"{'ok' if row.passed else 'FAILED'} ({worst:.1e})"


def _why(row: FamilyCoverage) -> list[str]:
    if row.unbuilt:
        return [f"no tiny model: {row.unbuilt}"]
    if row.refused:
        return [f"refused: {row.refused}"]
    why = [f"left unfused: {item}" for item in row.left_unfused]
    return why + ([f"not checked: {row.unchecked}"] if row.unchecked else [])


def summary_line(cov: Coverage) -> str:
    counts = Counter(r.status for r in cov.rows)
    parts = [f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    what = "planned (dry run)" if cov.dry_run else f"checked against the unfused model ({cov.impl})"
    return f"{len(cov.rows)} families of transformers {cov.transformers}, {what}: " + ", ".join(parts)


def coverage_text(cov: Coverage, reasons: bool = True) -> str:
    """A table a family a line, then each family's reasons (what is left unfused, and why)."""
    width = max((len(r.family) for r in cov.rows), default=6)
    title = "ops fused (places in the tiny model)"
    ops = max([len(title), *(len(_ops(r)) for r in cov.rows)])
    head = f"{'family':<{width}}  {'status':<13}  {title:<{ops}}  check"
    lines = [head, "-" * len(head)]
    for r in cov.rows:
        lines.append(f"{r.family:<{width}}  {r.status:<13}  {_ops(r):<{ops}}  {_check(r)}")
    if reasons:
        lines.append("")
        for r in cov.rows:
            why = _why(r)
            if why:
                lines.append(f"{r.family} ({r.model or 'no model'}):")
                lines += [f"    {w}" for w in why]
    lines += ["", summary_line(cov)]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def coverage_markdown(cov: Coverage) -> str:
    """The table for a page of the docs, reasons in the last column."""
    lines = [
        "| family | class | status | fused (places in the tiny model) | not fused, and why | check |",
        "|---|---|---|---|---|---|",
    ]
    for r in cov.rows:
        why = "<br>".join(_cell(w) for w in _why(r)) or "-"
        lines.append(
            f"| {r.family} | {r.model or '-'} | {r.status} | {_cell(_ops(r))} | {why} | {_cell(_check(r))} |"
        )
    return "\n".join([*lines, "", summary_line(cov)])
