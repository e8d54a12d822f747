"""Export a frozen quantlab model to ONNX Runtime with quantlab's own codes, and run it there.

    ort_model, summary = export_onnxruntime(model, "out/model.onnx", probe_ids)
    ort_model(ids).logits                              # ORT on CPU; also decodes with past_key_values

What each quantized linear becomes (ort_modules.ort_kind decides, per layer, and the row says):
- weight-only int4 / int8 with groups of a power of two >= 16, or per channel -> com.microsoft::MatMulNBits
  (blocks = groups, quantlab's zero points; ort_pack);
- w8 per-channel symmetric + dynamic per-token int8 activations (W8A8) -> per-token int8 codes from standard
  ops + MatMulInteger (ort_ops);
- anything else (3-bit, number formats, static activations, HQQ's real-valued zeros) -> a float MatMul on the
  dequantized weight (its activation fake-quant kept), counted in `ort_float_layers` with the reason.

The graph is torch.onnx.export's (the dynamo exporter) of the Hugging Face model wrapped so that the KV cache
is plain inputs/outputs (past_key_i / past_value_i -> present_*), plus `logit_positions`: which positions get
logits (all of them for perplexity, the last one for prefill and decode, as generate's logits_to_keep=1). Its
attention is ort_attention.grouped_attention (eager attention's math without repeating the KV heads).
"""
from __future__ import annotations

import copy
import importlib.util
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..core.registry import get_method
from . import ort_ops
from .ort_attention import grouped_attention_for_export
from .ort_modules import ACCURACY_LEVELS, DequantLinear, OrtLinearA8W8, OrtLinearNBits, ort_kind, swap_for_ort

OPSET = 18
# End-to-end parity gate: relative RMS of the logits vs the simulated (PyTorch) model on the probe ids.
# weight-only at accuracy 0: the same dequantized weights, another fp32 summation order (measured ~1e-6);
# accuracy 4 quantizes activations to int8 per block inside MatMulNBits (a different numeric path: measured
# 0.03-0.10 on SmolLM2, reports/smollm2_speed.md; int4 g32 fails this gate); W8A8: the same activation codes, but
# an exact int32 sum where PyTorch sums floats, so an occasional code flip propagates (as with torchao's int8
# kernels, see backends/torchao.py).
PARITY_RMS_TOLERANCE = {"weight_only_acc0": 1e-4, "weight_only_acc4": 5e-2, "a8w8": 1e-1}


def ort_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnxscript") is not None


def require_ort() -> None:
    if not ort_available():
        raise ImportError("backend 'onnxruntime' needs onnxruntime, onnx and onnxscript: pip install 'quantlab[ort]' "
                          "(or pip install onnxruntime onnx onnxscript)")


def check_ort_run(exp, run) -> None:
    """What backend = "onnxruntime" cannot do, named before any model loads."""
    where = f"experiment {exp.name!r}: run {run.name!r}: backend 'onnxruntime'"
    if exp.dtype != "float32":
        raise ValueError(f"{where} exports float32 models; dtype is {exp.dtype!r}")
    if exp.eval.metric != "perplexity":
        raise ValueError(f"{where} exports causal LMs (metric 'perplexity'), not metric {exp.eval.metric!r}")
    method = get_method(run.config)  # run extras are refused by each extra (RunSpec asks their refusal())
    if method.keeps_float_adapters(run.config):  # e.g. lora with its adapters kept beside the codes
        raise ValueError(f"{where} exports quantized linears, not the float adapters {method.name} keeps beside them "
                         f"(lora: set merge = true to fold them into re-quantized codes) or use backend = "
                         f"\"simulated\"")
    if exp.eval.lm_eval_tasks:
        raise ValueError(f"{where}: lm-eval wraps PyTorch models (HFLM), not an ORT session; drop "
                         f"[eval] lm_eval_tasks or use backend = \"simulated\"")
    if exp.eval.memory == "isolated":
        raise ValueError(f"{where}: [eval] memory = \"isolated\" reloads PyTorch models; set memory = \"none\"")


