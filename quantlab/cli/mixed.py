"""`quantlab sensitivity` and `quantlab mixed`: argument parsing, then library calls.

    quantlab sensitivity experiments/smollm2_mixed.toml --config '{method="rtn", bits=3, group_size=64, symmetric=false}'
    quantlab sensitivity smollm2-135m --method rtn --bits 3 --group-size 64 --asym --granularity type
    quantlab mixed experiments/smollm2_mixed.toml --target-bits 4.0 3.5
"""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path


def _configs(args) -> list:
    from ..core.registry import make_config

    configs = []
    for text in args.config or []:
        try:
            table = tomllib.loads(f"x = {text}")["x"]
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {text!r} is not an inline TOML table like "
                             f"'{{method=\"rtn\", bits=3, group_size=64}}': {e}") from None
        configs.append(make_config(table))
    if args.bits is not None or not configs:
        spec = {"method": args.method, "bits": args.bits or 4, "symmetric": not args.asym}
        if args.group_size:
            spec["group_size"] = args.group_size
        configs.append(make_config(spec))
    return configs


def _target(args):
    """(model, dtype, name, eval dataset, seq_len, bos) from an experiment file or a model name; the name (a
    file-name part: reports/<name>.sensitivity.*) is checked here, before anything loads."""
    from ..runs.experiment import load_experiment
    from ..util.checks import check_name

    if args.name is not None:
        check_name("--name", args.name)
    if args.target.endswith(".toml"):
        exp = load_experiment(args.target)
        return (exp.model, exp.dtype, args.name or exp.name, exp.eval.dataset, args.seq_len or exp.eval.seq_len,
                exp.eval.bos)
    name = args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(args.target).name)
    check_name("output name (from the model path; set one with --name)", name)
    return args.target, "float32", name, "wikitext2", args.seq_len or 512, "none"


def cmd_sensitivity(args) -> int:
    from ..mixed.plot import with_ext, write_sensitivity
    from ..mixed.sensitivity import sweep, validation_windows
    from ..models.data import bos_token_id
    from ..models.loading import load_model
    from ..reporting.results import results_lock

    configs = _configs(args)
    model_name, dtype, name, dataset, seq_len, bos = _target(args)
    suffix = "" if args.granularity == "layer" else f"_{args.granularity}"
    prefix = Path(args.reports_dir) / f"{name}.sensitivity{suffix}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    cache = with_ext(prefix, ".jsonl")
    with results_lock(cache):  # one sweep per cache file at a time; a second fails before loading anything
        model, tok = load_model(model_name, dtype, args.device, args.cache_dir, progress=not args.quiet)
        windows, source = validation_windows(tok, dataset, args.split, seq_len, args.windows, args.data_dir,
                                             args.cache_dir, bos_token_id(tok, bos))
        rows = sweep(model, configs, windows, args.granularity, cache, progress=not args.quiet)
        for r in rows:
            r.update(model=model_name, split=args.split, source=source, windows=len(windows), seq_len=seq_len)
        df = write_sensitivity(rows, prefix)
    print(f"wrote {prefix}.csv and .png ({len(df)} rows; cache {prefix}.jsonl)")
    top = df.sort_values("kl_mean", ascending=False).head(10)
    print(top[["unit", "candidate", "params", "kl_mean", "ppl"]].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def _mixed_names(args) -> tuple[list[str], list[str]]:
    """Run names for the bits and MiB targets, checked (they become file-name parts) before anything loads."""
    from ..util.checks import check_name

    if not args.target_bits and not args.target_mib:
        raise ValueError("give --target-bits and/or --target-mib")
    names = ([f"{args.prefix}{bits:g}b" for bits in args.target_bits],
             [f"{args.prefix}{mib:g}mib" for mib in args.target_mib])
    for name in names[0] + names[1]:
        check_name(f"run name (--prefix {args.prefix!r})", name)
    return names


def _read_sensitivity(path: Path) -> list[dict]:
    import io

    import pandas as pd

    from ..util.checks import read_utf8

    rows = pd.read_csv(io.StringIO(read_utf8(path))).to_dict("records")  # not UTF-8: names the file and byte
    for r in rows:  # pandas reads an empty group_size as NaN; the config column is the source of truth
        r["candidate"] = str(r["candidate"])
    return rows


def cmd_mixed(args) -> int:
    from ..mixed.solver import mixed_run_table, plan_summary, solve_budget
    from ..runs.experiment import load_experiment, parse_experiment
    from ..runs.tomlwrite import replace_runs
    from ..util.checks import read_utf8

    exp = load_experiment(args.experiment)
    bits_names, mib_names = _mixed_names(args)
    sens = Path(args.sensitivity or Path(args.reports_dir) / f"{exp.name}.sensitivity.csv")
    if not sens.exists():
        raise FileNotFoundError(f"sensitivity file {str(sens)!r} does not exist; run `quantlab sensitivity "
                                f"{args.experiment} ...` first")
    rows = _read_sensitivity(sens)
    new_runs = []
    for bits, name in zip(args.target_bits, bits_names):
        plan = solve_budget(rows, target_bits=bits, metric=args.metric)
        print(f"target {bits} bits/weight: {json.dumps(plan_summary(plan))}")
        new_runs.append(mixed_run_table(name, plan))
    for mib, name in zip(args.target_mib, mib_names):
        plan = solve_budget(rows, target_bytes=int(mib * 2**20), metric=args.metric)
        print(f"target {mib} MiB: {json.dumps(plan_summary(plan))}")
        new_runs.append(mixed_run_table(name, plan))
    # edit the file's own text in place: every comment, key order and formatting outside the new runs is kept
    text = replace_runs(read_utf8(args.experiment), new_runs, where=args.experiment)
    data = tomllib.loads(text)
    parse_experiment(data, where=args.experiment)  # validate before writing anything
    out = Path(args.out or args.experiment)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)  # a crash never leaves half a file
    load_experiment(out)  # what we wrote must load
    print(f"wrote {out} ({len(data['run'])} runs); now: quantlab run {out}")
    return 0


