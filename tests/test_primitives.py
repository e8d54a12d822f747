"""Primitives vs brute-force references; SQNR floors; STE gradients; packing."""
import math

import pytest
import torch

from quantlab.core import packing
from quantlab.core.primitives import QParams, code_range, dequantize, fake_quantize, qparams, quantize, sqnr_db


def brute_force_fake_quant(x, bits, group_size, symmetric):
    """Loop over rows and groups in plain Python floats (the reference)."""
    qmin, qmax = code_range(bits, symmetric)
    out = torch.empty_like(x)
    k = x.shape[1]
    g = k if group_size is None else group_size
    for r in range(x.shape[0]):
        for start in range(0, k, g):
            vals = x[r, start:start + g].tolist()
            if symmetric:
                scale = max(max(abs(v) for v in vals) / qmax, torch.finfo(torch.float32).tiny)
                zero = 0
            else:
                lo, hi = min(min(vals), 0.0), max(max(vals), 0.0)
                scale = max((hi - lo) / (qmax - qmin), torch.finfo(torch.float32).tiny)
                scale = float(torch.tensor(scale, dtype=torch.float32))
                zero = min(max(round(-lo / scale), qmin), qmax)
            scale = float(torch.tensor(scale, dtype=torch.float32))
            for j, v in enumerate(vals):
                q = min(max(round(v / scale) + zero, qmin), qmax)
                out[r, start + j] = (q - zero) * scale
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 4, 5])  # 5 does not divide 18: ragged last group
@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quant_matches_brute_force(bits, group_size, symmetric):
    x = torch.randn(3, 18, generator=torch.Generator().manual_seed(bits))
    p = qparams(x, bits, group_size, symmetric)
    got = fake_quantize(x, p, bits, group_size)
    ref = brute_force_fake_quant(x, bits, group_size, symmetric)
    # reference computes in float64 then stores float32: allow one float32 ulp of the scale product
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert p.scale.shape == (3, 1 if group_size is None else math.ceil(18 / group_size))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip_exact_on_grid_values(bits, symmetric):
    qmin, qmax = code_range(bits, symmetric)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(qmin, qmax + 1, (4, 24), generator=gen)
    scale = torch.rand(4, 3, generator=gen) + 0.1
    zero = None if symmetric else torch.randint(qmin, qmax + 1, (4, 3), generator=gen)
    p = QParams(scale, zero)
    x = dequantize(codes, p, group_size=8)
    assert torch.equal(quantize(x, p, bits, 8).long(), codes)  # exact, atol=0


@pytest.mark.parametrize("bits,group_size,floor_db", [(8, None, 40.0), (4, 32, 15.0)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_sqnr_floor_on_random_weights(bits, group_size, floor_db, symmetric):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    p = qparams(w, bits, group_size, symmetric)
    assert sqnr_db(w, fake_quantize(w, p, bits, group_size)) >= floor_db


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_zero_and_constant_groups_never_divide_by_zero(symmetric, scale_dtype):
    w = torch.zeros(4, 64)
    w[1] = 0.37  # constant channel
    w[2, :32] = -2.0  # one constant group, one zero group
    p = qparams(w, 4, 32, symmetric, scale_dtype)
    assert (p.scale > 0).all() and torch.isfinite(p.scale).all()
    out = fake_quantize(w, p, 4, 32)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(64)) and torch.equal(out[2, 32:], torch.zeros(32))
    torch.testing.assert_close(out[1], w[1], rtol=0.08, atol=0)  # within half a 4-bit step


def test_non_divisible_group_uses_its_own_columns():
    """576 % 128 = 64: the last group's scale comes from its 64 columns only."""
    w = torch.randn(2, 576, generator=torch.Generator().manual_seed(2))
    w[:, 512:] *= 0.01
    p = qparams(w, 4, 128, symmetric=True)
    assert p.scale.shape == (2, 5)
    torch.testing.assert_close(p.scale[:, 4], w[:, 512:].abs().amax(1) / 7, rtol=1e-6, atol=0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_ste_gradient_is_one_inside_zero_outside(symmetric):
    bits = 4
    p = QParams(torch.tensor([[0.1]]), None if symmetric else torch.tensor([[8]], dtype=torch.int32))
    x = torch.tensor([[-5.0, -0.42, 0.0, 0.33, 0.69, 5.0]], requires_grad=True)
    fake_quantize(x, p, bits, None).sum().backward()
    qmin, qmax = code_range(bits, symmetric)
    z = 0 if symmetric else 8
    inside = ((x / 0.1).round() + z >= qmin) & ((x / 0.1).round() + z <= qmax)
    assert torch.equal(x.grad, inside.float().detach())
    assert x.grad[0, 0] == 0 and x.grad[0, -1] == 0 and x.grad[0, 2] == 1


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [1, 7, 8, 1000, 1003])
def test_pack_unpack_round_trip_and_size(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(numel))
    packed = packing.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel * bits / 8)
    assert torch.equal(packing.unpack(packed, bits, numel).long(), codes)


def test_pack_bit_layout_is_little_endian():
    assert packing.pack(torch.tensor([1, 2]), 4).tolist() == [0x21]
    assert packing.pack(torch.tensor([5, 1, 7]), 3).tolist() == [0b11001101, 0b1]  # 5=101 | 1=001 | 7=111, low bits first


def test_primitives_do_not_mutate_inputs():
    w = torch.randn(8, 16)
    before = w.clone()
    p = qparams(w, 4, 8, False)
    fake_quantize(w, p, 4, 8)
    q = quantize(w, p, 4, 8)
    q_before = q.clone()
    dequantize(q, p, 8)
    assert torch.equal(w, before) and torch.equal(q, q_before)
