"""llm-compressor 0.14's own quantized checkpoint of a float model, calibrated on quantlab's exported token ids.

Runs inside the llm-compressor venv (build_venvs.sh); imports nothing from quantlab:

    ~/.cache/quantlab/venvs/llmcompressor-0.14.0/bin/python experiments/referee/peer_llmcompressor.py \
        --windows ~/.cache/quantlab/referee/windows --recipe gptq-w4a16-g64 \
        --out ~/.cache/quantlab/referee/llmcompressor-gptq-w4a16-g64

The float checkpoint folder comes from windows.json (model_dir) unless --model names one. The windows become a
`datasets.Dataset` of input_ids (with an all-ones attention mask): llm-compressor takes an already tokenized dataset
as it is (no tokenizer re-encoding, nothing from the hub: the hub is switched off). `oneshot` runs on every window
once (num_calibration_samples = their count, max_seq_length = their length) through its own data pipeline:
shuffle_calibration_samples=False (no random sampler: the same batches every run) leaves its LengthAwareSampler,
which orders equal-length windows by torch.argsort, a fixed permutation of quantlab's order (the set is the same;
only the order statistics are summed in differs). The checkpoint is written with save_compressed=True. Every
setting passed, each modifier's resolved fields, the versions and the wall time go to <out>/referee_settings.json
(printed too). Recipes: RECIPES below.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_common import Clock, load_windows, machine, offline_hub, set_threads, staged_output, versions, write_settings

TARGETS, IGNORE = ["Linear"], ["lm_head"]  # lm_head is tied to the embedding in SmolLM2: it stays float
# llm-compressor's W4A16 preset (int4 symmetric, groups of 128) with groups of 64: its group-size check refuses 128
# on SmolLM2's 576-wide layers (576 = 9 x 64). Checked against the installed preset by check_w4a16_g64().
W4A16_G64_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
W4A16_G64 = {"group_0": {"targets": TARGETS, "weights": W4A16_G64_WEIGHTS}}
W8A8 = "W8A8"  # its preset: int8 per-channel symmetric weights, dynamic per-token int8 symmetric inputs

# recipe -> (what and why, [(modifier class, the keyword arguments passed)]). Arguments not passed keep
# llm-compressor 0.14's defaults, which referee_settings.json records (each modifier's resolved fields).
RECIPES = {
    "rtn-w4a16-g64": (
        ("W4A16 g64 alone (QuantizationModifier, no calibration algorithm): its round-to-nearest on its own symmetric "
         "grid (amax/7.5 over codes -8..7), the grid its GPTQ and AWQ recipes round on"),
        [("QuantizationModifier", {"targets": TARGETS, "ignore": IGNORE, "config_groups": W4A16_G64})]),
    "gptq-w4a16-g64": (
        ("GPTQ, W4A16 int4 symmetric, groups of 64 (llm-compressor's defaults: block 128, dampening 0.01, "
         "actorder static)"),
        [("GPTQModifier", {"targets": TARGETS, "ignore": IGNORE, "config_groups": W4A16_G64})]),
    "awq-w4a16-g64": (
        "AWQ with its default duo_scaling=True (scales from activations and weights), then W4A16 g64 RTN",
        [("AWQModifier", {}),
         ("QuantizationModifier", {"targets": TARGETS, "ignore": IGNORE, "config_groups": W4A16_G64})]),
    "awq-w4a16-g64-noduo": (
        "matched to quantlab's AWQ (the llm-awq reference: scales from activations only): duo_scaling=False",
        [("AWQModifier", {"duo_scaling": False}),
         ("QuantizationModifier", {"targets": TARGETS, "ignore": IGNORE, "config_groups": W4A16_G64})]),
    "sq0.8-gptq-w8a8": (
        "as llm-compressor's W8A8 int8 example: SmoothQuant smoothing_strength 0.8, then GPTQ W8A8",
        [("SmoothQuantModifier", {"smoothing_strength": 0.8}),
         ("GPTQModifier", {"targets": TARGETS, "ignore": IGNORE, "scheme": W8A8})]),
    "sq0.5-gptq-w8a8": (
        "matched strength: SmoothQuant smoothing_strength 0.5 (quantlab's alpha), then GPTQ W8A8 as the example",
        [("SmoothQuantModifier", {"smoothing_strength": 0.5}),
         ("GPTQModifier", {"targets": TARGETS, "ignore": IGNORE, "scheme": W8A8})]),
    "sq0.5-rtn-w8a8": (
        ("matched to quantlab's smoothquant-a0.5-w8a8 (RTN int8 weights under dynamic int8 inputs): SmoothQuant "
         "0.5, then QuantizationModifier W8A8 (no GPTQ)"),
        [("SmoothQuantModifier", {"smoothing_strength": 0.5}),
         ("QuantizationModifier", {"targets": TARGETS, "ignore": IGNORE, "scheme": W8A8})]),
}


def modifier_classes() -> dict:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    return {c.__name__: c for c in (GPTQModifier, QuantizationModifier, AWQModifier, SmoothQuantModifier)}


def check_w4a16_g64() -> None:
    """W4A16_G64_WEIGHTS must be the installed W4A16 preset with group_size 64 and nothing else changed."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    preset = preset_name_to_scheme("W4A16", TARGETS).weights.model_dump()
    ours = QuantizationArgs(**W4A16_G64_WEIGHTS).model_dump()
    differ = sorted(k for k in preset if preset[k] != ours.get(k))
    if differ != ["group_size"]:
        raise ValueError(f"W4A16_G64_WEIGHTS differs from the W4A16 preset in {differ}, expected group_size only: "
                         f"preset {preset}, ours {ours}")


