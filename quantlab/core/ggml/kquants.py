"""llama.cpp's k-quants (Q2_K .. Q6_K: super-blocks of 256 weights) ported from ggml-quants.c, byte for byte.

quantize(x, imp) follows quantize_qX_K: imp None takes quantize_row_qX_K_ref (the unweighted fit), an importance
takes quantize_row_qX_K_impl (quant_weights for these 256 columns). Both run vectorized over blocks with the C
code's float32 evaluation order (see common.py); the byte layouts are ggml-common.h's block structs:

    q2_k  scales[16] (4-bit scale | 4-bit min << 4), qs[64] 2-bit, d, dmin            84 bytes
    q3_k  hmask[32] high bit, qs[64] low 2 bits, scales[12] 6-bit, d                    110 bytes
    q4_k  d, dmin, scales[12] (6-bit scales and mins), qs[128] 4-bit                   144 bytes
    q5_k  d, dmin, scales[12], qh[32] fifth bit, qs[128] low 4 bits                    176 bytes
    q6_k  ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8, d                   210 bytes

    raw = TYPES[2].quantize(x, None)          # x (n, 256) float32 -> (n, 144) uint8, Q4_K
    x_hat = TYPES[2].dequantize(raw)          # == gguf.quants.dequantize, bit for bit
"""
from __future__ import annotations

import torch

from ...util.device import single_threaded
from .common import (
    GROUP_MAX_EPS,
    first_absmax,
    fp16_bytes,
    fp16_from_bytes,
    fp16_round,
    make_q3_quants,
    make_qkx2_quants,
    make_qkx3_quants,
    make_qp_quants,
    make_qx_quants,
    nearest_int,
    seq_sum,
    sqrtf,
    wrap_i8,
    wrap_u8,
)
from .kblocks import (
    QK_K,
    as_u8,
    bits_of,
    block_sumsq,
    pack_2bit,
    pack_k4_scales,
    pack_q3_scales,
    per_weight,
    ratio,
    requant_min,
    requant_sym,
    running_max,
    shifts,
    sub_sums,
    unbits,
    unpack_2bit,
    unpack_k4_scales,
    unpack_q3_scales,
)
from .types import GGMLType

_U8 = torch.uint8


# ---- Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins --------------------------------------------------

def _fit_q45(x: torch.Tensor, imp: torch.Tensor | None, nmax: int):
    """-> (d, dmin (N,) fp16-rounded, 12 scale bytes (N, 12), codes L (N, 256)) of quantize_row_q{4,5}_K_*."""
    n = x.shape[0]
    xg = x.reshape(-1, 32)
    if imp is None:  # *_ref
        av_x = sqrtf(seq_sum((xg * xg).t().contiguous()) / 32.0)
        weights = av_x[:, None] + xg.abs()
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx2_quants(xg, weights, nmax, rmin, 0.1, nstep, False)
        scales, mins = scales.view(n, 8), mins.view(n, 8)
        max_scale, max_min = running_max(scales), running_max(mins)
        inv_scale = torch.where(max_scale > 0, ratio(63.0, max_scale), torch.zeros_like(max_scale))
        inv_min = torch.where(max_min > 0, ratio(63.0, max_min), torch.zeros_like(max_min))
        ls = wrap_u8(nearest_int(inv_scale[:, None] * scales)).clamp(max=63)
        lm = wrap_u8(nearest_int(inv_min[:, None] * mins)).clamp(max=63)
        d, dmin = fp16_round(max_scale / 63.0), fp16_round(max_min / 63.0)
    else:  # *_impl
        sigma2 = 2 * block_sumsq(x) / QK_K
        weights = imp * sqrtf(sigma2[:, None] + x * x)
        scales, mins, L = make_qkx3_quants(xg, weights.reshape(-1, 32), nmax, -0.9, 0.05, 36, False)
        sw = sub_sums(weights, 32)
        d_block, ls = make_qp_quants(scales.view(n, 8), 63, sw)
        m_block, lm = make_qp_quants(mins.view(n, 8), 63, sw)
        if nmax == 31:  # only Q5_K's impl clamps the (possibly wrapped) codes
            ls, lm = ls.clamp(max=63), lm.clamp(max=63)
        d, dmin = fp16_round(d_block), fp16_round(m_block)
    scale_bytes = pack_k4_scales(ls, lm)
    sc, m = unpack_k4_scales(scale_bytes)
    L = requant_min(x, d[:, None] * sc.float(), dmin[:, None] * m.float(), L, nmax)
    return d, dmin, scale_bytes, L


