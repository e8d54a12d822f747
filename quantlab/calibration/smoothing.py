"""Apply a per-channel smoothing scale to one ScaleGroup of a block (SmoothQuant, AWQ).

With s > 0 per input channel of the consumers:
    consumers' weight columns  W[:, c] *= s[c]
    producer's output channel  c       /= s[c]   (norm weight/bias, or linear rows/bias)
so the float function is unchanged: W (x / s) * s = W x. Groups without a foldable
producer keep the division explicit at each consumer (QuantLinear.input_scale).

A norm that multiplies by (offset + w) (ScaleGroup.norm_offset: Gemma's RMSNorm, x̂·(1 + w)) gets
w' = (offset + w) / s - offset, computed in float64: exact up to rounding w' to the weight's dtype,
i.e. an absolute error of ~1 ulp of `offset` in the norm's factor (Gemma: 6e-8 in fp32).
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.qlinear import QuantLinear
from ..models.arch import ScaleGroup


def group_modules(block: nn.Module, group: ScaleGroup) -> tuple[nn.Module | None, list[nn.Module]]:
    producer = block.get_submodule(group.producer) if group.producer else None
    return producer, [block.get_submodule(name) for name in group.consumers]


def group_applies(block: nn.Module, group: ScaleGroup) -> bool:
    """False where the table's group does not fit this block (e.g. v_proj -> o_proj under GQA)."""
    producer, consumers = group_modules(block, group)
    width = consumers[0].in_features
    if any(c.in_features != width for c in consumers):
        return False
    if group.kind == "linear":
        return producer.out_features == width
    if group.kind == "norm":
        return producer.weight.shape[-1] == width
    return all(isinstance(c, QuantLinear) for c in consumers)


@torch.no_grad()
def apply_scale(block: nn.Module, group: ScaleGroup, scale: torch.Tensor) -> None:
    """Fold `scale` (C,) into the group's producer and consumers, in place."""
    if not (scale > 0).all() or not torch.isfinite(scale).all():
        raise ValueError(f"smoothing scales for {group.consumers} must be finite and > 0")
    producer, consumers = group_modules(block, group)
    for c in consumers:
        c.weight.mul_(scale.to(c.weight.dtype))  # broadcasts over rows: columns scaled
    s = scale.to(consumers[0].weight.dtype)
    if group.kind == "explicit":
        for c in consumers:
            c.input_scale = s.clone() if c.input_scale is None else c.input_scale * s
        return
    if group.kind == "linear":
        producer.weight.div_(s.unsqueeze(1))
    elif group.norm_offset:
        factor = (group.norm_offset + producer.weight.double()) / scale.double()
        producer.weight.copy_(factor - group.norm_offset)
    else:
        producer.weight.div_(s)
    if getattr(producer, "bias", None) is not None:
        producer.bias.div_(s)
