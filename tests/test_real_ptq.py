"""Calibrated PTQ on the real models (slow): GPTQ and AWQ beat RTN at the same bits.

SmolLM2-135M. AWQ end to end: perplexity on the same 3 WikiText-2 test windows of 512 tokens, calibration on 2
seeded validation windows, a 5-point alpha grid (n_grid = 5, the grid's resolution, not another algorithm; the
experiments use 32 windows and 20 points). Measured at 1 thread on a 2-core AMD EPYC (AVX2): RTN 40.10, AWQ 35.58
(on 6 windows 39.46 against 35.42; with 4 calibration windows 34.64; AWQ wins on each of the 6 windows).
GPTQ on its first 4 blocks: its error of the last hidden state on 2 held-out validation windows, relative to the
float model's, against RTN's on the same blocks (measured 0.49x at w4, 0.53x at w3, calibrated on 4 windows).
Not end to end: with the suite's 8 calibration windows, whole-model GPTQ beat RTN's perplexity by only 1.6%
(38.81 against 39.46 at 1 thread; 36.49 at 2 threads: GPTQ's rounding decisions follow the float summation order),
too thin a margin to assert; with the experiments' 32 windows it is 37.81 against 41.01 (reports/smollm2_ptq.md).
MiniLM-L6 (genuine fp32 weights): mean-pooled embedding cosine vs fp32 on 128 test sentences, calibration on
32 validation windows of 128 tokens, both methods end to end.
"""
import copy

import pytest
import torch
from torch import nn

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
    return model, eval_windows(ids, 512, max_windows=3), val


def _ppl(model, windows, spec, calibration=None):
    m = copy.deepcopy(model)
    quantlab.quantize(m, quantlab.make_config(spec), calibration=calibration, progress=False)
    return quantlab.perplexity(m, windows, progress=False)["ppl"]


@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_awq_beats_rtn_at_w4_g64(smol):
    model, windows, val = smol
    calib = [w[None] for w in calibration_windows(val, 2, 512, seed=0)]
    rtn = _ppl(model, windows, _rtn(4, 64))
    awq = _ppl(model, windows, {"method": "awq", "base": _rtn(4, 64), "n_grid": 5}, calib)
    assert awq < 0.95 * rtn, (rtn, awq)  # measured 0.89x


@pytest.mark.needs_model("smollm2-135m")
@pytest.mark.parametrize("bits", [4, 3])
def test_smollm2_gptq_halves_rtns_held_out_error_on_four_blocks(smol, bits):
    """Reference: the float model cut to the same 4 blocks, its last hidden state (final norm applied) on 2
    validation windows GPTQ did not see."""
    model, _, val = smol
    cut = copy.deepcopy(model)
    cut.model.layers = nn.ModuleList(cut.model.layers[:4])
    calib = [w[None] for w in calibration_windows(val, 4, 512, seed=0)]
    held_out = calibration_windows(val, 2, 512, seed=7)
    with torch.no_grad():
        ref = cut.model(held_out).last_hidden_state
    errors = {}
    for method in ("rtn", "gptq"):
        m = copy.deepcopy(cut)
        spec = {**_rtn(bits, 64), "method": method} | ({"true_sequential": False} if method == "gptq" else {})
        quantlab.quantize(m, quantlab.make_config(spec), calibration=calib, progress=False)
        with torch.no_grad():
            errors[method] = float((m.model(held_out).last_hidden_state - ref).pow(2).sum() / ref.pow(2).sum())
    assert errors["gptq"] < 0.7 * errors["rtn"], errors  # measured 0.49 (w4) and 0.53 (w3)


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
    """At w3 g64, where RTN loses the most; w4 g64 is in reports/minilm_ptq.md's rows (28 s
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
