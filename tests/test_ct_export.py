"""compressed-tensors export (quantlab/backends/ct_export.py): quantlab's grids written by the library's own
compressors, loaded by transformers (CompressedTensorsHfQuantizer, CPU) and decompressed by compressed-tensors' own
code, on a tiny random Llama (hidden 64, 2 layers, tied head).

References and tolerances:
- weights: compressed-tensors' decompressor (BaseCompressor.decompress on the file's tensors) vs
  QuantLinear.quantized_weight(): bitwise (torch.equal);
- logits of the checkpoint as transformers loads it vs quantlab's simulated model: atol 1e-5, fp32 round-off
  (measured 0.0 on every weight grid, and with static or fp8 activations: the same values through the same ops);
- W8A8: compressed-tensors scales int8 tokens by amax / 127.5, quantlab by amax / 127. Against a quantlab model whose
  activation quantizer is the engine's grid: atol 1e-5 (measured 0.0); against quantlab's own simulation: max |diff|
  <= W8A8_LOGITS_ATOL (measured 0.009 here; 0.0047-0.0090 over model seeds 0-4 and two probes, with logits |max|
  1.3-1.6 and std 0.17: the size of W8A8's own error against the float model, 0.006-0.009) and not equal.
Loading: compressed-tensors 0.20 under transformers 5.25 cannot load two of these through the default path, so they
load with CompressedTensorsConfig(dequantize=True) (the library's decompressor at load time): asymmetric
pack-quantized (on the meta device its compressor leaves the zero point unpacked: a size mismatch) and mxfp4 in a
float32 model (its decompressor returns bfloat16 weights, which the float32 matmul refuses).
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

try:
    import compressed_tensors  # noqa: F401
except ImportError:
    from ci_policy import in_ci

    if in_ci():  # CI installs the [ct] extra (scripts/setup.sh): a missing package fails there
        raise
    pytest.skip("compressed-tensors is not installed: pip install -e '.[ct]'", allow_module_level=True)

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM

from quantlab.backends.ct_export import export_compressed_tensors
from quantlab.core.lifecycle import quant_linears, quantize
from quantlab.core.registry import get_method, make_config

ROUND_OFF_ATOL = 1e-5
W8A8_LOGITS_ATOL = 0.02

# name: (quantlab config, {scheme label: format}, load with dequantize=True (see the module docstring))
SCHEMES = {
    "w4-g32-asym": ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
                    {"w4 g32 asym": "pack-quantized"}, True),
    "w3-channel-sym": ({"method": "rtn", "bits": 3}, {"w3 channel sym": "pack-quantized"}, False),
    "w8a8": ({"method": "dynamic", "act_bits": 8, "base": {"method": "rtn", "bits": 8}},
             {"w8 channel sym + a8 token": "int-quantized"}, False),
    "fp8-channel": ({"method": "rtn", "format": "fp8_e4m3"}, {"fp8_e4m3 channel": "naive-quantized"}, False),
    "fp8-g32-a-fp8": ({"method": "dynamic", "act_format": "fp8_e4m3",
                       "base": {"method": "rtn", "format": "fp8_e4m3", "group_size": 32}},
                      {"fp8_e4m3 g32 + a-fp8 token": "float-quantized"}, False),
    "mxfp4": ({"method": "rtn", "format": "mxfp4"}, {"mxfp4 g32": "mxfp4-pack-quantized"}, True),
    "w8a8-static-asym": ({"method": "static"}, {"w8 channel sym + a8 asym static tensor": "int-quantized"}, False),
    "fp8-a-fp8-static": ({"method": "static", "act_format": "fp8_e4m3",
                          "base": {"method": "rtn", "format": "fp8_e4m3"}},
                         {"fp8_e4m3 channel + a-fp8 static tensor": "float-quantized"}, False),
}


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def probe_ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(probe_ids()).logits


def load(out_dir, dequantize: bool) -> nn.Module:
    """The checkpoint as transformers loads it; dequantize: decompressed at load time (see the module docstring)."""
    if not dequantize:
        return AutoModelForCausalLM.from_pretrained(out_dir).eval()
    with warnings.catch_warnings():  # "the model already has a quantization_config": ours only adds dequantize
        warnings.simplefilter("ignore", UserWarning)
        config = CompressedTensorsConfig(dequantize=True)
        return AutoModelForCausalLM.from_pretrained(out_dir, quantization_config=config).eval()


def ct_weights(out_dir) -> dict[str, torch.Tensor]:
    """Every quantized linear's weight as compressed-tensors' own decompressor rebuilds it from the file."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((out_dir / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    tensors = load_file(out_dir / "model.safetensors")
    layers = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    out = {}
    for name in layers:
        scheme = next(s for s in qconfig.config_groups.values() if "Linear" in s.targets or name in s.targets)
        state = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        out[name] = BaseCompressor.get_value_from_registry(scheme.format).decompress(state, scheme)["weight"]
    return out


