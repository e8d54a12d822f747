"""llama.cpp's file-type recipes ("Q4_K_M"): which GGML type each tensor of a model gets.

A port of llama_tensor_get_type and the code around it in llama.cpp's src/llama-quant.cpp (the version vendored by
llama-cpp-python 0.3.36), for dense models and the ftypes in FTYPES:

    choices = recipe_types("Q4_K_M", {"token_embd.weight": (576, 49152), "blk.0.attn_v.weight": (576, 192), ...},
                           arch="llama", n_layer=30, n_head=9, n_head_kv=3)
    choices["blk.0.attn_v.weight"]   # TensorChoice(type='q8_0', fallback_from='q6_k', reason='...')

Shapes are GGUF `ne` order (ne[0] = the row length = a linear's input features), as gguf.GGUFReader's
`tensor.shape` gives them. The steps, as llama.cpp takes them for every tensor:
  1. kept as stored: 1-D tensors, names not ending in "weight", norms and a few small tables (tensor_allows_quantization)
  2. the ftype's base type (q4_k for Q4_K_M), promoted by the mix rules: output / tied token_embd, attn_v
     (a fused attn_qkv follows attn_v's rules), ffn_down, attn_output (llama_tensor_get_type_impl)
  3. a row length that is not whole blocks of that type falls back to a type with a smaller block (tensor_type_fallback)
Tensors are visited in llama.cpp's order (non-layer tensors, then by layer, names sorted): the attn_v counter
(i_attention_wv) counts attn_v tensors in that order. Not ported: MoE (n_expert > 0), the IQ1/IQ2/IQ3/TQ ftypes,
--tensor-type overrides, --pure, --output-tensor-type / --token-embedding-type.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf

from .gguffile import read_header

# ftype -> (base type, llama_ftype value in llama.h, what the mix does)
_FTYPES: dict[str, tuple[str, int, str]] = {
    "Q4_0": ("q4_0", 2, "output q6_k; with an imatrix ffn_down q4_1 in the first eighth of layers"),
    "Q4_1": ("q4_1", 3, "output q6_k"),
    "Q5_0": ("q5_0", 8, "output q6_k; with an imatrix ffn_down q5_1 in the first eighth of layers"),
    "Q5_1": ("q5_1", 9, "output q6_k"),
    "Q8_0": ("q8_0", 7, "everything q8_0"),
    "Q2_K": ("q2_k", 10, "attn_v q4_k (n_gqa >= 4) else q3_k; ffn_down, attn_output q3_k; output q6_k"),
    "Q3_K_S": ("q3_k", 11, "output q6_k"),
    "Q3_K_M": ("q3_k", 12, ("attn_v q5_k in the first 2 layers else q4_k; ffn_down q5_k in the first sixteenth "
                            "else q4_k; attn_output q4_k; output q6_k")),
    "Q3_K_L": ("q3_k", 13, "attn_v, ffn_down, attn_output q5_k; output q6_k"),
    "Q4_K_S": ("q4_k", 14, "attn_v q5_k in the first 4 layers; ffn_down q5_k in the first eighth; output q6_k"),
    "Q4_K_M": ("q4_k", 15, ("attn_v, ffn_down q6_k in use_more_bits layers (first and last eighth, every third "
                            "between); output q6_k")),
    "Q5_K_S": ("q5_k", 16, "output q6_k"),
    "Q5_K_M": ("q5_k", 17, "attn_v, ffn_down q6_k in use_more_bits layers; output q6_k"),
    "Q6_K": ("q6_k", 18, "output q6_k"),
    "IQ4_NL": ("iq4_nl", 25, ("attn_v q5_k (n_gqa >= 4); without an imatrix ffn_down q5_k in the first eighth; "
                              "output q6_k")),
    "IQ4_XS": ("iq4_xs", 30, ("attn_v q5_k (n_gqa >= 4); without an imatrix ffn_down q5_k in the first eighth; "
                              "output q6_k")),
}
FTYPES: dict[str, str] = {name: f"base {base}; {mix}" for name, (base, _, mix) in _FTYPES.items()}
FTYPE_IDS: dict[str, int] = {name: ftype_id for name, (_, ftype_id, _) in _FTYPES.items()}
FTYPE_BASE: dict[str, str] = {name: base for name, (base, _, _) in _FTYPES.items()}  # "Q4_K_M" -> "q4_k"

# where a row is not whole blocks of the chosen type (tensor_type_fallback)
_FALLBACK = {"iq4_xs": "iq4_nl", "q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# a tensor whose name holds one of these is never quantized (tensor_allows_quantization, dense and multimodal parts)
_KEEP_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger",
    "a.rvq.codebook", "mm.a.code_embd",
    *(f"time_mix_{part}.weight" for part in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1",
                                             "g2", "decay_w1", "decay_w2", "lerp_fused")),
)
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")  # LLM_TN(arch)(POS_EMBD / TOKEN_TYPES, "weight")
# the architectures whose 80-layer (jais2: 68) model llama.cpp calls 70B: attn_v gets q5_k instead of q3_k / q4_k
_LAYERS_70B = {"llama": 80, "qwen2": 80, "deci": 80, "olmo": 80, "jais2": 68}
_LAYER = re.compile(r"blk\.([+-]?\d+)")  # sscanf("blk.%d."): the dot after the number is not needed


@dataclass(frozen=True)
class TensorChoice:
    """type: quantlab's lower-case type name; fallback_from: the type the mix chose when the row length forced
    another (else None); reason: which rule decided, in words."""

    type: str
    fallback_from: str | None
    reason: str


def block_size(type_name: str) -> int:
    """Weights per block of a GGML type ("q4_k" -> 256, "q8_0" -> 32, "f16" -> 1), from the gguf package."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]][0]


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layer pick for the extra bits: the first and last eighth, and every third layer between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _layer(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return len(dims)


def kept_reason(name: str, shape: tuple[int, ...], quantize_output_tensor: bool = True) -> str | None:
    """Why llama.cpp stores this tensor unquantized (its `quantize` condition), or None if it quantizes it."""
    if _n_dims(shape) < 2:
        return "1-D tensor"
    if not name.endswith("weight"):
        return "name does not end in 'weight'"
    if name == "output.weight" and not quantize_output_tensor:
        return "quantize_output_tensor is off"
    if name in _KEEP_NAMES:
        return "positional / token-type embedding"
    hit = next((s for s in _KEEP_SUBSTRINGS if s in name), None)
    return f"'{hit}' tensors are not quantized" if hit else None


def _category(name: str) -> str:
    """tensor_get_category: the first of these that the name matches."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                 "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return part.removesuffix(".weight")
    return "other"


@dataclass
class _State:
    """quantize_state_impl: the model's facts and the per-kind counters, advanced as tensors are visited."""

    arch: str
    n_layer: int
    n_gqa: int
    is_70b: bool
    imatrix: bool
    tied: bool
    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _output_type(base: str, ne0: int, st: _State, kind: str) -> tuple[str, str]:
    if st.arch == "falcon" or ne0 % block_size(base) != 0:
        why = "falcon" if st.arch == "falcon" else f"{ne0} columns are not whole {base} blocks"
        return "q8_0", f"{kind}: q8_0 ({why})"
    if base != "q8_0":
        return "q6_k", f"{kind}: q6_k (every ftype but Q8_0)"
    return base, f"{kind}: the base type"


def _attn_v_type(ftype: str, base: str, st: _State) -> tuple[str, str]:
    i, n = st.i_attention_wv, st.n_attention_wv
    new, why = base, "the base type"
    if ftype == "Q2_K":
        new, why = ("q4_k", "n_gqa >= 4") if st.n_gqa >= 4 else ("q3_k", "n_gqa < 4")
    elif ftype == "Q3_K_M":
        new, why = ("q5_k", "one of the first 2") if i < 2 else ("q4_k", "after the first 2")
    elif ftype == "Q3_K_L":
        new, why = "q5_k", "every layer"
    elif ftype in ("IQ4_NL", "IQ4_XS") and st.n_gqa >= 4:
        new, why = "q5_k", "n_gqa >= 4"
    elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        new, why = "q6_k", f"use_more_bits({i}, {n})"
    elif ftype == "Q4_K_S" and i < 4:
        new, why = "q5_k", "one of the first 4"
    if st.is_70b and new in ("q3_k", "q4_k"):
        new, why = "q5_k", "a 70B model (8 heads share attn_v)"
    st.i_attention_wv += 1
    return new, f"attn_v #{i} of {n}: {new} ({why})"


def _ffn_down_type(ftype: str, base: str, st: _State) -> tuple[str, str]:
    i, n, falcon = st.i_ffn_down, st.n_layer, st.arch == "falcon"
    new, why = base, "the base type"
    if ftype == "Q2_K":
        new, why = "q3_k", "every layer"
    elif ftype == "Q3_K_M":
        if i < n // 16:
            new, why = "q5_k", "first sixteenth"
        elif not falcon or use_more_bits(i, n):
            new, why = "q4_k", "after the first sixteenth"
        else:
            new, why = "q3_k", f"falcon, not use_more_bits({i}, {n})"
    elif ftype == "Q3_K_L":
        new, why = ("q4_k", "falcon") if falcon else ("q5_k", "every layer")
    elif ftype == "Q4_K_M":
        if falcon:
            new, why = ("q6_k", "first sixteenth") if i < n // 16 else (
                ("q5_k", f"use_more_bits({i}, {n})") if use_more_bits(i, n) else ("q4_k", "falcon"))
        elif use_more_bits(i, n):
            new, why = "q6_k", f"use_more_bits({i}, {n})"
    elif i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not st.imatrix:
        new, why = "q5_k", "first eighth, no imatrix"
    elif ftype == "Q5_K_M" and use_more_bits(i, n):
        new, why = "q6_k", f"use_more_bits({i}, {n})"
    elif ftype == "Q4_K_S" and not falcon and i < n // 8:
        new, why = "q5_k", "first eighth"
    elif ftype in ("Q4_0", "Q5_0") and st.imatrix and i < n // 8:
        new, why = ("q4_1" if ftype == "Q4_0" else "q5_1"), "first eighth, with an imatrix"
    st.i_ffn_down += 1
    return new, f"ffn_down in layer {i} of {n}: {new} ({why})"


