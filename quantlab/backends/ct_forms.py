"""Which compressed-tensors form a quantlab layer takes (backends/ct_export.py writes it): the form, or a ValueError
naming the layer, its grid and the forms that exist, found before anything is written.

    forms = check_exportable(model)        # {layer name: CTForm} for every QuantLinear
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.qlinear import QuantLinear

FORMS = ("int w2..w8 per channel or per group (a group dividing in_features), sym or asym, optionally + int8 "
         "activations (dynamic per-token sym, static per-tensor); fp8_e4m3 per channel or per group, optionally + "
         "fp8_e4m3 activations (dynamic per-token, static per-tensor); mxfp4")
INT8_ACT_NOTE = ("dynamic int8 activations: compressed-tensors scales each token by amax / 127.5 on [-128, 127], "
                 "quantlab's simulation by amax / 127 on [-127, 127]; the file runs them on the engine's grid")
NVFP4_WHY = ("nvfp4: compressed-tensors stores the tensor scale inverted (weight_global_scale = 1 / quantlab's "
             "tensor_scale) and divides the E4M3 block scale by it; in fp32 b / (1 / t) equals quantlab's b * t for "
             "every block scale only for about 1 tensor scale in 5, and its decompression returns bfloat16 weights")


@dataclass(frozen=True)
class CTForm:
    """How one layer is written: the scheme's weight / input arguments (as QuantizationArgs keywords) and the
    format; label names the scheme in the facts ("w4 g32 asym", "w8 channel sym + a8 token", ...)."""

    weights: dict
    inputs: dict | None
    format: str

    def key(self) -> tuple:
        return (tuple(sorted(self.weights.items())), tuple(sorted((self.inputs or {}).items())), self.format)

    @property
    def label(self) -> str:
        w, a = self.weights, self.inputs
        grid = "channel" if w["strategy"] == "channel" else f"g{w['group_size']}"
        if w["type"] == "int":
            text = f"w{w['num_bits']} {grid} {'sym' if w['symmetric'] else 'asym'}"
        else:
            text = f"{'fp8_e4m3' if w['num_bits'] == 8 else 'mxfp4'} {grid}"
        if a is not None:
            act = f"a{a['num_bits']}{'' if a['symmetric'] else ' asym'}" if a["type"] == "int" else "a-fp8"
            text += f" + {act} {'token' if a['strategy'] == 'token' else 'static tensor'}"
        return text


def _refuse(name: str, layer: QuantLinear, why: str) -> ValueError:
    return ValueError(f"{name}: grid {layer.spec.describe()}{_act_text(layer)} has no compressed-tensors form "
                      f"({why}); compressed-tensors stores {FORMS}")


def _act_text(layer: QuantLinear) -> str:
    return "" if layer.act_quant is None else f" + {layer.act_quant.extra_repr()}"


def _act_form(name: str, layer: QuantLinear, weight_type: str) -> dict | None:
    """The input_activations keywords of a layer's activation quantizer (None: activations stay float): dynamic per
    token, or static per tensor (its scale / zero written as input_scale / input_zero_point)."""
    aq = layer.act_quant
    if aq is None:
        return None
    if isinstance(aq, StaticActQuant) and aq.per_channel:
        raise _refuse(name, layer, "static per-channel activation scales: compressed-tensors' are per tensor, token "
                      "or group, not per input channel")
    if isinstance(aq, DynamicActQuant):
        how = {"strategy": "token", "dynamic": True}
    elif isinstance(aq, StaticActQuant):
        how = {"strategy": "tensor"}
    else:
        raise _refuse(name, layer, f"activation quantizer {type(aq).__name__}")
    if weight_type == "int" and aq.format == "int" and aq.bits == 8 and (aq.symmetric or how["strategy"] == "tensor"):
        return {"num_bits": 8, "type": "int", "symmetric": aq.symmetric, **how}
    if weight_type == "float" and aq.format == "fp8_e4m3":
        return {"num_bits": 8, "type": "float", "symmetric": True, **how}
    raise _refuse(name, layer, f"activations {aq.extra_repr()} with {weight_type} weights: compressed-tensors takes "
                  f"int8 activations (dynamic per-token sym, static per-tensor) with int weights, fp8_e4m3 ones with "
                  f"fp8 weights")


def _grouping(name: str, layer: QuantLinear) -> dict:
    g = layer.spec.group_size
    if g is None or g == layer.in_features:
        return {"strategy": "channel"}
    if layer.in_features % g:
        raise _refuse(name, layer, f"group size {g} does not divide in_features {layer.in_features}; "
                      f"compressed-tensors' groups are whole")
    return {"strategy": "group", "group_size": g}


def ct_form_of(name: str, layer: QuantLinear) -> CTForm:
    """The compressed-tensors form of one QuantLinear, or a ValueError naming the layer, its grid and the forms there
    are. Reads only the layer's spec and modules (no tensors)."""
    spec = layer.spec
    if layer.input_scale is not None:
        raise _refuse(name, layer, "an input scale (AWQ / SmoothQuant kept unfolded) that the checkpoint cannot carry")
    if spec.ggml is not None:
        raise _refuse(name, layer, f"llama.cpp type {spec.format}: its blocks have no compressed-tensors counterpart")
    if spec.fmt is None:
        if layer.float_zero:
            raise _refuse(name, layer, "real-valued (HQQ) zero points: compressed-tensors' zero points are integers")
        act = _act_form(name, layer, "int")
        weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric, **_grouping(name, layer)}
        return CTForm(weights, act, "pack-quantized" if act is None else "int-quantized")
    if spec.format == "fp8_e4m3":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, **_grouping(name, layer)}
        act = _act_form(name, layer, "float")
        return CTForm(weights, act, "naive-quantized" if act is None else "float-quantized")
    if spec.format == "mxfp4":
        if layer.act_quant is not None:
            raise _refuse(name, layer, "MX activations: compressed-tensors rounds their block exponent its own way")
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                   "scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
        return CTForm(weights, None, "mxfp4-pack-quantized")
    why = NVFP4_WHY if spec.format == "nvfp4" else (
        f"format {spec.format}: compressed-tensors has int grids, fp8 e4m3, mxfp4 / mxfp6 e2m3 / mxfp8 and nvfp4; "
        f"quantlab writes int, fp8_e4m3 and mxfp4")
    raise _refuse(name, layer, why)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_exportable(model: nn.Module) -> dict[str, CTForm]:
    """{layer name: CTForm} of every QuantLinear, or the first ValueError; nothing else in the model may quantize or
    hook (a quantized embedding, an online rotation, ...), since the checkpoint would run without it."""
    from ..core.qembedding import QuantEmbedding, QuantTiedHead

    forms = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantEmbedding, QuantTiedHead)):  # a refusal like every other: ValueError
            raise ValueError(f"{name}: a quantized embedding ({type(module).__name__}) has no "  # noqa: TRY004
                             f"compressed-tensors form here; export without embedding = {{...}}")
        if hasattr(module, "lora_A"):  # peft's LoRA layer over a QuantLinear
            raise ValueError(f"{name}: unmerged LoRA adapters have no compressed-tensors form (lora with "
                             f"merge = true has)")
        if module._forward_pre_hooks or module._forward_hooks:
            raise ValueError(f"{name}: a forward hook (an online rotation?) that a compressed-tensors checkpoint "
                             f"cannot carry; export a model without it")
        if isinstance(module, QuantLinear):
            forms[name] = ct_form_of(name, module)
    if not forms:
        raise ValueError("the model has no QuantLinear layers: nothing to write as compressed-tensors")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, QuantLinear) and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("lm_head: a quantized head tied to the float embedding has no compressed-tensors form "
                         "(untie it, or leave lm_head float)")
    return forms


# ---- one layer's tensors, as compressed-tensors holds them ---------------------------------------------------
