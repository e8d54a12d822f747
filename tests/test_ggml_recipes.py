"""llama.cpp's ftype recipes (quantlab/core/ggml/recipes.py) against llama.cpp itself.

Fast: synthetic tensor lists against the per-tensor types of llama.cpp's own snapshot tests
(tests/snapshots/*.schema, written by tests/test-quant-type-selection.cpp from the real models' metadata), plus
pinned rules (fallbacks, tied embeddings, kept tensors, imatrix switches, errors).
Slow: the real SmolLM2-135M and Gemma-3-270M GGUFs requantized by llama-cpp-python's llama_model_quantize
(allow_requantize); its dry run for every ftype (the types it logs per tensor), and one written file read back.
"""
from __future__ import annotations

import random

import ggml_reference
import numpy as np
import pytest

from quantlab.core.ggml.recipes import (
    FTYPE_IDS,
    FTYPES,
    TensorChoice,
    block_size,
    gguf_recipe_inputs,
    kept_reason,
    read_gguf_header,
    recipe_types,
    use_more_bits,
)


def dense_model(n_embd, n_ff, n_vocab, n_layer, n_head, n_head_kv, head_dim, tied=False) -> dict:
    """A dense decoder's GGUF tensors (ne order): embeddings, norms, q/k/v/o and gate/up/down per layer."""
    t = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,)}
    if not tied:
        t["output.weight"] = (n_embd, n_vocab)
    for i in range(n_layer):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, n_head * head_dim),
              p + "attn_k.weight": (n_embd, n_head_kv * head_dim), p + "attn_v.weight": (n_embd, n_head_kv * head_dim),
              p + "attn_output.weight": (n_head * head_dim, n_embd), p + "ffn_norm.weight": (n_embd,),
              p + "ffn_gate.weight": (n_embd, n_ff), p + "ffn_up.weight": (n_embd, n_ff),
              p + "ffn_down.weight": (n_ff, n_embd)}
    return t


# llama.cpp's tests/snapshots (qwen3-0.6b, gemma-3-4b-it, meta-llama-3.1-70b-instruct .schema), condensed: per ftype
# the tensors whose type is not the base type, as "<tensor kind> <type> [layers]" (all: every layer).
SNAPSHOTS = {
    "Qwen3-0.6B": (("qwen3", 1024, 3072, 151936, 28, 16, 8, 128, False), """
Q4_0   output q6_k
Q4_1   output q6_k
Q5_0   output q6_k
Q5_1   output q6_k
Q8_0   -
Q2_K   output q6_k; attn_output q3_k all; attn_v q3_k all; ffn_down q3_k all
Q3_K_S output q6_k
Q3_K_M output q6_k; attn_output q4_k all; attn_v q5_k 0-1; ffn_down q5_k 0; ffn_down q4_k 1-27; attn_v q4_k 2-27
Q3_K_L output q6_k; attn_output q5_k all; attn_v q5_k all; ffn_down q5_k all
Q4_K_S output q6_k; attn_v q5_k 0-3; ffn_down q5_k 0-2
Q4_K_M output q6_k; attn_v q6_k 0-2,5,8,11,14,17,20,23-27; ffn_down q6_k 0-2,5,8,11,14,17,20,23-27
Q5_K_S output q6_k
Q5_K_M output q6_k; attn_v q6_k 0-2,5,8,11,14,17,20,23-27; ffn_down q6_k 0-2,5,8,11,14,17,20,23-27
Q6_K   -
IQ4_NL output q6_k; ffn_down q5_k 0-2
IQ4_XS output q6_k; ffn_down q5_k 0-2
"""),
    "gemma-3-4b-it": (("gemma3", 2560, 10240, 262144, 34, 8, 4, 256, True), """
Q4_0   token_embd q6_k
Q4_1   token_embd q6_k
Q5_0   token_embd q6_k
Q5_1   token_embd q6_k
Q8_0   -
Q2_K   token_embd q6_k; attn_output q3_k all; attn_v q3_k all; ffn_down q3_k all
Q3_K_S token_embd q6_k
Q3_K_M token_embd q6_k; attn_output q4_k all; attn_v q5_k 0-1; ffn_down q5_k 0-1; attn_v q4_k 2-33; ffn_down q4_k 2-33
Q3_K_L token_embd q6_k; attn_output q5_k all; attn_v q5_k all; ffn_down q5_k all
Q4_K_S token_embd q6_k; attn_v q5_k 0-3; ffn_down q5_k 0-3
Q4_K_M token_embd q6_k; attn_v q6_k 0-3,6,9,12,15,18,21,24,27,29-33; ffn_down q6_k 0-3,6,9,12,15,18,21,24,27,29-33
Q5_K_S token_embd q6_k
Q5_K_M token_embd q6_k; attn_v q6_k 0-3,6,9,12,15,18,21,24,27,29-33; ffn_down q6_k 0-3,6,9,12,15,18,21,24,27,29-33
Q6_K   -
IQ4_NL token_embd q6_k; ffn_down q5_k 0-3
IQ4_XS token_embd q6_k; ffn_down q5_k 0-3
"""),
    "Meta-Llama-3.1-70B-Instruct": (("llama", 8192, 28672, 128256, 80, 64, 8, 128, False), """
Q4_0   output q6_k
Q4_1   output q6_k
Q5_0   output q6_k
Q5_1   output q6_k
Q8_0   -
Q2_K   output q6_k; attn_output q3_k all; attn_v q5_k all; ffn_down q3_k all
Q3_K_S output q6_k; attn_v q5_k all
Q3_K_M output q6_k; attn_output q4_k all; attn_v q5_k all; ffn_down q5_k 0-4; ffn_down q4_k 5-79
Q3_K_L output q6_k; attn_output q5_k all; attn_v q5_k all; ffn_down q5_k all
Q4_K_S output q6_k; attn_v q5_k all; ffn_down q5_k 0-9
Q4_K_M output q6_k; attn_v q6_k 0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69-79; ffn_down q6_k 0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69-79; attn_v q5_k 10-11,13-14,16-17,19-20,22-23,25-26,28-29,31-32,34-35,37-38,40-41,43-44,46-47,49-50,52-53,55-56,58-59,61-62,64-65,67-68
Q5_K_S output q6_k
Q5_K_M output q6_k; attn_v q6_k 0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69-79; ffn_down q6_k 0-9,12,15,18,21,24,27,30,33,36,39,42,45,48,51,54,57,60,63,66,69-79
Q6_K   -
IQ4_NL output q6_k; attn_v q5_k all; ffn_down q5_k 0-9
IQ4_XS output q6_k; attn_v q5_k all; ffn_down q5_k 0-9
"""),
}


