"""`quantlab doctor`: the quantization debugging checklist as pure checks over a model, its config and a device.

    rows = diagnose(model, tokenizer, torch.device("cpu"), seq_len=512)
    print(format_checks(rows))          # one line per check: ok / warn / error, what was seen, what to do
    exit_code(rows)                     # 1 when any check is an error

Every check returns Check rows and changes nothing; the model checks take any nn.Module, so a test
can hand them a crafted bad model (a NaN weight, a parameter on `meta`, an injected outlier).
The environment checks (device_rows, half_precision_rows, kernel_rows) need no model.
"""
from __future__ import annotations

import inspect
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .core.checks import check_choice

STATUSES = ("ok", "warn", "error")
# max |x| / median |x| over the input channels of a linear (each channel's max over the probe tokens) above
# which the input has outlier channels that per-tensor / per-token activation quantization spends its grid on:
# the SmoothQuant / rotation signal. Measured on PROBE_TEXT: the tiny random Llama <= 3x; SmolLM2-135M median 13x over
# its 211 linears, 5 above 100x, all down_proj (worst layers.11: channel 1229 at 2824 vs median 0.45, 6275x).
OUTLIER_RATIO_WARN = 100.0
PROBE_TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
              "structure in Paris. Its base is square, measuring 125 metres on each side.")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | error
    detail: str
    hint: str = ""

    def __post_init__(self):
        check_choice("check status", self.status, STATUSES)


def exit_code(rows: list[Check]) -> int:
    return 1 if any(r.status == "error" for r in rows) else 0


def format_checks(rows: list[Check]) -> str:
    """A table: status, check, detail; a hint line under each row that is not ok; a count at the end."""
    width = max([len(r.name) for r in rows] + [5])
    lines = [f"{'status':<7}{'check':<{width + 2}}detail"]
    for r in rows:
        lines.append(f"{r.status:<7}{r.name:<{width + 2}}{r.detail}")
        if r.hint and r.status != "ok":
            lines.append(f"{'':<{width + 9}}hint: {r.hint}")
    counts = Counter(r.status for r in rows)
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES))
    return "\n".join(lines)


# ---- environment -------------------------------------------------------------------------------------------

def device_rows(device: torch.device) -> list[Check]:
    """torch version and CPU threads; CUDA and MPS availability (an error only for the device asked for)."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    rows = [Check("torch", "warn" if threads == 1 < cores else "ok",
                  f"{torch.__version__}; {threads} CPU threads on {cores} cores",
                  "torch.set_num_threads(os.cpu_count()) (or unset OMP_NUM_THREADS)")]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = Check("cuda", "ok", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): {props.name} "
                                   f"(cc {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        cuda = Check("cuda", "error" if device.type == "cuda" else "ok",
                     f"not available (torch built with CUDA {torch.version.cuda or 'none'})",
                     "install a CUDA build of torch, or use --device cpu")
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    return rows + [cuda, Check("mps", "error" if device.type == "mps" and not mps_ok else "ok",
                               "available" if mps_ok else "not available", "Apple silicon only; use --device cpu")]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_ms(dtype: torch.dtype, device: torch.device, size: int = 512, budget_s: float = 0.3) -> float:
    """Median time of one (size x size) @ (size x size) matmul in `dtype`, repeated for ~budget_s (3..50 times).

    On CPU with one thread (restored after): the dtype ratio is what the check needs, and a thread pool on a
    busy machine times the scheduler instead (seen here: 8 / 16 / 32 ms steps for any size and dtype)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        a @ b  # warm-up (kernel selection, first-touch)
        _sync(device)
        times, start = [], time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(times)


