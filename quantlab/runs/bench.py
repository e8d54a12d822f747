"""Side-by-side speed and memory benchmark of precisions/backends on one model and device.

Used by experiments/smollm2_speed.py (CPU) and experiments/gpu_check.py (CUDA):

    cfgs = [BenchConfig("fp32"), BenchConfig("int8-wo", {"method": "rtn", "bits": 8}, backend="torchao"),
            BenchConfig("llamacpp-q4_0", {"method": "gguf", "type": "Q4_0"}, backend="llama.cpp")]
    models = {c.name: prepare(c, base_model, probe_ids, tmp / c.name, "smollm2-135m") for c in cfgs}
    rows = interleaved_latency(models, shapes=[(1, 512, 64), (8, 512, 64)], rounds=3)
    df = add_floor(speed_table(rows, "fp32"), measure_dram_bandwidth()["dram_bandwidth_gbs"], base_model.config)

Configurations are measured interleaved (round r measures every configuration once before round
r + 1), so a slow phase of a shared machine hits all of them alike; each number is the median over
rounds of one pass's p50. Backend "llama.cpp": the model written as a GGUF (backends/gguf_export.py) and timed
in llama.cpp (LlamaCppDecoder) on the same prompts. Each prepared configuration carries the weight bytes a decode
step reads (quantlab.eval.floor); add_floor turns them into the memory-bandwidth floor of its decode.
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..backends import export_model
from ..core.grid import grid_fields
from ..core.lifecycle import quantize
from ..core.registry import make_config
from ..eval.floor import decode_weight_bytes, gguf_decode_weight_bytes, kv_read_bytes, onnx_decode_weight_bytes
from ..eval.latency import measure_latency
from ..eval.memory import weight_stats
from ..util.checks import check_choice, check_dtype, resolve_dtype

BENCH_BACKENDS = ("torchao", "onnxruntime", "llama.cpp", "simulated")


@dataclass(frozen=True)
class BenchConfig:
    """name; quant: a method config dict (None = float); dtype of the float model; backend for quantized ones
    ("onnxruntime" and "llama.cpp" run float configurations too: the whole model in that runtime).
    torchao_config: instead of quantlab codes, quantize with torchao's own quantize_ (e.g. float8 on GPU)."""

    name: str
    quant: dict | None = None
    dtype: str = "float32"
    backend: str = "torchao"
    torchao_config: str | None = None  # "float8_dynamic"
    ort_accuracy_level: int = 0  # backend "onnxruntime": MatMulNBits accuracy_level (0 fp32, 4 int8 activations)
    note: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        check_dtype(f"{self.name}: dtype", self.dtype)
        check_choice(f"{self.name}: backend", self.backend, BENCH_BACKENDS)
        if self.torchao_config not in (None, "float8_dynamic"):
            raise ValueError(f"{self.name}: unknown torchao_config {self.torchao_config!r}; known: float8_dynamic")


def estimate_for(cfg: BenchConfig, model_config, batch: int, seq_len: int, summary: dict, device: str = "cpu",
                 overhead_mib: float | None = None):
    """quantlab.eval.estimate for a benchmark configuration as prepare() left it (summary: its export fields);
    None for backend "llama.cpp", which the estimate does not model."""
    from ..eval.estimate import estimate_memory

    if cfg.backend == "llama.cpp":
        return None
    if cfg.torchao_config:  # fp8: 1 byte per weight + a scale per row, roughly int8's layout
        bits, group_size, symmetric = 8, None, True
    elif cfg.quant:  # the effective weight grid, a base included (a W8A8 dynamic config says no bits itself)
        grid = grid_fields(make_config(cfg.quant), cfg.dtype)
        bits, group_size, symmetric = grid["bits"], grid["group_size"], grid["symmetric"]
    else:
        bits, group_size, symmetric = None, None, True
    kind = str(summary.get("backend", ""))  # "onnxruntime+float": some layers exported as fp32 MatMuls
    backend = next((b for b in ("onnxruntime", "torchao") if kind.startswith(b)), "simulated")
    return estimate_memory(model_config, bits=bits, group_size=group_size, seq_len=seq_len, batch=batch,
                           dtype=summary.get("export_dtype", cfg.dtype), symmetric=symmetric, backend=backend,
                           device=device, overhead_mib=overhead_mib)


def _torchao_float8(model) -> dict:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return {"backend": "torchao", "backend_kernels": "float8_dynamic (torchao quantize_, per-row)",
            "backend_note": "float8 weights and activations quantized by torchao itself (quantlab has no fp8 codes)"}


