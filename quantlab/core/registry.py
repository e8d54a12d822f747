"""The method registry: a name and a frozen config class joined to a Method.

Loud by design: unknown or duplicate names fail, listing the known ones.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Iterable

import torch
from torch import nn

from .qlinear import WeightSpec

_METHODS: dict[str, "Method"] = {}


@dataclasses.dataclass(frozen=True)
class LayerSelection:
    """Which linears a method touches, by module-name globs (fnmatch)."""

    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        for field in ("include", "exclude"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{field} must be a list of name globs, got {value!r}")
            object.__setattr__(self, field, tuple(value))

    def matches(self, name: str) -> bool:
        hit = any(fnmatch.fnmatchcase(name, p) for p in self.include)
        return hit and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)


class Method:
    """One quantization method: prepare -> calibrate -> (train) -> convert.

    Subclasses set `name`, `config_cls` and `needs_calibration`, and override
    the phases they need. Each phase mutates the model in place.
    """

    name: str = ""
    config_cls: type = object
    needs_calibration: bool = False
    # bumped when what a config computes by default changes (e.g. AWQ made reference-exact), so result
    # rows of the old behaviour are not reused for the new one (it enters the run key when > 1)
    version: int = 1
    baseline: bool = False  # the unquantized model every row is compared with (method "none")
    quantizes_activations: bool = False  # fake-quantizes linear inputs (dynamic / static / smoothquant)

    # ---- capabilities: what code outside the registry asks instead of a method's name -------------------

    def streams_blocks(self, config: Any) -> bool:
        """Whether every tensor it writes is written inside its block walk, between the walker's enter_block and
        leave_block (calibration/streaming.py): its run may then quantize a copy that shares the float model's
        blocks until it reaches each, and freeze each block as it leaves it."""
        return False

    def folds_channel_scales(self, config: Any) -> bool:
        """Whether it folds per-input-channel scales into the weights (AWQ, SmoothQuant): an online rotation of
        every linear's input would rotate channels the scales were fitted to."""
        return False

    def folds_scales_across_mlp(self, config: Any) -> bool:
        """Whether some of those scales sit between up_proj and down_proj (AWQ; SmoothQuant with
        smooth_linear_inputs): an online Hadamard on down_proj's input (rotation R4) would not let them cancel."""
        return False

    def folds_scales_between_linears(self, config: Any) -> bool:
        """Whether some of its scales sit between a linear and the next (v_proj -> o_proj as well as up_proj ->
        down_proj): an online Hadamard on o_proj's input (rotation o_proj_hadamard) would not let them cancel. The
        built-in methods fold both pairs or neither, so this defaults to folds_scales_across_mlp."""
        return self.folds_scales_across_mlp(config)

    def keeps_float_adapters(self, config: Any) -> bool:
        """Whether the converted model keeps float modules beside its quantized linears (LoRA adapters, unmerged):
        an export of quantized linears alone would drop them."""
        return False

    def check_model_config(self, config: Any, model_config: Any) -> None:
        """Refuse (ValueError) a model this config cannot apply to, from its Hugging Face config alone: runs before
        any weights load (runs/preflight.py). An imported checkpoint must be the model's architecture."""

    def weight_spec_for(self, config: Any) -> WeightSpec | None:
        """The grid its weights end on: the config's own weight_spec, else its base's (None: weights stay float)."""
        spec = getattr(config, "weight_spec", None)
        if isinstance(spec, WeightSpec):
            return spec
        base = getattr(config, "base", None)
        return get_method(base).weight_spec_for(base) if base is not None else None

    def grid_for(self, config: Any) -> dict | None:
        """The row's grid columns (bits, group_size, symmetric, format) where no single weight spec says them: a
        method whose layers take a mix of grids (a llama.cpp recipe) names the mix. None: from weight_spec_for."""
        return None

    def act_bits_for(self, config: Any) -> int | None:
        """Bits of its activation codes (the config's act_bits, else its base's), None where activations stay
        float."""
        if self.quantizes_activations and isinstance(getattr(config, "act_bits", None), int):
            return config.act_bits
        base = getattr(config, "base", None)
        return get_method(base).act_bits_for(base) if base is not None else None

    def describe(self, config: Any, dtype: str = "float32") -> str:
        """What it quantizes, for the report's scheme column: "w4 g64 asym", "w8 channel sym + a8 dynamic", ...
        Methods built on a base add their part to the base's text (QAT: " + QAT LSQ")."""
        own = getattr(config, "weight_spec", None)
        if isinstance(own, WeightSpec):  # per-layer overrides (core/overrides.py): the base grid is not the whole story
            n = len(getattr(config, "overrides", ()) or ())
            return own.describe() + (f" + {n} overrides" if n else "")
        base = getattr(config, "base", None)
        return get_method(base).describe(base, dtype) if base is not None else dtype

    def needs_calibration_for(self, config: Any) -> bool:
        """Whether this config needs calibration data (methods built on a base defer to it)."""
        return self.needs_calibration

    def prepare(self, model: nn.Module, config: Any) -> None:
        pass

    def calibrate(self, model: nn.Module, config: Any, batches: Iterable[torch.Tensor],
                  progress: bool = True) -> dict | None:
        """Use the calibration batches; may return diagnostics for the row (keys prefixed with the method's
        name, e.g. {"gptq_damp_max": 0.01}). progress=False silences every progress bar."""
        return None

    def convert(self, model: nn.Module, config: Any) -> dict | None:
        """Freeze to the deployed form; may return diagnostics for the row, as calibrate() (keys prefixed with
        the method's name, e.g. {"lora_adapter_bytes": ...})."""
        return None

    def needs_training_for(self, config: Any) -> bool:
        """Whether this config has a train phase (QAT) between calibrate and convert."""
        return False

    def needs_teacher_for(self, config: Any) -> bool:
        """Whether train() needs the unquantized model (distillation)."""
        return False

    def train(self, model: nn.Module, config: Any, data: Any, teacher: nn.Module | None = None,
              checkpoint_dir: Any = None, progress: bool = True) -> dict:
        """Fine-tune the prepared, calibrated model in place; returns train_* stats for the row."""
        return {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: make a Method available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _METHODS:
        raise ValueError(f"method {cls.name!r} is already registered")
    _METHODS[cls.name] = cls()
    return cls


def known_methods() -> list[str]:
    return sorted(_METHODS)


def get_method(name_or_config: Any) -> Method:
    """Look a method up by name or by an instance of its config class."""
    if isinstance(name_or_config, str):
        if name_or_config not in _METHODS:
            raise KeyError(f"unknown method {name_or_config!r}; known: {', '.join(known_methods())}")
        return _METHODS[name_or_config]
    for method in _METHODS.values():
        if type(name_or_config) is method.config_cls:
            return method
    raise KeyError(f"no method registered for config {type(name_or_config).__name__}; known: {', '.join(known_methods())}")


def field_defaults(cls) -> dict[str, Any]:
    """Field name -> default of a dataclass, for the fields that have one (factories called)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def non_default_fields(obj) -> dict:
    """A dataclass's fields that differ from their defaults (nested dataclasses likewise), as plain data.

    Run keys hash this, so adding a field with a default to a config or protocol never
    changes the key of a run that does not set it (finished rows stay finished).
    """
    out, defaults = {}, field_defaults(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in defaults and value == defaults[f.name]:
            continue
        out[f.name] = non_default_fields(value) if dataclasses.is_dataclass(value) else value
    return out


def method_versions(config: Any) -> dict[str, int]:
    """{method name: version} of a config and every nested config (a `base`), for methods past version 1."""
    out = {}
    method = get_method(config)
    if method.version != 1:
        out[method.name] = method.version
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            try:
                out.update(method_versions(value))
            except KeyError:  # a nested dataclass that is not a method config
                continue
    return out


def config_fields(method_name: str) -> dict[str, Any]:
    """Field name -> default for a method's config (None when required; for `quantlab list`)."""
    cls = get_method(method_name).config_cls
    defaults = field_defaults(cls)
    return {f.name: defaults.get(f.name) for f in dataclasses.fields(cls)}


def make_config(spec: dict[str, Any]) -> Any:
    """Build a validated config from a plain dict with a 'method' key.

    >>> make_config({"method": "rtn", "bits": 4, "group_size": 64})
    """
    spec = dict(spec)
    if "method" not in spec:
        raise ValueError(f"config has no 'method' key; known methods: {', '.join(known_methods())}")
    method = get_method(spec.pop("method"))
    fields = {f.name for f in dataclasses.fields(method.config_cls)}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(map(repr, unknown))} for method {method.name!r}; "
            f"valid: {', '.join(sorted(fields))}"
        )
    return method.config_cls(**spec)