def _layers(spec: str, n_layer: int) -> list[int]:
    if spec == "all":
        return list(range(n_layer))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def expected_from_snapshot(table: str, ftype: str, n_layer: int) -> dict[str, str]:
    line = next(row for row in table.strip().splitlines() if row.split()[0] == ftype)
    body = line[len(ftype):].strip()
    expected = {}
    for item in ([] if body == "-" else body.split("; ")):
        kind, type_name, *layers = item.split()
        if not layers:
            expected[f"{kind}.weight"] = type_name
        for i in _layers(layers[0], n_layer) if layers else []:
            expected[f"blk.{i}.{kind}.weight"] = type_name
    return expected


@pytest.mark.parametrize("model", list(SNAPSHOTS))
@pytest.mark.parametrize("ftype", list(FTYPES))
def test_types_equal_llama_cpp_snapshots(model, ftype):
    """Reference: llama.cpp's snapshot of llama_quant_compute_types for the model's metadata; exact, every
    quantized tensor (the snapshot lists those that differ from the base type)."""
    (arch, n_embd, n_ff, n_vocab, n_layer, n_head, n_head_kv, head_dim, tied), table = SNAPSHOTS[model]
    tensors = dense_model(n_embd, n_ff, n_vocab, n_layer, n_head, n_head_kv, head_dim, tied)
    choices = recipe_types(ftype, tensors, arch, n_layer, n_head, n_head_kv)
    base = FTYPES[ftype].split(";")[0].removeprefix("base ")
    expected = expected_from_snapshot(table, ftype, n_layer)
    got = {n: c.type for n, c in choices.items() if kept_reason(n, tensors[n]) is None}
    assert got == {n: expected.get(n, base) for n in got}
    assert set(expected) <= set(got)


# ---- pinned rules on a Qwen2-1.5B-shaped model (28 layers, 1536 / 8960, 12 heads / 2 KV heads: n_gqa 6) ----------

QWEN2 = {"arch": "qwen2", "n_layer": 28, "n_head": 12, "n_head_kv": 2}


@pytest.fixture(scope="module")
def qwen2_tensors():
    return dense_model(1536, 8960, 151936, 28, 12, 2, 128)


def _types(choices: dict[str, TensorChoice], kind: str) -> list[str]:
    return [choices[f"blk.{i}.{kind}.weight"].type for i in range(28)]


def test_use_more_bits_is_llama_cpps_layer_pick():
    """First eighth, last eighth, every third layer between: 28 layers -> n/8 = 3, 7n/8 = 24."""
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


