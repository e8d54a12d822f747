"""Evaluate one run against the shared context (context.py: float model, windows, calibration data), and its row.

The runner (runner.py), the Ray executor (ray_executor.py) and `quantlab lm-eval` (lmeval.py) all evaluate a run
through these three doors, so a run means the same thing wherever it executes:

    ctx = EvalContext(exp, device, data_dir, cache_dir, progress=True)   # loads the model once
    metrics = evaluate_run(ctx, run)                                     # quantize a copy, evaluate it
    row = result_row(ctx, run, metrics, environment(device))             # + identity, protocol, environment
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..backends import export_for_run
from ..calibration.streaming import shared_copy
from ..core.extras import AFTER_EXPORT, BEFORE_QUANTIZE, extras_to_dict
from ..core.grid import grid_fields
from ..core.lifecycle import quantize
from ..core.registry import get_method, method_versions, non_default_fields
from ..eval import measure_latency, peak_memory_mib, perplexity, reset_peak_memory, weight_stats
from ..eval.embedding import embedding_fidelity, layer_output_errors, mean_pooled_embeddings
from ..eval.lmeval import run_lm_eval
from ..eval.memprobe import isolated_run_memory, peak_rss_mib, reset_peak_rss
from ..eval.perplexity import KL_REFERENCE_ON_THE_FLY, KL_TOKEN_STATS
from ..models.data import bos_description
from ..models.loading import default_cache_dir, source_gguf
from ..reporting.report import LATENCY_REF, SPEED_COLUMNS, scheme
from ..util.memory import release_free_heap
from .context import EvalContext, source_fields
from .envinfo import load_average
from .experiment import Experiment, RunSpec

log = logging.getLogger(__name__)


def run_key(exp: Experiment, run: RunSpec, device: torch.device) -> str:
    method = get_method(run.config)
    # training (QAT) reads its windows from the calibration protocol too
    needs_calib = method.needs_calibration_for(run.config) or method.needs_training_for(run.config) or any(
        extra.needs_calibration_for(config) for extra, config in run.extras)  # SpinQuant learns from them too
    ident = {
        "run": {"name": run.name, "method": get_method(run.config).name, **non_default_fields(run.config),
                **({"backend": run.backend} if run.backend != "simulated" else {}),
                **extras_to_dict(run.extras)},
        "model": exp.model, "dtype": exp.dtype, "seed": exp.seed, "device": device.type,
        **({"reference": exp.reference} if exp.reference is not None else {}),
        "eval": non_default_fields(exp.eval),
        # a run's own calibration = {...} counts as what it is: the same protocol as the file's, the same key
        "calibration": non_default_fields(run.calibration or exp.calibration) if needs_calib else None,
    }
    versions = method_versions(run.config)
    if versions:  # a method whose default behaviour changed: rows of the old one are not reused
        ident["versions"] = versions
    if run.seed is not None:  # only runs expanded from `seeds`: every other key stays as it was
        ident["run_seed"] = run.seed
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _domain_metrics(ctx: EvalContext, model, main: dict) -> dict:
    """[eval] datasets: each domain's ppl, KL and per-window NLL under its own suffix (ppl_pystdlib, ...); the main
    domain's numbers are `main`'s (measured once). Each domain is measured as a single-domain run would be."""
    out, reference_s = {"eval_domains": json.dumps(list(ctx.domains))}, 0.0
    for label, (windows, source) in ctx.domains.items():
        if windows is ctx.windows:
            ppl = main
        else:
            kl = min(ctx.exp.eval.kl_windows, len(windows)) if ctx.kl_model is not None else 0
            ppl = perplexity(model, windows, ctx.kl_model if kl else None, ctx.progress, kl_windows=kl if kl else None,
                             dtype=ctx.eval_dtype)
            reference_s += ppl.get("kl_reference_s") or 0.0
        out.update({f"ppl_{label}": ppl["ppl"], f"nll_mean_{label}": ppl["nll_mean"],
                    f"kl_mean_{label}": ppl.get("kl_mean"), f"top1_agree_{label}": ppl.get("top1_agree"),
                    f"eval_windows_{label}": len(windows), f"eval_tokens_{label}": windows.numel(),
                    f"eval_source_{label}": source, f"window_nll_{label}": json.dumps(ppl["window_nll"]),
                    f"window_tokens_{label}": json.dumps([windows.shape[1] - 1] * len(windows))})
    return out | {"domains_kl_reference_s": reference_s}


def _perplexity_metrics(ctx: EvalContext, model) -> dict:
    reference = ctx.kl_model if ctx.kl_windows else None
    ppl = perplexity(model, ctx.windows, reference, ctx.progress, kl_windows=ctx.kl_windows if reference else None,
                     dtype=ctx.eval_dtype)
    domains = _domain_metrics(ctx, model, ppl) if ctx.domains else {}
    if domains:  # eval_s excludes every domain's reference time
        ppl["kl_reference_s"] = (ppl.get("kl_reference_s") or 0.0) + domains.pop("domains_kl_reference_s")
    return {"ppl": ppl["ppl"], "nll_mean": ppl["nll_mean"], "kl_mean": ppl.get("kl_mean"),
            "top1_agree": ppl.get("top1_agree"), "kl_tokens": ppl.get("kl_tokens", 0),
            # llama-perplexity --kl-divergence's statistics (eval/perplexity.kl_token_stats)
            **{k: ppl.get(k) for k in KL_TOKEN_STATS},
            "kl_reference": KL_REFERENCE_ON_THE_FLY if reference else None, "kl_reference_s": ppl.get("kl_reference_s"),
            "predicted_tokens": ppl["predicted_tokens"], "eval_windows": len(ctx.windows),
            "eval_batch_size": ppl["eval_batch_size"], "eval_gemm": ppl["eval_gemm"],
            "eval_tokens": ctx.windows.numel(), "seq_len": ctx.exp.eval.seq_len,
            # per-window NLL sums and predicted tokens: bootstrap intervals are computed from stored rows
            "window_nll": json.dumps(ppl["window_nll"]),
            "window_tokens": json.dumps([ctx.windows.shape[1] - 1] * len(ctx.windows))} | domains


def _embedding_metrics(ctx: EvalContext, model) -> dict:
    e = ctx.exp.eval
    emb = mean_pooled_embeddings(model, ctx.tokenizer, ctx.sentences, e.max_length, progress=ctx.progress)
    errors = layer_output_errors(model, ctx.model, ctx.error_batch) if model is not ctx.model else {}
    values = list(errors.values())
    return {**embedding_fidelity(ctx.reference, emb), "max_length": e.max_length,
            "layer_rel_err_mean": sum(values) / len(values) if values else 0.0,
            "layer_rel_err_max": max(values, default=0.0),
            "layer_rel_err": json.dumps({k: round(v, 6) for k, v in errors.items()})}


IN_PROCESS_CUDA = ("in-process CUDA allocator peak from just before this run's evaluation to the end of its latency "
                   "passes; the float model (baseline, KL reference run window by window) and this run's model are "
                   "both resident")


def _isolated_memory(ctx: EvalContext, run: RunSpec, model, method) -> dict:
    """[eval] memory = "isolated": one forward of seq_len tokens of this run's model in a fresh process."""
    exp = ctx.exp
    return isolated_run_memory(model, run.config, exp.model, exp.eval.seq_len, quantized=not method.baseline,
                               dtype=exp.dtype, backend=run.backend, device=str(ctx.device),
                               cache_dir=ctx.cache_dir, threads=torch.get_num_threads())


