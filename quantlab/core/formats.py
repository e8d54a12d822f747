"""Number formats beyond integer grids: FP8, FP6, FP4 (OCP), NF4, MX and NVFP4 — pure numerics.

Two layers, as the specs define them:

- **Element formats** (`ELEMENTS`): what one code means. Sign-magnitude minifloats E4M3 ("fn": max 448,
  no inf, one NaN), E5M2 (IEEE-like, max 57344), E3M2 / E2M3 (FP6) and E2M1 (FP4) from the OCP
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

Scales live in QParams (scale: the effective fp32 scale per group; `extra`: what the stored form needs
beyond it, e.g. NVFP4's tensor scale). `fake_quantize` = decode(encode(x / scale)) * scale, the frozen
forward uses the same decode, so the two agree bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

# ---- element formats ------------------------------------------------------------------------


@dataclass(frozen=True)
class Element:
    """One element format. kind: "fp" (sign-magnitude minifloat), "nf" (lookup table), "int" (two's complement)."""

    name: str
    bits: int
    kind: str
    ebits: int = 0
    mbits: int = 0
    nan_code: bool = False  # E4M3fn: S.1111.111 is NaN (the only non-finite code)
    ieee: bool = False  # E5M2: the top exponent is inf / NaN

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def max_value(self) -> float:
        return float(finite_magnitudes(self)[-1])

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max_value (MX's emax_elem)."""
        return math.floor(math.log2(self.max_value))


NF4_LEVELS = (  # bitsandbytes functional.py `get_4bit_type("nf4")`, the QLoRA paper's Appendix E table
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)

ELEMENTS = {
    "e4m3": Element("e4m3", 8, "fp", 4, 3, nan_code=True),
    "e5m2": Element("e5m2", 8, "fp", 5, 2, ieee=True),
    "e3m2": Element("e3m2", 6, "fp", 3, 2),
    "e2m3": Element("e2m3", 6, "fp", 2, 3),
    "e2m1": Element("e2m1", 4, "fp", 2, 1),
    "nf4": Element("nf4", 4, "nf"),
    "int8": Element("int8", 8, "int"),
}


def _minifloat_value(e: Element, code: int) -> float:
    sign = -1.0 if code >> (e.bits - 1) else 1.0
    exp, mant = (code >> e.mbits) & ((1 << e.ebits) - 1), code & ((1 << e.mbits) - 1)
    top = (1 << e.ebits) - 1
    if e.ieee and exp == top:
        return sign * math.inf if mant == 0 else math.nan
    if e.nan_code and exp == top and mant == (1 << e.mbits) - 1:
        return math.nan
    if exp == 0:  # subnormal
        return sign * mant / 2**e.mbits * 2.0 ** (1 - e.bias)
    return sign * (1 + mant / 2**e.mbits) * 2.0 ** (exp - e.bias)


@cache
def _values_list(e: Element) -> tuple[float, ...]:
    if e.kind == "fp":
        return tuple(_minifloat_value(e, c) for c in range(2**e.bits))
    if e.kind == "nf":
        return NF4_LEVELS
    return tuple((c - 256 if c >= 128 else c) / 64 for c in range(256))  # int8: code c is two's complement


def element_values(e: Element) -> torch.Tensor:
    """Code -> value for every code (float64, NaN / inf where the format has them).

    >>> element_values(ELEMENTS["e2m1"])[:8].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6]
    """
    return torch.tensor(_values_list(e), dtype=torch.float64)


@cache
def _magnitudes(e: Element) -> tuple[float, ...]:
    values = _values_list(e)
    if e.kind == "fp":  # positive codes 0 .. 2^(b-1)-1 are increasing; stop at the first non-finite one
        out = []
        for v in values[: 2 ** (e.bits - 1)]:
            if not math.isfinite(v):
                break
            out.append(v)
        return tuple(out)
    if e.kind == "int":
        return tuple(c / 64 for c in range(128))
    return values  # nf4: the signed levels, ascending


def finite_magnitudes(e: Element) -> torch.Tensor:
    """Ascending finite magnitudes (fp, int) or signed levels (nf4), float32."""
    return torch.tensor(_magnitudes(e), dtype=torch.float32)


def _nearest(table: torch.Tensor, a: torch.Tensor, ties_even: bool) -> torch.Tensor:
    """Index of the nearest entry of an ascending table for each a; ties to the even index, or the lower one."""
    mids = (table[:-1] + table[1:]) / 2  # exact: neighbouring levels are close dyadic (or fp32) numbers
    lo = torch.searchsorted(mids, a, right=False)  # a == mids[k] -> k (the lower level)
    if not ties_even:
        return lo
    hi = torch.searchsorted(mids, a, right=True)  # a == mids[k] -> k + 1
    return torch.where((lo != hi) & (lo % 2 == 1), hi, lo)


def encode(x: torch.Tensor, e: Element) -> torch.Tensor:
    """Floats in element units -> uint8 codes: nearest, ties to even, saturating. NaN in x is an error.

    >>> encode(torch.tensor([0.25, 0.75, -7.0]), ELEMENTS["e2m1"]).tolist() == [0, 2, 15]
    """
    x = x.detach().float()
    if torch.isnan(x).any():
        raise ValueError(f"cannot encode NaN as {e.name}")
    if e.name in TORCH_FP8:  # the same rounding (RNE, saturated by the clamp) as the table search, much faster
        return x.clamp(-e.max_value, e.max_value).to(TORCH_FP8[e.name]).view(torch.uint8)
    return encode_by_table(x, e)


def encode_by_table(x: torch.Tensor, e: Element) -> torch.Tensor:
    """encode() by a nearest-level search over the format's own value table (the reference for every format)."""
    x = x.detach().float()
    table = finite_magnitudes(e).to(x.device)
    if e.kind == "nf":
        return _nearest(table, x.clamp(-1.0, 1.0).contiguous(), ties_even=False).to(torch.uint8)
    a = x.abs().clamp(max=float(table[-1])).contiguous()
    idx = _nearest(table, a, ties_even=True)
    if e.kind == "int":
        return torch.where(torch.signbit(x), -idx, idx).to(torch.int16).bitwise_and(0xFF).to(torch.uint8)
    return (idx | (torch.signbit(x).to(idx.dtype) << (e.bits - 1))).to(torch.uint8)


TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def decode(codes: torch.Tensor, e: Element, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes -> values (a table lookup). >>> decode(torch.tensor([15], dtype=torch.uint8), ELEMENTS["e2m1"])"""
    table = element_values(e).to(device=codes.device, dtype=torch.float32)
    return table[codes.long()].to(dtype)


class _ElementRoundSTE(torch.autograd.Function):
    """decode(encode(u)) forward; backward passes the gradient where u is inside the format's range (STE)."""

    @staticmethod
    def forward(ctx, u, e: Element):
        lim = e.max_value
        ctx.save_for_backward((u >= (-1.0 if e.kind == "nf" else -lim)) & (u <= lim))
        return decode(encode(u, e), e, u.dtype)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside, None


def round_to_element(u: torch.Tensor, e: Element, ste: bool = False) -> torch.Tensor:
    """u in element units -> the nearest representable value (same dtype); differentiable with ste=True."""
    if ste and u.requires_grad:
        return _ElementRoundSTE.apply(u, e)
    return decode(encode(u, e), e, u.dtype)


# ---- formats: an element plus a shared-scale rule -------------------------------------------


@dataclass(frozen=True)
class Format:
    """scale: "float" (amax / max element, in the spec's scale_dtype), "e8m0" (MX), "nvfp4" (E4M3 x fp32).

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
)}

SCALE_BUFFERS = ("scale", "scale_e8m0", "tensor_scale", "dq_codes", "dq_scale", "dq_mean")  # a frozen layer's
DQ_BLOCK = 256  # QLoRA's double quantization: the absmax scales in blocks of 256, as 8-bit floats
E4M3_MAX = 448.0
E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2^-6, the smallest normal E4M3 (torchao's E4M3_EPS)


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; known: int, {', '.join(FORMATS)}")
    return FORMATS[name]


def _grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    from .primitives import _grouped as grouped  # one grouping convention (ragged tail zero-padded)
    return grouped(x, group_size)


def _ungrouped(xg: torch.Tensor, k: int) -> torch.Tensor:
    return xg.reshape(*xg.shape[:-2], -1)[..., :k]


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
    blocks = _grouped((flat - mean)[None], DQ_BLOCK)[0]  # (n_blocks, 256)
    block_scale = (blocks.abs().amax(-1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = encode(blocks / block_scale[:, None], ELEMENTS["e4m3"])
    return {"dq_codes": _ungrouped(codes[None], flat.numel())[0], "dq_scale": block_scale, "dq_mean": mean}


def dq_absmax(parts: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The absmax values double quantization stores (dequantized), shaped like the original; clamped > 0."""
    codes = _grouped(parts["dq_codes"][None].float(), DQ_BLOCK)[0].to(torch.uint8)  # (n_blocks, 256)
    values = decode(codes, ELEMENTS["e4m3"]) * parts["dq_scale"][:, None] + parts["dq_mean"]
    flat = _ungrouped(values[None], parts["dq_codes"].numel())[0]
    return flat.clamp(min=torch.finfo(torch.float32).tiny).reshape(shape)


def format_qparams(
    x: torch.Tensor, fmt: Format, group_size: int | None, scale_dtype: torch.dtype = torch.float32,
    tensor_amax: torch.Tensor | None = None, double_quant: bool = False,
):
    """Scales per group of the last dim of x (..., K) -> QParams(scale (..., n_groups) fp32 effective block scale,
    zero None, extra). NVFP4's per-tensor scale comes from tensor_amax (default: x's own amax).

    >>> p = format_qparams(w, FORMATS["mxfp4"], 32)   # p.scale: powers of two, p.extra["e8m0"]: uint8
    """
    from .primitives import QParams

    amax = _grouped(x.detach().float(), group_size).abs().amax(-1)  # (..., n_groups)
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
    from .primitives import QParams

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
    return _ungrouped(encode(_units(_grouped(x.float(), group_size), p, fmt), fmt.element), x.shape[-1])


def format_dequantize(codes: torch.Tensor, p, fmt: Format, group_size: int | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes (..., K) -> floats decode(code) * effective scale."""
    values = _grouped(decode(codes, fmt.element), group_size) * effective_scale(p, fmt).unsqueeze(-1)
    return _ungrouped(values, codes.shape[-1]).to(dtype)


def format_fake_quantize(x: torch.Tensor, p, fmt: Format, group_size: int | None, ste: bool = True) -> torch.Tensor:
    """dequantize(quantize(x)) in fp32, returned in x's dtype; with ste the rounding passes gradients (STE)."""
    xg = _grouped(x.float(), group_size)
    q = round_to_element(_units(xg, p, fmt), fmt.element, ste) * effective_scale(p, fmt).unsqueeze(-1)
    return _ungrouped(q, x.shape[-1]).to(x.dtype)


def scale_storage(p, fmt: Format, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a frozen layer keeps for its scales, in their stored dtype."""
    if fmt.scale == "e8m0":
        return {"scale_e8m0": p.extra["e8m0"].clone()}
    if fmt.scale == "nvfp4":
        return {"scale": p.scale.to(torch.float8_e4m3fn), "tensor_scale": p.extra["tensor_scale"].clone()}
    if p.extra is not None and "dq_codes" in p.extra:
        return {k: v.clone() for k, v in p.extra.items()}
    return {"scale": p.scale.to(scale_dtype).clone()}


def qparams_from_storage(buffers: dict[str, torch.Tensor], fmt: Format, shape: torch.Size):
    """Inverse of scale_storage: the QParams the fake-quant forward used, bit for bit."""
    from .primitives import QParams

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
    double-quantized NF4 one byte each + fp32 per 256 + the fp32 mean."""
    if fmt.scale == "e8m0":
        return n_scales
    if fmt.scale == "nvfp4":
        return n_scales + 4
    if double_quant:
        return n_scales + 4 * math.ceil(n_scales / DQ_BLOCK) + 4
    return n_scales * scale_dtype.itemsize
