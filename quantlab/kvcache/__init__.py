"""KV-cache quantization: K (after RoPE) and V per (batch, head, token), groups along head_dim; int4..8 or fp8.

- KVCacheConfig / kv_describe: the frozen config and its table label ("kv8 g64 asym").
- apply_kv_quant / remove_kv_quant / kv_quant: simulated, through transformers' attention interface
  (full-sequence forwards: the perplexity harness).
- QuantizedKVCache: a transformers Cache holding real codes + scales, for decoding; kv_cache_nbytes /
  kv_cache_float_nbytes: the bytes it holds vs a float DynamicCache.

    with kv_quant(model, KVCacheConfig(bits=4, group_size=64)):
        ppl = perplexity(model, windows)["ppl"]
        out = model(ids, use_cache=True, cache=QuantizedKVCache(cfg, model.config))
"""
from .attention import applied_kv_config, apply_kv_quant, kv_quant, remove_kv_quant
from .cache import QuantizedKVCache, QuantizedKVLayer, kv_cache_float_nbytes, kv_cache_nbytes
from .config import KVCacheConfig, kv_describe
from .numerics import KVCodes, kv_dequantize, kv_fake_quantize, kv_quantize, kv_token_nbytes

__all__ = [
    "KVCacheConfig", "KVCodes", "QuantizedKVCache", "QuantizedKVLayer", "applied_kv_config", "apply_kv_quant",
    "kv_cache_float_nbytes", "kv_cache_nbytes", "kv_dequantize", "kv_describe", "kv_fake_quantize", "kv_quant",
    "kv_quantize", "kv_token_nbytes", "remove_kv_quant",
]
