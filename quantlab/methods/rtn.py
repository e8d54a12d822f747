"""`rtn`: round-to-nearest weight-only quantization with min-max scales.

The baseline every calibrated method must beat: no data, one pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..api import quant_linears, select_linears, set_submodule
from ..overrides import LayerOverride, check_overrides_match, parse_overrides, spec_for
from ..qlinear import QuantLinear, WeightSpec
from ..registry import LayerSelection, Method, register_method


@dataclass(frozen=True)
class RTNConfig:
    """bits 2..8; group_size None = per output channel; symmetric or asymmetric (zero point).

    overrides: per-layer grids by name glob, later matches win (see quantlab/overrides.py).
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str = "float16"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)
    overrides: tuple[LayerOverride, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)
        object.__setattr__(self, "overrides", parse_overrides(self.overrides))
        self.weight_spec  # validates bits / group_size / scale_dtype

    def spec_for(self, name: str) -> WeightSpec:
        """The grid of layer `name`: weight_spec with the matching overrides applied."""
        return spec_for(self.weight_spec, self.overrides, name)

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, self.symmetric, self.scale_dtype)

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)


def swap_in_quant_linears(
    model: nn.Module, selection: LayerSelection, spec: WeightSpec, overrides: tuple[LayerOverride, ...] = (),
) -> list[str]:
    """Replace selected nn.Linear modules by fake-quant QuantLinear (grid: spec + matching overrides);
    returns their names. An override matching no selected layer is an error."""
    chosen = select_linears(model, selection)
    check_overrides_match(overrides, [n for n, _ in chosen])
    for name, linear in chosen:
        set_submodule(model, name, QuantLinear.from_linear(linear, spec_for(spec, overrides, name)))
    return [n for n, _ in chosen]


def freeze_all(model: nn.Module) -> None:
    for layer in quant_linears(model).values():
        layer.freeze()


@register_method
class RTN(Method):
    name = "rtn"
    config_cls = RTNConfig

    def prepare(self, model, config: RTNConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec, config.overrides)

    def convert(self, model, config: RTNConfig) -> None:
        freeze_all(model)
