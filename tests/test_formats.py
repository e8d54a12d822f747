"""Number formats (quantlab/core/formats.py): code tables against the OCP / IEEE specs, rounding, MX and NVFP4
scale selection against hand-worked blocks and torchao's reference implementations, NF4's table, true bytes,
exact fake-quant / frozen / saved parity, and the bad inputs that must fail before a model loads."""
from __future__ import annotations

import math

import pytest
import torch

import quantlab
from quantlab.core import formats as F
from quantlab.core.qlinear import QuantLinear, WeightSpec
from quantlab.core.registry import make_config

ALL = list(F.FORMATS)
FP_ELEMENTS = ["e2m1", "e3m2", "e2m3", "e4m3", "e5m2"]


def _codes(bits):
    return torch.arange(2**bits, dtype=torch.uint8)


# ---- element code tables --------------------------------------------------------------------

# OCP MX spec v1.0 §5.3.3 (FP6/FP4) and the OFP8 spec: (max normal, min normal, min subnormal)
SPEC_LIMITS = {"e2m1": (6.0, 1.0, 0.5), "e2m3": (7.5, 1.0, 0.125), "e3m2": (28.0, 0.25, 0.0625),
               "e4m3": (448.0, 2.0**-6, 2.0**-9), "e5m2": (57344.0, 2.0**-14, 2.0**-16)}


def test_e2m1_table_is_the_spec_table():
    values = F.element_values(F.ELEMENTS["e2m1"]).tolist()
    assert values[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values[8:] == [-v for v in values[:8]]  # sign bit on top (code 8 is -0)


@pytest.mark.parametrize("name", FP_ELEMENTS)
def test_max_normal_and_subnormals_match_the_spec(name):
    e = F.ELEMENTS[name]
    mags = F.finite_magnitudes(e).double()
    max_normal, min_normal, min_sub = SPEC_LIMITS[name]
    assert e.max_value == max_normal
    assert mags[1].item() == min_sub  # code 1: the smallest subnormal
    assert mags[2**e.mbits].item() == min_normal  # the first code with exponent field 1
    subnormals = mags[: 2**e.mbits]
    assert torch.equal(subnormals, torch.arange(2**e.mbits, dtype=torch.float64) * min_sub)  # evenly spaced


@pytest.mark.parametrize("name,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_code_points_decode_like_torch(name, dtype):
    ours = F.element_values(F.ELEMENTS[name])
    theirs = _codes(8).view(dtype).double()
    same = (ours == theirs) | (torch.isnan(ours) & torch.isnan(theirs))
    assert bool(same.all())
    if name == "e4m3":
        assert torch.isnan(ours).sum() == 2 and not torch.isinf(ours).any()  # fn: S.1111.111 only, no inf
    else:
        assert torch.isinf(ours).sum() == 2 and torch.isnan(ours).sum() == 6


@pytest.mark.parametrize("name,fn", [("e2m1", "f4_unpacked_to_f32"), ("e2m3", "f6_e2m3_unpacked_to_f32"),
                                     ("e3m2", "f6_e3m2_unpacked_to_f32")])
def test_fp6_fp4_code_points_decode_like_torchao(name, fn):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    e = F.ELEMENTS[name]
    assert torch.equal(F.decode(_codes(e.bits), e), getattr(kernels, fn)(_codes(e.bits)))


def test_nf4_levels_are_the_published_table_and_its_construction():
    """QLoRA Appendix E / bitsandbytes create_normal_map(offset=0.9677083): 8 positive and 7 negative
    normal quantiles, zero, scaled by the largest."""
    table = F.element_values(F.ELEMENTS["nf4"])
    assert table.tolist() == list(F.NF4_LEVELS) and len(table) == 16 and table[7] == 0
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    built = torch.sort(torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])).values
    built = built / built.abs().max()
    assert torch.allclose(built, table, atol=1e-7, rtol=0)


# ---- rounding -------------------------------------------------------------------------------

def test_e2m1_ties_round_half_to_even_and_saturate():
    e = F.ELEMENTS["e2m1"]
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.25, -5.0, -1e9])
    assert F.decode(F.encode(x, e), e).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0, -6.0]


