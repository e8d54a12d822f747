"""`smoothquant`: SmoothQuant (Xiao et al. 2022), then an activation-quantization base method.

Per-channel activation outliers are migrated into the weights: for each smoothing group
of the architecture table (a producer feeding consumer linears),
    s_c = max|X_c|^α / max|W_:,c|^(1-α)      (max|W| over every consumer's column c)
and smoothing.apply_scale folds s into producer and consumers (float function unchanged).
max|X| comes from the FLOAT model: the statistics pass runs before the base's prepare.

alpha = "search": each group independently (per group, not one global α) takes the α of
ALPHA_GRID minimizing its consumers' relative output error |XWᵀ - Q(X/s) Q(W·s)ᵀ|² / |XWᵀ|²
on a random sample of SEARCH_ROWS calibration tokens, with the base's weight grid and its
activation quantizer (dynamic per token, or static min-max of the sample for a static base).
Groups are processed in table order, each on the weights left by the previous ones.

calibrate() iterates the calibration batches more than once (statistics, then the base);
a one-shot iterator is first turned into a list.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.lifecycle import quant_linears, run_calibration
from ..core.observers import SmoothStats, attach_input_observers
from ..core.primitives import fake_quantize
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
from .smoothing import apply_scale, group_applies, group_modules

log = logging.getLogger(__name__)

ALPHA_GRID = tuple(i / 10 for i in range(11))  # 0.0, 0.1, ..., 1.0
SEARCH_ROWS = 256  # calibration tokens kept per group for alpha = "search"
SCALE_CLAMP = (1e-5, 1e5)  # s stays finite and > 0 for dead channels / zero weight columns


@dataclass(frozen=True)
class SmoothQuantConfig:
    """alpha in [0, 1] (migration strength) or "search"; base: an activation config (default W8A8 dynamic)."""

    alpha: Any = 0.5
    base: Any = DynamicConfig()

    def __post_init__(self):
        a = self.alpha
        if a != "search":
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
                raise ValueError(f"alpha must be a number in [0, 1] or 'search', got {a!r}")
            object.__setattr__(self, "alpha", float(a))
        base = as_config(self.base, "base")
        method = get_method(base)
        if method.name == "smoothquant" or not quantizes_activations(method):
            valid = [m for m in known_methods() if m != "smoothquant" and quantizes_activations(get_method(m))]
            raise ValueError(f"smoothquant: base must be an activation method ({', '.join(valid)}), got {method.name!r}")
        object.__setattr__(self, "base", base)


def _foldable(model: nn.Module, group: ScaleGroup) -> bool:
    """Architecture variants the table does not describe, where folding would change the function."""
    cfg = model.config
    if cfg.model_type == "opt" and group.kind == "norm" and not getattr(cfg, "do_layer_norm_before", True):
        return False  # post-LN OPT (350m): these norms act after the residual add, their output is the residual
    if cfg.model_type == "opt" and group.producer == "fc1" and getattr(cfg, "activation_function", "relu") != "relu":
        return False  # only ReLU commutes with a positive per-channel scale
    return True


def smoothing_groups(model: nn.Module) -> list[tuple[str, nn.Module, ScaleGroup]]:
    """(full name of the group's first consumer, block, group) for every table group of every block.

    Raises the arch_for error (listing supported model types) for unknown architectures.
    """
    groups = arch_for(model)["groups"]
    names = {id(m): n for n, m in model.named_modules()}
    return [
        (f"{names[id(block)]}.{g.consumers[0]}", block, g)
        for block in find_blocks(model) for g in groups if _foldable(model, g)
    ]


def collect_smoothing_stats(model: nn.Module, batches, sample_rows: int = 0, seed: int = 0,
                            progress: bool = True) -> dict[str, SmoothStats]:
    """One calibration loop observing each group's input; keyed by the first consumer's name.

    Export with observers.export_stats(result).
    """
    modules = {name: block.get_submodule(g.consumers[0]) for name, block, g in smoothing_groups(model)}
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


def output_error(
    x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor,
    act_fq: Callable[[torch.Tensor], torch.Tensor], weight_fq: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """Relative error of the smoothed, quantized consumers: Σ|XWᵀ - Q(X/s) Q(W·s)ᵀ|² / Σ|XWᵀ|²."""
    xq = act_fq(x / s)  # (n, C)
    num = den = 0.0
    for w in weights:
        w = w.detach().float()
        ref = x @ w.t()  # (n, out)
        num += float((ref - xq @ weight_fq(w * s).t()).pow(2).sum())
        den += float(ref.pow(2).sum())
    return num / max(den, torch.finfo(torch.float32).tiny)


def search_alpha(
    x: torch.Tensor, act_absmax: torch.Tensor, weights: list[torch.Tensor],
    act_fq: Callable, weight_fq: Callable, grid: tuple[float, ...] = ALPHA_GRID,
) -> tuple[float, list[float]]:
    """(the α of `grid` with the smallest output_error, the error of every α)."""
    errors = [output_error(x, weights, smoothing_scale(act_absmax, weights, a), act_fq, weight_fq) for a in grid]
    best = min(range(len(grid)), key=errors.__getitem__)
    return grid[best], errors


def base_quantizers(base: Any) -> tuple[Callable, Callable]:
    """(activation, weight) fake-quantizers simulating an activation config for the α search."""
    wb = base.base
    spec = getattr(wb, "weight_spec", None) or WeightSpec(
        getattr(wb, "bits", 8), getattr(wb, "group_size", None), getattr(wb, "symmetric", True))

    def weight_fq(w):
        return fake_quantize(w, spec.qparams(w), spec.bits, spec.group_size, ste=False)

    if hasattr(base, "act_granularity"):  # static: a min-max range of the sample itself
        def act_fq(x):
            lo, hi = (x.amin(0), x.amax(0)) if base.act_granularity == "channel" else (x.amin(), x.amax())
            return StaticActQuant.from_range(lo, hi, base.act_bits, base.act_symmetric)(x)
        return act_fq, weight_fq
    return DynamicActQuant(base.act_bits, base.act_symmetric), weight_fq


@torch.no_grad()
def smooth(model: nn.Module, stats: dict[str, SmoothStats], alpha: Any, base: Any = None) -> dict[str, float]:
    """Apply SmoothQuant scales to every group that fits its block; returns {first consumer: α used}.

    alpha = "search" needs stats collected with sample_rows > 0 and the activation config `base`.
    """
    if alpha == "search" and base is None:
        raise ValueError("alpha='search' needs the activation config (base) to simulate")
    quantizers = base_quantizers(base) if alpha == "search" else None
    chosen = {}
    for name, block, group in smoothing_groups(model):
        if not group_applies(block, group):
            continue
        _, consumers = group_modules(block, group)
        weights = [c.weight for c in consumers]
        act_absmax = stats[name].compute().to(weights[0].device)
        a = alpha
        if alpha == "search":
            if stats[name].samples is None:
                raise ValueError(f"alpha='search' needs sampled rows; collect stats of {name} with sample_rows > 0")
            a, _ = search_alpha(stats[name].samples.to(weights[0].device), act_absmax, weights, *quantizers)
        apply_scale(block, group, smoothing_scale(act_absmax, weights, a))
        chosen[name] = a
    return chosen


@register_method
class SmoothQuant(Method):
    name = "smoothquant"
    config_cls = SmoothQuantConfig
    needs_calibration = True
    quantizes_activations = True

    def prepare(self, model, config: SmoothQuantConfig) -> None:
        smoothing_groups(model)  # fail before any data is read for unsupported architectures

    def calibrate(self, model, config: SmoothQuantConfig, batches, progress: bool = True) -> dict | None:
        batches = batches if isinstance(batches, (list, tuple)) else list(batches)
        search = config.alpha == "search"
        stats = collect_smoothing_stats(model, batches, SEARCH_ROWS if search else 0, progress=progress)  # float
        base_method = get_method(config.base)
        base_method.prepare(model, config.base)  # explicit groups (BERT) need the QuantLinear consumers
        chosen = smooth(model, stats, config.alpha, config.base)
        log.info("smoothquant: %d groups smoothed; alpha %s", len(chosen),
                 f"searched, mean {sum(chosen.values()) / max(len(chosen), 1):.2f}" if search else config.alpha)
        if needs_calibration(config.base):
            return base_method.calibrate(model, config.base, batches, progress)
        return None

    def convert(self, model, config: SmoothQuantConfig) -> None:
        if not quant_linears(model):
            raise ValueError("smoothquant: calibrate() must run before convert() (it prepares the base method)")
        get_method(config.base).convert(model, config.base)
