"""llama.cpp's quantization types (GGML block formats) as quantlab grids: the contract every type implements.

A type quantizes rows of K floats in blocks of `block` weights (32 or 256), each block stored in `type_size`
bytes exactly as llama.cpp writes it in a GGUF file (ggml-common.h's block structs, little endian). A type is
five pure functions over blocks; x and imp are (n, block) float32, raw is (n, type_size) uint8:

    quantize(x, imp)      -> raw      llama.cpp's ggml_quantize_chunk, byte for byte (imp: its `quant_weights`,
                                      the importance of each weight's input column; None: the reference's
                                      unweighted path, which for some types differs from imp = ones)
    dequantize(raw)       -> x        gguf.quants.dequantize, bit for bit
    codes(raw)            -> (n, block) uint8   each weight's index into `levels`
    grid(raw)             -> (scale, offset), each (n, block) float32, such that
                                      dequantize(raw) == levels[codes(raw)] * scale + offset   exactly
    repack(raw, codes)    -> raw      the same block parameters (scales, mins) with other codes

`grid` and `repack` let GPTQ round column by column on a block's grid (fitted with `quantize` on the error-updated
weights, as GPTQModel does for q4_k) and store what it chose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Blocks = torch.Tensor  # (n, block) float32
Raw = torch.Tensor  # (n, type_size) uint8


@dataclass(frozen=True)
class GGMLType:
    """One llama.cpp quantization type. name: quantlab's format name (lower case, "q4_k"); gguf_id: its
    GGMLQuantizationType value in GGUF files; levels: the code -> level table (float32) grid() scales."""

    name: str
    gguf_id: int
    block: int
    type_size: int
    levels: torch.Tensor
    quantize: Callable[[Blocks, Blocks | None], Raw]
    dequantize: Callable[[Raw], Blocks]
    codes: Callable[[Raw], torch.Tensor]
    grid: Callable[[Raw], tuple[Blocks, Blocks]]
    repack: Callable[[Raw, torch.Tensor], Raw]
    summary: str = ""

    @property
    def bits_per_weight(self) -> float:
        """Bytes on disk per weight, in bits: Q4_K 4.5, Q6_K 6.5625, Q8_0 8.5."""
        return 8 * self.type_size / self.block

    @property
    def code_bits(self) -> int:
        """Bits of one code (the row's `bits` column): 4 for Q4_K and IQ4_XS, 6 for Q6_K."""
        return max(1, (len(self.levels) - 1).bit_length())
