"""Reports from stored rows: intervals, best-value marks, plots, byte-identical regeneration, compare."""
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from quantlab.cli import main
from quantlab.reporting import plots, stats
from quantlab.reporting.compare import compare_reports
from quantlab.reporting.regenerate import regenerate_report
from quantlab.runs import runner
from quantlab.runs.experiment import load_experiment, parse_experiment

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUNS = [{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
        {"name": "w4g32", "method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
        {"name": "w3g32", "method": "rtn", "bits": 3, "group_size": 32, "symmetric": False}]


FINDINGS = ("w3 g32 is {w3g32 vs w4g32:verdict} w4 g32 ({w3g32 vs w4g32}); "
            "w8 ppl {w8:ppl:.2f}, {w8:weight_mib:.3f} MiB.")


def _experiment(model_dir, name="tiny_report", runs=RUNS, **top):
    eval_table = {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 6, "kl_windows": 2,
                  "prefill_tokens": 8, "decode_tokens": 2, "latency_repeats": 1}
    return parse_experiment({"name": name, "model": str(model_dir), "device": "cpu", "description": "Tiny *test*.",
                             "eval": eval_table, "run": runs, **top})


@pytest.fixture(scope="module")
def tiny_reports(tiny_model_dir, tmp_path_factory):
    """One run of the tiny experiment (with a findings template) through the runner; returns its reports folder."""
    out = tmp_path_factory.mktemp("reports")
    runner.run_experiment(_experiment(tiny_model_dir, findings=FINDINGS), out, progress=False)
    return out


def _png_ok(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC) and data.endswith(b"IEND\xaeB`\x82")


def test_rows_carry_window_nll_and_the_csv_intervals(tiny_reports):
    rows = [json.loads(line) for line in (tiny_reports / "tiny_report.results.jsonl").read_text().splitlines()]
    nll, tokens = json.loads(rows[1]["window_nll"]), json.loads(rows[1]["window_tokens"])
    assert len(nll) == rows[1]["eval_windows"] == 6 and tokens == [31] * 6
    assert sum(nll) / sum(tokens) == pytest.approx(rows[1]["nll_mean"], rel=1e-12)  # the same NLL, split by window
    assert {r["experiment"] for r in rows} == {"tiny_report"} and rows[2]["run_group"] == "w4g32"
    # each CSV row's ppl and intervals are those of its own stored windows, paired with the baseline's
    # (reference: reporting.stats on the stored lists, itself hand-checked in test_stats.py)
    df = pd.read_csv(tiny_reports / "tiny_report.csv")
    assert list(df["run"]) == ["fp32", "w8", "w4g32", "w3g32"]
    base_nll = json.loads(df.loc[0, "window_nll"])
    for _, row in df.iterrows():
        nll, tokens = json.loads(row["window_nll"]), json.loads(row["window_tokens"])
        assert row["ppl"] == pytest.approx(math.exp(sum(nll) / sum(tokens)), rel=1e-9), row["run"]
        assert (row["ppl_ci_low"], row["ppl_ci_high"]) == pytest.approx(stats.ppl_interval(nll, tokens), rel=1e-12)
        paired = stats.paired_delta_interval(nll, base_nll, tokens)
        assert row["ppl_delta_pct"] == pytest.approx(paired["delta_pct"], rel=1e-9, abs=1e-9), row["run"]
        assert (row["ppl_delta_ci_low"], row["ppl_delta_ci_high"]) == pytest.approx((paired["low"], paired["high"]),
                                                                                    rel=1e-12, abs=1e-12)


def test_markdown_states_protocol_marks_best_embeds_plots(tiny_reports):
    md = (tiny_reports / "tiny_report.md").read_text()
    assert "Tiny *test*." in md and "6 non-overlapping windows of seq_len 32" in md and "BOS: none" in md
    assert "**Intervals.** 95% percentile bootstrap over the 6 evaluation windows" in md
    assert "| ppl 95% CI |" in md and "| Δppl % 95% CI (paired) |" in md
    assert "![perplexity vs weight size](tiny_report.ppl_vs_weight_bytes.png)" in md
    assert "![perplexity vs decode latency](tiny_report.ppl_vs_decode_latency.png)" in md
    assert md.rstrip().splitlines()[-1].startswith("**Environment.**") and "git_sha" in md and "torchao" in md
    df = pd.read_csv(tiny_reports / "tiny_report.csv")
    table = [line for line in md.splitlines() if line.startswith("| w3g32 |") or line.startswith("| w8 |")]
    smallest = df.loc[df["method"] != "none", "weight_ratio"].min()  # bold: the best quantized run's value
    assert df.loc[df["run"] == "w3g32", "weight_ratio"].item() == smallest
    assert f"**{smallest:.3f}**" in table[1] and f"{df['weight_ratio'].iloc[1]:.3f}" in table[0]
    assert "**" not in md.split("| fp32 |")[1].splitlines()[0]  # the baseline is never marked


def test_plots_have_one_point_per_run_and_are_pngs(tiny_reports):
    for slug in ("ppl_vs_weight_bytes", "ppl_vs_decode_latency"):
        assert _png_ok(tiny_reports / f"tiny_report.{slug}.png")
        points = pd.read_csv(tiny_reports / f"tiny_report.{slug}.csv")
        assert list(points["run"]) == ["fp32", "w8", "w4g32", "w3g32"]
        x = points.columns[points.columns.isin(["weight_bytes", "decode_ms_per_token_p50"])].item()
        # the point with the least x and the one with the least ppl are never dominated (unique minima here)
        assert points["pareto"].iloc[points[x].idxmin()] and points["pareto"].iloc[points["ppl"].idxmin()], slug
    points = pd.read_csv(tiny_reports / "tiny_report.ppl_vs_weight_bytes.csv")
    assert points["pareto"].tolist() == plots.pareto_front(points["weight_bytes"], points["ppl"])


def test_regenerated_report_is_byte_identical(tiny_reports, tmp_path):
    out = tmp_path / "again"
    assert main(["report", str(tiny_reports / "tiny_report.results.jsonl"), "--out", str(out)]) == 0
    names = sorted(p.name for p in tiny_reports.iterdir() if p.suffix != ".jsonl")
    assert sorted(p.name for p in out.iterdir()) == names and len(names) == 7  # csv, md, sidecar, 2 x (png, csv)
    for name in names:
        assert (out / name).read_bytes() == (tiny_reports / name).read_bytes(), name
    assert json.loads((out / "tiny_report.experiment.json").read_text())["findings"] == FINDINGS
    md = (out / "tiny_report.md").read_text()
    assert "## Findings" in md and "{" not in md.split("## Findings")[1].split("![")[0]  # every placeholder filled


@pytest.mark.parametrize("planted", ["tiny_report.md", "tiny_report.ppl_vs_weight_bytes.png", "tiny_report.csv"])
def test_a_link_planted_at_a_report_file_is_refused_and_its_target_untouched(tiny_reports, tmp_path, capsys, planted):
    """`quantlab report` writes nothing through a symlink in the output folder (it would write outside it)."""
    out, outside = tmp_path / "again", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("keep me")
    (out / planted).symlink_to(outside)
    assert main(["report", str(tiny_reports / "tiny_report.results.jsonl"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"report file {out / planted} is a symlink" in err and err.count("\n") == 1
    assert outside.read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == [planted]


def test_findings_section_from_the_rows(tiny_reports):
    """The section sits after the table, before the protocol, and says what the CSV's numbers say."""
    md = (tiny_reports / "tiny_report.md").read_text()
    df = pd.read_csv(tiny_reports / "tiny_report.csv").set_index("run")
    assert md.index("| w3g32 |") < md.index("## Findings") < md.index("**Protocol.**") < md.index("**Environment.**")
    assert "*Generated from the rows above by the experiment's `findings` template" in md
    assert f"w8 ppl {df.loc['w8', 'ppl']:.2f}, {df.loc['w8', 'weight_mib']:.3f} MiB." in md
    w3, w4 = (json.loads(df.loc[r, "window_nll"]) for r in ("w3g32", "w4g32"))  # reference: stats on the CSV
    d = stats.paired_delta_interval(w3, w4, json.loads(df.loc["w4g32", "window_tokens"]))
    verdict = ("not distinguishable from" if not d["excludes_zero"]
               else "lower than" if d["high"] < 0 else "higher than")
    assert f"w3 g32 is {verdict} w4 g32 ({d['delta_pct']:+.1f}% [{d['low']:+.1f}, {d['high']:+.1f}])" in md


def test_report_with_an_edited_template(tiny_reports, tiny_model_dir, tmp_path):
    """`quantlab report --experiment FILE` takes the file's description and findings (round-tripped through
    tomlwrite) instead of the sidecar's; a template that does not fit the rows fails before writing anything."""
    from quantlab.runs.tomlwrite import experiment_toml

    shutil.copy(tiny_reports / "tiny_report.results.jsonl", tmp_path)
    shutil.copy(tiny_reports / "tiny_report.experiment.json", tmp_path)
    exp = _experiment(tiny_model_dir, findings="Edited: {w4g32:bits_per_weight:.3f} bits.\n\n{{literal}}")
    toml = tmp_path / "tiny_report.toml"
    toml.write_text(experiment_toml(exp))
    assert load_experiment(toml) == exp  # the template round-trips exactly
    assert main(["report", str(tmp_path / "tiny_report.results.jsonl"), "--experiment", str(toml)]) == 0
    df = pd.read_csv(tmp_path / "tiny_report.csv").set_index("run")
    md = (tmp_path / "tiny_report.md").read_text()
    assert f"Edited: {df.loc['w4g32', 'bits_per_weight']:.3f} bits.\n\n{{literal}}" in md and "w8 ppl" not in md
    assert json.loads((tmp_path / "tiny_report.experiment.json").read_text())["findings"] == exp.findings
    before = md
    with pytest.raises(ValueError, match=r"run 'w8' has no column 'pplx'; known: .*ppl"):
        regenerate_report(tmp_path / "tiny_report.results.jsonl", findings="{w8:pplx}")
    assert (tmp_path / "tiny_report.md").read_text() == before


def test_regeneration_uses_the_sidecar_run_order_not_stale_rows(tiny_model_dir, tmp_path):
    """A changed run leaves its old row in the results file; the sidecar keeps it out of the report."""
    runs = RUNS[:2]
    runner.run_experiment(_experiment(tiny_model_dir, "stale", runs), tmp_path, progress=False)
    changed = [runs[0], {"name": "w8", "method": "rtn", "bits": 6}]
    runner.run_experiment(_experiment(tiny_model_dir, "stale", changed), tmp_path, progress=False)
    own = (tmp_path / "stale.md").read_bytes()
    df = regenerate_report(tmp_path / "stale.results.jsonl", tmp_path / "again")
    assert list(df["run"]) == ["fp32", "w8"] and df["bits"].iloc[1] == 6
    assert (tmp_path / "again" / "stale.md").read_bytes() == own


@pytest.mark.parametrize("name", ["smollm2_quickstart", "smollm2_ptq", "minilm_ptq", "smollm2_seeds", "smollm2_qat",
                                  "smollm2_mixed", "smollm2_lora", "minilm_methods2025",
                                  "smollm2_methods2025", "smollm2_rotation", "smollm2_w4a4_2025"])
@pytest.mark.parametrize("sidecar", [True, False])
def test_committed_results_regenerate(name, sidecar, tmp_path):
    """Every committed results file regenerates, with or without its sidecar; rows written before
    window NLL existed make a report without intervals, and say so. With the sidecar, the committed
    Markdown comes back byte for byte: its findings are what the current rows say."""
    results = REPO / "reports" / f"{name}.results.jsonl"
    assert results.exists(), f"{results.name} is listed here but not committed"
    shutil.copy(results, tmp_path)
    if sidecar:
        shutil.copy(REPO / "reports" / f"{name}.experiment.json", tmp_path)
    df = regenerate_report(tmp_path / results.name, tmp_path / "out")
    committed = pd.read_csv(REPO / "reports" / f"{name}.csv")
    if not sidecar:  # without the sidecar, rows come in results-file order (a rerun appends at the end)
        assert sorted(df["run"]) == sorted(committed["run"])
        df = df.set_index("run").loc[committed["run"]].reset_index()
    assert list(df["run"]) == list(committed["run"])
    metric = "ppl" if "ppl" in committed else "cos_mean"
    assert df[metric].tolist() == committed[metric].tolist()  # exact: the same stored numbers
    md = (tmp_path / "out" / f"{name}.md").read_text()
    if sidecar:
        assert json.loads((REPO / "reports" / f"{name}.experiment.json").read_text())["description"].strip() in md
        assert md == (REPO / "reports" / f"{name}.md").read_text()
    if metric == "cos_mean":
        assert "Intervals" not in md and not list((tmp_path / "out").glob("*.png"))
    elif "window_nll" in committed:
        assert "95% percentile bootstrap" in md and committed["ppl_ci_low"].notna().all()
    else:
        assert "no per-window NLL" in md and _png_ok(tmp_path / "out" / f"{name}.ppl_vs_weight_bytes.png")


def _write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_regenerate_bad_input(tiny_reports, tmp_path):
    rows = [json.loads(line) for line in (tiny_reports / "tiny_report.results.jsonl").read_text().splitlines()]
    with pytest.raises(ValueError, match=r"rows of experiment\(s\) 'tiny_report', not 'other'"):
        regenerate_report(_write_rows(tmp_path / "other.results.jsonl", rows))
    broken = [{k: v for k, v in r.items() if k != "weight_bytes"} for r in rows]
    with pytest.raises(ValueError, match=r"lacks column\(s\) weight_bytes; is this a quantlab results file"):
        regenerate_report(_write_rows(tmp_path / "tiny_report.results.jsonl", broken))
    with pytest.raises(ValueError, match=r"expected a <name>\.results\.jsonl"):
        regenerate_report(tiny_reports / "tiny_report.csv")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        regenerate_report(tmp_path / "missing.results.jsonl")
    _write_rows(tmp_path / "tiny_report.results.jsonl", rows[:2])
    shutil.copy(tiny_reports / "tiny_report.experiment.json", tmp_path)
    with pytest.raises(ValueError, match="sidecar lists run key"):
        regenerate_report(tmp_path / "tiny_report.results.jsonl")


def test_plotting_no_usable_rows_fails_without_writing(tmp_path):
    png = tmp_path / "p.png"
    with pytest.raises(ValueError, match="cannot plot ppl vs weight_bytes: no rows"):
        plots.plot_ppl_vs_weight_bytes(pd.DataFrame(), png)
    no_latency = pd.DataFrame({"run": ["a"], "ppl": [3.0], "weight_bytes": [10]})
    with pytest.raises(ValueError, match="1 row\\(s\\), none with both 'decode_ms_per_token_p50' and 'ppl'"):
        plots.plot_ppl_vs_decode_latency(no_latency, png)
    assert not list(tmp_path.iterdir())


def test_pareto_front_hand_checked():
    # (1,3) and (2,1) are optimal; (3,2) is beaten by (2,1); (2,2) too; equal points both stay on the front
    assert plots.pareto_front([1, 2, 3, 2], [3, 1, 2, 2]) == [True, True, False, False]
    assert plots.pareto_front([1, 1], [2, 2]) == [True, True]


def test_compare_two_reports(tiny_reports, tmp_path, capsys):
    a = tiny_reports / "tiny_report.csv"
    other = pd.read_csv(a)
    other["ppl"] *= 1.1
    other["seq_len"] = 64
    other.loc[other["run"] == "w8", "config"] = other.loc[other["run"] == "w8", "config"].str.replace('"bits": 8', '"bits": 7')
    other = other[other["run"] != "w3g32"]
    b = tmp_path / "b.csv"
    other.to_csv(b, index=False)
    df = compare_reports(a, b)
    assert list(df["run"]) == ["fp32", "w8", "w4g32"] and df.attrs["only_a"] == ["w3g32"]
    assert df["ppl_diff_pct"].tolist() == pytest.approx([10.0] * 3, abs=1e-9)
    assert df["weight_mib_diff"].tolist() == [0.0] * 3
    out = tmp_path / "diff.md"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    assert "| fp32 |" in out.read_text() and "Only in" in capsys.readouterr().out
    assert "**Protocols differ** (the numbers may not be comparable): seq_len 32 vs 64" in out.read_text()
    assert df.attrs["config_differs"] == ["w8"] and "**Same name, different config:** w8" in out.read_text()

    renamed = other.assign(run=["x", "y", "z"])
    renamed.to_csv(b, index=False)
    with pytest.raises(ValueError, match="no run name in common: .* has fp32, w8, w4g32, w3g32; .* has x, y, z"):
        compare_reports(a, b)
    with pytest.raises(ValueError, match=r"no column\(s\) ppl_typo; numeric columns: .*ppl"):
        compare_reports(a, a, metrics=["ppl_typo"])
    other[["run", "scheme"]].to_csv(b, index=False)
    with pytest.raises(ValueError, match="share none of the metric columns"):
        compare_reports(a, b)
    assert main(["compare", str(a), str(tmp_path / "nope.csv")]) == 1


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_real_model_intervals(tmp_path, wikitext_dir):
    """SmolLM2-135M, 6 x 256 test tokens: RTN w3 g64 (+~200% ppl) is resolved by the paired interval,
    w8 per-channel (±0.1%) is not; the unpaired spread of fp32 itself is several % wide."""
    exp = parse_experiment({
        "name": "real_ci", "model": "smollm2-135m", "device": "cpu",
        "eval": {"seq_len": 256, "max_windows": 6, "kl_windows": 0, "latency": False},
        "run": [{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
                {"name": "w3", "method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}]})
    runner.run_experiment(exp, tmp_path, data_dir=wikitext_dir, progress=False)
    df = pd.read_csv(tmp_path / "real_ci.csv").set_index("run")
    assert ((df["ppl_ci_low"] < df["ppl"]) & (df["ppl"] < df["ppl_ci_high"])).all()
    assert df.loc["fp32", "ppl_ci_high"] / df.loc["fp32", "ppl_ci_low"] > 1.03  # 6 windows: a wide interval
    assert df.loc["w3", "ppl_delta_ci_low"] > 50 and bool(df.loc["w3", "ppl_delta_excludes_zero"])
    assert abs(df.loc["w8", "ppl_delta_pct"]) < 1
    w8_width = df.loc["w8", "ppl_delta_ci_high"] - df.loc["w8", "ppl_delta_ci_low"]
    fp32_rel_width = (df.loc["fp32", "ppl_ci_high"] - df.loc["fp32", "ppl_ci_low"]) / df.loc["fp32", "ppl"] * 100
    assert w8_width < fp32_rel_width / 3  # pairing removes the shared window difficulty


def test_compare_pairs_ppl_over_the_stored_windows(tiny_reports, tmp_path):
    """B's w8 is worse by 0.1 nats on every token of every window: every resample gives Δ = e^0.1 − 1."""
    a = tiny_reports / "tiny_report.csv"
    other = pd.read_csv(a)
    i = other.index[other["run"] == "w8"][0]
    nll, tokens = json.loads(other.loc[i, "window_nll"]), json.loads(other.loc[i, "window_tokens"])
    other.loc[i, "window_nll"] = json.dumps([n + 0.1 * t for n, t in zip(nll, tokens)])
    b = tmp_path / "b.csv"
    other.to_csv(b, index=False)
    df = compare_reports(a, b, metrics=["ppl"]).set_index("run")
    expected = (math.exp(0.1) - 1) * 100
    assert df.loc["w8", "ppl_diff_ci_low"] == pytest.approx(expected, rel=1e-9)
    assert df.loc["w8", "ppl_diff_ci_high"] == pytest.approx(expected, rel=1e-9)
    assert df.loc["fp32", "ppl_diff_ci_low"] == 0 and df.loc["fp32", "ppl_diff_ci_high"] == 0
    other["seq_len"] = 64  # another protocol: the windows are not the same ones, so no pairing
    other.to_csv(b, index=False)
    assert "ppl_diff_ci_low" not in compare_reports(a, b, metrics=["ppl"])


def test_compare_ignores_fields_added_later_with_their_default():
    """An old report's config lacks `overrides`; that alone is not a different config."""
    from quantlab.reporting.compare import _config_key

    old = '{"bits": 4, "group_size": 64, "method": "rtn", "name": "w4", "symmetric": false}'
    new = '{"bits": 4, "group_size": 64, "method": "rtn", "name": "w4", "overrides": [], "symmetric": false}'
    assert _config_key(old) == _config_key(new)
    assert _config_key(old) != _config_key(old.replace('"bits": 4', '"bits": 3'))
    assert _config_key("not json") == "not json"


def test_lifetime_peak_rss_of_old_rows_is_left_out():
    """peak_rss_mib of rows without an isolated memory probe was the runner process's lifetime peak (the same
    number in every row): the report drops it; a peak measured in an isolated process is kept as measured."""
    from quantlab.reporting.report import drop_lifetime_peaks

    old = pd.DataFrame({"run": ["a", "b"], "peak_rss_mib": [2908.0, 2908.0]})
    assert "peak_rss_mib" not in drop_lifetime_peaks(old)
    mixed = pd.DataFrame({"run": ["a", "b", "c"], "peak_rss_mib": [2908.0, 612.5, 700.0],
                          "memory_probe": [None, "isolated process: load the model, ...", "not measured: x"]})
    out = drop_lifetime_peaks(mixed)
    assert out["peak_rss_mib"].tolist()[1] == 612.5
    assert out["peak_rss_mib"].isna().tolist() == [True, False, True]
    assert mixed["peak_rss_mib"].tolist() == [2908.0, 612.5, 700.0]  # the input is not modified


def test_speed_ratios_pair_each_row_with_its_float_measurement_or_fall_back_to_the_baseline():
    """A row with latency_ref_* divides that float measurement by its own latency (machine drift between rows
    cancels); a row without it (stored before the runner paired them) divides the baseline row's latency."""
    from quantlab.reporting.report import add_ratios
    from quantlab.reporting.sections import protocol_text
    nan = float("nan")
    common = {"ppl": 10.0, "weight_bytes": 100, "eval_dataset": "d", "eval_split": "test", "eval_source": "s",
              "bos": "none", "eval_windows": 1, "seq_len": 8, "eval_tokens": 8, "predicted_tokens": 7,
              "prefill_tokens": 4, "decode_tokens": 2, "batch_size": 1, "latency_repeats": 2}
    rows = [{"run": "fp32", "method": "none", "prefill_ms_p50": 10.0, "decode_ms_per_token_p50": 4.0,
             "latency_ref_prefill_ms_p50": nan, "latency_ref_decode_ms_per_token_p50": nan},
            {"run": "old", "method": "rtn", "prefill_ms_p50": 20.0, "decode_ms_per_token_p50": 8.0,
             "latency_ref_prefill_ms_p50": nan, "latency_ref_decode_ms_per_token_p50": nan},
            {"run": "new", "method": "rtn", "prefill_ms_p50": 20.0, "decode_ms_per_token_p50": 8.0,
             "latency_ref_prefill_ms_p50": 30.0, "latency_ref_decode_ms_per_token_p50": 12.0}]
    df = add_ratios(pd.DataFrame([{**common, **r} for r in rows]))
    assert df["decode_speedup"].tolist() == [1.0, 0.5, 1.5] and df["prefill_speedup"].tolist() == [1.0, 0.5, 1.5]
    assert "rows new divide the float model's latency measured just before their own; the others" in protocol_text(df)
    paired = df[df["run"] != "old"]
    assert "× speed: the float model's latency measured in the same process" in protocol_text(paired)
    old = df[df["run"] != "new"].drop(columns=[c for c in df if c.startswith("latency_ref_")])
    assert add_ratios(old)["decode_speedup"].tolist() == [1.0, 0.5]
    assert "× speed: the baseline row's latency over the row's, each measured at its own time" in protocol_text(old)
