"""`quantlab lm-eval`: lm-evaluation-harness tasks on an experiment's runs, each quantized as `quantlab run` does.

    quantlab lm-eval experiments/smollm2_ptq.toml --tasks wikitext_local --runs fp32 rtn-w4-g64 --limit 2
    quantlab lm-eval experiments/smollm2_ptq.toml --tasks hellaswag        # where the hub is reachable
"""
from __future__ import annotations

import dataclasses


def cmd_lm_eval(args) -> int:
    from ..reporting.lmeval import table
    from ..runs.experiment import load_experiment
    from ..runs.lmeval import lm_eval_runs, select_runs

    exp = load_experiment(args.experiment)
    tasks = args.tasks or list(exp.eval.lm_eval_tasks)
    if not tasks:
        raise ValueError(f"no lm-eval tasks: pass --tasks (e.g. --tasks wikitext_local) or set [eval] lm_eval_tasks "
                         f"in {args.experiment}")
    if args.device:
        exp = dataclasses.replace(exp, device=args.device)
    select_runs(exp, args.runs)  # unknown run names fail before anything loads
    limit = args.limit if args.limit is not None else exp.eval.lm_eval_limit
    df = lm_eval_runs(exp, tasks, args.runs, limit, args.max_length or exp.eval.lm_eval_max_length,
                      args.batch_size, args.data_dir, args.cache_dir, progress=not args.quiet)
    print(table(df))
    if args.out:
        df.to_csv(args.out, index=False)
        print(f"wrote {args.out} ({len(df)} rows)")
    return 0


def add_commands(sub) -> None:
    """Register lm-eval on the main parser's subparsers."""
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on an experiment's runs (quantized in memory)")
    p.add_argument("experiment")
    p.add_argument("--tasks", nargs="+", help="lm-eval task names (default: the experiment's [eval] lm_eval_tasks); "
                                              "offline: wikitext_local, any other where the hub is reachable")
    p.add_argument("--runs", nargs="+", metavar="NAME", help="only these runs (default: all)")
    p.add_argument("--limit", type=int, help="the first N documents of each task (default: all)")
    p.add_argument("--max-length", type=int, help="rolling-window tokens (default: the model's max positions)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", help="override the experiment's device (auto, cpu, cuda)")
    p.add_argument("--out", help="also write the rows as CSV here")
    p.set_defaults(func=cmd_lm_eval)
