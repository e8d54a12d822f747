"""Environment checks (no model): torch / CUDA / MPS, bf16 and fp16 matmul speed vs fp32, and which kernels
(torchao, ONNX Runtime) each scheme gets on the device."""
from __future__ import annotations

import os

import torch
from torch import nn

from ..util import device as device_util
from .checks import Check


def device_rows(device: torch.device) -> list[Check]:
    """torch version and CPU threads; CUDA and MPS availability (an error only for the device asked for)."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    rows = [Check("torch", "warn" if threads == 1 < cores else "ok",
                  f"{torch.__version__}; {threads} CPU threads on {cores} cores",
                  "torch.set_num_threads(os.cpu_count()) (or unset OMP_NUM_THREADS)")]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = Check("cuda", "ok", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): {props.name} "
                                   f"(cc {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        cuda = Check("cuda", "error" if device.type == "cuda" else "ok",
                     f"not available (torch built with CUDA {torch.version.cuda or 'none'})",
                     "install a CUDA build of torch, or use --device cpu")
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    return rows + [cuda, Check("mps", "error" if device.type == "mps" and not mps_ok else "ok",
                               "available" if mps_ok else "not available", "Apple silicon only; use --device cpu")]


def half_precision_rows(device: torch.device, size: int = 512, budget_s: float = 0.3) -> list[Check]:
    """bf16 / fp16 matmul on `device`: supported? its speed vs fp32 (warn where slower: AVX2 CPUs without
    bf16 units convert and compute in fp32). Three timings of ~budget_s each."""
    fp32 = device_util.matmul_ms(torch.float32, device, size, budget_s)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        try:
            ms = device_util.matmul_ms(dtype, device, size, budget_s)
        except (RuntimeError, TypeError) as e:
            rows.append(Check(f"{name} matmul", "warn", f"not supported on {device.type}: {str(e)[:80]}",
                              "keep dtype float32 on this device"))
            continue
        ratio = ms / fp32
        slower = ratio > 1.0
        rows.append(Check(
            f"{name} matmul", "warn" if slower else "ok",
            f"{size}x{size} matmul {ms:.2f} ms vs float32 {fp32:.2f} ms ({ratio:.2f}x the time) on {device.type}"
            + (" (1 thread)" if device.type == "cpu" else ""),
            f"{name} is slower than float32 here: keep dtype float32 (torchao's int4 kernels compute in bf16)"))
    return rows


def kernel_rows(device: torch.device) -> list[Check]:
    """For each scheme, the torchao kernel quantlab exports it to on `device` (backends/kernels.py's table),
    or why backend "torchao" / "auto" would keep it simulated, i.e. dequantize the codes on every forward."""
    from ..backends import choose_kernel, torchao_available
    from ..core.activations import DynamicActQuant
    from ..core.qlinear import QuantLinear, WeightSpec

    schemes = {"int8 weight-only": (WeightSpec(bits=8), False), "int8 dynamic (w8a8)": (WeightSpec(bits=8), True),
               "int4 g64 weight-only": (WeightSpec(bits=4, group_size=64), False),
               "fp8_e4m3 weight-only": (WeightSpec(format="fp8_e4m3"), False)}
    have_torchao, rows = torchao_available(), []
    for scheme, (spec, dynamic) in schemes.items():
        layer = QuantLinear.from_linear(nn.Linear(256, 8, bias=False), spec)
        layer.freeze()
        layer.act_quant = DynamicActQuant(8) if dynamic else None
        choice = choose_kernel(layer, device)
        if choice.kernel is None:
            rows.append(Check(f"kernel {scheme}", "warn", f"none on {device.type}: {choice.reason}",
                              "backend torchao/auto keeps these layers simulated: correct numbers, no speed-up"))
        elif not have_torchao:
            rows.append(Check(f"kernel {scheme}", "warn", f"{choice.kernel} needs torchao, which is not installed; "
                              "backend 'auto' silently runs simulated (dequantizes every forward)", "pip install torchao"))
        elif choice.kernel == "float8_weight_only" and device.type != "cuda":
            rows.append(Check(f"kernel {scheme}", "warn", f"{choice.kernel}: Float8Tensor dequantizes in the matmul "
                              f"on {device.type} (real bytes, no fp8 compute)", "expect float speed, not fp8 speed"))
        else:
            rows.append(Check(f"kernel {scheme}", "ok", choice.kernel))
    return rows


def ort_kernel_rows() -> list[Check]:
    """For each scheme, what backend "onnxruntime" exports it to (backends/ort.py's plan): MatMulNBits, the int8
    MatMulInteger path, or an fp32 MatMul on the dequantized weight (correct numbers, no int speed-up)."""
    from ..backends.ort import ort_available, ort_kind
    from ..core.activations import DynamicActQuant
    from ..core.qlinear import QuantLinear, WeightSpec

    if not ort_available():
        return [Check("onnxruntime", "warn", "onnxruntime / onnxscript not installed: backend 'onnxruntime' fails",
                      "pip install 'quantlab[ort]'")]
    import onnxruntime

    rows = [Check("onnxruntime", "ok", f"{onnxruntime.__version__}; providers "
                                       f"{', '.join(onnxruntime.get_available_providers())}")]
    schemes = {"int8 weight-only": (WeightSpec(bits=8), False), "int8 dynamic (w8a8)": (WeightSpec(bits=8), True),
               "int4 g64 weight-only": (WeightSpec(bits=4, group_size=64), False),
               "int3 g64 weight-only": (WeightSpec(bits=3, group_size=64), False)}
    for scheme, (spec, dynamic) in schemes.items():
        layer = QuantLinear.from_linear(nn.Linear(256, 8, bias=False), spec)
        layer.freeze()
        layer.act_quant = DynamicActQuant(8) if dynamic else None
        kind, why = ort_kind(layer)
        rows.append(Check(f"ort {scheme}", "ok", kind) if kind else Check(
            f"ort {scheme}", "warn", f"fp32 MatMul on the dequantized weight: {why}",
            "backend onnxruntime runs these layers in float: correct numbers, no int speed-up"))
    return rows
