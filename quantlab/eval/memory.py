"""Weight bytes, true bits per weight, and the CUDA allocator's peak memory per run.

On CPU no in-process peak is reported: a process's peak RSS (ru_maxrss, VmHWM) covers its whole
life (model loading, every earlier run), so it would be the same number for every run. Per-run
CPU peaks come from a fresh process: quantlab.eval.memprobe (the runner's [eval] memory = "isolated").
"""
from __future__ import annotations

import gc
import json

import torch
from torch import nn

from ..core.qlinear import QuantLinear

MIB = 2**20


def _plain(tensors):
    """Tensor subclasses (torchao weights) -> the plain tensors they hold."""
    from ..backends.modules import inner_tensors

    return [x for t in tensors for x in inner_tensors(t)]


def unique_tensor_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the plain tensors behind `tensors`, each storage view once; `seen` (updated) carries the views
    already counted across calls (tied weights)."""
    seen, total = set() if seen is None else seen, 0
    for t in _plain(tensors):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def weight_stats(model: nn.Module) -> dict:
    """Model weight bytes (tied tensors once), and for QuantLinear layers their real storage.

    bits_per_weight = 8 * (codes + scales + zeros bytes) / weights in quantized layers;
    quant_layer_float_bytes is what the same layers take at the model's float dtype.
    embedding_bytes: the input embedding (Gemma-3-270M: 262k x 640, 63% of its weights), quantized or not;
    weight_mib_no_embedding: everything else (a tied output head is the embedding, so it is left out too).
    """
    total = unique_tensor_bytes(list(model.parameters()) + list(model.buffers()))
    embedding = _input_embedding(model)
    embedding_bytes = (unique_tensor_bytes(list(embedding.parameters()) + _persistent_buffers(embedding))
                       if embedding is not None else 0)  # buffers: a QuantEmbedding's codes and scales
    # QuantLinear, and layers exported to torchao kernels (they carry storage_bytes too)
    qlayers = [m for m in model.modules() if isinstance(m, QuantLinear) or hasattr(m, "storage_bytes")]
    numel = sum(m.in_features * m.out_features for m in qlayers)
    qbytes = sum(m.storage_bytes() for m in qlayers)
    float_size = next(model.parameters()).element_size()
    return {
        "weight_bytes": total,
        "weight_mib": total / MIB,
        "quant_layers": len(qlayers),
        "quant_layer_bytes": qbytes,
        "quant_layer_float_bytes": numel * float_size,
        "bits_per_weight": 8 * qbytes / numel if numel else 8.0 * float_size,
        "embedding_bytes": embedding_bytes,
        "weight_mib_no_embedding": (total - embedding_bytes) / MIB,
        **_ggml_formats(qlayers),
    }


def _ggml_formats(qlayers: list) -> dict:
    """ggml_layer_types: how many quantized linears hold each llama.cpp type (where any does), so a type that fell
    back on rows it does not tile (q4_k -> q5_0 on 576 columns) shows in the row."""
    counts = {}
    for m in qlayers:
        spec = getattr(m, "spec", None)
        if spec is not None and spec.ggml is not None:
            counts[spec.format] = counts.get(spec.format, 0) + 1
    return {"ggml_layer_types": json.dumps(dict(sorted(counts.items())))} if counts else {}


def _persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Buffers a state dict holds (a QuantEmbedding's codes and scales), not derived ones (Gemma's embed_scale)."""
    return [b for m in module.modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set]


def _input_embedding(model: nn.Module) -> nn.Module | None:
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without an embedding
        return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a per-run peak on CUDA: free what earlier runs left cached (else the reserved peak starts
    at their cache), then reset the allocator's peaks to what is allocated now. No-op on CPU."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> dict:
    """On CUDA: peak allocated/reserved since reset_peak_memory (every tensor alive then counts too).
    On CPU: {} (see the module doc: no in-process per-run peak exists)."""
    if device.type == "cuda":
        return {
            "peak_vram_mib": torch.cuda.max_memory_allocated(device) / MIB,
            "peak_vram_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB,
        }
    return {}
