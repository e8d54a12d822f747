"""The pieces llama.cpp's k-quants share (kquants.py): sub-block sums and maxima in the C code's order, re-quantizing
with the final scales, and the bit packing of ggml-common.h's block structs (2-bit and 1-bit planes, the 6-bit
scale bytes of Q4_K/Q5_K and Q3_K). Every function works on whole rows of super-blocks at once: (N, 256) codes or
(N, bytes) uint8/int32.
"""
from __future__ import annotations

import torch

from .common import nearest_int, seq_sum, wrap_u8

QK_K = 256
_U8 = torch.uint8


def block_sumsq(x: torch.Tensor) -> torch.Tensor:
    """(N, 256) -> (N,): the impl paths' `for (j...) sumx2 += x[j]*x[j]`."""
    return seq_sum((x * x).t().contiguous())


def sub_sums(w: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 256) -> (N, 256 / size): each sub-block's weights summed in order (the impl paths' sw[j])."""
    return seq_sum(w.reshape(-1, size).t().contiguous()).view(w.shape[0], -1)


def running_max(v: torch.Tensor) -> torch.Tensor:
    """(N, m) -> (N,): `if (v[j] > best) best = v[j]` from best = 0."""
    best = torch.zeros_like(v[:, 0])
    for j in range(v.shape[1]):
        best = torch.where(v[:, j] > best, v[:, j], best)
    return best


def ratio(num: float, den: torch.Tensor) -> torch.Tensor:
    """num / den correctly rounded (torch's `scalar / tensor` multiplies by a reciprocal)."""
    return torch.full_like(den, num) / den


def requant_min(x: torch.Tensor, d: torch.Tensor, dm: torch.Tensor, L: torch.Tensor, nmax: int) -> torch.Tensor:
    """x (N, 256), d and dm (N, n_sub): codes clamp(round((x + dm) / d), 0, nmax); sub-blocks with d == 0 keep L."""
    size = QK_K // d.shape[1]
    xg, d, dm = x.reshape(-1, size), d.reshape(-1, 1), dm.reshape(-1, 1)
    new = nearest_int((xg + dm) / d).clamp(0, nmax)
    return torch.where(d != 0, new, L.reshape(-1, size).int()).view(-1, QK_K)


def requant_sym(x: torch.Tensor, d: torch.Tensor, L: torch.Tensor, half: int) -> torch.Tensor:
    """x (N, 256), d (N, n_sub): codes clamp(round(x / d), -half, half-1) + half; d == 0 keeps L."""
    size = QK_K // d.shape[1]
    xg, d = x.reshape(-1, size), d.reshape(-1, 1)
    new = nearest_int(xg / d).clamp(-half, half - 1) + half
    return torch.where(d != 0, new, L.reshape(-1, size).int()).view(-1, QK_K)


def shifts(like: torch.Tensor, amounts, shape) -> torch.Tensor:
    return torch.tensor(list(amounts), dtype=torch.int32, device=like.device).view(shape)


def pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(N, 256) codes < 4 -> (N, 64): byte 32h + l holds L[128h + 32k + l] at bits 2k."""
    L = L.int().view(-1, 2, 4, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    qs = qs.int().view(-1, 2, 1, 32)
    return ((qs >> shifts(qs, [0, 2, 4, 6], (1, 1, 4, 1))) & 3).reshape(-1, QK_K)


def bits_of(L: torch.Tensor, bit: int) -> torch.Tensor:
    """(N, 256) codes -> (N, 32): byte j holds bit `bit` of L[32k + j] at bit k (Q3_K's hmask, Q5_K's qh)."""
    b = (L.int().view(-1, 8, 32) >> bit) & 1
    return sum(b[:, k] << k for k in range(8))


def unbits(q: torch.Tensor) -> torch.Tensor:
    return ((q.int().view(-1, 1, 32) >> shifts(q, range(8), (1, 8, 1))) & 1).reshape(-1, QK_K)


def pack_k4_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 scales and 8 mins (N, 8), uint8 values -> the 12 scale bytes (N, 12) int32."""
    s = torch.cat([ls[:, :4], lm[:, :4], (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], dim=1)
    high = torch.cat([(ls[:, 4:] >> 4) << 6, (lm[:, 4:] >> 4) << 6, torch.zeros_like(ls[:, :4])], dim=1)
    return wrap_u8(s | high)


def unpack_k4_scales(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for j = 0..7: (N, 12) bytes -> (scale (N, 8), min (N, 8)) int32."""
    q = q.int()
    sc = torch.cat([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], dim=1)
    return sc, m


def pack_q3_scales(l: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit scales (N, 16) -> 12 bytes (N, 12) int32: low nibbles in 0..7, high pairs in 8..11."""
    low = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = (l >> 4).view(-1, 4, 4)  # [j // 4, j % 4]
    high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return wrap_u8(torch.cat([low, high], dim=1))


def unpack_q3_scales(q: torch.Tensor) -> torch.Tensor:
    """(N, 12) bytes -> (N, 16) int32 scales in [-32, 31]."""
    q = q.int()
    low = torch.cat([q[:, :8] & 0xF, q[:, :8] >> 4], dim=1)
    high = (q[:, 8:12].view(-1, 1, 4) >> shifts(q, [0, 2, 4, 6], (1, 4, 1))) & 3
    return (low | (high.reshape(-1, 16) << 4)) - 32


def per_weight(v: torch.Tensor) -> torch.Tensor:
    """(N, n_sub) -> (N, 256): each sub-block's value on each of its weights."""
    return v.repeat_interleave(QK_K // v.shape[1], dim=1)


def as_u8(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.to(_U8) for p in parts], dim=1)
