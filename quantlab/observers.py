"""Observers: calibration statistics that accumulate over batches, then compute.

Every observer sees activations (..., C) with channels last, keeps plain tensors,
and can export/import its state (dict name -> tensor), so statistics can be saved
and re-applied. Searching (what range to use) is separate from applying it.

>>> obs = make_observer("minmax", per_channel=False)
>>> for x in batches: obs.update(x)
>>> lo, hi = obs.range()
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class Observer:
    """Base: update(x) per batch; state() / load_state() for export."""

    name = ""

    def update(self, x: torch.Tensor) -> None:
        raise NotImplementedError

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


OBSERVERS: dict[str, Callable[..., Observer]] = {"minmax": MinMaxObserver, "hessian": HessianObserver}


def make_observer(name: str, **kwargs) -> Observer:
    if name not in OBSERVERS:
        raise ValueError(f"unknown observer {name!r}; known: {', '.join(sorted(OBSERVERS))}")
    return OBSERVERS[name](**kwargs)


def attach_input_observers(modules: dict[str, nn.Module], factory: Callable[[str], Observer]):
    """Observe each module's input with a fresh observer; returns (observers by name, remove())."""
    observers = {name: factory(name) for name in modules}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: observers[name].update(args[0]))
        for name, m in modules.items()
    ]

    def remove():
        for h in handles:
            h.remove()

    return observers, remove


def export_stats(observers: dict[str, Observer]) -> dict[str, torch.Tensor]:
    """Flatten observer states into {"<module>.<stat>": tensor} (safetensors-friendly)."""
    return {f"{name}.{k}": v for name, obs in observers.items() for k, v in obs.state().items()}


def import_stats(observers: dict[str, Observer], stats: dict[str, torch.Tensor]) -> None:
    for name, obs in observers.items():
        obs.load_state({k[len(name) + 1:]: v for k, v in stats.items() if k.startswith(name + ".")})
