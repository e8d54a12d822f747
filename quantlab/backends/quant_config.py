"""The schema of quant_config.json (serialize.save_quantized writes it beside the weights), checked field by field
before load_quantized uses any of it: a damaged or hand-edited file fails in one line naming the file, the field
path and the valid values, never as an AttributeError / KeyError from deep inside the loader.

    check_quant_config(meta, Path("out/w4/quant_config.json"), "quantlab-quantized/1")   # passes or ValueError:
    # out/w4/quant_config.json: layers["model.layers.0.self_attn.q_proj"].bits must be an integer in 2..8, got 9

Only the weights file is checksummed against quant_config.json; this checks that the config itself is well formed
(serialize.py then checks that it fits the architecture and the stored tensors, and its own hash).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..core import formats
from ..core.activations import STATIC_FORMATS, check_act_format
from ..core.qlinear import WeightSpec
from ..util.checks import DTYPES, check_int

TOP_KEYS = ("format", "base_model_id", "model_type", "dtype", "quantization", "layers", "aliases", "weights_sha256")
LAYER_KEYS = ("in_features", "out_features", "bias", "bits", "group_size", "symmetric", "scale_dtype",
              "input_scale", "act_quant")
LAYER_OPTIONAL = ("format", "double_quant", "float_zero")  # absent in files saved before these existed
ACT_KEYS, ACT_OPTIONAL, ACT_KINDS = ("kind", "bits", "symmetric"), ("format",), ("dynamic", "static")
SHA256 = re.compile(r"[0-9a-f]{64}")


def check_quant_config(meta, file: Path, format_name: str) -> dict:
    """`meta` (quant_config.json parsed) if it is well formed, else a ValueError naming `file` and the field."""
    try:
        _check_top(meta, format_name)
        for name, spec in meta["layers"].items():
            check_layer(spec, f"layers[{json.dumps(name)}]")
        for alias, source in meta["aliases"].items():
            _check_str(f"aliases[{json.dumps(alias)}]", source, "a tensor name of the weights file")
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return meta


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_type(field: str, value, types: tuple, what: str) -> None:
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise ValueError(f"{field} must be {what}, got {_short(value)}")


def _check_str(field: str, value, what: str = "a non-empty string") -> None:
    _check_type(field, value, (str,), what)
    if not value:
        raise ValueError(f"{field} must be {what}, got ''")


def _check_keys(field: str, table, required: tuple, optional: tuple = ()) -> None:
    _check_type(field, table, (dict,), "a JSON object")
    missing = [k for k in required if k not in table]
    if missing:
        raise ValueError(f"{field} lacks key(s) {', '.join(map(repr, missing))}; required: {', '.join(required)}")
    unknown = sorted(set(table) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{field} has unknown key(s) {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(required + optional)}")


def _check_choice(field: str, value, known) -> None:
    if isinstance(value, bool) or not isinstance(value, str) or value not in known:
        raise ValueError(f"{field} {_short(value)} unknown; known: {', '.join(map(str, known))}")


def _check_top(meta, format_name: str) -> None:
    _check_type("the top level", meta, (dict,), "a JSON object")
    if meta.get("format") != format_name:  # first: another version is another schema
        raise ValueError(f"format {_short(meta.get('format'))} is not {format_name!r}")
    _check_keys("the top level", meta, TOP_KEYS)
    _check_str("base_model_id", meta["base_model_id"])
    if meta["model_type"] is not None:
        _check_str("model_type", meta["model_type"], "a Hugging Face model_type or null")
    _check_choice("dtype", meta["dtype"], DTYPES)
    _check_type("quantization", meta["quantization"], (dict, type(None)), "a JSON object or null")
    _check_type("layers", meta["layers"], (dict,), "a JSON object {layer name: spec}")
    if not meta["layers"]:
        raise ValueError("layers is empty; a saved model has at least one quantized layer")
    _check_type("aliases", meta["aliases"], (dict,), "a JSON object {tensor name: tensor name}")
    sha = meta["weights_sha256"]
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):
        raise ValueError(f"weights_sha256 must be 64 lowercase hex digits, got {_short(sha)}")


def check_layer(spec, field: str) -> WeightSpec:
    """One entry of `layers`; returns its WeightSpec. Errors name the field: layers["..."].bits."""
    _check_keys(field, spec, LAYER_KEYS, LAYER_OPTIONAL)
    for key in ("in_features", "out_features"):
        check_int(f"{field}.{key}", spec[key], 1)
    for key in ("bias", "symmetric", "input_scale", "double_quant", "float_zero"):
        _check_type(f"{field}.{key}", spec.get(key, False), (bool,), "true or false")
    check_int(f"{field}.bits", spec["bits"], 2, 8)
    if spec["group_size"] is not None:  # null: per output channel
        check_int(f"{field}.group_size", spec["group_size"], 1)
    if spec["scale_dtype"] is not None:
        _check_choice(f"{field}.scale_dtype", spec["scale_dtype"], (*DTYPES, "null"))
    _check_choice(f"{field}.format", spec.get("format", "int"), ("int", *formats.FORMATS))
    try:  # the fields together (a format fixes bits, blocks, symmetry): WeightSpec's own rules
        ws = WeightSpec(spec["bits"], spec["group_size"], spec["symmetric"], spec["scale_dtype"],
                        spec.get("format", "int"), spec.get("double_quant", False))
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    if spec.get("float_zero", False) and (ws.symmetric or ws.fmt is not None):
        raise ValueError(f"{field}.float_zero = true applies to asymmetric integer grids (HQQ), not to "
                         f"{ws.describe()}")
    _check_act(spec["act_quant"], f"{field}.act_quant")
    return ws


def _check_act(act, field: str) -> None:
    if act is None:
        return
    _check_keys(field, act, ACT_KEYS, ACT_OPTIONAL)
    _check_choice(f"{field}.kind", act["kind"], ACT_KINDS)
    fmt = act.get("format", "int")
    allowed = STATIC_FORMATS if act["kind"] == "static" else tuple(formats.FORMATS)
    _check_choice(f"{field}.format", fmt, ("int", *allowed))
    try:  # bits and symmetric as the format allows (activations: int 4..8, a number format fixes them)
        check_act_format(fmt, act["bits"], act["symmetric"], "format", allowed)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
