"""Findings templates: placeholders filled from report rows, verdicts that follow the paired interval."""
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from quantlab.cli import main
from quantlab.reporting import stats
from quantlab.reporting.findings import (
    FindingsError,
    Placeholder,
    check_runs,
    findings_section,
    parse,
    quoted_reports,
    render,
    report_rows,
)
from quantlab.reporting.regenerate import regenerate_report
from quantlab.reporting.report import TABLE_COLUMNS, add_intervals, add_ratios, summarize_seeds
from quantlab.runs import runner
from quantlab.runs.experiment import load_experiment, parse_experiment

REPO = Path(__file__).resolve().parents[1]
FORMATS = {c: f for c, _, f in TABLE_COLUMNS}
BASE_NLL = [20.0, 30.0, 25.0, 35.0, 28.0, 22.0]
TOKENS = [10] * 6


def _row(run, nll=None, tokens=TOKENS, method="rtn", **extra):
    row = {"run": run, "method": method, "weight_bytes": 100, **extra}
    if nll is not None:
        row.update(window_nll=json.dumps(nll), window_tokens=json.dumps(tokens),
                   ppl=math.exp(sum(nll) / sum(tokens)), eval_windows=len(nll))
    return row


def _shifted(per_token: float) -> list[float]:
    """Every window's NLL moved by the same per-token amount: Δppl % is exp(per_token) - 1 in every resample."""
    return [n + per_token * t for n, t in zip(BASE_NLL, TOKENS)]


def _rows(extra_rows=()) -> dict:
    rows = [_row("fp32", BASE_NLL, method="none", weight_bytes=400), _row("minus10", _shifted(math.log(0.9))),
            _row("plus10", _shifted(math.log(1.1))),
            _row("mixed", [n + d for n, d in zip(BASE_NLL, [1, -1, 1, -1, 1, -1])]), *extra_rows]
    df = add_intervals(add_ratios(pd.DataFrame(rows)))
    return report_rows(df, summarize_seeds(df)[0])


def test_parse_forms_and_literal_braces():
    parts = parse("a {fp32:ppl:.1f} {x vs y} {x vs y:verdict:up|down|same} {x vs y:cos_mean} {x vs y:ppl:+.1f} {{z}}")
    ph = [p for p in parts if isinstance(p, Placeholder)]
    assert [(p.kind, p.run, p.other, p.column, p.fmt) for p in ph] == [
        ("value", "fp32", None, "ppl", ".1f"), ("delta", "x", "y", None, None), ("verdict", "x", "y", None, None),
        ("compare", "x", "y", "cos_mean", None), ("relative", "x", "y", "ppl", "+.1f")]
    assert ph[2].words == ("up", "down", "same") and ph[3].words == ("lower than", "higher than", "level with")
    assert "".join(p if isinstance(p, str) else "#" for p in parts) == "a # # # # # {z}"


@pytest.mark.parametrize("template,match", [
    ("{fp32}", r"expected \{RUN:COLUMN\}"),
    ("a { b", r"line 1: a lone '\{' \(write \{\{"),
    ("ok\nb }", r"line 2: a lone '\}'"),
    ("{fp32:ppl\n}", "placeholders sit on one line"),
    ("{fp32:ppl:.2q}", r"'\.2q' is not a Python format spec"),
    ("{a vs b:verdict:x|y}", "custom words are three, LOWER|HIGHER|SAME"),
    ("{a vs b:delta:zz}", r"'zz' is not a Python format spec"),
    ("{ vs b}", r"write a comparison as \{RUN vs OTHER\}"),
])
def test_parse_errors(template, match):
    with pytest.raises(FindingsError, match=match):
        parse(template)


def test_values_in_table_or_given_formats():
    """Reference: the values typed in by hand, formatted by hand."""
    rows = {"fp32": {"run": "fp32", "ppl": 30.64123, "eval_windows": 8.0, "kl_mean": float("nan"),
                     "scheme": "float32", "ppl_ci_low": 27.204, "ppl_ci_high": 34.106},
            "w4": {"run": "w4", "ppl": 33.705353, "weight_mib": 163.46, "train_tokens": 8192.0, "cos_mean": 0.9,
                   "ppl_delta_ci_low": 9.83, "ppl_delta_ci_high": 16.44}}
    text = ("{fp32:ppl} {fp32:ppl:.1f} {fp32:eval_windows} {fp32:kl_mean} {fp32:scheme} {w4:weight_mib} "
            "{w4:train_tokens:,.0f} {fp32:ppl_ci} {w4:ppl_delta_ci:+.1f} {w4 vs fp32:ppl:+.2f}% {{x}}")
    assert render(text, rows, FORMATS) == (
        "30.641 30.6 8 – float32 163.5 8,192 [27.20, 34.11] [+9.8, +16.4] +10.00% {x}")


