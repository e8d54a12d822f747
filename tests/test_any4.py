"""any4 / any3 / any2 (Elhoushi & Johnson 2025): the k-means against references written here from the formulas
(and scikit-learn's KMeans where installed), true storage, frozen == fake-quant bit for bit, the calibration
statistic, save/load, a lower output error than RTN int4, and config errors naming the field and the valid values."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import quantlab
from quantlab.backends.serialize import load_quantized, save_quantized
from quantlab.core import lut
from quantlab.core.lifecycle import quant_linears
from quantlab.core.primitives import QParams, fake_quantize
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.methods.any4 import Any4, Any4Config


def _weight(out=16, k=320, seed=0) -> torch.Tensor:
    """Gaussian rows with 1% outliers (x8): the heavy tails real LLM weights have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * 0.02
    mask = torch.rand(out, k, generator=g) < 0.01
    return torch.where(mask, w * 8, w)


def _reference_lloyd(u: torch.Tensor, sw: torch.Tensor, c: torch.Tensor, iters=300, tol=1e-4) -> torch.Tensor:
    """One row, the paper's weighted k-means written out: assign each value to its nearest centre, move each centre
    to the sample-weighted mean Σ w·u / Σ w of its values (an empty cluster stays); stop when the labels repeat or
    the centres moved less than tol · var(u) (scikit-learn's rule)."""
    c, old = c.clone(), None
    for _ in range(iters):
        labels = (u[:, None] - c[None, :]).abs().argmin(1)
        new = c.clone()
        for j in range(len(c)):
            m = labels == j
            if sw[m].sum() > 0:
                new[j] = (sw[m] * u[m]).sum() / sw[m].sum()
        shift = (new - c).square().sum()
        c = new
        if (old is not None and torch.equal(labels, old)) or shift <= tol * u.var(unbiased=False):
            break
        old = labels
    return c


# ---- the k-means (reference: the formulas above, from the same k-means++ init) ----------------

@pytest.mark.parametrize("bits", [4, 3, 2])
def test_each_row_table_is_the_weighted_kmeans_of_the_paper(bits):
    """lut_qparams' table of every row = the reference Lloyd from the same init (float64: atol 1e-12), stored as the
    fp16 rounding of it exactly; scale / offset = the group min-max formula exactly; weights |mean x| · scale."""
    w, g = _weight(), 128
    col = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(1))  # a signed column mean
    p = lut.lut_qparams(w, bits, g, torch.float16, col)
    wg = torch.nn.functional.pad(w, (0, 64), mode="replicate").view(16, 3, g)  # 320 = 128 + 128 + 64 (ragged)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).half()
    offset = (lo + 2 ** (bits - 1) * scale.float()).half()
    assert torch.equal(p.scale, scale) and torch.equal(p.extra["offset"], offset)  # atol = 0
    s = scale.float().repeat_interleave(g, 1)[:, :320]
    u = ((w - offset.float().repeat_interleave(g, 1)[:, :320]) / s).double()
    sw = col.abs().double()[None] * s.double()
    init = lut.kmeanspp_init(u, sw, 2**bits, seed=0)
    ref = torch.stack([_reference_lloyd(u[r], sw[r], init[r]) for r in range(16)]).sort(1).values
    ours = lut.weighted_kmeans(u, sw, 2**bits, seed=0).sort(1).values
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert torch.equal(p.extra["lut"], ours.half())
    assert p.extra["lut"].shape == (16, 2**bits)


