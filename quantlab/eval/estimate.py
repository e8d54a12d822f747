"""Predict a model's inference memory from its config alone: will it fit?

    est = estimate_memory("smollm2-135m", bits=4, group_size=64, seq_len=576, batch=8)
    print(format_estimate(est))            # breakdown table + fits / does not fit

Terms (bytes):
- weights: the decoder linears at `bits` (packed codes + scales + zero points per group, as
  the backend stores them) + everything kept in float: embeddings, lm_head when untied (tied:
  counted once), norms, biases;
- kv cache: layers x 2 x kv_heads x head_dim x seq_len x batch x bytes(kv dtype) (a sliding-window layer
  holds at most `sliding_window` tokens: transformers' cache keeps no more);
- activations: the transient tensors of one decoder layer at prefill, batch x seq_len x
  (2 hidden + 3 intermediate) x bytes, + last-position logits (batch x vocab, fp32) + with the
  simulated backend one dequantized weight matrix of the largest layer;
- overhead: the framework, a constant. CPU: measured on the 2-core Xeon this was developed on,
  310 MiB RSS once Python + torch + transformers + quantlab are imported, and 420-470 MiB once a
  model's modules and torchao's kernels are loaded too (RSS minus live tensors); 450 MiB is used.
  CUDA: the CUDA context, outside the caching allocator (~500 MiB; not in max_memory_allocated).
Only Llama-style decoders (q/k/v/o + gate/up/down) are modelled, Gemma-3 included (its four norms per
layer, q/k norms and sliding-window layers counted); others fail loudly.

Backend "onnxruntime" (backends/ort.py: float32 graph, CPU session) holds other things; each term was measured
on SmolLM2-135M (ONNX Runtime 1.32, glibc with a fixed mmap threshold, so freed tensors leave RSS at once) on a
2-core AMD EPYC with AVX2 only, and checked against every CPU kind's reports/smollm2_speed*.csv (tests/test_estimate):
- weights: the initializers in MatMulNBits' layout (ort_pack: codes over whole blocks + an fp32 scale and a
  packed zero point per block, symmetric too; per-channel layers cut into blocks of block_size_for) or fp32 for
  a layer MatMulNBits cannot take, + every float part, + a second copy of the embedding table when it is tied:
  constant folding turns the lm_head's Transpose(embedding) into a transposed initializer, while the embedding
  Gather reads the original through ORT's memory map of the external-data file (smaps: the 108 MiB table
  enters RSS as tokens are looked up: 85 MiB after one random 512-token prompt, 105 after eight). W8A8 layers
  (MatMulInteger: int8 codes + an fp32 scale per row) store less than the 8-bit blocks counted (6 MiB on
  SmolLM2, under 1% of its peak);
- kv cache: every layer keeps every token (the exported graph's cache is a plain DynamicCache);
- activations: the larger of prefill and decode. Prefill of seq_len tokens (the worst case: the whole context
  as one prompt): the PyTorch terms above + the attention scores, which the exported graph materializes
  (SDPA decomposed into QKᵀ, + mask, Softmax, IsNaN, Where: four fp32 and one bool (B, heads, T, T) tensors,
  17 B per score if all are alive at once): batch x heads x seq_len² x 17 B (measured 16.5 B: the second
  difference of the batch-8 prefill peak over T = 256, 384, 512, arena off; measured on the graph exported with
  transformers' SDPA, before backends/ort_attention's grouped attention, whose scores are QKᵀ, + mask and Softmax
  only: not re-measured yet, so this term may now be high). Decode: the present_* outputs
  are a second KV cache while the past_* inputs live;
- overhead: the framework constant above (the probe child imports torch and transformers too: 423 MiB
  measured) + ORT_OVERHEAD_MIB for the ONNX Runtime library (18 MiB RSS on import) and the session beyond
  its initializers (54 MiB fp32, 71 MiB int4 g64 accuracy_level 4: graph, kernels, packed weights' slack).
Not modelled: the slack of ORT's BFC arena (batch 8: +63 MiB at a 512-token prefill, +102 MiB, half a cache,
while decoding to 576 tokens); counting the scores at seq_len, not the shorter prompt, covers it on the report's
rows (all within 4%).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..backends.ort_pack import MATMUL_NBITS_BITS, block_size_for
from ..util.checks import check_choice, check_dtype, check_int, dtype_bytes

MIB, GIB = 2**20, 2**30
OVERHEAD_MIB = {"cpu": 450.0, "cuda": 500.0}
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "granite", "gemma3_text")
SANDWICH_NORMS = ("gemma3_text",)  # 4 norms of hidden per layer (pre/post attention and MLP) + q/k norms of head_dim
# Bytes per group of scale (+ zero) metadata, by backend: quantlab packs an fp16 scale (+ a uint8
# zero when asymmetric); torchao's int8 kernels keep an fp32 scale per channel, its int4 tinygemm
# kernels a bf16 scale + bf16 zero per group.
BACKENDS = ("simulated", "torchao", "onnxruntime")
ORT_OVERHEAD_MIB = 80.0  # ONNX Runtime library + session beyond its initializers (module doc: 18 + 54..71 MiB)
ORT_SCORE_BYTES = 17  # per (B, heads, T, T) score element at prefill: four fp32 tensors and one bool (module doc)


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    bits: int | None
    group_size: int | None
    seq_len: int
    batch: int
    dtype: str
    backend: str
    quant_params: int
    float_params: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    device_memory_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_bytes is None else self.total_bytes <= self.device_memory_bytes

    def to_row(self) -> dict:
        d = asdict(self)
        return d | {"total_bytes": self.total_bytes, "est_total_mib": self.total_bytes / MIB, "fits": self.fits}


def _cfg(config, name: str, default=None):
    value = getattr(config, name, default)
    if value is None:
        raise ValueError(f"model config ({getattr(config, 'model_type', '?')}) has no {name!r}; cannot estimate")
    return value


def _shapes(config) -> tuple[list[tuple[int, int]], int]:
    """(out, in) of every decoder linear, and the float parameter count outside them."""
    if getattr(config, "model_type", None) not in LLAMA_LIKE:
        raise ValueError(f"estimate: unsupported model_type {getattr(config, 'model_type', None)!r}; "
                         f"known: {', '.join(LLAMA_LIKE)}")
    h, inter, n_layers = _cfg(config, "hidden_size"), _cfg(config, "intermediate_size"), _cfg(config, "num_hidden_layers")
    heads = _cfg(config, "num_attention_heads")
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    vocab = _cfg(config, "vocab_size")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    bias = (heads * hd + 2 * kv * hd) if getattr(config, "attention_bias", False) else 0
    norms = 4 * h + 2 * hd if config.model_type in SANDWICH_NORMS else 2 * h
    floats = vocab * h * (1 if tied else 2) + n_layers * (norms + bias) + h  # embeddings (+ lm_head), norms, biases
    return layer * n_layers, floats


def _kv_tokens(config, seq_len: int) -> int:
    """Cached tokens summed over layers: a sliding-window layer (config.layer_types) keeps at most sliding_window."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or seq_len
    return sum(min(seq_len, window) if kind == "sliding_attention" else seq_len for kind in kinds)


