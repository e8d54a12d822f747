"""AutoRound's grid arithmetic (methods/autoround.py): the weight on the integer grid with rounding offsets and clip
factors, differentiable in both, and auto-round 0.16's full-range symmetric scale."""
from __future__ import annotations

import torch

from ..core.primitives import QParams, code_range, grouped, round_ste, ungrouped
from ..core.qlinear import WeightSpec

Q_SCALE_THRESH = 1e-5  # full_range: the reference's least |scale| (its q_scale_thresh)


def full_range_scale(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """auto-round 0.16's int_sym scale from a group's clipped range lo <= 0 <= hi: max(-lo, hi) / 2^(b-1), negative
    unless -lo is the larger (so that end lands on code -2^(b-1)), rounded to dtype, |scale| >= 1e-5.

    >>> full_range_scale(torch.tensor([-1.0]), torch.tensor([2.0]), 4, torch.float16)   # tensor([-0.25])
    """
    wmin_abs, wmax_abs = -lo, hi
    max_v = (2 * (wmax_abs < wmin_abs).int() - 1) * torch.maximum(wmax_abs, wmin_abs)  # as the reference writes it
    big = torch.finfo(dtype).max  # finite, where the reference would overflow to inf
    scale = (max_v / 2 ** (bits - 1)).clamp(-big, big).to(dtype)
    return torch.where(scale < 0, scale.clamp(max=-Q_SCALE_THRESH), scale.clamp(min=Q_SCALE_THRESH))


def autoround_qdq(w: torch.Tensor, v: torch.Tensor, min_factor: torch.Tensor, max_factor: torch.Tensor,
                  spec: WeightSpec, full_range: bool = False) -> tuple[torch.Tensor, QParams]:
    """W (out, in) on the integer grid of `spec` with rounding offsets v (out, in) and clip factors
    (out, n_groups): (the dequantized weight, differentiable in v and the factors; its qparams, detached).

    Pure. With v = 0 and factors 1 it is rtn min-max bit for bit: the same float ops as
    primitives.qparams_from_range / quantize / dequantize. full_range (symmetric spec only): the scale is
    full_range_scale's, as auto-round's quant_tensor_sym; codes clamp to the same [-2^(b-1), 2^(b-1)-1].

    >>> w_hat, p = autoround_qdq(w, torch.zeros_like(w), torch.ones(32, 2), torch.ones(32, 2), WeightSpec(4, 48, False))
    """
    qmin, qmax = code_range(spec.bits, spec.symmetric)
    wg = grouped(w, spec.group_size)  # (out, n_groups, g), the ragged tail zero-padded
    vg = grouped(v, spec.group_size)
    lo = torch.clamp(wg.amin(-1), max=0.0) * min_factor  # (out, n_groups)
    hi = torch.clamp(wg.amax(-1), min=0.0) * max_factor
    info = torch.finfo(spec.torch_scale_dtype)
    if full_range:
        if not spec.symmetric:
            raise ValueError(f"full_range needs a symmetric grid, got {spec.describe()}")
        scale, zero = full_range_scale(lo, hi, spec.bits, spec.torch_scale_dtype), None
    elif spec.symmetric:
        scale = (torch.maximum(lo.abs(), hi.abs()) / qmax).clamp(info.tiny, info.max).to(spec.torch_scale_dtype)
        zero = None
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(info.tiny, info.max).to(spec.torch_scale_dtype)
        zero = round_ste(-lo / scale.to(lo.dtype)).clamp(qmin, qmax)
    s = scale.to(w.dtype).unsqueeze(-1)
    q = round_ste(wg / s + vg)
    if zero is not None:
        q = q + zero.to(w.dtype).unsqueeze(-1)
    q = torch.clamp(q, qmin, qmax)
    out = (q - zero.to(w.dtype).unsqueeze(-1)) * s if zero is not None else q * s
    p = QParams(scale.detach(), None if zero is None else zero.detach().to(torch.int32))
    return ungrouped(out, w.shape[-1]), p
