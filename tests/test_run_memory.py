"""Experiment rows: memory columns that mean what they say ([eval] memory), and the runner's KL reference."""
from __future__ import annotations

import copy
import sys

import pandas as pd
import pytest
import torch

import quantlab
from quantlab.backends.serialize import load_quantized, save_quantized
from quantlab.runs import evaluate, runner
from quantlab.runs.experiment import EvalProtocol, parse_experiment

PPL = sys.modules["quantlab.eval.perplexity"]  # the module (quantlab.eval exports the function by that name)


def _experiment(model_dir, runs, **eval_overrides):
    eval_table = {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3, "kl_windows": 2,
                  "latency": False, **eval_overrides}
    return parse_experiment({"name": "tiny_mem", "model": str(model_dir), "device": "cpu", "eval": eval_table,
                             "run": runs})


def test_memory_option_validates_and_keeps_default_run_keys(tiny_model_dir):
    runs = [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 32}]
    plain, spelled = _experiment(tiny_model_dir, runs), _experiment(tiny_model_dir, runs, memory="none")
    isolated = _experiment(tiny_model_dir, runs, memory="isolated")
    cpu = torch.device("cpu")
    key = runner.run_key(plain, plain.runs[0], cpu)
    assert key == runner.run_key(spelled, spelled.runs[0], cpu)  # the default is not hashed: old keys stay
    assert key != runner.run_key(isolated, isolated.runs[0], cpu)  # its rows carry other columns
    with pytest.raises(ValueError, match="eval.memory 'rss' unknown; known: none, isolated"):
        EvalProtocol(memory="rss")
    with pytest.raises(ValueError, match="memory = 'isolated' needs metric = 'perplexity'.*got metric 'embedding'"):
        EvalProtocol(metric="embedding", memory="isolated")


def test_isolated_memory_rows(tiny_model_dir, tmp_path):
    """Each row's peak comes from its own fresh process (the float checkpoint; the saved codes exported to
    torchao), and says so. Reference: the child's loaded RSS, a lower bound of its peak."""
    runs = [{"name": "fp32", "method": "none"},
            {"name": "w8-torchao", "method": "rtn", "bits": 8, "backend": "torchao"}]
    df = runner.run_experiment(_experiment(tiny_model_dir, runs, memory="isolated"), tmp_path, progress=False)
    csv = pd.read_csv(tmp_path / "tiny_mem.csv")
    for _, row in csv.iterrows():
        assert row["peak_rss_mib"] >= row["loaded_rss_mib"] > 100, row["run"]  # torch alone is > 100 MiB
        assert row["memory_probe"].startswith("isolated process: load the "), row["memory_probe"]
        assert "one forward of 32 tokens" in row["memory_probe"]
    assert "float checkpoint (float32)" in csv.loc[0, "memory_probe"]
    assert "saved quantized model (backend torchao)" in csv.loc[1, "memory_probe"]
    assert list(df["run"]) == ["fp32", "w8-torchao"]


def test_a_model_save_quantized_cannot_write_says_so_in_the_row(tiny_model_dir, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("cannot save activation quantizer Foo; known: DynamicActQuant, StaticActQuant")

    monkeypatch.setattr("quantlab.backends.serialize.save_quantized", refuse)
    runs = [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 32}]
    df = runner.run_experiment(_experiment(tiny_model_dir, runs, memory="isolated"), tmp_path, progress=False)
    row = df.iloc[0]
    assert row["memory_probe"].startswith("not measured: save_quantized cannot write this model (cannot save")
    assert "peak_rss_mib" not in df.columns and row["ppl"] > 0  # the run's other numbers stand


