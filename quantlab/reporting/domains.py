"""Report columns of runs evaluated on several domains (`[eval] datasets`, runs/runner.py).

Rows store, per domain label d, `ppl_<d>`, `window_nll_<d>`, `window_tokens_<d>`, `eval_source_<d>`, ... and
`eval_domains` (the labels, the main one first). From those alone, as report.add_intervals does for the main
columns, this adds per domain `ppl_<d>_ci_low/high` (bootstrap over that domain's windows), `ppl_<d>_delta_pct`
against the baseline row and its paired interval `ppl_<d>_delta_ci_low/high` + `ppl_<d>_delta_excludes_zero`.
Rows without per-domain columns (every results file written before `datasets` existed) get nothing.

    df = add_domain_columns(df)
    columns = table_columns(df)      # extra (column, header, format) for the Markdown table
"""
from __future__ import annotations

import json

import pandas as pd

from ..core.registry import is_baseline
from . import stats


def domain_labels(df: pd.DataFrame) -> list[str]:
    """The domains the rows were evaluated on, the main one first ([] for single-domain rows)."""
    if "eval_domains" not in df:
        return []
    labels: list[str] = []
    for value in df["eval_domains"].dropna():
        labels += [d for d in json.loads(value) if d not in labels]
    return labels


def _windows(row, label: str) -> tuple[list, list] | None:
    nll, tokens = row.get(f"window_nll_{label}"), row.get(f"window_tokens_{label}")
    if not isinstance(nll, str) or not isinstance(tokens, str):
        return None
    return json.loads(nll), json.loads(tokens)


def add_domain_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Per-domain intervals and Δppl % against the first baseline row (method 'none'), paired on its windows."""
    labels = domain_labels(df)
    if not labels:
        return df
    df = df.copy()
    base_rows = df[df["method"].map(is_baseline)]
    base = base_rows.iloc[0] if not base_rows.empty else None
    for d in labels:
        cols = {c: [float("nan")] * len(df) for c in ("ci_low", "ci_high", "delta_pct", "delta_ci_low",
                                                       "delta_ci_high")}
        excludes = [None] * len(df)
        b = _windows(base, d) if base is not None else None
        for i, (_, row) in enumerate(df.iterrows()):
            w = _windows(row, d)
            if w is None:
                continue
            cols["ci_low"][i], cols["ci_high"][i] = stats.ppl_interval(*w)
            if b is not None and b[1] == w[1]:  # paired only on the very same windows
                x = stats.paired_delta_interval(w[0], b[0], w[1])
                cols["delta_pct"][i], cols["delta_ci_low"][i], cols["delta_ci_high"][i] = x["delta_pct"], x["low"], x["high"]
                excludes[i] = x["excludes_zero"]
        for c, v in cols.items():
            df[f"ppl_{d}_{c}"] = v
        df[f"ppl_{d}_delta_excludes_zero"] = excludes
    return df


def table_columns(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """Markdown columns of every domain after the main one (whose numbers are the ppl / Δppl columns)."""
    out = []
    for d in domain_labels(df)[1:]:
        out += [(f"ppl_{d}", f"ppl {d} ↓", "{:.3f}"), (f"ppl_{d}_ci", f"ppl {d} 95% CI", "{}"),
                (f"ppl_{d}_delta_pct", f"Δppl % {d}", "{:+.2f}"),
                (f"ppl_{d}_delta_ci", f"Δppl % {d} 95% CI (paired)", "{}")]
    return out


def lower_is_better(df: pd.DataFrame) -> set[str]:
    return {c for d in domain_labels(df) for c in (f"ppl_{d}", f"ppl_{d}_delta_pct")}


def interval_columns(df: pd.DataFrame) -> list[str]:
    """Columns that belong to one run's windows (a seed group's mean row leaves them empty)."""
    return [f"ppl_{d}_{c}" for d in domain_labels(df)
            for c in ("ci_low", "ci_high", "delta_ci_low", "delta_ci_high", "delta_excludes_zero")]


def protocol_text(df: pd.DataFrame) -> str:
    """" Every run is evaluated on N domains in one pass: ..." ("" for single-domain rows)."""
    labels = domain_labels(df)
    if not labels:
        return ""
    r = df[df["eval_domains"].notna()].iloc[0]
    parts = []
    for d in labels:
        if pd.isna(r.get(f"eval_windows_{d}")):
            continue
        parts.append(f"{d} `{r['eval_split']}` ({r[f'eval_source_{d}']}): {int(r[f'eval_windows_{d}'])} windows = "
                     f"{int(r[f'eval_tokens_{d}'])} tokens")
    return (f" Every run is evaluated on {len(labels)} domains in one pass, each as a single-domain run would be "
            f"(windows {'spread evenly over' if r.get('eval_window_order') == 'spread' else 'from the start of'} "
            f"its text, KL on its first windows; columns `ppl_<domain>`, "
            f"`kl_mean_<domain>`, `window_nll_<domain>`): " + "; ".join(parts) + ".")
