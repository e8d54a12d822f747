"""Rotations that move activation outliers out of the way before quantization (QuaRot, Ashkboos et al. 2024;
SpinQuant, Liu et al. 2024), folded into the weights so the float model computes the same function.

For a pre-norm decoder with RMSNorm (Llama family), with Q orthogonal:
- R1, the residual stream: every norm's weight is folded into the linears it feeds (W <- W diag(w), w <- 1), so
  RMSNorm(x Q) = RMSNorm(x) Q (RMSNorm without a weight only divides by ||x||). Then the embedding (E <- E Q),
  the linears reading the stream (q/k/v, gate/up, lm_head: W <- W Q) and the ones writing to it (o_proj,
  down_proj: W <- Qᵀ W, b <- b Q) are rotated. A tied embedding is untied first: the embedding and the head then
  hold different matrices (rows say `rotation_untied_head`; weight bytes grow by one vocab x hidden matrix).
- R2 (`r2`), per attention head: v_proj's outputs and o_proj's inputs are rotated by a head_dim Hadamard, one
  block per head (attention mixes tokens, never channels, so this folds exactly, also with grouped KV heads).
- `o_proj_hadamard` (QuaRot's online Hadamard across heads, on by default): an online Hadamard on o_proj's whole
  input (x <- x H / sqrt(n), n = heads x head_dim) and W_o <- W_o H / sqrt(n), so o_proj's input is mixed across
  heads, not only within each (R2). QuaRot applies a head-count Hadamard online after R2 (its full Hadamard then
  factors as heads x head_dim), which needs a Hadamard of order n_heads; SmolLM2 has 9 heads, so the full
  n-wide Hadamard runs online instead (the same mixing across heads; R2 before it is then redundant but harmless).
  `o_proj_hadamard = false` is quantlab's first variant (within-head R2 only), kept as a named option.
- R4 (`r4`): an online Hadamard on down_proj's input (x <- x H / sqrt(n), a fast Walsh-Hadamard transform in the
  forward, as a forward pre-hook that stays on the layer through quantization) and W_down <- W_down H / sqrt(n).
  Activation quantizers of down_proj see the rotated input.

kind "hadamard" (QuaRot): R1 = diag(random +-1) H / sqrt(n), seeded; R2 likewise per head; R4 the plain H / sqrt(n).
kind "random": Haar-random orthogonal R1 and R2 (R4 stays a Hadamard: online it must be fast).
kind "spinquant": R1 and one R2 per layer learned by Cayley SGD against the run's activation quantization
(transforms/spinquant.py; `steps`, `lr`), then folded as the Hadamards are.
Folding runs in float64, then casts back to the weights' dtype.

scope "online" (a named variant, for any architecture): no folding through norms; every linear except the output
head gets an online Hadamard on its input and W <- W H / sqrt(n). This is what a post-LN encoder (BERT) allows:
its LayerNorm subtracts the mean, has a bias, and its output also feeds the residual, so R1 cannot pass through it;
the price is one fast Walsh-Hadamard transform per linear per forward.

    from quantlab.transforms.rotation import RotationConfig, rotate_model
    rotate_model(model, RotationConfig(kind="hadamard", seed=0))   # logits unchanged (fp32 round-off)
    quantize(model, make_config({"method": "dynamic", "act_bits": 4, "base": {"method": "gptq", "bits": 4}}), ...)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.lifecycle import linearize_conv1d
from ..models.arch import find_blocks, rotation_facts
from ..util.checks import check_choice, check_int
from .hadamard import factor_order, hadamard_matrix, hadamard_transform, random_orthogonal, random_signs

KINDS = ("hadamard", "random", "spinquant")
SCOPES = ("residual", "online")


@dataclass(frozen=True)
class RotationConfig:
    """kind: "hadamard" (randomized Hadamard, QuaRot) or "random" (Haar orthogonal); seed: the random signs or
    matrix; r2: per-head rotation of v_proj / o_proj; r4: online Hadamard on down_proj's input; o_proj_hadamard:
    online Hadamard on o_proj's input, across heads (QuaRot; false: quantlab's first, within-head-only variant);
    steps, lr, windows_per_step: kind "spinquant"'s Cayley SGD: the reference's 100 steps at lr 1.5, each on 8
    windows of 2048 tokens (1 per GPU on 8 GPUs); here each step averages the gradient of windows_per_step
    calibration windows."""

    kind: str = "hadamard"
    seed: int = 0
    r2: bool = True
    r4: bool = True
    scope: str = "residual"
    o_proj_hadamard: bool = True
    steps: int = 100
    lr: float = 1.5
    windows_per_step: int = 1

    def __post_init__(self):
        check_choice("rotation kind", self.kind, KINDS)
        check_choice("rotation scope", self.scope, SCOPES)
        if self.scope == "online" and self.kind != "hadamard":
            raise ValueError(f"rotation scope 'online' runs a fast Hadamard in every forward; kind {self.kind!r} "
                             f"is not supported with it (use kind = \"hadamard\")")
        check_int("rotation seed", self.seed, 0)
        check_int("rotation steps", self.steps, 1)
        check_int("rotation windows_per_step", self.windows_per_step, 1)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"rotation lr must be a number > 0 (SpinQuant's is 1.5), got {self.lr!r}")
        if self.kind == "spinquant" and (self.scope != "residual" or not self.r2):
            raise ValueError("rotation kind 'spinquant' learns R1 and R2: it needs scope = \"residual\" and r2 = true")
        for field in ("r2", "r4", "o_proj_hadamard"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"rotation {field} must be true or false, got {getattr(self, field)!r}")

    def describe(self) -> str:
        if self.scope == "online":
            return "rot online hadamard (every linear input)"
        parts = ["R1"] + (["R2"] if self.r2 else []) + (["R4"] if self.r4 else []) + (
            ["o_proj online"] if self.o_proj_hadamard else [])
        per_step = f" x {self.windows_per_step} windows" if self.windows_per_step != 1 else ""
        learned = f" ({self.steps} steps{per_step})" if self.kind == "spinquant" else ""
        return f"rot {self.kind} {'+'.join(parts)}{learned}"

    @property
    def online_hadamards(self) -> bool:
        """Whether a Hadamard runs online in the forward (a PyTorch hook real kernels do not run)."""
        return self.r4 or self.o_proj_hadamard or self.scope == "online"

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "seed": self.seed, "r2": self.r2, "r4": self.r4}
        out |= {"scope": self.scope} if self.scope != "residual" else {}  # run keys of residual runs stay
        # always written for residual rotations: rows stored before it existed lack it and ran without it
        # (extras/rotation.py parse_stored), so both variants now get new run keys
        out |= {"o_proj_hadamard": self.o_proj_hadamard} if self.scope == "residual" else {}
        if self.kind != "spinquant":
            return out
        # windows_per_step only where it is not 1: the run keys of rows stored before it existed stay
        return out | {"steps": self.steps, "lr": self.lr} | (
            {"windows_per_step": self.windows_per_step} if self.windows_per_step != 1 else {})


class OnlineHadamard:
    """Forward pre-hook: the layer's input x becomes x H / sqrt(n) (fast Walsh-Hadamard transform)."""

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (hadamard_transform(args[0]),) + tuple(args[1:])