def as_config(value: Any, field: str = "base") -> Any:
    """A nested config given as a dict (from TOML) or as a config object -> config object.

    For methods built on other methods: SmoothQuantConfig(base={"method": "dynamic", ...}).
    """
    if isinstance(value, dict):
        try:
            return make_config(value)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{field}: {e.args[0] if e.args else e}") from None
    get_method(value)  # raises for a non-config
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """Inverse of make_config: plain, TOML/JSON-friendly dict (tuples become lists, nested configs dicts)."""
    d = {"method": get_method(config).name}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, tuple):  # items with to_dict (per-layer overrides) become plain tables
            v = [x.to_dict() if hasattr(x, "to_dict") else x for x in v]
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = config_to_dict(v)
        d[f.name] = v
    return d


def is_baseline(name: str) -> bool:
    """Whether the method called `name` (e.g. a result row's `method`) is the unquantized baseline; unknown names
    (rows of a method no longer registered) are not."""
    return name in _METHODS and _METHODS[name].baseline


def nested_configs(config: Any):
    """A method config and every config nested in it (`base`), outermost first."""
    while config is not None:
        yield config
        config = getattr(config, "base", None)


# ---- helpers for methods built on other methods -------------------------------------------

def quantizes_activations(method: Method) -> bool:
    return method.quantizes_activations


