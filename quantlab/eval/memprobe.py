"""Peak memory of one configuration, measured in a fresh subprocess.

A process's peak RSS never goes down, so each configuration runs in its own interpreter:
one run's allocations cannot pollute the next. Inside the child the peak is reset after the
model is loaded and freed heap is returned to the OS (malloc_trim; Linux /proc/self/clear_refs "5"
resets VmHWM), so peak_rss_mib is the peak of inference itself (weights + KV cache + activations +
framework); the peak while loading is reported too (load_peak_rss_mib). A short warm-up pass runs
before the reset, so one-time kernel initialization counts as loaded memory (loaded_rss_mib). On CUDA: reset_peak_memory_stats, then
max_memory_allocated / max_memory_reserved. The measured pass is a prefill of prefill_tokens and a
greedy decode of decode_tokens (KV cache, last-position prefill logits); decode_tokens = 0 is one
forward as perplexity runs it instead (every position's logits, no KV cache).

Allocator: by default the child runs glibc malloc with a fixed mmap threshold (64 KiB,
MALLOC_MMAP_THRESHOLD_), so every tensor-sized block is its own mapping and goes back to the OS
when freed: the peak then follows live tensors and repeats to the MiB. With glibc's default
(dynamic) threshold, freed blocks are kept in the heap and reused depending on history; the
same configuration's peak then varies by hundreds of MiB between runs (seen: fp32 batch 8,
+332 to +548 MiB above the loaded model). spec["allocator"] = "default" measures that way.

    row = measure_peak_memory({"model": "smollm2-135m", "prefill_tokens": 512, "decode_tokens": 64})
    row = measure_peak_memory({"quantized_dir": "out/w4", "backend": "torchao", "batch": 8})
    row = measure_peak_memory({"allocate_mib": 256})       # a known allocation, for testing
    row = isolated_run_memory(quantized, config, "smollm2-135m", seq_len=512)   # the runner's [eval] memory = "isolated"
"""
from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from ..util.memory import release_free_heap
from ..util.plugins import load_plugins, loaded_plugins

log = logging.getLogger(__name__)

MIB = 2**20
SPEC_KEYS = {"model", "quantized_dir", "onnx_dir", "dtype", "backend", "batch", "prefill_tokens", "decode_tokens",
             "threads", "device", "allocate_mib", "seed", "allocator", "cache_dir", "plugins"}
ALLOCATORS = {"fixed-mmap": {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}, "default": {}}


