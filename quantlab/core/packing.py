"""Dense bit packing of unsigned integer codes into uint8 bytes.

b-bit codes take exactly ceil(N * b / 8) bytes: 3-bit weights really cost 3 bits.
Eight b-bit codes fill exactly b bytes, so codes are packed eight at a time:
code i of a block occupies bits [i*b, (i+1)*b) of a little-endian 8b-bit word.
"""
from __future__ import annotations

import math

import torch


def packed_nbytes(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


def _word_dtype(bits: int) -> torch.dtype:
    return torch.int32 if 8 * bits <= 31 else torch.int64


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (any shape, values < 2**bits) -> flat uint8 tensor of packed_nbytes(numel, bits).

    >>> unpack(pack(torch.tensor([5, 1, 7]), 3), 3, 3).tolist() == [5, 1, 7]
    """
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    if 8 % bits == 0:  # 1, 2, 4 bits: whole codes per byte, uint8 arithmetic only
        per = 8 // bits
        blocks = torch.nn.functional.pad(flat, (0, (-n) % per)).view(-1, per)
        out = blocks[:, 0].clone()
        for i in range(1, per):
            out |= blocks[:, i] << (bits * i)
        return out
    dt = _word_dtype(bits)
    blocks = torch.nn.functional.pad(flat, (0, (-n) % 8)).view(-1, 8).to(dt)  # (M, 8)
    word = blocks[:, 0].clone()
    for i in range(1, 8):
        word |= blocks[:, i] << (bits * i)
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], dim=1).to(torch.uint8)  # (M, bits)
    return out.reshape(-1)[: packed_nbytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of pack: flat uint8 -> (numel,) uint8 codes."""
    if bits == 8:
        return packed[:numel]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        parts = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
        return torch.stack(parts, dim=1).reshape(-1)[:numel]
    dt = _word_dtype(bits)
    raw = torch.nn.functional.pad(packed, (0, (-packed.numel()) % bits)).view(-1, bits).to(dt)
    word = raw[:, 0].clone()
    for j in range(1, bits):
        word |= raw[:, j] << (8 * j)
    codes = torch.stack([(word >> (bits * i)) & mask for i in range(8)], dim=1)  # (M, 8)
    return codes.reshape(-1)[:numel].to(torch.uint8)
