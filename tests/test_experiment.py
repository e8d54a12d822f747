"""Experiment files validate before loading; the runner writes rows at once, resumes and reports."""
import json

import pandas as pd
import pytest

from quantlab.cli import main
from quantlab.core.registry import get_method, known_methods, make_config, method_versions, non_default_fields
from quantlab.runs import runner
from quantlab.runs.experiment import load_experiment, parse_experiment

REPORT_COLUMNS = {
    "run", "method", "scheme", "bits", "group_size", "symmetric", "ppl", "ppl_delta_pct", "kl_mean", "top1_agree",
    "weight_bytes", "weight_mib", "weight_ratio", "bits_per_weight", "prefill_ms_p50", "prefill_ms_p90",
    "decode_ms_per_token_p50", "decode_ms_per_token_p90", "decode_speedup", "quantize_s", "eval_s",
    "backend", "seq_len", "eval_tokens", "eval_windows", "eval_source", "bos", "seed", "device", "torch",
    "transformers", "git_sha", "config",
}


def _experiment(model_dir, runs=None, **eval_overrides):
    eval_table = {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 4, "kl_windows": 2,
                  "prefill_tokens": 8, "decode_tokens": 2, "latency_repeats": 1, **eval_overrides}
    runs = runs or [{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
                    {"name": "w4g32", "method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}]
    return parse_experiment({"name": "tiny", "model": str(model_dir), "device": "cpu", "eval": eval_table, "run": runs})


def test_quickstart_file_validates():
    exp = load_experiment("experiments/smollm2_quickstart.toml")
    assert exp.model == "smollm2-135m" and exp.runs[0].config.__class__.__name__ == "NoneConfig"
    assert len(exp.runs) >= 7 and exp.eval.max_windows


@pytest.mark.parametrize("data,match", [
    ({"model": "m", "modle": 1, "run": [{"name": "a", "method": "none"}]}, r"unknown key\(s\) 'modle'"),
    ({"model": "m", "eval": {"seqlen": 5}, "run": [{"name": "a", "method": "none"}]}, r"\[eval\]: unknown key\(s\) 'seqlen'"),
    ({"model": "m", "run": [{"name": "a", "method": "gtpq"}]}, r"run 'a': unknown method 'gtpq'; known: .*none, .*rtn"),
    ({"model": "m", "run": [{"name": "a", "method": "rtn", "bits": 9}]}, r"run 'a': bits must be an integer in 2..8, got 9"),
    ({"model": "m", "run": [{"name": "a", "method": "rtn", "group_size": 0}]}, "group_size must be an integer >= 1"),
    ({"model": "m", "run": [{"name": "a", "method": "none"}, {"name": "a", "method": "none"}]}, "duplicate run name"),
    ({"model": "m", "calibration": {"split": "test"}, "run": [{"name": "a", "method": "none"}]}, "never calibrate"),
    ({"model": "m", "run": []}, r"has no \[\[run\]\] entries"),
    ({"run": [{"name": "a", "method": "none"}]}, "missing required key 'model'"),
    ({"model": "m", "run": [{"method": "none"}]}, r"\[\[run\]\] #1 needs a non-empty 'name'"),
    # a training base under dynamic / static would be silently untrained while the row says QAT
    ({"model": "m", "run": [{"name": "a", "method": "dynamic", "base": {"method": "qat"}}]},
     (r"run 'a': dynamic: base 'qat' would never be trained .* labelled QAT; .*method = \"qat\" with "
      r"base = \{method = \"dynamic\", base = \{method = \"gptq\", bits = 4")),
    ({"model": "m", "run": [{"name": "a", "method": "static", "base": {"method": "qat", "base": {"method": "gptq"}}}]},
     r"run 'a': static: base 'qat' would never be trained .*method = \"qat\" with base = \{method = \"static\""),
    # names become file names: reports/<experiment>.*, and run names reach paths too
    ({"name": "../../x", "model": "m", "run": [{"name": "a", "method": "none"}]},
     r"experiment name '\.\./\.\./x' contains '/'; it must be a non-empty name without '/', '\\' or control"),
    ({"name": "a\\b", "model": "m", "run": [{"name": "a", "method": "none"}]}, r"experiment name 'a\\\\b' contains '\\'"),
    ({"name": ".hidden", "model": "m", "run": [{"name": "a", "method": "none"}]}, r"experiment name '\.hidden' starts with '\.'"),
    ({"name": "..", "model": "m", "run": [{"name": "a", "method": "none"}]}, r"experiment name '\.\.' starts with '\.'"),
    ({"name": " ", "model": "m", "run": [{"name": "a", "method": "none"}]}, r"experiment name ' ' is empty"),
    ({"name": "a\tb", "model": "m", "run": [{"name": "a", "method": "none"}]}, "contains a control character"),
    ({"name": 3, "model": "m", "run": [{"name": "a", "method": "none"}]}, "experiment name 3 is of type int"),
    ({"model": "m", "run": [{"name": "../w4", "method": "none"}]}, r"\[\[run\]\] #1: run name '\.\./w4' contains '/'"),
    ({"model": "m", "run": [{"name": "ok", "method": "none"}, {"name": "..", "method": "none"}]},
     r"\[\[run\]\] #2: run name '\.\.' starts with '\.'"),
    ({"model": "m", "run": [{"name": "w\n4", "method": "none"}]}, r"run name 'w\\n4' contains a control character"),
])
def test_bad_experiment_files_fail_before_loading(data, match):
    with pytest.raises(ValueError, match=match):
        parse_experiment(data)


def test_names_are_checked_on_direct_construction_too():
    from quantlab.runs.experiment import Experiment, RunSpec

    with pytest.raises(ValueError, match=r"run name 'a/b' contains '/'"):
        RunSpec("a/b", make_config({"method": "none"}))
    with pytest.raises(ValueError, match=r"experiment name '\.\./x' contains '/'"):
        Experiment("../x", "m", (RunSpec("a", make_config({"method": "none"})),))
    ok = parse_experiment({"name": "a..b_c-1.2", "model": "m", "run": [{"name": "w4 g64 (sym)", "method": "none"}]})
    assert ok.name == "a..b_c-1.2"  # dots inside a name and spaces are fine


def test_qat_base_under_dynamic_fails_when_the_file_loads(tmp_path):
    path = tmp_path / "w4a8_qat.toml"
    path.write_text('model = "m"\n[[run]]\nname = "w4a8-qat"\nmethod = "dynamic"\n'
                    'base = {method = "qat", base = {method = "gptq", bits = 4}, steps = 8}\n')
    with pytest.raises(ValueError, match=r"w4a8_qat.toml: run 'w4a8-qat': dynamic: base 'qat' would never be trained"):
        load_experiment(path)
    # the way the message points to loads, and trains
    path.write_text('model = "m"\n[[run]]\nname = "w4a8-qat"\nmethod = "qat"\nsteps = 8\n'
                    'base = {method = "dynamic", base = {method = "gptq", bits = 4}}\n')
    run = load_experiment(path).runs[0]
    assert get_method(run.config).needs_training_for(run.config)


def test_experiment_file_that_is_not_utf8_names_file_and_codec(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('description = "Gr\u00fc\u00dfe"\nmodel = "m"\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.toml: not a UTF-8 text file \('utf-8' codec can't decode byte 0xfc "
                                         r"in position 17: invalid start byte\)"):
        load_experiment(path)


def test_invalid_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(ValueError, match="bad.toml: invalid TOML"):
        load_experiment(bad)


def test_runner_writes_rows_resumes_and_reports(tiny_model_dir, tmp_path, monkeypatch):
    exp = _experiment(tiny_model_dir)
    df = runner.run_experiment(exp, tmp_path, progress=False)
    assert list(df["run"]) == ["fp32", "w8", "w4g32"]
    csv = pd.read_csv(tmp_path / "tiny.csv")
    assert REPORT_COLUMNS <= set(csv.columns)
    # a CPU process's peak RSS covers its whole life (same number in every row): not a per-run column
    assert "peak_rss_mib" not in csv.columns and "memory_probe" not in csv.columns
    base = csv.iloc[0]
    assert pd.isna(base["latency_ref_decode_ms_per_token_p50"]) and base["decode_speedup"] == 1.0  # the reference
    for i in (1, 2):  # ratio columns, recomputed from the CSV's own measurements
        row = csv.iloc[i]
        assert row["ppl_delta_pct"] == pytest.approx((row["ppl"] / base["ppl"] - 1) * 100, rel=1e-9, abs=1e-9)
        assert row["weight_ratio"] == pytest.approx(row["weight_bytes"] / base["weight_bytes"], rel=1e-12)
        for phase, col in (("decode", "decode_ms_per_token_p50"), ("prefill", "prefill_ms_p50")):
            # speed: the float model timed in the same run just before this row, not the baseline row's time
            assert row[f"latency_ref_{col}"] > 0
            assert row[f"{phase}_speedup"] == pytest.approx(row[f"latency_ref_{col}"] / row[col], rel=1e-9)
    assert (csv["weight_bytes"].iloc[1:] < base["weight_bytes"]).all()
    assert csv.loc[1, "kl_mean"] < csv.loc[2, "kl_mean"]
    md = (tmp_path / "tiny.md").read_text()
    assert "**Protocol.**" in md and "4 non-overlapping windows of seq_len 32" in md and "| w4g32 |" in md
    assert "× speed: the float model's latency measured in the same process just before the row's" in md

    real_context, real_evaluate, calls = runner.EvalContext, runner.evaluate_run, []
    monkeypatch.setattr(runner, "EvalContext", None)  # all runs done: the model must not even load
    runner.run_experiment(exp, tmp_path, progress=False)
    monkeypatch.setattr(runner, "EvalContext", real_context)
    monkeypatch.setattr(runner, "evaluate_run", lambda ctx, run: calls.append(run.name) or real_evaluate(ctx, run))
    changed = _experiment(tiny_model_dir, runs=[{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
                                                {"name": "w4g32", "method": "rtn", "bits": 4, "group_size": 16}])
    df = runner.run_experiment(changed, tmp_path, progress=False)
    assert calls == ["w4g32"]  # only the run whose config changed is redone
    assert list(df["run"]) == ["fp32", "w8", "w4g32"] and df["group_size"].iloc[2] == 16
    runner.run_experiment(changed, tmp_path, force=True, progress=False)
    assert calls == ["w4g32", "fp32", "w8", "w4g32"]  # --force reruns everything


def test_a_failing_run_keeps_finished_rows(tiny_model_dir, tmp_path, monkeypatch):
    exp = _experiment(tiny_model_dir)
    real = runner.evaluate_run

    def flaky(ctx, run):
        if run.name == "w8":
            raise RuntimeError("simulated crash")
        return real(ctx, run)

    monkeypatch.setattr(runner, "evaluate_run", flaky)
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed .*w8: simulated crash"):
        runner.run_experiment(exp, tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "tiny.results.jsonl").read_text().splitlines()]
    assert [r["run"] for r in rows] == ["fp32", "w4g32"]
    monkeypatch.setattr(runner, "evaluate_run", real)
    df = runner.run_experiment(exp, tmp_path, progress=False)  # the rerun only does w8, order is the file's
    assert list(df["run"]) == ["fp32", "w8", "w4g32"]


def test_cli_run_list_and_errors(tiny_model_dir, tmp_path, capsys):
    exp_file = tmp_path / "tiny.toml"
    exp_file.write_text(f"""
name = "tiny_cli"
model = "{tiny_model_dir}"
device = "cpu"
[eval]
dataset = "{tiny_model_dir / 'sample.txt'}"
seq_len = 32
max_windows = 2
kl_windows = 1
latency = false
[[run]]
name = "fp32"
method = "none"
[[run]]
name = "w4"
method = "rtn"
bits = 4
group_size = 16
""")
    assert main(["-q", "run", str(exp_file), "--reports-dir", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    csv = pd.read_csv(tmp_path / "tiny_cli.csv")  # the file's runs, as the file defines them
    assert list(csv["run"]) == ["fp32", "w4"] and list(csv["method"]) == ["none", "rtn"]
    assert (csv["bits"].iloc[1], csv["group_size"].iloc[1], csv["eval_windows"].iloc[1]) == (4, 16, 2)
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in known_methods()) and len(known_methods()) >= 8
    exp_file.write_text(exp_file.read_text().replace('method = "rtn"', 'method = "rtm"'))
    assert main(["run", str(exp_file), "--reports-dir", str(tmp_path)]) == 1
    assert "unknown method 'rtm'; known: " in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.toml")]) == 1
    assert "missing.toml" in capsys.readouterr().err


def test_run_key_ignores_fields_left_at_their_defaults(tiny_model_dir):
    """Spelling out a default is the same run: adding a defaulted field to a config keeps old keys valid."""
    import torch

    plain = _experiment(tiny_model_dir, runs=[{"name": "w4", "method": "rtn", "bits": 4}])
    spelled = _experiment(tiny_model_dir, runs=[{"name": "w4", "method": "rtn", "bits": 4, "symmetric": True,
                                                 "scale_dtype": "float16", "exclude": ["lm_head"]}])
    other = _experiment(tiny_model_dir, runs=[{"name": "w4", "method": "rtn", "bits": 4, "symmetric": False}])
    cpu = torch.device("cpu")
    key = runner.run_key(plain, plain.runs[0], cpu)
    assert key == runner.run_key(spelled, spelled.runs[0], cpu)
    assert key != runner.run_key(other, other.runs[0], cpu)
    assert non_default_fields(other.runs[0].config) == {"symmetric": False}  # bits = 4 is the default


def test_run_key_changes_when_a_method_version_changes(tiny_model_dir, monkeypatch):
    """A method whose default behaviour changed (version > 1) gets new run keys, also as a nested base,
    so rows of the old behaviour are never reused; version 1 leaves every key as it was."""
    import torch

    from quantlab import get_method

    runs = [{"name": "awq", "method": "awq"}, {"name": "w4a8", "method": "dynamic", "base": {"method": "awq"}},
            {"name": "rtn", "method": "rtn"}]
    exp = _experiment(tiny_model_dir, runs=runs)
    cpu = torch.device("cpu")
    before = [runner.run_key(exp, r, cpu) for r in exp.runs]
    bumped = get_method("awq").version + 1  # awq is at 2 since it became reference-exact
    monkeypatch.setattr(get_method("awq"), "version", bumped)
    after = [runner.run_key(exp, r, cpu) for r in exp.runs]
    assert after[0] != before[0] and after[1] != before[1]
    assert after[2] == before[2]
    assert method_versions(exp.runs[1].config) == {"awq": bumped}