def _attn_output_type(ftype: str, base: str, st: _State) -> tuple[str, str]:
    if st.arch == "falcon":
        table = {"Q3_K_L": "q4_k"}
    else:
        table = {"Q2_K": "q3_k", "Q3_K_M": "q4_k", "Q3_K_L": "q5_k"}
    new = table.get(ftype, base)
    return new, f"attn_output: {new} ({'the base type' if new == base else ftype + ' raises it'})"


def _mix_type(ftype: str, base: str, name: str, ne0: int, st: _State) -> tuple[str, str]:
    """llama_tensor_get_type_impl for a dense model: the type before the row-length fallback, and why."""
    category = _category(name)
    if category == "output" or (st.tied and category == "token_embd"):
        return _output_type(base, ne0, st, "output" if category == "output" else "tied token_embd (output)")
    if category in ("attn_v", "attn_qkv", "attn_kv_b"):
        # fused attn_qkv takes attn_v's rules and counter (category_is_attn_v): llama.cpp tests that before its own
        # attn_qkv branch (q4_k / q5_k / q6_k), which these ftypes therefore never reach
        return _attn_v_type(ftype, base, st)
    if category == "ffn_down":
        return _ffn_down_type(ftype, base, st)
    if category == "attn_output":
        return _attn_output_type(ftype, base, st)
    return base, f"{category}: the base type"