def needs_calibration(config: Any) -> bool:
    """Whether `config` needs calibration data (its method may defer to its own base)."""
    return get_method(config).needs_calibration_for(config)


def as_weight_base(value: Any, owner: str) -> Any:
    """A weight-only base config (dict from TOML or config object), or a ValueError listing the valid methods.

    A method that trains (qat) is no weight base either: the owner runs only prepare / calibrate /
    convert of its base, so the training would be skipped while the row still says QAT. Training goes
    outside: method = "qat" with base = {method = "<owner>", base = {...}}.
    """
    config = as_config(value, "base")
    method = get_method(config)
    if method.needs_training_for(config):
        raise ValueError(
            f"{owner}: base {method.name!r} would never be trained ({owner} runs only its base's prepare, "
            f"calibrate and convert), yet the row would be labelled {method.name.upper()}; to train, put {owner} "
            f"inside instead: method = \"{method.name}\" with base = {{method = \"{owner}\", "
            f"base = {{method = \"gptq\", bits = 4, ...}}}} (W4A8) and the {method.name} fields (steps, lr, ...) beside it"
        )
    if method.baseline or quantizes_activations(method):
        raise ValueError(f"{owner}: base must be a weight quantization method ({', '.join(_weight_bases())}), "
                         f"got {method.name!r}")
    return config


def _weight_bases() -> list[str]:
    """Methods a dynamic / static base may name: they quantize weights only and do not train."""
    out = []
    for name in known_methods():
        method = get_method(name)
        if method.baseline or quantizes_activations(method):
            continue
        try:
            trains = method.needs_training_for(method.config_cls())
        except (TypeError, ValueError):  # a config without defaults: assume it does not train
            trains = False
        if not trains:
            out.append(name)
    return out