def prepare(cfg: BenchConfig, base_model, probe_ids: torch.Tensor | None = None, save_dir=None,
            base_model_id: str = "", source_gguf=None):
    """(model, summary): a copy of base_model in cfg.dtype, quantized and exported as cfg says; the summary
    carries decode_weight_bytes / decode_head_bytes (quantlab.eval.floor) and kv_element_bytes.

    save_dir: also save the frozen quantized model there (before export), for a memprobe subprocess; backends
    "onnxruntime" and "llama.cpp" write their graph / GGUF there. source_gguf (llama.cpp): the GGUF whose tokenizer
    the export copies (default: models.loading.source_gguf(base_model_id)).
    """
    model, summary = _prepare(cfg, base_model, probe_ids, save_dir, base_model_id, source_gguf)
    config = base_model.config
    if "gguf_path" in summary:
        read, kv_bytes = gguf_decode_weight_bytes(summary["gguf_path"]), 2  # llama.cpp's KV cache: F16
    elif "ort_model_path" in summary:
        read = onnx_decode_weight_bytes(summary["ort_model_path"], config.vocab_size, config.hidden_size)
        kv_bytes = 4  # ORT graphs are float32
    else:  # the KV cache is in the dtype the model computes in (int4 on CPU: bf16)
        read, kv_bytes = decode_weight_bytes(model), model.get_input_embeddings().weight.element_size()
    return model, summary | read | {"kv_element_bytes": kv_bytes}


def _prepare(cfg: BenchConfig, base_model, probe_ids, save_dir, base_model_id, source_gguf):
    model = copy.deepcopy(base_model).to(resolve_dtype(cfg.dtype)).eval()
    scheme = ", ".join(f"{k}={v}" for k, v in cfg.quant.items()) if cfg.quant else cfg.dtype
    if cfg.backend in ("onnxruntime", "llama.cpp"):  # float or quantized: the whole model in that runtime
        if cfg.quant is not None:
            quantize(model, make_config(cfg.quant))
        if save_dir is None:
            raise ValueError(f"{cfg.name}: backend {cfg.backend!r} writes its graph / GGUF to save_dir; pass one")
        if cfg.backend == "llama.cpp":
            return _prepare_llamacpp(cfg, model, probe_ids, Path(save_dir), base_model_id, source_gguf, scheme)
        from ..backends.ort import export_onnxruntime

        ort_model, summary = export_onnxruntime(model, Path(save_dir) / "model.onnx", probe_ids,
                                                cfg.ort_accuracy_level)
        return ort_model, summary | {"scheme": scheme}
    if cfg.torchao_config:
        return model, _torchao_float8(model) | {"scheme": cfg.torchao_config}
    if cfg.quant is None:
        return model, {"backend": "float", "scheme": cfg.dtype}
    config = make_config(cfg.quant)
    quantize(model, config)
    if save_dir is not None:
        from ..backends.serialize import save_quantized

        save_quantized(model, save_dir, config, base_model_id)
    summary = export_model(model, cfg.backend, probe_ids)
    return model, summary | {"scheme": scheme}


def _prepare_llamacpp(cfg, model, probe_ids, save_dir: Path, base_model_id, source_gguf, scheme):
    from ..backends import export_for_run
    from ..backends.llamacpp import llamacpp_cpu_features
    from ..models.loading import source_gguf as model_source_gguf

    if probe_ids is None:
        raise ValueError(f"{cfg.name}: backend 'llama.cpp' checks the GGUF's logits against the model; pass probe_ids")
    source = source_gguf or (model_source_gguf(base_model_id) if base_model_id else None)
    lm, summary = export_for_run(model, "llama.cpp", True, probe_ids, onnx_dir=save_dir, source_gguf=source,
                                 n_ctx=probe_ids.shape[-1])
    types = ", ".join(f"{k}:{v}" for k, v in json.loads(summary["gguf_types"]).items())  # "f32:61, q8_0:210"
    return LlamaCppDecoder(lm), summary | {"scheme": scheme, "backend_kernels": f"gguf {types}",
                                           "llamacpp_cpu_features": llamacpp_cpu_features()}


