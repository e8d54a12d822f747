"""Perplexity over fixed windows, plus KL divergence and top-1 agreement vs a reference model.

ppl = exp(total next-token NLL / predicted tokens); every window predicts
seq_len - 1 tokens, so this equals the GPTQ code's exp(mean of window losses).

The reference for KL is either a list of precomputed log-probs (reference_logprobs: fp32 (T, V)
per window, ~100 MB per 512-token window at a 49k vocabulary, so memory grows with the number of
KL windows) or the reference *model* itself: then it runs on each KL window right before the
evaluated model, and only that window's log-probs are alive (memory: two windows' (T, V) tensors,
whatever the number of windows). Both give the same numbers bit for bit: the same forward and
log_softmax on the same window, just computed later.

    ref = reference_logprobs(float_model, windows[:8])      # stored: memory grows with windows
    perplexity(q, windows, ref)
    perplexity(q, windows, float_model, kl_windows=8)       # on the fly: bounded memory, exact
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

# what result rows say about the KL reference when it is the model run on the fly
KL_REFERENCE_ON_THE_FLY = "float model run on each KL window just before the evaluated model (exact, nothing stored)"


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _logits(model, window: torch.Tensor) -> torch.Tensor:
    return model(window.unsqueeze(0).to(_device(model)), use_cache=False).logits[0].float()  # (T, V)


def _reference_window(model, window: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(_logits(model, window), dim=-1)  # (T, V) fp32


@torch.inference_mode()
def reference_logprobs(model, windows: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Log-probs (T, V) of the reference model for each window, kept on CPU in fp32.

    Memory grows with len(windows) (T x V x 4 bytes each); for many windows pass the reference
    model to perplexity() instead, which recomputes each window's log-probs when it needs them.
    """
    it = tqdm(windows, desc="reference logits", leave=False, disable=not progress)
    return [_reference_window(model, w).cpu() for w in it]


def _kl_count(reference, kl_windows: int | None, n_windows: int) -> int:
    """How many leading windows measure KL."""
    if reference is None:
        return 0
    if isinstance(reference, nn.Module):
        if kl_windows is not None and (not isinstance(kl_windows, int) or kl_windows < 0):
            raise ValueError(f"kl_windows must be an integer >= 0 or None (all windows), got {kl_windows!r}")
        return n_windows if kl_windows is None else min(kl_windows, n_windows)
    if kl_windows is not None:
        raise ValueError(f"kl_windows={kl_windows!r} applies to a reference model; with a list of log-probs "
                         f"its length ({len(reference)}) decides")
    return min(len(reference), n_windows)


def _window_stats(model, w: torch.Tensor, ref: torch.Tensor | None) -> tuple[float, float, int, int]:
    """(NLL sum, KL sum, top-1 agreements, KL tokens) of one window; its (T, V) tensors die on return."""
    logits = _logits(model, w)
    nll = F.cross_entropy(logits[:-1], w[1:].to(logits.device), reduction="sum").item()
    if ref is None:
        return nll, 0.0, 0, 0
    ref = ref.to(logits.device)
    logq = F.log_softmax(logits, dim=-1)
    del logits  # keep two (T, V) tensors alive, not three
    kl = F.kl_div(logq, ref, log_target=True, reduction="sum").item()
    agree = (logq.argmax(-1) == ref.argmax(-1)).sum().item()
    return nll, kl, agree, ref.shape[0]


def _sync(model) -> None:
    if _device(model).type == "cuda":
        torch.cuda.synchronize(_device(model))


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, reference: list[torch.Tensor] | nn.Module | None = None,
               progress: bool = True, kl_windows: int | None = None) -> dict:
    """{'ppl', 'nll_mean', 'predicted_tokens', 'window_nll', and with a reference: 'kl_mean', 'top1_agree', 'kl_tokens'}.

    windows: (n, T) token ids. reference: reference_logprobs() of the first k <= n windows, or the
    reference model itself, run on each of the first `kl_windows` windows (default: all) right
    before `model` (adds 'kl_reference_s', the seconds spent in it). KL(P_ref || P_model) is
    averaged over every position of those windows.

    >>> perplexity(quantized, windows, float_model, kl_windows=8)["kl_mean"]
    """
    model.eval()
    k = _kl_count(reference, kl_windows, len(windows))
    ref_model = reference if isinstance(reference, nn.Module) else None
    if ref_model is not None:
        ref_model.eval()
    window_nll, kl_sum, agree, kl_tokens, reference_s = [], 0.0, 0, 0, 0.0
    for i, w in enumerate(tqdm(windows, desc="perplexity", leave=False, disable=not progress)):
        ref = None
        if i < k and ref_model is not None:
            t0 = time.perf_counter()
            ref = _reference_window(ref_model, w)
            _sync(ref_model)
            reference_s += time.perf_counter() - t0
        elif i < k:
            ref = reference[i]
        nll, kl, a, n = _window_stats(model, w, ref)
        del ref
        window_nll.append(nll)
        kl_sum, agree, kl_tokens = kl_sum + kl, agree + a, kl_tokens + n
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    nll_mean = sum(window_nll) / predicted
    out = {"ppl": math.exp(nll_mean), "nll_mean": nll_mean, "predicted_tokens": predicted, "window_nll": window_nll}
    if k:
        out.update(kl_mean=kl_sum / kl_tokens, top1_agree=agree / kl_tokens, kl_tokens=kl_tokens)
    if ref_model is not None:
        out["kl_reference_s"] = reference_s
    return out
