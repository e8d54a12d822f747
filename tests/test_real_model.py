"""SmolLM2-135M on real WikiText-2 text (slow: ~2 min; CI runs them, `-m "not slow"` skips them).

Same windows for every model, so orderings are paired comparisons.
"""
import copy
import dataclasses

import pytest

import quantlab
from quantlab.eval import perplexity, weight_stats
from quantlab.models.data import eval_windows, load_token_ids
from quantlab.runs.experiment import load_experiment
from quantlab.runs.runner import run_experiment

pytestmark = [pytest.mark.slow, pytest.mark.needs_model("smollm2-135m")]


@pytest.fixture(scope="module")
def smol(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    return model, tok, ids, eval_windows(ids, 512, max_windows=6)


def test_alias_loads_the_real_model(smol):
    model, tok, ids, _ = smol
    info = quantlab.model_info(model)
    assert info["model_type"] == "llama" and info["tied_embeddings"]
    assert len(info["linear_layers"]) == 211  # 30 blocks x 7 + lm_head
    assert 134e6 < info["params"] < 135e6
    assert ids.numel() > 280_000  # the joined test split, no BOS
    assert tok("Hello").input_ids[0] != tok.bos_token_id


def _ppl(model, windows, config):
    m = copy.deepcopy(model)
    quantlab.quantize(m, config)
    return perplexity(m, windows, progress=False)["ppl"], weight_stats(m)


def test_rtn_quality_ordering_and_bytes(smol):
    model, _, _, windows = smol
    fp = perplexity(model, windows, progress=False)["ppl"]
    w8, _ = _ppl(model, windows, quantlab.RTNConfig(bits=8))
    g64, stats64 = _ppl(model, windows, quantlab.RTNConfig(bits=4, group_size=64))
    g128, _ = _ppl(model, windows, quantlab.RTNConfig(bits=4, group_size=128))
    assert abs(w8 / fp - 1) < 0.005  # int8 per-channel within 0.5% of fp32
    assert g128 > g64 > w8
    assert stats64["quant_layers"] == 210
    assert stats64["quant_layer_bytes"] < 0.2 * stats64["quant_layer_float_bytes"]


def test_quickstart_experiment_end_to_end(tmp_path, wikitext_dir, smol):
    exp = load_experiment("experiments/smollm2_quickstart.toml")
    small = dataclasses.replace(
        exp, runs=exp.runs[:3],
        eval=dataclasses.replace(exp.eval, max_windows=2, kl_windows=1, decode_tokens=2, latency_repeats=1),
    )
    df = run_experiment(small, tmp_path, data_dir=wikitext_dir, progress=False)
    assert list(df["method"]) == ["none", "rtn", "rtn"]
    assert df["eval_tokens"].iloc[0] == 1024
    # the runner's fp32 row is the perplexity of the first 2 test windows (reference: eval.perplexity directly)
    model, _, _, windows = smol
    assert df["ppl"].iloc[0] == pytest.approx(perplexity(model, windows[:2], progress=False)["ppl"], rel=1e-6)
    assert (tmp_path / "smollm2_quickstart.md").read_text().count("\n| ") == 4  # header + 3 rows
