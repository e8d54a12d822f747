"""Activation fake-quantizers and the `dynamic` / `static` methods: references, SQNR floors, lifecycle, errors."""
import pytest
import torch
from torch import nn

import quantlab
from quantlab.core.activations import DynamicActQuant, StaticActQuant
from quantlab.core.lifecycle import quant_linears
from quantlab.core.observers import MinMaxObserver, export_stats
from quantlab.core.primitives import code_range, fake_quantize, qparams, sqnr_db
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.core.registry import config_to_dict, get_method, make_config
from quantlab.methods.dynamic import DynamicConfig
from quantlab.methods.static import StaticConfig, observe_activations, observer_factory


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _ids(n, t=32, seed=0):
    gen = _gen(seed)
    return [torch.randint(0, 300, (1, t), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dynamic_matches_per_token_reference(bits, symmetric):
    x = torch.randn(2, 5, 48, generator=_gen(bits))
    got = DynamicActQuant(bits, symmetric)(x)
    ref = torch.stack([
        torch.stack([fake_quantize(tok[None], qparams(tok[None], bits, None, symmetric), bits, None)[0] for tok in seq])
        for seq in x
    ])  # each token row quantized alone
    assert torch.equal(got, ref)  # exact: the same primitives, token by token


@pytest.mark.parametrize("bits,symmetric,floor_db", [(8, True, 35.0), (8, False, 35.0), (4, True, 15.0), (4, False, 15.0)])
def test_dynamic_sqnr_floor_on_gaussian_activations(bits, symmetric, floor_db):
    x = torch.randn(512, 256, generator=_gen(1))
    assert sqnr_db(x, DynamicActQuant(bits, symmetric)(x)) >= floor_db  # vs float; int8 measures ≈ 43 dB


def _static_from(calib, per_channel, bits, symmetric):
    obs = MinMaxObserver(per_channel=per_channel)
    obs.update(calib)
    return StaticActQuant.from_range(*obs.range(), bits=bits, symmetric=symmetric)


@pytest.mark.parametrize("symmetric", [True, False])
def test_static_sqnr_floors_per_tensor_and_per_channel(symmetric):
    channel_scale = torch.logspace(-1, 1, 64)  # channels from 0.1 to 10: per-channel ranges pay off
    calib = torch.randn(2048, 64, generator=_gen(2)) * channel_scale
    x = torch.randn(512, 64, generator=_gen(3)) * channel_scale  # fresh data, same distribution
    per_tensor = sqnr_db(x, _static_from(calib, False, 8, symmetric)(x))
    per_channel = sqnr_db(x, _static_from(calib, True, 8, symmetric)(x))
    assert per_tensor >= 28.0 and per_channel >= 34.0  # dB vs float; measured ≈ 31 and 36-39
    assert per_channel > per_tensor + 3.0
    gaussian = torch.randn(512, 64, generator=_gen(4))
    assert sqnr_db(gaussian, _static_from(torch.randn(4096, 64, generator=_gen(5)), False, 8, symmetric)(gaussian)) >= 35.0


@pytest.mark.parametrize("quantizer", [
    DynamicActQuant(8, True), DynamicActQuant(4, False),
    StaticActQuant(8, True, torch.tensor(1 / 127)), StaticActQuant(6, False, torch.full((16,), 0.05), torch.full((16,), 31)),
])
def test_act_quant_does_not_mutate_and_passes_straight_through(quantizer):
    x = torch.randn(3, 7, 16, generator=_gen(6), requires_grad=True)
    before = x.detach().clone()
    out = quantizer(x)
    assert torch.equal(x.detach(), before) and out.shape == x.shape
    out.sum().backward()
    # STE: gradient 1 where the integer code is inside the code range, 0 where the clamp is active
    if isinstance(quantizer, DynamicActQuant):
        p = qparams(before, quantizer.bits, None, quantizer.symmetric)
        scale, zero = p.scale, p.zero
    else:
        scale, zero = quantizer.scale, quantizer.zero
    codes = torch.round(before / scale) + (0 if zero is None else zero)
    qmin, qmax = code_range(quantizer.bits, quantizer.symmetric)
    assert torch.equal(x.grad, ((codes >= qmin) & (codes <= qmax)).float())


@pytest.mark.parametrize("make,match", [
    (lambda: DynamicActQuant(3), "bits must be an integer in 4..8, got 3"),
    (lambda: DynamicActQuant(9), "bits must be an integer in 4..8, got 9"),
    (lambda: DynamicActQuant(8.0), "bits must be an integer in 4..8, got 8.0"),
    (lambda: DynamicActQuant(8, "yes"), "symmetric must be true or false, got 'yes'"),
    (lambda: StaticActQuant(8, True, torch.tensor(0.0)), "scale must be finite and > 0"),
    (lambda: StaticActQuant(8, False, torch.tensor(0.1)), "asymmetric needs integer zero points"),
    (lambda: StaticActQuant(8, False, torch.tensor(0.1), torch.tensor(300)), "zero must be integers in 0..255"),
    (lambda: DynamicConfig(act_bits=2), "act_bits must be an integer in 4..8, got 2"),
    (lambda: StaticConfig(act_symmetric=1), "act_symmetric must be true or false, got 1"),
    (lambda: StaticConfig(act_granularity="token"), "unknown act_granularity 'token'; known: tensor, channel"),
    (lambda: StaticConfig(observer="histogram"), "unknown observer 'histogram'; known: minmax, moving_average, percentile, mse"),
    (lambda: StaticConfig(percentile=101), r"percentile must be a number in \(50, 100\], got 101"),
    (lambda: DynamicConfig(base={"method": "none"}), "dynamic: base must be a weight quantization method .*got 'none'"),
    (lambda: StaticConfig(base={"method": "dynamic"}), "static: base must be a weight quantization method .*got 'dynamic'"),
    (lambda: DynamicConfig(base={"method": "rtn", "bits": 1}), "base: bits must be an integer in 2..8, got 1"),
])
def test_bad_values_are_rejected_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_per_channel_static_rejects_a_mismatched_input():
    with pytest.raises(ValueError, match="input has 8 channels, per-channel qparams have 16"):
        StaticActQuant(8, True, torch.full((16,), 0.1))(torch.randn(2, 8))


@pytest.mark.parametrize("spec", [
    {"method": "dynamic", "act_bits": 6, "base": {"method": "gptq", "bits": 4, "group_size": 64}},
    {"method": "static", "act_granularity": "channel", "observer": "percentile", "percentile": 99.9,
     "base": {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}},
])
def test_configs_round_trip_through_dict(spec):
    cfg = make_config(spec)
    assert make_config(config_to_dict(cfg)) == cfg
    assert config_to_dict(cfg)["base"]["bits"] == 4


def test_dynamic_w8a8_on_tiny_llama(tiny_model):
    model, _ = tiny_model
    ids = _ids(1, 48, seed=1)[0]
    with torch.no_grad():
        ref = model(ids).logits
    assert get_method("dynamic").needs_calibration_for(DynamicConfig()) is False
    quantlab.quantize(model, DynamicConfig(), calibration=_ids(1))  # W8A8 dynamic defaults
    layers = quant_linears(model)
    assert len(layers) == 14 and all(m.frozen and isinstance(m.act_quant, DynamicActQuant) for m in layers.values())
    assert type(model.lm_head) is nn.Linear
    with torch.no_grad():
        got = model(ids).logits
    assert sqnr_db(ref, got) >= 35.0  # dB vs float logits; measured ≈ 43 on this model


@pytest.mark.parametrize("observer,granularity", [
    ("minmax", "tensor"), ("minmax", "channel"), ("moving_average", "tensor"), ("percentile", "tensor"), ("mse", "channel"),
])
def test_static_w8a8_on_tiny_llama(tiny_model, observer, granularity):
    model, _ = tiny_model
    calib = _ids(3)
    ids = torch.cat(calib)  # evaluate on the calibration tokens: no clipping of unseen values
    with torch.no_grad():
        ref = model(ids).logits
    config = StaticConfig(observer=observer, act_granularity=granularity)
    method = get_method(config)
    method.prepare(model, config)
    method.calibrate(model, config, iter(calib))  # a one-shot iterator is fine
    with torch.no_grad():
        fake = model(ids).logits
    method.convert(model, config)
    with torch.no_grad():
        frozen = model(ids).logits
    assert torch.equal(fake, frozen)  # atol = 0: fake-quant forward == frozen forward, act quant included
    layers = quant_linears(model).values()
    assert all(m.frozen and isinstance(m.act_quant, StaticActQuant) for m in layers)
    assert all(m.act_quant.per_channel == (granularity == "channel") for m in layers)
    assert sqnr_db(ref, frozen) >= 30.0  # dB vs float logits; measured 36-43


def test_static_statistics_are_exportable_and_see_the_input_scale():
    layer = QuantLinear.from_linear(nn.Linear(8, 4), WeightSpec(8))
    layer.input_scale = torch.full((8,), 2.0)
    model = nn.Sequential(layer)
    x = torch.randn(5, 8, generator=_gen(7))
    observers = observe_activations(model, [x], observer_factory(StaticConfig(act_granularity="channel")))
    stats = export_stats(observers)
    assert set(stats) == {"0.min_val", "0.max_val"} and layer.act_quant is None
    assert torch.equal(stats["0.max_val"], (x / 2).amax(0))  # exact: what act_quant sees, after input_scale


@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_static_nan_activation_names_the_module(tiny_model, observer):
    model, _ = tiny_model
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_proj.*NaN/Inf"):
        quantlab.quantize(model, StaticConfig(observer=observer), calibration=_ids(1))


def test_static_convert_before_calibrate_fails(tiny_model):
    model, _ = tiny_model
    config = StaticConfig()
    get_method(config).prepare(model, config)
    with pytest.raises(ValueError, match=r"static: calibrate\(\) must run before convert\(\)"):
        get_method(config).convert(model, config)


def test_static_reports_its_activation_ranges_for_the_row():
    """calibrate() returns the largest max(|lo|, |hi|) over layers, its layer and the median over layers
    (torch.median: the lower middle value): checked exactly against the inputs each prepared layer receives,
    recorded by hooks on the same calibration batches."""
    gen = _gen(11)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 4))
    batches = [torch.randn(3, 8, generator=gen) * 5 for _ in range(2)]
    config = make_config({"method": "static", "base": {"method": "rtn", "bits": 8, "include": ["0", "2", "4"]}})
    get_method(config).prepare(model, config)
    seen = {n: [] for n in ("0", "2", "4")}
    hooks = [model[int(n)].register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0])) for n in seen]
    with torch.no_grad():
        for b in batches:
            model(b)  # the prepared (fake-quant) forward: what static's observers see
    for h in hooks:
        h.remove()
    absmax = {n: max(float(torch.cat(xs).min().abs()), float(torch.cat(xs).max().abs())) for n, xs in seen.items()}
    diag = get_method(config).calibrate(model, config, batches, progress=False)
    top = max(absmax, key=absmax.get)
    assert diag["static_range_absmax_max_layer"] == top
    assert diag["static_range_absmax_max"] == absmax[top]
    assert diag["static_range_absmax_median"] == sorted(absmax.values())[1]  # the middle of three
