"""Findings written from the rows: an experiment's `findings` template, filled in by the report.

Every number and every comparison word comes from the report's rows, so a rerun rewrites them. The
template's syntax and its parser are in reporting/template.py.
"""
from __future__ import annotations

import json
import math

from . import stats
from .template import (  # noqa: F401 (check_*: the template's checks, re-exported beside its renderer)
    LEADERBOARD,
    FindingsError,
    Placeholder,
    check_domains,
    check_runs,
    parse,
    quoted_reports,
    split_quoted,
    template_parts,
)

INTERVAL_COLUMNS = {"ppl_ci": ("ppl_ci_low", "ppl_ci_high", ".2f"),
                    "ppl_delta_ci": ("ppl_delta_ci_low", "ppl_delta_ci_high", "+.2f")}
HEADER = ("## Findings\n\n*Generated from the rows above by the experiment's `findings` template: every number and "
          "every comparison word is computed from the stored rows, so a rerun rewrites them. The Δppl % of one run "
          "(or the Δ mean cosine of embedding rows) against another comes with its paired 95% bootstrap interval over "
          "the windows (sentences) in brackets, and the two are called not distinguishable when that interval "
          "includes 0; other comparisons are of point values.*")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _format(value, fmt: str | None) -> str:
    if _missing(value):
        return "–"
    if hasattr(value, "item"):  # numpy scalars -> Python ones
        value = value.item()
    if fmt is None:
        fmt = "{}"
        if isinstance(value, float):
            fmt = "{:.0f}" if value.is_integer() else "{:.4g}"
    return fmt.format(value) if "{" in fmt else format(value, fmt)


def _value(row: dict, name: str, column: str, p: Placeholder) -> object:
    if column not in row:
        raise FindingsError(f"findings placeholder {{{p.text}}}: run {name!r} has no column {column!r}; "
                            f"known: {', '.join(sorted(list(row) + list(INTERVAL_COLUMNS)))}")
    return row[column]


def _interval_column(column: str, row: dict) -> tuple[str, str, str] | None:
    """(low, high, default format) of an interval column: ppl_ci, ppl_delta_ci, ppl_<domain>_ci, ..."""
    if column in INTERVAL_COLUMNS:
        return INTERVAL_COLUMNS[column]
    if column.endswith("_ci") and f"{column}_low" in row:
        return f"{column}_low", f"{column}_high", "+.2f" if column.endswith("_delta_ci") else ".2f"
    return None


def _render_value(p: Placeholder, rows: dict, formats: dict) -> str:
    row = rows[p.run]
    interval = _interval_column(p.column, row)
    if interval:
        low, high, default = interval
        lo, hi = row.get(low), row.get(high)
        if _missing(lo) or _missing(hi):
            return "–"
        fmt = p.fmt or default
        return f"[{format(lo, fmt)}, {format(hi, fmt)}]"
    value = _value(row, p.run, p.column, p)
    try:
        return _format(value, p.fmt if p.fmt is not None else formats.get(p.column))
    except (ValueError, TypeError) as e:
        raise FindingsError(f"findings placeholder {{{p.text}}}: cannot format {value!r} of column {p.column!r} "
                            f"({e})") from None


