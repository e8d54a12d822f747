"""Where a decode step's time goes in ONNX Runtime and in PyTorch, at batch 1 and 8 (issue 32's ORT batch-8 profile).

    python3 experiments/profile_ort_decode.py --threads 1     # ~12 min on a 2-core AVX2 EPYC (two ONNX exports)

SmolLM2-135M, the configurations of reports/smollm2_speed: PyTorch fp32, ORT fp32 and ORT int4 g64 (asymmetric,
accuracy level 4: MatMulNBits with int8 activations), each exported once. Per configuration and batch: a prefill of
--prefill tokens (seeded random ids, as the speed report's), then --decode greedy steps; the first --warmup steps
are not counted. Two passes:
- unprofiled: the wall time of each step (median), as the speed report measures it;
- profiled: ORT's own per-node profile (backends/ort_profile.py), PyTorch's torch.profiler (self CPU time per aten
  op), summed into the parts of a step: the linears, attention (q·kᵀ, softmax, ·v), concat (the KV cache's past +
  new, rotary's halves), other (norms, rotary, masks, shape and elementwise ops), and what is outside any kernel
  (the profiled step's wall time minus its kernels: feeds, copies, the runtime's own overhead).
Writes reports/ort_decode_profile.{csv,md}; the CPU, its flags and the load average go in every row.
"""
from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from smollm2_speed import INT4, MODEL, cpu_facts

from quantlab.backends.ort import load_ort
from quantlab.backends.ort_profile import category, op_times
from quantlab.models.loading import load_model
from quantlab.runs.bench import BenchConfig, prepare
from quantlab.runs.envinfo import environment

CONFIGS = [BenchConfig("fp32"), BenchConfig("ort-fp32", backend="onnxruntime"),
           BenchConfig("ort-int4-g64", INT4, backend="onnxruntime", ort_accuracy_level=4)]
PARTS = ("linear", "attention", "concat", "other", "outside kernels")


def torch_category(name: str) -> str:
    """The part of a step an aten op's self time belongs to (as backends/ort_profile.category for ORT nodes)."""
    if name in ("aten::mm", "aten::addmm", "aten::linear"):
        return "linear"
    if "scaled_dot_product" in name or name in ("aten::_softmax", "aten::softmax", "aten::bmm", "aten::baddbmm"):
        return "attention"
    if name == "aten::cat":
        return "concat"
    return "other"


