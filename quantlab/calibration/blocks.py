"""Block-by-block calibration: capture the inputs of the first block once (and the call kwargs of
each kind of block: a sliding-window layer gets its own mask and RoPE, see capture_block_calls),
then walk the blocks. Block i+1 sees either block i's outputs after it was processed
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
from ..util.checks import check_choice
from .streaming import enter_block, leave_block

NEXT_INPUTS = ("quantized", "float")


class _StopForward(Exception):
    pass


_CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "layer_past")


def block_output(out) -> torch.Tensor:
    """Decoder/encoder layers return a tensor or a tuple whose first item is the hidden state."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _layer_kinds(model: nn.Module, n_blocks: int) -> list:
    """One key per block: blocks with the same key are called with the same kwargs. transformers' `layer_types`
    (Gemma-2/3, Qwen2 with sliding windows, ...): a sliding-window layer gets its own mask and RoPE; else one kind."""
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    return list(kinds) if isinstance(kinds, (list, tuple)) and len(kinds) == n_blocks else [None] * n_blocks


@torch.no_grad()
def capture_block_calls(model: nn.Module, batches: Iterable[torch.Tensor]) -> tuple[list, list[list[dict]]]:
    """Run the model into its blocks for each batch: (hidden states entering block 0, per batch), and per block the
    call kwargs (attention mask, position embeddings, ...) per batch.

    Blocks of one kind (_layer_kinds) share the kwargs captured at the first block of that kind; the forward
    stops at the first block of the last kind (block 0 when all are alike), so the earlier blocks run in float.
    """
    blocks = find_blocks(model)
    device = next(model.parameters()).device
    kinds = _layer_kinds(model, len(blocks))
    firsts = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}  # kind -> its first block
    last = max(firsts.values())
    inputs, by_kind = [], {kind: [] for kind in firsts}
    signature = inspect.signature(blocks[0].forward)

    def grab(index, args, kw):
        kw = dict(signature.bind_partial(*args, **kw).arguments)  # positional -> named (BERT passes the mask positionally)
        kw.update(kw.pop("kwargs", {}))
        hidden = kw.pop(next(iter(signature.parameters)))
        # replaying a block must not append to a KV cache: drop caches, turn use_cache off
        kw = {k: (None if k in _CACHE_KEYS else v) for k, v in kw.items()}
        if "use_cache" in kw:
            kw["use_cache"] = False
        if index == 0:
            inputs.append(hidden)
        by_kind[kinds[index]].append(kw)
        if index == last:
            raise _StopForward

    handles = [blocks[i].register_forward_pre_hook(lambda m, a, kw, i=i: grab(i, a, kw), with_kwargs=True)
               for i in sorted(firsts.values())]
    try:
        for batch in batches:
            try:
                model(batch.to(device))
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if not inputs:
        raise ValueError("calibration set is empty (0 batches)")
    return inputs, [by_kind[kind] for kind in kinds]


def capture_block_inputs(model: nn.Module, batches: Iterable[torch.Tensor]) -> tuple[list, list[dict]]:
    """(hidden states, call kwargs) of the first block per batch: capture_block_calls for block 0 alone."""
    inputs, kwargs = capture_block_calls(model, batches)
    return inputs, kwargs[0]


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


