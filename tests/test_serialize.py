"""save_quantized / load_quantized: bitwise round trip, no pickle, clear errors on bad directories."""
from __future__ import annotations

import json
import pickle

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
    with pytest.raises(ValueError, match=r"model\.safetensors: tensors do not fit the architecture"):
        load_quantized(path)


def test_save_needs_a_frozen_quantized_model(tiny_model, tmp_path):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="no QuantLinear layers"):
        save_quantized(model, tmp_path / "unused", None, "x")
