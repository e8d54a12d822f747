"""QAT: STE and LSQ gradients, training beats RTN, exact convert parity, bitwise resume, faults."""
import copy
import itertools
import json
import logging
import math

import pytest
import torch

import quantlab
import quantlab.qat.train as train_mod
from quantlab.core.primitives import code_range, fake_quantize, qparams
from quantlab.qat.checkpoint import load_checkpoint
from quantlab.qat.lsq import lsq_fake_quantize, lsq_grad_scale
from quantlab.qat.modules import QATLinear
from quantlab.qat.train import TrainingDiverged, distill_loss
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment

RTN3 = {"method": "rtn", "bits": 3, "group_size": 32, "symmetric": False}


def _tiny_lm(init=0.1, seed=0):
    """A 2-layer random Llama whose logits are peaked enough that quantization error shows in the KL."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, initializer_range=init,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _data(n=16, t=64, seed=1):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


def _qat(base=RTN3, **kw):
    return quantlab.make_config({"method": "qat", "base": base, "steps": 6, "seq_len": 64, "lr": 1e-3,
                                 "scale_lr": 1e-3, **kw})


def _kd(model, teacher, data):
    with torch.no_grad():
        return distill_loss(model(data).logits, teacher(data).logits).item()


# ---- numerics -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, True), (4, False), (8, True)])
def test_ste_gradient_is_one_inside_the_range_and_zero_outside_exactly(bits, symmetric):
    x = torch.linspace(-3, 3, 97).reshape(1, 97).requires_grad_(True)
    p = qparams(torch.linspace(-1.5, 1.0, 97).reshape(1, 97), bits, None, symmetric)  # range narrower than x
    fake_quantize(x, p, bits, None, ste=True).sum().backward()
    qmin, qmax = code_range(bits, symmetric)
    raw = torch.round(x.detach() / p.scale) + (0 if p.zero is None else p.zero)
    inside = ((raw >= qmin) & (raw <= qmax)).float()
    assert 0 < inside.sum() < inside.numel()  # both cases occur
    assert torch.equal(x.grad, inside)  # exact: 1 inside, 0 outside


@pytest.mark.parametrize("symmetric", [True, False])
def test_lsq_gradients_match_finite_differences(symmetric):
    """Reference: central differences (float64) of LSQ's surrogate, where each rounding residual
    round(v) - v and each clamp decision are frozen at the current point (what the STE
    differentiates), times LSQ's g."""
    bits, gs = 3, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    p0 = qparams(x, bits, gs, symmetric, torch.float64)
    scale0 = p0.scale * 0.7  # smaller than min-max so some codes clamp in every group
    zero0 = None if symmetric else p0.zero.double() + 0.3  # off-integer: round() has a residual too
    c = torch.randn(3, 16, generator=gen, dtype=torch.float64)  # loss = sum(c * x_hat)
    scale = scale0.clone().requires_grad_(True)
    zero = None if symmetric else zero0.clone().requires_grad_(True)
    (c * lsq_fake_quantize(x, scale, zero, bits, gs, scale_dtype=torch.float64)).sum().backward()

    qmin, qmax = code_range(bits, symmetric)
    g = lsq_grad_scale(gs, bits, symmetric)
    r = torch.round(x / scale0.repeat_interleave(gs, 1)) - x / scale0.repeat_interleave(gs, 1)
    rz = None if symmetric else torch.round(zero0) - zero0

    z0_ = 0 if symmetric else torch.round(zero0).repeat_interleave(gs, 1)
    code0 = torch.round(x / scale0.repeat_interleave(gs, 1)) + z0_
    inside = (code0 >= qmin) & (code0 <= qmax)
    assert 0 < inside.sum() < inside.numel()

    def surrogate(s, z):
        s_ = s.repeat_interleave(gs, 1)
        z_ = 0 if z is None else (z + rz).repeat_interleave(gs, 1)
        code = torch.where(inside, x / s_ + r + z_, torch.clamp(code0, qmin, qmax))
        return (c * (code - z_) * s_).sum()

    def fd(param, other, which):
        grad, h = torch.zeros_like(param), 1e-6
        for idx in itertools.product(*map(range, param.shape)):
            up, down = param.clone(), param.clone()
            up[idx] += h
            down[idx] -= h
            args_up = (up, other) if which == "scale" else (other, up)
            args_down = (down, other) if which == "scale" else (other, down)
            grad[idx] = (surrogate(*args_up) - surrogate(*args_down)) / (2 * h)
        return grad * g

    ref_s = fd(scale0, zero0, "scale")
    torch.testing.assert_close(scale.grad, ref_s, rtol=1e-3, atol=1e-9)
    if not symmetric:
        ref_z = fd(zero0, scale0, "zero")
        assert (ref_z != 0).all()  # every group has clamped codes, so d/dz is non-trivial
        torch.testing.assert_close(zero.grad, ref_z, rtol=1e-3, atol=1e-9)


