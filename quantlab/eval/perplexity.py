"""Perplexity over fixed windows, plus KL divergence and top-1 agreement vs a reference model.

ppl = exp(total next-token NLL / predicted tokens); every window predicts
seq_len - 1 tokens, so this equals the GPTQ code's exp(mean of window losses).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _logits(model, window: torch.Tensor) -> torch.Tensor:
    return model(window.unsqueeze(0).to(_device(model)), use_cache=False).logits[0].float()  # (T, V)


@torch.inference_mode()
def reference_logprobs(model, windows: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Log-probs (T, V) of the reference model for each window, kept on CPU in fp32."""
    it = tqdm(windows, desc="reference logits", leave=False, disable=not progress)
    return [F.log_softmax(_logits(model, w), dim=-1).cpu() for w in it]


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, reference: list[torch.Tensor] | None = None, progress: bool = True) -> dict:
    """{'ppl', 'nll_mean', 'predicted_tokens', 'window_nll', and with a reference: 'kl_mean', 'top1_agree', 'kl_tokens'}.

    windows: (n, T) token ids. reference: reference_logprobs() of the first k <= n
    windows; KL(P_ref || P_model) is averaged over every position of those windows.
    """
    model.eval()
    window_nll, kl_sum, agree, kl_tokens = [], 0.0, 0, 0
    for i, w in enumerate(tqdm(windows, desc="perplexity", leave=False, disable=not progress)):
        logits = _logits(model, w)
        target = w[1:].to(logits.device)
        window_nll.append(F.cross_entropy(logits[:-1], target, reduction="sum").item())
        if reference is not None and i < len(reference):
            ref = reference[i].to(logits.device)
            logq = F.log_softmax(logits, dim=-1)
            kl_sum += F.kl_div(logq, ref, log_target=True, reduction="sum").item()
            agree += (logq.argmax(-1) == ref.argmax(-1)).sum().item()
            kl_tokens += ref.shape[0]
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    nll_mean = sum(window_nll) / predicted
    out = {"ppl": math.exp(nll_mean), "nll_mean": nll_mean, "predicted_tokens": predicted, "window_nll": window_nll}
    if reference is not None:
        out.update(kl_mean=kl_sum / kl_tokens, top1_agree=agree / kl_tokens, kl_tokens=kl_tokens)
    return out
