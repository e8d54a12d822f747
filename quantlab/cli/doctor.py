"""`quantlab doctor`: the quantization debugging checklist (quantlab/doctor/) as one table; exit 1 on errors.

    quantlab doctor                                    # this machine: torch, devices, bf16 speed, kernels
    quantlab doctor smollm2-135m --device cpu          # + the model's tensors, one probe forward, limits, memory
    quantlab doctor experiments/smollm2_ptq.toml       # its model, dtype, device and [eval] seq_len
"""
from __future__ import annotations

from pathlib import Path


def _target(args) -> dict:
    """model / dtype / device / seq_len from the positional argument (alias, path, hub id or an experiment .toml)."""
    if args.target is None:
        return {"model": None, "dtype": args.dtype or "float32", "device": args.device or "auto", "seq_len": args.seq_len}
    if args.target.endswith(".toml") or Path(args.target).suffix == ".toml":
        from ..runs.experiment import load_experiment

        exp = load_experiment(args.target)
        return {"model": exp.model, "dtype": args.dtype or exp.dtype, "device": args.device or exp.device,
                "seq_len": args.seq_len or exp.eval.seq_len}
    return {"model": args.target, "dtype": args.dtype or "float32", "device": args.device or "auto",
            "seq_len": args.seq_len}


def cmd_doctor(args) -> int:
    import torch

    from ..doctor import device_rows, diagnose, exit_code, format_checks
    from ..models.loading import load_model, resolve_device

    target = _target(args)
    try:
        device = resolve_device(target["device"])
    except RuntimeError:  # the device asked for is not here: its row says so, nothing else can run
        rows = device_rows(torch.device(target["device"]))
        print(format_checks(rows))
        return exit_code(rows)
    model, tokenizer = None, None
    if target["model"] is not None:
        model, tokenizer = load_model(target["model"], target["dtype"], str(device), args.cache_dir, progress=False)
        print(f"{target['model']}: {target['dtype']} on {device}"
              + (f", seq_len {target['seq_len']}" if target["seq_len"] else "") + f", batch {args.batch}")
    rows = diagnose(model, tokenizer, device, seq_len=target["seq_len"], batch=args.batch, dtype=target["dtype"])
    print(format_checks(rows))
    return exit_code(rows)


def add_commands(sub) -> None:
    p = sub.add_parser("doctor", help="debugging checklist: devices, dtypes, NaN/Inf, outliers, kernels, memory, "
                                      "positions (exit 1 on errors)")
    p.add_argument("target", nargs="?", help="model alias, hub id or local path, or an experiment .toml")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N | mps (default: the experiment's, else auto)")
    p.add_argument("--dtype", help="float32 | float16 | bfloat16 (default: the experiment's, else float32)")
    p.add_argument("--seq-len", type=int, help="compared with the model's positions (default: the experiment's "
                                               "[eval] seq_len); the memory estimate uses min(max positions, 2048) without one")
    p.add_argument("--batch", type=int, default=1, help="for the memory estimate")
    p.set_defaults(func=cmd_doctor)
