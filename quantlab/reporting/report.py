"""Rows -> pandas -> CSV + Markdown (+ plots), with a baseline row, ratio columns and intervals.

Ratios are against the first row whose method is 'none' (the unquantized model). Everything
here depends only on the result rows (and the description and findings template), so
`quantlab report` regenerates a run's report byte for byte from its results file (see regenerate.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ..core.extras import describe_extras, known_extras
from ..core.grid import GRID_FIELDS, grid_fields
from ..core.registry import get_method, is_baseline, make_config
from . import domains, stats
from . import findings as findings_mod
from . import lmeval as lmeval_section
from .results import refuse_links
from .sections import LATENCY_REF, backend_text, environment_text, intervals_text, protocol_text

# (column, header, format) shown in the Markdown table; the CSV keeps every column.
TABLE_COLUMNS = [
    ("run", "run", "{}"),
    ("scheme", "scheme", "{}"),
    ("backend", "backend", "{}"),
    ("ppl", "ppl ↓", "{:.3f}"),
    ("ppl_ci", "ppl 95% CI", "{}"),
    ("ppl_delta_pct", "Δppl %", "{:+.2f}"),
    ("ppl_delta_ci", "Δppl % 95% CI (paired)", "{}"),
    ("kl_mean", "KL ↓", "{:.5f}"),
    ("top1_agree", "top-1 ↑", "{:.4f}"),
    ("kld_p99", "KLD p99 ↓", "{:.4f}"),  # llama-perplexity --kl-divergence's statistics (eval/perplexity.py)
    ("rms_dp", "RMS Δp % ↓", "{:.2f}"),
    ("cos_mean", "cos mean ↑", "{:.5f}"),
    ("cos_p5", "cos p5 ↑", "{:.5f}"),
    ("layer_rel_err_mean", "layer rel err mean ↓", "{:.4f}"),
    ("layer_rel_err_max", "layer rel err max ↓", "{:.4f}"),
    ("weight_mib", "weights MiB", "{:.1f}"),
    ("weight_mib_no_embedding", "weights MiB w/o embedding", "{:.1f}"),
    ("weight_ratio", "× weights", "{:.3f}"),
    ("bits_per_weight", "bits/w (quantized layers)", "{:.3f}"),
    ("gguf_bpw", "GGUF bits/w (whole file)", "{:.3f}"),  # method gguf: every tensor, as llama.cpp counts
    ("peak_rss_mib", "peak RSS MiB (isolated)", "{:.0f}"),
    ("peak_vram_mib", "peak VRAM MiB", "{:.0f}"),
    ("prefill_ms_p50", "prefill ms p50", "{:.1f}"),
    ("decode_ms_per_token_p50", "decode ms/tok p50", "{:.1f}"),
    ("decode_speedup", "× decode speed", "{:.2f}"),
    ("prefill_speedup", "× prefill speed", "{:.2f}"),
    ("calibrate_s", "calibrate s", "{:.1f}"),
    ("quantize_peak_rss_mib", "calibrate peak RSS MiB", "{:.0f}"),  # the process while quantizing (runs/evaluate.py)
    ("train_steps", "train steps", "{:.0f}"),
    ("train_tokens", "train tokens", "{:.0f}"),
    ("train_loss_final", "train loss final", "{:.4f}"),
    ("train_s", "train s", "{:.1f}"),
    ("train_dtype", "train dtype", "{}"),
]
# the best value of these columns (among the quantized runs) is bold in the Markdown table
LOWER_IS_BETTER = {"ppl", "ppl_delta_pct", "kl_mean", "kld_p99", "rms_dp", "gguf_bpw", "layer_rel_err_mean", "layer_rel_err_max", "weight_mib",
                   "weight_ratio", "bits_per_weight", "prefill_ms_p50", "decode_ms_per_token_p50", "peak_rss_mib",
                   "peak_vram_mib", "weight_mib_no_embedding"}
HIGHER_IS_BETTER = {"top1_agree", "cos_mean", "cos_p5", "decode_speedup", "prefill_speedup"}
SPEED_COLUMNS = (("prefill", "prefill_ms_p50"), ("decode", "decode_ms_per_token_p50"))  # -> <phase>_speedup
SEED_METRICS = ["ppl", "ppl_delta_pct", "kl_mean", "top1_agree", "cos_mean", "cos_p5"]  # mean ± std over seeds
PLOTS = [("ppl_vs_weight_bytes", "weight_bytes", "perplexity vs weight size"),
         ("ppl_vs_decode_latency", "decode_ms_per_token_p50", "perplexity vs decode latency")]


def run_config(cfg: dict):
    """A stored run config (a row's `config` JSON: name, method fields, extras' tables) -> its method config, or
    None where it no longer builds (a row of a method since removed or changed)."""
    spec = {k: v for k, v in cfg.items() if k != "name" and k not in known_extras()}
    try:
        return make_config(spec)
    except (ValueError, KeyError, TypeError):
        return None


def scheme(cfg: dict, dtype: str, config=None) -> str:
    """Short description of what a run quantizes: "w4 g64 asym", "w8 channel sym + a8 dynamic", "w4 g64 asym + QAT
    LSQ + kv4 g64 asym": the method's own describe() (methods/), then each run extra's (extras/). `config`: the
    method config run_config(cfg) gives, where the caller has built it already."""
    config = run_config(cfg) if config is None else config
    text = cfg.get("method", "?") if config is None else get_method(config).describe(config, dtype)
    return " + ".join([text, *describe_extras(cfg)])


def add_config_columns(df: pd.DataFrame) -> pd.DataFrame:
    """scheme, then bits, group_size, symmetric, format, act_bits, of every row from its stored config (each built
    once): the current wording and the effective grid (a base included: core.grid.grid_fields) for older rows too,
    as nullable integers / booleans. Rows whose config no longer builds keep the grid they stored."""
    if "config" not in df:
        return df
    df = df.copy()
    cfgs = [json.loads(c) for c in df["config"]]
    # a row of an imported checkpoint (source_format) describes the file's grid itself: its method config is "none"
    imported = (df["source_format"].notna() if "source_format" in df else pd.Series(False, index=df.index)).tolist()
    configs = [None if imp else run_config(c) for c, imp in zip(cfgs, imported)]
    df["scheme"] = [df["scheme"].iloc[i] if imported[i] and "scheme" in df else scheme(c, d, config)
                    for i, (c, d, config) in enumerate(zip(cfgs, df["dtype"], configs))]
    fields = []
    for i, (config, d) in enumerate(zip(configs, df["dtype"])):
        stored = {k: df[k].iloc[i] if k in df else None for k in GRID_FIELDS}
        fields.append(stored if config is None else grid_fields(config, d))
    grid = pd.DataFrame(fields, index=df.index, columns=list(GRID_FIELDS))
    types = {"bits": "Int64", "group_size": "Int64", "act_bits": "Int64", "symmetric": "boolean", "format": "string"}
    grid = grid.astype(types)
    rest = df.drop(columns=[c for c in GRID_FIELDS if c in df])
    at = list(rest.columns).index("scheme") + 1
    return pd.concat([rest.iloc[:, :at], grid, rest.iloc[:, at:]], axis=1)


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Add ppl_delta_pct, weight_ratio, prefill_speedup, decode_speedup vs the baseline row.

    A row that stored the float model's latency measured just before its own (latency_ref_<column>, the runner
    does it) gets its speed ratio from that pair, so drift of the machine between rows cancels; older rows
    divide the baseline row's latency by theirs."""
    df = df.copy()
    base = df[df["method"].map(is_baseline)]
    if base.empty:
        for c in ("ppl_delta_pct", "weight_ratio", "prefill_speedup", "decode_speedup"):
            df[c] = float("nan")
        return df
    b = base.iloc[0]
    if "ppl" in df:
        df["ppl_delta_pct"] = (df["ppl"] / b["ppl"] - 1) * 100
    df["weight_ratio"] = df["weight_bytes"] / b["weight_bytes"]
    for phase, col in SPEED_COLUMNS:
        if col not in df:
            df[f"{phase}_speedup"] = float("nan")
            continue
        ratio = b[col] / df[col]
        if LATENCY_REF + col in df:
            ref = pd.to_numeric(df[LATENCY_REF + col], errors="coerce")
            ratio = (ref / df[col]).where(ref.notna(), ratio)
        df[f"{phase}_speedup"] = ratio
    return df


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _window_lists(row) -> tuple[list, list] | None:
    nll, tokens = row.get("window_nll"), row.get("window_tokens")
    if not isinstance(nll, str) or not isinstance(tokens, str):
        return None
    return json.loads(nll), json.loads(tokens)


