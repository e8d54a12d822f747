"""The QAT training loop: AdamW, warm-up + cosine, clipping, accumulation, autocast, checkpoints.

Trains only what quantization touches: the float weights (and biases) of QuantLinear layers
and any learned quantization parameters (LSQ scales / zero points). Embeddings, norms and the
float lm_head stay fixed, so the rest of the model is the same as the PTQ model's. A caller may choose
other parameters (`params=`): LoRA trains only its adapters over a frozen quantized base (methods/lora.py).

Data: (N, T) token windows (the validation split, never test), cut into seq_len chunks and
visited in a seeded order (one fresh permutation per epoch, a pure function of seed and epoch,
so a resumed run sees the same batches). Loss: ce_weight * next-token CE + kd_weight *
KL(teacher || student) per token (Hinton et al. 2015, temperature T, scaled by T²).

>>> stats = train(model, windows, TrainSettings(steps=16, lr=1e-5), teacher=float_model)
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..core.qlinear import QuantLinear
from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .distributed import all_mean, rank_world, run_data_parallel, shard
from .modules import LearnedStaticActQuant, LearnedWeightQuant
from .settings import TrainSettings

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf; the message names the step and the kept checkpoint."""


def training_windows(data: torch.Tensor | Iterable[torch.Tensor], seq_len: int) -> torch.Tensor:
    """(N, T) windows, or an iterable of (T,) / (1, T) tensors -> (M, seq_len), each window cut into chunks."""
    if not isinstance(data, torch.Tensor):
        rows = [torch.as_tensor(w).reshape(-1) for w in data]
        if not rows:
            raise ValueError("training data is empty (0 windows)")
        if len({r.numel() for r in rows}) > 1:
            raise ValueError(f"training windows must all have the same length, got {sorted({r.numel() for r in rows})}")
        data = torch.stack(rows)
    if data.dim() != 2 or data.shape[0] == 0:
        raise ValueError(f"training data must be (N, T) token windows with N >= 1, got shape {tuple(data.shape)}")
    n, t = data.shape
    if t < seq_len:
        raise ValueError(f"training windows have {t} tokens, fewer than seq_len={seq_len}")
    k = t // seq_len
    return data[:, : k * seq_len].reshape(n * k, seq_len).long()


def window_index(position: int, n: int, seed: int, _cache: dict | None = None) -> int:
    """Which of n windows the `position`-th sample (counting over all epochs) is: a seeded permutation per epoch."""
    epoch, i = divmod(position, n)
    cache = {} if _cache is None else _cache
    if epoch not in cache:
        cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return int(cache[epoch][i])


