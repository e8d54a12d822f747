"""llama.cpp's 4-bit non-linear types IQ4_NL and IQ4_XS (ggml-quants.c, quantize_row_iq4_nl_impl), bit for bit.

Both round each block of 32 onto the 16 fixed levels kvalues_iq4nl times a scale found by a weighted search
(ntry = 7: the absmax scale, its least-squares refit, and 15 more starting points). IQ4_NL stores that scale as
fp16 per block of 32; IQ4_XS stores per super-block of 256 an fp16 d and a 6-bit signed multiple of it per 32.
Weights: quant_weights * sqrt(sigma2 + x²) with sigma2 = 2·mean x² over the super-block, or x² without them.
Unlike the legacy types, nothing here looks outside the super-block, so blocks are independent.

>>> raw = TYPES[1].quantize(torch.randn(4, 256), None)   # (4, 136) uint8, IQ4_XS
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import torch

from .common import GROUP_MAX_EPS, first_absmax, fp16_bytes, fp16_from_bytes, nearest_int, seq_sum, sqrtf
from .legacy import pack_nibbles, recip_or_zero, unpack_nibbles
from .types import GGMLType

KVALUES_IQ4NL = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                             dtype=torch.float32)
NTRY = 7  # what quantize_iq4_nl / quantize_iq4_xs (ggml_quantize_chunk) pass, with or without quant_weights


def _float_order(f: np.float32) -> int:
    """float32 -> int, monotone in the float's value (so bisection can walk float32 values one by one)."""
    i = int(np.array(f, dtype=np.float32).view(np.int32))
    return i if i >= 0 else -(i & 0x7FFFFFFF)


def _from_order(i: int) -> np.float32:
    return np.array(i if i >= 0 else (-i) | -0x80000000, dtype=np.int32).view(np.float32)[()]


@functools.lru_cache(maxsize=8)
def _thresholds(values: tuple[int, ...]) -> tuple[float, ...]:
    """For each neighbour pair (lo, hi) of the sorted int8 table, the least float32 x with
    !(x - lo < hi - x) in float32: where best_index_int8 turns from lo to hi (monotone in x, so bisection)."""
    out = []
    for lo, hi in itertools.pairwise(values):
        flo, fhi = np.float32(lo), np.float32(hi)
        a, b = _float_order(flo), _float_order(fhi)  # predicate true at lo, false at hi
        while b - a > 1:
            mid = (a + b) // 2
            x = _from_order(mid)
            if np.float32(x - flo) < np.float32(fhi - x):
                a = mid
            else:
                b = mid
        out.append(float(_from_order(b)))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _half_step_table(values: tuple[int, ...]) -> tuple[int, torch.Tensor] | None:
    """Where every threshold is a multiple of 1/2 (kvalues_iq4nl: all are the exact midpoints), the index depends
    only on floor(2x): -> (the lowest floor(2x) in the table, index per floor(2x)); else None."""
    t2 = [2 * t for t in _thresholds(values)]
    if any(v != int(v) for v in t2):
        return None
    lo, hi = int(t2[0]) - 1, int(t2[-1])
    n = torch.arange(lo, hi + 1, dtype=torch.float32)
    return lo, (n[:, None] >= torch.tensor(t2)[None]).sum(1)


