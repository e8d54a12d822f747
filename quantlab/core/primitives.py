"""Pure quantization numerics: qparams, quantize, dequantize, fake_quantize.

Conventions (all functions, never mutating their inputs):
- Groups run along the last dim: x is (..., K); with group size g there are
  ceil(K / g) groups, the last one shorter when g does not divide K.
  group_size=None means one group over the whole last dim (per-channel for a
  weight (out, in), per-token for activations (T, K)).
- scale and zero have shape (..., n_groups).
- symmetric: codes in [-2^(b-1), 2^(b-1)-1], scale = amax / (2^(b-1)-1), no zero.
- asymmetric: codes in [0, 2^b-1], range [min(x,0), max(x,0)] so 0.0 is exactly
  representable (PyTorch observers, the GPTQ reference), integer zero in code range.
  QParams.float_zero (HQQ, methods/hqq.py): a real-valued zero, codes round(x/s + zero).
- dequantize() is the one place codes become floats; fake_quantize() calls it too,
  so the fake-quant forward and the frozen integer forward agree bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QParams:
    scale: torch.Tensor  # (..., n_groups), stored dtype (e.g. float16)
    zero: torch.Tensor | None  # (..., n_groups) int32 codes, None when symmetric
    # non-integer formats (core/formats.py): what the stored form needs beyond the effective fp32 scale
    # (MX's E8M0 exponents, NVFP4's tensor scale, NF4's double-quantized absmax); None on integer grids
    extra: dict | None = None
    # True: zero is a real number (HQQ), codes round(x/s + zero). False: zero is an integer code (int32, or
    # an integer-valued float carrying LSQ's gradient), codes round(x/s) + zero. A flag, not zero's dtype:
    # the two differ at ties, and LSQ's float zeros must keep the integer formula their frozen form uses.
    float_zero: bool = False

    def __post_init__(self):
        if self.float_zero and (self.zero is None or not self.zero.is_floating_point()):
            got = "None" if self.zero is None else f"a {self.zero.dtype} tensor"
            raise ValueError(f"float_zero needs a floating-point zero tensor, got {got}")


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Smallest and largest integer code. >>> code_range(4, True) == (-8, 7)"""
    if symmetric:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def n_groups(k: int, group_size: int | None) -> int:
    return 1 if group_size is None else math.ceil(k / group_size)


def grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(..., K) -> (..., n_groups, g), the ragged tail padded with zeros.

    Zero padding never changes a group's |max| or its zero-including [min, max].
    """
    k = x.shape[-1]
    g = k if group_size is None else group_size
    pad = n_groups(k, group_size) * g - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, g)


def qparams_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> QParams:
    """Scale (and zero) covering [xmin, xmax] per group; any shape.

    Scales are rounded to scale_dtype and clamped to its smallest normal number,
    so an all-zero or constant group never divides by zero.
    """
    qmin, qmax = code_range(bits, symmetric)
    info = torch.finfo(scale_dtype)
    if symmetric:
        amax = torch.maximum(xmin.abs(), xmax.abs())
        scale = (amax / qmax).clamp(info.tiny, info.max).to(scale_dtype)
        return QParams(scale, None)
    lo = torch.clamp(xmin, max=0.0)
    hi = torch.clamp(xmax, min=0.0)
    scale = ((hi - lo) / (qmax - qmin)).clamp(info.tiny, info.max).to(scale_dtype)
    zero = torch.round(-lo / scale.to(lo.dtype)).clamp(qmin, qmax).to(torch.int32)
    return QParams(scale, zero)


def qparams(
    x: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
) -> QParams:
    """Min-max quantization parameters per group of the last dim.

    >>> p = qparams(torch.randn(16, 64), bits=4, group_size=32)   # p.scale: (16, 2)
    """
    xg = grouped(x.detach(), group_size)
    return qparams_from_range(xg.amin(-1), xg.amax(-1), bits, symmetric, scale_dtype)


class _RoundSTE(torch.autograd.Function):
    """round() forward, identity backward (straight-through estimator).

    A Function rather than x + (round(x) - x).detach(): that form can be off by
    one ulp from round(x), which would break exact fake-quant/convert parity.
    """

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


round_ste = _RoundSTE.apply


def ungrouped(xg: torch.Tensor, k: int) -> torch.Tensor:
    """(..., n_groups, g) -> (..., k): inverse of grouped."""
    return xg.reshape(*xg.shape[:-2], -1)[..., :k]


def quantize(x: torch.Tensor, p: QParams, bits: int, group_size: int | None, ste: bool = False) -> torch.Tensor:
    """Float (..., K) -> integer codes (..., K) as a float tensor holding integer values.

    With ste=True gradients flow straight through the rounding and are zero
    where the clamp is active.
    """
    symmetric = p.zero is None
    qmin, qmax = code_range(bits, symmetric)
    xg = grouped(x, group_size)  # (..., n_groups, g)
    if p.float_zero:  # HQQ: the real-valued zero shifts before rounding
        q = (round_ste if ste else torch.round)(xg / p.scale.to(x.dtype).unsqueeze(-1) + p.zero.to(x.dtype).unsqueeze(-1))
        return ungrouped(torch.clamp(q, qmin, qmax), x.shape[-1])
    q = (round_ste if ste else torch.round)(xg / p.scale.to(x.dtype).unsqueeze(-1))
    if not symmetric:
        q = q + p.zero.to(x.dtype).unsqueeze(-1)
    return ungrouped(torch.clamp(q, qmin, qmax), x.shape[-1])


def dequantize(q: torch.Tensor, p: QParams, group_size: int | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer codes (..., K) (any int or float dtype) -> floats (q - zero) * scale. Never mutates q."""
    qg = grouped(q, group_size)
    if p.zero is not None:
        out = qg.to(dtype) - p.zero.to(dtype).unsqueeze(-1)  # a new tensor, so mul_ below is safe
        out.mul_(p.scale.to(dtype).unsqueeze(-1))
    else:
        out = qg.to(dtype) * p.scale.to(dtype).unsqueeze(-1)
    return ungrouped(out, q.shape[-1])


def fake_quantize(
    x: torch.Tensor, p: QParams, bits: int, group_size: int | None, ste: bool = True
) -> torch.Tensor:
    """dequantize(quantize(x)): float in, float out, on the quantization grid."""
    return dequantize(quantize(x, p, bits, group_size, ste=ste), p, group_size, x.dtype)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|² / |ref - approx|²)."""
    noise = (ref.double() - approx.double()).pow(2).sum()
    signal = ref.double().pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise))
