"""Scatter plots of a report's rows: a PNG and, beside it, the CSV of the points drawn.

    plot_ppl_vs_weight_bytes(df, "reports/x.ppl_vs_weight_bytes.png")   # + reports/x.ppl_vs_weight_bytes.csv
    plot_ppl_vs_decode_latency(df, "reports/x.ppl_vs_decode_latency.png")

Both axes are "lower is better", so the Pareto front is the set of runs no other run beats
on both at once (pareto_front). Plotting with no usable rows raises before any file is written.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

PNG_META = {"Software": None}  # no matplotlib version in the file: the bytes depend on the data only


def pareto_front(x, y) -> list[bool]:
    """For each point, whether no other point has x' <= x and y' <= y with one strictly smaller.

    >>> pareto_front([1, 2, 3, 2], [3, 1, 2, 2])
    [True, True, False, False]
    """
    points = list(zip(x, y))
    return [not any(a <= px and b <= py and (a < px or b < py) for a, b in points) for px, py in points]


def usable_points(df: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Rows of df with a finite value in both columns (empty if either column is missing)."""
    if df is None or x not in df.columns or y not in df.columns:
        return pd.DataFrame()
    values = df[[x, y]].apply(pd.to_numeric, errors="coerce")
    keep = values.notna().all(axis=1) & values.abs().lt(float("inf")).all(axis=1)
    return df[keep]


def scatter_with_front(df: pd.DataFrame, x: str, y: str, png_path, xlabel: str, ylabel: str, title: str,
                       x_scale: float = 1.0) -> pd.DataFrame:
    """Scatter y against x (x divided by x_scale for display), front highlighted; writes PNG + CSV.

    Error bars: the y column's bootstrap interval (`<y>_ci_low/high`) where the rows carry one,
    else ± `<y>_std` across seeds. Returns the DataFrame written to the CSV.
    """
    png_path = Path(png_path)
    points = usable_points(df, x, y)
    if points.empty:
        have = "no rows" if df is None or len(df) == 0 else f"{len(df)} row(s), none with both {x!r} and {y!r}"
        raise ValueError(f"cannot plot {y} vs {x}: {have}")
    data = pd.DataFrame({"run": points["run"].astype(str).values,
                         "scheme": points["scheme"].values if "scheme" in points else "",
                         x: points[x].astype(float).values, y: points[y].astype(float).values})
    low, high = data[y].copy(), data[y].copy()
    if f"{y}_std" in points:
        std = points[f"{y}_std"].astype(float).fillna(0).values
        low, high = data[y] - std, data[y] + std
    if f"{y}_ci_low" in points:
        ci_low, ci_high = points[f"{y}_ci_low"].astype(float).values, points[f"{y}_ci_high"].astype(float).values
        has_ci = pd.notna(ci_low)
        low, high = low.where(~has_ci, ci_low), high.where(~has_ci, ci_high)
    data[f"{y}_err_low"], data[f"{y}_err_high"] = low.values, high.values
    data["pareto"] = pareto_front(data[x], data[y])

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    xs = data[x] / x_scale
    err = [(data[y] - data[f"{y}_err_low"]).clip(lower=0), (data[f"{y}_err_high"] - data[y]).clip(lower=0)]
    ax.errorbar(xs, data[y], yerr=err, fmt="none", ecolor="0.6", elinewidth=1, capsize=2, zorder=1)
    ax.scatter(xs[~data["pareto"]], data[y][~data["pareto"]], color="0.55", s=28, zorder=2, label="dominated")
    front = data[data["pareto"]].sort_values(x)
    ax.plot(front[x] / x_scale, front[y], "-o", color="tab:red", ms=6, zorder=3, label="Pareto front")
    labelled = data if len(data) <= 10 else front  # many points: name the front only (all are in the CSV)
    for _, r in labelled.iterrows():
        ax.annotate(r["run"], (r[x] / x_scale, r[y]), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if data[y].min() > 0 and data[y].max() / data[y].min() > 3:  # one collapsed run would squash the rest
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 40, not 4×10¹
        ax.yaxis.set_major_formatter(plain)
        if data[y].max() / data[y].min() < 30:  # within ~1.5 decades: label the 2s, 3s and 5s too
            ax.yaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
        else:  # many decades: minor labels would overlap
            ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=xlabel, ylabel=ylabel + (" (log scale)" if ax.get_yscale() == "log" else ""), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png", metadata=PNG_META)
    plt.close(fig)
    data.to_csv(png_path.with_suffix(".csv"), index=False)
    return data


def plot_ppl_vs_weight_bytes(df: pd.DataFrame, png_path) -> pd.DataFrame:
    """Perplexity vs model weight size (MiB on the axis, bytes in the CSV), Pareto front in red."""
    return scatter_with_front(df, "weight_bytes", "ppl", png_path, "weights (MiB)", "perplexity ↓",
                              "perplexity vs weight size", x_scale=2**20)


def plot_ppl_vs_decode_latency(df: pd.DataFrame, png_path) -> pd.DataFrame:
    """Perplexity vs median decode latency per token, Pareto front in red."""
    return scatter_with_front(df, "decode_ms_per_token_p50", "ppl", png_path, "decode ms/token (p50)",
                              "perplexity ↓", "perplexity vs decode latency")
