"""Import the quantized checkpoints other tools write, their integer codes kept: compressed-tensors (llm-compressor,
quantlab's own export), GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero points) and AWQ GEMM (AutoAWQ).

    model, tok, facts = load_quantized_checkpoint("out/qwen2.5-0.5b-gptq-int4")
    facts["source_format"], facts["source_schemes"]          # ('gptq', {'w4 g128 sym': 168})

The architecture is built from config.json without its quantization_config (empty weights: nothing is allocated
until assigned); every quantized linear becomes a frozen QuantLinear holding the file's codes, scales and zero points
exactly (ct_import.py, gptq_import.py: the same numbers, in quantlab's unsigned-code convention); every other tensor
is loaded as it is, cast to dtype. The config's schemes are all checked before any tensor is read: a scheme quantlab
cannot hold fails naming the folder, the layer, the scheme and what is supported. Reads safetensors only (never a
pickle), JSON and the tokenizer.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from torch import nn

from ..core.activations import DynamicActQuant
from ..core.lifecycle import quant_linears, set_submodule
from ..util.checks import resolve_dtype, utf8_error
from .ckpt_layer import frozen_layer
from .ct_import import INT8_TOKENS, check_ct_scheme, ct_layer_codes, ct_schemes, read_ct_config
from .gptq_import import awq_settings, gptq_layer_codes, gptq_settings

METHODS = {"compressed-tensors": "compressed-tensors", "gptq": "gptq", "awq": "awq-gemm"}  # quant_method -> format
PER_TENSOR_NOTE = "per-tensor weight scales are held per output channel (the one value on every row: the same numbers)"


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise utf8_error(file, e) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: corrupt JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must be a JSON object, got {type(data).__name__}")
    return data


def quantization_config(path: str | Path) -> tuple[dict, Path] | None:
    """(quantization config, the file holding it): config.json's quantization_config, else AutoGPTQ's
    quantize_config.json; None when the folder has neither (a float checkpoint, or no folder at all)."""
    path = Path(path).expanduser()
    config = path / "config.json"
    qc = _read_json(config).get("quantization_config") if config.is_file() else None
    if isinstance(qc, dict) and qc.get("quant_method"):
        return qc, config
    if (path / "quantize_config.json").is_file():
        qc = _read_json(path / "quantize_config.json")
        return {"quant_method": "gptq", **qc}, path / "quantize_config.json"
    return None


def checkpoint_format(path: str | Path) -> str | None:
    """"compressed-tensors", "gptq" or "awq-gemm" for a folder whose config names one of them (whether quantlab can
    hold its schemes is checked when it loads), else None. Reads JSON only.

    >>> checkpoint_format("out/w4g32")        # a folder export_compressed_tensors wrote
    'compressed-tensors'
    """
    found = quantization_config(path)
    return None if found is None else METHODS.get(str(found[0]["quant_method"]).lower())


def source_tool(fmt: str, qc: dict, path: Path) -> str:
    """Who wrote the checkpoint, from what its files record: compressed-tensors' version, llm-compressor's
    recipe.yaml, GPTQModel's meta.quantizer / AutoGPTQ's quantizer, auto-round's autoround_version, the GPTQ
    checkpoint_format, AWQ's version; "unrecorded" when none of them is there."""
    parts = [f"compressed-tensors {qc.get('version', '(version unrecorded)')}"] if fmt == "compressed-tensors" else []
    if (path / "recipe.yaml").is_file():
        parts.append("llm-compressor (recipe.yaml)")
    quantizer = (qc.get("meta") or {}).get("quantizer") or qc.get("quantizer")
    parts += [str(q) for q in (quantizer if isinstance(quantizer, list) else [quantizer] if quantizer else [])]
    if qc.get("autoround_version"):
        parts.append(f"auto-round {qc['autoround_version']}")
    if fmt == "gptq":
        parts.append(f"checkpoint_format {qc.get('checkpoint_format', qc.get('format', 'gptq'))}")
    if fmt == "awq-gemm":
        parts.append(f"awq version {qc.get('version', 'gemm')}")
    return "; ".join(parts) or "unrecorded"


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the folder's safetensors files (sharded ones through their index), and each key's file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(_read_json(index).get("weight_map", {}).values())) if index.is_file() else sorted(
        p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files (quantlab never unpickles a .bin checkpoint)")
    tensors, where = {}, {}
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: listed in {index.name}, missing")
        try:
            part = load_file(path / name)
        except SafetensorError as e:
            raise ValueError(f"{path / name}: corrupt safetensors file ({e})") from None
        tensors.update(part)
        where.update(dict.fromkeys(part, name))
    return tensors, where


def _skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The dense architecture of config.json, its quantization_config dropped, on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _linear(model: nn.Module, name: str, where: str) -> nn.Linear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{where}: layer {name} is quantized in the checkpoint but is no module of the architecture "
                         f"in config.json") from None
    if type(module) is not nn.Linear:
        raise ValueError(f"{where}: layer {name} is a {type(module).__name__} in the architecture; quantlab imports "
                         f"quantized nn.Linear layers")
    tied = getattr(model.config, "tie_word_embeddings", False) and module is model.get_output_embeddings()
    if tied:
        raise ValueError(f"{where}: layer {name} is quantized but tied to the float input embedding "
                         f"(tie_word_embeddings): quantlab holds the two apart only when the config unties them")
    return module


