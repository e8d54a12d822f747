"""Rows -> pandas -> CSV + Markdown, with a baseline row and ratio columns.

Ratios are against the first row whose method is 'none' (the unquantized model).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

# (column, header, format) shown in the Markdown table; the CSV keeps every column.
TABLE_COLUMNS = [
    ("run", "run", "{}"),
    ("scheme", "scheme", "{}"),
    ("backend", "backend", "{}"),
    ("ppl", "ppl ↓", "{:.3f}"),
    ("ppl_delta_pct", "Δppl %", "{:+.2f}"),
    ("kl_mean", "KL ↓", "{:.5f}"),
    ("top1_agree", "top-1 ↑", "{:.4f}"),
    ("cos_mean", "cos mean ↑", "{:.5f}"),
    ("cos_p5", "cos p5 ↑", "{:.5f}"),
    ("layer_rel_err_mean", "layer rel err mean ↓", "{:.4f}"),
    ("layer_rel_err_max", "layer rel err max ↓", "{:.4f}"),
    ("weight_mib", "weights MiB", "{:.1f}"),
    ("weight_ratio", "× weights", "{:.3f}"),
    ("bits_per_weight", "bits/w (quantized layers)", "{:.3f}"),
    ("prefill_ms_p50", "prefill ms p50", "{:.1f}"),
    ("decode_ms_per_token_p50", "decode ms/tok p50", "{:.1f}"),
    ("decode_speedup", "× decode speed", "{:.2f}"),
    ("prefill_speedup", "× prefill speed", "{:.2f}"),
    ("calibrate_s", "calibrate s", "{:.1f}"),
]


def scheme(cfg: dict, dtype: str) -> str:
    """Short description of what a run quantizes: "w4 g64 asym", "w8 channel sym + a8 dynamic", ..."""
    if "bits" in cfg:
        g = "channel" if cfg.get("group_size") is None else f"g{cfg['group_size']}"
        text = f"w{cfg['bits']} {g} {'sym' if cfg.get('symmetric', True) else 'asym'}"
    elif isinstance(cfg.get("base"), dict):
        text = scheme(cfg["base"], dtype)
    else:
        return dtype
    if "act_bits" in cfg:
        kind = "dynamic" if cfg["method"] == "dynamic" else f"static {cfg.get('act_granularity', '')} {cfg.get('observer', '')}"
        text += f" + a{cfg['act_bits']} {kind.strip()}"
    return text


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add ppl_delta_pct, weight_ratio, prefill_speedup, decode_speedup vs the baseline row."""
    df = df.copy()
    base = df[df["method"] == "none"]
    if base.empty:
        for c in ("ppl_delta_pct", "weight_ratio", "prefill_speedup", "decode_speedup"):
            df[c] = float("nan")
        return df
    b = base.iloc[0]
    if "ppl" in df:
        df["ppl_delta_pct"] = (df["ppl"] / b["ppl"] - 1) * 100
    df["weight_ratio"] = df["weight_bytes"] / b["weight_bytes"]
    for phase, col in (("prefill", "prefill_ms_p50"), ("decode", "decode_ms_per_token_p50")):
        df[f"{phase}_speedup"] = b[col] / df[col] if col in df else float("nan")
    return df


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(df: pd.DataFrame, columns=TABLE_COLUMNS) -> str:
    cols = [c for c in columns if c[0] in df.columns and df[c[0]].notna().any()]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], f) for c, _, f in cols) + " |")
    return "\n".join(lines)


def protocol_text(df: pd.DataFrame) -> str:
    r = df.iloc[0]
    if r.get("eval_metric") == "embedding":
        text = (
            f"**Protocol.** Embedding fidelity on {r['eval_dataset']} `{r['eval_split']}` ({r['eval_source']}): "
            f"the first {int(r['sentences'])} sentences (≥ 6 words, headings skipped), at most {int(r['max_length'])} "
            "tokens each, mean-pooled last hidden states; cosine similarity to the baseline's embedding per "
            "sentence (mean and 5th percentile). Layer rel err: ‖y − y_ref‖/‖y_ref‖ of each quantized linear's "
            "output, both models run end to end on the first 32 sentences."
        )
        if "prefill_tokens" in df and pd.notna(r.get("prefill_tokens")):
            text += f" Latency: one forward of {int(r['prefill_tokens'])} tokens, median of {int(r['latency_repeats'])} repeats."
        return text + _calibration_text(df)
    text = (
        f"**Protocol.** Perplexity on {r['eval_dataset']} `{r['eval_split']}` ({r['eval_source']}), "
        f"BOS: {r['bos']}, {int(r['eval_windows'])} non-overlapping windows of seq_len {int(r['seq_len'])} "
        f"= {int(r['eval_tokens'])} tokens ({int(r['predicted_tokens'])} predicted) from the start of the split."
    )
    if r.get("kl_tokens"):
        text += f" KL(baseline ‖ run) and top-1 agreement over the first {int(r['kl_tokens'])} tokens."
    if "prefill_tokens" in df and pd.notna(r.get("prefill_tokens")):
        text += (f" Latency: prefill {int(r['prefill_tokens'])} tokens, greedy decode {int(r['decode_tokens'])} "
                 f"tokens, batch {int(r['batch_size'])}, median of {int(r['latency_repeats'])} repeats after warm-up.")
    return text + _calibration_text(df)


def _calibration_text(df: pd.DataFrame) -> str:
    if "calib_samples" not in df or df["calib_samples"].isna().all():
        return ""
    r = df[df["calib_samples"].notna()].iloc[0]
    return (f" Calibration (methods that use data): {int(r['calib_samples'])} windows of {int(r['calib_seq_len'])} "
            f"tokens at seeded random offsets of {r['calib_source']} (never the test split).")


def environment_text(df: pd.DataFrame) -> str:
    r = df.iloc[-1]
    keys = ["model", "dtype", "seed", "device_name", "torch", "transformers", "torchao", "quantlab", "git_sha"]
    return "**Environment.** " + ", ".join(f"{k} `{r[k]}`" for k in keys if k in df.columns)


def backend_text(df: pd.DataFrame) -> str:
    backends = ", ".join(f"`{b}`" for b in df["backend"].unique())
    text = (f"**Backend.** {backends}. Simulated rows hold real integer codes (weight bytes are real) "
            "but dequantize them in PyTorch each forward, so their latency is not a low-bit kernel's.")
    if df["backend"].astype(str).str.startswith("torchao").any():
        text += (" `torchao` rows were exported from the same codes to torchao kernels (`backend_kernels`); their "
                 "latency and memory are real; `export_parity_*` columns hold the kernel-vs-simulated check.")
    return text


def write_report(name: str, rows: list[dict], reports_dir: str | Path, description: str = "") -> pd.DataFrame:
    """Write <reports_dir>/<name>.csv and .md from result rows; returns the DataFrame."""
    if not rows:
        raise ValueError(f"no result rows for {name!r}: nothing to report")
    reports_dir = Path(reports_dir)
    df = pd.DataFrame(rows)
    if "config" in df:  # derived from the stored config, so older rows get the current wording too
        df["scheme"] = [scheme(json.loads(c), d) for c, d in zip(df["config"], df["dtype"])]
    df = add_ratios(df)
    df.to_csv(reports_dir / f"{name}.csv", index=False)
    parts = [f"# {name}", description.strip(), protocol_text(df), markdown_table(df), backend_text(df),
             environment_text(df)]
    (reports_dir / f"{name}.md").write_text("\n\n".join(p for p in parts if p) + "\n")
    return df