@pytest.fixture(scope="module", params=list(SCHEMES))
def exported(request, tmp_path_factory):
    config = SCHEMES[request.param][0]
    model = tiny_llama()
    quantize(model, make_config(config), calibration=[probe_ids()[:1]], progress=False)  # static: its ranges
    out_dir = tmp_path_factory.mktemp(request.param) / "ct"
    facts = export_compressed_tensors(model, out_dir)
    return request.param, model, out_dir, facts


def test_transformers_loads_it_and_its_logits_are_quantlabs(exported):
    name, model, out_dir, _ = exported
    loaded = load(out_dir, dequantize=SCHEMES[name][2])
    got, ref = logits(loaded), logits(model)
    if name != "w8a8":
        torch.testing.assert_close(got, ref, rtol=0, atol=ROUND_OFF_ATOL)
        return
    engine = copy.deepcopy(model)  # the engine's int8 token grid in quantlab's model: the file's numerics exactly
    for layer in quant_linears(engine).values():
        layer.act_quant = EngineInt8Tokens()
    torch.testing.assert_close(got, logits(engine), rtol=0, atol=ROUND_OFF_ATOL)
    assert (got - ref).abs().max() <= W8A8_LOGITS_ATOL
    assert not torch.equal(got, ref)  # the grids differ (ct_notes says so); if they ever agree, update the note


class EngineInt8Tokens(nn.Module):
    """compressed-tensors' dynamic symmetric int8 per-token fake quantization (calculate_qparams, _quantize_dequantize):
    scale amax / 127.5, codes clamped to [-128, 127]."""

    def forward(self, x):
        scale = x.abs().amax(-1, keepdim=True) / 127.5
        return torch.clamp(torch.round(x / scale), -128, 127) * scale


def test_compressed_tensors_decompresses_quantlabs_weights_bitwise(exported):
    _, model, out_dir, _ = exported
    got = ct_weights(out_dir)
    layers = quant_linears(model)
    assert sorted(got) == sorted(layers)
    for name, layer in layers.items():  # .float(): mxfp4 decompresses to bfloat16, which holds its values exactly
        assert torch.equal(got[name].float(), layer.quantized_weight(torch.float32)), name


def test_the_config_names_every_scheme_and_ignores_the_head(exported):
    name, model, out_dir, facts = exported
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    formats = SCHEMES[name][1]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == next(iter(formats.values()))
    assert [g["format"] for g in qc["config_groups"].values()] == list(formats.values())
    assert facts["ct_format"] == formats and facts["ct_schemes"] == {next(iter(formats)): len(quant_linears(model))}
    assert "lm_head" in qc["ignore"] and facts["ct_ignored"] == qc["ignore"]
    spec = next(iter(quant_linears(model).values())).spec
    weights = next(iter(qc["config_groups"].values()))["weights"]
    assert weights["num_bits"] == spec.bits and weights["symmetric"] == spec.symmetric
    assert weights.get("group_size") == (spec.group_size if weights["strategy"] == "group" else None)
    acts = next(iter(qc["config_groups"].values()))["input_activations"]
    assert (acts is None) == (" + a" not in next(iter(formats)))
    if name == "w8a8":
        assert len(facts["ct_notes"]) == 1 and "amax / 127.5" in facts["ct_notes"][0]
    else:
        assert facts["ct_notes"] == []
    assert facts["ct_mib"] > 0


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
def test_every_int_width_keeps_its_codes(bits, symmetric, tmp_path):
    """pack-quantized takes w2..w8 either way; 8-bit asym puts zero points at both ends of the signed int8 range."""
    model = tiny_llama(seed=bits)
    group = 32 if symmetric else None
    quantize(model, make_config({"method": "rtn", "bits": bits, "group_size": group, "symmetric": symmetric}),
             progress=False)
    export_compressed_tensors(model, tmp_path / "ct")
    got = ct_weights(tmp_path / "ct")
    for name, layer in quant_linears(model).items():
        assert torch.equal(got[name], layer.quantized_weight(torch.float32)), name


