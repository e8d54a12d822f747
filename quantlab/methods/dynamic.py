"""`dynamic`: weight quantization by a base method + dynamic per-token activation quantization.

With the defaults this is W8A8 dynamic: int8 per-channel symmetric weights (RTN) and
int8 per-token symmetric activations whose scales are computed on the fly.

    [[run]]
    name = "w4a8-gptq"
    method = "dynamic"
    base = {method = "gptq", bits = 4, group_size = 64}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.activations import DynamicActQuant, attach_act_quant, check_act_format
from ..core.registry import Method, as_weight_base, get_method, needs_calibration, register_method
from .rtn import RTNConfig


@dataclass(frozen=True)
class DynamicConfig:
    """act_bits 4..8, per-token; base: the weight method's config (default RTN int8 per-channel sym).

    act_format: "int", or a number format (core/formats.py): fp8_e4m3 / fp8_e5m2 per token, MX formats per
    block of 32, nvfp4 per block of 16 (W4A4 in MXFP4 / NVFP4); a format fixes act_bits.
    """

    act_bits: int = 8
    act_symmetric: bool = True
    base: Any = RTNConfig(bits=8)
    act_format: str = "int"

    def __post_init__(self):
        object.__setattr__(self, "act_bits", check_act_format(self.act_format, self.act_bits, self.act_symmetric))
        object.__setattr__(self, "base", as_weight_base(self.base, "dynamic"))


@register_method
class Dynamic(Method):
    """prepare / calibrate / convert delegate to the base method; convert then adds DynamicActQuant.
    Needs calibration data exactly when the base does (e.g. gptq)."""

    name = "dynamic"
    config_cls = DynamicConfig
    needs_calibration = False
    quantizes_activations = True

    def needs_calibration_for(self, config: DynamicConfig) -> bool:
        return needs_calibration(config.base)

    def describe(self, config: DynamicConfig, dtype: str = "float32") -> str:
        act = f"a{config.act_bits}" if config.act_format == "int" else f"a-{config.act_format}"
        return f"{get_method(config.base).describe(config.base, dtype)} + {act} dynamic"

    def prepare(self, model, config: DynamicConfig) -> None:
        get_method(config.base).prepare(model, config.base)

    def calibrate(self, model, config: DynamicConfig, batches, progress: bool = True) -> dict | None:
        if needs_calibration(config.base):
            return get_method(config.base).calibrate(model, config.base, batches, progress)
        return None

    def convert(self, model, config: DynamicConfig) -> None:
        get_method(config.base).convert(model, config.base)
        attach_act_quant(model, lambda name: DynamicActQuant(config.act_bits, config.act_symmetric, config.act_format), self.name)
