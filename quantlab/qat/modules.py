"""Trainable quantizers for QAT: modules around the numerics in `lsq.py`.

- LearnedWeightQuant: LSQ scale (and zero point for asymmetric grids) of one weight,
  initialised from the qparams the base method chose (min-max for RTN, GPTQ's, AWQ's clip).
- QATLinear: a QuantLinear whose weight is fake-quantized with a LearnedWeightQuant when one is
  set (`weight_quant`); without one it is exactly a QuantLinear (plain STE with fixed qparams).
- LearnedStaticActQuant: a StaticActQuant whose scale (and zero) are learned with LSQ.

`bake()` turns each of them back into the plain, fixed-qparams form the base method converts
(QuantLinear.fixed_qparams, StaticActQuant), with the same forward values.

>>> layer = QATLinear.from_quant_linear(quant_linear)
>>> layer.weight_quant = LearnedWeightQuant.from_qparams(layer.current_qparams(), layer.spec)
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.activations import StaticActQuant
from ..core.primitives import QParams, fake_quantize
from ..core.qlinear import QuantLinear, WeightSpec
from .lsq import frozen_qparams, lsq_grad_scale, lsq_qparams


class LearnedWeightQuant(nn.Module):
    """Learnable per-group scale (out, n_groups) and, asymmetric, zero point (float, rounded with STE)."""

    def __init__(self, scale: torch.Tensor, zero: torch.Tensor | None, spec: WeightSpec, in_features: int):
        super().__init__()
        self.spec = spec
        self.scale = nn.Parameter(scale.detach().float().clone())
        self.zero = None if zero is None else nn.Parameter(zero.detach().float().clone())
        self.g = lsq_grad_scale(spec.group_size or in_features, spec.bits, spec.symmetric)

    @classmethod
    def from_qparams(cls, p: QParams, spec: WeightSpec, in_features: int) -> "LearnedWeightQuant":
        if (p.zero is None) != spec.symmetric:
            raise ValueError(f"qparams {'lack' if p.zero is None else 'have'} a zero point but spec.symmetric={spec.symmetric}")
        return cls(p.scale, p.zero, spec, in_features)

    def qparams(self) -> QParams:
        """QParams for the forward (gradients flow to scale and zero)."""
        return lsq_qparams(self.scale, self.zero, self.spec.bits, self.g, self.spec.torch_scale_dtype)

    def frozen_qparams(self) -> QParams:
        return frozen_qparams(self.scale, self.zero, self.spec.bits, self.spec.torch_scale_dtype)

    def extra_repr(self) -> str:
        return f"w{self.spec.bits} lsq scale {tuple(self.scale.shape)}{'' if self.zero is None else ' + zero'}, g={self.g:.4g}"


class QATLinear(QuantLinear):
    """QuantLinear + an optional LearnedWeightQuant (`weight_quant`) that supplies its qparams."""

    weight_quant: LearnedWeightQuant | None

    @classmethod
    def from_quant_linear(cls, layer: QuantLinear) -> "QATLinear":
        """The same layer (same parameters, buffers, act_quant, every attribute), as a QATLinear."""
        if layer.frozen:
            raise ValueError("cannot train a frozen QuantLinear (convert() already ran)")
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # the old module is discarded; its state moves over whole
        new.weight_quant = None
        return new

    def current_qparams(self) -> QParams:
        if self.weight_quant is not None:
            return self.weight_quant.qparams()
        return super().current_qparams()

    def bake(self) -> None:
        """Fix the learned qparams (scale in scale_dtype, integer zero) and drop the learner."""
        if self.weight_quant is not None:
            self.fixed_qparams = self.weight_quant.frozen_qparams()
            self.weight_quant = None


class LearnedStaticActQuant(nn.Module):
    """StaticActQuant with an LSQ-learned scale (0-dim or (C,)) and, asymmetric, zero point."""

    def __init__(self, static: StaticActQuant):
        super().__init__()
        self.bits, self.symmetric = static.bits, static.symmetric
        self.scale = nn.Parameter(static.scale.detach().float().clone())
        self.zero = None if static.zero is None else nn.Parameter(static.zero.detach().float().clone())

    def qparams(self, numel: int) -> QParams:
        g = lsq_grad_scale(max(numel // self.scale.numel(), 1), self.bits, self.symmetric)
        return lsq_qparams(self.scale, self.zero, self.bits, g, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group_size = 1 if self.scale.dim() == 1 else None  # per channel, or one group over the last dim
        return fake_quantize(x, self.qparams(x.numel()), self.bits, group_size, ste=True)

    def to_static(self) -> StaticActQuant:
        p = frozen_qparams(self.scale, self.zero, self.bits, torch.float32)
        return StaticActQuant(self.bits, self.symmetric, p.scale, p.zero)

    def extra_repr(self) -> str:
        return f"a{self.bits} static lsq {'sym' if self.symmetric else 'asym'} scale {tuple(self.scale.shape)}"


def bake(model: nn.Module) -> int:
    """Replace every learned quantizer by its fixed form (outputs unchanged); returns how many layers."""
    n = 0
    for module in model.modules():
        if isinstance(module, QATLinear):
            module.bake()
            if isinstance(module.act_quant, LearnedStaticActQuant):
                module.act_quant = module.act_quant.to_static()
            n += 1
    return n