def test_several_schemes_target_their_layers_by_name(tmp_path):
    model = tiny_llama()
    config = {"method": "rtn", "bits": 4, "group_size": 32, "overrides": [{"pattern": "*.mlp.down_proj",
                                                                             "format": "fp8_e4m3"}]}
    quantize(model, make_config(config), progress=False)
    facts = export_compressed_tensors(model, tmp_path / "ct")
    assert facts["ct_schemes"] == {"w4 g32 sym": 12, "fp8_e4m3 channel": 2}
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    targets = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert targets["naive-quantized"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(logits(load(tmp_path / "ct", False)), logits(model), rtol=0, atol=ROUND_OFF_ATOL)


def test_the_callers_model_is_left_as_it_was(tmp_path):
    """A prepared (fake-quant) model is frozen on the export's copy only; an existing folder is replaced whole."""
    model = tiny_llama()
    config = make_config({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False})
    get_method(config).prepare(model, config)
    before = logits(model)
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / "stale.txt").write_text("old")
    export_compressed_tensors(model, tmp_path / "ct")
    assert torch.equal(logits(model), before)
    assert not any(layer.frozen for layer in quant_linears(model).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct"] and not (tmp_path / "ct" / "stale.txt").exists()
    got = ct_weights(tmp_path / "ct")
    for name, layer in quant_linears(model).items():
        assert torch.equal(got[name], layer.quantized_weight(torch.float32)), name


REFUSED = {
    "hqq": ({"method": "hqq", "bits": 4, "group_size": 32}, "real-valued (HQQ) zero points"),
    "nf4": ({"method": "rtn", "format": "nf4"}, "format nf4"),
    "ggml-q4_0": ({"method": "rtn", "format": "q4_0"}, "llama.cpp type q4_0"),
    "nvfp4": ({"method": "rtn", "format": "nvfp4"}, "stores the tensor scale inverted"),
    "ragged-group": ({"method": "rtn", "bits": 4, "group_size": 48}, "does not divide in_features 64"),
    "static-per-channel": ({"method": "static", "act_granularity": "channel"}, "static per-channel activation scales"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_grid_without_a_form_fails_naming_the_layer_before_writing(case, tmp_path):
    config, why = REFUSED[case]
    model = tiny_llama()
    quantize(model, make_config(config), calibration=[probe_ids()[:1]], progress=False)
    spec = quant_linears(model)["model.layers.0.self_attn.q_proj"].spec
    with pytest.raises(ValueError) as info:
        export_compressed_tensors(model, tmp_path / "out" / "ct")
    message = str(info.value)
    assert message.startswith(f"model.layers.0.self_attn.q_proj: grid {spec.describe()}"), message
    assert why in message and "; compressed-tensors stores int w2..w8" in message
    assert not (tmp_path / "out").exists()


def test_quantlab_export_writes_a_run_as_compressed_tensors(tiny_model_dir, tmp_path):
    """`quantlab export --format compressed-tensors` end to end: the run quantized as the experiment says (GPTQ,
    calibrated), written, loaded by transformers; reference: the run's own model quantized in this process with the
    same windows (logits within fp32 round-off). --requantize and a KV-cache extra are refused before loading."""
    from quantlab.models.loading import load_model
    from quantlab.runs.context import EvalContext
    from quantlab.runs.experiment import parse_experiment
    from quantlab.runs.export import export_run

    gptq = {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32, "symmetric": True}
    exp = parse_experiment({"name": "ct", "model": str(tiny_model_dir), "device": "cpu", "seed": 0,
                            "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2},
                            "calibration": {"dataset": str(tiny_model_dir / "sample.txt"), "num_samples": 2,
                                            "seq_len": 32},
                            "run": [gptq, gptq | {"name": "kv", "kv_cache": {"bits": 4}}]})
    facts = export_run(exp, "gptq", tmp_path / "out", "compressed-tensors", progress=False)
    assert facts["ct_format"] == {"w4 g32 sym": "pack-quantized"} and facts["ct_ignored"] == ["lm_head"]
    ctx = EvalContext(exp, torch.device("cpu"), None, None, False)
    torch.manual_seed(0)
    ours = copy.deepcopy(ctx.model)
    quantize(ours, exp.runs[0].config, calibration=[w.unsqueeze(0) for w in ctx.calibration(0, exp.calibration)],
             progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = ctx.eval_ids[:32].unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ours(ids).logits, rtol=0, atol=ROUND_OFF_ATOL)
    model, tok = load_model(str(tmp_path / "out"), progress=False)  # quantlab's own loader takes it too
    assert tok is not None
    with pytest.raises(ValueError, match="--requantize applies to --format gguf only"):
        export_run(exp, "gptq", tmp_path / "x", "compressed-tensors", requantize="q4_0")
    with pytest.raises(ValueError, match=r"run 'kv': kv_cache = \{...\}: a compressed-tensors export does not "
                                         r"export a quantized KV cache"):
        export_run(exp, "kv", tmp_path / "y", "compressed-tensors")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
