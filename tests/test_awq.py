"""AWQ as the reference defines it (llm-awq): config, the four reference behaviours against brute-force
and float-model references, diagnostics, the lifecycle on tiny Llama and BERT.
The version-1 variants: test_awq_variants.py."""
import copy
import json

import pytest
import torch
from awq_v1_reference import build_model, calibration_ids
from torch import nn

import quantlab
from quantlab.calibration.awq_search import awq_scale, fake_quant_weight, search_clip_symmetric
from quantlab.calibration.blocks import capture_block_inputs
from quantlab.core.lifecycle import quant_linears, swap_in_quant_linears
from quantlab.core.qlinear import WeightSpec
from quantlab.core.registry import config_to_dict, get_method, make_config, method_versions
from quantlab.methods.awq import AWQConfig, awq_block, float_weights
from quantlab.methods.rtn import RTNConfig
from quantlab.models.arch import arch_for

REFERENCE_CLIP_GRID = [1 - i / 20 for i in range(10)]  # llm-awq auto_clip_layer: n_grid 20, max_shrink 0.5


def _ids(n=4, t=24, vocab=300, seed=0):
    return calibration_ids(n, t, vocab, seed)


# ---- config ---------------------------------------------------------------------------------

def test_config_round_trips_and_is_registered():
    cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 32}})
    assert cfg.base == RTNConfig(bits=4, group_size=32)
    assert make_config(config_to_dict(cfg)) == cfg
    assert config_to_dict(cfg)["base"]["method"] == "rtn"
    method = get_method(cfg)
    assert method.name == "awq" and method.needs_calibration
    assert method.version == 2 and method_versions(cfg) == {"awq": 2}  # rows of version 1 get other run keys
    default = AWQConfig()
    assert default.base == RTNConfig(bits=4, group_size=64)
    assert (default.scale_loss, default.clip, default.clip_qk, default.block_inputs) == \
        ("module", "symmetric", False, "float")
    assert default.clip_ratios == pytest.approx(REFERENCE_CLIP_GRID, abs=0)  # 1 ... 0.55, no 0.5


