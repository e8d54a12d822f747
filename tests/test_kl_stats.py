"""Per-token KL statistics (eval/perplexity.kl_token_stats), llama.cpp's `llama-perplexity --kl-divergence` columns.

References: a brute-force float64 computation from full logits with numpy's statistics (np.median, np.percentile's
linear interpolation = llama.cpp's `percentile`, np.var for llama.cpp's E[x^2] - E[x]^2); and, for the keys that
existed before these columns, a frozen copy of the previous per-batch loop: they must agree bit for bit.
"""
from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from quantlab.eval.perplexity import kl_token_stats, perplexity, reference_logprobs

ppl_mod = sys.modules["quantlab.eval.perplexity"]  # the module (quantlab.eval.perplexity is also the function)

NEW_KEYS = {"kld_mean_se", "kld_median", "kld_p99", "kld_max", "rms_dp", "rms_dp_se", "same_top_pct",
            "same_top_pct_se"}
VOCAB, SEQ, WINDOWS = 37, 23, 6
# float32 log-softmax in the harness vs float64 here: a token's KL carries ~1e-7 x the log-prob scale of absolute
# error (measured at most 3.6e-7 on these logits, kld_median); the rest agree to ~1e-6 relative. The top-token
# columns are exact.
RTOL, ATOL = 1e-5, 2e-6


