"""SpinQuant (transforms/spinquant.py): the Cayley step stays on the manifold and descends; learned R1/R2 are
orthogonal, lower the activation-quantized loss, leave the float model unchanged, and fold exactly."""
import copy

import pytest
import torch

import quantlab
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment
from quantlab.transforms.rotation import RotationConfig, rotate_model
from quantlab.transforms.spinquant import cayley_step, learn_rotations, random_hadamard


def test_cayley_step_stays_orthogonal_and_descends():
    g = torch.Generator().manual_seed(0)
    a, target = torch.randn(8, 3, generator=g, dtype=torch.float64), torch.linalg.qr(
        torch.randn(8, 8, generator=g, dtype=torch.float64))[0]
    x = random_hadamard(8, 0)
    f0 = None
    for _ in range(60):
        xr = x.clone().requires_grad_(True)
        f = (xr @ a - target @ a).pow(2).sum()
        grad, = torch.autograd.grad(f, xr)
        f0 = f.item() if f0 is None else f0
        x = cayley_step(x, grad, 0.1)
        torch.testing.assert_close(x @ x.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float((x @ a - target @ a).pow(2).sum()) < 1e-3 * f0  # measured: 5e-5 of the start after 50 steps


def test_cayley_step_size_is_lr_until_the_one_norm_cap_binds():
    """Reference: the cap 1 / ||W||_1 by hand (W = -(G^T X - X^T G) / 2 for an orthogonal X, its largest column
    sum); a small gradient takes lr, a large one the cap, and the step taken equals cayley_step's."""
    from quantlab.transforms.spinquant import cayley_step_size

    x = random_hadamard(8, 0)
    grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = -0.5 * (grad.T @ x - x.T @ grad)
    cap = 1 / float(w.abs().sum(0).max())
    assert cayley_step_size(x, grad, 10.0) == pytest.approx(cap, rel=1e-6)
    assert cayley_step_size(x, grad * 1e-6, 0.5) == 0.5
    eye = torch.eye(8, dtype=torch.float64)  # the retraction at that step, by hand
    y = torch.linalg.solve(eye - 0.5 * cap * w, (eye + 0.5 * cap * w) @ x.T).T
    torch.testing.assert_close(cayley_step(x, grad, 10.0), y, rtol=0, atol=1e-9)


def _outlier_model(tiny_model_dir):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :3] *= 30  # outlier channels in the residual stream, as LLMs have
    return model


def _windows(n=4):
    return [torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def test_learned_rotations_are_orthogonal_lower_the_loss_and_fold_exactly(tiny_model_dir):
    model = _outlier_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _windows(1)[0]
    with torch.no_grad():
        ref = model(ids).logits
    cfg = RotationConfig(kind="spinquant", steps=20)
    learned = learn_rotations(model, _windows(), cfg, act_bits=4, act_symmetric=False, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the float model is untouched
    for r in [learned.r1, *learned.r2]:
        torch.testing.assert_close(r @ r.T, torch.eye(r.shape[0], dtype=torch.float64), rtol=0, atol=1e-5)
    assert len(learned.r2) == 2 and not torch.equal(learned.r1, random_hadamard(64, 0))
    assert learned.loss_after < learned.loss_before  # measured 14.4867 -> 14.4858 on this random model
    assert len(learned.r1_step_sizes) == 20 and all(0 < a <= 1.5 for a in learned.r1_step_sizes)
    rot = copy.deepcopy(model)
    facts = rotate_model(rot, cfg, learned)
    with torch.no_grad():
        out = rot(ids).logits
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()  # the QuaRot tolerance of test_rotation
    assert facts["rotation"] == "rot spinquant R1+R2+R4+o_proj online (20 steps)"


def test_windows_per_step_averages_the_windows_gradients(tiny_model_dir):
    """Two copies of one window per step give bitwise the rotations of that window alone (the mean of equal
    gradients, halved and summed exactly); two different windows per step give other rotations than either alone."""
    model = _outlier_model(tiny_model_dir)
    a, b = _windows(2)
    learn = lambda ws, k: learn_rotations(model, ws, RotationConfig(kind="spinquant", steps=3, windows_per_step=k),
                                          act_bits=4, act_symmetric=False, progress=False)
    single, doubled = learn([a], 1), learn([a, a], 2)
    assert torch.equal(single.r1, doubled.r1) and all(torch.equal(x, y) for x, y in zip(single.r2, doubled.r2))
    pair = learn([a, b], 2)
    assert not torch.equal(pair.r1, single.r1) and not torch.equal(pair.r1, learn([b], 1).r1)
    cfg = RotationConfig(kind="spinquant", steps=3, windows_per_step=2)
    assert cfg.to_dict()["windows_per_step"] == 2 and "windows_per_step" not in RotationConfig(kind="spinquant").to_dict()
    assert cfg.describe() == "rot spinquant R1+R2+R4+o_proj online (3 steps x 2 windows)"
    with pytest.raises(ValueError, match="windows_per_step"):
        RotationConfig(kind="spinquant", windows_per_step=0)


def test_the_learned_rotation_is_what_the_hooks_trained(tiny_model_dir):
    """The folded model with activations quantized gives the loss learn_rotations measured with its hooks."""
    model = _outlier_model(tiny_model_dir)
    cfg = RotationConfig(kind="spinquant", steps=5)
    windows = _windows()
    learned = learn_rotations(model, windows, cfg, act_bits=4, act_symmetric=False, progress=False)
    quantlab.quantize(model, quantlab.make_config({"method": "dynamic", "act_bits": 4, "act_symmetric": False,
                                                   "base": {"method": "rtn", "bits": 8}}))
    # act-only quantization in the hooks vs W8A4 here: close, not equal (the weights' 8-bit rounding)
    rot = _outlier_model(tiny_model_dir)
    rotate_model(rot, cfg, learned)
    from quantlab.core.activations import DynamicActQuant
    from quantlab.core.qlinear import QuantLinear
    quantlab.quantize(rot, quantlab.make_config({"method": "rtn", "bits": 8, "exclude": ["lm_head"]}))
    for m in rot.modules():
        if isinstance(m, QuantLinear):
            m.act_quant = DynamicActQuant(4, False)
    with torch.no_grad():
        losses = []
        for w in windows:
            logits = rot(w).logits[:, :-1]
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 300), w[:, 1:].reshape(-1))))
    assert sum(losses) / len(losses) == pytest.approx(learned.loss_after, rel=2e-3)


