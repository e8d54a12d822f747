"""QuantLinear: the module every weight quantizer swaps in for nn.Linear.

Two states, one numerics path (primitives.dequantize):
- prepared: holds the float weight; forward uses fake_quantize(weight) with
  either fixed qparams (set by a method: GPTQ, QAT, ...) or min-max ones.
- frozen:   holds packed integer codes + scale (+ zero); forward dequantizes.
The two forwards agree exactly (tests/test_qlinear.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..util.checks import check_dtype, check_int, resolve_dtype
from . import formats, packing
from .ggml import registry as ggmlreg
from .primitives import QParams, code_range, dequantize, fake_quantize, n_groups, qparams, quantize


@dataclass(frozen=True)
class WeightSpec:
    """How a weight is quantized: a grid (format), its group size (None = per output channel) and scales.

    format "int" (default): bits 2..8, symmetric or asymmetric (zero point), scales in scale_dtype.
    Other formats (core/formats.py: fp8_e4m3, nf4, mxfp4, nvfp4, ...) fix bits and are symmetric; `bits`
    left at its default takes the format's. MX fixes blocks of 32 and NVFP4 of 16 (group_size None takes
    them), NF4 defaults to absmax blocks of 64; double_quant (NF4 only) double-quantizes the absmax.
    scale_dtype None: the format's own (int float16, fp8/nf4 float32; MX E8M0 and NVFP4 E4M3 are fixed).
    any4 / any3 / any2 (core/lut.py) keep a table of 2^bits values per row (fp16 like their scales) and a scale +
    offset per group of 128 (by default): asymmetric, so symmetric reads false; method "any4" learns the tables.
    llama.cpp's types (core/ggml: q4_0, q4_k, q6_k, iq4_xs, ...) fix everything: bits (the code's), group_size (the
    type's block, 32 or 256), symmetric (false for the types with mins: q4_1, q5_1, q2_k, q4_k, q5_k), the scales.
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str | None = None
    format: str = "int"
    double_quant: bool = False

    def __post_init__(self):
        check_int("group_size", self.group_size, 1, allow_none=True)  # omitted: per output channel
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"double_quant must be true or false, got {self.double_quant!r}")
        if self.format in ggmlreg.GGML_TYPES:
            self._check_ggml(ggmlreg.GGML_TYPES[self.format])
            return
        if self.format == "int":
            check_int("bits", self.bits, 2, 8)
            if self.double_quant:
                raise ValueError("double_quant applies to format 'nf4' only, not to integer grids")
            if self.scale_dtype is not None and check_dtype("scale_dtype", self.scale_dtype) == "float16":
                object.__setattr__(self, "scale_dtype", None)  # the default, spelled out
            return
        if self.format not in formats.FORMATS:
            raise ValueError(f"unknown format {self.format!r}; known: int, {', '.join(formats.FORMATS)}, "
                             f"and llama.cpp's {', '.join(ggmlreg.GGML_TYPES)}")
        fmt = formats.get_format(self.format)
        check_int("bits", self.bits, 2, 8)
        if self.bits not in (4, fmt.bits):  # 4: the default, left as is
            raise ValueError(f"format {fmt.name!r} has {fmt.bits}-bit elements; bits = {self.bits} contradicts it "
                             f"(leave bits out or set {fmt.bits})")
        if fmt.scale == "lut":  # min-max groups with an offset: the format fixes it, as llama.cpp's types with mins
            object.__setattr__(self, "symmetric", False)
        elif self.symmetric is not True:
            raise ValueError(f"format {fmt.name!r} is symmetric (no zero point); symmetric = {self.symmetric!r}")
        group = self.group_size if self.group_size is not None else fmt.block
        if fmt.fixed_block and group != fmt.block:
            raise ValueError(f"format {fmt.name!r} fixes blocks of {fmt.block} (its spec); group_size = "
                             f"{self.group_size} is not allowed (leave it out)")
        if fmt.scale not in ("float", "lut"):
            if self.scale_dtype is not None:
                raise ValueError(f"format {fmt.name!r} stores its scales as {fmt.default_scale_dtype} (its spec); "
                                 f"scale_dtype = {self.scale_dtype!r} is not allowed (leave it out)")
        elif self.scale_dtype is not None and check_dtype("scale_dtype", self.scale_dtype) == fmt.default_scale_dtype:
            object.__setattr__(self, "scale_dtype", None)
        if self.double_quant and fmt.name != "nf4":
            raise ValueError(f"double_quant applies to format 'nf4' only, not {fmt.name!r}")
        object.__setattr__(self, "bits", fmt.bits)
        object.__setattr__(self, "group_size", group)

    def _check_ggml(self, t: ggmlreg.GGMLType) -> None:
        if self.bits not in (4, t.code_bits):
            raise ValueError(f"llama.cpp type {t.name!r} has {t.code_bits}-bit codes; bits = {self.bits} contradicts "
                             f"it (leave bits out)")
        if self.group_size not in (None, t.block):
            raise ValueError(f"llama.cpp type {t.name!r} fixes blocks of {t.block}; group_size = {self.group_size} "
                             f"is not allowed (leave it out)")
        if self.scale_dtype is not None or self.double_quant:
            raise ValueError(f"llama.cpp type {t.name!r} fixes how its scales are stored; leave scale_dtype and "
                             f"double_quant out")
        object.__setattr__(self, "bits", t.code_bits)
        object.__setattr__(self, "group_size", t.block)
        object.__setattr__(self, "symmetric", not ggmlreg.has_min(t))

    @property
    def ggml(self) -> ggmlreg.GGMLType | None:
        """The llama.cpp type (core/ggml), or None."""
        return ggmlreg.GGML_TYPES.get(self.format)

    @property
    def fmt(self) -> formats.Format | ggmlreg.GGMLType | None:
        """The non-integer format (a number format or a llama.cpp type), or None on an integer grid."""
        if self.format == "int":
            return None
        return formats.FORMATS.get(self.format) or ggmlreg.GGML_TYPES[self.format]

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        """The dtype scales are rounded to (MX: powers of two and NVFP4: E4M3 values, held in float32)."""
        if self.scale_dtype is not None:
            return resolve_dtype(self.scale_dtype)
        if self.fmt is None or self.ggml is not None:
            return torch.float16
        return torch.float32 if self.fmt.scale not in ("float", "lut") else resolve_dtype(self.fmt.default_scale_dtype)

    def qparams(self, w: torch.Tensor, tensor_amax: torch.Tensor | None = None,
                importance: torch.Tensor | None = None) -> QParams:
        """Min-max (absmax) qparams per group of w; tensor_amax: NVFP4's tensor-level amax (default w's own).

        A llama.cpp type runs its own quantizer (importance: its quant_weights per input column, e.g. an imatrix
        row) and keeps the resulting GGUF bytes: QParams.extra["raw"] (out, in / block * type_size) uint8."""
        if self.ggml is not None:
            raw = ggmlreg.quantize_rows(w, self.format, importance)
            return QParams(torch.empty(0), None, {"raw": raw})
        if self.fmt is None:
            return qparams(w, self.bits, self.group_size, self.symmetric, self.torch_scale_dtype)
        return formats.format_qparams(w, self.fmt, self.group_size, self.torch_scale_dtype, tensor_amax,
                                      self.double_quant)

    def fake_quantize(self, w: torch.Tensor, p: QParams, ste: bool = True) -> torch.Tensor:
        """Float in, float out, on the grid (a llama.cpp type: its bytes decoded, gradients straight through)."""
        if self.ggml is not None:
            q = ggmlreg.dequantize_rows(p.extra["raw"], self.format, w.shape[-1]).to(w.dtype)
            return q + (w - w.detach()) if ste and w.requires_grad else q  # value q exactly, gradient to w
        if self.fmt is None:
            return fake_quantize(w, p, self.bits, self.group_size, ste=ste)
        return formats.format_fake_quantize(w, p, self.fmt, self.group_size, ste=ste)

    def encode(self, w: torch.Tensor, p: QParams) -> torch.Tensor:
        """Float (..., K) -> unsigned codes in [0, 2^bits) as uint8 (integer grids: q - qmin; a llama.cpp type:
        each weight's level index in its block, read from p's bytes)."""
        if self.ggml is not None:
            return ggmlreg.codes_rows(p.extra["raw"], self.format, w.shape[-1])
        if self.fmt is None:
            q = quantize(w, p, self.bits, self.group_size).to(torch.int32)
            return (q - code_range(self.bits, self.symmetric)[0]).to(torch.uint8)
        return formats.format_quantize(w, p, self.fmt, self.group_size)

    def scale_nbytes(self, n_scales: int) -> int:
        """Bytes of n_scales group scales as stored (integer grids: + one zero byte each when asymmetric; a llama.cpp
        type: its block bytes beyond the codes)."""
        if self.ggml is not None:
            return n_scales * self.ggml.type_size - packing.packed_nbytes(n_scales * self.ggml.block, self.bits)
        if self.fmt is None:
            return n_scales * (self.torch_scale_dtype.itemsize + (0 if self.symmetric else 1))
        return formats.scale_nbytes(self.fmt, n_scales, self.torch_scale_dtype, self.double_quant)

    def table_nbytes(self, rows: int) -> int:
        """Bytes of the per-row tables of a layer with `rows` output features (any4 / any3 / any2; else 0)."""
        if self.fmt is None or self.ggml is not None:
            return 0
        return formats.table_nbytes(self.fmt, rows, self.torch_scale_dtype)

    def describe(self) -> str:
        g = "channel" if self.group_size is None else f"g{self.group_size}"
        if self.ggml is not None:
            return f"{self.format} {g}"
        if self.fmt is None:
            return f"w{self.bits} {g} {'sym' if self.symmetric else 'asym'}"
        return f"{self.format}{'+dq' if self.double_quant else ''} {g}"