def has_online_rotation(module: nn.Module) -> bool:
    return any(isinstance(h, OnlineHadamard) for h in module._forward_pre_hooks.values())


def _orthogonal(n: int, config: RotationConfig, seed: int) -> torch.Tensor:
    """The n x n float64 rotation Q of this kind (x -> x Q)."""
    if config.kind == "spinquant":
        raise ValueError("rotation kind 'spinquant' folds learned matrices: pass learn_rotations()'s result")
    if config.kind == "random":
        return random_orthogonal(n, seed)
    return random_signs(n, seed)[:, None] * hadamard_matrix(n).to(torch.float64) / n ** 0.5


def _check_float(model: nn.Module) -> None:
    from ..core.qlinear import QuantLinear

    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if quantized:
        raise ValueError(f"rotation: rotate the float model before quantizing it ({quantized[0]} is already a "
                         f"QuantLinear)")
    if getattr(model, "quantlab_rotation", None) is not None:
        raise ValueError("rotation: this model is already rotated")


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


def _fold_norm_into(norm: nn.Module, linears: list[nn.Linear], q: torch.Tensor, name: str) -> None:
    """W <- (W diag(w)) Q for each consumer, then w <- 1."""
    if getattr(norm, "bias", None) is not None:
        raise ValueError(f"rotation: {name} has a bias (a LayerNorm, not an RMSNorm); only RMSNorm folds")
    w = norm.weight.detach().to(torch.float64)
    for lin in linears:
        _set(lin.weight, (lin.weight.detach().to(torch.float64) * w[None, :]) @ q)
    norm.weight.data.fill_(1.0)