def _plan_ct(qc: dict, cfg_file: Path, model: nn.Module) -> tuple[dict, list[str]]:
    """({layer name: (nn.Linear, build(where, linear, get, keys) -> LayerCodes)}, notes), every scheme checked."""
    where, plan, notes = str(cfg_file.parent), {}, []
    qconfig, grouped = read_ct_config(qc, str(cfg_file))
    for name, (gname, scheme, fmt) in ct_schemes(model, qconfig).items():
        kind = check_ct_scheme(where, name, scheme, fmt, grouped.get(gname))
        plan[name] = (_linear(model, name, where), lambda w, lin, get, ks, s=scheme, f=fmt, k=kind:
                      ct_layer_codes(w, lin, s, f, k, get, ks))
        if scheme.weights.strategy == "tensor" and PER_TENSOR_NOTE not in notes:
            notes.append(PER_TENSOR_NOTE)
    return plan, notes


def _plan_packed(settings, keys, model: nn.Module, where: str) -> dict:
    """GPTQ / AWQ: the layers are the owners of the qweight tensors, all on the config's one grid."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}  # the architecture's order; unknown ones first
    names = sorted((k.removesuffix(".qweight") for k in keys if k.endswith(".qweight")), key=lambda n: order.get(n, -1))
    return {n: (_linear(model, n, where), lambda w, lin, get, ks: gptq_layer_codes(w, lin, settings, get, ks))
            for n in names}


def _getter(tensors: dict, files: dict, path: Path, name: str, used: set):
    def get(local: str) -> torch.Tensor:
        key = f"{name}.{local}"
        if key not in tensors:
            raise ValueError(f"{path}: layer {name}: tensor {key} is missing from {', '.join(sorted(set(files.values())))}")
        used.add(key)
        return tensors[key]
    return get


def _layer_codes(plan: dict, tensors: dict, files: dict, path: Path) -> tuple[dict, set]:
    """({layer name: LayerCodes}, the tensor keys they used); a layer's tensor its scheme does not use is refused."""
    used, codes = set(), {}
    for name, (linear, build) in plan.items():
        layer_keys = {k[len(name) + 1:] for k in tensors if k.startswith(f"{name}.")}
        codes[name] = build(f"{path}: layer {name}", linear, _getter(tensors, files, path, name, used), layer_keys)
    leftover = sorted(k for n in plan for k in tensors if k.startswith(f"{n}.") and k not in used
                      and k != f"{n}.bias")
    if leftover:
        raise ValueError(f"{path}: tensors its scheme does not use: {', '.join(leftover[:5])}")
    return codes, used


def _load_float(model: nn.Module, tensors: dict, dtype: torch.dtype, path: Path) -> None:
    """Assign every tensor left (embeddings, norms, float linears, biases) cast to dtype; tie; nothing missing."""
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: tensors do not fit the architecture of config.json: {str(e)[:500]}") from None
    if result.unexpected_keys:
        raise ValueError(f"{path}: tensors that fit no module of the architecture (or quantization tensors of a "
                         f"layer no scheme targets): {', '.join(sorted(result.unexpected_keys)[:5])}")
    model.tie_weights()
    missing = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if missing:
        raise ValueError(f"{path}: tensors missing from the checkpoint: {', '.join(missing[:5])}")