@torch.inference_mode()
def decode_steps(model, prompt: torch.Tensor, steps: int) -> tuple[list[float], object]:
    """Prefill, then `steps` greedy decode steps; (ms of each step, a function that runs the next ones)."""
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5
    out = model(prompt, use_cache=True, logits_to_keep=1)
    state = {"cache": getattr(out, kv), "next": out.logits[:, -1:].argmax(-1)}

    def run(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model(state["next"], use_cache=True, logits_to_keep=1, **{kv: state["cache"]})
            state["next"], state["cache"] = out.logits[:, -1:].argmax(-1), getattr(out, kv)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    return run(steps), run


def profile_torch(model, prompt, warmup: int, steps: int) -> tuple[float, dict]:
    """(profiled wall ms per step, {part: self-CPU ms per step}) over `steps` steps after `warmup`."""
    from torch.profiler import ProfilerActivity, profile

    _, run = decode_steps(model, prompt, warmup)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = run(steps)
    parts = dict.fromkeys(PARTS[:-1], 0.0)
    for e in prof.key_averages():
        parts[torch_category(e.key)] += e.self_cpu_time_total / 1e3 / steps
    return statistics.mean(wall), parts


def profile_ort(directory: Path, threads: int, prompt, warmup: int, steps: int, prefix: Path) -> tuple[float, dict]:
    """As profile_torch, from a fresh ORT session that records its per-node profile."""
    model = load_ort(directory, threads, profile=prefix)
    _, run = decode_steps(model, prompt, warmup)
    wall = run(steps)
    times = op_times(model.session.end_profiling(), skip_runs=1 + warmup, key=category)
    assert times["runs"] == steps, times["runs"]
    return statistics.mean(wall), {part: us / 1e3 / steps for part, (us, _) in times["ops"].items()}


def measure(name: str, model, directory: Path | None, args, prompt) -> list[dict]:
    ort = directory is not None
    unprofiled = load_ort(directory, args.threads) if ort else model
    wall = statistics.median(decode_steps(unprofiled, prompt, args.warmup + args.decode)[0][args.warmup:])
    if ort:
        prof_wall, parts = profile_ort(directory, args.threads, prompt, args.warmup, args.decode,
                                       directory / f"profile-batch{prompt.shape[0]}")
    else:
        prof_wall, parts = profile_torch(model, prompt, args.warmup, args.decode)
    parts = {p: parts.get(p, 0.0) for p in PARTS[:-1]}
    parts["outside kernels"] = prof_wall - sum(parts.values())
    base = {"config": name, "batch_size": prompt.shape[0], "prefill_tokens": prompt.shape[1],
            "decode_steps": args.decode, "warmup_steps": args.warmup, "cpu_threads": args.threads,
            "step_ms_unprofiled": wall, "step_ms_profiled": prof_wall,
            "profiler": "onnxruntime enable_profiling" if ort else "torch.profiler (self CPU time)"}
    return [base | {"part": p, "ms_per_step": ms, "share": ms / prof_wall} for p, ms in parts.items()]


def markdown(df: pd.DataFrame, env: dict) -> str:
    wide = df.pivot_table(index=["batch_size", "config", "step_ms_unprofiled", "step_ms_profiled"], columns="part",
                          values="ms_per_step", sort=False).reset_index()
    wide = wide[["batch_size", "config", "step_ms_unprofiled", "step_ms_profiled", *PARTS]]
    heads = ["batch", "config", "step ms", "step ms (profiled)", *PARTS]
    table = "\n".join(["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)] + [
        "| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row) + " |"
        for row in wide.itertuples(index=False)])
    r = df.iloc[0]
    return (f"# Where a decode step's time goes: ONNX Runtime and PyTorch on SmolLM2-135M\n\n"
            f"*Generated by `experiments/profile_ort_decode.py` from `ort_decode_profile.csv`.* "
            f"Prefill {r['prefill_tokens']} tokens, then {r['decode_steps']} greedy decode steps after "
            f"{r['warmup_steps']} uncounted ones, {r['cpu_threads']} thread(s). CPU `{env['cpu_model']}` "
            f"({env['logical_cpus']} logical CPUs; SIMD {env['cpu_simd']}; AVX-512 {env['cpu_avx512']}; AMX "
            f"{env['cpu_amx']}); load average (1 min) {env['loadavg_1m_start']:.2f} at start, "
            f"{env['loadavg_1m_end']:.2f} at end. Milliseconds per step: `step ms` unprofiled (median), the parts "
            "from the profiled pass (ORT: its per-node kernel times; PyTorch: torch.profiler's self CPU time per "
            "aten op; both profilers add overhead of their own, most of it outside the kernels).\n\n"
            + table + "\n\n" + findings(df) + "\n")


def findings(df: pd.DataFrame) -> str:
    """Generated from the rows: batch 8, ORT int4 against PyTorch fp32, part by part."""
    def ms(config, batch, part):
        sel = df[(df.config == config) & (df.batch_size == batch) & (df.part == part)]
        return float(sel.ms_per_step.iloc[0]) if len(sel) else float("nan")

    def wall(config, batch):
        sel = df[(df.config == config) & (df.batch_size == batch)]
        return float(sel.step_ms_unprofiled.iloc[0]) if len(sel) else float("nan")

    out = []
    for batch in sorted(df.batch_size.unique()):
        parts = ", ".join(f"{p} {ms('ort-int4-g64', batch, p):.1f} ({ms('fp32', batch, p):.1f})" for p in PARTS)
        out.append(f"- **Batch {batch}.** A step of ORT int4 g64 takes {wall('ort-int4-g64', batch):.1f} ms against "
                   f"PyTorch fp32's {wall('fp32', batch):.1f} ms ({wall('fp32', batch) / wall('ort-int4-g64', batch):.2f}× "
                   f"the speed) and ORT fp32's {wall('ort-fp32', batch):.1f} ms. Profiled, ORT int4 (PyTorch fp32) in "
                   f"ms: {parts}.")
    return "## Findings\n\n" + "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "ort_decode_profile.csv")
    ap.add_argument("--model", default=MODEL, help="alias, hub id or local path (default: SmolLM2-135M)")
    ap.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS], choices=[c.name for c in CONFIGS])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    base, _ = load_model(args.model, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(0)
    save = Path(tempfile.mkdtemp(prefix="quantlab-ort-profile-"))
    try:
        configs = [c for c in CONFIGS if c.name in args.configs]
        dirs = {c.name: save / c.name if c.backend == "onnxruntime" else None for c in configs}
        models = {c.name: (prepare(c, base, save_dir=dirs[c.name])[0], dirs[c.name]) for c in configs}
        rows = []
        for batch in args.batches:
            prompt = torch.randint(0, base.config.vocab_size, (batch, args.prefill), generator=gen)
            for name, (model, directory) in models.items():
                print(f"profile_ort_decode: {name}, batch {batch}", flush=True)
                rows += measure(name, model, directory, args, prompt)
    finally:
        shutil.rmtree(save, ignore_errors=True)
    env = environment(torch.device("cpu")) | cpu_facts() | {"loadavg_1m_start": load_start,
                                                             "loadavg_1m_end": os.getloadavg()[0]}
    df = pd.DataFrame(rows).assign(**env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    args.out.with_suffix(".md").write_text(markdown(df, env))
    print(findings(df))
    return 0


if __name__ == "__main__":
    sys.exit(main())