def _paired_data(rows: dict, name: str, p: Placeholder) -> tuple[str, tuple]:
    """("ppl", (window_nll, window_tokens)) or ("cos", (sentence_cos,)) of one run's row."""
    row = rows[name]
    n_seeds = row.get("n_seeds")
    if not _missing(n_seeds) and n_seeds > 1:
        seeds = [n for n, r in rows.items() if r.get("run_group") == name and n != name]
        raise FindingsError(f"findings placeholder {{{p.text}}}: {name!r} is the mean of {int(n_seeds)} seeds; a "
                            f"paired interval needs one run's windows: compare a seed's run ({', '.join(seeds)})")
    if p.domain is not None:
        nll, tokens = row.get(f"window_nll_{p.domain}"), row.get(f"window_tokens_{p.domain}")
        if isinstance(nll, str) and isinstance(tokens, str):
            return "ppl", (json.loads(nll), json.loads(tokens))
        stored = json.loads(row["eval_domains"]) if isinstance(row.get("eval_domains"), str) else []
        raise FindingsError(f"findings placeholder {{{p.text}}}: run {name!r} was not evaluated on domain "
                            f"{p.domain!r}; its domains: {', '.join(stored) or 'none ([eval] datasets not set)'}")
    nll, tokens = row.get("window_nll"), row.get("window_tokens")
    if isinstance(nll, str) and isinstance(tokens, str):
        return "ppl", (json.loads(nll), json.loads(tokens))
    if isinstance(row.get("sentence_cos"), str):
        return "cos", (json.loads(row["sentence_cos"]),)
    raise FindingsError(f"findings placeholder {{{p.text}}}: run {name!r} has no per-window NLL (window_nll) "
                        "or per-sentence cosines (sentence_cos), so no paired interval")


def paired(p: Placeholder, rows: dict) -> dict:
    """A paired interval of p.run against p.other on what both stored: stats.paired_delta_interval (Δppl %,
    per-window NLL) or stats.paired_mean_interval (Δ mean cosine, per sentence). Adds 'kind' and 'delta'."""
    (ka, a), (kb, b) = _paired_data(rows, p.run, p), _paired_data(rows, p.other, p)
    if ka != kb:
        raise FindingsError(f"findings placeholder {{{p.text}}}: run {p.run!r} stored {ka} data and {p.other!r} "
                            f"{kb} data: no paired interval")
    if ka == "ppl":
        if a[1] != b[1]:
            raise FindingsError(f"findings placeholder {{{p.text}}}: runs {p.run!r} and {p.other!r} were evaluated "
                                f"on different windows ({len(a[1])} vs {len(b[1])} windows, or other lengths): "
                                "no paired interval")
        d = stats.paired_delta_interval(a[0], b[0], a[1])
        return {**d, "kind": "ppl", "delta": d["delta_pct"]}
    if len(a[0]) != len(b[0]):
        raise FindingsError(f"findings placeholder {{{p.text}}}: runs {p.run!r} and {p.other!r} were evaluated on "
                            f"different sentences ({len(a[0])} vs {len(b[0])}): no paired interval")
    return {**stats.paired_mean_interval(a[0], b[0]), "kind": "cos"}


def _pair_values(p: Placeholder, rows: dict) -> tuple[float, float]:
    a, b = _value(rows[p.run], p.run, p.column, p), _value(rows[p.other], p.other, p.column, p)
    for name, v in ((p.run, a), (p.other, b)):
        if _missing(v) or isinstance(v, (str, bool)):
            raise FindingsError(f"findings placeholder {{{p.text}}}: run {name!r} has no number in column "
                                f"{p.column!r} ({v!r})")
    return a, b


def _render_compare(p: Placeholder, rows: dict, formats: dict) -> str:
    a, b = _pair_values(p, rows)
    if p.kind == "relative":
        if b == 0:
            raise FindingsError(f"findings placeholder {{{p.text}}}: {p.other!r} has {p.column} = 0, "
                                "so no relative change")
        return format((a / b - 1) * 100, p.fmt)
    fmt = formats.get(p.column)
    if fmt is not None and _format(a, fmt) == _format(b, fmt):  # equal at the precision the table shows
        return p.words[2]
    return p.words[2] if a == b else p.words[0] if a < b else p.words[1]


def render_placeholder(p: Placeholder, rows: dict, formats: dict) -> str:
    if p.kind == "value":
        return _render_value(p, rows, formats)
    if p.kind in ("compare", "relative"):
        return _render_compare(p, rows, formats)
    d = paired(p, rows)
    if p.kind == "verdict":
        return p.words[2] if not d["excludes_zero"] else p.words[0] if d["high"] < 0 else p.words[1]
    f, unit = (p.fmt or "+.1f", "%") if d["kind"] == "ppl" else (p.fmt or "+.4f", "")
    return f"{format(d['delta'], f)}{unit} [{format(d['low'], f)}, {format(d['high'], f)}]"


