"""Sensitivity: suffix replay equals the full model, the cache makes reruns free, CSV/PNG, validation split."""
import copy

import pandas as pd
import pytest
import torch

import quantlab
from quantlab import make_config
from quantlab.cli import main
from quantlab.mixed import sensitivity
from quantlab.mixed.plot import write_sensitivity
from quantlab.mixed.sensitivity import SuffixEvaluator, make_units, sweep
from quantlab.models.data import eval_windows, tokenize

W4 = {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}
W2 = {"method": "rtn", "bits": 2, "group_size": 32, "symmetric": False}


@pytest.fixture()
def setup(tiny_model, tiny_model_dir):
    model, tok = tiny_model
    ids = tokenize((tiny_model_dir / "sample.txt").read_text(), tok)
    return model, eval_windows(ids, 32, 3)


def test_suffix_replay_equals_quantizing_the_full_model(setup):
    model, windows = setup
    ev = SuffixEvaluator(model, windows, progress=False)
    cfg = make_config(W2)
    units = make_units(model, cfg)
    for unit in (units[0], units[8], units[13]):  # block 0 (full forward), block 1 (replayed from stored input)
        got = sensitivity._evaluate_unit(ev, unit, cfg)
        q = copy.deepcopy(model)
        quantlab.quantize(q, make_config({**W2, "include": list(unit.layers)}))
        ref = quantlab.perplexity(q, windows, ev.reference, progress=False)
        # the evaluator and perplexity() share eval.perplexity.window_log_probs' ops: the same numbers
        assert got["kl_mean"] == pytest.approx(ref["kl_mean"], rel=1e-5, abs=1e-9)
        assert got["nll_mean"] == pytest.approx(ref["nll_mean"], rel=1e-6)
        assert got["kl_mean"] > 0
    # the float model is untouched after the sweep (every layer swapped back)
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n in {u.name for u in units})
    assert sensitivity._evaluate_unit(ev, units[0], make_config({**W2, "bits": 8}))["kl_mean"] < got["kl_mean"]


def test_cache_makes_a_rerun_free_and_resumes(setup, tmp_path, monkeypatch):
    model, windows = setup
    cache = tmp_path / "s.jsonl"
    calls = []
    real = SuffixEvaluator.measure
    monkeypatch.setattr(SuffixEvaluator, "measure", lambda self, start: calls.append(start) or real(self, start))
    rows = sweep(model, [make_config(W4), make_config(W2)], windows, cache_path=cache, progress=False)
    assert len(rows) == 2 * 14 and len(calls) == 28
    assert len(cache.read_text().splitlines()) == 28

    monkeypatch.setattr(sensitivity, "SuffixEvaluator", None)  # a full cache must not even build the reference
    again = sweep(model, [make_config(W4), make_config(W2)], windows, cache_path=cache, progress=False)
    assert len(calls) == 28 and again == rows

    monkeypatch.setattr(sensitivity, "SuffixEvaluator", SuffixEvaluator)
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:10]) + "\n" + lines[10][:15])  # interrupted mid-line after 10 units
    resumed = sweep(model, [make_config(W4), make_config(W2)], windows, cache_path=cache, progress=False)
    assert len(calls) == 28 + 18 and [r["kl_mean"] for r in resumed] == pytest.approx([r["kl_mean"] for r in rows])
    other = sweep(model, [make_config({**W4, "group_size": 16})], windows[:2], cache_path=cache, progress=False)
    assert len(calls) == 28 + 18 + 14 and len(other) == 14  # new grid or windows: a new key


