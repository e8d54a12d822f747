"""Checks that need the model's config only (no weights), run before the model loads and before any run is
evaluated: a window longer than the model's max positions, a rotation or a scale-folding method (AWQ, SmoothQuant) on
an architecture without its table entry fail in one line at once, not after the float model loaded (or, for a
rotation, after the fp32 row was evaluated).

    preflight(exp, pending_runs, cache_dir)   # ValueError: eval.seq_len = 512 exceeds the model's max positions ...

The checks repeat what the loaded model would refuse later (EvalContext._check_length, transforms/rotation.py,
models/arch.py arch_for), from the same config fields.
"""
from __future__ import annotations

import os

import torch

from ..core.extras import BEFORE_QUANTIZE
from ..core.ggml.gguffile import read_header
from ..core.registry import get_method, nested_configs
from ..eval.estimate import GIB, estimate_calibration, load_config
from ..models.arch import arch_for


def preflight(exp, runs, cache_dir=None, config=None) -> None:
    """Check `runs` of `exp` (the ones about to be evaluated) against the model's config, loaded without weights
    (or `config`, a Hugging Face config, when the caller has one). Nothing to check, nothing loaded."""
    runs = list(runs)
    if not runs:
        return
    if str(exp.model).endswith(".gguf"):  # a truncated or corrupt file fails here, named, before transformers reads it
        read_header(exp.model)
    config = config if config is not None else load_config(exp.model, cache_dir)
    max_positions = getattr(config, "max_position_embeddings", None)  # as EvalContext reads it (model_info)
    where = f"model {exp.model!r}"
    if max_positions:
        field = "eval.seq_len" if exp.eval.metric == "perplexity" else "eval.max_length"
        length = exp.eval.seq_len if exp.eval.metric == "perplexity" else exp.eval.max_length
        _check_length(field, length, max_positions, where)
    for run in runs:
        method = get_method(run.config)
        if max_positions and (method.needs_calibration_for(run.config) or method.needs_training_for(run.config)):
            own = f"run {run.name!r}: " if run.calibration is not None else ""
            _check_length(f"{own}calibration.seq_len", (run.calibration or exp.calibration).seq_len, max_positions,
                          where)
        try:
            _check_architecture(run, config)
        except ValueError as e:
            raise ValueError(f"run {run.name!r} on {where}: {e}") from None
    _check_calibration_memory(exp, runs, config, where)


def available_memory_bytes() -> int | None:
    """Host memory available now (psutil), or None where it cannot be read."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _check_calibration_memory(exp, runs, config, where: str) -> None:
    """On the CPU, refuse a calibrating run whose estimated peak (eval/estimate.py estimate_calibration) exceeds the
    memory available now, naming the need, its parts and the largest block. QUANTLAB_SKIP_MEMORY_CHECK=1 skips it."""
    if os.environ.get("QUANTLAB_SKIP_MEMORY_CHECK") == "1" or str(exp.device).startswith("cuda") or (
            exp.device == "auto" and torch.cuda.is_available()):
        return
    calibrating = [r for r in runs if get_method(r.config).needs_calibration_for(r.config)
                   or get_method(r.config).needs_training_for(r.config)]
    if not calibrating:
        return
    def streamed(r) -> bool:  # as runs/evaluate.py decides
        return (exp.execution.stream_blocks and get_method(r.config).streams_blocks(r.config)
                and not any(extra.stage == BEFORE_QUANTIZE for extra, _ in r.extras))

    try:
        sized = [(r, estimate_calibration(config, (r.calibration or exp.calibration).num_samples,
                                          (r.calibration or exp.calibration).seq_len, exp.dtype, streamed(r)))
                 for r in calibrating]
    except ValueError:  # an architecture the estimate does not know: nothing to check
        return
    run, est = max(sized, key=lambda pair: pair[1].total_bytes)
    available = available_memory_bytes()
    if available is None or est.total_bytes <= available:
        return
    c = run.calibration or exp.calibration
    raise ValueError(
        f"run {run.name!r} on {where}: calibrating on {c.num_samples} windows of {c.seq_len} tokens needs about "
        f"{est.total_bytes / GIB:.1f} GiB (the float model {est.model_bytes / GIB:.1f} GiB, the copy being "
        f"quantized {est.copy_bytes / GIB:.1f} GiB, hidden states {est.hidden_state_bytes / GIB:.1f} GiB, "
        f"{est.largest_block}), but {available / GIB:.1f} GiB is available; lower calibration.num_samples or "
        f"seq_len, or use a machine with more memory (QUANTLAB_SKIP_MEMORY_CHECK=1 runs it anyway)")


def _check_length(field: str, length: int, max_positions: int, where: str) -> None:
    if length > max_positions:
        raise ValueError(f"{field} = {length} exceeds the max positions of {where} ({max_positions}); "
                         f"valid: 1..{max_positions}")


def _check_architecture(run, model_config) -> None:
    """The architecture table entries the run needs (the smoothing groups of a method that folds per-channel scales:
    the table is where they find their producers), and what each of its extras asks of the model."""
    for c in nested_configs(run.config):
        method = get_method(c)
        method.check_model_config(c, model_config)
        if method.folds_channel_scales(c):
            arch_for(model_config, method.name)
    for extra, config in run.extras:
        extra.check_model_config(config, model_config)