def _experiment(model_dir, runs):
    return parse_experiment({"name": "spin", "model": str(model_dir), "device": "cpu",
                             "eval": {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2,
                                      "kl_windows": 2, "latency": False},
                             "calibration": {"dataset": str(model_dir / "sample.txt"), "num_samples": 2,
                                             "seq_len": 32},
                             "run": runs})


def test_a_spinquant_run_learns_then_quantizes(tiny_model_dir, tmp_path):
    w4a4 = {"method": "dynamic", "act_bits": 4, "base": {"method": "rtn", "bits": 4, "group_size": 32}}
    exp = _experiment(tiny_model_dir, [{"name": "spin", **w4a4, "rotation": {"kind": "spinquant", "steps": 3}},
                                      {"name": "had", **w4a4, "rotation": {}}])
    keys = [runner.run_key(exp, r, torch.device("cpu")) for r in exp.runs]
    assert len(set(keys)) == 2
    df = runner.run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert df.loc["spin", "scheme"].endswith("rot spinquant R1+R2+R4+o_proj online (3 steps)")
    assert df.loc["spin", "spinquant_act_bits"] == 4 and df.loc["spin", "calib_samples"] == 2
    assert 0 < df.loc["spin", "spinquant_loss_after"] < 20 and 0 < df.loc["spin", "spinquant_loss_before"] < 20


@pytest.mark.parametrize("run,match", [
    ({"method": "rtn", "bits": 4, "rotation": {"kind": "spinquant"}}, "quantizes no activations"),
    ({"method": "dynamic", "act_bits": 4, "rotation": {"kind": "spinquant", "scope": "online"}},
     "kind 'spinquant' is not supported with it"),
    ({"method": "dynamic", "act_bits": 4, "rotation": {"kind": "spinquant", "r2": False}}, "needs .* r2 = true"),
    ({"method": "dynamic", "act_bits": 4, "rotation": {"kind": "spinquant", "steps": 0}}, "steps must be"),
    ({"method": "dynamic", "act_bits": 4, "rotation": {"kind": "spinquant", "lr": -1}}, "lr must be a number > 0"),
])
def test_bad_spinquant_runs_fail_before_loading(tiny_model_dir, run, match):
    with pytest.raises(ValueError, match=match):
        _experiment(tiny_model_dir, [{"name": "a", **run}])


def test_spinquant_on_an_architecture_without_rotation_facts_names_the_supported_ones():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="model_type 'bert' has no rotation facts .*supported: llama, mistral, qwen2"):
        learn_rotations(bert, _windows(1), RotationConfig(kind="spinquant", steps=1), 4, False, progress=False)


def test_loss_along_the_first_step_starts_at_the_start_and_leaves_the_model(tiny_model_dir):
    """Reference: t = 0 is the start's loss on the gradient's window (what learn_rotations measures on it first), a
    small step along the first gradient lowers it on this smooth tiny model, and the float model is unchanged."""
    from quantlab.transforms.spinquant import loss_along_first_step

    model = _outlier_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = _windows()
    cfg = RotationConfig(kind="spinquant", steps=1)
    rows = loss_along_first_step(model, windows, cfg, 4, False, [0.0, 1e-3], held_out=2)
    assert [r["t"] for r in rows] == [0.0, 1e-3] and rows[0]["step"] == 0 and 0 < rows[1]["step"] <= 1e-3
    first = learn_rotations(model, windows[:1], RotationConfig(kind="spinquant", steps=1, lr=1e-12), 4, False,
                            progress=False)
    assert rows[0]["grad_loss"] == pytest.approx(first.loss_before, rel=1e-6)  # one window: the same loss
    assert rows[1]["grad_loss"] < rows[0]["grad_loss"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_loss_under_perturbation_starts_at_the_start_and_grows_with_eps(tiny_model_dir):
    """Reference: eps 0 is the start's loss (learn_rotations' loss_before on the same windows); on this smooth tiny
    model a change of 1e-6 moves the loss far less than one of 0.3; the model is unchanged."""
    from quantlab.transforms.spinquant import loss_under_perturbation

    model = _outlier_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = _windows()
    rows = loss_under_perturbation(model, windows, RotationConfig(kind="spinquant"), 4, False, [1e-6, 0.3], draws=2)
    assert [(r["eps"], r["draw"]) for r in rows] == [(0.0, 0), (1e-6, 0), (1e-6, 1), (0.3, 0), (0.3, 1)]
    start = learn_rotations(model, windows, RotationConfig(kind="spinquant", steps=1, lr=1e-12), 4, False,
                            progress=False).loss_before
    assert rows[0]["loss"] == pytest.approx(start, rel=1e-6)
    tiny = max(abs(r["loss"] - rows[0]["loss"]) for r in rows if r["eps"] == 1e-6)
    large = max(abs(r["loss"] - rows[0]["loss"]) for r in rows if r["eps"] == 0.3)
    assert tiny < 0.01 * large
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
