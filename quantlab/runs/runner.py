"""Run an experiment: one row per run, appended to a results file as soon as it is done.

A crash keeps every finished row; a rerun skips runs whose key (run config +
protocols + model + seed + device) is already in the file, unless force=True.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..core.extras import extras_to_dict
from ..core.registry import field_defaults, get_method, non_default_fields
from ..models.loading import resolve_device
from ..reporting.report import scheme, write_report
from ..reporting.results import append_row, drop_rows, read_rows, results_lock
from ..transforms.rotation import RotationConfig
from .context import EvalContext
from .envinfo import environment
from .evaluate import evaluate_run, result_row, run_key
from .experiment import Experiment, RunSpec
from .preflight import preflight

log = logging.getLogger(__name__)


EXECUTORS = ("local", "ray")


def _run_pending(exp: Experiment, pending: list[RunSpec], results: Path, device, data_dir, cache_dir,
                 progress: bool) -> list[str]:
    """Evaluate each pending run, appending its row at once; returns "name: error" per failed run."""
    ctx = EvalContext(exp, device, data_dir, cache_dir, progress)
    env = environment(device)
    failures = []
    for i, run in enumerate(pending, 1):
        log.info("[%d/%d] %s", i, len(pending), run.name)
        try:
            metrics = evaluate_run(ctx, run)
        except Exception as e:  # keep going: finished rows are saved, this run is retried next time
            log.error("run %r failed: %s: %s", run.name, type(e).__name__, e)
            log.debug("traceback of run %r:", run.name, exc_info=True)  # shown with quantlab -v
            failures.append(f"{run.name}: {e}")
            continue
        append_row(results, result_row(ctx, run, metrics, env))
    return failures


def _calibration_note(own, default) -> str:
    """A run's own calibration, in words, for --dry-run ("" for the file's)."""
    if own is None or own == default:
        return ""
    mix = f" mixed {':'.join(f'{w:g}' for w in own.mix)}" if own.mix else ""
    return f"calibration: {own.num_samples} x {own.seq_len} {' + '.join(own.domains())}{mix} {own.split}"


def plan_experiment(exp: Experiment, reports_dir: str | Path = "reports") -> list[dict]:
    """What `quantlab run` would do, loading no model: one dict per run (name, method, scheme, calibrates,
    trains, done), est_s, its seconds estimated from the finished rows in the results file (None without rows
    of its method), and est_basis, what the estimate rests on (see _estimate)."""
    results = Path(reports_dir) / f"{exp.name}.results.jsonl"
    device = resolve_device(exp.device)
    rows = read_rows(results) if results.exists() else []
    done = {r["run_key"] for r in rows}
    timed = _timed_rows(rows)
    plan = []
    for run in exp.runs:
        method = get_method(run.config)
        # a run's extras (rotation, kv_cache, ...) are its settings too: a row without them is not the same
        changed = set(non_default_fields(run.config)) | set(extras_to_dict(run.extras))
        est_s, basis = _estimate(run.to_dict(), timed, changed)
        plan.append({"run": run.name, "method": method.name, "scheme": scheme(run.to_dict(), exp.dtype),
                     "calibrates": method.needs_calibration_for(run.config),
                     "trains": method.needs_training_for(run.config), "backend": run.backend,
                     "done": run_key(exp, run, device) in done, "est_s": est_s, "est_basis": basis,
                     "calibration": _calibration_note(run.calibration, exp.calibration)})
    return plan


# A method's count of optimiser steps: its calibration or training time grows in proportion to it.
_WORK_STEPS = {"autoround": "iters", "qat": "steps", "lora": "steps"}


def _timed_rows(rows: list[dict]) -> list[tuple[dict, dict, float]]:
    """(config, row, seconds) of each finished row with an evaluation time, parsed once: seconds is the row's own
    work, quantize (calibration and training included), a rotation's learning (rotate_s, outside quantize_s),
    evaluation and the KL reference."""
    timed = []
    for r in rows:
        if isinstance(r.get("eval_s"), (int, float)):
            seconds = sum(r[k] for k in ("quantize_s", "rotate_s", "eval_s", "kl_reference_s")
                          if isinstance(r.get(k), (int, float)))
            timed.append((json.loads(r["config"]) if isinstance(r.get("config"), str) else {}, r, seconds))
    return timed


def _estimate(cfg: dict, timed: list[tuple[dict, dict, float]], changed: set[str] = frozenset()
              ) -> tuple[float | None, str | None]:
    """Seconds for a run from the finished rows: the median of the rows with its settings (name and seed aside; a
    field a row lacks, one added since it ran, counts as its default there, so it matches unless the run sets it
    (`changed`: the run's non-default fields)); else the median of its method's
    rows, each row's calibration and training time scaled by the run's step count over the row's where the method
    has one (AutoRound's iters, QAT's and LoRA's steps: 200 iterations take about 4x a 50-iteration row). A run with
    a rotation counts only the method's rows with a rotation of its kind, where there are any (a row's time includes
    learning its rotation, rotate_s), and a learned rotation's time scales with its steps, not with its windows a
    step: SpinQuant's steps cost much the same at 1 and 8 windows (1932 s and 3290 s for 100 steps on SmolLM2, 2-core
    Xeon); None without a timed row of the method."""
    def same_settings(c: dict) -> bool:
        return all(c[k] == cfg[k] if k in c else k not in changed for k in set(cfg) - {"name", "seed"})

    timed = [(c, r, seconds) for c, r, seconds in timed if r.get("method") == cfg["method"]]
    same = sorted(s for c, _, s in timed if same_settings(c))
    if same:
        return same[len(same) // 2], "same settings"
    kind = _rotation_kind(cfg)
    rotated = [t for t in timed if _rotation_kind(t[0]) == kind]
    basis = f"{cfg['method']} rows" + (f" with a {kind} rotation" if kind and rotated else "")
    timed = rotated if kind and rotated else timed
    if not timed:
        return None, None
    field, scaled, times = _WORK_STEPS.get(cfg["method"]), [], []
    for c, r, seconds in timed:
        mine, theirs = cfg.get(field), c.get(field)
        if field and isinstance(mine, int) and isinstance(theirs, int) and theirs > 0 and mine != theirs:
            work = sum(r[k] for k in ("calibrate_s", "train_s") if isinstance(r.get(k), (int, float)))
            seconds = seconds + work * (mine / theirs - 1)
            scaled.append(field)
        mine, theirs = _rotation_steps(cfg), _rotation_steps(c)
        if mine and theirs and mine != theirs and isinstance(r.get("rotate_s"), (int, float)):
            seconds = seconds + r["rotate_s"] * (mine / theirs - 1)
            scaled.append("rotation steps")
        times.append(seconds)
    times.sort()
    scaled = list(dict.fromkeys(scaled))
    return times[len(times) // 2], f"{basis}, {' and '.join(scaled)} scaled" if scaled else basis


def _rotation_kind(cfg: dict) -> str | None:
    rotation = cfg.get("rotation")
    return rotation.get("kind") if isinstance(rotation, dict) else None


def _rotation_steps(cfg: dict) -> int | None:
    """A learned rotation's optimiser steps (SpinQuant's Cayley SGD); None for a fixed one. A field the row lacks
    is its default."""
    rotation = cfg.get("rotation")
    if not isinstance(rotation, dict) or rotation.get("kind") != "spinquant":
        return None
    steps = rotation.get("steps", field_defaults(RotationConfig)["steps"])
    return steps if isinstance(steps, int) else None


def _check_executor_and_reports_dir(executor: str, address: str | None, reports_dir) -> Path:
    """Everything about where the runs go that fails before any lock, Ray or model; returns the reports folder,
    created."""
    from ..util.checks import check_reports_dir

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
    if executor == "local" and address is not None:
        raise ValueError(f"--address {address!r} needs --executor ray")
    if executor == "ray":
        from .ray_executor import check_reachable, import_ray

        if address is not None:
            check_reachable(address)  # an address nothing Ray answers at fails in seconds, before Ray loads
        import_ray()  # a missing Ray fails before any lock or model
    reports_dir = check_reports_dir(reports_dir, "reports_dir")
    try:
        reports_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # no permission, read-only file system, ...
        raise ValueError(f"cannot create the reports folder {str(reports_dir)!r}: {e.strerror}") from None
    return reports_dir


def select_runs(exp: Experiment, only) -> list[RunSpec]:
    """The runs `only` names: a run's name, or the name of a run with `seeds` for all its draws ("gptq-w4" for
    "gptq-w4-seed0", ...); None: every run. A name the experiment lacks raises, listing the ones it has."""
    if only is None:
        return list(exp.runs)
    only = list(only)
    known = list(dict.fromkeys(n for r in exp.runs for n in (r.group, r.name) if n))
    unknown = [n for n in only if n not in known]
    if unknown or not only:
        raise ValueError(f"{exp.name}: --only names no run called {', '.join(map(repr, unknown)) or 'anything'}; "
                         f"its runs: {', '.join(known)}")
    return [r for r in exp.runs if r.name in only or r.group in only]


def run_experiment(
    exp: Experiment, reports_dir: str | Path = "reports", force: bool = False, data_dir=None, cache_dir=None,
    progress: bool = True, wait: bool = False, wait_timeout_s: float | None = None, executor: str = "local",
    address: str | None = None, only=None,
):
    """Run every pending run of `exp`, then write reports/<name>.csv and .md. Returns the DataFrame.

    only: run names (select_runs) to run, the others left as they are (done or not); force then reruns only
    those. The report covers every run with a row either way.

    One process at a time per results file: another one running the same experiment makes this one
    fail at once (ResultsLocked, naming its PID), or with wait=True wait for it (up to wait_timeout_s).
    A failed run is logged in one line (its traceback at DEBUG), the others go on, and a RuntimeError
    listing the failures is raised after the report is written (no report when every run failed). executor "ray":
    each pending run is a Ray task on the cluster at `address` (None: a local Ray), see runs/ray_executor.py.
    """
    chosen = select_runs(exp, only)
    reports_dir = _check_executor_and_reports_dir(executor, address, reports_dir)
    results = reports_dir / f"{exp.name}.results.jsonl"
    with results_lock(results, wait=wait, timeout_s=wait_timeout_s):
        device = resolve_device(exp.device)
        if force and results.exists():
            if only is None:
                results.unlink()
            else:
                drop_rows(results, {run_key(exp, r, device) for r in chosen})
        done = {r["run_key"] for r in read_rows(results)}
        pending = [r for r in chosen if run_key(exp, r, device) not in done]
        log.info("%s: %d runs, %d already done, %d to run%s", exp.name, len(exp.runs),
                 sum(run_key(exp, r, device) in done for r in exp.runs), len(pending),
                 f" (--only {len(chosen)} of them)" if only is not None else "")
        preflight(exp, pending, cache_dir)  # what the model's config alone refuses, before any weights load
        if not pending:
            failures = []
        elif executor == "ray":
            from .ray_executor import run_pending_ray

            failures = run_pending_ray(exp, pending, results, data_dir, cache_dir, address)
        else:
            failures = _run_pending(exp, pending, results, device, data_dir, cache_dir, progress)
        latest = {r["run_key"]: r for r in read_rows(results)}
        rows = [latest[k] for k in (run_key(exp, r, device) for r in exp.runs) if k in latest]
        if rows or not failures:  # every run failed: the failures are the news, not "no rows"
            df = write_report(exp.name, rows, reports_dir, exp.description, exp.findings)
    if failures:
        kept = f" (finished rows kept in {results})" if rows else ", no rows to report"
        raise RuntimeError(f"{len(failures)} run(s) failed{kept}: " + "; ".join(failures))
    return df
