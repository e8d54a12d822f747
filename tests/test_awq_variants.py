"""AWQ's version-1 behaviour, kept as the variants scale_loss="linear", clip="minmax", clip_qk=true,
block_inputs="quantized": bit for bit against version 1's code frozen in tests/awq_v1_reference.py (run live),
and the numerics of those variants against brute-force references."""
import pytest
import torch
from awq_v1_reference import CASES, awq_v1_calibrate, build_model, calibration_ids

from quantlab.calibration.awq_search import minmax_clip_ratios, scaled_error, search_clip, search_scale
from quantlab.calibration.blocks import capture_block_inputs, run_block
from quantlab.core.lifecycle import swap_in_quant_linears
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.methods.awq import AWQConfig, awq_block, awq_scale, fake_quant_weight, float_weights
from quantlab.methods.rtn import RTNConfig
from quantlab.models.arch import arch_for

LEGACY = {"scale_loss": "linear", "clip": "minmax", "clip_qk": True, "block_inputs": "quantized"}
MINMAX = AWQConfig(clip="minmax")


def _salient_inputs(tokens=512, channels=128, n_salient=4, boost=30.0, seed=0):
    """Activations (tokens, C) whose first n_salient channels are ~boost times larger (AWQ's premise)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    x[:, :n_salient] *= boost
    return x


def _direct_error(w, x, w_q, s=None):
    """Brute-force ‖W X − Q(W s)(X / s)‖² on the token rows of x (w_q already holds Q(W s))."""
    x_in = x if s is None else x / s
    return float((x @ w.T - x_in @ w_q.T).detach().double().pow(2).sum())


def _ids(n=4, t=24, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]


# ---- bit for bit against version 1 ------------------------------------------------------------

def _awq_state(case: str, fields: dict | None) -> dict[str, torch.Tensor]:
    """The frozen state (codes, scales, zeros, folded norms, input scales) after AWQ on a seeded tiny model:
    quantlab's `awq` with `fields`, or version 1's frozen code when fields is None."""
    import quantlab
    from quantlab.core.lifecycle import freeze_all
    from quantlab.core.registry import make_config

    kind, case_fields, calib = CASES[case]
    model = build_model(kind)
    config = make_config({"method": "awq", **case_fields, **(fields or {})})
    if fields is None:
        swap_in_quant_linears(model, config.base.selection, config.base.weight_spec, config.base.overrides)
        awq_v1_calibrate(model, calibration_ids(*calib), config.n_grid, config.clip_grid, config.clip_max_shrink)
        freeze_all(model)
    else:
        quantlab.quantize(model, config, calibration=calibration_ids(*calib), progress=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not any(part in k for part in ("embed", "lm_head"))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_all_variants_reproduce_version_1_bit_for_bit(case):
    """Reference: version 1's AWQ (commit f67e5e4) frozen in tests/awq_v1_reference.py, run on the same machine;
    atol = 0 on every code, scale, zero point, explicit input scale and folded norm. Covers the v -> o group
    (MHA) and BERT's explicit groups. The reference defaults must differ from it."""
    want = _awq_state(case, None)
    got = _awq_state(case, LEGACY)
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    default = _awq_state(case, {})
    assert any(not torch.equal(default[k], want[k]) for k in want)


def test_minmax_ratio_grid_keeps_its_end_point():
    assert MINMAX.clip_ratios == pytest.approx([1 - i / 20 for i in range(11)], abs=0)  # 1 ... 0.5, 11 values
    assert minmax_clip_ratios(10, 0.3) == pytest.approx([1.0, 0.9, 0.8, 0.7], abs=0)


# ---- numerics of the variants vs brute force --------------------------------------------------

