"""Real low-bit execution: export quantlab's frozen codes to torchao kernels.

    from quantlab.backends import export_model
    summary = export_model(model, "torchao", probe_ids)   # in place; summary goes into the row

Backends: "simulated" (keep QuantLinear: dequantize on the fly), "torchao" (export every layer
that has a kernel on this device, the rest stay simulated with the reason), "auto" (torchao
when it is installed, else simulated), "onnxruntime" (an ONNX graph of the whole model with
MatMulNBits / int8 MatMulInteger from quantlab's codes, run by an ORT session on CPU: backends/ort.py),
"llama.cpp" (the model written as a GGUF, its llama.cpp types' bytes kept, run by llama-cpp-python:
backends/gguf_export.py, backends/llamacpp.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..util.checks import check_choice
from .kernels import KERNELS, KernelChoice, choose_kernel
from .modules import TorchaoLinear
from .torchao import PARITY_TOLERANCE, export_torchao, export_with_parity, logits_diff, plan_export, torchao_available

BACKENDS = ("simulated", "torchao", "auto", "onnxruntime", "llama.cpp")


def check_backend(backend) -> str:
    check_choice("backend", backend, BACKENDS)
    return backend


def export_model(model: nn.Module, backend: str, probe_ids: torch.Tensor | None = None) -> dict:
    """Apply `backend` to a quantized model in place; returns the row fields describing what runs.

    With probe_ids (B, T) the exported logits are compared with the simulated model's.
    """
    check_backend(backend)
    if backend in ("onnxruntime", "llama.cpp"):
        raise ValueError(f"export_model works in place; {backend} gives a new model: use export_for_run")
    if backend == "simulated":
        return {"backend": "simulated", "backend_note": "PyTorch dequantizes the codes on the fly"}
    if backend == "auto" and not torchao_available():
        return {"backend": "simulated", "backend_note": "auto: torchao is not installed"}
    if probe_ids is None:
        return export_torchao(model)
    return export_with_parity(model, probe_ids)


def export_for_run(model: nn.Module, backend: str, quantized: bool, probe_ids: torch.Tensor,
                   onnx_dir=None, source_gguf=None, n_ctx: int = 512) -> tuple[nn.Module, dict]:
    """The runner's hook: (the model to evaluate, row fields). Simulated: (model, {}) (rows keep their old
    columns); torchao: model exported in place, a plain 'float' for unquantized runs; onnxruntime: an
    OrtCausalLM of the graph written to onnx_dir/model.onnx (unquantized runs too: the ORT fp32 baseline);
    llama.cpp: the GGUF written to onnx_dir/model.gguf (tokenizer from source_gguf), run by llama.cpp (unquantized
    runs too: F32 tensors, llama.cpp's own float baseline)."""
    if backend == "simulated":
        return model, {}
    if backend == "onnxruntime":
        from .ort import export_onnxruntime

        return export_onnxruntime(model, Path(onnx_dir) / "model.onnx", probe_ids)
    if backend == "llama.cpp":
        from .gguf_export import export_llamacpp

        return export_llamacpp(model, Path(onnx_dir) / "model.gguf", source_gguf, probe_ids, n_ctx)
    if not quantized:
        return model, {"backend": "float", "backend_note": f"backend {backend!r}: nothing quantized to export"}
    return model, export_model(model, backend, probe_ids)


__all__ = ["export_for_run", "BACKENDS", "KERNELS", "KernelChoice", "PARITY_TOLERANCE", "TorchaoLinear", "check_backend",
           "choose_kernel", "export_model", "export_torchao", "export_with_parity", "logits_diff", "plan_export",
           "torchao_available"]
