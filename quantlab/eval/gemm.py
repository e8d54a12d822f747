"""Evaluation GEMMs on CPU through oneDNN: F.linear routed to torch.ops.mkldnn._linear_pointwise for no-grad fp32.

PyTorch's CPU F.linear calls the BLAS it was built with (MKL in the wheels); on some CPUs that BLAS is far from the
machine's rate (measured on a 2-core AMD EPYC with AVX-512, one thread: a (2048 x 576) @ (576 x 1536) product took
44 ms through F.linear and 17 ms through oneDNN, and ONNX Runtime's MLAS 7 ms for a quarter of it, as oneDNN).
Evaluation passes (perplexity, reference log-probs) run inside `onednn_linear()`, which swaps F.linear for oneDNN's
linear while they run, for float32 CPU tensors without grad; everything else (bf16, CUDA, training) takes the usual
path. Results differ from MKL's only by summation order (relative ~1e-7 on a layer's output).

gemm "auto" takes oneDNN on AMD CPUs only, where MKL runs below rate (reports/bench_harness.csv: the harness 1.63x the
plain loop through oneDNN, 0.95x through MKL). On an Intel Xeon (AVX-512 + AMX) MKL is at rate and oneDNN gains
nothing (reports/bench_harness_xeon_amx.csv: 1.01-1.02x through oneDNN, 1.01-1.03x through MKL), so "auto" keeps
PyTorch's BLAS, the plain path, there and on every other vendor.

    with onednn_linear():
        logits = model(ids).logits
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

GEMMS = ("auto", "aten", "onednn")
_aten_linear = F.linear


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not tensor subclasses (torchao's quantized weights dispatch their own)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (type(x) in _PLAIN and type(weight) in _PLAIN and (bias is None or type(bias) in _PLAIN) and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 2
            and weight.dim() == 2 and not torch.is_grad_enabled() and weight.layout == torch.strided
            and (bias is None or bias.dtype == torch.float32)):
        return torch.ops.mkldnn._linear_pointwise(x, weight.contiguous(), bias, "none", [], "")
    return _aten_linear(x, weight, bias)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"), "" where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def resolve_gemm(gemm: str, device: torch.device) -> str:
    """auto: oneDNN on an AMD CPU where this torch has it (MKL is below rate there), else aten (Intel, other CPUs,
    CUDA, MPS)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm {gemm!r} unknown; known: {', '.join(GEMMS)}")
    if gemm == "auto":
        amd = cpu_vendor() == "AuthenticAMD"
        return "onednn" if device.type == "cpu" and amd and onednn_available() else "aten"
    if gemm == "onednn" and not onednn_available():
        raise ValueError("gemm 'onednn': this torch has no oneDNN (mkldnn) linear; use 'aten'")
    return gemm


@contextlib.contextmanager
def onednn_linear(enabled: bool = True):
    """F.linear through oneDNN for fp32 CPU inference while the block runs (restored after, even on error)."""
    if not enabled or F.linear is _linear:  # nested: the outer one restores
        yield
        return
    F.linear = _linear
    try:
        yield
    finally:
        F.linear = _aten_linear
