"""The grid a run's weights (and activations) end on, as result-row columns: asked of the method, a base included.

>>> grid_fields(make_config({"method": "dynamic", "base": {"method": "gptq", "bits": 4, "group_size": 64}}))
{'bits': 4, 'group_size': 64, 'symmetric': True, 'format': 'int', 'act_bits': 8}
"""
from __future__ import annotations

from typing import Any

from .registry import get_method

GRID_FIELDS = ("bits", "group_size", "symmetric", "format", "act_bits")  # result-row columns, from grid_fields()
DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def grid_fields(config: Any, dtype: str = "float32") -> dict:
    """The grid a run's weights (and activations) end on, as result-row columns: bits, group_size (None: per
    output channel), symmetric, format, act_bits (None: float activations). From the effective weight grid, a
    `base` included, so an AWQ or W8A8 row says its bits too; weights left float say the dtype's bits and name.

    >>> grid_fields(make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 64}}))
    {'bits': 4, 'group_size': 64, 'symmetric': True, 'format': 'int', 'act_bits': None}
    """
    method = get_method(config)
    spec = method.weight_spec_for(config)
    mix = method.grid_for(config)
    if mix is not None:
        weights = mix
    elif spec is None:
        weights = {"bits": DTYPE_BITS.get(dtype), "group_size": None, "symmetric": None, "format": dtype}
    else:
        weights = {"bits": spec.bits, "group_size": spec.group_size, "symmetric": spec.symmetric,
                   "format": spec.format}
    return weights | {"act_bits": method.act_bits_for(config)}
