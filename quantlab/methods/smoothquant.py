"""`smoothquant`: SmoothQuant (Xiao et al. 2022), then an activation-quantization base method.

Per-channel activation outliers are migrated into the weights: for each smoothing group
(a producer feeding consumer linears),
    s_c = max|X_c|^α / max|W_:,c|^(1-α)      (max|W| over every consumer's column c)
and smoothing.apply_scale folds s into producer and consumers (float function unchanged).
max|X| comes from the FLOAT model: the statistics pass runs before the base's prepare.

Which groups: by default those whose input is a normalization's output (the architecture
table's `input_from == "norm"`): q/k/v after the attention norm and the MLP's first linears
after the MLP norm, as the paper and its reference code (smooth.py::smooth_lm) do.
`smooth_linear_inputs = true` also smooths the linear -> linear groups (v -> o, up -> down,
OPT fc1 -> fc2, BERT value -> attention.output.dense and output.dense): not the paper's method.

    [[run]]
    method = "smoothquant"
    alpha = 0.5                                  # or "search"
    base = { method = "dynamic", base = { method = "rtn", bits = 8 } }   # weights: rtn or gptq only

Weight bases (base.base) other than rtn / gptq fail at config time, saying why (_UNSUPPORTED_WHY).

alpha = "search": each group independently (per group, not one global α) takes the α of
ALPHA_GRID minimizing its consumers' relative output error |XWᵀ - Q(X/s) Q(W·s)ᵀ|² / |XWᵀ|²
on a random sample of SEARCH_ROWS calibration tokens, with the base's activation quantizer
(dynamic per token, or static min-max of the sample for a static base) and each consumer's own
weight grid (the base's overrides applied; a consumer the base leaves in float is simulated in
float). The grid is rounded to nearest: for a gptq base the search sees GPTQ's grid, not its
error-compensating rounding. Groups are processed in table order, each on the weights left by
the previous ones.

calibrate() iterates the calibration batches more than once (statistics, then the base);
a one-shot iterator is first turned into a list. It returns smoothquant_groups (groups smoothed)
and smoothquant_alpha_mean (and _min/_max when searched) for the result row, with the base's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..calibration.smoothing import apply_scale, group_applies, group_modules
from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.lifecycle import linearize_conv1d, quant_linears, run_calibration
from ..core.observer_hooks import attach_input_observers
from ..core.observers import SmoothStats
from ..core.qlinear import WeightSpec
from ..core.registry import (
    Method,
    as_config,
    get_method,
    known_methods,
    needs_calibration,
    quantizes_activations,
    register_method,
)
from ..models.arch import ScaleGroup, arch_for, find_blocks
from .dynamic import DynamicConfig

log = logging.getLogger(__name__)

ALPHA_GRID = tuple(i / 10 for i in range(11))  # 0.0, 0.1, ..., 1.0
SEARCH_ROWS = 256  # calibration tokens kept per group for alpha = "search"
SCALE_CLAMP = (1e-5, 1e5)  # s stays finite and > 0 for dead channels / zero weight columns


# weight bases (base.base) SmoothQuant composes with, and why the others do not
SUPPORTED_WEIGHT_BASES = ("gptq", "rtn")
_UNSUPPORTED_WHY = {
    "awq": "AWQ searches and folds its own scales into the same groups right after smoothing, with a "
           "weight-only loss, so the model would hold neither SmoothQuant's migration nor AWQ's, and "
           "alpha='search' could not simulate it",
}  # a training base (qat) is already refused by dynamic / static themselves


@dataclass(frozen=True)
class SmoothQuantConfig:
    """alpha in [0, 1] (migration strength) or "search"; base: an activation config (default W8A8 dynamic)
    whose weight base is rtn or gptq. smooth_linear_inputs: False (default, the paper) smooths only groups
    fed by a norm (q/k/v, gate/up, fc1, BERT query/key/value and intermediate); True also the linear ->
    linear groups (v -> o, up -> down, fc1 -> fc2, BERT value -> attention.output.dense, output.dense)."""

    alpha: Any = 0.5
    base: Any = DynamicConfig()
    smooth_linear_inputs: bool = False

    def __post_init__(self):
        a = self.alpha
        if a != "search":
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
                raise ValueError(f"alpha must be a number in [0, 1] or 'search', got {a!r}")
            object.__setattr__(self, "alpha", float(a))
        if not isinstance(self.smooth_linear_inputs, bool):
            raise ValueError(f"smooth_linear_inputs must be true or false, got {self.smooth_linear_inputs!r}")
        base = as_config(self.base, "base")
        method = get_method(base)
        if method.name == "smoothquant" or not quantizes_activations(method):
            valid = [m for m in known_methods() if m != "smoothquant" and quantizes_activations(get_method(m))]
            raise ValueError(f"smoothquant: base must be an activation method ({', '.join(valid)}), got {method.name!r}")
        weight_method = get_method(base.base).name
        if weight_method not in SUPPORTED_WEIGHT_BASES:
            why = _UNSUPPORTED_WHY.get(weight_method, "its weight grid cannot be simulated")
            raise ValueError(f"smoothquant: weight base {weight_method!r} (base.base) is not supported: {why}; "
                             f"supported: {', '.join(SUPPORTED_WEIGHT_BASES)}")
        object.__setattr__(self, "base", base)


def _foldable(model: nn.Module, group: ScaleGroup) -> bool:
    """Architecture variants the table does not describe, where folding would change the function."""
    cfg = model.config
    if cfg.model_type == "opt" and group.kind == "norm" and not getattr(cfg, "do_layer_norm_before", True):
        return False  # post-LN OPT (350m): these norms act after the residual add, their output is the residual
    if cfg.model_type == "opt" and group.producer == "fc1" and getattr(cfg, "activation_function", "relu") != "relu":
        return False  # only ReLU commutes with a positive per-channel scale
    return True


def smoothing_groups(model: nn.Module, linear_inputs: bool = False) -> list[tuple[str, nn.Module, ScaleGroup]]:
    """(full name of the group's first consumer, block, group) for the table groups of every block:
    those fed by a norm, plus with linear_inputs those fed by a linear (see ScaleGroup.input_from).

    Raises the arch_for error (listing supported model types) for unknown architectures.
    """
    groups = [g for g in arch_for(model, "smoothquant")["groups"] if linear_inputs or g.input_from == "norm"]
    names = {id(m): n for n, m in model.named_modules()}
    return [
        (f"{names[id(block)]}.{g.consumers[0]}", block, g)
        for block in find_blocks(model) for g in groups if _foldable(model, g)
    ]


def collect_smoothing_stats(model: nn.Module, batches, sample_rows: int = 0, seed: int = 0,
                            progress: bool = True, linear_inputs: bool = False) -> dict[str, SmoothStats]:
    """One calibration loop observing the input of each group smoothing_groups(model, linear_inputs)
    gives; keyed by the first consumer's name. Export with observers.export_stats(result).
    """
    modules = {name: block.get_submodule(g.consumers[0]) for name, block, g in smoothing_groups(model, linear_inputs)}
    stats, remove = attach_input_observers(modules, lambda name: SmoothStats(sample_rows, seed, name))
    try:
        run_calibration(model, batches, desc="smoothquant statistics", progress=progress)
    finally:
        remove()
    return stats


def smoothing_scale(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s = max|X|^α / max|W|^(1-α) per input channel (C,), max|W| over all consumers' columns.

    >>> s = smoothing_scale(x.abs().amax(0), [q.weight, k.weight, v.weight], alpha=0.5)
    """
    w_absmax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)  # (C,)
    lo = SCALE_CLAMP[0]
    s = act_absmax.float().clamp(min=lo).pow(alpha) / w_absmax.clamp(min=lo).pow(1 - alpha)
    return s.clamp(*SCALE_CLAMP)


