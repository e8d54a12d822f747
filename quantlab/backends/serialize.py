"""Save and load quantized models: safetensors + JSON, never pickle.

A saved directory holds
  model.safetensors     every tensor of the frozen model: packed codes (qweight), scales, zero points
                        (zero_u, HQQ's zero_f), biases, smoothing input scales, static activation qparams and the
                        float parameters (embeddings, norms); tied tensors are stored once
  quant_config.json     format version, base model id, the quantization config, per-layer specs
                        (bits, group size, sym, scale dtype, activation quantizer), tied aliases,
                        the safetensors file's sha256; the safetensors metadata records this file's own sha256
                        (quant_config_sha256, of its content less weights_sha256), so an edit is caught too
  config.json           the base model's Hugging Face config (architecture only)

load_quantized builds the architecture from config.json with empty weights (no base weights are
read), swaps in frozen QuantLinear shells and assigns the stored tensors: outputs are bitwise
identical to the saved model's on the same device. quant_config.json is checked before it is used: its schema
(quant_config.py), each layer against the architecture and the stored tensors, then both checksums; every
problem is one ValueError naming the file and the field.

    save_quantized(model, "out/w4", config=RTNConfig(bits=4, group_size=64), base_model_id="smollm2-135m")
    model = load_quantized("out/w4")
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core import formats, packing
from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.lifecycle import linearize_conv1d, quant_linears, set_submodule
from ..core.primitives import n_groups
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import config_to_dict
from ..util.checks import resolve_dtype, utf8_error
from .quant_config import check_quant_config

FORMAT = "quantlab-quantized/1"
WEIGHTS, QCONFIG, HF_CONFIG = "model.safetensors", "quant_config.json", "config.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _config_sha256(meta: dict) -> str:
    """sha256 of quant_config.json's content less weights_sha256, as canonical JSON (sorted keys, no spaces)."""
    core = {k: v for k, v in meta.items() if k != "weights_sha256"}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _act_spec(act: nn.Module | None) -> dict | None:
    if act is None:
        return None
    if isinstance(act, DynamicActQuant):
        return {"kind": "dynamic", "bits": act.bits, "symmetric": act.symmetric, "format": act.format}
    if isinstance(act, StaticActQuant):
        return {"kind": "static", "bits": act.bits, "symmetric": act.symmetric, "format": act.format}
    raise ValueError(f"cannot save activation quantizer {type(act).__name__}; known: DynamicActQuant, StaticActQuant")


def _layer_spec(layer: QuantLinear) -> dict:
    if not layer.frozen:
        raise ValueError("save_quantized needs a frozen model (run quantize() / method.convert first)")
    s = layer.spec
    return {"in_features": layer.in_features, "out_features": layer.out_features, "bias": layer.bias is not None,
            "bits": s.bits, "group_size": s.group_size, "symmetric": s.symmetric, "scale_dtype": s.scale_dtype,
            "format": s.format, "double_quant": s.double_quant,
            "input_scale": layer.input_scale is not None, "act_quant": _act_spec(layer.act_quant),
            "float_zero": layer.float_zero}


