"""Prefill and per-token decode latency with warm-up, repeats and percentiles.

Greedy decoding with the KV cache, a fixed number of new tokens (no early stop).
On CUDA the clock is read only after torch.cuda.synchronize().
"""
from __future__ import annotations

import inspect
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _cache_kwarg(model) -> str:
    """transformers >= 5.x names the KV cache `cache` (argument and output); older versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def _one_pass(model, prompt: torch.Tensor, new_tokens: int, device) -> tuple[float, list[float]]:
    _sync(device)
    t0 = time.perf_counter()
    out = model(prompt, use_cache=True) if new_tokens else model(prompt)  # 0 new tokens: encoders, prefill only
    _sync(device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    if not new_tokens:
        return prefill_ms, []
    cache_arg, step_ms = _cache_kwarg(model), []
    cache, nxt = getattr(out, cache_arg), out.logits[:, -1:].argmax(-1)
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = model(nxt, use_cache=True, **{cache_arg: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        _sync(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        cache = getattr(out, cache_arg)
    return prefill_ms, step_ms


def measure_latency(model, prompt: torch.Tensor, new_tokens: int = 32, warmup: int = 1, repeats: int = 3) -> dict:
    """prompt: (B, N) token ids. Returns p50/p90 prefill ms and decode ms/token, tokens/s.

    >>> measure_latency(model, ids[:128].unsqueeze(0), new_tokens=16)["decode_ms_per_token_p50"]
    """
    if repeats < 1 or new_tokens < 0:
        raise ValueError(f"repeats must be >= 1 and new_tokens >= 0, got {repeats} and {new_tokens}")
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    model.eval()
    for _ in range(warmup):
        _one_pass(model, prompt, min(new_tokens, 4), device)
    prefill, steps = [], []
    for _ in range(repeats):
        p, s = _one_pass(model, prompt, new_tokens, device)
        prefill.append(p)
        steps.extend(s)
    out = {
        "prefill_tokens": prompt.shape[1],
        "batch_size": prompt.shape[0],
        "prefill_ms_p50": statistics.median(prefill),
        "prefill_ms_p90": _percentile(prefill, 0.9),
        "latency_repeats": repeats,
        "cpu_threads": torch.get_num_threads(),
    }
    if not steps:
        return out
    decode_p50 = statistics.median(steps)
    return out | {
        "decode_tokens": new_tokens,
        "decode_ms_per_token_p50": decode_p50,
        "decode_ms_per_token_p90": _percentile(steps, 0.9),
        "decode_tokens_per_s": 1e3 * prompt.shape[0] / decode_p50,
    }
