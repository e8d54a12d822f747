"""The importance matrix (quantlab/calibration/imatrix.py) against llama.cpp's llama-imatrix.

References: a brute-force Σx² over the captured inputs of every linear; the file layout of imatrix.cpp's
save_imatrix (keys, tensor names, shapes, dtypes), and byte for byte the file libggml's own GGUF writer makes from
the same calls; a legacy .dat written here as save_imatrix_legacy writes it.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
import torch
from torch import nn

from quantlab.calibration.imatrix import (
    ImatrixEntry,
    check_imatrix,
    collect_imatrix,
    gguf_tensor_names,
    load_imatrix,
    read_imatrix,
    save_imatrix,
)


def _batches(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, 16), generator=g), {"input_ids": torch.randint(0, vocab, (2, 8), generator=g)}]


def _captured_inputs(model: nn.Module, batches: list) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_pre_hook(lambda _m, args, n=n: seen.setdefault(n, []).append(args[0].clone()))
               for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.inference_mode():
        for b in batches:
            model(**b) if isinstance(b, dict) else model(b)
    for h in handles:
        h.remove()
    return seen


@pytest.fixture(scope="module")
def collected():
    """conftest's tiny Llama (2 layers, hidden 64, tied embeddings, seed 0), built in memory: no tokenizer needed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).eval()
    batches = _batches(model.config.vocab_size)
    return model, batches, collect_imatrix(model, batches, progress=False)


def test_collect_equals_brute_force_sum_of_squares(collected):
    """Reference: every captured input row of each linear, Σx² in float64 over all 32 tokens at once, rounded to
    float32; exact (atol=0: both sums are float64, rounded once)."""
    model, batches, entries = collected
    seen = _captured_inputs(model, batches)
    assert set(entries) == set(seen) - {"lm_head"}  # output.weight is left out, as llama-imatrix does by default
    for name, entry in entries.items():
        rows = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen[name]]).double()
        assert entry.count == rows.shape[0] == 1 * 16 + 2 * 8
        assert entry.in_sum2.dtype == torch.float32 and entry.in_sum2.shape == (rows.shape[1],)
        assert torch.equal(entry.in_sum2, rows.square().sum(0).float()), name
        assert torch.equal(entry.importance, entry.in_sum2 / float(entry.count))


def test_include_and_exclude_globs(collected):
    model, batches, _ = collected
    mlp = collect_imatrix(model, batches, include=["*.mlp.*"], progress=False)
    assert sorted(mlp) == [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("down", "gate", "up")]
    assert "lm_head" in collect_imatrix(model, batches[:1], exclude=[], progress=False)
    with pytest.raises(ValueError, match=r"no nn.Linear matches include=\['nothing'\]"):
        collect_imatrix(model, batches, include=["nothing"], progress=False)


def test_gguf_tensor_names_for_llama_qwen2_gemma3(collected):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    names = gguf_tensor_names(collected[0])
    assert names["model.layers.0.self_attn.v_proj"] == "blk.0.attn_v.weight"
    assert names["model.layers.1.mlp.down_proj"] == "blk.1.ffn_down.weight"
    assert names["lm_head"] == "output.weight" and len(names) == 2 * 7 + 1
    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    for cls, config in ((Qwen2ForCausalLM, Qwen2Config(**small)), (Gemma3ForCausalLM, Gemma3TextConfig(**small))):
        names = gguf_tensor_names(cls(config))
        assert names["model.layers.1.self_attn.o_proj"] == "blk.1.attn_output.weight"
        assert names["model.layers.0.mlp.gate_proj"] == "blk.0.ffn_gate.weight"
    other = nn.Linear(2, 2)
    other.config = type("Config", (), {"model_type": "gpt2", "num_hidden_layers": 1})()
    with pytest.raises(ValueError, match="model type 'gpt2' has no GGUF mapping in quantlab; supported: gemma3, "
                                         "gemma3_text, llama, qwen2"):
        gguf_tensor_names(other)


@pytest.fixture
def saved(collected, tmp_path):
    model, _, entries = collected
    path = save_imatrix(tmp_path / "imatrix.gguf", entries, gguf_tensor_names(model), datasets=["sample.txt"],
                        chunk_size=16)
    return path, entries, gguf_tensor_names(model)


