"""`rtn`: round-to-nearest weight-only quantization with min-max scales.

The baseline every calibrated method must beat: no data, one pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..api import quant_linears, select_linears, set_submodule
from ..qlinear import QuantLinear, WeightSpec
from ..registry import LayerSelection, Method, register_method


@dataclass(frozen=True)
class RTNConfig:
    """bits 2..8; group_size None = per output channel; symmetric or asymmetric (zero point)."""

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str = "float16"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)
        self.weight_spec  # validates bits / group_size / scale_dtype

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, self.symmetric, self.scale_dtype)

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)


def swap_in_quant_linears(model: nn.Module, selection: LayerSelection, spec: WeightSpec) -> list[str]:
    """Replace selected nn.Linear modules by fake-quant QuantLinear; returns their names."""
    chosen = select_linears(model, selection)
    for name, linear in chosen:
        set_submodule(model, name, QuantLinear.from_linear(linear, spec))
    return [n for n, _ in chosen]


def freeze_all(model: nn.Module) -> None:
    for layer in quant_linears(model).values():
        layer.freeze()


@register_method
class RTN(Method):
    name = "rtn"
    config_cls = RTNConfig

    def prepare(self, model, config: RTNConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec)

    def convert(self, model, config: RTNConfig) -> None:
        freeze_all(model)
