"""SmoothQuant: the smoothed float model is unchanged (Llama, OPT, BERT); outlier channels are tamed; errors."""
import pytest
import torch
from torch import nn

import quantlab
from quantlab.core.activations import DynamicActQuant, StaticActQuant
from quantlab.core.lifecycle import quant_linears, swap_in_quant_linears
from quantlab.core.primitives import fake_quantize, qparams, sqnr_db
from quantlab.core.qlinear import WeightSpec
from quantlab.core.registry import LayerSelection, config_to_dict, get_method, make_config
from quantlab.methods.smoothquant import (
    ALPHA_GRID,
    SmoothQuantConfig,
    collect_smoothing_stats,
    output_error,
    search_alpha,
    smooth,
    smoothing_scale,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _ids(n, t=32, seed=0, vocab=300):
    gen = _gen(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


def _tiny(kind: str) -> nn.Module:
    """Small random models; norms get random weights/biases so folding them is really exercised."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if kind == "llama-mha":  # no GQA: v_proj -> o_proj is smoothed too
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=128))
    elif kind.startswith("opt"):
        model = OPTForCausalLM(OPTConfig(
            vocab_size=300, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, word_embed_proj_dim=64, do_layer_norm_before=kind == "opt"))
    elif kind == "bert":
        model = BertModel(BertConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None:
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()


def _out(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind,n_groups", [
    ("llama-gqa", 6), ("llama-mha", 8), ("opt", 8), ("opt-post-ln", 4), ("bert", 8),
])
def test_smoothed_float_model_is_unchanged(kind, n_groups, tiny_model):
    model = tiny_model[0] if kind == "llama-gqa" else _tiny(kind)  # GQA: v_proj -> o_proj does not fit, skipped
    if kind == "bert":  # explicit groups scale at QuantLinear.input_scale: float QuantLinears, nothing quantized
        swap_in_quant_linears(model, LayerSelection(), WeightSpec(8))
        for layer in quant_linears(model).values():
            layer.quant_enabled = False
    ids = torch.cat(_ids(2, 24, seed=1))
    ref = _out(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen = smooth(model, collect_smoothing_stats(model, _ids(3)), alpha=0.5)
    assert len(chosen) == n_groups and set(chosen.values()) == {0.5}
    changed = [k for k, v in model.state_dict().items() if k not in before or not torch.equal(v, before[k])]
    assert len(changed) >= n_groups  # the scales really moved weights around
    # reference: the unsmoothed float model; rtol 1e-5, atol 1e-5 of the output's scale (float32 reassociation)
    torch.testing.assert_close(_out(model, ids), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_smoothing_scale_matches_brute_force():
    gen = _gen(2)
    act_absmax = torch.rand(6, generator=gen) * 10
    weights = [torch.randn(4, 6, generator=gen), torch.randn(3, 6, generator=gen)]
    for alpha in (0.0, 0.5, 0.85, 1.0):
        got = smoothing_scale(act_absmax, weights, alpha)
        ref = [
            float(act_absmax[c]) ** alpha / max(abs(float(w[r, c])) for w in weights for r in range(w.shape[0])) ** (1 - alpha)
            for c in range(6)
        ]
        torch.testing.assert_close(got, torch.tensor(ref), rtol=1e-6, atol=0)  # Python-float loop, float32 result


def _outlier_pair():
    """A norm -> linear pair's view: X (256, 64) with 3 channels 50x larger, one consumer W (48, 64)."""
    gen = _gen(3)
    x = torch.randn(256, 64, generator=gen)
    x[:, [3, 17, 40]] *= 50
    return x, [torch.randn(48, 64, generator=gen) * 0.05]


def _w8(w):
    return fake_quantize(w, qparams(w, 8, None, True), 8, None)


def test_search_alpha_beats_no_smoothing_on_outlier_channels():
    x, weights = _outlier_pair()
    act_fq = DynamicActQuant(8, True)
    alpha, errors = search_alpha(x, x.abs().amax(0), weights, act_fq, _w8)
    assert alpha in ALPHA_GRID and len(errors) == len(ALPHA_GRID)
    assert errors[ALPHA_GRID.index(alpha)] == min(errors)  # exact: argmin of the grid
    unsmoothed = output_error(x, weights, torch.ones(64), act_fq, _w8)
    assert min(errors) < 0.2 * unsmoothed and 0 < alpha < 1  # W8A8 relative error vs the same pair unsmoothed


def _with_outliers(model):
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] *= 50  # a few input channels 50x larger, as in real LLMs
    return model


@pytest.mark.parametrize("base,alpha,margin_db", [
    ({"method": "dynamic"}, 0.5, 5.0), ({"method": "dynamic"}, "search", 5.0), ({"method": "static"}, 0.5, 3.0),
])
def test_w8a8_error_with_smoothquant_is_lower_on_outlier_channels(tiny_model_dir, base, alpha, margin_db):
    calib, ids = _ids(4), torch.cat(_ids(2, seed=5))

    def quantized_sqnr(config):
        model = _with_outliers(quantlab.load_model(str(tiny_model_dir), device="cpu")[0])
        ref = _out(model, ids)
        quantlab.quantize(model, config, calibration=calib)
        return sqnr_db(ref, _out(model, ids))

    plain = quantized_sqnr(make_config(base))
    smoothed = quantized_sqnr(make_config({"method": "smoothquant", "alpha": alpha, "base": base}))
    # reference: the same W8A8 base without smoothing, on the same float model; measured: +9 dB dynamic, +5 dB static
    assert smoothed > plain + margin_db


@pytest.mark.parametrize("kind", ["opt", "bert"])
@pytest.mark.parametrize("base", [{"method": "dynamic"}, {"method": "static", "act_granularity": "channel"}])
def test_smoothquant_lifecycle_on_opt_and_bert(kind, base):
    model = _tiny(kind)
    calib = _ids(3)
    ids = torch.cat(calib)
    ref = _out(model, ids)
    quantlab.quantize(model, make_config({"method": "smoothquant", "base": base}), calibration=iter(calib))
    layers = quant_linears(model).values()
    act = DynamicActQuant if base["method"] == "dynamic" else StaticActQuant
    assert layers and all(m.frozen and isinstance(m.act_quant, act) for m in layers)
    if kind == "bert":
        assert sum(m.input_scale is not None for m in layers) == 2 * 5  # explicit groups: q, k, v, intermediate, output
    assert sqnr_db(ref, _out(model, ids)) >= 25.0  # dB vs float outputs on the calibration tokens; measured ≥ 38


def test_nan_activation_names_the_module(tiny_model):
    model, _ = tiny_model
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[0] = float("nan")
    with pytest.raises(ValueError, match=r"smoothquant observer of model\.layers\.1\.mlp\.gate_proj: NaN/Inf"):
        quantlab.quantize(model, SmoothQuantConfig(), calibration=_ids(1))


def test_unknown_model_type_lists_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' has no architecture entry; supported: bert, llama, .*opt"):
        quantlab.quantize(model, SmoothQuantConfig(), calibration=_ids(1, vocab=50))


def test_convert_before_calibrate_fails(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match=r"smoothquant: calibrate\(\) must run before convert\(\)"):
        get_method("smoothquant").convert(model, SmoothQuantConfig())


@pytest.mark.parametrize("spec", [
    {"method": "smoothquant", "alpha": 0.5, "base": {"method": "dynamic"}},
    {"method": "smoothquant", "alpha": "search", "base": {"method": "static", "base": {"method": "gptq", "bits": 4}}},
])
def test_config_round_trips_through_dict(spec):
    cfg = make_config(spec)
    assert make_config(config_to_dict(cfg)) == cfg
    assert config_to_dict(cfg)["base"]["method"] == spec["base"]["method"]


@pytest.mark.parametrize("spec,match", [
    ({"alpha": 1.5}, r"alpha must be a number in \[0, 1\] or 'search', got 1.5"),
    ({"alpha": "serch"}, r"alpha must be a number in \[0, 1\] or 'search', got 'serch'"),
    ({"alpha": True}, r"alpha must be a number in \[0, 1\] or 'search', got True"),
    ({"base": {"method": "rtn"}}, r"smoothquant: base must be an activation method \(dynamic, static\), got 'rtn'"),
    ({"base": {"method": "dynamic", "act_bits": 16}}, "base: act_bits must be an integer in 4..8, got 16"),
])
def test_bad_config_values_are_rejected(spec, match):
    with pytest.raises(ValueError, match=match):
        make_config({"method": "smoothquant", **spec})
