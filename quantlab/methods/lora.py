"""`lora`: LoRA adapters trained over a frozen quantized base (QLoRA is one configuration of it, below).

    [[run]]
    name = "lora-rtn-w4-g64"
    method = "lora"
    base = {method = "rtn", bits = 4, group_size = 64, symmetric = false}   # or gptq, awq, hqq, nf4 (format), ...
    r = 16
    alpha = 32                # scaling alpha / r
    target_modules = ["*"]    # name globs or peft-style names ("q_proj", "mlp.down_proj") of the quantized linears
    merge = false             # true: fold B·A·alpha/r into the weights and re-quantize (a plain quantized model)
    steps = 16
    lr = 1e-3

Lifecycle: prepare = the base's prepare, then target_modules are resolved against its quantized linears (an error
before any data); calibrate = the base's; train = the base's convert (the base becomes integer codes + scales and
stays frozen), then adapters on the targeted layers, trained by the QAT loop (quantlab/qat/train.py: AMP,
accumulation, checkpoints, resume, NaN stop, distillation) with only lora_A / lora_B trainable; convert = keep the
adapters beside the frozen codes (merge = false) or merge and re-quantize (merge = true).
steps = 0 attaches the adapters untrained (B = 0): the base model's outputs exactly.

LoRA on int4 (frozen RTN codes), the example above and experiments/smollm2_lora.toml's lora-* rows, is not QLoRA.
QLoRA (Dettmers et al. 2023; artidoro/qlora qlora.py) is a 4-bit NormalFloat base with double-quantized absmax and
its recipe: r 64, alpha 16, dropout 0.1 and lr 2e-4 (its 7B / 13B scripts; 33B: 0.05, 1e-4), constant lr after a
3% warm-up, grad-norm clip 0.3, paged AdamW, cross-entropy on the data. Each knob is a field here (run qlora-nf4-dq
of experiments/smollm2_lora.toml): base = {method = "rtn", format = "nf4", double_quant = true}, r = 64,
alpha = 16, dropout = 0.1, lr = 2e-4, ce_weight = 1, kd_weight = 0, grad_clip = 0.3, min_lr_ratio = 1 (constant
after warm-up). What stays apart: the optimizer is torch's AdamW (paging only moves its state between GPU and CPU
memory), and the double quantization stores the absmax as FP8 E4M3 (core/formats.py), not bitsandbytes' 8-bit
dynamic map.

Adapters come from peft, not hand-written: peft is the implementation adapters are trained and shipped with, and
its init, scaling and dropout come with it. QuantLinear is a module peft does not know, so it goes through peft's
custom-module dispatch (LoraConfig._register_custom_module({QuantLinear: QuantLoraLinear}), qat/lora_layer.py,
following peft's own layer for HQQ's quantized linears) and peft.inject_adapter_in_model, which swaps the targeted
layers in place: no PeftModel wrapper, so module names, the transformers model class and every evaluation path stay
as they are. Only merge is ours (re-quantization; lora_layer.merged_quant_linear). Which layers are targeted is
resolved here by name (the house's glob selection, plus peft's suffix names) and handed to peft as exact names.

Row: lora_trainable_params, lora_adapter_bytes (the adapters as stored; counted in weight_bytes only when
merge = false), lora_targets (layers adapted), lora_merged; training columns as QAT's (train_s, train_steps, ...).
"""
from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import json
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..core.lifecycle import quant_linears, set_submodule
from ..core.qlinear import QuantLinear
from ..core.registry import Method, as_config, config_to_dict, get_method, needs_calibration, register_method
from ..qat.settings import TrainSettings
from ..qat.train import train
from ..util.checks import check_int
from .rtn import RTNConfig

# methods whose prepare() leaves QuantLinear layers (the frozen base the adapters sit beside)
LORA_BASES = ("autoround", "awq", "dynamic", "gptq", "hqq", "rtn", "smoothquant", "static")
ADAPTER = "default"  # peft's adapter name
_S = TrainSettings  # training defaults below are TrainSettings' own, except lr (adapters start at B = 0)


