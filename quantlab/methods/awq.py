"""`awq`: activation-aware weight quantization (Lin et al. 2023) on an `rtn` base config, as in the AWQ
reference (llm-awq `pre_quant.run_awq`, `auto_scale.auto_scale_block`, `auto_clip.auto_clip_block`).

Per block, with float weights throughout the searches:
1. one float forward collects each linear input's mean|X| and Gram, and the calls (args, kwargs) and
   output of each group's inspected module (arch table `ScaleGroup.inspect`: the attention module for
   q/k/v, the MLP for gate/up; the consumer itself for v -> o and up -> down);
2. per smoothing group, for α in {0, 1/n, ..., (n-1)/n}: s = mean|X|^α (≥ 1e-4, / sqrt(max·min)); the
   consumers compute with Q(W·s)/s, everything else float; loss = mean((org_out − out)²) of the inspected
   module replayed on its recorded calls. Where the inspected module is the group's one consumer (v -> o,
   up -> down) that MSE is ‖(W − Q(W·s)/s) X‖² / (tokens·out), taken from the Gram of X (the same quantity,
   ~20x fewer flops than replaying the linear). The best s is folded into producer and consumers
   (smoothing.apply_scale; the float function is unchanged). α = 0 is plain RTN.
3. per quantized linear except the q/k projections (arch table `qk`): per (row, group) the ratio r in
   {1, 1 - 1/clip_grid, ...} (int(clip_max_shrink·clip_grid) values: 1 … 0.55 for 20, 0.5) whose clamp of W
   to ±max|w|·r, quantized with min-max qparams of the clamped group, gives that group's partial output the
   least error; W is clamped in place and quantized later with min-max qparams of the clamped weights.
4. the next block's inputs are this block's float outputs, computed before scaling and clipping.

Documented differences: the clip loss counts every calibration token (Gram blocks) where llm-awq
subsamples 512; the grid is the base rtn's (asymmetric ranges include 0, scales rounded to scale_dtype);
replays stack the calibration samples in batches of up to 8192 tokens where llm-awq runs all of them at
once (the same mean over every sample; float summation order differs). Computation is in the model's dtype
for the module forwards and in float32 for Q(W·s)/s, where llm-awq uses fp16 throughout. Each group's scale
is folded before the next group is searched (llm-awq searches all, then folds): the same result, since no
group of the table reads a weight that an earlier group of its block changed.

Variants (non-default values reproduce quantlab's AWQ version 1 bit for bit):
- scale_loss = "linear": Σ over the consumers of ‖W X − Q(W·s)(X / s)‖² via the Gram of X;
- clip = "minmax": per (row, group) min and max shrunk by one ratio, grid incl. 1 - clip_max_shrink, pinned
  as fixed qparams only if the whole layer's output error improves;
- clip_qk = true: q/k projections are clipped too;
- block_inputs = "quantized": the next block's inputs come from this block after quantization.

>>> cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 64}})
>>> calib = [w[None] for w in quantlab.calibration_windows(val_ids, 16, 512, seed=0)]  # (1, T) each
>>> quantlab.quantize(model, cfg, calibration=calib)["diagnostics"]["awq_alpha_mean"]
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..calibration import awq_search as search

# version 1's public numerics stay importable from here
from ..calibration.awq_search import (  # noqa: F401
    awq_scale,
    fake_quant_weight,
    output_sq_error,
    scaled_error,
    search_clip,
    search_scale,
)
from ..calibration.blocks import ModuleCalls, float_weights, for_each_block, prepared_linears, run_block
from ..calibration.smoothing import apply_scale, group_applies
from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.observers import HessianObserver, MeanAbsObserver
from ..core.qlinear import QuantLinear
from ..core.registry import Method, as_config, get_method, register_method
from ..models.arch import ScaleGroup, arch_for
from ..util.checks import check_choice, check_int
from .rtn import RTNConfig

SCALE_LOSSES = ("module", "linear")
CLIPS = ("symmetric", "minmax")
BLOCK_INPUTS = ("float", "quantized")


@dataclass(frozen=True)
class AWQConfig:
    """base: the rtn config giving bits / group_size / symmetric / scale_dtype / include / exclude
    (a dict such as {"method": "rtn", "bits": 4, "group_size": 64} is accepted).
    n_grid: α in {0, 1/n_grid, ..., (n_grid-1)/n_grid}. clip_search: also search clip ratios
    {1, 1 - 1/clip_grid, ...} (see clip_ratios) per (output row, group).
    scale_loss "module" | "linear", clip "symmetric" | "minmax", clip_qk, block_inputs "float" | "quantized":
    the reference (defaults) or quantlab's version-1 variants (module docstring).
    """

    base: RTNConfig = RTNConfig(bits=4, group_size=64)
    n_grid: int = 20
    clip_search: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    scale_loss: str = "module"
    clip: str = "symmetric"
    clip_qk: bool = False
    block_inputs: str = "float"

    def __post_init__(self):
        try:
            base = as_config(self.base, "base")
        except KeyError:
            raise ValueError(f"base must be an rtn config or a dict with method 'rtn', got {self.base!r}") from None
        if not isinstance(base, RTNConfig) or get_method(base).name != "rtn":
            name = get_method(base).name
            raise ValueError(f"base must be a weight-only rtn config (method 'rtn'), got method {name!r}")
        if base.observer != "minmax":
            raise ValueError(f"awq: base.observer {base.observer!r} is not applied (AWQ searches its own clip "
                             f"ranges: clip_search); leave the base's observer out")
        object.__setattr__(self, "base", base)
        check_int("n_grid", self.n_grid, 1, 1000)
        check_int("clip_grid", self.clip_grid, 1, 1000)
        for name in ("clip_search", "clip_qk"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.clip_max_shrink, bool) or not isinstance(self.clip_max_shrink, (int, float)) \
                or not 0 <= self.clip_max_shrink < 1:
            raise ValueError(f"clip_max_shrink must be a number in [0, 1), got {self.clip_max_shrink!r}")
        check_choice("scale_loss", self.scale_loss, SCALE_LOSSES)
        check_choice("clip", self.clip, CLIPS)
        check_choice("block_inputs", self.block_inputs, BLOCK_INPUTS)
        formats_used = {base.format} | {o.format for o in base.overrides if o.format is not None}
        if self.clip == "minmax" and formats_used != {"int"}:
            raise ValueError(f"awq: clip = \"minmax\" shrinks integer min/max ranges; format(s) "
                             f"{', '.join(sorted(formats_used - {'int'}))} take clip = \"symmetric\" (the default)")

    @property
    def clip_ratios(self) -> list[float]:
        """Ratios tried by the clip search, starting at 1: llm-awq's grid, or with clip="minmax" that grid plus
        1 - clip_max_shrink."""
        grid = search.reference_clip_ratios if self.clip == "symmetric" else search.minmax_clip_ratios
        return grid(self.clip_grid, self.clip_max_shrink)


# ---- the inspected module's output loss (scale_loss = "module") --------------------------------
# blocks.ModuleCalls records the inspected module's calls and outputs in the block's float pass

@contextmanager
def substituted_weights(layers: list[QuantLinear], weights: list[torch.Tensor]):
    """The layers' weight Parameters replaced by `weights` (no copy), the originals restored on exit."""
    originals = [layer.weight for layer in layers]
    try:
        for layer, w in zip(layers, weights):
            layer.weight = nn.Parameter(w, requires_grad=False)
        yield
    finally:
        for layer, w in zip(layers, originals):
            layer.weight = w


