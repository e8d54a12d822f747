"""The legacy (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and IQ4 (IQ4_NL, IQ4_XS) ports against llama.cpp, byte for byte.

References: llama.cpp's own ggml_quantize_chunk through ctypes (tests/ggml_reference.py) for quantize, exact;
gguf-py's numpy dequantize for dequantize, bit for bit; gguf-py's numpy quantize as a second reference for the
unweighted legacy paths; a scalar port of best_index_int8 (brute force) for the level search. Tolerance: none.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from ggml_reference import ggml_quantize
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from quantlab.core.ggml import iquants, legacy

ALL_TYPES = (*legacy.TYPES, *iquants.TYPES)
IDS = [t.name for t in ALL_TYPES]
K = 512  # two IQ4_XS super-blocks, sixteen blocks of 32 per row


def hard_rows(seed: int, rows: int = 24, k: int = K) -> torch.Tensor:
    """randn with ×50 outliers, plus rows and blocks that exercise the edge cases of the C code."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[torch.rand(rows, k, generator=g) < 0.01] *= 50
    x[1] = 0.0                                               # all-zero row
    x[2, :256] = 0.3                                         # constant blocks (and a constant super-block)
    x[2, 256:288] = -2.5
    x[3] *= 1e-8                                             # tiny values
    x[4, :32] = -0.0                                         # negative zeros: the C's max starts at +0
    x[5] *= torch.logspace(-6, 3, k)                         # mixed scale along the row
    x[6, :256] *= 1e-20                                      # |x| under GROUP_MAX_EPS (1e-15) in IQ4_XS
    x[7, :32] = torch.randn(32, generator=g) * 1e-16
    x[8, 32:64] = torch.tensor([1.0, -1.0] * 16)             # exact ties between +max and -max
    x[9] = torch.round(x[9] * 4) / 4                         # values on a coarse grid: rounding ties
    x[10:14] *= torch.tensor([1e-3, 1.0, 1e2, 1e4])[:, None]  # rows of different scale
    return x


def importances(kind: str, k: int = K) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(7)
    if kind == "none":
        return None
    imp = torch.rand(k, generator=g) + 0.01
    if kind == "zeros":
        imp[torch.rand(k, generator=g) < 0.3] = 0.0
        imp[:32] = 0.0  # a block with no importance at all
    return imp


