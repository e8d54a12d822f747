"""Weight clip searches (core/clipping.py): the brute-force optimum of their ratio grid, uniform importance = plain
mse, and `observer = ...` on rtn / gptq end to end (frozen = fake-quant, lower weighted error than min-max)."""
import pytest
import torch

import quantlab
from quantlab.core.clipping import CLIP_SEARCHES, ClipSearch, normalized_importance, search_qparams, search_range
from quantlab.core.primitives import fake_quantize, qparams, qparams_from_range
from quantlab.core.qlinear import QuantLinear


def _weights(seed=0, out_f=24, in_f=96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    w[torch.rand(out_f, in_f, generator=g) < 0.02] *= 6  # outliers: clipping pays
    return w


def _group_error(w, p, bits, g, imp, norm):
    e = (fake_quantize(w, p, bits, g, ste=False) - w).abs().pow(norm) * imp
    return e.reshape(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("name", ["mse", "imatrix_mse"])
def test_without_patience_each_group_gets_the_brute_force_best_ratio(symmetric, name):
    w, bits, g = _weights(), 3, 32
    search = CLIP_SEARCHES[name]
    search = ClipSearch(search.max_shrink, search.grid, search.norm, 0, search.inclusive)  # patience 0: every ratio
    imp = normalized_importance(torch.rand(96, generator=torch.Generator().manual_seed(1)) ** 4 + 1e-3)
    lo, hi = search_range(w, bits, g, symmetric, search, imp)
    # brute force: every ratio's error for every group, the argmin (the first one on ties, as the strict < keeps)
    wg = w.reshape(w.shape[0], -1, g)
    errs = torch.stack([_group_error(w, qparams_from_range(r * wg.amin(-1), r * wg.amax(-1), bits, symmetric,
                                                           torch.float16), bits, g, imp, search.norm)
                        for r in search.ratios()])
    best = torch.tensor(search.ratios())[errs.argmin(0)]
    torch.testing.assert_close(lo, best * wg.amin(-1), rtol=0, atol=0)
    torch.testing.assert_close(hi, best * wg.amax(-1), rtol=0, atol=0)


def test_uniform_importance_equals_the_unweighted_search():
    w = _weights(2)
    for search in CLIP_SEARCHES.values():
        a = search_qparams(w, 4, 32, False, search, normalized_importance(torch.full((96,), 0.37)))
        b = search_qparams(w, 4, 32, False, search, None)
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


def test_the_reference_ratio_grids():
    assert CLIP_SEARCHES["mse"].ratios() == [1 - i / 100 for i in range(20)]  # llm-compressor memoryless_mse
    assert CLIP_SEARCHES["imatrix_mse"].ratios() == [1 - i / 20 for i in range(20)]  # imatrix_mse: 19 steps + 1


def test_the_search_never_loses_to_min_max_on_its_own_error():
    w = _weights(3)
    imp = normalized_importance(torch.rand(96, generator=torch.Generator().manual_seed(4)) + 0.01)
    for name, weights in (("mse", torch.ones(96)), ("imatrix_mse", imp)):
        norm = CLIP_SEARCHES[name].norm
        p = search_qparams(w, 4, 32, False, CLIP_SEARCHES[name], None if name == "mse" else imp)
        minmax = qparams(w, 4, 32, False, torch.float16)
        searched, plain = _group_error(w, p, 4, 32, weights, norm), _group_error(w, minmax, 4, 32, weights, norm)
        assert (searched <= plain).all() and searched.sum() < 0.99 * plain.sum()  # measured: 3.7% (mse) lower


def _calib(n=4):
    return [torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("observer", ["mse", "imatrix_mse"])
def test_observer_end_to_end_freezes_exactly(tiny_model_dir, method, observer):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    cfg = quantlab.make_config({"method": method, "bits": 3, "group_size": 32, "symmetric": False,
                                "observer": observer})
    m = quantlab.get_method(cfg)
    assert m.needs_calibration_for(cfg) and m.describe(cfg).endswith(f"+ {observer} clip")
    m.prepare(model, cfg)
    row = m.calibrate(model, cfg, _calib(), progress=False)
    if method == "rtn":
        assert 0.5 < row["rtn_clip_ratio_mean"] < 1.0  # some groups were clipped
    x = _calib(1)[0]
    with torch.no_grad():
        before = model(x).logits
        m.convert(model, cfg)
        after = model(x).logits
    assert torch.equal(before, after)
    assert all(layer.frozen for layer in model.modules() if isinstance(layer, QuantLinear))


def test_rtn_imatrix_mse_uses_the_float_models_activations(tiny_model_dir):
    """The importance is each column's mean x² in the float model: the qparams equal a search run by hand on it."""
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    layer_name = "model.layers.1.mlp.down_proj"
    seen = []
    handle = model.get_submodule(layer_name).register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 96)))
    with torch.no_grad():
        for x in _calib():
            model(x)
    handle.remove()
    x2 = torch.cat(seen).double().square().mean(0).float()
    w = model.get_submodule(layer_name).weight.detach().clone()
    expected = search_qparams(w, 3, 32, False, CLIP_SEARCHES["imatrix_mse"], normalized_importance(x2))
    cfg = quantlab.make_config({"method": "rtn", "bits": 3, "group_size": 32, "symmetric": False,
                                "observer": "imatrix_mse"})
    quantlab.quantize(model, cfg, calibration=_calib(), progress=False)
    layer = model.get_submodule(layer_name)
    torch.testing.assert_close(layer.scale, expected.scale, rtol=0, atol=0)
    assert torch.equal(layer.zero_u, expected.zero.to(torch.uint8))


@pytest.mark.parametrize("cfg,message", [
    ({"method": "rtn", "format": "nf4", "observer": "mse"}, "searches integer grids"),
    ({"method": "rtn", "bits": 4, "observer": "absmax"}, "observer"),
    ({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 64, "observer": "mse"}}, "not applied"),
])
def test_bad_observer_fails_before_any_model_loads(cfg, message):
    with pytest.raises(ValueError, match=message):
        quantlab.make_config(cfg)
