"""The memory-bandwidth floor of decoding: main-memory read bandwidth, and the weight bytes one decode step reads.

    bw = measure_dram_bandwidth()                       # {"dram_bandwidth_gbs": 22.4, "dram_bandwidth_method": ...}
    read = decode_weight_bytes(model)                   # {"decode_weight_bytes": ..., "decode_head_bytes": ...}
    floor_ms = read["decode_weight_bytes"] / (bw["dram_bandwidth_gbs"] * 1e9) * 1e3

A decode step of a batch-1 dense model reads every weight once, so no implementation can decode faster than
weight bytes / bandwidth (unless the weights fit a cache). Bytes are the configuration's real storage: a
torch model's tensors (quantized codes + scales + zeros as stored), an ONNX graph's initializers, a GGUF file's
tensors. The token embedding is a lookup (one row per token); the output head reads all of its table; a tied head
and embedding are one table, counted once (as the head). At batch B a step reads the weights once for B tokens.
Not counted here: the KV cache, which a step reads too (kv_read_bytes: the caller adds it where wanted).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

from .memory import unique_tensor_bytes

MIB = 2**20


def last_level_cache_bytes(sysfs: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest CPU cache of cpu0 in bytes (Linux sysfs), or None where sysfs does not say."""
    sizes = []
    for index in Path(sysfs).glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def measure_dram_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict:
    """Main-memory read bandwidth: torch.sum over a float32 array far larger than the last-level cache, with
    torch's current thread count (the benchmark's); one untimed pass, then `repeats` timed ones.

    nbytes: the array's size (default max(256 MiB, 8 x the last-level cache)); it is rounded down to whole
    float32 elements. GB/s = array bytes / time of the fastest pass / 1e9 (the floor is a lower bound, so the
    fastest the memory was seen to go); the median pass is reported too.

    >>> measure_dram_bandwidth()["dram_bandwidth_gbs"]   # 22.4 on a 2-core AMD EPYC VM, 1 thread
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    llc = last_level_cache_bytes()
    if nbytes is None:
        nbytes = max(256 * MIB, 8 * (llc or 0))
    if nbytes < 4:
        raise ValueError(f"nbytes must be >= 4 (one float32), got {nbytes}")
    x = torch.ones(nbytes // 4, dtype=torch.float32)  # (N,); ones, so every page is really mapped
    x.sum()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - t0)
    array_bytes = x.numel() * x.element_size()
    llc_text = f"{llc / MIB:.0f} MiB last-level cache" if llc else "last-level cache size unknown"
    return {
        "dram_bandwidth_gbs": array_bytes / min(seconds) / 1e9,
        "dram_bandwidth_gbs_median": array_bytes / statistics.median(seconds) / 1e9,
        "dram_bandwidth_bytes": array_bytes,
        "dram_bandwidth_best_s": min(seconds),
        "dram_bandwidth_method": (f"torch.sum over a float32 array of {array_bytes / MIB:.0f} MiB ({llc_text}), "
                                  f"fastest of {repeats} passes, {torch.get_num_threads()} thread(s)"),
    }


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's own parameters and the buffers a state dict holds (not derived ones such as rotary inv_freq)."""
    params = [p for p in module._parameters.values() if p is not None]
    buffers = [b for name, b in module._buffers.items()
               if b is not None and name not in module._non_persistent_buffers_set]
    return params + buffers


def _module_bytes(module: nn.Module, seen: set) -> int:
    """Bytes of a module's own weights: storage_bytes() (codes + scales + zeros, as quantized layers and torchao
    kernels report it) plus its bias, else its own tensors; a tensor already counted (tied) is skipped."""
    if hasattr(module, "storage_bytes"):
        bias = getattr(module, "bias", None)
        return module.storage_bytes() + (bias.nbytes if isinstance(bias, torch.Tensor) else 0)
    return unique_tensor_bytes(_own_tensors(module), seen)


