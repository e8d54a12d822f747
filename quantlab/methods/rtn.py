"""`rtn`: round-to-nearest weight-only quantization with min-max scales.

The baseline every calibrated method must beat: no data, one pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.overrides import LayerOverride, parse_overrides, spec_for
from ..core.qlinear import WeightSpec
from ..core.registry import LayerSelection, Method, register_method


@dataclass(frozen=True)
class RTNConfig:
    """bits 2..8; group_size None = per output channel; symmetric or asymmetric (zero point).

    format: "int" (the integer grid) or a number format of core/formats.py (fp8_e4m3, nf4, mxfp4, nvfp4, ...),
    which fixes bits (and MX / NVFP4 their block size); double_quant: NF4's double-quantized absmax.
    scale_dtype None: the format's own (int float16, fp8 / nf4 float32).

    overrides: per-layer grids by name glob, later matches win (see quantlab/core/overrides.py).
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str | None = None
    format: str = "int"
    double_quant: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)
    overrides: tuple[LayerOverride, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)
        object.__setattr__(self, "overrides", parse_overrides(self.overrides))
        spec = self.weight_spec  # validates; a format fills in its bits / block, a default scale_dtype reads None
        for field in ("bits", "group_size", "scale_dtype"):
            object.__setattr__(self, field, getattr(spec, field))

    def spec_for(self, name: str) -> WeightSpec:
        """The grid of layer `name`: weight_spec with the matching overrides applied."""
        return spec_for(self.weight_spec, self.overrides, name)

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, self.symmetric, self.scale_dtype, self.format, self.double_quant)

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)


@register_method
class RTN(Method):
    name = "rtn"
    config_cls = RTNConfig

    def prepare(self, model, config: RTNConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec, config.overrides)

    def convert(self, model, config: RTNConfig) -> None:
        freeze_all(model)
