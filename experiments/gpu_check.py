"""One command for a CUDA machine: the quickstart experiment + a latency/VRAM sweep, CSVs under --out.

    python3 experiments/gpu_check.py --out gpu_out          # CUDA: ~3-8 min on one GPU
    python3 experiments/gpu_check.py --out cpu_check        # no CUDA: a small CPU fallback (~3 min here)

CUDA sweep (SmolLM2-135M, prefill 512 + greedy decode 64, batch 1 and 8, 5 interleaved rounds):
fp16 and bf16 baselines, int8 weight-only, int4 weight-only (tinygemm, bf16), W8A8 dynamic (int8
GEMM), all exported from quantlab codes to torchao; float8 dynamic (torchao's own quantize_,
per-row) where compute capability >= 8.9. Each configuration's peak VRAM (max_memory_allocated /
max_memory_reserved after reset_peak_memory_stats) is measured on its own, next to the estimate.
A configuration that fails (a kernel missing on this GPU) becomes a row with its error, never a crash.
CPU fallback: the quickstart with 1 window and 2 runs, and a sweep of fp32 / int8 / W8A8 / int4 at
prefill 32 + decode 4, batch 1, 1 round.
Writes: <out>/gpu_check_sweep.{csv,md}, <out>/<quickstart name>.{csv,md,results.jsonl}, <out>/env.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.eval.estimate import MIB  # noqa: E402
from quantlab.eval.latency import measure_latency  # noqa: E402
from quantlab.models.loading import load_model  # noqa: E402
from quantlab.reporting.report import markdown_table  # noqa: E402
from quantlab.runs.bench import SPEED_COLUMNS, BenchConfig, estimate_for, interleaved_latency, prepare, speed_table  # noqa: E402
from quantlab.runs.envinfo import environment  # noqa: E402

W8 = {"method": "rtn", "bits": 8}
W4 = {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}


def sweep_configs(device: torch.device) -> list[BenchConfig]:
    if device.type != "cuda":
        return [BenchConfig("fp32"), BenchConfig("int8-wo", W8), BenchConfig("w8a8-dynamic", {"method": "dynamic"}),
                BenchConfig("int4-g64", W4)]
    cfgs = [BenchConfig("fp16", dtype="float16"), BenchConfig("bf16", dtype="bfloat16"),
            BenchConfig("int8-wo", W8, dtype="bfloat16"), BenchConfig("int4-g64", W4, dtype="bfloat16"),
            BenchConfig("w8a8-dynamic", {"method": "dynamic"}, dtype="bfloat16")]
    if torch.cuda.get_device_capability(device) >= (8, 9):
        cfgs.append(BenchConfig("fp8-dynamic", dtype="bfloat16", torchao_config="float8_dynamic"))
    return cfgs


def run_quickstart(out: Path, device: torch.device) -> str:
    from quantlab.runs.experiment import load_experiment
    from quantlab.runs.runner import run_experiment

    exp = dataclasses.replace(load_experiment(ROOT / "experiments" / "smollm2_quickstart.toml"), device=str(device))
    if device.type != "cuda":
        exp = dataclasses.replace(exp, name=exp.name + "_cpu_fallback", runs=exp.runs[:2], eval=dataclasses.replace(
            exp.eval, max_windows=1, kl_windows=1, decode_tokens=4, latency_repeats=1))
    run_experiment(exp, out, force=True, progress=False)
    return exp.name


def _vram(model, prompt, new_tokens, device, before_bytes) -> dict:
    """Peak VRAM of one prefill + decode pass, this configuration's resident weights included."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    measure_latency(model, prompt, new_tokens, warmup=0, repeats=1)
    return {"peak_vram_mib": (torch.cuda.max_memory_allocated(device) - before_bytes) / MIB,
            "peak_vram_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB}


def _estimate(cfg: BenchConfig, model_config, batch, seq_len, summary, device) -> dict:
    est = estimate_for(cfg, model_config, batch, seq_len, summary, device=device.type,
                       overhead_mib=0)  # allocator peak excludes the CUDA context
    return {"est_total_mib": est.total_bytes / MIB}


def run_sweep(model_name: str, out: Path, device: torch.device, shapes, rounds: int) -> "pd.DataFrame":  # noqa: F821
    base, _ = load_model(model_name, "float32", str(device))
    probe = torch.randint(0, base.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    models, failed, vram = {}, [], {}
    big = max(shapes)
    prompt = torch.randint(0, base.config.vocab_size, big[:2], generator=torch.Generator().manual_seed(2))
    for cfg in sweep_configs(device):
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        try:
            models[cfg.name] = prepare(cfg, base, probe)
            vram[cfg.name] = _vram(models[cfg.name][0], prompt, big[2], device, before)
        except Exception as e:  # a kernel this GPU lacks: record it, keep going
            models.pop(cfg.name, None)
            failed.append({"config": cfg.name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    baseline = next(iter(models))
    rows = interleaved_latency(models, shapes, rounds=rounds)
    by_name = {c.name: c for c in sweep_configs(device)}
    for row in rows:
        cfg = by_name[row["config"]]
        if row["batch_size"] == big[0]:
            row.update(vram.get(row["config"], {}))
            if "peak_vram_mib" in row:
                row.update(_estimate(cfg, base.config, big[0], big[1] + big[2], row, device))
                row["est_error_pct"] = 100 * (row["est_total_mib"] / row["peak_vram_mib"] - 1)
    df = speed_table(rows, baseline=baseline)
    if failed:
        import pandas as pd

        df = pd.concat([df, pd.DataFrame(failed)], ignore_index=True)
    df.to_csv(out / "gpu_check_sweep.csv", index=False)
    text = [f"# gpu_check sweep on {environment(device)['device_name']}",
            f"Prefill {big[1]} + greedy decode {big[2]} tokens, batches {[s[0] for s in shapes]}, {rounds} interleaved "
            f"rounds; speedups vs {baseline} at the same batch; VRAM measured at batch {big[0]} (allocator peak "
            "minus what other configurations hold; the estimate excludes the CUDA context).",
            markdown_table(df, SPEED_COLUMNS)]
    if failed:
        text.append("**Failed configurations.**\n" + "\n".join(f"- {f['config']}: {f['error']}" for f in failed))
    (out / "gpu_check_sweep.md").write_text("\n\n".join(text) + "\n")
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="quickstart + latency/VRAM sweep; CPU fallback without CUDA")
    ap.add_argument("--out", required=True, help="output directory for the CSVs and reports")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--no-quickstart", action="store_true", help="only the sweep")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    env = environment(device) | {"cuda": device.type == "cuda"}
    if device.type == "cuda":
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    (out / "env.json").write_text(json.dumps(env, indent=1, default=str))
    shapes, rounds = ([(1, 512, 64), (8, 512, 64)], 5) if device.type == "cuda" else ([(1, 32, 4)], 1)
    if not args.no_quickstart:
        name = run_quickstart(out, device)
        print(f"quickstart: {out / name}.csv ({time.time() - t0:.0f} s)")
    df = run_sweep(args.model, out, device, shapes, rounds)
    cols = [c for c in ("config", "backend", "batch_size", "prefill_speedup", "decode_speedup", "peak_vram_mib",
                        "error") if c in df]
    print(df[cols].to_string(index=False))
    print(f"wrote {out / 'gpu_check_sweep.csv'} ({time.time() - t0:.0f} s, device {device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
