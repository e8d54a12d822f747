"""The block driver's replay helpers: ModuleCalls records a module's calls and replays them stacked along the
batch dim, with the same result as one call at a time."""
import pytest
import torch
from awq_v1_reference import build_model, calibration_ids

from quantlab.calibration.blocks import ModuleCalls, capture_block_inputs, for_each_block, run_block


def _recorded(model, name, ids, batch_tokens):
    block = model.model.layers[0]
    calls = ModuleCalls(block.get_submodule(name), batch_tokens=batch_tokens)
    hidden, kwargs = capture_block_inputs(model, ids)
    handles = calls.attach()
    run_block(block, hidden, kwargs)
    for h in handles:
        h.remove()
    return calls


@pytest.mark.parametrize("name", ["self_attn", "mlp", "mlp.down_proj"])
def test_stacked_replay_equals_one_call_at_a_time(name):
    """Reference: the same records replayed one call per forward (batch_tokens=1); rtol 1e-5 (summation order)."""
    model = build_model("llama_mha")
    ids = calibration_ids(5, 16, 300) + calibration_ids(2, 24, 300, seed=1)  # two lengths: two kinds of runs
    stacked, single = _recorded(model, name, ids, 48), _recorded(model, name, ids, 1)
    assert len(stacked.stacked()) == 3 and len(single.stacked()) == 7  # 16-token calls in runs of 3 and 2, then 24+24
    assert stacked.replay_mse() < 1e-12  # reference: the recorded outputs; tolerance: rounding of a larger GEMM
    with torch.no_grad():
        for p in model.model.layers[0].get_submodule(name).parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert stacked.replay_mse() == pytest.approx(single.replay_mse(), rel=1e-5)
    assert stacked.replay_mse() > 0


def test_unrecorded_module_is_a_clear_error():
    with pytest.raises(ValueError, match="the recorded Linear was never called"):
        ModuleCalls(torch.nn.Linear(2, 2)).replay_mse()


def test_driver_rejects_unknown_next_inputs():
    with pytest.raises(ValueError, match=r"unknown next_inputs 'fp32'; known: quantized, float"):
        for_each_block(build_model("llama_gqa"), calibration_ids(1, 8, 300), lambda *args: None, next_inputs="fp32")
