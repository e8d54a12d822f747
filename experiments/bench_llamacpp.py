"""SmolLM2-135M decode speed: llama.cpp running quantlab's GGUF files against PyTorch fp32, torchao int4 and ONNX
Runtime int4, side by side in one run.

    python3 experiments/bench_llamacpp.py                 # ~8 min on a 2-core CPU
    python3 experiments/bench_llamacpp.py --smoke         # ~1 min: 1 round, short prompts

Every configuration prefills the same seeded random prompts (128 tokens) and decodes 32 greedy tokens, at batch 1
and 8, with the same number of threads, interleaved round by round (medians over rounds). llama.cpp configurations
run GGUF files quantlab wrote (F32 from the float model; Q8_0, Q4_K_M and Q4_0 by method "gguf": the bytes
llama.cpp's own quantizer would write) through quantlab.backends.llamacpp (llama-cpp-python built with
GGML_NATIVE=OFF: AVX2 kernels). Writes reports/bench_llamacpp.{csv,md} with ratios against PyTorch fp32 at the
same batch, the CPU model, threads and the load average at start and end.
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.backends.gguf_export import export_gguf  # noqa: E402
from quantlab.backends.llamacpp import llamacpp_cpu_features, measure_llamacpp_latency  # noqa: E402
from quantlab.core.lifecycle import quantize  # noqa: E402
from quantlab.core.registry import make_config  # noqa: E402
from quantlab.eval.latency import measure_latency  # noqa: E402
from quantlab.models.loading import alias_gguf_path, load_model  # noqa: E402
from quantlab.runs.bench import BenchConfig, prepare  # noqa: E402
from quantlab.runs.envinfo import load_average  # noqa: E402

MODEL = "smollm2-135m"
TORCH = [
    BenchConfig("torch-fp32"),
    BenchConfig("torchao-int4-g32", {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
                backend="torchao"),
    BenchConfig("ort-int4-g32", {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
                backend="onnxruntime", ort_accuracy_level=4),
]
GGUF = {"llamacpp-f32": None, "llamacpp-q8_0": "Q8_0", "llamacpp-q4_k_m": "Q4_K_M", "llamacpp-q4_0": "Q4_0"}
KEYS = ("prefill_ms_p50", "decode_ms_per_token_p50", "decode_tokens_per_s")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def table(df: pd.DataFrame) -> str:
    """A plain Markdown table, 4 significant digits."""
    cell = lambda v: "" if v is None or (isinstance(v, float) and v != v) else (f"{v:.4g}" if isinstance(v, float)
                                                                                 else str(v))  # noqa: E731
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)])


def write_ggufs(model, out_dir: Path) -> dict[str, Path]:
    paths = {}
    for name, recipe in GGUF.items():
        m = copy.deepcopy(model)
        if recipe is not None:
            quantize(m, make_config({"method": "gguf", "type": recipe}), progress=False)
        paths[name] = out_dir / f"{name}.gguf"
        export_gguf(m, paths[name], alias_gguf_path(MODEL))
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_llamacpp"))
    args = ap.parse_args()
    rounds, prompt_len, new = (1, 32, 8) if args.smoke else (args.rounds, 128, 32)
    torch.set_num_threads(args.threads)
    load_start = load_average()
    base, _ = load_model(MODEL, device="cpu", progress=False)
    probe = torch.randint(0, base.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for cfg in TORCH:
            save = Path(tmp) / cfg.name if cfg.backend == "onnxruntime" else None
            model, _ = prepare(cfg, base, probe, save_dir=save)
            models[cfg.name] = model
        ggufs = write_ggufs(base, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        samples: dict[tuple[str, int], list[dict]] = {}
        for b in (1, 8):
            prompt = torch.randint(0, base.config.vocab_size, (b, prompt_len), generator=gen)
            for name, model in models.items():  # warm-up
                measure_latency(model, prompt[:, :16], 2, warmup=1, repeats=1)
            for r in range(rounds):
                for name, model in models.items():
                    samples.setdefault((name, b), []).append(measure_latency(model, prompt, new, warmup=0, repeats=1))
                for name, path in ggufs.items():
                    row = measure_llamacpp_latency(path, prompt_len, new, (b,), threads=args.threads,
                                                   warmup=1 if r == 0 else 0, repeats=1, seed=r)[b]
                    samples.setdefault((name, b), []).append(row)
                print(f"batch {b}: round {r + 1}/{rounds} done", flush=True)
            sizes = {name: p.stat().st_size / 2**20 for name, p in ggufs.items()}
    rows = []
    for (name, b), runs in samples.items():
        rows.append({"config": name, "engine": "llama.cpp" if name.startswith("llamacpp") else name.split("-")[0],
                     "batch_size": b, "prefill_tokens": prompt_len, "decode_tokens": new, "rounds": len(runs),
                     **{k: statistics.median(r[k] for r in runs) for k in KEYS},
                     "gguf_mib": sizes.get(name), "threads": args.threads})
    df = pd.DataFrame(rows)
    ref = df[df.config == "torch-fp32"].set_index("batch_size")
    df["decode_speedup_vs_torch_fp32"] = [ref.loc[b, "decode_ms_per_token_p50"] / d
                                          for b, d in zip(df.batch_size, df.decode_ms_per_token_p50)]
    df["prefill_speedup_vs_torch_fp32"] = [ref.loc[b, "prefill_ms_p50"] / p
                                           for b, p in zip(df.batch_size, df.prefill_ms_p50)]
    df["cpu"] = cpu_model()
    df["llamacpp_cpu_features"] = llamacpp_cpu_features()
    df["load_avg_start"], df["load_avg_end"] = load_start, load_average()
    df["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out)
    if not args.smoke:
        df.to_csv(out.with_suffix(".csv"), index=False)
        cols = ["config", "batch_size", "prefill_ms_p50", "decode_ms_per_token_p50", "decode_tokens_per_s",
                "decode_speedup_vs_torch_fp32", "prefill_speedup_vs_torch_fp32", "gguf_mib"]
        head = (f"# llama.cpp vs PyTorch / torchao / ONNX Runtime: SmolLM2-135M decode\n\n"
                f"`{df.cpu[0]}`, {args.threads} threads, llama.cpp kernels: {df.llamacpp_cpu_features[0]}; load "
                f"average {load_start:.2f} at start, {df.load_avg_end[0]:.2f} at end; {rounds} interleaved rounds, "
                f"prompt {prompt_len} tokens, {new} decoded. Generated by experiments/bench_llamacpp.py.\n\n")
        out.with_suffix(".md").write_text(head + table(df[cols]) + "\n")
    print(df[["config", "batch_size", "prefill_ms_p50", "decode_ms_per_token_p50", "decode_speedup_vs_torch_fp32"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
