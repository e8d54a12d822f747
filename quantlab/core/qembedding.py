"""Input-embedding quantization: integer codes per vocabulary row with one symmetric scale per row.

At small model sizes the embedding dominates the weights (Gemma-3-270M: 262k x 640, 63% of them; SmolLM2-135M:
49k x 576, 21%), and weight-only methods leave it float. `embedding = { bits = 8 }` on a run stores it as codes
(int8 storage, bits 2..8) + a scale per row (absmax / (2^(bits-1) - 1), fp16 by default), the per-row (per output
channel) symmetric min-max rule of `rtn` with group_size = None. A lookup dequantizes only the rows it reads.

A tied output head (the same tensor as the embedding) reads the same codes and scales: its logits are
x @ dequant(W)ᵀ, computed over chunks of vocabulary rows so no float copy of the whole matrix is held (one
chunk's dequantized rows at a time). An untied head stays as it is.

    from quantlab.core.qembedding import EmbeddingQuantConfig, quantize_embedding
    facts = quantize_embedding(model, EmbeddingQuantConfig(bits=8))   # {"embedding_quant": "emb8 per-row", ...}
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..util.checks import check_dtype, check_int
from .primitives import dequantize, qparams, quantize, sqnr_db

SCALE_DTYPES = ("float16", "bfloat16", "float32")
HEAD_CHUNK_ROWS = 16384  # vocabulary rows dequantized at a time by a tied head (16k x 640 fp32: 40 MiB)


@dataclass(frozen=True)
class EmbeddingQuantConfig:
    """bits: 2..8 (codes stored as int8); scale_dtype: one scale per vocabulary row."""

    bits: int = 8
    scale_dtype: str = "float16"

    def __post_init__(self):
        check_int("embedding bits", self.bits, 2, 8)
        check_dtype("embedding scale_dtype", self.scale_dtype, SCALE_DTYPES)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"emb{self.bits} per-row" + ("" if self.scale_dtype == "float16" else f" {self.scale_dtype} scales")


class QuantEmbedding(nn.Module):
    """An embedding held as int8 codes (V, H) + scales (V, 1); forward = the looked-up rows dequantized
    (times the model's embedding scale where the original module has one, as Gemma's does)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, padding_idx: int | None,
                 embed_scale: torch.Tensor | None):
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("embed_scale", embed_scale, persistent=False)  # None: no scaling
        self.dtype, self.padding_idx = dtype, padding_idx
        self.num_embeddings, self.embedding_dim = codes.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.codes).to(self.dtype) * F.embedding(input_ids, self.scale).to(self.dtype)
        return out if self.embed_scale is None else out * self.embed_scale.to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix (a float copy, made on each access: for code that inspects the weight)."""
        return self.codes.to(self.dtype) * self.scale.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, codes={self.codes.dtype}, scale={self.scale.dtype}"


class QuantTiedHead(nn.Module):
    """The output head of a tied model reading a QuantEmbedding's codes and scales (the same tensors)."""

    def __init__(self, embedding: QuantEmbedding, bias: torch.Tensor | None):
        super().__init__()
        self.codes, self.scale, self.dtype = embedding.codes, embedding.scale, embedding.dtype  # shared, not copied
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = self.codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, HEAD_CHUNK_ROWS):
            rows = slice(start, start + HEAD_CHUNK_ROWS)
            w = self.codes[rows].to(x.dtype) * self.scale[rows].to(x.dtype)
            out[..., rows] = F.linear(x, w, None if self.bias is None else self.bias[rows])
        return out

    @property
    def weight(self) -> torch.Tensor:
        return self.codes.to(self.dtype) * self.scale.to(self.dtype)


def quantize_embedding(model: nn.Module, config: EmbeddingQuantConfig) -> dict:
    """Replace the model's input embedding (and a head tied to it) by their quantized form; returns row facts:
    embedding_quant (the label), embedding_head_tied (the head reads the same codes), embedding_sqnr_db."""
    if not isinstance(config, EmbeddingQuantConfig):
        raise TypeError(f"config must be an EmbeddingQuantConfig, got {type(config).__name__}")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"embedding quantization needs a model whose get_input_embeddings() is an nn.Embedding; "  # noqa: TRY004
                         f"{type(model).__name__} has {type(emb).__name__}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is not None and head.weight is emb.weight
    w = emb.weight.detach()
    p = qparams(w, config.bits, None, symmetric=True, scale_dtype=getattr(torch, config.scale_dtype))
    codes = quantize(w, p, config.bits, None).to(torch.int8)
    embed_scale = getattr(emb, "embed_scale", None)
    qemb = QuantEmbedding(codes, p.scale, w.dtype, emb.padding_idx,
                          embed_scale.detach().clone() if isinstance(embed_scale, torch.Tensor) else None)
    sqnr = sqnr_db(w.float(), dequantize(codes, p, None).float())
    model.set_input_embeddings(qemb)
    if tied:
        model.set_output_embeddings(QuantTiedHead(qemb, getattr(head, "bias", None)))
    return {"embedding_quant": config.describe(), "embedding_head_tied": tied, "embedding_sqnr_db": sqnr}
