"""Streamed block-by-block calibration (calibration/streaming.py): a copy that shares the float model's blocks until
the walker reaches each gives bitwise the in-memory path's quantized model, never writes to the float model, and
holds one block of its own at a time.

Reference for equality: quantize() on a full deep copy of the same model, same windows (torch.equal on every
tensor of the state dict). The memory claim is checked on SmolLM2 (slow): the streamed run's peak RSS while
quantizing is lower by most of one model's fp32 weights.
"""
from __future__ import annotations

import copy

import pytest
import torch

from quantlab.calibration import streaming
from quantlab.core.lifecycle import quantize
from quantlab.core.qlinear import QuantLinear
from quantlab.core.registry import get_method, make_config
from quantlab.models.arch import find_blocks
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment

W4 = {"bits": 4, "group_size": 32, "symmetric": False}
CONFIGS = {
    "gptq": {"method": "gptq", **W4},
    "gptq-channel-actorder": {"method": "gptq", "bits": 3, "act_order": True},
    "gptaq": {"method": "gptaq", **W4},
    "awq": {"method": "awq", "base": {"method": "rtn", **W4}},
    "awq-quantized-inputs": {"method": "awq", "base": {"method": "rtn", **W4}, "block_inputs": "quantized"},
    "autoround": {"method": "autoround", **W4, "iters": 3, "batch_size": 2},
    "any4": {"method": "any4", "group_size": 32},
}


def _windows(n: int = 3, t: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (1, t), generator=g) for _ in range(n)]


def _snapshot(model) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (p.detach().clone(), p._version) for n, p in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streamed_codes_equal_the_full_copys_and_the_float_model_is_untouched(tiny_model, name):
    model = tiny_model[0]
    config = make_config(CONFIGS[name])
    assert get_method(config).streams_blocks(config)
    before = _snapshot(model)
    torch.manual_seed(0)
    full = copy.deepcopy(model)
    quantize(full, config, calibration=_windows(), progress=False)
    torch.manual_seed(0)
    streamed = streaming.shared_copy(model)
    quantize(streamed, config, calibration=_windows(), progress=False)
    a, b = full.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for key, (value, version) in before.items():  # no in-place write reached the float model
        p = model.state_dict(keep_vars=True)[key]
        assert p._version == version and torch.equal(p, value), key
    shared = {t.data_ptr() for t in model.parameters()}
    assert not any(t.data_ptr() in shared for block in find_blocks(streamed) for t in block.parameters())


def test_blocks_share_until_entered_and_freeze_on_leaving(tiny_model):
    """While the walker is at block i: blocks after i still hold the float model's tensors, blocks before i are
    frozen (codes, no fp32 weight)."""
    model = tiny_model[0]
    streamed = streaming.shared_copy(model)
    seen = []
    from quantlab.methods import gptq as gptq_module

    solve = gptq_module.gptq_solve_detailed

    def spy(*args, **kwargs):
        blocks = find_blocks(streamed)
        current = next(i for i, b in enumerate(blocks) if any(m.weight is args[0] for m in b.modules()
                                                            if isinstance(m, QuantLinear)))
        later = [b.self_attn.q_proj.weight.data_ptr() for b in blocks[current + 1:]]
        originals = [b.self_attn.q_proj.weight.data_ptr() for b in find_blocks(model)[current + 1:]]
        earlier = [m.frozen for b in blocks[:current] for m in b.modules() if isinstance(m, QuantLinear)]
        seen.append((current, later == originals, all(earlier)))
        return solve(*args, **kwargs)

    gptq_module.gptq_solve_detailed = spy
    try:
        quantize(streamed, make_config(CONFIGS["gptq"]), calibration=_windows(), progress=False)
    finally:
        gptq_module.gptq_solve_detailed = solve
    assert {s[0] for s in seen} == {0, 1} and all(s[1] and s[2] for s in seen)


def _experiment(model_dir, stream: bool, runs):
    return parse_experiment({"name": "stream", "model": str(model_dir), "device": "cpu",
                             "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2,
                                      "kl_windows": 2, "latency": False},
                             "calibration": {"dataset": str(model_dir / "sample.txt"), "num_samples": 2,
                                             "seq_len": 32},
                             "execution": {"stream_blocks": stream}, "run": runs})


def test_runner_rows_are_the_same_streamed_or_not(tiny_model_dir, tmp_path):
    """The run key ignores execution.stream_blocks, and every metric is bitwise the same; a rotated run (an extra
    that rewrites every weight first) takes the full copy and works either way."""
    runs = [{"name": "gptq", **CONFIGS["gptq"]},
            {"name": "gptq-rot", **CONFIGS["gptq"], "rotation": {"kind": "hadamard", "seed": 0}}]
    on, off = _experiment(tiny_model_dir, True, runs), _experiment(tiny_model_dir, False, runs)
    cpu = torch.device("cpu")
    assert [runner.run_key(on, r, cpu) for r in on.runs] == [runner.run_key(off, r, cpu) for r in off.runs]
    a = runner.run_experiment(on, tmp_path / "on", progress=False).set_index("run")
    b = runner.run_experiment(off, tmp_path / "off", progress=False).set_index("run")
    for col in ("ppl", "kl_mean", "top1_agree", "weight_mib"):
        assert a[col].tolist() == b[col].tolist(), col
    with pytest.raises(ValueError, match="execution.stream_blocks must be true or false, got 'yes'"):
        _experiment(tiny_model_dir, "yes", runs)


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_streaming_lowers_the_calibration_peak_on_smollm2(tmp_path, wikitext_dir):
    """Reference: the same run with a full copy. SmolLM2's fp32 decoder blocks hold 106.2M weights (425 MiB): the
    streamed peak must be at least 300 MiB lower. The run is AutoRound with 0 iterations (its block walk, each block
    rounded to nearest and frozen as it is left): the walk is what streams, at a fraction of GPTQ's time."""
    runs = [{"name": "autoround-0", "method": "autoround", "bits": 4, "group_size": 64, "iters": 0}]  # the walk alone
    peaks = {}
    for stream in (False, True):
        exp = parse_experiment({"name": f"peak_{stream}", "model": "smollm2-135m", "device": "cpu",
                                "eval": {"dataset": "wikitext2", "seq_len": 64, "max_windows": 1, "kl_windows": 1,
                                         "latency": False},
                                "calibration": {"dataset": "wikitext2", "split": "validation", "num_samples": 1,
                                                "seq_len": 64},
                                "execution": {"stream_blocks": stream}, "run": runs})
        df = runner.run_experiment(exp, tmp_path / str(stream), data_dir=wikitext_dir, progress=False)
        peaks[stream] = float(df["quantize_peak_rss_mib"].iloc[0])
    print(f"quantize peak RSS MiB: full copy {peaks[False]:.0f}, streamed {peaks[True]:.0f}")
    assert peaks[True] < peaks[False] - 300, peaks
