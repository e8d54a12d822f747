"""Diff two report CSVs run by run: each metric side by side with B − A and the change in %.

    df = compare_reports("reports/smollm2_quickstart.csv", "/tmp/rerun/smollm2_quickstart.csv")
    print(compare_markdown(df, "A", "B"))
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

# compared when both files have them (in this order); others can be asked for by name
PROTOCOL = ["model", "dtype", "eval_dataset", "eval_split", "seq_len", "eval_windows", "eval_tokens", "bos",
            "calib_samples", "device_name"]
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


def compare_reports(a, b, metrics: list[str] | None = None) -> pd.DataFrame:
    """Runs in both CSVs (in A's order), with `<m>_a`, `<m>_b`, `<m>_diff` (B − A), `<m>_diff_pct` per metric."""
    da, db = _load(a), _load(b)
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if m in da and m in db and da[m].notna().any() and db[m].notna().any()]
        if not metrics:
            raise ValueError(f"{a} and {b} share none of the metric columns {', '.join(DEFAULT_METRICS)}")
    else:
        for path, df in ((a, da), (b, db)):
            missing = [m for m in metrics if m not in df.columns]
            if missing:
                numeric = [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]
                raise ValueError(f"{path}: no column(s) {', '.join(missing)}; numeric columns: {', '.join(numeric)}")
    common = [r for r in da["run"] if r in set(db["run"])]
    if not common:
        raise ValueError(f"no run name in common: {a} has {', '.join(map(str, da['run']))}; "
                         f"{b} has {', '.join(map(str, db['run']))}")
    ia, ib = da.drop_duplicates("run", keep="last").set_index("run"), db.drop_duplicates("run", keep="last").set_index("run")
    out = pd.DataFrame({"run": list(dict.fromkeys(common))})
    for m in metrics:
        va = pd.to_numeric(ia.loc[out["run"], m], errors="coerce").values
        vb = pd.to_numeric(ib.loc[out["run"], m], errors="coerce").values
        out[f"{m}_a"], out[f"{m}_b"], out[f"{m}_diff"] = va, vb, vb - va
        with np.errstate(divide="ignore", invalid="ignore"):  # A = 0 (e.g. the baseline's KL): no %
            out[f"{m}_diff_pct"] = np.where(va != 0, (vb / va - 1) * 100, np.nan)
    differs = []
    for c in (c for c in PROTOCOL if c in da and c in db):
        va, vb = sorted(map(str, da[c].dropna().unique())), sorted(map(str, db[c].dropna().unique()))
        if va != vb:
            differs.append(f"{c} {', '.join(va) or '–'} vs {', '.join(vb) or '–'}")
    config_differs = []
    if "config" in ia and "config" in ib:  # same name, different run: worth saying
        config_differs = [r for r in out["run"] if str(ia.loc[r, "config"]) != str(ib.loc[r, "config"])]
    out.attrs.update(metrics=metrics, protocol_differs=differs, config_differs=config_differs, only_a=[r for r in da["run"] if r not in set(db["run"])],
                     only_b=[r for r in db["run"] if r not in set(da["run"])])
    return out


def _num(v, fmt="{:.4g}") -> str:
    return "–" if v != v else fmt.format(v)


def compare_markdown(df: pd.DataFrame, label_a: str = "A", label_b: str = "B") -> str:
    """Markdown: one table per metric block (A, B, B − A, Δ %), plus runs found in only one file."""
    metrics = df.attrs["metrics"]
    header = ["run"] + [f"{m} {x}" for m in metrics for x in ("A", "B", "B−A", "Δ%")]
    lines = [f"**Compare.** A = `{label_a}`, B = `{label_b}`; B−A and Δ% = B/A − 1, on the runs both hold.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in df.iterrows():
        cells = [str(r["run"])]
        for m in metrics:
            cells += [_num(r[f"{m}_a"]), _num(r[f"{m}_b"]), _num(r[f"{m}_diff"], "{:+.4g}"),
                      _num(r[f"{m}_diff_pct"], "{:+.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    if df.attrs.get("protocol_differs"):
        lines += ["", "**Protocols differ** (the numbers may not be comparable): " + "; ".join(df.attrs["protocol_differs"])]
    if df.attrs.get("config_differs"):
        lines += ["", "**Same name, different config:** " + ", ".join(df.attrs["config_differs"])]
    for label, runs in ((label_a, df.attrs["only_a"]), (label_b, df.attrs["only_b"])):
        if runs:
            lines += ["", f"Only in `{label}`: {', '.join(map(str, runs))}"]
    return "\n".join(lines) + "\n"
