"""Per-row lookup-table grids (any4 / any3 / any2: Elhoushi & Johnson, ICML 2025) — pure numerics.

A weight W (out, in) is normalised per group of `group_size` input columns by the group's own min and max
(asymmetric, the range not widened to hold 0: the reference's group_q, facebookresearch/any4 quantize.py:106-130):

    scale = (max - min) / (2^b - 1),  offset = min + 2^(b-1)·scale   (both rounded to the scale dtype, fp16)
    u     = (w - offset) / scale      in [-2^(b-1), 2^(b-1) - 1]

Each row's u are clustered into 2^b centroids by sample-weighted k-means (below): the row's table (LUT, rounded to
the scale dtype). A weight stores the index of its nearest table entry (ties: the lower index); dequantization is

    w_hat = lut[row, code] · scale + offset

which is tinygemm's any4 layout (modules.py Any4Linear: `lut` (out, 2^b), `scales_and_zeros`; the reference stores
its [0, 2^b - 1] table minus 2^(b-1), quantize.py:893, as here). Storage: b bits per weight, 2^b table values per
row and a scale + offset per group, all in the scale dtype.

The k-means is scikit-learn's KMeans (the reference's default cluster_row_scikit, quantize.py:406-418: init
"k-means++", n_init 1, max_iter 300, tol 1e-4, random_state 0), per row, in float64:
- init: greedy k-means++ (sklearn `_kmeans_plusplus`): the first centre drawn with probability ∝ sample weight, then
  each next one the best of 2 + ⌊ln k⌋ candidates drawn ∝ weight·D² (the lowest weighted potential);
- Lloyd: labels = nearest centre, centre = Σ w·u / Σ w over its members; a row stops when its labels repeat or its
  centres move less than tol × var(u) in total (sklearn `_tolerance`, squared shift).
Differences: the random numbers come from torch's generator seeded with `seed` (not numpy's RandomState(0)), and an
empty cluster (or one whose weights sum to 0) keeps its centre (for an empty one the reference's own kmeans.py:265-275
does so too) where sklearn moves it to a far point.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .primitives import QParams, grouped, n_groups, ungrouped

CHUNK = 1 << 24  # elements of the largest (rows, values, centres) temporary; rows are processed in chunks below it


def lut_scales(w: torch.Tensor, bits: int, group_size: int | None,
               scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of w (out, in): (scale, offset) (out, n_groups) in scale_dtype from the group's own min-max.

    A ragged last group takes the min-max of its own columns (padding replicates its last column).

    >>> s, o = lut_scales(torch.randn(8, 256), 4, 128)   # s, o: (8, 2) float16
    """
    x = w.detach().float()
    k = x.shape[-1]
    g = k if group_size is None else group_size
    pad = n_groups(k, group_size) * g - k
    if pad:
        x = F.pad(x.reshape(-1, 1, k), (0, pad), mode="replicate").reshape(*x.shape[:-1], k + pad)
    xg = x.reshape(*x.shape[:-1], -1, g)
    lo, hi = xg.amin(-1), xg.amax(-1)
    info = torch.finfo(scale_dtype)
    scale = ((hi - lo) / (2**bits - 1)).clamp(info.tiny, info.max).to(scale_dtype)
    offset = (lo + 2 ** (bits - 1) * scale.float()).clamp(-info.max, info.max).to(scale_dtype)
    return scale, offset


def lut_units(w: torch.Tensor, p: QParams, group_size: int | None) -> torch.Tensor:
    """w (out, in) in table units, (w - offset) / scale, float32."""
    u = (grouped(w.float(), group_size) - p.extra["offset"].float().unsqueeze(-1)) / p.scale.float().unsqueeze(-1)
    return ungrouped(u, w.shape[-1])


