"""The registry of llama.cpp types (GGML_TYPES) and helpers over whole (rows, K) weights.

    GGML_TYPES["q4_k"].bits_per_weight          # 4.5
    raw = quantize_rows(w, "q4_k", importance)  # (out, in / 256 * 144) uint8: the bytes of a GGUF tensor
    w_hat = dequantize_rows(raw, "q4_k", in_features)

legacy.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), kquants.py (Q2_K .. Q6_K), iquants.py (IQ4_NL, IQ4_XS); the contract each
type implements is in types.py, llama.cpp's per-tensor recipes ("Q4_K_M") in recipes.py.
"""
from __future__ import annotations

import torch

from . import iquants, kquants, legacy
from ...util.device import single_threaded
from .types import GGMLType

GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (*legacy.TYPES, *kquants.TYPES, *iquants.TYPES)}
# the legacy types' weighted search scales the importance by sqrt(sigma2 + x²), sigma2 the mean x² of the whole row
ROW_SIGMA2 = {t.name for t in legacy.TYPES} - {"q8_0"}
GGML_BY_ID: dict[int, GGMLType] = {t.gguf_id: t for t in GGML_TYPES.values()}


def get_type(name: str) -> GGMLType:
    if name not in GGML_TYPES:
        raise ValueError(f"unknown llama.cpp type {name!r}; known: {', '.join(GGML_TYPES)}")
    return GGML_TYPES[name]


def check_row_size(t: GGMLType, in_features: int, where: str = "layer") -> None:
    """Blocks never straddle rows: a row of in_features weights must be whole blocks of t."""
    if in_features % t.block:
        fits = [n for n, other in GGML_TYPES.items() if in_features % other.block == 0]
        raise ValueError(f"{where}: {in_features} input columns are not a multiple of {t.name}'s block of "
                         f"{t.block}; types that fit: {', '.join(fits) or 'none'}")


def _blocks(x: torch.Tensor, t: GGMLType) -> torch.Tensor:
    return x.detach().float().contiguous().view(-1, t.block)


def quantize_rows(w: torch.Tensor, name: str, importance: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, K) floats -> (rows, K / block * type_size) uint8, llama.cpp's bytes for that tensor.

    importance (K,): llama.cpp's quant_weights (an imatrix row: the mean x² of each input column), or None."""
    t = get_type(name)
    rows, k = w.shape
    check_row_size(t, k)
    imp = None
    if importance is not None:
        if importance.shape != (k,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}; the weight has {k} input columns")
        imp = importance.detach().float().to(w.device).expand(rows, k)
        imp = _blocks(imp, t)
    with single_threaded(w.device):  # small elementwise ops: one thread is faster (util/device.py)
        if imp is not None and t.name in ROW_SIGMA2:
            sigma2 = legacy.row_sigma2(w.detach().float()).repeat_interleave(k // t.block)
            raw = t.quantize(_blocks(w, t), imp, sigma2=sigma2)
        else:
            raw = t.quantize(_blocks(w, t), imp)
    return raw.reshape(rows, k // t.block * t.type_size)


def codes_rows(raw: torch.Tensor, name: str, in_features: int) -> torch.Tensor:
    """(rows, bytes) uint8 -> (rows, in_features) uint8: each weight's index into the type's levels."""
    t = get_type(name)
    return t.codes(raw.reshape(-1, t.type_size)).reshape(raw.shape[0], in_features)


def has_min(t: GGMLType) -> bool:
    """Types whose blocks carry an offset (a min) besides the scale: llama.cpp's asymmetric grids."""
    return t.name in ("q4_1", "q5_1", "q2_k", "q4_k", "q5_k")


def dequantize_rows(raw: torch.Tensor, name: str, in_features: int) -> torch.Tensor:
    """Inverse of quantize_rows up to rounding: (rows, bytes) uint8 -> (rows, in_features) float32."""
    t = get_type(name)
    rows = raw.shape[0]
    with single_threaded(raw.device):
        return t.dequantize(raw.reshape(-1, t.type_size)).reshape(rows, in_features)


__all__ = ["GGML_BY_ID", "GGML_TYPES", "GGMLType", "check_row_size", "codes_rows", "has_min", "dequantize_rows", "get_type", "quantize_rows"]
