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
    # file systems cap a file name at 255 bytes: <name>.results.jsonl.lock, <name>_full.<plot>.png must fit
    ({"name": "x" * 240, "model": "m", "run": [{"name": "a", "method": "none"}]},
     r"experiment name 'x{40}'\.\.\. is 240 UTF-8 bytes long; it must be .* of at most 200 UTF-8 bytes"),
    ({"model": "m", "run": [{"name": "\u00e9" * 101, "method": "none"}]},
     r"\[\[run\]\] #1: run name '\u00e9{40}'\.\.\. is 202 UTF-8 bytes long"),
    # bidi controls make a file name display as something else ("report\u202egpj.exe" shows as "reportexe.jpg")
    ({"name": "report\u202egpj.exe", "model": "m", "run": [{"name": "a", "method": "none"}]},
     r"experiment name .* contains the bidirectional control character U\+202E; it must be"),
    ({"model": "m", "run": [{"name": "w4\u2066x", "method": "none"}]}, r"run name .* control character U\+2066"),
])
def test_bad_experiment_files_fail_before_loading(data, match):
    with pytest.raises(ValueError, match=match):
        parse_experiment(data)


@pytest.mark.parametrize("table,field,value,valid", [
    ("calibration", "num_samples", 1_000_000_000, "1..100000"),
    ("calibration", "seq_len", 1 << 30, "1..1048576"),
    ("eval", "seq_len", 1 << 30, "1..1048576"),
    ("eval", "max_windows", 10**12, "1..1000000"),
    ("eval", "max_tokens", 10**15, "1..1000000000"),
    ("eval", "num_sentences", 10**9, "1..1000000"),
    ("eval", "max_length", 1 << 30, "1..1048576"),
    ("eval", "prefill_tokens", 1 << 30, "1..1048576"),
    ("eval", "decode_tokens", 1 << 30, "1..1048576"),
    ("eval", "latency_repeats", 10**9, "1..10000"),
    ("eval", "kl_windows", 10**9, "0..100000"),
    ("eval", "lm_eval_limit", 10**9, "1..1000000"),
    ("eval", "lm_eval_max_length", 1 << 30, "2..1048576"),
    ("eval", "lm_eval_batch_size", 10**6, "1..4096"),
    ("execution", "qat_processes", 10**6, "1..1024"),
])
def test_sizes_that_allocate_are_bounded_before_anything_loads(table, field, value, valid):
    # num_samples = 1000000000 used to pass, then fail as an allocation error naming no field once the model loaded
    data = {"model": "m", table: {field: value}, "run": [{"name": "a", "method": "qat"}]}  # qat: qat_processes > 1
    with pytest.raises(ValueError, match=rf"{table}\.{field} must be an integer in {valid}(?: or omitted)?, "
                                         rf"got {value}$"):
        parse_experiment(data)
    data[table][field] = int(valid.split("..")[1])  # the limit itself passes
    parse_experiment(data)
    run_calibration = {"model": "m", "run": [{"name": "a", "method": "gptq", "calibration": {"num_samples": 10**9}}]}
    with pytest.raises(ValueError, match=r"run 'a': calibration.num_samples must be an integer in 1..100000"):
        parse_experiment(run_calibration)


def test_names_are_checked_on_direct_construction_too():
    from quantlab.runs.experiment import Experiment, RunSpec

    with pytest.raises(ValueError, match=r"run name 'a/b' contains '/'"):
        RunSpec("a/b", make_config({"method": "none"}))
    with pytest.raises(ValueError, match=r"experiment name '\.\./x' contains '/'"):
        Experiment("../x", "m", (RunSpec("a", make_config({"method": "none"})),))
    ok = parse_experiment({"name": "a..b_c-1.2", "model": "m", "run": [{"name": "w4 g64 (sym)", "method": "none"}]})
    assert ok.name == "a..b_c-1.2"  # dots inside a name and spaces are fine
    longest = "\u00e9" * 100  # 200 UTF-8 bytes: the limit itself passes
    exp = parse_experiment({"name": longest, "model": "m", "run": [{"name": longest, "method": "none"}]})
    assert exp.name == longest and exp.runs[0].name == longest