# ---- training and convert ------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("learn_scales", [False, True])
def test_qat_lowers_quantized_loss_vs_rtn(bits, learn_scales):
    teacher, data = _tiny_lm(), _data()
    base = {**RTN3, "bits": bits}
    rtn = copy.deepcopy(teacher)
    quantlab.quantize(rtn, quantlab.make_config(base))
    qat = copy.deepcopy(teacher)
    stats = quantlab.quantize(qat, _qat(base, learn_scales=learn_scales, steps=10, batch_size=2),
                              training=data, teacher=teacher, progress=False)
    rtn_loss, qat_loss = _kd(rtn, teacher, data), _kd(qat, teacher, data)
    assert rtn_loss > 0.01
    assert qat_loss < 0.9 * rtn_loss  # at least 10% lower KL to the float model on the same data
    assert stats["train_steps"] == 10 and stats["train_tokens"] == 10 * 2 * 64
    assert stats["train_dtype"] == "float32" and stats["train_resumed_from"] == 0


def test_ptq_then_qat_starts_from_the_ptq_grid_and_needs_lr_to_leave_it():
    """GPTQ -> QAT (STE): step 0 is GPTQ's model exactly; a weight on its grid only changes code once the
    optimizer has moved it half a step, so a tiny lr returns GPTQ's codes and a large one does not."""
    from quantlab.core.lifecycle import quant_linears

    teacher, data = _tiny_lm(), _data(n=8)
    calib = [w.unsqueeze(0) for w in data]
    gptq_spec = {"method": "gptq", "bits": 3, "group_size": 32, "symmetric": False}
    gptq = copy.deepcopy(teacher)
    quantlab.quantize(gptq, quantlab.make_config(gptq_spec), calibration=calib)
    codes = {n: m.qweight for n, m in quant_linears(gptq).items()}

    def flips(lr):
        q = copy.deepcopy(teacher)
        quantlab.quantize(q, _qat(gptq_spec, learn_scales=False, lr=lr, steps=6), calibration=calib,
                          training=data, teacher=teacher, progress=False)
        layers = quant_linears(q)
        assert all(torch.equal(layers[n].scale, m.scale) for n, m in quant_linears(gptq).items())  # STE: fixed
        return sum((layers[n].qweight != c).sum().item() for n, c in codes.items())

    assert flips(1e-7) == 0
    assert flips(1e-2) > 100


BASES = [
    RTN3,
    {"method": "rtn", "bits": 4, "group_size": 40, "symmetric": True},  # ragged last group
    {"method": "gptq", "bits": 3, "group_size": 32, "symmetric": False},
    {"method": "awq", "base": {"method": "rtn", "bits": 3, "group_size": 32, "symmetric": False}},
    {"method": "dynamic", "base": {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}},
    {"method": "static", "base": {"method": "rtn", "bits": 4, "group_size": 32}, "act_granularity": "channel"},
    {"method": "static", "base": {"method": "rtn", "bits": 4}, "act_symmetric": True},
]
HQQ_BASES = [{"method": "hqq", "bits": 4, "group_size": 32},  # real-valued zeros: plain STE only
             {"method": "dynamic", "base": {"method": "hqq", "bits": 3, "group_size": 32}}]


@pytest.mark.parametrize("base,learn_scales", [(b, ls) for b in BASES for ls in (False, True)]
                         + [(b, False) for b in HQQ_BASES], ids=lambda b: json.dumps(b).replace(" ", ""))
