"""Per-layer overrides of a weight grid, matched by module-name glob (fnmatch).

An RTN-family config (rtn, gptq, the `base` of awq / dynamic / static) carries an
`overrides` list; each entry names a glob `pattern` and any of bits, group_size,
symmetric, scale_dtype, format, double_quant (a new format starts from its own bits / block). Every override whose pattern matches a layer's name is applied
in order, field by field, so **later matches win** (write general rules first, then
exceptions). Fields an override leaves out keep the value set so far (the config's own
grid, or an earlier match). `group_size = "channel"` means per output channel (TOML has
no null to say group_size = None).

    [[run]]
    name = "w4-g64-keep-edges-8bit"
    method = "rtn"
    bits = 4
    group_size = 64
    overrides = [
      { pattern = "model.layers.0.mlp.down_proj", bits = 8, group_size = "channel" },
      { pattern = "model.layers.29.mlp.down_proj", bits = 8, group_size = "channel" },
    ]

A pattern that matches no quantized layer is an error when the model is prepared
(a typo would otherwise silently quantize everything at the base grid).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable

from .qlinear import WeightSpec

CHANNEL = "channel"
OVERRIDE_KEYS = ("pattern", "bits", "group_size", "symmetric", "scale_dtype", "format", "double_quant")


@dataclass(frozen=True)
class LayerOverride:
    """One rule: layers whose name matches `pattern` get the fields that are set (None = keep)."""

    pattern: str
    bits: int | None = None
    group_size: int | str | None = None  # None: keep; "channel": per output channel; int: group size
    symmetric: bool | None = None
    scale_dtype: str | None = None
    format: str | None = None  # e.g. "nf4": the layer gets that format's bits / block unless set here too
    double_quant: bool | None = None

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"pattern must be a non-empty module-name glob, got {self.pattern!r}")
        if all(getattr(self, k) is None for k in OVERRIDE_KEYS[1:]):
            raise ValueError(f"override {self.pattern!r} sets nothing; set one of {', '.join(OVERRIDE_KEYS[1:])}")
        g = self.group_size
        if g is not None and g != CHANNEL and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise ValueError(f"override {self.pattern!r}: group_size must be a positive integer or "
                             f"'{CHANNEL}' (per output channel), got {g!r}")
        if self.symmetric is not None and not isinstance(self.symmetric, bool):
            raise ValueError(f"override {self.pattern!r}: symmetric must be true or false, got {self.symmetric!r}")
        try:
            self.apply(WeightSpec())  # WeightSpec validates bits / scale_dtype
        except ValueError as e:
            raise ValueError(f"override {self.pattern!r}: {e}") from None

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def apply(self, spec: WeightSpec) -> WeightSpec:
        changes = {k: getattr(self, k) for k in OVERRIDE_KEYS[1:] if getattr(self, k) is not None}
        if changes.get("group_size") == CHANNEL:
            changes["group_size"] = None
        if "format" in changes and changes["format"] != spec.format:  # a new format starts from its own defaults
            return WeightSpec(**{"symmetric": spec.symmetric if changes["format"] == "int" else True, **changes})
        return dataclasses.replace(spec, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that are set (TOML-friendly: no None)."""
        return {k: getattr(self, k) for k in OVERRIDE_KEYS if getattr(self, k) is not None}


def parse_overrides(value: Any) -> tuple[LayerOverride, ...]:
    """A list of dicts (from TOML) or LayerOverride objects -> a tuple of LayerOverride.

    >>> parse_overrides([{"pattern": "*.down_proj", "bits": 8}])
    """
    if isinstance(value, (str, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"overrides must be a list of tables like {{pattern = \"*.down_proj\", bits = 8}}, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, LayerOverride):
            out.append(item)
            continue
        if not isinstance(item, dict):
            raise ValueError(f"overrides[{i}] must be a table with a 'pattern', got {item!r}")
        unknown = sorted(set(item) - set(OVERRIDE_KEYS))
        if unknown:
            raise ValueError(f"overrides[{i}]: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"valid: {', '.join(OVERRIDE_KEYS)}")
        if "pattern" not in item:
            raise ValueError(f"overrides[{i}] has no 'pattern' (a module-name glob such as 'model.layers.0.*')")
        try:
            out.append(LayerOverride(**item))
        except ValueError as e:
            raise ValueError(f"overrides[{i}]: {e}") from None
    return tuple(out)


def spec_for(base: WeightSpec, overrides: Iterable[LayerOverride], name: str) -> WeightSpec:
    """The grid of layer `name`: base, then every matching override in order (later wins)."""
    spec = base
    for rule in overrides:
        if rule.matches(name):
            spec = rule.apply(spec)
    return spec


def check_overrides_match(overrides: Iterable[LayerOverride], names: list[str]) -> None:
    """Every pattern must match at least one of the quantized layers `names`."""
    for rule in overrides:
        if not any(rule.matches(n) for n in names):
            examples = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ValueError(f"override pattern {rule.pattern!r} matches no quantized layer; "
                             f"the {len(names)} quantized layers are named like: {examples}")
