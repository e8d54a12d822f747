"""GPTQ: reduces to RTN with H = I; beats RTN on correlated inputs; damping, dead columns, NaN."""
import logging

import pytest
import torch

import quantlab
from quantlab.core.primitives import fake_quantize
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.methods import gptq
from quantlab.methods.gptq import GPTQConfig, gptq_solve, gptq_solve_detailed


def _weights(out_f=32, in_f=96, seed=0):
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))


def _correlated_inputs(in_f=96, n=2048, seed=1):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_f, in_f, generator=gen) * (torch.rand(in_f, generator=gen) * 3) ** 2  # uneven channel scales
    return torch.randn(n, in_f, generator=gen) @ mix / in_f**0.5


def _out_err(w, q, x):
    return (x @ w.T - x @ q.T).pow(2).sum().item()


@pytest.mark.parametrize("bits,group_size", [(4, None), (4, 32), (3, 40), (8, None)])  # 40 leaves a ragged group
@pytest.mark.parametrize("symmetric", [True, False])
def test_identity_hessian_reduces_to_rtn_exactly(bits, group_size, symmetric):
    w = _weights()
    spec = WeightSpec(bits, group_size, symmetric)
    q, p = gptq_solve(w, torch.eye(w.shape[1]), spec)
    rtn = fake_quantize(w, spec.qparams(w), bits, group_size)
    assert torch.equal(q, rtn)  # atol = 0
    assert torch.equal(p.scale, spec.qparams(w).scale)


@pytest.mark.parametrize("bits,group_size", [(4, None), (4, 32), (3, 32), (3, None)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, group_size):
    w, x = _weights(), _correlated_inputs()
    h = 2 * x.T @ x / len(x)
    spec = WeightSpec(bits, group_size, symmetric=False)
    rtn_err = _out_err(w, fake_quantize(w, spec.qparams(w), bits, group_size), x)
    q, _ = gptq_solve(w, h, spec, block_size=32)
    q_act, _ = gptq_solve(w, h, spec, block_size=32, act_order=True)
    assert _out_err(w, q, x) < 0.8 * rtn_err  # GPTQ at least 20% lower output error than RTN
    assert _out_err(w, q_act, x) < 0.8 * rtn_err  # act_order: not worse than RTN either


@pytest.mark.parametrize("act_order", [False, True])
def test_solution_lies_on_its_grid_so_freeze_is_exact(act_order):
    w, x = _weights(), _correlated_inputs()
    spec = WeightSpec(4, 32, symmetric=False)
    q, p = gptq_solve(w, 2 * x.T @ x / len(x), spec, act_order=act_order)
    assert torch.equal(fake_quantize(q, p, 4, 32), q)
    layer = QuantLinear.from_linear(torch.nn.Linear(96, 32, bias=False), spec)
    layer.weight.data.copy_(q)
    layer.fixed_qparams = p
    before = layer.quantized_weight().clone()
    layer.freeze()
    assert torch.equal(layer.quantized_weight(), before) and torch.equal(before, q)


def test_block_size_does_not_change_the_result_much():
    w, x = _weights(), _correlated_inputs()
    h = 2 * x.T @ x / len(x)
    spec = WeightSpec(4, None)
    q_small, _ = gptq_solve(w, h, spec, block_size=8)
    q_big, _ = gptq_solve(w, h, spec, block_size=128)
    # lazy batching is an exact reordering of the same updates up to float rounding
    assert (q_small != q_big).float().mean() < 0.01


def test_dead_columns_become_zero():
    w, x = _weights(), _correlated_inputs()
    x[:, 5] = 0
    h = 2 * x.T @ x / len(x)
    q, _ = gptq_solve(w, h, WeightSpec(4, 32, symmetric=False))
    assert torch.isfinite(q).all() and torch.equal(q[:, 5], torch.zeros(32))


def test_failed_cholesky_raises_damping_then_errors(caplog):
    w = _weights(4, 4)
    h = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.02]))
    with caplog.at_level(logging.WARNING):
        q, _ = gptq_solve(w, h, WeightSpec(4), where="blk.0.q_proj")
    assert torch.isfinite(q).all() and "blk.0.q_proj: Cholesky failed with damp=0.01; retrying with damp=0.1" in caplog.text
    with pytest.raises(ValueError, match="blk.0.q_proj: Hessian is not positive definite even with damp="):
        gptq_solve(w, -torch.eye(4), WeightSpec(4), where="blk.0.q_proj")
    with pytest.raises(ValueError, match="blk.0.q_proj: Hessian has NaN/Inf entries"):
        gptq_solve(w, torch.full((4, 4), float("nan")), WeightSpec(4), where="blk.0.q_proj")


