"""Export a quantized model as a compressed-tensors checkpoint: the folder llm-compressor writes, which vLLM serves
and transformers loads (its CompressedTensorsHfQuantizer).

    facts = export_compressed_tensors(model, "out/smollm2-w4g32", tokenizer)   # the caller's model is untouched

On a copy of the model every QuantLinear becomes an nn.Linear holding its dequantized weight, with a
compressed-tensors QuantizationScheme attached (initialize_module_for_quantization) and weight_scale /
weight_zero_point set to quantlab's own. The library then does what llm-compressor does when it saves:
ModelCompressor.from_pretrained_model -> compress_model (it re-quantizes each weight with those scales, which gives
back quantlab's codes: checked code by code before anything is written) -> save_pretrained -> update_config.

quantlab grid                                 compressed-tensors format (the one it infers itself)
int w2..w8 per channel / group, sym or asym   pack-quantized; codes and zeros shifted to its signed range:
                                              q = u - 2^(b-1), z = zero_u - 2^(b-1), so q - z = u - zero_u
int + dynamic per-token int8 sym activations  int-quantized (W8A8; int8 storage for narrower codes)
fp8_e4m3 per channel / group                  naive-quantized (as llm-compressor writes FP8 weight-only)
fp8_e4m3 + dynamic per-token fp8_e4m3         float-quantized
mxfp4 (E2M1, an E8M0 scale per 32)            mxfp4-pack-quantized

Activations: compressed-tensors scales an int8 token by amax / 127.5 on [-128, 127] (calculate_qparams), quantlab by
amax / 127 on [-127, 127]; the file runs activations on the engine's grid (facts["ct_notes"] says so). FP8 tokens
(amax / 448) are the same grid in both. Every other grid raises a ValueError naming the layer (ct_form_of).
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..core import packing
from ..core.activations import StaticActQuant
from ..core.qlinear import QuantLinear
from .ct_forms import INT8_ACT_NOTE, CTForm, check_exportable, model_dtype


def _codes(layer: QuantLinear) -> torch.Tensor:
    """A frozen layer's unsigned codes (out, in) uint8."""
    n = layer.out_features * layer.in_features
    return packing.unpack(layer.qweight, layer.spec.bits, n).view(layer.out_features, layer.in_features)


def layer_tensors(name: str, layer: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A frozen layer's {weight_scale, weight_zero_point (asym int), input_scale / input_zero_point (static
    activations), codes (what the compressor must store: signed int8 codes; fp8 / fp4 code bytes), e8m0 (mxfp4's
    scale bytes)}."""
    out = _weight_tensors(name, layer, dtype)
    aq = layer.act_quant
    if isinstance(aq, StaticActQuant):  # per tensor: ct_form_of refused per channel
        # quantlab's int grid divides by the scale in the input's dtype, its fp8 grid by the fp32 scale
        out["input_scale"] = aq.scale.to(dtype) if aq.format == "int" else _exact(name, "input", aq.scale, dtype)
        if aq.zero is not None:  # unsigned 0..255 -> signed, as the weights' zero points
            out["input_zero_point"] = (aq.zero - 128).to(torch.int8)
    return out


def _exact(name: str, what: str, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale in dtype (where compressed-tensors keeps scales), or a ValueError where dtype cannot hold it."""
    out = scale.to(dtype)
    if not torch.equal(out.float(), scale.float()):
        raise ValueError(f"{name}: fp8 {what} scales ({scale.dtype}) are not exact in the model's dtype {dtype}, "
                         f"where compressed-tensors keeps them; export from a float32 copy of the model")
    return out