def _fallback(ne0: int, chosen: str) -> tuple[str, str | None, str]:
    """tensor_type_fallback: a type whose block divides the row, else f16."""
    block = block_size(chosen)
    if ne0 % block == 0:
        return chosen, None, ""
    new = _FALLBACK.get(chosen, chosen)  # a 32-block type has no smaller block: f16 below
    if ne0 % block_size(new) != 0:
        new = "f16"
    return new, chosen, f"; {ne0} columns are not whole {chosen} blocks of {block}: falls back to {new}"


def row_fallback(type_name: str, in_features: int) -> str:
    """The type llama.cpp stores a tensor of type_name in when its rows (in_features) are not whole blocks of it
    (tensor_type_fallback: q4_k -> q5_0, q6_k -> q8_0, ...; f16 where no block fits); type_name where they are.

    >>> row_fallback("q4_k", 576), row_fallback("q4_k", 1536)
    ('q5_0', 'q4_k')
    """
    return _fallback(in_features, type_name)[0]


def check_ftype(ftype: str) -> str:
    """The ftype's name, or ValueError naming the known ones."""
    if ftype not in _FTYPES:
        raise ValueError(f"unknown llama.cpp ftype {ftype!r}; known: {', '.join(_FTYPES)}")
    return ftype


def recipe_types(ftype: str, tensors: Mapping[str, tuple[int, ...]], arch: str, n_layer: int, n_head: int,
                 n_head_kv: int, imatrix: bool = False, source_types: Mapping[str, str] | None = None,
                 quantize_output_tensor: bool = True) -> dict[str, TensorChoice]:
    """The GGML type llama.cpp's quantizer gives each tensor for `ftype`; shapes in GGUF ne order (ne[0] = row
    length). arch: GGUF general.architecture ("llama", "qwen2", "gemma3"); n_head / n_head_kv: layer 0's (n_gqa =
    n_head // n_head_kv); imatrix: whether an importance matrix is given (changes Q4_0 / Q5_0 / IQ4_* ffn_down);
    source_types: the stored type of each tensor, which a kept tensor keeps (default f32).

    >>> shapes = {"blk.0.attn_v.weight": (1536, 256), "blk.0.ffn_down.weight": (8960, 1536)}
    >>> recipe_types("Q4_K_M", shapes, "qwen2", n_layer=28, n_head=12, n_head_kv=2)["blk.0.attn_v.weight"].type
    'q6_k'
    """
    base = _FTYPES[check_ftype(ftype)][0]
    names = sorted(tensors, key=lambda n: (_layer(n), n))  # llama_model_loader's weights_map order
    st = _State(arch=arch, n_layer=n_layer, n_gqa=n_head // n_head_kv if n_head_kv else 0,
                is_70b=n_layer == _LAYERS_70B.get(arch) and (arch != "llama" or n_head != n_head_kv),
                imatrix=imatrix, tied="output.weight" not in tensors,
                n_attention_wv=sum(_category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in tensors))
    choices = {}
    for name in names:
        shape = tuple(int(d) for d in tensors[name])
        kept = kept_reason(name, shape, quantize_output_tensor)
        if kept is not None:
            stored = (source_types or {}).get(name, "f32")
            choices[name] = TensorChoice(stored, None, f"kept as stored ({stored}): {kept}")
            continue
        chosen, why = _mix_type(ftype, base, name, shape[0], st)
        final, fallback_from, fell = _fallback(shape[0], chosen)
        choices[name] = TensorChoice(final, fallback_from, f"{ftype}: {why}{fell}")
    return {name: choices[name] for name in tensors}




