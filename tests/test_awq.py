"""AWQ: config, the scale / clip searches against brute-force references, the lifecycle on tiny Llama and BERT."""
import copy

import pytest
import torch
from torch import nn

import quantlab
from quantlab.core.lifecycle import quant_linears, swap_in_quant_linears
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.core.registry import config_to_dict, get_method, make_config
from quantlab.methods.awq import (
    AWQConfig,
    awq_block,
    awq_scale,
    fake_quant_weight,
    float_weights,
    scaled_error,
    search_clip,
    search_scale,
)
from quantlab.methods.blocks import capture_block_inputs, run_block
from quantlab.methods.rtn import RTNConfig


def _salient_inputs(tokens=512, channels=128, n_salient=4, boost=30.0, seed=0):
    """Activations (tokens, C) whose first n_salient channels are ~boost times larger (AWQ's premise)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    x[:, :n_salient] *= boost
    return x


def _direct_error(w, x, w_q, s=None):
    """Brute-force ‖W X − Q(W s)(X / s)‖² on the token rows of x (w_q already holds Q(W s))."""
    x_in = x if s is None else x / s
    return float((x @ w.T - x_in @ w_q.T).detach().double().pow(2).sum())


def _ids(n=4, t=24, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


# ---- config ---------------------------------------------------------------------------------

def test_config_round_trips_and_is_registered():
    cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 32}})
    assert cfg.base == RTNConfig(bits=4, group_size=32)
    assert make_config(config_to_dict(cfg)) == cfg
    assert config_to_dict(cfg)["base"]["method"] == "rtn"
    method = get_method(cfg)
    assert method.name == "awq" and method.needs_calibration
    assert AWQConfig().base == RTNConfig(bits=4, group_size=64)
    assert AWQConfig().clip_ratios[0] == 1.0 and AWQConfig().clip_ratios[-1] == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs,match", [
    ({"n_grid": 0}, r"n_grid must be an integer in 1\.\.1000, got 0"),
    ({"clip_grid": 2.5}, r"clip_grid must be an integer in 1\.\.1000, got 2\.5"),
    ({"clip_max_shrink": 1.0}, r"clip_max_shrink must be a number in \[0, 1\), got 1\.0"),
    ({"clip_search": "yes"}, r"clip_search must be true or false, got 'yes'"),
    ({"base": {"method": "none"}}, r"base must be a weight-only rtn config \(method 'rtn'\), got method 'none'"),
    ({"base": {"method": "rtn", "bitz": 4}}, r"base: unknown config key\(s\) 'bitz' for method 'rtn'"),
    ({"base": 4}, r"base must be an rtn config or a dict with method 'rtn', got 4"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AWQConfig(**kwargs)


# ---- pure numerics vs brute force -------------------------------------------------------------

def test_gram_loss_equals_direct_output_error():
    x = _salient_inputs()
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    spec = WeightSpec(3, 32)
    s = awq_scale(x.abs().mean(0), 0.5)
    got = float(scaled_error([w], x.T @ x, s, spec))
    want = _direct_error(w, x, fake_quant_weight(w * s, spec), s)
    assert got == pytest.approx(want, rel=1e-4)  # reference: brute force over tokens; fp32 Gram rounding


def test_alpha_zero_is_rtn_exactly():
    x_mean = _salient_inputs().abs().mean(0)
    assert torch.equal(awq_scale(x_mean, 0.0), torch.ones(128))  # atol = 0


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_searched_scale_never_worse_than_rtn(bits, seed):
    """One group (a norm feeding two linears): the chosen α's loss <= α = 0's, measured by brute force."""
    x = _salient_inputs(seed=seed)
    gen = torch.Generator().manual_seed(seed + 10)
    weights = [torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)]
    spec = WeightSpec(bits, 32)
    s, alpha, losses = search_scale(weights, x.abs().mean(0), x.T @ x, spec, n_grid=20)
    awq = sum(_direct_error(w, x, fake_quant_weight(w * s, spec), s) for w in weights)
    rtn = sum(_direct_error(w, x, fake_quant_weight(w, spec)) for w in weights)
    assert awq <= rtn * (1 + 1e-5)  # reference: plain RTN (α = 0); tolerance: fp32 summation order
    assert min(losses) == losses[round(alpha * 20)]


@pytest.mark.parametrize("bits", [3, 4])
def test_awq_beats_rtn_with_salient_channels(bits):
    x = _salient_inputs(n_salient=4, boost=30.0)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    spec = WeightSpec(bits, 32)
    s, alpha, _ = search_scale([w], x.abs().mean(0), x.T @ x, spec)
    awq = _direct_error(w, x, fake_quant_weight(w * s, spec), s)
    rtn = _direct_error(w, x, fake_quant_weight(w, spec))
    assert alpha > 0 and awq < 0.8 * rtn  # reference: RTN on the same layer and data; at least 20% lower


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 48, None])  # 48 leaves a ragged tail of 128 columns
def test_clip_search_never_worse_and_helps_heavy_tails(symmetric, group_size):
    x = _salient_inputs(n_salient=2, boost=4.0)
    gen = torch.Generator().manual_seed(7)
    outliers = torch.rand(64, 128, generator=gen) < 0.02
    w = torch.randn(64, 128, generator=gen) + 8.0 * outliers  # sparse large weights: clipping pays off
    spec = WeightSpec(3, group_size, symmetric, "float32")
    p = search_clip(w, x.T @ x, spec, AWQConfig().clip_ratios)
    clipped = _direct_error(w, x, fake_quant_weight(w, spec, p))
    minmax = _direct_error(w, x, fake_quant_weight(w, spec))
    assert p is not None and clipped < minmax  # reference: min-max RTN on the same layer; strict improvement


def test_clip_search_keeps_minmax_when_nothing_helps():
    w = torch.sign(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))  # ±1: already on the grid
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    assert search_clip(w, x.T @ x, WeightSpec(4, 32), AWQConfig().clip_ratios) is None


# ---- one block, tiny Llama ------------------------------------------------------------------

def _prepared_llama(tiny_model, bits=4, group_size=32):
    model, _ = tiny_model
    swap_in_quant_linears(model, RTNConfig().selection, WeightSpec(bits, group_size))
    return model


def test_folded_scales_keep_the_float_model(tiny_model):
    """After AWQ's scales are folded and BEFORE quantizing, the float forward equals the original."""
    model = _prepared_llama(tiny_model)
    ids = _ids()
    layers = quant_linears(model)
    with torch.no_grad(), float_weights(layers):
        ref = [model(i).logits for i in ids]
    cfg = AWQConfig(base=RTNConfig(bits=3, group_size=32), clip_search=False)
    quantlab.get_method("awq").calibrate(model, cfg, ids)
    assert model.model.layers[0].input_layernorm.weight.ne(1).any()  # a scale was actually folded
    with torch.no_grad(), float_weights(layers):
        got = [model(i).logits for i in ids]
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # reference: original float model


