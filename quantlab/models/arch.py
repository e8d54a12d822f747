"""Architecture facts in one table keyed by config.model_type.

For smoothing methods (SmoothQuant, AWQ): which module's output feeds which
linears inside a decoder/encoder block, so a per-channel scale s can be folded
into the producer (output channels / s) and the consumers (input columns * s)
leaving the float model unchanged. Names are relative to one block.

`qk`: the linears whose outputs meet in the attention product q·kᵀ. AWQ's clip search
leaves them unclipped (llm-awq auto_clip_block: the error through the bmm is not the
per-layer output error the clip search measures).

`producer=None` means there is no foldable producer inside the block (e.g. a
post-LN BERT block, whose LayerNorm output also feeds the residual): a method
then applies the scale explicitly at the consumers' input (QuantLinear.input_scale).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ScaleGroup:
    producer: str | None  # norm or linear whose output channels are the consumers' input channels
    consumers: tuple[str, ...]  # linears sharing that input
    kind: str = "norm"  # "norm" (weight[, bias] per channel), "linear" (out rows), "explicit"
    # AWQ judges a scale by the output of this module (llm-awq's module2inspect): the attention or MLP
    # module the consumers sit in; None = the consumers' own output (one consumer: the reference's default)
    inspect: str | None = None
    # what the consumers read: a normalization's output ("norm": SmoothQuant's groups) or a linear's output,
    # possibly through an activation ("linear": v -> o, up -> down, fc1 -> fc2; SmoothQuant's option)
    input_from: str = "norm"
    # a "norm" producer multiplies by (norm_offset + weight): Gemma's RMSNorm computes x̂·(1 + w), so a scale
    # folds into (1 + w), not into w (smoothing.apply_scale)
    norm_offset: float = 0.0

    def __post_init__(self):
        if self.kind not in ("norm", "linear", "explicit"):
            raise ValueError(f"ScaleGroup kind {self.kind!r} unknown; known: norm, linear, explicit")
        if self.input_from not in ("norm", "linear"):
            raise ValueError(f"ScaleGroup input_from {self.input_from!r} unknown; known: norm, linear")
        if self.norm_offset and self.kind != "norm":
            raise ValueError(f"ScaleGroup norm_offset {self.norm_offset} needs kind 'norm', got {self.kind!r}")


_LLAMA = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), inspect="self_attn"),
    # only when v and o shapes match (no GQA)
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "linear", input_from="linear"),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp"),
    # gate(x) * up(x): scaling up's rows scales down's input
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "linear", input_from="linear"),
)

_LLAMA_QK = ("self_attn.q_proj", "self_attn.k_proj")

# Gemma-3 (gemma3_text): sandwich norms. input_layernorm feeds q/k/v; post_attention_layernorm normalizes the
# attention's OUTPUT (o_proj's, before the residual add), so the MLP's input norm is pre_feedforward_layernorm;
# post_feedforward_layernorm normalizes down_proj's output. An RMSNorm mixes all channels, so no scale passes
# from o_proj / down_proj outputs through the post-norms (none is needed: no group reads them). Its RMSNorm
# computes x̂·(1 + w): scales fold into (1 + w) (norm_offset). q_norm / k_norm (per-head RMSNorm after q_proj /
# k_proj) stop any per-channel scale on q/k outputs, so no group starts there. v -> o holds where the shapes
# match (group_applies: not under GQA, e.g. Gemma-3-270M's 4 query heads on 1 KV head). GeGLU: gelu(gate)·up,
# so scaling up's rows scales down's input. Sliding-window and global layers differ only in their attention
# mask and RoPE, which transformers passes per layer (calibration/blocks.py replays each layer with its own).
_GEMMA3 = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), inspect="self_attn",
               norm_offset=1.0),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "linear", input_from="linear"),
    ScaleGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), inspect="mlp", norm_offset=1.0),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "linear", input_from="linear"),
)

# rotations (transforms/rotation.py): which norm feeds which linears, which linears write to the residual stream
_LLAMA_ROTATION = {
    "final_norm": "model.norm",
    "norm_to_linears": (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
    "out_linears": ("self_attn.o_proj", "mlp.down_proj"),
    "v": "self_attn.v_proj", "o": "self_attn.o_proj", "down": "mlp.down_proj",
}

ARCH: dict[str, dict] = {
    "llama": {"blocks": "model.layers", "groups": _LLAMA, "qk": _LLAMA_QK, "rotation": _LLAMA_ROTATION},
    "mistral": {"blocks": "model.layers", "groups": _LLAMA, "qk": _LLAMA_QK, "rotation": _LLAMA_ROTATION},
    "qwen2": {"blocks": "model.layers", "groups": _LLAMA, "qk": _LLAMA_QK, "rotation": _LLAMA_ROTATION},
    "gemma3_text": {
        "blocks": "model.layers", "groups": _GEMMA3, "qk": _LLAMA_QK,
        # no "rotation": R1 would have to pass the post-attention / post-feedforward norms, whose per-channel
        # (1 + w) sits between o_proj / down_proj and the residual stream
        "rotation_why": "Gemma-3's post-attention and post-feedforward RMSNorms scale o_proj's and down_proj's "
                        "outputs per channel by (1 + w) before the residual add, so a residual rotation (R1) "
                        "cannot be folded through them",
    },
    "opt": {
        "blocks": "model.decoder.layers",
        "qk": ("self_attn.q_proj", "self_attn.k_proj"),
        "groups": (
            ScaleGroup("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       inspect="self_attn"),
            ScaleGroup("self_attn.v_proj", ("self_attn.out_proj",), "linear", input_from="linear"),
            ScaleGroup("final_layer_norm", ("fc1",)),
            ScaleGroup("fc1", ("fc2",), "linear", input_from="linear"),  # ReLU(x / s) = ReLU(x) / s for s > 0
        ),
    },
    "gpt2": {  # Conv1D layers: nn.Linear by prepare time (core.lifecycle.linearize_conv1d)
        "blocks": "transformer.h",
        # c_attn holds q, k and v (rows [q; k; v]): all of it is left unclipped, as llm-awq's auto_clip skips
        # a fused Wqkv (MPT); its v rows alone feed attn.c_proj, so that scale stays explicit
        "qk": ("attn.c_attn",),
        "groups": (
            ScaleGroup("ln_1", ("attn.c_attn",), inspect="attn"),  # pre-LN: ln_1 feeds only the attention
            ScaleGroup(None, ("attn.c_proj",), "explicit", input_from="linear"),
            ScaleGroup("ln_2", ("mlp.c_fc",), inspect="mlp"),
            ScaleGroup(None, ("mlp.c_proj",), "explicit", input_from="linear"),  # GELU in between: not foldable
        ),
    },
    "bert": {
        "blocks": "encoder.layer",
        "qk": ("attention.self.query", "attention.self.key"),
        "groups": (
            # post-LN: the LayerNorm output also feeds the residual, so scales stay explicit at the consumers
            ScaleGroup(None, ("attention.self.query", "attention.self.key", "attention.self.value"), "explicit",
                       inspect="attention.self"),
            ScaleGroup("attention.self.value", ("attention.output.dense",), "linear", input_from="linear"),
            ScaleGroup(None, ("intermediate.dense",), "explicit", inspect="intermediate"),
            # GELU in between: not foldable into intermediate
            ScaleGroup(None, ("output.dense",), "explicit", input_from="linear"),
        ),
    },
}


def _model_type(model_or_config) -> str | None:
    """config.model_type of a model, or model_type of a Hugging Face config itself (checks that load no weights)."""
    return getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)


def arch_for(model_or_config, needed_by: str | None = None) -> dict:
    """The table entry for the model_type of a model (model.config) or of a Hugging Face config alone, or an error
    naming it, the supported ones and (if given) the method that needs the entry.

    >>> arch_for(model, "awq")["groups"]
    >>> arch_for(load_model_config("smollm2-135m"), "awq")   # the same entry, no weights loaded
    """
    model_type = _model_type(model_or_config)
    if model_type not in ARCH:
        who = f"{needed_by}: " if needed_by else ""
        raise ValueError(f"{who}model_type {model_type!r} has no architecture entry; supported: "
                         f"{', '.join(sorted(ARCH))} (entries live in ARCH, quantlab/models/arch.py)")
    return ARCH[model_type]


def rotation_facts(model_or_config) -> dict:
    """The rotation facts (transforms/rotation.py) of a model's or a config's model_type, or an error naming it, why
    it has none and the supported ones.

    >>> rotation_facts(load_model_config("smollm2-135m"))["final_norm"]
    'model.norm'
    """
    model_type = _model_type(model_or_config)
    facts = ARCH.get(model_type, {}).get("rotation")
    if facts is None:
        known = sorted(k for k, v in ARCH.items() if v.get("rotation"))
        why = ARCH.get(model_type, {}).get("rotation_why", "pre-norm RMSNorm decoders only")
        raise ValueError(f"rotation: model_type {model_type!r} has no rotation facts ({why}); supported: "
                         f"{', '.join(known)}; scope = \"online\" works on any model")
    return facts


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks (decoder or encoder layers).

    Known model types use the table; otherwise the first ModuleList whose length is
    config.num_hidden_layers.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ARCH:
        path = ARCH[model_type]["blocks"]
        prefix = f"{model.base_model_prefix}."  # "model." for Llama/OPT, "transformer." for GPT-2
        candidates = [path, path.removeprefix("model."), path.removeprefix(prefix), prefix + path]
        for candidate in candidates:  # a CausalLM nests the base model; a bare base model does not
            try:
                return model.get_submodule(candidate)
            except AttributeError:
                continue
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for _, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n:
            return m
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} (model_type {model_type!r})")
