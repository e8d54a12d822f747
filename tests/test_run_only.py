"""`quantlab run --only`: some runs of an experiment, the others left as they are (done or not), the report still
covering every run with a row; with --force only those rows are redone, the others' lines kept byte for byte."""
import json

import pytest

from quantlab.cli import main
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.runner import select_runs


def _experiment(model_dir):
    return parse_experiment({
        "name": "only", "model": str(model_dir), "device": "cpu",
        "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2, "kl_windows": 1,
                 "latency": False},
        "run": [{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
                {"name": "w4g32", "method": "rtn", "bits": 4, "group_size": 32}]})


def test_select_runs_takes_names_and_seed_groups_and_lists_the_runs_for_an_unknown_one():
    exp = parse_experiment({"name": "e", "model": "m", "seeds": [0, 1], "run": [
        {"name": "fp32", "method": "none"}, {"name": "g", "method": "gptq", "bits": 4}]})
    assert [r.name for r in select_runs(exp, None)] == ["fp32", "g-seed0", "g-seed1"]
    assert [r.name for r in select_runs(exp, ["g"])] == ["g-seed0", "g-seed1"]  # a seeded run: all its draws
    assert [r.name for r in select_runs(exp, ["g-seed1", "fp32"])] == ["fp32", "g-seed1"]  # the file's order
    with pytest.raises(ValueError, match=r"e: --only names no run called 'g-seed2', 'w4'; its runs: fp32, g, "
                                         r"g-seed0, g-seed1$"):
        select_runs(exp, ["g-seed2", "fp32", "w4"])


def test_only_runs_those_and_the_report_covers_every_row(tiny_model_dir, tmp_path, monkeypatch):
    exp, calls = _experiment(tiny_model_dir), []
    real = runner.evaluate_run
    monkeypatch.setattr(runner, "evaluate_run", lambda ctx, run: calls.append(run.name) or real(ctx, run))
    df = runner.run_experiment(exp, tmp_path, progress=False, only=["w8"])
    assert calls == ["w8"] and list(df["run"]) == ["w8"]
    df = runner.run_experiment(exp, tmp_path, progress=False)  # the rest, in the file's order
    assert calls == ["w8", "fp32", "w4g32"] and list(df["run"]) == ["fp32", "w8", "w4g32"]
    results = tmp_path / "only.results.jsonl"
    before = results.read_text().splitlines(keepends=True)
    df = runner.run_experiment(exp, tmp_path, progress=False, force=True, only=["w8"])
    assert calls == ["w8", "fp32", "w4g32", "w8"]  # --force with --only: those alone are redone
    after = results.read_text().splitlines(keepends=True)
    # the others' lines as they were, w8's dropped and appended anew (its timestamp has one-second resolution: the
    # tiny run can land in the same second, so `calls` above is what shows it was redone)
    assert after[:2] == before[1:] and json.loads(after[2])["run"] == "w8" and len(after) == 3
    assert list(df["run"]) == ["fp32", "w8", "w4g32"]  # the report in the file's order still
    runner.run_experiment(exp, tmp_path, progress=False, only=["fp32", "w8"])  # both done: nothing runs
    assert calls == ["w8", "fp32", "w4g32", "w8"]


def test_an_unknown_only_name_fails_before_any_model_loads(tiny_model_dir, tmp_path, capsys, monkeypatch):
    path = tmp_path / "only.toml"
    path.write_text(f'name = "only"\nmodel = "{tiny_model_dir}"\n[[run]]\nname = "fp32"\nmethod = "none"\n')
    monkeypatch.setattr(runner, "EvalContext", None)  # loading anything would fail differently
    assert main(["-q", "run", str(path), "--reports-dir", str(tmp_path), "--only", "gptq"]) == 1
    assert "only: --only names no run called 'gptq'; its runs: fp32" in capsys.readouterr().err
    assert not (tmp_path / "only.results.jsonl").exists()
