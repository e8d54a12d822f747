"""QAT on SmolLM2-135M (slow, ~1-2 min): a few LSQ steps beat RTN at w3 g64; convert is exact.

Training: 6 steps x 256 tokens from seeded validation windows, distillation from the fp32
model, in float32 (the default): bf16 autocast is covered on the tiny model (test_qat.py), and on a CPU
without native bf16 (AVX2) it made this test ~11x slower (264 s against 23 s, emulated AVX2).
Evaluation: perplexity on the first 2 test windows of 512 tokens.
"""
import copy

import pytest
import torch

import quantlab
from quantlab.models.data import calibration_windows, eval_windows, load_token_ids

pytestmark = [pytest.mark.slow, pytest.mark.needs_model("smollm2-135m")]

RTN3 = {"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}


def test_smollm2_qat_lsq_beats_rtn_at_w3_g64_and_converts_exactly(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    val, _ = load_token_ids("wikitext2", "validation", tok, data_dir=wikitext_dir)
    windows, train = eval_windows(ids, 512, max_windows=2), calibration_windows(val, 6, 256, seed=0)

    rtn = copy.deepcopy(model)
    quantlab.quantize(rtn, quantlab.make_config(RTN3))
    rtn_ppl = quantlab.perplexity(rtn, windows, progress=False)["ppl"]
    del rtn

    config = quantlab.make_config({"method": "qat", "base": RTN3, "steps": 6, "seq_len": 256, "lr": 5e-5,
                                   "scale_lr": 1e-3, "dtype": "float32", "warmup_steps": 1})
    method, qat = quantlab.get_method(config), copy.deepcopy(model)
    method.prepare(qat, config)
    stats = method.train(qat, config, train, teacher=model, progress=False)
    with torch.no_grad():
        fake = qat(windows[:1, :128]).logits
    method.convert(qat, config)
    with torch.no_grad():
        frozen = qat(windows[:1, :128]).logits
    assert torch.equal(fake, frozen)  # atol = 0 on the real model too (fp32 eval)
    qat_ppl = quantlab.perplexity(qat, windows, progress=False)["ppl"]
    assert stats["train_tokens"] == 6 * 256
    assert qat_ppl < 0.9 * rtn_ppl, (qat_ppl, rtn_ppl)  # RTN w3 g64 is ~+200% ppl; 6 steps recover >= 10% of it
