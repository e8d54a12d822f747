"""Rebuild a report (CSV, Markdown, plots) from a stored results file, without running anything.

    regenerate_report("reports/smollm2_quickstart.results.jsonl", out_dir="again")

The runner writes `<name>.experiment.json` beside the results: the experiment's name, its
description, its findings template and the run keys of the rows its report showed, in order (a
results file also keeps rows of runs since changed or removed). With it, the regenerated files are
byte-identical to the run's own. Without it (results written before the sidecar existed) the report
uses the latest row of each run name in file order and the name from the file name. `description=`
and `findings=` (e.g. read from the experiment TOML after editing them) replace the sidecar's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .report import write_report
from .results import select_rows

SUFFIX = ".results.jsonl"
REQUIRED = ("run", "method", "run_key", "config", "weight_bytes")
METRICS = ("ppl", "cos_mean")  # a row needs one of them


def _read(path: Path) -> list[dict]:
    from .results import read_rows  # a line cut short by a crash is skipped

    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no result rows")
    return rows


def check_rows(rows: list[dict], name: str, where: str) -> None:
    """Raise if the rows lack a report's columns or belong to another experiment than `name`."""
    for i, row in enumerate(rows):
        missing = [c for c in REQUIRED if c not in row]
        if not any(m in row for m in METRICS):
            missing.append(" or ".join(METRICS))
        if missing:
            raise ValueError(f"{where}: row {i + 1} ({row.get('run', '?')!r}) lacks column(s) {', '.join(missing)}; "
                             "is this a quantlab results file?")
    others = sorted({r["experiment"] for r in rows if r.get("experiment") not in (None, name)})
    if others:
        raise ValueError(f"{where}: rows of experiment(s) {', '.join(map(repr, others))}, not {name!r}: "
                         "a results file from another experiment (or renamed)")


def regenerate_report(results, out_dir=None, description: str | None = None,
                      findings: str | None = None) -> pd.DataFrame:
    """Write <out_dir>/<name>.{csv,md,...} from <name>.results.jsonl (out_dir: the results' folder).

    description / findings: None takes the sidecar's (or none without a sidecar).
    """
    results = Path(results)
    if not results.is_file():
        raise FileNotFoundError(f"results file {str(results)!r} does not exist")
    if not results.name.endswith(SUFFIX):
        raise ValueError(f"{results}: expected a <name>{SUFFIX} file written by `quantlab run`")
    name = results.name[: -len(SUFFIX)]
    rows = _read(results)
    check_rows(rows, name, str(results))
    sidecar = results.with_name(f"{name}.experiment.json")
    meta = json.loads(sidecar.read_text()) if sidecar.exists() else None
    if meta is not None and meta.get("experiment") != name:
        raise ValueError(f"{sidecar}: describes experiment {meta.get('experiment')!r}, not {name!r}")
    if description is None:
        description = meta["description"] if meta else ""
    if findings is None:
        findings = meta.get("findings", "") if meta else ""
    selected = select_rows(rows, meta, str(results))
    out_dir = results.parent if out_dir is None else Path(out_dir)
    # reports the findings quote (REPORT/RUN) are looked up beside the new report, then beside the results
    return write_report(name, selected, out_dir, description, findings, quote_dirs=[out_dir, results.parent])