class ModuleCalls:
    """Every call a module receives during forward passes, (args, kwargs), and its output, so the module can be
    replayed on them after its weights changed (llm-awq's module2inspect with its org_out).

    Replays stack consecutive calls of one signature along the batch dim (at most `batch_tokens` tokens per
    forward): the same per-sample math in fewer, larger ops (2-3x faster on a CPU than one call per sample).

    >>> calls = ModuleCalls(block.mlp); handles = calls.attach(); run_block(block, xs, kws)
    >>> for h in handles: h.remove()
    >>> calls.replay_mse()  # mean((org_out - out)^2) with the module as it is now
    """

    def __init__(self, module: nn.Module, batch_tokens: int = 8192):
        self.module, self.batch_tokens = module, batch_tokens
        self.calls: list[tuple[tuple, dict]] = []
        self.outputs: list[torch.Tensor] = []
        self._stacked: list[tuple[tuple, dict, torch.Tensor]] | None = None

    def attach(self) -> list:
        """Register the recording hooks; returns their handles (remove them after the pass)."""
        def pre(_, args, kwargs):
            self.calls.append((args, dict(kwargs)))

        def post(_, args, out):
            self.outputs.append(block_output(out))

        self._stacked = None
        return [self.module.register_forward_pre_hook(pre, with_kwargs=True), self.module.register_forward_hook(post)]

    def stacked(self) -> list[tuple[tuple, dict, torch.Tensor]]:
        """(args, kwargs, org_out) per replay forward: runs of stackable calls concatenated along dim 0.
        Built once; the per-call records are released then."""
        if self._stacked is None:
            runs, tokens = [], 0
            for call, out in zip(self.calls, self.outputs):
                n = out.numel() // max(out.shape[-1], 1)
                if runs and tokens + n <= self.batch_tokens and _stackable(runs[-1][-1], (call, out)):
                    runs[-1].append((call, out))
                    tokens += n
                else:
                    runs.append([(call, out)])
                    tokens = n
            self._stacked = [(merge_calls([c[0] for c, _ in run]), merge_calls([c[1] for c, _ in run]),
                              torch.cat([o for _, o in run])) for run in runs]
            self.calls, self.outputs = [], []
        return self._stacked

    @torch.no_grad()
    def replay_mse(self) -> float:
        """mean((org_out − out)²) over every recorded call and element, with the module as it is now."""
        if not self.stacked():
            raise ValueError(f"the recorded {type(self.module).__name__} was never called")
        total, count = 0.0, 0
        for args, kwargs, org in self.stacked():
            diff = (org - block_output(self.module(*args, **kwargs))).float().flatten()
            total += float(torch.dot(diff, diff))
            count += org.numel()
        return total / count


def _batch_first(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1


def same_structure(a, b) -> bool:
    """Whether two call values can be stacked: batch-first (1, ...) tensors of one shape, or equal otherwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return _batch_first(a) or torch.equal(a, b)
    if type(a) in (tuple, list) or type(b) in (tuple, list):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_structure, a, b))
    if type(a) is dict or type(b) is dict:
        return type(a) is type(b) and a.keys() == b.keys() and all(same_structure(a[k], b[k]) for k in a)
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # objects without a plain equality: never stacked
        return False


def _stackable(previous: tuple, current: tuple) -> bool:
    """Two (call, output) records whose outputs are (1, ...) tensors of one shape and whose calls match."""
    (call_a, out_a), (call_b, out_b) = previous, current
    return _batch_first(out_a) and out_a.shape == out_b.shape and same_structure(call_a, call_b)


def merge_calls(values: list):
    """Stack one argument over a run of calls: batch-first tensors concatenated, anything else taken once."""
    first = values[0]
    if _batch_first(first):
        return torch.cat(values)
    if type(first) in (tuple, list):
        return type(first)(merge_calls([v[i] for v in values]) for i in range(len(first)))
    if type(first) is dict:
        return {k: merge_calls([v[k] for v in values]) for k in first}
    return first


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """Outputs of one block for every captured input."""
    return [block_output(block(x, **kw)) for x, kw in zip(inputs, kwargs)]


class _Observed(Exception):
    """Raised inside a block once every observed module has seen its input: the rest of the forward is not needed."""


def observe_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict], modules: dict[str, nn.Module]) -> None:
    """Run the block on every input only as far as `modules` (hooked by observers already) see their inputs.

    A forward pre-hook on each module notes it; once all have run, the forward stops (GPTQ's q/k/v stage needs
    only the input norm, not attention and the MLP). The observers see exactly what a full forward shows them;
    a module the forward never reaches just lets it run to the end.
    """
    seen: set[str] = set()

    def note(name):
        seen.add(name)
        if len(seen) == len(modules):
            raise _Observed

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: note(name)) for name, m in modules.items()]
    try:
        for x, kw in zip(inputs, kwargs):
            seen.clear()
            try:
                block(x, **kw)
            except _Observed:
                pass
    finally:
        for h in handles:
            h.remove()


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
    check_choice("next_inputs", next_inputs, NEXT_INPUTS)
    was_training = model.training
    model.eval()
    inputs, block_kwargs = capture_block_calls(model, batches)
    blocks = find_blocks(model)
    for i, block in enumerate(tqdm(blocks, desc=desc, leave=False, disable=not progress)):
        kwargs = block_kwargs[i]
        enter_block(model, block)  # a streamed copy (calibration/streaming.py): the block takes its own tensors
        if next_inputs == "float":
            with float_weights(prepared_linears(block)):
                outputs = run_block(block, inputs, kwargs)
            process(i, block, inputs, kwargs)
        else:
            process(i, block, inputs, kwargs)
            outputs = run_block(block, inputs, kwargs)
        leave_block(model, block)  # a streamed copy: the block freezes now, its fp32 weights released
        inputs = outputs
    model.train(was_training)
