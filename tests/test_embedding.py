"""Encoder metric: mean-pooled embedding cosine vs float, per-layer relative error, runner on a tiny BERT."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import quantlab
from quantlab.eval.embedding import embedding_fidelity, layer_output_errors, mean_pooled_embeddings, sentences_from_text
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.runner import run_experiment

TEXT = " = Heading = \n" + " The cat sat on the mat near the door . A dog ran in the park all day long . Short one .\n" * 30


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = tmp_path_factory.mktemp("tiny-bert")
    words = sorted(set(TEXT.lower().split()))
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(out)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(words) + 5, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, architectures=["BertModel"])
    BertModel(cfg).save_pretrained(out)
    (out / "text.txt").write_text(TEXT)
    return out


def test_sentences_skip_headings_and_short_ones():
    s = sentences_from_text(TEXT, 3)
    assert s == ["The cat sat on the mat near the door .", "A dog ran in the park all day long .",
                 "The cat sat on the mat near the door ."]
    with pytest.raises(ValueError, match="no sentences of at least 6 words"):
        sentences_from_text("= A =\n tiny .\n", 3)


# sentences of different lengths, so batches are padded and the mask matters
SENTENCES = ["The cat sat on the mat .", "A dog ran in the park all day long near the door .",
             "The dog sat near the cat .", "A cat ran .", "The mat near the door sat in the park all day ."]


def _alone(model, tok, sentence):
    """Reference embedding: the sentence run by itself (no padding), mean over its tokens."""
    with torch.no_grad():
        return model(**tok([sentence], return_tensors="pt")).last_hidden_state[0].mean(0)


def test_mean_pooling_and_cosine_vs_hand_computed(tiny_bert_dir):
    model, tok = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    assert type(model).__name__ == "BertModel"  # encoders load with AutoModel
    ref = mean_pooled_embeddings(model, tok, SENTENCES, batch_size=4, progress=False)  # 2 padded batches
    alone = torch.stack([_alone(model, tok, s) for s in SENTENCES])
    torch.testing.assert_close(ref, alone, rtol=1e-5, atol=1e-5)  # padding masked out; fp32 reassociation
    q, _ = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    quantlab.quantize(q, quantlab.RTNConfig(bits=3, group_size=32, exclude=()))
    emb = mean_pooled_embeddings(q, tok, SENTENCES, progress=False)
    f = embedding_fidelity(ref, emb)
    cos = [float(a.double() @ b.double() / (a.double().norm() * b.double().norm())) for a, b in zip(ref, emb)]
    # tolerance: float32 cosines vs float64, ~1 ulp at 1.0; w3 moves them by ~9e-5 (measured), 400x that
    assert f["sentences"] == 5 and f["cos_mean"] == pytest.approx(np.mean(cos), abs=2e-7)
    assert f["cos_p5"] == pytest.approx(np.percentile(cos, 5), abs=2e-7) and f["cos_mean"] < 1 - 1e-5
    stored = json.loads(f["sentence_cos"])  # per sentence, for paired intervals between runs (rounded to 1e-7)
    assert stored == pytest.approx(cos, abs=2e-7) and np.mean(stored) == pytest.approx(f["cos_mean"], abs=2e-7)


def test_layer_output_errors_vs_hand_computed(tiny_bert_dir):
    model, tok = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    q, _ = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    quantlab.quantize(q, quantlab.RTNConfig(bits=8, exclude=()))
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    errors = layer_output_errors(q, model, batch)
    assert len(errors) == 2 * 6 + 1  # q, k, v, attn out, intermediate, output per layer + pooler
    assert all(0 < e < 0.05 for e in errors.values())  # int8 per-channel: under 5% relative error
    # reference for the first linear: its input is the embeddings' output, the same in both models
    name = "encoder.layer.0.attention.self.query"
    float_layer, q_layer = model.get_submodule(name), q.get_submodule(name)
    with torch.no_grad():
        x = model.embeddings(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
        y_ref = F.linear(x, float_layer.weight, float_layer.bias)
        y_q = F.linear(x, q_layer.quantized_weight(), q_layer.bias)
    assert errors[name] == pytest.approx(float((y_q - y_ref).norm() / y_ref.norm()), rel=1e-4)


def test_runner_embedding_metric_on_tiny_bert(tiny_bert_dir, tmp_path):
    exp = parse_experiment({
        "name": "tiny_bert", "model": str(tiny_bert_dir), "device": "cpu",
        "eval": {"metric": "embedding", "dataset": str(tiny_bert_dir / "text.txt"), "num_sentences": 16,
                 "max_length": 32, "prefill_tokens": 16, "latency_repeats": 1},
        "calibration": {"dataset": str(tiny_bert_dir / "text.txt"), "split": "validation", "num_samples": 4, "seq_len": 32},
        "run": [{"name": "fp32", "method": "none"}, {"name": "w8", "method": "rtn", "bits": 8},
                {"name": "w3", "method": "rtn", "bits": 3, "group_size": 32}, {"name": "gptq3", "method": "gptq", "bits": 3, "group_size": 32}],
    })
    run_experiment(exp, tmp_path, progress=False)
    df = pd.read_csv(tmp_path / "tiny_bert.csv")
    # the w3 row's cosines are those of the protocol (first 16 sentences, max_length 32) vs the float model
    model, tok = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    sents = sentences_from_text(TEXT, 16)
    ref = mean_pooled_embeddings(model, tok, sents, max_length=32, progress=False)
    quantlab.quantize(model, quantlab.make_config({"method": "rtn", "bits": 3, "group_size": 32}))
    want = embedding_fidelity(ref, mean_pooled_embeddings(model, tok, sents, max_length=32, progress=False))
    assert df["cos_mean"].iloc[2] == pytest.approx(want["cos_mean"], rel=1e-9)
    assert df["cos_p5"].iloc[2] == pytest.approx(want["cos_p5"], rel=1e-9)
    assert df["cos_mean"].iloc[1] > df["cos_mean"].iloc[2] and df["cos_mean"].iloc[2] < 1 - 1e-5
    assert df["layer_rel_err_max"].iloc[2] > df["layer_rel_err_max"].iloc[1]
    assert "calib_samples" in df and df["calib_samples"].iloc[3] == 4
    assert df["layer_rel_err_mean"].iloc[3] < df["layer_rel_err_mean"].iloc[2]  # GPTQ below RTN at the same bits
    md = (tmp_path / "tiny_bert.md").read_text()
    assert "cos" in md and "16 sentences" in md
