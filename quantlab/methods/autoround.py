"""`autoround`: AutoRound / SignRound (Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient
Descent for the Quantization of LLMs"), as intel/auto-round (`autoround.py` quant_block, `wrapper.py`,
`data_type/int.py`) does it on the integer grid.

Block by block, every selected linear gets a rounding offset V (one per weight, init 0, kept in [-0.5, 0.5])
and, with enable_minmax_tuning, per-group factors on the clipped range (init 1, kept in [0.5, 1]):
    lo = min(w_group, 0)·min_factor, hi = max(w_group, 0)·max_factor -> scale, zero as rtn's min-max rule
    q = clamp(round(W / scale + V) + zero)           (straight-through round, also on the zero point)
The block's output with these weights is fitted to the float block's output on float inputs (MSE) by
signed gradient descent, p -= lr·sign(grad), the lr decaying linearly to 0 over `iters` steps, each step on
`batch_size` seeded random windows. The iterate with the lowest loss is kept; iteration 0 (V = 0, factors 1)
is exactly rtn min-max (full_range: the reference's min-max on its grid), so the kept one is never worse than
that start on the loss it was chosen by. The layers then hold that grid weight and its qparams as fixed
qparams (as GPTQ hands over), so convert() packs the integer codes and the frozen forward equals the
fake-quant forward bit for bit.

next_inputs = "quantized" (the reference's enable_quanted_input): each block trains on the outputs of the
quantized blocks before it; "float": on the float model's hidden states.

Differences from the reference (listed in docs/methods.md): by default the grid is rtn's (symmetric: codes
-2^(b-1)..2^(b-1)-1, scale amax / (2^(b-1)-1), so code -2^(b-1) goes unused; asymmetric zero points clamped
to the code range; scales at least the scale dtype's smallest normal number). full_range = true (needs
symmetric = true) takes the reference's int_sym grid (data_type/int.py quant_tensor_sym) instead: the end of
larger magnitude after the factors, max(-lo, hi), over 2^(b-1) as a signed scale (positive where -lo is the
larger, negative otherwise, ties included), so that end lands on code -2^(b-1) and all 2^b codes are used;
|scale| >= 1e-5 after rounding to the scale dtype (its q_scale_thresh). Factors are clamped to [0.5, 1] (the
paper's range; the code uses [0, 1]) and V to [-0.5, 0.5] after each step (the reference bounds V only
through its lr schedule); computation is in float32 unless dtype = "bfloat16" (below); when batch_size < the number of
windows, the kept iterate is compared with iteration 0 once more on every window and iteration 0 is kept if
it is better there (the reference compares minibatch losses only). Not ported: norm/bias tuning, activation
tuning, dynamic_max_gap, gradient accumulation, nblocks > 1, the `lm_head` / layers outside blocks.

dtype = "bfloat16" (a variant, named as one): the tuning loop's block forwards and backwards run under
torch.autocast(bfloat16), so its matmuls take bf16 inputs and accumulate in float32, and the loss is taken in float32;
the weights, V, the factors, the grid arithmetic, the block inputs and the float targets stay float32. The reference's
default (amp = True) on a device with native bf16, which includes CPUs with AVX512_BF16 / AMX, goes further: it casts
the model itself to bf16, so its cached inputs, its targets and the weights it rounds are bf16 values. Where the CPU
has no native bf16 the reference turns amp off; here a warning says the run will be slower, and it runs as asked.

compile = true (a variant of the numerics, named as one): during the tuning loop the block's forward runs under
torch.compile (inductor), the grid arithmetic traced into it, as auto-round compiles its block forward (its
enable_torch_compile, on by default). Its values are the eager ones up to the order of float sums, so a compiled run's
sign steps can part from an eager run's where a gradient is near 0. Each block checks itself at iteration 0: the
compiled loss and gradients against an eager forward and backward on the same windows (COMPILE_TOLERANCE), and
iteration 0 takes the eager ones. A block that disagrees is tuned eager, the run warns, and the row counts the compiled
blocks (a ragged last group is computed apart when compiled: autoround_grid.autoround_qdq). The full-set check and the
handed-over weights are always eager, and so are blocks whose windows differ in shape (no stacking). It needs
torch.compile to work here (a C++ compiler on CPU, triton on CUDA): calibrate() tries it before any block is tuned.

>>> cfg = make_config({"method": "autoround", "bits": 4, "group_size": 64, "iters": 200})
>>> quantlab.quantize(model, cfg, calibration=calib)["diagnostics"]["autoround_loss_reduction_mean"]
"""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from ..calibration import blocks
from ..calibration.blocks import (
    NEXT_INPUTS,
    block_output,
    capture_block_calls,
    float_weights,
    prepared_linears,
    run_block,
)
from ..calibration.streaming import enter_block, leave_block
from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.qlinear import WeightSpec
from ..core.registry import LayerSelection, Method, register_method
from ..models.arch import find_blocks
from ..util.checks import check_choice, check_int
from .autoround_compile import COMPILE_TOLERANCE, check_compile, compile_disagreement, compiled_forward
from .autoround_state import TunedLayers