def test_per_layer_error_with_clip_is_not_worse(tiny_model):
    """Clip search on: each layer's output error on its scaled calibration input is <= min-max's, same scales."""
    model = _prepared_llama(tiny_model, bits=3)
    block = model.model.layers[0]
    hidden, kwargs = capture_block_inputs(model, _ids(n=8))
    awq_block(block, quantlab.models.arch.arch_for(model)["groups"], hidden, kwargs, AWQConfig())
    layers = {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear)}
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].flatten(0, -2)))
             for n, m in layers.items()]
    with torch.no_grad(), float_weights(layers):
        run_block(block, hidden, kwargs)  # the inputs the scaled block's linears see
    for h in hooks:
        h.remove()
    improved = 0
    for name, layer in layers.items():
        x, w = torch.cat(inputs[name]), layer.weight
        with torch.no_grad():
            clipped = _direct_error(w, x, layer.quantized_weight())  # uses the searched fixed_qparams
        minmax = _direct_error(w, x, fake_quant_weight(w, layer.spec))
        assert clipped <= minmax * (1 + 1e-5), name  # reference: min-max RTN on the same scaled layer
        improved += layer.fixed_qparams is not None and clipped < minmax
    assert improved >= 1  # clipping pays off somewhere at 3 bits


def test_quantize_end_to_end_frozen_equals_fake_quant(tiny_model):
    model, _ = tiny_model
    float_model = copy.deepcopy(model)
    cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 32}})
    method, ids, probe = get_method(cfg), _ids(), _ids(n=1, t=32, seed=9)[0]
    method.prepare(model, cfg)
    method.calibrate(model, cfg, ids)
    assert any(m.fixed_qparams is not None for m in quant_linears(model).values())
    with torch.no_grad():
        fake = model(probe).logits
        method.convert(model, cfg)
        frozen = model(probe).logits
        ref = float_model(probe).logits
    layers = quant_linears(model)
    assert len(layers) == 14 and all(m.frozen and m.weight is None for m in layers.values())
    assert type(model.lm_head) is nn.Linear
    assert torch.equal(fake, frozen)  # atol = 0: the frozen codes reproduce the fake-quant forward
    snr = 10 * torch.log10(ref.pow(2).sum() / (ref - frozen).pow(2).sum())
    assert snr > 15  # dB vs float, w4 g32 on every decoder linear


