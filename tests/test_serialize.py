"""save_quantized / load_quantized: bitwise round trip, no pickle, clear errors on bad directories."""
from __future__ import annotations

import json
import pickle
import re

import pytest
import torch

import quantlab
from quantlab.backends.serialize import QCONFIG, WEIGHTS, load_quantized, save_quantized
from quantlab.core.lifecycle import quant_linears

SPECS = [
    {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
    {"method": "rtn", "bits": 3, "group_size": 64},
    {"method": "dynamic"},
    {"method": "smoothquant", "base": {"method": "static", "act_granularity": "channel"}},
    {"method": "rtn", "bits": 4, "group_size": 32, "overrides": [  # mixed precision: per-layer specs
        {"pattern": "*.mlp.down_proj", "bits": 8, "group_size": "channel"}, {"pattern": "*.0.*", "bits": 3}]},
]


def _ids(b=2, t=20, seed=0):
    return torch.randint(0, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def _saved(tiny_model_dir, tmp_path, spec):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config = quantlab.make_config(spec)
    calib = [_ids(1, 32, s) for s in range(3)]
    quantlab.quantize(model, config, calibration=calib)
    save_quantized(model, tmp_path / "q", config, str(tiny_model_dir))
    return model, tmp_path / "q"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["method"] + str(s.get("bits", "")))
def test_save_load_is_bitwise_identical(tiny_model_dir, tmp_path, spec, monkeypatch):
    model, path = _saved(tiny_model_dir, tmp_path, spec)
    # loading must never unpickle: make every pickle entry point fail
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    loaded = load_quantized(path, base_model_id=str(tiny_model_dir))
    ids = _ids()
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)  # exact, atol=0
    a, b = quant_linears(model), quant_linears(loaded)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].qweight, b[name].qweight) and torch.equal(a[name].scale, b[name].scale)
        assert type(a[name].act_quant) is type(b[name].act_quant)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    meta = json.loads((path / QCONFIG).read_text())
    assert meta["quantization"]["method"] == spec["method"] and meta["base_model_id"] == str(tiny_model_dir)


def test_loaded_weights_are_copies_not_a_mapping_of_the_file(tiny_model_dir, tmp_path):
    """A model mapped from its file keeps the whole file resident while any one tensor lives (so an
    export's replaced codes would stay in RSS); a copy does not see the file change under it."""
    model, path = _saved(tiny_model_dir, tmp_path, SPECS[0])
    loaded = load_quantized(path)
    weights = path / WEIGHTS
    size = weights.stat().st_size
    with weights.open("r+b") as f:  # rewrite in place (same inode): a mapping would now read zeros
        f.write(b"\0" * size)
    ids = _ids()
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_loaded_model_exports_to_torchao(tiny_model_dir, tmp_path):
    from quantlab.backends import export_model

    _, path = _saved(tiny_model_dir, tmp_path, SPECS[0])
    summary = export_model(load_quantized(path), "torchao", _ids())
    assert summary["backend"] == "torchao" and summary["export_parity_ok"]


