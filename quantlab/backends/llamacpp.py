"""llama.cpp (llama-cpp-python) as an evaluation backend: a GGUF file's logits and decode speed.

    lm = LlamaCppCausalLM("model.gguf", threads=8, n_ctx=512)
    lm(ids).logits                                   # (B, T, V) fp32, every window from an empty KV cache
    perplexity(lm, windows)                          # quantlab's harness, llama.cpp's numbers
    measure_llamacpp_latency("model.gguf", 128, 32, batch_sizes=(1, 8), threads=8)[8]["decode_ms_per_token_p50"]

The low-level C API (llama_decode on a llama_batch) is used, not llama_cpp.Llama: each window is one batch with
logits requested on every position (llama-perplexity's way), the KV cache is cleared before each window, and
batched decoding runs several sequences (seq ids 0..B-1) through one llama_batch per step, which Llama does not.
Numerics are llama.cpp's own: quantized matmuls quantize activations to 8 bits (Q8_0 / Q8_K), the KV cache is
F16, flash attention is llama.cpp's default ("auto"); so logits are close to, not equal to, a float model of the
same GGUF.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import statistics
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

BACKEND = "llama.cpp"
DEFAULT_UBATCH = 512  # llama.cpp's default physical batch
_state = {"backend_ready": False}


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require_llamacpp() -> None:
    if not llamacpp_available():
        raise ImportError("backend 'llama.cpp' needs llama-cpp-python: pip install 'quantlab[llamacpp]' (bash "
                          "scripts/setup.sh builds it portable, CMAKE_ARGS=\"-DGGML_NATIVE=OFF\")")


def _lib():
    require_llamacpp()
    import llama_cpp

    if not _state["backend_ready"]:
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below this level
        llama_cpp.llama_backend_init()
        _state["backend_ready"] = True
    return llama_cpp


def llamacpp_cpu_features() -> str:
    """The CPU features this llama.cpp build uses, e.g. "AVX AVX2 F16C FMA ..." (from llama_print_system_info)."""
    info = _lib().llama_print_system_info().decode()
    return " ".join(k.strip() for part in info.split("|") if part.count("=") == 1
                    for k, v in [part.split(":")[-1].split("=")] if v.strip() == "1")


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp (weights only, CPU); contexts are made from it. Freed with the object."""

    def __init__(self, path: str | Path):
        lib = _lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"backend 'llama.cpp': no GGUF file at {self.path}")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp {lib.__version__} cannot load {self.path} (an architecture or tensor type "
                               f"this build does not know?)")
        self._finalizer = weakref.finalize(self, lib.llama_model_free, self.ptr)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.ptr))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = _lib().llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def config(self) -> SimpleNamespace:
        """The model facts the harness reads (HF names), from the GGUF header."""
        lib = _lib()
        return SimpleNamespace(
            model_type=self.meta("general.architecture"), vocab_size=self.n_vocab,
            hidden_size=lib.llama_model_n_embd(self.ptr), num_hidden_layers=lib.llama_model_n_layer(self.ptr),
            num_attention_heads=lib.llama_model_n_head(self.ptr),
            num_key_value_heads=lib.llama_model_n_head_kv(self.ptr),
            max_position_embeddings=lib.llama_model_n_ctx_train(self.ptr), gguf_file=self.path.name)