Quantizer = Callable[[torch.Tensor], torch.Tensor]


def output_error(
    x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor,
    act_fq: Quantizer, weight_fq: Quantizer | Sequence[Quantizer | None],
) -> float:
    """Relative error of the smoothed, quantized consumers: Σ|XWᵀ - Q(X/s) Q(W·s)ᵀ|² / Σ|XWᵀ|².

    weight_fq: one fake-quantizer for every consumer, or one per consumer (None: the consumer is not
    quantized, weights nor input; it contributes its float round-off).
    """
    fqs = list(weight_fq) if isinstance(weight_fq, (list, tuple)) else [weight_fq] * len(weights)
    if len(fqs) != len(weights):
        raise ValueError(f"output_error: {len(fqs)} weight quantizers for {len(weights)} consumers")
    xs = x / s
    xq = act_fq(xs) if any(fq is not None for fq in fqs) else None  # (n, C)
    num = den = 0.0
    for w, fq in zip(weights, fqs):
        w = w.detach().float()
        ref = x @ w.t()  # (n, out)
        out = xs @ (w * s).t() if fq is None else xq @ fq(w * s).t()
        num += float((ref - out).pow(2).sum())
        den += float(ref.pow(2).sum())
    return num / max(den, torch.finfo(torch.float32).tiny)


