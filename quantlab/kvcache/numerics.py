"""KV numerics, pure functions: K or V (..., head_dim) -> stored codes + scales (+ zeros) -> floats.

Every row of the last dim (one batch, head, token) is quantized on its own, with groups along head_dim, so
quantizing a token alone (the cache, on insertion) and inside a whole sequence (the simulated path) give the
same bits. kv_fake_quantize is kv_dequantize(kv_quantize(x)): the simulated forward and the quantized cache
share these two functions, so they agree bit for bit by construction.

Storage per row (one batch, head, token) of K or V, head_dim D, G = D / group_size groups:
    codes   D * bits / 8 bytes   (4-bit codes two per byte; 5..7 bits packed densely when D % 8 == 0,
                                  else one byte per code; fp8 one byte)
    scales  G * itemsize(scale_dtype)
    zeros   G bytes (asymmetric int only: an integer code in 0..2^bits-1, as uint8)

    >>> kv = kv_quantize(k, KVCacheConfig(bits=4, group_size=32))      # k: (B, H, T, 64)
    >>> kv.codes.shape, kv.scale.shape      # (B, H, T, 32) uint8, (B, H, T, 2) float16
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.elements import TORCH_FP8
from ..core.formats import FORMATS, format_qparams, format_quantize
from ..core.packing import pack, unpack
from ..core.primitives import QParams, dequantize, grouped, n_groups, qparams, quantize, ungrouped
from ..util.checks import resolve_dtype
from .config import KVCacheConfig


class KVCodes(NamedTuple):
    """What a cache stores for K or V: all three share the leading dims (..., tokens) of the input."""

    codes: torch.Tensor  # (..., packed_width(bits, D)) uint8
    scale: torch.Tensor  # (..., G) scale_dtype
    zero: torch.Tensor | None  # (..., G) uint8 codes, asymmetric int only


def _packs_densely(bits: int, head_dim: int) -> bool:
    """Whether one row's codes pack on their own (no packing block straddles two rows)."""
    if bits == 8:
        return False  # already one byte per code
    return head_dim % (8 // bits) == 0 if 8 % bits == 0 else head_dim % 8 == 0


def packed_width(bits: int, head_dim: int) -> int:
    """Bytes of one row's codes."""
    return head_dim * bits // 8 if _packs_densely(bits, head_dim) else head_dim


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., D) -> (..., packed_width)."""
    d = codes.shape[-1]
    if not _packs_densely(bits, d):
        return codes
    return pack(codes, bits).reshape(*codes.shape[:-1], packed_width(bits, d))


def _unpack_rows(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    if not _packs_densely(bits, head_dim):
        return packed
    lead = packed.shape[:-1]
    n = head_dim * packed[..., 0].numel()
    return unpack(packed.reshape(-1), bits, n).reshape(*lead, head_dim)


def kv_token_nbytes(config: KVCacheConfig, head_dim: int) -> int:
    """Bytes stored per (batch, head, token) row of K or V: codes + scales (+ zeros)."""
    g = n_groups(head_dim, config.group_size)
    zero = g if (config.format == "int" and not config.symmetric) else 0
    return packed_width(config.bits, head_dim) + g * resolve_dtype(config.scale_dtype).itemsize + zero


def kv_quantize(x: torch.Tensor, config: KVCacheConfig) -> KVCodes:
    """Floats (..., D) -> KVCodes, per row with groups along the last dim (computed in fp32)."""
    if not config.enabled:
        raise ValueError("kv_quantize: this config has bits = 16 (off); there is nothing to quantize")
    xf = x.detach().float()
    scale_dtype = resolve_dtype(config.scale_dtype)
    if config.format == "int":
        p = qparams(xf, config.bits, config.group_size, config.symmetric, scale_dtype)
        q = quantize(xf, p, config.bits, config.group_size)  # integer values in a float tensor
        if config.symmetric:  # signed codes -> unsigned for packing; undone exactly in kv_dequantize
            q = q + 2 ** (config.bits - 1)
        zero = None if p.zero is None else p.zero.to(torch.uint8)
        return KVCodes(_pack_rows(q.to(torch.uint8), config.bits), p.scale, zero)
    fmt = FORMATS[config.format]
    p = format_qparams(xf, fmt, config.group_size, scale_dtype)
    return KVCodes(format_quantize(xf, p, fmt, config.group_size), p.scale, None)


def kv_dequantize(kv: KVCodes, config: KVCacheConfig, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """KVCodes -> floats (..., head_dim) in dtype, computed in fp32: (code - zero) * scale or fp8 value * scale."""
    codes = _unpack_rows(kv.codes, config.bits, head_dim)
    if config.format == "int":
        if config.symmetric:
            q = codes.to(torch.float32) - 2 ** (config.bits - 1)
            return dequantize(q, QParams(kv.scale, None), config.group_size, torch.float32).to(dtype)
        return dequantize(codes, QParams(kv.scale, kv.zero), config.group_size, torch.float32).to(dtype)
    # the fp8 code's exact value (torch's cast; elements.decode's table gives the same numbers, more slowly)
    values = codes.view(TORCH_FP8[FORMATS[config.format].element.name]).to(torch.float32)
    out = grouped(values, config.group_size) * kv.scale.to(torch.float32).unsqueeze(-1)
    return ungrouped(out, head_dim).to(dtype)


def kv_fake_quantize(x: torch.Tensor, config: KVCacheConfig) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype; x itself when the config is off. No gradient (evaluation only)."""
    if not config.enabled:
        return x
    return kv_dequantize(kv_quantize(x, config), config, x.shape[-1], x.dtype)