def test_save_load_round_trip_is_exact(saved):
    path, entries, names = saved
    importance = load_imatrix(path)
    raw = read_imatrix(path)
    assert set(importance) == {names[n] for n in entries}
    for hf_name, entry in entries.items():
        g = names[hf_name]
        assert torch.equal(raw.sums[g], entry.in_sum2) and raw.counts[g].tolist() == [entry.count]
        assert torch.equal(importance[g], entry.importance)
    assert (raw.datasets, raw.chunk_count, raw.chunk_size, raw.legacy) == (["sample.txt"], 2, 16, False)


def test_file_layout_is_imatrix_cpps(saved):
    """save_imatrix in imatrix.cpp: general.type, imatrix.datasets / chunk_count / chunk_size and nothing else;
    per tensor in sorted name order <name>.in_sum2 F32 then <name>.counts F32, made 2-D (K, 1) and (1, 1) but
    stored with ggml_n_dims dimensions: (K,) and (1,)."""
    import gguf

    path, entries, names = saved
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == ["general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"]
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.datasets"].contents() == ["sample.txt"]
    assert fields["imatrix.datasets"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        assert fields[key].types == [gguf.GGUFValueType.UINT32]
    gguf_names = sorted(names[n] for n in entries)
    assert [t.name for t in reader.tensors] == [n + s for n in gguf_names for s in (".in_sum2", ".counts")]
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        k = 96 if "ffn_down" in t.name else 64
        assert [int(d) for d in t.shape] == ([k] if t.name.endswith(".in_sum2") else [1]), t.name


def _ggml_writes_imatrix(path, sums: dict[str, np.ndarray], counts: dict[str, int], datasets, chunk_count,
                         chunk_size) -> None:
    """imatrix.cpp's save_imatrix, its gguf_* / ggml_* calls made through libggml-base over ctypes."""
    from ggml_reference import ggml_library

    lib = ggml_library()

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_init.restype, lib.ggml_init.argtypes = ctypes.c_void_p, [InitParams]
    lib.ggml_new_tensor_2d.restype = ctypes.c_void_p
    lib.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.ggml_set_name.restype, lib.ggml_set_name.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_get_data.restype, lib.ggml_get_data.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    lib.gguf_init_empty.restype = ctypes.c_void_p
    lib.gguf_set_val_str.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.gguf_set_arr_str.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
    lib.gguf_set_val_u32.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    lib.gguf_add_tensor.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.gguf_write_to_file.restype = ctypes.c_bool
    lib.gguf_write_to_file.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_bool]
    lib.gguf_free.argtypes = lib.ggml_free.argtypes = [ctypes.c_void_p]

    size = sum(2 * lib.ggml_tensor_overhead() + 4 * (len(v) + 1) + 64 for v in sums.values())
    ctx = lib.ggml_init(InitParams(size, None, False))
    out = lib.gguf_init_empty()
    lib.gguf_set_val_str(out, b"general.type", b"imatrix")
    arr = (ctypes.c_char_p * len(datasets))(*[d.encode() for d in datasets])
    lib.gguf_set_arr_str(out, b"imatrix.datasets", arr, len(datasets))
    lib.gguf_set_val_u32(out, b"imatrix.chunk_count", chunk_count)
    lib.gguf_set_val_u32(out, b"imatrix.chunk_size", chunk_size)
    for name in sorted(sums):
        for suffix, values in ((".in_sum2", sums[name]), (".counts", np.array([counts[name]], dtype=np.float32))):
            t = lib.ggml_new_tensor_2d(ctx, 0, len(values) if suffix == ".in_sum2" else 1, 1)  # GGML_TYPE_F32
            lib.ggml_set_name(t, (name + suffix).encode())
            ctypes.memmove(lib.ggml_get_data(t), np.ascontiguousarray(values, dtype=np.float32).ctypes.data,
                           4 * len(values))
            lib.gguf_add_tensor(out, t)
    assert lib.gguf_write_to_file(out, str(path).encode(), False)
    lib.gguf_free(out)
    lib.ggml_free(ctx)


def test_file_equals_libggmls_gguf_writer_byte_for_byte(saved, tmp_path):
    """Reference: the same entries written by libggml-base's gguf writer with save_imatrix's calls (llama-cpp-python's
    build); the two files are identical bytes."""
    path, entries, names = saved
    sums = {names[n]: e.in_sum2.numpy() for n, e in entries.items()}
    ref = tmp_path / "ggml.gguf"
    _ggml_writes_imatrix(ref, sums, {names[n]: e.count for n, e in entries.items()}, ["sample.txt"], 2, 16)
    assert path.read_bytes() == ref.read_bytes()


