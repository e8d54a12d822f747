"""`quantlab list`, `quantlab info`, `quantlab estimate`: methods and models, nothing quantized.

    quantlab list
    quantlab info smollm2-135m
    quantlab estimate smollm2-135m --bits 4 --group-size 64 --seq-len 2048 --batch 8 --device-memory 2
"""
from __future__ import annotations

import json


def cmd_list(args) -> int:
    from ..core.registry import config_fields, known_methods

    for name in known_methods():
        fields = ", ".join(f"{k}={v!r}" for k, v in config_fields(name).items())
        print(f"{name:10s} {fields}")
    print("\nformats (format = ... on rtn / gptq / awq bases, overrides; act_format = ... on dynamic / static):")
    for line in format_table():
        print(line)
    print("\nllama.cpp types (format = ... on rtn / gptq / awq, overrides; bit-exact ports of ggml-quants.c):")
    for line in ggml_table():
        print(line)
    print("\nllama.cpp recipes (method = \"gguf\", type = ...; each tensor's type by llama.cpp's rules):")
    for line in recipe_table():
        print(line)
    return 0


def ggml_table() -> list[str]:
    """One line per llama.cpp type: name, code bits, block, bits per weight as stored, what it is."""
    from ..core.ggml.registry import GGML_TYPES

    return [f"  {name:8s} {t.code_bits}-bit codes, block {t.block:3d}, {t.bits_per_weight:.4g} bits/w: "
            f"{t.summary.split('; ')[0]}" for name, t in GGML_TYPES.items()]


def recipe_table() -> list[str]:
    """One line per llama.cpp recipe (ftype): its base type's bits per weight and its mix rules."""
    from ..core.ggml.recipes import FTYPES

    return [f"  {name:7s} {text}" for name, text in FTYPES.items()]


def format_table() -> list[str]:
    """One line per weight format: name, element bits, block, scale storage, bits per weight (1 x 4096 row)."""
    from ..core.formats import FORMATS
    from ..core.qlinear import QuantLinear, WeightSpec

    lines = [f"  {'int':12s} bits 2..8, group_size None (channel) or any, sym / asym, fp16 scales (+ 8-bit zero)"]
    for name, fmt in FORMATS.items():
        spec = WeightSpec(format=name)
        bpw = 8 * QuantLinear(4096, 1, False, spec).storage_bytes() / 4096
        block = "channel" if spec.group_size is None else f"block {spec.group_size}"
        lines.append(f"  {name:12s} {fmt.bits}-bit, {block}, {bpw:.3f} bits/w: {fmt.summary}")
    return lines


def cmd_info(args) -> int:
    from ..models.loading import load_model, model_info

    model, _ = load_model(args.model, "float32", "cpu", args.cache_dir)
    info = model_info(model)
    linears = info.pop("linear_layers")
    info["linear_layer_count"] = len(linears)
    print(json.dumps(info, indent=1))
    for name in linears:
        print(" ", name)
    return 0


def cmd_estimate(args) -> int:
    from ..eval.estimate import estimate_memory, format_estimate

    est = estimate_memory(args.model, bits=args.bits, group_size=args.group_size, seq_len=args.seq_len,
                          batch=args.batch, dtype=args.dtype, symmetric=not args.asym, backend=args.backend,
                          device=args.device, device_memory_gib=args.device_memory, cache_dir=args.cache_dir)
    print(format_estimate(est))
    return 0 if est.fits is not False else 2


def add_commands(sub) -> None:
    """Register list / info / estimate on the main parser's subparsers."""
    sub.add_parser("list", help="registered methods, their config fields, and the number formats").set_defaults(func=cmd_list)
    p = sub.add_parser("info", help="parameter count, tied embeddings and linear layers of a model")
    p.add_argument("model")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("estimate", help="predict inference memory from the model config; does it fit?")
    p.add_argument("model")
    p.add_argument("--bits", type=int, help="weight bits of the decoder linears (omit for float)")
    p.add_argument("--group-size", type=int, help="quantization group size (omit for per-channel)")
    p.add_argument("--asym", action="store_true", help="asymmetric weights (a zero point per group)")
    p.add_argument("--seq-len", type=int, default=2048, help="context: prompt + generated tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="dtype of the float parts and the KV cache")
    p.add_argument("--backend", default="simulated", help="simulated | torchao | onnxruntime (weight layout, runtime)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (framework overhead)")
    p.add_argument("--device-memory", type=float, help="GiB available; prints fits / does not fit (exit 2)")
    p.set_defaults(func=cmd_estimate)