def quantize_rows(t, x: torch.Tensor, imp: torch.Tensor | None) -> np.ndarray:
    """(rows, K) -> (rows, bytes), as ggml_quantize_chunk: the legacy weighted paths get their row's sigma2."""
    blocks = x.reshape(-1, t.block)
    imp_blocks = None if imp is None else imp.expand_as(x).reshape(-1, t.block)
    kwargs = {}
    if t in legacy.TYPES and imp is not None:
        kwargs["sigma2"] = legacy.row_sigma2(x).repeat_interleave(x.shape[1] // t.block)
    return t.quantize(blocks, imp_blocks, **kwargs).reshape(x.shape[0], -1).numpy()


@pytest.mark.parametrize("imp_kind", ["none", "positive", "zeros"])
@pytest.mark.parametrize("t", ALL_TYPES, ids=IDS)
def test_quantize_is_llama_cpp_byte_for_byte(t, imp_kind):
    imp = importances(imp_kind)
    x = torch.cat([hard_rows(0), hard_rows(1)])  # one call: the cost is per torch op, not per row
    ours = quantize_rows(t, x, imp)
    ref = ggml_quantize(t.gguf_id, x.numpy(), None if imp is None else imp.numpy())
    bad = np.nonzero((ours != ref).reshape(-1, t.type_size).any(1))[0]
    assert bad.size == 0, f"{t.name} imp={imp_kind}: blocks {bad[:10].tolist()} of {len(ours) * K // t.block} differ"


@pytest.mark.parametrize("t", [t for t in ALL_TYPES if t.block == 32], ids=lambda t: t.name)
def test_rows_of_one_block_need_no_sigma2(t):
    """Left out, sigma2 comes from the block itself: llama.cpp's bytes when a row is one block wide."""
    x = hard_rows(3, rows=16, k=64).reshape(-1, 32)
    imp = importances("zeros", 32)
    ours = t.quantize(x, imp.expand_as(x)).numpy()
    assert np.array_equal(ours, ggml_quantize(t.gguf_id, x.numpy(), imp.numpy()))


@pytest.mark.parametrize("t", legacy.TYPES, ids=lambda t: t.name)
def test_unweighted_legacy_matches_gguf_py(t):
    """gguf-py's numpy quantize as a second reference (it takes +0 for an all -0.0 block's max where the C code
    keeps its initial +0, so the data here has no negative-zero block)."""
    x = hard_rows(4)
    x[4, :32] = 0.0
    ours = quantize_rows(t, x, None)
    assert np.array_equal(ours, gguf_quants.quantize(x.numpy(), GGMLQuantizationType(t.gguf_id)))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, NaN == NaN (a row of 1e4 scale overflows fp16: d = inf, and inf * 0 is NaN)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("t", ALL_TYPES, ids=IDS)
def test_dequantize_grid_codes_repack(t):
    x = hard_rows(5)
    raw = torch.from_numpy(quantize_rows(t, x, importances("positive"))).reshape(-1, t.type_size)
    deq = t.dequantize(raw)
    ref = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType(t.gguf_id)).reshape(deq.shape)
    assert np.array_equal(deq.numpy().view(np.uint32), ref.view(np.uint32))  # bit for bit, signed zeros too
    codes = t.codes(raw)
    scale, offset = t.grid(raw)
    assert codes.dtype == torch.uint8 and codes.shape == deq.shape and int(codes.max()) < len(t.levels)
    assert same_values(t.levels[codes.long()] * scale + offset, deq)
    assert torch.equal(t.repack(raw, codes), raw)
    other = torch.randint(0, len(t.levels), codes.shape, generator=torch.Generator().manual_seed(0))
    moved = t.repack(raw, other.to(torch.uint8))
    assert torch.equal(t.codes(moved), other.to(torch.uint8))
    assert all(same_values(a, b) for a, b in zip(t.grid(moved), (scale, offset)))


def scalar_best_index_int8(values: list[int], x: np.float32) -> int:
    """ggml-quants.c best_index_int8, line for line, in numpy float32 scalars."""
    n = len(values)
    if x <= values[0]:
        return 0
    if x >= values[n - 1]:
        return n - 1
    ml, mu = 0, n - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if np.float32(x - np.float32(values[mu - 1])) < np.float32(np.float32(values[mu]) - x) else mu


@pytest.mark.parametrize("values", [iquants.KVALUES_IQ4NL.int().tolist(), [-1, 2, 5, 100]])
def test_best_index_int8_matches_the_c_search(values):
    """Every float32 within 40 ulps of each midpoint, and random values (the second table's thresholds are off
    the half grid: 0.49999994, not 0.5)."""
    mids = [np.float32((a + b) / 2) for a, b in itertools.pairwise(values)]
    near = [(np.array(m).view(np.int32) + np.arange(-40, 41)).astype(np.int32).view(np.float32) for m in mids]
    rand = np.random.default_rng(0).normal(0, 80, 5000).astype(np.float32)
    xs = np.concatenate(near + [rand, np.array([-300, 300, 0, -0.0, 1e-30, -1e-30], dtype=np.float32)])
    ours = iquants.best_index_int8(torch.tensor(values, dtype=torch.float32), torch.from_numpy(xs)).numpy()
    ref = np.array([scalar_best_index_int8(values, np.float32(v)) for v in xs])
    assert np.array_equal(ours, ref)


def test_c_conversions():
    """(int8_t)f truncates toward zero and keeps the low byte; roundf rounds half away from zero."""
    v = torch.tensor([8.9, -8.9, 15.5, 200.0, -0.5, float("inf"), float("nan")])
    assert legacy.c_float_to_int8(v).tolist() == [8, -8, 15, -56, 0, 0, 0]