def best_index_int8(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest x in the sorted int8-valued table `values` (C best_index_int8: its binary
    search, its float32 differences and its tie rule, upper level at a tie) -> int64, same shape as x.
    Finite x only (C's NaN gives the last index, ours does not).

    >>> best_index_int8(KVALUES_IQ4NL, torch.tensor([-200.0, -4.5, -4.51, 200.0]))   # tensor([0, 8, 7, 15])
    """
    key = tuple(int(v) for v in values.tolist())
    table = _half_step_table(key)
    if table is None:  # thresholds off the half grid: a binary search on them
        edges = torch.tensor(_thresholds(key), dtype=torch.float32, device=x.device)
        return torch.searchsorted(edges, x.contiguous(), right=True)
    lo, index = table
    return _look_up(index.to(x.device), lo, x)


def _look_up(table: torch.Tensor, lo: int, x: torch.Tensor) -> torch.Tensor:
    """table[floor(2x) - lo], floor(2x) clamped to the table (2x is exact, so this is x against half steps)."""
    k = torch.floor((x * 2.0).clamp(lo, lo + table.numel() - 1)).to(torch.int64) - lo
    return table.index_select(0, k.reshape(-1)).reshape(x.shape)


def _levels_of(x: torch.Tensor) -> torch.Tensor:
    """KVALUES_IQ4NL[best_index_int8(KVALUES_IQ4NL, x)] in one look-up."""
    lo, index = _half_step_table(tuple(int(v) for v in KVALUES_IQ4NL.tolist()))
    return _look_up(KVALUES_IQ4NL[index].to(x.device), lo, x)


def _weighted_fit(xt: torch.Tensor, w: torch.Tensor, inv_scale: torch.Tensor):
    """Round x * inv_scale onto the levels and fit the scale: -> (sumqx, sumq2) in the C's float order.
    xt, w: (32, m) (positions first, so the C's sums over positions run over contiguous rows); inv_scale (m,)."""
    q = _levels_of(inv_scale * xt)
    wq = w * q
    return seq_sum(wq * xt), seq_sum(wq * q)


def block_scales(xb: torch.Tensor, w: torch.Tensor, ntry: int = NTRY) -> torch.Tensor:
    """The first stage of quantize_row_iq4_nl_impl for blocks of 32: each block's scale d (m,) float32 (0 where
    the block's max |x| is under GROUP_MAX_EPS). xb, w: (m, 32) float32."""
    xt, wt = xb.t().contiguous(), w.t().contiguous()
    amax, mx = first_absmax(xt)
    flat = amax < GROUP_MAX_EPS
    mx = torch.where(flat, torch.ones_like(mx), mx)  # keeps the discarded search of flat blocks finite
    v0 = float(KVALUES_IQ4NL[0])
    d = (-mx if ntry > 0 else mx) / v0
    sumqx, sumq2 = _weighted_fit(xt, wt, torch.ones_like(d) / d)
    d = torch.where(sumq2 > 0, sumqx / sumq2, torch.zeros_like(d))
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):  # sequential: each try compares with the best so far
        sqx, sq2 = _weighted_fit(xt, wt, torch.full_like(mx, itry + v0) / mx)
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = torch.where(better, sqx / sq2, d)
        best = torch.where(better, d * sqx, best)
    return torch.where(flat, torch.zeros_like(d), d)


def _weights(x: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """(n, S) super-blocks -> (n, S) weights: qw * sqrtf(sigma2 + x²), sigma2 = (ordered sum x²) * (2/S); or x²."""
    if imp is None:
        return x * x
    sigma2 = seq_sum((x * x).t()) * (2.0 / x.shape[1])
    return imp.to(torch.float32) * sqrtf(sigma2[:, None] + x * x)


def _check(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"expected (n, {width}) blocks, got shape {tuple(x.shape)}")
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):  # the C code's result is undefined there (NaN into a table search)
        raise ValueError(f"{int((~torch.isfinite(x)).sum())} non-finite values in the blocks to quantize")
    return x


# ---- IQ4_NL: fp16 d per 32, w = d * kvalues[q] ----

def quantize_iq4_nl(x: torch.Tensor, imp: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 32) float32 -> (n, 18) uint8: fp16 d, 16 bytes of nibbles (indices into KVALUES_IQ4NL), as
    quantize_iq4_nl (ntry 7) with quant_weights imp (n, 32) or None."""
    x = _check(x, 32)
    w = _weights(x, None if imp is None else _check(imp, 32))
    d = block_scales(x, w)
    codes = best_index_int8(KVALUES_IQ4NL, recip_or_zero(d)[:, None] * x)
    return torch.cat([fp16_bytes(d), pack_nibbles(codes)], dim=1)


def codes_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    """(n, 18) -> (n, 32) uint8 indices into KVALUES_IQ4NL."""
    return unpack_nibbles(raw[:, 2:])


def grid_iq4_nl(raw: torch.Tensor):
    """(n, 18) -> (scale d, offset 0), each (n, 32)."""
    d = fp16_from_bytes(raw[:, :2])[:, None].expand(-1, 32).contiguous()
    return d, torch.zeros_like(d)


def dequantize_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    """(n, 18) -> (n, 32) float32: d * kvalues[q], as gguf-py and dequantize_row_iq4_nl."""
    return fp16_from_bytes(raw[:, :2])[:, None] * KVALUES_IQ4NL.to(raw.device)[codes_iq4_nl(raw).long()]


def repack_iq4_nl(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d with other codes (n, 32) 0..15."""
    return torch.cat([raw[:, :2], pack_nibbles(codes)], dim=1)


# ---- IQ4_XS: per 256, fp16 d and 6-bit ls per 32; w = (d * (ls - 32)) * kvalues[q] ----

def quantize_iq4_xs(x: torch.Tensor, imp: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 256) float32 -> (n, 136) uint8: fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of nibbles, as
    quantize_iq4_xs with quant_weights imp (n, 256) or None."""
    x = _check(x, 256)
    n = x.shape[0]
    w = _weights(x, None if imp is None else _check(imp, 256))
    xb = x.reshape(n * 8, 32)
    scales = block_scales(xb, w.reshape(n * 8, 32)).reshape(n, 8)
    _, max_scale = first_absmax(scales.t())  # blocks under GROUP_MAX_EPS have scale 0 and never win
    d = -max_scale / 32.0
    l = nearest_int(recip_or_zero(d)[:, None] * scales).clamp(-32, 31).to(torch.int64)
    dl = d[:, None] * l.to(torch.float32)
    codes = best_index_int8(KVALUES_IQ4NL, recip_or_zero(dl).reshape(-1, 1) * xb).reshape(n, 256)
    return torch.cat([fp16_bytes(d), _scale_bytes(l + 32), pack_nibbles(codes)], dim=1)


def _scale_bytes(ls: torch.Tensor) -> torch.Tensor:
    """(n, 8) 6-bit scales -> (n, 6) uint8: uint16 scales_h (2 high bits each), scales_l (low nibbles, pairs)."""
    high = ((ls >> 4) << torch.arange(0, 16, 2, device=ls.device)).sum(1)
    low = (ls & 0xF).reshape(-1, 4, 2)
    return torch.cat([torch.stack([high & 0xFF, high >> 8], 1), low[:, :, 0] | (low[:, :, 1] << 4)], 1).to(torch.uint8)


def _scales(raw: torch.Tensor) -> torch.Tensor:
    """(n, 136) -> (n, 8) int64 ls - 32."""
    high = raw[:, 2].to(torch.int64) | (raw[:, 3].to(torch.int64) << 8)
    low = _nibble_pairs(raw[:, 4:8])
    return (low | (((high[:, None] >> torch.arange(0, 16, 2, device=raw.device)) & 3) << 4)) - 32


def _nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 -> (n, 2k) int64: low nibble of byte i at 2i, high nibble at 2i+1."""
    v = b.to(torch.int64)
    return torch.stack([v & 0xF, v >> 4], 2).reshape(b.shape[0], -1)


def codes_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    """(n, 136) -> (n, 256) uint8 indices into KVALUES_IQ4NL."""
    return unpack_nibbles(raw[:, 8:])


def grid_iq4_xs(raw: torch.Tensor):
    """(n, 136) -> (scale d * (ls - 32) per 32, offset 0), each (n, 256)."""
    dl = fp16_from_bytes(raw[:, :2])[:, None] * _scales(raw).to(torch.float32)  # (n, 8)
    scale = dl.repeat_interleave(32, dim=1)
    return scale, torch.zeros_like(scale)


def dequantize_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    """(n, 136) -> (n, 256) float32: (d * (ls - 32)) * kvalues[q], as gguf-py and dequantize_row_iq4_xs."""
    scale, _ = grid_iq4_xs(raw)
    return scale * KVALUES_IQ4NL.to(raw.device)[codes_iq4_xs(raw).long()]


def repack_iq4_xs(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d and 6-bit scales with other codes (n, 256) 0..15."""
    return torch.cat([raw[:, :8], pack_nibbles(codes)], dim=1)


TYPES = (
    GGMLType(name="iq4_nl", gguf_id=20, block=32, type_size=18, levels=KVALUES_IQ4NL.clone(),
             quantize=quantize_iq4_nl, dequantize=dequantize_iq4_nl, codes=codes_iq4_nl, grid=grid_iq4_nl,
             repack=repack_iq4_nl,
             summary="llama.cpp IQ4_NL: blocks of 32, fp16 scale, 16 non-linear levels; 4.5 bits/w"),
    GGMLType(name="iq4_xs", gguf_id=23, block=256, type_size=136, levels=KVALUES_IQ4NL.clone(),
             quantize=quantize_iq4_xs, dequantize=dequantize_iq4_xs, codes=codes_iq4_xs, grid=grid_iq4_xs,
             repack=repack_iq4_xs,
             summary="llama.cpp IQ4_XS: super-blocks of 256, fp16 scale, 6-bit scale per 32, 16 non-linear "
                     "levels; 4.25 bits/w"),
)
