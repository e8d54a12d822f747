"""Trainable fake-quantization numerics: straight-through rounding and LSQ (Esser et al. 2020).

Pure functions over tensors; the modules in `learned.py` are thin shells around them.

- STE (Bengio et al. 2013): round() forward, identity backward; the clamp to the code range
  passes gradient 1 inside the range and 0 outside (primitives.quantize(..., ste=True)).
- LSQ: the scale s (and, asymmetric, the zero point z, "LSQ+") are parameters. With STE
  rounding, d x̂/d s = round(x/s) - x/s inside the range and qmin - z or qmax - z where the
  code is clamped; d x̂/d z = 0 inside and -s outside. Both gradients are multiplied by
  g = 1 / sqrt(numel_per_scale * qmax) so that the step on s is commensurate with the step
  on the weights (LSQ paper, section 2.2).

The forward is exactly primitives.fake_quantize on QParams(scale rounded to the stored scale
dtype, round(zero)), so a trained layer freezes to integer codes whose dequantized values are
bit-for-bit the training forward's.

>>> w_hat = lsq_fake_quantize(w, scale, zero, bits=4, group_size=64)   # scale, zero: (out, n_groups)
"""
from __future__ import annotations

import math

import torch

from ..core.primitives import QParams, code_range, fake_quantize, round_ste


class _GradScale(torch.autograd.Function):
    """Identity forward (the same values, bit for bit), gradient times g backward."""

    @staticmethod
    def forward(ctx, x, g: float):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.g, None


class _CastSTE(torch.autograd.Function):
    """Round a float tensor to a narrower float dtype's values (kept in x's dtype); identity backward.

    Autograd's own .to(float16) would round the *gradient* to float16 too (underflow for small grads).
    """

    @staticmethod
    def forward(ctx, x, dtype: torch.dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def grad_scale(x: torch.Tensor, g: float) -> torch.Tensor:
    """x in the forward; its gradient multiplied by g in the backward."""
    return _GradScale.apply(x, g)


def cast_ste(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype`'s representable values (same dtype as x), gradient straight through."""
    return _CastSTE.apply(x, dtype)


def lsq_grad_scale(numel_per_scale: int, bits: int, symmetric: bool) -> float:
    """LSQ's g = 1 / sqrt(N * Q_P): N elements share one scale, Q_P the largest positive code."""
    return 1.0 / math.sqrt(numel_per_scale * code_range(bits, symmetric)[1])


def lsq_qparams(
    scale: torch.Tensor, zero: torch.Tensor | None, bits: int, g: float = 1.0,
    scale_dtype: torch.dtype = torch.float32,
) -> QParams:
    """Learnable (scale, zero) -> QParams for the forward, with gradients.

    scale: float, > 0 (clamped to scale_dtype's smallest normal), rounded to scale_dtype's values
    with a straight-through gradient; zero: float, rounded with STE and clamped to the code range.
    Both gradients are scaled by g.
    """
    info = torch.finfo(scale_dtype)
    s = cast_ste(grad_scale(scale, g).clamp(info.tiny, info.max), scale_dtype)
    if zero is None:
        return QParams(s, None)
    qmin, qmax = code_range(bits, False)
    z = torch.clamp(round_ste(grad_scale(zero, g)), qmin, qmax)
    return QParams(s, z)


def lsq_fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int | None,
    g: float | None = None, scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Fake-quantize x (..., K) with learnable scale/zero (..., n_groups); gradients to x, scale and zero.

    g=None uses LSQ's 1/sqrt(group numel * qmax).
    """
    symmetric = zero is None
    if g is None:
        g = lsq_grad_scale(group_size or x.shape[-1], bits, symmetric)
    p = lsq_qparams(scale, zero, bits, g, scale_dtype)
    return fake_quantize(x, p, bits, group_size, ste=True)


def frozen_qparams(scale: torch.Tensor, zero: torch.Tensor | None, bits: int, scale_dtype: torch.dtype) -> QParams:
    """The QParams a trained (scale, zero) freezes to: scale in scale_dtype, zero as int32 codes.

    Same values as lsq_qparams' forward, so freezing does not change the model's outputs.
    """
    with torch.no_grad():
        info = torch.finfo(scale_dtype)
        s = scale.detach().clamp(info.tiny, info.max).to(scale_dtype).clone()
        if zero is None:
            return QParams(s, None)
        qmin, qmax = code_range(bits, False)
        return QParams(s, torch.round(zero.detach()).clamp(qmin, qmax).to(torch.int32))