def decode_weight_bytes(model: nn.Module) -> dict:
    """Weight bytes one decode step of a torch causal LM reads: every layer's weights as stored, the output head
    whole, one row of the input embedding (none when the head is the embedding: counted once, as the head).

    >>> decode_weight_bytes(model)["decode_weight_bytes"] / 2**20    # SmolLM2-135M fp32: 513 MiB
    """
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    seen: set = set()
    head_bytes = _module_bytes(head, seen) if head is not None else 0
    total = head_bytes
    for module in model.modules():
        if module is head:
            continue
        if module is emb:
            if not tied:  # a lookup reads one row of the table
                total += _module_bytes(emb, set()) // emb.num_embeddings
            continue
        total += _module_bytes(module, seen)
    return {"decode_weight_bytes": total, "decode_head_bytes": head_bytes}


def _table_split(sizes: dict[str, int], tables: list[str], embedding_rows: int, where: str) -> dict:
    """Bytes per step from tensor sizes and the (vocab x hidden) tables among them: one table = a tied head, read
    whole; two = an embedding (the one named *embed*/token_embd, one row read) and a head (read whole)."""
    if len(tables) == 1:
        return {"decode_weight_bytes": sum(sizes.values()), "decode_head_bytes": sizes[tables[0]]}
    embedding = [n for n in tables if "embed" in n or n.startswith("token_embd")]
    if len(tables) != 2 or len(embedding) != 1:
        raise ValueError(f"{where}: cannot tell the embedding from the head among the vocabulary tables {tables}")
    head = next(n for n in tables if n != embedding[0])
    total = sum(sizes.values()) - sizes[embedding[0]] + sizes[embedding[0]] // embedding_rows
    return {"decode_weight_bytes": total, "decode_head_bytes": sizes[head]}


def onnx_decode_weight_bytes(path: str | Path, vocab_size: int, hidden_size: int) -> dict:
    """decode_weight_bytes of an exported ONNX graph: its initializers (MatMulNBits' packed codes, scales and zero
    points as ORT stores them; the tables of vocab_size x hidden_size split as in the module doc). Reads the graph
    only, not its external data. A quantized head (no float table for it) is not told apart."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(path), load_external_data=False).graph
    sizes, tables = {}, []
    for init in graph.initializer:
        numel = 1
        for d in init.dims:
            numel *= int(d)
        sizes[init.name] = numel * tensor_dtype_to_np_dtype(init.data_type).itemsize
        if sorted(int(d) for d in init.dims) == sorted((vocab_size, hidden_size)):
            tables.append(init.name)
    if not tables:
        raise ValueError(f"{path}: no {vocab_size} x {hidden_size} initializer (embedding / head) found")
    return _table_split(sizes, tables, vocab_size, str(path))


def gguf_decode_weight_bytes(path: str | Path) -> dict:
    """decode_weight_bytes of a GGUF file: its tensors' bytes as stored (llama.cpp's blocks); token_embd is read one
    row per token unless it is the head too (no output.weight: llama.cpp reuses it, as a tied model)."""
    from ..core.ggml.gguffile import read_gguf

    tensors = read_gguf(path).tensors
    sizes = {name: int(t.raw.nbytes) for name, t in tensors.items()}
    tables = [n for n in ("token_embd.weight", "output.weight") if n in sizes]
    if "token_embd.weight" not in sizes:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    return _table_split(sizes, tables, tensors["token_embd.weight"].shape[0], str(path))


def kv_read_bytes(config, context_tokens: float, batch: int = 1, element_bytes: int = 4) -> float:
    """Bytes of KV cache one decode step reads: keys and values of every layer over context_tokens positions, per
    sequence, times batch (a float: context_tokens may be a mean over the steps).

    >>> kv_read_bytes(model.config, 512 + 32.5, batch=8, element_bytes=2)
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * context_tokens * batch * element_bytes


__all__ = ["decode_weight_bytes", "gguf_decode_weight_bytes", "kv_read_bytes", "last_level_cache_bytes",
           "measure_dram_bandwidth", "onnx_decode_weight_bytes"]
