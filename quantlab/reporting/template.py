"""The findings template: its syntax, parsed into literal text and Placeholders, and checked against an
experiment's runs and domains before any model loads. reporting/findings.py fills it in from a report's rows.

A template is Markdown with placeholders in braces; every number and every comparison word comes
from the report's rows, so a rerun rewrites them. `{{` and `}}` are literal braces.

    {RUN:COLUMN}               a value of RUN's report row in the column's table format: {fp32:ppl} -> 30.641
    {RUN:COLUMN:FORMAT}        ... in a Python format spec: {awq-w4-g64:ppl:.2f} -> 36.19
    {A vs B}                   paired Δppl % of A against B on the same windows, with its 95% bootstrap
                               interval (reporting/stats.py): "-12.3% [-15.1, -9.8]"; for embedding rows
                               (per-sentence `sentence_cos`), the paired Δ mean cosine: "+0.0123 [+0.0101, +0.0145]"
    {A vs B:delta:FORMAT}      ... in FORMAT (default +.1f for Δppl %, +.4f for Δ cosine)
    {A vs B@DOMAIN}            the same on one domain of `[eval] datasets` (its window_nll_DOMAIN): {a vs b@pystdlib},
                               {a vs b@pystdlib:verdict}, {a vs b@pystdlib:delta:+.2f}; the domain follows the last @
    {A vs B:verdict}           "lower than" / "higher than" / "not distinguishable from": A's ppl (or mean cosine)
                               against B's, by whether that paired interval lies below 0, above 0, or includes it
    {A vs B:verdict:W1|W2|W3}  the same choice in your own words (lower | higher | not distinguishable)
    {A vs B:COLUMN}            a plain comparison of one column, without any interval (e.g. cos_mean):
                               "lower than" / "higher than" / "level with" (equal at the table's precision)
    {A vs B:COLUMN:W1|W2|W3}   ... in your own words
    {A vs B:COLUMN:FORMAT}     the relative change of COLUMN in %, (A / B - 1) * 100, without any interval:
                               {w4a8 vs w4:ppl:+.1f}% -> +4.3%
    {leaderboard}              every run of the report ranked, paired over the windows, Holm-adjusted, grouped by
                               letters, with the calibration noise of seed groups (reporting/leaderboard.py, as
                               `quantlab compare --all-pairs`): its table and findings paragraph, on its own line
    {leaderboard@DOMAIN}       ... on one domain of `[eval] datasets` (its window_nll_DOMAIN, ppl_DOMAIN)

RUN is a run name, a seed run ("gptq-w4-g64-seed1") or a seed group ("gptq-w4-g64": the mean over its
seeds, with `<metric>_std` and `n_seeds`), or REPORT/RUN: a run of another report, read from the REPORT.csv
beside this one (e.g. {smollm2_ptq/awq-w4-g64:ppl_delta_pct:+.0f}, {smollm2_ptq/awq-w3-g64 vs
smollm2_ptq/gptq-w3-g64:verdict}), so numbers quoted from another experiment are generated too; run names
cannot hold a '/'. COLUMN is any CSV column (ppl, ppl_delta_pct, kl_mean,
cos_mean, weight_mib, calibrate_s, ppl_pystdlib, ...) or an interval as "[low, high]": `ppl_ci` / `ppl_delta_ci`,
and per domain `ppl_DOMAIN_ci` / `ppl_DOMAIN_delta_ci`.
W1|W2|W3 are any three phrases, used when A's value is lower / higher / the same (or not distinguishable).
A placeholder sits on one line. Run names are checked when the experiment loads (before any model), columns
when the report is written; a run that has no row yet (failed, not run), or a quoted report without its CSV,
leaves the section with a note.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..util.checks import check_name

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}\n]*)\}|[{}]")
LEADERBOARD = "leaderboard"
VERDICT_WORDS = ("lower than", "higher than", "not distinguishable from")
COMPARE_WORDS = ("lower than", "higher than", "level with")


class FindingsError(ValueError):
    """A template that does not parse, or does not fit the rows."""


@dataclass(frozen=True)
class Placeholder:
    text: str  # as written, for messages
    run: str
    kind: str = "value"  # value | delta | verdict | compare | relative | leaderboard
    other: str | None = None  # B of "A vs B"
    column: str | None = None
    fmt: str | None = None
    words: tuple[str, str, str] | None = None  # lower, higher, same
    domain: str | None = None  # "A vs B@DOMAIN": the paired interval on that domain's windows

    def runs(self) -> list[str]:
        if self.kind == LEADERBOARD:  # every run of the report, none named
            return []
        return [self.run] + ([self.other] if self.other else [])


def _check_format(fmt: str, where: str) -> str:
    for probe in (1.5, "x"):
        try:
            format(probe, fmt)
            return fmt
        except (ValueError, TypeError):
            pass
    raise FindingsError(f"{where}: {fmt!r} is not a Python format spec (e.g. .2f, +.1f, .3g, ,.0f)")


def _words(arg: str, default: tuple, where: str) -> tuple[str, str, str]:
    if not arg:
        return default
    words = tuple(w.strip() for w in arg.split("|"))
    if len(words) != 3 or not all(words):
        raise FindingsError(f"{where}: custom words are three, LOWER|HIGHER|SAME, got {arg!r}")
    return words


def _placeholder(inner: str) -> Placeholder:
    where = f"findings placeholder {{{inner}}}"
    head, at, domain = inner.partition("@")
    if head.strip() == LEADERBOARD and " vs " not in inner:
        if at and not domain.strip():
            raise FindingsError(f"{where}: write {{leaderboard}} or {{leaderboard@DOMAIN}}")
        return Placeholder(inner, "", LEADERBOARD, domain=domain.strip() or None)
    if " vs " in inner:
        a, rest = inner.split(" vs ", 1)
        b, _, spec = rest.partition(":")
        field, _, arg = spec.partition(":")
        head, at, tail = b.rpartition("@")  # "OTHER@DOMAIN"; a run name may hold an @ too: the last one counts
        b, domain = (head, tail) if at else (tail, "")
        a, b, field, arg, domain = a.strip(), b.strip(), field.strip() or "delta", arg.strip(), domain.strip() or None
        if not a or not b or (at and not domain):
            raise FindingsError(f"{where}: write a comparison as {{RUN vs OTHER}} or {{RUN vs OTHER@DOMAIN}}")
        if domain and field not in ("delta", "verdict"):
            raise FindingsError(f"{where}: @{domain} goes with the paired interval (delta, verdict); for a column "
                                f"name the domain's own, e.g. ppl_{domain}")
        if field == "delta":
            return Placeholder(inner, a, "delta", b, fmt=_check_format(arg, where) if arg else None, domain=domain)
        if field == "verdict":
            return Placeholder(inner, a, "verdict", b, words=_words(arg, VERDICT_WORDS, where), domain=domain)
        if arg and "|" not in arg:
            return Placeholder(inner, a, "relative", b, column=field, fmt=_check_format(arg, where))
        return Placeholder(inner, a, "compare", b, column=field, words=_words(arg, COMPARE_WORDS, where))
    parts = [p.strip() for p in inner.split(":", 2)]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise FindingsError(f"{where}: expected {{RUN:COLUMN}}, {{RUN:COLUMN:FORMAT}} or {{RUN vs OTHER}}")
    fmt = _check_format(parts[2], where) if len(parts) == 3 and parts[2] else None
    return Placeholder(inner, parts[0], "value", column=parts[1], fmt=fmt)


def parse(template: str) -> list[str | Placeholder]:
    """Template text -> literal strings and Placeholders, in order.

    >>> parse("ppl {fp32:ppl:.1f} {{x}}")  # ['ppl ', Placeholder(run='fp32', column='ppl', fmt='.1f'), ' ', '{x}']
    """
    out, pos = [], 0
    for m in _TOKEN.finditer(template):
        out.append(template[pos:m.start()])
        token, pos = m.group(0), m.end()
        if token in ("{{", "}}"):
            out.append(token[0])
        elif m.group(1) is None:
            line = template.count("\n", 0, m.start()) + 1
            raise FindingsError(f"findings line {line}: a lone {token!r} (write {token * 2} for a literal brace; "
                                "placeholders sit on one line)")
        else:
            out.append(_placeholder(m.group(1)))
    out.append(template[pos:])
    return [p for p in out if p != ""]


def split_quoted(run: str) -> tuple[str | None, str]:
    """("smollm2_ptq", "awq-w4-g64") of a quoted "smollm2_ptq/awq-w4-g64"; (None, run) of a run of this report."""
    report, slash, name = run.partition("/")
    return (report, name) if slash else (None, run)


def quoted_reports(template: str) -> list[str]:
    """The other reports a template quotes (REPORT of its REPORT/RUN names), in order of first use."""
    out = []
    for p in parse(template):
        if isinstance(p, Placeholder):
            out += [r for r in (split_quoted(run)[0] for run in p.runs()) if r and r not in out]
    return out


def check_runs(template: str, known, where: str = "findings") -> None:
    """Raise unless every run a template names is in `known` (run names and seed-group names).

    A quoted REPORT/RUN is checked for its form only (two file-name-safe parts, see core.checks.check_name):
    the other report's rows are read when this report is written.
    """
    known = set(known)
    for p in parse(template):
        if not isinstance(p, Placeholder):
            continue
        for run in p.runs():
            report, name = split_quoted(run)
            if report is None:
                if run not in known:
                    raise FindingsError(f"{where}: placeholder {{{p.text}}} names unknown run {run!r}; "
                                        f"known: {', '.join(sorted(known))}")
                continue
            try:  # both parts are file-name safe: REPORT names <REPORT>.csv beside this report
                check_name("quoted report", report), check_name("quoted run", name)
            except ValueError as e:
                raise FindingsError(f"{where}: placeholder {{{p.text}}} quotes {run!r} ({e}); a run of "
                                    "another report is written REPORT/RUN, e.g. smollm2_ptq/awq-w4-g64") from None


def check_domains(template: str, known, where: str = "findings") -> None:
    """Raise unless every @DOMAIN of a template is one of `known` (the domain labels of [eval] datasets)."""
    known = list(known)
    for p in parse(template):
        if isinstance(p, Placeholder) and p.domain is not None and p.domain not in known:
            raise FindingsError(f"{where}: placeholder {{{p.text}}} names unknown domain {p.domain!r}; known: "
                                f"{', '.join(known) or 'none (set [eval] datasets to evaluate several domains)'}")


def template_parts(template: str) -> list[str]:
    """The template cut where a paragraph or a top-level bullet ("- ...") starts; each keeps its own line ends."""
    parts: list[str] = []
    for line in template.splitlines(keepends=True):
        starts = not parts or line.startswith("- ") or not line.strip() or not parts[-1].strip()
        if starts:
            parts.append(line)
        else:
            parts[-1] += line
    return parts
