"""SmoothQuant: the smoothed float model is unchanged (Llama, OPT, BERT); only norm-fed groups by default
(the paper), linear-fed ones as an option; the α search simulates each consumer's grid; outlier channels
are tamed; unsupported bases and values fail at config time."""
import pytest
import torch
from torch import nn

import quantlab
from quantlab.calibration.smoothing import apply_scale, group_applies
from quantlab.core.activations import DynamicActQuant, StaticActQuant
from quantlab.core.lifecycle import quant_linears, swap_in_quant_linears
from quantlab.core.primitives import fake_quantize, qparams, sqnr_db
from quantlab.core.qlinear import WeightSpec
from quantlab.core.registry import LayerSelection, config_to_dict, get_method, make_config, method_versions
from quantlab.methods.smoothquant import (
    ALPHA_GRID,
    SEARCH_ROWS,
    SmoothQuantConfig,
    act_quantizer,
    collect_smoothing_stats,
    consumer_grid,
    diagnostics,
    output_error,
    search_alpha,
    smooth,
    smoothing_scale,
    weight_quantizer,
)
from quantlab.models.arch import arch_for, find_blocks
from quantlab.runs.experiment import parse_experiment


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


@pytest.mark.parametrize("linear_inputs", [False, True])
@pytest.mark.parametrize("kind,n_norm,n_all", [  # groups smoothed: norm inputs only (default), all table groups
    ("llama-gqa", 4, 6), ("llama-mha", 4, 8), ("opt", 4, 8), ("opt-post-ln", 0, 4), ("bert", 4, 8),
])
def test_smoothed_float_model_is_unchanged(kind, n_norm, n_all, linear_inputs, tiny_model):
    model = tiny_model[0] if kind == "llama-gqa" else _tiny(kind)  # GQA: v_proj -> o_proj does not fit, skipped
    if kind == "bert":  # explicit groups scale at QuantLinear.input_scale: float QuantLinears, nothing quantized
        _float_quant_linears(model)
    ids = torch.cat(_ids(2, 24, seed=1))
    ref = _out(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = collect_smoothing_stats(model, _ids(3), linear_inputs=linear_inputs)
    chosen = smooth(model, stats, alpha=0.5, linear_inputs=linear_inputs)
    n_groups = n_all if linear_inputs else n_norm
    assert len(chosen) == n_groups and set(chosen.values()) <= {0.5}
    changed = [k for k, v in model.state_dict().items() if k not in before or not torch.equal(v, before[k])]
    assert len(changed) >= n_groups  # the scales really moved weights around
    # reference: the unsmoothed float model; rtol 1e-5, atol 1e-5 of the output's scale (float32 reassociation)
    torch.testing.assert_close(_out(model, ids), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _float_quant_linears(model):
    swap_in_quant_linears(model, LayerSelection(), WeightSpec(8))
    for layer in quant_linears(model).values():
        layer.quant_enabled = False
    return model


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
    if kind == "bert":  # default: the norm-fed explicit groups only (query, key, value; intermediate.dense)
        assert sum(m.input_scale is not None for m in layers) == 2 * 4
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
    model.config.model_type = "gpt9"  # gpt2 has an entry now (tests/test_arch_coverage.py)
    with pytest.raises(ValueError, match=r"model_type 'gpt9' has no architecture entry; supported: bert, .*llama, .*opt"):
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


# ---- which groups: norm inputs by default (the paper), linear inputs as an option -------------------------

def _layer_weights(state, i, names):
    return {n: state[f"model.layers.{i}.{n}.weight"] for n in names}


def test_default_smooths_exactly_the_norm_groups():
    model = _tiny("llama-mha")  # MHA: v_proj -> o_proj would fit, so leaving it alone is a choice
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = collect_smoothing_stats(model, _ids(3))
    assert set(stats) == {f"model.layers.{i}.{c}" for i in range(2) for c in ("self_attn.q_proj", "mlp.gate_proj")}
    smooth(model, stats, alpha=0.5)
    after = model.state_dict()
    for i in range(2):
        untouched = ("self_attn.o_proj", "mlp.down_proj")  # consumers of the linear -> linear groups
        assert all(torch.equal(a, b) for a, b in zip(_layer_weights(after, i, untouched).values(),
                                                     _layer_weights(before, i, untouched).values()))
        for norm, consumers in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            old = _layer_weights(before, i, consumers)
            s = smoothing_scale(stats[f"model.layers.{i}.{consumers[0]}"].compute(), list(old.values()), 0.5)
            assert (s - 1).abs().max() > 0.1  # a real rescaling
            new = _layer_weights(after, i, consumers)
            for c in consumers:  # exact (atol 0): the same float32 multiply, columns only (v_proj's rows untouched)
                torch.testing.assert_close(new[c], old[c] * s, rtol=0, atol=0)
            key = f"model.layers.{i}.{norm}.weight"
            torch.testing.assert_close(after[key], before[key] / s, rtol=0, atol=0)


def _smooth_every_table_group(model, stats, alpha, base=None):
    """Reference: SmoothQuant v1, i.e. before smooth_linear_inputs existed: every architecture-table group
    that fits its block, in table order; a searched α on the weight base's one grid. (Checked bitwise against
    the v1 code on Llama GQA/MHA, OPT, BERT x fixed/searched α x dynamic/static/gptq bases when written.)"""
    names = {id(m): n for n, m in model.named_modules()}
    chosen = {}
    for block in find_blocks(model):
        for g in arch_for(model)["groups"]:
            if not group_applies(block, g):
                continue
            name, weights = f"{names[id(block)]}.{g.consumers[0]}", [block.get_submodule(c).weight for c in g.consumers]
            a = alpha
            if alpha == "search":
                a, _ = search_alpha(stats[name].samples, stats[name].compute(), weights, act_quantizer(base),
                                    weight_quantizer(base.base.weight_spec))
            apply_scale(block, g, smoothing_scale(stats[name].compute(), weights, a))
            chosen[name] = a
    return chosen


@pytest.mark.parametrize("kind", ["llama-mha", "opt"])
@pytest.mark.parametrize("alpha", [0.5, "search"])
def test_smooth_linear_inputs_reproduces_every_table_group_bitwise(kind, alpha):
    import copy

    base = make_config({"method": "dynamic", "base": {"method": "rtn", "bits": 4, "group_size": 32}})
    model = _tiny(kind)
    stats = collect_smoothing_stats(model, _ids(3), SEARCH_ROWS, linear_inputs=True)
    reference = copy.deepcopy(model)
    got = smooth(model, stats, alpha, base, linear_inputs=True)
    want = _smooth_every_table_group(reference, stats, alpha, base)
    assert got == want and len(got) == 8  # 4 groups per block: 2 norm-fed + 2 linear-fed
    ref_state = reference.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in model.state_dict().items())  # bit for bit


# ---- bases: rtn / gptq weights only, rejected at config time otherwise ------------------------------------

@pytest.mark.parametrize("alpha", [0.5, "search"])
@pytest.mark.parametrize("act", ["dynamic", "static"])
@pytest.mark.parametrize("weights,match", [
    ("awq", r"smoothquant: weight base 'awq' \(base\.base\) is not supported: AWQ searches and folds its own "
            r"scales into the same groups.*; supported: gptq, rtn$"),
    ("qat", r"base: (dynamic|static): base 'qat' would never be trained"),  # refused by the activation base
])
def test_unsupported_weight_base_fails_at_config_time(alpha, act, weights, match):
    spec = {"method": "smoothquant", "alpha": alpha, "base": {"method": act, "base": {"method": weights}}}
    with pytest.raises(ValueError, match=match):
        make_config(spec)
    with pytest.raises(ValueError, match=match):  # an experiment fails while parsing, before any model loads
        parse_experiment({"name": "x", "model": "no-such-model", "run": [{"name": "sq", **spec}]})


def test_supported_weight_bases_build():
    for weights in ("rtn", "gptq"):
        cfg = make_config({"method": "smoothquant", "alpha": "search",
                           "base": {"method": "dynamic", "base": {"method": weights, "bits": 4}}})
        assert get_method(cfg.base.base).name == weights


# ---- α search: each consumer on its own grid --------------------------------------------------------------

def test_consumer_grid_applies_the_weight_base_overrides_and_selection():
    base = make_config({"method": "static", "base": {
        "method": "gptq", "bits": 4, "group_size": 32, "exclude": ["lm_head", "*.k_proj"],
        "overrides": [{"pattern": "model.layers.0.mlp.*", "bits": 8},
                      {"pattern": "*.up_proj", "group_size": "channel"}],
    }})
    assert consumer_grid(base, "model.layers.0.mlp.gate_proj") == WeightSpec(8, 32, True)
    assert consumer_grid(base, "model.layers.0.mlp.up_proj") == WeightSpec(8, None, True)  # later match wins
    assert consumer_grid(base, "model.layers.1.mlp.up_proj") == WeightSpec(4, None, True)
    assert consumer_grid(base, "model.layers.1.self_attn.q_proj") == WeightSpec(4, 32, True)
    assert consumer_grid(base, "model.layers.1.self_attn.k_proj") is None  # excluded: stays float


def test_output_error_with_one_quantizer_per_consumer():
    x, (w1,) = _outlier_pair()
    w2 = torch.randn(16, 64, generator=_gen(4))
    s = smoothing_scale(x.abs().amax(0), [w1, w2], 0.5)
    act_fq, w4 = DynamicActQuant(8, True), weight_quantizer(WeightSpec(4))
    # reference: the formula written out, consumer 2 in float (neither weight nor input quantized)
    ref1, ref2 = x @ w1.t(), x @ w2.t()
    num = (ref1 - act_fq(x / s) @ w4(w1 * s).t()).pow(2).sum() + (ref2 - (x / s) @ (w2 * s).t()).pow(2).sum()
    want = float(num / (ref1.pow(2).sum() + ref2.pow(2).sum()))
    assert output_error(x, [w1, w2], s, act_fq, [w4, None]) == pytest.approx(want, rel=1e-5)  # float32 sums
    # one quantizer for all == the same quantizer listed per consumer, exactly
    assert output_error(x, [w1, w2], s, act_fq, w4) == output_error(x, [w1, w2], s, act_fq, [w4, w4])
    with pytest.raises(ValueError, match="output_error: 1 weight quantizers for 2 consumers"):
        output_error(x, [w1, w2], s, act_fq, [w4])


def _searched_alphas(model_dir, weight_base):
    model = _with_outliers(quantlab.load_model(str(model_dir), device="cpu")[0])
    cfg = make_config({"method": "smoothquant", "alpha": "search", "base": {"method": "dynamic", "base": weight_base}})
    return smooth(model, collect_smoothing_stats(model, _ids(4), SEARCH_ROWS, progress=False), "search", cfg.base)


def test_override_changes_the_searched_alpha_of_its_layer_only(tiny_model_dir):
    w4 = _searched_alphas(tiny_model_dir, {"method": "rtn", "bits": 4})
    w8 = _searched_alphas(tiny_model_dir, {"method": "rtn", "bits": 8})
    mixed = _searched_alphas(tiny_model_dir, {"method": "rtn", "bits": 4,
                                              "overrides": [{"pattern": "model.layers.0.mlp.*", "bits": 8}]})
    group = "model.layers.0.mlp.gate_proj"
    assert w4[group] != w8[group]  # the case separates the grids (measured: 0.3 at 4 bits, 0.5 at 8 bits)
    assert mixed[group] == w8[group]  # gate_proj and up_proj simulated at 8 bits
    assert {k: v for k, v in mixed.items() if k != group} == {k: v for k, v in w4.items() if k != group}


# ---- BERT: the explicit groups fed by a LayerNorm only ------------------------------------------------------

def test_bert_default_smooths_query_key_value_and_intermediate_only():
    model = _float_quant_linears(_tiny("bert"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen = smooth(model, collect_smoothing_stats(model, _ids(3)), alpha=0.5)
    layers = [f"encoder.layer.{i}." for i in range(2)]
    assert set(chosen) == {p + c for p in layers for c in ("attention.self.query", "intermediate.dense")}
    scaled = {n for n, m in quant_linears(model).items() if m.input_scale is not None}
    assert scaled == {p + c for p in layers for c in ("attention.self.query", "attention.self.key",
                                                       "attention.self.value", "intermediate.dense")}
    after = model.state_dict()
    for key in (p + c + ".weight" for p in layers for c in ("attention.output.dense", "output.dense")):
        assert torch.equal(after[key], before[key])  # the linear-fed consumers are untouched


# ---- diagnostics and version ----------------------------------------------------------------------------------

def test_diagnostics_count_groups_and_summarize_alphas():
    chosen = {"a": 0.25, "b": 0.5, "c": 0.75}
    assert diagnostics(chosen, searched=True) == {"smoothquant_groups": 3, "smoothquant_alpha_mean": 0.5,
                                                  "smoothquant_alpha_min": 0.25, "smoothquant_alpha_max": 0.75}
    assert diagnostics({"a": 0.5}, searched=False) == {"smoothquant_groups": 1, "smoothquant_alpha_mean": 0.5}
    assert diagnostics({}, searched=True) == {"smoothquant_groups": 0}


@pytest.mark.parametrize("alpha", [0.3, "search"])
def test_calibrate_reports_diagnostics_merged_with_the_base(tiny_model, monkeypatch, alpha):
    model, _ = tiny_model
    static = get_method("static")
    base_calibrate = static.calibrate
    monkeypatch.setattr(static, "calibrate", lambda *a, **k: {**(base_calibrate(*a, **k) or {}), "static_probe": 1})
    config = make_config({"method": "smoothquant", "alpha": alpha, "base": {"method": "static"}})
    summary = quantlab.quantize(model, config, calibration=_ids(2), progress=False)
    got = summary["diagnostics"]
    assert got["static_probe"] == 1 and got["smoothquant_groups"] == 4  # 2 blocks x (q/k/v, gate/up)
    if alpha == "search":
        assert {got["smoothquant_alpha_min"], got["smoothquant_alpha_max"]} <= set(ALPHA_GRID)
        assert got["smoothquant_alpha_min"] <= got["smoothquant_alpha_mean"] <= got["smoothquant_alpha_max"]
    else:
        assert got["smoothquant_alpha_mean"] == 0.3 and "smoothquant_alpha_min" not in got


def test_version_2_changes_run_keys():
    assert method_versions(make_config({"method": "smoothquant"})) == {"smoothquant": 2}