def test_csv_and_png_for_each_granularity(setup, tmp_path):
    model, windows = setup
    for granularity, units in (("layer", 14), ("type", 7), ("block", 2)):
        rows = sweep(model, [make_config(W4), make_config(W2)], windows, granularity, progress=False)
        df = write_sensitivity(rows, tmp_path / f"s_{granularity}")
        csv = pd.read_csv(tmp_path / f"s_{granularity}.csv")
        assert len(csv) == 2 * units and set(csv["candidate"]) == {"w4 g32 asym", "w2 g32 asym"}
        assert csv["params"].sum() == 2 * sum(m.weight.numel() for n, m in model.named_modules()
                                               if type(m) is torch.nn.Linear and n != "lm_head")
        png = (tmp_path / f"s_{granularity}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
        assert (df.groupby("unit")["kl_mean"].apply(lambda s: s.iloc[1] > s.iloc[0])).all()  # 2-bit hurts more
    with pytest.raises(ValueError, match="no sensitivity rows"):
        write_sensitivity([], tmp_path / "empty")
    assert not (tmp_path / "empty.png").exists()


def test_only_rtn_configs_and_known_granularities(setup):
    model, windows = setup
    with pytest.raises(ValueError, match="sensitivity needs an 'rtn' config .* got method 'gptq'"):
        sweep(model, [make_config({"method": "gptq"})], windows)
    with pytest.raises(ValueError, match="unknown granularity 'row'; known: layer, type, block"):
        sweep(model, [make_config(W4)], windows, granularity="row")


def test_cli_reads_the_validation_split_never_test(tiny_model_dir, tmp_path, monkeypatch):
    from quantlab.models import data

    seen = []
    text = (tiny_model_dir / "sample.txt").read_text()

    def fake_load(dataset, split, tokenizer, data_dir=None, cache_dir=None):
        seen.append(split)
        return tokenize(text, tokenizer), f"fake:{split}"

    monkeypatch.setattr(data, "load_token_ids", fake_load)
    argv = ["-q", "sensitivity", str(tiny_model_dir), "--bits", "3", "--group-size", "32", "--asym",
            "--windows", "2", "--seq-len", "32", "--reports-dir", str(tmp_path), "--name", "tiny"]
    assert main(argv) == 0
    assert seen == ["validation"]
    csv = pd.read_csv(tmp_path / "tiny.sensitivity.csv")
    assert len(csv) == 14 and set(csv["split"]) == {"validation"} and set(csv["windows"]) == {2}
    png = (tmp_path / "tiny.sensitivity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png.endswith(b"IEND\xaeB`\x82")  # a whole PNG, not just a file
    assert main(argv[:-4] + ["--split", "test", "--reports-dir", str(tmp_path)]) == 1  # refused, clear error
    assert seen == ["validation"]


def test_mixed_cli_writes_an_experiment_the_runner_accepts(setup, tiny_model_dir, tmp_path):
    from quantlab.runs import runner
    from quantlab.runs.experiment import load_experiment

    model, windows = setup
    cands = [W2, W4, {"method": "rtn", "bits": 8, "symmetric": False}]
    write_sensitivity(sweep(model, [make_config(c) for c in cands], windows, progress=False), tmp_path / "t.sensitivity")
    exp_path = tmp_path / "t.toml"
    exp_path.write_text(
        "# header comment kept\nname = \"t\"\n"
        f"model = {str(tiny_model_dir)!r}\ndevice = \"cpu\"\n"
        f"[eval]\ndataset = {str(tiny_model_dir / 'sample.txt')!r}\nseq_len = 32\nmax_windows = 2\nkl_windows = 2\n"
        "latency = false\n[[run]]\nname = \"fp32\"\nmethod = \"none\"\n"
        "[[run]]\nname = \"mixed-3b\"\nmethod = \"rtn\"\n")  # a stale mixed run of the same name is replaced
    argv = ["mixed", str(exp_path), "--target-bits", "3", "4.5", "--sensitivity", str(tmp_path / "t.sensitivity.csv")]
    assert main(argv) == 0
    text = exp_path.read_text()
    assert text.startswith("# header comment kept\n") and "overrides = [" in text
    exp = load_experiment(exp_path)
    assert [r.name for r in exp.runs] == ["fp32", "mixed-3b", "mixed-4.5b"]
    df = runner.run_experiment(exp, tmp_path / "reports", progress=False)
    bits = dict(zip(df["run"], df["bits_per_weight"]))
    assert bits["mixed-3b"] <= 3.0 and 4.0 < bits["mixed-4.5b"] <= 4.5  # true bits (scales, zeros) within budget
    assert "overrides" in df.set_index("run").loc["mixed-4.5b", "scheme"]
    assert main(["mixed", str(exp_path), "--target-bits", "2", "--sensitivity", str(tmp_path / "t.sensitivity.csv")]) == 1
    # a size budget: the quantized layers' codes + scales + zeros within the MiB asked
    sens = pd.read_csv(tmp_path / "t.sensitivity.csv")
    params = sens.drop_duplicates("unit")["params"].sum()
    mib = 3.5 * params / 8 / 2**20
    assert main(["mixed", str(exp_path), "--target-mib", f"{mib:.6f}", "--sensitivity",
                 str(tmp_path / "t.sensitivity.csv")]) == 0
    exp = load_experiment(exp_path)
    name = f"mixed-{float(f'{mib:.6f}'):g}mib"
    assert name in [r.name for r in exp.runs]
    df = runner.run_experiment(exp, tmp_path / "reports", progress=False).set_index("run")
    assert 3.0 < df.loc[name, "bits_per_weight"] and df.loc[name, "bits_per_weight"] * params / 8 <= mib * 2**20
    assert main(["mixed", str(exp_path), "--sensitivity", str(tmp_path / "t.sensitivity.csv")]) == 1  # no target
