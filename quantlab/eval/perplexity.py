"""Perplexity over fixed windows, plus KL divergence and top-1 agreement vs a reference model.

ppl = exp(total next-token NLL / predicted tokens); every window predicts seq_len - 1 tokens, so this
equals the GPTQ code's exp(mean of window losses).

The harness runs near the model's own cost:
- windows go through the model in batches (`batch_size`, or chosen from free memory);
- the loss never materialises a (T, V) logits tensor: the model body gives hidden states (B, T, C) and
  the output head runs on `chunk` positions at a time (logsumexp and the target's logit per chunk), so
  memory is B x chunk x V, not B x T x V plus its fp32 / log-softmax copies (models that transform their
  logits further, e.g. softcapping, take the full-logits path with the same chunked loss);
- simulated quantized layers dequantize each weight once per evaluation (lifecycle.cached_weights).

The KL reference is either a list of precomputed log-probs (reference_logprobs: fp32 (T, V) per window,
~100 MB per 512-token window at a 49k vocabulary, so memory grows with the number of KL windows) or the
reference *model* itself: then it runs on each KL batch right before the evaluated model, and its logits
exist only chunk by chunk (memory independent of the number of KL windows, and exact: the same forward).

    ref = reference_logprobs(float_model, windows[:8])      # stored: memory grows with windows
    perplexity(q, windows, ref)
    perplexity(q, windows, float_model, kl_windows=8)       # on the fly: bounded memory, exact

Per-token statistics as llama.cpp's `llama-perplexity --kl-divergence` reports them (kl_token_stats; the
per-token values kept are KL windows x seq_len float64 numbers, nothing of vocabulary size).
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.lifecycle import cached_weights
from .gemm import onednn_linear, resolve_gemm

# what result rows say about the KL reference when it is the model run on the fly
KL_REFERENCE_ON_THE_FLY = "float model run on each KL window just before the evaluated model (exact, nothing stored)"
EVAL_DTYPES = ("float32", "bfloat16")  # perplexity(dtype=...), [eval] dtype


def check_eval_dtype(dtype: str | None, gemm: str = "auto") -> bool:
    """True when `dtype` asks for bf16 autocast; a clear error for an unknown dtype or an fp32-only GEMM."""
    if dtype is not None and dtype not in EVAL_DTYPES:
        raise ValueError(f"eval dtype {dtype!r} unknown; known: {', '.join(EVAL_DTYPES)}")
    if dtype == "bfloat16" and gemm == "onednn":
        raise ValueError("gemm 'onednn' routes float32 linears only; with dtype 'bfloat16' use gemm 'auto' or 'aten'")
    return dtype == "bfloat16"


LOSS_CHUNK = 128  # positions per output-head chunk: B x 128 x V fp32 logits alive at a time
MAX_AUTO_BATCH = 8


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def reference_logprobs(model, windows: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Log-probs (T, V) of the reference model for each window, kept on CPU in fp32.

    Memory grows with len(windows) (T x V x 4 bytes each); for many windows pass the reference
    model to perplexity() instead, which recomputes each window's logits when it needs them.
    """
    return [window_log_probs(model, w).cpu() for w in tqdm(windows, desc="reference logits", leave=False,
                                                            disable=not progress)]


def window_log_probs(model, window: torch.Tensor) -> torch.Tensor:
    """Log-probs (T, V) fp32 of one window, by the same ops perplexity() uses at batch_size=1 (the head on
    LOSS_CHUNK positions at a time, logits - logsumexp): two paths that must agree exactly share them."""
    with onednn_linear(resolve_gemm("auto", _device(model)) == "onednn"):  # perplexity()'s default GEMM
        scorer = _Scorer(model, window[None])
        parts = []
        for c0 in range(0, window.shape[0], LOSS_CHUNK):
            r = scorer.logits(c0, c0 + LOSS_CHUNK)[0]
            parts.append(r - torch.logsumexp(r, dim=-1, keepdim=True))
        return torch.cat(parts)


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


