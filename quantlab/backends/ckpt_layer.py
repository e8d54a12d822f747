"""One imported quantized linear as quantlab holds it (ct_import.py and gptq_import.py fill it, ckpt_import.py builds
the model): unsigned codes on a WeightSpec's grid, its scale tensors, integer zero points, an activation quantizer.

    codes = int_layer_codes("ckpt: q_proj", bits=4, group_size=128, symmetric=False, codes=u, scale=s, zero_u=z)
    layer = frozen_layer(linear, codes)        # a frozen QuantLinear: qweight = packing.pack(u, 4), scale, zero_u
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core import packing
from ..core.qlinear import QuantLinear, WeightSpec
from ..util.checks import DTYPES

# the scale dtypes tried in turn: quantlab's default first, then the narrowest that holds every scale exactly
SCALE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class LayerCodes:
    """spec: the grid; codes (out, in) uint8 unsigned (integer grids: u = q - qmin; number formats: the element's
    code); scales: the frozen layer's scale buffers ({"scale"} or MX's {"scale_e8m0"}); zero_u (out, groups) uint8
    for asymmetric integer grids; act_quant: the activation quantizer the scheme names (None: float inputs)."""

    spec: WeightSpec
    codes: torch.Tensor
    scales: dict
    zero_u: torch.Tensor | None = None
    act_quant: nn.Module | None = None

    @property
    def label(self) -> str:
        """The scheme as the facts count it: "w4 g128 asym", "w8 channel sym + a8 per-token sym", ..."""
        act = "" if self.act_quant is None else f" + {self.act_quant.extra_repr()}"
        return self.spec.describe() + act


def exact_scale_dtype(where: str, scale: torch.Tensor) -> str:
    """The first of float16 (quantlab's default), bfloat16, float32 that holds every scale exactly: the dequantized
    weight is the same either way (dequantize casts the scale to the compute dtype), the storage is the smallest."""
    if not torch.isfinite(scale.float()).all():
        raise ValueError(f"{where}: its scales hold inf or NaN")
    for name in SCALE_DTYPES:
        if torch.equal(scale.to(DTYPES[name]).to(scale.dtype), scale):
            return name
    return "float32"  # float64 scales no float32 holds: the nearest (not reached by the formats read here)


def int_layer_codes(where: str, bits: int, group_size: int | None, symmetric: bool, codes: torch.Tensor,
                    scale: torch.Tensor, zero_u: torch.Tensor | None, act_quant: nn.Module | None = None) -> LayerCodes:
    """An integer grid from unsigned codes (out, in), scales (out, groups) and unsigned zero points (out, groups)
    (None when symmetric: the midpoint 2^(bits-1), as quantlab's symmetric codes u = q + 2^(bits-1) imply).
    Codes or zeros outside [0, 2^bits) are a ValueError naming the layer (a damaged or mislabelled file)."""
    out_f, in_f = codes.shape
    group = None if group_size is None or group_size >= in_f else group_size
    groups = 1 if group is None else -(-in_f // group)
    for what, value, shape in (("codes", codes, (out_f, in_f)), ("zero points", zero_u, (out_f, groups))):
        if value is None:
            continue
        if tuple(value.shape) != shape:
            raise ValueError(f"{where}: {what} shaped {tuple(value.shape)}, expected {shape}")
        if int(value.min()) < 0 or int(value.max()) >= 2**bits:
            raise ValueError(f"{where}: {what} outside the {bits}-bit range 0..{2**bits - 1} "
                             f"(found {int(value.min())}..{int(value.max())})")
    if tuple(scale.shape) != (out_f, groups):
        raise ValueError(f"{where}: scales shaped {tuple(scale.shape)}, expected {(out_f, groups)}")
    if symmetric != (zero_u is None):
        raise ValueError(f"{where}: a symmetric grid takes no zero points, an asymmetric one needs them")
    spec = WeightSpec(bits, group, symmetric, exact_scale_dtype(where, scale))
    zero = None if zero_u is None else zero_u.to(torch.uint8)
    return LayerCodes(spec, codes.to(torch.uint8), {"scale": scale.to(spec.torch_scale_dtype)}, zero, act_quant)


def frozen_layer(linear: nn.Linear, c: LayerCodes) -> QuantLinear:
    """A frozen QuantLinear of linear's shape holding c; its bias stays on the meta device until the checkpoint's
    own is assigned (a file without it is then caught as a missing tensor, not read as garbage)."""
    layer = QuantLinear(linear.in_features, linear.out_features, linear.bias is not None, c.spec)
    if linear.bias is not None:
        layer.bias = nn.Parameter(torch.empty(linear.out_features, device="meta"), requires_grad=False)
    layer.register_buffer("qweight", packing.pack(c.codes, c.spec.bits))
    for key, value in c.scales.items():
        layer.register_buffer(key, value.contiguous())
    if c.zero_u is not None:
        layer.register_buffer("zero_u", c.zero_u.contiguous())
    layer.act_quant = c.act_quant
    layer.weight, layer.frozen = None, True
    return layer.eval()
