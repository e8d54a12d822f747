"""The quantized matmuls of an ONNX Runtime export: torch custom ops that carry ORT's storage layout through
torch.export, and their ONNX translations.

    y = torch.ops.quantlab.matmul_nbits(x, packed, scales, zeros, K, N, bits, block_size, accuracy_level)
    y = torch.ops.quantlab.matmul_a8w8(x, w_int8_t, w_scale)

matmul_nbits -> com.microsoft::MatMulNBits (weight-only int4 / int8, blocks along K, uint8 zero points);
matmul_a8w8  -> per-token symmetric int8 activation codes (quantlab's DynamicActQuant grid, computed with
standard ops: ReduceMax(|x|) / 127, Round, Clip) + MatMulInteger (int8 x int8 -> int32), rescaled by the
token and channel scales. Both eager implementations compute the same math in PyTorch, so a swapped model
still runs (and tests compare it) before export.
"""
from __future__ import annotations

import torch

from .ort_pack import dequantize_matmul_nbits

_F32_TINY = float(torch.finfo(torch.float32).tiny)


@torch.library.custom_op("quantlab::matmul_nbits", mutates_args=())
def matmul_nbits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, K: int, N: int,
                 bits: int, block_size: int, accuracy_level: int) -> torch.Tensor:
    """x (..., K) @ dequantized(packed)ᵀ -> (..., N); the layout is ort_pack.pack_matmul_nbits'."""
    w = dequantize_matmul_nbits(packed, scales, zeros, K, N, bits, block_size).to(x.dtype)  # (N, K)
    return x @ w.t()


@matmul_nbits.register_fake
def _(x, packed, scales, zeros, K, N, bits, block_size, accuracy_level):
    return x.new_empty(*x.shape[:-1], N)


def act_codes_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 codes and scales of x (..., K), as DynamicActQuant(bits=8) computes them."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = (amax / 127).clamp_min(_F32_TINY)  # qparams_from_range's symmetric scale in float32
    return torch.clamp(torch.round(x.float() / scale), -128, 127), scale


@torch.library.custom_op("quantlab::matmul_a8w8", mutates_args=())
def matmul_a8w8(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) float, w_t (K, N) int8 codes, w_scale (N,) float -> (..., N): int8 x int8 summed exactly."""
    q, scale = act_codes_int8(x)
    acc = (q.double() @ w_t.double())  # integer sums, exact in float64 (|sum| < 2^53)
    return (acc.float() * scale * w_scale.float()).to(x.dtype)


@matmul_a8w8.register_fake
def _(x, w_t, w_scale):
    return x.new_empty(*x.shape[:-1], w_t.shape[1])


def _u8_128():
    import onnx

    return onnx.helper.make_tensor("a_zero_point", onnx.TensorProto.UINT8, [], [128])


def translation_table() -> dict:
    """{torch op: onnxscript function} for torch.onnx.export(custom_translation_table=...)."""
    import onnxscript
    from onnx.defs import OpSchema
    from onnxscript import opset18 as op

    msft = onnxscript.values.Opset("com.microsoft", 1)
    fp, attr, optional = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.FormalParameterOption.Optional
    # onnx ships no schemas for ORT's contrib domain; this one is MatMulNBits' (the inputs quantlab uses)
    schema = OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[fp("A", "T1"), fp("B", "T2"), fp("scales", "T1"), fp("zero_points", "T3", param_option=optional)],
        outputs=[fp("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)"], "")],
        attributes=[attr(n, OpSchema.AttrType.INT, "") for n in ("K", "N", "bits", "block_size", "accuracy_level")])
    matmul_nbits_op = onnxscript.values.Op(msft, "MatMulNBits", schema)

    def onnx_matmul_nbits(x, packed, scales, zeros, K: int, N: int, bits: int, block_size: int,
                          accuracy_level: int):
        return matmul_nbits_op(x, packed, scales, zeros, K=K, N=N, bits=bits, block_size=block_size,
                               accuracy_level=accuracy_level)

    def onnx_matmul_a8w8(x, w_t, w_scale):
        amax = op.ReduceMax(op.Abs(x), op.Constant(value_ints=[-1]), keepdims=1)
        scale = op.Max(op.Div(amax, op.Constant(value_float=127.0)), op.Constant(value_float=_F32_TINY))
        q = op.Clip(op.Round(op.Div(x, scale)), op.Constant(value_float=-128.0), op.Constant(value_float=127.0))
        # uint8 codes q + 128 with zero point 128 give the same int32 sums as int8 q, on ORT's fast U8S8 path
        offset = op.Constant(value_float=128.0)
        acc = op.MatMulInteger(op.Cast(op.Add(q, offset), to=2), w_t, op.Constant(value=_u8_128()))  # 2: UINT8
        return op.Mul(op.Mul(op.Cast(acc, to=1), scale), w_scale)  # to=1: FLOAT

    return {torch.ops.quantlab.matmul_nbits.default: onnx_matmul_nbits,
            torch.ops.quantlab.matmul_a8w8.default: onnx_matmul_a8w8}