def _dedup_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with tied tensors once; aliases maps a dropped key to the key that holds its data."""
    tensors, aliases, seen = {}, {}, {}
    for key, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.detach().contiguous().cpu()
    return tensors, aliases


def save_quantized(model: nn.Module, path: str | Path, config: Any, base_model_id: str) -> Path:
    """Write a frozen quantized model to directory `path` (created). Returns the path."""
    from safetensors.torch import save_file

    layers = quant_linears(model)
    if not layers:
        raise ValueError("save_quantized: the model has no QuantLinear layers (quantize it first)")
    if not isinstance(base_model_id, str) or not base_model_id:
        raise ValueError(f"base_model_id must be a non-empty string, got {base_model_id!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _dedup_state(model)
    cfg = model.config.to_dict()
    float_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    meta = json.loads(json.dumps({  # as it will read back (tuples as lists), for its hash
        "format": FORMAT, "base_model_id": base_model_id, "model_type": cfg.get("model_type"),
        "dtype": str(float_dtype).removeprefix("torch."),
        "quantization": config_to_dict(config) if config is not None else None,
        "layers": {name: _layer_spec(layer) for name, layer in layers.items()},
        "aliases": aliases,
    }))
    save_file(tensors, str(path / WEIGHTS), metadata={"format": FORMAT, "quant_config_sha256": _config_sha256(meta)})
    (path / HF_CONFIG).write_text(json.dumps(cfg, indent=1, default=str))
    meta["weights_sha256"] = _sha256(path / WEIGHTS)
    (path / QCONFIG).write_text(json.dumps(meta, indent=1))
    return path


def _read_json(file: Path):
    if not file.is_file():
        raise FileNotFoundError(f"quantized model file {str(file)!r} is missing")
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise utf8_error(file, e) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: corrupt JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{file}: corrupt JSON (arrays or objects nest too deeply)") from None


def _read_meta(path: Path, base_model_id: str | None) -> dict:
    meta = check_quant_config(_read_json(path / QCONFIG), path / QCONFIG, FORMAT)
    if base_model_id is not None and base_model_id != meta["base_model_id"]:
        raise ValueError(f"{path / QCONFIG}: quantized from base model {meta['base_model_id']!r}, "
                         f"not {base_model_id!r}")
    weights = path / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"quantized model file {str(weights)!r} is missing")
    if _sha256(weights) != meta.get("weights_sha256"):
        raise ValueError(f"{weights}: corrupt (sha256 differs from the one recorded in {QCONFIG})")
    return meta


def _shell(spec: dict, dtype: torch.dtype, static_scale_shape: tuple) -> QuantLinear:
    """A frozen QuantLinear with empty buffers shaped as the spec implies; load assigns the stored tensors,
    so a file whose tensors do not match the spec fails in load_state_dict."""
    ws = WeightSpec(spec["bits"], spec["group_size"], spec["symmetric"], spec["scale_dtype"],
                    spec.get("format", "int"), spec.get("double_quant", False))
    out_f, in_f = spec["out_features"], spec["in_features"]
    layer = QuantLinear(in_f, out_f, spec["bias"], ws)
    groups = (out_f, n_groups(in_f, ws.group_size))
    if ws.ggml is not None:  # llama.cpp's blocks (scales and mins inside), one row of bytes per output feature
        layer.register_buffer("qweight", torch.empty(out_f, in_f // ws.ggml.block * ws.ggml.type_size,
                                                     dtype=torch.uint8))
    else:
        layer.register_buffer("qweight", torch.empty(packing.packed_nbytes(out_f * in_f, ws.bits), dtype=torch.uint8))
    if ws.fmt is not None and ws.ggml is None:
        for key, (shape, dtype_) in formats.storage_shapes(ws.fmt, groups, ws.torch_scale_dtype, ws.double_quant).items():
            layer.register_buffer(key, torch.empty(shape, dtype=dtype_))
    elif ws.fmt is None:
        layer.register_buffer("scale", torch.empty(groups, dtype=ws.torch_scale_dtype))
    if spec.get("float_zero", False):  # HQQ: real-valued zeros in the scale dtype
        layer.register_buffer("zero_f", torch.empty(groups, dtype=ws.torch_scale_dtype))
    elif not ws.symmetric and ws.fmt is None:  # integer zero points (any4's offsets are among the format's scales)
        layer.register_buffer("zero_u", torch.empty(groups, dtype=torch.uint8))
    if spec["input_scale"]:
        layer.register_buffer("input_scale", torch.empty(in_f, dtype=dtype))
    act = spec["act_quant"]
    if act is not None and act["kind"] == "dynamic":
        layer.act_quant = DynamicActQuant(act["bits"], act["symmetric"], act.get("format", "int"))
    elif act is not None:
        zero = None if act["symmetric"] else torch.zeros(static_scale_shape, dtype=torch.int32)
        layer.act_quant = StaticActQuant(act["bits"], act["symmetric"], torch.ones(static_scale_shape), zero,
                                         act.get("format", "int"))
    layer.weight, layer.frozen = None, True
    return layer


def _check_fits(model: nn.Module, name: str, spec: dict, file: Path) -> None:
    """The layer a `layers` entry names is a linear of the architecture (config.json) with its shape."""
    field = f"layers[{json.dumps(name)}]"
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{file}: {field} names no linear layer of the architecture in {HF_CONFIG} "
                         f"({type(linear).__name__ if linear is not None else 'no such module'})")
    for key in ("in_features", "out_features"):
        if spec[key] != getattr(linear, key):
            raise ValueError(f"{file}: {field}.{key} = {spec[key]}, but the architecture in {HF_CONFIG} has "
                             f"{getattr(linear, key)} there (edited, or a config.json of another base model?)")


def _check_tensors(shell: QuantLinear, name: str, tensors: dict, file: Path) -> None:
    """The tensors the layer's spec implies are the ones stored, shaped alike (else: the spec was changed)."""
    field, prefix = f"layers[{json.dumps(name)}]", f"{name}."
    want = {prefix + k: tuple(t.shape) for k, t in shell.state_dict().items()}
    have = {k: tuple(t.shape) for k, t in tensors.items() if k.startswith(prefix)}
    for key in sorted(want.keys() | have.keys()):
        if want.get(key) != have.get(key):
            implied = "no such tensor" if key not in want else f"shape {want[key]}"
            stored = "has none" if key not in have else f"holds shape {have[key]}"
            raise ValueError(f"{file}: {field} (bits, group_size, symmetric, format, input_scale, act_quant) "
                             f"disagrees with the stored tensors: it implies {implied} for {key}, {WEIGHTS} {stored}")


