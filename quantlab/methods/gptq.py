"""`gptq`: GPTQ (Frantar et al. 2022), layer-wise second-order weight quantization.

For each linear, with H = 2/n Σ xᵀx from calibration inputs, quantize columns one by
one and push each column's error onto the not-yet-quantized columns through the
inverse Hessian (upper Cholesky factor), with lazy block updates. Blocks are
processed in order, so each sees inputs from already-quantized earlier blocks;
within a block, `true_sequential` quantizes the table's stages (q/k/v, o,
gate/up, down) one after another.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..calibration import blocks
from ..calibration.blocks import for_each_block
from ..core import formats
from ..core.clipping import CLIP_SEARCHES, ClipSearch, normalized_importance, search_qparams
from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.observer_hooks import attach_shared_input_observers
from ..core.observers import HessianObserver
from ..core.primitives import QParams, code_range
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import Method, register_method
from ..models.arch import ARCH
from ..util.checks import check_int
from ..util.device import single_threaded
from .rtn import RTNConfig, observer_suffix

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQConfig(RTNConfig):
    """RTN's grid (bits, group_size, symmetric, scale_dtype, include, exclude) plus GPTQ's solver knobs.

    observer "mse" / "imatrix_mse": each group's range (fitted when GPTQ reaches its first column, on the
    error-updated weights) is the clip search of core/clipping.py instead of min-max; imatrix_mse weighs each
    column by diag(H) / 2, the mean x² of its input over the calibration tokens."""

    block_size: int = 128  # columns per lazy batch update
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    act_order: bool = False  # columns in order of decreasing diag(H); groups stay contiguous (static groups)
    true_sequential: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_int("block_size", self.block_size, 1)
        if self.double_quant:
            raise ValueError("gptq: double_quant needs every absmax of a layer at once, but GPTQ sets group scales "
                             "column by column; use method = \"rtn\" for NF4 with double quantization")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp!r}")


def _upper_cholesky_of_inverse(h: torch.Tensor, damp: float, where: str) -> tuple[torch.Tensor, float]:
    """(U, damp used) with Uᵀ U = (H + λI)⁻¹, λ = damp·mean(diag H); damp grows ×10 on failure (logged)."""
    mean_diag = torch.diag(h).mean()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(6):
        try:
            lower = torch.linalg.cholesky(h + damp * mean_diag * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True), damp
        except torch.linalg.LinAlgError:
            log.warning("%s: Cholesky failed with damp=%g; retrying with damp=%g", where, damp, damp * 10)
            damp *= 10
    raise ValueError(f"{where}: Hessian is not positive definite even with damp={damp / 10:g}")


class GPTQSolution(NamedTuple):
    q: torch.Tensor  # (out, in) weights on the grid
    qparams: QParams  # scales / zeros (out, n_groups)
    damp: float  # the damping fraction finally used (> the configured one when Cholesky needed retries)


@torch.no_grad()
def gptq_solve(
    w: torch.Tensor, h: torch.Tensor, spec: WeightSpec, block_size: int = 128, damp: float = 0.01,
    act_order: bool = False, where: str = "layer",
) -> tuple[torch.Tensor, QParams]:
    """Quantize W (out, in) against Hessian H (in, in). Returns (Q on the grid, qparams (out, n_groups)).

    Pure: inputs are not modified. With H = I it reduces exactly to RTN. gptq_solve_detailed also
    returns the damping used.

    >>> q, p = gptq_solve(layer.weight, 2 * x.T @ x / len(x), WeightSpec(4, 64))
    """
    solution = gptq_solve_detailed(w, h, spec, block_size, damp, act_order, where)
    return solution.q, solution.qparams


@torch.no_grad()
def gptq_solve_detailed(
    w: torch.Tensor, h: torch.Tensor, spec: WeightSpec, block_size: int = 128, damp: float = 0.01,
    act_order: bool = False, where: str = "layer", importance: torch.Tensor | None = None,
    clip: str = "minmax", dxxt: torch.Tensor | None = None, alpha: float = 0.25,
) -> GPTQSolution:
    """gptq_solve, plus the damping it finally used (for the row's diagnostics). importance (in,): a llama.cpp
    type's quant_weights (imatrix row), used where its quantizer fits each block's scales. clip: the range rule
    of integer grids ("minmax", or a search of core/clipping.py: "mse", "imatrix_mse" weighted by diag(H) / 2).

    dxxt (in, in): GPTAQ's asymmetric term, 2/n Σ (x_float - x)ᵀ x over the calibration tokens (x: this layer's
    inputs in the quantized model, x_float: in the float model). Then, as the GPTAQ reference (gptaq_utils.py
    fasterquant): P = alpha · triu₁(dxxt Uᵀ) U, with U the upper Cholesky factor of H⁻¹ and triu₁ the strictly upper
    triangle; each column's update of the block's later columns subtracts err·U[i, :] - w_i·P[i, :] (w_i read
    before its own update), and the lazy update of later blocks subtracts Err·U - W1·P with W1 the block's columns
    after its loop (their quantized values), as the reference does. dxxt None: plain GPTQ, bit for bit.

    >>> sol = gptq_solve_detailed(w, h, WeightSpec(4, 64)); sol.damp > 0.01   # True if Cholesky retried
    """
    if spec.ggml is not None and act_order:
        raise ValueError(f"{where}: act_order needs a column order (g_idx) that llama.cpp's {spec.format} blocks "
                         f"cannot store; leave act_order out")
    if not torch.isfinite(h).all():
        raise ValueError(f"{where}: Hessian has NaN/Inf entries")
    if clip != "minmax" and spec.fmt is not None:
        raise ValueError(f"{where}: clip search {clip!r} works on integer grids, not {spec.format!r}")
    w, h = w.detach().clone().float(), h.detach().clone().float()
    n_cols = w.shape[1]
    dead = torch.diag(h) == 0  # columns no calibration input ever reached
    search = None if clip == "minmax" else CLIP_SEARCHES[clip]
    col_imp = normalized_importance(torch.diag(h) / 2) if clip == "imatrix_mse" else None  # mean x² per column
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    g = spec.group_size or n_cols
    tensor_amax = w.abs().amax()  # NVFP4's tensor scale stays that of the whole (original) weight
    static = _range_qparams(w, spec, search, col_imp, spec.group_size, tensor_amax)  # per channel, or act_order's
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(n_cols, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    hinv, damp_used = _upper_cholesky_of_inverse(h, damp, where)
    asym = None if dxxt is None else _gptaq_term(dxxt, dead, perm, hinv, alpha)
    if spec.ggml is not None:
        q, raw = _ggml_columns(w, hinv, spec.ggml, importance, block_size, asym)
        return GPTQSolution(q, QParams(torch.empty(0), None, {"raw": raw}), damp_used)
    dynamic = spec.group_size is not None and not act_order
    scales, zeros = static.scale.clone(), None if static.zero is None else static.zero.clone()
    qmin, qmax = code_range(spec.bits, spec.symmetric)
    group_of = (perm // g).tolist()  # each (permuted) column's group in the original column order
    q_all = torch.zeros_like(w)
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        w1, err1 = w[:, i1:i2].clone(), torch.zeros(w.shape[0], i2 - i1, device=w.device)
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % g == 0:  # group params from the error-updated weights of the group's columns
                cols = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :g]
                p = _range_qparams(cols, spec, search, None if col_imp is None else col_imp[col:col + g], g,
                                   tensor_amax)
                scales[:, col // g] = p.scale[:, 0]
                if zeros is not None:
                    zeros[:, col // g] = p.zero[:, 0]
            if i == 0 or col % g == 0 or act_order:
                group = group_of[col]
                s = scales[:, group].float()
                z = torch.zeros_like(s) if zeros is None else zeros[:, group].float()
            if spec.fmt is not None:  # a number format: the column on its grid with the group's scale
                pcol = formats.with_scales(s[:, None], static, spec.fmt)
                q = formats.format_fake_quantize(w1[:, i:i + 1], pcol, spec.fmt, None, ste=False)[:, 0]
            else:  # the same float ops as primitives.quantize/dequantize, inlined for speed: bitwise equal results
                q = (torch.clamp(torch.round(w1[:, i] / s) + z, qmin, qmax) - z) * s
            q_all[:, col] = q
            err = (w1[:, i] - q) / hinv[col, col]
            _update_block(w1, i, err, hinv[col, col:i2], None if asym is None else asym[col, col:i2])
            err1[:, i] = err
        _update_rest(w, w1, err1, hinv, asym, i1, i2)
    inverse = torch.argsort(perm)
    p = QParams(scales, zeros) if spec.fmt is None else formats.with_scales(scales, static, spec.fmt)
    return GPTQSolution(q_all[:, inverse], p, damp_used)


def _range_qparams(w: torch.Tensor, spec: WeightSpec, search: ClipSearch | None, imp: torch.Tensor | None,
                   group_size: int | None, tensor_amax: torch.Tensor) -> QParams:
    """The grid of w's groups: the spec's min-max rule, or the clip search (integer grids)."""
    if search is None:
        return spec.qparams(w, tensor_amax)
    return search_qparams(w, spec.bits, group_size, spec.symmetric, search, imp, spec.torch_scale_dtype)


def _gptaq_term(dxxt: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor, hinv: torch.Tensor,
                alpha: float) -> torch.Tensor:
    """GPTAQ's P = alpha · ((dXXT Uᵀ) strictly upper) U, in the solver's column order (U: hinv)."""
    d = dxxt.detach().clone().float()
    d[:, dead] = 0.0
    d = d[perm][:, perm]
    return alpha * ((d @ hinv.T).triu_(diagonal=1)) @ hinv


def _update_block(w1: torch.Tensor, i: int, err: torch.Tensor, hrow: torch.Tensor,
                  prow: torch.Tensor | None) -> None:
    """Push column i's error onto the block's columns i.. (GPTQ's rank-1 update; GPTAQ subtracts w_i·P too)."""
    if prow is None:
        w1[:, i:].addr_(err, hrow, alpha=-1)
    else:  # the reference's one expression, w1[:, i] read before the update
        w1[:, i:] -= torch.outer(err, hrow) - torch.outer(w1[:, i], prow)


def _update_rest(w: torch.Tensor, w1: torch.Tensor, err1: torch.Tensor, hinv: torch.Tensor,
                 asym: torch.Tensor | None, i1: int, i2: int) -> None:
    """The lazy update of the columns after the block."""
    if asym is None:
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    else:
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:] - w1 @ asym[i1:i2, i2:]