log = logging.getLogger(__name__)

TUNING_DTYPES = ("float32", "bfloat16")  # the tuning loop's compute dtype (bfloat16: under torch.autocast)


def _check_lr(field: str, value) -> None:
    ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not ok or (value is not None and value <= 0):
        raise ValueError(f"{field} must be a number > 0 or omitted (default {'1/iters' if field == 'lr' else 'lr'}), "
                         f"got {value!r}")


@dataclass(frozen=True)
class AutoRoundConfig:
    """Integer grid (bits 2..8, group_size None = per output channel, symmetric, scale_dtype None = float16) and
    AutoRound's knobs: iters signed-gradient steps per block (0: the min-max start, rtn), lr None = 1/iters, minmax_lr
    None = lr, batch_size windows per step (capped at the calibration count), next_inputs "quantized" | "float",
    seed for the window sampling; dtype "float32" | "bfloat16" (the tuning loop's matmuls under bf16 autocast, a
    variant: see the module docstring); compile: the block forward under torch.compile while tuning (module
    docstring); include / exclude name globs as rtn. full_range (needs symmetric): auto-round's
    own symmetric grid, a signed scale max(|min|, max)/2^(b-1) over all 2^b codes; false: rtn's, amax/(2^(b-1)-1).
    The reference's default W4A16 grid is bits = 4, group_size = 128, symmetric = true, full_range = true."""

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = False
    scale_dtype: str | None = None
    iters: int = 200
    lr: float | None = None
    minmax_lr: float | None = None
    batch_size: int = 8
    enable_minmax_tuning: bool = True
    full_range: bool = False
    next_inputs: str = "quantized"
    seed: int = 0
    dtype: str = "float32"
    compile: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)
        check_choice("dtype", self.dtype, TUNING_DTYPES)
        for field in ("symmetric", "enable_minmax_tuning", "full_range", "compile"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be true or false, got {getattr(self, field)!r}")  # noqa: TRY004
        if self.full_range and not self.symmetric:
            raise ValueError("full_range = true is auto-round's symmetric grid and needs symmetric = true; got "
                             "symmetric = false (set symmetric = true, or leave full_range out for the asymmetric grid)")
        object.__setattr__(self, "scale_dtype", self.weight_spec.scale_dtype)  # validates bits, group_size too
        check_int("iters", self.iters, 0)
        check_int("batch_size", self.batch_size, 1)
        check_int("seed", self.seed, 0)
        _check_lr("lr", self.lr)
        _check_lr("minmax_lr", self.minmax_lr)
        check_choice("next_inputs", self.next_inputs, NEXT_INPUTS)

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, self.symmetric, self.scale_dtype)

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)

    @property
    def round_lr(self) -> float:
        """The rounding offsets' initial lr: lr, or 1/iters as the reference."""
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)

    @property
    def factor_lr(self) -> float:
        return self.minmax_lr if self.minmax_lr is not None else self.round_lr


class BlockResult(NamedTuple):
    rtn_loss: float | None  # MSE vs the float block's output at iteration 0 (rtn); None when iters = 0
    best_loss: float | None  # that of the kept iterate (<= rtn_loss)
    best_iter: int
    fell_back: bool  # batch_size < windows and rtn was better on every window than the kept iterate
    compiled: bool = False  # compile = true, and the block's compiled forward passed its check (tuned compiled)