def _check_config_sha(meta: dict, weights: bytes, file: Path) -> None:
    """quant_config.json's content against the sha256 save_quantized recorded in the weights' metadata."""
    header = json.loads(weights[8:8 + int.from_bytes(weights[:8], "little")])  # valid: load() read it
    recorded = header.get("__metadata__", {}).get("quant_config_sha256")
    if recorded is not None and recorded != _config_sha256(meta):  # None: saved before it was recorded
        raise ValueError(f"{file}: changed since it was saved (its sha256 differs from quant_config_sha256 in "
                         f"{WEIGHTS}'s metadata): its fields are well formed but may not describe these weights; "
                         f"save the model again")


def _swap_shells(model: nn.Module, meta: dict, tensors: dict, dtype: torch.dtype, file: Path) -> None:
    """Every quantized layer of meta as a frozen QuantLinear shell, each checked against the model and tensors."""
    for alias, source in meta["aliases"].items():
        if source not in tensors:
            raise ValueError(f"{file}: aliases[{json.dumps(alias)}] = {source!r} names no tensor of {WEIGHTS}")
        tensors[alias] = tensors[source]
    for name, spec in meta["layers"].items():
        _check_fits(model, name, spec, file)
        static = tensors.get(f"{name}.act_quant.scale")
        shell = _shell(spec, dtype, tuple(static.shape) if static is not None else ())
        _check_tensors(shell, name, tensors, file)
        set_submodule(model, name, shell)


def load_quantized(path: str | Path, base_model_id: str | None = None, device: str = "cpu") -> nn.Module:
    """Rebuild a model saved by save_quantized (eval mode, on device). Never unpickles anything.

    base_model_id, when given, must match the saved one. Errors name the missing or corrupt file.
    """
    from accelerate import init_empty_weights
    from safetensors import SafetensorError
    from safetensors.torch import load
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"quantized model directory {str(path)!r} does not exist")
    meta = _read_meta(path, base_model_id)
    hf_config = _read_json(path / HF_CONFIG)
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path / HF_CONFIG}: must be a JSON object (a Hugging Face config), "
                         f"got {type(hf_config).__name__}")
    if hf_config.get("model_type") != meta["model_type"]:
        raise ValueError(f"{path / HF_CONFIG}: model_type {hf_config.get('model_type')!r} does not match "
                         f"{meta['model_type']!r} in {QCONFIG} (mismatched base model)")
    dtype = resolve_dtype(meta["dtype"])
    config = AutoConfig.for_model(**hf_config)
    with init_empty_weights(include_buffers=False):  # params on meta: nothing allocated until assigned
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    linearize_conv1d(model)  # prepare turned every Conv1D (GPT-2) into nn.Linear before it was saved
    try:
        # read, not mmap: an mmapped file stays resident while any one tensor of it lives, so codes
        # replaced by an export (torchao) would keep their pages in RSS next to the new ones
        weights = (path / WEIGHTS).read_bytes()
        tensors = load(weights)
    except SafetensorError as e:
        raise ValueError(f"{path / WEIGHTS}: corrupt safetensors file ({e})") from None
    _swap_shells(model, meta, tensors, dtype, path / QCONFIG)
    _check_config_sha(meta, weights, path / QCONFIG)
    del weights  # the tensors are copies (load reads, never maps)
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path / WEIGHTS}: tensors do not fit the architecture in {HF_CONFIG} "
                         f"(mismatched base model?): {str(e)[:500]}") from None
    model.tie_weights()
    return model.to(device).eval()
