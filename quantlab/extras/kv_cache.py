"""`kv_cache = {...}`: quantize the keys and values attention uses (quantlab/kvcache), for the run's evaluation.

The runner owns it: applied once after the export, it holds for perplexity (simulated, through the attention
interface) and latency (measure_latency finds it applied and decodes on a QuantizedKVCache), and is removed when
the run's evaluation is done. Decoders only (metric "perplexity").
"""
from __future__ import annotations

import contextlib

from ..core.extras import AFTER_EXPORT, RunExtra, register_extra
from ..kvcache import KVCacheConfig, kv_describe, kv_quant


@register_extra
class KVCache(RunExtra):
    key = "kv_cache"
    config_cls = KVCacheConfig
    stage = AFTER_EXPORT
    metrics = ("perplexity",)

    def describe(self, config: KVCacheConfig) -> str:
        return kv_describe(config)

    def refusal(self, config: KVCacheConfig, backend: str) -> str | None:
        return "does not export a quantized KV cache (kv_cache = {...})" if backend in ("onnxruntime", "llama.cpp", "compressed-tensors") \
            else None

    def check_model_config(self, config: KVCacheConfig, model_config) -> None:
        heads = getattr(model_config, "num_attention_heads", None)
        head_dim = getattr(model_config, "head_dim", None) or (model_config.hidden_size // heads if heads else None)
        if head_dim:  # group_size must divide it (as apply_kv_quant checks on the loaded attention modules)
            config.check_head_dim(head_dim, getattr(model_config, "model_type", "model"))

    @contextlib.contextmanager
    def apply(self, model, config: KVCacheConfig):
        with kv_quant(model, config):  # removed on exit: the model is as it was before
            yield {"kv_cache": kv_describe(config)}