def _layer_bytes(out_f: int, in_f: int, bits: int, group_size: int | None, symmetric: bool, backend: str) -> int:
    groups = out_f * (1 if group_size is None else math.ceil(in_f / group_size))
    codes = math.ceil(out_f * in_f * bits / 8)
    if backend == "torchao" and bits == 8:
        return codes + out_f * 4
    if backend == "torchao" and bits == 4:
        return codes + groups * 4
    return codes + groups * (2 + (0 if symmetric else 1))


def _ort_layer_bytes(out_f: int, in_f: int, bits: int | None, group_size: int | None) -> int:
    """One linear as the ORT export stores it: MatMulNBits blocks (ort_pack.pack_matmul_nbits), else fp32."""
    block = block_size_for(group_size, in_f) if bits in MATMUL_NBITS_BITS else None
    if block is None:  # float model, or a layer MatMulNBits cannot take: an fp32 MatMul
        return out_f * in_f * 4
    k_blocks = math.ceil(in_f / block)
    return out_f * (k_blocks * block * bits // 8 + k_blocks * 4 + math.ceil(k_blocks * bits / 8))


def _ort_terms(config, linears, float_params: int, bits, group_size, seq_len: int, batch: int) -> tuple:
    """(weights, kv cache, activations, overhead MiB) of backend "onnxruntime", float32 (module doc)."""
    h, heads, vocab = config.hidden_size, config.num_attention_heads, config.vocab_size
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = (sum(_ort_layer_bytes(o, i, bits, group_size) for o, i in linears)
               + (float_params + (vocab * h if tied else 0)) * 4)  # tied: the lm_head's transposed copy
    kv_bytes = config.num_hidden_layers * seq_len * 2 * kv * hd * batch * 4
    prefill = (batch * seq_len * (2 * h + 3 * config.intermediate_size) * 4 + batch * vocab * 4
               + batch * heads * seq_len**2 * ORT_SCORE_BYTES)
    return weights, kv_bytes, max(prefill, kv_bytes), OVERHEAD_MIB["cpu"] + ORT_OVERHEAD_MIB


def load_config(model: str, cache_dir=None):
    """The model's Hugging Face config only: no weights are loaded or converted (models.loading.load_model_config)."""
    from ..models.loading import ALIASES, load_model_config

    try:
        return load_model_config(model, cache_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"unknown model {model!r}: no local config and not reachable on the hub "
                         f"({e.__class__.__name__}); built-in aliases: {', '.join(ALIASES)}") from None


def estimate_memory(
    model, bits: int | None = None, group_size: int | None = None, seq_len: int = 2048, batch: int = 1,
    dtype: str = "float32", symmetric: bool = True, backend: str = "simulated", device: str = "cpu",
    device_memory_gib: float | None = None, overhead_mib: float | None = None, cache_dir=None,
) -> MemoryEstimate:
    """Estimate inference memory of `model` (alias, path, hub id or a config object).

    bits None (or >= 16) keeps the linears in `dtype`. seq_len counts prompt + generated tokens.
    backend: how the weights are stored and run (simulated, torchao, onnxruntime: see the module doc).

    >>> estimate_memory("smollm2-135m", bits=4, group_size=64, seq_len=576, batch=8).total_bytes
    >>> estimate_memory("smollm2-135m", bits=4, group_size=64, seq_len=576, batch=8, backend="onnxruntime")
    """
    if bits is not None and bits < 16:
        check_int("bits", bits, 2)
        if bits > 8:
            raise ValueError(f"bits must be 2..8 (quantized) or 16/32/None (float), got {bits}")
    check_int("seq_len", seq_len, 1)
    check_int("batch", batch, 1)
    if group_size is not None:
        check_int("group_size", group_size, 1)
    check_dtype("dtype", dtype)
    check_choice("backend", backend, BACKENDS)
    check_choice("device", device, OVERHEAD_MIB)
    if backend == "onnxruntime" and (device, dtype) != ("cpu", "float32"):
        raise ValueError(f"backend 'onnxruntime' runs float32 graphs on the CPU (backends/ort.py); got device "
                         f"{device!r}, dtype {dtype!r}: use device 'cpu', dtype 'float32'")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise ValueError(f"device memory must be > 0 GiB, got {device_memory_gib!r}")
    config = load_config(model, cache_dir) if isinstance(model, str) else model
    linears, float_params = _shapes(config)
    fb = dtype_bytes(dtype)
    quant = bits is not None and bits < 16
    quant_params = sum(o * i for o, i in linears)
    linear_bytes = (sum(_layer_bytes(o, i, bits, group_size, symmetric, backend) for o, i in linears)
                    if quant else quant_params * fb)
    h, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    kv_bytes = _kv_tokens(config, seq_len) * 2 * kv * hd * batch * fb
    act = batch * seq_len * (2 * h + 3 * inter) * fb + batch * config.vocab_size * 4
    if quant and backend == "simulated":  # one weight dequantized on the fly (+ its unpacked uint8 codes)
        act += max(o * i for o, i in linears) * (fb + 1)
    weights, overhead = linear_bytes + float_params * fb, OVERHEAD_MIB[device]
    if backend == "onnxruntime":
        weights, kv_bytes, act, overhead = _ort_terms(config, linears, float_params, bits if quant else None,
                                                      group_size, seq_len, batch)
    overhead = overhead if overhead_mib is None else overhead_mib
    return MemoryEstimate(
        model=model if isinstance(model, str) else getattr(config, "name_or_path", "config"),
        bits=bits if quant else None, group_size=group_size if quant else None, seq_len=seq_len, batch=batch,
        dtype=dtype, backend=backend, quant_params=quant_params, float_params=float_params,
        weights_bytes=weights, kv_cache_bytes=kv_bytes, activation_bytes=act,
        overhead_bytes=int(overhead * MIB),
        device_memory_bytes=None if device_memory_gib is None else int(device_memory_gib * GIB),
    )


def format_estimate(est: MemoryEstimate) -> str:
    """A breakdown table (MiB) and the verdict."""
    prec = "float" if est.bits is None else f"w{est.bits} " + ("channel" if est.group_size is None else f"g{est.group_size}")
    lines = [f"{est.model}: {prec}, {est.dtype} float parts, backend {est.backend}, "
             f"seq_len {est.seq_len}, batch {est.batch}",
             f"  {'part':<12}{'MiB':>12}"]
    for name, b in (("weights", est.weights_bytes), ("kv cache", est.kv_cache_bytes),
                    ("activations", est.activation_bytes), ("overhead", est.overhead_bytes),
                    ("total", est.total_bytes)):
        lines.append(f"  {name:<12}{b / MIB:>12.1f}")
    if est.device_memory_bytes is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(f"  {verdict} in {est.device_memory_bytes / GIB:.2f} GiB "
                     f"({100 * est.total_bytes / est.device_memory_bytes:.1f}% used)")
    return "\n".join(lines)


@dataclass(frozen=True)
class CalibrationEstimate:
    """What block-by-block calibration holds at its peak (bytes): the float model, the copy being quantized (all of
    it, or streamed: what lies outside the decoder blocks, calibration/streaming.py), the calibration windows' hidden
    states at one block boundary (inputs and outputs, float and quantized streams), the largest block's Hessians
    (one per distinct input: q/k/v share one, gate/up share one), its attention scores for one window and its
    weights twice. An upper-side estimate: methods that keep less (RTN-based AWQ stats) fit under it."""

    model_bytes: int
    copy_bytes: int
    hidden_state_bytes: int
    block_bytes: int
    largest_block: str

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.copy_bytes + self.hidden_state_bytes + self.block_bytes


def estimate_calibration(config, num_samples: int, seq_len: int, dtype: str = "float32",
                         streamed: bool = False) -> CalibrationEstimate:
    """The peak of calibrating `config`'s model on num_samples windows of seq_len tokens (CalibrationEstimate);
    streamed: the run's copy shares the decoder blocks (calibration/streaming.py).

    >>> estimate_calibration(load_config("smollm2-135m"), 32, 512).total_bytes / GIB   # about 1.3
    """
    linears, floats = _shapes(config)
    fb = dtype_bytes(check_dtype("dtype", dtype))
    model_bytes = (sum(o * i for o, i in linears) + floats) * fb
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // heads
    tokens = num_samples * seq_len
    hidden = 4 * tokens * h * 4  # fp32 block inputs and outputs, float and quantized streams
    inputs = {"q/k/v input": h, "o_proj input": heads * hd, "gate/up input": h, "down_proj input": inter}
    hessians = sum(n * n * 4 for n in inputs.values())
    scores = heads * seq_len * seq_len * 4 * 2  # one window's attention probabilities and their softmax input
    block_weights = sum(o * i for o, i in linears[:7]) * 4 * 2  # the block's fp32 weights and a working copy
    block = hessians + scores + block_weights
    widest = max(inputs, key=inputs.get)
    largest = (f"one decoder block: {sum(o * i for o, i in linears[:7]) / 1e6:.1f}M weights, Hessians "
               f"{hessians / MIB:.0f} MiB (the widest input is {widest}, {inputs[widest]})")
    return CalibrationEstimate(model_bytes, floats * fb if streamed else model_bytes, hidden, block, largest)
