"""llama.cpp as an evaluation backend (backends/llamacpp.py): the missing-extra error, real quantized GGUF files that
load and decode (a crash on decode of Q4 / Q8 types is how a non-portable build fails on AMX machines), and logits
and perplexity against quantlab's own torch model of the same GGUF (load_model dequantizes it).

Measured (AMD EPYC, AVX2 build with GGML_NATIVE=OFF, llama-cpp-python 0.3.36, 1 thread), SmolLM2-135M Q4_1 on the
first two WikiText-2 test windows of 128 tokens vs the torch model: relative RMS of the logits 2.8e-2 / 2.7e-2,
max |Δlogit| 1.68 / 1.67 (max |logit| ~36), top-1 agreement 96.9% / 94.5%; ppl 46.470 vs 46.287 (+0.40%), KL 0.0033
nats. The same file rewritten as an F32 GGUF gives a relative RMS of 3.3e-4 (its F16 KV cache): the networks are the
same, the gap is llama.cpp's 8-bit activations in its quantized dot products. Tolerances: about twice the measured.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from ci_policy import missing

import quantlab
from quantlab.backends.llamacpp import LlamaCppCausalLM, llamacpp_available, measure_llamacpp_latency, require_llamacpp
from quantlab.eval.perplexity import perplexity
from quantlab.models.data import eval_windows, load_token_ids
from quantlab.models.loading import alias_gguf_path

SEQ = 128
LOGITS_REL_RMS, LOGITS_MAX_ABS, TOP1_MIN = 0.06, 3.5, 0.90  # measured 0.028, 1.68, 0.969 (window 0)
PPL_RTOL, KL_MAX = 0.03, 0.01  # measured +0.40% and 0.0033 nats (two windows; +0.84% and 0.0036 over four)
STEP_REL_RMS = 0.15  # token-by-token vs whole-window logits: measured 0 (SmolLM2), <= 0.063 (Gemma-3: other kernels)


def _need_llamacpp() -> None:
    if not llamacpp_available():
        missing("llama-cpp-python (the llamacpp extra)", "pip install 'quantlab[llamacpp]' (bash scripts/setup.sh "
                                                        "builds it with CMAKE_ARGS=-DGGML_NATIVE=OFF)")


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_missing_extra_names_it(monkeypatch):
    """Without llama-cpp-python: an ImportError naming the extra and the setup script, before any file is read."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec -> None: as if not installed
    assert not llamacpp_available()
    for call in (require_llamacpp, lambda: LlamaCppCausalLM("no-such.gguf")):
        with pytest.raises(ImportError, match=r"quantlab\[llamacpp\].*scripts/setup.sh"):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("alias", [
    pytest.param("smollm2-135m", marks=pytest.mark.needs_model("smollm2-135m")),  # Q4_1 linears, Q8_0 embedding
    pytest.param("gemma3-270m", marks=pytest.mark.needs_model("gemma3-270m")),  # Q4_K / Q5_0 / Q6_K / Q8_0
])
def test_quantized_gguf_decodes(alias):
    """Greedy decoding token by token on the KV cache agrees with whole-window logits; batched decoding of two
    sequences in one llama_batch per step (measure_llamacpp_latency) runs and fills its row."""
    _need_llamacpp()
    lm = LlamaCppCausalLM(alias_gguf_path(alias), threads=1, n_ctx=64)
    ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    ctx = lm.context
    ctx.clear()
    steps = [ctx.decode(np.array(ids), np.arange(16), np.zeros(16, np.int32), np.arange(16) == 15)[0]]
    for _ in range(4):
        ids.append(int(steps[-1].argmax()))
        steps.append(ctx.decode(np.array(ids[-1:]), np.array([len(ids) - 1]), np.array([0]), np.array([True]))[0])
    stepped = torch.from_numpy(np.stack(steps[:-1]))  # (4, V): logits that chose each new token
    window = lm(torch.tensor([ids])).logits[0, 15:19]
    assert torch.isfinite(stepped).all() and stepped.shape == (4, lm.config.vocab_size)
    assert _rel_rms(stepped, window) <= STEP_REL_RMS
    rows = measure_llamacpp_latency(alias_gguf_path(alias), 8, 3, batch_sizes=(1, 2), threads=1, warmup=0, repeats=1)
    assert sorted(rows) == [1, 2]
    for b, row in rows.items():
        assert row["batch_size"] == b and row["cpu_threads"] == 1 and row["backend"] == "llama.cpp"
        assert row["prefill_ms_p50"] > 0 and row["decode_ms_per_token_p50"] > 0 and row["decode_tokens_generated"] == 3


@pytest.fixture(scope="module")
def smollm2(wikitext_dir):
    """quantlab's torch model of the SmolLM2 GGUF, two WikiText-2 test windows, its logits on them (2, T, V) and
    llama.cpp on the same file."""
    _need_llamacpp()
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    windows = eval_windows(ids, SEQ, max_windows=2)
    with torch.inference_mode():
        ref = model(windows, use_cache=False).logits.float()
    return model, windows, ref, LlamaCppCausalLM(alias_gguf_path("smollm2-135m"), threads=1, n_ctx=SEQ)


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_logits_close_to_torch_model(smollm2):
    _, windows, ref, lm = smollm2
    ref = ref[:1]
    got = lm(windows[:1]).logits
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert _rel_rms(got, ref) <= LOGITS_REL_RMS
    assert (got - ref).abs().max().item() <= LOGITS_MAX_ABS
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= TOP1_MIN


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_perplexity_close_to_torch_model(smollm2):
    """quantlab's harness on LlamaCppCausalLM: ppl within PPL_RTOL of the torch model's, and the KL columns (the
    torch model's log-probs as the reference) small."""
    model, windows, ref, lm = smollm2
    want = perplexity(model, windows, progress=False, batch_size=2)
    got = perplexity(lm, windows, list(torch.log_softmax(ref, -1)), progress=False, batch_size=2)
    assert math.isfinite(got["ppl"]) and got["ppl"] == pytest.approx(want["ppl"], rel=PPL_RTOL)
    assert got["kl_mean"] <= KL_MAX and got["same_top_pct"] >= 100 * TOP1_MIN