def add_intervals(df: pd.DataFrame) -> pd.DataFrame:
    """Add ppl_ci_low/high (bootstrap over windows) and ppl_delta_ci_low/high + ppl_delta_excludes_zero
    (paired with the baseline), from the rows' stored window_nll. Rows without it get no columns."""
    if "window_nll" not in df or df["window_nll"].isna().all():
        return df
    df = df.copy()
    windows = [_window_lists(r) for _, r in df.iterrows()]
    base = next((w for w, m in zip(windows, df["method"]) if is_baseline(m)), None)
    out = {c: [float("nan")] * len(df) for c in ("ppl_ci_low", "ppl_ci_high", "ppl_delta_ci_low", "ppl_delta_ci_high")}
    excludes = [None] * len(df)
    for i, w in enumerate(windows):
        if w is None:
            continue
        out["ppl_ci_low"][i], out["ppl_ci_high"][i] = stats.ppl_interval(*w)
        if base is not None and base[1] == w[1]:  # paired only on the very same windows
            d = stats.paired_delta_interval(w[0], base[0], w[1])
            out["ppl_delta_ci_low"][i], out["ppl_delta_ci_high"][i], excludes[i] = d["low"], d["high"], d["excludes_zero"]
    for c, v in out.items():
        df[c] = v
    df["ppl_delta_excludes_zero"] = excludes
    return df


