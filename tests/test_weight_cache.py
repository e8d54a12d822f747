"""lifecycle.cached_weights: evaluation dequantizes each weight once, and its forward is bitwise the uncached one
for every weight method and format, frozen or still fake-quant; the cache is freed on exit and never used
where gradients flow."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import quantlab
from quantlab.core.lifecycle import cached_weights, quant_linears
from quantlab.eval.perplexity import perplexity

CONFIGS = [
    {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
    {"method": "rtn", "bits": 8},
    {"method": "gptq", "bits": 3, "group_size": 32},
    {"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 32}},
    {"method": "hqq", "bits": 4, "group_size": 32},
    {"method": "dynamic"},
    {"method": "static", "act_granularity": "channel"},
    {"method": "smoothquant"},
    {"method": "rtn", "format": "nf4", "double_quant": True},
    {"method": "rtn", "format": "mxfp4"},
    {"method": "gptq", "format": "nvfp4"},
    {"method": "rtn", "format": "fp8_e5m2"},
    {"method": "dynamic", "act_format": "mxfp4", "base": {"method": "rtn", "format": "mxfp6_e2m3"}},
]


def _ids(seed, t=24):
    return torch.randint(0, 300, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "fake-quant"])
@pytest.mark.parametrize("spec", CONFIGS, ids=lambda s: json.dumps(s).replace(" ", ""))
def test_cached_forward_is_bitwise_the_uncached_one(tiny_model, spec, frozen):
    model, _ = tiny_model
    config = quantlab.make_config(spec)
    method = quantlab.get_method(config)
    calib = [_ids(s, 32) for s in range(3)]
    method.prepare(model, config)
    if method.needs_calibration_for(config):
        method.calibrate(model, config, calib, progress=False)
    if frozen:
        method.convert(model, config)
    ids = _ids(7)
    with torch.inference_mode():
        plain = model(ids).logits
        with cached_weights(model):
            first = model(ids).logits
            layers = quant_linears(model)
            cached = {n: m.weight_cache[torch.float32] for n, m in layers.items()}
            second = model(ids).logits
            assert all(m.weight_cache[torch.float32] is cached[n] for n, m in layers.items())  # reused, not rebuilt
    assert torch.equal(first, plain) and torch.equal(second, plain)  # atol = 0
    assert all(m.weight_cache is None for m in quant_linears(model).values())  # freed


def test_perplexity_uses_the_cache_and_matches_the_uncached_pass(tiny_model, monkeypatch):
    model, _ = tiny_model
    quantlab.quantize(model, quantlab.make_config({"method": "rtn", "format": "nvfp4"}))
    windows = torch.cat([_ids(s, 16) for s in range(4)])
    calls = {"n": 0}
    original = quantlab.QuantLinear._weight

    def counting(self, dtype):
        calls["n"] += 1
        return original(self, dtype)

    monkeypatch.setattr(quantlab.QuantLinear, "_weight", counting)
    fast = perplexity(model, windows, progress=False)
    assert calls["n"] == len(quant_linears(model))  # once per layer, not once per layer and window
    with torch.inference_mode():  # the uncached reference: one window at a time, no cache
        nll = sum(torch.nn.functional.cross_entropy(model(w[None]).logits[0, :-1], w[1:], reduction="sum").item()
                  for w in windows)
    assert sum(fast["window_nll"]) == pytest.approx(nll, rel=1e-6)


def test_no_cache_where_gradients_flow(tiny_model):
    """QAT trains through the fake-quant weight: inside cached_weights a grad-enabled forward must still see
    the current weight, so it never reads or fills the cache."""
    model, _ = tiny_model
    config = quantlab.make_config({"method": "rtn", "bits": 4, "group_size": 32})
    quantlab.get_method(config).prepare(model, config)
    layer = next(iter(quant_linears(model).values()))
    x = torch.randn(2, layer.in_features)
    with cached_weights(model):
        before = layer(x)
        assert layer.weight_cache == {}
        with torch.no_grad():
            layer.weight.mul_(2)
        after = layer(x)
    assert not torch.equal(before, after)
    ref = copy.deepcopy(layer)
    assert torch.equal(ref(x), after)
