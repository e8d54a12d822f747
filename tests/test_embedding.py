"""Encoder metric: mean-pooled embedding cosine vs float, per-layer relative error, runner on a tiny BERT."""
import pandas as pd
import pytest
import torch

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


def test_fidelity_of_a_model_with_itself_is_one(tiny_bert_dir):
    model, tok = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    assert type(model).__name__ == "BertModel"  # encoders load with AutoModel
    sents = sentences_from_text(TEXT, 8)
    ref = mean_pooled_embeddings(model, tok, sents, progress=False)
    f = embedding_fidelity(ref, mean_pooled_embeddings(model, tok, sents, progress=False))
    assert f["cos_mean"] == pytest.approx(1.0, abs=1e-6) and f["cos_p5"] == pytest.approx(1.0, abs=1e-6)
    q, _ = quantlab.load_model(str(tiny_bert_dir), device="cpu")
    quantlab.quantize(q, quantlab.RTNConfig(bits=8, exclude=()))
    batch = tok(sents, padding=True, return_tensors="pt")
    errors = layer_output_errors(q, model, batch)
    assert len(errors) == 2 * 6 + 1  # q, k, v, attn out, intermediate, output per layer + pooler
    assert all(0 < e < 0.05 for e in errors.values())  # int8 per-channel: under 5% relative error


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
    assert df["cos_mean"].iloc[0] == pytest.approx(1.0, abs=1e-6)
    assert df["cos_mean"].iloc[1] > df["cos_mean"].iloc[2] and df["cos_mean"].iloc[2] < 1 - 1e-5
    # p5 is not bounded by the mean in general; where all sentences agree they match to fp32 rounding
    assert (df["cos_p5"] <= df["cos_mean"] + 1e-6).all() and df["layer_rel_err_max"].iloc[2] > df["layer_rel_err_max"].iloc[1]
    assert "calib_samples" in df and df["calib_samples"].iloc[3] == 4
    assert df["layer_rel_err_mean"].iloc[3] < df["layer_rel_err_mean"].iloc[2]  # GPTQ below RTN at the same bits
    md = (tmp_path / "tiny_bert.md").read_text()
    assert "cos" in md and "16 sentences" in md
