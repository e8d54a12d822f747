"""Number formats beyond integer grids: FP8, FP6, FP4 (OCP), NF4, MX and NVFP4 — pure numerics.

Two layers, as the specs define them:

- **Element formats** (`ELEMENTS`, in core/elements.py, re-exported here): what one code means.
  Sign-magnitude minifloats E4M3 ("fn": max 448, no inf, one NaN), E5M2 (IEEE-like, max 57344), E3M2 / E2M3 (FP6) and E2M1 (FP4) from the OCP
  Microscaling spec v1.0; NF4 (Dettmers et al. 2023, the 16 normal-float levels of bitsandbytes);
  MX's INT8 (two's complement with an implicit scale 2^-6, kept symmetric in ±127/64). `encode` rounds to
  nearest, ties to even (the even code: for minifloats that is the even mantissa), saturating at the largest
  finite value; NF4 ties go to the lower level (bitsandbytes' strict `x > midpoint`). Codes are uint8:
  sign bit at position bits-1 for minifloats, the level's index for NF4, two's complement bits for INT8.

- **Formats** (`FORMATS`): an element format plus how blocks share a scale.
    fp8_e4m3, fp8_e5m2   scale = amax / max_element in scale_dtype (fp32 by default), per channel or group
    nf4                  absmax blocks (64 by default), optional double quantization of the absmax
    mxfp8_e4m3 ... mxint8  blocks of 32 share an E8M0 power of two 2^(floor(log2 amax) - emax_elem)
    nvfp4                E2M1 blocks of 16 with FP8 E4M3 scales, times one fp32 scale per tensor
    any4, any3, any2     a learned table of 2^bits values per row, min-max groups (128) with a scale + offset
                         (scale rule "lut", numerics in core/lut.py; method "any4" learns the tables)

Scales live in QParams (scale: the effective fp32 scale per group; `extra`: what the stored form needs
beyond it, e.g. NVFP4's tensor scale). `fake_quantize` = decode(encode(x / scale)) * scale, the frozen
forward uses the same decode, so the two agree bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .elements import (  # noqa: F401  (re-exported: formats is the one import for callers)
    ELEMENTS,
    NF4_LEVELS,
    TORCH_FP8,
    Element,
    decode,
    element_values,
    encode,
    encode_by_table,
    finite_magnitudes,
    round_to_element,
)
from .lut import (
    lut_dequantize,
    lut_encode,
    lut_fake_quantize,
    lut_from_storage,
    lut_qparams,
    lut_storage,
    lut_storage_shapes,
)
from .primitives import QParams, grouped, ungrouped

# ---- formats: an element plus a shared-scale rule -------------------------------------------


@dataclass(frozen=True)
class Format:
    """scale: "float" (amax / max element, in the spec's scale_dtype), "e8m0" (MX), "nvfp4" (E4M3 x fp32), "lut" (a
    table per row learned from the weights, min-max groups with a scale + offset: core/lut.py).

    block: the block size the spec fixes (fixed_block) or the default group size (None: per channel).
    """

    name: str
    element: Element
    scale: str
    block: int | None = None
    fixed_block: bool = False
    default_scale_dtype: str = "float32"
    summary: str = ""

    @property
    def bits(self) -> int:
        return self.element.bits


def _mx(name: str, element: str, summary: str) -> Format:
    return Format(name, ELEMENTS[element], "e8m0", 32, True, "e8m0", summary)


def _any(bits: int) -> Format:
    return Format(f"any{bits}", Element(f"any{bits}", bits, "lut"), "lut", 128, False, "float16",
                  f"any{bits} (Elhoushi & Johnson 2025): {2 ** bits} fp16 values per row learned by k-means, "
                  f"min-max groups of 128 with fp16 scale + offset; method \"any4\" learns it")


FORMATS = {f.name: f for f in (
    Format("fp8_e4m3", ELEMENTS["e4m3"], "float", summary="FP8 E4M3 (OCP fn, max 448), fp32 scale per channel/group"),
    Format("fp8_e5m2", ELEMENTS["e5m2"], "float", summary="FP8 E5M2 (max 57344), fp32 scale per channel/group"),
    Format("nf4", ELEMENTS["nf4"], "float", 64, summary="NF4 (QLoRA): 16 normal-float levels, absmax blocks of 64"),
    _mx("mxfp8_e4m3", "e4m3", "OCP MX: FP8 E4M3 elements, E8M0 scale per 32"),
    _mx("mxfp8_e5m2", "e5m2", "OCP MX: FP8 E5M2 elements, E8M0 scale per 32"),
    _mx("mxfp6_e3m2", "e3m2", "OCP MX: FP6 E3M2 elements, E8M0 scale per 32"),
    _mx("mxfp6_e2m3", "e2m3", "OCP MX: FP6 E2M3 elements, E8M0 scale per 32"),
    _mx("mxfp4", "e2m1", "OCP MX: FP4 E2M1 elements, E8M0 scale per 32"),
    _mx("mxint8", "int8", "OCP MX: INT8 elements (implicit 2^-6, symmetric ±127), E8M0 scale per 32"),
    Format("nvfp4", ELEMENTS["e2m1"], "nvfp4", 16, True, "float8_e4m3fn",
           "NVFP4: E2M1 elements, FP8 E4M3 scale per 16, one fp32 scale per tensor"),
    _any(4), _any(3), _any(2),
)}

# a frozen layer's scale tensors, whichever its format keeps
SCALE_BUFFERS = ("scale", "scale_e8m0", "tensor_scale", "dq_codes", "dq_scale", "dq_mean", "lut_offset", "lut")
DQ_BLOCK = 256  # QLoRA's double quantization: the absmax scales in blocks of 256, as 8-bit floats
E4M3_MAX = 448.0
E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2^-6, the smallest normal E4M3 (torchao's E4M3_EPS)


SCALE_RULES = ("float", "e8m0", "nvfp4")


def register_format(fmt: Format) -> Format:
    """Make a number format usable by name wherever a format goes (`format = "..."` on rtn, gptq, ..., overrides).

    Its element may be a lookup table (kind "nf" with its own 2^bits levels) or a minifloat (kind "fp"), with one of
    the scale rules above. Returns fmt, so a plugin can keep it:

    >>> SF4 = register_format(Format("sf4", Element("sf4", 4, "nf", levels=STUDENT_T_LEVELS), "float", 64))
    """
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format takes a quantlab.core.formats.Format, got {type(fmt).__name__}")
    if fmt.name == "int" or fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is already registered; taken: int, {', '.join(FORMATS)}")
    if fmt.scale not in SCALE_RULES:
        raise ValueError(f"format {fmt.name!r}: scale rule {fmt.scale!r} unknown; known: {', '.join(SCALE_RULES)}")
    if not 2 <= fmt.element.bits <= 8:
        raise ValueError(f"format {fmt.name!r}: {fmt.element.bits}-bit elements; codes are stored in 2..8 bits")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; known: int, {', '.join(FORMATS)}")
    return FORMATS[name]


def e8m0_exponent(amax: torch.Tensor, element: Element) -> torch.Tensor:
    """MX shared exponent floor(log2 amax) - emax_elem, clamped to E8M0's [-127, 127] (spec §6.3, torchao FLOOR).

    floor(log2) is read from the fp32 exponent bits, as torchao does (a zero block gets -127).
    """
    biased = (amax.float().contiguous().view(torch.int32) >> 23) & 0xFF
    return (biased - 127 - element.emax).clamp(-127, 127)


def dq_scales(absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """QLoRA double quantization of fp32 absmax scales: minus their mean, blocks of 256 as FP8 E4M3 codes with an
    fp32 scale per block (the paper's "8-bit floats"; bitsandbytes uses its own 8-bit dynamic map: a variant)."""
    flat = absmax.float().reshape(-1)
    mean = flat.mean()
    blocks = grouped((flat - mean)[None], DQ_BLOCK)[0]  # (n_blocks, 256)
    block_scale = (blocks.abs().amax(-1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = encode(blocks / block_scale[:, None], ELEMENTS["e4m3"])
    return {"dq_codes": ungrouped(codes[None], flat.numel())[0], "dq_scale": block_scale, "dq_mean": mean}


def dq_absmax(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The absmax values double quantization stores (dequantized), shaped like the original; clamped > 0."""
    codes = grouped(parts["dq_codes"][None].float(), DQ_BLOCK)[0].to(torch.uint8)  # (n_blocks, 256)
    values = decode(codes, ELEMENTS["e4m3"]) * parts["dq_scale"][:, None] + parts["dq_mean"]
    flat = ungrouped(values[None], parts["dq_codes"].numel())[0]
    return flat.clamp(min=torch.finfo(torch.float32).tiny).reshape(shape)


def format_qparams(
    x: torch.Tensor, fmt: Format, group_size: int | None, scale_dtype: torch.dtype = torch.float32,
    tensor_amax: torch.Tensor | None = None, double_quant: bool = False,
):
    """Scales per group of the last dim of x (..., K) -> QParams(scale (..., n_groups) fp32 effective block scale,
    zero None, extra). NVFP4's per-tensor scale comes from tensor_amax (default: x's own amax).

    >>> p = format_qparams(w, FORMATS["mxfp4"], 32)   # p.scale: powers of two, p.extra["e8m0"]: uint8

    A "lut" format (any4): min-max scale + offset and each row's table by plain (unweighted) k-means.
    """
    if fmt.scale == "lut":
        return lut_qparams(x, fmt.bits, group_size, scale_dtype)
    amax = grouped(x.detach().float(), group_size).abs().amax(-1)  # (..., n_groups)
    if fmt.scale == "float":
        info = torch.finfo(scale_dtype)
        scale = (amax / fmt.element.max_value).clamp(info.tiny, info.max).to(scale_dtype)
        if double_quant:
            parts = dq_scales(scale)
            return QParams(dq_absmax(parts, scale.shape), None, parts)
        return QParams(scale, None)
    if fmt.scale == "e8m0":
        exponent = e8m0_exponent(amax, fmt.element)
        scale = torch.ldexp(torch.ones_like(amax), exponent)  # exactly 2^e (subnormal fp32 at e = -127)
        return QParams(scale, None, {"e8m0": (exponent + 127).to(torch.uint8)})
    t = x.detach().float().abs().amax() if tensor_amax is None else tensor_amax.float()
    tensor_scale = (t / (E4M3_MAX * fmt.element.max_value)).clamp(min=torch.finfo(torch.float32).tiny)
    block = (amax / fmt.element.max_value / tensor_scale).clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
    return QParams(block.float(), None, {"tensor_scale": tensor_scale})


def with_scales(scales: torch.Tensor, template, fmt: Format):
    """QParams with these block scales and the template's tensor-level parts (e8m0 codes follow the scales)."""
    if fmt.scale == "lut":
        raise ValueError(f"format {fmt.name!r}: its scales come with a table fitted to the whole row; they cannot be "
                         f"set group by group (GPTQ over a learned table is not ported)")
    if fmt.scale == "e8m0":
        return QParams(scales, None, {"e8m0": (torch.frexp(scales)[1] - 1 + 127).to(torch.uint8)})
    if fmt.scale == "nvfp4":
        return QParams(scales, None, {"tensor_scale": template.extra["tensor_scale"]})
    return QParams(scales, None)


def effective_scale(p, fmt: Format) -> torch.Tensor:
    """The fp32 factor a decoded element is multiplied by, per group (NVFP4: tensor scale x block scale)."""
    if fmt.scale == "nvfp4":
        return p.extra["tensor_scale"] * p.scale.float()
    return p.scale.float()


def _units(xg: torch.Tensor, p, fmt: Format) -> torch.Tensor:
    """Grouped floats (..., n_groups, g) -> element units."""
    if fmt.scale == "nvfp4":  # torchao / the MSLK kernel multiply by (1 / tensor scale) / block scale
        return xg * ((1.0 / p.extra["tensor_scale"]) / p.scale.float()).unsqueeze(-1)
    return xg / p.scale.float().unsqueeze(-1)


def format_quantize(x: torch.Tensor, p, fmt: Format, group_size: int | None) -> torch.Tensor:
    """Floats (..., K) -> uint8 codes (..., K)."""
    if fmt.scale == "lut":
        return lut_encode(x, p, group_size)
    return ungrouped(encode(_units(grouped(x.float(), group_size), p, fmt), fmt.element), x.shape[-1])


def format_dequantize(codes: torch.Tensor, p, fmt: Format, group_size: int | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes (..., K) -> floats decode(code) * effective scale ("lut": lut[row, code] * scale + offset)."""
    if fmt.scale == "lut":
        return lut_dequantize(codes, p, group_size, dtype)
    values = grouped(decode(codes, fmt.element), group_size) * effective_scale(p, fmt).unsqueeze(-1)
    return ungrouped(values, codes.shape[-1]).to(dtype)


def format_fake_quantize(x: torch.Tensor, p, fmt: Format, group_size: int | None, ste: bool = True) -> torch.Tensor:
    """dequantize(quantize(x)) in fp32, returned in x's dtype; with ste the rounding passes gradients (STE)."""
    if fmt.scale == "lut":
        return lut_fake_quantize(x, p, group_size, ste)
    xg = grouped(x.float(), group_size)
    q = round_to_element(_units(xg, p, fmt), fmt.element, ste) * effective_scale(p, fmt).unsqueeze(-1)
    return ungrouped(q, x.shape[-1]).to(x.dtype)


def scale_storage(p, fmt: Format, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a frozen layer keeps for its scales, in their stored dtype."""
    if fmt.scale == "lut":
        return lut_storage(p, scale_dtype)
    if fmt.scale == "e8m0":
        return {"scale_e8m0": p.extra["e8m0"].clone()}
    if fmt.scale == "nvfp4":
        return {"scale": p.scale.to(torch.float8_e4m3fn), "tensor_scale": p.extra["tensor_scale"].clone()}
    if p.extra is not None and "dq_codes" in p.extra:
        return {k: v.clone() for k, v in p.extra.items()}
    return {"scale": p.scale.to(scale_dtype).clone()}


def qparams_from_storage(buffers: dict[str, torch.Tensor], fmt: Format, shape: torch.Size):
    """Inverse of scale_storage: the QParams the fake-quant forward used, bit for bit."""
    if "lut" in buffers:
        return lut_from_storage(buffers)
    if "scale_e8m0" in buffers:
        e = buffers["scale_e8m0"]
        return QParams(torch.ldexp(torch.ones(e.shape, device=e.device), e.to(torch.int32) - 127), None, {"e8m0": e})
    if "tensor_scale" in buffers:
        return QParams(buffers["scale"].float(), None, {"tensor_scale": buffers["tensor_scale"]})
    if "dq_codes" in buffers:
        return QParams(dq_absmax(buffers, shape), None, dict(buffers))
    return QParams(buffers["scale"], None)


def storage_shapes(fmt: Format, groups: tuple, scale_dtype: torch.dtype,
                   double_quant: bool) -> dict[str, tuple[tuple, torch.dtype]]:
    """Buffer name -> (shape, dtype) of a frozen layer's scales (groups = (out, n_groups)), for loading."""
    if fmt.scale == "lut":
        return lut_storage_shapes(groups, fmt.bits, scale_dtype)
    if fmt.scale == "e8m0":
        return {"scale_e8m0": (groups, torch.uint8)}
    if fmt.scale == "nvfp4":
        return {"scale": (groups, torch.float8_e4m3fn), "tensor_scale": ((), torch.float32)}
    if double_quant:
        n = math.prod(groups)
        return {"dq_codes": ((n,), torch.uint8), "dq_scale": ((math.ceil(n / DQ_BLOCK),), torch.float32),
                "dq_mean": ((), torch.float32)}
    return {"scale": (groups, scale_dtype)}


def scale_nbytes(fmt: Format, n_scales: int, scale_dtype: torch.dtype, double_quant: bool) -> int:
    """Bytes of a layer's scales: E8M0 one byte each, NVFP4 one E4M3 byte each + a fp32 tensor scale,
    double-quantized NF4 one byte each + fp32 per 256 + the fp32 mean; a "lut" format a scale + offset each (its
    tables: table_nbytes)."""
    if fmt.scale == "lut":
        return 2 * n_scales * scale_dtype.itemsize
    if fmt.scale == "e8m0":
        return n_scales
    if fmt.scale == "nvfp4":
        return n_scales + 4
    if double_quant:
        return n_scales + 4 * math.ceil(n_scales / DQ_BLOCK) + 4
    return n_scales * scale_dtype.itemsize


def table_nbytes(fmt: Format, rows: int, scale_dtype: torch.dtype) -> int:
    """Bytes of a layer's per-row tables: 2^bits values per row in the scale dtype ("lut" formats; else 0)."""
    return rows * 2**fmt.bits * scale_dtype.itemsize if fmt.scale == "lut" else 0
