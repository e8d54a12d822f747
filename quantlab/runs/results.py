"""Results files: one JSON row per line, appended as each run finishes.

The one reader and writer of `*.results.jsonl` (and of the sensitivity cache, same format):
the runner appends, the sensitivity sweep caches, `quantlab report` and `compare` read.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash: that run is simply redone
                log.warning("ignoring a truncated line in %s", path)
    return rows


def append_row(path: Path, row: dict) -> None:
    """One JSON line, flushed at once: a crash keeps every finished row."""
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
