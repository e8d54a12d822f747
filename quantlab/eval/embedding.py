"""Encoder fidelity: cosine of mean-pooled sentence embeddings vs the float model,
and the relative output error of every quantized linear.

all-MiniLM-L6-v2 embeds a sentence as the attention-masked mean of its last hidden
states; we compare the quantized model's embeddings to the float model's per sentence.
"""
from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..core.lifecycle import cached_weights
from ..core.qlinear import QuantLinear


def sentences_from_text(text: str, num_sentences: int, min_words: int = 6) -> list[str]:
    """The first `num_sentences` sentences (>= min_words words) of a WikiText-style text, headings skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for sentence in re.split(r"(?<= \.) ", line):
            if len(sentence.split()) >= min_words:
                out.append(sentence)
                if len(out) == num_sentences:
                    return out
    if not out:
        raise ValueError(f"no sentences of at least {min_words} words in the text")
    return out


def _batches(tokenizer, sentences: list[str], max_length: int, batch_size: int):
    for i in range(0, len(sentences), batch_size):
        yield tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")


@torch.inference_mode()
def mean_pooled_embeddings(model: nn.Module, tokenizer, sentences: list[str], max_length: int = 128,
                           batch_size: int = 32, progress: bool = True) -> torch.Tensor:
    """(N, hidden) attention-masked mean of the last hidden state, fp32 on CPU."""
    device = next(model.parameters()).device
    chunks = []
    total = (len(sentences) + batch_size - 1) // batch_size
    with cached_weights(model):  # each quantized weight dequantized once, not on every batch
        for enc in tqdm(_batches(tokenizer, sentences, max_length, batch_size), total=total, desc="embeddings",
                        leave=False, disable=not progress):
            enc = {k: v.to(device) for k, v in enc.items()}
            hidden = model(**enc).last_hidden_state.float()  # (B, T, C)
            mask = enc["attention_mask"].unsqueeze(-1).float()
            chunks.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).cpu())
    return torch.cat(chunks)


def embedding_fidelity(reference: torch.Tensor, embeddings: torch.Tensor) -> dict:
    """Cosine similarity per sentence: mean and 5th percentile (the bad tail), and every sentence's value
    (`sentence_cos`, JSON) so that two runs on the same sentences can be compared with a paired interval."""
    cos = F.cosine_similarity(reference, embeddings, dim=-1)
    return {"cos_mean": cos.mean().item(), "cos_p5": torch.quantile(cos, 0.05).item(), "sentences": len(cos),
            "sentence_cos": json.dumps([round(c, 7) for c in cos.double().tolist()])}


@torch.inference_mode()
def layer_output_errors(model: nn.Module, reference: nn.Module, batch: dict) -> dict[str, float]:
    """‖y_q − y_ref‖ / ‖y_ref‖ for each QuantLinear of `model`, vs the same-named linear of `reference`,
    both run end to end on `batch` (so each error includes what earlier layers passed on)."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    outs: dict[str, dict[str, torch.Tensor]] = {"q": {}, "ref": {}}
    handles = []
    for key, net in (("q", model), ("ref", reference)):
        for n in names:
            hook = lambda m, a, y, key=key, n=n: outs[key].__setitem__(n, y.detach().float())
            handles.append(net.get_submodule(n).register_forward_hook(hook))
    try:
        for net in (model, reference):
            device = next(net.parameters()).device
            net(**{k: v.to(device) for k, v in batch.items()})
    finally:
        for h in handles:
            h.remove()
    return {n: ((outs["q"][n] - outs["ref"][n]).norm() / outs["ref"][n].norm().clamp(min=1e-12)).item() for n in names}