def split_head(model) -> tuple[nn.Module, nn.Module] | None:
    """(body, head) with head(body(ids).last_hidden_state) == model(ids).logits, or None where the model does
    more to its logits (softcapping, logit scale) or has no such split."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", None)
    if head is None or body is None or body is model:
        return None
    return body, head


class _Scorer:
    """Logits of one model for a batch of windows, chunk of positions by chunk."""

    def __init__(self, model, ids: torch.Tensor):
        self.split = split_head(model)
        ids = ids.to(_device(model))
        if self.split is not None:
            body, self.head = self.split
            self.states = body(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, C)
        else:
            self.states = model(ids, use_cache=False).logits  # (B, T, V)

    def logits(self, c0: int, c1: int) -> torch.Tensor:
        part = self.states[:, c0:c1]
        return (self.head(part) if self.split is not None else part).float()  # (B, c, V)


def _batch_stats(model, ids: torch.Tensor, ref, n_kl: int, chunk: int) -> dict:
    """Per-window NLL sums (B,), and over the first n_kl windows KL sum, top-1 agreements and KL tokens, plus
    per-token KL (n_kl, T), same top token (n_kl, T) and Δp of the next token (n_kl, T - 1), float64 on CPU.

    ref: None, a _Scorer of the reference model, or a list of (T, V) log-probs (one per window)."""
    b, t = ids.shape
    scorer = _Scorer(model, ids)
    device = scorer.states.device
    targets = ids[:, 1:].to(device)
    nll = torch.zeros(b, dtype=torch.float64, device=device)
    kl, agree = torch.zeros((), dtype=torch.float64, device=device), 0
    token_kl, same_top, p_diff = [], [], []  # per-token parts, (n_kl, c) each
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        logits = scorer.logits(c0, c1)  # (B, c, V)
        lse = torch.logsumexp(logits, dim=-1)  # (B, c)
        n = min(c1, t - 1) - c0  # positions with a next token (the last position has none)
        if n > 0:
            target_logit = logits[:, :n].gather(-1, targets[:, c0:c0 + n, None])[..., 0]
            nll += (lse[:, :n] - target_logit).double().sum(1)
        if n_kl:
            logq = (logits[:n_kl] - lse[:n_kl, :, None])  # (k, c, V)
            if isinstance(ref, _Scorer):
                r = ref.logits(c0, c1)[:n_kl]
                logp = r - torch.logsumexp(r, dim=-1, keepdim=True)
            else:
                logp = torch.stack([ref[i][c0:c1] for i in range(n_kl)]).to(device)
            term = (logp.exp() * (logp - logq)).double()  # (k, c, V); the sum below is kl_mean's, unchanged
            kl += term.sum()
            token_kl.append(term.sum(-1).cpu())
            del term
            same = logq.argmax(-1) == logp.argmax(-1)  # (k, c)
            agree += int(same.sum())
            same_top.append(same.cpu())
            if n > 0:  # Δp = p_model(next token) - p_ref(next token), llama.cpp's p_diff
                tgt = targets[:n_kl, c0:c0 + n, None]
                p_diff.append((logq[:, :n].gather(-1, tgt)[..., 0].double().exp()
                               - logp[:, :n].gather(-1, tgt)[..., 0].double().exp()).cpu())
            del logp, logq
    out = {"nll": nll.tolist(), "kl": float(kl), "agree": agree, "kl_tokens": n_kl * t}
    if n_kl:
        out |= {"token_kl": torch.cat(token_kl, 1), "same_top": torch.cat(same_top, 1),
                "p_diff": torch.cat(p_diff, 1) if p_diff else torch.zeros(n_kl, 0, dtype=torch.float64)}
    return out


def _mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty: the mean and its standard error sqrt((E[x^2] - E[x]^2) / (n - 1)),
    0 where the variance is not positive or count <= 10."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, (math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0)


def _percentile(sorted_values: torch.Tensor, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation at fraction * (n - 1) of the sorted values."""
    n = sorted_values.numel()
    pos = fraction * (n - 1)
    i = int(pos)
    w = pos - i
    return float((1 - w) * sorted_values[i] + w * sorted_values[min(i + 1, n - 1)])


KL_TOKEN_STATS = ("kld_mean_se", "kld_median", "kld_p99", "kld_max", "rms_dp", "rms_dp_se", "same_top_pct",
                  "same_top_pct_se")


