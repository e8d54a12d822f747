"""`qat`: quantization-aware training on top of a PTQ base config.

    [[run]]
    name = "gptq-qat-w3-g64"
    method = "qat"
    base = {method = "gptq", bits = 3, group_size = 64, symmetric = false}
    learn_scales = true          # LSQ scales (+ zero points); false = plain STE, qparams fixed
    steps = 16
    lr = 2e-5

Lifecycle: prepare = the base's prepare, with every QuantLinear made a QATLinear;
calibrate = the base's (GPTQ / AWQ / static ranges: "PTQ then QAT"); train = fake-quant
fine-tuning (quantlab/qat/train.py) of the quantized layers' weights and, with learn_scales, of
LSQ scales and zero points initialised from the base's qparams; convert = fix the learned
qparams, then the base's convert, so the result holds the same packed integer codes + scales
(+ activation quantizers) a PTQ run of the base produces, with outputs equal to the
fake-quant model's.

Activations: a `dynamic` base's per-token quantizers are attached for training (per-token scales
come from the data; nothing to learn, gradients pass straight through); a `static` base's
calibrated scales are learned with LSQ when learn_scales is set.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from ..core.activations import DynamicActQuant, StaticActQuant
from ..core.lifecycle import quant_linears, set_submodule
from ..core.primitives import QParams
from ..core.registry import Method, as_config, config_to_dict, get_method, needs_calibration, register_method
from ..qat.modules import LearnedStaticActQuant, LearnedWeightQuant, QATLinear, bake
from ..qat.settings import TrainSettings
from ..qat.train import train
from .rtn import RTNConfig

QAT_BASES = ("awq", "dynamic", "gptq", "hqq", "rtn", "static")  # methods whose QuantLinear layers exist after prepare()
_S = TrainSettings  # defaults below are TrainSettings' own


@dataclass(frozen=True)
class QATConfig:
    """base: any rtn / gptq / awq / dynamic / static config; learn_scales: LSQ (true) or plain STE (false);
    the rest are TrainSettings (steps, batch_size, seq_len, lr, scale_lr, ..., dtype, checkpoint_every, seed)."""

    base: Any = RTNConfig(bits=4, group_size=64, symmetric=False)
    learn_scales: bool = True
    steps: int = _S.steps
    batch_size: int = _S.batch_size
    seq_len: int = _S.seq_len
    lr: float = _S.lr
    scale_lr: float = _S.scale_lr
    weight_decay: float = _S.weight_decay
    warmup_steps: int = _S.warmup_steps
    min_lr_ratio: float = _S.min_lr_ratio
    grad_clip: float = _S.grad_clip
    grad_accum: int = _S.grad_accum
    ce_weight: float = _S.ce_weight
    kd_weight: float = _S.kd_weight
    kd_temperature: float = _S.kd_temperature
    dtype: str = _S.dtype
    checkpoint_every: int = _S.checkpoint_every
    seed: int = _S.seed

    def __post_init__(self):
        base = as_config(self.base, "base")
        name = get_method(base).name
        if name not in QAT_BASES:
            raise ValueError(f"qat: base must be one of {', '.join(QAT_BASES)} (a method whose quantized linears "
                             f"QAT can train), got {name!r}")
        object.__setattr__(self, "base", base)
        if not isinstance(self.learn_scales, bool):
            raise ValueError(f"learn_scales must be true or false, got {self.learn_scales!r}")
        self.settings  # validates the training fields
        if self.learn_scales and "hqq" in nested_methods(base):
            raise ValueError("qat: learn_scales (LSQ) learns integer zero points, but an hqq base has real-valued "
                             "zeros (its stored form); set learn_scales = false (plain STE, HQQ's qparams fixed)")
        used = number_formats(base)
        if self.learn_scales and used:
            raise ValueError(f"qat: learn_scales (LSQ) learns integer-grid scales and zero points; the base uses "
                             f"format(s) {', '.join(sorted(used))}: set learn_scales = false (plain STE through "
                             f"the format's rounding, scales fixed from the base)")

    @property
    def settings(self) -> TrainSettings:
        return TrainSettings(**{f.name: getattr(self, f.name) for f in fields(TrainSettings)})


def nested_methods(config: Any) -> set[str]:
    """The method names of a config and its bases."""
    base = getattr(config, "base", None)
    return {get_method(config).name} | (nested_methods(base) if base is not None and not isinstance(base, dict) else set())


def number_formats(config: Any) -> set[str]:
    """The non-integer formats (weights, per-layer overrides, activations) a config and its bases use."""
    out = set()
    for field in ("format", "act_format"):
        if getattr(config, field, "int") != "int":
            out.add(getattr(config, field))
    out |= {o.format for o in getattr(config, "overrides", ()) if o.format not in (None, "int")}
    base = getattr(config, "base", None)
    return out | (number_formats(base) if base is not None and not isinstance(base, dict) else set())


def attach_quantizers(model, config: QATConfig) -> int:
    """After the base's calibrate: learned (LSQ) or fixed (STE) weight qparams, and activation quantizers."""
    layers = {n: m for n, m in quant_linears(model).items() if isinstance(m, QATLinear)}
    if not layers:
        raise ValueError("qat: no QATLinear layers; run prepare() before train()")
    base_name = get_method(config.base).name
    for layer in layers.values():
        if layer.weight_quant is not None:  # already attached (train() called again)
            continue
        p = layer.current_qparams()
        p = QParams(p.scale.detach().clone(), None if p.zero is None else p.zero.detach().clone(), p.extra,
                    p.float_zero)
        if config.learn_scales:
            layer.weight_quant = LearnedWeightQuant.from_qparams(p, layer.spec, layer.in_features)
        else:
            layer.fixed_qparams = p  # plain STE: the base's qparams, fixed (no min-max drift as weights move)
        if base_name == "dynamic" and layer.act_quant is None:  # the base adds these only in convert()
            layer.act_quant = DynamicActQuant(config.base.act_bits, config.base.act_symmetric, config.base.act_format)
        if config.learn_scales and isinstance(layer.act_quant, StaticActQuant):
            layer.act_quant = LearnedStaticActQuant(layer.act_quant)
    return len(layers)