def test_missing_directory_and_files_are_named(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_quantized(tmp_path / "nope")
    _, path = _saved(tiny_model_dir, tmp_path, SPECS[0])
    (path / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*is missing"):
        load_quantized(path)
    (path / QCONFIG).unlink()
    with pytest.raises(FileNotFoundError, match=r"quant_config\.json.*is missing"):
        load_quantized(path)


def test_corrupt_files_are_named(tiny_model_dir, tmp_path):
    _, path = _saved(tiny_model_dir, tmp_path, SPECS[0])
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data
    (path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt"):
        load_quantized(path)
    (path / QCONFIG).write_text("{not json")
    with pytest.raises(ValueError, match=r"quant_config\.json: corrupt JSON"):
        load_quantized(path)


def test_mismatched_base_model_is_an_error(tiny_model_dir, tmp_path):
    _, path = _saved(tiny_model_dir, tmp_path, SPECS[0])
    with pytest.raises(ValueError, match=r"quant_config\.json: quantized from base model .* not 'smollm2-135m'"):
        load_quantized(path, base_model_id="smollm2-135m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"hidden_size": 128}))  # another architecture
    with pytest.raises(ValueError, match=r"quant_config\.json: layers\[\"model\.layers\.0\.self_attn\.q_proj\"\]"
                                         r"\.in_features = 64, but the architecture in config\.json has 128 there"):
        load_quantized(path)


def test_save_needs_a_frozen_quantized_model(tiny_model, tmp_path):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="no QuantLinear layers"):
        save_quantized(model, tmp_path / "unused", None, "x")


Q = '["model.layers.0.self_attn.q_proj"]'  # the field path of the first layer in messages


def _layer(meta, **fields):
    meta["layers"]["model.layers.0.self_attn.q_proj"].update(fields)
    return meta


def _drop_layer_key(meta, key):
    del meta["layers"]["model.layers.0.self_attn.q_proj"][key]
    return meta


TAMPERED = [  # (id, change of the parsed quant_config.json (or its bytes), the field the error names and valid values)
    ("truncated", lambda m, raw: raw[: len(raw) // 2], r"corrupt JSON \(.*line \d+ column \d+"),
    ("not-utf8", lambda m, raw: b"\xff\xfe" + raw, r"not a UTF-8 text file \('utf-8' codec can't decode byte 0xff"),
    ("nested-deep", lambda m, raw: b"[" * 100_000, r"corrupt JSON \(arrays or objects nest too deeply\)"),
    ("top-level-list", lambda m, raw: [m], r"the top level must be a JSON object, got \["),
    ("format-version", lambda m, raw: m | {"format": "quantlab-quantized/9"},
     r"format 'quantlab-quantized/9' is not 'quantlab-quantized/1'"),
    ("missing-layers", lambda m, raw: {k: v for k, v in m.items() if k != "layers"},
     r"the top level lacks key\(s\) 'layers'; required: format, base_model_id, .*weights_sha256"),
    ("unknown-top-key", lambda m, raw: m | {"evil": 1}, r"the top level has unknown key\(s\) 'evil'; valid: format"),
    ("dtype-evil", lambda m, raw: m | {"dtype": "evil"}, r"dtype 'evil' unknown; known: float32, float16, bfloat16"),
    ("base-model-id-int", lambda m, raw: m | {"base_model_id": 7}, r"base_model_id must be a non-empty string, got 7"),
    ("layers-list", lambda m, raw: m | {"layers": list(m["layers"])}, r"layers must be a JSON object \{layer name"),
    ("layers-empty", lambda m, raw: m | {"layers": {}}, r"layers is empty; a saved model has at least one"),
    ("layer-not-object", lambda m, raw: m | {"layers": {"model.layers.0.self_attn.q_proj": 4}},
     rf"layers{re.escape(Q)} must be a JSON object, got 4"),
    ("bits-string", lambda m, raw: _layer(m, bits="4"), rf"layers{re.escape(Q)}\.bits must be an integer in 2\.\.8, got '4'"),
    ("bits-9", lambda m, raw: _layer(m, bits=9), rf"layers{re.escape(Q)}\.bits must be an integer in 2\.\.8, got 9"),
    ("group-size-negative", lambda m, raw: _layer(m, group_size=-32),
     rf"layers{re.escape(Q)}\.group_size must be an integer >= 1, got -32"),
    ("bias-string", lambda m, raw: _layer(m, bias="no"), rf"layers{re.escape(Q)}\.bias must be true or false, got 'no'"),
    ("format-evil", lambda m, raw: _layer(m, format="evil"),
     rf"layers{re.escape(Q)}\.format 'evil' unknown; known: int, fp8_e4m3, .*nf4"),
    ("nf4-asymmetric", lambda m, raw: _layer(m, format="nf4", bits=4, symmetric=False),
     rf"layers{re.escape(Q)}: format 'nf4' is symmetric \(no zero point\); symmetric = False"),
    ("scale-dtype-evil", lambda m, raw: _layer(m, scale_dtype="evil"),
     rf"layers{re.escape(Q)}\.scale_dtype 'evil' unknown; known: float32, float16, bfloat16, null"),
    ("layer-missing-key", lambda m, raw: _drop_layer_key(m, "symmetric"),
     rf"layers{re.escape(Q)} lacks key\(s\) 'symmetric'; required: in_features, "),
    ("layer-unknown-key", lambda m, raw: _layer(m, evil=1), rf"layers{re.escape(Q)} has unknown key\(s\) 'evil'"),
    ("act-kind-evil", lambda m, raw: _layer(m, act_quant={"kind": "evil", "bits": 8, "symmetric": True}),
     rf"layers{re.escape(Q)}\.act_quant\.kind 'evil' unknown; known: dynamic, static"),
    ("act-bits-3", lambda m, raw: _layer(m, act_quant={"kind": "dynamic", "bits": 3, "symmetric": True}),
     rf"layers{re.escape(Q)}\.act_quant: bits must be an integer in 4\.\.8, got 3"),
    ("act-string", lambda m, raw: _layer(m, act_quant="int8"), rf"layers{re.escape(Q)}\.act_quant must be a JSON object"),
    ("static-act-mxfp4", lambda m, raw: _layer(m, act_quant={"kind": "static", "bits": 4, "symmetric": True,
                                                              "format": "mxfp4"}),
     rf"layers{re.escape(Q)}\.act_quant\.format 'mxfp4' unknown; known: int, fp8_e4m3, fp8_e5m2"),
    ("sha-number", lambda m, raw: m | {"weights_sha256": 12}, r"weights_sha256 must be 64 lowercase hex digits, got 12"),
    ("alias-unknown", lambda m, raw: m | {"aliases": {"lm_head.weight": "nope"}},
     r"aliases\[\"lm_head\.weight\"\] = 'nope' names no tensor of model\.safetensors"),
    ("layer-not-in-model", lambda m, raw: m | {"layers": {"model.layers.9.mlp.up_proj": m["layers"][
        "model.layers.0.mlp.up_proj"]}}, r"layers\[\"model\.layers\.9\.mlp\.up_proj\"\] names no linear layer"),
    ("shape-disagrees", lambda m, raw: _layer(m, in_features=65),
     rf"layers{re.escape(Q)}\.in_features = 65, but the architecture in config\.json has 64 there"),
    ("bits-disagree-with-weights", lambda m, raw: _layer(m, bits=4),
     (rf"layers{re.escape(Q)} \(bits, .*\) disagrees with the stored tensors: it implies shape \(2048,\) for "
      r"model\.layers\.0\.self_attn\.q_proj\.qweight, model\.safetensors holds shape \(4096,\)")),
    ("asymmetric-without-zeros", lambda m, raw: _layer(m, symmetric=False),
     rf"layers{re.escape(Q)} \(.*\) disagrees .*: it implies shape \(64, 1\) for .*q_proj\.zero_u, .* has none"),
    # well formed and fitting the weights, yet not what was saved: the config's own sha256 (in the weights' metadata)
    ("act-bits-edited", lambda m, raw: _layer(m, act_quant={"kind": "dynamic", "bits": 4, "symmetric": True,
                                                             "format": "int"}),
     r"changed since it was saved \(its sha256 differs from quant_config_sha256 in model\.safetensors's metadata\)"),
]


def test_a_tampered_quant_config_fails_naming_the_file_and_the_field(tiny_model_dir, tmp_path):
    """Every damaged or edited quant_config.json is one ValueError line naming the file and the field (these gave
    AttributeError: module 'torch' has no attribute 'evil', KeyError: 'layers', ... before its schema was checked)."""
    _, path = _saved(tiny_model_dir, tmp_path, {"method": "dynamic"})
    raw = (path / QCONFIG).read_bytes()
    wrong = []
    for name, change, field in TAMPERED:
        changed = change(json.loads(raw), raw)
        (path / QCONFIG).write_bytes(changed if isinstance(changed, bytes) else json.dumps(changed).encode())
        try:
            load_quantized(path)
            wrong.append(f"{name}: loaded")
        except ValueError as e:
            if not re.fullmatch(rf"{re.escape(str(path / QCONFIG))}: .*{field}.*", str(e)):
                wrong.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - any other error type is the defect
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)
    (path / QCONFIG).write_bytes(raw)
    load_quantized(path)  # the untouched file still loads