def test_q4_k_m_mix_on_qwen2(qwen2_tensors):
    c = recipe_types("Q4_K_M", qwen2_tensors, **QWEN2)
    more = [use_more_bits(i, 28) for i in range(28)]
    assert _types(c, "attn_v") == ["q6_k" if m else "q4_k" for m in more]
    assert _types(c, "ffn_down") == ["q6_k" if m else "q4_k" for m in more]
    assert set(_types(c, "attn_q") + _types(c, "ffn_up") + _types(c, "attn_output")) == {"q4_k"}
    assert c["output.weight"] == TensorChoice("q6_k", None, c["output.weight"].reason)
    assert c["token_embd.weight"].type == "q4_k"  # an untied embedding keeps the base type
    assert c["blk.0.attn_norm.weight"].type == "f32" and "1-D" in c["blk.0.attn_norm.weight"].reason
    assert "use_more_bits(5, 28)" in c["blk.5.attn_v.weight"].reason


def test_n_gqa_rules(qwen2_tensors):
    """n_gqa = 12 / 2 = 6 >= 4: Q2_K's attn_v q4_k, IQ4_XS's attn_v q5_k; n_gqa 2 (12 / 6): q3_k and the base type."""
    assert set(_types(recipe_types("Q2_K", qwen2_tensors, **QWEN2), "attn_v")) == {"q4_k"}
    assert set(_types(recipe_types("IQ4_XS", qwen2_tensors, **QWEN2), "attn_v")) == {"q5_k"}
    mha = {**QWEN2, "n_head_kv": 6}
    assert set(_types(recipe_types("Q2_K", qwen2_tensors, **mha), "attn_v")) == {"q3_k"}
    assert set(_types(recipe_types("IQ4_XS", qwen2_tensors, **mha), "attn_v")) == {"iq4_xs"}


@pytest.mark.parametrize("ftype, without, with_imatrix", [
    ("Q4_0", "q4_0", "q4_1"), ("Q5_0", "q5_0", "q5_1"), ("IQ4_NL", "q5_k", "iq4_nl"), ("IQ4_XS", "q5_k", "iq4_xs"),
])
def test_imatrix_switches_the_first_eighth_of_ffn_down(qwen2_tensors, ftype, without, with_imatrix):
    """llama-quant.cpp: with an imatrix Q4_0 / Q5_0 guard ffn_down of layers < n/8 with Q4_1 / Q5_1; IQ4_NL / IQ4_XS
    give them Q5_K only without one. The other layers keep the base type either way."""
    base = FTYPES[ftype].split(";")[0].removeprefix("base ")
    for imatrix, first in ((False, without), (True, with_imatrix)):
        down = _types(recipe_types(ftype, qwen2_tensors, **QWEN2, imatrix=imatrix), "ffn_down")
        assert down == [first] * 3 + [base] * 25, (imatrix, down)


def test_q2_k_imatrix_changes_no_type(qwen2_tensors):
    """Q2_K's choice does not read has_imatrix (only Q2_K_S needs one, and only its numerics use it)."""
    assert recipe_types("Q2_K", qwen2_tensors, **QWEN2) == recipe_types("Q2_K", qwen2_tensors, **QWEN2, imatrix=True)


def test_visiting_order_is_llama_cpps_not_the_dicts(qwen2_tensors):
    """The attn_v counter runs in llama.cpp's order (layer, then name), whatever order the dict lists them in."""
    names = list(qwen2_tensors)
    random.Random(0).shuffle(names)
    shuffled = {n: qwen2_tensors[n] for n in names}
    for ftype in ("Q3_K_M", "Q4_K_S", "Q4_K_M"):
        assert recipe_types(ftype, shuffled, **QWEN2) == recipe_types(ftype, qwen2_tensors, **QWEN2)
    assert list(recipe_types("Q4_K_M", shuffled, **QWEN2)) == names  # the result follows the caller's order


def test_fused_attn_qkv_follows_attn_v():
    """category_is_attn_v takes attn_qkv: its own later branch (q5_k for Q4_K_M) is never reached."""
    t = {"token_embd.weight": (1024, 1000), "output.weight": (1024, 1000)}
    t |= {f"blk.{i}.attn_qkv.weight": (1024, 3072) for i in range(16)}
    t |= {f"blk.{i}.ffn_down.weight": (4096, 1024) for i in range(16)}
    c = recipe_types("Q4_K_M", t, "phi3", n_layer=16, n_head=32, n_head_kv=32)
    assert [c[f"blk.{i}.attn_qkv.weight"].type for i in range(16)] == [
        "q6_k" if use_more_bits(i, 16) else "q4_k" for i in range(16)]
    c = recipe_types("Q3_K_M", t, "phi3", n_layer=16, n_head=32, n_head_kv=32)
    assert [c[f"blk.{i}.attn_qkv.weight"].type for i in range(3)] == ["q5_k", "q5_k", "q4_k"]


