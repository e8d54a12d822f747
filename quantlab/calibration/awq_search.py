"""AWQ's searches as pure functions over tensors (quantlab.methods.awq runs them on a model).

- awq_scale: the smoothing scale s = mean|X|^α, normalised (llm-awq auto_scale).
- search_clip_symmetric: per (row, group) the clip ratio r of llm-awq auto_clip_layer: W clamped to
  ±max|w|·r, quantized with min-max qparams of the clamped group, judged by that group's output error.
- search_scale / scaled_error / search_clip: quantlab's AWQ before version 2, kept as the variants
  scale_loss="linear" and clip="minmax" (see AWQConfig).

Output errors use the inputs' Gram matrix G ∝ XᵀX: ‖ΔW X‖² = Σ (ΔW G) ∘ ΔW, so every calibration
token counts at (C, C) memory whatever the token count.

>>> r = search_clip_symmetric(w, x.T @ x, WeightSpec(4, 64), reference_clip_ratios(20, 0.5))  # (out, n_groups)
>>> w_clipped = clamp_symmetric(w, r, 64)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..core.primitives import QParams, grouped, n_groups, qparams_from_range, ungrouped
from ..core.qlinear import WeightSpec


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
    return spec.fake_quantize(w, spec.qparams(w) if p is None else p, ste=False)


def scaled_weight(w: torch.Tensor, s: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Q(W·diag s) / s in float32: what a consumer computes with on its unscaled input X during the α search."""
    return fake_quant_weight(w.detach().float() * s, spec) / s


# ---- scale_loss = "linear" (quantlab before version 2) --------------------------------------

def scaled_error(weights: list[torch.Tensor], gram: torch.Tensor, s: torch.Tensor,
                 spec: WeightSpec | list[WeightSpec]) -> torch.Tensor:
    """Σ_c ‖W_c X − Q(W_c·diag s)(X / s)‖², via the Gram matrix of the consumers' shared input X.

    spec: one grid for every consumer, or one per consumer (per-layer overrides)."""
    specs = spec if isinstance(spec, (list, tuple)) else [spec] * len(weights)
    total = torch.zeros((), device=gram.device)
    for w, grid in zip(weights, specs):
        w = w.detach().float()
        total = total + output_sq_error(w - fake_quant_weight(w * s, grid) / s, gram)
    return total


def search_scale(
    weights: list[torch.Tensor], x_mean_abs: torch.Tensor, gram: torch.Tensor, spec: WeightSpec | list[WeightSpec],
    n_grid: int = 20,
) -> tuple[torch.Tensor, float, list[float]]:
    """Best smoothing scale over α in {0, 1/n_grid, ...} by the summed linear output errors (scaled_error):
    (s (C,), α, loss per α). Ties keep the smaller α.

    >>> s, alpha, losses = search_scale([q.weight, k.weight], x.abs().mean(0), x.T @ x, WeightSpec(4, 64))
    """
    return best_alpha(lambda s: float(scaled_error(weights, gram, s, spec)), x_mean_abs, n_grid)


def best_alpha(loss_of, x_mean_abs: torch.Tensor, n_grid: int) -> tuple[torch.Tensor, float, list[float]]:
    """argmin over α in {0, 1/n_grid, ...} of loss_of(awq_scale(x_mean_abs, α)): (s, α, losses); ties keep the
    smaller α (strict <, as llm-awq)."""
    best_loss, best, best_s, losses = math.inf, None, None, []
    for k in range(n_grid):
        s = awq_scale(x_mean_abs, k / n_grid)
        loss = loss_of(s)
        losses.append(loss)
        if loss < best_loss:
            best_loss, best, best_s = loss, k / n_grid, s
    if best_s is None:
        raise ValueError(f"no finite loss on the α grid (losses {losses[:3]}...): NaN/Inf weights or inputs")
    return best_s, best, losses


# ---- clip searches ----------------------------------------------------------------------------

def reference_clip_ratios(clip_grid: int, max_shrink: float) -> list[float]:
    """llm-awq auto_clip_layer's grid: 1 - i/clip_grid for i in range(int(max_shrink·clip_grid)); 1 … 0.55 for 20, 0.5."""
    return [1 - i / clip_grid for i in range(int(max_shrink * clip_grid))]


def minmax_clip_ratios(clip_grid: int, max_shrink: float) -> list[float]:
    """quantlab before version 2 (clip="minmax"): the reference grid plus its end point 1 - max_shrink."""
    steps = math.floor(max_shrink * clip_grid + 1e-9)
    return [1 - i / clip_grid for i in range(steps + 1)]