def test_uniform_weights_give_plain_kmeans():
    """Uniform sample weights (any constant) = unweighted k-means: the cluster means, as written here and as
    scikit-learn's KMeans computes them (Lloyd, same init, n_init 1: the reference's clusterer), atol 1e-9."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ones = torch.ones_like(x)
    init = lut.kmeanspp_init(x, ones, 16, seed=3)
    plain = torch.stack([_reference_lloyd(x[r], ones[r], init[r]) for r in range(6)])
    for weight in (None, ones, 3.7 * ones):
        got = lut.lloyd(x, ones if weight is None else weight, init)
        torch.testing.assert_close(got, plain, rtol=0, atol=1e-9)
    torch.testing.assert_close(lut.weighted_kmeans(x, None, 16, seed=3), lut.weighted_kmeans(x, 3.7 * ones, 16, seed=3),
                               rtol=0, atol=1e-12)  # the same draws: only the rounding of 3.7·w differs
    if importlib.util.find_spec("sklearn") is None:
        return
    from sklearn.cluster import KMeans

    for r in range(6):
        km = KMeans(16, init=init[r].numpy()[:, None], n_init=1, max_iter=300, tol=1e-4, algorithm="lloyd")
        centres = torch.from_numpy(km.fit(x[r].numpy()[:, None]).cluster_centers_[:, 0])
        torch.testing.assert_close(centres.sort().values, plain[r].sort().values, rtol=0, atol=1e-9)


def test_kmeanspp_draws_by_sample_weight_and_is_seeded():
    """Every centre is a value of the row; values of weight 0 are never drawn (probability ∝ w·D²); same seed, same
    centres, whatever the row chunking."""
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = torch.ones_like(x)
    w[:, ::2] = 0  # even columns weigh nothing
    c = lut.kmeanspp_init(x, w, 16, seed=0)
    for r in range(4):
        assert all(bool((x[r, 1::2] == v).any()) for v in c[r])
    assert torch.equal(c, lut.kmeanspp_init(x, w, 16, seed=0))
    assert not torch.equal(c, lut.kmeanspp_init(x, w, 16, seed=1))
    old = lut.CHUNK
    try:
        lut.CHUNK = 200 * 4  # one row per chunk
        assert torch.equal(c, lut.kmeanspp_init(x, w, 16, seed=0))
    finally:
        lut.CHUNK = old


# ---- storage and parity ----------------------------------------------------------------------

@pytest.mark.parametrize("bits,out,k,g", [(4, 64, 576, 128), (3, 48, 256, 64), (2, 32, 320, 128)])
def test_storage_bytes_are_codes_tables_scales_and_offsets(bits, out, k, g):
    """bytes = ceil(out·k·b / 8) codes + out·2^b fp16 table values + out·n_groups fp16 scales and offsets, before
    and after freeze; every code is its weight's nearest table entry."""
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(k, out), WeightSpec(bits, g, False, None, f"any{bits}"))
    p = lut.lut_qparams(layer.weight, bits, g)
    layer.fixed_qparams = p
    predicted = layer.storage_bytes()
    u = lut.lut_units(layer.weight.detach(), p, g)
    codes = lut.lut_encode(layer.weight, p, g).long()
    dist = (u[:, :, None] - p.extra["lut"].float()[:, None, :]).abs()
    assert torch.equal(dist.gather(2, codes[:, :, None])[..., 0], dist.amin(-1))
    layer.freeze()
    groups = out * math.ceil(k / g)
    expected = math.ceil(out * k * bits / 8) + out * 2**bits * 2 + groups * 2 * 2
    assert predicted == layer.storage_bytes() == expected
    assert layer.lut.dtype == layer.scale.dtype == layer.lut_offset.dtype == torch.float16
    if (bits, k, g) == (4, 576, 128):  # 5 groups (the last of 64): 4 + (5 · 32 + 16 · 16) / 576 bits per weight
        bpw = 8 * expected / (out * k)
        assert bpw == pytest.approx(4 + (5 * 32 + 256) / 576, abs=1e-12) and round(bpw, 4) == 4.7222


def _calibration(n=3):
    return [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(s)) for s in range(n)]


@pytest.mark.parametrize("bits", [4, 2])
def test_frozen_forward_equals_fake_quant_on_the_tiny_llama(tiny_model_dir, bits):
    """prepare -> calibrate (fake-quant logits) -> convert (packed codes): logits equal bit for bit (atol 0); every
    linear but lm_head got a calibrated table; the model still runs (finite logits)."""
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config, method, ids = Any4Config(bits=bits, group_size=32), Any4(), torch.randint(0, 300, (2, 24))
    method.prepare(model, config)
    diagnostics = method.calibrate(model, config, _calibration(), progress=False)
    layers = quant_linears(model)
    assert diagnostics == {"any4_layers": 14, "any4_unweighted_layers": 0} and len(layers) == 14  # 2 blocks x 7
    assert all(layer.fixed_qparams is not None for layer in layers.values())
    with torch.inference_mode():
        fake = model(ids).logits
    method.convert(model, config)
    assert all(layer.frozen and layer.weight is None for layer in layers.values())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, fake)
    assert torch.isfinite(fake).all()


def test_each_table_is_fitted_to_the_signed_mean_of_its_quantized_inputs(tiny_model_dir):
    """The calibration statistic is the reference's: the mean of each input column (signed; |.| in the weights) of
    the layer's input with the layers before it already quantized. After calibrate, every layer's input in the
    fake-quant model is the one it was fitted on (later layers do not feed it), so the tables = lut_qparams of those
    means exactly. lm_head (selected here, outside the blocks) gets the unweighted tables."""
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config, calib = Any4Config(group_size=32, exclude=()), _calibration()
    Any4().prepare(model, config)
    assert Any4().calibrate(model, config, calib, progress=False) == {"any4_layers": 14, "any4_unweighted_layers": 1}
    sums, counts = {}, {}
    layers = quant_linears(model)

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    with torch.inference_mode():
        for ids in calib:
            model(ids)
    for h in handles:
        h.remove()
    for name, layer in layers.items():
        mean = None if name == "lm_head" else (sums[name] / counts[name]).float()
        want = lut.lut_qparams(layer.weight, 4, 32, torch.float16, mean)
        assert torch.equal(layer.fixed_qparams.extra["lut"], want.extra["lut"]), name


