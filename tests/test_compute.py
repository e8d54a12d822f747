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
