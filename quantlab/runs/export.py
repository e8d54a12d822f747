"""`quantlab export`: one run of an experiment, quantized as the experiment defines it, written for an engine.

    quantlab export experiments/smollm2_gguf.toml --run gptq-q4_0 out/smollm2-gptq-q4_0.gguf
    quantlab export experiments/smollm2_ptq.toml --run gptq-w4-g64 --format compressed-tensors out/smollm2-gptq-w4

Format "gguf": the file llama.cpp runs (backends/gguf_export.py: llama.cpp types keep their bytes, w4/w8 g32
symmetric integer grids become Q4_0 / Q8_0 exactly, any other grid fails naming the layer unless --requantize
names a type, which the file then records). Format "compressed-tensors": a checkpoint folder transformers and vLLM
load (backends/ct_export.py: quantlab's codes, scales and zero points exactly; a grid without a compressed-tensors
form fails naming the layer).
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from ..backends.ct_export import export_compressed_tensors
from ..backends.gguf_export import export_gguf
from ..core.extras import BEFORE_QUANTIZE
from ..core.ggml.registry import GGML_TYPES
from ..core.lifecycle import quantize
from ..core.registry import get_method
from ..models.loading import source_gguf
from .context import EvalContext
from .experiment import Experiment

FORMATS = ("gguf", "compressed-tensors")
BACKEND = {"gguf": "llama.cpp", "compressed-tensors": "compressed-tensors"}  # the engine an extra is judged for


def export_run(exp: Experiment, run_name: str, out: str | Path, fmt: str = "gguf", requantize: str | None = None,
               data_dir=None, cache_dir=None, progress: bool = True) -> dict:
    """Quantize run `run_name` of exp (its calibration, seed and extras) and write it to out; returns the export's
    facts (gguf: gguf_path, gguf_mib, gguf_types, gguf_requantized; compressed-tensors: ct_dir, ct_format,
    ct_schemes, ct_mib, ct_ignored, ct_notes). Every check runs before the model loads."""
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r} unknown; known: {', '.join(FORMATS)}")
    if requantize is not None and fmt != "gguf":
        raise ValueError(f"--requantize applies to --format gguf only, not {fmt!r}")
    if requantize is not None and requantize not in GGML_TYPES:
        raise ValueError(f"--requantize {requantize!r} is not a llama.cpp type; known: {', '.join(GGML_TYPES)}")
    runs = {r.name: r for r in exp.runs}
    if run_name not in runs:
        raise ValueError(f"experiment {exp.name!r} has no run {run_name!r}; its runs: {', '.join(runs)}")
    run = runs[run_name]
    for extra, config in run.extras:
        why = extra.refusal(config, BACKEND[fmt])
        if why:
            raise ValueError(f"run {run_name!r}: {extra.key} = {{...}}: a {fmt} export {why}")
    source = source_gguf(exp.model, cache_dir) if fmt == "gguf" else None
    if fmt == "gguf" and source is None:
        raise ValueError(f"model {exp.model!r} has no GGUF of its own to lend the export its tokenizer "
                         f"(use a GGUF alias or a .gguf model path)")
    ctx = EvalContext(exp, torch.device("cpu"), data_dir, cache_dir, progress)
    seed = exp.seed if run.seed is None else run.seed
    torch.manual_seed(seed)
    model = copy.deepcopy(ctx.model)
    method = get_method(run.config)
    calib = None
    if method.needs_calibration_for(run.config):
        calib = [w.unsqueeze(0) for w in ctx.calibration(seed, run.calibration or exp.calibration)]
    if method.needs_training_for(run.config):
        raise ValueError(f"run {run_name!r} trains (QAT / LoRA): run the experiment first; export of trained runs "
                         f"is not supported yet")
    if any(extra.needs_calibration_for(config) for extra, config in run.extras) and calib is None:
        calib = [w.unsqueeze(0) for w in ctx.calibration(seed, run.calibration or exp.calibration)]
    with contextlib.ExitStack() as stack:
        for extra, config in run.extras:
            if extra.stage == BEFORE_QUANTIZE:
                data = {"calibration": calib, "method_config": run.config} if extra.needs_calibration_for(config) else {}
                stack.enter_context(extra.apply(model, config, **data))
        quantize(model, run.config, calibration=calib if method.needs_calibration_for(run.config) else None,
                 progress=progress)
        if fmt == "compressed-tensors":
            return export_compressed_tensors(model, out, ctx.tokenizer, progress)
        return export_gguf(model, out, source, requantize)