def _rotate_output(lin: nn.Linear, q: torch.Tensor) -> None:
    """A linear writing to the residual stream: W <- Qᵀ W, b <- b Q."""
    _set(lin.weight, q.T @ lin.weight.detach().to(torch.float64))
    if lin.bias is not None:
        _set(lin.bias, lin.bias.detach().to(torch.float64) @ q)


def _untie_head(model: nn.Module, head: nn.Linear, embed: nn.Embedding) -> bool:
    if head.weight is not embed.weight and head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    model.config.tie_word_embeddings = False  # save/load and tie_weights() keep them apart
    return True


def _rotate_heads(attn: nn.Module, facts: dict, qh: torch.Tensor, n_heads: int, n_kv: int) -> None:
    """R2: v_proj rows per KV head <- Qhᵀ rows; o_proj columns per head <- columns Qh."""
    v, o = attn.get_submodule(facts["v"]), attn.get_submodule(facts["o"])
    hd = qh.shape[0]
    wv = v.weight.detach().to(torch.float64).reshape(n_kv, hd, -1)
    _set(v.weight, torch.einsum("dk,hdi->hki", qh, wv).reshape(n_kv * hd, -1))
    if v.bias is not None:
        _set(v.bias, (v.bias.detach().to(torch.float64).reshape(n_kv, hd) @ qh).reshape(-1))
    wo = o.weight.detach().to(torch.float64).reshape(o.weight.shape[0], n_heads, hd)
    _set(o.weight, torch.einsum("ohd,dk->ohk", wo, qh).reshape(o.weight.shape[0], n_heads * hd))


@torch.no_grad()
def _rotate_online(model: nn.Module, config: RotationConfig) -> dict:
    """scope "online": an online Hadamard on the input of every linear but the output head, folded into W."""
    linearize_conv1d(model)  # GPT-2's Conv1D layers are rotated (and later quantized) as nn.Linear
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and m is not head]
    if not linears:
        raise ValueError(f"rotation: {type(model).__name__} has no nn.Linear layers to rotate")
    for name, lin in linears:
        try:
            factor_order(lin.in_features)
        except ValueError as e:
            raise ValueError(f"rotation: {name} in_features = {lin.in_features}: {e}") from None
    for _, lin in linears:
        n = lin.in_features
        _set(lin.weight, lin.weight.detach().to(torch.float64) @ (hadamard_matrix(n).to(torch.float64) / n ** 0.5))
        lin.register_forward_pre_hook(OnlineHadamard())
    model.quantlab_rotation = config
    return {"rotation": config.describe(), "rotation_seed": config.seed, "rotation_untied_head": False,
            "rotation_online_layers": len(linears)}