def summarize_seeds(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """One row per run group: runs repeated over seeds become their mean, with `<metric>_std` and n_seeds.

    Returns (summary, per-seed rows) — per-seed rows is None when no run was repeated.
    """
    groups = df["run_group"].fillna(df["run"]) if "run_group" in df else df["run"]
    if not groups.duplicated().any():
        return df, None
    rows = []
    for group, g in df.groupby(groups, sort=False):
        if len(g) == 1:
            rows.append(g.iloc[0])
            continue
        row = g.iloc[0].copy()
        for c in df.columns:
            if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]):
                row[c] = g[c].mean()
        for m in SEED_METRICS + sorted(domains.lower_is_better(df)):
            if m in g:
                row[f"{m}_std"] = stats.mean_std(g[m])[1]
        for c in ("ppl_ci_low", "ppl_ci_high", "ppl_delta_ci_low", "ppl_delta_ci_high", "ppl_delta_excludes_zero",
                  *domains.interval_columns(df)):
            if c in row:  # window intervals belong to single runs; the seed spread is the ± std
                row[c] = None
        row["run"], row["n_seeds"], row["seed"] = group, len(g), ", ".join(str(s) for s in g["seed"])
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True), df[groups.duplicated(keep=False)]


def _interval(row, low: str, high: str, fmt: str) -> str | None:
    lo, hi = row.get(low), row.get(high)
    if lo is None or hi is None or lo != lo or hi != hi:
        return None
    return f"[{fmt.format(lo)}, {fmt.format(hi)}]"