def test_gram_loss_equals_direct_output_error():
    x = _salient_inputs()
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    spec = WeightSpec(3, 32)
    s = awq_scale(x.abs().mean(0), 0.5)
    got = float(scaled_error([w], x.T @ x, s, spec))
    want = _direct_error(w, x, fake_quant_weight(w * s, spec), s)
    assert got == pytest.approx(want, rel=1e-4)  # reference: brute force over tokens; fp32 Gram rounding


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_searched_scale_never_worse_than_rtn(bits, seed):
    """One group (a norm feeding two linears): the chosen α's loss <= α = 0's, measured by brute force."""
    x = _salient_inputs(seed=seed)
    gen = torch.Generator().manual_seed(seed + 10)
    weights = [torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)]
    spec = WeightSpec(bits, 32)
    s, alpha, losses = search_scale(weights, x.abs().mean(0), x.T @ x, spec, n_grid=20)
    awq = sum(_direct_error(w, x, fake_quant_weight(w * s, spec), s) for w in weights)
    rtn = sum(_direct_error(w, x, fake_quant_weight(w, spec)) for w in weights)
    assert awq <= rtn * (1 + 1e-5)  # reference: plain RTN (α = 0); tolerance: fp32 summation order
    assert min(losses) == losses[round(alpha * 20)]


@pytest.mark.parametrize("bits", [3, 4])
def test_awq_beats_rtn_with_salient_channels(bits):
    x = _salient_inputs(n_salient=4, boost=30.0)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    spec = WeightSpec(bits, 32)
    s, alpha, _ = search_scale([w], x.abs().mean(0), x.T @ x, spec)
    awq = _direct_error(w, x, fake_quant_weight(w * s, spec), s)
    rtn = _direct_error(w, x, fake_quant_weight(w, spec))
    assert alpha > 0 and awq < 0.8 * rtn  # reference: RTN on the same layer and data; at least 20% lower


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 48, None])  # 48 leaves a ragged tail of 128 columns
def test_clip_search_never_worse_and_helps_heavy_tails(symmetric, group_size):
    x = _salient_inputs(n_salient=2, boost=4.0)
    gen = torch.Generator().manual_seed(7)
    outliers = torch.rand(64, 128, generator=gen) < 0.02
    w = torch.randn(64, 128, generator=gen) + 8.0 * outliers  # sparse large weights: clipping pays off
    spec = WeightSpec(3, group_size, symmetric, "float32")
    p = search_clip(w, x.T @ x, spec, MINMAX.clip_ratios)
    clipped = _direct_error(w, x, fake_quant_weight(w, spec, p))
    minmax = _direct_error(w, x, fake_quant_weight(w, spec))
    assert p is not None and clipped < minmax  # reference: min-max RTN on the same layer; strict improvement


def test_clip_search_keeps_minmax_when_nothing_helps():
    w = torch.sign(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))  # ±1: already on the grid
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    assert search_clip(w, x.T @ x, WeightSpec(4, 32), MINMAX.clip_ratios) is None


# ---- the variants on a block of the tiny Llama -------------------------------------------------

def _prepared_llama(tiny_model, bits=4, group_size=32):
    model, _ = tiny_model
    swap_in_quant_linears(model, RTNConfig().selection, WeightSpec(bits, group_size))
    return model


def test_minmax_clip_per_layer_error_is_not_worse(tiny_model):
    """clip="minmax": each layer's output error on its scaled calibration input is <= min-max's, same scales
    (the whole-layer guard of version 1)."""
    model = _prepared_llama(tiny_model, bits=3)
    block = model.model.layers[0]
    hidden, kwargs = capture_block_inputs(model, _ids(n=8))
    awq_block(block, arch_for(model)["groups"], hidden, kwargs, AWQConfig(**LEGACY))
    layers = {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear)}
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].flatten(0, -2)))
             for n, m in layers.items()]
    with torch.no_grad(), float_weights(layers):
        run_block(block, hidden, kwargs)  # the inputs the scaled block's linears see
    for h in hooks:
        h.remove()
    improved = 0
    for name, layer in layers.items():
        x, w = torch.cat(inputs[name]), layer.weight
        with torch.no_grad():
            clipped = _direct_error(w, x, layer.quantized_weight())  # uses the searched fixed_qparams
        minmax = _direct_error(w, x, fake_quant_weight(w, layer.spec))
        assert clipped <= minmax * (1 + 1e-5), name  # reference: min-max RTN on the same scaled layer
        improved += layer.fixed_qparams is not None and clipped < minmax
    assert improved >= 1  # clipping pays off somewhere at 3 bits
