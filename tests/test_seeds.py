"""seeds = [...]: calibration-dependent runs repeat per seed; the report shows mean ± std."""
import pandas as pd
import pytest
import torch

from quantlab.reporting.report import summarize_seeds
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment

RUNS = [{"name": "fp32", "method": "none"}, {"name": "w4", "method": "rtn", "bits": 4, "group_size": 32},
        {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32, "symmetric": False}]


def _experiment(model_dir, runs=RUNS, **top):
    data = {"name": "tiny_seeds", "model": str(model_dir), "device": "cpu", "run": runs,
            "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 4, "kl_windows": 2,
                     "latency": False},
            "calibration": {"dataset": str(model_dir / "sample.txt"), "num_samples": 4, "seq_len": 32}, **top}
    return parse_experiment(data)


def test_experiment_seeds_expand_only_calibrated_runs_and_keep_other_keys(tiny_model_dir):
    plain, seeded = _experiment(tiny_model_dir), _experiment(tiny_model_dir, seeds=[0, 1, 2])
    assert [r.name for r in seeded.runs] == ["fp32", "w4", "gptq-seed0", "gptq-seed1", "gptq-seed2"]
    assert [r.seed for r in seeded.runs] == [None, None, 0, 1, 2] and seeded.runs[3].group == "gptq"
    cpu = torch.device("cpu")
    for a, b in zip(plain.runs[:2], seeded.runs[:2]):  # runs that do not repeat keep their finished rows
        assert runner.run_key(plain, a, cpu) == runner.run_key(seeded, b, cpu)
    keys = {runner.run_key(seeded, r, cpu) for r in seeded.runs}
    assert len(keys) == 5 and runner.run_key(plain, plain.runs[2], cpu) not in keys


def test_run_level_seeds(tiny_model_dir):
    runs = [RUNS[0], {**RUNS[1], "seeds": [3, 4]}, RUNS[2]]
    exp = _experiment(tiny_model_dir, runs=runs)
    assert [r.name for r in exp.runs] == ["fp32", "w4-seed3", "w4-seed4", "gptq"]  # asked for, so repeated


@pytest.mark.parametrize("seeds,match", [
    ([], "non-empty list of integers"), ([1, 1], r"seeds \[1, 1\] repeat a value"), (["a"], "integers >= 0"),
    ([-1], "integers >= 0"), (3, "non-empty list"),
])
def test_bad_seeds(tiny_model_dir, seeds, match):
    with pytest.raises(ValueError, match=match):
        _experiment(tiny_model_dir, seeds=seeds)
    with pytest.raises(ValueError, match=f"run 'gptq': .*{match}"):
        _experiment(tiny_model_dir, runs=[RUNS[0], {**RUNS[2], "seeds": seeds}])


def test_seeded_runs_draw_their_own_calibration_and_report_mean_std(tiny_model_dir, tmp_path):
    exp = _experiment(tiny_model_dir, seeds=[0, 1])
    df = runner.run_experiment(exp, tmp_path, progress=False)
    seeded = df[df["run_group"] == "gptq"]
    assert seeded["seed"].tolist() == [0, 1] and seeded["run"].tolist() == ["gptq-seed0", "gptq-seed1"]
    assert seeded["ppl"].iloc[0] != seeded["ppl"].iloc[1]  # different calibration windows, different result
    summary, per_seed = summarize_seeds(pd.read_csv(tmp_path / "tiny_seeds.csv"))
    row = summary.set_index("run").loc["gptq"]
    assert row["ppl"] == pytest.approx(seeded["ppl"].mean(), rel=1e-12)
    assert row["ppl_std"] == pytest.approx(seeded["ppl"].std(ddof=1), rel=1e-9) and row["n_seeds"] == 2
    assert list(summary["run"]) == ["fp32", "w4", "gptq"] and len(per_seed) == 2
    md = (tmp_path / "tiny_seeds.md").read_text()
    gptq_line = next(line for line in md.splitlines() if line.startswith("| gptq |"))
    assert f"{row['ppl']:.3f} ± {row['ppl_std']:.3f}" in gptq_line.replace("**", "")
    assert "**Seeds.**" in md and "| gptq-seed1 |" in md
    w4 = df.set_index("run").loc["w4"]
    w4_line = next(line for line in md.splitlines() if line.startswith("| w4 |"))
    assert bool(w4["ppl_delta_excludes_zero"]) == ("✓" in w4_line)  # a single run beside a seed group keeps its mark
    assert f"[{w4['ppl_delta_ci_low']:+.2f}, {w4['ppl_delta_ci_high']:+.2f}]" in w4_line
