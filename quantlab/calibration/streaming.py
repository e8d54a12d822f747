"""Streamed block-by-block calibration: the copy being quantized holds one decoder block of its own at a time.

A run quantizes a copy of the float model, and a plain deep copy doubles the weights in memory (7 GiB more for a
1.5B model in fp32). shared_copy() copies everything outside the decoder blocks (embeddings, final norm, head) but
lets each block's tensors stay the float model's own, read-only. The block walkers (blocks.for_each_block, GPTQ,
GPTAQ, AWQ, AutoRound, any4) call enter_block() before they touch a block: the block takes copies of its tensors
(in-place writes, GPTQ's weight updates and AWQ's folded scales, then land on the copies). They call leave_block()
once the block's outputs are computed: the block's quantized layers freeze right away (packed codes and scales;
the fp32 weights are released and the heap trimmed), as convert() would do at the end. The codes are bitwise the in-memory path's
(tests/test_streaming.py); the float model's checkpoint tensors are memory-mapped by transformers, so the peak
holds the float model, one block in fp32, the frozen blocks and the calibration state.

Only methods whose every write happens inside their block walk stream (Method.streams_blocks); runs with an
extra that changes the weights before quantizing (a rotation) copy the whole model as before.

>>> q = shared_copy(model); quantize(q, make_config({"method": "gptq", "bits": 4}), calibration=windows)
"""
from __future__ import annotations

import copy
import itertools
import weakref

import torch
from torch import nn

from ..core.lifecycle import freeze_all
from ..models.arch import find_blocks
from ..util.memory import release_free_heap

_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # copy -> ids of the blocks it owns


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of model whose decoder blocks share the model's tensors until enter_block() takes them."""
    memo = {id(t): t for block in find_blocks(model) for t in itertools.chain(block.parameters(), block.buffers())}
    clone = copy.deepcopy(model, memo)
    _STREAMS[clone] = set()
    return clone


def is_streamed(model: nn.Module) -> bool:
    return model in _STREAMS


def enter_block(model: nn.Module, block: nn.Module) -> None:
    """Give `block` of a shared_copy its own copies of its tensors (a no-op for any other model, or once owned)."""
    owned = _STREAMS.get(model)
    if owned is None or id(block) in owned:
        return
    copies: dict[int, torch.Tensor] = {}  # a tensor shared by two modules of the block stays shared
    with torch.no_grad():
        for module in block.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    module._parameters[name] = copies[id(p)]
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = copies.setdefault(id(b), b.clone())
    owned.add(id(block))


def leave_block(model: nn.Module, block: nn.Module) -> None:
    """The walker is done with `block` of a shared_copy: freeze its quantized layers now (no-op otherwise)."""
    if model in _STREAMS:
        freeze_all(block)
        release_free_heap()  # else glibc keeps the released fp32 weights' pages, and RSS grows block by block