def test_convert_equals_fake_quant_exactly_and_matches_ptq_form(base, learn_scales):
    teacher, data = _tiny_lm(), _data(n=8)
    calib = [w.unsqueeze(0) for w in data]
    config = _qat(base, learn_scales=learn_scales, steps=3)
    method = quantlab.get_method(config)
    model = copy.deepcopy(teacher)
    method.prepare(model, config)
    if method.needs_calibration_for(config):
        method.calibrate(model, config, calib)
    method.train(model, config, data, teacher, progress=False)
    with torch.no_grad():
        fake = model(data[:2]).logits
    method.convert(model, config)
    with torch.no_grad():
        frozen = model(data[:2]).logits
    assert torch.equal(fake, frozen)  # atol = 0, fp32 CPU

    ptq = copy.deepcopy(teacher)  # the same integer form PTQ of the base produces
    quantlab.quantize(ptq, config.base, calibration=calib)
    q_layers, p_layers = quantlab.core.lifecycle.quant_linears(model), quantlab.core.lifecycle.quant_linears(ptq)
    assert q_layers.keys() == p_layers.keys()
    for name, layer in q_layers.items():
        ref = p_layers[name]
        assert layer.frozen and layer.weight is None and layer.spec == ref.spec
        assert layer.qweight.dtype == ref.qweight.dtype and layer.qweight.shape == ref.qweight.shape
        assert layer.scale.dtype == ref.scale.dtype and layer.scale.shape == ref.scale.shape
        assert type(layer.act_quant) is type(ref.act_quant)
    assert quantlab.weight_stats(model) == quantlab.weight_stats(ptq)
    moved = any(not torch.equal(q_layers[n].qweight, p_layers[n].qweight) or not torch.equal(q_layers[n].scale, p_layers[n].scale)
                for n in q_layers)
    # GPTQ's weights sit exactly on grid points: 3 small STE steps with fixed scales cannot reach a rounding boundary
    assert moved == (learn_scales or base["method"] != "gptq")


def test_learned_scales_move_and_ste_keeps_them(tmp_path):
    teacher, data = _tiny_lm(), _data()
    for learn_scales in (False, True):
        config = _qat(learn_scales=learn_scales, steps=4)
        model = copy.deepcopy(teacher)
        method = quantlab.get_method(config)
        method.prepare(model, config)
        method.train(model, config, data, teacher, progress=False)
        layer = model.model.layers[0].self_attn.q_proj
        assert isinstance(layer, QATLinear)
        if learn_scales:
            start = qparams(teacher.model.layers[0].self_attn.q_proj.weight, 3, 32, False, torch.float16).scale.float()
            assert not torch.equal(layer.weight_quant.scale.detach(), start)
        else:
            assert layer.weight_quant is None and layer.fixed_qparams.scale.dtype == torch.float16


def _interrupt_at(monkeypatch, call: int, exc):
    """Make the n-th micro-batch loss raise `exc` (an exception instance) or return it (a tensor)."""
    real, calls = train_mod._loss, {"n": 0}

    def loss(*args):
        calls["n"] += 1
        if calls["n"] == call:
            if isinstance(exc, torch.Tensor):
                return exc
            raise exc
        return real(*args)

    monkeypatch.setattr(train_mod, "_loss", loss)


def _trained_state(teacher, data, config, ckpt):
    model = copy.deepcopy(teacher)
    stats = quantlab.quantize(model, config, training=data, teacher=teacher, checkpoint_dir=ckpt, progress=False)
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


@pytest.mark.parametrize("learn_scales", [False, True])
def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path, monkeypatch, learn_scales):
    teacher, data = _tiny_lm(), _data()
    config = _qat(learn_scales=learn_scales, steps=6, checkpoint_every=2, grad_accum=2, warmup_steps=1)
    ref, ref_stats = _trained_state(teacher, data, config, tmp_path / "a")
    _interrupt_at(monkeypatch, 10, KeyboardInterrupt())  # 2 micro-batches per step: dies in step 5
    with pytest.raises(KeyboardInterrupt):
        _trained_state(teacher, data, config, tmp_path / "b")
    assert load_checkpoint(tmp_path / "b")["step"] == 4
    monkeypatch.undo()
    resumed, stats = _trained_state(teacher, data, config, tmp_path / "b")
    assert stats["train_resumed_from"] == 4 and stats["train_loss_final"] == ref_stats["train_loss_final"]
    assert resumed.keys() == ref.keys()
    for k in ref:
        assert torch.equal(resumed[k], ref[k]), k  # bitwise


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    teacher, data = _tiny_lm(), _data()
    config = _qat(steps=6, checkpoint_every=2)
    _interrupt_at(monkeypatch, 5, torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 5/6.*last good checkpoint \(step 4\)"):
        _trained_state(teacher, data, config, tmp_path)
    assert load_checkpoint(tmp_path)["step"] == 4


def test_checkpoint_from_another_config_is_refused(tmp_path, monkeypatch):
    teacher, data = _tiny_lm(), _data()
    _interrupt_at(monkeypatch, 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _trained_state(teacher, data, _qat(steps=6, checkpoint_every=2), tmp_path)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="different run or config"):
        _trained_state(teacher, data, _qat(steps=6, checkpoint_every=2, lr=2e-3), tmp_path)


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    ({"lr": 0}, r"lr must be a finite number > 0, got 0"),
    ({"lr": -1e-5}, r"lr must be .* got -1e-05"),
    ({"scale_lr": 0.0}, r"scale_lr must be"),
    ({"steps": 0}, r"steps must be an integer >= 1, got 0"),
    ({"batch_size": 0}, r"batch_size must be an integer >= 1"),
    ({"dtype": "int8"}, r"unknown training dtype 'int8'; known: float32, float16, bfloat16"),
    ({"ce_weight": 0, "kd_weight": 0}, r"both 0"),
    ({"learn_scales": "yes"}, r"learn_scales must be true or false"),
    ({"base": {"method": "none"}}, r"base must be one of awq, dynamic, gptq, hqq, rtn, static .* got 'none'"),
    ({"base": {"method": "dynamic", "base": {"method": "hqq"}}}, r"hqq base has real-valued zeros"),
    ({"base": {"method": "smoothquant"}}, r"base must be one of .* got 'smoothquant'"),
    ({"base": {"method": "rtn", "bits": 9}}, r"base: bits must be an integer in 2..8"),
    ({"stepz": 3}, r"unknown config key\(s\) 'stepz' for method 'qat'"),
])
def test_bad_configs_fail_with_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        quantlab.make_config({"method": "qat", "base": RTN3, **fields})


