"""Calibrated PTQ on the real models (slow): GPTQ and AWQ beat RTN at the same bits.

SmolLM2-135M: perplexity on the same 6 WikiText-2 test windows of 512 tokens, calibration on 8 seeded
validation windows for GPTQ and the first 4 of them for AWQ (the experiments use 32). Measured at 1 thread:
RTN 39.46; GPTQ 37.73 with 8 windows but 39.88 with 4 (so GPTQ keeps 8); AWQ 35.17 with 8, 34.63 with 4, in
half of AWQ's 466 s (its 20-point alpha grid replays attention and MLP on every calibration token). AWQ here
searches a 5-point alpha grid (n_grid = 5, the grid's resolution, not another algorithm): on 2 threads of a
2-core AMD EPYC (AVX2) RTN 39.46, GPTQ 36.49 (44 s), AWQ 34.64 in 37 s where the 10-point grid gave 34.34 in 58 s
and the 20-point one 34.63 in 98 s (the suite's budget: AWQ's margin over RTN stays wide at 5 points).
MiniLM-L6 (genuine fp32 weights): mean-pooled embedding cosine vs fp32 on 128 test sentences, calibration on
32 validation windows of 128 tokens.
"""
import copy

import pytest

import quantlab
from quantlab.eval.embedding import embedding_fidelity, mean_pooled_embeddings, sentences_from_text
from quantlab.models.data import calibration_windows, eval_windows, load_text, load_token_ids

pytestmark = pytest.mark.slow


def _rtn(bits, group_size):
    return {"method": "rtn", "bits": bits, "group_size": group_size, "symmetric": False}


@pytest.fixture(scope="module")
def smol(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    val, _ = load_token_ids("wikitext2", "validation", tok, data_dir=wikitext_dir)
    calib = [w[None] for w in calibration_windows(val, 8, 512, seed=0)]
    return model, eval_windows(ids, 512, max_windows=6), calib


def _ppl(smol, spec, calibration_windows=None):
    model, windows, calib = smol
    m = copy.deepcopy(model)
    quantlab.quantize(m, quantlab.make_config(spec), calibration=calib[:calibration_windows])
    return quantlab.perplexity(m, windows, progress=False)["ppl"]


@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_gptq_and_awq_beat_rtn_at_w4_g64(smol):
    rtn = _ppl(smol, _rtn(4, 64))
    gptq = _ppl(smol, {**_rtn(4, 64), "method": "gptq", "true_sequential": False})
    awq = _ppl(smol, {"method": "awq", "base": _rtn(4, 64), "n_grid": 5}, calibration_windows=4)
    assert gptq < rtn and awq < rtn, (rtn, gptq, awq)


@pytest.fixture(scope="module")
def minilm(wikitext_dir):
    model, tok = quantlab.load_model("minilm-l6", device="cpu")
    text, _ = load_text("wikitext2", "test", wikitext_dir)
    sentences = sentences_from_text(text, 128)
    val, _ = load_token_ids("wikitext2", "validation", tok, data_dir=wikitext_dir)
    calib = [w[None] for w in calibration_windows(val, 32, 128, seed=0)]
    return model, tok, sentences, mean_pooled_embeddings(model, tok, sentences, progress=False), calib


@pytest.mark.needs_model("minilm-l6")
def test_minilm_gptq_and_awq_beat_rtn_embedding_cosine(minilm):
    """At w3 g64, where RTN loses the most; w4 g64 is SmolLM2's test above and reports/minilm_ptq.md's rows (28 s
    each in the suite: the w4 case was dropped to keep the suite within its budget)."""
    bits = 3
    model, tok, sentences, ref, calib = minilm
    cos = {}
    base = {**_rtn(bits, 64), "exclude": ["pooler.dense"]}
    for name, spec in [("rtn", base), ("gptq", {**base, "method": "gptq"}), ("awq", {"method": "awq", "base": base})]:
        m = copy.deepcopy(model)
        quantlab.quantize(m, quantlab.make_config(spec), calibration=calib)
        cos[name] = embedding_fidelity(ref, mean_pooled_embeddings(m, tok, sentences, progress=False))["cos_mean"]
    assert cos["gptq"] > cos["rtn"] and cos["awq"] > cos["rtn"], cos