def _cell(row, col: str, fmt: str) -> str:
    if col.endswith("_delta_ci"):  # ppl_delta_ci, ppl_<domain>_delta_ci
        text = _interval(row, f"{col}_low", f"{col}_high", "{:+.2f}")
        excludes = row.get(f"{col[:-3]}_excludes_zero")  # True, numpy True (via a DataFrame), None or NaN
        return "–" if text is None else text + (" ✓" if excludes is not None and excludes == True else "")  # noqa: E712
    if col.endswith("_ci"):  # ppl_ci, ppl_<domain>_ci
        return _interval(row, f"{col}_low", f"{col}_high", "{:.2f}") or "–"
    text = _fmt(row[col], fmt)
    std = row.get(f"{col}_std")
    if std is not None and std == std and text != "–":
        text += " ± " + _fmt(std, fmt.replace("+", ""))
    return text


def _shown(df: pd.DataFrame, col: str) -> bool:
    source = f"{col}_low" if col.endswith("_ci") else col  # ppl_ci, ppl_delta_ci, ppl_<domain>_ci, ...
    return source in df.columns and df[source].notna().any()


def _best(df: pd.DataFrame, col: str, fmt: str) -> str | None:
    """The formatted best value of a column among the non-baseline rows (ties all count)."""
    lower = LOWER_IS_BETTER | domains.lower_is_better(df)
    if col not in lower | HIGHER_IS_BETTER:
        return None
    values = pd.to_numeric(df.loc[~df["method"].map(is_baseline), col], errors="coerce").dropna()
    if values.empty:
        return None
    return _fmt(values.min() if col in lower else values.max(), fmt)


