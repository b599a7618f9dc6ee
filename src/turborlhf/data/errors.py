"""Data-layer errors and the per-line problem record shared by the converter and the loaders."""

from __future__ import annotations

from dataclasses import dataclass

from turborlhf.errors import UserError


class DataError(UserError, ValueError):
    """Malformed input data (raised in ``strict`` mode, or when nothing usable remains); the message
    lists kinds and line numbers."""


class DataFileError(DataError, FileNotFoundError):
    """A data file that is missing, is a directory, or cannot be read as UTF-8 text (file named)."""


@dataclass(frozen=True)
class Problem:
    """One bad input line: 1-based ``line`` number, a short ``kind`` and a human ``detail``."""

    line: int
    kind: str
    detail: str = ""


def group_problems(problems: list[Problem]) -> dict[str, list[int]]:
    """``{kind: [line, ...]}`` in first-seen kind order, lines sorted ascending."""
    out: dict[str, list[int]] = {}
    for p in problems:
        out.setdefault(p.kind, []).append(p.line)
    return {k: sorted(v) for k, v in out.items()}


def format_problems(problems: list[Problem], max_lines: int = 50, unit: str = "line") -> str:
    """One line: ``"missing_key (2) at lines 3, 7 (line 3: key 'chosen' is missing); ..."``.

    Each kind lists its line (or row, ``unit="row"``) numbers, long lists elided, and the detail
    of its first occurrence, which names the key or value at fault.
    """
    first: dict[str, Problem] = {}
    for p in problems:
        first.setdefault(p.kind, p)
    parts = []
    for kind, lines in group_problems(problems).items():
        shown = ", ".join(str(n) for n in lines[:max_lines])
        if len(lines) > max_lines:
            shown += f", ... ({len(lines) - max_lines} more)"
        p = first[kind]
        detail = " ".join(p.detail.split())  # one line even if a decoder message had newlines
        why = f" ({unit} {p.line}: {detail})" if detail else ""
        parts.append(f"{kind} ({len(lines)}) at {unit}{'s' if len(lines) > 1 else ''} {shown}{why}")
    return "; ".join(parts)


def raise_if_problems(problems: list[Problem], source: str) -> None:
    """Raise ``DataError`` naming every problem kind and its line numbers, if there are any."""
    if problems:
        raise DataError(f"{source}: {len(problems)} bad line(s): {format_problems(problems)}")
