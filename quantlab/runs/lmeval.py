"""`quantlab lm-eval`: lm-evaluation-harness tasks on an experiment's runs, each built as `quantlab run` builds it.

Every selected run is rotated / quantized / exported exactly as the runner does (evaluate.evaluate_run), with the
experiment's [eval] reduced to what lm-eval needs: no latency, no KL, no isolated memory, one perplexity window
(its numbers are dropped). The rows hold the run, its scheme and the lm-eval columns (eval/lmeval.py).

    exp = load_experiment("experiments/smollm2_ptq.toml")
    df = lm_eval_runs(exp, ["wikitext_local"], runs=["fp32", "rtn-w4-g64"], limit=2)
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from ..eval.lmeval import PREFIX
from ..models.loading import resolve_device
from ..reporting.report import scheme
from .context import EvalContext
from .evaluate import evaluate_run
from .experiment import Experiment


def select_runs(exp: Experiment, names: list[str] | None) -> Experiment:
    """The experiment with only the named runs (a seed group's name selects all its seeds), in the file's order."""
    if not names:
        return exp
    known = [r.name for r in exp.runs] + [r.group for r in exp.runs if r.group]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown run(s) {', '.join(map(repr, unknown))} in experiment {exp.name!r}; "
                         f"known: {', '.join(dict.fromkeys(known))}")
    return dataclasses.replace(exp, runs=tuple(r for r in exp.runs if r.name in names or r.group in names))


def lm_eval_runs(exp: Experiment, tasks: list[str], runs: list[str] | None = None, limit: int | None = None,
                 max_length: int | None = None, batch_size: int = 1, data_dir=None, cache_dir=None,
                 progress: bool = True) -> pd.DataFrame:
    """One row per selected run: run, scheme and its lm-eval columns (lmeval_<task>_<metric>, _stderr, protocol)."""
    exp = select_runs(exp, runs)
    e = dataclasses.replace(exp.eval, lm_eval_tasks=tuple(tasks), lm_eval_limit=limit, lm_eval_max_length=max_length,
                            lm_eval_batch_size=batch_size, latency=False, kl_windows=0, max_windows=1,
                            max_tokens=None, memory="none")
    exp = dataclasses.replace(exp, eval=e)
    ctx = EvalContext(exp, resolve_device(exp.device), data_dir, cache_dir, progress)  # tasks checked before the model
    rows = []
    for run in exp.runs:
        metrics = evaluate_run(ctx, run)
        rows.append({"run": run.name, "method": run.to_dict()["method"], "scheme": scheme(run.to_dict(), exp.dtype),
                     "model": exp.model, "dtype": exp.dtype,
                     **{k: v for k, v in metrics.items() if k.startswith(PREFIX)}})
    return pd.DataFrame(rows)
