"""Export a (quantized) model as a GGUF file that llama.cpp runs.

    facts = export_gguf(model, "out.gguf", source_gguf="SmolLM2-135M-Instruct.Q4_1.gguf")

- A QuantLinear on a llama.cpp type (`format = "q4_k"`, the `gguf` method, GPTQ on a GGUF grid, an imported GGUF)
  keeps its bytes: the codes quantlab chose are the codes llama.cpp runs.
- A QuantLinear on an integer grid that a GGUF type expresses exactly keeps its codes too: w4 g32 symmetric with
  fp16 scales is Q4_0 (value d * (q - 8) with q = code + 8), w8 g32 symmetric with fp16 scales is Q8_0.
- Any other grid has no GGUF form: the export fails naming the layer and the types that would take its shape,
  unless `requantize = "<type>"` asks to quantize that layer's dequantized weight to the named type (the file's
  metadata `quantlab.requantized` lists those layers, and so does the row).
- Layers left in float, norms and biases are written as F32; a tied head is not written (llama.cpp reuses
  token_embd, as the converter does).
- The tokenizer and every other metadata key come from the source GGUF (the model alias' file); the
  hyperparameters come from the model's config, so a model with fewer layers than its source still loads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..core.ggml import names
from ..core.ggml.gguffile import kv_string, kv_strings, kv_uint32, read_header, read_metadata, write_gguf
from ..core.ggml.registry import GGML_TYPES, check_row_size, quantize_rows
from ..core.primitives import code_range
from ..core.qlinear import QuantLinear

# the keys export_gguf writes itself (from the model's config), not copied from the source file
_OWN_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "block_count",
             "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "vocab_size")


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def int_grid_as_ggml(layer: QuantLinear) -> tuple[str, torch.Tensor] | None:
    """(type, GGUF bytes (out, blocks * size)) for a frozen integer-grid layer that Q4_0 or Q8_0 expresses exactly."""
    s = layer.spec
    if (not layer.frozen or s.fmt is not None or not s.symmetric or s.group_size != 32 or s.bits not in (4, 8)
            or layer.float_zero or layer.scale.dtype != torch.float16 or layer.input_scale is not None
            or layer.act_quant is not None or layer.in_features % 32):
        return None
    from ..core import packing

    out_f, in_f = layer.out_features, layer.in_features
    codes = packing.unpack(layer.qweight, s.bits, out_f * in_f).view(out_f, in_f // 32, 32).to(torch.int16)
    q = codes + code_range(s.bits, True)[0]  # signed codes: -8..7 or -128..127
    d = _fp16_bytes(layer.scale.view(out_f, in_f // 32))  # (out, blocks, 2)
    if s.bits == 8:
        body = q.to(torch.int8).view(torch.uint8)
        return "q8_0", torch.cat([d, body], dim=-1).reshape(out_f, -1)
    u = (q + 8).to(torch.uint8)  # Q4_0 stores q + 8; byte j holds element j (low nibble) and j + 16 (high)
    body = u[..., :16] | (u[..., 16:] << 4)
    return "q4_0", torch.cat([d, body], dim=-1).reshape(out_f, -1)


def _no_gguf_form(name: str, layer: QuantLinear) -> ValueError:
    fits = [t for t, g in GGML_TYPES.items() if layer.in_features % g.block == 0]
    why = ("an input scale (AWQ/SmoothQuant kept unfolded)" if layer.input_scale is not None else
           "quantized activations" if layer.act_quant is not None else f"grid {layer.spec.describe()}")
    if layer.input_scale is not None or layer.act_quant is not None:
        return ValueError(f"{name}: {why} has no GGUF type: llama.cpp would run the weights without it (export "
                          f"a run whose scales fold into the weights, and weight-only)")
    return ValueError(f"{name}: {why} has no GGUF type (GGUF stores Q4_0 = w4 g32 sym fp16 scales, Q8_0 = w8 g32 "
                      f"sym, and llama.cpp's own types: use format = \"q4_0\" / \"q4_k\" ... on the method); "
                      f"requantize = \"<type>\" writes it as one of {', '.join(fits)} instead (the file says so)")


def layer_bytes(name: str, layer: nn.Module, requantize: str | None) -> tuple[str, torch.Tensor, bool]:
    """(type, data, requantized) for one linear: GGUF bytes (out, row bytes) or float32 weights."""
    if isinstance(layer, QuantLinear) and (layer.input_scale is not None or layer.act_quant is not None):
        raise _no_gguf_form(name, layer)  # llama.cpp would run the weights without the scale / quantizer
    if isinstance(layer, QuantLinear) and layer.spec.ggml is not None:
        if not layer.frozen:
            layer.freeze()
        return layer.spec.format, layer.qweight, False
    if isinstance(layer, QuantLinear):
        exact = int_grid_as_ggml(layer)
        if exact is not None:
            return exact[0], exact[1], False
        if requantize is None:
            raise _no_gguf_form(name, layer)
        check_row_size(GGML_TYPES[requantize], layer.in_features, name)
        return requantize, quantize_rows(layer.quantized_weight(torch.float32).detach(), requantize), True
    return "f32", layer.weight.detach().float(), False


def _raw_matches(module: nn.Module) -> bool:
    """An embedding's kept GGUF bytes still decode to its table (nothing changed it since)."""
    from ..core.ggml.registry import dequantize_rows

    w = module.weight
    return torch.equal(dequantize_rows(module.ggml_raw, module.ggml_type, w.shape[1]).to(w.dtype), w.detach())