def _compute(block: nn.Module, dtype: str):
    """The tuning loop's forward context: bf16 autocast on the block's device, or nothing for float32."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(next(block.parameters()).device.type, dtype=getattr(torch, dtype))


def _loss(block: nn.Module, inputs: list, targets: list, kwargs: list[dict], idx: list[int], stack: bool,
          backward: bool, dtype: str = "float32") -> float:
    """MSE over the windows `idx` (stacked into one forward when their shapes allow), the block's forward in
    `dtype` (autocast) and the error in float32; backward() when asked."""
    count = sum(targets[i].numel() for i in idx)
    chunks = [idx] if stack else [[i] for i in idx]
    total = 0.0
    for chunk in chunks:
        x, kw = torch.cat([inputs[i] for i in chunk]), blocks.merge_calls([kwargs[i] for i in chunk])
        target = torch.cat([targets[i] for i in chunk])
        with torch.set_grad_enabled(backward):
            with _compute(block, dtype):
                out = block_output(block(x, **kw))
            loss = (out.float() - target.float()).pow(2).sum() / count
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total


def _full_loss(block, tuned: TunedLayers, values: list, inputs: list, targets: list, kwargs: list[dict],
               stack: bool, dtype: str) -> float:
    tuned.load(values)
    return _loss(block, inputs, targets, kwargs, list(range(len(inputs))), stack, backward=False, dtype=dtype)


def autoround_block(block: nn.Module, inputs: list, targets: list, kwargs: list[dict], config: AutoRoundConfig,
                    generator: torch.Generator) -> BlockResult | None:
    """Tune the block's prepared QuantLinears so that block(inputs) ≈ targets; None when it has none."""
    layers = prepared_linears(block)
    if not layers:
        return None
    tuned = TunedLayers(layers, config.enable_minmax_tuning, config.full_range)
    rtn = best = tuned.snapshot()
    rtn_loss = best_loss = None
    best_iter, fell_back, n = 0, False, len(inputs)
    batch = min(config.batch_size, n)
    stack = all(blocks.same_structure((inputs[0], kwargs[0]), (inputs[i], kwargs[i])) for i in range(n))
    compiled = config.compile and stack and config.iters > 0
    with tuned.forwards(block), (compiled_forward(block) if compiled else nullcontext()) as eager_forward:
        for i in range(config.iters):
            idx = sorted(torch.randperm(n, generator=generator)[:batch].tolist())
            loss = _loss(block, inputs, targets, kwargs, idx, stack, backward=True, dtype=config.dtype)
            if i == 0 and compiled:
                compiled, loss = _check_block_compiled(block, eager_forward, tuned, loss, inputs, targets, kwargs,
                                                       idx, config.dtype)
            if i == 0:
                rtn_loss = best_loss = loss
            elif loss < best_loss:
                best, best_loss, best_iter = tuned.snapshot(), loss, i
            decay = 1.0 - i / config.iters  # the reference's LinearLR(1 -> 0 over iters)
            tuned.sign_step(config.round_lr * decay, config.factor_lr * decay)
        if config.iters and batch < n:  # the losses above are minibatch ones: compare on every window
            rtn_loss, best_loss = (_full_loss(block, tuned, values, inputs, targets, kwargs, stack, config.dtype)
                                   for values in (rtn, best))
            if best_loss > rtn_loss:
                best, best_loss, best_iter, fell_back = rtn, rtn_loss, 0, True
    tuned.load(best)
    tuned.apply()
    return BlockResult(rtn_loss, best_loss, best_iter, fell_back, compiled)


def _check_block_compiled(block, eager_forward, tuned: TunedLayers, loss: float, inputs, targets, kwargs, idx,
                          dtype: str) -> tuple[bool, float]:
    """Iteration 0 under compile = true, just after the compiled forward and backward: the same windows through
    eager_forward, compared by compile_disagreement. Iteration 0 keeps the eager loss and gradients either way, so
    it is rtn's exactly, as in an eager run. (True, that loss): the block goes on compiled; (False, that loss): the
    block's forward stays eager for the rest of its loop (logged here; calibrate() warns once per run)."""
    grads = tuned.take_grads()
    compiled_forward, block.forward = block.forward, eager_forward
    eager_loss = _loss(block, inputs, targets, kwargs, idx, True, backward=True, dtype=dtype)
    off = compile_disagreement(loss, grads, eager_loss, [p.grad for p in tuned.params()])
    ok = all(off[k] <= COMPILE_TOLERANCE[k] for k in COMPILE_TOLERANCE)
    if ok:
        block.forward = compiled_forward
    else:
        log.info("autoround compile = true: a block's compiled forward disagrees with its eager one at iteration 0 "
                 "(loss %.2g relative, gradient %.2g; tolerance %s): that block is tuned eager", off["loss"],
                 off["grad"], COMPILE_TOLERANCE)
    return ok, eager_loss