def test_detailed_solve_reports_the_damping_it_used():
    """Same result as gptq_solve (exact), plus the damping: the configured one, or x10 per Cholesky retry."""
    w, x = _weights(4, 4), _correlated_inputs(4, 64)
    retry = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.02]))  # damp 0.01·mean(diag) = 0.0075 < 0.02; 0.1 is enough
    for h, damp in ((2 * x.T @ x / len(x), 0.01), (retry, 0.01 * 10)):
        sol = gptq_solve_detailed(w, h, WeightSpec(4))
        q, p = gptq_solve(w, h, WeightSpec(4))
        assert sol.damp == damp and torch.equal(sol.q, q) and torch.equal(sol.qparams.scale, p.scale)


def _indefinite_hessians(monkeypatch, layer_suffix):
    """Make the Hessian of the layers named *layer_suffix indefinite: one channel decoupled, with a diagonal
    entry of -0.03·mean(diag) (Cholesky fails with damp 0.01, succeeds with 0.1)."""
    class Indefinite(gptq.HessianObserver):
        def compute(self, where="layer"):
            h = super().compute(where)
            if where.endswith(layer_suffix):
                m = torch.diag(h).mean()
                h[0, :], h[:, 0] = 0, 0
                h[0, 0] = -0.03 * m
            return h

    monkeypatch.setattr(gptq, "HessianObserver", Indefinite)


def test_calibrate_reports_damping_diagnostics(tiny_model_dir, monkeypatch):
    calib = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    summary = quantlab.quantize(model, GPTQConfig(bits=4, group_size=32), calibration=calib, progress=False)
    assert summary["diagnostics"] == {"gptq_damp_max": 0.01, "gptq_damp_raised_layers": 0}
    _indefinite_hessians(monkeypatch, "layers.1.mlp.down_proj")
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    summary = quantlab.quantize(model, GPTQConfig(bits=4, group_size=32), calibration=calib, progress=False)
    assert summary["diagnostics"] == {"gptq_damp_max": 0.01 * 10, "gptq_damp_raised_layers": 1}
    # a gptq base reports the same through dynamic (W4A8)
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    cfg = quantlab.make_config({"method": "dynamic", "base": {"method": "gptq", "bits": 4, "group_size": 32}})
    summary = quantlab.quantize(model, cfg, calibration=calib, progress=False)
    assert summary["diagnostics"] == {"gptq_damp_max": 0.01 * 10, "gptq_damp_raised_layers": 1}


def test_solver_does_not_mutate_inputs():
    w, x = _weights(), _correlated_inputs()
    h = 2 * x.T @ x / len(x)
    w0, h0 = w.clone(), h.clone()
    gptq_solve(w, h, WeightSpec(3, 32), act_order=True)
    assert torch.equal(w, w0) and torch.equal(h, h0)


def test_config_validation():
    with pytest.raises(ValueError, match="damp must be in"):
        GPTQConfig(damp=0)
    with pytest.raises(ValueError, match="bits must be an integer in 2..8"):
        quantlab.make_config({"method": "gptq", "bits": 1})
    with pytest.raises(ValueError, match="needs calibration data"):
        quantlab.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), GPTQConfig())


def test_gptq_model_output_closer_to_float_than_rtn(tiny_model_dir):
    calib = [torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    test = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(99))
    errs = {}
    for name, cfg in [("rtn", quantlab.RTNConfig(bits=3, group_size=32)), ("gptq", GPTQConfig(bits=3, group_size=32))]:
        model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
        with torch.no_grad():
            ref = model(test).logits
        quantlab.quantize(model, cfg, calibration=calib)
        assert all(m.frozen for m in quantlab.core.lifecycle.quant_linears(model).values())
        with torch.no_grad():
            errs[name] = (model(test).logits - ref).pow(2).mean().item()
    assert errs["gptq"] < errs["rtn"]


