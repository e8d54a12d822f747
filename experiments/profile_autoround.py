"""Where AutoRound's tuning-loop time goes, in float32 and under bf16 autocast (issue 32, item 3: why the reference
defaults do not fit in 15 minutes on 2 cores).

    python3 experiments/profile_autoround.py --threads 1 --compile-qdq --compile-block   # ~8 min, 2-core Xeon with AMX

The first decoder block of SmolLM2-135M alone (`bench_calibration._first_blocks`), the referee's AutoRound settings
(w4 g64 symmetric, full_range, batch 8 windows of 512 tokens a step) on 16 seeded WikiText-2 validation windows, --iters
iterations (default 30), one row per mode:
- `float32`, `bfloat16` (`dtype = "bfloat16"`: the block forward and backward under bf16 autocast);
- with --compile-qdq, each again with the grid arithmetic (`autoround_qdq`, forward and backward) under torch.compile,
  an experiment only (quantlab does not ship it): what fusing those elementwise passes would save;
- with --compile-block, each again with AutoRound's `compile = true`: the decoder block's forward under torch.compile
  while tuning (the grid arithmetic traced into it), as auto-round compiles its block forward, each block checked
  against eager at iteration 0 (that check runs in both timed runs, so it cancels from the seconds per iteration).
Per mode, after one untimed 2-iteration run (compiling, allocator warm-up): the seconds per iteration, from two
unprofiled runs, (t(iters) - t(2)) / (iters - 2), so the fixed work (the block's float targets, the full-set check's
forwards) cancels; then torch.profiler's self CPU time of a third run of --iters iterations, summed into parts: matmul (aten::mm / addmm / bmm), attention (the
scaled-dot-product kernels, forward and backward), casts (aten::copy_ / _to_copy: autocast's bf16 copies, the weights'
dtype change) and the rest (norms, activations, rotary, the loss, the grid arithmetic's elementwise ops, autograd's own);
and the grid arithmetic's forward alone (its record_function's total, children included; its backward runs in
autograd's engine and falls in the parts above). The profiled run includes the fixed work (about 3 forwards over
the windows, against 3 forward-equivalents an iteration: under a tenth of the run at 30 iterations).
Writes reports/profile_autoround.csv (a row per mode) and profile_autoround_ops.csv (the --top ops of each mode by self
time); the CPU, its flags, the threads and the load average go in every row.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_calibration import _first_blocks

from quantlab.core.lifecycle import quantize
from quantlab.core.registry import make_config
from quantlab.methods import autoround_state
from quantlab.models.data import calibration_windows, load_token_ids
from quantlab.models.loading import load_model
from quantlab.runs.envinfo import cpu_facts, environment, load_average

SPEC = {"method": "autoround", "bits": 4, "group_size": 64, "symmetric": True, "full_range": True, "batch_size": 8}
PARTS = ("matmul", "attention", "casts", "rest")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm"}
CASTS = {"aten::copy_", "aten::_to_copy"}


def part(op: str) -> str:
    """The part of the loop an aten op's self time counts in."""
    if op in MATMUL:
        return "matmul"
    if "scaled_dot_product" in op:
        return "attention"
    return "casts" if op in CASTS else "rest"


@contextmanager
def grid_arithmetic(compiled: bool):
    """autoround_qdq inside a record_function (its forward's total) and, compiled, under torch.compile."""
    real = autoround_state.autoround_qdq
    inner = torch.compile(real, dynamic=False) if compiled else real

    def qdq(*args, **kwargs):
        with record_function("autoround_qdq"):
            return inner(*args, **kwargs)

    autoround_state.autoround_qdq = qdq
    try:
        yield
    finally:
        autoround_state.autoround_qdq = real


