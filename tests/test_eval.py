"""Perplexity vs a hand-written loop, KL of a model with itself, latency and weight stats."""
import math

import pytest
import torch

import quantlab
from quantlab.eval import measure_latency, perplexity, reference_logprobs, weight_stats


def _windows(n=3, t=24):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(0))


def test_perplexity_equals_reference_loop(tiny_model):
    model, _ = tiny_model
    windows = _windows()
    nlls = []
    with torch.no_grad():
        for w in windows:  # the GPTQ code's loop: mean loss per window, averaged, exp
            logits = model(w[None]).logits[0]
            nlls.append(torch.nn.functional.cross_entropy(logits[:-1], w[1:]).item())
    ref = math.exp(sum(nlls) / len(nlls))
    got = perplexity(model, windows, progress=False)
    assert got["ppl"] == pytest.approx(ref, rel=1e-5)
    assert got["predicted_tokens"] == 3 * 23


def test_kl_of_model_with_itself_is_zero(tiny_model):
    model, _ = tiny_model
    windows = _windows()
    ref = reference_logprobs(model, windows[:2], progress=False)
    got = perplexity(model, windows, ref, progress=False)
    assert abs(got["kl_mean"]) < 1e-6 and got["top1_agree"] == 1.0 and got["kl_tokens"] == 2 * 24


def test_kl_grows_with_coarser_quantization(tiny_model_dir):
    kls = []
    for bits in (8, 4, 2):
        model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
        ref = reference_logprobs(model, _windows(), progress=False)
        quantlab.quantize(model, quantlab.RTNConfig(bits=bits, group_size=32))
        kls.append(perplexity(model, _windows(), ref, progress=False)["kl_mean"])
    assert 0 < kls[0] < kls[1] < kls[2]


def test_latency_reports_percentiles_and_token_counts(tiny_model):
    model, _ = tiny_model
    r = measure_latency(model, _windows(1, 16), new_tokens=5, warmup=1, repeats=3)
    assert r["prefill_ms_p50"] <= r["prefill_ms_p90"] and r["decode_ms_per_token_p50"] <= r["decode_ms_per_token_p90"]
    assert r["decode_tokens"] == 5 and r["prefill_tokens"] == 16 and r["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="new_tokens >= 0, got 3 and -1"):
        measure_latency(model, _windows(1, 16), new_tokens=-1)
    prefill_only = measure_latency(model, _windows(2, 16), new_tokens=0, repeats=2)
    assert prefill_only["batch_size"] == 2 and "decode_ms_per_token_p50" not in prefill_only


def test_weight_stats_count_tied_embeddings_once_and_real_codes(tiny_model):
    model, _ = tiny_model
    fp = weight_stats(model)
    unique = sum(p.numel() for p in model.parameters()) * 4  # parameters() yields the tied tensor once
    assert fp["weight_bytes"] == unique + sum(b.nbytes for b in model.buffers())
    quantlab.quantize(model, quantlab.RTNConfig(bits=4, group_size=32, symmetric=False))
    q = weight_stats(model)
    numel = sum(m.in_features * m.out_features for m in quantlab.core.lifecycle.quant_linears(model).values())
    # 4-bit codes + fp16 scale + uint8 zero per 32 weights = 4.75 bits
    assert q["bits_per_weight"] == pytest.approx(4 + 16 / 32 + 8 / 32)
    assert q["quant_layer_bytes"] == numel * 4.75 / 8
    assert fp["weight_bytes"] - q["weight_bytes"] == numel * 4 - q["quant_layer_bytes"]