def add_commands(sub) -> None:
    """Register the two subcommands on the main parser's subparsers."""
    p = sub.add_parser("sensitivity", help="quantize one layer / type / block at a time; KL vs float on validation")
    p.add_argument("target", help="an experiment .toml (model, dtype, eval dataset and seq_len) or a model name")
    p.add_argument("--config", action="append", help="candidate as an inline TOML table (repeatable)")
    p.add_argument("--method", default="rtn")
    p.add_argument("--bits", type=int)
    p.add_argument("--group-size", type=int, help="omit for per output channel")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero point)")
    p.add_argument("--granularity", default="layer", choices=["layer", "type", "block"])
    p.add_argument("--windows", type=int, default=2, help="validation windows (default 2)")
    p.add_argument("--seq-len", type=int, help="window length (default: the experiment's eval.seq_len, else 512)")
    p.add_argument("--split", default="validation", help="never 'test'")
    p.add_argument("--name", help="output name (reports/<name>.sensitivity.*)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reports-dir", default="reports")
    p.set_defaults(func=cmd_sensitivity)
    p = sub.add_parser("mixed", help="per-layer bits under a budget from sensitivity data -> [[run]]s in the experiment")
    p.add_argument("experiment")
    p.add_argument("--target-bits", type=float, nargs="+", default=[], help="average bits per weight (scales incl.)")
    p.add_argument("--target-mib", type=float, nargs="+", default=[],
                   help="size of the quantized layers (codes + scales + zeros) in MiB; runs are named <prefix><MiB>mib")
    p.add_argument("--sensitivity", help="sensitivity CSV (default reports/<experiment name>.sensitivity.csv)")
    p.add_argument("--metric", default="kl_mean")
    p.add_argument("--prefix", default="mixed-", help="run name prefix; runs are named <prefix><bits>b")
    p.add_argument("--out", help="experiment file to write (default: edit the input in place, comments kept)")
    p.add_argument("--reports-dir", default="reports")
    p.set_defaults(func=cmd_mixed)