def search_module_scale(inspected: ModuleCalls, consumers: list[QuantLinear], x_mean_abs: torch.Tensor,
                        n_grid: int = 20) -> tuple[torch.Tensor, float, list[float]]:
    """llm-awq _search_module_scale: (s, α, loss per α), the loss the inspected module's output MSE with the
    consumers computing with Q(W·s)/s. Call it with the block's other layers in float (float_weights)."""
    def loss_of(s):
        candidates = [search.scaled_weight(c.weight, s, c.spec).to(c.weight.dtype) for c in consumers]
        with substituted_weights(consumers, candidates):
            return inspected.replay_mse()

    return search.best_alpha(loss_of, x_mean_abs, n_grid)


def inspect_name(group: ScaleGroup) -> str:
    """The module whose output judges the group's scale: `inspect`, or the group's single consumer."""
    if group.inspect is not None:
        return group.inspect
    if len(group.consumers) != 1:
        raise ValueError(f"awq: group {group.consumers} has several consumers and no inspect module")
    return group.consumers[0]


# ---- one block -----------------------------------------------------------------------------

@dataclass
class BlockResult:
    alphas: dict[str, float] = field(default_factory=dict)  # chosen α by group (its first consumer's name)
    clip_ratios: dict[str, torch.Tensor] = field(default_factory=dict)  # ratio in effect (out, n_groups) by layer


