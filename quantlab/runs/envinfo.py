"""The environment stamped into every result row."""
from __future__ import annotations

import importlib.metadata
import os
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


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni")  # the x86 vector sets below AVX-512


def cpu_facts(cpuinfo: str | None = None) -> dict:
    """What this CPU is, from /proc/cpuinfo (else platform): model, logical CPUs, SIMD (SSE4.2 to AVX-VNNI), AVX-512
    and AMX flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():  # the first processor's block is enough: the flags are the same on all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name") or platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "cpu_simd": " ".join(f for f in SIMD_FLAGS if f in flags) or "none",
            "cpu_avx512": " ".join(sorted(f for f in flags if f.startswith("avx512"))) or "none",
            "cpu_amx": " ".join(sorted(f for f in flags if f.startswith("amx"))) or "none"}


def cpu_isa(facts: dict) -> str:
    """The widest vector / matrix extension of cpu_facts(), in one word: "amx", "avx512", "avx2", "avx", "sse4_2" or
    "none" (the machine kinds whose speed ratios differ)."""
    if facts["cpu_amx"] != "none":
        return "amx"
    if facts["cpu_avx512"] != "none":
        return "avx512"
    simd = facts["cpu_simd"].split()
    return next((isa for isa in ("avx2", "avx", "sse4_2") if isa in simd), "none")


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was while a row was timed."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


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
        # the CPU every row's timings (calibrate_s, eval_s, latency) ran on, CUDA rows included (the host)
        "cpu_model": (facts := cpu_facts())["cpu_model"],
        "cpu_isa": cpu_isa(facts),
    }
