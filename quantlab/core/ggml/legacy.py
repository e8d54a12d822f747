"""llama.cpp's legacy block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (ggml-quants.c), ported bit for bit to torch.

Every block holds 32 weights. Without an importance vector llama.cpp takes quantize_row_qX_ref (round from the
block's absolute max, or its min and max); with one it takes quantize_row_qX_impl (a weighted scale search,
make_qx_quants / make_qkx3_quants), whose weights use sigma2 = mean x² over the block's whole *row*. A block
alone cannot know its row, so quantize() takes `sigma2` (n,) from the caller (row_sigma2 of the rows, repeated
per block); left out, each block is its own row (llama.cpp's bytes when rows are 32 wide).

Float order follows the C (float32, no fused multiply-add; sums accumulated in order), so bytes match
ggml_quantize_chunk exactly. All functions are pure and vectorized over blocks.

>>> raw = TYPES[0].quantize(torch.randn(4, 32), None)   # (4, 18) uint8, Q4_0
"""
from __future__ import annotations

import torch

from .common import first_absmax, fp16_bytes, fp16_from_bytes, make_qkx3_quants, make_qx_quants, seq_sum, sqrtf
from .types import GGMLType

BLOCK = 32


# ---- byte and conversion helpers, shared with iquants.py (public: rooms talk through public doors) ----

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(n, 32k) integer codes -> (n, 16k) uint8: byte j of each 32 holds code j | code j+16 << 4 (as the C: the
    low code is not masked, so an out-of-range code spills into the high nibble exactly like `qs |= x1 << 4`).

    >>> pack_nibbles(torch.arange(32)[None] % 16)[0, :2]   # tensor([0, 17], dtype=torch.uint8)
    """
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 2, 16)
    return ((c[:, :, 0] | (c[:, :, 1] << 4)) & 0xFF).to(torch.uint8).reshape(codes.shape[0], -1)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: (n, 16k) uint8 -> (n, 32k) uint8 codes 0..15."""
    q = qs.reshape(qs.shape[0], -1, 1, 16)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], -1)


def c_float_to_int8(v: torch.Tensor) -> torch.Tensor:
    """C's `(int8_t)f` / `(uint8_t)f` as x86 compiles it (truncate to int32, keep the low byte; NaN, inf and
    out-of-range give INT32_MIN, whose low byte is 0) -> int64 in -128..127. c_float_to_int8(tensor([8.9])) -> 8."""
    t = torch.trunc(v)
    ok = torch.isfinite(t) & (t >= -2.0**31) & (t < 2.0**31)
    low = torch.where(ok, t, torch.zeros_like(t)).to(torch.int64) & 0xFF
    return low - ((low & 0x80) << 1)


def recip_or_zero(d: torch.Tensor) -> torch.Tensor:
    """C's `d ? 1.0f/d : 0.0f` in float32 (a tensor numerator: torch's `1.0 / t` is not correctly rounded)."""
    return torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))


def row_sigma2(rows: torch.Tensor) -> torch.Tensor:
    """(R, K) float32 -> (R,) float32: the legacy *_impl paths' sigma2 = (sum of x² in column order) / K.

    >>> s = row_sigma2(w).repeat_interleave(w.shape[1] // 32)   # one per block, for quantize(..., sigma2=s)
    """
    rows = rows.to(torch.float32)
    sq = (rows * rows).t().contiguous()
    return seq_sum(sq) / float(rows.shape[1])


# ---- shared pieces of the five formats ----

def _abs_max_signed(x: torch.Tensor) -> torch.Tensor:
    """The first value of largest |x| (C: `if (amax < fabsf(v))`, starting from 0) -> (n,)."""
    return first_absmax(x.t())[1]


def _min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C's running min / max from +-FLT_MAX with strict comparisons -> (min, max), each (n,)."""
    big = torch.finfo(torch.float32).max
    mn = torch.full((x.shape[0],), big, dtype=torch.float32, device=x.device)
    mx = torch.full_like(mn, -big)
    for j in range(x.shape[1]):
        v = x[:, j]
        mn = torch.where(v < mn, v, mn)
        mx = torch.where(v > mx, v, mx)
    return mn, mx


