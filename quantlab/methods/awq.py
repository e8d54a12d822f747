"""`awq`: activation-aware weight quantization (Lin et al. 2023) on an `rtn` base config.

Per block, for each smoothing group of the architecture table (linears sharing one
input X, fed by a producer): try s = mean|X|^α for α in {0, 1/n, ..., (n-1)/n}, keep
the s minimising Σ_consumers ‖W X − Q(W·diag s)(X / s)‖², and fold it into producer
and consumers (smoothing.apply_scale; the float function is unchanged). Then, per
quantized linear, shrink each (row, group) range by the ratio that minimises that
group's output error (AWQ's auto_clip) and pin it as the layer's fixed qparams.
α = 0 is plain RTN, so the loss on the calibration data is never worse than RTN's.

Losses use the inputs' Gram matrix G ∝ XᵀX: ‖ΔW X‖² = Σ (ΔW G) ∘ ΔW. Every calibration
token counts, memory is (C, C) per input whatever the token count, and a grid point
costs out·C² flops instead of out·C·tokens.

Blocks are walked in order (blocks.for_each_block), so each block's inputs come from
the already-quantized blocks before it; inside a block the statistics are taken with
float weights, as in the AWQ reference, and stay valid while scales are folded.

>>> cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 64}})
>>> calib = [w[None] for w in quantlab.calibration_windows(val_ids, 16, 512, seed=0)]  # (1, T) each
>>> quantlab.quantize(model, cfg, calibration=calib)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..core.checks import check_int
from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.observers import HessianObserver, MeanAbsObserver
from ..core.primitives import QParams, _grouped, fake_quantize, n_groups, qparams_from_range
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import Method, as_config, get_method, register_method
from ..models.arch import ScaleGroup, arch_for
from .blocks import float_weights, for_each_block, run_block
from .rtn import RTNConfig
from .smoothing import apply_scale, group_applies


@dataclass(frozen=True)
class AWQConfig:
    """base: the rtn config giving bits / group_size / symmetric / scale_dtype / include / exclude
    (a dict such as {"method": "rtn", "bits": 4, "group_size": 64} is accepted).
    n_grid: α in {0, 1/n_grid, ..., (n_grid-1)/n_grid}. clip_search: also search clip ratios
    {1, 1 - 1/clip_grid, ...} down to 1 - clip_max_shrink per (output row, group).
    """

    base: RTNConfig = RTNConfig(bits=4, group_size=64)
    n_grid: int = 20
    clip_search: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5

    def __post_init__(self):
        try:
            base = as_config(self.base, "base")
        except KeyError:
            raise ValueError(f"base must be an rtn config or a dict with method 'rtn', got {self.base!r}") from None
        if not isinstance(base, RTNConfig) or get_method(base).name != "rtn":
            name = get_method(base).name
            raise ValueError(f"base must be a weight-only rtn config (method 'rtn'), got method {name!r}")
        object.__setattr__(self, "base", base)
        check_int("n_grid", self.n_grid, 1, 1000)
        check_int("clip_grid", self.clip_grid, 1, 1000)
        if not isinstance(self.clip_search, bool):
            raise ValueError(f"clip_search must be true or false, got {self.clip_search!r}")
        if isinstance(self.clip_max_shrink, bool) or not isinstance(self.clip_max_shrink, (int, float)) \
                or not 0 <= self.clip_max_shrink < 1:
            raise ValueError(f"clip_max_shrink must be a number in [0, 1), got {self.clip_max_shrink!r}")

    @property
    def clip_ratios(self) -> list[float]:
        """Range multipliers tried by the clip search; the first is 1 (min-max)."""
        steps = math.floor(self.clip_max_shrink * self.clip_grid + 1e-9)
        return [1 - i / self.clip_grid for i in range(steps + 1)]


# ---- pure numerics -------------------------------------------------------------------------

def awq_scale(x_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|X|^α per input channel, floored at 1e-4 (dead channels) and normalised so
    max(s)·min(s) = 1, as the AWQ reference. alpha = 0 gives s = 1 exactly."""
    s = x_mean_abs.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def output_sq_error(delta_w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖ΔW X‖² from G = XᵀX (a positive factor on G carries over): Σ_ij (ΔW G)_ij ΔW_ij.

    ΔW (out, C), G (C, C). >>> output_sq_error(w - q, x.T @ x)  # == ((x @ (w - q).T) ** 2).sum()
    """
    return ((delta_w @ gram) * delta_w).sum()


def fake_quant_weight(w: torch.Tensor, spec: WeightSpec, p: QParams | None = None) -> torch.Tensor:
    """Q(w) on the spec's grid with min-max qparams, or `p` when given."""
    return fake_quantize(w, spec.qparams(w) if p is None else p, spec.bits, spec.group_size, ste=False)


def scaled_error(weights: list[torch.Tensor], gram: torch.Tensor, s: torch.Tensor,
                 spec: WeightSpec | list[WeightSpec]) -> torch.Tensor:
    """Σ_c ‖W_c X − Q(W_c·diag s)(X / s)‖², via the Gram matrix of the consumers' shared input X.

    spec: one grid for every consumer, or one per consumer (per-layer overrides)."""
    specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(weights)
    total = torch.zeros((), device=gram.device)
    for w, spec in zip(weights, specs):
        w = w.detach().float()
        total = total + output_sq_error(w - fake_quant_weight(w * s, spec) / s, gram)
    return total


def search_scale(
    weights: list[torch.Tensor], x_mean_abs: torch.Tensor, gram: torch.Tensor, spec: WeightSpec | list[WeightSpec],
    n_grid: int = 20,
) -> tuple[torch.Tensor, float, list[float]]:
    """Best smoothing scale over α in {0, 1/n_grid, ...}: (s (C,), α, loss per α). Ties keep the smaller α.

    >>> s, alpha, losses = search_scale([q.weight, k.weight], x.abs().mean(0), x.T @ x, WeightSpec(4, 64))
    """
    best_loss, best_alpha, best_s, losses = math.inf, None, None, []
    for k in range(n_grid):
        s = awq_scale(x_mean_abs, k / n_grid)
        loss = float(scaled_error(weights, gram, s, spec))
        losses.append(loss)
        if loss < best_loss:
            best_loss, best_alpha, best_s = loss, k / n_grid, s
    if best_s is None:
        raise ValueError(f"no finite loss on the α grid (losses {losses[:3]}...): NaN/Inf weights or inputs")
    return best_s, best_alpha, losses


def _diagonal_blocks(gram: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(C, C) -> (n_groups, g, g): the Gram's blocks for each input group, the ragged tail zero-padded."""
    k = gram.shape[0]
    g = k if group_size is None else group_size
    ng = n_groups(k, group_size)
    padded = nn.functional.pad(gram, (0, ng * g - k, 0, ng * g - k)).view(ng, g, ng, g)
    idx = torch.arange(ng, device=gram.device)
    return padded[idx, :, idx, :]


def search_clip(w: torch.Tensor, gram: torch.Tensor, spec: WeightSpec, ratios: list[float]) -> QParams | None:
    """Per-(row, group) range shrink minimising that group's part of ‖(W − Q(W)) X‖² (AWQ's auto_clip).

    Returns the clipped qparams, or None (min-max) when no group shrinks or when the full
    output error, cross-group terms included, would not improve on min-max.
    """
    w = w.detach().float()
    wg = _grouped(w, spec.group_size)  # (out, n_groups, g)
    xmin, xmax = wg.amin(-1), wg.amax(-1)
    blocks = _diagonal_blocks(gram.float(), spec.group_size)  # (n_groups, g, g)

    def clipped(ratio) -> QParams:
        return qparams_from_range(xmin * ratio, xmax * ratio, spec.bits, spec.symmetric, spec.torch_scale_dtype)

    best_err, best_ratio = torch.full_like(xmin, math.inf), torch.ones_like(xmin)
    for ratio in ratios:
        delta = _grouped(w - fake_quant_weight(w, spec, clipped(ratio)), spec.group_size).transpose(0, 1)
        err = (torch.bmm(delta, blocks) * delta).sum(-1).transpose(0, 1)  # (out, n_groups)
        better = err < best_err
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    if bool((best_ratio == 1).all()):
        return None
    p = clipped(best_ratio)
    full_clipped = output_sq_error(w - fake_quant_weight(w, spec, p), gram)
    return p if full_clipped <= output_sq_error(w - fake_quant_weight(w, spec), gram) else None


# ---- one block -----------------------------------------------------------------------------

def _input_stats(block, layers, owners, inputs, kwargs, prefix) -> dict[str, tuple[HessianObserver, MeanAbsObserver]]:
    """Gram and mean|x| of each distinct linear input of the block, from one float forward."""
    stats = {name: (HessianObserver(), MeanAbsObserver()) for name in dict.fromkeys(owners.values())}

    def observe(module, args, name):
        x = args[0] if module.input_scale is None else args[0] / module.input_scale.to(args[0].dtype)
        if not torch.isfinite(x).all():
            raise ValueError(f"awq: NaN/Inf in the input activations of {prefix}{name}")
        for obs in stats[name]:
            obs.update(x)

    handles = [layers[n].register_forward_pre_hook(lambda m, a, n=n: observe(m, a, n)) for n in stats]
    try:
        with float_weights(layers):
            run_block(block, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def awq_block(
    block: nn.Module, groups: tuple[ScaleGroup, ...], inputs: list[torch.Tensor], kwargs: list[dict],
    config: AWQConfig, prefix: str = "",
) -> dict[str, float]:
    """AWQ on one block in place: fold the best scale of each usable group, then (optionally) pin clipped
    qparams on every prepared QuantLinear. Returns the chosen α by group (its first consumer's name).

    Statistics come from one pass with float weights; they stay valid while scales are folded,
    since folding leaves the float function unchanged (a group's own input becomes X / s).
    """
    layers = {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear) and not m.frozen}
    usable = [g for g in groups if all(c in layers for c in g.consumers) and group_applies(block, g)]
    owners = {n: n for n in layers}  # a group's consumers share one input: one set of statistics
    for g in usable:
        owners.update({c: g.consumers[0] for c in g.consumers})
    stats = _input_stats(block, layers, owners, inputs, kwargs, prefix)
    grams = {n: gram_obs.compute(prefix + n) for n, (gram_obs, _) in stats.items()}

    alphas, divisors = {}, {}
    for g in usable:
        key, consumers = g.consumers[0], [layers[c] for c in g.consumers]
        x_mean_abs = stats[key][1].compute(prefix + key)
        s, alpha, _ = search_scale([c.weight for c in consumers], x_mean_abs, grams[key], [c.spec for c in consumers],
                                   config.n_grid)
        apply_scale(block, g, s)
        alphas[prefix + key] = alpha
        divisors.update({c: s for c in g.consumers})

    if config.clip_search:  # after every fold: a linear producer's rows change when a later group is scaled
        for name, layer in layers.items():
            gram = grams[owners[name]]
            if name in divisors:  # the input is now X / s
                gram = gram / torch.outer(divisors[name], divisors[name])
            layer.fixed_qparams = search_clip(layer.weight, gram, layer.spec, config.clip_ratios)
    return alphas


@register_method
class AWQ(Method):
    name = "awq"
    config_cls = AWQConfig
    needs_calibration = True

    def prepare(self, model, config: AWQConfig) -> None:
        arch_for(model)  # an unknown model_type fails before the model is touched
        swap_in_quant_linears(model, config.base.selection, config.base.weight_spec, config.base.overrides)

    def calibrate(self, model, config: AWQConfig, batches, progress: bool = True) -> dict:
        groups = arch_for(model)["groups"]
        batches = list(batches)
        tokens = sum(b.numel() for b in batches)
        if tokens == 0:
            raise ValueError(f"awq needs calibration tokens; got {len(batches)} batches holding {tokens} tokens")
        names = {id(m): n for n, m in model.named_modules()}

        def process(index, block, inputs, kwargs):
            awq_block(block, groups, inputs, kwargs, config, prefix=f"{names[id(block)]}.")

        for_each_block(model, batches, process, desc="awq", progress=progress)
        return {}

    def convert(self, model, config: AWQConfig) -> None:
        freeze_all(model)
