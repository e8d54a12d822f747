"""The lm-eval section of a report: one table of every lmeval_<task>_<metric> column (± lm-eval's stderr), shown
only when rows have them (runs of an experiment with [eval] lm_eval_tasks, or `quantlab lm-eval`)."""
from __future__ import annotations

import json

import pandas as pd

# as quantlab.eval.lmeval writes them (not imported: a report is written from rows alone, without torch or lm-eval)
PREFIX = "lmeval_"
PROTOCOL = {f"{PREFIX}{k}" for k in ("tasks", "limit", "max_length", "prefix_token_id", "document_bos", "batch_size",
                                     "gemm", "version", "s", "higher_is_better")}


def metric_columns(df: pd.DataFrame) -> list[str]:
    """lmeval_<task>_<metric> columns with a value: not their _stderr, the per-task _docs count or the protocol."""
    return [c for c in df.columns if c.startswith(PREFIX) and c not in PROTOCOL and not c.endswith(("_stderr", "_docs"))
            and df[c].notna().any()]


def _higher_is_better(df: pd.DataFrame) -> dict:
    out = {}
    for text in df.get(f"{PREFIX}higher_is_better", pd.Series(dtype=object)).dropna():
        out.update(json.loads(text))
    return out


def _cell(row, col: str) -> str:
    value, stderr = row.get(col), row.get(f"{col}_stderr")
    if value is None or value != value:
        return "–"
    text = f"{value:.5g}"
    return text + (f" ± {stderr:.2g}" if isinstance(stderr, (int, float)) and stderr == stderr else "")


def table(df: pd.DataFrame) -> str:
    """Markdown: run, scheme, then each lm-eval metric (↓ / ↑ as lm-eval declares it), ± its stderr."""
    cols, better = metric_columns(df), _higher_is_better(df)
    arrow = {c: {True: " ↑", False: " ↓"}.get(better.get(c), "") for c in cols}
    head = ["run", "scheme"] + [c.removeprefix(PREFIX) + arrow[c] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join([str(row["run"]), str(row.get("scheme", ""))] + [_cell(row, c) for c in cols])
                     + " |")
    return "\n".join(lines)


def section(df: pd.DataFrame) -> str:
    """The report's lm-eval part ("" when no row has lm-eval columns)."""
    if not metric_columns(df):
        return ""
    r = df[df[f"{PREFIX}tasks"].notna()].iloc[0]
    limit = r.get(f"{PREFIX}limit")
    docs = ("all documents" if limit is None or limit != limit
            else "the first document" if int(limit) == 1 else f"the first {int(limit)} documents")
    text = (f"**lm-evaluation-harness** {r.get(f'{PREFIX}version')} on each run's model as evaluated above "
            f"(wrapped in memory as `HFLM`, nothing reloaded): tasks {r[f'{PREFIX}tasks']}, {docs} of each, rolling "
            f"windows of {int(r[f'{PREFIX}max_length'])} tokens, each document's first window starting from token "
            f"id {r.get(f'{PREFIX}prefix_token_id')}"
            + (" (the tokenizer also puts its BOS at the start of each document, which lm-eval then scores)"
               if r.get(f"{PREFIX}document_bos") is True else "")
            + ". ± is lm-eval's stderr where it gives one (it does not bootstrap the perplexities).")
    return text + "\n\n" + table(df)
