"""Prefill and per-token decode latency with warm-up, repeats and percentiles.

Greedy decoding with the KV cache, a fixed number of new tokens (no early stop).
On CUDA (and MPS) the clock is read only after the device is synchronized. Passes repeat until both
`repeats` passes and `min_time_s` seconds are done. Prefill computes the last position's
logits only where the model supports it (logits_to_keep=1, as generate() does), so a
(B, 512) prompt does not materialize B x 512 x vocab logits.

KV-cache quantization (quantlab.kvcache): with kv=KVCacheConfig(...), or on a model that already runs under
apply_kv_quant (the runner applies a run's kv_cache for its whole evaluation), each pass prefills into a fresh
QuantizedKVCache (bits 16: a float DynamicCache) and the row adds
    kv_cache_mib        bytes the last pass's cache holds after its last decode step (codes + scales + zeros)
    kv_cache_float_mib  what a float DynamicCache in the model's dtype holds for the same tokens
    kv_config           kv_describe(kv), e.g. "kv4 g64 asym"
A config applied here is removed again on return; one applied by the caller stays applied (its owner removes it).
"""
from __future__ import annotations

import inspect
import statistics
import time

import torch

from ..kvcache import (
    KVCacheConfig,
    QuantizedKVCache,
    applied_kv_config,
    kv_cache_float_nbytes,
    kv_cache_nbytes,
    kv_describe,
    kv_quant,
)
from ..util.device import synchronize

MIB = 2**20


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _cache_kwarg(model) -> str:
    """transformers >= 5.x names the KV cache `cache` (argument and output); older versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prefill_kwargs(model) -> dict:
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.inference_mode()
def _one_pass(model, prompt: torch.Tensor, new_tokens: int, device, call=None,
              make_cache=None) -> tuple[float, list[float]]:
    """One prefill + new_tokens greedy decode steps; `call` is the (maybe compiled) callable, `model` the module.
    make_cache: None (the model's default cache) or a function returning the cache object the prefill fills."""
    call = model if call is None else call  # not `or`: a compiled module has no truth value (len)
    given = {} if make_cache is None or not new_tokens else {_cache_kwarg(model): make_cache()}
    synchronize(device)
    t0 = time.perf_counter()
    # 0 new tokens: encoders, prefill only
    out = call(prompt, use_cache=True, **_prefill_kwargs(model), **given) if new_tokens else call(prompt)
    synchronize(device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    if not new_tokens:
        return prefill_ms, []
    cache_arg, step_ms = _cache_kwarg(model), []
    cache, nxt = getattr(out, cache_arg), out.logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = call(nxt, use_cache=True, **{cache_arg: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        synchronize(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        cache = getattr(out, cache_arg)
    return prefill_ms, step_ms


def measure_latency(
    model, prompt: torch.Tensor, new_tokens: int = 32, warmup: int = 1, repeats: int = 3,
    min_time_s: float = 0.0, compile: bool = False, max_repeats: int = 1000, kv=None,
) -> dict:
    """prompt: (B, N) token ids. Returns p50/p90 prefill ms and decode ms/token, tokens/s.

    Runs `warmup` untimed passes, then timed passes until at least `repeats` passes and
    `min_time_s` seconds (at most max_repeats passes). Each pass prefills the prompt and decodes
    exactly `new_tokens` greedy tokens per sequence. compile=True wraps the model in torch.compile.
    kv: a quantlab.kvcache.KVCacheConfig: decode on its quantized cache and add kv_cache_mib (bytes the last
    pass's cache holds) and kv_cache_float_mib (a float DynamicCache for the same tokens). None: the config the
    model already runs under (apply_kv_quant), if any, else plain decoding.

    >>> measure_latency(model, ids[:128].unsqueeze(0), new_tokens=16)["decode_ms_per_token_p50"]
    """
    if repeats < 1 or new_tokens < 0:
        raise ValueError(f"repeats must be >= 1 and new_tokens >= 0, got {repeats} and {new_tokens}")
    if warmup < 0 or min_time_s < 0:
        raise ValueError(f"warmup and min_time_s must be >= 0, got {warmup} and {min_time_s}")
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (batch, tokens) with tokens >= 1, got shape {tuple(prompt.shape)}")
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    model.eval()
    kv = applied_kv_config(model) if kv is None else kv
    if kv is not None:
        return _kv_measure(model, prompt, kv, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device)
    return _measure(model, prompt, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device)


def _measure(model, prompt, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device,
             make_cache=None) -> dict:
    call = torch.compile(model) if compile else model
    for _ in range(warmup):
        _one_pass(model, prompt, new_tokens if compile else min(new_tokens, 4), device, call, make_cache)
    prefill, steps, passes = [], [], []
    t_start = time.perf_counter()
    while len(prefill) < max_repeats and (len(prefill) < repeats or time.perf_counter() - t_start < min_time_s):
        p, s = _one_pass(model, prompt, new_tokens, device, call, make_cache)
        prefill.append(p)
        steps.extend(s)
        passes.append(len(s))
    out = {
        "prefill_tokens": prompt.shape[1],
        "batch_size": prompt.shape[0],
        "prefill_ms_p50": statistics.median(prefill),
        "prefill_ms_p90": _percentile(prefill, 0.9),
        "prefill_tokens_per_s": 1e3 * prompt.numel() / statistics.median(prefill),
        "latency_repeats": len(prefill),
        "latency_compile": compile,
        "cpu_threads": torch.get_num_threads(),
    }
    if not steps:
        return out
    decode_p50 = statistics.median(steps)
    return out | {
        "decode_tokens": new_tokens,
        "decode_tokens_generated": min(passes),  # per sequence, in every timed pass
        "decode_ms_per_token_p50": decode_p50,
        "decode_ms_per_token_p90": _percentile(steps, 0.9),
        "decode_tokens_per_s": 1e3 * prompt.shape[0] / decode_p50,
    }


def _kv_measure(model, prompt, kv: KVCacheConfig, new_tokens, warmup, repeats, min_time_s, compile, max_repeats,
                device) -> dict:
    """_measure on a fresh QuantizedKVCache per pass, under kv_quant(model, kv), + the last cache's bytes."""
    if not isinstance(kv, KVCacheConfig):
        raise TypeError(f"kv must be a quantlab.kvcache.KVCacheConfig or None, got {type(kv).__name__}")
    made = []

    def make_cache():
        from transformers import DynamicCache

        made.clear()  # keep only the newest: the bytes reported are the last pass's
        made.append(QuantizedKVCache(kv, model.config) if kv.enabled else DynamicCache(config=model.config))
        return made[0]

    with kv_quant(model, kv):  # a no-op where the caller applied this config already
        out = _measure(model, prompt, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device,
                       make_cache)
    out["kv_config"] = kv_describe(kv)
    if made:
        out |= {"kv_cache_mib": kv_cache_nbytes(made[0]) / MIB,
                "kv_cache_float_mib": kv_cache_float_nbytes(made[0]) / MIB}
    made.clear()
    return out