def _diagonal_blocks(gram: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(C, C) -> (n_groups, g, g): the Gram's blocks for each input group, the ragged tail zero-padded."""
    k = gram.shape[0]
    g = k if group_size is None else group_size
    ng = n_groups(k, group_size)
    padded = nn.functional.pad(gram, (0, ng * g - k, 0, ng * g - k)).view(ng, g, ng, g)
    idx = torch.arange(ng, device=gram.device)
    return padded[idx, :, idx, :]


def group_errors(delta_w: torch.Tensor, blocks: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(out, n_groups): each (row, group)'s part of ‖ΔW X‖² without cross-group terms, i.e. the error of that
    group's partial output Σ_{j∈group} ΔW_j x_j (llm-awq's clip loss)."""
    delta = grouped(delta_w, group_size).transpose(0, 1)  # (n_groups, out, g)
    return (torch.bmm(delta, blocks) * delta).sum(-1).transpose(0, 1)


def clamp_symmetric(w: torch.Tensor, ratio: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """W clamped to ±max|w|·ratio per (row, group) (llm-awq apply_clip); ratio (out, n_groups). A new tensor."""
    wg = grouped(w, group_size)  # (out, n_groups, g)
    max_val = (wg.abs().amax(-1) * ratio).unsqueeze(-1)
    return ungrouped(torch.clamp(wg, -max_val, max_val), w.shape[-1])


def search_clip_symmetric(w: torch.Tensor, gram: torch.Tensor, spec: WeightSpec, ratios: list[float]) -> torch.Tensor:
    """The clip ratio per (row, group), (out, n_groups), minimising that group's output error
    ‖(W_g − Q(clamp(W_g, ±max|W_g|·r))) X_g‖² with min-max qparams of the clamped group (llm-awq
    auto_clip_layer). Ties keep the larger r (the grid starts at 1); an empty grid gives all ones.

    Difference from the reference: every calibration token counts (Gram blocks), where llm-awq
    subsamples 512 tokens.
    """
    w = w.detach().float()
    blocks = _diagonal_blocks(gram.float(), spec.group_size)  # (n_groups, g, g)
    shape = (w.shape[0], n_groups(w.shape[1], spec.group_size))
    best_err, best_ratio = torch.full(shape, math.inf, device=w.device), torch.ones(shape, device=w.device)
    for r in ratios:
        ratio = torch.full(shape, r, device=w.device)
        err = group_errors(w - fake_quant_weight(clamp_symmetric(w, ratio, spec.group_size), spec), blocks,
                           spec.group_size)
        better = err < best_err
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    return best_ratio


def search_clip_minmax(w: torch.Tensor, gram: torch.Tensor, spec: WeightSpec,
                       ratios: list[float]) -> tuple[QParams | None, torch.Tensor]:
    """quantlab before version 2 (clip="minmax"): per (row, group) shrink min and max by the same ratio;
    (qparams or None for min-max, the ratio in effect per (row, group)). None when no group shrinks or when
    the full output error, cross-group terms included, would not improve on min-max."""
    w = w.detach().float()
    wg = grouped(w, spec.group_size)  # (out, n_groups, g)
    xmin, xmax = wg.amin(-1), wg.amax(-1)
    blocks = _diagonal_blocks(gram.float(), spec.group_size)  # (n_groups, g, g)

    def clipped(ratio) -> QParams:
        return qparams_from_range(xmin * ratio, xmax * ratio, spec.bits, spec.symmetric, spec.torch_scale_dtype)

    best_err, best_ratio = torch.full_like(xmin, math.inf), torch.ones_like(xmin)
    for ratio in ratios:
        err = group_errors(w - fake_quant_weight(w, spec, clipped(ratio)), blocks, spec.group_size)
        better = err < best_err
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    ones = torch.ones_like(best_ratio)
    if bool((best_ratio == 1).all()):
        return None, ones
    p = clipped(best_ratio)
    full_clipped = output_sq_error(w - fake_quant_weight(w, spec, p), gram)
    if full_clipped <= output_sq_error(w - fake_quant_weight(w, spec), gram):
        return p, best_ratio
    return None, ones


def search_clip(w: torch.Tensor, gram: torch.Tensor, spec: WeightSpec, ratios: list[float]) -> QParams | None:
    """search_clip_minmax's qparams only (None: min-max)."""
    return search_clip_minmax(w, gram, spec, ratios)[0]
