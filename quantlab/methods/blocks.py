"""Block-by-block calibration: capture the inputs of the first block once, then
walk the blocks, each seeing the outputs of the already-processed blocks before it.

Used by GPTQ (sequential layer processing) and AWQ. Memory: one hidden-state
tensor (1, T, C) per calibration sample, kept on the model's device.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..models.arch import find_blocks


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


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """Outputs of one block for every captured input."""
    return [block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs)]


def for_each_block(
    model: nn.Module, batches: Iterable[torch.Tensor],
    process: Callable[[int, nn.Module, list[torch.Tensor], list[dict]], None], desc: str = "blocks",
    progress: bool = True,
) -> None:
    """Call process(index, block, inputs, kwargs) block by block; the next block's
    inputs are this block's outputs *after* process (so later blocks see quantized earlier ones)."""
    was_training = model.training
    model.eval()
    inputs, kwargs = capture_block_inputs(model, batches)
    blocks = find_blocks(model)
    for i, block in enumerate(tqdm(blocks, desc=desc, leave=False, disable=not progress)):
        process(i, block, inputs, kwargs)
        inputs = run_block(block, inputs, kwargs)
    model.train(was_training)