def test_quantize_via_api_runs_the_calibration(tiny_model):
    """quantize() with an AWQ config does AWQ, not just its RTN base: scales folded, other codes."""
    model, _ = tiny_model
    rtn = copy.deepcopy(model)
    quantlab.quantize(rtn, RTNConfig(bits=4, group_size=32))
    norm = model.model.layers[0].input_layernorm.weight.detach().clone()
    cfg = AWQConfig(base=RTNConfig(bits=4, group_size=32), n_grid=5)
    summary = quantlab.quantize(model, cfg, calibration=_ids(n=2))
    assert summary["method"] == "awq" and summary["quantized_layers"] == 14
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm)
    awq_layers, rtn_layers = quant_linears(model), quant_linears(rtn)
    assert all(m.frozen for m in awq_layers.values())
    assert sum(not torch.equal(awq_layers[n].qweight, rtn_layers[n].qweight) for n in awq_layers) >= 7


# ---- errors ---------------------------------------------------------------------------------

def test_empty_calibration_is_a_clear_error(tiny_model):
    model, _ = tiny_model
    quantlab.get_method("awq").prepare(model, AWQConfig())
    with pytest.raises(ValueError, match="awq needs calibration tokens; got 0 batches holding 0 tokens"):
        quantlab.get_method("awq").calibrate(model, AWQConfig(), [])


def test_nan_activations_name_the_module(tiny_model):
    model = _prepared_llama(tiny_model)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/Inf in the input activations of model\.layers\.0\.mlp\.gate_proj"):
        quantlab.get_method("awq").calibrate(model, AWQConfig(), _ids(n=1))


def test_unknown_model_type_lists_supported(tiny_model):
    model, _ = tiny_model
    model.config.model_type = "gpt9"
    with pytest.raises(ValueError, match=r"model_type 'gpt9' has no architecture entry; supported: bert, llama"):
        quantlab.get_method("awq").prepare(model, AWQConfig())
    assert not quant_linears(model)  # failed before touching the model


# ---- BERT: explicit-scale groups ---------------------------------------------------------------

@pytest.fixture()
def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return BertModel(cfg).eval()


def test_bert_end_to_end_with_explicit_scales(tiny_bert):
    model = tiny_bert
    ids = _ids(n=3, t=16, vocab=100)
    with torch.no_grad():
        ref = model(ids[0]).last_hidden_state
    cfg = AWQConfig(base=RTNConfig(bits=4, group_size=16), clip_search=False)
    method = get_method(cfg)
    method.prepare(model, cfg)
    method.calibrate(model, cfg, ids)
    layers = quant_linears(model)
    assert len(layers) == 2 * 6 + 1  # + pooler.dense, outside the blocks: plain min-max
    assert layers["encoder.layer.0.attention.self.query"].input_scale is not None
    assert layers["encoder.layer.1.output.dense"].input_scale is not None
    with torch.no_grad(), float_weights(layers):
        folded = model(ids[0]).last_hidden_state
    torch.testing.assert_close(folded, ref, rtol=1e-5, atol=1e-5)  # reference: original float BERT
    with torch.no_grad():
        fake = model(ids[0]).last_hidden_state
        method.convert(model, cfg)
        frozen = model(ids[0]).last_hidden_state
    assert all(m.frozen for m in layers.values())
    assert torch.equal(fake, frozen)  # atol = 0
    snr = 10 * torch.log10(ref.pow(2).sum() / (ref - frozen).pow(2).sum())
    assert snr > 15  # dB vs float, w4 g16


def test_bert_quantize_with_clip_search(tiny_bert):
    """Clip search only shrinks ranges: block 0 (same inputs and scales with or without it; later blocks
    see other quantized outputs) ends with symmetric scales <= min-max's, some strictly smaller."""
    calib, minmax = _ids(n=2, t=16, vocab=100), copy.deepcopy(tiny_bert)
    summary = quantlab.quantize(tiny_bert, AWQConfig(base=RTNConfig(bits=4, group_size=16)), calibration=calib)
    quantlab.quantize(minmax, AWQConfig(base=RTNConfig(bits=4, group_size=16), clip_search=False), calibration=calib)
    assert summary["quantized_layers"] == 13
    clipped, plain = quant_linears(tiny_bert), quant_linears(minmax)
    assert all(m.frozen for m in clipped.values())
    block0 = [n for n in clipped if n.startswith("encoder.layer.0.")]
    assert len(block0) == 6 and all(torch.equal(clipped[n].input_scale, plain[n].input_scale) for n in block0
                                    if clipped[n].input_scale is not None)
    assert all((clipped[n].scale <= plain[n].scale).all() for n in block0)
    assert any((clipped[n].scale < plain[n].scale).any() for n in block0)