class LlamaCppContext:
    """A llama.cpp context (KV cache for n_seq_max sequences of n_ctx / n_seq_max tokens each) and one llama_batch
    of n_batch tokens; decode() runs one batch and returns the requested logits."""

    def __init__(self, model: LlamaCppModel, n_ctx: int, n_batch: int, n_seq_max: int = 1, threads: int | None = None,
                 flash_attn: bool | None = None):
        lib = _lib()
        self.model, self.threads = model, threads or torch.get_num_threads()
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, DEFAULT_UBATCH)
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq_max, self.threads, self.threads
        params.no_perf = True
        if flash_attn is not None:
            params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ptr = lib.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp cannot make a context (n_ctx={n_ctx}, n_batch={n_batch}, "
                               f"n_seq_max={n_seq_max}) for {model.path}")
        self.n_ctx, self.n_batch, self.n_seq_max = lib.llama_n_ctx(self.ptr), n_batch, n_seq_max
        self.batch = lib.llama_batch_init(n_batch, 0, n_seq_max)
        self._finalizer = weakref.finalize(self, _free_context, lib, self.ptr, self.batch, model)
        self.memory = lib.llama_get_memory(self.ptr)
        # numpy views of the batch's arrays; seq_id is an array of pointers, one per token
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self.n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))
        self.want = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))

    def clear(self) -> None:
        """Empty the KV cache (every sequence)."""
        _lib().llama_memory_clear(self.memory, True)

    def decode(self, tokens, pos, seq, want) -> np.ndarray:
        """One llama_decode of n tokens: token ids, positions, sequence ids and which get logits (n,) each.
        Returns the logits (sum(want), V) fp32, in batch order (a copy)."""
        lib, n = _lib(), len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens do not fit the llama_batch of {self.n_batch}")
        self.tokens[:n], self.pos[:n], self.n_seq_id[:n], self.want[:n] = tokens, pos, 1, want
        for i, s in enumerate(seq):
            self.batch.seq_id[i][0] = int(s)
        self.batch.n_tokens = n
        rc = lib.llama_decode(self.ptr, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({n} tokens, context n_ctx={self.n_ctx}, "
                               f"n_seq_max={self.n_seq_max}): 1 = no KV-cache slot, < 0 = error")
        n_out = int(np.count_nonzero(want))
        if not n_out:
            return np.zeros((0, self.model.n_vocab), np.float32)
        return np.ctypeslib.as_array(lib.llama_get_logits(self.ptr), shape=(n_out, self.model.n_vocab)).copy()


def _free_context(lib, ctx, batch, model) -> None:  # model: kept alive until its contexts are freed
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


def _pad(n: int, to: int = 256) -> int:
    return -(-n // to) * to


class LlamaCppCausalLM(nn.Module):
    """A GGUF file run by llama.cpp behind the slice of the HF causal-LM interface quantlab's perplexity harness
    uses: model(ids).logits, fp32 (B, T, V). Each row of ids is one window decoded in one llama_batch from an
    empty KV cache with logits on every position (or the last logits_to_keep); rows run one after another.
    No KV cache across calls (use measure_llamacpp_latency for decoding speed).

    >>> lm = LlamaCppCausalLM(alias_gguf_path("smollm2-135m"), threads=2, n_ctx=512)
    >>> perplexity(lm, windows)["ppl"]
    """

    def __init__(self, path: str | Path, threads: int | None = None, n_ctx: int = 512, config=None,
                 flash_attn: bool | None = None):
        super().__init__()
        self.gguf = LlamaCppModel(path)
        self.context = LlamaCppContext(self.gguf, _pad(n_ctx), n_ctx, 1, threads, flash_attn)
        self.n_ctx, self.threads = n_ctx, self.context.threads
        self.config = config if config is not None else self.gguf.config()
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)  # device / dtype for the harness

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False,
                past_key_values=None, logits_to_keep: int = 0, **_):
        if use_cache or past_key_values is not None:
            raise ValueError("LlamaCppCausalLM scores whole windows (use_cache=False); decoding speed: "
                             "measure_llamacpp_latency")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("LlamaCppCausalLM takes unpadded windows (an attention_mask of ones or None)")
        t = input_ids.shape[1]
        if t > self.n_ctx:
            raise ValueError(f"window of {t} tokens > n_ctx={self.n_ctx}; make LlamaCppCausalLM(..., n_ctx={t})")
        keep = t if not logits_to_keep else min(logits_to_keep, t)
        want = np.arange(t) >= t - keep
        ids = input_ids.cpu().numpy().astype(np.int32)
        rows = []
        for row in ids:
            self.context.clear()
            rows.append(self.context.decode(row, np.arange(t), np.zeros(t, np.int32), want))
        return SimpleNamespace(logits=torch.from_numpy(np.stack(rows)), past_key_values=None)  # (B, keep, V)


