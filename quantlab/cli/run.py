"""`quantlab run`, `quantlab report`, `quantlab compare`: experiments and their reports.

    quantlab run experiments/smollm2_quickstart.toml [--full] [--force] [--wait [--wait-timeout S]] [--dry-run]
    quantlab run experiments/referee_smollm2_full.toml --only fp32 gptq-w4-g64 [--force]
    quantlab run experiments/grid.toml --executor ray [--address auto|HOST:PORT]
    quantlab report reports/smollm2_quickstart.results.jsonl [--out DIR]
    quantlab compare A.csv B.csv [--out diff.md]
    quantlab compare --all-pairs REPORT.csv [--alpha 0.05] [--out leaderboard.md]
"""
from __future__ import annotations

import dataclasses
import os


def cmd_run(args) -> int:
    from ..runs.experiment import load_experiment
    from ..runs.runner import run_experiment
    from ..util.checks import check_reports_dir

    check_reports_dir(args.reports_dir, "--reports-dir")
    exp = load_experiment(args.experiment)  # validates every run before any model loads
    if args.full:
        _check_full_name(args.experiment, exp.name)
        exp = dataclasses.replace(exp, name=f"{exp.name}_full", eval=exp.eval.unbounded())
    if args.device:
        exp = dataclasses.replace(exp, device=args.device)
    if args.dry_run:
        if args.only is not None:  # run_experiment checks --only itself; a dry run refuses an unknown name too
            from ..runs.runner import select_runs

            select_runs(exp, args.only)
        return _dry_run(exp, args.reports_dir)
    df = run_experiment(exp, args.reports_dir, args.force, args.data_dir, args.cache_dir, progress=not args.quiet,
                        wait=args.wait, wait_timeout_s=args.wait_timeout, executor=args.executor, address=args.address,
                        only=args.only)
    print(f"wrote {args.reports_dir}/{exp.name}.csv and .md ({len(df)} rows)")
    cols = [c for c in ("run", "scheme", "ppl", "ppl_delta_pct", "kl_mean", "weight_mib", "bits_per_weight") if c in df]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def cmd_export(args) -> int:
    from ..runs.experiment import load_experiment
    from ..runs.export import export_run

    exp = load_experiment(args.experiment)
    facts = export_run(exp, args.run, args.out, args.format, args.requantize, args.data_dir, args.cache_dir,
                       progress=not args.quiet)
    if args.format == "compressed-tensors":
        print(f"wrote {facts['ct_dir']} ({facts['ct_mib']:.1f} MiB): "
              + ", ".join(f"{n} {label} ({facts['ct_format'][label]})" for label, n in facts["ct_schemes"].items())
              + f"; left float: {', '.join(facts['ct_ignored'])}")
        for note in facts.get("ct_notes") or []:
            print(f"note: {note}")
        return 0
    print(f"wrote {facts['gguf_path']} ({facts['gguf_mib']:.1f} MiB): "
          + ", ".join(f"{n} {t}" for t, n in facts["gguf_types"].items()))
    if facts["gguf_requantized"]:
        print(f"requantized to {args.requantize}: {len(facts['gguf_requantized'])} layers")
    return 0


def _check_full_name(path, name: str) -> None:
    """--full reports as <name>_full: say so when that, not the name in the file, is what runs past the limit."""
    from ..util.checks import NAME_MAX_BYTES

    size = len(f"{name}_full".encode("utf-8", "surrogatepass"))
    if size > NAME_MAX_BYTES:
        raise ValueError(f"{path}: experiment name {name[:40]!r}... becomes {size} UTF-8 bytes with --full (it "
                         f"reports as <name>_full), over the limit of {NAME_MAX_BYTES}: shorten it to at most "
                         f"{NAME_MAX_BYTES - len('_full')} bytes")


def _dry_run(exp, reports_dir) -> int:
    """Print the expanded run list and the work it means; nothing loads."""
    from ..runs.runner import plan_experiment

    plan = plan_experiment(exp, reports_dir)
    width = max(len(p["run"]) for p in plan)
    for p in plan:
        work = "train" if p["trains"] else ("calibrate" if p["calibrates"] else "")
        est = "" if p["est_s"] is None or p["done"] else f"~{p['est_s']:.0f} s ({p['est_basis']})"
        print(f"{p['run']:{width}s}  {p['scheme']:36s} {work:9s} {'done' if p['done'] else 'pending':7s} {est}"
              + (f"  ({p['calibration']})" if p.get("calibration") else ""))
    pending = [p for p in plan if not p["done"]]
    known = [p["est_s"] for p in pending if p["est_s"] is not None]
    print(f"{len(plan)} runs: {len(plan) - len(pending)} done, {len(pending)} pending "
          f"({sum(p['calibrates'] for p in pending)} calibrate, {sum(p['trains'] for p in pending)} train)"
          + (f"; ~{sum(known) / 60:.0f} min for the {len(known)} with timed rows of their method in "
             f"{reports_dir}/{exp.name}.results.jsonl" if known else ""))
    if exp.eval.datasets:
        print(f"each run evaluated on {', '.join(exp.eval.datasets)} ({exp.eval.split})")
    return 0