def render_leaderboard(p: Placeholder, frame) -> str:
    """{leaderboard} / {leaderboard@DOMAIN}: leaderboard.leaderboard_section of the report's rows."""
    from .leaderboard import leaderboard_section

    if frame is None:
        raise FindingsError(f"findings placeholder {{{p.text}}}: the leaderboard needs the report's rows")
    try:
        return leaderboard_section(frame, p.domain)
    except ValueError as e:
        raise FindingsError(f"findings placeholder {{{p.text}}}: {e}") from None


def render(template: str, rows: dict[str, dict], formats: dict[str, str] | None = None, frame=None) -> str:
    """Fill a template from {run name: report row}; `formats` holds each column's default format ("{:.3f}");
    `frame`: the report's rows (one per run and seed), which {leaderboard} ranks.

    Raises FindingsError naming the placeholder for an unknown run or column, or runs without shared windows.
    """
    formats = formats or {}
    out = []
    for p in parse(template):
        if isinstance(p, str):
            out.append(p)
            continue
        if p.kind == LEADERBOARD:
            out.append(render_leaderboard(p, frame))
            continue
        bad = [r for r in p.runs() if r not in rows]
        if bad:
            raise FindingsError(f"findings placeholder {{{p.text}}}: no row for run {bad[0]!r}; "
                                f"rows: {', '.join(rows)}")
        out.append(render_placeholder(p, rows, formats))
    return "".join(out)


def report_rows(df, summary) -> dict[str, dict]:
    """{name: row} for every run of a report, plus each seed group's summary row under the group's name."""
    rows = {r["run"]: r for r in df.to_dict("records")}
    for r in summary.to_dict("records"):
        rows.setdefault(r["run"], r)
    if "run_group" in df:  # a group of one seed run ("x-seed0"): its group name points at that run
        for group, g in df.groupby("run_group", sort=False):
            if len(g) == 1:
                rows.setdefault(group, rows[g["run"].iloc[0]])
    return rows


def findings_section(template: str, df, summary, formats: dict[str, str],
                     quoted: dict[str, dict[str, dict] | None] | None = None) -> str:
    """The report's Findings section ("" without a template).

    `quoted` holds the rows of each report the template quotes ({report: {run: row}}, see quoted_reports),
    None for a report whose CSV was not found. A paragraph or top-level bullet naming runs that have no row (failed,
    or not run yet) is replaced by a note saying so, the others are generated; a quoted report that is missing
    leaves the section unrendered with a note; any other mismatch (an unknown column, runs on different windows)
    raises FindingsError.
    """
    if not template.strip():
        return ""
    rows = report_rows(df, summary)
    quoted = quoted or {}
    lost = [r for r in quoted_reports(template) if quoted.get(r) is None]
    if lost:
        return (HEADER + f"\n\n**Not generated:** the template quotes report(s) {', '.join(lost)}, whose CSV is not "
                "beside this report; write (or copy) it there and regenerate.")
    for report, report_rows_ in quoted.items():
        rows.update({f"{report}/{run}": row for run, row in (report_rows_ or {}).items()})
    return HEADER + "\n\n" + "".join(_render_part(part, rows, formats, df)
                                     for part in template_parts(template)).strip()


def _render_part(part: str, rows: dict, formats: dict, frame=None) -> str:
    """One paragraph or bullet, rendered; one that names runs without a row (failed, or not run yet) says so in
    their place, and the rest of the section is still generated."""
    absent = sorted({r for p in parse(part) if isinstance(p, Placeholder) for r in p.runs() if r not in rows})
    if not absent:
        return render(part, rows, formats, frame)
    where = "this report" + (" or the report it quotes" if any(split_quoted(r)[0] for r in absent) else "")
    bullet = "- " if part.startswith("- ") else ""
    return (f"{bullet}**Not generated:** this {'item' if bullet else 'paragraph'} names run(s) {', '.join(absent)} "
            f"that have no row in {where} (failed, or not run yet); rerun the experiment to fill it in.\n")