def build_recipe(name: str) -> tuple[str, list, list[dict]]:
    """(description, modifiers, [{class, passed}]) for a recipe name; an unknown name lists the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    description, steps = RECIPES[name]
    classes = modifier_classes()
    modifiers = [classes[cls](**kwargs) for cls, kwargs in steps]
    return description, modifiers, [{"class": cls, "passed": kwargs} for cls, kwargs in steps]


def cpu_patches(classes: list[str]) -> list[str]:
    """Workarounds for running `classes` (the recipe's modifiers) without an accelerator; each one installed is
    recorded in referee_settings.json.

    llm-compressor 0.14's AWQ pins its cached block inputs (IntermediatesCache.pin_memory, awq/base.py
    _apply_smoothing) unconditionally, and torch refuses to pin memory where no accelerator exists ("Cannot access
    accelerator device when none is available"). Pinned memory only speeds host-to-device copies; here every tensor
    stays on the CPU, so skipping it changes no value.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available() or "AWQModifier" not in classes:
        return []
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return [("IntermediatesCache.pin_memory made a no-op (no accelerator: AWQ's unconditional pin_memory() fails on "
             "a CPU-only torch; pinning only speeds host-to-device copies, so no value changes)")]


def calibration_dataset(ids):
    """An already tokenized datasets.Dataset: llm-compressor uses it as it is (datasets/utils.py)."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * ids.shape[0]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", required=True, help="export_windows.py's folder (windows.npy, windows.json)")
    ap.add_argument("--recipe", required=True, choices=list(RECIPES))
    ap.add_argument("--out", required=True, help="the checkpoint folder to write (must not exist)")
    ap.add_argument("--model", help="float checkpoint folder (default: windows.json's model_dir)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    offline_hub()
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids, windows_meta = load_windows(args.windows)
    model_dir = args.model or windows_meta["model_dir"]
    threads = set_threads(args.threads)
    check_w4a16_g64()
    description, modifiers, passed = build_recipe(args.recipe)
    patches = cpu_patches([p["class"] for p in passed])
    with Clock() as load:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    oneshot_args = {"num_calibration_samples": int(ids.shape[0]), "max_seq_length": int(ids.shape[1]),
                    "shuffle_calibration_samples": False, "save_compressed": True}
    print(f"peer_llmcompressor: {args.recipe}: {description}\n  modifiers: {json.dumps(passed)}\n"
          f"  oneshot: {json.dumps(oneshot_args)}; {ids.shape[0]} windows of {ids.shape[1]} tokens", flush=True)
    with staged_output(args.out) as tmp:
        with Clock() as run:
            oneshot(model=model, processor=tokenizer, dataset=calibration_dataset(ids), recipe=modifiers,
                    output_dir=str(tmp), **oneshot_args)
        write_settings(tmp, {
            "peer": "llm-compressor", "recipe": args.recipe, "description": description,
            "model_dir": str(model_dir), "model_dtype": "float32",
            "windows": {"folder": str(Path(args.windows).expanduser()), **windows_meta},
            "modifiers": [{**p, "resolved": m.model_dump(mode="json")} for p, m in zip(passed, modifiers)],
            "oneshot": {**oneshot_args, "processor": "the model folder's tokenizer (saved with the checkpoint)",
                        "dataset": "datasets.Dataset of the windows' input_ids + all-ones attention_mask",
                        "output_dir": str(Path(args.out).expanduser())},
            "patches": patches,
            "versions": versions("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate",
                                 "datasets", "numpy"),
            "machine": machine(), "torch_threads": threads,
            "load_s": round(load.seconds, 2), "wall_s": round(run.seconds, 2),
            "wall_s_is": "oneshot: calibration, compression and save_pretrained(save_compressed=True)",
        })
    print(f"peer_llmcompressor: {args.recipe} in {run.seconds:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