def kl_token_stats(token_kl: torch.Tensor, same_top: torch.Tensor, p_diff: torch.Tensor) -> dict:
    """Per-token KL statistics with the definitions of llama.cpp's `llama-perplexity --kl-divergence`
    (tools/perplexity/perplexity.cpp), on quantlab's positions:

    token_kl  KL(P_ref || P_model) of every scored position (any shape; nats)
    same_top  whether the two argmaxes agree at those positions (bool, same shape)
    p_diff    p_model(next token) - p_ref(next token) at the positions with a next token (any shape; probability)

    kld_mean_se       standard error of the mean KL ("Mean KLD: m ± se"): sqrt((mean(kl^2) - mean(kl)^2) / (n - 1)),
                      0 for n <= 10 (llama.cpp's mean_and_uncertainty); nats
    kld_median        median KL ("Median KLD"; the mean of the two middle values for even n); nats
    kld_p99           99th percentile of KL ("99.0% KLD"), linear interpolation at 0.99 (n - 1); nats
    kld_max           largest KL ("Maximum KLD"); nats
    rms_dp            100 sqrt(mean(p_diff^2)) ("RMS Δp"); percent (of probability)
    rms_dp_se         its uncertainty, 100 se(p_diff^2) / (2 sqrt(mean(p_diff^2))), as llama.cpp; percent
    same_top_pct      100 x the fraction of positions whose top tokens agree ("Same top p"); percent
    same_top_pct_se   100 sqrt(f (1 - f) / (n - 1)) ("Same top p: f ± se"); percent

    Differences from llama.cpp: the reference log-probs are exact fp32 (llama.cpp stores them as 16-bit codes
    and drops terms with log p_ref <= -16), statistics are in float64, and the positions are quantlab's
    (every position of each KL window for the KL and top-token columns, as kl_mean; every position with a next
    token for Δp) where llama.cpp scores the second half of each n_ctx chunk.

    >>> kl_token_stats(torch.tensor([0.1, 0.2, 0.0]), torch.tensor([True, True, False]), torch.tensor([0.05, -0.1]))
    """
    kl = token_kl.reshape(-1).double()
    n = kl.numel()
    if n == 0:
        raise ValueError("kl_token_stats needs at least one KL position")
    ordered = kl.sort().values
    _, kld_se = _mean_and_uncertainty(float(kl.sum()), float((kl * kl).sum()), n)
    dp2 = p_diff.reshape(-1).double() ** 2
    mse, mse_se = _mean_and_uncertainty(float(dp2.sum()), float((dp2 * dp2).sum()), dp2.numel())
    rms = math.sqrt(mse)
    same = float(same_top.reshape(-1).sum()) / same_top.numel()
    same_se = math.sqrt(same * (1 - same) / (same_top.numel() - 1)) if same_top.numel() > 1 else 0.0
    return {"kld_mean_se": kld_se, "kld_median": _percentile(ordered, 0.5), "kld_p99": _percentile(ordered, 0.99),
            "kld_max": float(ordered[-1]), "rms_dp": 100 * rms, "rms_dp_se": 100 * 0.5 / rms * mse_se if rms else 0.0,
            "same_top_pct": 100 * same, "same_top_pct_se": 100 * same_se}


