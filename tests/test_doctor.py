"""`quantlab doctor`: each check fires on a crafted bad tiny model (a NaN weight, a parameter on meta, mixed dtypes,
seq_len beyond the positions, an injected activation outlier, too little memory) and stays silent on the healthy
one; the CLI's exit codes; the real SmolLM2 (slow): no errors, its down_proj outliers named."""
import math

import pytest
import torch
from torch import nn

from quantlab import doctor
from quantlab.cli import main
from quantlab.util import device as device_util

CPU = torch.device("cpu")


def statuses(rows):
    return {r.name: r.status for r in rows}


def test_healthy_tiny_model_has_no_error(tiny_model):
    model, tok = tiny_model
    rows = doctor.diagnose(model, tok, CPU, seq_len=128, matmul_budget_s=0.01)
    assert doctor.exit_code(rows) == 0, doctor.format_checks(rows)
    got = statuses(rows)
    for name in ("devices", "dtypes", "weights finite", "activations finite", "activation outliers", "positions",
                 "memory"):
        assert got[name] == "ok", doctor.format_checks(rows)


def test_nan_weight_names_the_layer(tiny_model):
    model, tok = tiny_model
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[3, 5] = math.nan
    check = doctor.finite_weights_check(model)
    assert check.status == "error" and "first: model.layers.1.self_attn.v_proj.weight (1 values)" in check.detail
    stats = doctor.forward_stats(model, doctor.probe_ids(model, tok))
    assert stats.first_nonfinite == "model.layers.1.self_attn.v_proj"  # the first module whose output is NaN
    assert doctor.finite_activations_check(stats).status == "error"
    assert doctor.exit_code(doctor.diagnose(model, tok, CPU, matmul_budget_s=0.01)) == 1


def test_meta_parameter_is_an_error_and_skips_the_forward(tiny_model):
    model, tok = tiny_model
    up = model.model.layers[0].mlp.up_proj
    up.weight = nn.Parameter(torch.empty_like(up.weight, device="meta"))
    check = doctor.placement_check(model)
    assert check.status == "error" and "1 tensor(s) on meta (no data), first: model.layers.0.mlp.up_proj.weight" in check.detail
    got = statuses(doctor.diagnose(model, tok, CPU, matmul_budget_s=0.01))
    assert got["devices"] == "error" and got["forward"] == "warn"  # skipped, not crashed


def test_mixed_dtypes_are_named_with_counts(tiny_model):
    model, tok = tiny_model
    model.model.layers[0].mlp.half()  # gate / up / down: 3 float16 weights among 22 float tensors
    check = doctor.dtype_check(model)
    assert check.status == "warn"
    assert "mixed: float32 19, float16 3; first not float32: model.layers.0.mlp.gate_proj.weight" in check.detail
    rows = doctor.diagnose(model, tok, CPU, matmul_budget_s=0.01)
    forward = next(r for r in rows if r.name == "forward")  # the mismatch breaks the forward: an error naming it
    assert forward.status == "error" and "dtype" in forward.detail.lower()


def test_seq_len_beyond_max_positions(tiny_model):
    config = tiny_model[0].config  # max_position_embeddings 256
    assert doctor.positions_check(config, 256).status == "ok"
    check = doctor.positions_check(config, 512)
    assert check.status == "error" and "seq_len 512 > max positions 256" in check.detail and "<= 256" in check.hint
    assert doctor.positions_check(config, None).status == "ok"


def test_sliding_window_limits():
    from transformers import Gemma3TextConfig, MistralConfig

    mistral = MistralConfig(sliding_window=64, max_position_embeddings=1024, num_hidden_layers=2)
    check = doctor.positions_check(mistral, 128)
    assert check.status == "warn" and "sliding window 64 on every layer" in check.detail
    gemma = Gemma3TextConfig(sliding_window=64, num_hidden_layers=6, max_position_embeddings=1024)
    check = doctor.positions_check(gemma, 128)  # 5 local + 1 global layer: by design
    assert check.status == "ok" and "5 of 6 layers slide over 64 tokens" in check.detail


def test_injected_activation_outlier_names_that_linear(tiny_model):
    model, tok = tiny_model
    healthy = doctor.outlier_check(doctor.forward_stats(model, doctor.probe_ids(model, tok)))
    assert healthy.status == "ok"
    with torch.no_grad():  # up_proj row 7 x 1000 -> input channel 7 of down_proj is ~1000x the others
        model.model.layers[0].mlp.up_proj.weight[7] *= 1000
    stats = doctor.forward_stats(model, doctor.probe_ids(model, tok))
    ratio, channel, _, _ = stats.outliers["model.layers.0.mlp.down_proj"]
    assert channel == 7 and ratio > doctor.OUTLIER_RATIO_WARN
    check = doctor.outlier_check(stats)
    assert check.status == "warn" and check.detail.split("worst: ")[1].startswith("model.layers.0.mlp.down_proj")
    assert f"> {doctor.OUTLIER_RATIO_WARN:g}x" in check.detail  # the threshold is stated