def half_precision_rows(device: torch.device, size: int = 512, budget_s: float = 0.3) -> list[Check]:
    """bf16 / fp16 matmul on `device`: supported? its speed vs fp32 (warn where slower: AVX2 CPUs without
    bf16 units convert and compute in fp32). Three timings of ~budget_s each."""
    fp32 = matmul_ms(torch.float32, device, size, budget_s)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        try:
            ms = matmul_ms(dtype, device, size, budget_s)
        except (RuntimeError, TypeError) as e:
            rows.append(Check(f"{name} matmul", "warn", f"not supported on {device.type}: {str(e)[:80]}",
                              "keep dtype float32 on this device"))
            continue
        ratio = ms / fp32
        slower = ratio > 1.0
        rows.append(Check(
            f"{name} matmul", "warn" if slower else "ok",
            f"{size}x{size} matmul {ms:.2f} ms vs float32 {fp32:.2f} ms ({ratio:.2f}x the time) on {device.type}"
            + (" (1 thread)" if device.type == "cpu" else ""),
            f"{name} is slower than float32 here: keep dtype float32 (torchao's int4 kernels compute in bf16)"))
    return rows


def kernel_rows(device: torch.device) -> list[Check]:
    """For each scheme, the torchao kernel quantlab exports it to on `device` (backends/kernels.py's table),
    or why backend "torchao" / "auto" would keep it simulated, i.e. dequantize the codes on every forward."""
    from .backends import choose_kernel, torchao_available
    from .core.activations import DynamicActQuant
    from .core.qlinear import QuantLinear, WeightSpec

    schemes = {"int8 weight-only": (WeightSpec(bits=8), False), "int8 dynamic (w8a8)": (WeightSpec(bits=8), True),
               "int4 g64 weight-only": (WeightSpec(bits=4, group_size=64), False),
               "fp8_e4m3 weight-only": (WeightSpec(format="fp8_e4m3"), False)}
    have_torchao, rows = torchao_available(), []
    for scheme, (spec, dynamic) in schemes.items():
        layer = QuantLinear.from_linear(nn.Linear(256, 8, bias=False), spec)
        layer.freeze()
        layer.act_quant = DynamicActQuant(8) if dynamic else None
        choice = choose_kernel(layer, device)
        if choice.kernel is None:
            rows.append(Check(f"kernel {scheme}", "warn", f"none on {device.type}: {choice.reason}",
                              "backend torchao/auto keeps these layers simulated: correct numbers, no speed-up"))
        elif not have_torchao:
            rows.append(Check(f"kernel {scheme}", "warn", f"{choice.kernel} needs torchao, which is not installed; "
                              "backend 'auto' silently runs simulated (dequantizes every forward)", "pip install torchao"))
        elif choice.kernel == "float8_weight_only" and device.type != "cuda":
            rows.append(Check(f"kernel {scheme}", "warn", f"{choice.kernel}: Float8Tensor dequantizes in the matmul "
                              f"on {device.type} (real bytes, no fp8 compute)", "expect float speed, not fp8 speed"))
        else:
            rows.append(Check(f"kernel {scheme}", "ok", choice.kernel))
    return rows


# ---- the model's tensors -----------------------------------------------------------------------------------

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
    from .eval.estimate import MIB, estimate_memory

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


def diagnose(model: nn.Module | None, tokenizer=None, device: torch.device | None = None,
             seq_len: int | None = None, batch: int = 1, dtype: str = "float32",
             free_bytes: int | None = None, matmul_budget_s: float = 0.3) -> list[Check]:
    """Every check: the environment, then (with a model) its tensors, one probe forward, its limits and memory.

    >>> print(format_checks(diagnose(*load_model("smollm2-135m", device="cpu"), torch.device("cpu"))))
    """
    device = device or torch.device("cpu")
    rows = device_rows(device) + half_precision_rows(device, budget_s=matmul_budget_s) + kernel_rows(device)
    if model is None:
        return rows
    placement = placement_check(model)
    rows += [placement, dtype_check(model), finite_weights_check(model)]
    if placement.status == "error":
        rows.append(Check("forward", "warn", "skipped: the devices row is an error", "fix it first"))
    else:
        stats = forward_stats(model, probe_ids(model, tokenizer))
        rows += [finite_activations_check(stats)] + ([outlier_check(stats)] if not stats.error else [])
    config = getattr(model, "config", None)
    if config is not None:
        rows.append(positions_check(config, seq_len))
        free = free_memory_bytes(device) if free_bytes is None else free_bytes
        eval_len = seq_len or min(getattr(config, "max_position_embeddings", None) or 2048, 2048)
        rows.append(memory_check(config, eval_len, batch, dtype, device, free, tensor_bytes(model)))
    return rows