class QuantLinear(nn.Module):
    """nn.Linear with a quantized weight. Build with QuantLinear.from_linear(linear, spec)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: WeightSpec):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.weight: nn.Parameter | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.fixed_qparams: QParams | None = None  # set by methods that choose their own scales
        self.frozen = False
        # Optional input transforms, applied in this order before the matmul:
        #   input_scale (in,): x / input_scale, a smoothing scale kept explicit where it cannot be
        #       folded into a producer (the weight columns were multiplied by it);
        #   act_quant: an activation (fake-)quantizer module, e.g. dynamic per-token int8.
        self.register_buffer("input_scale", None)
        self.quant_enabled = True  # False: prepared layer computes with its float weight (calibration passes)
        self.act_quant: nn.Module | None = None
        # evaluation cache (lifecycle.cached_weights): {dtype: the weight the forward multiplies by}, so a
        # no-grad evaluation dequantizes / fake-quantizes each weight once instead of on every forward
        self.weight_cache: dict | None = None
        # llama.cpp types: the importance of each input column (an imatrix row, mean x^2) their quantizers weigh
        # the rounding error by; None: the types' unweighted reference path
        self.register_buffer("importance", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: WeightSpec) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, spec)
        q.weight = linear.weight  # shared, not copied; convert() releases it
        q.bias = linear.bias
        return q

    def current_qparams(self) -> QParams:
        if self.fixed_qparams is not None:
            return self.fixed_qparams
        if self.spec.ggml is not None:
            return self.spec.qparams(self.weight, importance=self.importance)
        return self.spec.qparams(self.weight)

    @property
    def float_zero(self) -> bool:
        """Real-valued zero points (HQQ): a frozen zero_f buffer, or fixed qparams with float_zero."""
        if self.frozen:
            return getattr(self, "zero_f", None) is not None
        return self.fixed_qparams is not None and self.fixed_qparams.float_zero

    def quantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the forward multiplies by: fake-quantized (prepared) or dequantized codes (frozen).

        Inside lifecycle.cached_weights and without grad, computed once per dtype and reused (the same tensor,
        so the forward is bitwise the uncached one)."""
        if self.weight_cache is not None and not torch.is_grad_enabled():
            if dtype not in self.weight_cache:
                self.weight_cache[dtype] = self._weight(dtype)
            return self.weight_cache[dtype]
        return self._weight(dtype)

    def _weight(self, dtype: torch.dtype | None) -> torch.Tensor:
        if self.frozen and self.spec.ggml is not None:  # qweight: the GGUF bytes of the tensor
            return ggmlreg.dequantize_rows(self.qweight, self.spec.format, self.in_features).to(dtype or torch.float32)
        if self.frozen and self.spec.fmt is not None:
            codes = packing.unpack(self.qweight, self.spec.bits, self.out_features * self.in_features)
            codes = codes.view(self.out_features, self.in_features)
            return formats.format_dequantize(codes, self.stored_qparams(), self.spec.fmt, self.spec.group_size,
                                             dtype or torch.float32)
        if self.frozen:
            # unsigned codes u = q - qmin; (u - zero_u) * scale equals the fake-quant (q - zero) * scale exactly,
            # since u - zero_u == q - zero as integers (zero_u = zero - qmin, or -qmin when symmetric).
            codes = packing.unpack(self.qweight, self.spec.bits, self.out_features * self.in_features)
            codes = codes.view(self.out_features, self.in_features)
            if self.float_zero:  # HQQ: asymmetric (qmin = 0), so u == q and (u - zero_f) * scale is the fake-quant's
                p = QParams(self.scale, self.zero_f, float_zero=True)
            else:
                zero_u = self.zero_u if not self.spec.symmetric else torch.tensor(-code_range(self.spec.bits, True)[0])
                p = QParams(self.scale, zero_u)
            return dequantize(codes, p, self.spec.group_size, dtype or torch.float32)
        if not self.quant_enabled:
            return self.weight
        return self.spec.fake_quantize(self.weight, self.current_qparams())

    def stored_qparams(self) -> QParams:
        """A frozen non-integer-format layer's qparams, rebuilt from its stored scale tensors."""
        buffers = {k: getattr(self, k) for k in formats.SCALE_BUFFERS if getattr(self, k, None) is not None}
        shape = (self.out_features, n_groups(self.in_features, self.spec.group_size))
        return formats.qparams_from_storage(buffers, self.spec.fmt, torch.Size(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        if self.act_quant is not None:
            x = self.act_quant(x)
        return F.linear(x, self.quantized_weight(x.dtype), self.bias)

    @torch.no_grad()
    def freeze(self) -> None:
        """Replace the float weight by packed integer codes + scale (+ zero)."""
        if self.frozen:
            return
        p = self.current_qparams()
        if self.spec.ggml is not None:
            self.register_buffer("qweight", p.extra["raw"].clone())
            self.weight, self.fixed_qparams, self.importance, self.frozen = None, None, None, True
            return
        if self.spec.fmt is not None:
            self.register_buffer("qweight", packing.pack(self.spec.encode(self.weight, p), self.spec.bits))
            for key, value in formats.scale_storage(p, self.spec.fmt, self.spec.torch_scale_dtype).items():
                self.register_buffer(key, value)
            self.weight, self.fixed_qparams, self.frozen = None, None, True
            return
        codes = quantize(self.weight, p, self.spec.bits, self.spec.group_size).to(torch.int32)
        unsigned = codes - code_range(self.spec.bits, self.spec.symmetric)[0]
        self.register_buffer("qweight", packing.pack(unsigned, self.spec.bits))
        self.register_buffer("scale", p.scale.clone())
        if p.float_zero:  # HQQ's real-valued zero, stored as the forward used it (no rounding here)
            if p.zero.dtype != self.spec.torch_scale_dtype:
                raise ValueError(f"a float zero must be in the scale dtype {self.spec.torch_scale_dtype}, "
                                 f"got {p.zero.dtype} (round it there before the fake-quant forward)")
            self.register_buffer("zero_f", p.zero.clone())
        elif p.zero is not None:  # asymmetric codes are already unsigned (qmin = 0)
            self.register_buffer("zero_u", p.zero.to(torch.uint8))
        self.weight = None
        self.fixed_qparams = None
        self.frozen = True

    def storage_bytes(self) -> int:
        """Bytes of the quantized weight: codes + scales + zeros (bias excluded)."""
        if self.spec.ggml is not None:  # llama.cpp's blocks, whole
            return self.out_features * self.in_features // self.spec.group_size * self.spec.ggml.type_size
        if self.frozen and self.spec.fmt is not None:
            return self.qweight.nbytes + sum(getattr(self, k).nbytes for k in formats.SCALE_BUFFERS
                                             if getattr(self, k, None) is not None)
        if self.frozen:
            zero = 0 if self.spec.symmetric else (self.zero_f if self.float_zero else self.zero_u).nbytes
            return self.qweight.nbytes + self.scale.nbytes + zero
        n = self.out_features * self.in_features
        groups = self.out_features * n_groups(self.in_features, self.spec.group_size)
        if self.float_zero:  # HQQ: a scale and a zero per group, both in the scale dtype (freeze checks it)
            return packing.packed_nbytes(n, self.spec.bits) + 2 * groups * self.spec.torch_scale_dtype.itemsize
        tables = self.spec.table_nbytes(self.out_features)  # any4's per-row tables
        return packing.packed_nbytes(n, self.spec.bits) + self.spec.scale_nbytes(groups) + tables

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.spec.describe()}, "
                f"{'frozen' if self.frozen else 'fake-quant'}")
