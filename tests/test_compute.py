"""quantlab.eval.compute: matmul FLOPs counted as 2 per multiply-add, forward and backward; the F.linear rate."""
import torch

from quantlab.eval.compute import count_matmul_flops, measure_matmul_rate


def test_a_linear_counts_two_flops_per_multiply_add_and_its_backward_twice_that():
    x, w = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True)
    flops, y = count_matmul_flops(lambda: torch.nn.functional.linear(x, w))
    assert flops == 2 * 4 * 8 * 16 and y.shape == (4, 16)
    # backward of y = x wᵀ w.r.t. w alone: one more product of the same size (x needs no grad)
    assert count_matmul_flops(lambda: torch.nn.functional.linear(x, w).sum().backward())[0] == 2 * (2 * 4 * 8 * 16)
    assert count_matmul_flops(lambda: (x * 2).sum())[0] == 0  # elementwise work and reductions are not counted


def test_the_rate_is_the_best_shape_and_lists_every_shape():
    rate = measure_matmul_rate(((64, 32, 48), (32, 64, 16)), repeats=3)
    assert rate["matmul_shape"] in ("64x32x48", "32x64x16") and rate["matmul_gflops"] > 0
    by_shape = dict(item.split(":") for item in rate["matmul_gflops_by_shape"].split())
    assert set(by_shape) == {"64x32x48", "32x64x16"}
    assert abs(max(map(float, by_shape.values())) - rate["matmul_gflops"]) < 0.05 + 1e-3 * rate["matmul_gflops"]


def test_in_place_products_count_as_their_out_of_place_forms():
    """GPTQ accumulates its Hessian with addmm_, which torch 2.13's counter skips."""
    h, x = torch.zeros(8, 8), torch.randn(5, 8)
    assert count_matmul_flops(lambda: h.addmm_(x.t(), x))[0] == count_matmul_flops(lambda: h.addmm(x.t(), x))[0] == 640
    b, a1, a2 = torch.zeros(3, 4, 6), torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    assert count_matmul_flops(lambda: b.baddbmm_(a1, a2))[0] == count_matmul_flops(lambda: torch.bmm(a1, a2))[0]
    assert count_matmul_flops(lambda: h.addr_(x[0], x[1]))[0] == 0  # a rank-1 update is not a matrix product


def test_cpu_attention_counts_as_the_same_math_written_with_matmuls():
    """F.scaled_dot_product_attention's CPU kernel, causal, grouped (9 query heads on 3 KV heads), against q·kᵀ and
    p·v as explicit batched matmuls (counted by torch's own bmm formula); its backward against torch's formula. (With
    unequal q and v widths the CPU takes the math path, whose bmms torch counts itself.)"""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    q, k = torch.randn(2, 9, 64, 16), torch.randn(2, 3, 64, 16)
    sdpa = count_matmul_flops(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, k, is_causal=True, enable_gqa=True))[0]
    kk = k.repeat_interleave(3, dim=1)
    explicit = count_matmul_flops(lambda: torch.softmax(q @ kk.transpose(-1, -2), -1) @ kk)[0]
    assert sdpa == explicit == 2 * 2 * 9 * 64 * 64 * 32

    q, k, v = (torch.randn(2, 3, 64, 16, requires_grad=True) for _ in range(3))
    both = count_matmul_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward())[0]
    assert both == 2 * 2 * 3 * 64 * 64 * 32 + sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
