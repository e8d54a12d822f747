"""Bootstrap confidence intervals for perplexity over evaluation windows, and seed statistics.

Windows are the resampling unit (tokens inside a window are not independent). A resample
draws n window indices with replacement and recomputes ppl = exp(Σ nll[idx] / Σ tokens[idx]);
the 95% interval is the 2.5th..97.5th percentile of those values (percentile bootstrap).
Comparisons against the baseline are *paired*: run and baseline are resampled with the
same indices, so window difficulty (which both share) cancels out of Δppl.

    lo, hi = ppl_interval(window_nll, window_tokens)          # per-window NLL sums, predicted tokens
    d = paired_delta_interval(run_nll, base_nll, window_tokens)  # {'delta_pct', 'low', 'high', 'excludes_zero'}
    d = paired_mean_interval(run_cos, base_cos)   # per-sentence values: {'delta', 'low', 'high', 'excludes_zero'}
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0  # fixed, so a report regenerated from the same rows has the same intervals


def _arrays(nll: Sequence[float], tokens: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    nll, tokens = np.asarray(nll, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    if nll.ndim != 1 or nll.size == 0:
        raise ValueError(f"need a non-empty 1-D list of per-window NLL sums, got shape {nll.shape}")
    if tokens.shape != nll.shape:
        raise ValueError(f"window_nll has {nll.size} windows but window_tokens has {tokens.size}")
    if (tokens <= 0).any():
        raise ValueError("every window must predict at least one token")
    return nll, tokens


def _indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # (resamples, n)


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def ppl_from_windows(nll: Sequence[float], tokens: Sequence[float]) -> float:
    """exp(total NLL / total predicted tokens): the point estimate the intervals are around."""
    nll, tokens = _arrays(nll, tokens)
    return math.exp(nll.sum() / tokens.sum())


def ppl_interval(nll, tokens, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval of the perplexity over windows: (low, high)."""
    nll, tokens = _arrays(nll, tokens)
    idx = _indices(nll.size, resamples, seed)
    return _percentiles(np.exp(nll[idx].sum(1) / tokens[idx].sum(1)), level)


def _delta_pct(run_nll, base_nll, run_tok, base_tok) -> np.ndarray:
    return (np.exp(run_nll / run_tok - base_nll / base_tok) - 1) * 100


def paired_delta_interval(run_nll, base_nll, tokens, resamples: int = RESAMPLES, level: float = LEVEL,
                          seed: int = SEED) -> dict:
    """Δppl % of a run vs the baseline on the same windows, with a paired bootstrap interval.

    Returns {'delta_pct', 'low', 'high', 'excludes_zero'}; excludes_zero says the difference
    is unlikely to be window-sampling noise at this level.
    """
    run, tok = _arrays(run_nll, tokens)
    base, _ = _arrays(base_nll, tokens)
    idx = _indices(run.size, resamples, seed)
    t = tok[idx].sum(1)
    lo, hi = _percentiles(_delta_pct(run[idx].sum(1), base[idx].sum(1), t, t), level)
    point = float(_delta_pct(run.sum(), base.sum(), tok.sum(), tok.sum()))
    return {"delta_pct": point, "low": lo, "high": hi, "excludes_zero": bool(lo > 0 or hi < 0)}


def unpaired_delta_interval(run_nll, base_nll, tokens, resamples: int = RESAMPLES, level: float = LEVEL,
                            seed: int = SEED) -> tuple[float, float]:
    """The same Δppl % interval with run and baseline resampled independently (what pairing avoids)."""
    run, tok = _arrays(run_nll, tokens)
    base, _ = _arrays(base_nll, tokens)
    i, j = _indices(run.size, resamples, seed), _indices(run.size, resamples, seed + 1)
    return _percentiles(_delta_pct(run[i].sum(1), base[j].sum(1), tok[i].sum(1), tok[j].sum(1)), level)


def paired_mean_interval(run: Sequence[float], base: Sequence[float], resamples: int = RESAMPLES,
                         level: float = LEVEL, seed: int = SEED) -> dict:
    """mean(run) - mean(base) over the same items (e.g. per-sentence embedding cosines), with a paired
    percentile-bootstrap interval: items are resampled with the same indices for both.

    Returns {'delta', 'low', 'high', 'excludes_zero'}.
    """
    a, b = np.asarray(run, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"need a non-empty 1-D list of per-item values, got shape {a.shape}")
    if b.shape != a.shape:
        raise ValueError(f"paired values need the same items: {a.size} vs {b.size}")
    diff = a - b
    lo, hi = _percentiles(diff[_indices(diff.size, resamples, seed)].mean(1), level)
    return {"delta": float(diff.mean()), "low": lo, "high": hi, "excludes_zero": bool(lo > 0 or hi < 0)}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value) across seeds."""
    v = np.asarray([x for x in values if x is not None and x == x], dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0