def _metadata(source: Path, cfg, arch: str, extra: list[bytes]) -> list[bytes]:
    """The source file's metadata entries, copied byte for byte, with the hyperparameters of the model's config
    (general.architecture first, as llama.cpp's converter writes it)."""
    header = read_header(source)
    own = {f"{arch}.{k}" for k in _OWN_KEYS} | set(_OWN_KEYS)
    kv = [kv_string("general.architecture", arch)]
    kv += [raw for key, raw in header.kv_bytes.items() if key not in own]
    n_head = cfg.num_attention_heads
    for key, value in (("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", n_head),
                       ("attention.head_count_kv", getattr(cfg, "num_key_value_heads", None) or n_head),
                       ("vocab_size", cfg.vocab_size)):
        kv.append(kv_uint32(f"{arch}.{key}", int(value)))
    return kv + [kv_uint32("general.quantization_version", 2)] + extra


def export_gguf(model: nn.Module, path: str | Path, source_gguf: str | Path, requantize: str | None = None,
                progress: bool = False) -> dict:
    """Write model as a GGUF at path (atomically: a temporary file renamed); returns the row's facts:
    gguf_path, gguf_mib, gguf_types (type -> tensor count), gguf_requantized (layers requantized, or None)."""
    if requantize is not None and requantize not in GGML_TYPES:
        raise ValueError(f"requantize = {requantize!r} is not a llama.cpp type; known: {', '.join(GGML_TYPES)}")
    cfg = model.config
    arch = names.gguf_arch(cfg.model_type)
    meta = read_metadata(source_gguf)
    if meta.get("general.architecture") != arch:
        raise ValueError(f"{source_gguf}: a {meta.get('general.architecture')!r} file cannot lend its tokenizer "
                         f"to a {arch!r} model")
    n_tokens = meta.get("tokenizer.ggml.tokens", 0)  # a string array: its length
    if n_tokens != cfg.vocab_size:
        raise ValueError(f"{source_gguf}: its tokenizer has {n_tokens} tokens, the model's vocabulary {cfg.vocab_size}")
    n_layers, n_head = cfg.num_hidden_layers, cfg.num_attention_heads
    n_head_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, types, requantized = [], {}, []  # tensors: (GGUF name, ne shape, type id, data as stored)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for owner_name, owner in model.named_modules():
        if tied and owner_name == "lm_head":
            continue  # llama.cpp reads the tied head from token_embd, as its converter writes it
        parts = []  # (HF name, kind, data)
        if isinstance(owner, nn.Linear | QuantLinear):
            kind, data, requant = layer_bytes(owner_name, owner, requantize)
            requantized += [owner_name] if requant else []
            parts.append((f"{owner_name}.weight", kind, data))
            if owner.bias is not None:
                parts.append((f"{owner_name}.bias", "f32", owner.bias.detach().float()))
        elif getattr(owner, "ggml_raw", None) is not None and _raw_matches(owner):  # method gguf's embedding
            parts = [(f"{owner_name}.weight", owner.ggml_type, owner.ggml_raw)]
        else:  # embeddings, norms: their own parameters, in float
            parts = [(f"{owner_name}.{leaf}", "f32", p.detach().float())
                     for leaf, p in owner.named_parameters(recurse=False)]
        for hf_name, kind, data in parts:
            gname = names.to_gguf_name(hf_name, cfg.model_type, n_layers)
            shift = names.norm_shift(gname, cfg.model_type)
            if kind == "f32" and shift:
                data = data + shift
            array = names.to_gguf_rows(data, gname, cfg.model_type, n_head, n_head_kv).detach().cpu().contiguous()
            ne = tuple(reversed(array.shape)) if kind == "f32" else (array.shape[1] // GGML_TYPES[kind].type_size
                                                                     * GGML_TYPES[kind].block, array.shape[0])
            type_id = 0 if kind == "f32" else GGML_TYPES[kind].gguf_id
            tensors.append((gname, ne, type_id, array.float().numpy() if kind == "f32" else array.numpy()))
            types[kind] = types.get(kind, 0) + 1
    extra = [kv_strings("quantlab.requantized", requantized), kv_string("quantlab.requantized_to", requantize)] \
        if requantized else []
    write_gguf(path, _metadata(Path(source_gguf), cfg, arch, extra), tensors)
    return {"gguf_path": str(path), "gguf_mib": path.stat().st_size / 2**20,
            "gguf_types": dict(sorted(types.items())), "gguf_requantized": requantized or None}


