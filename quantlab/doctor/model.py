"""Model checks: placement, dtypes, finite weights and activations, outlier channels, positions, memory."""
from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .checks import Check

# max |x| / median |x| over the input channels of a linear (each channel's max over the probe tokens) above
# which the input has outlier channels that per-tensor / per-token activation quantization spends its grid on:
# the SmoothQuant / rotation signal. Measured on PROBE_TEXT: the tiny random Llama <= 3x; SmolLM2-135M median 13x over
# its 211 linears, 5 above 100x, all down_proj (worst layers.11: channel 1229 at 2824 vs median 0.45, 6275x).
OUTLIER_RATIO_WARN = 100.0
PROBE_TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
              "structure in Paris. Its base is square, measuring 125 metres on each side.")


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if b is not None)


def placement_check(model: nn.Module) -> Check:
    """Every parameter and buffer on one device and none on `meta`; names the first one that is not."""
    tensors = list(_named_tensors(model))
    meta = next((n for n, t in tensors if t.is_meta), None)
    if meta is not None:
        count = sum(t.is_meta for _, t in tensors)
        return Check("devices", "error", f"{count} tensor(s) on meta (no data), first: {meta}",
                     "the checkpoint lacks these weights, or a device_map / init_empty_weights left them "
                     "unmaterialized; load without device_map or load_state_dict(..., assign=True)")
    devices = Counter(str(t.device) for _, t in tensors)
    if len(devices) <= 1:
        return Check("devices", "ok", f"all {len(tensors)} tensors on {next(iter(devices), 'none')}")
    main = devices.most_common(1)[0][0]
    first = next(f"{n} ({t.device})" for n, t in tensors if str(t.device) != main)
    detail = f"mixed: {', '.join(f'{d} {c}' for d, c in devices.most_common())}; first off {main}: {first}"
    if getattr(model, "hf_device_map", None):
        return Check("devices", "ok", detail + " (an hf_device_map places them)")
    return Check("devices", "error", detail, f"model.to({main!r}) before quantizing or evaluating")


def dtype_check(model: nn.Module) -> Check:
    """Floating-point parameters and buffers in one dtype; names each dtype with its tensor count and an example."""
    floats = [(n, t) for n, t in _named_tensors(model) if t.is_floating_point()]
    counts = Counter(str(t.dtype).removeprefix("torch.") for _, t in floats)
    if len(counts) <= 1:
        return Check("dtypes", "ok", f"all {len(floats)} float tensors {next(iter(counts), '-')}")
    main = counts.most_common(1)[0][0]
    first = next(n for n, t in floats if str(t.dtype).removeprefix("torch.") != main)
    return Check("dtypes", "warn", f"mixed: {', '.join(f'{d} {c}' for d, c in counts.most_common())}; "
                 f"first not {main}: {first}", f"model.to(torch.{main}) unless the mix is deliberate "
                 "(a matmul of two dtypes fails with 'expected scalar type')")


def finite_weights_check(model: nn.Module) -> Check:
    """No NaN / Inf in any floating parameter or buffer; names the first one that has some."""
    bad = [(n, int((~torch.isfinite(t)).sum())) for n, t in _named_tensors(model)
           if t.is_floating_point() and not t.is_meta and not torch.isfinite(t).all()]
    if not bad:
        return Check("weights finite", "ok", "no NaN / Inf in parameters or buffers")
    name, count = bad[0]
    return Check("weights finite", "error", f"{len(bad)} tensor(s) with NaN/Inf, first: {name} ({count} values)",
                 "reload the checkpoint; after quantizing, look for a zero scale or a divide by zero")


# ---- one forward -------------------------------------------------------------------------------------------

@dataclass
class ForwardStats:
    """What one probe forward saw: the first module with a non-finite output, and per linear (by name) the
    input's (max |x| / median |x| over input channels, worst channel, its max |x|, the median)."""
    first_nonfinite: str | None = None
    outliers: dict[str, tuple[float, int, float, float]] = field(default_factory=dict)
    error: str | None = None


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _tensors(v)


def probe_ids(model: nn.Module, tokenizer=None, tokens: int = 48, seed: int = 0) -> torch.Tensor:
    """(1, T) token ids: PROBE_TEXT through the tokenizer, or seeded random ids without one."""
    if tokenizer is not None:
        ids = tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"][:, :tokens]
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    return ids


def _run(model: nn.Module, ids: torch.Tensor):
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return model(ids.to(next(model.parameters()).device), **kwargs)


def _nonfinite(out) -> bool:
    return any(t.is_floating_point() and not torch.isfinite(t).all() for t in _tensors(out))


@torch.inference_mode()
def forward_stats(model: nn.Module, ids: torch.Tensor) -> ForwardStats:
    """One forward of ids (B, T) with pre-hooks on every linear (its input's channel statistics). Only when the
    output holds a NaN/Inf, a second forward hooks every module (post-order: names the innermost module that first
    produced one); a check per module costs ~as much as the forward itself on a busy CPU."""
    stats, handles = ForwardStats(), []

    def on_input(name):
        def hook(module, args):
            channel_max = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()  # (in,); NaN propagates
            if torch.isfinite(channel_max).all():
                median = channel_max.median().item()
                worst = int(channel_max.argmax())
                peak = channel_max[worst].item()
                stats.outliers[name] = (peak / max(median, 1e-12), worst, peak, median)
        return hook

    def on_output(name):
        def hook(module, args, out):
            if stats.first_nonfinite is None and _nonfinite(out):
                stats.first_nonfinite = name
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or hasattr(module, "in_features") and hasattr(module, "spec"):
            handles.append(module.register_forward_pre_hook(on_input(name)))
    try:
        if _nonfinite(_run(model, ids)):
            handles += [m.register_forward_hook(on_output(n)) for n, m in model.named_modules() if n]
            _run(model, ids)
            stats.first_nonfinite = stats.first_nonfinite or "the model output"
    except Exception as e:  # noqa: BLE001 -- any failure of the forward is the finding
        stats.error = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        for h in handles:
            h.remove()
    return stats


