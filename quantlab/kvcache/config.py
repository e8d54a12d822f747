"""KVCacheConfig: how keys (after RoPE) and values are quantized, per (batch, head, token), groups along head_dim.

    KVCacheConfig(bits=8)                               # int8, asymmetric, one group per head (g = head_dim)
    KVCacheConfig(bits=4, group_size=32)                # int4, two groups per 64-dim head
    KVCacheConfig(format="fp8_e4m3", group_size=64)     # FP8 E4M3 codes, fp16 scale per group
    KVCacheConfig(bits=4, rotate_k=True)                # QuaRot: Hadamard on Q and K (after RoPE) before quantizing K
    KVCacheConfig(bits=16)                              # off: the float model, untouched

Defaults and why: integer KV is asymmetric (KIVI and most KV papers: K and V rows are rarely centred on 0, an
asymmetric grid spends no code on the empty side); FP8 is symmetric by construction. Scales (and integer zeros)
are per (batch, head, token, group); scales are stored as float16, as KIVI does, zeros as uint8 codes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..util.checks import check_choice, check_dtype, check_int

OFF_BITS = 16
INT_BITS = (4, 8)  # inclusive range of integer bit widths
FORMATS = ("int", "fp8_e4m3", "fp8_e5m2")
SCALE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class KVCacheConfig:
    """bits: 4..8 (int) or 8 (fp8), 16 = off. group_size: None = the whole head_dim, else it must divide head_dim
    (checked when applied to a model). symmetric: None = the format's default (int: False, fp8: True).
    rotate_k: orthonormal head_dim Hadamard on Q and K after RoPE (q·kᵀ unchanged), applied even at 16 bits."""

    bits: int = 8
    format: str = "int"
    group_size: int | None = None
    symmetric: bool | None = None
    rotate_k: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self):
        check_choice("kv format", self.format, FORMATS)
        if self.format == "int":
            if self.bits != OFF_BITS:
                lo, hi = INT_BITS
                if not (isinstance(self.bits, int) and not isinstance(self.bits, bool) and lo <= self.bits <= hi):
                    raise ValueError(f"kv bits must be an integer in {lo}..{hi}, or {OFF_BITS} (off), "
                                     f"got {self.bits!r}")
            symmetric = False if self.symmetric is None else self.symmetric
        else:
            if self.bits != 8 or isinstance(self.bits, bool):
                raise ValueError(f"kv format {self.format!r} has 8-bit codes; bits must be 8, got {self.bits!r} "
                                 f"(use format 'int' with bits {OFF_BITS} for no KV quantization)")
            if self.symmetric is False:
                raise ValueError(f"kv format {self.format!r} is symmetric; symmetric = False contradicts it")
            symmetric = True
        if not isinstance(symmetric, bool):
            raise ValueError(f"kv symmetric must be true, false or omitted, got {self.symmetric!r}")  # noqa: TRY004
        object.__setattr__(self, "symmetric", symmetric)
        check_int("kv group_size", self.group_size, 1, allow_none=True)
        if not isinstance(self.rotate_k, bool):
            raise ValueError(f"kv rotate_k must be true or false, got {self.rotate_k!r}")  # noqa: TRY004
        check_dtype("kv scale_dtype", self.scale_dtype, SCALE_DTYPES)

    @property
    def enabled(self) -> bool:
        """True when K/V are quantized (bits < 16)."""
        return self.bits != OFF_BITS

    @property
    def active(self) -> bool:
        """True when the attention changes at all: quantization, or the K/Q rotation alone."""
        return self.enabled or self.rotate_k

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVCacheConfig:
        """The inverse of to_dict; unknown keys fail naming the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown kv cache config keys {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        return cls(**d)

    def check_head_dim(self, head_dim: int, model_type: str = "model") -> None:
        """group_size must divide head_dim (groups never straddle heads; one token's codes pack on their own)."""
        if self.group_size is not None and head_dim % self.group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
            raise ValueError(f"kv group_size {self.group_size} does not divide {model_type}'s head_dim {head_dim}; "
                             f"valid: {', '.join(map(str, divisors))} or None (the whole head_dim)")


def kv_describe(config: KVCacheConfig | None) -> str:
    """A short label for tables. >>> kv_describe(KVCacheConfig(bits=8, group_size=64)) == 'kv8 g64 asym'"""
    if config is None or not config.active:
        return "kv16"
    rot = " rotk" if config.rotate_k else ""
    if not config.enabled:
        return f"kv16{rot}"
    group = "ghead" if config.group_size is None else f"g{config.group_size}"
    scale = "" if config.scale_dtype == "float16" else f" s-{config.scale_dtype}"
    if config.format != "int":
        return f"kv-{config.format} {group}{rot}{scale}"
    return f"kv{config.bits} {group} {'sym' if config.symmetric else 'asym'}{rot}{scale}"