@register_method
class QAT(Method):
    name = "qat"
    config_cls = QATConfig

    def needs_calibration_for(self, config: QATConfig) -> bool:
        return needs_calibration(config.base)

    def needs_training_for(self, config: QATConfig) -> bool:
        return True

    def needs_teacher_for(self, config: QATConfig) -> bool:
        return config.settings.needs_teacher

    def describe(self, config: QATConfig, dtype: str = "float32") -> str:
        base = get_method(config.base).describe(config.base, dtype)
        return f"{base} + QAT {'LSQ' if config.learn_scales else 'STE'}"

    def prepare(self, model, config: QATConfig) -> None:
        get_method(config.base).prepare(model, config.base)
        layers = quant_linears(model)
        if not layers:
            raise ValueError(f"qat: base {get_method(config.base).name!r} created no quantized linear layers")
        for name, layer in layers.items():
            set_submodule(model, name, QATLinear.from_quant_linear(layer))

    def calibrate(self, model, config: QATConfig, batches, progress: bool = True) -> dict | None:
        if needs_calibration(config.base):
            return get_method(config.base).calibrate(model, config.base, batches, progress)
        return None

    def train(self, model, config: QATConfig, data, teacher=None, checkpoint_dir=None, progress=True,
              processes: int = 1) -> dict:
        """processes > 1: data-parallel QAT (qat/distributed.py), the same global batch."""
        attach_quantizers(model, config)
        fingerprint = json.dumps(config_to_dict(config), sort_keys=True, default=str)
        return train(model, data, config.settings, teacher, checkpoint_dir, progress, fingerprint, processes)

    def convert(self, model, config: QATConfig) -> None:
        bake(model)
        get_method(config.base).convert(model, config.base)