def finite_activations_check(stats: ForwardStats) -> Check:
    if stats.error:
        return Check("forward", "error", f"the probe forward failed: {stats.error}",
                     "fix the devices / dtypes rows above first")
    if stats.first_nonfinite:
        return Check("activations finite", "error", f"NaN/Inf first in the output of {stats.first_nonfinite}",
                     "fp16 overflow (try bfloat16 or float32), a NaN weight, or a zero quantization scale there")
    return Check("activations finite", "ok", "no NaN / Inf in one probe forward")


def outlier_check(stats: ForwardStats, threshold: float = OUTLIER_RATIO_WARN, top: int = 3) -> Check:
    """The `top` linears whose input has the largest max/median channel ratio; warn above `threshold`."""
    if not stats.outliers:
        return Check("activation outliers", "ok", "no linear inputs seen")
    worst = sorted(stats.outliers.items(), key=lambda kv: -kv[1][0])[:top]
    listed = "; ".join(f"{n} {r:.0f}x (ch {c}: {p:.3g} vs median {m:.3g})" for n, (r, c, p, m) in worst)
    above = sum(r > threshold for r, *_ in stats.outliers.values())
    status = "warn" if above else "ok"
    return Check("activation outliers", status,
                 f"max/median |x| per input channel, {above} of {len(stats.outliers)} linears > {threshold:g}x; "
                 f"worst: {listed}",
                 "outlier channels eat the activation grid (w8a8 / a4): use smoothquant or a rotation, "
                 "or keep these layers' activations in float")


# ---- the model's limits vs the run -------------------------------------------------------------------------

def positions_check(config, seq_len: int | None) -> Check:
    """seq_len vs max_position_embeddings (error beyond) and vs a sliding window (warn where every layer slides)."""
    max_pos = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 configs carry a window they do not use
        window = None
    kinds = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * getattr(
        config, "num_hidden_layers", 1)
    sliding = sum(k == "sliding_attention" for k in kinds) if window else 0
    limits = f"max positions {max_pos}" + (f", {sliding} of {len(kinds)} layers slide over {window} tokens" if sliding else "")
    if seq_len is None:
        return Check("positions", "ok", limits + " (no seq_len given)", "")
    if max_pos is not None and seq_len > max_pos:
        return Check("positions", "error", f"seq_len {seq_len} > {limits}",
                     f"set [eval] seq_len <= {max_pos}: positions beyond were never trained (learned position "
                     "embeddings fail with an index error)")
    if sliding and seq_len > window and sliding == len(kinds):
        return Check("positions", "warn", f"seq_len {seq_len} > sliding window {window} on every layer ({limits})",
                     f"tokens see only the last {window}; seq_len <= {window} to measure full-context perplexity")
    return Check("positions", "ok", f"seq_len {seq_len} within {limits}")


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the model lives: torch.cuda.mem_get_info on CUDA, psutil's available RAM on CPU and MPS
    (unified memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def memory_check(config, seq_len: int, batch: int, dtype: str, device: torch.device, free_bytes: int,
                 loaded_bytes: int = 0) -> Check:
    """eval/estimate.py's estimate vs free memory. The model is loaded already (loaded_bytes, the framework too),
    so what must still fit in free_bytes is the KV cache + activations; warn above 80 % of it."""
    from ..eval.estimate import MIB, estimate_memory

    kind = "cuda" if device.type == "cuda" else "cpu"
    try:
        est = estimate_memory(config, seq_len=seq_len, batch=batch, dtype=dtype, device=kind)
    except ValueError:  # estimate models Llama-style decoders only
        return Check("memory", "ok", f"no estimate for model_type {getattr(config, 'model_type', None)!r} (Llama-style "
                                     f"decoders only); loaded {loaded_bytes / MIB:.0f} MiB, {free_bytes / MIB:.0f} MiB free")
    more = est.kv_cache_bytes + est.activation_bytes
    detail = (f"estimate {est.total_bytes / MIB:.0f} MiB at seq_len {seq_len}, batch {batch}, {dtype} (weights "
              f"{est.weights_bytes / MIB:.0f}, kv {est.kv_cache_bytes / MIB:.0f}, activations "
              f"{est.activation_bytes / MIB:.0f}); kv + activations need {more / MIB:.0f} of {free_bytes / MIB:.0f} "
              f"MiB free on {device.type}")
    if more <= 0.8 * free_bytes:
        return Check("memory", "ok", detail)
    half = estimate_memory(config, seq_len=max(seq_len // 2, 1), batch=batch, dtype=dtype, device=kind)
    w4 = estimate_memory(config, bits=4, group_size=64, seq_len=seq_len, batch=batch, dtype=dtype, device=kind)
    hint = (f"kv + activations grow with batch x seq_len: seq_len {max(seq_len // 2, 1)} needs "
            f"{(half.kv_cache_bytes + half.activation_bytes) / MIB:.0f} MiB"
            + (f", batch {batch // 2} about half" if batch > 1 else "")
            + f"; 4-bit g64 weights take {w4.weights_bytes / MIB:.0f} MiB instead of {est.weights_bytes / MIB:.0f}")
    return Check("memory", "error" if more > free_bytes else "warn", detail, hint)


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights)."""
    seen, total = set(), 0
    for _, t in _named_tensors(model):
        if not t.is_meta and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total