@pytest.mark.parametrize("name,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_encoding_equals_torch_saturated_cast(name, dtype):
    """torchao's float8 casting (to_fp8_saturated): clamp to ±max, then the RNE cast."""
    e = F.ELEMENTS[name]
    g = torch.Generator().manual_seed(0)
    mags = F.finite_magnitudes(e)
    mids = (mags[:-1] + mags[1:]) / 2  # every tie
    x = torch.cat([torch.randn(20000, generator=g) * e.max_value / 4, mids, -mids, mags, torch.tensor([1e30, -1e30])])
    expected = x.clamp(-e.max_value, e.max_value).to(dtype).view(torch.uint8)
    assert torch.equal(F.encode_by_table(x, e), expected)  # the table search, the reference for every format
    assert torch.equal(F.encode(x, e), expected)  # the fast path encode() takes for FP8


@pytest.mark.parametrize("name,fn", [("e2m1", "f32_to_f4_unpacked"), ("e2m3", "f32_to_f6_e2m3_unpacked"),
                                     ("e3m2", "f32_to_f6_e3m2_unpacked")])
def test_fp6_fp4_encoding_equals_torchao(name, fn):
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    e = F.ELEMENTS[name]
    mags = F.finite_magnitudes(e)
    mids = (mags[:-1] + mags[1:]) / 2
    x = torch.cat([torch.randn(20000, generator=torch.Generator().manual_seed(1)) * e.max_value / 3,
                   mids, -mids, mags, -mags]).clamp(-e.max_value, e.max_value)  # torchao clamps before its cast
    assert torch.equal(F.encode(x, e), getattr(kernels, fn)(x))
    assert torch.equal(F.encode_by_table(x, e), F.encode(x, e))


def test_mxint8_elements_are_sixty_fourths_symmetric():
    e = F.ELEMENTS["int8"]
    x = torch.tensor([1.0, -1.0, 1 / 128, 3 / 128, 5.0, -5.0])
    assert F.decode(F.encode(x, e), e).tolist() == [1.0, -1.0, 0.0, 2 / 64, 127 / 64, -127 / 64]


def test_nan_cannot_be_encoded():
    with pytest.raises(ValueError, match="NaN"):
        F.encode(torch.tensor([1.0, float("nan")]), F.ELEMENTS["e4m3"])


# ---- shared scales --------------------------------------------------------------------------

def test_mx_scale_hand_worked_blocks():
    fmt = F.FORMATS["mxfp4"]
    ones = torch.ones(32)
    zeros = torch.zeros(32)
    huge = torch.ones(32)
    huge[5] = 1000.0
    x = torch.stack([ones, zeros, huge])  # (3 blocks of 32)
    p = F.format_qparams(x, fmt, 32)
    # floor(log2 amax) - emax(E2M1) = 0 - 2, (-inf -> the E8M0 minimum) -127, 9 - 2
    assert (p.extra["e8m0"].view(-1).int() - 127).tolist() == [-2, -127, 7]
    q = F.format_dequantize(F.format_quantize(x, p, fmt, 32), p, fmt, 32)
    assert torch.equal(q[0], ones) and torch.equal(q[1], zeros)
    assert q[2, 5].item() == 6.0 * 128  # 1000 / 2^7 = 7.8 saturates to E2M1's 6
    assert q[2].sum().item() == 768.0  # the ones (1 / 128 in element units) flush to zero


@pytest.mark.parametrize("fmt_name,dtype", [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2),
                                            ("mxfp6_e2m3", "fp6_e2m3"), ("mxfp6_e3m2", "fp6_e3m2"),
                                            ("mxfp4", torch.float4_e2m1fn_x2)])
def test_mx_matches_torchao_to_mx_bit_for_bit(fmt_name, dtype):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    x[3, 64:96] = 0.0  # a block of zeros
    fmt = F.FORMATS[fmt_name]
    scale_e8m0, data = mx.to_mx(x, dtype, 32)
    p = F.format_qparams(x, fmt, 32)
    assert torch.equal(p.extra["e8m0"], scale_e8m0.view(torch.uint8).reshape(16, 8))
    codes = F.format_quantize(x, p, fmt, 32)
    if fmt_name == "mxfp4":
        data = kernels.unpack_uint4(data.view(torch.uint8)).reshape(16, 256)
    assert torch.equal(codes, data.view(torch.uint8).reshape(16, 256))


