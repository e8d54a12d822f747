"""measure_latency(..., kv=config): prefill + greedy decode on a QuantizedKVCache, and the bytes it holds.

The model runs under apply_kv_quant(model, kv) for the whole measurement (restored after), each pass prefills
into a fresh cache (QuantizedKVCache; a float DynamicCache when kv is off), and the row adds
    kv_cache_mib        bytes the last pass's cache holds after its last decode step (codes + scales + zeros)
    kv_cache_float_mib  what a float DynamicCache in the model's dtype holds for the same tokens
    kv_config           kv_describe(kv), e.g. "kv4 g64 asym"
"""
from __future__ import annotations

from transformers import DynamicCache

from ..eval.latency import _measure
from .attention import kv_quant
from .cache import QuantizedKVCache, kv_cache_float_nbytes, kv_cache_nbytes
from .config import KVCacheConfig, kv_describe

MIB = 2**20


def kv_latency(model, prompt, kv: KVCacheConfig, new_tokens, warmup, repeats, min_time_s, compile, max_repeats,
               device) -> dict:
    """measure_latency's body with a KV config (see quantlab.eval.latency.measure_latency)."""
    if not isinstance(kv, KVCacheConfig):
        raise TypeError(f"kv must be a quantlab.kvcache.KVCacheConfig or None, got {type(kv).__name__}")
    made = []

    def make_cache():
        made.clear()  # keep only the newest: the bytes reported are the last pass's
        made.append(QuantizedKVCache(kv, model.config) if kv.enabled else DynamicCache(config=model.config))
        return made[0]

    with kv_quant(model, kv):
        out = _measure(model, prompt, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device,
                       make_cache)
    out["kv_config"] = kv_describe(kv)
    if made:
        out |= {"kv_cache_mib": kv_cache_nbytes(made[0]) / MIB, "kv_cache_float_mib": kv_cache_float_nbytes(made[0]) / MIB}
    made.clear()
    return out