def cmd_report(args) -> int:
    from ..reporting.regenerate import regenerate_report
    from ..runs.experiment import load_experiment

    description = findings = None
    if args.experiment:  # its description and findings replace the sidecar's (edited text, or no sidecar)
        exp = load_experiment(args.experiment)
        description, findings = exp.description, exp.findings
    df = regenerate_report(args.results, args.out, description, findings)
    name = os.path.basename(args.results).removesuffix(".results.jsonl")
    print(f"wrote {os.path.join(args.out or os.path.dirname(args.results), name)}.csv, .md and plots ({len(df)} rows)")
    return 0


def cmd_compare(args) -> int:
    from ..reporting.compare import compare_markdown, compare_reports
    from ..util.checks import read_utf8

    _check_compare_args(args)
    for path in (args.a, args.b):  # a CSV that is not UTF-8 fails naming itself (pandas would not say which)
        if path is not None and os.path.isfile(path):
            read_utf8(path)
    if args.all_pairs:
        from ..reporting.leaderboard import leaderboard, leaderboard_markdown, load_rows

        text = leaderboard_markdown(*leaderboard(load_rows(args.a), 0.05 if args.alpha is None else args.alpha))
    else:
        metrics = args.metrics.split(",") if args.metrics else None
        text = compare_markdown(compare_reports(args.a, args.b, metrics), args.a, args.b)
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


def _check_compare_args(args) -> None:
    """Two reports, or one with --all-pairs; the options of one mode refused in the other."""
    if args.all_pairs:
        if args.b is not None:
            raise ValueError(f"--all-pairs ranks the runs of one report; got two ({args.a}, {args.b})")
        if args.metrics:
            raise ValueError("--metrics applies to comparing two reports, not to --all-pairs (which ranks by ppl)")
    else:
        if args.b is None:
            raise ValueError(f"compare needs two reports, A and B (got only {args.a}); or rank the runs of one "
                             "report against each other with --all-pairs")
        if args.alpha is not None:
            raise ValueError("--alpha applies to --all-pairs only")


def add_commands(sub) -> None:
    """Register run / report / compare / export on the main parser's subparsers."""
    p = sub.add_parser("run", help="run an experiment file and write reports/<name>.csv/.md")
    p.add_argument("experiment")
    p.add_argument("--force", action="store_true", help="rerun runs already in the results file (with --only: those)")
    p.add_argument("--only", nargs="+", metavar="RUN",
                   help="run only these runs (a run's name, or a seeded run's name for all its draws); the report "
                        "still covers every run with a row")
    p.add_argument("--dry-run", action="store_true", help="print the expanded run list and the work; load nothing")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: one run after another in this process (default); ray: one Ray task per run")
    p.add_argument("--address", help="with --executor ray: 'auto' or the address `ray start --head` printed "
                                     "(default: start a local Ray)")
    p.add_argument("--full", action="store_true", help="evaluate the whole test split (drops max_windows/max_tokens)")
    p.add_argument("--device", help="override the experiment's device (auto, cpu, cuda)")
    p.add_argument("--reports-dir", default="reports")
    p.add_argument("--wait", action="store_true",
                   help="if another process is running this experiment, wait until it finishes instead of failing")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="with --wait: give up after SECONDS")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("report", help="regenerate CSV, Markdown and plots from a results file (runs nothing)")
    p.add_argument("results", help="reports/<name>.results.jsonl")
    p.add_argument("--out", help="output folder (default: beside the results file)")
    p.add_argument("--experiment", help="experiment TOML whose description and findings template to use instead "
                   "of the sidecar's (after editing them, or for results without a sidecar)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("compare", help="diff two report CSVs run by run, or rank one report's runs (--all-pairs)")
    p.add_argument("a", help="report A (with --all-pairs: the report, X.csv or X.results.jsonl)")
    p.add_argument("b", nargs="?", help="report B (not with --all-pairs)")
    p.add_argument("--metrics", help="comma-separated columns (default: the usual metrics both have)")
    p.add_argument("--all-pairs", action="store_true",
                   help="a leaderboard of one report: every pair of runs compared over the shared windows (paired "
                        "t-test, Holm-adjusted), letters for the runs it cannot tell apart")
    p.add_argument("--alpha", type=float, help="with --all-pairs: the level for the Holm-adjusted p (default 0.05)")
    p.add_argument("--out", help="also write the comparison as Markdown here")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("export", help="quantize one run of an experiment and write it for an engine (a GGUF for "
                                      "llama.cpp, a compressed-tensors folder for transformers / vLLM)")
    p.add_argument("experiment", help="the experiment TOML file")
    p.add_argument("out", help="the file (gguf, e.g. out/model-q4_k_m.gguf) or folder (compressed-tensors) to write")
    p.add_argument("--run", required=True, help="the run's name in the experiment")
    p.add_argument("--format", default="gguf", choices=["gguf", "compressed-tensors"],
                   help="gguf (a file llama.cpp runs; the default) or compressed-tensors (a checkpoint folder "
                        "transformers and vLLM load)")
    p.add_argument("--requantize", metavar="TYPE", default=None,
                   help="quantize layers whose grid has no GGUF type to this llama.cpp type (q4_k, q8_0, ...); "
                        "the file lists them under quantlab.requantized")
    p.set_defaults(func=cmd_export)
