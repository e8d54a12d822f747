"""Where a decode step's time goes in ONNX Runtime and in PyTorch, at batch 1 and 8 (issue 32's ORT batch-8 profile).

    python3 experiments/profile_ort_decode.py --threads 1     # ~8 min on a 2-core AVX2 EPYC (two ONNX exports)

SmolLM2-135M, the configurations of reports/smollm2_speed: PyTorch fp32, ORT fp32 and ORT int4 g64 (asymmetric,
accuracy level 4: MatMulNBits with int8 activations), each exported once. Per configuration and batch: a prefill of
--prefill tokens (seeded random ids, as the speed report's), then --decode greedy steps; the first --warmup steps
are not counted. Two passes:
- unprofiled: the wall time of each step (median), as the speed report measures it;
- profiled: ORT's own per-node profile (backends/ort_profile.py), summed into the parts of a step: the linears,
  attention (q·kᵀ, softmax, ·v), concat (the KV cache's past + new, rotary's halves), other (norms, rotary, masks,
  shape and elementwise ops), and what is outside any kernel (the profiled step's wall time minus its kernels:
  feeds, copies, the runtime's own overhead); and per op type. PyTorch: forward hooks time its linears and its
  attention modules (torch.profiler slowed its batch-8 step 2.3x and charged most of it to aten::cat).
Writes reports/ort_decode_profile.{csv,md} and ort_decode_profile_ops.csv (ORT's op types); the CPU, its flags and
the load average go in every row.
"""
from __future__ import annotations

import argparse
import inspect
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from smollm2_speed import INT4, MODEL

from quantlab.backends.ort import load_ort
from quantlab.backends.ort_profile import category, op_times
from quantlab.models.loading import load_model
from quantlab.runs.bench import BenchConfig, prepare
from quantlab.runs.envinfo import cpu_facts, environment, load_average

CONFIGS = [BenchConfig("fp32"), BenchConfig("ort-fp32", backend="onnxruntime"),
           BenchConfig("ort-int4-g64", INT4, backend="onnxruntime", ort_accuracy_level=4)]
PARTS = ("linear", "attention", "concat", "other", "outside kernels")


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


def profile_torch(model, prompt, warmup: int, steps: int) -> tuple[float, dict, list]:
    """(wall ms per step, {part: ms per step}, []) over `steps` steps after `warmup`, timed by forward hooks:
    "linear" every nn.Linear (lm_head included), "attention" each attention module's own time less its linears
    (rotary, the KV cache's update and concat, SDPA), "other" the rest of the step (norms, the MLP's activation,
    embedding, the framework). torch.profiler is not used: on this model it slowed a batch-8 step 2.3x and charged
    most of it to aten::cat, so its parts did not add up to the unprofiled step."""
    spent, started = {"linear": 0.0, "attention": 0.0, "linear in attention": 0.0}, {}

    def hooks(module: nn.Module, parts: tuple[str, ...]):
        def pre(mod, args):
            started[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            for part in parts:
                spent[part] += time.perf_counter() - started[id(mod)]
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles += hooks(module, ("linear", "linear in attention") if ".self_attn." in name else ("linear",))
        elif name.endswith("self_attn"):
            handles += hooks(module, ("attention",))
    _, run = decode_steps(model, prompt, warmup)
    spent.update(dict.fromkeys(spent, 0.0))  # the prefill and warm-up steps do not count
    try:
        wall = statistics.mean(run(steps))
    finally:
        for h in handles:
            h.remove()
    linear, attention = spent["linear"] * 1e3 / steps, (spent["attention"] - spent["linear in attention"]) * 1e3 / steps
    return wall, {"linear": linear, "attention": attention, "other": wall - linear - attention}, []


def profile_ort(directory: Path, threads: int, prompt, warmup: int, steps: int, prefix: Path) -> tuple[float, dict,
                                                                                                         list]:
    """(wall ms per step, {part: kernel ms per step}, [(op type, part, ms per step, calls per step)]) from a fresh
    ORT session that records its per-node profile, over `steps` steps after `warmup`."""
    model = load_ort(directory, threads, profile=prefix)
    _, run = decode_steps(model, prompt, warmup)
    wall = statistics.mean(run(steps))
    by_op = op_times(model.session.end_profiling(), skip_runs=1 + warmup,
                     key=lambda e: (e.get("args", {}).get("op_name", "?"), category(e)))
    assert by_op["runs"] == steps, by_op["runs"]
    ops = [(op, part, us / 1e3 / steps, n / steps) for (op, part), (us, n) in by_op["ops"].items()]
    parts: dict[str, float] = {}
    for _, part, ms, _ in ops:  # each part: the sum of its op types
        parts[part] = parts.get(part, 0.0) + ms
    return wall, parts | {"outside kernels": wall - sum(parts.values())}, ops


def measure(name: str, model, directory: Path | None, args, prompt) -> tuple[list[dict], list[dict]]:
    """(a row per part, a row per ORT op type) of one configuration at one batch size."""
    ort = directory is not None
    unprofiled = load_ort(directory, args.threads) if ort else model
    wall = statistics.median(decode_steps(unprofiled, prompt, args.warmup + args.decode)[0][args.warmup:])
    if ort:
        prof_wall, parts, ops = profile_ort(directory, args.threads, prompt, args.warmup, args.decode,
                                            directory / f"profile-batch{prompt.shape[0]}")
    else:
        prof_wall, parts, ops = profile_torch(model, prompt, args.warmup, args.decode)
    base = {"config": name, "batch_size": prompt.shape[0], "prefill_tokens": prompt.shape[1],
            "decode_steps": args.decode, "warmup_steps": args.warmup, "cpu_threads": args.threads,
            "step_ms_unprofiled": wall, "step_ms_profiled": prof_wall,
            "profiler": "onnxruntime enable_profiling" if ort else "forward hooks (perf_counter)"}
    rows = [base | {"part": p, "ms_per_step": parts.get(p, float("nan")), "share": parts.get(p, float("nan")) / prof_wall}
            for p in PARTS]
    op_rows = [{"config": name, "batch_size": prompt.shape[0], "op": op, "part": part, "ms_per_step": ms,
                "calls_per_step": calls, "share": ms / prof_wall} for op, part, ms, calls in ops]
    return rows, op_rows


def _cell(v) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.1f}"
    return str(v)