def timed_pass(ctx: LlamaCppContext, prompts: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
    """Prefill B prompts (B, N) as B sequences in one llama_batch (logits at each last token), then new_tokens
    greedy steps of one llama_batch of B tokens; ms of the prefill and of each step (argmax included)."""
    b, n = prompts.shape
    ctx.clear()
    want = np.tile(np.arange(n) == n - 1, b)
    t0 = time.perf_counter()
    logits = ctx.decode(prompts.reshape(-1), np.tile(np.arange(n), b), np.repeat(np.arange(b), n), want)
    nxt = logits.argmax(-1)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    steps, seqs, ones = [], np.arange(b), np.ones(b, bool)
    for s in range(new_tokens):
        t0 = time.perf_counter()
        nxt = ctx.decode(nxt, np.full(b, n + s), seqs, ones).argmax(-1)
        steps.append((time.perf_counter() - t0) * 1e3)
    return prefill_ms, steps


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90))  # linear interpolation, as eval/latency.py's percentile


def measure_llamacpp_latency(path: str | Path, prompt_len: int = 128, new_tokens: int = 32,
                             batch_sizes: tuple[int, ...] = (1, 8), threads: int | None = None, warmup: int = 1,
                             repeats: int = 3, seed: int = 0, flash_attn: bool | None = None) -> dict[int, dict]:
    """llama.cpp prefill and greedy decode latency of a GGUF file: {batch_size: row}.

    Batch B: B seeded random prompts of prompt_len tokens prefilled as B sequences in one llama_batch, then
    new_tokens steps each decoding one token of every sequence in one llama_batch (a context with n_seq_max=B).
    `warmup` untimed passes, then `repeats` timed ones, each from an empty KV cache. Row columns as
    eval/latency.measure_latency's (prefill_* over the B x prompt_len prefill; decode_ms_per_token_* per step, so
    per token of each sequence; decode_tokens_per_s = B tokens per step), plus backend, gguf_file,
    llamacpp_version, llamacpp_cpu_features, llamacpp_flash_attn, seed. cpu_threads: llama.cpp's threads.

    >>> measure_llamacpp_latency("model.gguf", 128, 32, (1, 8), threads=8)[1]["decode_ms_per_token_p50"]
    """
    if repeats < 1 or warmup < 0 or new_tokens < 1 or prompt_len < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, new_tokens >= 1, prompt_len >= 1; got {repeats}, "
                         f"{warmup}, {new_tokens}, {prompt_len}")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be integers >= 1, got {batch_sizes!r}")
    lib, model = _lib(), LlamaCppModel(path)
    prompts = np.random.default_rng(seed).integers(0, model.n_vocab, (max(batch_sizes), prompt_len), dtype=np.int32)
    rows = {}
    for b in batch_sizes:
        ctx = LlamaCppContext(model, b * _pad(prompt_len + new_tokens), b * prompt_len, b, threads, flash_attn)
        for _ in range(warmup):
            timed_pass(ctx, prompts[:b], min(new_tokens, 4))
        prefill, steps = [], []
        for _ in range(repeats):
            p, s = timed_pass(ctx, prompts[:b], new_tokens)
            prefill.append(p)
            steps += s
        decode_p50 = statistics.median(steps)
        rows[b] = {
            "prefill_tokens": prompt_len, "batch_size": b, "prefill_ms_p50": statistics.median(prefill),
            "prefill_ms_p90": _p90(prefill), "prefill_tokens_per_s": 1e3 * b * prompt_len / statistics.median(prefill),
            "latency_repeats": repeats, "cpu_threads": ctx.threads, "decode_tokens": new_tokens,
            "decode_tokens_generated": new_tokens, "decode_ms_per_token_p50": decode_p50,
            "decode_ms_per_token_p90": _p90(steps), "decode_tokens_per_s": 1e3 * b / decode_p50,
            "backend": BACKEND, "gguf_file": model.path.name, "llamacpp_version": lib.__version__,
            "llamacpp_cpu_features": llamacpp_cpu_features(), "llamacpp_flash_attn": _flash_name(flash_attn),
            "seed": seed,
        }
        del ctx
    return rows


def _flash_name(flash_attn: bool | None) -> str:
    return "auto" if flash_attn is None else ("on" if flash_attn else "off")


__all__ = ["BACKEND", "LlamaCppCausalLM", "LlamaCppContext", "LlamaCppModel", "llamacpp_available",
           "llamacpp_cpu_features", "measure_llamacpp_latency", "require_llamacpp"]
