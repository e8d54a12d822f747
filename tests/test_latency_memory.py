"""Latency harness (percentiles, token counts, batch, minimum time) and subprocess peak-memory probe."""
from __future__ import annotations

import time

import pytest
import torch

import quantlab
from quantlab.backends.serialize import save_quantized
from quantlab.eval import measure_latency
from quantlab.eval.memprobe import measure_peak_memory


def _prompt(b, t, seed=0):
    return torch.randint(0, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def test_latency_passes_tokens_and_batch(tiny_model):
    model, _ = tiny_model
    shapes = []  # what each forward received: the whole batch, a prefill then one-token steps
    hook = model.register_forward_pre_hook(lambda m, args, kw: shapes.append(tuple(args[0].shape)), with_kwargs=True)
    try:
        r = measure_latency(model, _prompt(3, 12), new_tokens=7, warmup=1, repeats=4)
    finally:
        hook.remove()
    # warm-up: prefill + min(7, 4) steps; then 4 timed passes of prefill + exactly 7 steps (no early stop)
    assert shapes == [(3, 12)] + [(3, 1)] * 4 + ([(3, 12)] + [(3, 1)] * 7) * 4
    assert r["decode_tokens"] == r["decode_tokens_generated"] == 7 and r["batch_size"] == 3
    assert r["latency_repeats"] == 4 and r["cpu_threads"] == torch.get_num_threads()
    assert r["decode_tokens_per_s"] == pytest.approx(1e3 * 3 / r["decode_ms_per_token_p50"])
    assert r["prefill_tokens_per_s"] == pytest.approx(1e3 * 36 / r["prefill_ms_p50"])


def test_latency_repeats_until_the_minimum_time(tiny_model):
    model, _ = tiny_model
    t0 = time.perf_counter()
    r = measure_latency(model, _prompt(1, 8), new_tokens=2, warmup=0, repeats=1, min_time_s=0.5)
    assert r["latency_repeats"] > 1 and time.perf_counter() - t0 >= 0.5
    few = measure_latency(model, _prompt(1, 8), new_tokens=2, warmup=0, repeats=2)
    assert few["latency_repeats"] == 2  # without a minimum time: exactly the requested repeats


def test_latency_bad_inputs(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="warmup and min_time_s must be >= 0, got 1 and -1"):
        measure_latency(model, _prompt(1, 8), min_time_s=-1)
    with pytest.raises(ValueError, match=r"prompt must be \(batch, tokens\)"):
        measure_latency(model, torch.tensor([1, 2, 3]))


def test_latency_on_exported_model_runs_the_kernels(tiny_model_dir):
    from quantlab.backends import export_model
    from quantlab.backends.modules import TorchaoLinear

    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(model, quantlab.RTNConfig(bits=4, group_size=32))
    export_model(model, "torchao")
    exported = [m for m in model.modules() if isinstance(m, TorchaoLinear)]
    calls = []
    hooks = [m.register_forward_hook(lambda m, a, y: calls.append(tuple(y.shape[:2]))) for m in exported]
    try:
        r = measure_latency(model, _prompt(2, 16), new_tokens=5, repeats=2)
    finally:
        for h in hooks:
            h.remove()
    assert len(exported) == 14 and r["decode_tokens_generated"] == 5
    # what was timed ran torchao's kernels: 14 layers x (warm-up 1 + 4 forwards, then 2 x (1 + 5))
    assert len(calls) == 14 * (5 + 2 * 6) and calls.count((2, 16)) == 14 * 3


@pytest.mark.parametrize("allocator", ["fixed-mmap", "default"])
def test_peak_memory_of_a_known_allocation_within_10_percent(allocator):
    r = measure_peak_memory({"allocate_mib": 256, "allocator": allocator})
    assert r["peak_reset"], "VmHWM could not be reset here"
    assert r["allocator"] == allocator
    assert r["peak_rss_mib"] - r["baseline_rss_mib"] == pytest.approx(256, rel=0.10)


def test_peak_memory_of_a_quantized_model_in_a_subprocess(tiny_model_dir, tmp_path):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config = quantlab.RTNConfig(bits=8)
    quantlab.quantize(model, config)
    save_quantized(model, tmp_path / "q", config, str(tiny_model_dir))
    r = measure_peak_memory({"quantized_dir": str(tmp_path / "q"), "backend": "torchao", "batch": 2,
                             "prefill_tokens": 16, "decode_tokens": 3, "threads": 1})
    assert r["backend"] == "torchao" and r["cpu_threads"] == 1 and r["decode_tokens"] == 3
    assert r["batch_size"] == 2 and r["prefill_tokens"] == 16 and r["peak_reset"]
    # the subprocess loaded these codes and exported them: its weight bytes are those of the same export here
    from quantlab.backends import export_model
    from quantlab.backends.serialize import load_quantized

    here = load_quantized(tmp_path / "q")
    export_model(here, "torchao")
    assert r["weight_bytes"] == quantlab.weight_stats(here)["weight_bytes"]
    assert r["backend_kernels"] == "int8_weight_only:14" and r["loaded_rss_mib"] > 100  # torch alone is > 100 MiB
    # inference of this tiny model (KV cache of 2 x 19 tokens) adds little over the loaded state: measured 0.2 MiB
    assert r["peak_rss_mib"] - r["loaded_rss_mib"] < 32


def test_memprobe_rejects_bad_specs():
    with pytest.raises(ValueError, match="unknown memprobe key"):
        measure_peak_memory({"allocate": 1})
    with pytest.raises(ValueError, match="needs 'model', 'quantized_dir', 'onnx_dir' or 'allocate_mib'"):
        measure_peak_memory({"batch": 2})
    with pytest.raises(ValueError, match="unknown memprobe allocator 'jemalloc'; valid: fixed-mmap, default"):
        measure_peak_memory({"allocate_mib": 1, "allocator": "jemalloc"})


@pytest.mark.slow
def test_compiled_latency_matches_token_count(tiny_model):
    model, _ = tiny_model
    r = measure_latency(model, _prompt(1, 8), new_tokens=3, warmup=1, repeats=1, compile=True)
    assert r["latency_compile"] and r["decode_tokens_generated"] == 3
