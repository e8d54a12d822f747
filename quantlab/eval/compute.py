"""The compute side of a method's cost: the matmul FLOPs it runs and the rate this machine multiplies at.

    rate = measure_matmul_rate()                  # {"matmul_gflops": 121.3, "matmul_shape": "8192x576x1536", ...}
    flops = count_matmul_flops(lambda: quantize(model, cfg, calibration=calib, progress=False))
    achieved = flops / seconds / 1e9              # GFLOP/s, then / rate["matmul_gflops"]: the fraction of the rate

FLOPs are counted by torch.utils.flop_counter.FlopCounterMode: the matrix products torch runs (mm, addmm, bmm,
baddbmm, scaled-dot-product attention, convolutions), forward and backward, 2 per multiply-add. Two kinds torch 2.13's
counter misses are added here: the in-place products (`addmm_`, `baddbmm_`: GPTQ's Hessian accumulation) and the CPU
attention kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward, which F.scaled_dot_product_attention
runs on CPU, mask or not), counted as torch counts its CUDA kernels: every query against every key, the causal half
included, per query head (grouped-query attention's shared KV heads do not shrink the products). Elementwise work,
rank-1 updates (`addr_`), reductions, sorting and linear-algebra solves (Cholesky, triangular solves) are not
counted, so a method whose time goes there shows a low rate: the rate says how much of its time runs at matmul
speed, not that the rest is waste.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

# activation x weight shapes (tokens, in, out) of the calibration replays on a 576-wide model (SmolLM2's q/o and
# gate/up/down projections on 16 x 512 tokens): the rate a method's matmuls can reach at best on this machine
CALIBRATION_SHAPES = ((8192, 576, 1536), (8192, 1536, 576), (8192, 576, 576))


def measure_matmul_rate(shapes: tuple[tuple[int, int, int], ...] = CALIBRATION_SHAPES, repeats: int = 5,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """The best rate (GFLOP/s) of F.linear over `shapes`, each the median of `repeats` timed calls after a warm-up,
    at torch's current thread count: {"matmul_gflops", "matmul_shape", "matmul_gflops_by_shape"}."""
    gen = torch.Generator().manual_seed(0)
    by_shape = {}
    for t, k, n in shapes:
        x = torch.randn(t, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen).to(device, dtype)
        torch.nn.functional.linear(x, w)  # warm-up: kernel choice, first touch
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        by_shape[f"{t}x{k}x{n}"] = 2 * t * k * n / statistics.median(times) / 1e9
    best = max(by_shape, key=by_shape.get)
    return {"matmul_gflops": by_shape[best], "matmul_shape": best,
            "matmul_gflops_by_shape": " ".join(f"{s}:{v:.1f}" for s, v in by_shape.items())}


def _inplace_mm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _inplace_bmm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


def _attention_shape(query_shape, key_shape, value_shape) -> tuple[int, int, int, int, int]:
    """(batch x query heads, queries, keys, qk dim, v dim) of (..., heads, seq, dim) tensors."""
    *lead, s_q, d_qk = query_shape
    return math.prod(lead), s_q, key_shape[-2], d_qk, value_shape[-1]


def _cpu_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Scores q·kᵀ and probabilities·v (torch's sdpa_flop_count, which the CPU kernel lacks)."""
    bh, s_q, s_k, d_qk, d_v = _attention_shape(query_shape, key_shape, value_shape)
    return 2 * bh * s_q * s_k * (d_qk + d_v)


def _cpu_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                 **kwargs) -> int:
    """The scores recomputed, then dV, dP, dQ and dK (torch's sdpa_backward_flop_count)."""
    bh, s_q, s_k, d_qk, d_v = _attention_shape(query_shape, key_shape, value_shape)
    return 2 * bh * s_q * s_k * (3 * d_qk + 2 * d_v)


_ATEN = torch.ops.aten
MISSING_FLOP_FORMULAS = {
    _ATEN.addmm_: _inplace_mm_flop,
    _ATEN.baddbmm_: _inplace_bmm_flop,
    _ATEN._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flop,
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flop,
}


def count_matmul_flops(fn) -> tuple[int, object]:
    """(matmul FLOPs that fn() ran, fn's return value). Runs fn once under FlopCounterMode (with the formulas torch's
    counter misses, above), which slows torch ops: time fn in a separate call."""
    counter = FlopCounterMode(display=False, custom_mapping=MISSING_FLOP_FORMULAS)
    with counter:
        out = fn()
    return int(counter.get_total_flops()), out