def test_experiment_file_with_a_utf8_bom_loads(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'name = "bom"\nmodel = "m"\n[[run]]\nname = "a"\nmethod = "none"\n')
    exp = load_experiment(path)  # as Windows Notepad saves "UTF-8 with BOM"
    assert exp.name == "bom" and [r.name for r in exp.runs] == ["a"]


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


@pytest.mark.parametrize("nested", ["[" * 100_000, "{a = " * 100_000], ids=["arrays", "inline-tables"])
def test_a_toml_nested_too_deeply_names_the_file_and_the_cause(tmp_path, capsys, nested):
    deep = tmp_path / "deep.toml"
    deep.write_text(f"a = {nested}\n")
    with pytest.raises(ValueError, match=r"deep\.toml: invalid TOML: arrays or inline tables nest too deeply"):
        load_experiment(deep)
    assert main(["run", str(deep), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nest too deeply" in err and "Traceback" not in err


def _config_only_model(tmp_path, model_type, **fields):
    """A model folder holding a config.json alone (no weights): preflight must need nothing more."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "max_position_embeddings": 4096,
                                                 "vocab_size": 300, **fields})
    config.save_pretrained(tmp_path / model_type)
    return tmp_path / model_type


@pytest.mark.parametrize("case", ["eval-seq-len", "calibration-seq-len", "run-calibration-seq-len",
                                  "rotation-bert", "rotation-gemma3", "rotation-head-dim", "awq-gpt-neox",
                                  "kv-group", "calibration-memory"])
def test_what_the_models_config_refuses_fails_before_its_weights_load(case, tiny_model_dir, tmp_path, monkeypatch):
    """Checks that need the config alone run before load_model (and so before the fp32 row is evaluated)."""
    from quantlab.runs import context, preflight

    monkeypatch.setattr(context, "load_model", lambda *a, **k: pytest.fail("the model's weights were loaded"))
    fp32, gptq = {"name": "fp32", "method": "none"}, {"name": "gptq", "method": "gptq", "bits": 4}
    rotated = {"name": "rot", "method": "rtn", "bits": 4, "rotation": {}}
    model, runs, eval_table, match = tiny_model_dir, [fp32, rotated], {}, None
    if case == "eval-seq-len":  # the tiny Llama has 256 positions
        runs, eval_table = [fp32], {"seq_len": 512}
        match = r"^eval\.seq_len = 512 exceeds the max positions of model '.*' \(256\); valid: 1\.\.256$"
    elif case == "calibration-seq-len":
        runs = [fp32, gptq]
        match = r"^calibration\.seq_len = 512 exceeds the max positions of model '.*' \(256\); valid: 1\.\.256$"
    elif case == "run-calibration-seq-len":
        runs = [fp32, gptq | {"calibration": {"seq_len": 300}}]
        match = r"^run 'gptq': calibration\.seq_len = 300 exceeds the max positions .*; valid: 1\.\.256$"
    elif case == "rotation-bert":
        model = _config_only_model(tmp_path, "bert")
        match = r"^run 'rot' on model '.*bert': rotation: model_type 'bert' has no rotation facts .*supported: llama"
    elif case == "rotation-gemma3":
        model = _config_only_model(tmp_path, "gemma3_text")
        match = r"run 'rot' .*: model_type 'gemma3_text' has no rotation facts \(Gemma-3's post-attention"
    elif case == "rotation-head-dim":  # head_dim 18: no Hadamard of that order (transforms/hadamard.py)
        model = _config_only_model(tmp_path, "llama", hidden_size=72, intermediate_size=144)
        match = r"run 'rot' .*: rotation: head_dim = 18: no Hadamard construction for order 18"
    elif case == "kv-group":  # the tiny Llama's head_dim is 16: groups of 5 straddle it
        runs = [fp32, {"name": "kv", "method": "none", "kv_cache": {"bits": 4, "group_size": 5}}]
        match = r"run 'kv' .*: kv group_size 5 does not divide llama's head_dim 16; valid: 1, 2, 4, 8, 16"
    elif case == "calibration-memory":  # a 70B-shaped Llama: about 560 GB of fp32 weights, twice
        model = _config_only_model(tmp_path, "llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
        monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 24 * 2**30)
        runs = [fp32, gptq]
        match = (r"^run 'gptq' on model '.*llama': calibrating on 128 windows of 512 tokens needs about 2\d\d\.\d GiB "
                 r"\(the float model 2\d\d\.\d GiB, the copy being quantized 7\.8 GiB, .*one decoder block: 855\.6M weights, "
                 r"Hessians .* MiB \(the widest input is down_proj input, 28672\)\), but 24\.0 GiB is available; lower "
                 r"calibration\.num_samples")
    else:
        model, runs = _config_only_model(tmp_path, "gpt_neox"), [fp32, {"name": "awq", "method": "awq"}]
        match = r"run 'awq' .*: awq: model_type 'gpt_neox' has no architecture entry; supported: .*llama"
    exp = parse_experiment({"name": "pre", "model": str(model), "device": "cpu", "eval": {"seq_len": 32} | eval_table,
                            "calibration": {"seq_len": 512} if case == "calibration-seq-len" else
                            {"num_samples": 128, "seq_len": 512} if case == "calibration-memory" else {}, "run": runs})
    with pytest.raises(ValueError, match=match):
        runner.run_experiment(exp, tmp_path / "reports", progress=False)
    assert not (tmp_path / "reports" / "pre.results.jsonl").exists() or not (
        tmp_path / "reports" / "pre.results.jsonl").read_text()  # no row: not even the fp32 one


def test_preflight_loads_nothing_when_no_run_is_pending(monkeypatch):
    from quantlab.runs import preflight

    monkeypatch.setattr(preflight, "load_config", lambda *a, **k: pytest.fail("a config was loaded"))
    preflight.preflight(parse_experiment({"model": "m", "run": [{"name": "a", "method": "none"}]}), [])


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
    # every row names the CPU its timings ran on and how busy the machine was
    from quantlab.runs.envinfo import cpu_facts, cpu_isa
    facts = cpu_facts()
    assert (csv["cpu_model"] == facts["cpu_model"]).all() and (csv["cpu_isa"] == cpu_isa(facts)).all()
    assert (csv["load_avg_1m_start"] >= 0).all() and (csv["load_avg_1m_end"] >= 0).all()
    md = (tmp_path / "tiny.md").read_text()
    assert f"cpu_model `{facts['cpu_model']}`" in md and "load average (1 min) at the runs' starts and ends" in md
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


def test_every_run_failing_names_the_failures_and_writes_no_report(tiny_model_dir, tmp_path, monkeypatch):
    def crash(ctx, run):
        raise RuntimeError(f"simulated crash of {run.name}")

    monkeypatch.setattr(runner, "EvalContext", lambda *args: None)  # no model needed: every run fails
    monkeypatch.setattr(runner, "evaluate_run", crash)
    with pytest.raises(RuntimeError, match=r"^3 run\(s\) failed, no rows to report: fp32: simulated crash of fp32; "
                                           r"w8: simulated crash of w8; w4g32: simulated crash of w4g32$"):
        runner.run_experiment(_experiment(tiny_model_dir), tmp_path, progress=False)
    assert not (tmp_path / "tiny.csv").exists() and not (tmp_path / "tiny.md").exists()


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


def test_the_calibration_estimate_counts_the_real_parameters(tiny_model):
    """Reference: the tiny Llama's own parameter count (tied embedding once), fp32; hidden states and Hessians by
    hand from its shapes (hidden 64, MLP 128 wide per the fixture's config)."""
    from quantlab.eval.estimate import estimate_calibration

    model = tiny_model[0]
    cfg = model.config
    est = estimate_calibration(cfg, 4, 32)
    assert est.model_bytes == sum(p.numel() for p in model.parameters()) * 4
    h, inter = cfg.hidden_size, cfg.intermediate_size
    assert est.hidden_state_bytes == 4 * (4 * 32) * h * 4
    hessians = (3 * h * h + inter * inter) * 4  # q/k/v, o_proj, gate/up inputs are hidden wide; down_proj's is MLP
    assert est.block_bytes > hessians and f"Hessians {hessians / 2**20:.0f} MiB" in est.largest_block
    assert est.total_bytes == 2 * est.model_bytes + est.hidden_state_bytes + est.block_bytes
    streamed = estimate_calibration(cfg, 4, 32, streamed=True)  # the copy: all but the decoder linears' weights
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if type(m).__name__ == "Linear" and n.startswith("model.layers."))
    assert streamed.copy_bytes == (sum(p.numel() for p in model.parameters()) - linears) * 4
    assert streamed.total_bytes < est.total_bytes