@pytest.mark.parametrize("spec", [
    {"method": "smoothquant", "base": {"method": "static"}},  # explicit input scales + static activation qparams
    {"method": "qat", "base": {"method": "static"}, "steps": 2, "seq_len": 32, "batch_size": 1},  # QAT, converted
    {"method": "qat", "base": {"method": "rtn", "bits": 4, "group_size": 32}, "learn_scales": True, "steps": 2,
     "seq_len": 32, "batch_size": 1},
], ids=["smoothquant-static", "qat-static", "qat-lsq-rtn"])
def test_what_the_isolated_probe_saves_loads_bitwise(tiny_model_dir, tmp_path, spec):
    """The configs the isolated probe must write: save_quantized + load_quantized give identical logits (atol 0)."""
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    teacher = copy.deepcopy(model)
    windows = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    config = quantlab.make_config(spec)
    quantlab.quantize(model, config, calibration=windows, training=windows if spec["method"] == "qat" else None,
                      teacher=teacher, progress=False)
    save_quantized(model, tmp_path / "q", config, str(tiny_model_dir))
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, load_quantized(tmp_path / "q")(ids).logits)


def test_cuda_peak_is_reset_right_before_the_measured_phase(tiny_model_dir, tmp_path, monkeypatch):
    """Order of the runner's calls: quantize, isolated probe, export, then the peak reset, and only then the
    evaluation and latency (the measured phase): the float model's latency first (the paired reference of the
    speed ratio), then the quantized model's."""
    calls = []

    def record(name, real):
        def call(*a, **k):
            quantized = name == "measure_latency" and any("Quant" in type(m).__name__ for m in a[0].modules())
            calls.append(name + (" quantized" if quantized else " float" if name == "measure_latency" else ""))
            return real(*a, **k)
        return call

    for name in ("quantize", "_isolated_memory", "export_for_run", "reset_peak_memory", "perplexity",
                 "measure_latency"):
        monkeypatch.setattr(evaluate, name, record(name, getattr(evaluate, name)))
    monkeypatch.setattr(evaluate, "isolated_run_memory", lambda *a, **k: {})  # the order is the point, not the probe
    runs = [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 32}]
    exp = _experiment(tiny_model_dir, runs, memory="isolated", latency=True, prefill_tokens=8, decode_tokens=2,
                      latency_repeats=1)
    runner.run_experiment(exp, tmp_path, progress=False)
    assert calls == ["quantize", "_isolated_memory", "export_for_run", "reset_peak_memory", "perplexity",
                     "measure_latency float", "measure_latency quantized"]


def test_runner_kl_is_the_stored_reference_kl_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """The runner passes the float model as the KL reference (nothing stored); reference: the list form
    computed from the same float model on the same windows. Equal with atol 0."""
    seen = []

    def checked(model, windows, reference, progress=True, kl_windows=None, dtype=None):
        live = PPL.perplexity(model, windows, reference, progress, kl_windows=kl_windows, dtype=dtype)
        assert isinstance(reference, torch.nn.Module) and kl_windows == 2
        stored = PPL.perplexity(model, windows, PPL.reference_logprobs(reference, windows[:kl_windows], False), False)
        seen.append((live["kl_mean"], stored["kl_mean"], live["top1_agree"], stored["top1_agree"]))
        return live

    monkeypatch.setattr(evaluate, "perplexity", checked)
    runs = [{"name": "fp32", "method": "none"}, {"name": "w3", "method": "rtn", "bits": 3, "group_size": 32}]
    df = runner.run_experiment(_experiment(tiny_model_dir, runs), tmp_path, progress=False)
    assert len(seen) == 2 and all(a == b and c == d for a, b, c, d in seen)
    assert df["kl_mean"].iloc[0] == 0 and df["kl_mean"].iloc[1] > 0 and df["kl_tokens"].iloc[1] == 2 * 32
    assert df["kl_reference"].iloc[1].startswith("float model run on each KL window")


