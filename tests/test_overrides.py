"""Per-layer overrides: grids flow to each layer (rtn, gptq, awq, dynamic), bad input fails, TOML round-trips."""
import json
import math
import tomllib
from pathlib import Path

import pytest
import torch

import quantlab
from quantlab import make_config
from quantlab.core.lifecycle import quant_linears
from quantlab.core.overrides import LayerOverride
from quantlab.core.primitives import fake_quantize, qparams, sqnr_db
from quantlab.core.registry import non_default_fields
from quantlab.reporting.results import read_rows
from quantlab.runs.evaluate import run_key
from quantlab.runs.experiment import load_experiment, parse_experiment
from quantlab.runs.tomlwrite import experiment_toml

OVERRIDES = [
    {"pattern": "model.layers.0.mlp.down_proj", "bits": 8, "group_size": "channel"},
    {"pattern": "*.self_attn.*", "bits": 3},
    {"pattern": "model.layers.1.self_attn.q_proj", "group_size": 16},  # later match wins field by field
]
EXPECTED = {  # name -> (bits, group_size) for the RTN w4 g32 asym base above
    "model.layers.0.mlp.down_proj": (8, None),
    "model.layers.1.mlp.down_proj": (4, 32),
    "model.layers.0.self_attn.k_proj": (3, 32),
    "model.layers.1.self_attn.q_proj": (3, 16),
    "model.layers.1.mlp.gate_proj": (4, 32),
}


def _cfg(**extra):
    return make_config({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False, "overrides": OVERRIDES,
                        **extra})


def test_overrides_set_each_layers_grid_and_dequant_exactly(tiny_model):
    model, _ = tiny_model
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantlab.quantize(model, _cfg())
    layers = quant_linears(model)
    for name, (bits, group_size) in EXPECTED.items():
        assert (layers[name].spec.bits, layers[name].spec.group_size) == (bits, group_size), name
    expected_bytes = 0
    for name, layer in layers.items():
        s = layer.spec
        # reference: primitives on the float weight with this layer's own grid (atol = 0)
        p = qparams(floats[name], s.bits, s.group_size, s.symmetric, torch.float16)
        ref = fake_quantize(floats[name], p, s.bits, s.group_size, ste=False)
        assert torch.equal(layer.quantized_weight(), ref), name
        out_f, in_f = floats[name].shape
        groups = out_f * (1 if s.group_size is None else math.ceil(in_f / s.group_size))
        expected_bytes += math.ceil(out_f * in_f * s.bits / 8) + 3 * groups  # codes + fp16 scale + uint8 zero
    stats = quantlab.weight_stats(model)
    numel = sum(floats[n].numel() for n in layers)
    assert stats["quant_layer_bytes"] == expected_bytes
    assert stats["bits_per_weight"] == pytest.approx(8 * expected_bytes / numel, rel=1e-12)


def test_overrides_reach_gptq_awq_and_dynamic_bases(tiny_model):
    model, _ = tiny_model
    calib = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        ref = model(calib[0]).logits
    for spec in (
        {"method": "gptq", "bits": 4, "group_size": 32, "overrides": OVERRIDES},
        {"method": "awq", "n_grid": 2, "clip_grid": 2, "base": {"method": "rtn", "bits": 4, "group_size": 32,
                                                                "overrides": OVERRIDES}},
        {"method": "dynamic", "base": {"method": "rtn", "bits": 4, "group_size": 32, "overrides": OVERRIDES}},
    ):
        q, _ = quantlab.load_model(str(Path(model.name_or_path)), device="cpu")
        quantlab.quantize(q, make_config(spec), calibration=calib)
        layers = quant_linears(q)
        for name, (bits, group_size) in EXPECTED.items():
            assert (layers[name].spec.bits, layers[name].spec.group_size) == (bits, group_size), (spec["method"], name)
        for name, layer in layers.items():  # frozen codes packed at each layer's own bits and groups
            s, (out_f, in_f) = layer.spec, (layer.out_features, layer.in_features)
            groups = out_f * (1 if s.group_size is None else math.ceil(in_f / s.group_size))
            assert layer.frozen and layer.storage_bytes() == math.ceil(out_f * in_f * s.bits / 8) + 2 * groups, name
        with torch.no_grad():
            out = q(calib[0]).logits
        assert sqnr_db(ref, out) > 10.0, spec["method"]  # dB vs float logits; measured 13-16 (w3 attention, w4/w8 MLP)


