"""Per-layer sensitivity: quantize one unit (a layer, a layer type, or a block) at a time,
everything else float, and measure how far the model moves from the float model.

Metric: KL(P_float ‖ P_unit-quantized) per token, averaged over a few windows of the
**validation** split (sensitivity drives a choice — what to keep in high precision — so it
never looks at the test split). Validation perplexity comes for free from the same logits.

Cheap by construction: the float hidden states at every block's input are computed once;
a unit whose earliest layer sits in block b replays blocks b..end from the stored input of
block b (earlier blocks are skipped), and the unit's linears are swapped for fake-quant
QuantLinears that share the float weight, then swapped back. Results are cached in a JSONL
file keyed by (model weights, windows, unit layers, their grids): a rerun is free and an
interrupted run resumes.

>>> rows = layer_sensitivity(model, make_config({"method": "rtn", "bits": 3, "group_size": 64}), windows,
...                          cache_path="reports/x.sensitivity.jsonl")
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..core.lifecycle import select_linears, set_submodule
from ..core.qlinear import QuantLinear
from ..core.registry import config_to_dict, get_method
from ..eval.perplexity import window_log_probs
from ..methods.rtn import RTNConfig
from ..models.arch import find_blocks
from ..reporting.report import scheme
from ..reporting.results import append_row, read_rows
from ..util.checks import check_choice

GRANULARITIES = ("layer", "type", "block")


@dataclass(frozen=True)
class Unit:
    """What is quantized together: one layer, all layers of one type, or all layers of one block."""

    name: str
    layers: tuple[str, ...]
    type: str  # e.g. "mlp.down_proj" (the name inside a block); "*" for a whole block
    block: int | None  # None for a type spanning blocks, or a linear outside the blocks (lm_head)


def _block_of(name: str, prefix: str) -> tuple[int | None, str]:
    """'model.layers.3.mlp.down_proj' -> (3, 'mlp.down_proj'); outside the blocks -> (None, name)."""
    if name.startswith(prefix + "."):
        index, _, rest = name[len(prefix) + 1:].partition(".")
        if index.isdigit():
            return int(index), rest
    return None, name


def make_units(model: nn.Module, config: RTNConfig, granularity: str = "layer") -> list[Unit]:
    """The units of a sensitivity sweep over the layers `config` selects, in model order."""
    check_choice("granularity", granularity, GRANULARITIES)
    blocks = find_blocks(model)
    prefix = next(n for n, m in model.named_modules() if m is blocks)
    names = [n for n, _ in select_linears(model, config.selection)]
    where = {n: _block_of(n, prefix) for n in names}
    if granularity == "layer":
        return [Unit(n, (n,), where[n][1], where[n][0]) for n in names]
    key = (lambda n: where[n][1]) if granularity == "type" else (lambda n: where[n][0])
    groups: dict[Any, list[str]] = {}
    for n in names:
        groups.setdefault(key(n), []).append(n)
    if granularity == "type":
        return [Unit(t, tuple(ls), t, None) for t, ls in groups.items()]
    return [Unit(f"{prefix}.{b}" if b is not None else ls[0], tuple(ls), "*" if b is not None else where[ls[0]][1], b)
            for b, ls in groups.items()]


def check_config(config: Any) -> RTNConfig:
    """Sensitivity quantizes layers in isolation without data: an `rtn` config (overrides allowed)."""
    if type(config) is not RTNConfig:  # exactly RTN: subclasses (gptq, hqq) round otherwise than spec_for says
        raise ValueError(f"sensitivity needs an 'rtn' config (per-layer, data-free), got method "
                         f"{get_method(config).name!r}; calibrated methods (gptq, awq) depend on every other layer")
    if config.observer != "minmax":
        raise ValueError(f"sensitivity quantizes layers with min-max ranges; observer {config.observer!r} searches "
                         f"them from data (leave it out here)")
    return config


def fingerprint_model(model: nn.Module) -> str:
    """sha256 of every parameter's bytes (in name order): the cache key's model part."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint_windows(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:16] + f"-{tuple(windows.shape)}"


