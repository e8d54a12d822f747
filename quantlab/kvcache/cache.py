"""QuantizedKVCache: a transformers Cache that holds K/V as integer (or fp8) codes + scales (+ zeros).

Each new token's K (after RoPE; rotated first when rotate_k) and V is quantized once, on insertion, per
(batch, head, token) with groups along head_dim, and never again; update() returns every position dequantized,
in the model's dtype. There is no float residual window: every position, the prompt's included, is read back
from its codes, so decoding sees exactly what the simulated path (apply_kv_quant on a full forward) sees.
(transformers' QuantizedCache (KIVI-like) keeps the most recent `residual_length` tokens in float, quantizes
K per channel, and returns the prompt's float K/V at prefill: a different variant.)

Use it with the model under apply_kv_quant(model, same config): the attention wrapper rotates Q when rotate_k
and leaves the cache's K/V alone (no double rounding); without rotate_k the plain model works too.

    with kv_quant(model, cfg):
        out = model(ids, use_cache=True, cache=QuantizedKVCache(cfg, model.config))
    kv_cache_nbytes(out.cache), kv_cache_float_nbytes(out.cache)

Dequantizing the whole cache on every step is what a cache without fused kernels costs: it saves memory, not time.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..transforms.hadamard import hadamard_transform
from .attention import PREFIX, mark_quantized
from .config import KVCacheConfig
from .numerics import KVCodes, kv_dequantize, kv_quantize


def _cat(a: KVCodes | None, b: KVCodes) -> KVCodes:
    """Append b's tokens (dim -2 of every part) to a's."""
    if a is None:
        return b
    return KVCodes(*(None if x is None else torch.cat([x, y], dim=-2) for x, y in zip(a, b)))


def _map(kv: KVCodes | None, fn) -> KVCodes | None:
    return None if kv is None else KVCodes(*(None if x is None else fn(x) for x in kv))


def _nbytes(kv: KVCodes | None) -> int:
    return 0 if kv is None else sum(x.numel() * x.element_size() for x in kv if x is not None)


class QuantizedKVLayer(DynamicLayer):
    """One layer's K and V codes: KVCodes with parts (B, H_kv, T, ...) each."""

    is_croppable = True

    def __init__(self, kv_config: KVCacheConfig):
        super().__init__()
        self.kv_config = kv_config
        self.cumulative_length = 0
        self.k_codes: KVCodes | None = None
        self.v_codes: KVCodes | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.head_dim = key_states.shape[-1]
        self.kv_shape = tuple(key_states.shape[:2])  # (B, H_kv)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Quantize the new tokens' K/V once, append the codes, return all positions dequantized (marked)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if value_states.shape[-1] != self.head_dim:
            raise ValueError(f"QuantizedKVCache needs K and V of one head_dim, got {self.head_dim} and "
                             f"{value_states.shape[-1]}")
        cfg = self.kv_config
        if cfg.rotate_k:
            key_states = hadamard_transform(key_states)
        self.k_codes = _cat(self.k_codes, kv_quantize(key_states, cfg))
        self.v_codes = _cat(self.v_codes, kv_quantize(value_states, cfg))
        self.cumulative_length += key_states.shape[-2]
        keys = kv_dequantize(self.k_codes, cfg, self.head_dim, self.dtype)
        values = kv_dequantize(self.v_codes, cfg, self.head_dim, self.dtype)
        mark_quantized(keys, values, cfg)
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.k_codes = self.v_codes = None
        self.cumulative_length = 0

    def _apply(self, fn) -> None:
        self.k_codes, self.v_codes = _map(self.k_codes, fn), _map(self.v_codes, fn)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens (a negative count, as DynamicLayer takes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._apply(lambda x: x[..., :tokens_to_remove, :])
        self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.k_codes is not None:
            self._apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda x: x[indices, ...])

    def offload(self):
        self._apply(lambda x: x.to("cpu", non_blocking=True))

    def prefetch(self):
        self._apply(lambda x: x.to(self.device, non_blocking=True))

    def nbytes(self) -> int:
        """Bytes held: codes + scales (+ zeros) of K and V."""
        return _nbytes(self.k_codes) + _nbytes(self.v_codes)

    def float_nbytes(self) -> int:
        """Bytes a float DynamicLayer would hold for the same tokens (K and V in the model's dtype)."""
        if not self.is_initialized:
            return 0
        b, h = self.kv_shape if self.k_codes is None else tuple(self.k_codes.codes.shape[:2])
        return 2 * b * h * self.cumulative_length * self.head_dim * self.dtype.itemsize


class QuantizedKVCache(Cache):
    """One QuantizedKVLayer per decoder layer of `config` (the model's config; full-attention layers only).

    >>> cache = QuantizedKVCache(KVCacheConfig(bits=4, group_size=64), model.config)
    """

    def __init__(self, kv_config: KVCacheConfig, config):
        if not isinstance(kv_config, KVCacheConfig):
            raise TypeError(f"kv_config must be a KVCacheConfig, got {type(kv_config).__name__}")
        if not kv_config.enabled:
            raise ValueError("QuantizedKVCache needs bits < 16; for no KV quantization use a DynamicCache")
        text = config.get_text_config(decoder=True)
        other = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]) - {"full_attention"})
        if other:
            raise ValueError(f"QuantizedKVCache supports full-attention layers only; model type "
                             f"{getattr(text, 'model_type', '?')!r} has {', '.join(other)}")
        self.kv_config, self.model_config = kv_config, text
        super().__init__(layers=[QuantizedKVLayer(kv_config) for _ in range(text.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.kv_config.rotate_k and not str(self.model_config._attn_implementation).startswith(PREFIX):
            raise ValueError("a QuantizedKVCache with rotate_k stores K rotated: Q must be rotated too; apply "
                             "quantlab.kvcache.apply_kv_quant(model, the same config) first")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _float_layer_nbytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)


def kv_cache_nbytes(cache) -> int:
    """Bytes of K/V a cache holds now: codes + scales (+ zeros) for a QuantizedKVCache, the K and V tensors of a
    float cache (DynamicCache)."""
    return sum(layer.nbytes() if isinstance(layer, QuantizedKVLayer) else _float_layer_nbytes(layer)
               for layer in cache.layers)


def kv_cache_float_nbytes(cache) -> int:
    """Bytes a float DynamicCache (the model's dtype) would hold for the same tokens; for a float cache, its own."""
    return sum(layer.float_nbytes() if isinstance(layer, QuantizedKVLayer) else _float_layer_nbytes(layer)
               for layer in cache.layers)
