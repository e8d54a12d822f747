"""Diff two report CSVs run by run: each metric side by side with B − A and the change in %.

    df = compare_reports("reports/smollm2_quickstart.csv", "rerun/smollm2_quickstart.csv")
    print(compare_markdown(df, "A", "B"))
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from . import stats

# compared when both files have them (in this order); others can be asked for by name
PROTOCOL = ["model", "dtype", "eval_dataset", "eval_split", "seq_len", "eval_windows", "eval_window_order",
            "eval_tokens", "bos", "calib_samples", "device_name"]
SAME_WINDOWS = {"eval_dataset", "eval_split", "seq_len", "eval_windows", "eval_window_order", "eval_tokens",
                "bos"}  # for pairing
IMPLIED = {"eval_window_order": "first"}  # a column rows leave out at its default
DEFAULT_METRICS = ["ppl", "ppl_delta_pct", "kl_mean", "top1_agree", "cos_mean", "cos_p5", "layer_rel_err_mean",
                   "weight_mib", "bits_per_weight", "prefill_ms_p50", "decode_ms_per_token_p50", "calibrate_s"]


def _load(path) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"report CSV {str(path)!r} does not exist")
    df = pd.read_csv(path)
    if "run" not in df.columns:
        raise ValueError(f"{path}: no 'run' column; is this a quantlab report CSV? columns: {', '.join(df.columns[:12])}")
    return df


def _metrics(a, b, da, db, metrics):
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if m in da and m in db and da[m].notna().any() and db[m].notna().any()]
        if not metrics:
            raise ValueError(f"{a} and {b} share none of the metric columns {', '.join(DEFAULT_METRICS)}")
        return metrics
    for path, df in ((a, da), (b, db)):
        missing = [m for m in metrics if m not in df.columns]
        if missing:
            numeric = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
            raise ValueError(f"{path}: no column(s) {', '.join(missing)}; numeric columns: {', '.join(numeric)}")
    return metrics


def _protocol_differences(da: pd.DataFrame, db: pd.DataFrame) -> list[str]:
    differs = []
    da, db = (df.assign(**{c: df[c].fillna(v) if c in df else v for c, v in IMPLIED.items()})
              if "eval_windows" in df else df for df in (da, db))
    for c in (c for c in PROTOCOL if c in da and c in db):
        va, vb = sorted(map(str, da[c].dropna().unique())), sorted(map(str, db[c].dropna().unique()))
        if va != vb:
            differs.append(f"{c} {', '.join(va) or '–'} vs {', '.join(vb) or '–'}")
    return differs


def _paired_ppl(ia: pd.DataFrame, ib: pd.DataFrame, runs) -> tuple[list, list]:
    """Paired bootstrap interval of B's Δppl % vs A, per run, where both rows hold the same windows."""
    low, high = [float("nan")] * len(runs), [float("nan")] * len(runs)
    for i, r in enumerate(runs):
        wa, wb = (_windows(df.loc[r]) for df in (ia, ib))
        if wa is not None and wb is not None and wa[1] == wb[1]:
            d = stats.paired_delta_interval(wb[0], wa[0], wa[1])
            low[i], high[i] = d["low"], d["high"]
    return low, high


def _windows(row):
    nll, tokens = row.get("window_nll"), row.get("window_tokens")
    return (json.loads(nll), json.loads(tokens)) if isinstance(nll, str) and isinstance(tokens, str) else None


