"""What both peer scripts share: read the exported windows, write a checkpoint folder whole, record settings.

Runs inside a peer's venv: stdlib, numpy and torch only, nothing from quantlab.

    windows, meta = load_windows("~/.cache/quantlab/referee/windows")   # (n, seq_len) int64, windows.json
    with staged_output(out) as tmp:            # tmp beside out, renamed to out only when the block succeeds
        ...save the checkpoint into tmp...
        write_settings(tmp, {...})
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

SETTINGS_FILE = "referee_settings.json"


def offline_hub() -> None:
    """Nothing downloads from the model or dataset hub: set before transformers / datasets are imported."""
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"


def load_windows(folder: str | Path) -> tuple[np.ndarray, dict]:
    """(ids (n, seq_len) int64, windows.json) from export_windows.py's folder; the ids must match the recorded
    sha256 and shape, so a peer never calibrates on a file other than the one quantlab drew."""
    folder = Path(folder).expanduser()
    meta = json.loads((folder / "windows.json").read_text())
    ids = np.load(folder / "windows.npy", allow_pickle=False)
    digest = hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()
    if ids.dtype != np.int64 or list(ids.shape) != meta["shape"] or digest != meta["ids_sha256"]:
        raise ValueError(f"{folder}/windows.npy ({ids.dtype}, shape {list(ids.shape)}, sha256 {digest[:12]}) does "
                         f"not match windows.json (int64, shape {meta['shape']}, sha256 {meta['ids_sha256'][:12]})")
    return ids, meta


def versions(*packages: str) -> dict:
    """{package: installed version} (None where missing), with python's."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    """The CPU the wall time was measured on: its model name (Linux /proc/cpuinfo) and logical core count."""
    name = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        name = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("model name")), name)
    return {"cpu": name, "logical_cores": os.cpu_count()}


def set_threads(threads: int | None) -> int:
    """torch's intra-op threads (None: torch's default); returns the number in use."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def staged_output(out: str | Path):
    """A temporary folder beside `out`, renamed to `out` when the block succeeds and removed when it fails,
    so an interrupted run never leaves a folder that looks finished. An existing `out` is an error."""
    out = Path(out).expanduser()
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it to build this checkpoint again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_settings(folder: Path, settings: dict) -> Path:
    """folder/referee_settings.json, printed too (every setting passed, the versions, the wall time)."""
    text = json.dumps(settings, indent=1, default=str) + "\n"
    print(text, end="")
    path = Path(folder) / SETTINGS_FILE
    path.write_text(text)
    return path


class Clock:
    """Wall time of a block: `with Clock() as c: ...; c.seconds`."""

    def __enter__(self):
        self.start, self.seconds = time.perf_counter(), None
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
