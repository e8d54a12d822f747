"""A leaderboard that says which differences are real: every pair of runs compared on the windows they share.

All runs of one report are evaluated on the same windows, so each pair is a *paired* comparison: a paired
t-test on the per-window mean-NLL differences, Holm-adjusted over all pairs, beside the paired bootstrap
interval of Δppl % (stats.paired_delta_interval). Runs that share a letter (compact letter display) are not
resolved; a pair whose ppl gap is within the calibration noise of a method rerun with several seeds is not
resolved whatever the window test says.

    table, pairs = leaderboard(load_rows("reports/smollm2_methods2025.csv"))
    print(leaderboard_markdown(table, pairs))
"""
from __future__ import annotations

import itertools
import json
import math
import re
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd

from . import stats
from .compare import IMPLIED, SAME_WINDOWS

WINDOW_COLUMNS = ("window_nll", "window_tokens")  # per-window NLL sums, predicted tokens per window
LETTERS = string.ascii_lowercase + string.ascii_uppercase
SEED_SUFFIX = re.compile(r"-seed(\d+)$")  # what runs/experiment.py's seed expansion appends to a run name


def load_rows(path) -> pd.DataFrame:
    """A report's rows from `X.csv` or `X.results.jsonl` (the rows its report shows), refusing a file whose rows
    carry no per-window data. The path is kept in `df.attrs["source"]` for error messages and the Markdown."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"report {str(path)!r} does not exist")
    if path.name.endswith(".results.jsonl"):
        from .results import read_rows, select_rows

        sidecar = path.with_name(path.name.removesuffix(".results.jsonl") + ".experiment.json")
        meta = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else None
        df = pd.DataFrame(select_rows(read_rows(path), meta, str(path)))
    else:
        df = pd.read_csv(path)
    if "run" not in df.columns:
        raise ValueError(f"{path}: no 'run' column; is this a quantlab report? columns: {', '.join(df.columns[:12])}")
    missing = [c for c in WINDOW_COLUMNS if c not in df.columns or df[c].isna().all()]
    if missing:
        raise ValueError(f"{path}: no per-window data (missing column(s) {', '.join(missing)}): the leaderboard "
                         "pairs runs window by window, which needs the rows of a perplexity report")
    df.attrs["source"] = str(path)
    return df


def _frame(rows) -> pd.DataFrame:
    if isinstance(rows, (list, tuple)):
        rows = pd.DataFrame(list(rows))
    if not isinstance(rows, pd.DataFrame):
        raise TypeError(f"rows must be a DataFrame or a list of row dicts, got {type(rows).__name__}")
    if "run" not in rows.columns:
        raise ValueError(f"{rows.attrs.get('source', 'rows')}: no 'run' column; columns: {', '.join(rows.columns[:12])}")
    return rows


def window_arrays(row) -> tuple[np.ndarray, np.ndarray] | None:
    """(per-window NLL sums, predicted tokens per window) of one row, from JSON text or lists; None if absent."""
    values = [row.get(c) for c in WINDOW_COLUMNS]
    values = [json.loads(v) if isinstance(v, str) else v for v in values]
    if not all(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return None
    return np.asarray(values[0], dtype=np.float64), np.asarray(values[1], dtype=np.float64)


def _check_same_windows(df: pd.DataFrame, where: str) -> None:
    """Refuse rows evaluated on different windows, naming the protocol columns (or runs) that differ."""
    differs = []
    for c in sorted(c for c in SAME_WINDOWS if c in df.columns):
        values = df[c].fillna(IMPLIED.get(c, "–")).map(str)
        if values.nunique() > 1:
            differs.append(f"{c}: " + "; ".join(f"{v} ({', '.join(df.loc[values == v, 'run'].map(str))})"
                                                 for v in values.unique()))
    if differs:
        raise ValueError(f"{where}: runs evaluated on different windows cannot be paired: " + " | ".join(differs))


def candidates(rows) -> pd.DataFrame:
    """The runs to rank: the latest row per run name that carries per-window data, sorted by its perplexity
    (best first), with `nll` / `tokens` arrays. attrs: source, no_windows (the runs left out), n_windows, tokens."""
    df = _frame(rows)
    where = df.attrs.get("source", "rows")
    latest = df.drop_duplicates("run", keep="last")
    arrays = [window_arrays(r) for r in latest.to_dict("records")]
    keep = [a is not None for a in arrays]
    out = latest[keep].copy()
    if len(out) < 2:
        raise ValueError(f"{where}: need at least two runs with per-window data ({', '.join(WINDOW_COLUMNS)}), "
                         f"found {len(out)}")
    _check_same_windows(out, where)
    for k, col in enumerate(("nll", "tokens")):  # one array per row
        out[col] = pd.Series([a[k] for a in arrays if a is not None], index=out.index, dtype=object)
    first = out["tokens"].iloc[0]
    other = [r for r, t in zip(out["run"], out["tokens"]) if t.shape != first.shape or not np.array_equal(t, first)]
    if other:
        raise ValueError(f"{where}: runs {', '.join(map(str, other))} predicted other tokens per window than "
                         f"{out['run'].iloc[0]}: they were not evaluated on the same windows")
    if first.size < 2:
        raise ValueError(f"{where}: {first.size} window: a paired test needs at least two")
    out["ppl"] = [stats.ppl_from_windows(n, t) for n, t in zip(out["nll"], out["tokens"])]
    out = out.sort_values("ppl", kind="stable").reset_index(drop=True)
    out.attrs.update(source=where, no_windows=[str(r) for r, k in zip(latest["run"], keep) if not k],
                     n_windows=int(first.size), tokens=int(first.sum()))
    return out


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's (1979) step-down adjusted p-values, in the input order: with p sorted ascending,
    adjusted p_(k) = max over m <= k of min(1, (M - m + 1) * p_(m)).

    >>> holm([0.01, 0.04, 0.03]).round(2).tolist()
    [0.03, 0.06, 0.06]
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1 or np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"need a 1-D list of p-values in [0, 1], got {p_values!r}")
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (p.size - np.arange(p.size)) * p[order])  # (M - m + 1) * p_(m), m counted from 1
    out = np.empty_like(p)
    out[order] = np.maximum.accumulate(scaled)
    return out


def paired_t_pvalue(d: Sequence[float]) -> float:
    """Two-sided p-value of a paired t-test (one-sample t on the differences d, n - 1 degrees of freedom).
    All differences equal: p = 1 if they are 0, else 0 (no spread: the difference is exact)."""
    d = np.asarray(d, dtype=np.float64)
    mean, sd = d.mean(), d.std(ddof=1)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    try:
        from scipy.stats import t as student_t
    except ImportError as e:  # not a dependency of the base install (lm-eval's scikit-learn brings it)
        raise RuntimeError("the leaderboard's paired t-test needs scipy: pip install scipy") from e
    return float(2 * student_t.sf(abs(mean / (sd / math.sqrt(d.size))), d.size - 1))


def windows_for_power(d: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> int | None:
    """Windows at which a two-sided paired test at level `alpha` resolves the mean of the per-window differences
    `d` with probability `power`, by the normal approximation n = ((z_{1-alpha/2} + z_power) * sd / |mean|)^2,
    rounded up (at least 2, a t-test's minimum). The t-test's own power at that n is slightly lower (about 0.78
    for 0.8 at n = 32), and `alpha` is one comparison's level (no Holm adjustment). None when the mean is 0: no
    number of windows resolves it.

    >>> windows_for_power([0.01 + 0.02 * z for z in (-1.0, 1.0)])  # mean 0.01, sd 0.02 * sqrt(2)
    63
    """
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha and power must be in (0, 1), got alpha={alpha}, power={power}")
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"need at least two per-window differences, got shape {d.shape}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if mean == 0:
        return None
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return max(2, math.ceil((z * sd / abs(mean)) ** 2))


def pairwise(rows, alpha: float = 0.05, power: float = 0.8) -> pd.DataFrame:
    """Every pair (a, b) of runs, a ranked better: Δppl % of b against a with its paired bootstrap 95% interval,
    the paired t-test on d_w = (nll_b,w - nll_a,w) / tok_w, its Holm-adjusted p over all pairs, `significant`
    (adjusted p < alpha) and `windows_needed` (windows_for_power at `power`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    c = candidates(rows)
    out = []
    for i in range(len(c)):
        for j in range(i + 1, len(c)):
            a, b = c.iloc[i], c.iloc[j]
            d = (b["nll"] - a["nll"]) / a["tokens"]
            ci = stats.paired_delta_interval(b["nll"], a["nll"], a["tokens"])
            out.append({"a": a["run"], "b": b["run"], "ppl_a": a["ppl"], "ppl_b": b["ppl"],
                        "delta_pct": ci["delta_pct"], "ci_low": ci["low"], "ci_high": ci["high"],
                        "d_mean": float(d.mean()), "d_sd": float(d.std(ddof=1)), "p": paired_t_pvalue(d),
                        "windows_needed": windows_for_power(d, alpha, power)})
    pairs = pd.DataFrame(out)
    pairs["p_holm"] = holm(pairs["p"].to_numpy())
    pairs["significant"] = pairs["p_holm"] < alpha
    pairs["windows_needed"] = pairs["windows_needed"].astype("Int64")  # None: a mean difference of exactly 0
    pairs.attrs.update(c.attrs, alpha=alpha, power=power, order=list(c["run"]), ppl=dict(zip(c["run"], c["ppl"])))
    return pairs


def letters(order: Sequence[str], significant_pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Compact letter display (Piepho 2004, insert-and-absorb): two candidates share a letter iff their
    difference is not significant. `order` ranks them best first; letters a, b, c... follow that order.

    >>> letters(["A", "B", "C"], [("A", "C")])
    {'A': 'a', 'B': 'ab', 'C': 'b'}
    """
    order = list(order)
    rank = {name: i for i, name in enumerate(order)}
    if len(rank) != len(order):
        raise ValueError(f"duplicate candidate names in {order}")
    pairs = set()
    for a, b in significant_pairs:
        unknown = [x for x in (a, b) if x not in rank]
        if unknown or a == b:
            raise ValueError(f"significant pair ({a!r}, {b!r}): " + (f"unknown {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(order)}" if unknown else "a candidate against itself"))
        pairs.add(tuple(sorted((rank[a], rank[b]))))
    columns = [frozenset(range(len(order)))]
    for i, j in sorted(pairs):
        split = []
        for col in columns:  # a letter holding both is split into one without i and one without j
            split += [col - {i}, col - {j}] if i in col and j in col else [col]
        columns = [col for k, col in enumerate(split)  # absorb: drop letters inside another (or equal, earlier)
                   if not any(col < other or (col == other and m < k) for m, other in enumerate(split))]
    columns.sort(key=sorted)
    if len(columns) > len(LETTERS):
        raise ValueError(f"{len(columns)} letters needed, more than the {len(LETTERS)} available: read the pairs table")
    return {name: "".join(LETTERS[k] for k, col in enumerate(columns) if rank[name] in col) for name in order}


def calibration_noise(rows) -> pd.DataFrame:
    """Methods rerun with several calibration draws (rows of one `run_group`, or run names differing only in a
    `-seed<N>` suffix, or one run name with different `seed`): one row per method with `runs`, `draws` (distinct
    seeds), `ppl_min`, `ppl_max` and `ppl_spread` (max - min, latest row per run and seed)."""
    df = _frame(rows)
    name = df["run"].map(str)
    stripped = name.str.replace(SEED_SUFFIX, "", regex=True)
    group = df["run_group"].fillna(stripped) if "run_group" in df else stripped
    suffix = name.str.extract(SEED_SUFFIX)[0].astype(float)
    seed = pd.to_numeric(df["seed"], errors="coerce").fillna(suffix) if "seed" in df else suffix
    if "ppl" in df:
        ppl = pd.to_numeric(df["ppl"], errors="coerce")
    else:  # rows without a ppl column: their windows'
        windows = [window_arrays(r) for r in df.to_dict("records")]
        ppl = pd.Series([np.nan if w is None else stats.ppl_from_windows(*w) for w in windows], index=df.index)
    draws = pd.DataFrame({"group": group, "run": name, "seed": seed, "ppl": ppl})
    draws = draws.dropna(subset=["seed", "ppl"]).drop_duplicates(["run", "seed"], keep="last")
    out = []
    for g, d in draws.groupby("group", sort=False):
        if d["seed"].nunique() > 1:
            out.append({"group": g, "runs": list(dict.fromkeys(d["run"])), "draws": int(d["seed"].nunique()),
                        "ppl_min": d["ppl"].min(), "ppl_max": d["ppl"].max(),
                        "ppl_spread": d["ppl"].max() - d["ppl"].min()})
    return pd.DataFrame(out, columns=["group", "runs", "draws", "ppl_min", "ppl_max", "ppl_spread"])


def leaderboard(rows, alpha: float = 0.05, power: float = 0.8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, pairs). pairs: pairwise() plus `within_noise` (|ppl_b - ppl_a| at most the larger calibration
    spread of the two) and `resolved` (significant and not within noise). table: rank, run, ppl, letters (from
    the resolved pairs), calib_spread, and against the run ranked just above: delta_pct, p_holm, within_noise,
    resolved, windows_needed."""
    pairs = pairwise(rows, alpha, power)
    order = pairs.attrs["order"]
    noise = calibration_noise(rows)
    spread = {run: s for runs, s in zip(noise["runs"], noise["ppl_spread"]) for run in runs}
    largest = [np.fmax(spread.get(a, np.nan), spread.get(b, np.nan)) for a, b in zip(pairs["a"], pairs["b"])]
    gap = (pairs["ppl_b"] - pairs["ppl_a"]).abs()
    # at most the spread, to rounding (two seeds of one method are exactly its spread apart); NaN: no noise known
    pairs["within_noise"] = [bool(g <= s * (1 + 1e-9)) for g, s in zip(gap, largest)]
    pairs["resolved"] = pairs["significant"] & ~pairs["within_noise"]
    shown = letters(order, zip(pairs.loc[pairs["resolved"], "a"], pairs.loc[pairs["resolved"], "b"]))
    by_pair = pairs.set_index(["a", "b"])
    table = pd.DataFrame({"rank": range(1, len(order) + 1), "run": order,
                          "ppl": [pairs.attrs["ppl"][r] for r in order], "letters": [shown[r] for r in order],
                          "calib_spread": [spread.get(r, np.nan) for r in order]})
    above = [by_pair.loc[(a, b)] for a, b in itertools.pairwise(order)]  # the first run has none above
    for col, dtype in (("delta_pct", "Float64"), ("p_holm", "Float64"), ("within_noise", "boolean"),
                       ("resolved", "boolean"), ("windows_needed", "Int64")):
        table[col] = pd.array([pd.NA] + [p[col] for p in above], dtype=dtype)
    table.attrs.update(pairs.attrs, letters=shown)
    return table, pairs


def _fmt(v, spec: str = "{:.4g}") -> str:
    return "–" if v is None or v is pd.NA or v != v else spec.format(v)


def leaderboard_markdown(table: pd.DataFrame, pairs: pd.DataFrame) -> str:
    """The ranked table and a findings paragraph, every number from `leaderboard()`'s frames."""
    a = table.attrs
    noise = table["calib_spread"].notna().any()
    header = ["rank", "run", "ppl", "letters"] + (["calib. spread"] if noise else []) + [
        "Δppl % vs above", "p (Holm) vs above", f"windows for {a['power']:.0%} power"]
    intro = (f"**Leaderboard** of `{a['source']}`: {len(table)} runs on the same {a['n_windows']} windows "
             f"({a['tokens']} predicted tokens), best perplexity first. Runs sharing a letter are not resolved: a "
             f"paired t-test over windows, Holm-adjusted over all {len(pairs)} pairs, does not reject at "
             f"α = {a['alpha']:g}, or their gap is within a method's calibration spread.")
    lines = [intro, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in table.iterrows():
        cells = [str(r["rank"]), f"`{r['run']}`", _fmt(r["ppl"]), r["letters"]]
        cells += [_fmt(r["calib_spread"])] if noise else []
        cells += [_fmt(r["delta_pct"], "{:+.2f}"), _fmt(r["p_holm"], "{:.2g}"), _fmt(r["windows_needed"], "{:d}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", _findings(table, pairs)]) + "\n"


def _findings(table: pd.DataFrame, pairs: pd.DataFrame) -> str:
    a, shown = table.attrs, table.attrs["letters"]
    groups = {ch: [r for r in a["order"] if ch in shown[r]] for ch in LETTERS if any(ch in s for s in shown.values())}
    noisy = pairs[pairs["significant"] & pairs["within_noise"]]
    text = [f"**Findings.** Of the {len(pairs)} pairs, {int(pairs['resolved'].sum())} are resolved"
            + (f" and {len(noisy)} more pass the window test but lie within calibration noise "
               f"({', '.join(f'{x} vs {y}' for x, y in zip(noisy['a'], noisy['b']))})" if len(noisy) else "")
            + f". The letters form {len(groups)} group(s): "
            + "; ".join(f"{ch}: {', '.join(runs)}" for ch, runs in groups.items()) + "."]
    ties = table[table["resolved"].eq(False).fillna(False)]
    if len(ties):
        text.append("Not resolved from the run above: " + "; ".join(
            f"{r['run']} (Δ {_fmt(r['delta_pct'], '{:+.2f}')} %, " + ("within calibration noise)" if r["within_noise"]
            else f"about {_fmt(r['windows_needed'], '{:d}')} windows for {a['power']:.0%} power)")
            for _, r in ties.iterrows()) + f"; this report has {a['n_windows']} windows.")
    if a["no_windows"]:
        text.append(f"Left out (no per-window data): {', '.join(a['no_windows'])}.")
    return " ".join(text)


def leaderboard_section(frame: pd.DataFrame, domain: str | None = None) -> str:
    """leaderboard_markdown of every run of a report's rows (one per run and seed), on the main windows or on one
    domain's (its window_nll_DOMAIN, window_tokens_DOMAIN, ppl_DOMAIN taking the place of the main ones)."""
    df = frame.copy()
    label = f"{df['eval_dataset'].iloc[0]} {df['eval_split'].iloc[0]}" if {"eval_dataset", "eval_split"} <= set(df) \
        else "this report's"
    if domain is not None:
        names = {f"window_nll_{domain}": "window_nll", f"window_tokens_{domain}": "window_tokens",
                 f"ppl_{domain}": "ppl"}
        missing = [c for c in names if c not in df]
        if missing:
            raise ValueError(f"the rows have no {', '.join(missing)}")
        df = df.drop(columns=[c for c in names.values() if c in df]).rename(columns=names)
        label = f"{domain} {df['eval_split'].iloc[0]}" if "eval_split" in df else domain
    df.attrs["source"] = f"{label} windows"
    return leaderboard_markdown(*leaderboard(df)).strip()
