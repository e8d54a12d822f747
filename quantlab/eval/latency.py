"""Prefill and per-token decode latency with warm-up, repeats and percentiles.

Greedy decoding with the KV cache, a fixed number of new tokens (no early stop).
On CUDA (and MPS) the clock is read only after the device is synchronized. Passes repeat until both
`repeats` passes and `min_time_s` seconds are done. Prefill computes the last position's
logits only where the model supports it (logits_to_keep=1, as generate() does), so a
(B, 512) prompt does not materialize B x 512 x vocab logits.

With kv=KVCacheConfig(...) (quantlab.kvcache) the model runs under apply_kv_quant and decodes on a
QuantizedKVCache (bits 16: a float DynamicCache), and the row adds the cache's bytes after the last pass.
"""
from __future__ import annotations

import inspect
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # Metal queues kernels asynchronously too
        torch.mps.synchronize()


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
    _sync(device)
    t0 = time.perf_counter()
    # 0 new tokens: encoders, prefill only
    out = call(prompt, use_cache=True, **_prefill_kwargs(model), **given) if new_tokens else call(prompt)
    _sync(device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    if not new_tokens:
        return prefill_ms, []
    cache_arg, step_ms = _cache_kwarg(model), []
    cache, nxt = getattr(out, cache_arg), out.logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = call(nxt, use_cache=True, **{cache_arg: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        _sync(device)
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
    kv: a quantlab.kvcache.KVCacheConfig (None: as before): decode on its quantized cache and add kv_cache_mib
    (bytes the last pass's cache holds) and kv_cache_float_mib (a float DynamicCache for the same tokens).

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
    if kv is not None:
        from ..kvcache.latency import kv_latency

        return kv_latency(model, prompt, kv, new_tokens, warmup, repeats, min_time_s, compile, max_repeats, device)
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