def test_a_run_that_modifies_the_float_model_is_an_error(tiny_model_dir, tmp_path, monkeypatch):
    """The float model is the KL reference of every run: a run that changes it in place must not pass silently."""
    real = evaluate.quantize

    def spoil(model, config, **kwargs):
        out = real(model, config, **kwargs)
        if getattr(config, "bits", None) == 4:
            with torch.no_grad():
                next(ctx_model[0].parameters()).mul_(1.0)  # in place: bumps the version, values unchanged
        return out

    ctx_model, real_context = [], runner.EvalContext

    def context(*args, **kwargs):
        ctx = real_context(*args, **kwargs)
        ctx_model.append(ctx.model)
        return ctx

    monkeypatch.setattr(runner, "EvalContext", context)
    monkeypatch.setattr(evaluate, "quantize", spoil)
    runs = [{"name": "fp32", "method": "none"}, {"name": "w4", "method": "rtn", "bits": 4, "group_size": 32}]
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed .*w4: the float model \(KL reference, baseline\) "
                                           r"was modified"):
        runner.run_experiment(_experiment(tiny_model_dir, runs), tmp_path, progress=False)


@pytest.mark.slow
def test_isolated_memory_of_smollm2_holds_the_forwards_logits(tmp_path):
    """Real model, one window. Reference for the lower bound: the forward's (512, 49152) fp32 logits (96 MiB)
    are alive at its peak, on top of the loaded model; the fixed-mmap allocator makes RSS follow live tensors."""
    # simulated backend: the model stays fp32 (torchao's int4 kernels would run it, logits included, in bf16)
    runs = [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}]
    exp = parse_experiment({"name": "smol_mem", "model": "smollm2-135m", "device": "cpu", "run": runs,
                            "eval": {"seq_len": 512, "max_windows": 1, "kl_windows": 1, "latency": False,
                                     "memory": "isolated"}})
    row = runner.run_experiment(exp, tmp_path, progress=False).iloc[0]
    logits_mib = 512 * 49152 * 4 / 2**20
    assert row["peak_rss_mib"] - row["loaded_rss_mib"] >= logits_mib, row["memory_probe"]
    assert row["loaded_rss_mib"] > row["weight_mib"] and row["peak_rss_mib"] < row["loaded_rss_mib"] + 1024
    assert "saved quantized model (backend simulated)" in row["memory_probe"]


def test_calibrating_rows_carry_the_peak_rss_of_quantizing(tiny_model_dir, tmp_path, monkeypatch):
    """Reference: a method that holds 256 MiB more while it calibrates raises quantize_peak_rss_mib over an identical
    run that does not (VmHWM is reset before each quantize) by that, less a tolerance of 106 MiB for the process' own
    RSS moving between the two runs (in a whole-suite run it moved by -14 MiB); rtn, which calibrates nothing, has no
    such column."""
    from quantlab.methods.gptq import GPTQ

    if not evaluate.reset_peak_rss():
        pytest.skip("this OS cannot reset the peak RSS (Linux /proc/self/clear_refs)")
    runs = [{"name": "rtn", "method": "rtn", "bits": 4, "group_size": 32},
            {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32}]
    cal = {"dataset": str(tiny_model_dir / "sample.txt"), "num_samples": 2, "seq_len": 32}

    def experiment():
        exp = _experiment(tiny_model_dir, runs)
        return parse_experiment({"name": "tiny_mem", "model": str(tiny_model_dir), "device": "cpu",
                                 "eval": {k: getattr(exp.eval, k) for k in ("dataset", "seq_len", "max_windows",
                                                                           "kl_windows", "latency")},
                                 "calibration": cal, "run": runs})

    plain = runner.run_experiment(experiment(), tmp_path / "plain", progress=False).set_index("run")
    calibrate = GPTQ.calibrate

    def hungry(self, *args, **kwargs):
        ballast = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
        out = calibrate(self, *args, **kwargs)
        assert float(ballast[-1]) == 1.0
        return out

    monkeypatch.setattr(GPTQ, "calibrate", hungry)
    fat = runner.run_experiment(experiment(), tmp_path / "fat", progress=False).set_index("run")
    assert "quantize_peak_rss_mib" not in plain.columns or pd.isna(plain.loc["rtn", "quantize_peak_rss_mib"])
    assert fat.loc["gptq", "quantize_peak_rss_mib"] >= plain.loc["gptq", "quantize_peak_rss_mib"] + 256 - 106
