"""torchao tensors built from a frozen QuantLinear's own codes, scales and zero points.

Nothing is re-quantized: GPTQ/AWQ/QAT codes reach the kernel unchanged. The only rounding
is of the scales into the dtype a kernel wants (fp16 -> fp32 is exact; fp16 -> bf16 for int4
is not, which the export parity check measures).

Code conventions (see qlinear.py): packed unsigned codes u = q - qmin; symmetric layers have
no zero_u (their zero is -qmin), asymmetric ones store zero_u (out, n_groups) uint8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import packing
from ..primitives import code_range
from ..qlinear import QuantLinear


def unsigned_codes(layer: QuantLinear) -> torch.Tensor:
    """(out, in) uint8 codes u in [0, 2^bits)."""
    n = layer.out_features * layer.in_features
    return packing.unpack(layer.qweight, layer.spec.bits, n).view(layer.out_features, layer.in_features)


def zero_codes(layer: QuantLinear) -> torch.Tensor:
    """(out, n_groups) int32 zero point in unsigned-code units: zero_u, or -qmin when symmetric."""
    if layer.spec.symmetric:
        return torch.full(layer.scale.shape, -code_range(layer.spec.bits, True)[0], dtype=torch.int32,
                          device=layer.scale.device)
    return layer.zero_u.to(torch.int32)


def _act_pre_scale(layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor | None:
    # QuantLinear divides by input_scale; torchao multiplies by act_pre_scale.
    return None if layer.input_scale is None else (1.0 / layer.input_scale.float()).to(dtype)


def int8_tensor(layer: QuantLinear, dtype: torch.dtype, dynamic: bool):
    """Int8Tensor (per-row symmetric) from int8 per-channel symmetric codes; dynamic adds per-token int8 activations."""
    from torchao.quantization import MappingType, PerRow
    from torchao.quantization.quantize_.workflows import Int8Tensor, QuantizeTensorToInt8Kwargs

    q = (unsigned_codes(layer).to(torch.int16) + code_range(8, True)[0]).to(torch.int8)  # (out, in) signed
    act_kwargs = None
    if dynamic:
        mapping = MappingType.SYMMETRIC if layer.act_quant.symmetric else MappingType.ASYMMETRIC
        act_kwargs = QuantizeTensorToInt8Kwargs(granularity=PerRow(), mapping_type=mapping)
    return Int8Tensor(q.contiguous(), layer.scale.float().reshape(-1, 1).contiguous(), [1, layer.in_features], dtype,
                      act_quant_kwargs=act_kwargs, act_pre_scale=_act_pre_scale(layer, dtype))


def _tinygemm_scale_zero(layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (out, n_groups) scale and tinygemm float zero: w = (u - 8) * s + zf, so zf = (8 - zero_u) * s."""
    scale = layer.scale.to(torch.bfloat16)
    zero = ((8 - zero_codes(layer)).float() * scale.float()).to(torch.bfloat16)
    return scale, zero


def int4_cpu_tensor(layer: QuantLinear):
    """Int4OpaqueTensor (tinygemm CPU kernel, bf16 activations) from 4-bit group codes."""
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    codes = unsigned_codes(layer).to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale, zero = _tinygemm_scale_zero(layer)
    scale_and_zero = pack_tinygemm_scales_and_zeros(scale, zero, torch.bfloat16)
    return Int4OpaqueTensor(packed, scale_and_zero, [1, layer.spec.group_size], torch.Size(codes.shape),
                            act_pre_scale=_act_pre_scale(layer, torch.bfloat16))


def int4_cuda_tensor(layer: QuantLinear):
    """Int4TilePackedTo4dTensor (tinygemm CUDA kernel, bf16) from 4-bit group codes.

    The kernel wants in_features padded to 1024 and out_features to 8: padded codes are 8 with
    scale 1 and zero 0, i.e. weight exactly 0 (the kernel also zero-pads the activations).
    """
    from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros
    from torchao.utils import find_multiple

    g, (n, k) = layer.spec.group_size, (layer.out_features, layer.in_features)
    n_pad, k_pad = find_multiple(n, 8), find_multiple(k, 1024)
    codes = F.pad(unsigned_codes(layer).to(torch.int32), (0, k_pad - k, 0, n_pad - n), value=8)
    scale, zero = _tinygemm_scale_zero(layer)
    groups_pad = k_pad // g - scale.shape[1]
    scale = F.pad(scale, (0, groups_pad, 0, n_pad - n), value=1.0)
    zero = F.pad(zero, (0, groups_pad, 0, n_pad - n), value=0.0)
    packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous(), 8)
    scale_and_zero = pack_tinygemm_scales_and_zeros(scale, zero, torch.bfloat16)
    return Int4TilePackedTo4dTensor(packed, scale_and_zero, [1, g], torch.Size((n, k)),
                                    act_pre_scale=_act_pre_scale(layer, torch.bfloat16))


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a torchao tensor subclass holds (itself when it is plain)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for name in names for x in inner_tensors(getattr(t, name))]


class TorchaoLinear(nn.Module):
    """A linear whose weight is a torchao tensor subclass; F.linear dispatches to its kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def storage_bytes(self) -> int:
        """Bytes the kernel's weight really occupies (packed codes + scales + zeros; bias excluded)."""
        return sum(t.numel() * t.element_size() for t in inner_tensors(self.weight.data))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, torchao {self.kernel}"


BUILDERS = {
    "int8_weight_only": lambda layer, dtype: int8_tensor(layer, dtype, dynamic=False),
    "int8_dynamic": lambda layer, dtype: int8_tensor(layer, dtype, dynamic=True),
    "int4_cpu": lambda layer, dtype: int4_cpu_tensor(layer),
    "int4_cuda": lambda layer, dtype: int4_cuda_tensor(layer),
}