def profile_mode(block_model, calib, iters: int, dtype: str, compiled: str, top: int) -> tuple[dict, list[dict]]:
    """One mode, compiled "" (eager), "qdq" or "block": (its row, its top ops)."""
    mode_spec = {**SPEC, "dtype": dtype} | ({"compile": True} if compiled == "block" else {})
    cfg, short = make_config({**mode_spec, "iters": iters}), make_config({**mode_spec, "iters": 2})

    def timed(c) -> float:
        model = copy.deepcopy(block_model)
        t0 = time.perf_counter()
        quantize(model, c, calibration=calib, progress=False)
        return time.perf_counter() - t0

    with grid_arithmetic(compiled == "qdq"):
        timed(short)  # compiles (compiled qdq), warms the allocator
        t_short, t_long = timed(short), timed(cfg)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed(cfg)
    events = prof.key_averages()
    self_s = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    total = sum(self_s.values())
    shares = {p: sum(s for op, s in self_s.items() if part(op) == p) / total for p in PARTS}
    qdq_s = sum(e.cpu_time_total for e in events if e.key == "autoround_qdq") / 1e6
    mode = dtype + (f" + compiled {compiled}" if compiled else "")
    row = {"mode": mode, "dtype": dtype, "compiled": compiled, "iters": iters, "wall_s": t_long,
           "wall_s_2_iters": t_short, "s_per_iter": (t_long - t_short) / (iters - 2), "profiled_s": total,
           **{f"share_{p}": shares[p] for p in PARTS}, "share_qdq_forward": qdq_s / total}
    ops = sorted(self_s.items(), key=lambda kv: -kv[1])[:top]
    return row, [{"mode": mode, "op": op, "part": part(op), "self_s": s, "share": s / total} for op, s in ops]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (batch_size 8 of them a step)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--compile-qdq", action="store_true", help="also each mode with autoround_qdq compiled")
    ap.add_argument("--compile-block", action="store_true",
                    help="also each mode with compile = true (the block forward compiled)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--top", type=int, default=25, help="ops per mode in the ops CSV")
    ap.add_argument("--out", default=str(ROOT / "reports" / "profile_autoround.csv"))
    args = ap.parse_args(argv)
    if args.iters < 3:
        ap.error(f"--iters must be >= 3 (seconds per iteration: against a 2-iteration run), got {args.iters}")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, tok = load_model(args.model, "float32", "cpu", progress=False)
        ids, _ = load_token_ids("wikitext2", "validation", tok)
        calib = [w.unsqueeze(0) for w in calibration_windows(ids, args.windows, args.seq_len, 0)]
        one = _first_blocks(model, 1)
        load_start = load_average()
        rows, ops = [], []
        for dtype in args.dtypes:
            for compiled in [""] + ["qdq"] * args.compile_qdq + ["block"] * args.compile_block:
                row, top = profile_mode(one, calib, args.iters, dtype, compiled, args.top)
                rows.append(row)
                ops += top
                print(f"{row['mode']:26s} {row['s_per_iter']:6.3f} s/iter (unprofiled); of the profiled time: "
                      + ", ".join(f"{p} {row[f'share_{p}']:.0%}" for p in PARTS)
                      + f"; grid arithmetic forward {row['share_qdq_forward']:.0%}", flush=True)
        env = environment(torch.device("cpu")) | cpu_facts() | {
            "model": args.model, "windows": args.windows, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
            "load_avg_start": load_start, "load_avg_end": load_average()}
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{**r, **env} for r in rows]).to_csv(out, index=False)
    pd.DataFrame([{**o, **env} for o in ops]).to_csv(out.with_name(out.stem + "_ops.csv"), index=False)
    eager = {r["dtype"]: r for r in rows if not r["compiled"]}
    for r in rows[1:]:
        base = eager[r["dtype"]] if r["compiled"] else rows[0]
        print(f"{r['mode']} against {base['mode']}: {base['s_per_iter'] / r['s_per_iter']:.2f}x")
    print(f"-> {out} [{env['cpu_model']}, {env['threads']} thread(s), load {load_start:.2f} -> {env['load_avg_end']:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
