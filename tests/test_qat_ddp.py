"""Data-parallel QAT (quantlab/qat/distributed.py): two gloo processes with per-rank batch 1 train the same
weights as one process with batch 2, within fp32 all-reduce round-off, and the converted models' perplexities
agree to 1e-4; a batch the processes cannot split fails clearly. Spawning a process costs a few seconds: slow."""
from __future__ import annotations

import copy

import pytest
import torch
from test_qat import _data, _qat, _tiny_lm

import quantlab
from quantlab.core.lifecycle import quant_linears
from quantlab.eval.perplexity import perplexity


def _trained(processes: int, tmp_path=None, **kw):
    teacher, data = _tiny_lm(), _data(n=8)
    config = _qat(batch_size=2, steps=4, lr=1e-2, **kw)
    model = copy.deepcopy(teacher)
    summary = quantlab.quantize(model, config, training=data, teacher=teacher, progress=False,
                                checkpoint_dir=tmp_path, train_processes=processes)
    return model, summary, data


@pytest.mark.slow
def test_two_gloo_processes_train_what_one_process_trains():
    one, s1, data = _trained(1)
    two, s2, _ = _trained(2)
    assert s2["train_processes"] == 2 and s1["train_processes"] == 1
    a, b = quant_linears(one), quant_linears(two)
    moved = 0
    for name in a:
        wa, wb = a[name].quantized_weight(), b[name].quantized_weight()
        assert torch.allclose(wa, wb, rtol=0, atol=1e-6), name  # codes x scales: identical up to round-off flips
        moved += int((a[name].qweight != b[name].qweight).sum())
    assert moved <= 2  # at most a code at a rounding boundary
    p1, p2 = perplexity(one, data[:4], progress=False)["ppl"], perplexity(two, data[:4], progress=False)["ppl"]
    assert p2 == pytest.approx(p1, rel=1e-4)
    assert s2["train_loss_final"] == pytest.approx(s1["train_loss_final"], rel=1e-4)  # the global mean loss


@pytest.mark.slow
def test_rank0_checkpoints_and_a_resume_with_either_world_size_ends_the_same(tmp_path):
    """Rank 0 alone writes <dir>/latest.pt (at step 2 of 4 here); a fresh run pointed at it resumes from step 2,
    with 2 processes or with 1, and ends with the uninterrupted run's weights."""
    full, s_full, _ = _trained(2, tmp_path, checkpoint_every=2)
    assert (tmp_path / "latest.pt").exists() and s_full["train_resumed_from"] == 0
    for processes in (2, 1):
        resumed, s, _ = _trained(processes, tmp_path, checkpoint_every=2)
        assert s["train_resumed_from"] == 2
        for name, layer in quant_linears(full).items():
            assert torch.allclose(quant_linears(resumed)[name].quantized_weight(), layer.quantized_weight(),
                                  rtol=0, atol=1e-6), (processes, name)


def test_a_batch_the_processes_cannot_split_fails_clearly():
    teacher, data = _tiny_lm(), _data(n=8)
    model = copy.deepcopy(teacher)
    with pytest.raises(ValueError, match=r"qat_processes = 2 must divide batch_size = 1"):
        quantlab.quantize(model, _qat(batch_size=1), training=data, teacher=teacher, progress=False,
                          train_processes=2)


@pytest.mark.slow
def test_the_runner_trains_with_execution_qat_processes(tiny_model_dir, tmp_path):
    from quantlab.reporting.results import read_rows
    from quantlab.runs.experiment import parse_experiment
    from quantlab.runs.runner import run_experiment

    text = str(tiny_model_dir / "sample.txt")
    exp = parse_experiment({
        "name": "ddp", "model": str(tiny_model_dir), "device": "cpu", "execution": {"qat_processes": 2},
        "eval": {"dataset": text, "seq_len": 32, "max_windows": 2, "kl_windows": 1, "latency": False},
        "calibration": {"dataset": text, "num_samples": 4, "seq_len": 32},
        "run": [{"name": "qat", "method": "qat", "steps": 2, "batch_size": 2, "seq_len": 32,
                 "base": {"method": "rtn", "bits": 4, "group_size": 32}}]})
    run_experiment(exp, tmp_path, progress=False, cache_dir=tmp_path / "cache")
    (row,) = read_rows(tmp_path / "ddp.results.jsonl")
    assert row["train_processes"] == 2 and row["train_steps"] == 2 and row["ppl"] > 0