def auto_batch_size(model, seq_len: int, n_windows: int, free_bytes: int | None = None) -> int:
    """The largest power of two <= MAX_AUTO_BATCH whose activations (a generous per-token estimate: one layer's
    MLP and attention tensors, the attention scores and a loss chunk of logits) fit in a quarter of free memory."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", 1024)
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    heads = getattr(cfg, "num_attention_heads", 16)
    vocab = getattr(cfg, "vocab_size", 50000)
    per_window = 4 * (seq_len * (3 * inter + 8 * hidden) + heads * seq_len * seq_len + 3 * LOSS_CHUNK * vocab)
    if free_bytes is None:
        device = _device(model)
        if device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(device)[0]
        else:
            import psutil

            free_bytes = psutil.virtual_memory().available
    b = 1
    while b * 2 <= min(MAX_AUTO_BATCH, n_windows) and 2 * b * per_window <= free_bytes // 4:
        b *= 2
    return b


def _sync(model) -> None:
    if _device(model).type == "cuda":
        torch.cuda.synchronize(_device(model))


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, reference: list[torch.Tensor] | nn.Module | None = None,
               progress: bool = True, kl_windows: int | None = None, batch_size: int | None = None,
               chunk: int = LOSS_CHUNK, gemm: str = "auto", dtype: str | None = None) -> dict:
    """{'ppl', 'nll_mean', 'predicted_tokens', 'window_nll', 'eval_batch_size', and with a reference: 'kl_mean',
    'top1_agree', 'kl_tokens' and llama.cpp's per-token statistics (kl_token_stats: 'kld_mean_se', 'kld_median',
    'kld_p99', 'kld_max', 'rms_dp', 'rms_dp_se', 'same_top_pct', 'same_top_pct_se')}.

    windows: (n, T) token ids. reference: reference_logprobs() of the first k <= n windows, or the reference
    model itself, run on each of the first `kl_windows` windows (default: all) right before `model` (adds
    'kl_reference_s', the seconds spent in it). KL(P_ref || P_model) is averaged over every position of those
    windows. batch_size: windows per forward (None: chosen from free memory, auto_batch_size). gemm: "auto"
    (oneDNN for fp32 linears on an AMD CPU, else PyTorch's BLAS; eval/gemm.py), "onednn" or "aten" (PyTorch's
    BLAS); the result has 'eval_gemm'. dtype: None or "float32" computes in the models' own dtype; "bfloat16" runs
    both models' forwards under torch.autocast (matmuls in bf16, weights and norms left as they are, logits upcast to
    fp32 for the loss): faster where the CPU computes bf16 natively (AVX512_BF16 / AMX), with the result's
    'eval_dtype' saying so; its linears take PyTorch's BLAS (oneDNN's fp32 route would bypass autocast).

    >>> perplexity(quantized, windows, float_model, kl_windows=8)["kl_mean"]
    """
    autocast = check_eval_dtype(dtype, gemm)
    model.eval()
    k = _kl_count(reference, kl_windows, len(windows))
    ref_model = reference if isinstance(reference, nn.Module) else None
    if ref_model is not None:
        ref_model.eval()
    if batch_size is None:
        batch_size = auto_batch_size(model, windows.shape[1], len(windows))
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1 or None (from free memory), got {batch_size!r}")
    window_nll, kl_sum, agree, kl_tokens, reference_s = [], 0.0, 0, 0, 0.0
    per_token = {"token_kl": [], "same_top": [], "p_diff": []}  # kl_token_stats' inputs, one part per batch
    bar = tqdm(total=len(windows), desc="perplexity", leave=False, disable=not progress)
    gemm = "aten" if autocast else resolve_gemm(gemm, _device(model))
    amp = torch.autocast(_device(model).type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cached_weights(model), onednn_linear(gemm == "onednn"), amp:  # each quantized weight dequantized once
        for i in range(0, len(windows), batch_size):
            ids = windows[i:i + batch_size]
            n_kl = max(0, min(k - i, len(ids)))
            ref = None
            if n_kl and ref_model is not None:
                t0 = time.perf_counter()
                ref = _Scorer(ref_model, ids[:n_kl])
                _sync(ref_model)
                reference_s += time.perf_counter() - t0
            elif n_kl:
                ref = reference[i:i + n_kl]
            stats = _batch_stats(model, ids, ref, n_kl, chunk)
            del ref
            window_nll += stats["nll"]
            kl_sum, agree, kl_tokens = kl_sum + stats["kl"], agree + stats["agree"], kl_tokens + stats["kl_tokens"]
            for key, parts in per_token.items():
                if key in stats:
                    parts.append(stats[key])
            bar.update(len(ids))
    bar.close()
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    nll_mean = sum(window_nll) / predicted
    out = {"ppl": math.exp(nll_mean), "nll_mean": nll_mean, "predicted_tokens": predicted, "window_nll": window_nll,
           "eval_batch_size": batch_size, "eval_gemm": gemm, **({"eval_dtype": "bfloat16"} if autocast else {})}
    if k:
        out.update(kl_mean=kl_sum / kl_tokens, top1_agree=agree / kl_tokens, kl_tokens=kl_tokens)
        out.update(kl_token_stats(*(torch.cat([p.reshape(-1) for p in per_token[key]])
                                    for key in ("token_kl", "same_top", "p_diff"))))
    if ref_model is not None:
        out["kl_reference_s"] = reference_s
    return out
