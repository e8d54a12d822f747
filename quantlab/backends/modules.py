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

from ..core import packing
from ..core.primitives import code_range, qparams, quantize
from ..core.qlinear import QuantLinear


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


def signed_int8_codes(layer: QuantLinear) -> torch.Tensor:
    """(out, in) int8 codes q of an int8 symmetric layer (u - 128)."""
    return (unsigned_codes(layer).to(torch.int16) + code_range(8, True)[0]).to(torch.int8).contiguous()


def int8_tensor(layer: QuantLinear, dtype: torch.dtype):
    """torchao Int8Tensor (per-row symmetric, weight-only kernel) from int8 per-channel symmetric codes."""
    from torchao.quantization.quantize_.workflows import Int8Tensor

    return Int8Tensor(signed_int8_codes(layer), layer.scale.float().reshape(-1, 1).contiguous(),
                      [1, layer.in_features], dtype, act_pre_scale=_act_pre_scale(layer, dtype))


def float8_tensor(layer: QuantLinear, dtype: torch.dtype):
    """torchao Float8Tensor (per-row scale, weight-only) from quantlab's FP8 codes and fp32 scales, as stored."""
    from torchao.quantization import Float8Tensor

    torch_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[layer.spec.format]
    codes = packing.unpack(layer.qweight, 8, layer.out_features * layer.in_features)
    qdata = codes.view(torch_dtype).reshape(layer.out_features, layer.in_features).contiguous()
    return Float8Tensor(qdata, layer.scale.float().reshape(-1, 1).contiguous(), [1, layer.in_features], dtype=dtype)


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


class Int8DynamicLinear(nn.Module):
    """W8A8 dynamic on torchao's int8 GEMM (torchao.kernel.int_scaled_matmul: torch._int_mm, AMX/VNNI on CPU).

    Activations are quantized per token with quantlab's own qparams (scale = amax / 127, or the
    asymmetric min/max grid), so the integer codes equal the simulated model's and only the float
    rounding of the accumulation differs. torchao's Int8Tensor dynamic path would pick
    amax / 127.5, i.e. another activation grid than the one quantlab evaluated.
    Asymmetric activations: u - 128 fits int8, and y -= (zero - 128) * rowsum(W_q) corrects it.
    """

    kernel = "int8_dynamic"

    def __init__(self, layer: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.act_bits, self.act_symmetric = layer.act_quant.bits, layer.act_quant.symmetric
        self.register_buffer("qweight", signed_int8_codes(layer))  # (out, in) int8
        self.register_buffer("weight_scale", layer.scale.float().reshape(-1))  # (out,)
        self.register_buffer("weight_row_sum", self.qweight.sum(dim=1, dtype=torch.int32))  # (out,)
        self.register_buffer("input_scale", None if layer.input_scale is None else layer.input_scale.to(dtype).clone())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.kernel import int_scaled_matmul

        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        p = qparams(x2.float(), self.act_bits, None, self.act_symmetric)  # scale (M, 1) fp32, as DynamicActQuant
        codes = quantize(x2, p, self.act_bits, None)  # integer-valued floats, like the simulated path
        if not self.act_symmetric:
            codes = codes - 128
        x_scale = p.scale.float()
        y = int_scaled_matmul(codes.to(torch.int8).contiguous(), self.qweight.t(), x_scale)  # (M, N) fp32
        if not self.act_symmetric:
            y = y - ((p.zero.float() - 128) * x_scale) * self.weight_row_sum.float()
        y = (y * self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def storage_bytes(self) -> int:
        return self.qweight.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, torchao int8_dynamic (a{self.act_bits} per-token)"


def build_module(kernel: str, layer: QuantLinear, dtype: torch.dtype) -> nn.Module:
    """The exported module for one frozen layer and its chosen kernel."""
    if kernel == "int8_dynamic":
        return Int8DynamicLinear(layer, dtype)
    weight = {"int8_weight_only": lambda: int8_tensor(layer, dtype), "int4_cpu": lambda: int4_cpu_tensor(layer),
              "int4_cuda": lambda: int4_cuda_tensor(layer),
              "float8_weight_only": lambda: float8_tensor(layer, dtype)}[kernel]()
    return TorchaoLinear(weight, layer.bias, kernel)