def test_nvfp4_matches_torchao_two_level_quantize():
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    x[0, 0] = 3.0  # one outlier sets the tensor scale
    fmt = F.FORMATS["nvfp4"]
    tensor_scale = nv.per_tensor_amax_to_scale(x.abs().amax())
    block_scale, packed = nv.nvfp4_quantize(x, 16, tensor_scale)
    p = F.format_qparams(x, fmt, 16)
    assert torch.equal(p.extra["tensor_scale"], tensor_scale)
    assert torch.equal(p.scale.to(torch.float8_e4m3fn).view(torch.uint8), block_scale.view(torch.uint8))
    codes = F.format_quantize(x, p, fmt, 16)
    assert torch.equal(codes, kernels.unpack_uint4(packed).reshape(32, 128))
    values = kernels.f4_unpacked_to_f32(codes).reshape(32, 8, 16) * (tensor_scale * block_scale.float())[..., None]
    assert torch.equal(F.format_dequantize(codes, p, fmt, 16), values.reshape(32, 128))  # NVFP4Tensor.dequantize


def test_fp8_channel_scales_equal_torchao_float8_per_row():
    tq = pytest.importorskip("torchao.quantization")
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    ref = tq.Float8Tensor.from_hp(w, float8_dtype=torch.float8_e4m3fn, granularity=tq.PerRow())
    spec = WeightSpec(format="fp8_e4m3")
    p = spec.qparams(w)
    assert torch.equal(p.scale, ref.scale.reshape(48, 1))
    assert torch.equal(spec.encode(w, p), ref.qdata.view(torch.uint8))


# ---- storage: true bytes, exact parity, save / load -----------------------------------------

def _frozen(spec, out=64, k=512, seed=0):
    torch.manual_seed(seed)
    q = QuantLinear.from_linear(torch.nn.Linear(k, out), spec)
    x = torch.randn(3, k)
    y = q(x)
    predicted = q.storage_bytes()
    q.freeze()
    return q, x, y, predicted


@pytest.mark.parametrize("name", ALL)
def test_frozen_forward_equals_fake_quant_exactly(name):
    for dq in ([False, True] if name == "nf4" else [False]):
        q, x, y, _ = _frozen(WeightSpec(format=name, double_quant=dq))
        assert torch.equal(q(x), y)  # atol=0


BITS_PER_WEIGHT = {  # (codes + scales) / weights for a 64 x 512 layer, as the specs count them
    "mxfp4": 4 + 8 / 32, "mxfp6_e2m3": 6.25, "mxfp8_e4m3": 8.25, "mxint8": 8.25,
    "nvfp4": 4 + 8 / 16 + 32 / (64 * 512), "fp8_e4m3": 8 + 32 / 512, "nf4": 4 + 32 / 64,
}


@pytest.mark.parametrize("name", BITS_PER_WEIGHT)
def test_true_bits_per_weight(name):
    q, _, _, predicted = _frozen(WeightSpec(format=name))
    assert predicted == q.storage_bytes()
    assert 8 * q.storage_bytes() / (64 * 512) == pytest.approx(BITS_PER_WEIGHT[name], abs=1e-12)


def test_nf4_fp16_scales_and_double_quant_bits():
    q, _, _, _ = _frozen(WeightSpec(format="nf4", scale_dtype="float16"))
    assert 8 * q.storage_bytes() / (64 * 512) == 4.25
    q, _, _, predicted = _frozen(WeightSpec(format="nf4", double_quant=True), out=1536, k=576)
    n_scales = 1536 * 576 // 64
    expected = 1536 * 576 / 2 + n_scales + 4 * math.ceil(n_scales / 256) + 4
    assert predicted == q.storage_bytes() == expected
    assert 8 * expected / (1536 * 576) == pytest.approx(4.127, abs=1e-3)  # QLoRA's figure