def test_bad_training_inputs_fail_with_clear_errors():
    teacher, data = _tiny_lm(), _data(n=4)
    with pytest.raises(ValueError, match=r"batch_size=8 is larger than the training data \(4 windows of 64 tokens\)"):
        quantlab.quantize(copy.deepcopy(teacher), _qat(batch_size=8), training=data, teacher=teacher)
    with pytest.raises(ValueError, match=r"fewer than seq_len=64"):
        quantlab.quantize(copy.deepcopy(teacher), _qat(), training=data[:, :32], teacher=teacher)
    with pytest.raises(ValueError, match=r"method 'qat' trains; pass training="):
        quantlab.quantize(copy.deepcopy(teacher), _qat())
    with pytest.raises(ValueError, match=r"kd_weight=1.0 needs a teacher"):
        quantlab.quantize(copy.deepcopy(teacher), _qat(), training=data)
    with pytest.raises(ValueError, match=r"'float16' needs CUDA"):
        quantlab.quantize(copy.deepcopy(teacher), _qat(dtype="float16"), training=data, teacher=teacher)
    with pytest.raises(ValueError, match=r"checkpoint_every=2 needs a checkpoint directory"):
        quantlab.quantize(copy.deepcopy(teacher), _qat(checkpoint_every=2), training=data, teacher=teacher)


def test_ce_only_needs_no_teacher_and_bf16_autocast_runs():
    teacher, data = _tiny_lm(), _data()
    config = _qat(ce_weight=1.0, kd_weight=0.0, dtype="bfloat16", steps=2)
    assert not quantlab.get_method(config).needs_teacher_for(config)
    model = copy.deepcopy(teacher)
    stats = quantlab.quantize(model, config, training=data, progress=False)
    assert stats["train_dtype"] == "bfloat16" and 4 < stats["train_loss_final"] < 7  # CE near ln(300) = 5.7


@pytest.mark.parametrize("bf16_ms, warns", [(12.0, True), (1.5, False)])
def test_bf16_training_on_a_cpu_without_native_bf16_warns_once(monkeypatch, caplog, bf16_ms, warns):
    """A bf16 matmul >= 2x the fp32 one (AVX2: ~12x measured) warns, naming float32 as the faster dtype; float32
    training probes nothing."""
    from quantlab.util import device as device_util

    calls = []

    def fake_matmul_ms(dtype, device, **kw):
        calls.append(dtype)
        return bf16_ms if dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(device_util, "matmul_ms", fake_matmul_ms)
    with caplog.at_level(logging.WARNING, logger="quantlab.qat.train"):
        stats = quantlab.quantize(copy.deepcopy(_tiny_lm()), _qat(ce_weight=1.0, kd_weight=0.0, dtype="bfloat16",
                                                                  steps=1), training=_data(), progress=False)
    assert stats["train_dtype"] == "bfloat16" and calls == [torch.bfloat16, torch.float32]
    slow = [r.getMessage() for r in caplog.records if "bf16 matmul" in r.getMessage()]
    assert slow == ([f"training dtype 'bfloat16': a bf16 matmul on this CPU takes {bf16_ms:.1f}x the fp32 one (no "
                     "native bf16, e.g. AVX2 without AVX512_BF16/AMX); dtype = 'float32' trains faster here "
                     "(`quantlab doctor` shows the check)"] if warns else [])
    calls.clear()
    quantlab.quantize(copy.deepcopy(_tiny_lm()), _qat(ce_weight=1.0, kd_weight=0.0, steps=1), training=_data(),
                      progress=False)
    assert calls == [] and train_mod._warn_if_bf16_is_slow(torch.device("cpu"), "float32") is None