@dataclass(frozen=True)
class LoRAConfig:
    """base: a config of one of LORA_BASES; r, alpha (scaling alpha / r), dropout (on the adapter input);
    target_modules: globs (fnmatch, full names) or peft-style names (a full name or its dotted suffix) of the base's
    quantized linears, default all of them; merge: re-quantize W + B·A·alpha/r (true) or keep the adapters (false);
    the rest are TrainSettings (steps, batch_size, seq_len, lr, ..., dtype, kd_weight, checkpoint_every, seed)."""

    base: Any = RTNConfig(bits=4, group_size=64, symmetric=False)
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("*",)
    merge: bool = False
    steps: int = _S.steps
    batch_size: int = _S.batch_size
    seq_len: int = _S.seq_len
    lr: float = 2e-4
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
        if importlib.util.find_spec("peft") is None:
            raise ValueError("method 'lora' needs the peft package: pip install peft")
        base = as_config(self.base, "base")
        name = get_method(base).name
        if name not in LORA_BASES:
            raise ValueError(f"lora: base must be a method that leaves quantized linears (QuantLinear) to put "
                             f"adapters beside: one of {', '.join(LORA_BASES)}; got {name!r}")
        object.__setattr__(self, "base", base)
        check_int("r", self.r, 1)
        for field, lo in (("alpha", 0.0), ("dropout", 0.0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < lo or (field == "alpha" and value == 0) or (field == "dropout" and value >= 1):
                valid = "a number > 0" if field == "alpha" else "a number in [0, 1)"
                raise ValueError(f"lora: {field} must be {valid}, got {value!r}")
        targets = self.target_modules
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets \
                or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"lora: target_modules must be a non-empty list of layer names or globs, e.g. "
                             f"[\"q_proj\", \"v_proj\"] or [\"*.mlp.*\"], got {targets!r}")
        object.__setattr__(self, "target_modules", tuple(targets))
        if not isinstance(self.merge, bool):
            raise ValueError(f"lora: merge must be true or false, got {self.merge!r}")
        check_int("steps", self.steps, 0)
        self.settings  # validates the training fields

    @property
    def settings(self) -> TrainSettings:
        """The training loop's settings (steps = 0 validates as 1: nothing is trained then)."""
        values = {f.name: getattr(self, f.name) for f in fields(TrainSettings) if hasattr(self, f.name)}
        return TrainSettings(**{**values, "steps": max(self.steps, 1)})


def matches_target(name: str, pattern: str) -> bool:
    """A glob of the full module name, or a peft-style name: the full name or a dotted suffix of it."""
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.endswith("." + pattern)


def resolve_targets(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Names of the quantized linears `patterns` select; a pattern that selects none is an error naming it.

    >>> resolve_targets(model, ("q_proj", "*.mlp.down_proj"))  # ['model.layers.0.self_attn.q_proj', ...]
    """
    names = [n.removesuffix(".base_layer") for n in quant_linears(model)]
    unmatched = [p for p in patterns if not any(matches_target(n, p) for n in names)]
    if unmatched:
        others = sorted({n for n, m in model.named_modules() if type(m) is nn.Linear
                         and any(matches_target(n, p) for p in unmatched)})
        note = f" ({', '.join(others[:3])} {'is' if len(others) == 1 else 'are'} not quantized by the base)" \
            if others else ""
        raise ValueError(f"lora: target_modules {', '.join(map(repr, unmatched))} matched no quantized linear of "
                         f"the base{note}; quantized linears look like: {', '.join(names[:4])}, ... (globs such as "
                         f"'*.self_attn.*' and peft-style names such as 'q_proj' match these)")
    return [n for n in names if any(matches_target(n, p) for p in patterns)]


@contextlib.contextmanager
def seeded(seed: int, device: torch.device):
    """The global RNG seeded for a block (adapter init, dropout masks), restored after it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from ..qat.lora_layer import QuantLoraLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLoraLinear)}


