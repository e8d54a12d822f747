"""Export a quantlab-quantized model to torchao kernels, in place, and check parity.

    summary = export_torchao(model)                       # every layer with a kernel is swapped
    summary = export_with_parity(model, ids)              # + logits vs the dequantized model

Layers without a kernel on the device stay QuantLinear (simulated) and the summary says why.
When an exported kernel computes in bf16 (int4), the float parts of the model are cast to bf16
too; QuantLinear scales stay as stored, so remaining simulated layers keep their exact grid.
"""
from __future__ import annotations

import copy
import importlib.util
from collections import Counter

import torch
from torch import nn

from ..core.lifecycle import quant_linears, set_submodule
from ..core.qlinear import QuantLinear
from .kernels import KERNEL_DTYPE, choose_kernel
from .modules import build_module

# Kernel parity, per exported layer: max |y_kernel - y_simulated| / max |y_simulated| on the same
# random input (the `ok` flag of a row). int8: the same integer codes (weights and, for dynamic, the
# per-token activation codes, computed by quantlab's own qparams), summed in another order in fp32.
# int4: a bf16 tinygemm kernel vs the bf16 dequantized matmul (other accumulation and rounding).
PARITY_TOLERANCE = {"int8_weight_only": 1e-5, "int8_dynamic": 1e-5, "int4_cpu": 2e-2, "int4_cuda": 2e-2,
                    "float8_weight_only": 1e-5}
# End-to-end logits are recorded too (export_parity_logits_*), not gated: with dynamic activation
# quantization a float rounding difference can flip one activation code, and on SmolLM2's massive
# activation outliers (|x| ~ 2e4) one code step is ~150, so such flips grow through 30 layers
# (measured: logits rel RMS 0.04-0.08 vs the simulated model, which is itself 0.12 from fp32).

def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device if any(True for _ in model.parameters()) else next(model.buffers()).device


def cast_float_parts(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast float params/buffers to dtype, except QuantLinear's scales (kept exactly as stored)."""
    for module in model.modules():
        keep = {"scale"} if isinstance(module, QuantLinear) else set()
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if name not in keep and b is not None and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)


def plan_export(model: nn.Module, device: torch.device | None = None) -> dict:
    """name -> KernelChoice for every QuantLinear (nothing is changed)."""
    device = device or _model_device(model)
    return {name: choose_kernel(layer, device) for name, layer in quant_linears(model).items()}


def _compute_dtype(model: nn.Module, kernels: set[str]) -> torch.dtype:
    wanted = {KERNEL_DTYPE[k] for k in kernels if k in KERNEL_DTYPE}
    float_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return wanted.pop() if wanted else float_dtype


def export_torchao(model: nn.Module, device: torch.device | None = None) -> dict:
    """Swap every QuantLinear that has a torchao kernel on `device` for a TorchaoLinear, in place.

    Returns {backend, backend_kernels, backend_note, exported_layers, simulated_layers, export_dtype}.
    backend: "torchao" (all layers), "torchao+simulated" (some), "simulated" (none, or no torchao).
    """
    plan = plan_export(model, device)
    if not plan:
        raise ValueError("export_torchao: the model has no QuantLinear layers (quantize it first)")
    if not torchao_available():
        plan = {n: type(c)(None, "torchao is not installed") for n, c in plan.items()}
    chosen = {n: c.kernel for n, c in plan.items() if c.kernel}
    dtype = _compute_dtype(model, set(chosen.values()))
    cast_float_parts(model, dtype)
    layers = quant_linears(model)
    for name, kernel in chosen.items():
        set_submodule(model, name, build_module(kernel, layers[name], dtype))
    reasons = Counter(c.reason for c in plan.values() if not c.kernel)
    n_sim = sum(reasons.values())
    backend = "simulated" if not chosen else ("torchao" if not n_sim else "torchao+simulated")
    note = "; ".join(f"{k} ({v} layers)" for k, v in reasons.items())
    return {
        "backend": backend,
        "backend_kernels": ", ".join(f"{k}:{v}" for k, v in sorted(Counter(chosen.values()).items())),
        "backend_note": note or f"all {len(chosen)} quantized layers run torchao kernels",
        "exported_layers": len(chosen), "simulated_layers": n_sim, "export_dtype": str(dtype).removeprefix("torch."),
    }


def _outputs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids, use_cache=False)
    logits = getattr(out, "logits", None)
    return (logits if logits is not None else out.last_hidden_state).float()  # encoders: hidden states


@torch.inference_mode()
def logits_diff(model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> dict:
    """Max abs, max relative (to max |reference|) and relative RMS difference of the logits on ids (B, T)."""
    ids = ids.to(_model_device(model))
    a, b = _outputs(model, ids), _outputs(reference, ids)
    diff = (a - b).abs().max().item()
    return {"export_parity_logits_max_abs": diff,
            "export_parity_logits_max_rel": diff / max(b.abs().max().item(), 1e-12),
            "export_parity_logits_rel_rms": ((a - b).norm() / b.norm().clamp_min(1e-12)).item()}


@torch.inference_mode()
def layer_parity(model: nn.Module, reference: nn.Module, tokens: int = 8, seed: int = 0) -> dict:
    """Per exported layer, max |y - y_ref| / max |y_ref| on one seeded random input (tokens, in).

    Returns {layer name: relative error} for every layer that is exported in `model`
    and a QuantLinear in `reference`.
    """
    gen = torch.Generator().manual_seed(seed)
    ref_layers, out = quant_linears(reference), {}
    dtype = next(p.dtype for p in reference.parameters() if p.is_floating_point())
    for name, module in model.named_modules():
        if name in ref_layers and not isinstance(module, QuantLinear):
            ref = ref_layers[name]
            x = torch.randn(tokens, ref.in_features, generator=gen).to(dtype=dtype, device=ref.scale.device)
            y_ref = ref(x).float()
            out[name] = ((module(x).float() - y_ref).abs().max() / y_ref.abs().max().clamp_min(1e-12)).item()
    return out


def export_with_parity(model: nn.Module, ids: torch.Tensor, device: torch.device | None = None) -> dict:
    """export_torchao + parity of the logits on ids against the dequantized (simulated) model.

    The reference is the model before export, cast to the export dtype, so the check isolates the
    kernels. Gate (export_parity_ok): every layer's kernel output within PARITY_TOLERANCE of its
    simulated output; the logits differences on ids are recorded alongside.
    """
    reference = copy.deepcopy(model)
    summary = export_torchao(model, device)
    if summary["exported_layers"] == 0:
        return summary
    cast_float_parts(reference, getattr(torch, summary["export_dtype"]))
    kernels = {n: m.kernel for n, m in model.named_modules() if hasattr(m, "kernel")}
    errors = layer_parity(model, reference)
    worst = max(errors, key=lambda n: errors[n] / PARITY_TOLERANCE[kernels[n]])
    parity = logits_diff(model, reference, ids)
    del reference
    tol = PARITY_TOLERANCE[kernels[worst]]
    return summary | parity | {
        "export_parity_layer_max_rel": max(errors.values()), "export_parity_worst_layer": worst,
        "export_parity_tol": tol, "export_parity_ok": errors[worst] <= tol,
    }