@pytest.mark.parametrize("overrides,match", [
    ([{"pattern": "*", "bitz": 8}], r"overrides\[0\]: unknown key\(s\) 'bitz'; valid: pattern, bits, group_size"),
    ([{"bits": 8}], r"overrides\[0\] has no 'pattern'"),
    ([{"pattern": "*", "bits": 9}], r"overrides\[0\]: override '\*': bits must be an integer in 2..8, got 9"),
    ([{"pattern": "*", "group_size": 0}], r"group_size must be a positive integer or 'channel'"),
    ([{"pattern": "*"}], "sets nothing"),
    ([{"pattern": "", "bits": 8}], "non-empty module-name glob"),
    ({"pattern": "*", "bits": 8}, "must be a list of tables"),
    (["*"], r"overrides\[0\] must be a table"),
])
def test_bad_overrides_fail_at_config_time(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config({"method": "rtn", "overrides": overrides})


def test_bad_override_in_an_experiment_names_the_run():
    data = {"model": "m", "run": [{"name": "mix", "method": "rtn", "overrides": [{"pattern": "*", "bits": 1}]}]}
    with pytest.raises(ValueError, match=r"run 'mix': overrides\[0\].*bits must be an integer in 2..8, got 1"):
        parse_experiment(data)


def test_pattern_matching_no_layer_fails_at_prepare(tiny_model):
    model, _ = tiny_model
    cfg = make_config({"method": "rtn", "overrides": [{"pattern": "model.layers.7.*", "bits": 8}]})
    with pytest.raises(ValueError, match=r"override pattern 'model.layers.7.\*' matches no quantized layer; "
                                         r"the 14 quantized layers are named like: model.layers.0.self_attn.q_proj"):
        quantlab.quantize(model, cfg)
    excluded = make_config({"method": "rtn", "exclude": ["lm_head", "*.down_proj"],
                            "overrides": [{"pattern": "*.down_proj", "bits": 8}]})
    with pytest.raises(ValueError, match="matches no quantized layer"):
        quantlab.quantize(model, excluded)


def test_default_overrides_keep_run_keys():
    assert "overrides" not in non_default_fields(make_config({"method": "rtn", "bits": 4}))
    exp = load_experiment("experiments/smollm2_quickstart.toml")
    stored = {r["run_key"] for r in read_rows(Path("reports/smollm2_quickstart.results.jsonl"))}
    keys = {run_key(exp, r, torch.device("cpu")) for r in exp.runs}
    assert keys <= stored  # committed rows stay finished: the new field changed no key


def _mixed_experiment():
    return parse_experiment({
        "name": "mix", "model": "smollm2-135m", "seed": 3,
        "description": 'Line one.\nA "quoted" line with a back\\slash and """ triple quotes.\n',
        "eval": {"seq_len": 512, "max_windows": 8, "latency": False},
        "calibration": {"num_samples": 16},
        "run": [
            {"name": "fp32", "method": "none"},
            {"name": "mixed", "method": "rtn", "bits": 3, "group_size": 64, "symmetric": False,
             "overrides": OVERRIDES},
            {"name": "awq-mixed", "method": "awq", "base": {"method": "rtn", "bits": 4, "overrides": OVERRIDES[:1]}},
            {"name": "gptq", "method": "gptq", "bits": 4, "damp": 0.05, "exclude": ["lm_head", "*.k_proj"]},
        ],
    })


def test_experiment_with_overrides_round_trips_through_toml(tmp_path):
    exp = _mixed_experiment()
    text = experiment_toml(exp, header="# generated\n")
    path = tmp_path / "mix.toml"
    path.write_text(text)
    back = load_experiment(path)
    assert back == exp
    assert back.runs[1].config.overrides[2] == LayerOverride("model.layers.1.self_attn.q_proj", group_size=16)
    assert text.startswith("# generated\n") and "overrides = [\n  { pattern = " in text
    assert json.loads(json.dumps(back.runs[1].to_dict()))["overrides"][0]["group_size"] == "channel"


@pytest.mark.parametrize("path", sorted(Path("experiments").glob("*.toml")))
def test_committed_experiments_round_trip(path):
    exp = load_experiment(path)
    assert parse_experiment(tomllib.loads(experiment_toml(exp)), default_name=exp.name) == exp
