"""`gguf`: llama.cpp's quantization, tensor by tensor as llama.cpp's own quantizer does it, or a GGUF file's codes.

    [[runs]]
    method = "gguf"
    type = "Q4_K_M"          # llama.cpp's recipe: each tensor's type from its rules (core/ggml/recipes.py)
    imatrix = true           # importance matrix from the calibration windows (or a path to an .imatrix file)

    [[runs]]
    method = "gguf"
    file = "model-Q4_K_M.gguf"   # import: the file's codes, bit for bit, scored against the experiment's model

A recipe quantizes every linear with its type's ported quantizer (bit-exact with llama.cpp's, core/ggml), the
importance of each input column (llama.cpp's imatrix: mean x² over the calibration tokens) weighting the search
where given. The token embedding gets its type too: its table is replaced by the dequantized values (a lookup of
dequantized rows is what llama.cpp computes), and a tied head reads the same. An imported file replaces every
linear by a frozen QuantLinear holding the file's bytes, and every other tensor by the file's values.

The row records the type of every tensor (gguf_types), the fallbacks the row length forced (gguf_fallbacks), and
gguf_bpw, the bits per weight of the whole file as llama.cpp counts them (every tensor, embedding included).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..calibration.imatrix import check_imatrix, collect_imatrix, load_imatrix, read_imatrix
from ..core.ggml import names
from ..core.ggml.gguffile import read_gguf, read_metadata
from ..core.ggml.recipes import FTYPE_BASE, FTYPES, check_ftype, recipe_types
from ..core.ggml.registry import GGML_TYPES, dequantize_rows, quantize_rows
from ..core.lifecycle import freeze_all, quant_linears, set_submodule
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import Method, register_method

log = logging.getLogger(__name__)
FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


@dataclass(frozen=True)
class GGUFConfig:
    """type: a llama.cpp recipe (Q4_K_M, Q2_K, ..., see FTYPES); file: a GGUF whose codes to import (one of the two);
    imatrix: false, true (collected from the calibration windows) or the path of an imatrix file (llama.cpp's GGUF
    or legacy .dat format) for the recipe's quantizers."""

    type: str | None = None
    file: str | None = None
    imatrix: bool | str = False

    def __post_init__(self):
        if (self.type is None) == (self.file is None):
            raise ValueError(f"gguf: give exactly one of type (a llama.cpp recipe: {', '.join(FTYPES)}) or file "
                             f"(a GGUF to import); got type = {self.type!r}, file = {self.file!r}")
        if self.type is not None:
            check_ftype(self.type)
        if self.file is not None:  # exists, parses and is an architecture quantlab maps: before any weights load
            arch = read_metadata(self.file).get("general.architecture")
            if arch not in set(names.GGUF_ARCHS.values()):
                raise ValueError(f"gguf: {self.file} holds a {arch!r} model; quantlab reads GGUF architectures "
                                 f"{', '.join(sorted(set(names.GGUF_ARCHS.values())))}")
            if self.imatrix is not False:
                raise ValueError("gguf: imatrix applies to a recipe (type = ...); an imported file is already quantized")
        if not isinstance(self.imatrix, (bool, str)):
            raise ValueError(f"gguf: imatrix must be true, false or a file path, got {self.imatrix!r}")
        if isinstance(self.imatrix, str):
            read_imatrix(self.imatrix)  # exists and parses (named errors), before any weights load


def _recipe(model: nn.Module, ftype: str, imatrix: bool) -> dict:
    cfg = model.config
    tensors = names.gguf_tensors(model)
    n_head = cfg.num_attention_heads
    return recipe_types(ftype, {g: shape for g, (_, shape) in tensors.items()}, names.gguf_arch(cfg.model_type),
                        cfg.num_hidden_layers, n_head, getattr(cfg, "num_key_value_heads", None) or n_head, imatrix)