def _block_stats(block, layers, owners, inputs, kwargs, prefix, inspected) -> dict:
    """Gram and mean|x| of each distinct linear input of the block, and the inspected modules' calls and
    outputs, from one float forward."""
    stats = {name: (HessianObserver(), MeanAbsObserver()) for name in dict.fromkeys(owners.values())}

    def observe(module, args, name):
        x = args[0] if module.input_scale is None else args[0] / module.input_scale.to(args[0].dtype)
        if not torch.isfinite(x).all():
            raise ValueError(f"awq: NaN/Inf in the input activations of {prefix}{name}")
        for obs in stats[name]:
            obs.update(x)

    handles = [layers[n].register_forward_pre_hook(lambda m, a, n=n: observe(m, a, n)) for n in stats]
    for calls in inspected:
        handles += calls.attach()
    try:
        with float_weights(layers):
            run_block(block, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return stats


def _clip_layer(layer: QuantLinear, gram: torch.Tensor, config: AWQConfig) -> torch.Tensor:
    """Search and apply the layer's clip; returns the ratio in effect per (row, group)."""
    if config.clip == "minmax":
        layer.fixed_qparams, ratio = search.search_clip_minmax(layer.weight, gram, layer.spec, config.clip_ratios)
        return ratio
    ratio = search.search_clip_symmetric(layer.weight, gram, layer.spec, config.clip_ratios)
    if bool((ratio < 1).any()):  # llm-awq apply_clip: the float weight itself is clamped
        layer.weight.copy_(search.clamp_symmetric(layer.weight.float(), ratio, layer.spec.group_size))
    layer.fixed_qparams = None  # min-max qparams of the clamped weight
    return ratio


@torch.no_grad()
def awq_block(
    block: nn.Module, groups: tuple[ScaleGroup, ...], inputs: list[torch.Tensor], kwargs: list[dict],
    config: AWQConfig, prefix: str = "", qk: tuple[str, ...] = (),
) -> BlockResult:
    """AWQ on one block in place: fold the best scale of each usable group, then (clip_search) clip every
    prepared QuantLinear except the `qk` ones (unless clip_qk). Returns the chosen α and clip ratios.

    Statistics come from one pass with float weights; they stay valid while scales are folded,
    since folding leaves the float function unchanged (a group's own input becomes X / s).
    """
    layers = prepared_linears(block)
    usable = [g for g in groups if all(c in layers for c in g.consumers) and group_applies(block, g)]
    owners = {n: n for n in layers}  # a group's consumers share one input: one set of statistics
    for g in usable:
        owners.update({c: g.consumers[0] for c in g.consumers})
    # a group whose inspected module is its single consumer needs no replay: that linear's output MSE is
    # ‖ΔW X‖² / (tokens·out), computed from the Gram of X exactly as scale_loss="linear" does (~20x fewer flops)
    replayed = [g for g in usable if config.scale_loss == "module" and inspect_name(g) not in g.consumers]
    inspected = {name: ModuleCalls(block.get_submodule(name)) for name in map(inspect_name, replayed)}
    stats = _block_stats(block, layers, owners, inputs, kwargs, prefix, inspected.values())
    grams = {n: gram_obs.compute(prefix + n) for n, (gram_obs, _) in stats.items()}

    result, divisors = BlockResult(), {}
    for g in usable:
        key, consumers = g.consumers[0], [layers[c] for c in g.consumers]
        x_mean_abs = stats[key][1].compute(prefix + key)
        if g in replayed:
            with float_weights(layers):
                s, alpha, _ = search_module_scale(inspected[inspect_name(g)], consumers, x_mean_abs, config.n_grid)
        else:
            s, alpha, _ = search_scale([c.weight for c in consumers], x_mean_abs, grams[key],
                                       [c.spec for c in consumers], config.n_grid)
        apply_scale(block, g, s)
        result.alphas[prefix + key] = alpha
        divisors.update({c: s for c in g.consumers})

    if config.clip_search:  # after every fold: a linear producer's rows change when a later group is scaled
        for name, layer in layers.items():
            if name in qk and not config.clip_qk:
                continue
            gram = grams[owners[name]]
            if name in divisors:  # the input is now X / s
                gram = gram / torch.outer(divisors[name], divisors[name])
            result.clip_ratios[prefix + name] = _clip_layer(layer, gram, config)
    return result


def diagnostics(results: list[BlockResult]) -> dict:
    """Scalars for the result row: α over the scaled groups, clip ratio over the clip-searched rows×groups."""
    alphas = [a for r in results for a in r.alphas.values()]
    ratios = [t.flatten() for r in results for t in r.clip_ratios.values()]
    out = {"awq_groups": len(alphas), "awq_alpha_mean": None, "awq_alpha_min": None, "awq_alpha_max": None,
           "awq_clip_ratio_mean": None, "awq_clip_shrunk_frac": None}
    if alphas:
        out.update(awq_alpha_mean=sum(alphas) / len(alphas), awq_alpha_min=min(alphas), awq_alpha_max=max(alphas))
    if ratios:
        flat = torch.cat(ratios).double()
        out.update(awq_clip_ratio_mean=float(flat.mean()), awq_clip_shrunk_frac=float((flat < 1).double().mean()))
    return out


@register_method
class AWQ(Method):
    name = "awq"
    config_cls = AWQConfig
    needs_calibration = True
    version = 2  # 2: reference-exact defaults (module loss, symmetric clip without q/k, float block inputs)

    def streams_blocks(self, config) -> bool:
        return True  # its writes all happen in its block walk (calibration/streaming.py)

    def folds_channel_scales(self, config: AWQConfig) -> bool:
        return True

    def folds_scales_across_mlp(self, config: AWQConfig) -> bool:
        return True  # its up_proj -> down_proj group

    def prepare(self, model, config: AWQConfig) -> None:
        arch_for(model, "awq")  # an unknown model_type fails before the model is touched
        swap_in_quant_linears(model, config.base.selection, config.base.weight_spec, config.base.overrides)

    def calibrate(self, model, config: AWQConfig, batches, progress: bool = True) -> dict:
        arch = arch_for(model, "awq")
        batches = list(batches)
        tokens = sum(b.numel() for b in batches)
        if tokens == 0:
            raise ValueError(f"awq needs calibration tokens; got {len(batches)} batches holding {tokens} tokens")
        names = {id(m): n for n, m in model.named_modules()}
        results = []

        def process(index, block, inputs, kwargs):
            results.append(awq_block(block, arch["groups"], inputs, kwargs, config, prefix=f"{names[id(block)]}.",
                                     qk=arch["qk"]))

        for_each_block(model, batches, process, desc="awq", progress=progress, next_inputs=config.block_inputs)
        return diagnostics(results)

    def convert(self, model, config: AWQConfig) -> None:
        freeze_all(model)
