"""`quantlab doctor`: the quantization debugging checklist as pure checks over a model, its config and a device.

    rows = diagnose(model, tokenizer, torch.device("cpu"), seq_len=512)
    print(format_checks(rows))          # one line per check: ok / warn / error, what was seen, what to do
    exit_code(rows)                     # 1 when any check is an error

Every check returns Check rows and changes nothing; the model checks take any nn.Module, so a test
can hand them a crafted bad model (a NaN weight, a parameter on `meta`, an injected outlier).
The environment checks (device_rows, half_precision_rows, kernel_rows, ort_kernel_rows) need no model:
quantlab/doctor/environment.py; the model checks are in quantlab/doctor/model.py.
"""
from __future__ import annotations

import torch
from torch import nn

from ..util.device import matmul_ms
from .checks import STATUSES, Check, exit_code, format_checks
from .environment import device_rows, half_precision_rows, kernel_rows, ort_kernel_rows
from .model import (
    OUTLIER_RATIO_WARN,
    PROBE_TEXT,
    ForwardStats,
    dtype_check,
    finite_activations_check,
    finite_weights_check,
    forward_stats,
    free_memory_bytes,
    memory_check,
    outlier_check,
    placement_check,
    positions_check,
    probe_ids,
    tensor_bytes,
)


def diagnose(model: nn.Module | None, tokenizer=None, device: torch.device | None = None,
             seq_len: int | None = None, batch: int = 1, dtype: str = "float32",
             free_bytes: int | None = None, matmul_budget_s: float = 0.3) -> list[Check]:
    """Every check: the environment, then (with a model) its tensors, one probe forward, its limits and memory.

    >>> print(format_checks(diagnose(*load_model("smollm2-135m", device="cpu"), torch.device("cpu"))))
    """
    device = device or torch.device("cpu")
    rows = device_rows(device) + half_precision_rows(device, budget_s=matmul_budget_s) + kernel_rows(device)
    if device.type == "cpu":  # ONNX Runtime's CPU execution provider
        rows += ort_kernel_rows()
    if model is None:
        return rows
    placement = placement_check(model)
    rows += [placement, dtype_check(model), finite_weights_check(model)]
    if placement.status == "error":
        rows.append(Check("forward", "warn", "skipped: the devices row is an error", "fix it first"))
    else:
        stats = forward_stats(model, probe_ids(model, tokenizer))
        rows += [finite_activations_check(stats)] + ([outlier_check(stats)] if not stats.error else [])
    config = getattr(model, "config", None)
    if config is not None:
        rows.append(positions_check(config, seq_len))
        free = free_memory_bytes(device) if free_bytes is None else free_bytes
        eval_len = seq_len or min(getattr(config, "max_position_embeddings", None) or 2048, 2048)
        rows.append(memory_check(config, eval_len, batch, dtype, device, free, tensor_bytes(model)))
    return rows


__all__ = ["OUTLIER_RATIO_WARN", "PROBE_TEXT", "STATUSES", "Check", "ForwardStats", "device_rows", "diagnose",
           "dtype_check", "exit_code", "finite_activations_check", "finite_weights_check", "format_checks",
           "forward_stats", "free_memory_bytes", "half_precision_rows", "kernel_rows", "matmul_ms", "memory_check",
           "ort_kernel_rows", "outlier_check", "placement_check", "positions_check", "probe_ids", "tensor_bytes"]