def parameter_groups(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """(weights, quantizer params) to train, by name: QuantLinear weights/biases; LSQ scales and zeros."""
    weights, qparams = {}, {}
    quant_modules = (LearnedWeightQuant, LearnedStaticActQuant)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and not module.frozen and module.weight is not None:
            weights[f"{name}.weight"] = module.weight
            if module.bias is not None:
                weights[f"{name}.bias"] = module.bias
        elif isinstance(module, quant_modules):
            for pname, p in module.named_parameters(recurse=False):
                qparams[f"{name}.{pname}"] = p
    if not weights:
        raise ValueError("the model has no unfrozen QuantLinear layers to train (prepare() first; not after convert())")
    return weights, qparams


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of KL(softmax(teacher/T) || softmax(student/T)) * T²; logits (..., V)."""
    s = F.log_softmax(student.float() / temperature, dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher.float() / temperature, dim=-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def _autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype == "float16" and device.type != "cuda":
        raise ValueError(f"training dtype 'float16' needs CUDA (GradScaler); on {device.type} use 'bfloat16' or 'float32'")
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def _warn_if_bf16_is_slow(device: torch.device, dtype: str) -> float | None:
    """On CPU with dtype 'bfloat16': warn when a bf16 matmul is SLOW_BF16_RATIO times slower than fp32 or more
    (util.device.bf16_slowdown, quantlab doctor's probe). Returns the ratio, or None where nothing was probed."""
    if device.type != "cpu" or dtype != "bfloat16":
        return None
    from ..util.device import SLOW_BF16_RATIO, bf16_slowdown

    ratio = bf16_slowdown(device)
    if ratio >= SLOW_BF16_RATIO:
        log.warning("training dtype 'bfloat16': a bf16 matmul on this CPU takes %.1fx the fp32 one (no native bf16, "
                    "e.g. AVX2 without AVX512_BF16/AMX); dtype = 'float32' trains faster here "
                    "(`quantlab doctor` shows the check)", ratio)
    return ratio


def _loss(model, teacher, batch: torch.Tensor, settings: TrainSettings, autocast) -> torch.Tensor:
    """The training loss of one micro-batch (B, T): ce_weight * CE + kd_weight * KD."""
    with autocast:
        logits = model(batch, use_cache=False).logits  # (B, T, V)
        loss = logits.new_zeros((), dtype=torch.float32)
        if settings.ce_weight > 0:
            ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten())
            loss = loss + settings.ce_weight * ce
        if settings.kd_weight > 0:
            with torch.no_grad():
                target = teacher(batch, use_cache=False).logits
            loss = loss + settings.kd_weight * distill_loss(logits, target, settings.kd_temperature)
    return loss


def _fingerprint(settings: TrainSettings, extra: str, n_windows: int, names: list[str]) -> str:
    return json.dumps({"settings": settings.to_dict(), "extra": extra, "windows": n_windows, "params": names},
                      sort_keys=True, default=str)


def _diverged(what: str, value: float, step: int, settings: TrainSettings, directory, last_saved: int | None,
              label: str = "QAT"):
    kept = (f"the last good checkpoint (step {last_saved}) is kept in {directory}" if last_saved
            else "no checkpoint was saved before it" + ("" if settings.checkpoint_every else " (checkpoint_every = 0)"))
    return TrainingDiverged(f"{label} {what} became {value} at step {step}/{settings.steps}; training stopped; {kept}. "
                            "Try a lower lr / scale_lr or grad_clip.")


def _check_inputs(windows: torch.Tensor, settings: TrainSettings, teacher, checkpoint_dir) -> None:
    if settings.batch_size > len(windows):
        raise ValueError(f"batch_size={settings.batch_size} is larger than the training data "
                         f"({len(windows)} windows of {settings.seq_len} tokens)")
    if settings.needs_teacher and teacher is None:
        raise ValueError(f"kd_weight={settings.kd_weight} needs a teacher model (the unquantized model); pass teacher=")
    if settings.checkpoint_every and checkpoint_dir is None:
        raise ValueError(f"checkpoint_every={settings.checkpoint_every} needs a checkpoint directory")


def _optimizer(weights: dict, qparams: dict, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW: weights at lr (with weight decay), quantizer params at scale_lr (no decay); peak_lr per group."""
    groups = [{"params": list(weights.values()), "lr": settings.lr, "peak_lr": settings.lr}]
    if qparams:
        groups.append({"params": list(qparams.values()), "lr": settings.scale_lr, "peak_lr": settings.scale_lr,
                       "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay)


def _restore(state: dict, fp: str, trainable: dict, optimizer, scaler, checkpoint_dir,
             label: str = "QAT") -> tuple[int, list, float]:
    """Load a checkpoint into params / optimizer / scaler / RNG; returns (step, loss history, elapsed_s)."""
    if state.get("fingerprint") != fp:
        raise ValueError(f"checkpoint in {checkpoint_dir} was written by a different run or config; delete it to start over")
    with torch.no_grad():
        for name, value in state["params"].items():
            trainable[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    log.info("resuming %s from step %d (%s)", label, state["step"], checkpoint_dir)
    return state["step"], list(state["history"]), state["elapsed_s"]


def _optimizer_step(model, teacher, batches: list[torch.Tensor], settings: TrainSettings, autocast, optimizer,
                    scaler, params: list[nn.Parameter], diverged) -> float:
    """One optimizer step over grad_accum micro-batches; returns the step's mean loss."""
    optimizer.zero_grad(set_to_none=True)
    step_loss = 0.0
    for batch in batches:
        loss = _loss(model, teacher, batch, settings, autocast)
        mean = all_mean(loss.item())  # over the ranks: every rank stops together (one NaN makes the mean NaN)
        if not math.isfinite(mean):
            raise diverged("loss", mean)
        scaled = loss / settings.grad_accum
        (scaler.scale(scaled) if scaler else scaled).backward()
        step_loss += loss.item() / settings.grad_accum
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip if settings.grad_clip > 0 else math.inf)
    if scaler is not None:  # GradScaler skips steps with inf gradients and lowers its scale
        scaler.step(optimizer)
        scaler.update()
    elif not torch.isfinite(norm):
        raise diverged("gradient norm", norm.item())
    else:
        optimizer.step()
    return all_mean(step_loss)


def train(
    model: nn.Module, data, settings: TrainSettings, teacher: nn.Module | None = None,
    checkpoint_dir: str | Path | None = None, progress: bool = True, fingerprint: str = "", processes: int = 1,
    params: Callable[[nn.Module], tuple[dict, dict]] = parameter_groups, label: str = "QAT",
) -> dict[str, Any]:
    """Train the quantized layers of `model` in place; resume from <checkpoint_dir>/latest.pt if present.

    processes > 1: data-parallel over that many processes (qat/distributed.py), the same global batch.
    params: which parameters train, model -> ({name: weight} at lr, {name: quantizer param} at scale_lr); every
    other parameter is held fixed. Default: QAT's (parameter_groups); LoRA passes its adapters (methods/lora.py).
    A module-level function, so data-parallel ranks can apply it to their own copy. label names the run in
    messages and the progress bar.
    Returns train_steps, train_tokens, train_s, train_loss_first, train_loss_final, train_dtype,
    train_resumed_from (0 = fresh start), train_processes.
    """
    if processes > 1 and rank_world()[1] == 1:
        return run_data_parallel(processes, train, model, data, settings, teacher, checkpoint_dir=checkpoint_dir,
                                 progress=progress, fingerprint=fingerprint, params=params, label=label)
    rank, world = rank_world()
    windows = training_windows(data, settings.seq_len)
    _check_inputs(windows, settings, teacher, checkpoint_dir)
    device = next(model.parameters()).device
    autocast = _autocast(device, settings.dtype)
    _warn_if_bf16_is_slow(device, settings.dtype)
    weights, qparams = params(model)
    trainable = {**weights, **qparams}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(False)
    for p in trainable.values():
        p.requires_grad_(True)
    optimizer = _optimizer(weights, qparams, settings)
    scaler = torch.amp.GradScaler("cuda") if settings.dtype == "float16" else None
    fp = _fingerprint(settings, fingerprint, len(windows), sorted(trainable))
    start, history, elapsed = 0, [], 0.0
    state = load_checkpoint(checkpoint_dir)
    if state is not None:
        start, history, elapsed = _restore(state, fp, trainable, optimizer, scaler, checkpoint_dir, label)
    last_saved = start or None
    order_cache: dict = {}
    was_training = model.training
    model.train()
    forward = model
    if world > 1:  # gradients of the trainable parameters averaged over the ranks at every backward
        device_ids = [device.index] if device.type == "cuda" else None
        forward = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    t0 = time.perf_counter()
    bar = tqdm(range(start, settings.steps), desc=label.lower(), leave=False, disable=not progress,
               initial=start, total=settings.steps)
    try:
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = group["peak_lr"] * settings.lr_factor(step)
            batches = []
            for micro in range(settings.grad_accum):
                first = (step * settings.grad_accum + micro) * settings.batch_size
                idx = [window_index(first + b, len(windows), settings.seed, order_cache) for b in range(settings.batch_size)]
                batches.append(windows[shard(idx)].to(device))  # this rank's share of the global batch

            def diverged(what, value, step=step):
                return _diverged(what, value, step + 1, settings, checkpoint_dir, last_saved, label)

            history.append(_optimizer_step(forward, teacher, batches, settings, autocast, optimizer, scaler,
                                           list(trainable.values()), diverged))
            bar.set_postfix(loss=f"{history[-1]:.4f}")
            done = step + 1
            if rank == 0 and settings.checkpoint_every and done % settings.checkpoint_every == 0 and done < settings.steps:
                save_checkpoint(checkpoint_dir, {
                    "step": done, "params": {n: p.detach().clone() for n, p in trainable.items()},
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                    "rng": rng_state(), "history": history, "fingerprint": fp,
                    "elapsed_s": elapsed + time.perf_counter() - t0,
                })
                last_saved = done
    finally:
        bar.close()
        model.train(was_training)
        for name, p in model.named_parameters():
            p.requires_grad_(flags.get(name, True))
        optimizer.zero_grad(set_to_none=True)
    return {
        "train_steps": settings.steps,
        "train_tokens": settings.steps * settings.windows_per_step * settings.seq_len,
        "train_s": elapsed + time.perf_counter() - t0,
        "train_loss_first": history[0] if history else None,
        "train_loss_final": history[-1] if history else None,
        "train_dtype": settings.dtype,
        "train_resumed_from": start,
        "train_processes": world,
    }
