"""Observers: calibration statistics that accumulate over batches, then compute.

Every observer sees activations (..., C) with channels last, keeps plain tensors,
and can export/import its state (dict name -> tensor), so statistics can be saved
and re-applied. Searching (what range to use) is separate from applying it.

>>> obs = make_observer("minmax", per_channel=False)
>>> for x in batches: obs.update(x)
>>> lo, hi = obs.range()
"""
from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from ..util.checks import check_int
from .primitives import fake_quantize, qparams_from_range


class Observer(abc.ABC):
    """Base: update(x) per batch; state() / load_state() for export."""

    name = ""

    @abc.abstractmethod
    def update(self, x: torch.Tensor) -> None:
        """Fold one batch of activations (..., C) into the statistics."""

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            setattr(self, k, v.clone())

    def _check_finite(self, x: torch.Tensor, where: str = "") -> None:
        if not torch.isfinite(x).all():
            raise ValueError(f"{self.name} observer{' of ' + where if where else ''}: NaN/Inf in the statistics")


class MinMaxObserver(Observer):
    """Running min and max, per tensor or per channel (last dim)."""

    name = "minmax"

    def __init__(self, per_channel: bool = False):
        self.per_channel = per_channel
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def _reduce(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().float()
        if self.per_channel:
            x = x.reshape(-1, x.shape[-1])
            return x.amin(0), x.amax(0)
        return x.amin(), x.amax()

    def update(self, x: torch.Tensor) -> None:
        lo, hi = self._reduce(x)
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val, self.max_val = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.min_val is None:
            raise ValueError(f"{self.name} observer saw no data")
        self._check_finite(self.min_val)
        self._check_finite(self.max_val)
        return self.min_val, self.max_val


class HessianObserver(Observer):
    """H = 2/n Σ xᵀx over n token rows (GPTQ's layer Hessian), kept as a running mean in fp32."""

    name = "hessian"

    def __init__(self):
        self.hessian: torch.Tensor | None = None
        self.samples = torch.zeros((), dtype=torch.long)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # (rows, C)
        n_new = x.shape[0]
        if self.hessian is None:
            self.hessian = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        total = int(self.samples) + n_new
        self.hessian.mul_(int(self.samples) / total)
        x = x * (2.0 / total) ** 0.5
        self.hessian.addmm_(x.t(), x)
        self.samples = torch.tensor(total)

    def compute(self, where: str = "") -> torch.Tensor:
        if self.hessian is None:
            raise ValueError(f"hessian observer{' of ' + where if where else ''} saw no data")
        self._check_finite(self.hessian, where)
        return self.hessian


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of each batch's min and max (torch.ao's MovingAverageMinMaxObserver).

    The first batch sets the range; after that min <- min + c * (batch_min - min), same for max.
    """

    name = "moving_average"

    def __init__(self, averaging_constant: float = 0.01, per_channel: bool = False, where: str = ""):
        if isinstance(averaging_constant, bool) or not 0 < averaging_constant <= 1:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
        super().__init__(per_channel)
        self.averaging_constant, self.where = float(averaging_constant), where

    def update(self, x: torch.Tensor) -> None:
        self._check_finite(x, self.where)
        lo, hi = self._reduce(x)
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            c = self.averaging_constant
            self.min_val, self.max_val = self.min_val + c * (lo - self.min_val), self.max_val + c * (hi - self.max_val)


def keep_random_rows(
    rows: torch.Tensor | None, keys: torch.Tensor | None, new: torch.Tensor, capacity: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounded uniform sample of every row seen: keep the `capacity` rows with the smallest random keys.

    (bottom-k sampling: the result is a uniform random subset without replacement of all rows,
    and holds every row while fewer than `capacity` were seen). rows: (n, C), keys: (n,).
    """
    new_keys = torch.rand(new.shape[0], generator=generator, device=new.device)
    if new.shape[0] > capacity:  # pre-select inside the batch: only its bottom-k can survive
        idx = new_keys.topk(capacity, largest=False).indices
        new, new_keys = new[idx], new_keys[idx]
    if rows is not None:
        new, new_keys = torch.cat([rows, new]), torch.cat([keys, new_keys])
    if new_keys.numel() > capacity:
        idx = new_keys.topk(capacity, largest=False).indices
        new, new_keys = new[idx], new_keys[idx]
    return new, new_keys