def _impl_weights(x: torch.Tensor, imp: torch.Tensor, sigma2: torch.Tensor | None) -> torch.Tensor:
    """weight[j] = qw[j] * sqrtf(sigma2 + x[j]*x[j]) with sigma2 per block (default: the block as its row)."""
    if sigma2 is None:
        sigma2 = row_sigma2(x)
    return imp * sqrtf(sigma2.to(torch.float32)[:, None] + x * x)


def _qh_bytes(codes: torch.Tensor) -> torch.Tensor:
    """(n, 32) 5-bit codes -> (n, 4) uint8: uint32 qh with bit j = bit 4 of code j, little endian."""
    bits = ((codes.to(torch.int64) >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8 -> (n, 32) uint8 fifth bits."""
    return ((qh.to(torch.int64)[:, :, None] >> torch.arange(8, device=qh.device)) & 1).reshape(-1, 32).to(torch.uint8)


def _five_bit_body(codes: torch.Tensor) -> torch.Tensor:
    """(n, 32) codes 0..31 -> qh (4 bytes) + qs (16 bytes)."""
    return torch.cat([_qh_bytes(codes), pack_nibbles(codes.to(torch.int64) & 0x0F)], dim=1)


def _five_bit_codes(body: torch.Tensor) -> torch.Tensor:
    """qh (4 bytes) + qs (16 bytes) -> (n, 32) codes 0..31."""
    return unpack_nibbles(body[:, 4:]) | (_qh_bits(body[:, :4]) << 4)


def _check(x: torch.Tensor, width: int = BLOCK) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"expected (n, {width}) blocks, got shape {tuple(x.shape)}")
    return x.to(torch.float32)


# ---- Q4_0: d = max / -8, w = d * (q - 8) ----

def quantize_q4_0(x: torch.Tensor, imp: torch.Tensor | None = None, sigma2: torch.Tensor | None = None):
    """(n, 32) float32 -> (n, 18) uint8: fp16 d, 16 bytes of nibbles. imp None: quantize_row_q4_0_ref; else
    quantize_row_q4_0_impl with weights imp * sqrt(sigma2 + x²), sigma2 (n,) the block's row mean x² (row_sigma2;
    None: the block's own). Q4_1, Q5_0, Q5_1 take the same arguments; Q8_0 ignores imp and sigma2."""
    x = _check(x)
    if imp is None:
        d = _abs_max_signed(x) / -8.0
        q = c_float_to_int8(x * recip_or_zero(d)[:, None] + 8.5).clamp(max=15) & 0xFF
    else:
        d, q = make_qx_quants(x, 8, 1, _impl_weights(x, _check(imp), sigma2))
    return torch.cat([fp16_bytes(d), pack_nibbles(q)], dim=1)


def codes_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 18) -> (n, 32) uint8 codes 0..15 (levels -8..7)."""
    return unpack_nibbles(raw[:, 2:])


def grid_q4_0(raw: torch.Tensor):
    """(n, 18 or 22) -> (scale d, offset 0), each (n, 32): Q4_0 and Q5_0 keep d in bytes 0..1."""
    d = fp16_from_bytes(raw[:, :2])[:, None].expand(-1, BLOCK)
    return d.contiguous(), torch.zeros_like(d)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 18) -> (n, 32) float32: d * (q - 8), as gguf-py and dequantize_row_q4_0."""
    q = codes_q4_0(raw).to(torch.float32) - 8.0
    return fp16_from_bytes(raw[:, :2])[:, None] * q


def repack_q4_0(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d with other codes (n, 32) 0..15."""
    return torch.cat([raw[:, :2], pack_nibbles(codes)], dim=1)


# ---- Q4_1: d = (max - min) / 15, w = d * q + m ----

def quantize_q4_1(x: torch.Tensor, imp: torch.Tensor | None = None, sigma2: torch.Tensor | None = None):
    """(n, 32) float32 -> (n, 20) uint8: fp16 d, fp16 m, 16 bytes of nibbles."""
    x = _check(x)
    if imp is None:
        mn, mx = _min_max(x)
        d = (mx - mn) / 15.0
        q = c_float_to_int8((x - mn[:, None]) * recip_or_zero(d)[:, None] + 0.5).clamp(max=15) & 0xFF
        m = mn
    else:
        d, the_min, q = make_qkx3_quants(x, _impl_weights(x, _check(imp), sigma2), 15, -0.9, 0.05, 36, False)
        m = -the_min
    return torch.cat([fp16_bytes(d), fp16_bytes(m), pack_nibbles(q)], dim=1)


def codes_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """(n, 20) -> (n, 32) uint8 codes 0..15."""
    return unpack_nibbles(raw[:, 4:])


def grid_q4_1(raw: torch.Tensor):
    """(n, 20 or 24) -> (scale d, offset m), each (n, 32): Q4_1 and Q5_1 keep d, m in bytes 0..3."""
    d = fp16_from_bytes(raw[:, :2])[:, None].expand(-1, BLOCK)
    m = fp16_from_bytes(raw[:, 2:4])[:, None].expand(-1, BLOCK)
    return d.contiguous(), m.contiguous()


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """(n, 20) -> (n, 32) float32: d * q + m."""
    q = codes_q4_1(raw).to(torch.float32)
    return fp16_from_bytes(raw[:, :2])[:, None] * q + fp16_from_bytes(raw[:, 2:4])[:, None]


def repack_q4_1(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d, m with other codes (n, 32) 0..15."""
    return torch.cat([raw[:, :4], pack_nibbles(codes)], dim=1)


# ---- Q5_0: d = max / -16, w = d * (q - 16) ----

def quantize_q5_0(x: torch.Tensor, imp: torch.Tensor | None = None, sigma2: torch.Tensor | None = None):
    """(n, 32) float32 -> (n, 22) uint8: fp16 d, uint32 qh (fifth bits), 16 bytes of nibbles."""
    x = _check(x)
    if imp is None:
        d = _abs_max_signed(x) / -16.0
        q = c_float_to_int8(x * recip_or_zero(d)[:, None] + 16.5).clamp(max=31) & 0xFF
    else:
        d, q = make_qx_quants(x, 16, 1, _impl_weights(x, _check(imp), sigma2))
    return torch.cat([fp16_bytes(d), _five_bit_body(q)], dim=1)


def codes_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 22) -> (n, 32) uint8 codes 0..31 (levels -16..15)."""
    return _five_bit_codes(raw[:, 2:])


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 22) -> (n, 32) float32: d * (q - 16)."""
    q = codes_q5_0(raw).to(torch.float32) - 16.0
    return fp16_from_bytes(raw[:, :2])[:, None] * q


def repack_q5_0(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d with other codes (n, 32) 0..31."""
    return torch.cat([raw[:, :2], _five_bit_body(codes)], dim=1)


# ---- Q5_1: d = (max - min) / 31, w = d * q + m ----

def quantize_q5_1(x: torch.Tensor, imp: torch.Tensor | None = None, sigma2: torch.Tensor | None = None):
    """(n, 32) float32 -> (n, 24) uint8: fp16 d, fp16 m, uint32 qh, 16 bytes of nibbles."""
    x = _check(x)
    if imp is None:
        mn, mx = _min_max(x)
        d = (mx - mn) / 31.0
        q = c_float_to_int8((x - mn[:, None]) * recip_or_zero(d)[:, None] + 0.5) & 0xFF  # (uint8_t), no MIN
        m = mn
    else:
        d, the_min, q = make_qkx3_quants(x, _impl_weights(x, _check(imp), sigma2), 31, -0.9, 0.05, 36, False)
        m = -the_min
    return torch.cat([fp16_bytes(d), fp16_bytes(m), _five_bit_body(q)], dim=1)


def codes_q5_1(raw: torch.Tensor) -> torch.Tensor:
    """(n, 24) -> (n, 32) uint8 codes 0..31."""
    return _five_bit_codes(raw[:, 4:])


def dequantize_q5_1(raw: torch.Tensor) -> torch.Tensor:
    """(n, 24) -> (n, 32) float32: d * q + m."""
    q = codes_q5_1(raw).to(torch.float32)
    return fp16_from_bytes(raw[:, :2])[:, None] * q + fp16_from_bytes(raw[:, 2:4])[:, None]


def repack_q5_1(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d, m with other codes (n, 32) 0..31."""
    return torch.cat([raw[:, :4], _five_bit_body(codes)], dim=1)


# ---- Q8_0: d = amax / 127, w = d * q; llama.cpp ignores quant_weights for it ----

def quantize_q8_0(x: torch.Tensor, imp: torch.Tensor | None = None, sigma2: torch.Tensor | None = None):
    """(n, 32) float32 -> (n, 34) uint8: fp16 d, 32 int8. imp and sigma2 are ignored, as in llama.cpp."""
    x = _check(x)
    amax = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for j in range(BLOCK):
        v = x[:, j].abs()
        amax = torch.where(amax > v, amax, v)  # MAX(amax, fabsf(v))
    d = amax / 127.0
    q = c_float_to_int8(_roundf(x * recip_or_zero(d)[:, None])) & 0xFF
    return torch.cat([fp16_bytes(d), q.to(torch.uint8)], dim=1)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C roundf: half away from zero, exact for every float32 (trunc(v) + 1 when |v - trunc(v)| >= 0.5)."""
    t = torch.trunc(v)
    frac = v - t  # exact in float32
    step = torch.where(frac.abs() >= 0.5, torch.sign(v), torch.zeros_like(v))
    return t + step


def codes_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 34) -> (n, 32) uint8: int8 q as index q + 128 into levels -128..127."""
    return raw[:, 2:] ^ 0x80


def grid_q8_0(raw: torch.Tensor):
    """(n, 34) -> (scale d, offset 0), each (n, 32)."""
    d = fp16_from_bytes(raw[:, :2])[:, None].expand(-1, BLOCK)
    return d.contiguous(), torch.zeros_like(d)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """(n, 34) -> (n, 32) float32: q * d."""
    q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return q * fp16_from_bytes(raw[:, :2])[:, None]


def repack_q8_0(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The same d with other codes (n, 32) 0..255 (q = code - 128)."""
    return torch.cat([raw[:, :2], codes.to(torch.uint8) ^ 0x80], dim=1)


def _levels(lo: int, count: int) -> torch.Tensor:
    return torch.arange(lo, lo + count, dtype=torch.float32)


TYPES = (
    GGMLType(name="q4_0", gguf_id=2, block=32, type_size=18, levels=_levels(-8, 16),
             quantize=quantize_q4_0, dequantize=dequantize_q4_0, codes=codes_q4_0, grid=grid_q4_0,
             repack=repack_q4_0,
             summary="llama.cpp Q4_0: blocks of 32, fp16 scale, codes 0..15 around 8; 4.5 bits/w"),
    GGMLType(name="q4_1", gguf_id=3, block=32, type_size=20, levels=_levels(0, 16),
             quantize=quantize_q4_1, dequantize=dequantize_q4_1, codes=codes_q4_1, grid=grid_q4_1,
             repack=repack_q4_1,
             summary="llama.cpp Q4_1: blocks of 32, fp16 scale and min, codes 0..15; 5 bits/w"),
    GGMLType(name="q5_0", gguf_id=6, block=32, type_size=22, levels=_levels(-16, 32),
             quantize=quantize_q5_0, dequantize=dequantize_q5_0, codes=codes_q5_0, grid=grid_q4_0,
             repack=repack_q5_0,
             summary="llama.cpp Q5_0: blocks of 32, fp16 scale, codes 0..31 around 16; 5.5 bits/w"),
    GGMLType(name="q5_1", gguf_id=7, block=32, type_size=24, levels=_levels(0, 32),
             quantize=quantize_q5_1, dequantize=dequantize_q5_1, codes=codes_q5_1, grid=grid_q4_1,
             repack=repack_q5_1,
             summary="llama.cpp Q5_1: blocks of 32, fp16 scale and min, codes 0..31; 6 bits/w"),
    GGMLType(name="q8_0", gguf_id=8, block=32, type_size=34, levels=_levels(-128, 256),
             quantize=quantize_q8_0, dequantize=dequantize_q8_0, codes=codes_q8_0, grid=grid_q8_0,
             repack=repack_q8_0,
             summary="llama.cpp Q8_0: blocks of 32, fp16 scale, int8 codes; 8.5 bits/w"),
)
