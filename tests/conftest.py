"""Shared fixtures: a tiny random Llama (with a real BPE tokenizer) saved to disk, seeded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog . Quantization maps floats to a small grid of integers . "
    "Perplexity measures how surprised a language model is by held-out text . "
) * 40


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama (hidden 64, tied embeddings) and a byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([SAMPLE_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    assert len(fast) <= 300
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    (out / "sample.txt").write_text(SAMPLE_TEXT)
    return out


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from quantlab import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    from quantlab.models.data import find_wikitext2_dir

    path = find_wikitext2_dir()
    if path is None:
        pytest.skip("wikitext-2 files not found beside the repo (../shared/data/wikitext-2)")
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
