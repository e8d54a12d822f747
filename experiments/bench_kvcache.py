"""SmolLM2-135M KV-cache quantization on this CPU: float vs KV8 vs KV4 cache bytes and prefill / decode time.

    python3 experiments/bench_kvcache.py --threads 2          # full: 2048-token prompt, batch 8, decode 16
    python3 experiments/bench_kvcache.py --smoke              # ~1 min: prompt 64, batch 2, decode 4, 1 round

The prompt is real text: the first `batch` non-overlapping windows of the WikiText-2 test split (no BOS).
Each configuration runs quantlab.eval.measure_latency(..., kv=config): the model under apply_kv_quant, one
prefill into a fresh cache (float: transformers' DynamicCache; KV8 / KV4: quantlab's QuantizedKVCache, codes +
fp16 scales + uint8 zeros, every token quantized once on insertion), then greedy decode of exactly `decode`
tokens. Configurations run side by side, interleaved round by round (round r measures every configuration once),
after one short warm-up pass each; times are medians over rounds of each pass's p50.

kv_cache_mib is the bytes the cache holds after the last decode step (what a float cache would hold:
kv_cache_float_mib). The quantized cache dequantizes all positions of one layer on every step (no fused
kernel), so it saves memory, not time: kv_dequant_transient_mib is the float K/V of one layer that this
materializes at a time. Writes reports/bench_kvcache.csv (smoke: reports/bench_kvcache_smoke.csv).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from quantlab.eval.latency import measure_latency
from quantlab.kvcache import KVCacheConfig, kv_describe
from quantlab.models.data import eval_windows, load_token_ids
from quantlab.models.loading import load_model
from quantlab.runs.envinfo import cpu_facts, environment, load_average

MODEL = "smollm2-135m"
CONFIGS = {"float": KVCacheConfig(bits=16), "kv8": KVCacheConfig(bits=8), "kv4": KVCacheConfig(bits=4)}
TIMES = ("prefill_ms_p50", "decode_ms_per_token_p50", "decode_ms_per_token_p90")


def interleaved(model, prompt, decode: int, rounds: int, progress: bool) -> list[dict]:
    """One row per configuration: medians over rounds of measure_latency's p50 / p90, the last round's bytes."""
    for cfg in CONFIGS.values():  # warm-up: a short pass each (allocator, first-call costs)
        measure_latency(model, prompt[:, :16], new_tokens=2, warmup=0, repeats=1, kv=cfg)
    passes = {name: [] for name in CONFIGS}
    for r in range(rounds):
        for name, cfg in CONFIGS.items():
            t0 = time.perf_counter()
            passes[name].append(measure_latency(model, prompt, new_tokens=decode, warmup=0, repeats=1, kv=cfg))
            if progress:
                print(f"round {r + 1}/{rounds} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for name, cfg in CONFIGS.items():
        last = passes[name][-1]
        row = {"config": name, "kv_label": kv_describe(cfg), **cfg.to_dict()} | {
            k: last[k] for k in ("batch_size", "prefill_tokens", "decode_tokens", "decode_tokens_generated",
                                 "kv_cache_mib", "kv_cache_float_mib", "cpu_threads")}
        row |= {k: statistics.median(p[k] for p in passes[name]) for k in TIMES}
        cfg_model = model.config
        head_dim = getattr(cfg_model, "head_dim", cfg_model.hidden_size // cfg_model.num_attention_heads)
        row["kv_dequant_transient_mib"] = (0.0 if not cfg.enabled else 2 * prompt.shape[0] * cfg_model.num_key_value_heads
                                           * (prompt.shape[1] + decode) * head_dim * 4 / 2**20)
        row["rounds"] = rounds
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["kv_cache_ratio"] = row["kv_cache_mib"] / base["kv_cache_mib"]
        row["prefill_speedup"] = base["prefill_ms_p50"] / row["prefill_ms_p50"]
        row["decode_speedup"] = base["decode_ms_per_token_p50"] / row["decode_ms_per_token_p50"]
    return rows


def main(argv=None) -> int:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="prompt 64, batch 2, decode 4, 1 round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data-dir", default=None, help="WikiText-2 directory (default: ../shared/data/wikitext-2)")
    ap.add_argument("--out", default=str(ROOT / "reports"))
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    prefill, batch, decode, rounds = (64, 2, 4, 1) if args.smoke else (args.prefill, args.batch, args.decode,
                                                                      args.rounds)
    name = "bench_kvcache_smoke" if args.smoke else "bench_kvcache"
    torch.set_num_threads(args.threads)
    t0, load_start = time.time(), load_average()
    model, tok = load_model(MODEL, "float32", "cpu", progress=False)
    ids, source = load_token_ids("wikitext2", "test", tok, data_dir=args.data_dir)
    prompt = eval_windows(ids, prefill, max_windows=batch)
    if prompt.shape[0] < batch:
        raise ValueError(f"the test split has only {prompt.shape[0]} windows of {prefill} tokens, asked for {batch}")
    rows = interleaved(model, prompt, decode, rounds, progress=not args.quiet)
    env = environment(torch.device("cpu")) | cpu_facts() | {
        "model": MODEL, "dtype": "float32", "data": f"wikitext2 test, first {batch} windows of {prefill} ({source})",
        "loadavg_1m_start": load_start, "loadavg_1m_end": load_average(), "wall_s": time.time() - t0,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds")}
    df = pd.DataFrame([row | env for row in rows])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{name}.csv", index=False)
    print(df[["config", "kv_cache_mib", "kv_cache_float_mib", "kv_cache_ratio", "prefill_ms_p50",
              "decode_ms_per_token_p50", "decode_speedup"]].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {out / f'{name}.csv'} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