def lora_parameters(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """(adapter weights at lr, no quantizer params): the `params` hook of qat.train.train."""
    weights = {f"{name}.{pname}": p for name, layer in _lora_layers(model).items()
               for part in ("lora_A", "lora_B") for pname, p in getattr(layer, part).named_parameters(prefix=part)}
    if not weights:
        raise ValueError("lora: the model has no LoRA adapters to train (attach_adapters() first)")
    return weights, {}


def attach_adapters(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Freeze the prepared (and calibrated) base with its own convert, then inject peft LoRA adapters into the
    targeted QuantLinears, initialised from config.seed. Returns the adapted names (no-op if already attached)."""
    existing = _lora_layers(model)
    if existing:
        return list(existing)
    from peft import LoraConfig, inject_adapter_in_model

    from ..qat.lora_layer import QuantLoraLinear

    get_method(config.base).convert(model, config.base)
    targets = resolve_targets(model, config.target_modules)
    peft_config = LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                             target_modules=targets, bias="none")
    peft_config._register_custom_module({QuantLinear: QuantLoraLinear})
    with seeded(config.seed, next(model.parameters()).device):
        inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)
    return targets


def merge_adapters(model: nn.Module) -> int:
    """Merge every adapter into its base by re-quantization and put the plain QuantLinear back; returns how many."""
    layers = _lora_layers(model)
    for name, layer in layers.items():
        layer.merge()
        set_submodule(model, name, layer.get_base_layer())
    return len(layers)


def adapter_stats(model: nn.Module) -> dict:
    weights, _ = lora_parameters(model)
    return {"lora_trainable_params": sum(p.numel() for p in weights.values()),
            "lora_adapter_bytes": sum(p.numel() * p.element_size() for p in weights.values()),
            "lora_targets": len(_lora_layers(model))}


@register_method
class LoRA(Method):
    name = "lora"
    config_cls = LoRAConfig

    def needs_calibration_for(self, config: LoRAConfig) -> bool:
        return needs_calibration(config.base)

    def needs_training_for(self, config: LoRAConfig) -> bool:
        return config.steps > 0

    def keeps_float_adapters(self, config: LoRAConfig) -> bool:
        return not config.merge  # merge = true folds them into re-quantized codes

    def describe(self, config: LoRAConfig, dtype: str = "float32") -> str:
        base = get_method(config.base).describe(config.base, dtype)  # adapters beside the codes, or merged in
        return f"{base} + LoRA r{config.r}{' merged' if config.merge else ''}"

    def needs_teacher_for(self, config: LoRAConfig) -> bool:
        return config.steps > 0 and config.settings.needs_teacher

    def prepare(self, model, config: LoRAConfig) -> None:
        get_method(config.base).prepare(model, config.base)
        if not quant_linears(model):
            raise ValueError(f"lora: base {get_method(config.base).name!r} created no quantized linear layers")
        resolve_targets(model, config.target_modules)  # a bad pattern fails here, before calibration

    def calibrate(self, model, config: LoRAConfig, batches, progress: bool = True) -> dict | None:
        if needs_calibration(config.base):
            return get_method(config.base).calibrate(model, config.base, batches, progress)
        return None

    def train(self, model, config: LoRAConfig, data, teacher=None, checkpoint_dir=None, progress=True,
              processes: int = 1) -> dict:
        """The base frozen, adapters attached, then the QAT loop over the adapters only."""
        attach_adapters(model, config)
        fingerprint = json.dumps(config_to_dict(config), sort_keys=True, default=str)
        with seeded(config.seed + 1, next(model.parameters()).device):  # dropout masks, apart from the init's
            return train(model, data, config.settings, teacher, checkpoint_dir, progress, fingerprint, processes,
                         params=lora_parameters, label="LoRA")

    def convert(self, model, config: LoRAConfig) -> dict:
        attach_adapters(model, config)  # steps = 0: the adapters as initialised (B = 0)
        stats = adapter_stats(model)
        if config.merge:
            merge_adapters(model)
        return {**stats, "lora_merged": config.merge}

