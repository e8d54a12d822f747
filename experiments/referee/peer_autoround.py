"""Intel auto-round 0.16.1's own quantized checkpoint of a float model, calibrated on quantlab's exported token ids.

Runs inside the auto-round venv (build_venvs.sh); imports nothing from quantlab:

    ~/.cache/quantlab/venvs/auto-round-0.16.1/bin/python experiments/referee/peer_autoround.py \
        --windows ~/.cache/quantlab/referee/windows --out ~/.cache/quantlab/referee/autoround-w4a16-g64

SignRound (auto-round's default algorithm) at W4A16: int4 weights, symmetric (its W4A16 default), groups of 64
(its preset's 128 does not divide SmolLM2's 576-wide layers), --iters rounds of sign-gradient descent per block
(default 200, its own; recipe w4a16-g64-light: 50 at lr 5e-3, auto-round's `light` recipe). The windows go in as a list of {input_ids, attention_mask = all ones} samples: no
tokenizer re-encoding, no dataset download (the hub is switched off), every token attended as quantlab's
calibration attends it. nsamples and seqlen are the windows' count and length (auto-round skips a sample shorter
than seqlen). Everything else keeps auto-round's defaults (batch_size 8, seed 42, lr = 1/iters, min-max tuning on,
quantized inputs to later blocks, torch.compile where it decides to), and referee_settings.json records them as
resolved. The checkpoint is written in format "llm_compressor": compressed-tensors pack-quantized, which quantlab's
compressed-tensors importer reads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_common import Clock, load_windows, machine, offline_hub, set_threads, staged_output, versions, write_settings

W4A16_G64 = {"scheme": "W4A16", "group_size": 64, "sym": True}
# checkpoint: autoround-<recipe>. "light": auto-round's own `light` recipe (cli/main.py RECIPES: 50 iterations at
# lr 5e-3, batch 8), the settings of quantlab's 50-iteration row, so the two sit side by side on the same windows.
RECIPES = {"w4a16-g64": W4A16_G64, "w4a16-g64-light": {**W4A16_G64, "iters": 50, "lr": 5e-3}}
EXPORT_FORMAT = "llm_compressor"  # compressed-tensors; auto-round's others: auto_round, auto_gptq, auto_awq, gguf


def calibration_samples(ids) -> list[dict]:
    """One {input_ids (1, T), attention_mask (1, T) of ones} per window, in quantlab's order. With the mask given,
    auto-round uses it as it is; without one it would mask the last token and any pad-token id (llm.py calib)."""
    import torch

    windows = torch.from_numpy(ids)
    return [{"input_ids": w[None], "attention_mask": torch.ones_like(w[None])} for w in windows]


def lift_checkpoint(folders, tmp: Path) -> None:
    """auto-round writes into output_dir/<model name>-<scheme>/ (quantize_and_save returns that path, or a list of
    them for several formats): move its files up into tmp, so the checkpoint folder is the one asked for."""
    import shutil

    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    if len(folders) != 1:
        raise RuntimeError(f"auto-round wrote {len(folders)} checkpoint folders ({folders}); expected one")
    written = Path(folders[0])
    for path in written.iterdir():
        path.rename(tmp / path.name)
    shutil.rmtree(tmp / "autoround")


def resolved(compressor) -> dict:
    """auto-round's settings as the compressor holds them (defaults included), after quantization."""
    config = {k: v for k, v in vars(compressor.quantize_config).items() if not k.startswith("_")}
    calib = compressor.calibration_context
    model = compressor.model_context
    return {
        "algorithm": type(compressor.quantize_config).__name__, "sign_round": config,
        "calibration": {"nsamples": calib.nsamples, "seqlen": calib.seqlen, "batch_size": calib.batch_size},
        "seed": compressor.seed, "amp": model.amp, "amp_dtype": model.amp_dtype,
        "enable_torch_compile": compressor.enable_torch_compile, "quant_lm_head": compressor.quant_lm_head,
        "cache_device": compressor.compress_context.cache_device,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", required=True, help="export_windows.py's folder (windows.npy, windows.json)")
    ap.add_argument("--out", required=True, help="the checkpoint folder to write (must not exist)")
    ap.add_argument("--recipe", default="w4a16-g64", choices=list(RECIPES))
    ap.add_argument("--iters", type=int, help="SignRound iterations per block (default: auto-round's, 200)")
    ap.add_argument("--model", help="float checkpoint folder (default: windows.json's model_dir)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    offline_hub()
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids, windows_meta = load_windows(args.windows)
    model_dir = args.model or windows_meta["model_dir"]
    threads = set_threads(args.threads)
    with Clock() as load:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    passed = {**RECIPES[args.recipe], "nsamples": int(ids.shape[0]), "seqlen": int(ids.shape[1]),
              "device_map": "cpu", **({"iters": args.iters} if args.iters is not None else {})}
    print(f"peer_autoround: {args.recipe}: AutoRound({json.dumps(passed)}), format {EXPORT_FORMAT}", flush=True)
    with staged_output(args.out) as tmp:
        with Clock() as run:
            compressor = AutoRound(model, tokenizer, dataset=calibration_samples(ids), **passed)
            _, folders = compressor.quantize_and_save(output_dir=str(tmp / "autoround"), format=EXPORT_FORMAT)
        lift_checkpoint(folders, tmp)
        write_settings(tmp, {
            "peer": "auto-round", "recipe": args.recipe, "model_dir": str(model_dir), "model_dtype": "float32",
            "windows": {"folder": str(Path(args.windows).expanduser()), **windows_meta},
            "passed": {**passed, "dataset": "the windows: [{input_ids (1, T), attention_mask ones (1, T)}]",
                       "tokenizer": "the model folder's (saved with the checkpoint)", "format": EXPORT_FORMAT},
            "resolved": resolved(compressor),
            "versions": versions("auto-round", "compressed-tensors", "transformers", "torch", "accelerate",
                                 "datasets", "numpy"),
            "machine": machine(), "torch_threads": threads,
            "load_s": round(load.seconds, 2), "wall_s": round(run.seconds, 2),
            "wall_s_is": "AutoRound(...) + quantize_and_save: calibration, tuning, packing and writing",
        })
    print(f"peer_autoround: {args.recipe} in {run.seconds:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
