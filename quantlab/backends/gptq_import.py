"""Read GPTQ (AutoGPTQ / GPTQModel) and AWQ GEMM (AutoAWQ) checkpoints' quantized layers into quantlab's frozen
form (backends/ckpt_import.py builds the model around them). Pure functions over the stored int32 words.

GPTQ, per layer (bits b in 2, 3, 4, 8; groups of g input rows, g = -1: one group):
  qweight (in * b / 32, out) int32   each output column's input codes as one little-endian bit stream: code i at
                                     bits [i*b, (i+1)*b) of the column's words (3-bit codes straddle words)
  qzeros  (groups, out * b / 32)     the zero points, packed the same way along each row
  scales  (groups, out) fp16         w = scales[g_idx[i]] * (q - zero[g_idx[i]])
  g_idx   (in,) int32                must be i // g: act-order (desc_act) groups are permutations, quantlab's contiguous
  checkpoint_format "gptq" (v1) stores zero - 1, each 32-bit word as one integer (GPTQModel's v1 <-> v2 conversion
  adds / subtracts 0x..1111 per word); "gptq_v2" stores the zero itself.
AWQ GEMM (version "gemm", w4, zero_point true):
  qweight (in, out / 8) int32        word j of row i holds output columns 8j + ORDER[k] in nibble k,
  qzeros  (groups, out / 8) int32    ORDER = AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; the zero points likewise
  scales  (groups, out) fp16         w = scales * (q - zero)

    settings = gptq_settings(quantization_config, "ckpt/config.json")
    codes = gptq_layer_codes("ckpt: q_proj", linear, settings, get)        # LayerCodes: codes, scales, zeros
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ckpt_layer import LayerCodes, int_layer_codes

GPTQ_SUPPORTED = ("GPTQ w2 / w3 / w4 / w8 in int32 words, group_size -1 or g, g_idx absent or i // group_size "
                  "(no act-order groups), checkpoint_format gptq (v1) or gptq_v2, sym or asym")
AWQ_SUPPORTED = "AWQ GEMM (version gemm), w4, zero_point true, group_size -1 or g"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_ORDER[k] of its 8


@dataclass(frozen=True)
class PackedSettings:
    """What the config says of every layer: bits, group size (None: one group), symmetric, v1 zeros (stored minus
    one), awq (AWQ GEMM's interleaved order, zeros as they are)."""

    bits: int
    group_size: int | None
    symmetric: bool
    zeros_minus_one: bool
    awq: bool = False


def _int(qc: dict, keys: tuple[str, ...], where: str, default=None):
    value = next((qc[k] for k in keys if k in qc), default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {keys[0]} must be an integer, got {value!r}")
    return value


def gptq_settings(qc: dict, where: str) -> PackedSettings:
    """The GPTQ config (config.json's quantization_config or quantize_config.json), or a ValueError naming what
    quantlab cannot hold."""
    bits = _int(qc, ("bits",), where)
    group = _int(qc, ("group_size",), where, -1)
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    problems = []
    if bits not in (2, 3, 4, 8):
        problems.append(f"bits {bits}")
    if fmt not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format {fmt!r} (a kernel's own layout)")
    if qc.get("pack_dtype", "int32") != "int32":
        problems.append(f"pack_dtype {qc['pack_dtype']!r}")
    if qc.get("dynamic"):
        problems.append("per-module `dynamic` overrides")
    if problems:
        raise ValueError(f"{where}: {', '.join(problems)}: quantlab imports {GPTQ_SUPPORTED}")
    return PackedSettings(bits, None if group == -1 else group, bool(qc.get("sym", True)), fmt == "gptq")


def awq_settings(qc: dict, where: str) -> PackedSettings:
    bits = _int(qc, ("bits", "w_bit"), where)
    group = _int(qc, ("group_size", "q_group_size"), where, -1)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or bits != 4 or qc.get("zero_point", True) is not True:
        raise ValueError(f"{where}: AWQ version {version!r}, w{bits}, zero_point {qc.get('zero_point', True)!r}: "
                         f"quantlab imports {AWQ_SUPPORTED}")
    return PackedSettings(4, None if group == -1 else group, False, False, awq=True)


def unpack_stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """(..., n_words) int32 -> (..., count) int64: code i at bits [i*bits, (i+1)*bits) of the words read as one
    little-endian bit stream (word 0's bit 0 first); a code may straddle two words.

    >>> unpack_stream(torch.tensor([[0x76543210]], dtype=torch.int32), 4, 8).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat((w, torch.zeros_like(w[..., :1])), dim=-1)  # a zero word past the end: straddling reads stay valid
    start = torch.arange(count) * bits
    word, offset = start // 32, start % 32
    low = w[..., word] >> offset
    high = w[..., word + 1] << (32 - offset)
    return (low | torch.where(offset + bits > 32, high, torch.zeros_like(high))) & ((1 << bits) - 1)


def _v1_zeros(qzeros: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """GPTQ v1 stores zero - 1. For 2, 4, 8 bits each int32 word is restored as one integer, word + 0x..0101 mod 2^32
    (GPTQModel's v1 -> v2): exact for every file its v2 -> v1 wrote, borrows included, and equal to adding one to each
    field where no field is all ones (AutoGPTQ's files). 3-bit fields straddle words: one added to each field, a field
    of all ones (a zero of 0, ambiguous in v1) refused."""
    if bits == 3:
        stored = unpack_stream(qzeros, 3, count)
        if bool((stored == 7).any()):
            raise ValueError("3-bit GPTQ v1 zero points hold 7 (zero - 1 for a zero of 0, which v1 cannot store "
                             "unambiguously); re-save the checkpoint as gptq_v2")
        return stored + 1
    ones = sum(1 << (bits * j) for j in range(32 // bits))
    words = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF
    return unpack_stream(words, bits, count)


def _check_shape(where: str, key: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{where}: {key} is {tuple(t.shape)} {t.dtype}, expected {shape}"
                         f"{'' if dtype is None else f' {dtype}'} for this layer and config")


def gptq_layer_codes(where: str, linear: torch.nn.Linear, s: PackedSettings, get, keys) -> LayerCodes:
    """One GPTQ or AWQ GEMM layer's LayerCodes: get(local name) returns a tensor (or raises naming it)."""
    out_f, in_f = linear.out_features, linear.in_features
    group = s.group_size or in_f
    groups = -(-in_f // group)
    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    if s.awq:
        for key, t, shape in (("qweight", qweight, (in_f, out_f // 8)), ("qzeros", qzeros, (groups, out_f // 8))):
            _check_shape(where, key, t, shape, torch.int32)
        inverse = torch.tensor(AWQ_ORDER).argsort()  # column c of a block of 8 sits in nibble inverse[c]
        codes = unpack_stream(qweight, 4, out_f).view(in_f, -1, 8)[..., inverse].reshape(in_f, out_f).t()
        zeros = unpack_stream(qzeros, 4, out_f).view(groups, -1, 8)[..., inverse].reshape(groups, out_f)
    else:
        _check_shape(where, "qweight", qweight, (-(-in_f * s.bits // 32), out_f), torch.int32)
        _check_shape(where, "qzeros", qzeros, (groups, -(-out_f * s.bits // 32)), torch.int32)
        codes = unpack_stream(qweight.t(), s.bits, in_f)  # (out, in): each column's stream
        try:
            zeros = _v1_zeros(qzeros, s.bits, out_f) if s.zeros_minus_one else unpack_stream(qzeros, s.bits, out_f)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if "g_idx" in keys and not torch.equal(get("g_idx").to(torch.int64), torch.arange(in_f) // group):
            raise ValueError(f"{where}: g_idx is not i // group_size (desc_act / act-order groups); quantlab's groups "
                             f"are contiguous runs of {group} input rows; quantlab imports {GPTQ_SUPPORTED}")
    _check_shape(where, "scales", scales, (groups, out_f), None)
    zeros = zeros.t()  # (out, groups)
    zero_u = None
    if s.symmetric:  # engines (Marlin, ExLlama) ignore the stored zeros of a sym checkpoint: they must be the midpoint
        if not bool((zeros == 2 ** (s.bits - 1)).all()):
            raise ValueError(f"{where}: sym = true, but its zero points are not all {2 ** (s.bits - 1)}: kernels that "
                             f"ignore them and kernels that read them would disagree")
    else:
        zero_u = zeros
    return int_layer_codes(where, s.bits, s.group_size, s.symmetric, codes, scales.t(), zero_u)
