"""Bad input around llama.cpp's types, recipes and files fails naming the value and the valid ones, before any
weights load; a type whose blocks do not tile a layer falls back as llama.cpp does, and the row says so. Fast: a
tiny Llama (hidden 64) and files written here."""
from __future__ import annotations

import pytest
import torch

from quantlab.core.ggml.gguffile import read_gguf, read_header
from quantlab.core.lifecycle import quantize
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.core.registry import make_config
from quantlab.eval import weight_stats
from quantlab.runs.experiment import parse_experiment


def test_weight_spec_on_a_llama_cpp_type_takes_its_facts_and_refuses_others():
    spec = WeightSpec(format="q4_k")
    assert (spec.bits, spec.group_size, spec.symmetric) == (4, 256, False)
    assert WeightSpec(format="q6_k").symmetric and WeightSpec(format="q8_0").bits == 8
    with pytest.raises(ValueError, match="llama.cpp type 'q4_k' fixes blocks of 256; group_size = 64"):
        WeightSpec(format="q4_k", group_size=64)
    with pytest.raises(ValueError, match="'q6_k' has 6-bit codes; bits = 3"):
        WeightSpec(bits=3, format="q6_k")
    with pytest.raises(ValueError, match="leave scale_dtype and double_quant out"):
        WeightSpec(format="q4_0", scale_dtype="float32")
    with pytest.raises(ValueError, match=r"unknown format 'q4_kk'; known: int, .*and llama.cpp's q4_0, q4_1"):
        WeightSpec(format="q4_kk")


def test_fake_quant_and_frozen_forward_agree_and_bytes_are_llama_cpps():
    torch.manual_seed(0)
    for fmt, bpw in (("q4_0", 4.5), ("q4_k", 4.5), ("q6_k", 6.5625), ("iq4_xs", 4.25), ("q2_k", 2.625)):
        layer = QuantLinear.from_linear(torch.nn.Linear(512, 16), WeightSpec(format=fmt))
        x = torch.randn(3, 512)
        with torch.no_grad():
            fake = layer(x)
            layer.freeze()
            assert torch.equal(layer(x), fake), fmt
        assert 8 * layer.storage_bytes() / (512 * 16) == bpw, fmt


def test_a_type_that_does_not_tile_the_rows_falls_back_as_llama_cpp(tiny_model):
    tiny_model = tiny_model[0]
    quantize(tiny_model, make_config({"method": "rtn", "format": "q4_k"}), progress=False)  # 64 columns
    formats = {m.spec.format for m in tiny_model.modules() if isinstance(m, QuantLinear)}
    assert formats == {"q5_0"}  # llama.cpp's fallback for q4_k
    assert weight_stats(tiny_model)["ggml_layer_types"] == '{"q5_0": 14}'


def test_gptq_refuses_act_order_on_a_llama_cpp_type():
    from quantlab.methods.gptq import gptq_solve

    with pytest.raises(ValueError, match="act_order needs a column order"):
        gptq_solve(torch.randn(4, 256), torch.eye(256), WeightSpec(format="q4_k"), act_order=True)


@pytest.mark.parametrize("table, match", [
    ({}, "give exactly one of type"),
    ({"type": "Q4_K_M", "file": "x.gguf"}, "give exactly one of type"),
    ({"type": "Q4_K_X"}, "unknown llama.cpp ftype 'Q4_K_X'; known: Q4_0"),
    ({"type": "Q4_K_M", "imatrix": "missing.imatrix"}, "missing.imatrix"),
    ({"type": "Q4_K_M", "imatrix": 3}, "imatrix must be true, false or a file path"),
])
def test_gguf_method_config_errors(table, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        make_config({"method": "gguf", **table})


def test_a_truncated_gguf_is_named_before_anything_loads(tmp_path):
    from quantlab.backends.gguf_export import export_gguf
    from quantlab.core.ggml.gguffile import kv_string, kv_uint32, write_gguf

    path = tmp_path / "small.gguf"
    import numpy as np

    write_gguf(path, [kv_string("general.architecture", "llama"), kv_uint32("llama.block_count", 1)],
               [("blk.0.attn_q.weight", (32, 2), 0, np.ones((2, 32), np.float32))])
    assert read_gguf(path).tensors["blk.0.attn_q.weight"].floats().shape == (2, 32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"cut.gguf is not a readable GGUF file .*runs past the end"):
        read_header(cut)
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        make_config({"method": "gguf", "file": str(cut)})
    phi = tmp_path / "phi.gguf"
    write_gguf(phi, [kv_string("general.architecture", "phi3")], [])
    with pytest.raises(ValueError, match="holds a 'phi3' model; quantlab reads GGUF architectures gemma3, llama"):
        make_config({"method": "gguf", "file": str(phi)})
    del export_gguf


def test_backend_llama_cpp_needs_a_model_with_a_gguf(tiny_model_dir):
    data = {"name": "x", "model": str(tiny_model_dir), "run": [{"name": "a", "method": "rtn", "bits": 8,
                                                                   "backend": "llama.cpp"}]}
    with pytest.raises(ValueError, match="backend 'llama.cpp' writes a GGUF whose tokenizer comes from the model's "
                                         "own GGUF"):
        parse_experiment(data)


def test_export_names_the_run_and_the_type_before_loading(tmp_path):
    from quantlab.runs.export import export_run

    exp = parse_experiment({"name": "x", "model": "smollm2-135m", "run": [{"name": "a", "method": "rtn"}]})
    with pytest.raises(ValueError, match="has no run 'b'; its runs: a"):
        export_run(exp, "b", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="--requantize 'q4_kk' is not a llama.cpp type; known: q4_0"):
        export_run(exp, "a", tmp_path / "x.gguf", requantize="q4_kk")


def test_a_llama_cpp_layer_with_an_input_scale_or_activation_quantizer_has_no_gguf_form():
    from quantlab.backends.gguf_export import layer_bytes
    from quantlab.core.activations import DynamicActQuant

    layer = QuantLinear.from_linear(torch.nn.Linear(64, 4), WeightSpec(format="q4_0"))
    layer.freeze()
    assert layer_bytes("l", layer, None)[0] == "q4_0"
    layer.register_buffer("input_scale", torch.ones(64))
    with pytest.raises(ValueError, match="l: an input scale .* has no GGUF type"):
        layer_bytes("l", layer, "q8_0")
    layer.input_scale, layer.act_quant = None, DynamicActQuant(8, True)
    with pytest.raises(ValueError, match="l: quantized activations has no GGUF type"):
        layer_bytes("l", layer, None)
