"""Read a compressed-tensors checkpoint's quantized layers into quantlab's frozen form: ct_export.py's inverse, for
the files llm-compressor writes too (backends/ckpt_import.py builds the model around them).

compressed-tensors (a QuantizationScheme and a format per layer)   quantlab
pack-quantized int w2..w8 (unpack_from_int32)                       int grid: u = q + 2^(b-1), zero_u = z + 2^(b-1)
int-quantized / naive-quantized int (int8 storage)                   the same, the codes checked to fit b bits
naive- / float-quantized fp8 e4m3                                    fp8_e4m3, fp32 scales, the codes are the bytes
mxfp4-pack-quantized (two E2M1 a byte, low nibble first; E8M0)       mxfp4, the scale bytes as they are
weights per channel or group; per tensor                             held per channel (every row the one scale)
inputs: dynamic per-token int8 sym                                   DynamicActQuant(8): quantlab's grid (INT8_TOKENS)
        static per-tensor int8 (sym / asym), fp8 per token / tensor   StaticActQuant / DynamicActQuant, the same grid

Everything else (NVFP4, MX 6/8, 2-D blocks, act-order groups, sparse or transformed models, a KV-cache scheme, ...)
is refused by check_ct_scheme, from the config alone, naming the layer, its scheme and SUPPORTED.
"""
from __future__ import annotations

import json

import torch

from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.qlinear import WeightSpec
from .ckpt_layer import LayerCodes, int_layer_codes
from .ct_forms import NVFP4_WHY

SUPPORTED = ("pack-quantized / int-quantized int w2..w8 per channel, group or tensor, sym or asym (with float "
             "inputs, dynamic per-token int8 sym or static per-tensor int8 inputs); naive- / float-quantized fp8_e4m3 "
             "per channel, group or tensor (with float inputs or fp8 ones, dynamic per token or static per tensor); "
             "mxfp4-pack-quantized")
INT8_TOKENS = ("dynamic per-token int8 inputs run on quantlab's grid (amax / 127 on [-127, 127]), not the engine's "
               "(compressed-tensors: amax / 127.5 on [-128, 127])")
INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FP8_FORMATS = ("naive-quantized", "float-quantized")


def read_ct_config(qc: dict, where: str) -> tuple:
    """(the checkpoint's QuantizationConfig, {config group: its actorder "group" / "dynamic"}), parsed by
    compressed-tensors' own parser, or a ValueError for what no layer of quantlab's can carry: weights not
    compressed, sparsity, transforms, a quantized KV cache. Act-order groups (which compressed-tensors 0.20 no longer
    parses) are taken out for the parser and refused per layer by check_ct_scheme."""
    from compressed_tensors.quantization import QuantizationConfig

    status = qc.get("quantization_status")
    if status != "compressed":
        raise ValueError(f"{where}: quantization_status {status!r}; quantlab imports compressed checkpoints "
                         f"(integer codes stored), not float weights with qparams beside them")
    for key, what in (("sparsity_config", "sparse weights"), ("transform_config", "online transforms (rotations)"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if qc.get(key):
            raise ValueError(f"{where}: {key} is set ({what}), which a quantlab model would run without; supported: "
                             f"{SUPPORTED}")
    qc = json.loads(json.dumps(qc))  # a copy to edit
    grouped = {}
    for gname, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") in ("group", "dynamic"):
            grouped[gname] = weights.pop("actorder")
    try:
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("sparsity_config",
                                                                                            "transform_config")})
        return parsed, grouped
    except ValueError as e:
        raise ValueError(f"{where}: quantization_config does not parse as compressed-tensors' ({e})") from None


def ct_schemes(model: torch.nn.Module, qconfig) -> dict[str, tuple]:
    """{module name: (config group, scheme, format)} of every module a config group targets and `ignore` does not
    name, matched as compressed-tensors matches them (class names such as "Linear", module names, "re:" patterns)."""
    from compressed_tensors.utils.match import is_match

    out = {}
    for name, module in model.named_modules():
        for gname, scheme in qconfig.config_groups.items():
            if scheme.weights is not None and is_match(name, module, scheme.targets, qconfig.ignore or ()):
                out[name] = (gname, scheme, scheme.format or qconfig.format)
                break
    return out


def _describe(scheme, fmt) -> str:
    w, a = scheme.weights, scheme.input_activations
    text = f"{fmt}: weights {w.type} w{w.num_bits} {w.strategy}"
    text += f" g{w.group_size}" if w.group_size else ""
    text += " sym" if w.symmetric else " asym"
    if a is not None:
        text += f", inputs {a.type} a{a.num_bits} {a.strategy} {'dynamic' if a.dynamic else 'static'}"
    return text


def _refuse(where: str, name: str, scheme, fmt, why: str) -> ValueError:
    return ValueError(f"{where}: layer {name}: scheme ({_describe(scheme, fmt)}) has no quantlab form ({why}); "
                      f"quantlab imports {SUPPORTED}")