def export_llamacpp(model: nn.Module, path: str | Path, source_gguf: str | Path | None, probe_ids: torch.Tensor,
                    n_ctx: int, threads: int | None = None) -> tuple[nn.Module, dict]:
    """backend = "llama.cpp": the model written as a GGUF (export_gguf), run by llama.cpp; row facts include the
    parity of llama.cpp's logits against the simulated model on probe_ids (max abs / rel, rel RMS). llama.cpp
    quantizes activations to 8 bits inside its quantized dot products, so the two agree closely, not exactly."""
    from .llamacpp import LlamaCppCausalLM, llamacpp_cpu_features, require_llamacpp
    from .torchao import logits_diff

    require_llamacpp()
    if source_gguf is None:
        raise ValueError("backend 'llama.cpp' writes the model as a GGUF and takes its tokenizer from the model's "
                         "own GGUF; this model has none (use a GGUF alias, a .gguf model path, or a checkpoint "
                         "converted from one)")
    facts = export_gguf(model, path, source_gguf)
    lm = LlamaCppCausalLM(path, threads=threads, n_ctx=max(n_ctx, probe_ids.shape[-1]), config=model.config)
    parity = logits_diff(lm, model, probe_ids)
    return lm, {"backend": "llama.cpp", "backend_note": f"llama-cpp-python ({llamacpp_cpu_features()}), "
                f"{lm.threads} threads; the GGUF quantlab wrote", **facts,
                "gguf_types": json.dumps(facts["gguf_types"]),
                "gguf_requantized": json.dumps(facts["gguf_requantized"]) if facts["gguf_requantized"] else None,
                **{k.replace("export_parity", "llamacpp_parity"): v for k, v in parity.items()}}
