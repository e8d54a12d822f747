"""The perplexity harness against a plain Hugging Face loop, side by side in one process (not a timed test).

    python3 experiments/bench_harness.py                # ~8 min on a 2-core CPU
    python3 experiments/bench_harness.py --smoke        # ~1 min: 2 windows of 128 tokens, 1 round

On the same WikiText-2 test windows (6 x 512 tokens) and threads, measured round-robin (each round runs every
configuration once; the median round counts):
- `hf-loop`: `model(ids, labels=ids)` one window at a time, the loss the naive way (full logits, upcast,
  cross-entropy), on the fp32 model; the baseline of every ratio;
- `harness-b<B>`: quantlab.perplexity with B windows per forward and the chunked loss, fp32 model, its default GEMM
  (gemm = "auto": oneDNN's linear on an AMD CPU, PyTorch's BLAS elsewhere, quantlab/eval/gemm.py);
- `harness-aten-b<B>`, `harness-onednn-b<B>`: the same with each GEMM named (aten: PyTorch's BLAS, what the plain
  loop uses): the rows split the gain between batching / the chunked loss and the GEMM library, on any CPU;
- `sim-w4g64-hf-loop`: the plain loop on a simulated RTN w4 g64 model (each forward dequantizes every weight);
- `sim-w4g64-harness-b<B>`: the harness on that model (each weight dequantized once per evaluation);
- `bf16-hf-loop`, `bf16-harness-b<B>`: the fp32 model cast to bfloat16 (what `dtype = "bfloat16"` loads), plain loop
  and harness (logits upcast to fp32 for the loss), and `bf16-autocast-harness-b<B>`: the fp32 model evaluated
  under bf16 autocast (`[eval] dtype = "bfloat16"`, perplexity(dtype="bfloat16")): fast only where the CPU computes
  bf16 natively (AVX512_BF16 / AMX), about 10x slower than fp32 where it does not (AVX2); `--no-bf16` leaves them
  out.
Every fp32 and simulated configuration's NLL is checked against the hf-loop's on the same model (rel 1e-5) before
any time counts; a bf16 row is not gated, its NLL's relative difference from the fp32 loop's is a column
(`nll_rel_diff_vs_fp32`). Writes reports/bench_harness.csv (one row per configuration, with the CPU it ran on; --out
names another file, one per CPU kind) and its Markdown beside it (the table and the summary, from the rows).
Every row also says how close it runs to the machine: the matmul FLOPs of one pass over the windows (counted once on
the fp32 plain loop, quantlab.eval.compute; every configuration runs the same products, full logits included), the
GFLOP/s achieved, and its fraction of F.linear's rate at the same threads, measured in the same run (fp32: the faster
of PyTorch's BLAS and oneDNN, both in the CSV; bf16 rows against the bf16 rate), so a ratio that cannot grow is told
from one that can.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.core.lifecycle import quantize
from quantlab.core.registry import make_config
from quantlab.eval.compute import count_matmul_flops, measure_matmul_rate
from quantlab.eval.gemm import onednn_available, onednn_linear, resolve_gemm
from quantlab.eval.perplexity import perplexity
from quantlab.models.data import eval_windows, load_token_ids
from quantlab.models.loading import load_model
from quantlab.reporting.report import markdown_table
from quantlab.runs.envinfo import cpu_facts, environment, load_average

MODEL = "smollm2-135m"


@torch.inference_mode()
def hf_loop(model, windows: torch.Tensor) -> float:
    """Total NLL the naive way: one window per forward, labels=ids (HF shifts and averages)."""
    total = 0.0
    for w in windows:
        out = model(w[None], labels=w[None], use_cache=False)
        total += out.loss.item() * (w.numel() - 1)
    return total


def harness(model, windows: torch.Tensor, batch: int, gemm: str = "auto", dtype: str | None = None) -> float:
    return sum(perplexity(model, windows, progress=False, batch_size=batch, gemm=gemm, dtype=dtype)["window_nll"])


def dtype_of(config: str) -> str:
    """The dtype a configuration's matmuls run in: bf16 rows (cast or autocast) in bfloat16, the rest in float32."""
    return "bfloat16" if config.startswith("bf16") else "float32"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench_harness.csv"))
    ap.add_argument("--no-bf16", action="store_true", help="leave out the bfloat16 rows")
    args = ap.parse_args(argv)
    n, seq_len, rounds, batches = (2, 128, 1, (1, 2)) if args.smoke else (6, 512, args.rounds, (1, 2, 3, 6))
    torch.set_num_threads(args.threads)
    load_start = load_average()
    model, tok = load_model(MODEL, "float32", "cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok)
    windows = eval_windows(ids, seq_len, n)
    sim = copy.deepcopy(model)
    quantize(sim, make_config({"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}))
    configs = {"hf-loop": lambda: hf_loop(model, windows)}
    configs |= {f"harness-b{b}": (lambda b=b: harness(model, windows, b)) for b in batches}
    configs |= {f"harness-aten-b{b}": (lambda b=b: harness(model, windows, b, "aten")) for b in batches[-2:]}
    if onednn_available():
        configs |= {f"harness-onednn-b{b}": (lambda b=b: harness(model, windows, b, "onednn")) for b in batches[-2:]}
    configs["sim-w4g64-hf-loop"] = lambda: hf_loop(sim, windows)
    configs |= {f"sim-w4g64-harness-b{b}": (lambda b=b: harness(sim, windows, b)) for b in batches}
    if not args.no_bf16:
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        configs["bf16-hf-loop"] = lambda: hf_loop(bf16, windows)
        configs |= {f"bf16-harness-b{b}": (lambda b=b: harness(bf16, windows, b)) for b in (batches[0], batches[-1])}
        configs |= {f"bf16-autocast-harness-b{b}": (lambda b=b: harness(model, windows, b, dtype="bfloat16"))
                    for b in (batches[0], batches[-1])}
    nll = {name: fn() for name, fn in configs.items()}  # warm-up, and the correctness gate
    for name, value in nll.items():
        if name.startswith("bf16"):
            continue  # not gated: its difference from fp32 is reported
        ref = nll["sim-w4g64-hf-loop" if name.startswith("sim") else "hf-loop"]
        if abs(value - ref) > 1e-5 * abs(ref):
            raise SystemExit(f"{name}: NLL {value} differs from the plain loop's {ref}")
    seconds = {name: [] for name in configs}
    for _ in range(rounds):
        for name, fn in configs.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    flops = count_matmul_flops(lambda: hf_loop(model, windows))[0]
    gemm_rate = {"aten": measure_matmul_rate()["matmul_gflops"]}
    if onednn_available():
        with onednn_linear():
            gemm_rate["onednn"] = measure_matmul_rate()["matmul_gflops"]
    rate = {"float32": max(gemm_rate.values())}  # the machine's: the faster GEMM library
    if not args.no_bf16:
        rate["bfloat16"] = measure_matmul_rate(dtype=torch.bfloat16)["matmul_gflops"]
    tokens = windows.numel()
    base = statistics.median(seconds["hf-loop"])
    sim_base = statistics.median(seconds["sim-w4g64-hf-loop"])
    own_loop = {"sim": sim_base, "bf16": statistics.median(seconds["bf16-hf-loop"]) if "bf16-hf-loop" in seconds else None}
    env = environment(torch.device("cpu")) | cpu_facts() | {"threads": args.threads, "load_avg_start": load_start,
                                                             "load_avg_end": load_average()} | {
        f"matmul_gflops_fp32_{lib}": v for lib, v in gemm_rate.items()}
    rows = []
    for name, times in seconds.items():
        s = statistics.median(times)
        rows.append({"config": name, "windows": n, "seq_len": seq_len, "rounds": rounds, "seconds_median": s,
                     "seconds_all": " ".join(f"{t:.3f}" for t in times), "tokens_per_s": tokens / s,
                     "speedup_vs_hf_loop_fp32": base / s,
                     "speedup_vs_same_model_hf_loop": (own_loop.get(name.split("-")[0]) or base) / s,
                     "nll_total": nll[name], "nll_rel_diff_vs_fp32": nll[name] / nll["hf-loop"] - 1,
                     "gflop_per_pass": flops / 1e9, "achieved_gflops": flops / s / 1e9,
                     "matmul_rate_dtype": dtype_of(name), "matmul_gflops": rate[dtype_of(name)],
                     "fraction_of_matmul_rate": flops / s / 1e9 / rate[dtype_of(name)], **env})
    df = pd.DataFrame(rows)
    best_fp32 = df[df.config.str.startswith("harness-b")].seconds_median.min()
    best_aten = df[df.config.str.startswith("harness-aten")].seconds_median.min()
    best_onednn = df[df.config.str.startswith("harness-onednn")].seconds_median.min()
    best_sim = df[df.config.str.startswith("sim-w4g64-harness")].seconds_median.min()
    bf16_rows = df[df.config.str.startswith("bf16-harness")]
    best_bf16 = bf16_rows.seconds_median.min() if len(bf16_rows) else None
    bf16_diff = bf16_rows.nll_rel_diff_vs_fp32[bf16_rows.seconds_median.idxmin()] if len(bf16_rows) else None
    amp_rows = df[df.config.str.startswith("bf16-autocast-harness")]
    amp = amp_rows.loc[amp_rows.seconds_median.idxmin()] if len(amp_rows) else None
    def fraction(prefix: str) -> float:
        return df[df.config.str.startswith(prefix)].fraction_of_matmul_rate.max()

    summary = (f"best harness vs HF loop (fp32): {base / best_fp32:.2f}x (gemm auto = "
               f"{resolve_gemm('auto', torch.device('cpu'))}; PyTorch's BLAS: {base / best_aten:.2f}x, oneDNN: "
               f"{base / best_onednn:.2f}x); "
               f"simulated w4 g64 / fp32 (best harness each): {best_sim / best_fp32:.3f}x; plain loop simulated / fp32: "
               f"{sim_base / base:.3f}x"
               + (f"; best bf16 harness vs HF loop (fp32): {base / best_bf16:.2f}x, its NLL {bf16_diff:+.2e} relative to "
                  "fp32's" if best_bf16 else "")
               + (f"; bf16 autocast ([eval] dtype = \"bfloat16\", the model left in fp32): "
                  f"{base / amp.seconds_median:.2f}x, NLL {amp.nll_rel_diff_vs_fp32:+.2e}" if amp is not None else "")
               + f"; matmuls at {fraction('harness-b'):.0%} of F.linear's best fp32 rate at {args.threads} threads "
               f"({rate['float32']:.0f} GFLOP/s; " + ", ".join(f"{lib} {v:.0f}" for lib, v in gemm_rate.items())
               + f") in the best fp32 harness, {fraction('hf-loop'):.0%} in the HF loop, "
               f"so 1.3x the HF loop in fp32 would need {1.3 * fraction('hf-loop'):.0%}"
               + f" [{env['cpu_model']}, AVX-512: {env['cpu_avx512'] != 'none'}, AMX: {env['cpu_amx'] != 'none'}, "
               f"{args.threads} threads]")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    out.with_suffix(".md").write_text(_markdown(df, summary, out.name))
    print(df[["config", "seconds_median", "tokens_per_s", "speedup_vs_hf_loop_fp32"]].to_string(index=False))
    print(f"{summary} -> {out}")
    return 0


COLUMNS = [("config", "config", "{}"), ("seconds_median", "s (median)", "{:.3f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
           ("speedup_vs_hf_loop_fp32", "x fp32 HF loop", "{:.2f}"),
           ("speedup_vs_same_model_hf_loop", "x same model's loop", "{:.2f}"),
           ("nll_rel_diff_vs_fp32", "NLL rel. diff vs fp32", "{:+.1e}"),
           ("fraction_of_matmul_rate", "of F.linear rate", "{:.0%}")]


def _markdown(df: pd.DataFrame, summary: str, csv_name: str) -> str:
    r = df.iloc[0]
    return (f"# The perplexity harness against a plain Hugging Face loop\n\n*Generated by `experiments/bench_harness.py` "
            f"from `{csv_name}`.* SmolLM2-135M, {r.windows} WikiText-2 test windows of {r.seq_len} tokens, median of "
            f"{r.rounds} interleaved rounds, {r.threads} thread(s). CPU `{r.cpu_model}` ({r.logical_cpus} logical CPUs; "
            f"SIMD {r.cpu_simd}; AVX-512 {r.cpu_avx512}; AMX {r.cpu_amx}); load average (1 min) {r.load_avg_start:.2f} "
            f"at start, {r.load_avg_end:.2f} at end.\n\n{markdown_table(df, COLUMNS)}\n\n{summary}.\n")


if __name__ == "__main__":
    raise SystemExit(main())