def test_plain_comparisons_words_and_precision():
    rows = {"a": {"cos_mean": 0.98, "ppl": 10.0}, "b": {"cos_mean": 0.96, "ppl": 10.0004},
            "c": {"cos_mean": 0.980001, "ppl": 12.0}}
    assert render("{a vs b:cos_mean} {b vs a:cos_mean} {a vs c:cos_mean}", rows, FORMATS) == (
        "higher than lower than level with")  # 0.98000 == 0.98000 at the table's .5f
    assert render("{a vs b:ppl:beats|trails|ties with} {c vs a:ppl:beats|trails|ties with}", rows, FORMATS) == (
        "ties with trails")  # 10.000 == 10.000 at .3f
    assert render("{a vs b:cos_mean:below|above|level}", rows, {}) == "above"


def test_paired_delta_and_verdict_follow_the_interval():
    rows = _rows()
    # every resample of a constant per-token shift gives exactly that Δ: the interval is the point (up to rounding)
    assert render("{minus10 vs fp32} / {plus10 vs fp32:delta:+.2f}", rows) == (
        "-10.0% [-10.0, -10.0] / +10.00% [+10.00, +10.00]")
    assert render("{minus10 vs fp32:verdict}|{plus10 vs fp32:verdict}|{mixed vs fp32:verdict}", rows) == (
        "lower than|higher than|not distinguishable from")
    ref = stats.paired_delta_interval(json.loads(rows["mixed"]["window_nll"]), BASE_NLL, TOKENS)
    assert ref["low"] < 0 < ref["high"] and not ref["excludes_zero"]  # the mixed run's interval does include 0
    assert render("{mixed vs fp32:delta:.6f}", rows) == f"{ref['delta_pct']:.6f}% [{ref['low']:.6f}, {ref['high']:.6f}]"
    assert render("{plus10 vs minus10:verdict:ahead|behind|level}", rows) == "behind"
    # the verdict against the baseline agrees with the report's own ✓ column
    for name in ("minus10", "plus10", "mixed"):
        said = render(f"{{{name} vs fp32:verdict}}", rows) != "not distinguishable from"
        assert said == bool(rows[name]["ppl_delta_excludes_zero"])


def test_paired_comparison_errors_name_the_runs():
    rows = _rows([_row("short", BASE_NLL[:5], tokens=TOKENS[:5]), _row("nowin", ppl=31.0)])
    with pytest.raises(FindingsError, match="runs 'short' and 'fp32' were evaluated on different windows"):
        render("{short vs fp32}", rows)
    with pytest.raises(FindingsError, match=r"run 'nowin' has no per-window NLL \(window_nll\) or per-sentence"):
        render("{fp32 vs nowin:verdict}", rows)


def test_embedding_rows_pair_per_sentence_cosines():
    base = [0.990, 0.950, 0.970, 0.900, 0.985]
    rows = {"fp32": {"run": "fp32", "sentence_cos": json.dumps([1.0] * 5)},
            "rtn": {"run": "rtn", "sentence_cos": json.dumps(base)},
            "gptq": {"run": "gptq", "sentence_cos": json.dumps([c + 0.002 for c in base])},
            "noisy": {"run": "noisy", "sentence_cos": json.dumps([c + d for c, d in zip(base, [.01, -.01] * 2 + [0])])},
            "ppl": _row("ppl", BASE_NLL)}
    # a constant per-sentence gain of 0.002 is its own interval
    assert render("{gptq vs rtn}", rows) == "+0.0020 [+0.0020, +0.0020]"
    assert render("{gptq vs rtn:delta:+.3f}|{gptq vs rtn:verdict}|{rtn vs gptq:verdict}", rows) == (
        "+0.002 [+0.002, +0.002]|higher than|lower than")
    ref = stats.paired_mean_interval(json.loads(rows["noisy"]["sentence_cos"]), base)
    assert render("{noisy vs rtn:delta:.6f}", rows) == f"{ref['delta']:.6f} [{ref['low']:.6f}, {ref['high']:.6f}]"
    assert render("{noisy vs rtn:verdict}", rows) == "not distinguishable from" and not ref["excludes_zero"]
    with pytest.raises(FindingsError, match="run 'rtn' stored cos data and 'ppl' ppl data"):
        render("{rtn vs ppl}", rows)
    rows["short"] = {"run": "short", "sentence_cos": json.dumps(base[:4])}
    with pytest.raises(FindingsError, match="different sentences \\(4 vs 5\\)"):
        render("{short vs rtn}", rows)