def _is_float_model(run: RunSpec, method, model, evaluated) -> bool:
    """True for a run that evaluates the float model itself (the baseline method, no run extra): its latency is the
    reference, so no paired one is measured."""
    return method.baseline and evaluated is model and not run.extras


def _apply_extras(stack: contextlib.ExitStack, run: RunSpec, stage: str, model, calib=None) -> dict:
    """Enter each of the run's extras of `stage` on `model`; `stack` (the run's) leaves them when the run is done.
    An extra that learns from data gets the calibration windows and the run's method config."""
    fields = {}
    for extra, config in run.extras:
        if extra.stage == stage:
            data = {"calibration": calib, "method_config": run.config} if extra.needs_calibration_for(config) else {}
            fields |= stack.enter_context(extra.apply(model, config, **data))
    return fields


def _source_gguf(ctx: EvalContext, run: RunSpec):
    return source_gguf(ctx.exp.model, ctx.cache_dir) if run.backend == "llama.cpp" else None


def evaluate_run(ctx: EvalContext, run: RunSpec) -> dict:
    """Quantize a copy of the float model as the run says (its extras applied around it), evaluate it and return
    the run's metrics. The run owns its extras: each is entered at its stage and left, in reverse order, when the
    evaluation is done, so nothing the run applied outlives it."""
    exp = ctx.exp
    load_start = load_average()
    seed = exp.seed if run.seed is None else run.seed
    torch.manual_seed(seed)
    method = get_method(run.config)
    streamed = (exp.execution.stream_blocks and method.streams_blocks(run.config)
                and not any(extra.stage == BEFORE_QUANTIZE for extra, _ in run.extras))
    model = shared_copy(ctx.model) if streamed else copy.deepcopy(ctx.model)
    needs_calib, needs_train = method.needs_calibration_for(run.config), method.needs_training_for(run.config)
    extra_calib = any(extra.needs_calibration_for(config) for extra, config in run.extras)
    calib_protocol = run.calibration or exp.calibration
    calib = [w.unsqueeze(0) for w in ctx.calibration(seed, calib_protocol)] \
        if needs_calib or needs_train or extra_calib else None
    checkpoints = Path(ctx.cache_dir or default_cache_dir()) / "checkpoints" / run_key(exp, run, ctx.device)
    with contextlib.ExitStack() as extras:
        peak = _PeakRSS(ctx.device) if needs_calib or needs_train or extra_calib else contextlib.nullcontext({})
        with peak as quantize_memory:
            applied = _apply_extras(extras, run, BEFORE_QUANTIZE, model, calib)  # GPTQ / static ranges see it rotated
            summary = quantize(model, run.config, calibration=calib if needs_calib else None,
                               training=calib if needs_train else None,
                               teacher=ctx.model if method.needs_teacher_for(run.config) else None,
                               checkpoint_dir=checkpoints if needs_train else None, progress=ctx.progress,
                               train_processes=exp.execution.qat_processes)
        isolated = _isolated_memory(ctx, run, model, method) if exp.eval.memory == "isolated" else {}
        onnx_dir = Path(ctx.cache_dir or default_cache_dir()) / "onnx" / run_key(exp, run, ctx.device)
        evaluated, exported = export_for_run(model, run.backend, not method.baseline, ctx.eval_ids[:64].unsqueeze(0),
                                             onnx_dir, _source_gguf(ctx, run), exp.eval.seq_len)
        applied |= _apply_extras(extras, run, AFTER_EXPORT, model)  # methods calibrated on the float embedding
        row = _measure(ctx, run, model, evaluated, _is_float_model(run, method, model, evaluated))
    if isolated:  # every memory column from the fresh process (or memory_probe saying why there are none)
        row.update(isolated)
    elif ctx.device.type == "cuda":  # CPU: no in-process per-run peak exists (eval/memory.py)
        row.update(peak_memory_mib(ctx.device), memory_probe=IN_PROCESS_CUDA)
    row.update(weight_stats(model))  # the quantized PyTorch model's storage (onnxruntime: ort_model_mib too)
    row.update({k: v for k, v in summary.items() if k.endswith("_s") or k.startswith("train_")})
    row.update(summary["diagnostics"])  # what calibrate() reported, e.g. AWQ's chosen alphas
    row.update(exported | applied | quantize_memory | source_fields(ctx))
    if needs_calib or needs_train or extra_calib:
        c = calib_protocol
        row.update(calib_source=ctx.calib_sources[c], calib_samples=c.num_samples, calib_seq_len=c.seq_len)
    del model, evaluated
    if needs_train and checkpoints.exists():  # the row is about to be saved: the run will not resume
        shutil.rmtree(checkpoints)
    row.update(load_avg_1m_start=load_start, load_avg_1m_end=load_average())  # how busy the machine was
    return row