def _file_facts(shapes: dict[str, tuple[int, ...]], types: dict[str, str]) -> dict:
    """gguf_types (type -> tensor count), gguf_bpw (bits per weight of the whole file, every tensor counted, as
    llama.cpp's quantizer reports it)."""
    bits = n = 0
    for g, shape in shapes.items():
        numel, t = int(torch.Size(shape).numel()), types[g]
        bits += 8 * (numel * FLOAT_BYTES[t] if t in FLOAT_BYTES else numel // GGML_TYPES[t].block * GGML_TYPES[t].type_size)
        n += numel
    return {"gguf_types": json.dumps(_count(types.values())), "gguf_bpw": bits / n}


def _count(values) -> dict:
    out = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _quantize_embedding(model: nn.Module, type_name: str) -> None:
    """The input embedding's table on the type's grid: its values become the dequantized ones (unweighted: no
    imatrix reaches it), and the bytes stay with the module (ggml_type / ggml_raw) for a GGUF export."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        w = emb.weight
        raw = quantize_rows(w.detach().float(), type_name)
        w.copy_(dequantize_rows(raw, type_name, w.shape[1]).to(w.dtype))
    emb.ggml_type, emb.ggml_raw = type_name, raw


@register_method
class GGUF(Method):
    name = "gguf"
    config_cls = GGUFConfig

    def needs_calibration_for(self, config: GGUFConfig) -> bool:
        return config.imatrix is True

    def describe(self, config: GGUFConfig, dtype: str = "float32") -> str:
        if config.file is not None:
            return f"gguf file {Path(config.file).name}"
        return f"{config.type}{' imatrix' if config.imatrix else ''}"

    def grid_for(self, config: GGUFConfig) -> dict | None:
        """A recipe's grid columns: its base type's code bits, format "gguf Q4_K_M" (the types vary per tensor:
        gguf_types); an imported file's are known once it is read (gguf_types)."""
        if config.type is None:
            return {"bits": None, "group_size": None, "symmetric": None, "format": "gguf file"}
        base = GGML_TYPES[FTYPE_BASE[config.type]]
        return {"bits": base.code_bits, "group_size": None, "symmetric": None, "format": f"gguf {config.type}"}

    def prepare(self, model, config: GGUFConfig) -> None:
        if config.file is not None:
            import_gguf(model, config.file)
            return
        choices = _recipe(model, config.type, config.imatrix is not False)
        tensors = names.gguf_tensors(model)
        model._quantlab_gguf_plan = (choices, {g: shape for g, (_, shape) in tensors.items()})  # for convert
        for g, (pname, _) in tensors.items():
            module_name = pname.rpartition(".")[0]
            module = model.get_submodule(module_name)
            if isinstance(module, nn.Linear) and choices[g].type in GGML_TYPES:
                set_submodule(model, module_name, QuantLinear.from_linear(module, WeightSpec(format=choices[g].type)))
        if isinstance(config.imatrix, str):
            _apply_importance(model, load_imatrix(config.imatrix), config.imatrix)

    def calibrate(self, model, config: GGUFConfig, batches, progress: bool = True) -> dict:
        layers = quant_linears(model)
        for layer in layers.values():
            layer.quant_enabled = False  # llama-imatrix runs the unquantized model
        try:
            entries = collect_imatrix(model, batches, progress=progress)
        finally:
            for layer in layers.values():
                layer.quant_enabled = True
        tokens = 0
        for name, layer in layers.items():
            if name in entries:  # llama-imatrix leaves the output head out
                layer.importance = entries[name].importance
                tokens = max(tokens, entries[name].count)
        return {"gguf_imatrix_tokens": tokens}

    def convert(self, model, config: GGUFConfig) -> dict:
        freeze_all(model)
        if config.file is not None:
            f = read_gguf(config.file)
            return {"gguf_source": str(config.file),
                    **_file_facts({g: tuple(reversed(t.shape)) for g, t in f.tensors.items()},
                                  {g: t.type for g, t in f.tensors.items()})}
        choices, shapes = model._quantlab_gguf_plan
        del model._quantlab_gguf_plan
        emb = choices.get("token_embd.weight")
        if emb is not None and emb.type in GGML_TYPES:
            _quantize_embedding(model, emb.type)
        fallbacks = [f"{c.fallback_from}->{c.type}" for c in choices.values() if c.fallback_from]
        return {**_file_facts(shapes, {g: c.type for g, c in choices.items()}), "gguf_fallbacks": len(fallbacks),
                "gguf_fallback_types": json.dumps(_count(fallbacks))}


def _apply_importance(model: nn.Module, importance: dict[str, torch.Tensor], source: str) -> None:
    """Each QuantLinear's importance from an imatrix keyed by GGUF tensor names (checked against the model)."""
    cfg = model.config
    layers = quant_linears(model)
    wanted = {names.to_gguf_name(f"{n}.weight", cfg.model_type, cfg.num_hidden_layers): (n, layer.in_features)
              for n, layer in layers.items()}
    try:
        check_imatrix(importance, {g: k for g, (_, k) in wanted.items()})
    except ValueError as e:
        raise ValueError(f"gguf: imatrix {source}: {e}") from None
    for g, (n, _) in wanted.items():
        if g in importance:
            layers[n].importance = importance[g].float()


def import_gguf(model: nn.Module, path: str | Path) -> dict[str, str]:
    """Replace the model's tensors by a GGUF file's: linears stored in a llama.cpp type become frozen QuantLinears
    holding the file's bytes (rows in the model's order); everything else takes the file's values. Returns
    GGUF name -> type. The file must be the model's architecture, tensor for tensor."""
    cfg = model.config
    f = read_gguf(path)
    arch = names.gguf_arch(cfg.model_type)
    if f.arch != arch:
        raise ValueError(f"{path}: a {f.arch!r} model; the experiment's model is {arch!r}")
    tensors = names.gguf_tensors(model)
    missing = sorted(set(tensors) - set(f.tensors))
    if missing:
        raise ValueError(f"{path}: lacks {len(missing)} tensors of the model (first: {', '.join(missing[:3])}); "
                         f"is it another model?")
    n_head = cfg.num_attention_heads
    n_head_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    for g, (pname, shape) in tensors.items():
        t = f.tensors[g]
        if tuple(reversed(t.shape)) != shape and t.shape != tuple(reversed(shape)):
            raise ValueError(f"{path}: tensor {g} has shape {t.shape}, the model's {pname} {tuple(reversed(shape))}")
        module_name = pname.rpartition(".")[0]
        module = model.get_submodule(module_name)
        if isinstance(module, nn.Linear) and t.ggml is not None and pname.endswith(".weight"):
            raw = names.from_gguf_rows(torch.from_numpy(t.raw.copy()), g, cfg.model_type, n_head, n_head_kv)
            layer = QuantLinear(module.in_features, module.out_features, module.bias is not None,
                                WeightSpec(format=t.type))
            layer.bias = module.bias
            layer.register_buffer("qweight", raw)
            layer.weight, layer.frozen = None, True
            set_submodule(model, module_name, layer)
            continue
        values = names.from_gguf_rows(t.floats(), g, cfg.model_type, n_head, n_head_kv)
        shift = names.norm_shift(g, cfg.model_type)
        param = model.get_parameter(pname)
        with torch.no_grad():
            param.copy_((values - shift if shift else values).reshape(param.shape).to(param.dtype))
        if isinstance(module, nn.Embedding) and t.ggml is not None:  # bytes kept for a GGUF export
            module.ggml_type, module.ggml_raw = t.type, torch.from_numpy(t.raw.copy())
    return {g: t.type for g, t in f.tensors.items()}
