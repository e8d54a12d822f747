"""AutoRound's trainable state (methods/autoround.py): for one block's selected layers, the rounding offsets V and
the two per-group clip factors, their signed-gradient step, and the hand-over of the kept iterate to the layers."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..core.primitives import QParams, n_groups
from ..core.qlinear import QuantLinear
from .autoround_grid import autoround_qdq

FACTOR_RANGE = (0.5, 1.0)  # min/max clip factors
OFFSET_RANGE = (-0.5, 0.5)  # rounding offsets V


class TunedLayers:
    """The trainable state of one block's layers: V and the two clip factors per layer."""

    def __init__(self, layers: dict[str, QuantLinear], minmax: bool, full_range: bool = False):
        self.layers, self.full_range = layers, full_range
        self.w = {n: m.weight.detach().float() for n, m in layers.items()}
        self.v = {n: torch.zeros_like(w, requires_grad=True) for n, w in self.w.items()}
        shapes = {n: (w.shape[0], n_groups(w.shape[1], layers[n].spec.group_size)) for n, w in self.w.items()}
        self.lo = {n: torch.ones(s, device=self.w[n].device, requires_grad=minmax) for n, s in shapes.items()}
        self.hi = {n: torch.ones(s, device=self.w[n].device, requires_grad=minmax) for n, s in shapes.items()}

    def qdq(self, name: str) -> tuple[torch.Tensor, QParams]:
        return autoround_qdq(self.w[name], self.v[name], self.lo[name], self.hi[name], self.layers[name].spec,
                             self.full_range)

    def params(self) -> list[torch.Tensor]:
        return [t for d in (self.v, self.lo, self.hi) for t in d.values()]

    def take_grads(self) -> list[torch.Tensor | None]:
        """The parameters' gradients, which are cleared."""
        grads = [p.grad for p in self.params()]
        for p in self.params():
            p.grad = None
        return grads

    def snapshot(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.params()]

    @torch.no_grad()
    def load(self, values: list[torch.Tensor]) -> None:
        for t, value in zip(self.params(), values):
            t.copy_(value)

    @torch.no_grad()
    def sign_step(self, round_lr: float, factor_lr: float) -> None:
        """p -= lr·sign(grad), then each parameter back into its range."""
        for params, lr, (lo, hi) in ((self.v, round_lr, OFFSET_RANGE), (self.lo, factor_lr, FACTOR_RANGE),
                                     (self.hi, factor_lr, FACTOR_RANGE)):
            for p in params.values():
                if p.grad is not None:
                    p.sub_(lr * p.grad.sign()).clamp_(lo, hi)
                    p.grad = None

    @contextmanager
    def forwards(self, block: nn.Module):
        """The block's layers multiply by their tuned grid weight (an instance override of quantized_weight, so
        QuantLinear's input transforms still run); the block's own parameters take no gradient."""
        frozen = [(p, p.requires_grad) for p in block.parameters()]
        for name, layer in self.layers.items():
            layer.quantized_weight = lambda dtype=None, name=name: self.qdq(name)[0].to(dtype or torch.float32)
        try:
            for p, _ in frozen:
                p.requires_grad_(False)
            yield
        finally:
            for layer in self.layers.values():
                layer.__dict__.pop("quantized_weight", None)
            for p, flag in frozen:
                p.requires_grad_(flag)

    @torch.no_grad()
    def apply(self) -> None:
        """Hand the current iterate to the layers: grid weight + fixed qparams (freeze packs its codes)."""
        for name, layer in self.layers.items():
            w_hat, p = self.qdq(name)
            layer.weight.data.copy_(w_hat.to(layer.weight.dtype))
            layer.fixed_qparams = p
