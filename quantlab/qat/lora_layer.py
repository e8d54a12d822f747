"""QuantLoraLinear: peft's LoRA layer over a (frozen) QuantLinear; imported only when peft is used (methods/lora.py).

Built on peft's template for quantized bases (peft/tuners/lora/hqq.py, HqqLoraLinear): peft's LoraLayer holds the
adapters, their init (A Kaiming-uniform, B zero), dropout and scaling alpha / r; the forward adds
lora_B(lora_A(dropout(x))) * scaling to the base layer's output. Ours is merge(): a QuantLinear's weight is integer
codes, so merging re-quantizes W + ΔW on the base's grid (merged_quant_linear) instead of adding ΔW in place.

>>> config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=[...])
>>> config._register_custom_module({QuantLinear: QuantLoraLinear})
>>> peft.inject_adapter_in_model(config, model)
"""
from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import LoraConfig, LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from ..core.qlinear import QuantLinear


def merged_quant_linear(layer: QuantLinear, delta: torch.Tensor) -> QuantLinear:
    """A frozen QuantLinear on `layer`'s grid (its WeightSpec) holding RTN(dequant(layer) + delta ⊙ input scale).

    delta (out, in) acts on the input the layer is called with; a smoothing input_scale s is divided out before
    the layer's matmul (W (x / s)), so the weight that adds delta there is W + delta · diag(s). Scales are min-max
    ones of the merged weight (RTN); act_quant, input_scale and bias carry over.

    >>> merged = merged_quant_linear(layer, lora_layer.get_delta_weight("default"))
    """
    if layer._forward_pre_hooks:  # an online rotation transforms only the base's input: delta cannot fold in
        raise ValueError("lora merge: the quantized layer has a forward pre-hook (an online rotation); its input "
                         "differs from the adapter's, so the adapter cannot be folded in; use merge = false")
    with torch.no_grad():
        weight = layer.quantized_weight(torch.float32)  # (out, in) dequantized codes
        if layer.input_scale is not None:
            delta = delta * layer.input_scale.to(delta.dtype)
        merged = QuantLinear(layer.in_features, layer.out_features, layer.bias is not None, layer.spec)
        merged.weight = nn.Parameter(weight + delta.to(torch.float32), requires_grad=False)
        merged.bias = layer.bias
        merged.input_scale = layer.input_scale
        merged.act_quant = layer.act_quant
        merged.freeze()  # min-max qparams of the merged weight on the same spec: codes + scales (+ zeros)
    return merged.train(layer.training)


class QuantLoraLinear(nn.Module, LoraLayer):
    """LoRA adapters beside a QuantLinear (peft custom module); the base's codes and scales are not touched."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs: Any) -> None:
        if config.lora_bias or config.use_dora:
            raise ValueError("lora on QuantLinear supports plain LoRA only (no lora_bias, no DoRA)")
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # peft's generic lookup would warn "unsupported layer"

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        return None  # vanilla LoRA

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """B @ A * scaling, (out, in)."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Fold the adapters into the base by re-quantizing (irreversible: the old codes are gone)."""
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.lora_A:
                continue
            delta = self.get_delta_weight(name)
            if safe_merge and not torch.isfinite(delta).all():
                raise ValueError(f"NaN/Inf in adapter {name!r}; not merged")
            self.base_layer = merged_quant_linear(self.get_base_layer(), delta)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Refused by design: merge re-quantized W + ΔW, so the base's codes are gone (keep a copy of the model,
        or use merge = false, to keep both)."""
        raise RuntimeError("a merged QuantLoraLinear was re-quantized; the base codes cannot be restored (keep a "
                           "copy before merging, or use merge = false)")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            cast = not torch.is_autocast_enabled(x.device.type)
            xa = self._cast_input_dtype(x, lora_a.weight.dtype) if cast else x
            out = lora_b(lora_a(self.lora_dropout[name](xa))) * self.scaling[name]
            result = result + (out.to(result.dtype) if cast else out)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()
