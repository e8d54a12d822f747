"""Write quantlab's calibration windows as token ids, so every peer tool calibrates on identical ids (issue 30).

Runs in quantlab's own environment:

    python3 experiments/referee/export_windows.py --out ~/.cache/quantlab/referee/windows
    ... --experiment experiments/smollm2_ptq.toml --num-samples 32 --seq-len 512 --seed 0   # the defaults' source

The windows are the experiment's seeded draw from its [calibration] protocol, the validation split (never the
test split: CalibrationProtocol refuses it), drawn as EvalContext.calibration draws them (runs/context.py:
split_counts over the datasets, models/data.calibration_windows with the experiment's seed and [eval] bos).
Flags override the file's fields. Writes into --out:
  windows.npy   int64 (num_samples, seq_len), one window a row, in quantlab's order
  windows.json  model_dir (the float checkpoint folder the peers load: for an alias, quantlab's converted
                safetensors folder), the protocol, the seed, the text's source, the ids' sha256
The test split is never read here: only the calibration protocol's own split is tokenized.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_EXPERIMENT = ROOT / "experiments" / "smollm2_ptq.toml"  # SmolLM2: 32 validation windows of 512, seed 0


def calibration_draw(tokenizer, protocol, seed: int, bos_id: int | None, data_dir=None,
                     cache_dir=None) -> tuple[torch.Tensor, str]:
    """(windows (num_samples, seq_len), source): the draw EvalContext.calibration(seed, protocol) makes.

    >>> windows, source = calibration_draw(tok, CalibrationProtocol(num_samples=32), seed=0, bos_id=None)
    """
    from quantlab.models.data import calibration_windows, domain_label, load_token_ids, split_counts

    counts = split_counts(protocol.num_samples, protocol.mix or [1] * len(protocol.domains()))
    parts, sources = [], []
    for dataset, n in zip(protocol.domains(), counts):
        ids, source = load_token_ids(dataset, protocol.split, tokenizer, data_dir, cache_dir)
        parts.append(calibration_windows(ids, n, protocol.seq_len, seed, bos_id))
        sources.append(source if protocol.datasets is None else f"{domain_label(dataset)} ({n} windows): {source}")
    return torch.cat(parts), "; ".join(sources)


def resolve_protocol(args):
    """(model, seed, bos, CalibrationProtocol) from --experiment with the flags' overrides; the protocol's own
    checks run here (split = 'test' is refused)."""
    from quantlab.runs.experiment import load_experiment
    from quantlab.runs.protocols import CalibrationProtocol

    exp = load_experiment(args.experiment)
    fields = dataclasses.asdict(exp.calibration)
    if args.dataset is not None:  # one dataset replaces the file's list, as a run's calibration = {dataset} does
        fields.update(dataset=args.dataset, datasets=None, mix=None)
    overrides = {"split": args.split, "num_samples": args.num_samples, "seq_len": args.seq_len}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    protocol = CalibrationProtocol(**fields)
    model = args.model or exp.model
    seed = exp.seed if args.seed is None else args.seed
    return model, seed, args.bos or exp.eval.bos, protocol


def export_windows(model: str, protocol, seed: int, bos: str, out: str | Path, data_dir=None,
                   cache_dir=None) -> dict:
    """Write out/windows.npy and out/windows.json (see the module docstring); returns the json's dict."""
    from transformers import AutoConfig, AutoTokenizer

    from quantlab.models.data import bos_token_id
    from quantlab.models.loading import resolve_model_path

    model_dir = Path(resolve_model_path(model, cache_dir)).resolve()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model {model!r} resolves to {str(model_dir)!r}, not a local checkpoint folder; "
                                f"the peers load a folder (a built-in alias or a saved checkpoint)")
    max_positions = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    if max_positions and protocol.seq_len > max_positions:
        raise ValueError(f"calibration.seq_len {protocol.seq_len} exceeds the model's max positions ({max_positions})")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows, source = calibration_draw(tokenizer, protocol, seed, bos_token_id(tokenizer, bos), data_dir, cache_dir)
    ids = windows.numpy().astype(np.int64)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "windows.npy", ids, allow_pickle=False)
    meta = {
        "model": model, "model_dir": str(model_dir), "seed": seed, "bos": bos,
        "calibration": {k: v for k, v in dataclasses.asdict(protocol).items() if v is not None},
        "source": source, "shape": list(ids.shape), "dtype": "int64",
        "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
        "note": "quantlab's calibration draw (EvalContext.calibration), validation split; never the test split",
    }
    (out / "windows.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for windows.npy and windows.json")
    ap.add_argument("--experiment", default=str(DEFAULT_EXPERIMENT),
                    help="the experiment whose model, seed, [calibration] and [eval] bos are used "
                         "(default: experiments/smollm2_ptq.toml)")
    ap.add_argument("--model", help="alias or checkpoint folder (default: the experiment's)")
    ap.add_argument("--seed", type=int, help="default: the experiment's")
    ap.add_argument("--dataset", help="default: the experiment's calibration dataset(s)")
    ap.add_argument("--split", help="default: the experiment's calibration split (validation); 'test' is refused")
    ap.add_argument("--num-samples", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--bos", choices=("none", "prepend"), help="default: the experiment's [eval] bos")
    ap.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"),
                    help="wikitext-2 files (env QUANTLAB_DATA_DIR; default: ../shared/data/wikitext-2)")
    ap.add_argument("--cache-dir", default=os.environ.get("QUANTLAB_CACHE_DIR"),
                    help="converted models and token caches (env QUANTLAB_CACHE_DIR; default ~/.cache/quantlab)")
    args = ap.parse_args(argv)
    try:
        model, seed, bos, protocol = resolve_protocol(args)
        meta = export_windows(model, protocol, seed, bos, args.out, args.data_dir, args.cache_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"export_windows: error: {e}", file=sys.stderr)
        return 2
    print(f"export_windows: {meta['shape'][0]} windows of {meta['shape'][1]} tokens ({meta['source']}, seed {seed}) "
          f"-> {Path(args.out) / 'windows.npy'}; model_dir {meta['model_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