def markdown_table(df: pd.DataFrame, columns=TABLE_COLUMNS, mark_best: bool = False) -> str:
    """A Markdown table of the columns that have values; mark_best bolds each column's best quantized run."""
    cols = [c for c in columns if _shown(df, c[0])]
    best = {c: _best(df, c, f) for c, _, f in cols} if mark_best and "method" in df else {}
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = []
        for c, _, f in cols:
            text = _cell(row, c, f)
            is_best = best.get(c) is not None and not is_baseline(row.get("method")) and _fmt(row[c], f) == best[c]
            cells.append(f"**{text}**" if is_best else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drop_lifetime_peaks(df: pd.DataFrame) -> pd.DataFrame:
    """Rows recorded before per-run memory existed carry the runner process's lifetime peak RSS in
    peak_rss_mib (the same number in every row): not a per-run measurement, so it is left out. Only a
    peak measured in an isolated process (memory_probe says so) is kept."""
    if "peak_rss_mib" not in df:
        return df
    probe = df["memory_probe"] if "memory_probe" in df else pd.Series([None] * len(df), index=df.index)
    isolated = probe.map(lambda p: isinstance(p, str) and p.startswith("isolated process"))
    df = df.copy()
    df.loc[~isolated, "peak_rss_mib"] = float("nan")
    return df.drop(columns=["peak_rss_mib"]) if df["peak_rss_mib"].isna().all() else df


def plots_text(name: str, summary: pd.DataFrame, reports_dir: Path) -> str:
    """Draw every plot the rows have data for (<name>.<plot>.png + .csv) and return their Markdown."""
    from . import plots  # matplotlib loads only when a report is written

    lines = []
    for slug, x, title in PLOTS:
        if plots.usable_points(summary, x, "ppl").empty:
            continue
        getattr(plots, f"plot_{slug}")(summary, reports_dir / f"{name}.{slug}.png")
        lines.append(f"![{title}]({name}.{slug}.png)\n\n*{title.capitalize()}: Pareto front in red, error bars "
                     f"the 95% interval or ± std over seeds; the points are in `{name}.{slug}.csv`.*")
    return "\n\n".join(lines)


def report_paths(name: str, reports_dir: Path) -> list[Path]:
    """Every file write_report may write for report `name`."""
    plots = [reports_dir / f"{name}.{slug}.{ext}" for slug, _, _ in PLOTS for ext in ("png", "csv")]
    return [reports_dir / f"{name}.{ext}" for ext in ("csv", "md", "experiment.json")] + plots


def write_sidecar(name: str, rows: list[dict], reports_dir: Path, description: str, findings: str = "") -> None:
    """<name>.experiment.json: what the report needs beyond the rows (name, description, findings template,
    which rows, in order). An empty `findings` is left out, so sidecars of experiments without one stay as they were."""
    meta = {"experiment": name, "description": description, **({"findings": findings} if findings else {}),
            "run_keys": [r.get("run_key") for r in rows]}
    (reports_dir / f"{name}.experiment.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def quoted_rows(template: str, dirs) -> dict[str, dict[str, dict] | None]:
    """{report: {run: row}} of each report a findings template quotes (REPORT/RUN), read from the first
    <dir>/<report>.csv of `dirs`; None for a report none of them holds. Seed groups are addressable as in
    the report's own rows."""
    out = {}
    for report in findings_mod.quoted_reports(template):
        path = next((f for f in (Path(d) / f"{report}.csv" for d in dirs) if f.is_file()), None)
        if path is None:
            out[report] = None
            continue
        df = pd.read_csv(path)
        out[report] = findings_mod.report_rows(df, summarize_seeds(df)[0])
    return out


def write_report(name: str, rows: list[dict], reports_dir: str | Path, description: str = "",
                 findings: str = "", quote_dirs=None) -> pd.DataFrame:
    """Write <reports_dir>/<name>.csv, .md, plots and the .experiment.json sidecar; returns the DataFrame.

    `findings` is the experiment's template (see findings.py), rendered from the rows after the table; a
    template that does not fit the rows raises before any file is written. Runs it quotes from another
    report (REPORT/RUN) come from REPORT.csv in the first of `quote_dirs` (default: reports_dir) that has it.
    Depends on the rows, the description, the template and the quoted CSVs only, so
    regenerate.regenerate_report() reproduces it.
    """
    if not rows:
        raise ValueError(f"no result rows for {name!r}: nothing to report")
    reports_dir = Path(reports_dir)
    df = pd.DataFrame(rows)
    if "config" in df:  # derived from the stored config, so older rows get the current wording and grid too
        df = add_config_columns(df)
    df = domains.add_domain_columns(add_intervals(add_ratios(drop_lifetime_peaks(df))))
    summary, per_seed = summarize_seeds(df)
    at = [c for c, _, _ in TABLE_COLUMNS].index("ppl_delta_ci") + 1  # other domains' columns follow the main ppl's
    columns = TABLE_COLUMNS[:at] + domains.table_columns(df) + TABLE_COLUMNS[at:]
    formats = {c: f for c, _, f in columns}
    quoted = quoted_rows(findings, [reports_dir] if quote_dirs is None else quote_dirs)
    findings_text = findings_mod.findings_section(findings, df, summary, formats, quoted)  # raises before writing
    for path in report_paths(name, reports_dir):  # never written through a link planted in the reports folder
        refuse_links(path, "report file")
    reports_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(reports_dir / f"{name}.csv", index=False)
    legend = "**Bold**: the best value of a column among the quantized runs (the baseline excluded)."
    seeds = "" if per_seed is None else (
        "**Seeds.** Rows with ± are the mean ± sample std over calibration seeds (seeds draw the calibration "
        "windows); each seed's run:\n\n" + markdown_table(per_seed, columns))
    parts = [f"# {name}", description.strip(), legend + "\n\n" + markdown_table(summary, columns, mark_best=True), seeds,
             lmeval_section.section(summary),  # lm-eval columns' table, when the rows have them
             findings_text, plots_text(name, summary, reports_dir), protocol_text(df), intervals_text(df),
             backend_text(df), environment_text(df)]
    (reports_dir / f"{name}.md").write_text("\n\n".join(p for p in parts if p) + "\n")
    write_sidecar(name, rows, reports_dir, description, findings)
    return df
