"""Block-by-block calibration: capture the inputs of the first block once, then
walk the blocks. Block i+1 sees either block i's outputs after it was processed
(next_inputs="quantized": GPTQ, errors of earlier blocks carried forward) or its
float outputs from before (next_inputs="float": the float model's hidden states,
as llm-awq's run_awq computes `inps = layer(inps)` before scaling and clipping).

Used by GPTQ (sequential layer processing) and AWQ. Memory: one hidden-state
tensor (1, T, C) per calibration sample, kept on the model's device.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.qlinear import QuantLinear
from ..models.arch import find_blocks

NEXT_INPUTS = ("quantized", "float")


class _StopForward(Exception):
    pass


_CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "layer_past")


def block_output(out) -> torch.Tensor:
    """Decoder/encoder layers return a tensor or a tuple whose first item is the hidden state."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_block_inputs(model: nn.Module, batches: Iterable[torch.Tensor]) -> tuple[list, list[dict]]:
    """Run the model up to its first block for each batch: (hidden states, call kwargs) per batch."""
    blocks = find_blocks(model)
    device = next(model.parameters()).device
    inputs, kwargs = [], []

    signature = inspect.signature(blocks[0].forward)

    def grab(module, args, kw):
        kw = dict(signature.bind_partial(*args, **kw).arguments)  # positional -> named (BERT passes the mask positionally)
        kw.update(kw.pop("kwargs", {}))
        hidden = kw.pop(next(iter(signature.parameters)))
        # replaying a block must not append to a KV cache: drop caches, turn use_cache off
        kw = {k: (None if k in _CACHE_KEYS else v) for k, v in kw.items()}
        if "use_cache" in kw:
            kw["use_cache"] = False
        inputs.append(hidden)
        kwargs.append(kw)
        raise _StopForward

    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            try:
                model(batch.to(device))
            except _StopForward:
                pass
    finally:
        handle.remove()
    if not inputs:
        raise ValueError("calibration set is empty (0 batches)")
    return inputs, kwargs


@contextmanager
def float_weights(layers: dict[str, QuantLinear]):
    """Prepared QuantLinears compute with their float weights inside the block (restored on exit)."""
    before = {name: layer.quant_enabled for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.quant_enabled = False
        yield
    finally:
        for name, layer in layers.items():
            layer.quant_enabled = before[name]


def prepared_linears(block: nn.Module) -> dict[str, QuantLinear]:
    """The block's QuantLinears that still hold a float weight (not frozen), by name relative to the block."""
    return {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear) and not m.frozen}


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """Outputs of one block for every captured input."""
    return [block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs)]


def for_each_block(
    model: nn.Module, batches: Iterable[torch.Tensor],
    process: Callable[[int, nn.Module, list[torch.Tensor], list[dict]], None], desc: str = "blocks",
    progress: bool = True, next_inputs: str = "quantized",
) -> None:
    """Call process(index, block, inputs, kwargs) block by block.

    next_inputs="quantized": the next block's inputs are this block's outputs *after* process
    (later blocks see quantized earlier ones). "float": its outputs *before* process, with its
    prepared QuantLinears computing in float, so every block sees the float model's hidden states.

    >>> for_each_block(model, calib, lambda i, block, xs, kws: ..., next_inputs="float")
    """
    if next_inputs not in NEXT_INPUTS:
        raise ValueError(f"unknown next_inputs {next_inputs!r}; known: {', '.join(NEXT_INPUTS)}")
    was_training = model.training
    model.eval()
    inputs, kwargs = capture_block_inputs(model, batches)
    blocks = find_blocks(model)
    for i, block in enumerate(tqdm(blocks, desc=desc, leave=False, disable=not progress)):
        if next_inputs == "float":
            with float_weights(prepared_linears(block)):
                outputs = run_block(block, inputs, kwargs)
            process(i, block, inputs, kwargs)
        else:
            process(i, block, inputs, kwargs)
            outputs = run_block(block, inputs, kwargs)
        inputs = outputs
    model.train(was_training)
