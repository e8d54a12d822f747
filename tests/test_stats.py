"""Bootstrap intervals over windows: hand-checked cases, coverage, shrinkage, pairing."""
import math

import numpy as np
import pytest

from quantlab.reporting import stats

TOK = 511  # predicted tokens per window of seq_len 512


def _widths(lo_hi):
    return lo_hi[1] - lo_hi[0]


def test_equal_windows_give_a_zero_width_interval_at_the_point_estimate():
    nll = [3.5 * TOK] * 10
    lo, hi = stats.ppl_interval(nll, [TOK] * 10)
    assert lo == hi == pytest.approx(math.exp(3.5), rel=1e-12)  # every resample is the same set
    d = stats.paired_delta_interval([n + 0.1 * TOK for n in nll], nll, [TOK] * 10)
    expected = (math.exp(0.1) - 1) * 100  # each window is 0.1 nats/token worse
    assert d["delta_pct"] == pytest.approx(expected, rel=1e-12)
    assert d["low"] == pytest.approx(expected, rel=1e-12) and d["high"] == pytest.approx(expected, rel=1e-12)
    assert d["excludes_zero"]


def test_two_windows_hand_checked():
    """Resamples of 2 windows are {a,a}, {a,b}, {b,b} with probability 1/4, 1/2, 1/4, so the 2.5th
    and 97.5th percentiles of 2000 draws are exp(a) and exp(b) exactly (the tails hold ~500 draws)."""
    lo, hi = stats.ppl_interval([2.0, 4.0], [1, 1])
    assert lo == pytest.approx(math.exp(2.0), rel=1e-12) and hi == pytest.approx(math.exp(4.0), rel=1e-12)
    assert stats.ppl_from_windows([2.0, 4.0], [1, 1]) == pytest.approx(math.exp(3.0), rel=1e-12)


def test_interval_covers_the_point_estimate_and_is_seeded():
    rng = np.random.default_rng(1)
    nll = rng.normal(3.5, 0.4, size=24) * TOK
    lo, hi = stats.ppl_interval(nll, [TOK] * 24)
    point = stats.ppl_from_windows(nll, [TOK] * 24)
    assert lo < point < hi
    assert (lo, hi) == stats.ppl_interval(nll, [TOK] * 24)  # same seed, same interval (reports regenerate)
    assert (lo, hi) != stats.ppl_interval(nll, [TOK] * 24, seed=5)


def test_interval_shrinks_with_more_windows():
    """Per-window mean NLL ~ N(3.5, 0.4): the width scales like 1/sqrt(n), so 16x the windows ~ 1/4 the width."""
    rng = np.random.default_rng(2)
    few, many = (rng.normal(3.5, 0.4, size=n) * TOK for n in (16, 256))
    w_few, w_many = _widths(stats.ppl_interval(few, [TOK] * 16)), _widths(stats.ppl_interval(many, [TOK] * 256))
    assert w_many < 0.45 * w_few  # expected ratio 0.25; 0.45 leaves room for sampling noise


def test_paired_interval_is_narrower_than_unpaired_on_correlated_runs():
    """Run and baseline share window difficulty (sd 0.4) and differ by a small noisy shift (sd 0.02)."""
    rng = np.random.default_rng(3)
    difficulty = rng.normal(3.5, 0.4, size=32)
    base = difficulty * TOK
    run = (difficulty + 0.05 + rng.normal(0, 0.02, size=32)) * TOK
    paired = stats.paired_delta_interval(run, base, [TOK] * 32)
    unpaired = stats.unpaired_delta_interval(run, base, [TOK] * 32)
    assert paired["low"] < paired["delta_pct"] < paired["high"]
    assert _widths((paired["low"], paired["high"])) < 0.2 * _widths(unpaired)
    assert paired["excludes_zero"] and unpaired[0] < 0 < unpaired[1]  # only pairing resolves a 5% change


@pytest.mark.parametrize("nll,tokens,match", [
    ([], [], "non-empty"),
    ([1.0, 2.0], [1], "2 windows but window_tokens has 1"),
    ([1.0], [0], "at least one token"),
])
def test_bad_window_lists(nll, tokens, match):
    with pytest.raises(ValueError, match=match):
        stats.ppl_interval(nll, tokens)


def test_mean_std_over_seeds():
    assert stats.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sample std (ddof=1)
    assert stats.mean_std([4.0]) == (4.0, 0.0)


def test_paired_mean_interval_hand_checked_and_pairing():
    # a constant per-item difference is the interval exactly, whatever the items' spread
    base = [0.90, 0.99, 0.95, 0.80, 0.97]
    d = stats.paired_mean_interval([b + 0.01 for b in base], base)
    assert d["delta"] == pytest.approx(0.01, abs=1e-12)
    assert d["low"] == pytest.approx(0.01, abs=1e-12) and d["high"] == pytest.approx(0.01, abs=1e-12)
    assert d["excludes_zero"]
    # two items, differences +1 and -1: resample means are k/2 - (2-k)/2 for k ~ Binomial(2, 1/2) in {-1, 0, 1}
    d = stats.paired_mean_interval([1.0, 0.0], [0.0, 1.0])
    assert d["delta"] == 0 and d["low"] == -1 and d["high"] == 1 and not d["excludes_zero"]
    with pytest.raises(ValueError, match="same items: 3 vs 2"):
        stats.paired_mean_interval([1, 2, 3], [1, 2])