def search_alpha(
    x: torch.Tensor, act_absmax: torch.Tensor, weights: list[torch.Tensor],
    act_fq: Quantizer, weight_fq: Quantizer | Sequence[Quantizer | None], grid: tuple[float, ...] = ALPHA_GRID,
) -> tuple[float, list[float]]:
    """(the α of `grid` with the smallest output_error, the error of every α)."""
    errors = [output_error(x, weights, smoothing_scale(act_absmax, weights, a), act_fq, weight_fq) for a in grid]
    best = min(range(len(grid)), key=errors.__getitem__)
    return grid[best], errors


def consumer_grid(base: Any, name: str) -> WeightSpec | None:
    """The weight grid the activation config `base` gives the linear `name` (its weight base's overrides
    applied), or None where the weight base does not select it (it stays float).

    >>> base = make_config({"method": "dynamic", "base": {"method": "rtn", "bits": 4}})
    >>> consumer_grid(base, "model.layers.0.mlp.up_proj")
    WeightSpec(bits=4, group_size=None, symmetric=True, scale_dtype='float16')
    """
    weights = base.base
    if get_method(weights).name not in SUPPORTED_WEIGHT_BASES:  # SmoothQuantConfig rejects these first
        raise ValueError(f"smoothquant: cannot simulate weight base {get_method(weights).name!r}; "
                         f"supported: {', '.join(SUPPORTED_WEIGHT_BASES)}")
    return weights.spec_for(name) if weights.selection.matches(name) else None


def weight_quantizer(spec: WeightSpec | None) -> Quantizer | None:
    """Round-to-nearest fake-quantizer on `spec`'s grid (None stays None: float)."""
    if spec is None:
        return None
    return lambda w: spec.fake_quantize(w, spec.qparams(w), ste=False)


def act_quantizer(base: Any) -> Quantizer:
    """The activation fake-quantizer of an activation config, for the α search."""
    if hasattr(base, "act_granularity"):  # static: a min-max range of the sample itself
        def act_fq(x):
            lo, hi = (x.amin(0), x.amax(0)) if base.act_granularity == "channel" else (x.amin(), x.amax())
            return StaticActQuant.from_range(lo, hi, base.act_bits, base.act_symmetric, base.act_format)(x)
        return act_fq
    return DynamicActQuant(base.act_bits, base.act_symmetric, base.act_format)


