"""Sensitivity rows -> tidy CSV + a PNG (matplotlib, Agg): a block × layer-type heat map of
log10 KL per candidate for per-layer sweeps, bars otherwise. The CSV is the data behind the plot.

>>> write_sensitivity(rows, "reports/smollm2_mixed.sensitivity")   # .csv and .png
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd


def with_ext(prefix: Path, ext: str) -> Path:
    """reports/x.sensitivity + .csv -> reports/x.sensitivity.csv (Path.with_suffix would drop '.sensitivity')."""
    return prefix.parent / (prefix.name + ext)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def write_sensitivity(rows: list[dict], out_prefix: str | Path, metric: str = "kl_mean") -> pd.DataFrame:
    """Write <out_prefix>.csv (every row) and <out_prefix>.png (metric per unit and candidate)."""
    if not rows:
        raise ValueError("no sensitivity rows: nothing to write or plot")
    df = pd.DataFrame(rows)
    if metric not in df:
        raise ValueError(f"unknown metric {metric!r}; columns: {', '.join(df.columns)}")
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(with_ext(out_prefix, ".csv"), index=False)
    plt = _pyplot()
    candidates = list(dict.fromkeys(df["candidate"]))
    per_layer = (df["granularity"] == "layer").all() and df["block"].notna().all()
    if per_layer:
        fig = _heatmaps(plt, df, candidates, metric)
    else:
        fig = _bars(plt, df, candidates, metric)
    fig.savefig(with_ext(out_prefix, ".png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return df


def _heatmaps(plt, df: pd.DataFrame, candidates: list[str], metric: str):
    types = list(dict.fromkeys(df["type"]))
    blocks = sorted({int(b) for b in df["block"]})
    values = df[metric].clip(lower=1e-12)
    lo, hi = math.log10(values.min()), math.log10(values.max())
    fig, axes = plt.subplots(1, len(candidates), figsize=(2.2 + 1.1 * len(types) * len(candidates), 0.22 * len(blocks) + 2),
                             squeeze=False)
    for ax, cand in zip(axes[0], candidates):
        sub = df[df["candidate"] == cand]
        grid = sub.pivot_table(index="block", columns="type", values=metric).reindex(index=blocks, columns=types)
        im = ax.imshow(grid.clip(lower=1e-12).apply(lambda c: c.map(math.log10)).to_numpy(), aspect="auto",
                       cmap="viridis", vmin=lo, vmax=hi)
        ax.set_title(cand, fontsize=9)
        ax.set_xticks(range(len(types)), [t.split(".")[-1] for t in types], rotation=60, fontsize=7)
        ax.set_yticks(range(len(blocks)), blocks, fontsize=6)
        ax.set_ylabel("block")
    fig.colorbar(im, ax=axes[0].tolist(), label=f"log10 {metric} (one layer quantized)")
    return fig


def _bars(plt, df: pd.DataFrame, candidates: list[str], metric: str):
    units = list(dict.fromkeys(df["unit"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(units) * len(candidates)), 4))
    width = 0.8 / len(candidates)
    for k, cand in enumerate(candidates):
        sub = df[df["candidate"] == cand].set_index("unit").reindex(units)
        ax.bar([i + k * width for i in range(len(units))], sub[metric], width, label=cand)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(units))], units, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(f"{metric} (one unit quantized)")
    ax.legend(fontsize=8)
    return fig