def test_double_quant_error_is_small():
    """DQ rounds each absmax to an E4M3 code of its 256-block: the absmax moves by < 2^-4 of the block's range."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(5))
    plain = F.format_qparams(w, F.FORMATS["nf4"], 64)
    dq = F.format_qparams(w, F.FORMATS["nf4"], 64, double_quant=True)
    spread = (plain.scale - plain.scale.mean()).abs().max()
    assert (dq.scale - plain.scale).abs().max() <= spread * 2**-4


def test_packed_codes_are_dense():
    q, _, _, _ = _frozen(WeightSpec(format="mxfp6_e3m2"), out=8, k=64)
    assert q.qweight.numel() == 8 * 64 * 6 // 8  # four 6-bit codes in three bytes


@pytest.mark.parametrize("spec", [
    {"method": "rtn", "format": "nf4", "double_quant": True},
    {"method": "rtn", "format": "mxfp4", "overrides": [{"pattern": "*.down_proj", "format": "nvfp4"}]},
    {"method": "rtn", "format": "fp8_e4m3", "overrides": [  # every other format on its own layer type
        {"pattern": "*.q_proj", "format": "fp8_e5m2"}, {"pattern": "*.k_proj", "format": "mxfp6_e3m2"},
        {"pattern": "*.v_proj", "format": "mxfp8_e5m2"}, {"pattern": "*.o_proj", "format": "mxint8"},
        {"pattern": "*.gate_proj", "format": "nf4"}, {"pattern": "*.up_proj", "format": "mxfp6_e2m3"},
        {"pattern": "*.down_proj", "format": "mxfp8_e4m3"}]},
    {"method": "dynamic", "act_format": "mxfp4", "base": {"method": "rtn", "format": "mxfp4"}},
    {"method": "static", "act_format": "fp8_e4m3", "base": {"method": "rtn", "format": "fp8_e4m3"}},
], ids=["nf4dq", "mxfp4+nvfp4", "all-formats", "w4a4-mxfp4", "w8a8-fp8-static"])
def test_save_load_round_trips_every_format_bit_for_bit(tiny_model_dir, tmp_path, spec):
    from quantlab.backends.serialize import load_quantized, save_quantized
    from quantlab.core.lifecycle import quant_linears

    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    config = make_config(spec)
    calib = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    quantlab.quantize(model, config, calibration=calib)
    save_quantized(model, tmp_path / "q", config, str(tiny_model_dir))
    loaded = load_quantized(tmp_path / "q")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    a, b = quant_linears(model), quant_linears(loaded)
    assert {m.spec for m in a.values()} == {m.spec for m in b.values()}
    for name in a:
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8)) for k in sa)


# ---- methods on format grids -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_e4m3", "nf4", "mxfp4", "nvfp4", "mxfp6_e2m3"])
def test_gptq_on_a_format_grid_beats_rtn_and_reduces_to_it(name):
    from quantlab.methods.gptq import gptq_solve

    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(2048, 256, generator=g) @ (0.3 * torch.randn(256, 256, generator=g)) + torch.randn(2048, 256, generator=g)
    spec = WeightSpec(format=name)
    rtn = spec.fake_quantize(w, spec.qparams(w), ste=False)
    q, p = gptq_solve(w, 2 * x.T @ x / len(x), spec)
    assert torch.equal(spec.fake_quantize(q, p, ste=False), q)  # on its own grid
    err = lambda a: float(((x @ (w - a).T) ** 2).sum())  # noqa: E731
    assert err(q) < 0.8 * err(rtn)
    assert torch.equal(gptq_solve(w, torch.eye(256), spec)[0], rtn)  # H = I: RTN exactly


def test_ste_gradient_passes_inside_the_range_and_stops_outside():
    p = F.format_qparams(torch.ones(1, 32), F.FORMATS["mxfp4"], 32)  # scale 0.25: range ±1.5
    x = torch.tensor([[0.3, -1.2, 2.0, -9.0] + [0.0] * 28], requires_grad=True)
    F.format_fake_quantize(x, p, F.FORMATS["mxfp4"], 32, ste=True).sum().backward()
    assert x.grad[0, :4].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_dynamic_fp8_activations_are_per_token():
    from quantlab.core.activations import DynamicActQuant

    x = torch.randn(4, 64) * torch.tensor([1.0, 10.0, 100.0, 1000.0])[:, None]
    y = DynamicActQuant(format="fp8_e4m3")(x)
    scale = x.abs().amax(1, keepdim=True) / 448
    assert torch.equal(y, (x / scale).to(torch.float8_e4m3fn).float() * scale)


def test_torchao_float8_export_is_exact():
    pytest.importorskip("torchao")
    from quantlab.backends.kernels import choose_kernel
    from quantlab.backends.modules import build_module

    q, x, y, _ = _frozen(WeightSpec(format="fp8_e4m3"))
    assert choose_kernel(q, torch.device("cpu")).kernel == "float8_weight_only"
    assert torch.equal(build_module("float8_weight_only", q, torch.float32)(x), y)
    mx, _, _, _ = _frozen(WeightSpec(format="mxfp4"))
    choice = choose_kernel(mx, torch.device("cpu"))
    assert choice.kernel is None and "cc >= 10.0" in choice.reason


# ---- bad input: fails before a model loads, naming the value and the valid ones ---------------

@pytest.mark.parametrize("spec,message", [
    ({"method": "rtn", "format": "fp5"}, "unknown format 'fp5'; known: int, fp8_e4m3"),
    ({"method": "rtn", "format": "mxfp4", "group_size": 64}, "fixes blocks of 32"),
    ({"method": "gptq", "format": "nvfp4", "group_size": 32}, "fixes blocks of 16"),
    ({"method": "rtn", "format": "fp8_e4m3", "bits": 6}, "8-bit elements; bits = 6"),
    ({"method": "rtn", "format": "nf4", "symmetric": False}, "symmetric"),
    ({"method": "rtn", "format": "mxfp4", "scale_dtype": "float16"}, "stores its scales as e8m0"),
    ({"method": "rtn", "format": "fp8_e4m3", "double_quant": True}, "'nf4' only"),
    ({"method": "gptq", "format": "nf4", "double_quant": True}, "column by column"),
    ({"method": "awq", "clip": "minmax", "base": {"method": "rtn", "format": "nf4"}}, "clip = \"symmetric\""),
    ({"method": "qat", "base": {"method": "rtn", "format": "mxfp4"}}, "learn_scales = false"),
    ({"method": "static", "act_format": "mxfp4"}, "unknown act_format 'mxfp4' here; known: int, fp8_e4m3"),
    ({"method": "static", "act_format": "fp8_e4m3", "observer": "mse"}, "observer 'mse'"),
    ({"method": "dynamic", "act_format": "nvfp4", "act_bits": 8, "act_symmetric": False}, "symmetric"),
    ({"method": "rtn", "overrides": [{"pattern": "*", "format": "nf3"}]}, "unknown format 'nf3'"),
])
def test_bad_format_configs_fail_clearly(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config(spec)


def test_nan_weights_fail_at_quantize_naming_the_layer(tiny_model):
    model, _ = tiny_model
    layer = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        layer.weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj: weight has 1 NaN/Inf value\(s\)"):
        quantlab.quantize(model, make_config({"method": "rtn", "format": "nvfp4"}))


def test_list_and_the_formats_page_state_the_true_bits_per_weight():
    """`quantlab list` computes bits/w from real layers; the formats page's table (docs/formats.md) must agree."""
    from pathlib import Path

    from quantlab.cli.models import format_table

    lines = {line.split()[0]: line for line in format_table()}
    assert "4.250 bits/w" in lines["mxfp4"] and "4.500 bits/w" in lines["nf4"]
    assert "6.250 bits/w" in lines["mxfp6_e2m3"] and "8.008 bits/w" in lines["fp8_e4m3"]
    assert "4.508 bits/w" in lines["nvfp4"]  # 4.5 + 32 bits per 4096-weight tensor
    readme = (Path(__file__).parents[1] / "docs" / "formats.md").read_text()
    for row in ("| `nf4` | NF4 (QLoRA's 16 levels) | fp32 absmax per 64 (fp16: 4.25) | 4.5 |",
                "| E2M1, FP6, FP8, INT8 | E8M0 per 32 | 4.25, 6.25, 8.25, 8.25 |", "| 8.008 |"):
        assert row in readme