class _SampledObserver(Observer):
    """Exact running min/max plus a bounded random sample of the data (max_samples floats).

    Per tensor the sample holds single values as rows (n, 1); per channel it holds whole
    token rows (n, C), so n = max_samples // C rows. Ranges come back 0-dim per tensor,
    (C,) per channel, like MinMaxObserver.
    """

    def __init__(self, per_channel: bool, max_samples: int, seed: int, where: str):
        check_int("max_samples", max_samples, 1)
        self.per_channel, self.max_samples, self.seed, self.where = per_channel, max_samples, seed, where
        self.min_val: torch.Tensor | None = None  # (1,) or (C,)
        self.max_val: torch.Tensor | None = None
        self.samples: torch.Tensor | None = None  # (n, 1) or (n, C)
        self.keys: torch.Tensor | None = None  # (n,) random priorities of the kept rows
        self._generator: torch.Generator | None = None

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        self._check_finite(x, self.where)
        rows = x.reshape(-1, x.shape[-1]) if self.per_channel else x.reshape(-1, 1)
        lo, hi = rows.amin(0), rows.amax(0)
        if self.min_val is None:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val, self.max_val = torch.minimum(self.min_val, lo), torch.maximum(self.max_val, hi)
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device).manual_seed(self.seed)
        capacity = max(1, self.max_samples // rows.shape[1])
        self.samples, self.keys = keep_random_rows(self.samples, self.keys, rows, capacity, self._generator)

    def _checked(self) -> None:
        if self.samples is None:
            raise ValueError(f"{self.name} observer{' of ' + self.where if self.where else ''} saw no data")
        for t in (self.min_val, self.max_val, self.samples):
            self._check_finite(t, self.where)

    def _shaped(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (lo, hi) if self.per_channel else (lo[0], hi[0])


class PercentileObserver(_SampledObserver):
    """Clip to a percentile of the observed values (of x, or of |x| when absolute=True).

    percentile=99.99 -> range [q(0.01 %), q(99.99 %)] (or ±q(|x|, 99.99 %)), computed with
    torch.quantile (linear interpolation) on a bounded random sample of max_samples floats;
    exact while fewer values than that were seen.
    """

    name = "percentile"

    def __init__(self, percentile: float = 99.99, per_channel: bool = False, absolute: bool = False,
                 max_samples: int = 2**18, seed: int = 0, where: str = ""):
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 < percentile <= 100:
            raise ValueError(f"percentile must be a number in (50, 100], got {percentile!r}")
        super().__init__(per_channel, max_samples, seed, where)
        self.percentile, self.absolute = float(percentile), absolute

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._checked()
        q = self.percentile / 100
        if self.absolute:
            hi = torch.quantile(self.samples.abs(), q, dim=0)
            return self._shaped(-hi, hi)
        return self._shaped(torch.quantile(self.samples, 1 - q, dim=0), torch.quantile(self.samples, q, dim=0))


class MSEObserver(_SampledObserver):
    """Clipping range minimizing the quantization MSE of the observed values for bits/symmetric.

    Candidates shrink the exact min-max range: [s * min, s * max] for s = 1 - i / grid,
    i = 0 .. max_shrink * grid - 1 (GPTQ's grid search, with p = 2); the MSE is measured on
    the bounded random sample, per tensor or per channel (each channel its own s).
    """

    name = "mse"

    def __init__(self, bits: int = 8, symmetric: bool = False, per_channel: bool = False, grid: int = 100,
                 max_shrink: float = 0.8, max_samples: int = 2**18, seed: int = 0, where: str = ""):
        check_int("bits", bits, 2, 8)
        check_int("grid", grid, 1)
        if isinstance(max_shrink, bool) or not 0 < max_shrink < 1:
            raise ValueError(f"max_shrink must be in (0, 1), got {max_shrink!r}")
        super().__init__(per_channel, max_samples, seed, where)
        self.bits, self.symmetric, self.grid, self.max_shrink = bits, symmetric, grid, float(max_shrink)

    def shrink_factors(self) -> list[float]:
        return [1 - i / self.grid for i in range(max(1, int(self.max_shrink * self.grid)))]

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._checked()
        x = self.samples  # (n, C) or (n, 1): group_size=1 below gives each column its own scale
        best_err = torch.full_like(self.min_val, float("inf"))
        best_lo, best_hi = self.min_val.clone(), self.max_val.clone()
        for s in self.shrink_factors():
            lo, hi = self.min_val * s, self.max_val * s
            p = qparams_from_range(lo, hi, self.bits, self.symmetric)
            err = (fake_quantize(x, p, self.bits, 1, ste=False) - x).pow(2).mean(0)  # (C,)
            better = err < best_err  # strict: ties keep the wider range
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        return self._shaped(best_lo, best_hi)


class MeanAbsObserver(Observer):
    """Running mean of |x| per channel (last dim): AWQ's activation salience."""

    name = "meanabs"

    def __init__(self):
        self.abs_sum: torch.Tensor | None = None
        self.samples = torch.zeros((), dtype=torch.long)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # (rows, C)
        total = x.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.samples = self.samples + x.shape[0]

    def compute(self, where: str = "") -> torch.Tensor:
        if self.abs_sum is None:
            raise ValueError(f"meanabs observer{' of ' + where if where else ''} saw no data")
        self._check_finite(self.abs_sum, where)
        return self.abs_sum / self.samples


class SmoothStats(Observer):
    """Per-channel max|x| of a group's input, plus (sample_rows > 0) a bounded random sample of token rows
    (SmoothQuant's activation statistics)."""

    name = "smoothquant"

    def __init__(self, sample_rows: int = 0, seed: int = 0, where: str = ""):
        self.sample_rows, self.seed, self.where = sample_rows, seed, where
        self.act_absmax: torch.Tensor | None = None  # (C,)
        self.samples: torch.Tensor | None = None  # (n <= sample_rows, C)
        self.keys: torch.Tensor | None = None
        self._generator: torch.Generator | None = None

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        self._check_finite(x, self.where)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, C)
        amax = rows.abs().amax(0)
        self.act_absmax = amax if self.act_absmax is None else torch.maximum(self.act_absmax, amax)
        if self.sample_rows:
            if self._generator is None or self._generator.device != x.device:
                self._generator = torch.Generator(device=x.device).manual_seed(self.seed)
            self.samples, self.keys = keep_random_rows(self.samples, self.keys, rows, self.sample_rows, self._generator)

    def compute(self) -> torch.Tensor:
        if self.act_absmax is None:
            raise ValueError(f"smoothquant statistics of {self.where} saw no data")
        self._check_finite(self.act_absmax, self.where)
        return self.act_absmax


OBSERVERS: dict[str, Callable[..., Observer]] = {
    "minmax": MinMaxObserver, "hessian": HessianObserver, "moving_average": MovingAverageMinMaxObserver,
    "percentile": PercentileObserver, "mse": MSEObserver,
}


RANGE_OBSERVERS = ["minmax", "moving_average", "percentile", "mse"]  # observers with range(): what `static` names


def register_observer(name: str, factory: Callable[..., Observer], ranges: bool = True) -> Callable[..., Observer]:
    """Make an observer available by name. ranges=True: it has range() -> (lo, hi), so `static` can name it
    (observer = "..."); static calls factory(per_channel=..., where=module_name, bits=..., symmetric=...).

    >>> register_observer("absmax99", lambda per_channel, where, bits, symmetric: MyObserver(per_channel))
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"observer name must be a non-empty string, got {name!r}")
    if name in OBSERVERS:
        raise ValueError(f"observer {name!r} is already registered; taken: {', '.join(sorted(OBSERVERS))}")
    if not callable(factory):
        raise TypeError(f"observer {name!r}: factory must be callable, got {type(factory).__name__}")
    OBSERVERS[name] = factory
    if ranges:
        RANGE_OBSERVERS.append(name)
    return factory


def make_observer(name: str, **kwargs) -> Observer:
    if name not in OBSERVERS:
        raise ValueError(f"unknown observer {name!r}; known: {', '.join(sorted(OBSERVERS))}")
    return OBSERVERS[name](**kwargs)


def export_stats(observers: dict[str, Observer]) -> dict[str, torch.Tensor]:
    """Flatten observer states into {"<module>.<stat>": tensor} (safetensors-friendly)."""
    return {f"{name}.{k}": v for name, obs in observers.items() for k, v in obs.state().items()}


def import_stats(observers: dict[str, Observer], stats: dict[str, torch.Tensor]) -> None:
    for name, obs in observers.items():
        obs.load_state({k[len(name) + 1:]: v for k, v in stats.items() if k.startswith(name + ".")})
