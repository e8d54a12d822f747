"""The lifecycle every method shares: prepare -> calibrate -> convert.

>>> model, tok = quantlab.load_model("smollm2-135m")
>>> quantlab.quantize(model, quantlab.make_config({"method": "rtn", "bits": 4, "group_size": 64}))
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from .ggml.recipes import row_fallback
from .ggml.registry import GGML_TYPES
from .overrides import LayerOverride, check_overrides_match, spec_for
from .qlinear import QuantLinear, WeightSpec
from .registry import LayerSelection, get_method

log = logging.getLogger(__name__)


def linearize_conv1d(model: nn.Module) -> list[str]:
    """Replace every transformers `Conv1D` (GPT-2: weight (in, out), y = x @ W + b) by the nn.Linear computing
    the same function (weight Wᵀ, made contiguous; bias shared), in place, keeping its name; returns the names.

    Every method, saved file and export then sees a plain linear (weight (out, in)). The float forward stays
    bitwise equal on CPU fp32 (measured: tests/test_arch_coverage.py): Linear multiplies x by the transpose of
    a contiguous Wᵀ, the same (in, out) operand Conv1D's addmm reads.

    >>> linearize_conv1d(gpt2)  # ['transformer.h.0.attn.c_attn', ...]
    """
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: no Conv1D can be in the model
        return []
    names = [n for n, m in model.named_modules() if type(m) is Conv1D]
    for name in names:
        conv = model.get_submodule(name)
        weight = conv.weight.detach()
        linear = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None, device="meta", dtype=weight.dtype)
        linear.weight = nn.Parameter(weight.t().contiguous(), requires_grad=conv.weight.requires_grad)
        linear.bias = conv.bias
        linear.train(conv.training)
        set_submodule(model, name, linear)
    return names


def select_linears(model: nn.Module, selection: LayerSelection) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear whose name passes the include/exclude globs.

    Conv1D layers (GPT-2) are first turned into nn.Linear in place (linearize_conv1d), so they are
    selected, quantized and saved like any linear, under their own names."""
    linearize_conv1d(model)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    chosen = [(n, m) for n, m in linears if selection.matches(n)]
    if not chosen:
        examples = ", ".join(n for n, _ in linears[:4]) or "none (model has no nn.Linear)"
        raise ValueError(
            f"include={list(selection.include)} exclude={list(selection.exclude)} matched no linear layer; "
            f"linear names look like: {examples}"
        )
    return chosen


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the module at `name`. Forward pre-hooks of the module replaced move to the new one (a rotation's
    online Hadamard on a layer's input stays through every swap: quantize, QAT, export, sensitivity)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child, None)
    if isinstance(old, nn.Module) and old is not module:
        for key, hook in old._forward_pre_hooks.items():
            module._forward_pre_hooks.setdefault(key, hook)
    setattr(parent, child, module)


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def swap_in_quant_linears(
    model: nn.Module, selection: LayerSelection, spec: WeightSpec, overrides: tuple[LayerOverride, ...] = (),
) -> list[str]:
    """Replace selected nn.Linear modules by fake-quant QuantLinear (grid: spec + matching overrides);
    returns their names. An override matching no selected layer is an error."""
    chosen = select_linears(model, selection)
    check_overrides_match(overrides, [n for n, _ in chosen])
    for name, linear in chosen:
        bad = ~torch.isfinite(linear.weight.detach())
        if bad.any():  # a NaN / Inf scale would silently turn the whole group (or row) into NaN
            raise ValueError(f"{name}: weight has {int(bad.sum())} NaN/Inf value(s) (first at index "
                             f"{tuple(bad.nonzero()[0].tolist())}); cannot quantize it")
        layer_spec = spec_for(spec, overrides, name)
        if layer_spec.ggml is not None and linear.in_features % layer_spec.ggml.block:
            layer_spec = _ggml_fallback(name, linear, layer_spec)
        set_submodule(model, name, QuantLinear.from_linear(linear, layer_spec))
    return [n for n, _ in chosen]


def _ggml_fallback(name: str, linear: nn.Linear, spec: WeightSpec) -> WeightSpec:
    """A llama.cpp type whose blocks do not tile the layer's rows: the type llama.cpp falls back to there (logged;
    the row's ggml_fallbacks counts them), or an error naming the layer where none fits."""
    new = row_fallback(spec.format, linear.in_features)
    if new not in GGML_TYPES:
        raise ValueError(f"{name}: {linear.in_features} input columns are not whole {spec.format} blocks of "
                         f"{spec.ggml.block}, and llama.cpp's fallback ({new}) is no quantized type")
    log.info("%s: %d input columns are not whole %s blocks of %d; llama.cpp's fallback %s instead", name,
             linear.in_features, spec.format, spec.ggml.block, new)
    return WeightSpec(format=new)


@contextlib.contextmanager
def cached_weights(model: nn.Module):
    """Within this block, no-grad forwards compute each QuantLinear's weight once (per dtype) and reuse it:
    simulated evaluation at float speed, bitwise equal to the uncached forward (activation quantizers still run
    per forward). The caches (a float copy of every quantized weight) are freed on exit.

    >>> with cached_weights(model): ppl = perplexity(model, windows)
    """
    layers = list(quant_linears(model).values())
    for layer in layers:
        layer.weight_cache = {}
    try:
        yield
    finally:
        for layer in layers:
            layer.weight_cache = None


def freeze_all(model: nn.Module) -> None:
    for layer in quant_linears(model).values():
        layer.freeze()


def run_calibration(model: nn.Module, batches: Iterable[torch.Tensor], desc: str = "calibrate",
                    progress: bool = True) -> int:
    """The single calibration loop: eval mode, no grad, one forward per batch.

    Methods attach observers/hooks in prepare(); this only feeds data.
    Returns the number of batches seen.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    n = 0
    with torch.inference_mode():
        for batch in tqdm(batches, desc=desc, leave=False, disable=not progress):
            model(batch.to(device))
            n += 1
    model.train(was_training)
    if n == 0:
        raise ValueError("calibration set is empty (0 batches)")
    return n


def quantize(
    model: nn.Module, config: Any, calibration: Iterable[torch.Tensor] | None = None,
    training: Any = None, teacher: nn.Module | None = None, checkpoint_dir: Any = None, progress: bool = True,
    train_processes: int = 1,
) -> dict:
    """Quantize `model` in place with `config`; returns a small summary dict.

    Runs method.prepare, method.calibrate (when the method needs data), method.train
    (QAT: `training` token windows, `teacher` for distillation, resumable from
    `checkpoint_dir`) and method.convert. `calibration` is an iterable of (1, T) token-id tensors.
    summary["diagnostics"] holds what calibrate() and convert() reported (e.g. AWQ's chosen α); progress=False
    silences every progress bar. train_processes > 1: data-parallel QAT over that many processes.
    """
    method = get_method(config)
    t0 = time.perf_counter()
    method.prepare(model, config)
    t1 = time.perf_counter()
    diagnostics = {}
    if method.needs_calibration_for(config):
        if calibration is None:
            raise ValueError(f"method {method.name!r} needs calibration data; pass calibration=[...]")
        diagnostics = method.calibrate(model, config, calibration, progress=progress) or {}
    t2 = time.perf_counter()
    train_stats = {}
    if method.needs_training_for(config):
        if training is None:
            raise ValueError(f"method {method.name!r} trains; pass training=[...] token windows (never the test split)")
        extra = {"processes": train_processes} if train_processes > 1 else {}
        train_stats = method.train(model, config, training, teacher, checkpoint_dir, progress, **extra)
    t2b = time.perf_counter()
    converted = method.convert(model, config) or {}  # e.g. LoRA's adapter sizes, for the row
    t3 = time.perf_counter()
    return {**train_stats,
        "diagnostics": {**diagnostics, **converted},
        "method": method.name,
        "quantized_layers": len(quant_linears(model)),
        "prepare_s": t1 - t0,
        "calibrate_s": t2 - t1,
        "convert_s": t3 - t2b,
        "quantize_s": t3 - t0,
    }