def read_gguf_header(path: str | Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    """A GGUF file's metadata (numeric arrays as tuples; string arrays skipped, their value is their length) and its
    tensor table {name: (shape in ne order, type name)}, from the header alone (gguffile.read_header).

    >>> meta, tensors = read_gguf_header("model.gguf")   # doctest: +SKIP
    >>> meta["general.architecture"], tensors["blk.0.attn_v.weight"]   # doctest: +SKIP
    ('llama', ((576, 192), 'q4_1'))
    """
    import gguf

    header = read_header(path)
    known = gguf.GGMLQuantizationType._value2member_map_
    return header.meta, {name: (shape, gguf.GGMLQuantizationType(t).name.lower() if t in known else f"type id {t}")
                         for name, (shape, t, _) in header.tensors.items()}


def gguf_recipe_inputs(path: str | Path) -> dict:
    """recipe_types' keyword arguments but ftype, read from a GGUF model's header: tensors (ne order), arch,
    n_layer, n_head, n_head_kv (layer 0's where the file has one per layer) and source_types.

    >>> recipe_types("Q4_K_M", **gguf_recipe_inputs("model.gguf"))  # doctest: +SKIP
    """
    meta, tensors = read_gguf_header(path)
    arch = meta["general.architecture"]
    first = lambda v: v[0] if isinstance(v, tuple) else v
    n_head = int(first(meta[f"{arch}.attention.head_count"]))
    return {
        "tensors": {name: shape for name, (shape, _) in tensors.items()},
        "arch": arch,
        "n_layer": int(meta[f"{arch}.block_count"]),
        "n_head": n_head,
        "n_head_kv": int(first(meta.get(f"{arch}.attention.head_count_kv", n_head))),
        "source_types": {name: type_name for name, (_, type_name) in tensors.items()},
    }


__all__ = ["FTYPES", "FTYPE_BASE", "FTYPE_IDS", "TensorChoice", "block_size", "check_ftype", "gguf_recipe_inputs", "kept_reason",
           "read_gguf_header", "recipe_types", "row_fallback", "use_more_bits"]