def check_rotatable(config: RotationConfig, model_config) -> dict:
    """The rotation facts of a residual-scope rotation for a model, from its Hugging Face config alone (no weights:
    runs/preflight.py asks before loading), or a ValueError: no facts for its model_type, or a size with no
    Hadamard matrix (random rotations need one only for R4's online Hadamard)."""
    facts = rotation_facts(model_config)
    hidden, heads = model_config.hidden_size, model_config.num_attention_heads
    sizes = {"hidden_size": hidden} | (
        {"head_dim": getattr(model_config, "head_dim", None) or hidden // heads} if config.r2 else {}) | (
        {"intermediate_size": model_config.intermediate_size} if config.r4 else {}) | (
        {"attention width (heads x head_dim)": heads * (getattr(model_config, "head_dim", None) or hidden // heads)}
        if config.o_proj_hadamard else {})
    for what, n in sizes.items():
        if config.kind != "random" or what in ("intermediate_size", "attention width (heads x head_dim)"):
            try:
                factor_order(n)
            except ValueError as e:
                raise ValueError(f"rotation: {what} = {n}: {e}") from None
    return facts


@torch.no_grad()
def rotate_model(model: nn.Module, config: RotationConfig, learned=None) -> dict:
    """Rotate a float model in place: Llama family R1 (+ R2, R4) folded, or scope "online" on any model; returns
    facts for the result row. The model computes the same logits afterwards (to float round-off); quantize it next.
    learned: kind "spinquant"'s matrices (transforms/spinquant.py LearnedRotations: R1 and one R2 per block).
    """
    _check_float(model)
    if config.scope == "online":
        return _rotate_online(model, config)
    facts = check_rotatable(config, model.config)
    cfg = model.config
    hidden = cfg.hidden_size
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
    inter = cfg.intermediate_size
    if (config.kind == "spinquant") != (learned is not None):
        raise ValueError("rotation: learned matrices go with kind 'spinquant' and only with it")
    q1 = learned.r1 if learned is not None else _orthogonal(hidden, config, config.seed)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = _untie_head(model, head, embed)
    _set(embed.weight, embed.weight.detach().to(torch.float64) @ q1)
    _fold_norm_into(model.get_submodule(facts["final_norm"]), [head], q1, facts["final_norm"])
    qh = None if not config.r2 or learned is not None else _orthogonal(head_dim, config, config.seed + 1)
    q4 = hadamard_matrix(inter).to(torch.float64) / inter ** 0.5 if config.r4 else None
    for i, block in enumerate(find_blocks(model)):
        for norm_name, consumers in facts["norm_to_linears"]:
            _fold_norm_into(block.get_submodule(norm_name), [block.get_submodule(c) for c in consumers], q1,
                            f"block {i} {norm_name}")
        for name in facts["out_linears"]:
            _rotate_output(block.get_submodule(name), q1)
        if qh is not None or learned is not None:
            _rotate_heads(block, facts, qh if learned is None else learned.r2[i], n_heads, n_kv)
        if q4 is not None:
            _rotate_input_online(block.get_submodule(facts["down"]), q4)
        if config.o_proj_hadamard:
            o = block.get_submodule(facts["o"])
            _rotate_input_online(o, hadamard_matrix(o.in_features).to(torch.float64) / o.in_features ** 0.5)
    model.quantlab_rotation = config
    n_blocks = len(find_blocks(model))
    return {"rotation": config.describe(), "rotation_seed": config.seed, "rotation_untied_head": untied,
            "rotation_online_layers": n_blocks * (int(config.r4) + int(config.o_proj_hadamard))}


def _rotate_input_online(lin: nn.Linear, h: torch.Tensor) -> None:
    """W <- W H and the input x <- x H online (H orthogonal: the product is unchanged)."""
    _set(lin.weight, lin.weight.detach().to(torch.float64) @ h)
    lin.register_forward_pre_hook(OnlineHadamard())
