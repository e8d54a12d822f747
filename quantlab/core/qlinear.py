"""QuantLinear: the module every weight quantizer swaps in for nn.Linear.

Two states, one numerics path (primitives.dequantize):
- prepared: holds the float weight; forward uses fake_quantize(weight) with
  either fixed qparams (set by a method: GPTQ, QAT, ...) or min-max ones.
- frozen:   holds packed integer codes + scale (+ zero); forward dequantizes.
The two forwards agree exactly (tests/test_qlinear.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import packing
from .checks import check_dtype, check_int, resolve_dtype
from .primitives import QParams, code_range, dequantize, fake_quantize, n_groups, qparams, quantize


@dataclass(frozen=True)
class WeightSpec:
    """How a weight is quantized: bits, group size (None = per output channel), sym/asym."""

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str = "float16"

    def __post_init__(self):
        check_int("bits", self.bits, 2, 8)
        check_int("group_size", self.group_size, 1, allow_none=True)  # omitted: per output channel
        check_dtype("scale_dtype", self.scale_dtype)

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return resolve_dtype(self.scale_dtype)

    def qparams(self, w: torch.Tensor) -> QParams:
        return qparams(w, self.bits, self.group_size, self.symmetric, self.torch_scale_dtype)


class QuantLinear(nn.Module):
    """nn.Linear with a quantized weight. Build with QuantLinear.from_linear(linear, spec)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: WeightSpec):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.weight: nn.Parameter | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.fixed_qparams: QParams | None = None  # set by methods that choose their own scales
        self.frozen = False
        # Optional input transforms, applied in this order before the matmul:
        #   input_scale (in,): x / input_scale, a smoothing scale kept explicit where it cannot be
        #       folded into a producer (the weight columns were multiplied by it);
        #   act_quant: an activation (fake-)quantizer module, e.g. dynamic per-token int8.
        self.register_buffer("input_scale", None)
        self.quant_enabled = True  # False: prepared layer computes with its float weight (calibration passes)
        self.act_quant: nn.Module | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: WeightSpec) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, spec)
        q.weight = linear.weight  # shared, not copied; convert() releases it
        q.bias = linear.bias
        return q

    def current_qparams(self) -> QParams:
        return self.fixed_qparams if self.fixed_qparams is not None else self.spec.qparams(self.weight)

    def quantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the forward multiplies by: fake-quantized (prepared) or dequantized codes (frozen)."""
        if self.frozen:
            # unsigned codes u = q - qmin; (u - zero_u) * scale equals the fake-quant (q - zero) * scale exactly,
            # since u - zero_u == q - zero as integers (zero_u = zero - qmin, or -qmin when symmetric).
            codes = packing.unpack(self.qweight, self.spec.bits, self.out_features * self.in_features)
            codes = codes.view(self.out_features, self.in_features)
            zero_u = self.zero_u if not self.spec.symmetric else torch.tensor(-code_range(self.spec.bits, True)[0])
            return dequantize(codes, QParams(self.scale, zero_u), self.spec.group_size, dtype or torch.float32)
        if not self.quant_enabled:
            return self.weight
        p = self.current_qparams()
        return fake_quantize(self.weight, p, self.spec.bits, self.spec.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_quant is not None:
            x = self.act_quant(x)
        return F.linear(x, self.quantized_weight(x.dtype), self.bias)

    @torch.no_grad()
    def freeze(self) -> None:
        """Replace the float weight by packed integer codes + scale (+ zero)."""
        if self.frozen:
            return
        p = self.current_qparams()
        codes = quantize(self.weight, p, self.spec.bits, self.spec.group_size).to(torch.int32)
        unsigned = codes - code_range(self.spec.bits, self.spec.symmetric)[0]
        self.register_buffer("qweight", packing.pack(unsigned, self.spec.bits))
        self.register_buffer("scale", p.scale.clone())
        if p.zero is not None:  # asymmetric codes are already unsigned (qmin = 0)
            self.register_buffer("zero_u", p.zero.to(torch.uint8))
        self.weight = None
        self.fixed_qparams = None
        self.frozen = True

    def storage_bytes(self) -> int:
        """Bytes of the quantized weight: codes + scales + zeros (bias excluded)."""
        if self.frozen:
            zero = 0 if self.spec.symmetric else self.zero_u.nbytes
            return self.qweight.nbytes + self.scale.nbytes + zero
        n = self.out_features * self.in_features
        groups = self.out_features * n_groups(self.in_features, self.spec.group_size)
        scale_bytes = groups * self.spec.torch_scale_dtype.itemsize
        return packing.packed_nbytes(n, self.spec.bits) + scale_bytes + (0 if self.spec.symmetric else groups)

    def extra_repr(self) -> str:
        s = self.spec
        g = "channel" if s.group_size is None else f"g{s.group_size}"
        return (f"in={self.in_features}, out={self.out_features}, w{s.bits} {g} "
                f"{'sym' if s.symmetric else 'asym'}, {'frozen' if self.frozen else 'fake-quant'}")
