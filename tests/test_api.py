"""Registry, config validation, layer selection by name globs, the quantize() lifecycle."""
import pytest
import torch
from torch import nn

import quantlab
from quantlab.core.lifecycle import quant_linears, select_linears
from quantlab.core.registry import LayerSelection, config_to_dict, make_config


def test_unknown_method_lists_known():
    with pytest.raises(KeyError, match=r"unknown method 'rtm'; known: .*none, .*rtn"):
        make_config({"method": "rtm"})


def test_unknown_config_key_lists_valid():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) 'bit' for method 'rtn'; valid: bits, double_quant, exclude"):
        make_config({"method": "rtn", "bit": 4})


def test_config_round_trips_through_dict():
    cfg = make_config({"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False, "exclude": ["lm_head", "*.0.*"]})
    assert cfg == quantlab.RTNConfig(bits=3, group_size=64, symmetric=False, exclude=("lm_head", "*.0.*"))
    assert make_config(config_to_dict(cfg)) == cfg


def test_bad_include_type_is_rejected():
    with pytest.raises(ValueError, match="include must be a list of name globs"):
        quantlab.RTNConfig(include="*")


def test_selection_globs(tiny_model):
    model, _ = tiny_model
    names = [n for n, _ in select_linears(model, LayerSelection())]
    assert "lm_head" not in names and len(names) == 2 * 7
    only_mlp = [n for n, _ in select_linears(model, LayerSelection(include=("*mlp*",), exclude=("*.1.*",)))]
    assert only_mlp == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    with pytest.raises(ValueError, match="matched no linear layer; linear names look like: model.layers.0.self_attn.q_proj"):
        select_linears(model, LayerSelection(include=("decoder.*",)))


def test_quantize_lifecycle_on_tiny_llama(tiny_model):
    model, _ = tiny_model
    ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    summary = quantlab.quantize(model, quantlab.RTNConfig(bits=8))
    layers = quant_linears(model)
    assert summary["quantized_layers"] == len(layers) == 14
    assert all(m.frozen for m in layers.values()) and type(model.lm_head) is nn.Linear
    with torch.no_grad():
        got = model(ids).logits
    snr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())
    assert snr > 30  # dB: int8 per-channel on every decoder linear


def test_none_method_leaves_model_unchanged(tiny_model):
    model, _ = tiny_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantlab.quantize(model, quantlab.NoneConfig())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