def write_legacy_dat(path, stats: dict[str, tuple[np.ndarray, int]], chunk_size: int, last_chunk: int,
                     dataset: str) -> None:
    """imatrix.cpp's save_imatrix_legacy: entries in sorted name order, each value stored as (Σx² / count) · ncall
    in float32, ncall = ceil(count / chunk_size); then the chunk count and the dataset name."""
    out = struct.pack("<i", len(stats))
    for name in sorted(stats):
        sums, count = stats[name]
        ncall = (count + chunk_size - 1) // chunk_size
        values = (sums.astype(np.float32) / np.float32(count)) * np.float32(ncall)
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, len(values))
        out += values.astype("<f4").tobytes()
    path.write_bytes(out + struct.pack("<ii", last_chunk, len(dataset)) + dataset.encode())


def test_legacy_dat_loads(saved, tmp_path):
    """Reference: llama-quantize's reading, value / ncall in float32, of the values save_imatrix_legacy stores;
    within float32 rounding (rtol 1e-6) of Σx² / count."""
    _, entries, names = saved
    stats = {names[n]: (e.in_sum2.numpy(), e.count) for n, e in entries.items()}
    dat = tmp_path / "imatrix.dat"
    write_legacy_dat(dat, stats, chunk_size=16, last_chunk=2, dataset="sample.txt")
    raw = read_imatrix(dat)
    assert (raw.legacy, raw.datasets, raw.chunk_count) == (True, ["sample.txt"], 2)
    importance = load_imatrix(dat)
    assert set(importance) == set(stats)
    for name, (sums, count) in stats.items():
        stored = (sums / np.float32(count)) * np.float32(2)
        assert np.array_equal(importance[name].numpy(), stored / np.float32(2))
        torch.testing.assert_close(importance[name], torch.from_numpy(sums / count), rtol=1e-6, atol=0)


def test_missing_and_corrupt_files_are_named(saved, tmp_path):
    path, _, _ = saved
    with pytest.raises(FileNotFoundError, match=r"imatrix file .*nowhere.gguf does not exist"):
        load_imatrix(tmp_path / "nowhere.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"imatrix file .*cut.gguf is not a valid llama.cpp imatrix: cannot parse"):
        load_imatrix(cut)
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x02\x00\x00\x00\x05\x00\x00\x00blk")
    with pytest.raises(ValueError, match=r"junk.dat is not a valid llama.cpp imatrix: the file ends inside entry 1"):
        load_imatrix(junk)
    empty = tmp_path / "empty.dat"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.dat is not a valid .*ends inside the entry count"):
        load_imatrix(empty)


def test_a_model_gguf_is_not_an_imatrix(tmp_path):
    import gguf

    model_file = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(model_file, "llama")
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="model.gguf is not a valid llama.cpp imatrix: missing imatrix metadata "
                                         "imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size"):
        load_imatrix(model_file)


def test_check_imatrix_names_the_tensor_that_does_not_fit(saved):
    path, entries, names = saved
    importance = load_imatrix(path)
    model = {names[n]: e.in_sum2.numel() for n, e in entries.items()} | {"output.weight": 64}
    assert check_imatrix(importance, model) == ["output.weight"]  # not collected: quantized without an imatrix
    other = dict(model, **{"blk.1.ffn_down.weight": 128})
    with pytest.raises(ValueError, match=r"imatrix entry blk.1.ffn_down.weight has 96 values; the model's tensor "
                                         r"has 128 input columns \(an imatrix from another model\?\)"):
        check_imatrix(importance, other)
    fewer = {k: v for k, v in model.items() if not k.startswith("blk.1.")}
    with pytest.raises(ValueError, match=r"imatrix entry blk.1.\S+ is not a tensor of this model"):
        check_imatrix(importance, fewer)


def test_save_refuses_what_llama_quantize_would(collected, tmp_path):
    model, _, entries = collected
    names = gguf_tensor_names(model)
    with pytest.raises(ValueError, match="datasets must name at least one calibration text"):
        save_imatrix(tmp_path / "x.gguf", entries, names, datasets=[], chunk_size=16)
    with pytest.raises(ValueError, match="no GGUF tensor name for model.layers.0.mlp.down_proj"):
        save_imatrix(tmp_path / "x.gguf", entries, {}, datasets=["a"], chunk_size=16)
    lone = {"x": ImatrixEntry(torch.ones(4), 0)}
    path = save_imatrix(tmp_path / "zero.gguf", lone, {"x": "blk.0.attn_v.weight"}, datasets=["a"], chunk_size=16)
    assert torch.equal(load_imatrix(path)["blk.0.attn_v.weight"], torch.ones(4))  # count 0: llama.cpp's 1s