def check_ct_scheme(where: str, name: str, scheme, fmt, actorder=None) -> str:
    """The kind of layer ("int", "fp8", "mxfp4") a scheme gives, or a ValueError naming the layer (config only);
    actorder: the group's act-order as the file wrote it, where read_ct_config took it out."""
    w, a = scheme.weights, scheme.input_activations
    if scheme.output_activations is not None:
        raise _refuse(where, name, scheme, fmt, "quantized outputs")
    if fmt == "nvfp4-pack-quantized":
        raise _refuse(where, name, scheme, fmt, NVFP4_WHY)
    if w.strategy not in ("channel", "group", "tensor"):
        raise _refuse(where, name, scheme, fmt, f"weight strategy {w.strategy}: quantlab's scales are per channel "
                      f"or per group of input channels")
    actorder = actorder or w.actorder
    if actorder not in (None, "weight", "static"):
        raise _refuse(where, name, scheme, fmt, f"actorder {actorder}: its groups follow a g_idx permutation, "
                      f"quantlab's are contiguous")
    if w.type == "int" and fmt in INT_FORMATS and 2 <= w.num_bits <= 8:
        kind = "int"
    elif w.type == "float" and w.num_bits == 8 and fmt in FP8_FORMATS and w.symmetric:
        kind = "fp8"
    elif (w.type == "float" and w.num_bits == 4 and fmt == "mxfp4-pack-quantized" and w.strategy == "group"
          and w.group_size == 32 and a is None):
        kind = "mxfp4"
    else:
        raise _refuse(where, name, scheme, fmt, f"{w.type} w{w.num_bits} stored {fmt}")
    if a is not None and _act_kind(a, kind) is None:
        raise _refuse(where, name, scheme, fmt, "its input quantization")
    return kind


def _act_kind(a, kind: str) -> str | None:
    """"token" (dynamic per token) or "tensor" (static per tensor) where quantlab has the grid, else None."""
    how = "token" if a.strategy == "token" and a.dynamic is True else (
        "tensor" if a.strategy == "tensor" and a.dynamic is False else None)
    if kind == "int" and a.type == "int" and a.num_bits == 8 and (how == "tensor" or (how == "token" and a.symmetric)):
        return how
    if kind == "fp8" and a.type == "float" and a.num_bits == 8 and a.symmetric:
        return how
    return None


def _act_quant(where: str, scheme, kind: str, get) -> torch.nn.Module | None:
    a = scheme.input_activations
    if a is None:
        return None
    fmt = "int" if a.type == "int" else "fp8_e4m3"
    if _act_kind(a, kind) == "token":
        return DynamicActQuant(8, True, fmt)
    scale = get("input_scale").float().reshape(())
    zero = None
    if not a.symmetric:  # signed int8 -> quantlab's unsigned 0..255, as the weights' zero points
        zero = (get("input_zero_point").to(torch.int32) + 128).reshape(())
    try:
        return StaticActQuant(8, a.symmetric, scale, zero, fmt)
    except ValueError as e:
        raise ValueError(f"{where}: input_scale / input_zero_point: {e}") from None


def _per_row(t: torch.Tensor, out_f: int, strategy: str) -> torch.Tensor:
    """A scale or zero point as (out, groups): a per-tensor one repeated on every row (the same numbers)."""
    return t.reshape(1, 1).expand(out_f, 1).clone() if strategy == "tensor" else t.reshape(out_f, -1)


def _check_g_idx(where: str, get, keys, w, in_f: int) -> None:
    if "weight_g_idx" not in keys:  # (act-order groups, which store one, are refused from the config)
        return
    g_idx = get("weight_g_idx").to(torch.int64)
    group = w.group_size or in_f
    if not torch.equal(g_idx, torch.arange(in_f) // group):
        raise ValueError(f"{where}: weight_g_idx is not i // group_size (activation-ordered groups); quantlab's groups "
                         f"are contiguous runs of {group} input channels; quantlab imports {SUPPORTED}")


def ct_layer_codes(where: str, linear: torch.nn.Linear, scheme, fmt: str, kind: str, get, keys) -> LayerCodes:
    """The layer's LayerCodes from its tensors: get(local name) returns one (or raises naming it), keys lists them."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w, out_f, in_f = scheme.weights, linear.out_features, linear.in_features
    _check_g_idx(where, get, keys, w, in_f)
    act = _act_quant(where, scheme, kind, get)
    scale = _per_row(get("weight_scale"), out_f, w.strategy)
    group = w.group_size if w.strategy == "group" else None
    if kind == "mxfp4":
        packed = get("weight_packed")
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out_f, -1)
        if scale.dtype != torch.uint8 or tuple(codes.shape) != (out_f, in_f):
            raise ValueError(f"{where}: mxfp4 expects weight_packed {(out_f, in_f // 2)} uint8 and E8M0 weight_scale "
                             f"bytes, got {tuple(packed.shape)} {packed.dtype} and {scale.dtype}")
        return LayerCodes(WeightSpec(format="mxfp4"), codes, {"scale_e8m0": scale}, None, act)
    if kind == "fp8":
        weight = get("weight")
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (out_f, in_f):
            raise ValueError(f"{where}: fp8 weight must be {(out_f, in_f)} float8_e4m3fn, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        spec = WeightSpec(format="fp8_e4m3", group_size=group)
        return LayerCodes(spec, weight.view(torch.uint8), {"scale": scale.float()}, None, act)
    bits, offset = w.num_bits, 2 ** (w.num_bits - 1)
    if fmt == "pack-quantized":
        shape = get("weight_shape").tolist()
        if shape != [out_f, in_f]:
            raise ValueError(f"{where}: weight_shape {shape}, but the architecture's layer is {[out_f, in_f]}")
        q = unpack_from_int32(get("weight_packed"), bits, torch.Size(shape))
    else:
        q = get("weight")
        if q.dtype != torch.int8:
            raise ValueError(f"{where}: {fmt} int weight must be int8 codes, got {q.dtype}")
    zero = None
    if not w.symmetric:
        z = get("weight_zero_point")
        if fmt == "pack-quantized" and w.strategy in ("channel", "group"):  # packed along the output dim
            z = unpack_from_int32(z, bits, torch.Size((out_f, scale.shape[-1])), packed_dim=0)
        zero = _per_row(z, out_f, w.strategy).to(torch.int16) + offset
    return int_layer_codes(where, bits, group, w.symmetric, q.to(torch.int16) + offset, scale, zero, act)