@pytest.mark.parametrize("true_sequential", [True, False])
def test_stages_of_the_tiny_llama_block(tiny_model, true_sequential):
    """The arch table's order (q/k/v, o, gate/up, down); a block with nothing selected has no stage at all
    (it used to get one empty stage without true_sequential: a Hessian forward pass that observed nothing)."""
    from quantlab.core.lifecycle import swap_in_quant_linears
    from quantlab.methods.gptq import gptq_stages

    model, _ = tiny_model
    config = GPTQConfig(true_sequential=true_sequential, include=("model.layers.0.*",))
    swap_in_quant_linears(model, config.selection, config.weight_spec)
    stages = gptq_stages(model.model.layers[0], config, "llama")
    expected = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    assert stages == (expected if true_sequential else [[n for stage in expected for n in stage]])
    assert gptq_stages(model.model.layers[1], config, "llama") == []


@pytest.mark.parametrize("true_sequential", [True, False])
def test_stopping_each_stage_pass_early_changes_nothing(tiny_model_dir, monkeypatch, true_sequential):
    """Stage passes stop once the stage's layers have their inputs (calibration/blocks.observe_block); reference:
    the previous full block forward per stage. Same Hessians, so bitwise the same codes and scales."""
    from quantlab.calibration import blocks
    from quantlab.core.lifecycle import quant_linears

    calib = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    spec = {"method": "gptq", "bits": 3, "group_size": 32, "true_sequential": true_sequential}
    calls = []
    real = blocks.observe_block

    def counting(block, inputs, kwargs, modules):
        calls.append(sorted(modules))
        return real(block, inputs, kwargs, modules)

    monkeypatch.setattr(blocks, "observe_block", counting)
    early, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(early, quantlab.make_config(spec), calibration=calib)
    monkeypatch.setattr(blocks, "observe_block", lambda block, inputs, kwargs, modules: blocks.run_block(block, inputs, kwargs))
    full, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(full, quantlab.make_config(spec), calibration=calib)
    assert len(calls) == (8 if true_sequential else 2)  # 2 blocks x 4 stages, or one pass per block
    a, b = quant_linears(early), quant_linears(full)
    for name in a:
        assert torch.equal(a[name].qweight, b[name].qweight) and torch.equal(a[name].scale, b[name].scale), name


def test_observe_block_stops_at_the_last_observed_layer(tiny_model):
    """The q/k/v stage never reaches the MLP; a stage whose layer is never called runs the whole block."""
    from quantlab.calibration.blocks import observe_block
    from quantlab.models.arch import find_blocks

    model, _ = tiny_model
    block = find_blocks(model)[0]
    reached = []
    hook = block.mlp.register_forward_pre_hook(lambda m, a: reached.append("mlp"))
    x = torch.randn(1, 8, model.config.hidden_size)
    pos = model.model.rotary_emb(x, torch.arange(8)[None])
    observe_block(block, [x], [{"position_embeddings": pos}], {"q": block.self_attn.q_proj, "v": block.self_attn.v_proj})
    assert reached == []
    observe_block(block, [x], [{"position_embeddings": pos}], {"never": torch.nn.Linear(2, 2)})
    assert reached == ["mlp"]
    hook.remove()


@pytest.mark.parametrize("true_sequential", [True, False])
def test_sharing_one_hessian_per_input_changes_no_bit(tiny_model_dir, monkeypatch, true_sequential):
    """q/k/v (and gate/up) share one Hessian; reference: one observer per layer, as before. Same codes and scales."""
    from quantlab.core import observer_hooks, observers
    from quantlab.core.lifecycle import quant_linears

    calib = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    spec = {"method": "gptq", "bits": 3, "group_size": 32, "true_sequential": true_sequential}
    made = []
    monkeypatch.setattr(gptq, "HessianObserver", lambda: made.append(observers.HessianObserver()) or made[-1])
    shared, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(shared, quantlab.make_config(spec), calibration=calib)
    assert len(made) == 2 * 4  # 2 blocks x (q/k/v, o, gate/up, down): 8 Hessians for 14 layers
    monkeypatch.setattr(gptq, "attach_shared_input_observers", observer_hooks.attach_input_observers)
    apart, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(apart, quantlab.make_config(spec), calibration=calib)
    assert len(made) == 8 + 14
    a, b = quant_linears(shared), quant_linears(apart)
    for name in a:
        assert torch.equal(a[name].qweight, b[name].qweight) and torch.equal(a[name].scale, b[name].scale), name
