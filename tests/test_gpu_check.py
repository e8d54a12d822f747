"""experiments/gpu_check.py: runs here as a CPU fallback and writes its CSVs; on CUDA the full sweep."""
from __future__ import annotations

import importlib.util

import pandas as pd
import pytest
import torch
from conftest import REPO


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "experiments" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU fallback")
def test_cpu_fallback_sweep_on_the_tiny_model(tiny_model_dir, tmp_path):
    assert _gpu_check().main(["--out", str(tmp_path), "--model", str(tiny_model_dir), "--no-quickstart"]) == 0
    df = pd.read_csv(tmp_path / "gpu_check_sweep.csv")
    assert list(df["config"]) == ["fp32", "int8-wo", "w8a8-dynamic", "int4-g64"]
    assert list(df["backend"]) == ["float", "torchao", "torchao", "torchao+simulated"]  # tiny down_proj: in 96
    assert (df["prefill_ms_p50"] > 0).all() and df.loc[0, "prefill_speedup"] == 1.0
    assert (tmp_path / "gpu_check_sweep.md").read_text().startswith("# gpu_check sweep")
    assert (tmp_path / "env.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU fallback")
def test_cpu_fallback_full_command(tmp_path):
    """The command a GPU machine would run, here on CPU: quickstart (reduced) + SmolLM2 sweep."""
    assert _gpu_check().main(["--out", str(tmp_path)]) == 0
    quick = pd.read_csv(tmp_path / "smollm2_quickstart_cpu_fallback.csv")
    assert list(quick["run"]) == ["fp32", "rtn-w8-channel"] and quick["ppl"].notna().all()
    sweep = pd.read_csv(tmp_path / "gpu_check_sweep.csv")
    assert set(sweep["backend"]) == {"float", "torchao"} and "error" not in sweep


@pytest.mark.gpu
def test_gpu_sweep_measures_vram(tmp_path):
    assert _gpu_check().main(["--out", str(tmp_path), "--no-quickstart"]) == 0
    sweep = pd.read_csv(tmp_path / "gpu_check_sweep.csv")
    assert (sweep.loc[sweep["batch_size"] == 8, "peak_vram_mib"] > 0).all()
