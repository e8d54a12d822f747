"""ONNX Runtime export of GPTQ-quantized SmolLM2-135M (slow, ~1 min on 2 cores): logits parity with the simulated model.

The real model cut to its first 4 decoder blocks (real weights, embedding and head; exporting all 30 only costs
time): GPTQ on 4 seeded validation windows of 256 tokens, int4 g64 asymmetric on blocks 0-1 and int8 per-channel
symmetric on blocks 2-3 (one export covers both MatMulNBits widths). Reference: the simulated PyTorch model on 2
held-out test windows of 128 tokens. Tolerance: relative RMS of the logits <= 1e-4 at accuracy_level 0 (the same
dequantized weights, another fp32 summation order; measured ~2e-6 on the whole model), top-1 agreement 100%.
"""
import pytest
import torch
from torch import nn

import quantlab
from quantlab.backends.ort import PARITY_RMS_TOLERANCE, export_onnxruntime
from quantlab.models.data import calibration_windows, eval_windows, load_token_ids

pytestmark = [pytest.mark.slow, pytest.mark.needs_model("smollm2-135m")]

GPTQ = {"method": "gptq", "bits": 4, "group_size": 64, "symmetric": False,
        "overrides": [{"pattern": "model.layers.[23].*", "bits": 8, "group_size": "channel", "symmetric": True}]}


def test_gptq_smollm2_exports_to_ort_within_tolerance(wikitext_dir, tmp_path):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    model.model.layers = nn.ModuleList(model.model.layers[:4])
    model.config.num_hidden_layers = 4
    val, _ = load_token_ids("wikitext2", "validation", tok, data_dir=wikitext_dir)
    test, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    calib = [w[None] for w in calibration_windows(val, 4, 256, seed=0)]
    quantlab.quantize(model, quantlab.make_config(GPTQ), calibration=calib)
    ids = eval_windows(test, 128, 2)
    ort_model, summary = export_onnxruntime(model, tmp_path / "model.onnx", ids)
    assert summary["backend_kernels"] == "matmul_nbits:28" and summary["ort_float_layers"] == 0
    assert PARITY_RMS_TOLERANCE["weight_only_acc0"] == 1e-4 and summary["export_parity_ok"]
    assert summary["export_parity_logits_rel_rms"] <= 1e-4 and summary["export_parity_top1_agree"] == 1.0
    # the decode path: one token on the cache of 127 equals the 128-token forward's last logits
    first = ort_model(ids[:, :127], use_cache=True, logits_to_keep=1)
    step = ort_model(ids[:, 127:], use_cache=True, past_key_values=first.past_key_values).logits[:, -1]
    with torch.inference_mode():
        simulated = model(ids, use_cache=False).logits[:, -1]
    assert ((step - simulated).norm() / simulated.norm()).item() <= 1e-4
