"""QuantLinear: fake-quant forward == frozen integer forward (exact); real byte savings."""
import math

import pytest
import torch
from torch import nn

from quantlab.core.qlinear import QuantLinear, WeightSpec


def _layer(in_f=576, out_f=48, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("group_size", [None, 64, 128])  # 128 does not divide 576
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_frozen_forward_equals_fake_quant_exactly(bits, group_size, symmetric, scale_dtype):
    q = QuantLinear.from_linear(_layer(), WeightSpec(bits, group_size, symmetric, scale_dtype))
    x = torch.randn(3, 5, 576)
    with torch.no_grad():
        w_fake, y_fake = q.quantized_weight().clone(), q(x)
        q.freeze()
        w_frozen, y_frozen = q.quantized_weight(), q(x)
    assert q.weight is None and q.frozen
    assert torch.equal(w_fake, w_frozen)  # atol = 0
    assert torch.equal(y_fake, y_frozen)


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 64, False), (3, 128, True), (8, None, True), (2, 32, False)])
def test_storage_bytes_are_real_and_shrink(bits, group_size, symmetric):
    out_f, in_f = 48, 576
    q = QuantLinear.from_linear(_layer(in_f, out_f), WeightSpec(bits, group_size, symmetric, "float16"))
    predicted = q.storage_bytes()
    q.freeze()
    groups = out_f * (1 if group_size is None else math.ceil(in_f / group_size))
    expected = math.ceil(out_f * in_f * bits / 8) + 2 * groups + (0 if symmetric else groups)
    assert predicted == q.storage_bytes() == expected
    buffers = q.qweight.nbytes + q.scale.nbytes + (0 if symmetric else q.zero_u.nbytes)
    assert buffers == expected
    assert expected < out_f * in_f * 4 * (bits + 1) / 32


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 1}, "bits must be an integer in 2..8"),
    ({"bits": 9}, "bits must be an integer in 2..8"),
    ({"group_size": 0}, "group_size must be an integer >= 1"),
    ({"group_size": -64}, "group_size must be an integer >= 1"),
    ({"scale_dtype": "float64"}, "unknown scale_dtype 'float64'; known: float32, float16, bfloat16"),
])
def test_weight_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSpec(**kwargs)


def test_quantization_error_is_close_to_float():
    lin = _layer(256, 64, bias=False)
    q = QuantLinear.from_linear(_layer(256, 64, bias=False), WeightSpec(8, None, True, "float32"))
    q.freeze()
    x = torch.randn(10, 256)
    with torch.no_grad():
        ref, got = lin(x), q(x)
    snr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())
    assert snr > 35  # dB, int8 per-channel
