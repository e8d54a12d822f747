"""quantlab's frozen codes in ONNX Runtime's MatMulNBits layout, and back (pure functions).

MatMulNBits (com.microsoft) stores W (N, K) as
- B (N, k_blocks, block_size * bits / 8) uint8: each row's codes, block by block, packed low bits first
  (two 4-bit codes per byte, the even element in the low nibble): quantlab's core.packing order, row by row;
- scales (N * k_blocks,) in the activation dtype;
- zero_points (N, ceil(k_blocks * bits / 8)) uint8, packed the same way;
and computes Y = A @ ((B - zero) * scale)ᵀ. block_size is a power of two >= 16.

quantlab's unsigned codes u = q - qmin with zero_u (asymmetric) or 2^(bits-1) (symmetric) are exactly that
form. Per-channel layers (no groups) repeat their one scale and zero over the row's blocks, which changes no
value; a K that is not a multiple of the block is padded with the zero point's code (dequantizes to 0).

    packed, scales, zeros, block = pack_matmul_nbits(codes, scale, zero_u, bits=4, group_size=64)
    w = dequantize_matmul_nbits(packed, scales, zeros, K, N, 4, block)     # == the layer's dequantized weight
"""
from __future__ import annotations

import math

import torch

from ..core import packing

MATMUL_NBITS_BITS = (4, 8)  # what ORT's CPU MatMulNBits kernel takes and quantlab exports


def block_size_for(group_size: int | None, k: int) -> int | None:
    """MatMulNBits block for a layer: its group (a power of two >= 16), or for per-channel layers the largest
    power of two in 16..256 that divides K (else 32, K padded); None where the group cannot map."""
    if group_size is None:
        return next((b for b in (256, 128, 64, 32, 16) if k % b == 0), 32)
    if group_size >= 16 and group_size & (group_size - 1) == 0:
        return group_size
    return None


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, M) unsigned codes -> (N, ceil(M * bits / 8)) uint8, each row packed alone, low bits first."""
    n, m = codes.shape
    width = math.ceil(m * bits / 8)
    per_row = math.ceil(m * bits / 8) * 8 // bits  # codes per row, the tail padded to a whole byte
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, per_row - m))
    return packing.pack(padded, bits).view(n, width)


def pack_matmul_nbits(codes: torch.Tensor, scale: torch.Tensor, zero_u: torch.Tensor | None, bits: int,
                      group_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """codes (N, K) uint8 in [0, 2^bits); scale (N, G); zero_u (N, G) or None (symmetric: 2^(bits-1)).

    Returns (B (N, k_blocks, block*bits/8) uint8, scales (N*k_blocks,) float32, zero_points uint8, block)."""
    if bits not in MATMUL_NBITS_BITS:
        raise ValueError(f"MatMulNBits export takes bits in {MATMUL_NBITS_BITS}, got {bits}")
    n, k = codes.shape
    block = block_size_for(group_size, k)
    if block is None:
        raise ValueError(f"group_size {group_size}: MatMulNBits blocks are powers of two >= 16")
    k_blocks = math.ceil(k / block)
    zero = zero_u if zero_u is not None else torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
    if group_size is None:  # one scale per row: repeat it over the row's blocks
        scale, zero = scale.reshape(n, 1).expand(n, k_blocks), zero.reshape(n, 1).expand(n, k_blocks)
    zero = zero.reshape(n, k_blocks).to(torch.uint8)
    pad = k_blocks * block - k
    if pad:  # the zero point's code: the padded weights dequantize to exactly 0
        fill = zero[:, -1:].expand(n, pad)
        codes = torch.cat([codes.to(torch.uint8), fill], dim=1)
    b = _pack_rows(codes, bits).view(n, k_blocks, block * bits // 8)
    scales = scale.reshape(n, k_blocks).float().reshape(-1).contiguous()
    return b.contiguous(), scales, _pack_rows(zero, bits).reshape(-1).contiguous(), block


def dequantize_matmul_nbits(b: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, n: int, bits: int,
                            block: int) -> torch.Tensor:
    """The float32 weight (N, K) MatMulNBits computes with: (code - zero) * scale, per block."""
    k_blocks = math.ceil(k / block)
    codes = packing.unpack(b.reshape(-1), bits, n * k_blocks * block).view(n, k_blocks, block)
    zero_width = math.ceil(k_blocks * bits / 8)
    zero = packing.unpack(zeros.reshape(n, zero_width).reshape(-1), bits, n * zero_width * 8 // bits)
    zero = zero.view(n, -1)[:, :k_blocks]
    w = (codes.float() - zero.float().unsqueeze(-1)) * scales.view(n, k_blocks, 1).float()
    return w.reshape(n, k_blocks * block)[:, :k]
