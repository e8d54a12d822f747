"""Run extras: what a run changes beside its method. A rotation, a quantized KV cache and a quantized embedding are
not quantization methods; each is a RunExtra, keyed by the run table's key, joined to a frozen config class.

    [[run]]
    name = "gptq-w4-rot-kv4"
    method = "gptq"
    bits = 4
    rotation = { r4 = false }                 # extras/rotation.py:  before the method quantizes
    kv_cache = { bits = 4, group_size = 64 }  # extras/kv_cache.py:  around the evaluation, removed after

Every place that handles extras loops over the run's `extras` tuple ((RunExtra, config) pairs in registry
order), never over their names: parsing (`parse`), run keys and TOML (`to_dict`), the report's scheme
(`describe`), the backends' refusals (`refusal`), composition checks (`check`) and the runner, which enters
`apply(model, config)` for each extra at its `stage` and leaves every context when the run's evaluation is done.

    @register_extra
    class MyExtra(RunExtra):
        key = "my_extra"; config_cls = MyExtraConfig; stage = AFTER_EXPORT
        @contextmanager
        def apply(self, model, config):
            handle = install(model, config)
            try:
                yield {"my_extra": self.describe(config)}   # fields for the result row
            finally:
                handle.remove()
"""
from __future__ import annotations

import abc
import dataclasses
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

BEFORE_QUANTIZE = "before_quantize"  # on the float model copy, before calibration (the method sees the result)
AFTER_EXPORT = "after_export"  # on the quantized (and exported) model, around its evaluation
STAGES = (BEFORE_QUANTIZE, AFTER_EXPORT)
METRICS = ("perplexity", "embedding")

_EXTRAS: dict[str, "RunExtra"] = {}


class RunExtra(abc.ABC):
    """One kind of run extra. Subclasses set `key`, `config_cls` and `stage`, and define `apply`.

    `metrics`: the [eval] metrics it applies to. `replayed_in_isolation`: whether the isolated memory probe (a fresh
    process that reloads the saved model, eval/memprobe.py) reproduces it; none does yet.
    """

    key: str = ""
    config_cls: type = object
    stage: str = AFTER_EXPORT
    metrics: tuple[str, ...] = METRICS
    replayed_in_isolation: bool = False

    def parse(self, table: Any) -> Any:
        """The run's `<key> = {...}` table (or a config object) -> its config; unknown keys named with the valid."""
        if isinstance(table, self.config_cls):
            return table
        if not isinstance(table, dict):
            raise ValueError(f"{self.key} must be a table, e.g. {self.key} = {{...}}, got {table!r}")
        names = [f.name for f in dataclasses.fields(self.config_cls)]
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise ValueError(f"{self.key}: unknown key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(names)}")
        return self.config_cls(**table)

    def needs_calibration_for(self, config: Any) -> bool:
        """Whether apply() learns from calibration windows (SpinQuant's rotation): the runner then passes
        apply(model, config, calibration=[(1, T) windows], method_config=the run's method config)."""
        return False

    def parse_stored(self, table: dict) -> Any:
        """A stored run config's table (to_dict's form, maybe written by an older version) -> its config. An extra
        whose default changed overrides this, so rows of the old default keep their meaning."""
        return self.parse(table)

    def to_dict(self, config: Any) -> dict:
        """Plain data for run keys, result rows and TOML; parse(to_dict(c)) == c."""
        return config.to_dict() if hasattr(config, "to_dict") else dataclasses.asdict(config)

    def describe(self, config: Any) -> str:
        """A short label for the report's scheme column, e.g. "kv4 g64 asym"."""
        return config.describe() if hasattr(config, "describe") else self.key

    def refusal(self, config: Any, backend: str) -> str | None:
        """Why `backend` cannot evaluate a model with this extra, or None when it can."""
        return None

    def check(self, config: Any, method_config: Any, backend: str) -> None:
        """Raise ValueError when the extra does not compose with the run's method (ask its capabilities)."""

    def check_model_config(self, config: Any, model_config: Any) -> None:
        """Raise ValueError when the model cannot take the extra, judged from its Hugging Face config alone (run
        before any weights load: runs/preflight.py)."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, config: Any) -> AbstractContextManager[dict]:
        """A context manager (decorate it with contextlib.contextmanager) that changes `model` in place for the run
        and yields the fields it adds to the result row; on exit it undoes what can be undone (hooks, attention
        functions); weight changes stay, as the run's model is a copy."""


def register_extra(cls: type[RunExtra]) -> type[RunExtra]:
    """Class decorator: make a RunExtra available under its `key` (a run-table key)."""
    if not cls.key or not isinstance(cls.key, str):
        raise ValueError(f"run extra {cls.__name__} has no key")
    if cls.stage not in STAGES:
        raise ValueError(f"run extra {cls.key!r}: stage {cls.stage!r} unknown; known: {', '.join(STAGES)}")
    if cls.key in _EXTRAS:
        raise ValueError(f"run extra {cls.key!r} is already registered (by {type(_EXTRAS[cls.key]).__module__})")
    _EXTRAS[cls.key] = cls()
    return cls


def known_extras() -> list[str]:
    """Keys in registry order (the order extras of one stage apply in)."""
    return list(_EXTRAS)


def get_extra(key: str) -> RunExtra:
    if key not in _EXTRAS:
        raise KeyError(f"unknown run extra {key!r}; known: {', '.join(known_extras())}")
    return _EXTRAS[key]


def parse_extras(tables: dict[str, Any]) -> tuple[tuple[RunExtra, Any], ...]:
    """{key: table or config} -> ((extra, config), ...) in registry order; None values are left out."""
    unknown = sorted(set(tables) - set(_EXTRAS))
    if unknown:
        raise ValueError(f"unknown run extra(s) {', '.join(map(repr, unknown))}; known: {', '.join(known_extras())}")
    return tuple((extra, extra.parse(tables[key])) for key, extra in _EXTRAS.items() if tables.get(key) is not None)


def extras_to_dict(extras) -> dict[str, dict]:
    """((extra, config), ...) -> {key: plain dict}: the form run keys, rows and TOML files hold."""
    return {extra.key: extra.to_dict(config) for extra, config in extras}


def describe_extras(cfg: dict) -> list[str]:
    """Labels of the extras a stored run config (its JSON form) holds, in registry order; an extra no longer known
    or whose stored table no longer parses is named by its key."""
    out = []
    for key, extra in _EXTRAS.items():
        if cfg.get(key) is None:
            continue
        try:
            out.append(extra.describe(extra.parse_stored(cfg[key])))
        except (TypeError, ValueError):
            out.append(key)
    return out
