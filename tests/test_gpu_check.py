"""experiments/gpu_check.py: runs here as a CPU fallback and writes its CSVs; on CUDA the full sweep."""
from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest
import torch
from conftest import REPO


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "experiments" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def no_cuda(monkeypatch):
    """The CPU fallback, also on a CUDA machine (instead of a skip there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_fallback_sweep_on_the_tiny_model(tiny_model_dir, tmp_path, no_cuda):
    assert _gpu_check().main(["--out", str(tmp_path), "--model", str(tiny_model_dir), "--no-quickstart"]) == 0
    df = pd.read_csv(tmp_path / "gpu_check_sweep.csv")
    assert list(df["config"]) == ["fp32", "int8-wo", "w8a8-dynamic", "int4-g64"]
    assert list(df["backend"]) == ["float", "torchao", "torchao", "torchao+simulated"]  # tiny down_proj: in 96
    assert (df["batch_size"] == 1).all() and (df["prefill_ms_p50"] > 0).all()
    # speedups: the fp32 row's p50 over each row's p50 (same batch), recomputed from the CSV's latencies
    fp32 = df.iloc[0]
    for phase, col in (("prefill", "prefill_ms_p50"), ("decode", "decode_ms_per_token_p50")):
        assert df[f"{phase}_speedup"].tolist() == pytest.approx((fp32[col] / df[col]).tolist(), rel=1e-9), phase
    assert (tmp_path / "gpu_check_sweep.md").read_text().startswith("# gpu_check sweep")
    assert json.loads((tmp_path / "env.json").read_text())["cuda"] is False


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_cpu_fallback_full_command(tmp_path, no_cuda, wikitext_dir):
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
