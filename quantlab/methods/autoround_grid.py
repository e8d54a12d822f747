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

    Traced by torch.compile (compile = true), a ragged last group is computed apart from the whole ones and
    concatenated, rather than zero-padded and sliced off: torch 2.13's inductor returns memory never written for
    the padded group's gradient (pad, reshape, a broadcast multiply, reshape, slice). The same values either way
    (a zero pad never changes a group's zero-including [min, max]); eager keeps the padded form.

    >>> w_hat, p = autoround_qdq(w, torch.zeros_like(w), torch.ones(32, 2), torch.ones(32, 2), WeightSpec(4, 48, False))
    """
    if full_range and not spec.symmetric:
        raise ValueError(f"full_range needs a symmetric grid, got {spec.describe()}")
    k, g = w.shape[-1], spec.group_size or w.shape[-1]
    whole = k // g * g
    if whole not in (0, k) and torch.compiler.is_compiling():
        head = _qdq_groups(w[..., :whole].reshape(*w.shape[:-1], -1, g), v[..., :whole].reshape(*v.shape[:-1], -1, g),
                           min_factor[..., :-1], max_factor[..., :-1], spec, full_range)
        tail = _qdq_groups(w[..., whole:].unsqueeze(-2), v[..., whole:].unsqueeze(-2), min_factor[..., -1:],
                           max_factor[..., -1:], spec, full_range)
        with torch.autocast(w.device.type, enabled=False):  # CPU autocast's cat refuses float16 scales
            out = torch.cat([head[0].flatten(-2), tail[0].flatten(-2)], dim=-1)
            scale = torch.cat([head[1], tail[1]], dim=-1)
            zero = None if head[2] is None else torch.cat([head[2], tail[2]], dim=-1)
    else:
        outg, scale, zero = _qdq_groups(grouped(w, spec.group_size), grouped(v, spec.group_size), min_factor,
                                        max_factor, spec, full_range)  # the ragged tail zero-padded
        out = ungrouped(outg, k)
    return out, QParams(scale.detach(), None if zero is None else zero.detach().to(torch.int32))


def _qdq_groups(wg: torch.Tensor, vg: torch.Tensor, min_factor: torch.Tensor, max_factor: torch.Tensor,
                spec: WeightSpec, full_range: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """autoround_qdq on grouped (out, n_groups, g) tensors: (the dequantized groups, the scales, the zero points or
    None)."""
    qmin, qmax = code_range(spec.bits, spec.symmetric)
    lo = torch.clamp(wg.amin(-1), max=0.0) * min_factor  # (out, n_groups)
    hi = torch.clamp(wg.amax(-1), min=0.0) * max_factor
    info = torch.finfo(spec.torch_scale_dtype)
    if full_range:
        scale, zero = full_range_scale(lo, hi, spec.bits, spec.torch_scale_dtype), None
    elif spec.symmetric:
        scale = (torch.maximum(lo.abs(), hi.abs()) / qmax).clamp(info.tiny, info.max).to(spec.torch_scale_dtype)
        zero = None
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(info.tiny, info.max).to(spec.torch_scale_dtype)
        zero = round_ste(-lo / scale.to(lo.dtype)).clamp(qmin, qmax)
    s = scale.to(wg.dtype).unsqueeze(-1)
    q = round_ste(wg / s + vg)
    if zero is not None:
        q = q + zero.to(wg.dtype).unsqueeze(-1)
    q = torch.clamp(q, qmin, qmax)
    out = (q - zero.to(wg.dtype).unsqueeze(-1)) * s if zero is not None else q * s
    return out, scale, zero
