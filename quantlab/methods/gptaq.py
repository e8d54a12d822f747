"""`gptaq`: GPTAQ (Li et al. 2025, "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric Calibration",
first released as GPTQv2), GPTQ that fits each layer to the float model's output rather than its own.

GPTQ minimises ||(W - Q) X||² with X the layer's inputs in the partly quantized model. GPTAQ minimises
||W X_float - Q X||²: the error that earlier quantized layers left in X is corrected too. Per layer it
accumulates, besides H = 2/n Σ xᵀx, the cross term dXXT = 2/n Σ (x_float - x)ᵀ x (n tokens; x_float the same
token's input in the float model), and the column loop carries the term P = alpha · triu₁(dXXT Uᵀ) U
(methods/gptq.py gptq_solve_detailed). As the reference (Intelligent-Computing-Lab-Yale/GPTAQ,
fake_quant/gptaq_utils.py): x_float comes from running each block in float on the float model's hidden states
(the float stream), x from the block with its earlier stages quantized on the quantized stream; alpha = 0.25.

asymmetric_calibration = false drops the term and the float stream: the result is `gptq`'s, bit for bit.
The grid (int, number formats, llama.cpp types), true_sequential, act_order, observer and the other knobs are
gptq's. Memory: besides GPTQ's hidden states, the float stream's (one more (1, T, C) per window) and, for the
block being quantized, its linears' float inputs (views, shared by q/k/v).

>>> cfg = make_config({"method": "gptaq", "bits": 3, "group_size": 64})
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..calibration import blocks
from ..calibration.blocks import capture_block_calls, float_weights, run_block
from ..calibration.streaming import enter_block, leave_block
from ..core.qlinear import QuantLinear
from ..core.registry import register_method
from ..models.arch import find_blocks
from .gptq import GPTQ, GPTQConfig, gptq_solve_detailed, gptq_stages


@dataclass(frozen=True)
class GPTAQConfig(GPTQConfig):
    """gptq's fields, plus alpha (the reference's scale of the asymmetric term, 0.25) and asymmetric_calibration
    (false: plain gptq, bit for bit)."""

    alpha: float = 0.25
    asymmetric_calibration: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.asymmetric_calibration, bool):
            raise ValueError(f"asymmetric_calibration must be true or false, got {self.asymmetric_calibration!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"alpha must be a number > 0 (the reference uses 0.25), got {self.alpha!r}")


class AsymmetricHessian:
    """H = 2/n Σ xᵀx and dXXT = 2/n Σ (x_float - x)ᵀ x over n token rows, as running means in fp32; the float
    inputs are given up front, one (T, C) tensor per call, in call order."""

    def __init__(self, float_inputs: list[torch.Tensor]):
        self.float_inputs, self.calls = float_inputs, 0
        self.hessian: torch.Tensor | None = None
        self.dxxt: torch.Tensor | None = None
        self.rows = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # (rows, C)
        xf = self.float_inputs[self.calls].reshape(-1, x.shape[-1]).float()
        if xf.shape != x.shape:
            raise ValueError(f"gptaq: float input {tuple(xf.shape)} does not match the quantized one {tuple(x.shape)}")
        self.calls += 1
        if self.hessian is None:
            self.hessian = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            self.dxxt = torch.zeros_like(self.hessian)
        total = self.rows + x.shape[0]
        self.hessian.mul_(self.rows / total)
        self.dxxt.mul_(self.rows / total)
        c = (2.0 / total) ** 0.5
        xs = x * c
        self.hessian.addmm_(xs.t(), xs)
        self.dxxt.addmm_((xf * c - xs).t(), xs)  # as the reference: the scaled float rows minus the scaled rows
        self.rows = total


def _float_inputs(block, layers: dict[str, QuantLinear], inputs: list, kwargs: list) -> tuple[dict, list]:
    """The float block on the float stream: each layer's inputs (one (T, C) view per window) and the block's
    outputs (the next block's float stream)."""
    seen = {name: [] for name in layers}
    handles = [layer.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(args[0].detach()))
               for name, layer in layers.items()]
    try:
        with float_weights(layers):
            outputs = run_block(block, inputs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen, outputs


@register_method
class GPTAQ(GPTQ):
    name = "gptaq"
    config_cls = GPTAQConfig

    def describe(self, config: GPTAQConfig, dtype: str = "float32") -> str:
        return super().describe(config, dtype) + ("" if config.asymmetric_calibration else " (no asym. term)")

    def calibrate(self, model, config: GPTAQConfig, batches, progress: bool = True) -> dict:
        """Blocks in order on two streams (quantized, float); returns gptaq_damp_max, gptaq_damp_raised_layers and
        gptaq_dxxt_rel (the mean over layers of ||dXXT|| / ||H||: how far the quantized inputs had drifted)."""
        if not config.asymmetric_calibration:
            row = super().calibrate(model, config, batches, progress)
            return {k.replace("gptq_", "gptaq_", 1): v for k, v in row.items()}
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        prefix = {id(m): n for n, m in model.named_modules()}
        was_training = model.training
        model.eval()
        q_inputs, block_kwargs = capture_block_calls(model, batches)
        f_inputs = q_inputs  # block 0's inputs are the embeddings, float in both
        damps, drift = [], []
        for index, block in enumerate(tqdm(find_blocks(model), desc="gptaq", leave=False, disable=not progress)):
            kwargs = block_kwargs[index]
            enter_block(model, block)
            stages = gptq_stages(block, config, model_type)
            layers = {n: block.get_submodule(n) for stage in stages for n in stage}
            float_in, f_outputs = _float_inputs(block, layers, f_inputs, kwargs)
            for layer in layers.values():
                layer.quant_enabled = False  # statistics from float weights of this and later stages
            for stage in stages:
                observed = {n: layers[n] for n in stage}
                stats = {n: AsymmetricHessian(float_in[n]) for n in stage}
                handles = [layers[n].register_forward_pre_hook(lambda m, args, n=n: stats[n].update(args[0]))
                           for n in stage]
                try:
                    blocks.observe_block(block, q_inputs, kwargs, observed)
                finally:
                    for h in handles:
                        h.remove()
                for name in stage:
                    layer, where, st = layers[name], f"{prefix[id(block)]}.{name}", stats[name]
                    if st.hessian is None:
                        raise ValueError(f"{where}: no calibration input reached this layer")
                    sol = gptq_solve_detailed(layer.weight, st.hessian, layer.spec, config.block_size, config.damp,
                                              config.act_order, where, layer.importance, config.observer,
                                              st.dxxt, config.alpha)
                    layer.weight.data.copy_(sol.q.to(layer.weight.dtype))
                    layer.fixed_qparams = sol.qparams
                    layer.quant_enabled = True
                    damps.append(sol.damp)
                    drift.append(float(st.dxxt.norm() / st.hessian.norm().clamp_min(1e-30)))
                    del stats[name].float_inputs
            q_inputs, f_inputs = run_block(block, q_inputs, kwargs), f_outputs
            leave_block(model, block)
        model.train(was_training)
        return {"gptaq_damp_max": max(damps, default=config.damp),
                "gptaq_damp_raised_layers": sum(d > config.damp for d in damps),
                "gptaq_dxxt_rel": sum(drift) / len(drift) if drift else 0.0}
