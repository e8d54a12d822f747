"""Simulated KV quantization through transformers' own hook point, the attention interface.

transformers 5 attention modules compute Q, K (after RoPE) and V, update the cache, then call
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)`. apply_kv_quant
registers one wrapper per inner implementation (name "quantlab_kv_<inner>", e.g. "quantlab_kv_sdpa", with the
inner one's mask function) and points the model's config at it; the wrapper:

    rotate_k:  q, k <- q H, k H       (H the orthonormal head_dim Hadamard: q·kᵀ unchanged; QuaRot)
    bits < 16: k, v <- fake-quantize per (batch, head, token), groups along head_dim
    then calls the inner implementation (sdpa, eager, ...) unchanged.

K and V coming out of a QuantizedKVCache are already rotated and quantized (marked by the cache with its config):
the wrapper rotates only Q and never rounds them a second time. With any other cache (or none) every K/V it sees
is float and is quantized here. Nothing in transformers is patched; remove_kv_quant restores the config.

    with kv_quant(model, KVCacheConfig(bits=4, group_size=64)):
        ppl = perplexity(model, windows)["ppl"]
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..transforms.hadamard import factor_order, hadamard_transform
from .config import KVCacheConfig
from .numerics import kv_fake_quantize

PREFIX = "quantlab_kv_"
STATE_ATTR = "quantlab_kv"  # the _KVState on each attention module while applied
MARK_ATTR = "_quantlab_kv_config"  # set by QuantizedKVCache on the K/V it returns: already rotated + quantized


@dataclass(frozen=True)
class _KVState:
    config: KVCacheConfig
    inner: Callable  # the attention function the model used before (sdpa, eager, ...)
    inner_name: str  # the model's _attn_implementation before


def _model_type(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Attention modules that dispatch through transformers' attention interface: those whose modeling file
    uses ALL_ATTENTION_FUNCTIONS and that know their layer_idx and head_dim (Llama, Qwen2, Mistral, ...)."""
    out = {}
    for name, m in model.named_modules():
        src = inspect.getmodule(type(m))
        if (hasattr(src, "ALL_ATTENTION_FUNCTIONS") and hasattr(m, "layer_idx") and hasattr(m, "head_dim")
                and hasattr(m, "config") and type(m).__name__.endswith("Attention")):
            out[name] = m
    return out


def _kv_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The registered wrapper: rotate / quantize K and V (see the module docstring), then the inner function."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs the quantlab_kv attention but has no KV config; "
                           "apply it with quantlab.kvcache.apply_kv_quant(model, config)")
    cfg = state.config
    stored = getattr(key, MARK_ATTR, None)
    if stored is not None:  # from a QuantizedKVCache: K (rotated) and V are on the grid already
        if stored != cfg:
            raise ValueError(f"the QuantizedKVCache holds {stored} but the model's attention applies {cfg}; "
                             "build the cache with the config passed to apply_kv_quant")
        if cfg.rotate_k:
            query = hadamard_transform(query)
    else:
        if cfg.rotate_k:
            query, key = hadamard_transform(query), hadamard_transform(key)
        key, value = kv_fake_quantize(key, cfg), kv_fake_quantize(value, cfg)
    return state.inner(module, query, key, value, attention_mask, *args, **kwargs)


def _register(inner_name: str) -> str:
    """Register "quantlab_kv_<inner>" (attention wrapper + the inner implementation's mask); idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = PREFIX + inner_name
    AttentionInterface.register(name, _kv_attention)
    if inner_name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # else: no mask, as for the inner one
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    return name


def _inner_function(module: nn.Module, inner_name: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    src = inspect.getmodule(type(module))
    eager = getattr(src, "eager_attention_forward", None)
    if inner_name == "eager":
        if eager is None:
            raise ValueError(f"{src.__name__} has no eager_attention_forward to wrap; load the model with "
                             "attn_implementation='sdpa'")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, eager)


def _configs(model: nn.Module, modules) -> list:
    """The distinct config objects that name the attention implementation (the model's, each module's)."""
    seen, out = set(), []
    for c in [model.config, *(m.config for m in modules)]:
        if id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return out


def apply_kv_quant(model: nn.Module, config: KVCacheConfig) -> KVQuantHandle | None:
    """Make every attention layer rotate (rotate_k) and fake-quantize its K (after RoPE) and V before attention.

    Returns a handle (.remove(), or use kv_quant() as a context manager); None when the config changes nothing
    (bits 16, no rotation): the model is left exactly as it was. Applying again replaces the config.
    Raises ValueError naming the model type when its attention does not go through transformers' interface,
    when group_size does not divide head_dim, or when rotate_k meets a head_dim with no Hadamard matrix.

    >>> handle = apply_kv_quant(model, KVCacheConfig(bits=8)); ...; handle.remove()
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    modules = attention_modules(model)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not modules or not isinstance(impl, str):
        raise ValueError(f"KV-cache quantization needs attention that dispatches through transformers' "
                         f"ALL_ATTENTION_FUNCTIONS (Llama, Qwen2, Mistral, ...); model type {_model_type(model)!r} "
                         f"has no such attention modules")
    remove_kv_quant(model)
    if not config.active:
        return None
    impl = model.config._attn_implementation
    for m in modules.values():
        config.check_head_dim(m.head_dim, _model_type(model))
        if config.rotate_k:
            try:
                factor_order(m.head_dim)
            except ValueError as e:
                raise ValueError(f"rotate_k on {_model_type(model)!r}: {e}") from None
    name = _register(impl)
    for m in modules.values():
        setattr(m, STATE_ATTR, _KVState(config, _inner_function(m, impl), impl))
    for c in _configs(model, modules.values()):
        c._attn_implementation = name
    return KVQuantHandle(model)


def remove_kv_quant(model: nn.Module) -> bool:
    """Undo apply_kv_quant: the attention implementation the model had before; False when none was applied."""
    modules = [m for m in model.modules() if hasattr(m, STATE_ATTR)]
    if not modules:
        return False
    inner_name = getattr(modules[0], STATE_ATTR).inner_name
    for c in _configs(model, modules):
        c._attn_implementation = inner_name
    for m in modules:
        delattr(m, STATE_ATTR)
    return True


def applied_kv_config(model: nn.Module) -> KVCacheConfig | None:
    """The KVCacheConfig apply_kv_quant set on the model, or None."""
    state = next((getattr(m, STATE_ATTR) for m in model.modules() if hasattr(m, STATE_ATTR)), None)
    return None if state is None else state.config


class KVQuantHandle:
    def __init__(self, model: nn.Module):
        self.model = model

    def remove(self) -> None:
        remove_kv_quant(self.model)


@contextmanager
def kv_quant(model: nn.Module, config: KVCacheConfig | None):
    """Apply KV quantization for the duration of the block (None: nothing); on exit the model is as it was before
    the block: a config the caller had applied (its owner removes it) is back in place, even where the block
    applied another one. The block applying the config the model already runs under changes nothing."""
    if config is None:
        yield model
        return
    before = applied_kv_config(model)
    if before == config:  # the owner applied it: neither reapply nor remove
        yield model
        return
    apply_kv_quant(model, config)
    try:
        yield model
    finally:
        remove_kv_quant(model)
        if before is not None:
            apply_kv_quant(model, before)


def mark_quantized(key: torch.Tensor, value: torch.Tensor, config: KVCacheConfig) -> None:
    """Tag K/V (returned by a QuantizedKVCache) so the wrapper neither rotates K nor rounds them again."""
    setattr(key, MARK_ATTR, config)
    setattr(value, MARK_ATTR, config)