# ---- fallbacks, tied embeddings, kept tensors --------------------------------------------------------------------

@pytest.mark.parametrize("ftype, ne0, chosen, fallback", [
    ("Q4_K_S", 576, "q4_k", "q5_0"), ("Q2_K", 576, "q2_k", "q4_0"), ("Q3_K_S", 576, "q3_k", "q4_0"),
    ("Q5_K_S", 576, "q5_k", "q5_1"), ("Q6_K", 576, "q6_k", "q8_0"), ("IQ4_XS", 576, "iq4_xs", "iq4_nl"),
    ("Q4_K_S", 100, "q4_k", "f16"), ("Q4_0", 100, "q4_0", "f16"), ("IQ4_NL", 48, "iq4_nl", "f16"),
])
def test_row_length_fallback(ftype, ne0, chosen, fallback):
    """tensor_type_fallback: 576 columns are 2.25 blocks of 256; 100 and 48 are not whole blocks of 32 either."""
    c = recipe_types(ftype, {"output.weight": (64, 64), "blk.0.attn_q.weight": (ne0, 256)}, "llama", 1, 4, 4)
    choice = c["blk.0.attn_q.weight"]
    assert (choice.type, choice.fallback_from) == (fallback, chosen)
    assert f"{ne0} columns are not whole {chosen} blocks of {block_size(chosen)}" in choice.reason


def test_tied_token_embd_is_treated_as_the_output():
    """No output.weight: token_embd takes output's rule (q6_k; q8_0 when its rows are not whole base blocks)."""
    t = {"token_embd.weight": (1024, 5000), "blk.0.attn_q.weight": (1024, 1024)}
    assert recipe_types("Q4_K_M", t, "llama", 1, 8, 8)["token_embd.weight"].type == "q6_k"
    assert recipe_types("Q8_0", t, "llama", 1, 8, 8)["token_embd.weight"].type == "q8_0"
    smol = {"token_embd.weight": (576, 49152)}
    c = recipe_types("Q4_K_M", smol, "llama", 1, 9, 3)["token_embd.weight"]
    assert (c.type, c.fallback_from) == ("q8_0", None) and "576 columns are not whole q4_k blocks" in c.reason
    c = recipe_types("Q4_0", smol, "llama", 1, 9, 3)["token_embd.weight"]  # q6_k chosen (576 = 18 blocks of 32)...
    assert (c.type, c.fallback_from) == ("q8_0", "q6_k")  # ... then 576 is not whole blocks of 256


def test_kept_tensors_keep_their_stored_type():
    t = {"output.weight": (1024, 1000), "output_norm.weight": (1024,), "blk.0.attn_q_norm.weight": (128,),
         "blk.0.ffn_norm.weight": (1024, 1), "blk.0.ssm_conv1d.weight": (4, 1024), "blk.0.attn_q.bias": (1024, 2),
         "blk.0.attn_q.weight": (1024, 1024)}
    c = recipe_types("Q4_K_M", t, "llama", 1, 8, 8, source_types={"output_norm.weight": "f32",
                                                                   "blk.0.ssm_conv1d.weight": "f16"})
    assert {n: x.type for n, x in c.items()} == {
        "output.weight": "q6_k", "output_norm.weight": "f32", "blk.0.attn_q_norm.weight": "f32",
        "blk.0.ffn_norm.weight": "f32", "blk.0.ssm_conv1d.weight": "f16", "blk.0.attn_q.bias": "f32",
        "blk.0.attn_q.weight": "q4_k"}
    assert "1-D" in c["blk.0.ffn_norm.weight"].reason  # (1024, 1): ggml_n_dims drops trailing 1s
    assert "ssm_conv1d" in c["blk.0.ssm_conv1d.weight"].reason
    kept = recipe_types("Q4_K_M", t, "llama", 1, 8, 8, quantize_output_tensor=False)["output.weight"]
    assert kept.type == "f32" and "quantize_output_tensor" in kept.reason


def test_unknown_ftype_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown llama.cpp ftype 'Q4_K_X'; known: Q4_0, .*Q4_K_M.*IQ4_XS"):
        recipe_types("Q4_K_X", {}, "llama", 1, 1, 1)


