"""The environment stamped into every result row."""
from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path

import torch


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_sha() -> str:
    """HEAD of the quantlab checkout (+ '-dirty' with uncommitted changes outside reports/), or 'unknown'."""
    repo = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        # code, not results: a run rewriting reports/ (or --force deleting them) leaves the code clean
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!reports"],
                               cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict:
    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "torchao": _version("torchao"),
        "quantlab": _version("quantlab"),
        "python": platform.python_version(),
        "git_sha": git_sha(),
    }