class _KVWrapper(nn.Module):
    """(input_ids, attention_mask, logit_positions, past k/v...) -> (logits at those positions, present k/v...)."""

    def __init__(self, model: nn.Module, n_layers: int):
        super().__init__()
        self.model, self.n_layers = model, n_layers

    def forward(self, input_ids, attention_mask, logit_positions, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        out = body(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state.index_select(1, logit_positions)  # (B, P, C)
        logits = self.model.get_output_embeddings()(hidden)  # (B, P, V)
        presents = []
        for layer in cache.layers:
            presents += [layer.keys, layer.values]
        return (logits, *presents)


def _kv_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def export_onnx(model: nn.Module, path: str | Path) -> dict:
    """torch.onnx.export of a swapped (swap_for_ort) causal LM with its KV cache as inputs/outputs."""
    require_ort()
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None):
        raise ValueError(f"backend 'onnxruntime': {cfg.model_type} softcaps its logits; the exported head does not")
    n_layers, kv_heads, head_dim = _kv_shape(cfg)
    b, t, p = 2, 3, 4  # example sizes > 1, so the exporter keeps them symbolic
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.ones(b, p + t, dtype=torch.long)
    positions = torch.arange(t)
    past = [torch.zeros(b, kv_heads, p, head_dim) for _ in range(2 * n_layers)]
    batch, seq, total, npos, plen = (torch.export.Dim(n) for n in ("batch", "seq", "total", "positions", "past"))
    names = [f"past_{kind}_{i}" for i in range(n_layers) for kind in ("key", "value")]
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: npos}, tuple({0: batch, 2: plen} for _ in names))  # *past
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.no_grad(), grouped_attention_for_export(model):  # GQA without copies of the KV cache
        program = torch.onnx.export(
            _KVWrapper(model, n_layers).eval(), (ids, mask, positions, *past), dynamo=True, opset_version=OPSET,
            input_names=["input_ids", "attention_mask", "logit_positions", *names],
            output_names=["logits", *[n.replace("past_", "present_") for n in names]],
            dynamic_shapes=dynamic, custom_translation_table=ort_ops.translation_table(), optimize=True,
            verbose=False)
    program.save(str(path), external_data=True)
    files = [path] + [f for f in path.parent.iterdir() if f.name.startswith(path.name) and f != path]
    return {"ort_export_s": time.perf_counter() - t0, "ort_model_path": str(path),
            "ort_model_mib": sum(f.stat().st_size for f in files) / 2**20}


class OrtCache:
    """The KV cache between ORT calls: one (key, value) numpy pair per layer, (B, H, T, D)."""

    def __init__(self, arrays: list):
        self.arrays = arrays

    def get_seq_length(self) -> int:
        return self.arrays[0].shape[2]


class OrtCausalLM(nn.Module):
    """An ORT InferenceSession behind the slice of the HF causal-LM interface quantlab's harness uses:
    model(ids).logits, and model(ids, use_cache=True, past_key_values=cache, logits_to_keep=1)."""

    def __init__(self, path: str | Path, config, threads: int | None = None, profile: str | Path | None = None):
        super().__init__()
        require_ort()
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if profile is not None:  # ORT's per-node profile: session.end_profiling() writes it (ort_profile.op_times)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(profile)
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own Fail / InvalidGraph / NotImplemented types
            raise RuntimeError(
                f"onnxruntime {ort.__version__} cannot load {path}: {str(e)[:400]}. quantlab exports opset {OPSET} "
                f"with com.microsoft::MatMulNBits and MatMulInteger; an op or opset this onnxruntime lacks needs "
                f"a newer one: pip install -U 'quantlab[ort]' (tested with onnxruntime 1.32)") from e
        self.config = config
        self.n_layers, self.kv_heads, self.head_dim = _kv_shape(config)
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)  # device / dtype for the harness

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: OrtCache | None = None, use_cache: bool = False, logits_to_keep: int = 0):
        import numpy as np

        b, t = input_ids.shape
        past = past_key_values.arrays if past_key_values is not None else [
            np.zeros((b, self.kv_heads, 0, self.head_dim), np.float32)] * (2 * self.n_layers)
        p = past[0].shape[2]
        keep = t if not logits_to_keep else min(logits_to_keep, t)
        feeds = {"input_ids": input_ids.cpu().numpy().astype(np.int64),
                 "attention_mask": (attention_mask.cpu().numpy().astype(np.int64) if attention_mask is not None
                                    else np.ones((b, p + t), np.int64)),
                 "logit_positions": np.arange(t - keep, t, dtype=np.int64)}
        feeds |= {f"past_{kind}_{i}": past[2 * i + j] for i in range(self.n_layers)
                  for j, kind in enumerate(("key", "value"))}
        outs = self.session.run(None, feeds)
        logits = torch.from_numpy(outs[0])
        return SimpleNamespace(logits=logits, past_key_values=OrtCache(outs[1:]) if use_cache else None)


