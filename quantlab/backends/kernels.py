"""Which torchao kernel (if any) runs a frozen QuantLinear on a device.

One pure decision per layer, from the layer's scheme and the device, so the export and
the report agree on what ran. `None` kernel = stays simulated, with the reason.

| scheme (weights / activations)            | CPU                         | CUDA                          |
|-------------------------------------------|-----------------------------|-------------------------------|
| int8 per-channel sym / float              | int8_weight_only            | int8_weight_only              |
| int8 per-channel sym / int8 dynamic token | int8_dynamic                | int8_dynamic                  |
| int4 g32/64/128 (K % g == 0) / float      | int4_cpu (Int4OpaqueTensor, | int4_cuda (tinygemm, cc >= 8, |
|                                           | bf16)                       | bf16)                         |
| fp8_e4m3 / e5m2 per-channel / float       | float8_weight_only          | float8_weight_only            |
|                                           | (Float8Tensor, dequantizes) |                               |
| other number formats, format activations  | simulated (reason says what the kernel needs)               |
| anything else (incl. hqq's float zeros)   | simulated                   | simulated                     |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.activations import DynamicActQuant
from ..core.qlinear import QuantLinear

KERNELS = ("int8_weight_only", "int8_dynamic", "int4_cpu", "int4_cuda", "float8_weight_only")
INT4_GROUP_SIZES = (32, 64, 128)
# Compute dtype each kernel needs: int4 tinygemm kernels take bf16 activations and scales.
KERNEL_DTYPE = {"int4_cpu": torch.bfloat16, "int4_cuda": torch.bfloat16}


@dataclass(frozen=True)
class KernelChoice:
    kernel: str | None  # one of KERNELS, or None: stays simulated
    reason: str = ""    # why it stays simulated


def _simulated(reason: str) -> KernelChoice:
    return KernelChoice(None, reason)


def choose_kernel(layer: QuantLinear, device: torch.device) -> KernelChoice:
    """The torchao kernel for this frozen layer on `device`, or None with the reason.

    >>> choose_kernel(model.model.layers[0].mlp.up_proj, torch.device("cpu")).kernel   # 'int4_cpu'
    """
    if not layer.frozen:
        return _simulated("layer is not frozen (call convert/quantize first)")
    if layer.float_zero:
        return _simulated("real-valued zero points (hqq): quantlab's torchao export takes integer zero points")
    spec, act = layer.spec, layer.act_quant
    if spec.fmt is not None or getattr(act, "format", "int") != "int":
        return _format_kernel(layer, device)
    if act is not None and not isinstance(act, DynamicActQuant):
        return _simulated(f"{type(act).__name__} activations: no static-activation kernel is exported")
    if act is not None and act.bits != 8:
        return _simulated(f"a{act.bits} dynamic activations: only int8 activation kernels exist")
    if spec.bits == 8:
        if spec.group_size is not None:
            return _simulated(f"w8 g{spec.group_size}: torchao's int8 kernels are per-channel only")
        if not spec.symmetric:
            return _simulated("w8 asymmetric: torchao's int8 weight kernels take symmetric weights")
        return KernelChoice("int8_dynamic" if act is not None else "int8_weight_only")
    if spec.bits == 4:
        if act is not None:
            return _simulated("w4 + a8 dynamic: the CPU da8w4 kernel re-quantizes weights; not exported")
        if spec.group_size not in INT4_GROUP_SIZES:
            g = "per-channel" if spec.group_size is None else f"g{spec.group_size}"
            return _simulated(f"w4 {g}: int4 kernels need group size 32, 64 or 128")
        if layer.in_features % spec.group_size:
            return _simulated(f"w4 g{spec.group_size}: in_features {layer.in_features} is not a multiple of it")
        if device.type == "cpu":
            return KernelChoice("int4_cpu")
        if device.type == "cuda":
            if torch.cuda.get_device_capability(device)[0] < 8:
                return _simulated("w4 on CUDA: the tinygemm int4 kernel needs compute capability >= 8.0")
            return KernelChoice("int4_cuda")
        return _simulated(f"w4 on {device.type}: no int4 kernel")
    return _simulated(f"w{spec.bits}: no torchao kernel for {spec.bits}-bit weights")


def _format_kernel(layer: QuantLinear, device: torch.device) -> KernelChoice:
    """Number formats: FP8 per-channel weights export to torchao's Float8Tensor (weight-only: it dequantizes
    in the matmul on CPU); the rest has kernels only on recent GPUs, which quantlab does not export yet."""
    spec, act = layer.spec, layer.act_quant
    act_format = getattr(act, "format", "int") if act is not None else None
    if act is not None:
        need = "CUDA cc >= 8.9 (float8 matmul)" if str(act_format).startswith("fp8") else "CUDA cc >= 10.0"
        return _simulated(f"{spec.describe()} + a-{act_format} activations: torchao's kernel needs {need}; "
                          f"quantlab exports weight-only formats only (device: {device.type})")
    if spec.format in ("fp8_e4m3", "fp8_e5m2"):
        if spec.group_size is not None:
            return _simulated(f"{spec.format} g{spec.group_size}: quantlab exports per-channel FP8 (PerRow) only")
        return KernelChoice("float8_weight_only")
    if spec.format in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4"):
        return _simulated(f"{spec.format}: torchao's MX / NVFP4 matmuls need CUDA cc >= 10.0; not exported "
                          f"(device: {device.type})")
    return _simulated(f"{spec.format}: no torchao kernel for this format")
