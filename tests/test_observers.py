"""Observers vs brute-force references: moving-average min/max, percentile, MSE clipping; export; NaN errors."""
import pytest
import torch

from quantlab.core.observers import (
    OBSERVERS,
    HessianObserver,
    MovingAverageMinMaxObserver,
    MSEObserver,
    PercentileObserver,
    export_stats,
    import_stats,
    keep_random_rows,
    make_observer,
)
from quantlab.core.primitives import code_range


def _batches(n=5, shape=(3, 40, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) * (1 + i) for i in range(n)]


@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("per_channel", [False, True])
def test_moving_average_matches_explicit_ema_loop(c, per_channel):
    batches = _batches()
    obs = MovingAverageMinMaxObserver(averaging_constant=c, per_channel=per_channel)
    for x in batches:
        obs.update(x)
    # reference: a Python-float loop per channel (float64), the first batch initializing
    cols = [x.reshape(-1, 8) if per_channel else x.reshape(-1, 1) for x in batches]
    ref_lo, ref_hi = [], []
    for ch in range(cols[0].shape[1]):
        lo = hi = None
        for col in cols:
            b_lo, b_hi = min(col[:, ch].tolist()), max(col[:, ch].tolist())
            lo = b_lo if lo is None else lo + c * (b_lo - lo)
            hi = b_hi if hi is None else hi + c * (b_hi - hi)
        ref_lo.append(lo)
        ref_hi.append(hi)
    lo, hi = obs.range()
    assert lo.shape == ((8,) if per_channel else ())
    # float32 EMA vs float64 loop: a few float32 ulps of values of size ~5
    torch.testing.assert_close(lo.reshape(-1), torch.tensor(ref_lo, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hi.reshape(-1), torch.tensor(ref_hi, dtype=torch.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("absolute", [False, True])
def test_percentile_matches_torch_quantile_while_data_fits(percentile, per_channel, absolute):
    batches = _batches()  # 5 * 120 rows * 8 channels = 4800 values < max_samples: the sample holds everything
    obs = PercentileObserver(percentile, per_channel=per_channel, absolute=absolute, max_samples=8192)
    for x in batches:
        obs.update(x)
    data = torch.cat([x.reshape(-1, 8) for x in batches])  # (600, 8)
    if not per_channel:
        data = data.reshape(-1, 1)
    q = percentile / 100
    if absolute:
        hi = torch.quantile(data.abs(), q, dim=0)
        lo = -hi
    else:
        lo, hi = torch.quantile(data, 1 - q, dim=0), torch.quantile(data, q, dim=0)
    got_lo, got_hi = obs.range()
    # same values, same torch.quantile: exact (atol=0)
    assert torch.equal(got_lo.reshape(-1), lo) and torch.equal(got_hi.reshape(-1), hi)


def test_percentile_is_bounded_and_close_on_large_inputs():
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 1024, generator=gen) for _ in range(8)]  # 524k values, 32x the sample
    obs = PercentileObserver(99.0, max_samples=2**14)
    for x in batches:
        obs.update(x)
    assert obs.samples.numel() <= 2**14 and obs.keys.numel() <= 2**14
    exact = torch.quantile(torch.cat(batches).flatten()[: 2**24], 0.99)
    # sampling error of a 99 % quantile from 16k draws: sd ≈ 1.3 % of q; allow 5 %
    torch.testing.assert_close(obs.range()[1], exact, rtol=0.05, atol=0)


def test_keep_random_rows_keeps_everything_under_capacity_and_a_subset_over_it():
    gen = torch.Generator().manual_seed(0)
    rows = torch.arange(30.0).reshape(10, 3)
    kept, keys = keep_random_rows(None, None, rows[:4], 8, gen)
    kept, keys = keep_random_rows(kept, keys, rows[4:7], 8, gen)
    assert sorted(kept[:, 0].tolist()) == rows[:7, 0].tolist()
    kept, keys = keep_random_rows(kept, keys, rows[7:], 5, gen)
    assert kept.shape == (5, 3) and keys.shape == (5,)
    assert all(any(torch.equal(r, s) for s in rows) for r in kept)  # whole rows, never mixed


def _mse_reference(values, lo, hi, bits, symmetric):
    """Quantization MSE of a range, element by element in Python floats (float32-rounded scale)."""
    qmin, qmax = code_range(bits, symmetric)
    if symmetric:
        scale, zero = max(abs(lo), abs(hi)) / qmax, 0
    else:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        scale = (hi - lo) / (qmax - qmin)
    scale = float(torch.tensor(max(scale, torch.finfo(torch.float32).tiny), dtype=torch.float32))
    if not symmetric:
        zero = min(max(round(-lo / scale), qmin), qmax)
    err = 0.0
    for v in values:
        q = min(max(round(v / scale) + zero, qmin), qmax)
        err += ((q - zero) * scale - v) ** 2
    return err / len(values)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("per_channel", [False, True])
def test_mse_observer_matches_brute_force_grid_search(bits, symmetric, per_channel):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(60, 3, generator=gen)
    x[7, :] = torch.tensor([9.0, -7.0, 12.0])  # outliers: clipping pays off
    obs = MSEObserver(bits, symmetric, per_channel=per_channel, grid=50, max_shrink=0.8)
    obs.update(x[:30])
    obs.update(x[30:])
    lo, hi = obs.range()
    cols = [x[:, c].tolist() for c in range(3)] if per_channel else [x.flatten().tolist()]
    for c, values in enumerate(cols):
        mn, mx = min(values), max(values)
        best = min(_mse_reference(values, mn * s, mx * s, bits, symmetric) for s in obs.shrink_factors())
        got_lo, got_hi = (lo[c], hi[c]) if per_channel else (lo, hi)
        got = _mse_reference(values, float(got_lo), float(got_hi), bits, symmetric)
        # the chosen range is as good as the brute-force best, up to float32 vs float64 evaluation
        assert got <= best * (1 + 1e-4)
        assert any(abs(float(got_hi) - mx * s) <= 1e-6 * abs(mx) for s in obs.shrink_factors())


def test_mse_clipping_beats_minmax_on_heavy_tails():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen)
    x[:4] = torch.tensor([30.0, -25.0, 20.0, -40.0])
    obs = MSEObserver(bits=4, symmetric=True)
    obs.update(x)
    lo, hi = obs.range()
    full = _mse_reference(x.tolist(), float(x.min()), float(x.max()), 4, True)
    clipped = _mse_reference(x.tolist(), float(lo), float(hi), 4, True)
    assert clipped < 0.6 * full  # reference: min-max range MSE on the same data (measured ratio 0.55)