class _PeakRSS:
    """The process' peak memory while calibrating or training (the float model, its copy being quantized, the
    calibration windows and the method's own state together): quantize_peak_rss_mib from Linux's VmHWM, reset on
    entry (absent where the OS cannot reset it); on CUDA also quantize_peak_cuda_mib (peak allocated)."""

    def __init__(self, device: torch.device):
        self.device, self.out = device, {}

    def __enter__(self) -> dict:
        release_free_heap()  # the heap an earlier phase freed (evaluation logits) is not this run's
        self.reset = reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.out

    def __exit__(self, *exc) -> None:
        if self.reset:
            self.out["quantize_peak_rss_mib"] = peak_rss_mib()
        if self.device.type == "cuda":
            self.out["quantize_peak_cuda_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20


def _measure(ctx: EvalContext, run: RunSpec, model, evaluated, is_float: bool) -> dict:
    """The measured phase: quality (perplexity or embedding fidelity, lm-eval tasks) then latency, the float
    model's paired latency right before the run's own (unless the run is the float model)."""
    exp = ctx.exp
    ctx.check_reference()
    dtype_shift = ctx.eval_dtype_fields()  # measured once per experiment, outside this run's eval_s
    reset_peak_memory(ctx.device)  # CUDA: the measured phase (evaluation + latency) starts here
    t0 = time.perf_counter()
    row = (_embedding_metrics if exp.eval.metric == "embedding" else _perplexity_metrics)(ctx, evaluated)
    row.update(dtype_shift)
    row["eval_s"] = time.perf_counter() - t0 - (row.get("kl_reference_s") or 0.0)  # this model's evaluation
    if exp.eval.lm_eval_tasks:  # the model as evaluated above; its time is lmeval_s, not in eval_s
        e = exp.eval
        row.update(run_lm_eval(model, ctx.tokenizer, list(e.lm_eval_tasks), e.lm_eval_limit, e.lm_eval_max_length,
                               e.lm_eval_batch_size, ctx.data_dir, manager=ctx.lm_eval_tasks))
    if exp.eval.latency:
        prompt = ctx.eval_ids[: exp.eval.prefill_tokens].unsqueeze(0)
        new_tokens = exp.eval.decode_tokens if exp.eval.metric == "perplexity" else 0
        if not is_float:  # paired: the float model just before
            ref = measure_latency(ctx.model, prompt, new_tokens, repeats=exp.eval.latency_repeats)
            row.update({LATENCY_REF + col: ref[col] for _, col in SPEED_COLUMNS if col in ref})
        if run.backend == "llama.cpp":  # llama.cpp's own prefill and decode (batch 1) on the GGUF it evaluated
            from ..backends.llamacpp import measure_llamacpp_latency

            row.update(measure_llamacpp_latency(evaluated.gguf.path, prompt.shape[1], max(new_tokens, 1), (1,),
                                                threads=torch.get_num_threads(),
                                                repeats=exp.eval.latency_repeats)[1])
        else:  # a kv_cache extra is applied to the model: measure_latency decodes on its quantized cache
            row.update(measure_latency(evaluated, prompt, new_tokens, repeats=exp.eval.latency_repeats))
    return row


def result_row(ctx: EvalContext, run: RunSpec, metrics: dict, env: dict) -> dict:
    """The run's row: identity, scheme and grid columns, its metrics, the protocol, the environment, its key."""
    exp, cfg = ctx.exp, run.to_dict()
    return {
        "run": run.name, "method": cfg["method"], "scheme": scheme(cfg, exp.dtype),
        **grid_fields(run.config, exp.dtype),
        **metrics,
        "backend": metrics.get("backend") or (
            "float" if get_method(run.config).baseline else "simulated (PyTorch dequant on the fly)"),
        "model": exp.model, "dtype": exp.dtype, "seed": exp.seed if run.seed is None else run.seed,
        "experiment": exp.name, "run_group": run.group or run.name,
        "eval_metric": exp.eval.metric, "eval_dataset": exp.eval.dataset, "eval_split": exp.eval.split,
        "eval_source": ctx.eval_source, "bos": bos_description(ctx.tokenizer, exp.eval.bos, exp.eval.seq_len),
        **({"eval_window_order": exp.eval.windows} if exp.eval.windows != "first" else {}), **env,
        "config": json.dumps(cfg, sort_keys=True),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_key": run_key(exp, run, ctx.device),
    }