def test_memory_too_small_is_an_error_with_a_hint(tiny_model):
    config = tiny_model[0].config
    assert doctor.memory_check(config, 256, 1, "float32", CPU, free_bytes=2**30).status == "ok"
    check = doctor.memory_check(config, 256, 4, "float32", CPU, free_bytes=1000)
    assert check.status == "error" and "seq_len 128 needs" in check.hint and "batch 2" in check.hint
    assert "4-bit g64 weights" in check.hint


def test_bf16_slower_than_fp32_warns(monkeypatch):
    ms = {torch.float32: 1.0, torch.bfloat16: 3.0, torch.float16: 0.5}
    monkeypatch.setattr(device_util, "matmul_ms", lambda dtype, *a, **k: ms[dtype])
    got = statuses(doctor.half_precision_rows(CPU))
    assert got == {"bfloat16 matmul": "warn", "float16 matmul": "ok"}



def test_matmul_timer_restores_threads():
    threads = torch.get_num_threads()
    assert doctor.matmul_ms(torch.float32, CPU, 64, 0.01) > 0 and torch.get_num_threads() == threads  # timed on 1


def test_kernel_rows(monkeypatch):
    rows = {r.name: r for r in doctor.kernel_rows(CPU)}
    assert rows["kernel int4 g64 weight-only"].detail == "int4_cpu"  # backends/kernels.py's table
    assert rows["kernel fp8_e4m3 weight-only"].status == "warn" and "dequantizes" in rows["kernel fp8_e4m3 weight-only"].detail
    import quantlab.backends

    monkeypatch.setattr(quantlab.backends, "torchao_available", lambda: False)
    rows = doctor.kernel_rows(CPU)
    assert all(r.status == "warn" for r in rows) and "pip install torchao" in rows[0].hint


def test_ort_kernel_rows(monkeypatch):
    """backend onnxruntime's plan per scheme (backends/ort.py ort_kind): int4/int8 MatMulNBits, w8a8 MatMulInteger,
    3-bit a float MatMul (warned); without onnxruntime one warning naming the extra."""
    rows = {r.name: r for r in doctor.ort_kernel_rows()}
    assert rows["onnxruntime"].status == "ok" and "CPUExecutionProvider" in rows["onnxruntime"].detail
    assert rows["ort int4 g64 weight-only"].detail == "matmul_nbits"
    assert rows["ort int8 dynamic (w8a8)"].detail == "a8w8"
    assert rows["ort int3 g64 weight-only"].status == "warn" and "w3" in rows["ort int3 g64 weight-only"].detail
    import quantlab.backends.ort

    monkeypatch.setattr(quantlab.backends.ort, "ort_available", lambda: False)
    (row,) = doctor.ort_kernel_rows()
    assert row.status == "warn" and "quantlab[ort]" in row.hint


def test_mps_requested_without_mps(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert statuses(doctor.device_rows(torch.device("mps")))["mps"] == "error"
    assert main(["doctor", "--device", "mps"]) == 1
    assert "error  mps" in capsys.readouterr().out


def test_cli_exit_codes(tiny_model, tiny_model_dir, tmp_path, capsys):
    assert main(["doctor", str(tiny_model_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "0 error" in out and "activation outliers" in out
    model, tok = tiny_model
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = math.inf
    model.save_pretrained(tmp_path / "bad")
    tok.save_pretrained(tmp_path / "bad")
    assert main(["doctor", str(tmp_path / "bad"), "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "error  weights finite" in out and "model.layers.0.mlp.down_proj.weight" in out


def test_cli_experiment_seq_len_beyond_positions(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "long.toml"
    path.write_text(f'name = "long"\nmodel = "{tiny_model_dir}"\ndevice = "cpu"\n[eval]\n'
                    f'dataset = "{tiny_model_dir / "sample.txt"}"\nseq_len = 512\n[[run]]\nname = "fp32"\nmethod = "none"\n')
    assert main(["doctor", str(path)]) == 1
    assert "seq_len 512 > max positions 256" in capsys.readouterr().out


def test_cli_unknown_model_is_a_clear_error(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "no-such-model")]) == 1
    assert "built-in aliases: gemma3-270m, minilm-l6, smollm2-135m" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_has_no_error_and_down_proj_outliers():
    from quantlab.models.loading import load_model

    model, tok = load_model("smollm2-135m", device="cpu", progress=False)
    rows = doctor.diagnose(model, tok, CPU, seq_len=2048, matmul_budget_s=0.05)
    assert doctor.exit_code(rows) == 0, doctor.format_checks(rows)
    outliers = next(r for r in rows if r.name == "activation outliers")
    worst = outliers.detail.split("worst: ")[1]
    assert outliers.status == "warn" and "mlp.down_proj" in worst, outliers.detail
