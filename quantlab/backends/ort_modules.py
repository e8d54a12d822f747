"""The ONNX Runtime forms of frozen QuantLinear layers (what backends/ort.py swaps in before export).

ort_kind decides per layer: "matmul_nbits" (weight-only int4 / int8 -> com.microsoft::MatMulNBits), "a8w8"
(w8 per-channel sym + dynamic per-token int8 activations -> MatMulInteger), or None with the reason (an fp32
MatMul on the dequantized weight, its activation fake-quant kept).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..core.activations import DynamicActQuant
from ..core.lifecycle import quant_linears, set_submodule
from ..core.primitives import code_range
from ..core.qlinear import QuantLinear
from . import ort_ops  # noqa: F401  (registers torch.ops.quantlab.* that the modules call)
from .ort_pack import MATMUL_NBITS_BITS, block_size_for, pack_matmul_nbits

ACCURACY_LEVELS = (0, 4)  # MatMulNBits: 0 = fp32 compute on dequantized blocks; 4 = int8 activations (faster)


def ort_kind(layer: QuantLinear) -> tuple[str | None, str]:
    """("matmul_nbits" | "a8w8" | None, why not) for one frozen QuantLinear."""
    if not layer.frozen:
        return None, "layer is not frozen (call convert/quantize first)"
    spec, act = layer.spec, layer.act_quant
    if spec.fmt is not None:
        return None, f"{spec.format}: no ONNX Runtime kernel for this number format"
    if layer.float_zero:
        return None, "real-valued zero points (hqq): exported as float"
    if act is not None:
        if isinstance(act, DynamicActQuant) and act.fmt is None and act.bits == 8 and act.symmetric:
            if spec.bits == 8 and spec.symmetric and spec.group_size is None:
                return "a8w8", ""
            return None, f"a8 dynamic with {spec.describe()} weights: the int8 path takes w8 per-channel symmetric"
        return None, f"{type(act).__name__} activations: no ONNX Runtime kernel exported"
    if spec.bits not in MATMUL_NBITS_BITS:
        return None, f"w{spec.bits}: MatMulNBits takes {' or '.join(map(str, MATMUL_NBITS_BITS))} bits"
    if block_size_for(spec.group_size, layer.in_features) is None:
        return None, f"g{spec.group_size}: MatMulNBits blocks are powers of two >= 16"
    return "matmul_nbits", ""


class OrtLinearNBits(nn.Module):
    """A frozen QuantLinear as MatMulNBits storage (+ its input scale and bias, kept in float)."""

    def __init__(self, layer: QuantLinear, accuracy_level: int):
        super().__init__()
        spec = layer.spec
        codes = _codes(layer)
        zero_u = None if spec.symmetric else layer.zero_u
        packed, scales, zeros, block = pack_matmul_nbits(codes, layer.scale, zero_u, spec.bits, spec.group_size)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bits, self.block_size, self.accuracy_level = spec.bits, block, accuracy_level
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("input_scale", layer.input_scale)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        y = torch.ops.quantlab.matmul_nbits(x, self.packed, self.scales, self.zeros, self.in_features,
                                            self.out_features, self.bits, self.block_size, self.accuracy_level)
        return y if self.bias is None else y + self.bias


class OrtLinearA8W8(nn.Module):
    """A frozen W8A8 QuantLinear: int8 codes (K, N), per-channel scales, per-token int8 activations."""

    def __init__(self, layer: QuantLinear):
        super().__init__()
        qmin = code_range(8, True)[0]
        codes = (_codes(layer).to(torch.int16) + qmin).to(torch.int8)  # unsigned u = q - qmin -> q
        self.register_buffer("w_t", codes.t().contiguous())
        self.register_buffer("w_scale", layer.scale.reshape(-1).float())
        self.register_buffer("input_scale", layer.input_scale)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        y = torch.ops.quantlab.matmul_a8w8(x, self.w_t, self.w_scale)
        return y if self.bias is None else y + self.bias


class DequantLinear(nn.Module):
    """A layer without an ORT kernel: its dequantized float weight, input scale and activation fake-quant."""

    def __init__(self, layer: QuantLinear):
        super().__init__()
        self.weight = nn.Parameter(layer.quantized_weight(torch.float32).detach().clone(), requires_grad=False)
        self.bias = layer.bias
        self.register_buffer("input_scale", layer.input_scale)
        self.act_quant = layer.act_quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_quant is not None:
            x = self.act_quant(x)
        return nn.functional.linear(x, self.weight, self.bias)


def _codes(layer: QuantLinear) -> torch.Tensor:
    from ..core import packing

    n, k = layer.out_features, layer.in_features
    return packing.unpack(layer.qweight, layer.spec.bits, n * k).view(n, k)


def swap_for_ort(model: nn.Module, accuracy_level: int = 0) -> dict:
    """Replace every QuantLinear by its ORT form, in place; returns the plan's counts and reasons."""
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"ort accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    kinds, reasons = Counter(), Counter()
    for name, layer in quant_linears(model).items():
        kind, why = ort_kind(layer)
        if kind == "matmul_nbits":
            new = OrtLinearNBits(layer, accuracy_level)
        elif kind == "a8w8":
            new = OrtLinearA8W8(layer)
        else:
            new, kind = DequantLinear(layer), "float"
            reasons[why] += 1
        kinds[kind] += 1
        set_submodule(model, name, new)
    return {"kinds": kinds, "reasons": reasons}
