"""`quantlab` command line: parses arguments and calls the library, nothing more.

    quantlab run experiments/smollm2_quickstart.toml [--full] [--force]
    quantlab report reports/smollm2_quickstart.results.jsonl [--out DIR]
    quantlab compare A.csv B.csv [--out diff.md]
    quantlab list
    quantlab info smollm2-135m
    quantlab estimate smollm2-135m --bits 4 --group-size 64 --seq-len 2048 --batch 8 --device-memory 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys


def _cmd_run(args) -> int:
    from .experiment import load_experiment
    from .runner import run_experiment

    exp = load_experiment(args.experiment)  # validates every run before any model loads
    if args.full:
        exp = dataclasses.replace(exp, name=f"{exp.name}_full", eval=exp.eval.unbounded())
    if args.device:
        exp = dataclasses.replace(exp, device=args.device)
    df = run_experiment(exp, args.reports_dir, args.force, args.data_dir, args.cache_dir, progress=not args.quiet)
    print(f"wrote {args.reports_dir}/{exp.name}.csv and .md ({len(df)} rows)")
    cols = [c for c in ("run", "scheme", "ppl", "ppl_delta_pct", "kl_mean", "weight_mib", "bits_per_weight") if c in df]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def _cmd_report(args) -> int:
    from .experiment import load_experiment
    from .regenerate import regenerate_report

    description = None
    if args.experiment:  # supplies the description for results written before the sidecar existed
        exp = load_experiment(args.experiment)
        description = exp.description
    df = regenerate_report(args.results, args.out, description)
    name = os.path.basename(args.results).removesuffix(".results.jsonl")
    print(f"wrote {os.path.join(args.out or os.path.dirname(args.results), name)}.csv, .md and plots ({len(df)} rows)")
    return 0


def _cmd_compare(args) -> int:
    from .compare import compare_markdown, compare_reports

    metrics = args.metrics.split(",") if args.metrics else None
    text = compare_markdown(compare_reports(args.a, args.b, metrics), args.a, args.b)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _cmd_list(args) -> int:
    from .registry import config_fields, known_methods

    for name in known_methods():
        fields = ", ".join(f"{k}={v!r}" for k, v in config_fields(name).items())
        print(f"{name:10s} {fields}")
    return 0


def _cmd_info(args) -> int:
    from .models import load_model, model_info

    model, _ = load_model(args.model, "float32", "cpu", args.cache_dir)
    info = model_info(model)
    linears = info.pop("linear_layers")
    info["linear_layer_count"] = len(linears)
    print(json.dumps(info, indent=1))
    for name in linears:
        print(" ", name)
    return 0


def _cmd_estimate(args) -> int:
    from .estimate import estimate_memory, format_estimate

    est = estimate_memory(args.model, bits=args.bits, group_size=args.group_size, seq_len=args.seq_len,
                          batch=args.batch, dtype=args.dtype, symmetric=not args.asym, backend=args.backend,
                          device=args.device, device_memory_gib=args.device_memory, cache_dir=args.cache_dir)
    print(format_estimate(est))
    return 0 if est.fits is not False else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quantlab", description="quantization experiments on small LMs")
    parser.add_argument("--cache-dir", default=os.environ.get("QUANTLAB_CACHE_DIR"),
                        help="converted models and token caches (default ~/.cache/quantlab; env QUANTLAB_CACHE_DIR)")
    parser.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"),
                        help="directory with the wikitext-2 files (env QUANTLAB_DATA_DIR; default: ../shared/data/wikitext-2)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run an experiment file and write reports/<name>.csv/.md")
    p.add_argument("experiment")
    p.add_argument("--force", action="store_true", help="rerun runs already in the results file")
    p.add_argument("--full", action="store_true", help="evaluate the whole test split (drops max_windows/max_tokens)")
    p.add_argument("--device", help="override the experiment's device (auto, cpu, cuda)")
    p.add_argument("--reports-dir", default="reports")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("report", help="regenerate CSV, Markdown and plots from a results file (runs nothing)")
    p.add_argument("results", help="reports/<name>.results.jsonl")
    p.add_argument("--out", help="output folder (default: beside the results file)")
    p.add_argument("--experiment", help="experiment TOML whose description to use (results without a sidecar)")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("compare", help="diff two report CSVs run by run")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--metrics", help="comma-separated columns (default: the usual metrics both have)")
    p.add_argument("--out", help="also write the comparison as Markdown here")
    p.set_defaults(func=_cmd_compare)
    sub.add_parser("list", help="registered methods and their config fields").set_defaults(func=_cmd_list)
    p = sub.add_parser("info", help="parameter count, tied embeddings and linear layers of a model")
    p.add_argument("model")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("estimate", help="predict inference memory from the model config; does it fit?")
    p.add_argument("model")
    p.add_argument("--bits", type=int, help="weight bits of the decoder linears (omit for float)")
    p.add_argument("--group-size", type=int, help="quantization group size (omit for per-channel)")
    p.add_argument("--asym", action="store_true", help="asymmetric weights (a zero point per group)")
    p.add_argument("--seq-len", type=int, default=2048, help="context: prompt + generated tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="dtype of the float parts and the KV cache")
    p.add_argument("--backend", default="simulated", help="simulated | torchao (how scales are stored)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (framework overhead)")
    p.add_argument("--device-memory", type=float, help="GiB available; prints fits / does not fit (exit 2)")
    p.set_defaults(func=_cmd_estimate)

    from .mixed_cli import add_commands  # sensitivity, mixed

    add_commands(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"quantlab: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
