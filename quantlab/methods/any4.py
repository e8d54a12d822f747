"""`any4`: any4 / any3 / any2 (Elhoushi & Johnson, ICML 2025, "any4: Learned 4-bit Numeric Representation for LLMs").

Each weight row gets its own table (LUT) of 2^bits float16 values, learned by k-means; a weight stores the b-bit index
of its nearest table entry. As the reference (facebookresearch/any4, quantize.py `anyq` with the paper's recipe
`sample_weight=calibrate, scale_sample_weight=True`, README footnotes 5-62):

1. each group of 128 input columns is min-max normalised, u = (w - offset) / scale with scale = (max - min) / (2^b - 1)
   (group_q, quantize.py:106-130; offset = min + 2^(b-1)·scale, so u lies in [-2^(b-1), 2^(b-1) - 1]);
2. calibration: the mean of each input column of the layer's input over the calibration tokens, signed (calibrate.py
   `abs=False`, lines 41-66 and 173), taken by layer in module order with the layers before it already quantized
   (quantize.py:49-65 calibrates each layer on the partly quantized model);
3. each row's u are clustered by scikit-learn's KMeans (cluster_row_scikit, quantize.py:406-418: k-means++, n_init 1,
   max_iter 300, tol 1e-4, random_state 0) with sample weight |mean x_k · scale| for the weight in column k
   (scale_sample_weight, quantize.py:548-551; the absolute value: kmeans.build_sample_weight, kmeans.py:130);
4. the table is stored in float16 with the group scales and offsets (modules.py Any4Linear: lut (out, 2^b),
   scales_and_zeros; dequantization lut[row, code]·scale + offset). Numerics: quantlab/core/lut.py.

Storage is real: b-bit packed codes + 2^b fp16 values per row + an fp16 scale and offset per group, so a 576-wide
layer at g128 costs 4 + (5 groups · 32 + 256) / 576 = 4.722 bits per weight (the reference needs in % 128 == 0;
quantlab lets a last group be shorter). The frozen forward equals the fake-quant one bit for bit.

Differences from the reference: the k-means runs in float64 with torch's random numbers (seed 0) instead of numpy's,
and an empty cluster keeps its centre (the reference's own kmeans.py) where scikit-learn moves it; the scales are
rounded to fp16 before the clustering, so codes are the nearest entries of the stored table; calibration runs block by
block on the experiment's calibration windows (the reference's default is one handwritten prompt); linears outside
the transformer blocks (none in a Llama with lm_head excluded) get unweighted k-means. Not ported: the reference's
neural-network table learning (nnq / learn_anyq), bias_pow, keep_outliers, per-tensor tables (per_row = False), the
other clustering back-ends, the optional AWQ pre-processing (pre_process/awq, eval.py --pre-quantize) and the tinygemm
kernel (frozen layers dequantize; the row says simulated).

GPTQ over the LUT grid: not ported, because the reference has none (its GPTQ appears only as a data loader and as a
baseline through transformers) and GPTQ's column-by-column error feedback would move the weights a row's table was
fitted to; `method = "gptq", format = "any4"` is refused, naming method "any4".

    [[run]]
    name = "any4-g128"
    method = "any4"     # bits = 4 (3: any3, 2: any2), group_size = 128
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..calibration import blocks
from ..calibration.blocks import for_each_block
from ..core.lifecycle import freeze_all, quant_linears, swap_in_quant_linears
from ..core.lut import lut_qparams
from ..core.observer_hooks import attach_input_observers
from ..core.observers import Observer
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import LayerSelection, Method, register_method
from ..models.arch import find_blocks
from ..util.checks import check_int

BITS = {2: "any2", 3: "any3", 4: "any4"}


@dataclass(frozen=True)
class Any4Config:
    """bits 2..4 (any2 / any3 / any4), group_size (min-max groups, the reference's 128), the k-means of scikit-learn's
    KMeans as the reference calls it (iters = max_iter 300, tol 1e-4, seed = random_state 0), layers by name globs.

    >>> Any4Config(bits=3).weight_spec.describe()
    'any3 g128'
    """

    bits: int = 4
    group_size: int = 128
    iters: int = 300
    tol: float = 1e-4
    seed: int = 0
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"bits must be one of 2, 3, 4 (any2, any3, any4: a table of 2^bits values per row), "
                             f"got {self.bits!r}")
        check_int("group_size", self.group_size, 1)  # the columns sharing a min-max scale and offset
        check_int("iters", self.iters, 1)
        check_int("seed", self.seed, 0)
        ok = isinstance(self.tol, (int, float)) and not isinstance(self.tol, bool) and math.isfinite(self.tol)
        if not ok or self.tol < 0:
            raise ValueError(f"tol must be a number >= 0 (k-means stops when its centres move less than tol x the "
                             f"row's variance), got {self.tol!r}")
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, False, None, BITS[self.bits])

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)


class SignedMeanObserver(Observer):
    """Mean of x per input channel (last dim), signed, summed in float64 as the reference's calibrate.py."""

    name = "signed_mean"

    def __init__(self):
        self.total: torch.Tensor | None = None
        self.samples = torch.zeros((), dtype=torch.long)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()  # (tokens, C)
        self.total = x.sum(0) if self.total is None else self.total + x.sum(0)
        self.samples = self.samples + x.shape[0]

    def compute(self, where: str = "") -> torch.Tensor:
        if self.total is None:
            raise ValueError(f"signed_mean observer{' of ' + where if where else ''} saw no data")
        self._check_finite(self.total, where)
        return (self.total / self.samples).float()


def fit_layer(layer: QuantLinear, column_mean: torch.Tensor | None, config: Any4Config) -> None:
    """Fix the layer's qparams to its any-b tables (weighted by |column_mean| x scale; None: unweighted)."""
    spec = layer.spec
    layer.fixed_qparams = lut_qparams(layer.weight, spec.bits, spec.group_size, spec.torch_scale_dtype, column_mean,
                                      config.iters, config.tol, config.seed)


@register_method
class Any4(Method):
    name = "any4"
    config_cls = Any4Config
    needs_calibration = True

    def streams_blocks(self, config) -> bool:
        return True  # its writes all happen in its block walk (calibration/streaming.py)

    def prepare(self, model, config: Any4Config) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec)

    def calibrate(self, model, config: Any4Config, batches, progress: bool = True) -> dict:
        """Block by block; inside a block, layer by layer in module order, each on inputs from the layers before it
        already quantized (the reference's sequence). Selected linears outside the blocks get unweighted tables
        first. Returns any4_layers (tables fitted to calibration) and any4_unweighted_layers."""
        inside = {id(m) for block in find_blocks(model) for m in block.modules()}
        outside = [layer for layer in quant_linears(model).values() if id(layer) not in inside and not layer.frozen]
        for layer in outside:  # fitted once here, not by every forward of the calibration passes
            fit_layer(layer, None, config)
        fitted = []

        def process(index, block, inputs, kwargs):
            layers = {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear) and not m.frozen}
            for layer in layers.values():
                layer.quant_enabled = False  # later layers compute in float until fitted, as in the reference
            for name, layer in layers.items():
                observers, remove = attach_input_observers({name: layer}, lambda n: SignedMeanObserver())
                try:  # the block's forward stops once this layer has seen its input
                    blocks.observe_block(block, inputs, kwargs, {name: layer})
                finally:
                    remove()
                fit_layer(layer, observers[name].compute(name), config)
                layer.quant_enabled = True
                fitted.append(name)

        for_each_block(model, batches, process, desc="any4", progress=progress)
        return {"any4_layers": len(fitted), "any4_unweighted_layers": len(outside)}

    def convert(self, model, config: Any4Config) -> None:
        freeze_all(model)