def test_unknown_column_and_run_at_report_time():
    rows = _rows()
    with pytest.raises(FindingsError, match=r"\{fp32:pplx\}: run 'fp32' has no column 'pplx'; known: .*ppl, "):
        render("{fp32:pplx}", rows)
    with pytest.raises(FindingsError, match=r"no row for run 'gptq'; rows: fp32, minus10, plus10, mixed"):
        render("{gptq vs fp32}", rows)


def test_seed_groups_are_addressable_but_not_paired():
    seeds = [_row("g-seed0", _shifted(0.05), run_group="g", seed=0), _row("g-seed1", _shifted(0.15), run_group="g",
                                                                           seed=1)]
    rows = _rows(seeds)
    ppls = [math.exp(sum(_shifted(d)) / sum(TOKENS)) for d in (0.05, 0.15)]
    mean, std = stats.mean_std(ppls)
    assert render("{g:ppl:.6f} ± {g:ppl_std:.6f} ({g:n_seeds} seeds)", rows) == f"{mean:.6f} ± {std:.6f} (2 seeds)"
    assert render("{g-seed1 vs g-seed0:delta:.3f}", rows) == "10.517% [10.517, 10.517]"  # exp(0.1) - 1
    with pytest.raises(FindingsError, match=r"'g' is the mean of 2 seeds; .*compare a seed's run \(g-seed0, g-seed1\)"):
        render("{g vs fp32}", rows)


def test_section_notes_runs_without_rows_and_generates_the_rest():
    """A partial experiment (a run failed, or is not run yet): each paragraph or bullet naming a run without a row is
    replaced by a note naming it; the others are generated as usual."""
    df = add_intervals(add_ratios(pd.DataFrame([_row("fp32", BASE_NLL, method="none")])))
    text = findings_section("{fp32:ppl} vs {gone:ppl}", df, df, FORMATS)
    assert text.startswith("## Findings") and "**Not generated:** this paragraph names run(s) gone" in text
    template = ("Intro {fp32:ppl:.2f}.\n- first {fp32:ppl:.1f}\n  continued\n- second {gone:ppl} and {lost:ppl}\n"
                "  still second\n\nClosing {fp32:eval_windows}.")
    text = findings_section(template, df, df, FORMATS)
    ppl = df["ppl"].iloc[0]
    body = text.split("\n\n", 2)[2]  # after the header and its note
    assert body == (f"Intro {ppl:.2f}.\n- first {ppl:.1f}\n  continued\n- **Not generated:** this item names run(s) "
                    f"gone, lost that have no row in this report (failed, or not run yet); rerun the experiment to "
                    f"fill it in.\n\nClosing {df['eval_windows'].iloc[0]}.")
    assert findings_section("  ", df, df, FORMATS) == ""


def test_quoted_runs_come_from_the_other_report_rows():
    """REPORT/RUN names a row of another report: its values, and paired intervals between two of its runs, come
    from its rows exactly as they do in that report; pairing across reports on other windows is refused."""
    df = add_intervals(add_ratios(pd.DataFrame([_row("fp32", BASE_NLL, method="none")])))
    other = _rows()
    template = "{other/minus10:ppl_delta_pct:+.2f}% {other/minus10 vs other/fp32} {other/plus10 vs other/fp32:verdict}"
    text = findings_section(template, df, df, FORMATS, {"other": other})
    assert text.endswith("-10.00% -10.0% [-10.0, -10.0] higher than")
    assert findings_section("{other/minus10 vs fp32:delta:.3f}", df, df, FORMATS, {"other": other}).endswith(
        "-10.000% [-10.000, -10.000]")  # the same windows: a quoted run pairs with one of this report
    shorter = add_intervals(add_ratios(pd.DataFrame([_row("fp32", BASE_NLL[:4], TOKENS[:4], method="none")])))
    with pytest.raises(FindingsError, match=r"'other/minus10' and 'fp32' were evaluated on different windows"):
        findings_section("{other/minus10 vs fp32}", shorter, shorter, FORMATS, {"other": other})
    lost = findings_section("{fp32:ppl} {other/minus10:ppl}", df, df, FORMATS, {"other": None})
    assert "**Not generated:** the template quotes report(s) other, whose CSV is not beside this report" in lost
    gone = findings_section("{other/gone:ppl}", df, df, FORMATS, {"other": other})
    assert "names run(s) other/gone that have no row in this report or the report it quotes" in gone
    with pytest.raises(FindingsError, match=r"quotes 'a/b/c' \(quoted run 'b/c' contains '/'.*\); a run of another "
                                         r"report is written REPORT/RUN"):
        check_runs("{a/b/c:ppl}", ["fp32"])
    with pytest.raises(FindingsError, match=r"quotes '\.\./x' \(quoted report '\.\.'"):
        check_runs("{../x:ppl}", ["fp32"])
    with pytest.raises(FindingsError, match=r"quotes '/b'"):
        check_runs("{fp32 vs /b}", ["fp32"])
    check_runs("{x/fp32 vs fp32} {y/z:ppl}", ["fp32"])  # quoted runs are checked when the report is written
    assert quoted_reports("{x/a vs b} {y/c:ppl} {x/d:ppl} {b:ppl}") == ["x", "y"]


