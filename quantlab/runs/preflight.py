"""Checks that need the model's config only (no weights), run before the model loads and before any run is
evaluated: a window longer than the model's max positions, a rotation or a scale-folding method (AWQ, SmoothQuant) on
an architecture without its table entry fail in one line at once, not after the float model loaded (or, for a
rotation, after the fp32 row was evaluated).

    preflight(exp, pending_runs, cache_dir)   # ValueError: eval.seq_len = 512 exceeds the model's max positions ...

The checks repeat what the loaded model would refuse later (EvalContext._check_length, transforms/rotation.py,
models/arch.py arch_for), from the same config fields.
"""
from __future__ import annotations

from ..core.ggml.gguffile import read_header
from ..core.registry import get_method, nested_configs
from ..eval.estimate import load_config
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


def _check_length(field: str, length: int, max_positions: int, where: str) -> None:
    if length > max_positions:
        raise ValueError(f"{field} = {length} exceeds the max positions of {where} ({max_positions}); "
                         f"valid: 1..{max_positions}")


def _check_architecture(run, model_config) -> None:
    """The architecture table entries the run needs (the smoothing groups of a method that folds per-channel scales:
    the table is where they find their producers), and what each of its extras asks of the model."""
    for c in nested_configs(run.config):
        method = get_method(c)
        if method.folds_channel_scales(c):
            arch_for(model_config, method.name)
    for extra, config in run.extras:
        extra.check_model_config(config, model_config)