@pytest.mark.parametrize("name", ["moving_average", "percentile", "mse"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_input_names_the_module(name, bad):
    obs = make_observer(name, where="model.layers.3.mlp.down_proj")
    x = torch.randn(4, 8)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=rf"{name} observer of model\.layers\.3\.mlp\.down_proj: NaN/Inf"):
        obs.update(x)


@pytest.mark.parametrize("name,kwargs", [
    ("moving_average", {"averaging_constant": 0.2}), ("percentile", {"percentile": 99.9}), ("mse", {"bits": 4, "grid": 20}),
])
@pytest.mark.parametrize("per_channel", [False, True])
def test_state_export_and_import_reproduce_the_range(name, kwargs, per_channel):
    observers = {"a": make_observer(name, per_channel=per_channel, **kwargs),
                 "a.b": make_observer(name, per_channel=per_channel, **kwargs)}
    for i, x in enumerate(_batches(3)):
        for obs in observers.values():
            obs.update(x + i)
    stats = export_stats(observers)
    assert all(isinstance(v, torch.Tensor) for v in stats.values()) and "a.min_val" in stats
    fresh = {k: make_observer(name, per_channel=per_channel, **kwargs) for k in observers}
    import_stats(fresh, stats)
    for k in observers:
        for got, ref in zip(fresh[k].range(), observers[k].range()):
            assert torch.equal(got, ref)  # exact


@pytest.mark.parametrize("name,kwargs,match", [
    ("moving_average", {"averaging_constant": 0.0}, r"averaging_constant must be in \(0, 1\], got 0.0"),
    ("percentile", {"percentile": 40}, r"percentile must be a number in \(50, 100\], got 40"),
    ("percentile", {"max_samples": 0}, "max_samples must be an integer >= 1, got 0"),
    ("mse", {"bits": 9}, "bits must be an integer in 2..8, got 9"),
    ("mse", {"max_shrink": 1.0}, r"max_shrink must be in \(0, 1\), got 1.0"),
])
def test_observer_arguments_are_validated(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_observer(name, **kwargs)


def test_unknown_observer_lists_known_and_empty_observer_fails():
    with pytest.raises(ValueError, match="unknown observer 'histogram'; known: .*minmax, moving_average, mse, percentile"):
        make_observer("histogram")
    assert {"moving_average", "percentile", "mse"} <= set(OBSERVERS)
    with pytest.raises(ValueError, match="percentile observer of x saw no data"):
        PercentileObserver(where="x").range()


def test_hessian_is_two_over_n_sum_of_xtx_over_all_rows():
    """Batches of 10, 7 and 3 rows (2-D and 3-D): H = 2/n Σ xᵀx over all n = 20 rows, not a mean of
    per-batch means. Reference: float64 over the concatenated rows; tolerance: the fp32 running mean
    (rescaled each batch) vs float64, 1e-6 of the largest entry."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.linspace(0.1, 5.0, 16)  # uneven channels, so a wrong weighting shows
    batches = [torch.randn(2, 5, 16, generator=gen) * scales, torch.randn(7, 16, generator=gen) * scales + 1.0,
               torch.randn(1, 3, 16, generator=gen) * 3 * scales]
    obs = HessianObserver()
    for x in batches:
        obs.update(x)
    rows = torch.cat([x.reshape(-1, 16) for x in batches]).double()
    ref = 2 * rows.T @ rows / rows.shape[0]
    assert int(obs.samples) == 20
    h = obs.compute("model.layers.0.self_attn.q_proj")
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    torch.testing.assert_close(h.double(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    per_batch_mean = sum(2 * b.reshape(-1, 16).double().T @ b.reshape(-1, 16).double() / b[..., 0].numel()
                         for b in batches) / len(batches)
    assert (h.double() - per_batch_mean).abs().max() > 1e-2 * ref.abs().max()  # the test tells the two apart


def test_hessian_errors_name_the_layer():
    with pytest.raises(ValueError, match="hessian observer of model.layers.2.mlp.up_proj saw no data"):
        HessianObserver().compute("model.layers.2.mlp.up_proj")
    obs = HessianObserver()
    obs.update(torch.randn(4, 8))
    x = torch.randn(3, 8)
    x[1, 2] = float("inf")
    obs.update(x)
    with pytest.raises(ValueError, match=r"hessian observer of model\.layers\.2\.mlp\.up_proj: NaN/Inf"):
        obs.compute("model.layers.2.mlp.up_proj")


class _Fan(torch.nn.Module):
    """a, b and c read x itself; d reads a copy of it (equal values, another tensor)."""

    def __init__(self, copy_for_b_after: int | None = None):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(8, 8) for _ in range(4))
        self.calls, self.copy_for_b_after = 0, copy_for_b_after

    def forward(self, x):
        self.calls += 1
        b_in = x.clone() if self.copy_for_b_after is not None and self.calls > self.copy_for_b_after else x
        return self.a(x) + self.b(b_in) + self.c(x) + self.d(x.clone())


def test_modules_handed_one_tensor_share_one_observer_with_the_same_bits():
    """Reference: one observer per module (attach_input_observers). Shared: a/b/c's Hessian is one object that saw
    each batch once, bitwise what each module's own observer computed; d (a copy) keeps its own."""
    from quantlab.core.observer_hooks import attach_input_observers, attach_shared_input_observers

    fan, batches = _Fan(), _batches(n=3)
    mods = {n: getattr(fan, n) for n in "abcd"}
    own, remove = attach_input_observers(mods, lambda n: HessianObserver())
    for x in batches:
        fan(x)
    remove()
    shared, remove = attach_shared_input_observers(mods, lambda n: HessianObserver())
    for x in batches:
        fan(x)
    remove()
    assert shared["a"] is shared["b"] is shared["c"] and shared["d"] is not shared["a"]
    assert int(shared["a"].samples) == int(own["a"].samples) == 3 * 3 * 40
    for n in "abcd":
        assert torch.equal(shared[n].compute(n), own[n].compute(n)), n
    assert sorted(shared) == list("abcd") and len(shared) == 4


def test_a_sharing_that_stops_holding_raises_and_an_unreached_module_says_so():
    from quantlab.core.observer_hooks import attach_shared_input_observers

    fan = _Fan(copy_for_b_after=1)
    shared, remove = attach_shared_input_observers({n: getattr(fan, n) for n in "ab"}, lambda n: HessianObserver())
    fan(_batches(n=1)[0])
    with pytest.raises(RuntimeError, match="b: its input is no longer the tensor a is handed"):
        fan(_batches(n=1)[0])
    remove()
    shared, remove = attach_shared_input_observers({"a": fan.a, "never": torch.nn.Linear(2, 2)},
                                                   lambda n: HessianObserver())
    with pytest.raises(ValueError, match="never: no observed forward reached it"):
        shared["never"]
    remove()
