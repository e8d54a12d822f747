"""Why does SpinQuant's loss rise on SmolLM2? Short Cayley-SGD trials at several lr, with the step each took.

The SGDG step is min(lr, 1 / ||W||_1) · W (transforms/spinquant.py): where the gradient is large the cap binds and
every lr above it takes the same step. This runs `--steps` steps of learn_rotations per lr (W4 per-token symmetric
activations, as `smollm2_w4a4_2025`'s SpinQuant row; float weights, as the reference learns them), on the seed-0
draw of 32 WikiText-2 validation windows of 512 tokens, and writes one row per lr: the loss before and after on the
first 8 windows, R1's mean / min / max step, and the seconds.

    python experiments/spinquant_lr.py --steps 10 --lr 1.5 1e-2 1e-3 1e-4 --threads 2
      -> reports/spinquant_lr.csv (rows appended: an lr already in the file for these settings is skipped)
    python experiments/spinquant_lr.py --line-search 0 1e-4 3e-4 1e-3 3e-3 1e-2 --threads 2
      -> reports/spinquant_linesearch.csv: the loss along the first step's direction (loss_along_first_step), on
         the gradient's window and on the 8 next ones, at each step size: is the surface smooth enough to descend?
    python experiments/spinquant_lr.py --perturb 1e-6 1e-4 1e-2 --draws 4 --seeds 0 5 --threads 2
      -> reports/spinquant_perturb.csv: the loss on the first 8 windows with R1 times a random rotation of relative
         size eps (loss_under_perturbation), from the random-Hadamard start of each seed: the loss's noise floor

About 2 minutes per lr at 10 steps on a 2-core AVX2 EPYC (2 threads).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments.smollm2_speed, run from anywhere

import quantlab
from quantlab.models.data import calibration_windows, load_token_ids
from quantlab.runs.envinfo import cpu_facts, git_sha, load_average
from quantlab.transforms.rotation import RotationConfig
from quantlab.transforms.spinquant import LOSS_WINDOWS, learn_rotations, loss_along_first_step, loss_under_perturbation


def schedule(lr: float, steps: int) -> list[float]:
    """The lr of each step as learn_rotations decays it (cosine to 0, no warm-up)."""
    return [lr * 0.5 * (1 + math.cos(math.pi * s / steps)) for s in range(steps)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, nargs="+", default=[1.5, 1e-2, 1e-3, 1e-4])
    p.add_argument("--windows-per-step", type=int, default=1)
    p.add_argument("--act-bits", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--line-search", type=float, nargs="+", metavar="T",
                   help="instead of the lr trials: the loss along the first step at these step sizes")
    p.add_argument("--perturb", type=float, nargs="+", metavar="EPS",
                   help="instead of the lr trials: the loss with R1 perturbed by random rotations of these sizes")
    p.add_argument("--draws", type=int, default=4, help="--perturb: random rotations per size")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="--perturb: the Hadamard starts' seeds")
    p.add_argument("--out", default=None, help="default reports/spinquant_lr.csv (--line-search: "
                                              "reports/spinquant_linesearch.csv, --perturb: spinquant_perturb.csv)")
    args = p.parse_args(argv)
    mode = "linesearch" if args.line_search else "perturb" if args.perturb else "lr"
    args.out = args.out or f"reports/spinquant_{mode}.csv"
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model, tok = quantlab.load_model(args.model, device="cpu", progress=False)
        val, source = load_token_ids("wikitext2", "validation", tok)
        calib = [w[None] for w in calibration_windows(val, 32, 512, seed=0)]
        out = Path(args.out)
        if args.perturb:
            load, t, rows = load_average(), time.perf_counter(), []
            for seed in args.seeds:
                cfg = RotationConfig(kind="spinquant", seed=seed)
                got = loss_under_perturbation(model, calib[:LOSS_WINDOWS], cfg, args.act_bits, True, args.perturb,
                                              args.draws, seed=seed)
                rows += [r | {"seed": seed} for r in got]
                for r in got:
                    print(f"seed {seed} eps {r['eps']:g} draw {r['draw']}: loss {r['loss']:.4f}", flush=True)
            env = {"model": args.model, "act_bits": args.act_bits, "threads": args.threads,
                   "seconds": time.perf_counter() - t, "load_start": load, "load_end": load_average(),
                   "calib_source": source, "git_sha": git_sha(), **cpu_facts()}
            out.parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame([r | env for r in rows]).to_csv(out, index=False)
            return 0
        if args.line_search:
            load, t = load_average(), time.perf_counter()
            cfg = RotationConfig(kind="spinquant", windows_per_step=args.windows_per_step)
            rows = loss_along_first_step(model, calib, cfg, args.act_bits, True, args.line_search)
            env = {"model": args.model, "act_bits": args.act_bits, "windows_per_step": args.windows_per_step,
                   "threads": args.threads, "seconds": time.perf_counter() - t, "load_start": load,
                   "load_end": load_average(), "calib_source": source, "git_sha": git_sha(), **cpu_facts()}
            df = pd.DataFrame([r | env for r in rows])
            out.parent.mkdir(parents=True, exist_ok=True)
            df.to_csv(out, index=False)
            for r in rows:
                print(f"t {r['t']:g} (step {r['step']:.3g}): loss on the gradient's window {r['grad_loss']:.4f}, "
                      f"on the next 8 {r['held_out_loss']:.4f}")
            return 0
        old = pd.read_csv(out) if out.is_file() else pd.DataFrame()
        for lr in args.lr:
            same = {"model": args.model, "steps": args.steps, "windows_per_step": args.windows_per_step, "lr": lr,
                        "act_bits": args.act_bits}
            if len(old) and (old[list(same)] == pd.Series(same)).all(axis=1).any():
                print(f"lr {lr}: in {out} already, skipped")
                continue
            load = load_average()
            t = time.perf_counter()
            cfg = RotationConfig(kind="spinquant", steps=args.steps, lr=lr, windows_per_step=args.windows_per_step)
            r = learn_rotations(model, calib, cfg, args.act_bits, True, progress=False)
            row = {**same, "loss_before": r.loss_before, "loss_after": r.loss_after,
                   "loss_change": r.loss_after - r.loss_before, "r1_step_mean": sum(r.r1_step_sizes) / args.steps,
                   "r1_step_min": min(r.r1_step_sizes), "r1_step_max": max(r.r1_step_sizes),
                   "cap_binds_steps": sum(a < want * 0.999 for a, want in zip(r.r1_step_sizes, schedule(lr, args.steps))),
                   "r1_steps": json.dumps([round(a, 6) for a in r.r1_step_sizes]), "seconds": time.perf_counter() - t,
                   "threads": args.threads, "load_start": load, "load_end": load_average(),
                   "calib_source": source, "git_sha": git_sha(), **cpu_facts()}
            print(f"lr {lr:g}: loss {r.loss_before:.4f} -> {r.loss_after:.4f}, R1 step mean {row['r1_step_mean']:.3g} "
                  f"(cap bound on {row['cap_binds_steps']} of {args.steps} steps), {row['seconds']:.0f} s", flush=True)
            old = pd.concat([old, pd.DataFrame([row])], ignore_index=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            old.to_csv(out, index=False)  # after each lr: a crash keeps the finished ones
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
