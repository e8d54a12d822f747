"""Importing other tools' quantized checkpoints with their integer codes (quantlab/backends/ckpt_import.py), on tiny
random Llamas (hidden 64, 2 layers).

References and tolerances:
- compressed-tensors round trip: quantlab quantizes, export_compressed_tensors writes, the importer reads back;
  every QuantLinear's codes, scales, zero points (and activation quantizer) are the original's bit for bit (mxfp4:
  -0 codes read as +0, the one thing compressed-tensors' FP4 cast drops), and the logits are equal (torch.equal);
- GPTQ (v1 / v2, w2 / w3 / w4 / w8) and AWQ GEMM: checkpoints packed here, by loops written from the formats'
  descriptions (AutoGPTQ / GPTQModel's pack loops incl. the 3-bit word layout, AutoAWQ's order map), independent of
  the importer's bit-stream reader; the imported codes / scales / zeros equal the packed ones, and the logits equal
  (torch.equal) a dense model holding w = (q - zero) * scale computed in fp32;
- errors: act-order g_idx, unsupported schemes, missing tensors each name the folder, the layer and what is
  supported; the scheme errors come before any tensor is read (the weights file is absent there).
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

try:
    import compressed_tensors  # noqa: F401
except ImportError:
    from ci_policy import in_ci

    if in_ci():  # CI installs the [ct] extra (scripts/setup.sh)
        raise
    pytest.skip("compressed-tensors is not installed: pip install -e '.[ct]'", allow_module_level=True)

from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from quantlab.backends.ckpt_import import checkpoint_format, load_quantized_checkpoint
from quantlab.backends.ct_export import export_compressed_tensors
from quantlab.core import packing
from quantlab.core.activations import StaticActQuant
from quantlab.core.lifecycle import quant_linears, quantize
from quantlab.core.registry import make_config

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def tiny_llama(seed: int = 0, bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=bias)
    return LlamaForCausalLM(cfg).eval()


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def codes(layer) -> torch.Tensor:
    n = layer.out_features * layer.in_features
    return packing.unpack(layer.qweight, layer.spec.bits, n).view(layer.out_features, layer.in_features)


# ---- compressed-tensors: quantlab -> export -> import ----------------------------------------------------------

ROUND_TRIPS = {
    "w4-g32-asym": {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
    "w8-channel-sym": {"method": "rtn", "bits": 8},
    "w3-g32-sym": {"method": "rtn", "bits": 3, "group_size": 32},
    "w8a8-dynamic": {"method": "dynamic", "act_bits": 8, "base": {"method": "rtn", "bits": 8}},
    "w8a8-static-asym": {"method": "static"},
    "fp8-g32": {"method": "rtn", "format": "fp8_e4m3", "group_size": 32},
    "fp8-a-fp8": {"method": "dynamic", "act_format": "fp8_e4m3", "base": {"method": "rtn", "format": "fp8_e4m3"}},
    "mxfp4": {"method": "rtn", "format": "mxfp4"},
    "mixed": {"method": "rtn", "bits": 4, "group_size": 32, "overrides": [{"pattern": "*.mlp.down_proj",
                                                                           "format": "fp8_e4m3"}]},
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_a_compressed_tensors_export_imports_to_the_same_codes_and_logits(case, tmp_path):
    model = tiny_llama()
    quantize(model, make_config(ROUND_TRIPS[case]), calibration=[torch.randint(0, 300, (1, 24))], progress=False)
    export = export_compressed_tensors(model, tmp_path / "ct")
    got, _, facts = load_quantized_checkpoint(tmp_path / "ct")
    assert facts["source_format"] == "compressed-tensors" and facts["source_tool"].startswith("compressed-tensors 0.")
    assert facts["source_float_linears"] == ["lm_head"]
    ours, theirs = quant_linears(model), quant_linears(got)
    assert sorted(ours) == sorted(theirs)
    labels = {}
    for name, a in ours.items():
        b = theirs[name]
        assert b.frozen and b.spec == a.spec, name
        want, have = codes(a), codes(b)
        if a.spec.format == "mxfp4":  # -0 (0b1000) is written as +0
            want = torch.where(want == 0b1000, torch.zeros_like(want), want)
        assert torch.equal(have, want), name
        for key in ("scale", "zero_u", "scale_e8m0"):
            x, y = getattr(a, key, None), getattr(b, key, None)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), (name, key)
        assert type(a.act_quant) is type(b.act_quant), name
        if a.act_quant is not None:
            assert a.act_quant.extra_repr() == b.act_quant.extra_repr()
        if isinstance(a.act_quant, StaticActQuant):
            assert torch.equal(a.act_quant.scale, b.act_quant.scale)
            assert (a.act_quant.zero is None) == (b.act_quant.zero is None)
            assert a.act_quant.zero is None or torch.equal(a.act_quant.zero, b.act_quant.zero)
        labels[b.extra_repr()] = labels.get(b.extra_repr(), 0) + 1
    assert sum(facts["source_schemes"].values()) == len(ours) == 14
    assert len(facts["source_schemes"]) == len(export["ct_schemes"])
    assert torch.equal(logits(got), logits(model))
    assert ("amax / 127" in " ".join(facts["source_notes"])) == (case == "w8a8-dynamic")


# ---- GPTQ and AWQ GEMM checkpoints, packed here from the formats' rules -----------------------------------------


def pack_gptq_columns(values: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) ints -> (rows * bits / 32, cols) words, AutoGPTQ / GPTQModel's pack loop along the rows: 2/4/8
    bits: row r's word holds values r*k .. r*k+k-1 at bits*j; 3 bits: the 10 / 1-split / 10 / 1-split / 10 layout."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0] // 32 * bits, v.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < out.shape[0]:
        if bits in (2, 4, 8):
            for j in range(32 // bits):
                out[row] |= v[i + j] << (bits * j)
            i, row = i + 32 // bits, row + 1
            continue
        for j in range(10):
            out[row] |= v[i + j] << (3 * j)
        i += 10
        out[row] |= (v[i] << 30) & 0xFFFFFFFF
        out[row + 1] |= (v[i] >> 2) & 1
        i += 1
        for j in range(10):
            out[row + 1] |= v[i + j] << (3 * j + 1)
        i += 10
        out[row + 1] |= (v[i] << 31) & 0xFFFFFFFF
        out[row + 2] |= (v[i] >> 1) & 0x3
        i += 1
        for j in range(10):
            out[row + 2] |= v[i + j] << (3 * j + 2)
        i, row = i + 10, row + 3
    return out


def pack_awq(values: np.ndarray) -> np.ndarray:
    """(rows, cols) 4-bit ints -> (rows, cols / 8) words, AutoAWQ's WQLinear_GEMM.from_linear loop."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return out


