"""Run an experiment: one row per run, appended to a results file as soon as it is done.

A crash keeps every finished row; a rerun skips runs whose key (run config +
protocols + model + seed + device) is already in the file, unless force=True.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .api import quantize
from .data import calibration_windows, eval_windows, load_token_ids
from .envinfo import environment
from .eval import measure_latency, peak_memory_mib, perplexity, reference_logprobs, reset_peak_memory, weight_stats
from .experiment import Experiment, RunSpec
from .models import load_model, model_info, resolve_device
from .registry import get_method
from .report import write_report

log = logging.getLogger(__name__)


def _scheme(cfg: dict, dtype: str) -> str:
    if "bits" not in cfg:
        return dtype
    g = "channel" if cfg.get("group_size") is None else f"g{cfg['group_size']}"
    return f"w{cfg['bits']} {g} {'sym' if cfg.get('symmetric', True) else 'asym'}"


def run_key(exp: Experiment, run: RunSpec, device: torch.device) -> str:
    needs_calib = get_method(run.config).needs_calibration
    ident = {
        "run": run.to_dict(), "model": exp.model, "dtype": exp.dtype, "seed": exp.seed, "device": device.type,
        "eval": dataclasses.asdict(exp.eval),
        "calibration": dataclasses.asdict(exp.calibration) if needs_calib else None,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash: that run is simply redone
                log.warning("ignoring a truncated line in %s", path)
    return rows


def _append_row(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


class _Context:
    """Model, token windows and reference logits, built lazily and shared across runs."""

    def __init__(self, exp: Experiment, device, data_dir, cache_dir, progress: bool):
        self.exp, self.device, self.data_dir, self.cache_dir, self.progress = exp, device, data_dir, cache_dir, progress
        self.model, self.tokenizer = load_model(exp.model, exp.dtype, str(device), cache_dir)
        info = model_info(self.model)
        if info["max_positions"] and exp.eval.seq_len > info["max_positions"]:
            raise ValueError(f"eval.seq_len={exp.eval.seq_len} exceeds the model's max positions ({info['max_positions']})")
        ids, self.eval_source = load_token_ids(exp.eval.dataset, exp.eval.split, self.tokenizer, data_dir, cache_dir)
        self.eval_ids = ids
        self.windows = eval_windows(ids, exp.eval.seq_len, exp.eval.max_windows, exp.eval.max_tokens)
        k = min(exp.eval.kl_windows, len(self.windows))
        self.reference = reference_logprobs(self.model, self.windows[:k], progress) if k else None
        self._calib = None

    def calibration(self) -> torch.Tensor:
        if self._calib is None:
            c = self.exp.calibration
            ids, self.calib_source = load_token_ids(c.dataset, c.split, self.tokenizer, self.data_dir, self.cache_dir)
            self._calib = calibration_windows(ids, c.num_samples, c.seq_len, self.exp.seed)
        return self._calib


def _evaluate_run(ctx: _Context, run: RunSpec) -> dict:
    exp = ctx.exp
    torch.manual_seed(exp.seed)
    model = copy.deepcopy(ctx.model)
    method = get_method(run.config)
    calib = [w.unsqueeze(0) for w in ctx.calibration()] if method.needs_calibration else None
    summary = quantize(model, run.config, calibration=calib)
    reset_peak_memory(ctx.device)
    t0 = time.perf_counter()
    ppl = perplexity(model, ctx.windows, ctx.reference, ctx.progress)
    eval_s = time.perf_counter() - t0
    row = {"ppl": ppl["ppl"], "nll_mean": ppl["nll_mean"], "kl_mean": ppl.get("kl_mean"),
           "top1_agree": ppl.get("top1_agree"), "kl_tokens": ppl.get("kl_tokens", 0), "eval_s": eval_s}
    if exp.eval.latency:
        prompt = ctx.eval_ids[: exp.eval.prefill_tokens].unsqueeze(0)
        row.update(measure_latency(model, prompt, exp.eval.decode_tokens, repeats=exp.eval.latency_repeats))
    row.update(peak_memory_mib(ctx.device))
    row.update(weight_stats(model))
    row.update({k: v for k, v in summary.items() if k.endswith("_s")})
    if method.needs_calibration:
        c = exp.calibration
        row.update(calib_source=ctx.calib_source, calib_samples=c.num_samples, calib_seq_len=c.seq_len)
    row["predicted_tokens"] = ppl["predicted_tokens"]
    del model
    return row


def run_experiment(
    exp: Experiment, reports_dir: str | Path = "reports", force: bool = False, data_dir=None, cache_dir=None,
    progress: bool = True,
):
    """Run every pending run of `exp`, then write reports/<name>.csv and .md. Returns the DataFrame."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    results = reports_dir / f"{exp.name}.results.jsonl"
    if force and results.exists():
        results.unlink()
    device = resolve_device(exp.device)
    done = {r["run_key"] for r in read_rows(results)}
    pending = [r for r in exp.runs if run_key(exp, r, device) not in done]
    log.info("%s: %d runs, %d already done, %d to run", exp.name, len(exp.runs), len(exp.runs) - len(pending), len(pending))
    failures = []
    if pending:
        ctx = _Context(exp, device, data_dir, cache_dir, progress)
        env = environment(device)
        for i, run in enumerate(pending, 1):
            log.info("[%d/%d] %s", i, len(pending), run.name)
            try:
                metrics = _evaluate_run(ctx, run)
            except Exception as e:  # keep going: finished rows are saved, this run is retried next time
                log.exception("run %r failed", run.name)
                failures.append(f"{run.name}: {e}")
                continue
            cfg = run.to_dict()
            row = {
                "run": run.name, "method": cfg["method"], "scheme": _scheme(cfg, exp.dtype),
                "bits": cfg.get("bits"), "group_size": cfg.get("group_size"), "symmetric": cfg.get("symmetric"),
                **metrics,
                "backend": "float" if cfg["method"] == "none" else "simulated (PyTorch dequant on the fly)",
                "model": exp.model, "dtype": exp.dtype, "seed": exp.seed,
                "eval_dataset": exp.eval.dataset, "eval_split": exp.eval.split, "eval_source": ctx.eval_source,
                "bos": "none", "seq_len": exp.eval.seq_len, "eval_windows": len(ctx.windows),
                "eval_tokens": ctx.windows.numel(), **env,
                "config": json.dumps(cfg, sort_keys=True),
                "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "run_key": run_key(exp, run, device),
            }
            _append_row(results, row)
    latest = {r["run_key"]: r for r in read_rows(results)}
    rows = [latest[k] for k in (run_key(exp, r, device) for r in exp.runs) if k in latest]
    df = write_report(exp.name, rows, reports_dir, exp.description)
    if failures:
        raise RuntimeError(f"{len(failures)} run(s) failed (finished rows kept in {results}): " + "; ".join(failures))
    return df