def load_quantized_checkpoint(path: str | Path, dtype: str | torch.dtype = "float32",
                              device: str | torch.device = "cpu") -> tuple[nn.Module, object, dict]:
    """(model in eval mode on device, tokenizer or None, facts) of a compressed-tensors, GPTQ or AWQ GEMM folder.

    >>> model, tok, facts = load_quantized_checkpoint("out/w4g32")
    >>> facts["source_format"], facts["source_tool"], facts["source_schemes"]
    ('compressed-tensors', 'compressed-tensors 0.20.0', {'w4 g32 asym': 14})

    facts: source_dir, source_format, source_tool (source_tool()), source_schemes (layers per scheme),
    source_float_linears (linears left float, lm_head among them) and source_notes (where the numerics are
    quantlab's rather than the engine's: INT8_TOKENS; per-tensor scales held per channel)."""
    from transformers import AutoTokenizer

    path, torch_dtype = Path(path).expanduser(), resolve_dtype(dtype)
    found = quantization_config(path)
    fmt = None if found is None else METHODS.get(str(found[0]["quant_method"]).lower())
    if fmt is None:
        method = "none" if found is None else repr(found[0]["quant_method"])
        raise ValueError(f"{path}: quantization method {method}; quantlab imports {', '.join(METHODS.values())} "
                         f"checkpoints (config.json's quantization_config.quant_method, or quantize_config.json)")
    qc, cfg_file = found
    model = _skeleton(path, torch_dtype)
    if fmt == "compressed-tensors":  # every scheme checked before a tensor is read
        plan, notes = _plan_ct(qc, cfg_file, model)
        tensors, files = read_tensors(path)
    else:  # the config checked first; the layers are known from the tensors' names
        settings = (gptq_settings if fmt == "gptq" else awq_settings)(qc, str(cfg_file))
        tensors, files = read_tensors(path)
        plan, notes = _plan_packed(settings, tensors.keys(), model, str(path)), []
    if not plan:
        raise ValueError(f"{path}: no layer of the architecture is quantized by its config / tensors")
    codes, used = _layer_codes(plan, tensors, files, path)
    for name, (linear, _) in plan.items():
        set_submodule(model, name, frozen_layer(linear, codes[name]))
    _load_float(model, {k: v for k, v in tensors.items() if k not in used}, torch_dtype, path)
    counts: dict[str, int] = {}
    for c in codes.values():
        counts[c.label] = counts.get(c.label, 0) + 1
    if any(isinstance(c.act_quant, DynamicActQuant) and c.act_quant.format == "int" for c in codes.values()):
        notes.insert(0, INT8_TOKENS)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
        notes.append("the folder holds no tokenizer")
    facts = {"source_dir": str(path), "source_format": fmt, "source_tool": source_tool(fmt, qc, path),
             "source_schemes": counts, "source_notes": notes,
             "source_float_linears": [n for n, m in model.named_modules() if type(m) is nn.Linear]}
    return model.to(device).eval(), tokenizer, facts


def imported_row_fields(facts: dict, model: nn.Module) -> dict:
    """A result row's fields for an imported checkpoint (load_quantized_checkpoint's facts, the model holding its
    layers): source_format, source_tool, source_schemes and source_notes (JSON), the scheme as "imported <format>:
    <schemes>", and bits / group_size / symmetric / format / act_bits where one scheme covers every quantized linear."""
    specs = {(layer.spec, None if layer.act_quant is None else layer.act_quant.bits)
             for layer in quant_linears(model).values()}
    grid = {}
    if len(specs) == 1:
        (spec, act_bits), = specs
        grid = {"bits": spec.bits, "group_size": spec.group_size, "symmetric": spec.symmetric, "format": spec.format,
                "act_bits": act_bits}
    return {"source_format": facts["source_format"], "source_tool": facts["source_tool"],
            "source_schemes": json.dumps(facts["source_schemes"]), "source_notes": json.dumps(facts["source_notes"]),
            "scheme": f"imported {facts['source_format']}: " + ", ".join(facts["source_schemes"]), **grid}