def test_save_and_load_round_trip_bit_for_bit(tiny_model_dir, tmp_path):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config = quantlab.make_config({"method": "any4", "bits": 3, "group_size": 32})
    quantlab.quantize(model, config, calibration=_calibration(), progress=False)
    save_quantized(model, tmp_path / "q", config, str(tiny_model_dir))
    loaded = load_quantized(tmp_path / "q")
    ids = torch.randint(0, 300, (2, 20))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)  # atol = 0
    layer = quant_linears(loaded)["model.layers.0.mlp.up_proj"]
    assert layer.spec.format == "any3" and layer.lut.shape == (96, 8)


# ---- accuracy floor: any4 vs RTN int4 on the same group size -------------------------------

def test_any4_beats_rtn_int4_on_the_layers_output_error():
    """A 256 x 512 weight with outliers, activations with per-channel means and a few large channels: the output
    error ‖X Wᵀ - X Ŵᵀ‖² of any4 g128 (tables weighted by |mean x|) is at least 10% below RTN int4 asym g128's
    (measured: 0.32x), and below unweighted any4's (0.58x): the calibration weighting is what lowers it further."""
    g = torch.Generator().manual_seed(7)
    w = _weight(256, 512, seed=7)
    scale = torch.ones(512)
    scale[torch.randperm(512, generator=g)[:8]] = 10.0  # outlier channels
    x = (torch.randn(512, generator=g) + torch.randn(1024, 512, generator=g)) * scale  # (tokens, in)
    p = lut.lut_qparams(w, 4, 128, torch.float16, x.mean(0))
    any4 = lut.lut_fake_quantize(w, p, 128, ste=False)
    rtn = WeightSpec(4, 128, False)
    int4 = fake_quantize(w, rtn.qparams(w), 4, 128, ste=False)

    def err(q):
        return float((x.double() @ (w.double() - q.double()).T).square().sum())

    assert err(any4) < 0.9 * err(int4)
    unweighted = lut.lut_fake_quantize(w, lut.lut_qparams(w, 4, 128), 128, ste=False)
    assert err(any4) < 0.9 * err(unweighted)


# ---- config errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ({"bits": 5}, r"bits must be one of 2, 3, 4 \(any2, any3, any4.*got 5"),
    ({"bits": "4"}, r"bits must be one of 2, 3, 4 .*got '4'"),
    ({"group_size": 0}, r"group_size must be an integer >= 1, got 0"),
    ({"group_size": None}, r"group_size must be an integer >= 1, got None"),
    ({"group_size": 64.5}, r"group_size must be an integer >= 1, got 64.5"),
    ({"iters": 0}, r"iters must be an integer >= 1, got 0"),
    ({"tol": -1.0}, r"tol must be a number >= 0 .*got -1.0"),
    ({"symmetric": True}, r"unknown config key\(s\) 'symmetric' for method 'any4'; valid: bits, exclude, group_size"),
    ({"include": "model.*"}, r"include must be a list of name globs, got 'model.\*'"),
])
def test_config_errors_name_the_field_and_the_valid_values(spec, message):
    with pytest.raises(ValueError, match=message):
        quantlab.make_config({"method": "any4", **spec})


@pytest.mark.parametrize("spec,message", [
    ({"method": "gptq", "format": "any4"},
     (r"format 'any4' is a lookup table learned per weight row .*method = \"any4\" with bits = 4; method 'gptq' .*"
      r"GPTQ over the LUT grid is not ported")),
    ({"method": "rtn", "format": "any3"}, r"format 'any3' .*method = \"any4\" with bits = 3; method 'rtn'"),
    ({"method": "rtn", "overrides": [{"pattern": "*.down_proj", "format": "any2"}]}, r"format 'any2' .*method 'rtn'"),
    ({"method": "dynamic", "act_format": "any4"}, r"act_format 'any4' is a weight format .*method \"any4\""),
])
def test_learned_tables_are_refused_where_a_fixed_grid_is_rounded_to(spec, message):
    with pytest.raises(ValueError, match=message):
        quantlab.make_config(spec)


def test_spec_and_description():
    config = Any4Config()
    assert (config.bits, config.group_size, config.iters, config.tol, config.seed) == (4, 128, 300, 1e-4, 0)
    spec = config.weight_spec
    assert (spec.format, spec.bits, spec.group_size, spec.symmetric, spec.describe()) == ("any4", 4, 128, False,
                                                                                          "any4 g128")
    assert quantlab.get_method("any4").needs_calibration and isinstance(quantlab.Any4Config(bits=2), Any4Config)
    assert isinstance(lut.lut_qparams(torch.randn(2, 8), 2, None), QParams)
