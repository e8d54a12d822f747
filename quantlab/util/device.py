"""Device helpers every room may use: wait for a device's queued work, and time a matmul per dtype.

>>> synchronize(torch.device("cpu"))              # a no-op on CPU; CUDA / MPS wait for their queues
>>> matmul_ms(torch.bfloat16, torch.device("cpu")) / matmul_ms(torch.float32, torch.device("cpu"))
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_ms(dtype: torch.dtype, device: torch.device, size: int = 512, budget_s: float = 0.3) -> float:
    """Median time of one (size x size) @ (size x size) matmul in `dtype`, repeated for ~budget_s (3..50 times).

    On CPU with one thread (restored after): the dtype ratio is what the check needs, and a thread pool on a
    busy machine times the scheduler instead (seen here: 8 / 16 / 32 ms steps for any size and dtype)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        a @ b  # warm-up (kernel selection, first-touch)
        synchronize(device)
        times, start = [], time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
            t0 = time.perf_counter()
            a @ b
            synchronize(device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(times)


@contextlib.contextmanager
def single_threaded(device: torch.device | str = "cpu"):
    """One CPU thread inside the block (restored after): many small elementwise ops (the block-by-block quantizer
    ports of core/ggml) run several times faster than with a thread pool, which on a busy 2-core machine times the
    scheduler (seen here: 50x slower with 2 threads while another job held the cores). Not thread-safe: torch's
    thread count is process-wide. A no-op off CPU or at one thread already."""
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


SLOW_BF16_RATIO = 2.0  # a CPU whose bf16 matmul takes this many times the fp32 one has no native bf16 (AVX512_BF16/AMX)


def bf16_slowdown(device: torch.device) -> float | None:
    """On CPU: a bf16 matmul's time over an fp32 one's (~0.2 s of probing; measured ~12x on an emulated AVX2 CPU,
    below 1 with AVX512_BF16 / AMX); None on other devices."""
    if device.type != "cpu":
        return None
    return matmul_ms(torch.bfloat16, device, budget_s=0.1) / matmul_ms(torch.float32, device, budget_s=0.1)
