"""The k-quant ports (Q2_K .. Q6_K) against llama.cpp, byte for byte, with and without an importance vector.

References: llama.cpp's own ggml_quantize_chunk through ctypes (tests/ggml_reference.py) for quantize, exact;
gguf-py's numpy dequantize for dequantize, bit for bit (signed zeros included); the contract's identity
dequantize == levels[codes] * scale + offset, bit for bit; scalar C semantics (numpy float32) for the primitives.
Tolerance: none anywhere.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ggml_reference import ggml_quantize
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from quantlab.core.ggml import common, kquants

IDS = [t.name for t in kquants.TYPES]
K = 768  # three super-blocks per row


def hard_rows(seed: int, rows: int = 24, k: int = K) -> torch.Tensor:
    """randn with ×50 outliers, plus rows and blocks that exercise the edge cases of the C code."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[torch.rand(rows, k, generator=g) < 0.01] *= 50
    x[1] = 0.0                                               # all-zero row
    x[2, :256] = 0.3                                         # a constant super-block
    x[2, 256:512] = -2.5                                     # a constant negative one (min < 0, max == min)
    x[2, 528:544] = 1.0                                      # a constant sub-block
    x[3] *= 1e-8                                             # tiny values (fp16 super-scales underflow)
    x[4, :32] = -0.0                                         # negative zeros
    x[4, 48:64] = 0.0                                        # an all-zero sub-block of 16 in a live block
    x[5] *= torch.logspace(-6, 3, k)                         # mixed scale along the row
    x[6, :256] *= 1e-39                                      # subnormals: the C's iscale overflows to inf
    x[7, :256] = x[7, :256].abs()                            # all-positive (min clamps to 0)
    x[7, 256:512] = -x[7, 256:512].abs()                     # all-negative
    x[8] = torch.round(x[8] * 4) / 4                         # values on a coarse grid: rounding ties
    x[9, :] = 0.0
    x[9, 100] = 5.0                                          # one non-zero weight
    x[10:14] *= torch.tensor([1e-3, 1.0, 1e2, 1e4])[:, None]  # rows of different scale
    x[14] *= torch.repeat_interleave(torch.logspace(-7, 2, k // 16), 16)  # sub-blocks of different scale
    return x


def importances(kind: str, k: int = K) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(7)
    if kind == "none":
        return None
    imp = torch.rand(k, generator=g) ** 2 + 1e-3
    if kind == "zeros":
        imp[torch.rand(k, generator=g) < 0.3] = 0.0
        imp[:32] = 0.0      # a sub-block (and part of the next) with no importance at all
        imp[256:512] = 0.0  # a whole super-block with none
    return imp


def quantize_rows(t, x: torch.Tensor, imp: torch.Tensor | None) -> np.ndarray:
    blocks = x.reshape(-1, kquants.QK_K)
    imp_blocks = None if imp is None else imp.expand_as(x).reshape(-1, kquants.QK_K)
    return t.quantize(blocks, imp_blocks).reshape(x.shape[0], -1).numpy()


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return torch.cat([hard_rows(0), hard_rows(1)])  # one call per type: the cost is per torch op, not per row


@pytest.mark.parametrize("imp_kind", ["none", "positive", "zeros"])
@pytest.mark.parametrize("t", kquants.TYPES, ids=IDS)
def test_quantize_is_llama_cpp_byte_for_byte(t, imp_kind, rows):
    imp = importances(imp_kind)
    ours = quantize_rows(t, rows, imp)
    ref = ggml_quantize(t.gguf_id, rows.numpy(), None if imp is None else imp.numpy())
    bad = np.nonzero((ours != ref).reshape(-1, t.type_size).any(1))[0]
    assert bad.size == 0, f"{t.name} imp={imp_kind}: blocks {bad[:10].tolist()} of {rows.numel() // 256} differ"


@pytest.mark.parametrize("t", kquants.TYPES, ids=IDS)
def test_dequantize_grid_codes_and_repack_agree_bit_for_bit(t, rows):
    raw = torch.from_numpy(ggml_quantize(t.gguf_id, rows.numpy(), importances("zeros").numpy()))
    raw = raw.reshape(-1, t.type_size)
    ref = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType(t.gguf_id)).reshape(-1, kquants.QK_K)
    ours = t.dequantize(raw)
    assert np.array_equal(ours.numpy().view(np.int32), ref.view(np.int32)), t.name
    codes = t.codes(raw)
    assert codes.dtype == torch.uint8 and codes.shape == ours.shape and int(codes.max()) < len(t.levels)
    scale, offset = t.grid(raw)
    assert torch.equal((t.levels[codes.long()] * scale + offset).view(torch.int32), ours.view(torch.int32))
    assert torch.equal(t.repack(raw, codes), raw)
    # other codes: the block parameters stay, the codes read back, the grid is unchanged
    g = torch.Generator().manual_seed(3)
    other = torch.randint(0, len(t.levels), codes.shape, generator=g, dtype=torch.uint8)
    repacked = t.repack(raw, other)
    assert torch.equal(t.codes(repacked), other)
    assert all(torch.equal(a, b) for a, b in zip(t.grid(repacked), (scale, offset)))


@pytest.mark.parametrize("t", kquants.TYPES, ids=IDS)
def test_chunks_do_not_change_the_bytes(t, monkeypatch):
    x = hard_rows(2, rows=16).reshape(-1, kquants.QK_K)
    imp = importances("positive").expand(16, K).reshape(-1, kquants.QK_K)
    whole = t.quantize(x, imp)
    monkeypatch.setattr(kquants, "CPU_CHUNK_BLOCKS", 5)
    assert torch.equal(t.quantize(x, imp), whole)


def test_type_table_matches_gguf():
    from gguf import GGML_QUANT_SIZES

    bits = {"q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
    for t in kquants.TYPES:
        assert (t.block, t.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType(t.gguf_id)], t.name
        assert GGMLQuantizationType(t.gguf_id).name.lower() == t.name
        assert t.bits_per_weight == bits[t.name] and t.summary.startswith("llama.cpp ")
        assert t.code_bits == {"q2_k": 2, "q3_k": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}[t.name]


def _c_nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's nearest_int, scalar C semantics in numpy float32."""
    bits = (f.astype(np.float32) + np.float32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def test_nearest_int_is_the_magic_number_round():
    f = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 4194303.0, -4194303.5, 1e9, np.inf, -np.inf, np.nan],
                 dtype=np.float32)
    f = np.concatenate([f, np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100])
    assert np.array_equal(common.nearest_int(torch.from_numpy(f)).numpy(), _c_nearest_int(f))
    assert common.nearest_int(torch.tensor([0.5, 1.5, 2.5])).tolist() == [0, 2, 2]  # half to even


def test_seq_sum_and_sqrtf_follow_c_float_semantics():
    rng = np.random.default_rng(0)
    p = (rng.standard_normal((32, 500)) * 10.0 ** rng.integers(-3, 8, (32, 500))).astype(np.float32)
    want = np.zeros(500, dtype=np.float32)
    for row in p:
        want = want + row  # float32 adds in index order, as `s += p[i]`
    assert np.array_equal(common.seq_sum(torch.from_numpy(p)).numpy(), want)
    v = rng.random(100000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100000).astype(np.float32)
    assert np.array_equal(common.sqrtf(torch.from_numpy(v)).numpy(), np.sqrt(v))  # IEEE: correctly rounded