def test_header_reader_equals_gguf_reader(tmp_path):
    """read_gguf_header (string arrays skipped) against gguf.GGUFReader on a small file written by gguf.GGUFWriter."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_head_count_kv([4, 2])  # per layer: layer 0's is taken
    writer.add_head_count(8)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((3, 64), dtype=np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert tensors == {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name.lower()) for t in reader.tensors}
    assert tensors["blk.0.attn_v.weight"] == ((64, 3), "f16")
    assert meta["tokenizer.ggml.tokens"] == 3 and meta["llama.attention.head_count_kv"] == (4, 2)
    inputs = gguf_recipe_inputs(path)
    assert (inputs["arch"], inputs["n_layer"], inputs["n_head"], inputs["n_head_kv"]) == ("llama", 2, 8, 4)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file"):
        read_gguf_header(tmp_path / "bad.gguf")


def test_ftype_ids_are_llama_h_values():
    assert FTYPE_IDS["Q4_K_M"] == 15 and FTYPE_IDS["IQ4_XS"] == 30 and FTYPE_IDS["Q8_0"] == 7
    assert FTYPES["Q4_K_M"].startswith("base q4_k;")


# ---- the real models, requantized by llama.cpp (slow) ----------------------------------------------------------

def llama_cpp_quantize(src, ftype: str, out=None, imatrix_sizes: dict[str, int] | None = None) -> dict[str, str]:
    """llama.cpp's quantizer on src (tests/ggml_reference.py) with an all-ones imatrix of imatrix_sizes -> types."""
    ones = {n: np.ones(k, np.float32) for n, k in (imatrix_sizes or {}).items()} or None
    return ggml_reference.llama_model_quantize(src, ftype, out, ones)


def _check(ftype: str, inputs: dict, got: dict[str, str], imatrix: bool = False) -> None:
    choices = recipe_types(ftype, **inputs, imatrix=imatrix)
    assert set(got) == set(choices)
    wrong = {n: (c.type, got[n]) for n, c in choices.items() if c.type != got[n]}
    assert not wrong, f"{ftype} imatrix={imatrix}: (ours, llama.cpp's) {wrong}"


GEMMA3_FTYPES = ("Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS")
IMATRIX_SENSITIVE = ("Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q4_K_M")  # Q2_K, Q4_K_M: controls


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
@pytest.mark.needs_model("gemma3-270m")
def test_types_equal_llama_cpp_quantize_on_the_real_models():
    """Reference: llama_model_quantize's dry run on the real GGUFs (SmolLM2-135M: 576 columns, so k-quant fallbacks
    everywhere; Gemma-3-270M: 640 columns, tied embeddings, n_gqa 4), every ftype on SmolLM2 and four on Gemma-3,
    without an imatrix and, for the ftypes whose rules read it (and two controls), with one; exact, every tensor."""
    from quantlab.models.loading import alias_gguf_path

    for alias, ftypes in (("smollm2-135m", list(FTYPES)), ("gemma3-270m", GEMMA3_FTYPES)):
        path = alias_gguf_path(alias)
        inputs = gguf_recipe_inputs(path)
        sizes = {n: s[0] for n, s in inputs["tensors"].items() if len(s) > 1}
        for ftype in ftypes:
            _check(ftype, inputs, llama_cpp_quantize(path, ftype))
            if ftype in IMATRIX_SENSITIVE:  # the others' rules do not read has_imatrix (fast tests pin that)
                _check(ftype, inputs, llama_cpp_quantize(path, ftype, imatrix_sizes=sizes), imatrix=True)


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
@pytest.mark.needs_model("gemma3-270m")
def test_types_equal_the_files_llama_cpp_writes(tmp_path):
    """Reference: the tensor types of written GGUFs, read back with gguf.GGUFReader: SmolLM2-135M requantized to
    Q4_K_M by llama_model_quantize here (also checks the dry-run log reading and the header reader above), and the
    Gemma-3-270M Q4_K_M file as published (llama.cpp wrote it). ~20 s."""
    import gguf

    from quantlab.models.loading import alias_gguf_path

    smol = alias_gguf_path("smollm2-135m")
    out = tmp_path / "smollm2-q4_k_m.gguf"
    written = llama_cpp_quantize(smol, "Q4_K_M", out=out)
    assert written == {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
    _check("Q4_K_M", gguf_recipe_inputs(smol), written)
    assert written == llama_cpp_quantize(smol, "Q4_K_M")
    gemma = gguf_recipe_inputs(alias_gguf_path("gemma3-270m"))
    _check("Q4_K_M", gemma, gemma["source_types"])
