"""Check rows: one line of the doctor's table (ok / warn / error, what was seen, what to do)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..util.checks import check_choice

STATUSES = ("ok", "warn", "error")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | error
    detail: str
    hint: str = ""

    def __post_init__(self):
        check_choice("check status", self.status, STATUSES)


def exit_code(rows: list[Check]) -> int:
    return 1 if any(r.status == "error" for r in rows) else 0


def format_checks(rows: list[Check]) -> str:
    """A table: status, check, detail; a hint line under each row that is not ok; a count at the end."""
    width = max([len(r.name) for r in rows] + [5])
    lines = [f"{'status':<7}{'check':<{width + 2}}detail"]
    for r in rows:
        lines.append(f"{r.status:<7}{r.name:<{width + 2}}{r.detail}")
        if r.hint and r.status != "ok":
            lines.append(f"{'':<{width + 9}}hint: {r.hint}")
    counts = Counter(r.status for r in rows)
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES))
    return "\n".join(lines)
