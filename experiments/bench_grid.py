"""The same 8-run grid with the local executor and with Ray on this machine, side by side (not a timed test).

    python3 experiments/bench_grid.py            # ~6 min on a 2-core CPU

Grid: RTN on SmolLM2-135M, bits 3/4 x group size 64/128 x sym/asym (8 runs, `[[sweep]]`), 2 test windows of
256 tokens, KL on both. Local: one process, runs one after another on all threads. Ray: a local instance with
2 slots of 1 CPU each (the tasks' torch threads), each task loading the model by name. Reports:
- wall time of each executor, and the speed-up;
- Ray's overhead per task: the slot-seconds the grid took beyond the runs' own measured work (quantize +
  evaluate), per task (worker start, imports, model load, windows), and the round trip of an empty task;
- a projection for 4 such nodes from the measured per-run time + overhead (8 runs over 8 slots).
Writes reports/bench_grid.csv.
"""
from __future__ import annotations

import argparse
import math
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

from quantlab.reporting.results import read_rows
from quantlab.runs.envinfo import cpu_facts
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.runner import run_experiment

SLOTS = 2


def grid():
    return parse_experiment({
        "name": "bench_grid", "model": "smollm2-135m", "device": "cpu", "execution": {"num_cpus": 1},
        "eval": {"seq_len": 256, "max_windows": 2, "kl_windows": 2, "latency": False},
        "sweep": [{"method": "rtn", "bits": [3, 4], "group_size": [64, 128], "symmetric": [True, False]}],
    })


def work_s(rows) -> float:
    return sum(sum(r.get(k) or 0.0 for k in ("quantize_s", "eval_s", "kl_reference_s")) for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_grid.csv"))
    args = ap.parse_args(argv)
    import ray

    exp = grid()
    tmp = Path(tempfile.mkdtemp(prefix="quantlab-bench-grid-"))
    try:
        t0 = time.perf_counter()
        run_experiment(exp, tmp / "local", progress=False)
        local_s = time.perf_counter() - t0
        ray.init(num_cpus=SLOTS, include_dashboard=False, log_to_driver=False)
        empty = ray.remote(lambda: None)
        ray.get([empty.remote() for _ in range(4)])  # warm the workers
        rt = []
        for _ in range(20):
            t = time.perf_counter()
            ray.get(empty.remote())
            rt.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        run_experiment(exp, tmp / "ray", progress=False, executor="ray")
        ray_s = time.perf_counter() - t0
        ray.shutdown()
        local_rows = read_rows(tmp / "local/bench_grid.results.jsonl")
        ray_rows = read_rows(tmp / "ray/bench_grid.results.jsonl")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(exp.runs)
    per_run_local = work_s(local_rows) / n
    per_run_ray = work_s(ray_rows) / n
    overhead = (ray_s * SLOTS - work_s(ray_rows)) / n
    nodes, slots_per_node = 4, SLOTS
    projected = math.ceil(n / (nodes * slots_per_node)) * (per_run_ray + overhead)
    env = cpu_facts() | {"torch": torch.__version__, "ray": ray.__version__, "threads_local": torch.get_num_threads()}
    rows = [
        {"measure": "local_wall_s", "value": local_s, "note": f"{n} runs one after another, {env['threads_local']} threads"},
        {"measure": "ray_wall_s", "value": ray_s, "note": f"{SLOTS} slots x 1 CPU, incl. Ray start and worker setup"},
        {"measure": "ray_speedup", "value": local_s / ray_s, "note": "local wall / Ray wall"},
        {"measure": "per_run_work_local_s", "value": per_run_local, "note": "quantize + evaluate, mean"},
        {"measure": "per_run_work_ray_s", "value": per_run_ray, "note": "the same on a 1-thread worker"},
        {"measure": "ray_overhead_per_task_s", "value": overhead,
         "note": "slot-seconds beyond the runs' own work, per task (worker start, imports, model load, windows)"},
        {"measure": "ray_empty_task_roundtrip_ms", "value": 1e3 * statistics.median(rt), "note": "median of 20"},
        {"measure": "projected_4_nodes_wall_s", "value": projected,
         "note": f"{nodes} nodes x {slots_per_node} slots like this one: ceil({n}/{nodes * slots_per_node}) x "
                 f"(per-run work + overhead); not measured"},
    ]
    df = pd.DataFrame([{**r, **env} for r in rows])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(df[["measure", "value", "note"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
