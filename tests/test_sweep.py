"""[[sweep]] grids: cartesian expansion with derived names, composition with seeds / overrides / backends,
clear errors before anything loads, and `quantlab run --dry-run`."""
from __future__ import annotations

import pytest

from quantlab.cli import main
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.sweep import expand_sweep


def _exp(*sweeps, runs=()):
    return parse_experiment({"model": "m", "sweep": list(sweeps), "run": list(runs)}, where="f.toml")


def test_the_issue_example_gives_eight_runs_named_by_their_values():
    exp = _exp({"method": "gptq", "bits": [3, 4], "group_size": [64, 128], "seeds": [0, 1]})
    assert [r.name for r in exp.runs] == [f"gptq-w{b}-g{g}-seed{s}" for b in (3, 4) for g in (64, 128) for s in (0, 1)]
    first = exp.runs[0]
    assert (first.config.bits, first.config.group_size, first.seed, first.group) == (3, 64, 0, "gptq-w3-g64")


def test_sweeps_compose_with_runs_nested_bases_overrides_and_backends():
    over = [{"pattern": "*.down_proj", "bits": 8}]
    exp = _exp({"name": "w4a8", "method": "dynamic", "act_format": ["int", "fp8_e4m3"], "backend": "auto",
                "base": {"method": "rtn", "bits": [4, 8], "overrides": over}},
               runs=[{"name": "fp32", "method": "none"}])
    names = [r.name for r in exp.runs]
    assert names == ["fp32", "w4a8-int-base-w4", "w4a8-int-base-w8", "w4a8-fp8-e4m3-base-w4", "w4a8-fp8-e4m3-base-w8"]
    run = exp.runs[3]
    assert run.backend == "auto" and run.config.act_format == "fp8_e4m3" and run.config.base.bits == 4
    assert run.config.base.overrides[0].pattern == "*.down_proj"  # a list-valued field is one value, not an axis
    # a list of lists sweeps a list field
    tables = expand_sweep({"method": "rtn", "exclude": [["lm_head"], ["lm_head", "x"]], "bits": [4]}, "s")
    assert [t["exclude"] for t in tables] == [["lm_head"], ["lm_head", "x"]]


def test_boolean_axes_are_named_by_what_they_mean():
    names = [t["name"] for t in expand_sweep({"method": "gptq", "symmetric": [True, False],
                                               "act_order": [True, False]}, "s")]
    assert names == ["gptq-sym-act-order", "gptq-sym-no-act-order", "gptq-asym-act-order", "gptq-asym-no-act-order"]


def test_experiment_seeds_expand_only_seed_dependent_sweep_runs():
    exp = parse_experiment({"model": "m", "seeds": [0, 1], "sweep": [{"method": ["rtn", "gptq"], "bits": 4}]})
    assert [r.name for r in exp.runs] == ["rtn", "gptq-seed0", "gptq-seed1"]  # RTN is deterministic


@pytest.mark.parametrize("sweep,message", [
    ({"method": "gptq", "bitz": [3, 4]}, r"\[\[sweep\]\] #1: run 'gptq-bitz3': unknown config key\(s\) 'bitz'"),
    ({"method": "gptq", "bits": []}, r"\[\[sweep\]\] #1: bits = \[\] sweeps over nothing"),
    ({"method": "rtn", "bits": [4, 4]}, r"duplicate run name\(s\) rtn-w4"),
    ({"method": "rtn", "bits": 4}, r"no field holds a list of values"),
    ({"bits": [3, 4]}, r"needs a 'method' \(one, or a list of methods to sweep\)"),
    ({"method": "rtn", "bits": [3, 9]}, r"run 'rtn-w9': bits must be an integer in 2..8"),
])
def test_bad_sweeps_fail_before_anything_loads(sweep, message):
    with pytest.raises(ValueError, match=message):
        _exp(sweep)


def test_a_sweep_name_clashing_with_a_run_fails():
    with pytest.raises(ValueError, match=r"duplicate run name\(s\) rtn-w4 \(a \[\[sweep\]\] names its runs"):
        _exp({"method": "rtn", "bits": [3, 4]}, runs=[{"name": "rtn-w4", "method": "rtn"}])


