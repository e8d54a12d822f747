"""`checkpoint`: another tool's quantized checkpoint as one run of an experiment, scored beside quantlab's own.

    [[run]]
    name = "llmcompressor-gptq-w4a16-g64"
    method = "checkpoint"
    path = "~/.cache/quantlab/referee/llmcompressor-gptq-w4a16-g64"   # compressed-tensors, GPTQ or AWQ GEMM

The run's copy of the experiment's float model takes the checkpoint's state whole: each quantized linear becomes
the frozen QuantLinear holding the file's codes, scales, zero points and g_idx (backends/ckpt_import.py, the same
numbers as `model = "DIR"`), and every other tensor (embeddings, norms a SmoothQuant folded its scales into, float
linears, biases) takes the file's values. So the run is evaluated on the experiment's windows with the experiment's
float model as its KL reference, and one report (one leaderboard) holds other tools' checkpoints and quantlab's
runs. The checkpoint's config.json must be the experiment model's architecture (checked before any weights load).

The row records source_format, source_tool (who wrote it, from its files), source_schemes, source_notes,
source_sha256 (each safetensors file's digest: which bytes were scored) and, where one scheme covers every quantized
linear, its bits / group_size / symmetric / format / act_bits.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..backends.ckpt_import import METHODS, checkpoint_format, imported_row_fields, load_quantized_checkpoint
from ..core.lifecycle import freeze_all, quant_linears, set_submodule
from ..core.registry import Method, register_method

# the config.json fields two checkpoints of one architecture share (absent fields are not compared)
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


@dataclass(frozen=True)
class CheckpointConfig:
    """path: a folder holding a compressed-tensors, GPTQ or AWQ GEMM checkpoint (config.json's quantization_config,
    or AutoGPTQ's quantize_config.json) of the experiment's model."""

    path: str = ""

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"checkpoint: path must be the folder of a quantized checkpoint, got {self.path!r}")


def check_checkpoint_folder(path: str) -> Path:
    """The folder, expanded, if it holds a checkpoint quantlab imports (reads JSON only); else ValueError naming it.
    Checked when the run is about to be evaluated (runs/preflight.py), not when the file is parsed: an experiment
    whose peers' checkpoints are not built yet still parses (and `quantlab run --dry-run` plans it)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"checkpoint: path {path!r} is not a folder (a compressed-tensors, GPTQ or AWQ GEMM "
                         f"checkpoint is a folder with config.json and safetensors files)")
    if checkpoint_format(folder) is None:
        raise ValueError(f"checkpoint: {path!r} holds no quantization config quantlab imports (config.json's "
                         f"quantization_config.quant_method one of {', '.join(METHODS)}, or quantize_config.json)")
    return folder


def checkpoint_sha256(path: str | Path) -> str:
    """"file:sha256" of each safetensors file of the folder, sorted by name, joined by ";"."""
    parts = []
    for file in sorted(Path(path).expanduser().glob("*.safetensors")):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        parts.append(f"{file.name}:{digest.hexdigest()}")
    return ";".join(parts)


def check_same_architecture(path: str | Path, checkpoint_config, model_config) -> None:
    """The checkpoint's config against the experiment model's, field by field (SHAPE_FIELDS both have)."""
    differ = [f"{k} {getattr(checkpoint_config, k)!r} (the model's {getattr(model_config, k)!r})"
              for k in SHAPE_FIELDS if hasattr(checkpoint_config, k) and hasattr(model_config, k)
              and getattr(checkpoint_config, k) != getattr(model_config, k)]
    if differ:
        raise ValueError(f"checkpoint {str(path)!r} is not the experiment model's architecture: {'; '.join(differ)}")


@register_method
class Checkpoint(Method):
    name = "checkpoint"
    config_cls = CheckpointConfig

    def describe(self, config: CheckpointConfig, dtype: str = "float32") -> str:
        return f"checkpoint {Path(config.path).name}"

    def grid_for(self, config: CheckpointConfig) -> dict | None:
        """Unknown until the file is read: convert() reports them where one scheme covers every quantized linear."""
        return {"bits": None, "group_size": None, "symmetric": None, "format": "checkpoint"}

    def check_model_config(self, config: CheckpointConfig, model_config) -> None:
        from transformers import AutoConfig

        folder = check_checkpoint_folder(config.path)
        check_same_architecture(config.path, AutoConfig.from_pretrained(folder), model_config)

    def prepare(self, model: nn.Module, config: CheckpointConfig) -> None:
        param = next(model.parameters())
        imported, _, facts = load_quantized_checkpoint(check_checkpoint_folder(config.path), param.dtype,
                                                       param.device)
        check_same_architecture(config.path, imported.config, model.config)
        for name, layer in quant_linears(imported).items():
            set_submodule(model, name, layer)
        result = model.load_state_dict(imported.state_dict(), strict=False)
        if result.missing_keys or result.unexpected_keys:  # the same architecture: neither happens
            raise ValueError(f"checkpoint {config.path!r}: tensors that do not match the model: "
                             f"{', '.join((result.missing_keys + result.unexpected_keys)[:5])}")
        model._quantlab_checkpoint_facts = facts  # for convert's row fields

    def convert(self, model: nn.Module, config: CheckpointConfig) -> dict:
        freeze_all(model)
        facts = model._quantlab_checkpoint_facts
        del model._quantlab_checkpoint_facts
        return {**imported_row_fields(facts, model), "source_sha256": checkpoint_sha256(config.path)}