def nearest(u: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Index of each value's nearest centre, per row: u (R, N), centres (R, C) -> (R, N) int64 (ties: lower)."""
    out = torch.empty(u.shape, dtype=torch.long, device=u.device)
    step = max(1, CHUNK // max(1, u.shape[1] * centres.shape[1]))
    for r in range(0, u.shape[0], step):
        out[r:r + step] = (u[r:r + step, :, None] - centres[r:r + step, None, :]).abs().argmin(-1)
    return out


def _inverse_cdf(mass: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Indices drawn ∝ mass (R, N) from uniform draws (R, T): searchsorted(cumsum(mass), draw·Σ mass) (sklearn)."""
    cum = mass.cumsum(1)
    return torch.searchsorted(cum, (draws * cum[:, -1:]).contiguous()).clamp_(max=mass.shape[1] - 1)


def kmeanspp_init(x: torch.Tensor, weight: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """Greedy sample-weighted k-means++ per row (sklearn's `_kmeans_plusplus`): x, weight (R, N) -> centres (R, k).

    All random numbers are drawn up front (CPU generator seeded with `seed`), so the result does not depend on the
    row chunking or the device.

    >>> c = kmeanspp_init(torch.rand(4, 100, dtype=torch.float64), torch.ones(4, 100, dtype=torch.float64), 16)
    """
    rows, n = x.shape
    trials = 2 + int(math.log(k))
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(rows, 1 + (k - 1) * trials, generator=gen, dtype=torch.float64).to(x.device, x.dtype)
    centres = x.new_empty(rows, k)
    step = max(1, CHUNK // max(1, n * trials))
    for r in range(0, rows, step):
        xs, ws, ds = x[r:r + step], weight[r:r + step], draws[r:r + step]
        idx = torch.arange(xs.shape[0], device=x.device)
        centres[r:r + step, 0] = xs.gather(1, _inverse_cdf(ws, ds[:, :1]))[:, 0]
        closest = (xs - centres[r:r + step, :1]).square()  # (R, N): squared distance to the nearest centre so far
        for c in range(1, k):
            cand = xs.gather(1, _inverse_cdf(ws * closest, ds[:, 1 + (c - 1) * trials:1 + c * trials]))  # (R, T)
            dist = torch.minimum(closest[:, None, :], (xs[:, None, :] - cand[:, :, None]).square())  # (R, T, N)
            best = (ws[:, None, :] * dist).sum(-1).argmin(1)  # the candidate with the lowest weighted potential
            centres[r:r + step, c] = cand[idx, best]
            closest = dist[idx, best]
    return centres


def lloyd(x: torch.Tensor, weight: torch.Tensor, centres: torch.Tensor, iters: int = 300,
          tol: float = 1e-4) -> torch.Tensor:
    """Sample-weighted Lloyd iterations per row (sklearn's `_kmeans_single_lloyd`) from `centres` (R, k).

    Each row stops when its labels repeat or Σ (centre shift)² <= tol · var(row); an empty cluster keeps its centre.
    """
    tol_abs = tol * x.var(1, unbiased=False)
    centres = centres.clone()
    labels_old = torch.full(x.shape, -1, dtype=torch.long, device=x.device)
    active = torch.arange(x.shape[0], device=x.device)
    for _ in range(iters):
        if active.numel() == 0:
            break
        xa, wa, ca = x[active], weight[active], centres[active]
        labels = nearest(xa, ca)
        mass = torch.zeros_like(ca).scatter_add_(1, labels, wa)
        total = torch.zeros_like(ca).scatter_add_(1, labels, wa * xa)
        new = torch.where(mass > 0, total / mass, ca)
        centres[active] = new
        done = (labels == labels_old[active]).all(1) | ((new - ca).square().sum(1) <= tol_abs[active])
        labels_old[active] = labels
        active = active[~done]
    return centres


def weighted_kmeans(x: torch.Tensor, weight: torch.Tensor | None, k: int, iters: int = 300, tol: float = 1e-4,
                    seed: int = 0) -> torch.Tensor:
    """k-means++ then Lloyd, per row, in float64: x (R, N), weight (R, N) >= 0 or None (uniform) -> centres (R, k).

    A row whose weights sum to 0 is clustered unweighted.

    >>> lut = weighted_kmeans(torch.randn(8, 512), None, 16)   # (8, 16) float64
    """
    x = x.detach().double()
    weight = torch.ones_like(x) if weight is None else weight.detach().double()
    weight = torch.where(weight.sum(1, keepdim=True) > 0, weight, torch.ones_like(weight))
    return lloyd(x, weight, kmeanspp_init(x, weight, k, seed), iters, tol)


def lut_qparams(w: torch.Tensor, bits: int, group_size: int | None, scale_dtype: torch.dtype = torch.float16,
                column_weight: torch.Tensor | None = None, iters: int = 300, tol: float = 1e-4,
                seed: int = 0) -> QParams:
    """any-b qparams of w (out, in): QParams(scale, None, {"offset": (out, n_groups), "lut": (out, 2^b) ascending}).

    column_weight (in,): a statistic of each input column from calibration (any4: |mean x|); a weight's k-means sample
    weight is |column_weight| × its group's scale (the reference's sample_weight=calibrate with
    scale_sample_weight=True, quantize.py:548-551). None: uniform weights (plain k-means).

    >>> p = lut_qparams(layer.weight, 4, 128, column_weight=x.mean(0).abs())   # p.extra["lut"]: (out, 16)
    """
    if w.dim() != 2:
        raise ValueError(f"a lookup-table grid quantizes 2-D weights (out, in), got shape {tuple(w.shape)}")
    scale, offset = lut_scales(w, bits, group_size, scale_dtype)
    p = QParams(scale, None, {"offset": offset})
    u = lut_units(w.detach(), p, group_size)
    sample_weight = None
    if column_weight is not None:
        per_weight = ungrouped(scale.float().unsqueeze(-1).expand(*scale.shape, group_size or w.shape[-1]), w.shape[-1])
        sample_weight = column_weight.to(w.device).double().abs()[None, :] * per_weight.double()
    lut = weighted_kmeans(u, sample_weight, 2**bits, iters, tol, seed).sort(dim=1).values
    return QParams(scale, None, {"offset": offset, "lut": lut.to(scale_dtype)})


def lut_encode(w: torch.Tensor, p: QParams, group_size: int | None) -> torch.Tensor:
    """w (out, in) -> uint8 codes: each weight's nearest entry of its row's table."""
    return nearest(lut_units(w.detach(), p, group_size), p.extra["lut"].float()).to(torch.uint8)


def lut_dequantize(codes: torch.Tensor, p: QParams, group_size: int | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes (out, in) -> lut[row, code] · scale + offset (computed in float32, returned in dtype)."""
    values = grouped(p.extra["lut"].float().gather(1, codes.long()), group_size)
    values = values * p.scale.float().unsqueeze(-1) + p.extra["offset"].float().unsqueeze(-1)
    return ungrouped(values, codes.shape[-1]).to(dtype)


def lut_fake_quantize(w: torch.Tensor, p: QParams, group_size: int | None, ste: bool = True) -> torch.Tensor:
    """lut_dequantize(lut_encode(w)) in w's dtype; with ste the gradient passes straight through to w."""
    q = lut_dequantize(lut_encode(w, p, group_size), p, group_size, w.dtype)
    return q + (w - w.detach()) if ste and w.requires_grad else q


# ---- storage: what a frozen layer keeps beside its packed codes --------------------------------

def lut_storage(p: QParams, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"scale": p.scale.to(scale_dtype).clone(), "lut_offset": p.extra["offset"].to(scale_dtype).clone(),
            "lut": p.extra["lut"].to(scale_dtype).clone()}


def lut_from_storage(buffers: dict[str, torch.Tensor]) -> QParams:
    return QParams(buffers["scale"], None, {"offset": buffers["lut_offset"], "lut": buffers["lut"]})


def lut_storage_shapes(groups: tuple, bits: int, scale_dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    return {"scale": (groups, scale_dtype), "lut_offset": (groups, scale_dtype),
            "lut": ((groups[0], 2**bits), scale_dtype)}
