"""`none`: the unquantized baseline (the model is left as loaded)."""
from dataclasses import dataclass

from ..core.registry import Method, register_method


@dataclass(frozen=True)
class NoneConfig:
    """No quantization; the row every report compares against."""


@register_method
class NoMethod(Method):
    name = "none"
    config_cls = NoneConfig
    baseline = True
