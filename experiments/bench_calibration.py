"""Calibration seconds per method on SmolLM2-135M on this machine, side by side in one run (not a timed test).

    python3 experiments/bench_calibration.py               # ~8 min on a 2-core CPU
    python3 experiments/bench_calibration.py --windows 2   # quicker, noisier

Same seeded calibration windows (validation split, 8 x 512 tokens by default) for every method:
- GPTQ w4 g64 with true_sequential (the default): the current stage passes, which stop each block forward
  once the stage's layers have their inputs (calibration/blocks.observe_block), against the previous
  implementation (a full block forward per stage), with a check that both give the same codes bit for bit;
- GPTQ w4 g64, true_sequential = false; AWQ w4 g64 (llm-awq reference); SmoothQuant W8A8 (alpha 0.5 and
  searched); a sensitivity sweep of 4 layers (rtn w3 g64).
Then each method's pace against the machine (--blocks, default 2: the first decoder blocks of SmolLM2, 16 x 512
calibration tokens as the PTQ reports): seconds per block, matmul FLOPs per block (torch's FlopCounterMode with the
in-place products and CPU attention it misses, quantlab.eval.compute, on a separate pass; AutoRound's by its
iteration count: counted at 1 and 2 iterations, which differ by one iteration's FLOPs), the achieved GFLOP/s and
its fraction of this machine's F.linear rate on the replays' shapes, measured in the same run. GPTQ (w4 g64,
true_sequential false), AWQ reference and version 1, AutoRound w4 g64 at 50 iterations (the committed rows) and
at the reference's 200, in float32 and with its matmuls under bf16 autocast (`dtype = "bfloat16"`; its fraction
is of F.linear's bf16 rate, measured too); `--methods` picks some.
Writes reports/bench_calibration.csv (seconds) and reports/bench_calibration_rate.csv (the pace; --out X.csv writes
X_rate.csv beside it), with the CPU and the load average.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.calibration import blocks
from quantlab.core.lifecycle import quant_linears, quantize
from quantlab.core.registry import make_config
from quantlab.eval.compute import count_matmul_flops, measure_matmul_rate
from quantlab.mixed.sensitivity import sweep
from quantlab.models.data import calibration_windows, load_token_ids
from quantlab.models.loading import load_model
from quantlab.runs.envinfo import cpu_facts, environment, load_average

W4 = {"bits": 4, "group_size": 64, "symmetric": False}


def _timed(model, spec: dict, calib) -> tuple[float, torch.nn.Module]:
    q = copy.deepcopy(model)
    t0 = time.perf_counter()
    quantize(q, make_config(spec), calibration=calib, progress=False)
    return time.perf_counter() - t0, q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_calibration.csv"))
    ap.add_argument("--blocks", type=int, default=2, help="decoder blocks the pace is measured on")
    ap.add_argument("--rate-only", action="store_true", help="only the pace (bench_calibration_rate.csv)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--methods", nargs="+", default=None, metavar="SUBSTRING",
                    help="pace only the methods whose name contains one of these (default: all; names: "
                         + "; ".join(PACE) + ")")
    args = ap.parse_args(argv)
    if args.methods and not any(m in n for n in PACE for m in args.methods):  # before any model loads
        ap.error(f"--methods {' '.join(args.methods)}: no method matches; names: {'; '.join(PACE)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", "float32", "cpu")
    ids, _ = load_token_ids("wikitext2", "validation", tok)
    windows = calibration_windows(ids, args.windows, 512, 0)
    calib = [w.unsqueeze(0) for w in windows]
    if args.rate_only:
        return pace(model, tok, args.blocks, Path(args.out).with_name(Path(args.out).stem + "_rate.csv"),
                    args.methods)
    rows = []

    def add(name, seconds, note=""):
        rows.append({"method": name, "calibrate_s": seconds, "note": note})
        print(f"{name:40s} {seconds:8.1f} s  {note}", flush=True)

    gptq = {"method": "gptq", **W4}
    new_s, new = _timed(model, gptq, calib)
    real = blocks.observe_block
    blocks.observe_block = lambda block, inputs, kwargs, modules: blocks.run_block(block, inputs, kwargs)
    try:
        old_s, old = _timed(model, gptq, calib)
    finally:
        blocks.observe_block = real
    same = all(torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
               for a, b in zip(quant_linears(new).values(), quant_linears(old).values()))
    if not same:
        raise SystemExit("GPTQ with early-stopped stage passes differs from the full-forward version")
    add("gptq-w4-g64 true_sequential (current)", new_s, f"{old_s / new_s:.2f}x faster than the previous; same codes")
    add("gptq-w4-g64 true_sequential (previous)", old_s, "a full block forward per stage")
    del new, old
    add("gptq-w4-g64 true_sequential=false", _timed(model, {**gptq, "true_sequential": False}, calib)[0])
    add("awq-w4-g64 (llm-awq reference)", _timed(model, {"method": "awq", "base": {"method": "rtn", **W4}}, calib)[0])
    add("smoothquant-a0.5-w8a8", _timed(model, {"method": "smoothquant", "alpha": 0.5}, calib)[0])
    add("smoothquant-search-w8a8", _timed(model, {"method": "smoothquant", "alpha": "search"}, calib)[0])
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.29.self_attn.q_proj",
              "model.layers.29.mlp.down_proj"]
    cfg = make_config({"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False, "include": layers})
    t0 = time.perf_counter()
    sweep(model, [cfg], windows[:2], progress=False)
    add("sensitivity, 4 layers x 2 windows", time.perf_counter() - t0, "float reference + 4 unit replays")
    env = environment(torch.device("cpu")) | cpu_facts() | {"calib_windows": args.windows, "calib_seq_len": 512}
    df = pd.DataFrame([{**r, **env} for r in rows])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(f"-> {args.out} [{env['cpu_model']}, avx512: {env['cpu_avx512'] != 'none'}]")
    return pace(model, tok, args.blocks, Path(args.out).with_name(Path(args.out).stem + "_rate.csv"), args.methods)


PACE = {  # name -> (config, FLOPs linear in iters: counted at 1 and 2 iterations)
    "gptq-w4-g64": ({"method": "gptq", **W4, "true_sequential": False}, False),
    "awq-w4-g64 (reference)": ({"method": "awq", "base": {"method": "rtn", **W4}}, False),
    "awq-v1-w4-g64": ({"method": "awq", "base": {"method": "rtn", **W4}, "scale_loss": "linear", "clip": "minmax",
                       "clip_qk": True, "block_inputs": "quantized"}, False),
    "autoround-w4-g64 iters=50": ({"method": "autoround", **W4, "iters": 50}, True),
    "autoround-w4-g64 iters=200 (reference)": ({"method": "autoround", **W4, "iters": 200}, True),
    # the tuning loop's matmuls under bf16 autocast (auto-round's amp default where the CPU has native bf16)
    "autoround-w4-g64 iters=200 bf16": ({"method": "autoround", **W4, "iters": 200, "dtype": "bfloat16"}, True),
}


def _first_blocks(model, n: int):
    """A copy of `model` with only its first n decoder blocks (calibration cost is per block)."""
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:n]
    short.config.num_hidden_layers = n
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = short.config.layer_types[:n]
    return short


def _count(model, spec: dict, calib) -> int:
    return count_matmul_flops(lambda: quantize(copy.deepcopy(model), make_config(spec), calibration=calib,
                                               progress=False))[0]


def pace(model, tok, n_blocks: int, out: Path, methods: list[str] | None = None) -> int:
    """Seconds and matmul FLOPs per block of each PACE method (those whose name contains one of `methods`, default
    all) on the first n_blocks blocks, against this machine's F.linear rate measured in the same run, in float32 and,
    for a bf16 method, in bf16 as well."""
    chosen = {n: v for n, v in PACE.items() if methods is None or any(m in n for m in methods)}  # main() checked
    ids, _ = load_token_ids("wikitext2", "validation", tok)
    calib = [w.unsqueeze(0) for w in calibration_windows(ids, 16, 512, 0)]
    load_start = load_average()
    rate = measure_matmul_rate()
    print(f"F.linear rate: {rate['matmul_gflops']:.1f} GFLOP/s at {rate['matmul_shape']} ({rate['matmul_gflops_by_shape']})")
    if any(spec.get("dtype") == "bfloat16" for spec, _ in chosen.values()):
        bf16 = measure_matmul_rate(dtype=torch.bfloat16)
        rate |= {"matmul_gflops_bf16": bf16["matmul_gflops"], "matmul_gflops_by_shape_bf16": bf16["matmul_gflops_by_shape"]}
        print(f"F.linear rate in bf16: {bf16['matmul_gflops']:.1f} GFLOP/s ({bf16['matmul_gflops_by_shape']})")
    short, one = _first_blocks(model, n_blocks), _first_blocks(model, 1)
    rows = []
    for name, (spec, per_iter) in chosen.items():
        seconds = _timed(short, spec, calib)[0] / n_blocks
        if per_iter:  # F(iters) = F0 + iters x Fi, counted at 1 and 2 iterations
            f1, f2 = (_count(one, {**spec, "iters": i}, calib) for i in (1, 2))
            flops = f1 + (spec["iters"] - 1) * (f2 - f1)
        else:
            flops = _count(one, spec, calib)
        achieved = flops / seconds / 1e9
        key = "matmul_gflops_bf16" if spec.get("dtype") == "bfloat16" else "matmul_gflops"  # its own dtype's rate
        rows.append({"method": name, "s_per_block": seconds, "gflop_per_block": flops / 1e9,
                     "achieved_gflops": achieved, "fraction_of_matmul_rate": achieved / rate[key],
                     "matmul_rate_dtype": spec.get("dtype", "float32"),
                     "full_model_s_estimate": seconds * model.config.num_hidden_layers})
        print(f"{name:42s} {seconds:7.1f} s/block {flops / 1e9:8.1f} GFLOP/block {achieved:6.1f} GFLOP/s "
              f"= {achieved / rate[key]:.0%} of the F.linear rate in {spec.get('dtype', 'float32')}", flush=True)
    env = environment(torch.device("cpu")) | cpu_facts() | rate | {
        "calib_windows": 16, "calib_seq_len": 512, "blocks_measured": n_blocks, "threads": torch.get_num_threads(),
        "load_avg_start": load_start, "load_avg_end": load_average(),
        "flop_count": "FlopCounterMode + in-place products + CPU attention (quantlab.eval.compute)"}
    pd.DataFrame([{**r, **env} for r in rows]).to_csv(out, index=False)
    print(f"-> {out} [{env['cpu_model']}, load {load_start:.2f} -> {env['load_avg_end']:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
