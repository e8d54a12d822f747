"""Activation fake-quantizers, used as `QuantLinear.act_quant` (applied to the input before the matmul).

- DynamicActQuant: per-token qparams computed on the fly from each token's own min/max
  (one group over the last dim of x (..., C)); nothing to calibrate.
- StaticActQuant: fixed qparams from a calibration range, per tensor (scale 0-dim) or
  per channel (scale (C,), one scale per input channel of the consumer).

Both are thin shells around primitives.fake_quantize with ste=True (QAT can train
through them), compute in the input's dtype and never mutate their input.

>>> layer.act_quant = DynamicActQuant(bits=8, symmetric=True)                 # W8A8 dynamic
>>> layer.act_quant = StaticActQuant.from_range(lo, hi, bits=8, symmetric=False)
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..util.checks import check_int
from . import formats
from .lifecycle import quant_linears
from .primitives import QParams, code_range, fake_quantize, qparams, qparams_from_range

ACT_BITS = (4, 8)  # inclusive range of supported activation bit widths
STATIC_FORMATS = ("fp8_e4m3", "fp8_e5m2")  # static ranges give one scale per tensor / channel: FP8 (no blocks)


def check_act_bits(bits, symmetric, field: str = "act_bits") -> None:
    """Raise a ValueError naming the bad value unless bits is an int in 4..8 and symmetric a bool."""
    lo, hi = ACT_BITS
    check_int(field, bits, lo, hi)
    if not isinstance(symmetric, bool):
        name = field.replace("bits", "symmetric") if "bits" in field else "symmetric"
        raise ValueError(f"{name} must be true or false, got {symmetric!r}")


def check_act_format(fmt: str, bits, symmetric, field: str = "act_format", allowed: tuple | None = None) -> int:
    """Validate an activation format (with its bits / symmetric fields); returns the bits it implies.

    "int": bits 4..8, symmetric or not; a number format fixes bits (8, the default, may stay) and is symmetric.
    """
    if fmt == "int":
        check_act_bits(bits, symmetric, field.replace("format", "bits"))
        return bits
    if allowed is not None and fmt not in allowed:
        raise ValueError(f"unknown {field} {fmt!r} here; known: int, {', '.join(allowed)}")
    f = formats.get_format(fmt)
    if f.scale == "lut":
        weight_only = ", ".join(n for n, g in formats.FORMATS.items() if g.scale == "lut")
        raise ValueError(f"{field} {fmt!r} is a weight format (a table learned per weight row: method \"any4\"); "
                         f"activations take int or a number format other than {weight_only}")
    if bits not in (8, f.bits):
        raise ValueError(f"{field} {fmt!r} has {f.bits}-bit elements; {field.replace('format', 'bits')} = {bits} "
                         f"contradicts it (leave it out)")
    if symmetric is not True:
        raise ValueError(f"{field} {fmt!r} is symmetric; {field.replace('format', 'symmetric')} = {symmetric!r}")
    return f.bits


class DynamicActQuant(nn.Module):
    """Per-token min-max fake quantization: each token row of x (..., C) gets its own scale (and zero).

    With a number format: FP8 scales per token (amax / max element); MX / NVFP4 per block of the last dim,
    NVFP4's tensor scale from the current tensor's amax (dynamic; deployments often calibrate it: a variant).
    """

    def __init__(self, bits: int = 8, symmetric: bool = True, format: str = "int"):
        super().__init__()
        bits = check_act_format(format, bits, symmetric, "format")
        self.bits, self.symmetric, self.format = bits, symmetric, format
        self.fmt = None if format == "int" else formats.FORMATS[format]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt is not None:
            p = formats.format_qparams(x, self.fmt, self.fmt.block)
            return formats.format_fake_quantize(x, p, self.fmt, self.fmt.block, ste=True)
        p = qparams(x.float(), self.bits, None, self.symmetric)  # scale (..., 1): one group = one token
        return fake_quantize(x, p, self.bits, None, ste=True)

    def extra_repr(self) -> str:
        if self.fmt is not None:
            return f"a-{self.format} {'per-token' if self.fmt.block is None else f'blocks of {self.fmt.block}'}"
        return f"a{self.bits} per-token {'sym' if self.symmetric else 'asym'}"


class StaticActQuant(nn.Module):
    """Fixed qparams: scale 0-dim (per tensor) or (C,) (per input channel); zero likewise, None when symmetric.

    Per-channel activation scales vary along the matmul's reduction dim: fine for simulation,
    not for an integer GEMM kernel (which wants per-tensor or per-token activation scales).
    """

    def __init__(self, bits: int, symmetric: bool, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 format: str = "int"):
        super().__init__()
        bits = check_act_format(format, bits, symmetric, "format", STATIC_FORMATS)
        self.format = format
        scale = torch.as_tensor(scale).detach()
        if scale.dim() > 1:
            raise ValueError(f"scale must be 0-dim (per tensor) or (C,) (per channel), got shape {tuple(scale.shape)}")
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError("scale must be finite and > 0")
        if symmetric != (zero is None):
            raise ValueError("symmetric quantization takes zero=None; asymmetric needs integer zero points")
        if zero is not None:
            zero = torch.as_tensor(zero).detach()
            qmin, qmax = code_range(bits, False)
            if zero.shape != scale.shape or zero.is_floating_point() or (zero < qmin).any() or (zero > qmax).any():
                raise ValueError(f"zero must be integers in {qmin}..{qmax} shaped like scale {tuple(scale.shape)}")
            zero = zero.to(torch.int32).clone()
        self.bits, self.symmetric = bits, symmetric
        # clone: ranges computed under inference_mode must not become (read-only) inference-tensor buffers
        self.register_buffer("scale", scale.float().clone())
        self.register_buffer("zero", zero)

    @classmethod
    def from_range(cls, lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool,
                   format: str = "int") -> "StaticActQuant":
        """From an observer's range: 0-dim lo/hi -> per tensor, (C,) -> per channel. FP8: scale = amax / max."""
        if format != "int":
            check_act_format(format, bits, symmetric, "format", STATIC_FORMATS)
            fmt = formats.FORMATS[format]
            amax = torch.maximum(lo.float().abs(), hi.float().abs())
            scale = (amax / fmt.element.max_value).clamp(min=torch.finfo(torch.float32).tiny)
            return cls(fmt.bits, True, scale, None, format)
        check_act_bits(bits, symmetric, "bits")
        p = qparams_from_range(lo.float(), hi.float(), bits, symmetric)
        return cls(bits, symmetric, p.scale, p.zero)

    @property
    def per_channel(self) -> bool:
        return self.scale.dim() == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_channel and x.shape[-1] != self.scale.numel():
            raise ValueError(f"input has {x.shape[-1]} channels, per-channel qparams have {self.scale.numel()}")
        group_size = 1 if self.per_channel else None  # one group per channel, or one over the whole last dim
        if self.format != "int":
            return formats.format_fake_quantize(x, QParams(self.scale, None), formats.FORMATS[self.format],
                                                group_size, ste=True)
        return fake_quantize(x, QParams(self.scale, self.zero), self.bits, group_size, ste=True)

    def extra_repr(self) -> str:
        gran = f"per-channel ({self.scale.numel()})" if self.per_channel else "per-tensor"
        if self.format != "int":
            return f"a-{self.format} static {gran}"
        return f"a{self.bits} static {gran} {'sym' if self.symmetric else 'asym'}"


def attach_act_quant(model: nn.Module, make: Callable[[str], nn.Module], owner: str) -> int:
    """Set layer.act_quant = make(name) on every QuantLinear; returns how many. Raises if there are none."""
    layers = quant_linears(model)
    if not layers:
        raise ValueError(f"{owner}: the model has no QuantLinear layers to quantize activations of")
    for name, layer in layers.items():
        layer.act_quant = make(name)
    return len(layers)