@torch.no_grad()
def smooth(model: nn.Module, stats: dict[str, SmoothStats], alpha: Any, base: Any = None,
           linear_inputs: bool = False) -> dict[str, float]:
    """Apply SmoothQuant scales to every group of smoothing_groups(model, linear_inputs) that fits its
    block; returns {first consumer: α used}.

    alpha = "search" needs stats collected with sample_rows > 0 and the activation config `base`.
    """
    if alpha == "search" and base is None:
        raise ValueError("alpha='search' needs the activation config (base) to simulate")
    act_fq = act_quantizer(base) if alpha == "search" else None
    chosen = {}
    for name, block, group in smoothing_groups(model, linear_inputs):
        if not group_applies(block, group):
            continue
        _, consumers = group_modules(block, group)
        weights = [c.weight for c in consumers]
        act_absmax = stats[name].compute().to(weights[0].device)
        a = alpha
        if alpha == "search":
            if stats[name].samples is None:
                raise ValueError(f"alpha='search' needs sampled rows; collect stats of {name} with sample_rows > 0")
            prefix = name.removesuffix(group.consumers[0])  # the block's name and a dot
            weight_fqs = [weight_quantizer(consumer_grid(base, prefix + c)) for c in group.consumers]
            a, _ = search_alpha(stats[name].samples.to(weights[0].device), act_absmax, weights, act_fq, weight_fqs)
        apply_scale(block, group, smoothing_scale(act_absmax, weights, a))
        chosen[name] = a
    return chosen


def diagnostics(chosen: dict[str, float], searched: bool) -> dict[str, Any]:
    """The result row's smoothquant_* entries from smooth()'s {group: α}."""
    out: dict[str, Any] = {"smoothquant_groups": len(chosen)}
    if chosen:
        alphas = list(chosen.values())
        out["smoothquant_alpha_mean"] = sum(alphas) / len(alphas)
        if searched:
            out["smoothquant_alpha_min"], out["smoothquant_alpha_max"] = min(alphas), max(alphas)
    return out


@register_method
class SmoothQuant(Method):
    name = "smoothquant"
    config_cls = SmoothQuantConfig
    needs_calibration = True
    quantizes_activations = True
    version = 2  # default smooths only norm -> linear groups (the paper); v1 also smoothed linear -> linear

    def folds_channel_scales(self, config: SmoothQuantConfig) -> bool:
        return True

    def folds_scales_across_mlp(self, config: SmoothQuantConfig) -> bool:
        return config.smooth_linear_inputs  # up_proj -> down_proj is one of the linear -> linear pairs

    def prepare(self, model, config: SmoothQuantConfig) -> None:
        smoothing_groups(model)  # fail before any data is read for unsupported architectures
        linearize_conv1d(model)  # GPT-2's Conv1D: statistics and folding address nn.Linear columns

    def calibrate(self, model, config: SmoothQuantConfig, batches, progress: bool = True) -> dict | None:
        batches = batches if isinstance(batches, (list, tuple)) else list(batches)
        search, linear_inputs = config.alpha == "search", config.smooth_linear_inputs
        stats = collect_smoothing_stats(model, batches, SEARCH_ROWS if search else 0, progress=progress,
                                        linear_inputs=linear_inputs)  # float model
        base_method = get_method(config.base)
        base_method.prepare(model, config.base)  # explicit groups (BERT) need the QuantLinear consumers
        chosen = smooth(model, stats, config.alpha, config.base, linear_inputs)
        row = diagnostics(chosen, search)
        log.info("smoothquant: %d groups smoothed (%s); alpha %s", len(chosen),
                 "norm and linear inputs" if linear_inputs else "norm inputs",
                 f"searched, mean {row.get('smoothquant_alpha_mean', float('nan')):.2f}" if search else config.alpha)
        if needs_calibration(config.base):
            row.update(base_method.calibrate(model, config.base, batches, progress) or {})
        return row

    def convert(self, model, config: SmoothQuantConfig) -> None:
        if not quant_linears(model):
            raise ValueError("smoothquant: calibrate() must run before convert() (it prepares the base method)")
        get_method(config.base).convert(model, config.base)
