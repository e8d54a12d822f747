"""SmolLM2-135M speed and memory on this CPU: fp32 to int4 in PyTorch/torchao, ONNX Runtime and llama.cpp.

    python3 experiments/smollm2_speed.py --threads 1            # 108 min on a 2-core AVX2 EPYC (16 configs)
    python3 experiments/smollm2_speed.py --smoke                # tiny shapes, 1 round: 25 min at load 4-5
    python3 experiments/smollm2_speed.py --reestimate           # seconds: new estimate columns for the stored rows

Prefill 512 tokens, then greedy decode 64 tokens (no early stop), at batch 1 and 8; every
configuration measured side by side, interleaved round by round (see quantlab.runs.bench); quantized
configurations run torchao kernels exported from quantlab's own codes, ONNX Runtime graphs carrying them, and
llama.cpp (llama-cpp-python) on GGUF files quantlab wrote from the same float model (F32, Q8_0, Q4_0, Q4_K_M), all in
the same interleaved rounds. Peak RSS comes from a fresh subprocess per configuration and batch
(quantlab.eval.memprobe; not for llama.cpp rows), next to the estimate of quantlab.eval.estimate for the same shapes.
Each row also gets its memory-bandwidth floor: the weight bytes a decode step reads / the read bandwidth measured in
the same run (quantlab.eval.floor, quantlab.runs.bench.add_floor). Writes reports/smollm2_speed.{csv,md}.
Budget: the 12-configuration run took 30.2 min with --threads 1 on a 2-core CPU at load ~2; the four llama.cpp
configurations add their GGUF writing and passes, hence 3 rounds (not a minimum time) per configuration and shape.
Most of a --smoke run is fixed cost: 7 ONNX exports, 4 GGUF files and 2 memory probes per row. The report states
only what was measured about the machine: CPU model, logical CPUs, threads, instruction-set flags, load average at
start and end, read bandwidth.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.eval.estimate import MIB  # noqa: E402
from quantlab.eval.floor import measure_dram_bandwidth  # noqa: E402
from quantlab.eval.memprobe import measure_peak_memory  # noqa: E402
from quantlab.models.loading import load_model  # noqa: E402
from quantlab.reporting.report import markdown_table  # noqa: E402
from quantlab.runs.bench import (  # noqa: E402
    SPEED_COLUMNS,
    BenchConfig,
    add_floor,
    estimate_for,
    interleaved_latency,
    prepare,
    speed_table,
)
from quantlab.runs.envinfo import cpu_facts, environment, load_average  # noqa: E402

MODEL = "smollm2-135m"
INT4 = {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}
CONFIGS = [
    BenchConfig("fp32"),
    BenchConfig("bf16", dtype="bfloat16"),
    BenchConfig("int8-wo", {"method": "rtn", "bits": 8}),
    BenchConfig("w8a8-dynamic", {"method": "dynamic"}),
    BenchConfig("int4-g64-bf16", {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}),
    # ONNX Runtime (CPU EP): the whole model as one graph; quantized linears from quantlab's codes (backends/ort.py)
    BenchConfig("ort-fp32", backend="onnxruntime"),
    BenchConfig("ort-int8", {"method": "rtn", "bits": 8}, backend="onnxruntime", ort_accuracy_level=4),
    BenchConfig("ort-int4-g32", INT4 | {"group_size": 32}, backend="onnxruntime", ort_accuracy_level=4),
    BenchConfig("ort-int4-g64", INT4, backend="onnxruntime", ort_accuracy_level=4),
    BenchConfig("ort-int4-g128", INT4 | {"group_size": 128}, backend="onnxruntime", ort_accuracy_level=4),
    BenchConfig("ort-int4-g64-acc0", INT4, backend="onnxruntime", ort_accuracy_level=0),
    BenchConfig("ort-w8a8", {"method": "dynamic"}, backend="onnxruntime"),
    # llama.cpp: GGUF files quantlab writes from the same float model (method "gguf": llama.cpp's own recipes' bytes)
    BenchConfig("llamacpp-f32", backend="llama.cpp"),
    BenchConfig("llamacpp-q8_0", {"method": "gguf", "type": "Q8_0"}, backend="llama.cpp"),
    BenchConfig("llamacpp-q4_0", {"method": "gguf", "type": "Q4_0"}, backend="llama.cpp"),
    BenchConfig("llamacpp-q4_k_m", {"method": "gguf", "type": "Q4_K_M"}, backend="llama.cpp"),
]


EST_KEYS = ("est_total_mib", "est_weights_mib", "est_kv_cache_mib", "est_activations_mib", "est_overhead_mib")


def _estimate(cfg: BenchConfig, model_config, batch: int, seq_len: int, summary: dict) -> dict:
    est = estimate_for(cfg, model_config, batch, seq_len, summary)
    if est is None:  # a backend the estimate does not model (llama.cpp)
        return dict.fromkeys(EST_KEYS, float("nan"))
    return {"est_total_mib": est.total_bytes / MIB, "est_weights_mib": est.weights_bytes / MIB,
            "est_kv_cache_mib": est.kv_cache_bytes / MIB, "est_activations_mib": est.activation_bytes / MIB,
            "est_overhead_mib": est.overhead_bytes / MIB}


def reestimate(df, model_config):
    """Stored rows with their est_* columns and est_error_pct recomputed (estimate_for on each row's config,
    batch and prefill + decode tokens); every measured column is kept as it is.

    >>> reestimate(pd.read_csv("reports/smollm2_speed.csv"), load_config("smollm2-135m"))["est_error_pct"]
    """
    by_name = {c.name: c for c in CONFIGS}
    df = df.copy()
    for i, row in df.iterrows():
        if row["config"] not in by_name:
            raise ValueError(f"row {i}: unknown config {row['config']!r}; known: {', '.join(by_name)}")
        seq_len = int(row["prefill_tokens"] + row["decode_tokens"])
        est = _estimate(by_name[row["config"]], model_config, int(row["batch_size"]), seq_len, row.dropna().to_dict())
        est["est_error_pct"] = 100 * (est["est_total_mib"] / row["peak_rss_mib"] - 1)
        for key, value in est.items():
            df.at[i, key] = value
    return df


def _memory(cfg: BenchConfig, save_dir: Path, batch: int, prefill: int, decode: int, threads: int) -> dict:
    spec = {"batch": batch, "prefill_tokens": prefill, "decode_tokens": decode, "threads": threads}
    if cfg.backend == "llama.cpp":  # memprobe loads torch models and ONNX graphs, not GGUF files
        return dict.fromkeys(("peak_rss_mib", "load_peak_rss_mib", "loaded_rss_mib", "peak_rss_default_malloc_mib"),
                             float("nan"))
    if cfg.backend == "onnxruntime":  # the exported graph, loaded in a fresh ORT session
        spec |= {"onnx_dir": str(save_dir / cfg.name)}
    elif cfg.quant is None:
        spec |= {"model": MODEL, "dtype": cfg.dtype}
    else:
        spec |= {"quantized_dir": str(save_dir / cfg.name), "backend": cfg.backend}
    m = measure_peak_memory(spec)  # fixed mmap threshold: the peak of live tensors, repeatable
    d = measure_peak_memory(spec | {"allocator": "default"})  # what a default glibc process saw this time
    return {"peak_rss_mib": m["peak_rss_mib"], "load_peak_rss_mib": m["load_peak_rss_mib"],
            "loaded_rss_mib": m["loaded_rss_mib"], "peak_rss_default_malloc_mib": d["peak_rss_mib"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="prefill 64, decode 8, 1 round, batch 1 and 2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "reports"))
    ap.add_argument("--name", default=None, help="report name (default smollm2_speed, smoke: smollm2_speed_smoke)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite reports/<name>.md from reports/<name>.csv (no measurement)")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the est_* columns of reports/<name>.csv with quantlab.eval.estimate (every "
                         "measured column kept), then rewrite its .md (no measurement)")
    args = ap.parse_args(argv)
    if args.reestimate:
        return _reestimate_report(Path(args.out), args.name or "smollm2_speed")
    if args.markdown_only:
        return _rewrite_markdown(Path(args.out), args.name or "smollm2_speed")
    prefill, decode, batches, rounds = (64, 8, (1, 2), 1) if args.smoke else (512, 64, (1, 8), args.rounds)
    name = args.name or ("smollm2_speed_smoke" if args.smoke else "smollm2_speed")
    torch.set_num_threads(args.threads)
    t0, load_start = time.time(), load_average()
    base, tok = load_model(MODEL, "float32", "cpu")
    probe = torch.randint(0, base.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    save_dir = Path(tempfile.mkdtemp(prefix="quantlab-speed-"))
    own_dir = lambda c: c.quant or c.backend in ("onnxruntime", "llama.cpp")  # noqa: E731
    models = {c.name: prepare(c, base, probe, save_dir / c.name if own_dir(c) else None, MODEL)
              for c in tqdm(CONFIGS, desc="prepare", disable=args.quiet)}
    shapes = [(b, prefill, decode) for b in batches]
    bw_start = measure_dram_bandwidth(repeats=2 if args.smoke else 5)
    rows = interleaved_latency(models, shapes, rounds=rounds, progress=not args.quiet)
    bw_end = measure_dram_bandwidth(repeats=2 if args.smoke else 5)
    del models
    by_name = {c.name: c for c in CONFIGS}
    for row in rows:
        cfg = by_name[row["config"]]
        row.update(_memory(cfg, save_dir, row["batch_size"], prefill, decode, args.threads))
        row.update(_estimate(cfg, base.config, row["batch_size"], prefill + decode, row))
        row["est_error_pct"] = 100 * (row["est_total_mib"] / row["peak_rss_mib"] - 1)
    shutil.rmtree(save_dir, ignore_errors=True)  # ONNX graphs, GGUFs and saved codes: ~3 GB
    env = environment(torch.device("cpu")) | cpu_facts() | {"loadavg_1m_start": load_start,
                                                             "loadavg_1m_end": load_average()}
    bw = max(bw_start, bw_end, key=lambda b: b["dram_bandwidth_gbs"])  # the floor is a lower bound: the fastest
    env |= {"dram_bandwidth_method": bw["dram_bandwidth_method"], "dram_bandwidth_gbs_start":
            bw_start["dram_bandwidth_gbs"], "dram_bandwidth_gbs_end": bw_end["dram_bandwidth_gbs"]}
    df = add_floor(speed_table(rows, baseline="fp32"), bw["dram_bandwidth_gbs"], base.config)
    for k, v in env.items():
        df[k] = v
    df["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    df["bench_wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{name}.csv", index=False)
    (out / f"{name}.md").write_text(_markdown(df, prefill, decode, rounds, args.threads, time.time() - t0))
    print(df[["config", "batch_size", "prefill_speedup", "decode_speedup", "decode_ms_per_token_p50",
              "floor_ms_per_token", "decode_vs_floor", "decode_vs_floor_kv", "peak_rss_mib", "est_error_pct"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"read bandwidth {bw['dram_bandwidth_gbs']:.1f} GB/s ({bw['dram_bandwidth_method']}); load average "
          f"(1 min) {_load_text(load_start)} at start, {_load_text(env['loadavg_1m_end'])} at end")
    return 0


def _reestimate_report(out: Path, name: str) -> int:
    """--reestimate: reports/<name>.csv with new est_* columns (reestimate; the model's config only), then its .md."""
    import pandas as pd

    from quantlab.eval.estimate import load_config

    path = out / f"{name}.csv"
    reestimate(pd.read_csv(path), load_config(MODEL)).to_csv(path, index=False)
    return _rewrite_markdown(out, name)


def _rewrite_markdown(out: Path, name: str) -> int:
    """The report's text from its CSV alone (protocol fields, rows, wall time); for reports written before
    bench_wall_s was a column, the wall time is read from the old Markdown."""
    import re

    import pandas as pd

    df = pd.read_csv(out / f"{name}.csv")
    r = df.iloc[0]
    if "bench_wall_s" in df:
        wall_s = float(r["bench_wall_s"])
    else:
        wall_s = 60 * float(re.search(r"Wall time of the whole benchmark: ([0-9.]+) min",
                                      (out / f"{name}.md").read_text()).group(1))
    (out / f"{name}.md").write_text(_markdown(df, int(r["prefill_tokens"]), int(r["decode_tokens"]), int(r["rounds"]),
                                              int(r["cpu_threads"]), wall_s))
    return 0


def _load_text(v) -> str:
    return "n/a" if v is None or v != v else f"{v:.2f}"


def machine_text(r, threads: int) -> str:
    """Measured facts about the machine only (the row's cpu_facts and load averages)."""
    return (f"**Machine.** CPU `{r['cpu_model']}`, {r['logical_cpus']} logical CPUs, {threads} benchmark "
            f"thread(s). AVX-512: {r['cpu_avx512']}. AMX: {r['cpu_amx']} (/proc/cpuinfo flags). Load average "
            f"(1 min) at start {_load_text(r['loadavg_1m_start'])}, at end {_load_text(r['loadavg_1m_end'])}.")


def _times(v: float) -> str:
    return "n/a" if v != v else f"{v:.2f}x"


def findings_text(df) -> str:
    """The findings, every number from the rows: the machine (CPU, instruction sets, llama.cpp's build, load average,
    read bandwidth), then per configuration its decode speed-up against torch fp32 and its distance from its
    memory-bandwidth floor (weights only, and with the KV cache read) at each batch size. "" for rows without
    floor columns (reports written before them)."""
    if "decode_vs_floor" not in df or "fp32" not in set(df["config"]):
        return ""
    r = df.iloc[0]
    llama = df["llamacpp_cpu_features"].dropna() if "llamacpp_cpu_features" in df else []
    head = [f"**Findings** (generated from the rows). CPU `{r['cpu_model']}`; instruction sets (/proc/cpuinfo): "
            f"{r.get('cpu_simd', 'n/a')}, AVX-512: {r['cpu_avx512']}, AMX: {r['cpu_amx']}"
            + (f"; the llama.cpp build uses {llama.iloc[0]}" if len(llama) else "")
            + f". Load average (1 min) {_load_text(r['loadavg_1m_start'])} at start, "
            f"{_load_text(r['loadavg_1m_end'])} at end. Read bandwidth {r['dram_bandwidth_gbs']:.1f} GB/s "
            f"({r['dram_bandwidth_method']}; {r.get('dram_bandwidth_gbs_start', float('nan')):.1f} before the rounds, "
            f"{r.get('dram_bandwidth_gbs_end', float('nan')):.1f} after; the floor takes the faster). Decode speed-up "
            "= torch fp32 decode ms/token / the configuration's, same batch; × floor = measured decode ms/token / "
            "(weight bytes a step reads / bandwidth), × floor+KV the same with the KV cache read added (at batch B a "
            "step makes B tokens from one read of the weights, so both are per step):"]
    t = df.set_index(["config", "batch_size"])
    batches = sorted(df["batch_size"].unique())
    lines = []
    for name in dict.fromkeys(df["config"]):
        first = t.loc[(name, batches[0])]
        per = "; ".join(f"batch {b}: decode {_times(t.loc[(name, b), 'decode_speedup'])} fp32, "
                        f"{_times(t.loc[(name, b), 'decode_vs_floor'])} its floor of "
                        f"{t.loc[(name, b), 'floor_ms_per_token']:.2f} ms/token "
                        f"({_times(t.loc[(name, b), 'decode_vs_floor_kv'])} with the KV cache)"
                        for b in batches if (name, b) in t.index)
        lines.append(f"- `{name}` ({first['backend']}, {first['decode_weight_mib']:.1f} MiB read per step, of it "
                     f"{first['decode_head_bytes'] / 2**20:.1f} MiB output head): {per}.")
    for b in batches:
        at = df[df["batch_size"] == b]
        fast, near = at.loc[at["decode_speedup"].idxmax()], at.loc[at["decode_vs_floor"].idxmin()]
        lines.append(f"- Batch {b}: fastest decode `{fast['config']}` ({_times(fast['decode_speedup'])} fp32, "
                     f"{fast['decode_ms_per_token_p50']:.2f} ms/token); closest to its floor `{near['config']}` "
                     f"({_times(near['decode_vs_floor'])}).")
    return "\n".join(head + lines)


ORT_VS_TORCHAO = [("ort-int8", "int8-wo"), ("ort-int4-g64", "int4-g64-bf16"), ("ort-w8a8", "w8a8-dynamic"),
                  ("ort-fp32", "fp32")]


def _ratios_text(df) -> str:
    """ONNX Runtime against PyTorch / torchao on the same scheme, per batch: time ratios from the rows."""
    t = df.set_index(["config", "batch_size"])
    parts = []
    for batch in sorted(df["batch_size"].unique()):
        pairs = []
        for ort, ref in ORT_VS_TORCHAO:
            if (ort, batch) in t.index and (ref, batch) in t.index:
                a, b = t.loc[(ort, batch)], t.loc[(ref, batch)]
                decode_x = b["decode_ms_per_token_p50"] / a["decode_ms_per_token_p50"]
                pairs.append(f"`{ort}` vs `{ref}` decode {decode_x:.2f}x, "
                             f"prefill {b['prefill_ms_p50'] / a['prefill_ms_p50']:.2f}x")
        if pairs:
            parts.append(f"batch {batch}: " + "; ".join(pairs))
    return ("**ONNX Runtime against the same scheme in PyTorch / torchao** (time of the PyTorch row / time of the ORT "
            "row, > 1 = ORT faster): " + ". ".join(parts) + ".") if parts else ""


def _ort_parity_text(ort) -> str:
    """Which ORT configurations passed their logits-parity gate, from the rows."""
    if not len(ort):
        return ""
    failed = ort[~ort["export_parity_ok"].astype(bool)]
    if not len(failed):
        return f"All {len(ort)} ORT configurations passed their parity gate."
    named = ", ".join(f"`{r.config}` (rel RMS {r.export_parity_logits_rel_rms:.1e} > {r.export_parity_tol:.0e})"
                      for r in failed.itertuples())
    return (f"{len(ort) - len(failed)} of {len(ort)} ORT configurations passed their parity gate; failed: {named}: "
            "at accuracy_level 4 the kernel quantizes activations to int8 per block of K, a numeric path of its own "
            "that SmolLM2's outlier activations (see `quantlab doctor`) make coarse; its perplexity is not measured "
            "here (an experiment row with backend \"onnxruntime\" measures the accuracy_level 0 export).")


LLAMACPP_TEXT = (
    " `llama.cpp`: the float model written as a GGUF by quantlab (F32; Q8_0, Q4_0 and Q4_K_M by method \"gguf\", "
    "the bytes llama.cpp's own quantizer writes, the token embedding in the recipe's type too) and run by "
    "llama-cpp-python's low-level API with the same prompts and threads: the sequences of a batch prefilled in one "
    "llama_batch, then one llama_batch of B tokens per step (batched decoding), F16 KV cache, a fresh context per "
    "pass; kernels lists the file's tensor types, weights MiB its size; its logits parity (relative RMS against the "
    "simulated PyTorch model on 64 probe tokens) is not gated: llama.cpp quantizes activations to 8 bits inside its "
    "quantized dot products.")
LLAMACPP_MEMORY_TEXT = (" llama.cpp rows have neither: memprobe loads PyTorch models and ONNX graphs only, and the "
                        "estimate has no llama.cpp backend.")
FLOOR_TEXT = (
    "**Floor.** A decode step reads every weight once, so it cannot take less than the bytes it reads divided by the "
    "memory's read bandwidth (unless they fit the cache). Bytes per step are the configuration's real storage "
    "(quantlab.eval.floor): a PyTorch model's tensors (codes + scales + zeros as stored, the float head), the ONNX "
    "graph's initializers, the GGUF file's tensors; the embedding lookup reads one row, the output head its whole "
    "table, a tied table is counted once. The bandwidth is measured in the same run, before and after the rounds "
    "(method in the findings). The KV cache is left out of `× floor` and added in `× floor+KV` (every sequence's "
    "keys and values at the mean context of the decode, in the backend's KV dtype: PyTorch the model's, ORT fp32, "
    "llama.cpp F16).")


def _markdown(df, prefill, decode, rounds, threads, wall_s) -> str:
    r = df.iloc[0]
    env = ", ".join(f"{k} `{r[k]}`" for k in ("device_name", "torch", "transformers", "torchao", "git_sha") if k in df)
    has = df["export_parity_ok"].notna() if "export_parity_ok" in df else df["config"].isna()
    backend = (df["backend"] if "backend" in df else df["config"].map(lambda _: "")).astype(str)
    parity = df[has & backend.str.startswith("torchao")]
    ort = df[has & backend.str.startswith("onnxruntime")].drop_duplicates("config")
    shown = df.copy()  # llama.cpp's parity in the logits-parity column (its own key in the CSV)
    if "llamacpp_parity_logits_rel_rms" in df:
        col = shown["export_parity_logits_rel_rms"] if "export_parity_logits_rel_rms" in shown else float("nan")
        shown["export_parity_logits_rel_rms"] = col
        shown["export_parity_logits_rel_rms"] = shown["export_parity_logits_rel_rms"].fillna(
            df["llamacpp_parity_logits_rel_rms"])
    has_llamacpp = bool(backend.eq("llama.cpp").any())
    parts = [
        "# SmolLM2-135M: speed and memory on this CPU",
        f"**Protocol.** Seeded random prompts of {prefill} tokens, then greedy decode of exactly {decode} new "
        f"tokens (no early stop) with the KV cache; prefill computes last-position logits only. Batch "
        f"{', '.join(str(b) for b in sorted(df['batch_size'].unique()))}. {threads} CPU thread(s). All configurations "
        f"measured side by side, interleaved: {rounds} rounds, each measuring every configuration once per batch "
        "size after one warm-up pass each; numbers are medians over rounds of each pass's p50 (decode p50 is over "
        "that pass's steps), p90 columns the same for p90 (prefill p90: the max over rounds). Absolute times "
        "depend on whatever else ran on the CPU (see the load average below); ratios from interleaved rounds are "
        "the robust part. Speedup = fp32 time / config time at the same batch.",
        machine_text(r, threads),
        markdown_table(shown, SPEED_COLUMNS),
        findings_text(df),
        _ratios_text(df),
        "**Backends.** `float`: PyTorch dense matmuls in the model dtype. `torchao`: the quantized linears "
        "were exported from quantlab's own codes (nothing re-quantized) to torchao kernels: `int8_weight_only` "
        "(torchao Int8Tensor), `int8_dynamic` (torchao's int8 GEMM `int_scaled_matmul` with quantlab's per-token "
        "activation grid), `int4_cpu` (torchao Int4OpaqueTensor, tinygemm CPU kernel; computes in bf16, so the "
        "whole int4 model runs in bf16). Kernel parity: every exported layer's output vs its simulated "
        "(dequantized) output on a random input, max relative error, gated per kernel "
        f"(all passed: {bool(parity['export_parity_ok'].all()) if len(parity) else 'n/a'}). "
        "`onnxruntime`: the whole model exported by `torch.onnx.export` (dynamo) and run by an ONNX Runtime CPU "
        "session, the KV cache as graph inputs/outputs; its quantized linears carry quantlab's codes (nothing "
        "re-quantized): `matmul_nbits` is `com.microsoft::MatMulNBits` (blocks = groups, quantlab's zero points; "
        "`ort-int8` and the int4 rows at accuracy_level 4, which quantizes activations to int8 per block inside "
        "the kernel, `-acc0` at accuracy_level 0, fp32 math on the same dequantized weights), `a8w8` is "
        "quantlab's per-token int8 activation grid computed in the graph + `MatMulInteger` (uint8 x int8, exact "
        "int32 sums). ORT parity: relative RMS of the logits vs the simulated PyTorch model on 64 probe tokens, "
        "gated by `PARITY_RMS_TOLERANCE` in quantlab/backends/ort.py; weights MiB of ORT rows is the size of the "
        "ONNX file and its external data. " + _ort_parity_text(ort) + (LLAMACPP_TEXT if has_llamacpp else ""),
        "**Memory.** Peak RSS of a fresh subprocess per configuration and batch: the model is loaded "
        "(float: from the checkpoint; quantized: `load_quantized` of the saved codes, then exported), the "
        "freed heap is returned to the OS (`malloc_trim`), the peak is reset (`/proc/self/clear_refs`), and one "
        "prefill + decode pass runs; `load_peak_rss_mib` in the CSV is the peak while loading. The child runs "
        "glibc malloc with a fixed 64 KiB mmap threshold, so freed tensors leave RSS at once and the peak is "
        "that of live tensors (it repeats to the MiB); *(default malloc)* is the same measurement with glibc's "
        "dynamic threshold, whose heap reuse depends on allocation history, so it varies between runs of one "
        "configuration (by hundreds of MiB at batch 8). Estimate: `quantlab estimate` for the same shapes "
        "(seq_len = prefill + decode) from the config alone: weights as the backend stores them, KV cache, "
        "one layer's activations, and a framework overhead; its error is against the fixed-threshold peak. ORT "
        "rows use its `onnxruntime` backend: the initializers in MatMulNBits' layout + a second copy of the tied "
        "embedding (the lm_head's constant-folded transpose; the Gather reads the memory-mapped original), the "
        "larger of the prefill's materialized attention scores (batch x heads x T² x 17 B, T = prefill + decode) "
        "and decode's second KV cache (`present_*` beside `past_*`), and the ONNX Runtime library and session "
        "on top of the framework constant (terms and where each was measured: quantlab/eval/estimate.py)."
        + (LLAMACPP_MEMORY_TEXT if has_llamacpp else ""),
        FLOOR_TEXT if "decode_vs_floor" in df else "",
        f"**Environment.** {env}. Wall time of the whole benchmark: {wall_s / 60:.1f} min.",
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


if __name__ == "__main__":
    sys.exit(main())