def test_dry_run_lists_the_grid_and_loads_nothing(tmp_path, monkeypatch, capsys):
    from quantlab.runs import context, runner

    monkeypatch.setattr(context, "load_model", lambda *a, **k: pytest.fail("--dry-run loaded a model"))
    monkeypatch.setattr(runner, "EvalContext", lambda *a, **k: pytest.fail("--dry-run built a run context"))
    toml = tmp_path / "grid.toml"
    toml.write_text('model = "smollm2-135m"\n[[run]]\nname = "fp32"\nmethod = "none"\n'
                    '[[sweep]]\nmethod = "gptq"\nbits = [3, 4]\ngroup_size = [64, 128]\nseeds = [0, 1]\n')
    assert main(["run", str(toml), "--dry-run", "--reports-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "gptq-w4-g128-seed1" in out and "w4 g128 sym" in out
    assert "9 runs: 0 done, 9 pending (8 calibrate, 0 train)" in out
    assert not (tmp_path / "r").exists()  # nothing written


def test_dry_run_estimates_from_rows_of_the_same_settings_else_scales_by_step_count(tmp_path):
    import json

    from quantlab.runs.runner import plan_experiment

    exp = parse_experiment({"name": "e", "model": "m", "run": [
        {"name": "ar50", "method": "autoround", "bits": 4, "group_size": 64, "iters": 50},
        {"name": "ar200", "method": "autoround", "bits": 4, "group_size": 64, "iters": 200},
        {"name": "gptq", "method": "gptq", "bits": 4}]}, where="e.toml")
    cfg = exp.runs[0].to_dict()

    def row(seed, calibrate_s, drop=(), **cfg_changes):  # quantize 2 s beyond calibration, eval 30 s, KL 10 s
        c = {k: v for k, v in {**cfg, "name": f"ar50-seed{seed}", "seed": seed, **cfg_changes}.items() if k not in drop}
        return {"run_key": f"k{seed}", "method": "autoround", "config": json.dumps(c), "calibrate_s": calibrate_s,
                "quantize_s": calibrate_s + 2.0, "eval_s": 30.0, "kl_reference_s": 10.0}

    # seed 2's row predates a config field: a field one side lacks is not compared
    rows = [row(0, 100.0), row(1, 300.0), row(2, 200.0, drop=("batch_size",)),
            {"run_key": "x", "method": "autoround", "quantize_s": 1.0}]
    (tmp_path / "e.results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = {p["run"]: p for p in plan_experiment(exp, tmp_path)}
    # same settings, seed aside: the median of 142, 342, 242 (the row without eval_s is no timing)
    assert (plan["ar50"]["est_s"], plan["ar50"]["est_basis"]) == (242.0, "same settings")
    # 4x the steps: each row's calibration 4x, the rest as it was; the median of 442, 1242, 842
    assert (plan["ar200"]["est_s"], plan["ar200"]["est_basis"]) == (842.0, "autoround rows, iters scaled")
    assert (plan["gptq"]["est_s"], plan["gptq"]["est_basis"]) == (None, None)
    # a run setting a field the rows predate (seed 2's lacks batch_size) does not match them: ar200 at batch 4
    exp4 = parse_experiment({"name": "e", "model": "m", "run": [{"name": "b4", "method": "autoround", "bits": 4,
                             "group_size": 64, "iters": 50, "batch_size": 4}]}, where="e.toml")
    assert plan_experiment(exp4, tmp_path)[0]["est_basis"] == "autoround rows"
    # a row of other settings whose step count matches is used as it is
    (tmp_path / "e.results.jsonl").write_text(json.dumps(row(0, 100.0, lr=0.01)) + "\n")
    assert plan_experiment(exp, tmp_path)[0]["est_s"] == 142.0
    assert plan_experiment(exp, tmp_path)[0]["est_basis"] == "autoround rows"


def test_dry_run_estimates_a_rotation_from_rows_of_its_kind_with_the_time_it_took_to_learn(tmp_path):
    """A rotated run's estimate: the method's rows with a rotation of its kind, each row's time counting rotate_s
    (outside quantize_s), a learned rotation's time scaled by its steps and not by its windows a step. It used to
    put the 8-window SpinQuant row (3290 s learning its rotations) at the median of the method's rows, ~9 min."""
    import json

    from quantlab.runs.runner import plan_experiment

    gptq = {"method": "gptq", "bits": 4, "group_size": 64}
    runs = [{"name": "hadamard", "method": "dynamic", "act_bits": 4, "base": gptq, "rotation": {"kind": "hadamard"}},
            {"name": "spin", "method": "dynamic", "act_bits": 4, "base": gptq, "rotation": {"kind": "spinquant"}},
            {"name": "spin-8w-200", "method": "dynamic", "act_bits": 4, "base": gptq,
             "rotation": {"kind": "spinquant", "steps": 200, "windows_per_step": 8}},
            {"name": "plain", "method": "dynamic", "act_bits": 4, "base": gptq}]
    exp = parse_experiment({"name": "e", "model": "m", "run": runs}, where="e.toml")
    configs = {r.name: r.to_dict() for r in exp.runs}

    def row(name, rotate_s):  # GPTQ 80 s, eval 30 s, KL 10 s; the rotation's own time beside them
        learned = {"rotate_s": rotate_s} if rotate_s else {}
        return {"run_key": name, "method": "dynamic", "config": json.dumps(configs[name]), "calibrate_s": 80.0,
                "quantize_s": 80.0, "eval_s": 30.0, "kl_reference_s": 10.0, **learned}

    rows = [row("hadamard", 2.0), row("spin", 1000.0), row("plain", None)]
    (tmp_path / "e.results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = {p["run"]: p for p in plan_experiment(exp, tmp_path)}
    assert (plan["spin"]["est_s"], plan["spin"]["est_basis"]) == (1120.0, "same settings")  # rotate_s counted
    # 200 steps of 8 windows against the row's 100 of 1: its rotation's 1000 s twice, the rest as it was
    assert plan["spin-8w-200"]["est_s"] == 2120.0
    assert plan["spin-8w-200"]["est_basis"] == "dynamic rows with a spinquant rotation, rotation steps scaled"
    rows = [row("hadamard", 2.0), row("plain", None)]  # none of its kind: the method's rows (122, 120), unscaled
    (tmp_path / "e.results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = {p["run"]: p for p in plan_experiment(exp, tmp_path)}
    # the upper median of 122 and 120; the row without a rotation is not "same settings"
    assert (plan["spin-8w-200"]["est_s"], plan["spin-8w-200"]["est_basis"]) == (122.0, "dynamic rows")


def test_execution_and_a_formats_sweep_round_trip_through_toml():
    import tomllib

    from quantlab.runs.tomlwrite import experiment_toml

    exp = _exp({"method": "rtn", "format": ["nf4", "mxfp4"], "double_quant": False})
    exp = parse_experiment({**tomllib.loads(experiment_toml(exp)), "execution": {"num_cpus": 2, "max_retries": 3}})
    again = parse_experiment(tomllib.loads(experiment_toml(exp)))
    assert again == exp and again.execution.num_cpus == 2 and [r.name for r in again.runs] == ["rtn-nf4", "rtn-mxfp4"]


def test_an_unknown_field_in_a_large_grid_fails_before_the_grid_expands(monkeypatch):
    # 5 axes of 10 values (100,000 points) with an unknown field: the first combination is parsed first
    from quantlab.runs import experiment

    monkeypatch.setattr(experiment, "expand_sweep", lambda *a: pytest.fail("expanded a grid with an unknown key"))
    sweep = {"method": "rtn", "bits": [2, 3, 4, 5, 6, 7, 8, 2, 3, 4], "group_size": list(range(16, 176, 16)),
             "symmetric": [True, False] * 5, "bitz": list(range(10)), "foo": list(range(10))}
    with pytest.raises(ValueError, match=r"f.toml: \[\[sweep\]\] #1: run 'rtn-w2-g16-sym-bitz0-foo0': "
                                         r"unknown config key\(s\) 'bitz', 'foo'"):
        _exp(sweep)


def test_a_grid_past_the_cap_fails_naming_the_sweep_and_its_size():
    from quantlab.runs.sweep import MAX_SWEEP_RUNS

    sweep = {"method": "rtn", "bits": [4, 8], "exclude": [[f"x{i}"] for i in range(MAX_SWEEP_RUNS // 2 + 1)]}
    with pytest.raises(ValueError, match=r"f.toml: \[\[sweep\]\] #1: the grid has 10,002 runs \(bits 2 x exclude "
                                         r"5001\), more than the 10,000 a sweep may expand to"):
        _exp(sweep)


def test_a_10k_grid_is_parsed_once_per_run_and_in_linear_time(monkeypatch):
    import time

    from quantlab.runs import experiment

    calls, make_config = [], experiment.make_config
    monkeypatch.setattr(experiment, "make_config", lambda table: calls.append(1) or make_config(table))
    sweep = {"method": "rtn", "bits": [4, 5, 6, 7, 8], "symmetric": [True, False],
             "group_size": list(range(16, 176, 16)), "exclude": [[f"x{i}"] for i in range(100)]}
    start = time.perf_counter()
    exp = _exp(sweep)
    seconds = time.perf_counter() - start
    assert len(exp.runs) == 10_000 and len({r.name for r in exp.runs}) == 10_000
    assert len(calls) == 10_001  # the first combination before expanding, then each run once (was: twice each)
    assert seconds < 5, f"10,000 runs took {seconds:.1f} s to parse (0.5 s expected; quadratic was 6 s)"
