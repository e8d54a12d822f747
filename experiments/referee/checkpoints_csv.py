"""Record finished peer checkpoints in experiments/referee/checkpoints.csv: one row per checkpoint build.

    python3 experiments/referee/checkpoints_csv.py ~/.cache/quantlab/referee/llmcompressor-gptq-w4a16-g64 ...

Stdlib only (any python3). A row comes from the folder itself: its referee_settings.json (peer, recipe, versions,
wall time, the windows' sha256) and the sha256 and bytes of its safetensors files. A checkpoint recorded again with
the same bytes replaces its row; rebuilt with other bytes (another CPU kind, another amp dtype) it gets a row of its
own beside the earlier build's, so every build a report's `source_sha256` names stays listed. Rows are sorted by
checkpoint name, then by the CPU that built them.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path

CSV = Path(__file__).resolve().parent / "checkpoints.csv"
COLUMNS = ["checkpoint", "peer", "recipe", "peer_version", "compressed_tensors", "transformers", "torch",
           "safetensors_sha256", "safetensors_bytes", "size_mib", "wall_s", "torch_threads", "cpu",
           "windows_sha256", "windows", "model_dir", "patches"]
PEER_PACKAGE = {"llm-compressor": "llmcompressor", "auto-round": "auto-round"}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_row(folder: str | Path) -> dict:
    """The CSV row of a finished checkpoint folder (one with referee_settings.json and safetensors files).

    >>> checkpoint_row("~/.cache/quantlab/referee/autoround-w4a16-g64")["safetensors_sha256"]
    'model.safetensors:4d1b…'
    """
    folder = Path(folder).expanduser()
    settings_file = folder / "referee_settings.json"
    if not settings_file.is_file():
        raise FileNotFoundError(f"{folder} has no referee_settings.json: not a finished peer checkpoint")
    settings = json.loads(settings_file.read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors file")
    size = sum(f.stat().st_size for f in files)
    v, windows = settings["versions"], settings["windows"]
    return {
        "checkpoint": folder.name, "peer": settings["peer"], "recipe": settings["recipe"],
        "peer_version": v.get(PEER_PACKAGE.get(settings["peer"], settings["peer"])),
        "compressed_tensors": v.get("compressed-tensors"), "transformers": v.get("transformers"),
        "torch": v.get("torch"),
        "safetensors_sha256": ";".join(f"{f.name}:{file_sha256(f)}" for f in files),
        "safetensors_bytes": size, "size_mib": round(size / 2**20, 3), "wall_s": settings["wall_s"],
        "torch_threads": settings.get("torch_threads"), "cpu": settings.get("machine", {}).get("cpu"),
        "windows_sha256": windows["ids_sha256"],
        "windows": f"{windows['shape'][0]} x {windows['shape'][1]} tokens, seed {windows['seed']}, {windows['source']}",
        "model_dir": settings["model_dir"], "patches": "; ".join(settings.get("patches", [])),
    }


def record(folders, csv_path: str | Path = CSV) -> list[dict]:
    """Upsert the rows of `folders` into csv_path, one per (checkpoint, safetensors sha256); returns every row
    written."""
    csv_path = Path(csv_path)
    rows = {}
    if csv_path.is_file():
        with csv_path.open(newline="") as f:
            rows = {(r["checkpoint"], r["safetensors_sha256"]): r for r in csv.DictReader(f)}
    for folder in folders:
        row = checkpoint_row(folder)
        rows[row["checkpoint"], row["safetensors_sha256"]] = row
    ordered = sorted(rows.values(), key=lambda r: (r["checkpoint"], r["cpu"] or "", r["safetensors_sha256"]))
    tmp = csv_path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(ordered)
    tmp.replace(csv_path)
    return ordered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="finished checkpoint folders")
    ap.add_argument("--csv", default=str(CSV), help="default: experiments/referee/checkpoints.csv")
    args = ap.parse_args(argv)
    for row in record(args.folders, args.csv):
        if row["checkpoint"] in {Path(f).expanduser().name for f in args.folders}:
            print(f"checkpoints_csv: {row['checkpoint']}: {row['size_mib']} MiB, {row['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
