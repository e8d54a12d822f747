"""Weight range search: the clip ratio per group that minimises the (importance-weighted) rounding error.

Ported from llm-compressor 0.14's weight observers (`observers/mse_quant.py` `_grid_search_mse`, "mse";
`observers/imatrix.py` `_grid_search`, "imatrix_mse"). For every group of a weight (out, in) they try the range
p·[min, max] for p = 1, 1 - 1/grid, 1 - 2/grid, ... and keep, per group, the p whose grid gives the lowest

    err(p) = Σ_j imp_j · |w_j - q_p(w_j)|^norm        (imp_j = 1: "mse"; the mean x² of input column j: "imatrix_mse")

The search stops once `patience` steps in a row improved no group. imatrix_mse normalises imp by its mean over
the layer's columns first (as the reference: it does not change the argmin, only the float sums). The ranges
then go through quantlab's own min-max rule (primitives.qparams_from_range: the asymmetric range includes 0,
symmetric scale amax / (2^(b-1)-1)), so p = 1 is exactly rtn's grid and a searched grid is never worse than rtn
on the error it minimises. Integer grids only (number formats and llama.cpp types have their own searches).

>>> p = search_qparams(w, WeightSpec(4, 64, False), CLIP_SEARCHES["imatrix_mse"], importance=x2_mean)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..util.checks import check_int
from .primitives import QParams, fake_quantize, grouped, qparams_from_range


@dataclass(frozen=True)
class ClipSearch:
    """One search's settings: max_shrink (the smallest ratio tried is about 1 - max_shrink), grid (ratio step
    1/grid), norm (error exponent), patience (steps without any group improving before it stops; 0: never),
    inclusive (the reference's imatrix search also tries the last ratio, its mse search does not)."""

    max_shrink: float
    grid: int
    norm: float
    patience: int
    inclusive: bool

    def __post_init__(self):
        if isinstance(self.max_shrink, bool) or not 0 <= self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink!r}")
        check_int("grid", self.grid, 1)
        check_int("patience", self.patience, 0)
        if isinstance(self.norm, bool) or not isinstance(self.norm, (int, float)) or not self.norm > 0:
            raise ValueError(f"norm must be a number > 0, got {self.norm!r}")

    def ratios(self) -> list[float]:
        """The clip ratios tried, in order (the reference's p = 1 - i / grid)."""
        steps = int(self.max_shrink * self.grid)
        steps = max(1, steps) + 1 if self.inclusive else steps
        return [1 - i / self.grid for i in range(max(steps, 1))]


# the references' defaults: llm-compressor MemorylessMSEObserver (maxshrink 0.20, grid 100, norm 2.4, patience 5)
# and IMatrixMSEObserver (maxshrink 0.95, grid 20, norm 3.0, patience 5)
CLIP_SEARCHES = {
    "mse": ClipSearch(0.20, 100, 2.4, 5, inclusive=False),
    "imatrix_mse": ClipSearch(0.95, 20, 3.0, 5, inclusive=True),
}
WEIGHT_OBSERVERS = ("minmax", *CLIP_SEARCHES)  # what `observer = ...` on rtn / gptq names


def normalized_importance(importance: torch.Tensor) -> torch.Tensor:
    """imp / mean(imp), as the reference (float32); fails on negative, non-finite or all-zero importance."""
    imp = importance.detach().float()
    if not torch.isfinite(imp).all() or (imp < 0).any() or not (imp > 0).any():
        raise ValueError("importance must be finite, >= 0 and not all zero (mean x² of each input column)")
    return imp / (imp.mean() + torch.finfo(torch.float32).tiny)


@torch.no_grad()
def search_range(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool, search: ClipSearch,
                 importance: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per group of w (..., K) -> (..., n_groups): the clipped range with the lowest error.

    importance (K,): weights of the error per column, already normalised (normalized_importance) or None.
    Pure; groups are searched together, each keeping its own best ratio."""
    w = w.detach().float()
    wg = grouped(w, group_size)  # (..., n_groups, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    best_err = torch.full_like(lo, torch.finfo(torch.float32).max)
    best_lo, best_hi = lo.clone(), hi.clone()
    stale = 0
    for p in search.ratios():
        lo_p, hi_p = p * lo, p * hi
        q = fake_quantize(w, qparams_from_range(lo_p, hi_p, bits, symmetric, scale_dtype), bits, group_size, ste=False)
        err = q.sub_(w).abs_().pow_(search.norm)
        if importance is not None:
            err.mul_(importance.float())
        err = grouped(err, group_size).sum(-1)  # (..., n_groups); a ragged tail's padding adds 0
        better = err < best_err
        if better.any():
            best_err[better], best_lo[better], best_hi[better] = err[better], lo_p[better], hi_p[better]
            stale = 0
        else:
            stale += 1
            if search.patience and stale >= search.patience:
                break
    return best_lo, best_hi


def search_qparams(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool, search: ClipSearch,
                   importance: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float16) -> QParams:
    """The qparams of search_range's ranges (quantlab's min-max rule on them).

    >>> p = search_qparams(w, 4, 64, False, CLIP_SEARCHES["mse"])   # p.scale: (out, in // 64)
    """
    lo, hi = search_range(w, bits, group_size, symmetric, search, importance, scale_dtype)
    return qparams_from_range(lo, hi, bits, symmetric, scale_dtype)