def _table(heads: list[str], rows) -> str:
    return "\n".join(["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
                     + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def markdown(df: pd.DataFrame, ops: pd.DataFrame, env: dict, stem: str = "ort_decode_profile") -> str:
    keys = ["batch_size", "config"]
    steps = df.groupby(keys, sort=False)[["step_ms_unprofiled", "step_ms_profiled"]].first()
    wide = steps.join(df.set_index([*keys, "part"]).ms_per_step.unstack("part").reindex(columns=list(PARTS)))
    parts = _table(["batch", "config", "step ms", "step ms (profiled)", *PARTS],
                   wide.reset_index().itertuples(index=False))
    r = df.iloc[0]
    return (f"# Where a decode step's time goes: ONNX Runtime and PyTorch on SmolLM2-135M\n\n"
            f"*Generated by `experiments/profile_ort_decode.py` from `{stem}.csv` and "
            f"`{stem}_ops.csv`.* Prefill {r['prefill_tokens']} tokens, then {r['decode_steps']} greedy "
            f"decode steps after {r['warmup_steps']} uncounted ones, {r['cpu_threads']} thread(s). CPU "
            f"`{env['cpu_model']}` ({env['logical_cpus']} logical CPUs; SIMD {env['cpu_simd']}; AVX-512 "
            f"{env['cpu_avx512']}; AMX {env['cpu_amx']}); load average (1 min) {env['loadavg_1m_start']:.2f} at "
            f"start, {env['loadavg_1m_end']:.2f} at end.\n\n"
            "Milliseconds per step. `step ms`: unprofiled (median of the steps). The parts come from a second, "
            "profiled pass (`step ms (profiled)`, its mean). ONNX Runtime: its own per-node kernel times "
            "(`enable_profiling`), by part (backends/ort_profile.category); `outside kernels` is the profiled step "
            "less its kernels (feeds, copies, the session's own work). PyTorch: forward hooks around every "
            "`nn.Linear` and attention module; its `attention` holds rotary, the KV cache's update (its concat) and "
            "SDPA, and its `other` is the rest of the step, framework included, so it has no `concat` or "
            "`outside kernels` of its own.\n\n" + parts + "\n\n" + op_section(ops) + "\n\n" + findings(df, ops) + "\n")


def op_section(ops: pd.DataFrame, config: str = "ort-int4-g64", top: int = 12) -> str:
    """ORT int4's op types, the costliest at the largest batch first, ms per step (calls per step) at each batch."""
    sel = ops[ops.config == config]
    if sel.empty:
        return ""
    batches = sorted(sel.batch_size.unique())
    order = sel[sel.batch_size == batches[-1]].sort_values("ms_per_step", ascending=False)[["op", "part"]]
    rows = []
    for op, part in order.head(top).itertuples(index=False):
        cells = []
        for b in batches:
            hit = sel[(sel.batch_size == b) & (sel.op == op) & (sel.part == part)]
            cells.append(f"{hit.ms_per_step.iloc[0]:.1f} ({hit.calls_per_step.iloc[0]:.0f})" if len(hit) else "–")
        rows.append((op, part, *cells))
    return (f"**{config}: its costliest op types** (kernel ms per step, calls per step in brackets):\n\n"
            + _table(["op", "part", *(f"batch {b}" for b in batches)], rows))


def findings(df: pd.DataFrame, ops: pd.DataFrame) -> str:
    """Generated from the rows: ORT int4 against PyTorch fp32 at each batch, and what grows with the batch."""
    def value(column, config, batch, part=None):
        sel = df[(df.config == config) & (df.batch_size == batch) & ((df.part == part) if part else True)]
        return float(sel[column].iloc[0]) if len(sel) else float("nan")

    def ms(config, batch, part):
        return value("ms_per_step", config, batch, part)

    def wall(config, batch):
        return value("step_ms_unprofiled", config, batch)

    def profiled(config, batch):
        return value("step_ms_profiled", config, batch)

    out, q = [], "ort-int4-g64"
    batches = sorted(df.batch_size.unique())
    for b in batches:
        rest = profiled(q, b) - ms(q, b, "linear")
        out.append(f"- **Batch {b}.** A step of ORT int4 g64 takes {wall(q, b):.1f} ms against PyTorch fp32's "
                   f"{wall('fp32', b):.1f} ms ({wall('fp32', b) / wall(q, b):.2f}× its speed) and ORT fp32's "
                   f"{wall('ort-fp32', b):.1f} ms. Its linears (MatMulNBits and the float lm_head) take "
                   f"{ms(q, b, 'linear'):.1f} ms, {ms(q, b, 'linear') / profiled(q, b):.0%} of the profiled step, "
                   f"against PyTorch fp32's {ms('fp32', b, 'linear'):.1f} ms; the rest of ORT's step takes "
                   f"{rest:.1f} ms (attention {ms(q, b, 'attention'):.1f}, concat {ms(q, b, 'concat'):.1f}, other "
                   f"{ms(q, b, 'other'):.1f}, outside kernels {ms(q, b, 'outside kernels'):.1f}), against PyTorch's "
                   f"{profiled('fp32', b) - ms('fp32', b, 'linear'):.1f} ms beside its linears.")
    if len(batches) > 1:
        lo, hi = batches[0], batches[-1]
        sel = ops[(ops.config == q) & (ops.part == "other")]
        grow = sel.pivot_table(index="op", columns="batch_size", values="ms_per_step", aggfunc="sum").fillna(0.0)
        if hi in grow and lo in grow:
            grow = (grow[hi] - grow[lo]).sort_values(ascending=False).head(4)
            named = ", ".join(f"{op} +{d:.1f} ms" for op, d in grow.items())
            out.append(f"- **What grows with the batch** (ORT int4, batch {lo} → {hi}): linears "
                       f"{ms(q, lo, 'linear'):.1f} → {ms(q, hi, 'linear'):.1f} ms, attention "
                       f"{ms(q, lo, 'attention'):.1f} → {ms(q, hi, 'attention'):.1f}, concat "
                       f"{ms(q, lo, 'concat'):.1f} → {ms(q, hi, 'concat'):.1f}, other {ms(q, lo, 'other'):.1f} → "
                       f"{ms(q, hi, 'other'):.1f}; the op types of `other` that grew most: {named}.")
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
    load_start = load_average()
    base, _ = load_model(args.model, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(0)
    save = Path(tempfile.mkdtemp(prefix="quantlab-ort-profile-"))
    try:
        configs = [c for c in CONFIGS if c.name in args.configs]
        dirs = {c.name: save / c.name if c.backend == "onnxruntime" else None for c in configs}
        models = {c.name: (prepare(c, base, save_dir=dirs[c.name])[0], dirs[c.name]) for c in configs}
        rows, op_rows = [], []
        for batch in args.batches:
            prompt = torch.randint(0, base.config.vocab_size, (batch, args.prefill), generator=gen)
            for name, (model, directory) in models.items():
                print(f"profile_ort_decode: {name}, batch {batch}", flush=True)
                part_rows, ops = measure(name, model, directory, args, prompt)
                rows, op_rows = rows + part_rows, op_rows + ops
    finally:
        shutil.rmtree(save, ignore_errors=True)
    env = environment(torch.device("cpu")) | cpu_facts() | {"loadavg_1m_start": load_start,
                                                             "loadavg_1m_end": load_average()}
    df = pd.DataFrame(rows).assign(**env)
    ops = pd.DataFrame(op_rows, columns=["config", "batch_size", "op", "part", "ms_per_step", "calls_per_step",
                                         "share"]).assign(**env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    ops.to_csv(args.out.with_name(args.out.stem + "_ops.csv"), index=False)
    args.out.with_suffix(".md").write_text(markdown(df, ops, env, args.out.stem))
    print(findings(df, ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