class TableLM(nn.Module):
    """A fake causal LM: logits[b, t] = table[ids[b, t]] + position[t] (no config: the full-logits path)."""

    def __init__(self, seed: int, scale: float = 2.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(scale * torch.randn(VOCAB, VOCAB, generator=g), requires_grad=False)
        self.position = nn.Parameter(torch.randn(SEQ, VOCAB, generator=g), requires_grad=False)

    def forward(self, ids, use_cache=False):
        return SimpleNamespace(logits=self.table[ids] + self.position[: ids.shape[1]])  # (B, T, V)


def perturbed(model: TableLM, seed: int, noise: float = 0.3) -> TableLM:
    q = TableLM(seed)
    g = torch.Generator().manual_seed(seed + 1)
    q.table.copy_(model.table + noise * torch.randn(model.table.shape, generator=g))
    q.position.copy_(model.position)
    return q


def brute_force(ref: TableLM, model: TableLM, windows: torch.Tensor) -> dict:
    """llama.cpp's definitions (tools/perplexity/perplexity.cpp) over full float64 log-softmaxes."""
    with torch.no_grad():
        logp = torch.log_softmax(ref(windows).logits.double(), -1)  # (N, T, V)
        logq = torch.log_softmax(model(windows).logits.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).reshape(-1).numpy()  # every position, as kl_mean
    same = (logp.argmax(-1) == logq.argmax(-1)).reshape(-1).numpy()
    tgt = windows[:, 1:, None]  # Δp at the positions with a next token
    dp = (logq[:, :-1].gather(-1, tgt).exp() - logp[:, :-1].gather(-1, tgt).exp()).reshape(-1).numpy()
    n, m = kl.size, dp.size
    mse = np.mean(dp**2)
    f = same.mean()
    return {"kl_mean": kl.mean(), "top1_agree": f, "kld_mean_se": math.sqrt(np.var(kl) / (n - 1)),
            "kld_median": np.median(kl), "kld_p99": np.percentile(kl, 99), "kld_max": kl.max(),
            "rms_dp": 100 * math.sqrt(mse), "rms_dp_se": 100 * 0.5 / math.sqrt(mse) * math.sqrt(np.var(dp**2) / (m - 1)),
            "same_top_pct": 100 * f, "same_top_pct_se": 100 * math.sqrt(f * (1 - f) / (n - 1))}


@pytest.fixture
def setup():
    ref = TableLM(0)
    model = perturbed(ref, 1)
    windows = torch.randint(0, VOCAB, (WINDOWS, SEQ), generator=torch.Generator().manual_seed(2))
    return ref, model, windows


@pytest.mark.parametrize("batch_size,chunk", [(1, 128), (4, 5), (6, 7)])
def test_kl_stats_match_brute_force(setup, batch_size, chunk):
    """Every column vs the float64 brute force, through batches and chunks that cut windows and positions."""
    ref, model, windows = setup
    out = perplexity(model, windows, ref, progress=False, batch_size=batch_size, chunk=chunk)
    want = brute_force(ref, model, windows)
    assert NEW_KEYS <= set(out)
    for key, value in want.items():
        assert out[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key
    assert out["same_top_pct"] == pytest.approx(100 * out["top1_agree"], rel=1e-12)  # the same positions
    assert 0 < out["same_top_pct"] < 100 and out["kld_mean_se"] > 0  # a non-degenerate test


def test_kl_stats_stored_logprobs_and_kl_windows(setup):
    """Stored reference log-probs and kl_windows < windows: the statistics cover the KL windows only."""
    ref, model, windows = setup
    want = brute_force(ref, model, windows[:4])
    for reference, kw in [(reference_logprobs(ref, windows[:4], progress=False), {}), (ref, {"kl_windows": 4})]:
        out = perplexity(model, windows, reference, progress=False, batch_size=3, chunk=8, **kw)
        assert out["kl_tokens"] == 4 * SEQ
        for key, value in want.items():
            assert out[key] == pytest.approx(value, rel=RTOL, abs=ATOL), key


def test_kl_token_stats_pure():
    """kl_token_stats alone: odd/even medians, llama.cpp's n <= 10 rule for the standard errors, exact values."""
    kl = torch.tensor([0.3, 0.1, 0.2])
    out = kl_token_stats(kl, torch.tensor([True, False, True]), torch.tensor([0.1, -0.1]))
    assert out["kld_median"] == pytest.approx(0.2) and out["kld_max"] == pytest.approx(0.3)
    assert out["kld_p99"] == pytest.approx(0.2 + 0.98 * 0.1)  # 0.99 * (3 - 1) = 1.98: between 0.2 and 0.3
    assert out["kld_mean_se"] == 0.0 and out["rms_dp_se"] == 0.0  # count <= 10: llama.cpp reports 0
    assert out["rms_dp"] == pytest.approx(10.0) and out["same_top_pct"] == pytest.approx(200 / 3)
    assert out["same_top_pct_se"] == pytest.approx(100 * math.sqrt(2 / 9 / 2))
    even = kl_token_stats(torch.arange(12.0), torch.ones(12, dtype=torch.bool), torch.zeros(11))
    assert even["kld_median"] == 5.5 and even["kld_mean_se"] == pytest.approx(math.sqrt(np.var(np.arange(12.0)) / 11))
    assert even["rms_dp"] == 0.0 and even["rms_dp_se"] == 0.0 and even["same_top_pct_se"] == 0.0
    with pytest.raises(ValueError, match="at least one KL position"):
        kl_token_stats(torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0))


def _previous_batch_stats(model, ids, ref, n_kl, chunk):
    """The per-batch loop as it was before the per-token statistics (frozen copy): the existing code path."""
    b, t = ids.shape
    scorer = ppl_mod._Scorer(model, ids)
    device = scorer.states.device
    targets = ids[:, 1:].to(device)
    nll = torch.zeros(b, dtype=torch.float64, device=device)
    kl, agree = torch.zeros((), dtype=torch.float64, device=device), 0
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        logits = scorer.logits(c0, c1)
        lse = torch.logsumexp(logits, dim=-1)
        n = min(c1, t - 1) - c0
        if n > 0:
            target_logit = logits[:, :n].gather(-1, targets[:, c0:c0 + n, None])[..., 0]
            nll += (lse[:, :n] - target_logit).double().sum(1)
        if n_kl:
            logq = (logits[:n_kl] - lse[:n_kl, :, None])
            if isinstance(ref, ppl_mod._Scorer):
                r = ref.logits(c0, c1)[:n_kl]
                logp = r - torch.logsumexp(r, dim=-1, keepdim=True)
            else:
                logp = torch.stack([ref[i][c0:c1] for i in range(n_kl)]).to(device)
            kl += (logp.exp() * (logp - logq)).double().sum()
            agree += int((logq.argmax(-1) == logp.argmax(-1)).sum())
            del logp, logq
    return {"nll": nll.tolist(), "kl": float(kl), "agree": agree, "kl_tokens": n_kl * t}


@pytest.mark.parametrize("kl_windows,batch_size,chunk", [(None, 4, 5), (3, 2, 128), (0, 6, 7)])
def test_existing_keys_bit_for_bit(setup, monkeypatch, kl_windows, batch_size, chunk):
    """Each batch's NLL sums, KL sum, agreements and KL tokens are exactly (==) the previous loop's, and so are
    ppl, nll_mean, window_nll, kl_mean, top1_agree and kl_tokens built from them."""
    ref, model, windows = setup
    current, batches = ppl_mod._batch_stats, []

    def both(*args):
        out = current(*args)
        batches.append(({k: out[k] for k in ("nll", "kl", "agree", "kl_tokens")}, _previous_batch_stats(*args)))
        return out

    monkeypatch.setattr(ppl_mod, "_batch_stats", both)
    out = perplexity(model, windows, ref, progress=False, kl_windows=kl_windows, batch_size=batch_size, chunk=chunk)
    assert len(batches) == math.ceil(WINDOWS / batch_size)
    assert all(new == old for new, old in batches)
    window_nll = [x for _, old in batches for x in old["nll"]]
    assert out["window_nll"] == window_nll and out["nll_mean"] == sum(window_nll) / (WINDOWS * (SEQ - 1))
    assert out["ppl"] == math.exp(out["nll_mean"])
    kl, agree, tokens = 0.0, 0, 0
    for _, old in batches:
        kl, agree, tokens = kl + old["kl"], agree + old["agree"], tokens + old["kl_tokens"]
    if kl_windows == 0:
        assert not {"kl_mean", "top1_agree", "kl_tokens"} & set(out) and not NEW_KEYS & set(out)
    else:
        assert (out["kl_mean"], out["top1_agree"], out["kl_tokens"]) == (kl / tokens, agree / tokens, tokens)
        assert NEW_KEYS <= set(out)
