"""Side-by-side speed and memory benchmark of precisions/backends on one model and device.

Used by experiments/smollm2_speed.py (CPU) and experiments/gpu_check.py (CUDA):

    cfgs = [BenchConfig("fp32"), BenchConfig("int8-wo", {"method": "rtn", "bits": 8}, backend="torchao")]
    models = {c.name: prepare(c, base_model, device) for c in cfgs}
    rows = interleaved_latency(models, shapes=[(1, 512, 64), (8, 512, 64)], rounds=3)
    df = speed_table(rows)

Configurations are measured interleaved (round r measures every configuration once before round
r + 1), so a slow phase of a shared machine hits all of them alike; each number is the median over
rounds of one pass's p50.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..backends import export_model
from ..core.grid import grid_fields
from ..core.lifecycle import quantize
from ..core.registry import make_config
from ..eval.latency import measure_latency
from ..eval.memory import weight_stats
from ..util.checks import check_dtype, resolve_dtype


@dataclass(frozen=True)
class BenchConfig:
    """name; quant: a method config dict (None = float); dtype of the float model; backend for quantized ones.
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
        if self.torchao_config not in (None, "float8_dynamic"):
            raise ValueError(f"{self.name}: unknown torchao_config {self.torchao_config!r}; known: float8_dynamic")


def estimate_for(cfg: BenchConfig, model_config, batch: int, seq_len: int, summary: dict, device: str = "cpu",
                 overhead_mib: float | None = None):
    """quantlab.eval.estimate for a benchmark configuration as prepare() left it (summary: its export fields)."""
    from ..eval.estimate import estimate_memory

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
            base_model_id: str = ""):
    """(model, summary): a copy of base_model in cfg.dtype, quantized and exported as cfg says.

    save_dir: also save the frozen quantized model there (before export), for a memprobe subprocess.
    """
    model = copy.deepcopy(base_model).to(resolve_dtype(cfg.dtype)).eval()
    if cfg.backend == "onnxruntime":  # float or quantized: the whole model becomes an ORT session
        from ..backends.ort import export_onnxruntime

        if cfg.quant is not None:
            quantize(model, make_config(cfg.quant))
        if save_dir is None:
            raise ValueError(f"{cfg.name}: backend 'onnxruntime' writes its graph to save_dir; pass one")
        ort_model, summary = export_onnxruntime(model, Path(save_dir) / "model.onnx", probe_ids,
                                                cfg.ort_accuracy_level)
        scheme = ", ".join(f"{k}={v}" for k, v in cfg.quant.items()) if cfg.quant else cfg.dtype
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
    return model, summary | {"scheme": ", ".join(f"{k}={v}" for k, v in cfg.quant.items())}


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
            measure_latency(model, prompts[s][:, : min(32, s[1])], min(s[2], 4), warmup=warmup, repeats=1)
    for _ in tqdm(range(rounds), desc="rounds", disable=not progress):
        for s in shapes:
            for name, (model, _) in models.items():
                samples[(name, s)].append(measure_latency(model, prompts[s], s[2], warmup=0, repeats=1,
                                                          min_time_s=min_time_s))
    rows = []
    for (name, s), runs in samples.items():
        model, summary = models[name]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        rows.append({
            "config": name, "batch_size": s[0], "prefill_tokens": s[1], "decode_tokens": s[2],
            "prefill_ms_p50": med("prefill_ms_p50"), "prefill_ms_p90": max(r["prefill_ms_p90"] for r in runs),
            "decode_ms_per_token_p50": med("decode_ms_per_token_p50"),
            "decode_ms_per_token_p90": med("decode_ms_per_token_p90"),
            "decode_tokens_per_s": med("decode_tokens_per_s"), "rounds": rounds,
            "cpu_threads": runs[0]["cpu_threads"], **summary,
            "weight_mib": summary.get("ort_model_mib") or weight_stats(model)["weight_mib"],  # ORT: the file
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


SPEED_COLUMNS = [
    ("config", "config", "{}"), ("backend", "backend", "{}"), ("backend_kernels", "kernels", "{}"),
    ("batch_size", "batch", "{}"), ("weight_mib", "weights MiB", "{:.1f}"),
    ("prefill_ms_p50", "prefill ms p50", "{:.1f}"), ("prefill_ms_p90", "p90", "{:.1f}"),
    ("prefill_speedup", "× prefill", "{:.2f}"),
    ("decode_ms_per_token_p50", "decode ms/tok p50", "{:.2f}"), ("decode_ms_per_token_p90", "p90", "{:.2f}"),
    ("decode_tokens_per_s", "tok/s", "{:.1f}"), ("decode_speedup", "× decode", "{:.2f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"), ("peak_rss_default_malloc_mib", "(default malloc)", "{:.0f}"),
    ("peak_vram_mib", "peak VRAM MiB", "{:.0f}"),
    ("est_total_mib", "estimate MiB", "{:.0f}"), ("est_error_pct", "est. error %", "{:+.1f}"),
    ("export_parity_layer_max_rel", "kernel parity (layer max rel)", "{:.1e}"),
    ("export_parity_logits_rel_rms", "logits parity (rel RMS)", "{:.1e}"), ("export_parity_ok", "parity ok", "{}"),
]