def test_lr_schedule_warms_up_then_decays_to_min():
    s = _qat(steps=10, warmup_steps=2, min_lr_ratio=0.1).settings
    f = [s.lr_factor(i) for i in range(10)]
    assert f[0] == pytest.approx(1 / 3) and f[1] == pytest.approx(2 / 3) and f[2] == pytest.approx(1.0)
    # cosine from 1 at step 2 towards 0.1 over the 8 remaining steps: 0.1 + 0.45 (1 + cos(pi k / 8))
    assert f[6] == pytest.approx(0.55, rel=1e-12)  # halfway: cos(pi / 2) = 0
    assert f[9] == pytest.approx(0.1 + 0.45 * (1 - math.cos(math.pi / 8)), rel=1e-12)  # 0.1343, 7/8 of the way
    assert all(a > b for a, b in itertools.pairwise(f[2:]))


# ---- runner ------------------------------------------------------------------------------------------

def test_runner_row_has_train_fields_and_checkpoints_are_removed(tiny_model_dir, tmp_path):
    exp = parse_experiment({
        "name": "tiny_qat", "model": str(tiny_model_dir), "device": "cpu",
        "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2, "kl_windows": 2,
                 "latency": False},
        "calibration": {"dataset": str(tiny_model_dir / "sample.txt"), "split": "validation", "num_samples": 4,
                        "seq_len": 32},
        "run": [{"name": "fp32", "method": "none"}, {"name": "rtn", **RTN3},
                {"name": "qat", "method": "qat", "base": RTN3, "steps": 2, "seq_len": 32, "checkpoint_every": 1}],
    })
    df = runner.run_experiment(exp, tmp_path / "reports", cache_dir=tmp_path / "cache", progress=False)
    row = df.iloc[2]
    assert row["train_steps"] == 2 and row["train_tokens"] == 64 and row["train_dtype"] == "float32"
    assert row["train_s"] > 0 and row["train_loss_final"] > 0 and row["calib_samples"] == 4
    assert row["scheme"] == "w3 g32 asym + QAT LSQ"
    assert not (tmp_path / "cache" / "checkpoints" / row["run_key"]).exists()
    assert "train steps" in (tmp_path / "reports" / "tiny_qat.md").read_text()
    # a run key covers the training data protocol; PTQ rows' keys are unchanged by this
    assert runner.run_key(exp, exp.runs[1], torch.device("cpu")) == df.iloc[1]["run_key"]


@pytest.mark.parametrize("base", [
    {"method": "rtn", "format": "mxfp4"}, {"method": "gptq", "format": "nvfp4"},
    {"method": "dynamic", "act_format": "fp8_e4m3", "base": {"method": "rtn", "format": "fp8_e4m3"}},
], ids=["mxfp4", "gptq-nvfp4", "fp8-w8a8"])
def test_qat_on_a_number_format_trains_with_ste_and_converts_exactly(base):
    """Plain STE through the format's rounding: weights move, scales stay the base's, frozen == fake-quant."""
    teacher, data = _tiny_lm(), _data(n=8)
    calib = [w.unsqueeze(0) for w in data]
    config = _qat(base, learn_scales=False, steps=3, lr=1e-2)
    method = quantlab.get_method(config)
    model = copy.deepcopy(teacher)
    method.prepare(model, config)
    if method.needs_calibration_for(config):
        method.calibrate(model, config, calib)
    before = {n: m.weight.detach().clone() for n, m in quantlab.core.lifecycle.quant_linears(model).items()}
    method.train(model, config, data, teacher, progress=False)
    layers = quantlab.core.lifecycle.quant_linears(model)
    assert any(not torch.equal(layers[n].weight, w) for n, w in before.items())
    with torch.no_grad():
        fake = model(data[:2]).logits
    method.convert(model, config)
    with torch.no_grad():
        assert torch.equal(model(data[:2]).logits, fake)
    assert all(m.frozen and m.spec.fmt is not None for m in layers.values())