def as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def write_packed_checkpoint(out, model, layers: dict, quantization_config: dict) -> None:
    """The float model's other tensors, every layer's packed ones (layers: {name: {tensor: value}}), config.json."""
    out.mkdir()
    quantized = {f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS}
    state = {k: v for k, v in model.state_dict().items()
             if k.rsplit(".", 1)[0] not in quantized or k.endswith(".bias")}
    state.pop("lm_head.weight")  # tied: the file holds the embedding once
    for name, tensors in layers.items():
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    config = model.config.to_dict() | {"quantization_config": quantization_config}
    (out / "config.json").write_text(json.dumps(config, default=str))


def random_grid(model, bits: int, group: int | None, symmetric: bool, zero_lo: int, seed: int) -> dict:
    """{layer: (codes (out, in), zeros (out, groups), scales (out, groups) fp16)} drawn at random."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(2):
        for n in LINEARS:
            lin = model.get_submodule(f"model.layers.{i}.{n}")
            groups = 1 if group is None else lin.in_features // group
            q = torch.randint(0, 2**bits, (lin.out_features, lin.in_features), generator=g)
            z = torch.full((lin.out_features, groups), 2 ** (bits - 1)) if symmetric else torch.randint(
                zero_lo, 2**bits, (lin.out_features, groups), generator=g)
            s = (torch.rand(lin.out_features, groups, generator=g) * 0.02 + 1e-3).half()
            out[f"model.layers.{i}.{n}"] = (q, z, s)
    return out


def dense_reference(model, grid: dict, group: int | None) -> nn.Module:
    """The float model with every quantized weight replaced by (q - zero) * scale in fp32."""
    dense = copy.deepcopy(model)
    for name, (q, z, s) in grid.items():
        size = q.shape[1] if group is None else group
        w = (q.float() - z.float().repeat_interleave(size, 1)) * s.float().repeat_interleave(size, 1)
        dense.get_submodule(name).weight.data = w
    return dense


def check_imported(got, grid: dict) -> None:
    layers = quant_linears(got)
    assert sorted(layers) == sorted(grid)
    for name, (q, z, s) in grid.items():
        layer = layers[name]
        assert torch.equal(codes(layer).long(), q), name
        assert torch.equal(layer.scale, s) and layer.scale.dtype == torch.float16, name
        if layer.spec.symmetric:
            assert getattr(layer, "zero_u", None) is None and bool((z == 2 ** (layer.spec.bits - 1)).all())
        else:
            assert torch.equal(layer.zero_u.long(), z), name


GPTQ_CASES = [  # bits, group (None: -1), sym, checkpoint_format
    (4, 32, False, "gptq"), (4, 32, True, "gptq_v2"), (3, 32, False, "gptq_v2"), (3, None, False, "gptq"),
    (2, None, False, "gptq_v2"), (8, 32, True, "gptq"), (8, 32, False, "gptq"),
]


@pytest.mark.parametrize("bits,group,sym,fmt", GPTQ_CASES)
def test_a_gptq_checkpoint_imports_its_codes(bits, group, sym, fmt, tmp_path):
    model = tiny_llama(seed=bits)
    v1 = fmt == "gptq"
    grid = random_grid(model, bits, group, sym, zero_lo=1 if v1 else 0, seed=bits)  # v1 cannot store a zero of 0
    layers = {}
    for name, (q, z, s) in grid.items():
        stored = z - 1 if v1 else z
        layers[name] = {"qweight": as_int32(pack_gptq_columns(q.t().numpy(), bits)),
                        "qzeros": as_int32(pack_gptq_columns(stored.numpy(), bits).T),  # along each group row
                        "scales": s.t().contiguous(),
                        "g_idx": (torch.arange(q.shape[1]) // (group or q.shape[1])).to(torch.int32)}
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": False, "sym": sym,
          "checkpoint_format": fmt, "meta": {"quantizer": ["gptqmodel:4.2.0"]}}
    write_packed_checkpoint(tmp_path / "gptq", model, layers, qc)
    assert checkpoint_format(tmp_path / "gptq") == "gptq"
    got, _, facts = load_quantized_checkpoint(tmp_path / "gptq")
    check_imported(got, grid)
    label = f"w{bits} {'channel' if group is None else f'g{group}'} {'sym' if sym else 'asym'}"
    assert facts["source_schemes"] == {label: 14}
    assert facts["source_tool"] == f"gptqmodel:4.2.0; checkpoint_format {fmt}"
    assert torch.equal(logits(got), logits(dense_reference(model, grid, group)))


def test_gptq_v1_zeros_borrowed_by_gptqmodel_come_back(tmp_path):
    """GPTQModel's v2 -> v1 subtracts 0x11111111 from each int32 word (a zero of 0 borrows from its neighbour); the
    importer adds it back word by word, so zeros of 0 and their neighbours are exact."""
    model = tiny_llama()
    grid = random_grid(model, 4, 32, False, zero_lo=0, seed=3)
    layers = {}
    for name, (q, z, s) in grid.items():
        z[:, 0] = 0  # every row starts with a zero of 0: a borrow in every word
        v2 = pack_gptq_columns(z.numpy(), 4).T.astype(np.int64)
        layers[name] = {"qweight": as_int32(pack_gptq_columns(q.t().numpy(), 4)),
                        "qzeros": as_int32(((v2 - 0x11111111) % 2**32).astype(np.uint32)),
                        "scales": s.t().contiguous()}
    write_packed_checkpoint(tmp_path / "v1", model, layers, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                             "sym": False, "checkpoint_format": "gptq"})
    got, _, _ = load_quantized_checkpoint(tmp_path / "v1")
    check_imported(got, grid)


def test_an_awq_gemm_checkpoint_imports_its_codes(tmp_path):
    model = tiny_llama(bias=True)  # q/k/v/o biases: stored fp16, loaded as they are
    grid = random_grid(model, 4, 32, False, zero_lo=0, seed=5)
    layers = {}
    for name, (q, z, s) in grid.items():
        layers[name] = {"qweight": as_int32(pack_awq(q.t().numpy())), "qzeros": as_int32(pack_awq(z.t().numpy())),
                        "scales": s.t().contiguous()}
        bias = model.get_submodule(name).bias
        if bias is not None:
            bias.data = bias.data.half().float()
            layers[name]["bias"] = bias.data.half()
    write_packed_checkpoint(tmp_path / "awq", model, layers, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                              "zero_point": True, "version": "gemm"})
    got, _, facts = load_quantized_checkpoint(tmp_path / "awq")
    check_imported(got, grid)
    assert facts["source_format"] == "awq-gemm" and facts["source_tool"] == "awq version gemm"
    assert torch.equal(logits(got), logits(dense_reference(model, grid, 32)))


# ---- refusals -----------------------------------------------------------------------------------------------


def gptq_folder(tmp_path, g_idx=None, drop=None, qc=None):
    model = tiny_llama()
    grid = random_grid(model, 4, 32, True, 0, seed=1)
    layers = {}
    for name, (q, z, s) in grid.items():
        layers[name] = {"qweight": as_int32(pack_gptq_columns(q.t().numpy(), 4)),
                        "qzeros": as_int32(pack_gptq_columns(z.numpy(), 4).T), "scales": s.t().contiguous()}
        if g_idx is not None:
            layers[name]["g_idx"] = g_idx(q.shape[1])
    layers["model.layers.1.mlp.up_proj"].pop(drop, None)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq_v2"}
    write_packed_checkpoint(tmp_path / "q", model, layers, config | (qc or {}))
    return tmp_path / "q"


def test_act_order_groups_fail_naming_the_layer(tmp_path):
    def shuffled(n):  # desc_act's groups: a permutation of the input rows
        return (torch.arange(n).flip(0) // 32).to(torch.int32)

    with pytest.raises(ValueError, match=r"/q: layer model\.layers\.0\.self_attn\.q_proj: g_idx is not i // "
                                         r"group_size .*quantlab imports GPTQ w2"):
        load_quantized_checkpoint(gptq_folder(tmp_path, g_idx=shuffled))


def test_a_missing_tensor_fails_naming_the_layer_and_file(tmp_path):
    with pytest.raises(ValueError, match=r"layer model\.layers\.1\.mlp\.up_proj: tensor model\.layers\.1\.mlp\."
                                         r"up_proj\.scales is missing from model\.safetensors"):
        load_quantized_checkpoint(gptq_folder(tmp_path, drop="scales"))


@pytest.mark.parametrize("qc,match", [
    ({"bits": 5}, r"bits 5: quantlab imports GPTQ w2 / w3 / w4 / w8"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' \(a kernel's own layout\)"),
    ({"quant_method": "awq", "version": "gemv"}, r"AWQ version 'gemv'.*quantlab imports AWQ GEMM"),
    ({"quant_method": "bitsandbytes"}, r"quantization method 'bitsandbytes'; quantlab imports compressed-tensors"),
])
def test_an_unsupported_gptq_or_awq_config_fails_before_reading_tensors(tmp_path, qc, match):
    folder = gptq_folder(tmp_path, qc=qc)
    (folder / "model.safetensors").unlink()  # the config alone must refuse it
    with pytest.raises(ValueError, match=match):
        load_quantized_checkpoint(folder)


@pytest.fixture(scope="module")
def ct_folder(tmp_path_factory):
    model = tiny_llama()
    quantize(model, make_config({"method": "rtn", "bits": 4, "group_size": 32}), progress=False)
    out = tmp_path_factory.mktemp("ct") / "ct"
    export_compressed_tensors(model, out)
    return out


def edited_ct(ct_folder, tmp_path, edit_config=None, drop=None):
    out = tmp_path / "edited"
    out.mkdir()
    config = json.loads((ct_folder / "config.json").read_text())
    if edit_config:
        edit_config(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(ct_folder / "model.safetensors")
    if drop is None:
        return out
    tensors.pop(drop)
    save_file(tensors, out / "model.safetensors")
    return out


def _nvfp4(qc):
    qc["config_groups"]["group_0"] |= {"format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}


def _actorder_group(qc):
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"


def _block(qc):
    qc["config_groups"]["group_0"]["weights"] |= {"strategy": "block", "block_structure": [32, 32],
                                                  "group_size": None}


@pytest.mark.parametrize("edit,why", [
    (_nvfp4, "stores the tensor scale inverted"),
    (_actorder_group, "actorder group: its groups follow a g_idx permutation"),
    (_block, "weight strategy block"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme is set"),
])
def test_an_unsupported_ct_scheme_fails_naming_the_layer_before_reading_tensors(ct_folder, tmp_path, edit, why):
    folder = edited_ct(ct_folder, tmp_path, edit)  # no weights file: the config alone must refuse it
    with pytest.raises(ValueError) as info:
        load_quantized_checkpoint(folder)
    message = str(info.value)
    assert why in message and str(folder) in message, message
    assert "quantlab imports pack-quantized" in message or "kv_cache" in message, message
    if "kv_cache" not in why:
        assert "layer model.layers.0.self_attn.q_proj: scheme (" in message, message


def test_a_ct_layer_missing_its_scale_fails_naming_it(ct_folder, tmp_path):
    folder = edited_ct(ct_folder, tmp_path, drop="model.layers.0.mlp.down_proj.weight_scale")
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.down_proj: tensor model\.layers\.0\.mlp\."
                                         r"down_proj\.weight_scale is missing from model\.safetensors"):
        load_quantized_checkpoint(folder)


# ---- an experiment on an imported checkpoint --------------------------------------------------------------------


def _experiment(model_dir, reference, runs, **extra):
    from quantlab.runs.experiment import parse_experiment

    return parse_experiment({"name": "imported", "model": str(model_dir), "device": "cpu",
                             **({"reference": str(reference)} if reference else {}),
                             "eval": {"dataset": str(reference / "sample.txt"), "seq_len": 32, "max_windows": 2,
                                      "kl_windows": 2, "latency": False, **extra},
                             "run": runs})


def test_an_experiment_evaluates_an_imported_checkpoint_against_its_reference(tiny_model_dir, tmp_path):
    from quantlab.models.loading import load_model
    from quantlab.reporting.results import read_rows
    from quantlab.runs import runner

    model, tok = load_model(str(tiny_model_dir), device="cpu", progress=False)
    quantize(model, make_config({"method": "rtn", "bits": 4, "group_size": 32}), progress=False)
    export_compressed_tensors(model, tmp_path / "ct", tok)
    exp = _experiment(tmp_path / "ct", tiny_model_dir, [{"name": "imported", "method": "none"}])
    df = runner.run_experiment(exp, tmp_path / "reports", progress=False)
    assert list(df["source_format"]) == ["compressed-tensors"]
    assert df["scheme"].iloc[0] == "imported compressed-tensors: w4 g32 sym"  # the report keeps the file's grid
    assert df["bits"].iloc[0] == 4 and df["group_size"].iloc[0] == 32
    row, = read_rows(tmp_path / "reports" / "imported.results.jsonl")  # as stored
    assert row["source_format"] == "compressed-tensors" and row["source_tool"].startswith("compressed-tensors 0.")
    assert json.loads(row["source_schemes"]) == {"w4 g32 sym": 14} and row["scheme"].startswith("imported")
    assert row["bits"] == 4 and row["group_size"] == 32 and row["reference_model"] == str(tiny_model_dir)
    assert 0 < row["kl_mean"] < 1 and 0 < row["top1_agree"] <= 1  # measured against the float reference
    with pytest.raises(ValueError, match=r"run 'rtn': model .* is a compressed-tensors checkpoint, evaluated as "
                                         r"imported: its runs take method \"none\""):
        _experiment(tmp_path / "ct", tiny_model_dir, [{"name": "rtn", "method": "rtn", "bits": 4}])
    with pytest.raises(ValueError, match=r"reference = .* applies to a model that is a quantized checkpoint"):
        _experiment(tiny_model_dir, tiny_model_dir, [{"name": "base", "method": "none"}])


# ---- another tool's checkpoint as one run of an experiment on the float model (method "checkpoint") -------------


def test_a_checkpoint_run_takes_the_files_state_whole_and_scores_beside_quantlabs_runs(tiny_model_dir, tmp_path):
    """Reference: quantlab's own RTN run of the same grid. Its export, scored as a `checkpoint` run, gives the RTN
    run's per-window NLL exactly (the same codes, the same float tensors); a norm edited in the file (as a
    SmoothQuant fold edits it) reaches the run's model, whose logits equal the imported model's (torch.equal)."""
    import hashlib

    from quantlab.models.loading import load_model
    from quantlab.runs import runner
    from quantlab.runs.experiment import parse_experiment

    rtn = {"method": "rtn", "bits": 4, "group_size": 32}
    model, tok = load_model(str(tiny_model_dir), device="cpu", progress=False)
    quantize(model, make_config(rtn), progress=False)
    export_compressed_tensors(model, tmp_path / "same", tok)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(1.5)
    export_compressed_tensors(model, tmp_path / "edited", tok)

    float_model, _ = load_model(str(tiny_model_dir), device="cpu", progress=False)
    edited = copy.deepcopy(float_model)
    quantize(edited, make_config({"method": "checkpoint", "path": str(tmp_path / "edited")}), progress=False)
    imported, _, _ = load_quantized_checkpoint(tmp_path / "edited")
    assert torch.equal(edited.model.layers[0].input_layernorm.weight, model.model.layers[0].input_layernorm.weight)
    assert torch.equal(logits(edited), logits(imported)) and torch.equal(logits(edited), logits(model))

    exp = parse_experiment({"name": "referee", "model": str(tiny_model_dir), "device": "cpu",
                            "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3,
                                     "kl_windows": 3, "latency": False},
                            "run": [{"name": "fp32", "method": "none"}, {"name": "rtn", **rtn},
                                    {"name": "theirs", "method": "checkpoint", "path": str(tmp_path / "same")},
                                    {"name": "edited", "method": "checkpoint", "path": str(tmp_path / "edited")}]})
    df = runner.run_experiment(exp, tmp_path / "reports", progress=False).set_index("run")
    assert df.loc["theirs", "window_nll"] == df.loc["rtn", "window_nll"]  # the same numbers, window by window
    assert df.loc["edited", "window_nll"] != df.loc["rtn", "window_nll"]
    assert df.loc["theirs", "source_format"] == "compressed-tensors"
    assert df.loc["theirs", "scheme"] == "imported compressed-tensors: w4 g32 sym"
    assert df.loc["theirs", "bits"] == 4 and df.loc["theirs", "group_size"] == 32
    assert df.loc["theirs", "bits_per_weight"] == df.loc["rtn", "bits_per_weight"]
    (file,) = (tmp_path / "same").glob("*.safetensors")
    assert df.loc["theirs", "source_sha256"] == f"{file.name}:{hashlib.sha256(file.read_bytes()).hexdigest()}"
    assert 0 < df.loc["theirs", "kl_mean"] == df.loc["rtn", "kl_mean"]  # against the experiment's float model


def test_a_checkpoint_run_of_another_architecture_fails_before_any_weights_load(tiny_model_dir, tmp_path):
    from quantlab.runs import runner
    from quantlab.runs.experiment import parse_experiment

    other = tiny_llama()  # intermediate 128; the experiment's model has 96
    quantize(other, make_config({"method": "rtn", "bits": 4, "group_size": 32}), progress=False)
    export_compressed_tensors(other, tmp_path / "other")
    for f in (tmp_path / "other").glob("*.safetensors"):
        f.unlink()  # a weights read would fail differently: the check reads config.json only
    exp = parse_experiment({"name": "mismatch", "model": str(tiny_model_dir), "device": "cpu",
                            "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2},
                            "run": [{"name": "theirs", "method": "checkpoint", "path": str(tmp_path / "other")}]})
    with pytest.raises(ValueError, match=r"run 'theirs' on model .*: checkpoint .*other' is not the experiment "
                                         r"model's architecture: intermediate_size 128 \(the model's 96\)"):
        runner.run_experiment(exp, tmp_path / "reports", progress=False)


def test_a_bad_checkpoint_path_fails_naming_it_before_any_weights_load(tiny_model_dir, tmp_path):
    from quantlab.runs import runner
    from quantlab.runs.experiment import parse_experiment

    with pytest.raises(ValueError, match=r"path must be the folder of a quantized checkpoint, got ''"):
        make_config({"method": "checkpoint", "path": ""})
    for path, match in ((tmp_path / "missing", r"path '.*missing' is not a folder"),
                        (tiny_model_dir, r".* holds no quantization config quantlab imports \(.*compressed-tensors")):
        exp = parse_experiment({"name": "bad", "model": str(tiny_model_dir), "device": "cpu",
                                "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32},
                                "run": [{"name": "theirs", "method": "checkpoint", "path": str(path)}]})
        with pytest.raises(ValueError, match=r"run 'theirs' on model .*: checkpoint: " + match):
            runner.run_experiment(exp, tmp_path / "reports", progress=False)
        assert not (tmp_path / "reports" / "bad.results.jsonl").exists() or not (
            tmp_path / "reports" / "bad.results.jsonl").read_text()
