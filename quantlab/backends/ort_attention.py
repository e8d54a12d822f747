"""The attention the ONNX export traces: grouped-query attention that never repeats the KV cache.

transformers' SDPA and eager attention give every query head its own copy of its key/value head (repeat_kv, or
SDPA's enable_gqa), and the exporter writes that as Expand + Reshape + Transpose of the whole cache, every layer,
every step. At batch 8 on SmolLM2 (9 query heads on 3 KV heads) those copies took more of ORT's decode step than
its int4 linears did (reports/ort_decode_profile.md). Here each KV head's query heads are stacked along the query
axis instead: q (B, Hkv, r·T, D) @ kᵀ (B, Hkv, D, S), the additive mask broadcast over the r heads, softmax, @ v,
so the cache is read where it lies. Same math as eager_attention_forward (another summation order only).

    with grouped_attention_for_export(model):    # the model's attention swapped while torch.onnx.export traces it
        torch.onnx.export(...)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

NAME = "quantlab_grouped"


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, Hq, T, D), key / value (B, Hkv, S, D), an additive float mask
    broadcastable to (B, 1, T, S) -> (attention output (B, T, Hq, D), None). Query head h reads KV head h // r,
    as repeat_kv orders them."""
    if kwargs.get("softcap") is not None:
        raise ValueError("backend 'onnxruntime': attention logit softcapping is not exported")
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    r = hq // hkv
    scale = d ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(b, hkv, r * t, d), key.transpose(2, 3)) * scale  # (B, Hkv, r·T, S)
    if attention_mask is not None:
        scores = (scores.view(b, hkv, r, t, s) + attention_mask[:, :, None, :, :s]).view(b, hkv, r * t, s)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # (B, Hkv, r·T, D)
    return out.view(b, hq, t, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # an additive float mask, sliding windows included


@contextmanager
def grouped_attention_for_export(model: nn.Module):
    """The model (and its sub-configs) on grouped_attention inside the block, its own attention after."""
    _register()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}  # configs do not hash
    saved = [(c, c._attn_implementation) for c in configs.values()]
    try:
        for c, _ in saved:
            c._attn_implementation = NAME
        yield model
    finally:
        for c, impl in saved:
            c._attn_implementation = impl
