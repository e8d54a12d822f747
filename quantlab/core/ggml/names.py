"""Between a Hugging Face model and its GGUF file: architecture names, tensor names, and the row order llama.cpp's
converter gives some tensors.

    gguf_arch("llama")                                            # "llama"  (qwen2 -> "qwen2", gemma3_text -> "gemma3")
    to_gguf_name("model.layers.0.self_attn.q_proj.weight", "llama", 30)   # "blk.0.attn_q.weight"
    to_gguf_rows(w, "blk.0.attn_q.weight", "llama", n_head=9, n_head_kv=3)  # rows as the GGUF stores them

llama.cpp's convert_hf_to_gguf permutes the rows of a llama model's attn_q / attn_k (its rotary layout) and
stores a Gemma RMSNorm weight as 1 + w; transformers' GGUF loader undoes both. Row permutations move whole rows,
so they apply to quantized bytes as well as to floats.
"""
from __future__ import annotations

import torch

# model_type (transformers) -> GGUF general.architecture, for the decoders quantlab reads and writes
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3"}


def gguf_arch(model_type: str) -> str:
    if model_type not in GGUF_ARCHS:
        raise ValueError(f"model type {model_type!r} has no GGUF mapping in quantlab; supported: "
                         f"{', '.join(sorted(GGUF_ARCHS))}")
    return GGUF_ARCHS[model_type]


def to_gguf_name(hf_name: str, model_type: str, n_layers: int) -> str:
    """A parameter's name in the model's state dict -> its tensor name in a GGUF file (ValueError if none)."""
    import gguf

    arch = gguf_arch(model_type)
    mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    name = mapping.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"{hf_name}: no GGUF tensor name for it in llama.cpp's {arch} table")
    return name


def _rotary_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order convert_hf_to_gguf gives a llama attn_q/attn_k weight: per head, the even rotary pairs'
    halves interleaved (its permute())."""
    dim = rows // n_head // 2
    return torch.arange(rows).view(n_head, 2, dim).transpose(1, 2).reshape(rows)


def row_order(gguf_name: str, model_type: str, n_head: int, n_head_kv: int, rows: int) -> torch.Tensor | None:
    """The permutation p with gguf_rows = hf_rows[p] for this tensor, or None where the rows are kept."""
    if gguf_arch(model_type) != "llama":
        return None
    if ".attn_q." in gguf_name:
        return _rotary_rows(rows, n_head)
    if ".attn_k." in gguf_name:
        return _rotary_rows(rows, n_head_kv)
    return None


def to_gguf_rows(x: torch.Tensor, gguf_name: str, model_type: str, n_head: int, n_head_kv: int) -> torch.Tensor:
    """A tensor in the model's row order -> in the GGUF's (floats or quantized bytes, rows first)."""
    p = row_order(gguf_name, model_type, n_head, n_head_kv, x.shape[0])
    return x if p is None else x[p]


def from_gguf_rows(x: torch.Tensor, gguf_name: str, model_type: str, n_head: int, n_head_kv: int) -> torch.Tensor:
    """Inverse of to_gguf_rows."""
    p = row_order(gguf_name, model_type, n_head, n_head_kv, x.shape[0])
    return x if p is None else x[torch.argsort(p)]


def norm_shift(gguf_name: str, model_type: str) -> float:
    """What the GGUF adds to a tensor beyond the model's value: Gemma's RMSNorm weights are stored as 1 + w."""
    return 1.0 if gguf_arch(model_type) == "gemma3" and gguf_name.endswith("norm.weight") else 0.0


def gguf_tensors(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (the model's parameter name, shape in GGUF ne order: row length first) for every tensor
    llama.cpp's converter would write (a tied head is not a tensor of its own)."""
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out = {}
    for pname, p in model.named_parameters(remove_duplicate=True):
        if tied and pname.startswith("lm_head."):
            continue
        out[to_gguf_name(pname, cfg.model_type, cfg.num_hidden_layers)] = (pname, tuple(reversed(p.shape)))
    return out