def diagnostics(results: list[BlockResult | None], config: AutoRoundConfig) -> dict:
    """Row scalars: mean relative loss reduction vs rtn over the tuned blocks, the worst best/rtn ratio, mean best
    iteration, blocks where rtn was kept after the full-set check."""
    done = [r for r in results if r is not None and r.rtn_loss is not None]
    out = {"autoround_iters": config.iters, "autoround_dtype": config.dtype, "autoround_compile": config.compile,
           "autoround_compiled_blocks": sum(r.compiled for r in done), "autoround_blocks": len(done),
           "autoround_loss_reduction_mean": None,
           "autoround_loss_ratio_max": None, "autoround_best_iter_mean": None,
           "autoround_rtn_kept_blocks": sum(r.fell_back for r in done)}
    if done:
        ratios = [r.best_loss / r.rtn_loss if r.rtn_loss > 0 else 1.0 for r in done]
        out.update(autoround_loss_reduction_mean=sum(1 - r for r in ratios) / len(ratios),
                   autoround_loss_ratio_max=max(ratios),
                   autoround_best_iter_mean=sum(r.best_iter for r in done) / len(done))
    return out


def _warn_if_slow_dtype(model, dtype: str) -> None:
    """bfloat16 on a CPU whose bf16 matmuls are emulated (QAT's check, util.device.bf16_slowdown): warn, run as asked."""
    device = next(model.parameters()).device
    if dtype != "bfloat16" or device.type != "cpu":
        return
    from ..util import device as device_util

    ratio = device_util.bf16_slowdown(device)
    if ratio >= device_util.SLOW_BF16_RATIO:
        log.warning("autoround dtype 'bfloat16' on a CPU without AVX512_BF16 or AMX: its bf16 matmuls are emulated "
                    "(%.1fx the fp32 time) and run slower than float32 (the reference turns amp off there); running "
                    "as asked", ratio)


@register_method
class AutoRound(Method):
    name = "autoround"
    config_cls = AutoRoundConfig
    needs_calibration = True

    def streams_blocks(self, config) -> bool:
        return True  # its writes all happen in its block walk (calibration/streaming.py)

    def describe(self, config: AutoRoundConfig, dtype: str = "float32") -> str:
        """The grid's text, "+ full_range" on auto-round's own symmetric grid: "w4 g128 sym + full_range"."""
        return super().describe(config, dtype) + (" + full_range" if config.full_range else "")

    def prepare(self, model, config: AutoRoundConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec)

    def calibrate(self, model, config: AutoRoundConfig, batches, progress: bool = True) -> dict:
        """Blocks in order, with two streams of hidden states: float (the targets, and the next float inputs) and
        quantized (the training inputs with next_inputs = "quantized")."""
        _warn_if_slow_dtype(model, config.dtype)
        if config.compile and config.iters:
            check_compile(next(model.parameters()).device.type)
        was_training = model.training
        model.eval()
        inputs, block_kwargs = capture_block_calls(model, batches)  # kwargs per block: sliding-window layers differ
        q_inputs, generator, results = inputs, torch.Generator().manual_seed(config.seed), []
        for block, kwargs in zip(tqdm(find_blocks(model), desc="autoround", leave=False, disable=not progress),
                                 block_kwargs):
            enter_block(model, block)
            with float_weights(prepared_linears(block)):
                targets = run_block(block, inputs, kwargs)  # the float block on float inputs
            train_inputs = q_inputs if config.next_inputs == "quantized" else inputs
            results.append(autoround_block(block, train_inputs, targets, kwargs, config, generator))
            if config.next_inputs == "quantized":
                q_inputs = run_block(block, q_inputs, kwargs)
            leave_block(model, block)
            inputs = targets
        model.train(was_training)
        out = diagnostics(results, config)
        if config.compile and out["autoround_compiled_blocks"] < out["autoround_blocks"]:
            log.warning("autoround compile = true: %d of %d blocks were tuned eager: their compiled forward disagreed "
                        "with the eager one at iteration 0 (tolerance %s), or their windows differ in shape",
                        out["autoround_blocks"] - out["autoround_compiled_blocks"], out["autoround_blocks"],
                        COMPILE_TOLERANCE)
        return out

    def convert(self, model, config: AutoRoundConfig) -> None:
        freeze_all(model)