def compare_reports(a, b, metrics: list[str] | None = None) -> pd.DataFrame:
    """Runs in both CSVs (in A's order), with `<m>_a`, `<m>_b`, `<m>_diff` (B − A), `<m>_diff_pct` per metric,
    and, where both rows stored per-window NLL on the same protocol, `ppl_diff_ci_low/high` (paired, %)."""
    da, db = _load(a), _load(b)
    metrics = _metrics(a, b, da, db, metrics)
    common = list(dict.fromkeys(r for r in da["run"] if r in set(db["run"])))
    if not common:
        raise ValueError(f"no run name in common: {a} has {', '.join(map(str, da['run']))}; "
                         f"{b} has {', '.join(map(str, db['run']))}")
    ia, ib = (df.drop_duplicates("run", keep="last").set_index("run") for df in (da, db))
    out = pd.DataFrame({"run": common})
    for m in metrics:
        va = pd.to_numeric(ia.loc[common, m], errors="coerce").values
        vb = pd.to_numeric(ib.loc[common, m], errors="coerce").values
        out[f"{m}_a"], out[f"{m}_b"], out[f"{m}_diff"] = va, vb, vb - va
        with np.errstate(divide="ignore", invalid="ignore"):  # A = 0 (e.g. the baseline's KL): no %
            out[f"{m}_diff_pct"] = np.where(va != 0, (vb / va - 1) * 100, np.nan)
    differs = _protocol_differences(da, db)
    if "ppl" in metrics and not any(d.split()[0] in SAME_WINDOWS for d in differs):
        out["ppl_diff_ci_low"], out["ppl_diff_ci_high"] = _paired_ppl(ia, ib, common)
    config_differs = []
    if "config" in ia and "config" in ib:  # same name, different run: worth saying
        config_differs = [r for r in common if _config_key(ia.loc[r, "config"]) != _config_key(ib.loc[r, "config"])]
    out.attrs.update(metrics=metrics, protocol_differs=differs, config_differs=config_differs,
                     only_a=[r for r in da["run"] if r not in set(db["run"])],
                     only_b=[r for r in db["run"] if r not in set(da["run"])])
    return out


def _num(v, fmt="{:.4g}") -> str:
    return "–" if v != v else fmt.format(v)


def compare_markdown(df: pd.DataFrame, label_a: str = "A", label_b: str = "B") -> str:
    """Markdown: one table per metric block (A, B, B − A, Δ %), plus runs found in only one file."""
    metrics = df.attrs["metrics"]
    paired = "ppl_diff_ci_low" in df and df["ppl_diff_ci_low"].notna().any()
    header = ["run"] + [f"{m} {x}" for m in metrics for x in ("A", "B", "B−A", "Δ%")
                        + (("Δ% 95% CI (paired)",) if m == "ppl" and paired else ())]
    note = (" The ppl interval is a paired bootstrap over the windows both rows stored (✓: excludes 0)."
            if paired else "")
    lines = [f"**Compare.** A = `{label_a}`, B = `{label_b}`; B−A and Δ% = B/A − 1, on the runs both hold.{note}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in df.iterrows():
        cells = [str(r["run"])]
        for m in metrics:
            cells += [_num(r[f"{m}_a"]), _num(r[f"{m}_b"]), _num(r[f"{m}_diff"], "{:+.4g}"),
                      _num(r[f"{m}_diff_pct"], "{:+.2f}")]
            if m == "ppl" and paired:
                lo, hi = r["ppl_diff_ci_low"], r["ppl_diff_ci_high"]
                cells.append("–" if lo != lo else f"[{lo:+.2f}, {hi:+.2f}]" + (" ✓" if lo > 0 or hi < 0 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    if df.attrs.get("protocol_differs"):
        lines += ["", "**Protocols differ** (the numbers may not be comparable): " + "; ".join(df.attrs["protocol_differs"])]
    if df.attrs.get("config_differs"):
        lines += ["", "**Same name, different config:** " + ", ".join(df.attrs["config_differs"])]
    for label, runs in ((label_a, df.attrs["only_a"]), (label_b, df.attrs["only_b"])):
        if runs:
            lines += ["", f"Only in `{label}`: {', '.join(map(str, runs))}"]
    return "\n".join(lines) + "\n"


def _config_key(text) -> str:
    """A run's config as its non-default fields, so a field added later with a default (say `overrides`)
    does not make an old report's run look different; the raw text when it does not parse."""
    from ..core.registry import make_config, non_default_fields

    try:
        fields = {k: v for k, v in json.loads(str(text)).items() if k != "name"}
        return json.dumps(non_default_fields(make_config(fields)), sort_keys=True, default=str)
    except (ValueError, TypeError, KeyError):
        return str(text)