def export_onnxruntime(model: nn.Module, path: str | Path, probe_ids: torch.Tensor | None = None,
                       accuracy_level: int = 0) -> tuple[OrtCausalLM, dict]:
    """Export a frozen quantlab causal LM (float32) to an ORT model at `path` and load it; the original model
    is not changed. With probe_ids (B, T) the row gets logits parity vs the simulated model, gated.
    A model without QuantLinear layers exports as float (the ORT fp32 baseline)."""
    require_ort()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if dtype != torch.float32:
        raise ValueError(f"backend 'onnxruntime' exports float32 models (MatMulNBits on CPU); the model is {dtype}")
    swapped = copy.deepcopy(model)
    plan = swap_for_ort(swapped, accuracy_level)
    exported = export_onnx(swapped, path)
    del swapped
    model.config.to_json_file(str(Path(path).parent / "config.json"))  # load_ort's model facts
    ort_model = OrtCausalLM(path, model.config)
    kinds = plan["kinds"]
    note = ("; ".join(f"{why} ({n} layers)" for why, n in plan["reasons"].items())
            or f"all {sum(kinds.values())} quantized layers run ONNX Runtime int kernels")
    summary = exported | {
        "backend": "onnxruntime" if not kinds["float"] else "onnxruntime+float",
        "backend_kernels": ", ".join(f"{k}:{v}" for k, v in sorted(kinds.items()) if k != "float"),
        "backend_note": note if kinds else "float model: every linear is an fp32 MatMul in ONNX Runtime",
        "exported_layers": sum(v for k, v in kinds.items() if k != "float"), "ort_float_layers": kinds["float"],
        "ort_accuracy_level": accuracy_level,
    }
    if probe_ids is not None:
        summary |= ort_parity(ort_model, model, probe_ids, _parity_key(kinds, accuracy_level))
    return ort_model, summary


def load_ort(directory: str | Path, threads: int | None = None, profile: str | Path | None = None) -> OrtCausalLM:
    """The OrtCausalLM export_onnxruntime wrote to directory/model.onnx (with its config.json); `profile`: a file
    prefix, for a session that records ORT's per-node profile (backends/ort_profile.py)."""
    from transformers import AutoConfig

    directory = Path(directory)
    return OrtCausalLM(directory / "model.onnx", AutoConfig.from_pretrained(directory), threads, profile)


def _parity_key(kinds: Counter, accuracy_level: int) -> str:
    if kinds["a8w8"]:
        return "a8w8"
    return f"weight_only_acc{accuracy_level}"


@torch.inference_mode()
def ort_parity(ort_model: OrtCausalLM, reference: nn.Module, ids: torch.Tensor, key: str) -> dict:
    """Logits of the ORT model vs the simulated PyTorch model on ids (B, T): max relative (to max |ref|) and
    relative RMS differences, top-1 agreement; gated on the relative RMS by PARITY_RMS_TOLERANCE[key]."""
    a = ort_model(ids).logits.float()
    b = reference(ids.to(next(reference.parameters()).device), use_cache=False).logits.float().cpu()
    rms = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    tol = PARITY_RMS_TOLERANCE[key]
    return {"export_parity_logits_max_rel": ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item(),
            "export_parity_logits_rel_rms": rms,
            "export_parity_top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "export_parity_tol": tol, "export_parity_ok": rms <= tol}


__all__ = ["ACCURACY_LEVELS", "OPSET", "PARITY_RMS_TOLERANCE", "DequantLinear", "OrtCache", "OrtCausalLM",
           "OrtLinearA8W8", "OrtLinearNBits", "check_ort_run", "export_onnx", "export_onnxruntime", "load_ort",
           "ort_available", "ort_kind", "ort_parity", "require_ort", "swap_for_ort"]
