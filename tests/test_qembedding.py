"""Input-embedding quantization (core/qembedding.py): per-row codes, a tied head reading them, rows and bytes."""
import copy

import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from quantlab.core import qembedding
from quantlab.core.primitives import dequantize, qparams, quantize
from quantlab.core.qembedding import EmbeddingQuantConfig, QuantEmbedding, QuantTiedHead, quantize_embedding
from quantlab.core.registry import make_config
from quantlab.eval.memory import weight_stats
from quantlab.runs import runner
from quantlab.runs.experiment import RunSpec, parse_experiment

IDS = torch.tensor([[1, 5, 17, 200, 3, 299, 42, 7, 0, 64]])


def _reference(model, bits=8):
    """The float model with its embedding (and so a tied head) replaced by the dequantized per-row grid."""
    ref = copy.deepcopy(model)
    w = ref.get_input_embeddings().weight
    p = qparams(w.detach(), bits, None, symmetric=True, scale_dtype=torch.float16)
    w.data = dequantize(quantize(w.detach(), p, bits, None), p, None, w.dtype)
    return ref


def _llama(tied=True):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)).eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_tied_model_equals_its_dequantized_reference(monkeypatch, bits):
    """Lookups are exact; the tied head, computed in vocabulary chunks, equals the reference to fp32 round-off."""
    monkeypatch.setattr(qembedding, "HEAD_CHUNK_ROWS", 128)  # 300 rows: chunks of 128, 128, 44
    model = _llama()
    ref = _reference(model, bits)
    facts = quantize_embedding(model, EmbeddingQuantConfig(bits=bits))
    assert facts["embedding_quant"] == f"emb{bits} per-row" and facts["embedding_head_tied"] is True
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantTiedHead) and head.codes is emb.codes
    assert emb.codes.dtype == torch.int8 and emb.scale.shape == (300, 1)
    assert torch.equal(emb(IDS), ref.get_input_embeddings()(IDS))  # exact: the same rows, the same products
    with torch.no_grad():
        out, want = model(IDS).logits, ref(IDS).logits
    assert torch.allclose(out, want, rtol=0, atol=1e-5 * want.abs().max().item())
    sqnr_floor = {8: 38.0, 4: 14.0}[bits]  # per-row absmax on a N(0, 0.02) matrix: ~6 dB per bit
    assert facts["embedding_sqnr_db"] >= sqnr_floor


def test_bytes_are_codes_plus_row_scales_and_counted_once():
    model = _llama()
    before = weight_stats(model)
    quantize_embedding(model, EmbeddingQuantConfig())
    after = weight_stats(model)
    assert before["embedding_bytes"] == 300 * 64 * 4
    assert after["embedding_bytes"] == 300 * 64 + 300 * 2  # int8 codes + fp16 scales, the tied head sharing them
    assert before["weight_bytes"] - after["weight_bytes"] == before["embedding_bytes"] - after["embedding_bytes"]
    assert after["weight_mib_no_embedding"] == before["weight_mib_no_embedding"]


def test_untied_head_stays_float():
    model = _llama(tied=False)
    head = model.get_output_embeddings()
    facts = quantize_embedding(model, EmbeddingQuantConfig())
    assert facts["embedding_head_tied"] is False and model.get_output_embeddings() is head
    assert isinstance(head, nn.Linear)


def test_gemma_embedding_scale_is_kept():
    """Gemma-3 multiplies looked-up rows by sqrt(hidden): the quantized lookup must too."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ref = _reference(model)
    quantize_embedding(model, EmbeddingQuantConfig())
    assert torch.equal(model.get_input_embeddings()(IDS), ref.get_input_embeddings()(IDS))
    with torch.no_grad():
        out, want = model(IDS).logits, ref(IDS).logits
    assert torch.allclose(out, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="embedding bits"):
        EmbeddingQuantConfig(bits=9)
    with pytest.raises(ValueError, match=r"unknown embedding scale_dtype 'float8'"):
        EmbeddingQuantConfig(scale_dtype="float8")
    with pytest.raises(ValueError, match=r"embedding: unknown key\(s\) 'bitz'; valid: bits, scale_dtype"):
        RunSpec("emb", make_config({"method": "none"}), extras={"embedding": {"bitz": 8}})  # the experiment file's path
    with pytest.raises(ValueError, match="needs a model whose get_input_embeddings"):
        quantize_embedding(nn.Linear(4, 4), EmbeddingQuantConfig())


def _experiment(model_dir, runs, **eval_extra):
    return parse_experiment({"name": "emb", "model": str(model_dir), "device": "cpu", "run": runs,
                             "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3,
                                      "kl_windows": 2, "latency": False, **eval_extra}})


def test_experiment_run_quantizes_the_embedding(tiny_model_dir, tmp_path):
    runs = [{"name": "fp32", "method": "none"},
            {"name": "fp32-emb8", "method": "none", "embedding": {"bits": 8}},
            {"name": "w4-emb8", "method": "rtn", "bits": 4, "group_size": 32, "embedding": {}}]
    exp = _experiment(tiny_model_dir, runs)
    keys = {runner.run_key(exp, r, torch.device("cpu")) for r in exp.runs}
    assert len(keys) == 3
    df = runner.run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert df.loc["fp32-emb8", "scheme"] == "float32 + emb8 per-row" and df.loc["w4-emb8", "scheme"] == "w4 g32 sym + emb8 per-row"
    assert df.loc["fp32-emb8", "embedding_quant"] == "emb8 per-row" and df.loc["fp32-emb8", "embedding_head_tied"]
    assert df.loc["fp32-emb8", "embedding_bytes"] == 300 * 64 + 300 * 2
    assert df.loc["fp32-emb8", "weight_bytes"] < df.loc["fp32", "weight_bytes"]
    assert df.loc["fp32-emb8", "ppl"] != df.loc["fp32", "ppl"] and df.loc["fp32-emb8", "kl_mean"] > 0
    with pytest.raises(ValueError, match="embedding: unknown key"):
        _experiment(tiny_model_dir, [{"name": "a", "method": "none", "embedding": {"bitz": 8}}])
    with pytest.raises(ValueError, match="embedding must be a table"):
        _experiment(tiny_model_dir, [{"name": "a", "method": "none", "embedding": 8}])
    with pytest.raises(ValueError, match="isolated memory process"):
        _experiment(tiny_model_dir, runs[1:2], memory="isolated")
