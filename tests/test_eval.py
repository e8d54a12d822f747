"""Perplexity vs a hand-written loop, KL of a model with itself, latency and weight stats."""
import math

import numpy as np
import pytest
import torch

import quantlab
from quantlab.eval import latency, measure_latency, perplexity, reference_logprobs, weight_stats


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


def test_kl_and_top1_match_a_hand_computed_reference(tiny_model):
    """KL(float || quantized) per token and top-1 agreement on the first 2 windows (every position),
    against float64 sums over softmaxes of the two models' logits; tolerance rel 1e-4 (fp32 logits)."""
    model, _ = tiny_model
    windows = _windows()
    ref = reference_logprobs(model, windows[:2], progress=False)
    with torch.no_grad():
        p_logits = [model(w[None]).logits[0].double() for w in windows[:2]]
    quantlab.quantize(model, quantlab.RTNConfig(bits=3, group_size=32))
    got = perplexity(model, windows, ref, progress=False)
    with torch.no_grad():
        q_logits = [model(w[None]).logits[0].double() for w in windows[:2]]
    kl, agree, tokens = 0.0, 0, 0
    for p, q in zip(p_logits, q_logits):  # (24, vocab) each
        logp, logq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
        kl += float((logp.exp() * (logp - logq)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        tokens += p.shape[0]
    assert got["kl_tokens"] == tokens == 2 * 24
    assert got["kl_mean"] == pytest.approx(kl / tokens, rel=1e-4) and got["kl_mean"] > 1e-4  # w3: measured 8e-4
    assert got["top1_agree"] == agree / tokens


def _quantized_and_float(tiny_model_dir, bits=4):
    float_model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    q, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(q, quantlab.RTNConfig(bits=bits, group_size=32))
    return q, float_model


def test_on_the_fly_reference_equals_the_stored_one_exactly(tiny_model_dir):
    """Reference: the precomputed list (reference_logprobs). The on-the-fly reference runs the same forward
    and log_softmax on the same window, so every output is bitwise equal (atol 0)."""
    q, float_model = _quantized_and_float(tiny_model_dir)
    windows = _windows(5, 24)
    stored = perplexity(q, windows, reference_logprobs(float_model, windows[:3], progress=False), progress=False,
                        batch_size=1)
    live = perplexity(q, windows, float_model, progress=False, kl_windows=3, batch_size=1)
    assert live["kl_reference_s"] >= 0
    for key in ("kl_mean", "top1_agree", "kl_tokens", "ppl", "window_nll"):
        assert live[key] == stored[key], key
    batched = perplexity(q, windows, float_model, progress=False, kl_windows=3, batch_size=4)  # other GEMM shapes
    assert batched["kl_mean"] == pytest.approx(stored["kl_mean"], rel=1e-3)  # KL: a small difference of logs
    assert batched["window_nll"] == pytest.approx(stored["window_nll"], rel=1e-6)
    assert live["kl_tokens"] == 3 * 24 and live["kl_mean"] > 0
    every = perplexity(q, windows, float_model, progress=False)  # kl_windows None: all windows
    assert every["kl_tokens"] == 5 * 24
    assert "kl_mean" not in perplexity(q, windows, float_model, progress=False, kl_windows=0)
    with pytest.raises(ValueError, match="kl_windows=2 applies to a reference model; with a list"):
        perplexity(q, windows, reference_logprobs(float_model, windows[:1], progress=False), kl_windows=2)
    with pytest.raises(ValueError, match="kl_windows must be an integer >= 0 or None.*got -1"):
        perplexity(q, windows, float_model, kl_windows=-1)


def test_loss_never_materialises_full_logits_and_kl_memory_is_per_batch(tiny_model_dir, monkeypatch):
    """Counted: the output head only ever sees `chunk` positions of a batch (never (T, V) logits), and at most
    two scorers (the model's and the reference's hidden states) are alive at once, whatever kl_windows is."""
    import sys
    import weakref

    ppl_module = sys.modules["quantlab.eval.perplexity"]
    q, float_model = _quantized_and_float(tiny_model_dir)
    windows = _windows(6, 48)
    seen, alive, peak = [], [], [0]
    real_init, real_logits = ppl_module._Scorer.__init__, ppl_module._Scorer.logits

    def init(self, model, ids):
        real_init(self, model, ids)
        alive.append(weakref.ref(self))
        peak[0] = max(peak[0], sum(r() is not None for r in alive))

    def logits(self, c0, c1):
        out = real_logits(self, c0, c1)
        seen.append(out.shape[1])
        return out

    monkeypatch.setattr(ppl_module._Scorer, "__init__", init)
    monkeypatch.setattr(ppl_module._Scorer, "logits", logits)
    for k in (1, 6):
        peak[0] = 0
        got = perplexity(q, windows, float_model, progress=False, kl_windows=k, batch_size=2, chunk=16)
        assert got["kl_tokens"] == k * 48 and peak[0] <= 2
    assert seen and max(seen) == 16  # 48 positions in chunks of 16


def test_batched_perplexity_equals_one_window_at_a_time(tiny_model_dir):
    """Batches of 1, 2, 4 and the auto batch give the same per-window NLL to 1e-6 relative, and the chunked loss
    equals F.cross_entropy on full logits."""
    q, _ = _quantized_and_float(tiny_model_dir)
    windows = _windows(5, 40)
    one = perplexity(q, windows, progress=False, batch_size=1)
    with torch.inference_mode():
        full = [torch.nn.functional.cross_entropy(q(w[None]).logits[0, :-1], w[1:], reduction="sum").item()
                for w in windows]
    assert one["window_nll"] == pytest.approx(full, rel=1e-6)
    for b in (2, 4, None):
        got = perplexity(q, windows, progress=False, batch_size=b, chunk=7)
        assert got["window_nll"] == pytest.approx(one["window_nll"], rel=1e-6), b
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1 or None .*got 0"):
        perplexity(q, windows, progress=False, batch_size=0)


def test_models_without_a_plain_head_take_the_full_logits_path(tiny_model_dir, monkeypatch):
    import sys

    from quantlab.eval.perplexity import split_head

    q, float_model = _quantized_and_float(tiny_model_dir)
    assert split_head(q) is not None  # the Llama head: hidden states -> lm_head
    windows = _windows(4, 24)
    split = perplexity(q, windows, float_model, progress=False, batch_size=2)
    q.config.final_logit_softcapping = 30.0  # e.g. Gemma-2: the head is no longer the whole story
    assert split_head(q) is None
    q.config.final_logit_softcapping = None
    monkeypatch.setattr(sys.modules["quantlab.eval.perplexity"], "split_head", lambda model: None)
    full = perplexity(q, windows, float_model, progress=False, batch_size=2)
    assert full["window_nll"] == pytest.approx(split["window_nll"], rel=1e-6)
    assert full["kl_mean"] == pytest.approx(split["kl_mean"], rel=1e-3)


def test_auto_batch_size_follows_free_memory(tiny_model):
    from quantlab.eval.perplexity import auto_batch_size

    model, _ = tiny_model
    assert auto_batch_size(model, 512, 100, free_bytes=1) == 1
    assert auto_batch_size(model, 512, 100, free_bytes=1 << 40) == 8
    assert auto_batch_size(model, 512, 3, free_bytes=1 << 40) == 2  # never more than the windows


def test_kl_grows_with_coarser_quantization(tiny_model_dir):
    kls = []
    for bits in (8, 4, 2):
        model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
        ref = reference_logprobs(model, _windows(), progress=False)
        quantlab.quantize(model, quantlab.RTNConfig(bits=bits, group_size=32))
        kls.append(perplexity(model, _windows(), ref, progress=False)["kl_mean"])
    assert 0 < kls[0] < kls[1] < kls[2]


class _ScriptedClock:
    """Stands in for latency's `time`: the clock moves only while the model runs, by scripted durations
    (ms), one per forward: prefill calls (more than one token) and decode steps (one token)."""

    def __init__(self, prefill_ms, decode_ms):
        self.now, self.prefill_ms, self.decode_ms = 0.0, list(prefill_ms), list(decode_ms)

    def perf_counter(self) -> float:
        return self.now

    def advance(self, module, args, kwargs):
        self.now += (self.prefill_ms if args[0].shape[1] > 1 else self.decode_ms).pop(0) / 1e3


def test_latency_percentiles_against_a_scripted_clock(tiny_model, monkeypatch):
    """p50 / p90 of known per-pass times; reference: numpy.percentile (linear interpolation)."""
    model, _ = tiny_model
    prefill_ms = [5.0, 1.0, 4.0, 2.0, 3.0]  # 5 timed passes
    decode_ms = [1.5, 0.5, 2.5, 0.25, 3.0, 1.0, 2.0, 0.75, 2.25, 1.25, 0.5, 2.75, 1.0, 1.75, 3.5]  # 5 x 3 steps
    clock = _ScriptedClock(prefill_ms, decode_ms)
    monkeypatch.setattr(latency, "time", clock)
    hook = model.register_forward_pre_hook(clock.advance, with_kwargs=True)
    try:
        r = measure_latency(model, _windows(1, 16), new_tokens=3, warmup=0, repeats=5)
    finally:
        hook.remove()
    assert clock.prefill_ms == clock.decode_ms == []  # every scripted forward was timed, no other
    p50, p90 = np.percentile(prefill_ms, [50, 90])  # 3.0, 4.6
    d50, d90 = np.percentile(decode_ms, [50, 90])  # 1.5, 2.9
    assert (r["prefill_ms_p50"], r["prefill_ms_p90"]) == (pytest.approx(p50, rel=1e-9), pytest.approx(p90, rel=1e-9))
    assert r["decode_ms_per_token_p50"] == pytest.approx(d50, rel=1e-9)
    assert r["decode_ms_per_token_p90"] == pytest.approx(d90, rel=1e-9)
    assert r["prefill_tokens_per_s"] == pytest.approx(16e3 / p50, rel=1e-9)
    assert r["decode_tokens_per_s"] == pytest.approx(1e3 / d50, rel=1e-9)
    assert r["latency_repeats"] == 5 and r["decode_tokens"] == 3 and r["prefill_tokens"] == 16


def test_latency_token_counts_and_bad_input(tiny_model):
    model, _ = tiny_model
    r = measure_latency(model, _windows(1, 16), new_tokens=5, warmup=1, repeats=3)
    assert r["decode_tokens"] == r["decode_tokens_generated"] == 5 and r["prefill_tokens"] == 16
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