def _grid_q45(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dmin = fp16_from_bytes(raw[:, 0:2]), fp16_from_bytes(raw[:, 2:4])
    sc, m = unpack_k4_scales(raw[:, 4:16])
    return per_weight(d[:, None] * sc.float()), -per_weight(dmin[:, None] * m.float())


def _q4_k_pack(L: torch.Tensor) -> torch.Tensor:
    L = L.int().view(-1, 4, 2, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k_quantize(x, imp):
    d, dmin, scale_bytes, L = _fit_q45(x, imp, 15)
    return as_u8(fp16_bytes(d), fp16_bytes(dmin), scale_bytes, _q4_k_pack(L))


def _q4_k_codes(raw):
    qs = raw[:, 16:144].int().view(-1, 4, 1, 32)
    return ((qs >> shifts(qs, [0, 4], (1, 1, 2, 1))) & 0xF).reshape(-1, QK_K).to(_U8)


def _q4_k_repack(raw, codes):
    return torch.cat([raw[:, :16], _q4_k_pack(codes).to(_U8)], dim=1)


def _q5_k_pack(L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return bits_of(L, 4), _q4_k_pack(L.int() & 0xF)


def _q5_k_quantize(x, imp):
    d, dmin, scale_bytes, L = _fit_q45(x, imp, 31)
    return as_u8(fp16_bytes(d), fp16_bytes(dmin), scale_bytes, *_q5_k_pack(L))


def _q5_k_codes(raw):
    low = _q4_k_codes(torch.cat([raw[:, :16], raw[:, 48:176]], dim=1))
    return (low | (unbits(raw[:, 16:48]) << 4)).to(_U8)


def _q5_k_repack(raw, codes):
    return as_u8(raw[:, :16], *_q5_k_pack(codes))


# ---- Q6_K: 16 sub-blocks of 16, int8 scales, symmetric 6-bit codes ----------------------------------------------

def _q6_k_pack(L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    L = L.int().view(-1, 2, 4, 32)  # [half, k, l]: weight 128*half + 32k + l
    ql = (L[:, :, 0:2] & 0xF) | ((L[:, :, 2:4] & 0xF) << 4)
    qh = sum((L[:, :, k] >> 4) << (2 * k) for k in range(4))
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


def _q6_k_quantize(x, imp):
    n = x.shape[0]
    xg = x.reshape(-1, 16)
    scales, L = make_qx_quants(xg, 32, 1, None if imp is None else imp.reshape(-1, 16))
    scales = scales.view(n, 16)
    max_abs, max_scale = first_absmax(scales.t())
    zero_block = max_abs < GROUP_MAX_EPS
    iscale = ratio(-128.0, max_scale)
    d = fp16_round(torch.ones_like(iscale) / iscale)
    sc = wrap_i8(nearest_int(iscale[:, None] * scales).clamp(max=127))
    L = requant_sym(x, d[:, None] * sc.float(), L, 32)
    raw = as_u8(*_q6_k_pack(L), wrap_u8(sc), fp16_bytes(d))
    return torch.where(zero_block[:, None], torch.zeros_like(raw), raw)


def _q6_k_codes(raw):
    ql = raw[:, 0:128].int().view(-1, 2, 1, 2, 32)  # [half, nibble, a, l] -> k = 2*nibble + a
    low = ((ql >> shifts(ql, [0, 4], (1, 1, 2, 1, 1))) & 0xF).view(-1, 2, 4, 32)
    qh = raw[:, 128:192].int().view(-1, 2, 1, 32)
    high = (qh >> shifts(qh, [0, 2, 4, 6], (1, 1, 4, 1))) & 3
    return (low | (high << 4)).reshape(-1, QK_K).to(_U8)


def _q6_k_grid(raw):
    sc = wrap_i8(raw[:, 192:208].int())
    d = fp16_from_bytes(raw[:, 208:210])
    scale = per_weight(d[:, None] * sc.float())
    return scale, torch.full_like(scale, -0.0)


def _q6_k_repack(raw, codes):
    return as_u8(*_q6_k_pack(codes), raw[:, 192:210])


# ---- Q3_K: 16 sub-blocks of 16, 6-bit scales, symmetric 3-bit codes ---------------------------------------------

def _q3_k_quantize(x, imp):
    n = x.shape[0]
    xg = x.reshape(-1, 16)
    if imp is None:  # *_ref
        scales, L = make_q3_quants(xg, 4, True)
        scales = scales.view(n, 16)
        _, max_scale = first_absmax(scales.t())
        iscale = ratio(-32.0, max_scale)
        l = wrap_i8(nearest_int(iscale[:, None] * scales)).clamp(-32, 31) + 32
        nonzero = max_scale != 0
        scale_bytes = torch.where(nonzero[:, None], pack_q3_scales(l), 0)
        d = torch.where(nonzero, fp16_round(torch.ones_like(iscale) / iscale), torch.zeros_like(iscale))
    else:  # *_impl
        sigma2 = 2 * block_sumsq(x) / QK_K
        weights = imp * sqrtf(sigma2[:, None] + x * x)
        scales, L = make_qx_quants(xg, 4, 1, weights.reshape(-1, 16))
        d_block, ls = make_qx_quants(scales.view(n, 16), 32, 1, sub_sums(weights, 16))
        scale_bytes = pack_q3_scales(ls.int())
        d = fp16_round(d_block)
    sc = unpack_q3_scales(scale_bytes)
    L = requant_sym(x, d[:, None] * sc.float(), L, 4)
    return as_u8(bits_of(L, 2), pack_2bit(L & 3), scale_bytes, fp16_bytes(d))


def _q3_k_codes(raw):
    return (unpack_2bit(raw[:, 32:96]) | (unbits(raw[:, 0:32]) << 2)).to(_U8)


def _q3_k_grid(raw):
    d = fp16_from_bytes(raw[:, 108:110])
    scale = per_weight(d[:, None] * unpack_q3_scales(raw[:, 96:108]).float())
    return scale, torch.full_like(scale, -0.0)


def _q3_k_repack(raw, codes):
    return as_u8(bits_of(codes, 2), pack_2bit(codes.int() & 3), raw[:, 96:110])


# ---- Q2_K: 16 sub-blocks of 16, 4-bit scales and mins, 2-bit codes ----------------------------------------------

def _q2_k_quantize(x, imp):
    n = x.shape[0]
    xg = x.reshape(-1, 16)
    if imp is None:  # *_ref
        scales, mins, L = make_qkx2_quants(xg, xg.abs(), 3, -0.5, 0.1, 15, True)
        scales, mins = scales.view(n, 16), mins.view(n, 16)
        max_scale, max_min = running_max(scales), running_max(mins)
        has_scale, has_min = max_scale > 0, max_min > 0
        low = wrap_u8(nearest_int(ratio(15.0, max_scale)[:, None] * scales))
        low = torch.where(has_scale[:, None], low, 0)
        high = nearest_int(ratio(15.0, max_min)[:, None] * mins) << 4
        scale_bytes = wrap_u8(torch.where(has_min[:, None], low | high, low))
        zero = torch.zeros_like(max_scale)
        d = torch.where(has_scale, fp16_round(max_scale / 15.0), zero)
        dmin = torch.where(has_min, fp16_round(max_min / 15.0), zero)
    else:  # *_impl
        sigma2 = block_sumsq(x) / QK_K
        weights = imp * sqrtf(sigma2[:, None] + x * x)
        scales, mins, L = make_qkx3_quants(xg, weights.reshape(-1, 16), 3, -0.9, 0.05, 36, False)
        sw = sub_sums(weights, 16)
        dm, ls = make_qp_quants(scales.view(n, 16), 15, sw)
        mm, lm = make_qp_quants(mins.view(n, 16), 15, sw)
        d, dmin = fp16_round(dm), fp16_round(mm)
        scale_bytes = wrap_u8(ls | (lm << 4))
    L = requant_min(x, d[:, None] * (scale_bytes & 0xF).float(), dmin[:, None] * (scale_bytes >> 4).float(), L, 3)
    return as_u8(scale_bytes, pack_2bit(L), fp16_bytes(d), fp16_bytes(dmin))


def _q2_k_grid(raw):
    sc = raw[:, 0:16].int()
    d, dmin = fp16_from_bytes(raw[:, 80:82]), fp16_from_bytes(raw[:, 82:84])
    return per_weight(d[:, None] * (sc & 0xF).float()), -per_weight(dmin[:, None] * (sc >> 4).float())


def _q2_k_repack(raw, codes):
    return as_u8(raw[:, 0:16], pack_2bit(codes), raw[:, 80:84])


# ---- the registry entries -------------------------------------------------------------------------------------

# The port is a long chain of small element-wise ops, so on CPU it runs single-threaded: with OpenMP's hand-off
# per op (and its spinning workers) it measured 5-8x slower on a 2-core machine with other jobs running. Blocks go
# through in chunks of CPU_CHUNK_BLOCKS to bound memory (the fits hold ~10 float copies of a chunk).
CPU_CHUNK_BLOCKS = 2048


def _chunked(name: str, type_size: int, quantize):
    def run(x: torch.Tensor, imp: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != QK_K:
            raise ValueError(f"{name} quantizes blocks of shape (n, {QK_K}); got x of shape {tuple(x.shape)}")
        if imp is not None and imp.shape != x.shape:
            raise ValueError(f"{name}: imp has shape {tuple(imp.shape)}, x has {tuple(x.shape)}; they must match")
        x = x.float()
        imp = None if imp is None else imp.float()
        if x.shape[0] == 0:
            return torch.zeros(0, type_size, dtype=_U8, device=x.device)
        step = CPU_CHUNK_BLOCKS if x.device.type == "cpu" else x.shape[0]
        with single_threaded(x.device):
            parts = [quantize(x[i:i + step], None if imp is None else imp[i:i + step])
                     for i in range(0, x.shape[0], step)]
        return torch.cat(parts) if len(parts) != 1 else parts[0]
    return run


def _dequantizer(levels, codes, grid):
    def dequantize(raw: torch.Tensor) -> torch.Tensor:
        scale, offset = grid(raw)
        return levels.to(raw.device)[codes(raw).long()] * scale + offset
    return dequantize


def _k_type(name, gguf_id, type_size, levels, quantize, codes, grid, repack, summary) -> GGMLType:
    levels = torch.tensor(levels, dtype=torch.float32)
    return GGMLType(name=name, gguf_id=gguf_id, block=QK_K, type_size=type_size, levels=levels,
                    quantize=_chunked(name, type_size, quantize),
                    dequantize=_dequantizer(levels, codes, grid), codes=codes, grid=grid, repack=repack,
                    summary=summary)


TYPES = (
    _k_type("q2_k", 10, 84, range(4), _q2_k_quantize, lambda raw: unpack_2bit(raw[:, 16:80]).to(_U8), _q2_k_grid,
            _q2_k_repack, "llama.cpp Q2_K: 16 sub-blocks of 16, 4-bit scales and mins, fp16 super-scales; 2.625 bits/w"),
    _k_type("q3_k", 11, 110, range(-4, 4), _q3_k_quantize, _q3_k_codes, _q3_k_grid, _q3_k_repack,
            "llama.cpp Q3_K: 16 sub-blocks of 16, 6-bit scales, symmetric, fp16 super-scale; 3.4375 bits/w"),
    _k_type("q4_k", 12, 144, range(16), _q4_k_quantize, _q4_k_codes, _grid_q45, _q4_k_repack,
            "llama.cpp Q4_K: 8 sub-blocks of 32, 6-bit scales and mins, fp16 super-scales; 4.5 bits/w"),
    _k_type("q5_k", 13, 176, range(32), _q5_k_quantize, _q5_k_codes, _grid_q45, _q5_k_repack,
            "llama.cpp Q5_K: 8 sub-blocks of 32, 6-bit scales and mins, fp16 super-scales; 5.5 bits/w"),
    _k_type("q6_k", 14, 210, range(-32, 32), _q6_k_quantize, _q6_k_codes, _q6_k_grid, _q6_k_repack,
            "llama.cpp Q6_K: 16 sub-blocks of 16, int8 scales, symmetric, fp16 super-scale; 6.5625 bits/w"),
)