def test_quoted_report_regenerates_and_follows_its_source(tmp_path):
    """The committed gemma3_ptq report quotes smollm2_ptq and smollm2_qat rows: it regenerates byte for byte from
    their committed CSVs, a changed quoted row changes the quoted number, and without the CSVs it says so."""
    for f in ("gemma3_ptq.results.jsonl", "gemma3_ptq.experiment.json", "smollm2_ptq.csv", "smollm2_qat.csv"):
        shutil.copy(REPO / "reports" / f, tmp_path)
    committed = (REPO / "reports" / "gemma3_ptq.md").read_text()
    regenerate_report(tmp_path / "gemma3_ptq.results.jsonl", tmp_path / "out")
    assert (tmp_path / "out" / "gemma3_ptq.md").read_text() == committed  # quoted CSVs found beside the results
    quoted = pd.read_csv(tmp_path / "smollm2_qat.csv")
    gptq = quoted.set_index("run").loc["gptq-w3-g64", "ppl_delta_pct"]
    assert f"against GPTQ's\n  {gptq:+.0f}%:" in committed
    quoted.loc[quoted["run"] == "gptq-w3-g64", "ppl_delta_pct"] = 555.0
    quoted.to_csv(tmp_path / "out" / "smollm2_qat.csv", index=False)  # beside the new report: found first
    regenerate_report(tmp_path / "gemma3_ptq.results.jsonl", tmp_path / "out")
    md = (tmp_path / "out" / "gemma3_ptq.md").read_text()
    assert "against GPTQ's\n  +555%:" in md and md.replace("+555%", f"{gptq:+.0f}%") == committed
    for f in ("smollm2_ptq.csv", "smollm2_qat.csv"):
        (tmp_path / f).unlink()
        (tmp_path / "out" / f).unlink(missing_ok=True)
    regenerate_report(tmp_path / "gemma3_ptq.results.jsonl", tmp_path / "out")
    assert ("the template quotes report(s) smollm2_ptq, smollm2_qat, whose CSV is not beside this report"
            in (tmp_path / "out" / "gemma3_ptq.md").read_text())


def _data(model_dir, findings):
    return {"name": "tiny_findings", "model": str(model_dir), "device": "cpu", "findings": findings,
            "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 4, "latency": False},
            "seeds": [0, 1], "run": [{"name": "fp32", "method": "none"},
                                     {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32}]}


def test_experiment_checks_run_names_at_load(tiny_model_dir, tmp_path, monkeypatch):
    ok = parse_experiment(_data(tiny_model_dir, "{gptq:ppl} {gptq-seed1 vs fp32:verdict} {fp32:ppl}"))
    assert ok.findings.startswith("{gptq:ppl}")  # the seed group and its seed runs are known names
    assert dataclasses.replace(ok, runs=ok.runs[:1]).findings == ok.findings  # a subset still builds (and reports)
    with pytest.raises(ValueError, match=r"findings: placeholder \{awq vs fp32\} names unknown run 'awq'; "
                                         r"known: fp32, gptq, gptq-seed0, gptq-seed1"):
        parse_experiment(_data(tiny_model_dir, "{awq vs fp32}"))
    with pytest.raises(ValueError, match="findings must be a string"):
        parse_experiment(_data(tiny_model_dir, 3))
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nmodel = "smollm2-135m"\nfindings = "GPTQ {gtpq:ppl:.2f}"\n'
                   '[[run]]\nname = "fp32"\nmethod = "none"\n')
    with pytest.raises(ValueError, match="names unknown run 'gtpq'; known: fp32"):
        load_experiment(bad)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(runner, "EvalContext", no_model)
    assert main(["run", str(bad), "--reports-dir", str(tmp_path)]) == 1  # fails before any model loads


@pytest.mark.parametrize("path", sorted((REPO / "experiments").glob("*.toml")), ids=lambda p: p.stem)
def test_committed_experiments_load_and_their_reports_carry_the_template(path):
    """Every experiment file validates (its findings name real runs), and the committed report was regenerated
    from the current template (the sidecar holds it; test_report checks the Markdown byte for byte)."""
    exp = load_experiment(path)
    assert "**Findings" not in exp.description  # numbers live in the template, not in the hand-typed setup text
    sidecar = REPO / "reports" / f"{exp.name}.experiment.json"
    if sidecar.exists():
        meta = json.loads(sidecar.read_text())
        assert meta.get("findings", "") == exp.findings and meta["description"] == exp.description
