"""Calibration seconds per method on SmolLM2-135M on this machine, side by side in one run (not a timed test).

    python3 experiments/bench_calibration.py               # ~8 min on a 2-core CPU
    python3 experiments/bench_calibration.py --windows 2   # quicker, noisier

Same seeded calibration windows (validation split, 8 x 512 tokens by default) for every method:
- GPTQ w4 g64 with true_sequential (the default): the current stage passes, which stop each block forward
  once the stage's layers have their inputs (calibration/blocks.observe_block), against the previous
  implementation (a full block forward per stage), with a check that both give the same codes bit for bit;
- GPTQ w4 g64, true_sequential = false; AWQ w4 g64 (llm-awq reference); SmoothQuant W8A8 (alpha 0.5 and
  searched); a sensitivity sweep of 4 layers (rtn w3 g64).
Writes reports/bench_calibration.csv with the CPU it ran on.
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

from experiments.smollm2_speed import cpu_facts
from quantlab.calibration import blocks
from quantlab.core.lifecycle import quant_linears, quantize
from quantlab.core.registry import make_config
from quantlab.mixed.sensitivity import sweep
from quantlab.models.data import calibration_windows, load_token_ids
from quantlab.models.loading import load_model
from quantlab.runs.envinfo import environment

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
    args = ap.parse_args(argv)
    model, tok = load_model("smollm2-135m", "float32", "cpu")
    ids, _ = load_token_ids("wikitext2", "validation", tok)
    windows = calibration_windows(ids, args.windows, 512, 0)
    calib = [w.unsqueeze(0) for w in windows]
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
