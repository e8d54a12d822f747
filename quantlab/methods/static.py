"""`static`: weight quantization by a base method + static activation quantization from calibration ranges.

After the base's prepare/calibrate, an observer watches the input of every QuantLinear's
activation quantizer (after any smoothing input_scale) over the calibration batches; its
range becomes fixed qparams (StaticActQuant). Defaults: W8A8 with int8 per-channel sym
weights (RTN) and int8 per-tensor *asymmetric* activations (min-max range): inputs such as
down_proj's (SiLU-gated) or OPT fc2's (ReLU) are far from symmetric, so a zero point uses
the 256 codes better; per-tensor asymmetric int8 is also what integer kernels take.

calibrate() iterates the calibration batches twice when the base needs data (the base's
own pass, then the one calibration loop here); a one-shot iterator is first turned into a list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.activations import STATIC_FORMATS, StaticActQuant, check_act_bits, check_act_format
from ..core.lifecycle import quant_linears, run_calibration
from ..core.observer_hooks import attach_input_observers
from ..core.observers import RANGE_OBSERVERS, Observer, make_observer
from ..core.registry import Method, as_weight_base, get_method, needs_calibration, register_method
from ..util.checks import check_choice
from .rtn import RTNConfig

ACT_GRANULARITIES = ("tensor", "channel")


@dataclass(frozen=True)
class StaticConfig:
    """act_bits 4..8; act_granularity tensor | channel; observer minmax | moving_average | percentile | mse."""

    act_bits: int = 8
    act_symmetric: bool = False
    act_granularity: str = "tensor"
    observer: str = "minmax"
    percentile: float = 99.99  # used by observer = "percentile"
    base: Any = RTNConfig(bits=8)
    act_format: str = "int"  # or fp8_e4m3 / fp8_e5m2 (symmetric, scale = observed amax / max element)

    def __post_init__(self):
        if self.act_format == "int":
            check_act_bits(self.act_bits, self.act_symmetric)
        else:  # a format is symmetric: the default act_symmetric = false gives way
            object.__setattr__(self, "act_symmetric", True)
            object.__setattr__(self, "act_bits", check_act_format(self.act_format, self.act_bits, True,
                                                                  "act_format", STATIC_FORMATS))
            if self.observer == "mse":
                raise ValueError(f"static: observer 'mse' searches integer grids; act_format {self.act_format!r} "
                                 f"takes {', '.join(o for o in RANGE_OBSERVERS if o != 'mse')}")
        check_choice("act_granularity", self.act_granularity, ACT_GRANULARITIES)
        check_choice("observer", self.observer, RANGE_OBSERVERS)
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 50 < p <= 100:
            raise ValueError(f"percentile must be a number in (50, 100], got {p!r}")
        object.__setattr__(self, "base", as_weight_base(self.base, "static"))


def observer_factory(config: StaticConfig) -> Callable[[str], Observer]:
    """name -> a fresh observer for that module's activations, as the config asks."""
    per_channel = config.act_granularity == "channel"
    extra = {
        "minmax": {},
        "moving_average": {},
        "percentile": {"percentile": config.percentile},
        "mse": {"bits": config.act_bits, "symmetric": config.act_symmetric},
    }.get(config.observer, {"bits": config.act_bits, "symmetric": config.act_symmetric})  # registered ones: all

    def make(name: str) -> Observer:
        where = {} if config.observer == "minmax" else {"where": name}  # MinMaxObserver takes no `where`
        return make_observer(config.observer, per_channel=per_channel, **extra, **where)

    return make


def observe_activations(
    model: nn.Module, batches, factory: Callable[[str], Observer], progress: bool = True,
) -> dict[str, Observer]:
    """One calibration loop with an observer on what each QuantLinear's act_quant would see.

    The observers hook a temporary nn.Identity in the act_quant slot, so they see the input
    after QuantLinear.input_scale. Returns {module name: observer}; export with
    observers.export_stats(result).
    """
    layers = quant_linears(model)
    if not layers:
        raise ValueError("static: the model has no QuantLinear layers to observe")
    for layer in layers.values():
        layer.act_quant = nn.Identity()
    try:
        observers, remove = attach_input_observers({n: m.act_quant for n, m in layers.items()}, factory)
        try:
            run_calibration(model, batches, desc="observe activations", progress=progress)
        finally:
            remove()
    finally:
        for layer in layers.values():
            layer.act_quant = None
    return observers


def observed_range(name: str, observer: Observer) -> tuple[torch.Tensor, torch.Tensor]:
    """observer.range(), with errors (no data, NaN/Inf) naming the module."""
    try:
        return observer.range()
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if name in msg else f"{name}: {msg}") from None


def set_static_act_quant(model: nn.Module, observers: dict[str, Observer], bits: int, symmetric: bool,
                         format: str = "int") -> dict:
    """Give every observed QuantLinear a StaticActQuant covering its observer's range.

    Returns a summary of the ranges for the result row: the largest max(|lo|, |hi|) over layers, its
    layer, and the median over layers (a per-tensor static grid spends its codes on the largest value)."""
    absmax = {}
    for name, layer in quant_linears(model).items():
        if name not in observers:
            raise ValueError(f"static: no activation statistics for {name}")
        lo, hi = observed_range(name, observers[name])
        layer.act_quant = StaticActQuant.from_range(lo, hi, bits, symmetric, format)
        absmax[name] = float(torch.maximum(lo.abs().max(), hi.abs().max()))
    top = max(absmax, key=absmax.get)
    return {"static_range_absmax_max": absmax[top], "static_range_absmax_max_layer": top,
            "static_range_absmax_median": float(torch.tensor(list(absmax.values())).median())}


@register_method
class Static(Method):
    name = "static"
    config_cls = StaticConfig
    needs_calibration = True
    quantizes_activations = True

    def describe(self, config: StaticConfig, dtype: str = "float32") -> str:
        act = f"a{config.act_bits}" if config.act_format == "int" else f"a-{config.act_format}"
        kind = f"static {config.act_granularity} {config.observer}"
        return f"{get_method(config.base).describe(config.base, dtype)} + {act} {kind}"

    def prepare(self, model, config: StaticConfig) -> None:
        get_method(config.base).prepare(model, config.base)

    def calibrate(self, model, config: StaticConfig, batches, progress: bool = True) -> dict | None:
        batches = batches if isinstance(batches, (list, tuple)) else list(batches)
        diagnostics = None
        if needs_calibration(config.base):
            diagnostics = get_method(config.base).calibrate(model, config.base, batches, progress)
        # weights are final after the base's calibrate (fake-quant forward == frozen forward), so the
        # ranges observed here are those the converted model's activations will have
        observers = observe_activations(model, batches, observer_factory(config), progress)
        ranges = set_static_act_quant(model, observers, config.act_bits, config.act_symmetric, config.act_format)
        return {**(diagnostics or {}), **ranges}

    def convert(self, model, config: StaticConfig) -> None:
        missing = [n for n, m in quant_linears(model).items() if not isinstance(m.act_quant, StaticActQuant)]
        if missing:
            raise ValueError(f"static: calibrate() must run before convert(); no activation qparams for {missing[0]}")
        get_method(config.base).convert(model, config.base)