class LlamaCppDecoder:
    """A GGUF loaded once by llama.cpp (lm: export_llamacpp's LlamaCppCausalLM), timed the way
    eval.latency.measure_latency times a torch model: the same (B, N) prompts prefilled as B sequences in one
    llama_batch, then exactly new_tokens greedy steps of one llama_batch of B tokens (backends/llamacpp.py's
    batched decoding). Each call makes a fresh context (KV cache) sized for its prompts, outside the clock.

    >>> LlamaCppDecoder(lm).measure_latency(ids, 64, warmup=0, repeats=1)["decode_ms_per_token_p50"]
    """

    def __init__(self, lm):
        self.lm, self.config, self.threads = lm, lm.config, lm.threads

    def measure_latency(self, prompt: torch.Tensor, new_tokens: int, warmup: int = 1, repeats: int = 3,
                        min_time_s: float = 0.0) -> dict:
        from ..backends.llamacpp import LlamaCppContext, timed_pass

        ids = prompt.cpu().numpy().astype(np.int32)  # (B, N)
        b, n = ids.shape
        per_seq = -(-(n + new_tokens) // 256) * 256  # llama.cpp pads a sequence's context to 256 positions
        ctx = LlamaCppContext(self.lm.gguf, b * per_seq, b * n, b, self.threads)
        for _ in range(warmup):
            timed_pass(ctx, ids, min(new_tokens, 4))
        prefill, steps, t_start = [], [], time.perf_counter()
        while len(prefill) < repeats or time.perf_counter() - t_start < min_time_s:
            p, s = timed_pass(ctx, ids, new_tokens)
            prefill.append(p)
            steps += s
        decode_p50 = statistics.median(steps)
        return {"prefill_ms_p50": statistics.median(prefill), "prefill_ms_p90": float(np.percentile(prefill, 90)),
                "decode_ms_per_token_p50": decode_p50, "decode_ms_per_token_p90": float(np.percentile(steps, 90)),
                "decode_tokens_per_s": 1e3 * b / decode_p50, "cpu_threads": self.threads}


def _latency(model, prompt: torch.Tensor, new_tokens: int, warmup: int, min_time_s: float = 0.0) -> dict:
    """One measurement: the model's own measure_latency where it has one (LlamaCppDecoder), else eval.latency's."""
    own = getattr(model, "measure_latency", None)
    if own is not None:
        return own(prompt, new_tokens, warmup=warmup, repeats=1, min_time_s=min_time_s)
    return measure_latency(model, prompt, new_tokens, warmup=warmup, repeats=1, min_time_s=min_time_s)


def interleaved_latency(models: dict, shapes: list[tuple[int, int, int]], rounds: int = 3, warmup: int = 1,
                        min_time_s: float = 0.0, vocab_size: int | None = None, seed: int = 0,
                        progress: bool = True) -> list[dict]:
    """One row per (config, shape): medians over `rounds` interleaved passes.

    models: name -> (model, summary). shapes: (batch, prefill_tokens, decode_tokens). Prompts are
    seeded random token ids, the same for every configuration. progress=False: no progress bar.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab_size or next(iter(models.values()))[0].config.vocab_size
    prompts = {s: torch.randint(0, vocab, s[:2], generator=gen) for s in shapes}
    samples = {(n, s): [] for n in models for s in shapes}
    for name, (model, _) in models.items():  # warm-up once per configuration and shape
        for s in shapes:
            _latency(model, prompts[s][:, : min(32, s[1])], min(s[2], 4), warmup=warmup)
    for _ in tqdm(range(rounds), desc="rounds", disable=not progress):
        for s in shapes:
            for name, (model, _) in models.items():
                samples[(name, s)].append(_latency(model, prompts[s], s[2], warmup=0, min_time_s=min_time_s))
    rows = []
    for (name, s), runs in samples.items():
        model, summary = models[name]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        weight_mib = (summary.get("ort_model_mib") or summary.get("gguf_mib")  # ORT, llama.cpp: the file
                      or weight_stats(model)["weight_mib"])
        rows.append({
            "config": name, "batch_size": s[0], "prefill_tokens": s[1], "decode_tokens": s[2],
            "prefill_ms_p50": med("prefill_ms_p50"), "prefill_ms_p90": max(r["prefill_ms_p90"] for r in runs),
            "decode_ms_per_token_p50": med("decode_ms_per_token_p50"),
            "decode_ms_per_token_p90": med("decode_ms_per_token_p90"),
            "decode_tokens_per_s": med("decode_tokens_per_s"), "rounds": rounds,
            "cpu_threads": runs[0]["cpu_threads"], **summary, "weight_mib": weight_mib,
        })
    return rows


def speed_table(rows: list[dict], baseline: str) -> pd.DataFrame:
    """Rows -> DataFrame with prefill/decode speedups vs `baseline` at the same batch size (>1 = faster)."""
    df = pd.DataFrame(rows)
    base = df[df["config"] == baseline].set_index("batch_size")
    if base.empty:
        raise ValueError(f"baseline {baseline!r} not among the configurations: {', '.join(df['config'].unique())}")
    df["prefill_speedup"] = [base.loc[b, "prefill_ms_p50"] / v for b, v in zip(df["batch_size"], df["prefill_ms_p50"])]
    df["decode_speedup"] = [base.loc[b, "decode_ms_per_token_p50"] / v
                            for b, v in zip(df["batch_size"], df["decode_ms_per_token_p50"])]
    df["weight_ratio"] = df["weight_mib"] / float(base["weight_mib"].iloc[0])
    return df


def add_floor(df: pd.DataFrame, bandwidth_gbs: float, model_config) -> pd.DataFrame:
    """The memory-bandwidth floor of each row's decode step (quantlab.eval.floor), from its decode_weight_bytes,
    kv_element_bytes, batch and shape, and a measured read bandwidth in GB/s:

        floor_ms_per_token     decode_weight_bytes / bandwidth: no step can be faster (unless the weights fit a
                               cache); per token of each sequence, like decode_ms_per_token_p50, so at batch B one
                               read of the weights serves B tokens and the floor per generated token is 1/B of it
        decode_vs_floor        decode_ms_per_token_p50 / floor_ms_per_token (1 = at the floor)
        decode_kv_bytes        the KV cache a step also reads, at the mean context of the decode (prefill +
                               (decode + 1) / 2 positions), every sequence of the batch
        floor_kv_ms_per_token  (weights + KV cache) / bandwidth; decode_vs_floor_kv against it

    >>> add_floor(speed_table(rows, "fp32"), 22.4, model.config)["decode_vs_floor"]
    """
    if not bandwidth_gbs > 0:
        raise ValueError(f"bandwidth_gbs must be > 0, got {bandwidth_gbs}")
    df = df.copy()
    per_ms = bandwidth_gbs * 1e9 / 1e3  # bytes per millisecond
    context = df["prefill_tokens"] + (df["decode_tokens"] + 1) / 2
    df["decode_weight_mib"] = df["decode_weight_bytes"] / 2**20
    df["floor_ms_per_token"] = df["decode_weight_bytes"] / per_ms
    df["decode_vs_floor"] = df["decode_ms_per_token_p50"] / df["floor_ms_per_token"]
    df["decode_kv_bytes"] = [kv_read_bytes(model_config, c, int(b), int(e))
                             for c, b, e in zip(context, df["batch_size"], df["kv_element_bytes"])]
    df["floor_kv_ms_per_token"] = (df["decode_weight_bytes"] + df["decode_kv_bytes"]) / per_ms
    df["decode_vs_floor_kv"] = df["decode_ms_per_token_p50"] / df["floor_kv_ms_per_token"]
    df["dram_bandwidth_gbs"] = bandwidth_gbs
    return df


SPEED_COLUMNS = [
    ("config", "config", "{}"), ("backend", "backend", "{}"), ("backend_kernels", "kernels", "{}"),
    ("batch_size", "batch", "{}"), ("weight_mib", "weights MiB", "{:.1f}"),
    ("prefill_ms_p50", "prefill ms p50", "{:.1f}"), ("prefill_ms_p90", "p90", "{:.1f}"),
    ("prefill_speedup", "× prefill", "{:.2f}"),
    ("decode_ms_per_token_p50", "decode ms/tok p50", "{:.2f}"), ("decode_ms_per_token_p90", "p90", "{:.2f}"),
    ("decode_tokens_per_s", "tok/s", "{:.1f}"), ("decode_speedup", "× decode", "{:.2f}"),
    ("decode_weight_mib", "weights read/step MiB", "{:.1f}"), ("floor_ms_per_token", "floor ms/tok", "{:.2f}"),
    ("decode_vs_floor", "× floor", "{:.2f}"), ("decode_vs_floor_kv", "× floor+KV", "{:.2f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"), ("peak_rss_default_malloc_mib", "(default malloc)", "{:.0f}"),
    ("peak_vram_mib", "peak VRAM MiB", "{:.0f}"),
    ("est_total_mib", "estimate MiB", "{:.0f}"), ("est_error_pct", "est. error %", "{:+.1f}"),
    ("export_parity_layer_max_rel", "kernel parity (layer max rel)", "{:.1e}"),
    ("export_parity_logits_rel_rms", "logits parity (rel RMS)", "{:.1e}"), ("export_parity_ok", "parity ok", "{}"),
]
