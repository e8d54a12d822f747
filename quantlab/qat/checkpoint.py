"""Atomic training checkpoints: write to a temporary file, fsync, then rename over `latest.pt`.

A crash (or Ctrl-C) during a save leaves the previous checkpoint intact; a run resumed from
`latest.pt` continues with the same parameters, optimizer moments, schedule, RNG state and
step, so on CPU it ends bitwise equal to a run that was never interrupted (tests/test_qat.py).

>>> save_checkpoint(dir, {"step": 8, "params": {...}, "optimizer": opt.state_dict(), ...})
>>> state = load_checkpoint(dir)          # None when there is none
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "latest.pt"


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / CHECKPOINT_NAME


def save_checkpoint(directory: str | Path, state: dict[str, Any]) -> Path:
    """Atomically write `state` (tensors, state dicts, plain data) to <directory>/latest.pt."""
    path = checkpoint_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | Path | None) -> dict[str, Any] | None:
    """The state saved in <directory>/latest.pt, or None if there is no checkpoint (or no directory)."""
    if directory is None:
        return None
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
    except Exception as e:  # a file that is not a checkpoint: say which, do not silently start over
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({e.__class__.__name__}: {e}); delete it to start over") from e


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