@pytest.mark.parametrize("kwargs,match", [
    ({"n_grid": 0}, r"n_grid must be an integer in 1\.\.1000, got 0"),
    ({"clip_grid": 2.5}, r"clip_grid must be an integer in 1\.\.1000, got 2\.5"),
    ({"clip_max_shrink": 1.0}, r"clip_max_shrink must be a number in \[0, 1\), got 1\.0"),
    ({"clip_search": "yes"}, r"clip_search must be true or false, got 'yes'"),
    ({"clip_qk": 1}, r"clip_qk must be true or false, got 1"),
    ({"scale_loss": "gram"}, r"unknown scale_loss 'gram'; known: module, linear"),
    ({"clip": "asymmetric"}, r"unknown clip 'asymmetric'; known: symmetric, minmax"),
    ({"block_inputs": "fp32"}, r"unknown block_inputs 'fp32'; known: float, quantized"),
    ({"base": {"method": "none"}}, r"base must be a weight-only rtn config \(method 'rtn'\), got method 'none'"),
    ({"base": {"method": "rtn", "bitz": 4}}, r"base: unknown config key\(s\) 'bitz' for method 'rtn'"),
    ({"base": 4}, r"base must be an rtn config or a dict with method 'rtn', got 4"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AWQConfig(**kwargs)


def test_alpha_zero_is_rtn_exactly():
    x_mean = torch.rand(128) * 10
    assert torch.equal(awq_scale(x_mean, 0.0), torch.ones(128))  # atol = 0


# ---- the reference behaviours -------------------------------------------------------------------

class _Stop(Exception):
    pass


def _io(module, model, ids, stop=False):
    """(inputs, outputs) of `module` over one plain forward of `model` per calibration sample (hooks);
    stop: end each forward right after the module."""
    ins, outs = [], []

    def post(m, a, o):
        outs.append(o[0] if isinstance(o, tuple) else o)
        if stop:
            raise _Stop

    hooks = [module.register_forward_pre_hook(lambda m, a, k: ins.append(a[0] if a else k["hidden_states"]),
                                              with_kwargs=True), module.register_forward_hook(post)]
    with torch.no_grad():
        for i in ids:
            try:
                model(i)
            except _Stop:
                pass
    for h in hooks:
        h.remove()
    return ins, outs


def _brute_force_alpha(float_model, group, spec, ids, n_grid):
    """llm-awq _search_module_scale on the untouched float model: for each α its consumers hold Q(W·s)/s;
    the loss is the MSE of the inspected module's output over a plain forward. Returns (α, losses)."""
    block = float_model.model.layers[0]
    x, _ = _io(block.get_submodule(group.consumers[0]), float_model, ids, stop=True)
    mean_abs = torch.cat([t.flatten(0, -2) for t in x]).abs().mean(0)
    inspected = block.get_submodule(group.inspect or group.consumers[0])
    _, org = _io(inspected, float_model, ids, stop=True)
    linears = [block.get_submodule(name) for name in group.consumers]
    originals = [linear.weight.data for linear in linears]
    losses = []
    for k in range(n_grid):
        s = mean_abs.pow(k / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for linear, w in zip(linears, originals):
            linear.weight.data = fake_quant_weight(w * s, spec) / s
        _, out = _io(inspected, float_model, ids, stop=True)
        sq = sum(float((o - r).double().pow(2).sum()) for o, r in zip(out, org))
        losses.append(sq / sum(r.numel() for r in org))
    for linear, w in zip(linears, originals):
        linear.weight.data = w
    return losses.index(min(losses)) / n_grid, losses


def _block0(kind, bits=3, group_size=32, symmetric=False):
    model = build_model(kind)
    swap_in_quant_linears(model, RTNConfig().selection, WeightSpec(bits, group_size, symmetric))
    return model, model.model.layers[0]


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_mha"])  # MHA: the v -> o group (o_proj inspected) too
def test_scale_is_chosen_by_the_inspected_modules_output(kind):
    """(1) α of every group = brute-force argmin of the inspected module's output MSE (self_attn for q/k/v,
    mlp for gate/up, o_proj, down_proj) on an independent float copy; exact grid point."""
    ids, spec, cfg = _ids(n=4, t=32), WeightSpec(3, 32, False), AWQConfig(clip_search=False, n_grid=10)
    float_model = build_model(kind)
    model, block = _block0(kind)
    hidden, kwargs = capture_block_inputs(model, ids)
    groups = arch_for(model)["groups"]
    got = awq_block(block, groups, hidden, kwargs, cfg).alphas
    want = {}
    for g in groups:
        if g.consumers[0] in got:
            want[g.consumers[0]], _ = _brute_force_alpha(float_model, g, spec, ids, cfg.n_grid)
    assert got == want and len(got) == {"llama_gqa": 3, "llama_mha": 4}[kind]
    _, block = _block0(kind)
    linear = awq_block(block, groups, hidden, kwargs, AWQConfig(clip_search=False, n_grid=10, scale_loss="linear"))
    assert linear.alphas != got  # the test can tell the reference loss from the summed linear losses


def test_clip_skips_q_and_k_projections():
    """(2) q/k_proj keep min-max qparams of their scaled weights; v/o/gate/up/down are clipped; clip_qk=True
    clips q/k too. Reference: the same block with clip_search=False (identical scales), atol = 0."""
    ids = _ids(n=8, t=32)
    results, weights = {}, {}
    for name, cfg in [("none", AWQConfig(clip_search=False)), ("ref", AWQConfig()), ("qk", AWQConfig(clip_qk=True))]:
        model, block = _block0("llama_mha")
        hidden, kwargs = capture_block_inputs(model, ids)
        results[name] = awq_block(block, arch_for(model)["groups"], hidden, kwargs, cfg, qk=arch_for(model)["qk"])
        weights[name] = {n: m.weight.clone() for n, m in quant_linears(block).items()}
        assert all(m.fixed_qparams is None for m in quant_linears(block).values())  # min-max of the (clamped) W
    qk = {"self_attn.q_proj", "self_attn.k_proj"}
    assert set(results["ref"].clip_ratios) == set(weights["ref"]) - qk
    for name, w in weights["ref"].items():
        assert torch.equal(w, weights["none"][name]) == (name in qk), name
    assert set(results["qk"].clip_ratios) == set(weights["qk"])
    assert all(not torch.equal(weights["qk"][n], weights["none"][n]) for n in qk)


def _clamp_reference(w, ratio, g):
    """W clamped to ±max|w|·r per (row, group of g columns), written out (g divides in_features)."""
    wg = w.view(w.shape[0], -1, g)
    bound = wg.abs().amax(-1, keepdim=True) * ratio.unsqueeze(-1)
    return torch.clamp(wg, -bound, bound).view_as(w)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clipped_layers_are_minmax_of_the_clamped_weight(symmetric):
    """(3) Each clipped layer's weight = W (scaled, unclipped) clamped to ±max|w|·r for its chosen r per
    (row, group), r on the reference grid; its qparams = min-max of that clamped W. Exact (atol = 0)."""
    ids = _ids(n=8, t=32)
    (model, scaled), (_, clipped) = _block0("llama_mha", symmetric=symmetric), _block0("llama_mha", symmetric=symmetric)
    hidden, kwargs = capture_block_inputs(model, ids)
    arch = arch_for(model)
    awq_block(scaled, arch["groups"], hidden, kwargs, AWQConfig(clip_search=False))
    result = awq_block(clipped, arch["groups"], hidden, kwargs, AWQConfig(), qk=arch["qk"])
    shrunk = 0
    for name, ratio in result.clip_ratios.items():
        layer, before = clipped.get_submodule(name), scaled.get_submodule(name).weight
        assert set(ratio.unique().tolist()) <= set(torch.tensor(REFERENCE_CLIP_GRID).tolist()), name
        want = _clamp_reference(before, ratio, 32)
        assert torch.equal(layer.weight, want), name
        p, q = layer.current_qparams(), layer.spec.qparams(want)
        assert torch.equal(p.scale, q.scale) and (symmetric or torch.equal(p.zero, q.zero)), name
        shrunk += int((ratio < 1).sum())
    assert shrunk > 0


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 48])  # 48: a ragged tail of 128 columns
def test_clip_ratio_minimises_each_groups_partial_output_error(symmetric, group_size):
    """(3) search_clip_symmetric vs brute force over tokens: per (row, group) and r on the grid, clamp, quantize
    with min-max qparams, error of that group's partial output. Tolerance: fp32 Gram vs direct sums (1e-4)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 128, generator=gen)
    w = torch.randn(16, 128, generator=gen) + 6.0 * (torch.rand(16, 128, generator=gen) < 0.03)
    spec = WeightSpec(3, group_size, symmetric, "float32")
    got = search_clip_symmetric(w, x.T @ x, spec, REFERENCE_CLIP_GRID)
    starts = list(range(0, 128, group_size))
    errors = torch.zeros(len(REFERENCE_CLIP_GRID), 16, len(starts), dtype=torch.float64)
    for k, r in enumerate(REFERENCE_CLIP_GRID):
        clamped = w.clone()
        for j, c in enumerate(starts):
            part = w[:, c:c + group_size]
            bound = part.abs().amax(-1, keepdim=True) * r
            clamped[:, c:c + group_size] = torch.clamp(part, -bound, bound)
        delta = (w - fake_quant_weight(clamped, spec)).double()
        for j, c in enumerate(starts):
            errors[k, :, j] = (x[:, c:c + group_size].double() @ delta[:, c:c + group_size].T).pow(2).sum(0)
    best = errors.min(0).values
    index = (got.unsqueeze(-1) - torch.tensor(REFERENCE_CLIP_GRID)).abs().argmin(-1)  # (16, n_groups)
    assert torch.equal(torch.tensor(REFERENCE_CLIP_GRID)[index], got)  # on the grid
    chosen = errors.gather(0, index.unsqueeze(0)).squeeze(0)
    assert torch.all(chosen <= best * (1 + 1e-4))
    assert (got < 1).any() and (got > 0.5).all()


def _block1_inputs(model, ids):
    return _io(model.model.layers[1], model, ids)[0]


@pytest.mark.parametrize("block_inputs", ["float", "quantized"])
def test_next_block_sees_float_or_quantized_outputs(tiny_model, block_inputs):
    """(4) block_inputs="float": every call of block 1 during calibration gets exactly the float model's block-0
    outputs (hooks on an unquantized copy, atol = 0); "quantized": those of the calibrated block 0."""
    model, _ = tiny_model
    float_inputs = _block1_inputs(copy.deepcopy(model), ids := _ids())
    cfg = AWQConfig(base=RTNConfig(bits=3, group_size=32), block_inputs=block_inputs)
    method, seen = get_method(cfg), []
    method.prepare(model, cfg)
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, a, k: seen.append(a[0]), with_kwargs=True)
    method.calibrate(model, cfg, ids)
    hook.remove()
    want = float_inputs if block_inputs == "float" else _block1_inputs(model, ids)
    assert len(seen) == 2 * len(ids)  # the statistics pass and the driver's pass, each over every sample
    for j, x in enumerate(seen):
        assert torch.equal(x, want[j % len(ids)]), j
    assert not torch.equal(float_inputs[0], _block1_inputs(model, ids)[0])  # quantization did change them


def test_diagnostics_are_small_json_scalars(tiny_model):
    model, _ = tiny_model
    summary = quantlab.quantize(model, AWQConfig(base=RTNConfig(bits=3, group_size=32)), calibration=_ids())
    d = summary["diagnostics"]
    assert set(d) == {"awq_groups", "awq_alpha_mean", "awq_alpha_min", "awq_alpha_max", "awq_clip_ratio_mean",
                      "awq_clip_shrunk_frac"}
    assert d["awq_groups"] == 6  # 2 blocks x (q/k/v, gate/up, up -> down); v -> o needs MHA
    assert 0 <= d["awq_alpha_min"] <= d["awq_alpha_mean"] <= d["awq_alpha_max"] < 1
    assert 0.55 <= d["awq_clip_ratio_mean"] < 1 and 0 < d["awq_clip_shrunk_frac"] <= 1
    json.dumps(d, allow_nan=False)


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


def test_quantize_end_to_end_frozen_equals_fake_quant(tiny_model):
    model, _ = tiny_model
    float_model = copy.deepcopy(model)
    cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 32}})
    method, ids, probe = get_method(cfg), _ids(), _ids(n=1, t=32, seed=9)[0]
    method.prepare(model, cfg)
    assert method.calibrate(model, cfg, ids)["awq_clip_shrunk_frac"] > 0  # some weights were clamped
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
    with pytest.raises(ValueError, match=r"model_type 'gpt9' has no architecture entry; supported: bert, .*llama"):
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