def unit_key(model_fp: str, windows_fp: str, unit: Unit, config: RTNConfig) -> str:
    specs = {n: config.spec_for(n).__dict__ for n in unit.layers}
    ident = {"model": model_fp, "windows": windows_fp, "layers": specs, "quantlab_sensitivity": 1}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


class _Replay(nn.Module):
    """Stands in for the blocks before the unit: returns the stored float input of the first replayed block."""

    def __init__(self):
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden if self.hidden is not None else hidden_states


class SuffixEvaluator:
    """Float reference (log-probs, block inputs) for `windows`, then KL / nll of a model with some
    layers quantized, replaying only the blocks from the earliest touched one."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, progress: bool = True):
        self.model, self.windows = model.eval(), windows
        self.blocks = find_blocks(model)
        self.device = next(model.parameters()).device
        n_blocks = len(self.blocks)
        self.block_inputs: list[list[torch.Tensor]] = [[] for _ in range(n_blocks)]
        self.reference, self.float_nll = [], 0.0

        def grab(module, args, kwargs, index):
            self.block_inputs[index].append(args[0] if args else kwargs["hidden_states"])

        handles = [b.register_forward_pre_hook(lambda m, a, k, i=i: grab(m, a, k, i), with_kwargs=True)
                   for i, b in enumerate(self.blocks)]
        try:
            with torch.inference_mode():
                for w in tqdm(windows, desc="float reference", leave=False, disable=not progress):
                    logp = window_log_probs(self.model, w)
                    self.reference.append(logp)
                    self.float_nll += F.nll_loss(logp[:-1], w[1:].to(logp.device), reduction="sum").item()
        finally:
            for h in handles:
                h.remove()
        self.predicted = windows.shape[0] * (windows.shape[1] - 1)
        self.evaluations = 0  # how many unit evaluations ran (tests: a cached rerun runs none)

    @torch.inference_mode()
    def measure(self, start_block: int) -> dict:
        """KL / nll of the model as it is now (some layers quantized), replaying blocks start_block.."""
        saved = list(self.blocks[:start_block])
        replay = _Replay()
        for i in range(start_block):  # skipped blocks pass the hidden state through; the last one injects
            self.blocks[i] = replay if i == start_block - 1 else _Replay()
        kl, nll = 0.0, 0.0
        try:
            for i, w in enumerate(self.windows):
                replay.hidden = self.block_inputs[start_block][i] if start_block else None
                logq = window_log_probs(self.model, w)  # the ops perplexity() uses: its KL agrees exactly
                kl += F.kl_div(logq, self.reference[i], log_target=True, reduction="sum").item()
                nll += F.nll_loss(logq[:-1], w[1:].to(logq.device), reduction="sum").item()
        finally:
            for i, b in enumerate(saved):
                self.blocks[i] = b
        self.evaluations += 1
        tokens = self.windows.numel()
        return {"kl_mean": kl / tokens, "nll_mean": nll / self.predicted, "kl_tokens": tokens}


def _evaluate_unit(ev: SuffixEvaluator, unit: Unit, config: RTNConfig) -> dict:
    model = ev.model
    originals = {n: model.get_submodule(n) for n in unit.layers}
    for n, linear in originals.items():  # fake-quant sharing the float weight; nothing is modified
        set_submodule(model, n, QuantLinear.from_linear(linear, config.spec_for(n)))
    try:
        starts = [_block_of_module(ev, n) for n in unit.layers]
        return ev.measure(min(starts))
    finally:
        for n, linear in originals.items():
            set_submodule(model, n, linear)


def _block_of_module(ev: SuffixEvaluator, name: str) -> int:
    """Index of the block holding layer `name`; 0 (replay everything) for a layer outside the blocks."""
    module = ev.model.get_submodule(name)
    for i, block in enumerate(ev.blocks):
        if any(m is module for m in block.modules()):
            return i
    return 0


def read_cache(path: Path | None) -> dict[str, dict]:
    """key -> cached measurement; a line cut short by a crash is skipped, so that unit is redone."""
    return {} if path is None else {r["key"]: r for r in read_rows(path) if "key" in r}


def layer_sensitivity(
    model: nn.Module, config: Any, windows: torch.Tensor, granularity: str = "layer", cache_path=None,
    progress: bool = True, evaluator: SuffixEvaluator | Callable[[], SuffixEvaluator] | None = None,
) -> list[dict]:
    """One row per unit: name, type, block, params, the grid, kl_mean, ppl (validation), bytes.

    `windows` (n, T) must come from a non-test split (the caller states which in the rows it writes).
    `evaluator`: a SuffixEvaluator (or a factory) to share the float reference across configs.
    """
    config = check_config(config)
    cache_path = Path(cache_path) if cache_path is not None else None
    units = make_units(model, config, granularity)
    model_fp, windows_fp = fingerprint_model(model), fingerprint_windows(windows)
    cache = read_cache(cache_path)
    cfg = config_to_dict(config)
    rows, ev = [], evaluator
    for unit in tqdm(units, desc=f"sensitivity {scheme(cfg, '')}", leave=False, disable=not progress):
        key = unit_key(model_fp, windows_fp, unit, config)
        if key not in cache:
            if not isinstance(ev, SuffixEvaluator):
                ev = ev() if callable(ev) else SuffixEvaluator(model, windows, progress)
            metrics = _evaluate_unit(ev, unit, config)
            cache[key] = {"key": key, **metrics, "float_nll_mean": ev.float_nll / ev.predicted}
            if cache_path is not None:
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                append_row(cache_path, cache[key])
        rows.append(_row(model, unit, config, cfg, cache[key], granularity))
    return rows


def _row(model, unit: Unit, config: RTNConfig, cfg: dict, metrics: dict, granularity: str) -> dict:
    params = sum(model.get_submodule(n).weight.numel() for n in unit.layers)
    nbytes = sum(QuantLinear.from_linear(model.get_submodule(n), config.spec_for(n)).storage_bytes()
                 for n in unit.layers)
    return {
        "unit": unit.name, "type": unit.type, "block": unit.block, "granularity": granularity,
        "layers": len(unit.layers), "params": params, "candidate": scheme(cfg, ""),
        "bits": config.bits, "group_size": config.group_size, "symmetric": config.symmetric,
        "format": config.format, "quant_bytes": nbytes, "bits_per_weight": 8 * nbytes / params,
        "kl_mean": metrics["kl_mean"], "ppl": math.exp(metrics["nll_mean"]),
        "ppl_float": math.exp(metrics["float_nll_mean"]), "kl_tokens": metrics["kl_tokens"],
        "config": json.dumps(cfg, sort_keys=True),
    }


def validation_windows(tokenizer, dataset: str = "wikitext2", split: str = "validation", seq_len: int = 512,
                       windows: int = 2, data_dir=None, cache_dir=None, bos_id: int | None = None,
                       ) -> tuple[torch.Tensor, str]:
    """The first `windows` non-overlapping windows of a non-test split (each starting with bos_id, if given),
    and its source description."""
    from ..models.data import eval_windows, load_token_ids

    if split == "test":
        raise ValueError("sensitivity on the 'test' split is not allowed: it chooses the assignment that is "
                         "then evaluated on test; use 'validation'")
    ids, source = load_token_ids(dataset, split, tokenizer, data_dir, cache_dir)
    return eval_windows(ids, seq_len, windows, bos_id=bos_id), source


def sweep(model: nn.Module, configs: list[Any], windows: torch.Tensor, granularity: str = "layer",
          cache_path=None, progress: bool = True) -> list[dict]:
    """layer_sensitivity for several candidate configs, sharing one float reference (built only if needed)."""
    shared: list[SuffixEvaluator] = []

    def evaluator() -> SuffixEvaluator:
        if not shared:
            shared.append(SuffixEvaluator(model, windows, progress))
        return shared[0]

    rows = []
    for config in configs:
        rows += layer_sensitivity(model, config, windows, granularity, cache_path, progress, evaluator)
    return rows