def _weight_tensors(name: str, layer: QuantLinear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    spec = layer.spec
    if spec.fmt is None:
        offset = 2 ** (spec.bits - 1)
        out = {"weight_scale": layer.scale.to(dtype), "codes": (_codes(layer).to(torch.int16) - offset).to(torch.int8)}
        if not spec.symmetric:
            out["weight_zero_point"] = (layer.zero_u.to(torch.int16) - offset).to(torch.int8)
        return out
    if spec.format == "fp8_e4m3":  # quantlab multiplies by the fp32 scale
        return {"weight_scale": _exact(name, "weight", layer.scale, dtype), "codes": _codes(layer)}
    e = layer.scale_e8m0.to(torch.int32) - 127
    scale = torch.ldexp(torch.ones(e.shape), e).to(dtype)  # the powers of two the compressor turns back into bytes
    return {"weight_scale": scale, "codes": _codes(layer), "e8m0": layer.scale_e8m0}


def ct_linear(layer: QuantLinear, scheme, tensors: dict, dtype: torch.dtype) -> nn.Linear:
    """An nn.Linear with the layer's dequantized weight (in dtype), the scheme initialized on it and quantlab's
    scale / zero point in its qparams."""
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization

    lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
    lin.weight = nn.Parameter(layer.quantized_weight(dtype).detach().clone(), requires_grad=False)
    if layer.bias is not None:
        lin.bias = nn.Parameter(layer.bias.detach().to(dtype).clone(), requires_grad=False)
    initialize_module_for_quantization(lin, scheme)
    lin.weight_scale.data.copy_(tensors["weight_scale"].reshape(lin.weight_scale.shape))
    for key in ("weight_zero_point", "input_scale", "input_zero_point"):
        if key in tensors:
            getattr(lin, key).data.copy_(tensors[key].reshape(getattr(lin, key).shape))
    return lin


def stored_codes(lin: nn.Linear, form: CTForm) -> dict[str, torch.Tensor]:
    """What compress_model stored in a module, read back as codes: {"codes", "zero" (asym int), "e8m0" (mxfp4)}."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w = form.weights
    if form.format == "pack-quantized":
        out = {"codes": unpack_from_int32(lin.weight_packed, w["num_bits"], lin.weight_shape)}
        if not w["symmetric"]:
            shape = (lin.weight_shape[0], lin.weight_scale.shape[-1])
            out["zero"] = unpack_from_int32(lin.weight_zero_point, w["num_bits"], shape, packed_dim=0)
        return out
    if form.format == "int-quantized":
        return {"codes": lin.weight.data, **({} if w["symmetric"] else {"zero": lin.weight_zero_point.data})}
    if form.format in ("naive-quantized", "float-quantized"):
        return {"codes": lin.weight.data.view(torch.uint8)}
    packed = lin.weight_packed.data  # mxfp4: two E2M1 codes a byte, the first in the low nibble
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return {"codes": codes, "e8m0": lin.weight_scale.data}


def _positive_zero(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes with -0 (0b1000) written as +0: compressed-tensors' FP4 cast drops the sign of a zero."""
    return torch.where(codes == 0b1000, torch.zeros_like(codes), codes)


def check_stored(name: str, lin: nn.Linear, form: CTForm, tensors: dict, dtype: torch.dtype) -> None:
    """Raise unless the compressor stored quantlab's codes (and zero points / MX scale bytes) exactly. It re-quantizes
    the dequantized weight held in the model's dtype: bfloat16 cannot hold every (u - zero) * scale of an 8-bit grid."""
    got = stored_codes(lin, form)
    want = {"codes": tensors["codes"]}
    if form.format == "mxfp4-pack-quantized":  # the same value, 0.0, either way
        got["codes"], want["codes"] = _positive_zero(got["codes"]), _positive_zero(want["codes"])
    if "zero" in got:
        want["zero"] = tensors["weight_zero_point"]
    if "e8m0" in got:
        want["e8m0"] = tensors["e8m0"]
    for key, value in want.items():
        if not torch.equal(got[key].reshape(value.shape).to(value.dtype), value):
            bad = int((got[key].reshape(value.shape).to(value.dtype) != value).sum())
            hint = "" if dtype == torch.float32 else f" (the weights in {dtype} are not exact: export a float32 copy)"
            raise ValueError(f"{name}: compressed-tensors stored {bad} {key} value(s) other than quantlab's "
                             f"({form.format}){hint}; nothing was written")


# ---- the model ----------------------------------------------------------------------------------------------


def _schemes(forms: dict[str, CTForm]) -> tuple[dict, list[CTForm]]:
    """{layer name: its QuantizationScheme} (one object per distinct form) and the distinct forms in order. One form
    targets "Linear" (llm-compressor's usual config); several target their layers by name."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    distinct: dict[tuple, list[str]] = {}
    by_key = {}
    for name, form in forms.items():
        distinct.setdefault(form.key(), []).append(name)
        by_key[form.key()] = form
    out = {}
    for key, names in distinct.items():
        form = by_key[key]
        scheme = QuantizationScheme(
            targets=["Linear"] if len(distinct) == 1 else names, format=form.format,
            weights=QuantizationArgs(**form.weights),
            input_activations=QuantizationArgs(**form.inputs) if form.inputs else None)
        out.update({n: scheme for n in names})
    return out, [by_key[k] for k in distinct]


@contextlib.contextmanager
def _quiet(progress: bool):
    """Without progress: transformers' bars off, and compressed-tensors' compress bar (a tqdm on stderr it offers no
    switch for) swallowed."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move tmp to out; an existing out is moved aside first and removed only once the new one is in place."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def export_compressed_tensors(model: nn.Module, out_dir: str | Path, tokenizer=None, progress: bool = False) -> dict:
    """Write a quantized model as a compressed-tensors checkpoint at out_dir (atomically: a folder beside it,
    renamed); the caller's model is left as it was. Every check runs before anything is written.

    >>> facts = export_compressed_tensors(model, "out/w4g32", tok)
    >>> facts["ct_format"], facts["ct_schemes"]
    ({'w4 g32 asym': 'pack-quantized'}, {'w4 g32 asym': 14})

    Returns ct_dir, ct_format (format per scheme), ct_schemes (layers per scheme), ct_mib (the safetensors),
    ct_ignored (the config's ignore list: linears left float) and ct_notes (where the file's numerics are the
    engine's, not quantlab's: int8 activation scales)."""
    from compressed_tensors.compressors import ModelCompressor

    forms = check_exportable(model)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    dtype = model_dtype(model)
    ct_model = copy.deepcopy(model)
    schemes, distinct = _schemes(forms)
    linears = {}
    for name, form in forms.items():
        layer = ct_model.get_submodule(name)
        layer.freeze()  # a prepared layer's codes; its forward is the frozen one bit for bit
        tensors = layer_tensors(name, layer, dtype)
        lin = ct_linear(layer, schemes[name], tensors, dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(ct_model.get_submodule(parent), leaf, lin)
        linears[name] = (lin, tensors)
    formats = sorted({f.format for f in distinct})
    with _quiet(progress):
        compressor = ModelCompressor.from_pretrained_model(
            ct_model, quantization_format=formats[0] if len(formats) == 1 else None)  # several: each scheme's own
        compressor.compress_model(ct_model)
    for name, (lin, tensors) in linears.items():
        check_stored(name, lin, forms[name], tensors, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with _quiet(progress):
            ct_model.save_pretrained(tmp)
        compressor.update_config(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts: dict[str, int] = {}
    for form in forms.values():
        counts[form.label] = counts.get(form.label, 0) + 1
    int8_tokens = any(f.inputs and f.inputs["type"] == "int" and f.inputs["strategy"] == "token" for f in distinct)
    return {
        "ct_dir": str(out),
        "ct_format": {f.label: f.format for f in distinct},
        "ct_schemes": counts,
        "ct_mib": sum(p.stat().st_size for p in out.glob("*.safetensors")) / 2**20,
        "ct_ignored": list(compressor.quantization_config.ignore or []),
        "ct_notes": [INT8_ACT_NOTE] if int8_tokens else [],
    }