def _ggml_columns(w: torch.Tensor, hinv: torch.Tensor, t, importance: torch.Tensor | None,
                  block_size: int, asym: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's column loop on a llama.cpp type's grid -> (Q (out, in), its GGUF bytes (out, in / block * size)).

    When a column opens a block, the type's own quantizer fits that block's scales and mins on the error-updated
    weights (as GPTQModel does for q4_k); each column then takes the nearest level of its position's grid
    (levels * scale + offset, which is the type's dequantization exactly), and the block is stored with the codes
    GPTQ chose (repack)."""
    rows, n_cols = w.shape
    b = t.block
    raw = torch.empty(rows, n_cols // b, t.type_size, dtype=torch.uint8, device=w.device)
    levels = t.levels.to(w.device)
    q_all = torch.zeros_like(w)
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        w1, err1 = w[:, i1:i2].clone(), torch.zeros(rows, i2 - i1, device=w.device)
        for i in range(i2 - i1):
            col = i1 + i
            j = col % b
            if j == 0:  # fit the block on the error-updated weights of its columns
                block = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :b].contiguous()
                imp = None if importance is None else importance[col:col + b].float().expand(rows, b).contiguous()
                with single_threaded(w.device):  # the ported quantizer: small ops, faster on one thread
                    fitted = t.quantize(block, imp)  # (rows, type_size): one block per row
                    scale, offset = t.grid(fitted)  # (rows, b)
                codes = torch.empty(rows, b, dtype=torch.uint8, device=w.device)
            candidates = levels[None, :] * scale[:, j:j + 1] + offset[:, j:j + 1]  # (rows, n_levels)
            code = (candidates - w1[:, i:i + 1]).abs().argmin(dim=1)
            q = candidates.gather(1, code[:, None])[:, 0]
            codes[:, j] = code.to(torch.uint8)
            if j == b - 1:
                raw[:, col // b] = t.repack(fitted, codes)
            q_all[:, col] = q
            err = (w1[:, i] - q) / hinv[col, col]
            _update_block(w1, i, err, hinv[col, col:i2], None if asym is None else asym[col, col:i2])
            err1[:, i] = err
        _update_rest(w, w1, err1, hinv, asym, i1, i2)
    return q_all, raw.reshape(rows, -1)


def gptq_stages(block, config: GPTQConfig, model_type: str | None) -> list[list[str]]:
    """Names (relative to the block) of selected QuantLinear layers, in quantization stages."""
    layers = [n for n, m in block.named_modules() if isinstance(m, QuantLinear)]
    if not config.true_sequential or model_type not in ARCH:
        return [layers] if layers else []  # a block with nothing selected needs no Hessian pass
    stages = [[c for c in group.consumers if c in layers] for group in ARCH[model_type]["groups"]]
    stages = [s for i, s in enumerate(stages) if s and s not in stages[:i]]
    rest = [n for n in layers if not any(n in s for s in stages)]
    return stages + ([rest] if rest else [])


@register_method
class GPTQ(Method):
    name = "gptq"
    config_cls = GPTQConfig
    needs_calibration = True

    def streams_blocks(self, config) -> bool:
        return True  # its writes all happen in its block walk (calibration/streaming.py)

    def describe(self, config: GPTQConfig, dtype: str = "float32") -> str:
        return super().describe(config, dtype) + observer_suffix(config)

    def prepare(self, model, config: GPTQConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec, config.overrides)

    def calibrate(self, model, config: GPTQConfig, batches, progress: bool = True) -> dict:
        """Blocks in order; returns gptq_damp_max (the largest damping any layer finally used) and
        gptq_damp_raised_layers (how many layers needed more than config.damp for Cholesky)."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        prefix = {id(m): n for n, m in model.named_modules()}
        damps = []

        def process(index, block, inputs, kwargs):
            stages = gptq_stages(block, config, model_type)
            layers = {n: block.get_submodule(n) for stage in stages for n in stage}
            for layer in layers.values():
                layer.quant_enabled = False  # Hessians from float weights of this and later stages
            for stage in stages:
                observed = {n: layers[n] for n in stage}
                # layers handed one input (q/k/v, gate/up) share its Hessian: computed once, the same bits
                observers, remove = attach_shared_input_observers(observed, lambda n: HessianObserver())
                try:  # stops each forward once the stage's layers have their inputs (the rest is not needed)
                    blocks.observe_block(block, inputs, kwargs, observed)
                finally:
                    remove()
                for name in stage:
                    layer, where = layers[name], f"{prefix[id(block)]}.{name}"
                    sol = gptq_solve_detailed(layer.weight, observers[name].compute(where), layer.spec,
                                              config.block_size, config.damp, config.act_order, where,
                                              layer.importance, config.observer)
                    layer.weight.data.copy_(sol.q.to(layer.weight.dtype))
                    layer.fixed_qparams = sol.qparams
                    layer.quant_enabled = True
                    damps.append(sol.damp)

        for_each_block(model, batches, process, desc="gptq", progress=progress)
        return {"gptq_damp_max": max(damps, default=config.damp),
                "gptq_damp_raised_layers": sum(d > config.damp for d in damps)}

    def convert(self, model, config: GPTQConfig) -> None:
        freeze_all(model)
