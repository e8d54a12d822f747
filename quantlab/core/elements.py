"""Element formats: what one code of FP8 (E4M3 fn, E5M2), FP6 (E3M2, E2M3), FP4 (E2M1), NF4 or MX's INT8 means.

encode rounds floats in element units to the nearest code, ties to even (the even code: for minifloats the
even mantissa), saturating at the largest finite value; NF4 ties go to the lower level (bitsandbytes' strict
`x > midpoint`). Codes are uint8: sign bit at position bits-1 for minifloats, the level's index for NF4, two's
complement bits for INT8. The shared-scale rules built on these live in core/formats.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

# ---- element formats ------------------------------------------------------------------------


@dataclass(frozen=True)
class Element:
    """One element format. kind: "fp" (sign-magnitude minifloat), "nf" (lookup table), "int" (two's complement),
    "lut" (a table learned per weight row, any4: no fixed values; its numerics are core/lut.py's)."""

    name: str
    bits: int
    kind: str
    ebits: int = 0
    mbits: int = 0
    nan_code: bool = False  # E4M3fn: S.1111.111 is NaN (the only non-finite code)
    ieee: bool = False  # E5M2: the top exponent is inf / NaN
    levels: tuple[float, ...] | None = None  # kind "nf": the 2^bits ascending levels in [-1, 1] (None: NF4's)

    def __post_init__(self):
        if self.kind not in ("fp", "nf", "int", "lut"):
            raise ValueError(f"element {self.name!r}: kind {self.kind!r} unknown; known: fp, nf, int, lut")
        if self.levels is None:
            return
        levels = tuple(float(v) for v in self.levels)
        if self.kind != "nf" or len(levels) != 2 ** self.bits:
            raise ValueError(f"element {self.name!r}: levels are a lookup table of kind 'nf' with 2^bits = "
                             f"{2 ** self.bits} values, got kind {self.kind!r} with {len(levels)}")
        if any(b <= a for a, b in zip(levels, levels[1:])) or levels[0] < -1 or levels[-1] != 1.0:
            raise ValueError(f"element {self.name!r}: levels must ascend strictly within [-1, 1] and end at 1.0 "
                             f"(absmax scaling maps a group's largest |w| there), got {levels}")
        object.__setattr__(self, "levels", levels)

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
        return e.levels or NF4_LEVELS
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