def _status_mib(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process' peak RSS (VmHWM) to its current RSS; False where the OS has no such switch."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak RSS since exec: VmHWM (ru_maxrss would carry the parent's peak over fork + exec on Linux)."""
    hwm = _status_mib("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / MIB if sys.platform == "darwin" else rss / 1024


def _load(spec: dict):
    """The model alone (no tokenizer, so float and quantized configurations carry the same framework)."""
    from transformers import AutoModelForCausalLM

    from ..backends.serialize import load_quantized
    from ..models.loading import resolve_model_path
    from ..util.checks import resolve_dtype

    device = spec.get("device", "cpu")
    for name, folder in spec.get("plugins", []):
        load_plugins([name], folder, where="memprobe")
    if spec.get("onnx_dir"):  # an ONNX Runtime session of an exported model (backends/ort.py)
        from ..backends.ort import load_ort

        return load_ort(spec["onnx_dir"]), {"backend": "onnxruntime"}
    if spec.get("quantized_dir"):
        model = load_quantized(spec["quantized_dir"], device=device)
    else:
        path = resolve_model_path(spec["model"], spec.get("cache_dir"))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(spec.get("dtype", "float32")))
        model = model.to(device).eval()
    backend = spec.get("backend", "simulated")
    summary = {"backend": "float" if not spec.get("quantized_dir") else backend}
    if spec.get("quantized_dir") and backend != "simulated":
        from ..backends import export_model

        summary = export_model(model, backend)
    return model, summary


def _measured_pass(model, prompt, decode_tokens: int) -> dict:
    """Prefill + greedy decode as measure_latency runs it; decode_tokens = 0: one forward as perplexity runs
    it (every position's logits, no KV cache)."""
    import torch

    from .latency import measure_latency

    if decode_tokens == 0:
        with torch.inference_mode():
            model(prompt.to(next(model.parameters()).device), use_cache=False)
        return {"batch_size": prompt.shape[0], "prefill_tokens": prompt.shape[1], "decode_tokens": 0}
    lat = measure_latency(model, prompt, decode_tokens, warmup=0, repeats=1)
    return {"batch_size": lat["batch_size"], "prefill_tokens": prompt.shape[1], "decode_tokens": decode_tokens}


def _child(spec: dict) -> dict:
    import gc

    import torch

    from .latency import measure_latency
    from .memory import weight_stats

    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    device = torch.device(spec.get("device", "cpu"))
    out = {"cpu_threads": torch.get_num_threads()}
    if "allocate_mib" in spec:
        gc.collect()
        reset = reset_peak_rss()
        base = _status_mib("VmRSS")
        x = torch.ones(int(spec["allocate_mib"] * MIB) // 4)  # float32, every page touched
        out.update(allocated_mib=x.numel() * 4 / MIB)
        del x
        return out | {"baseline_rss_mib": base, "peak_rss_mib": peak_rss_mib(), "peak_reset": reset}
    model, summary = _load(spec)
    out.update(summary)
    if not spec.get("onnx_dir"):  # an ORT session holds its weights outside PyTorch
        out.update({k: v for k, v in weight_stats(model).items() if k in ("weight_bytes", "weight_mib")})
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    batch, n = int(spec.get("batch", 1)), int(spec.get("prefill_tokens", 128))
    prompt = torch.randint(0, model.config.vocab_size, (batch, n), generator=gen)
    out["load_peak_rss_mib"] = peak_rss_mib()
    # warm-up: one short pass, so one-time kernel initialization and lazy imports count as loaded, not as inference
    measure_latency(model, prompt[:1, :8], 2, warmup=0, repeats=1)
    gc.collect()
    release_free_heap()  # loader garbage is not counted as inference
    out["loaded_rss_mib"] = _status_mib("VmRSS")
    out["peak_reset"] = reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out.update(_measured_pass(model, prompt, int(spec.get("decode_tokens", 32))))
    if device.type == "cuda":
        out.update(peak_vram_mib=torch.cuda.max_memory_allocated(device) / MIB,
                   peak_vram_reserved_mib=torch.cuda.max_memory_reserved(device) / MIB)
    return out | {"peak_rss_mib": peak_rss_mib()}


def measure_peak_memory(spec: dict, timeout_s: float = 900) -> dict:
    """Run one configuration in a fresh Python process; returns its memory row (see module doc)."""
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown memprobe key(s) {', '.join(unknown)}; valid: {', '.join(sorted(SPEC_KEYS))}")
    if "allocate_mib" not in spec and not (spec.get("model") or spec.get("quantized_dir") or spec.get("onnx_dir")):
        raise ValueError("memprobe spec needs 'model', 'quantized_dir', 'onnx_dir' or 'allocate_mib'")
    allocator = spec.get("allocator", "fixed-mmap")
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown memprobe allocator {allocator!r}; valid: {', '.join(ALLOCATORS)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | ALLOCATORS[allocator]
    root = str(Path(__file__).resolve().parents[2])  # this quantlab checkout, first on the child's path
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if "threads" in spec:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run([sys.executable, "-m", "quantlab.eval.memprobe", json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout_s, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memprobe child failed (exit {proc.returncode}) for {spec}: {proc.stderr[-1500:]}")
    return json.loads(lines[-1]) | {"allocator": allocator}


def _probe_fields(spec: dict, what: str) -> dict:
    """measure_peak_memory(spec) -> the result-row columns, with words saying what was measured."""
    m = measure_peak_memory(spec)
    text = (f"isolated process: load the {what}, then one forward of {spec['prefill_tokens']} tokens as perplexity "
            f"runs it (batch 1, every position's logits, no KV cache); peak RSS of that forward (model included), "
            f"{m['allocator']} allocator")
    if not m.get("peak_reset"):
        text += "; VmHWM could not be reset, so the peak includes loading"
    row = {"peak_rss_mib": m["peak_rss_mib"], "loaded_rss_mib": m["loaded_rss_mib"], "memory_probe": text}
    return row | {k: m[k] for k in ("peak_vram_mib", "peak_vram_reserved_mib") if k in m}


def isolated_run_memory(
    model, config, model_name: str, seq_len: int, *, quantized: bool = True, dtype: str = "float32",
    backend: str = "simulated", device: str = "cpu", cache_dir=None, threads: int | None = None,
) -> dict:
    """Peak memory of one forward of seq_len tokens of this run's model, measured in a fresh process.

    quantized: the frozen model is written with save_quantized to a temporary directory and the child
    loads it (load_quantized, then the run's backend); else (the baseline) the child loads model_name
    in dtype. Returns peak_rss_mib, loaded_rss_mib (on CUDA also peak_vram_*) and memory_probe (what
    was measured); a model save_quantized cannot write, or a failed child, gives only memory_probe
    saying so, never an exception: the run's other numbers stand.

    >>> isolated_run_memory(q, RTNConfig(bits=4), "smollm2-135m", seq_len=512, backend="torchao")["peak_rss_mib"]
    """
    from ..backends.serialize import save_quantized

    spec = {"prefill_tokens": seq_len, "decode_tokens": 0, "batch": 1, "backend": backend, "device": str(device)}
    if loaded_plugins():  # the child rebuilds the config from quant_config.json: outside methods must register
        spec["plugins"] = loaded_plugins()
    if threads is not None:
        spec["threads"] = threads
    try:
        if not quantized:
            spec |= {"model": model_name, "dtype": dtype} | ({"cache_dir": str(cache_dir)} if cache_dir else {})
            return _probe_fields(spec, f"float checkpoint ({dtype})")
        with tempfile.TemporaryDirectory(prefix="quantlab-memprobe-") as tmp:
            try:
                save_quantized(model, tmp, config, model_name)
            except (ValueError, TypeError) as e:
                return {"memory_probe": f"not measured: save_quantized cannot write this model ({e})"}
            return _probe_fields(spec | {"quantized_dir": tmp}, f"saved quantized model (backend {backend})")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("isolated memory probe failed: %s", e)
        return {"memory_probe": f"not measured: the probe process failed ({str(e)[:300]})"}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
