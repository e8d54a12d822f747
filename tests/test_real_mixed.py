"""SmolLM2-135M: per-layer sensitivity on a few layers (slow, ~30 s on 2 cores)."""
import copy

import pytest

import quantlab
from quantlab import make_config
from quantlab.mixed import sensitivity
from quantlab.mixed.sensitivity import SuffixEvaluator, make_units, validation_windows

pytestmark = [pytest.mark.slow, pytest.mark.needs_model("smollm2-135m")]

W3 = {"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}


def test_real_model_sensitivity_few_layers(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    windows, source = validation_windows(tok, "wikitext2", "validation", 512, 1, data_dir=wikitext_dir)
    assert "valid" in source
    cfg = make_config(W3)
    units = {u.name: u for u in make_units(model, cfg)}
    assert len(units) == 210
    ev = SuffixEvaluator(model, windows, progress=False)
    kl = {}
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.14.mlp.up_proj", "model.layers.29.mlp.down_proj"):
        kl[name] = sensitivity._evaluate_unit(ev, units[name], cfg)["kl_mean"]
    # replaying from block 14 equals quantizing that one layer in the full model (reference: eval.perplexity)
    q = copy.deepcopy(model)
    quantlab.quantize(q, make_config({**W3, "include": ["model.layers.14.mlp.up_proj"]}))
    ref = quantlab.perplexity(q, windows, ev.reference, progress=False)["kl_mean"]
    assert kl["model.layers.14.mlp.up_proj"] == pytest.approx(ref, rel=1e-4)
    # the last block's down_proj (rare, huge inputs) moves the output most; every layer moves it somewhat
    assert kl["model.layers.29.mlp.down_proj"] > 5 * kl["model.layers.0.self_attn.k_proj"] > 0
