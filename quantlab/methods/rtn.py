"""`rtn`: round-to-nearest weight-only quantization with min-max scales.

The baseline every calibrated method must beat: no data, one pass.

observer = "mse" | "imatrix_mse" (integer grids): instead of each group's min-max range, the clipped range with
the lowest (importance-weighted) rounding error, searched as llm-compressor's weight observers do
(core/clipping.py); "imatrix_mse" weighs each input column by its mean x² over the calibration windows (the float
model's, as llama-imatrix collects it). The search runs in calibrate(), after any method built on rtn folded its
scales into the weights (SmoothQuant), so both observers make rtn a calibrated method ("mse" reads no data).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..calibration.blocks import float_weights
from ..calibration.imatrix import collect_imatrix
from ..core import formats
from ..core.clipping import CLIP_SEARCHES, WEIGHT_OBSERVERS, normalized_importance, search_qparams
from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.overrides import LayerOverride, parse_overrides, spec_for
from ..core.qlinear import QuantLinear, WeightSpec
from ..core.registry import LayerSelection, Method, get_method, register_method
from ..util.checks import check_choice


@dataclass(frozen=True)
class RTNConfig:
    """bits 2..8; group_size None = per output channel; symmetric or asymmetric (zero point).

    format: "int" (the integer grid) or a number format of core/formats.py (fp8_e4m3, nf4, mxfp4, nvfp4, ...),
    which fixes bits (and MX / NVFP4 their block size); double_quant: NF4's double-quantized absmax.
    scale_dtype None: the format's own (int float16, fp8 / nf4 float32).

    overrides: per-layer grids by name glob, later matches win (see quantlab/core/overrides.py).
    observer: "minmax" (each group's range), "mse" or "imatrix_mse" (the clip searches of core/clipping.py;
    integer grids only).
    """

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: str | None = None
    format: str = "int"
    double_quant: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ("lm_head",)
    overrides: tuple[LayerOverride, ...] = ()
    observer: str = "minmax"

    def __post_init__(self):
        object.__setattr__(self, "include", self.selection.include)
        object.__setattr__(self, "exclude", self.selection.exclude)
        object.__setattr__(self, "overrides", parse_overrides(self.overrides))
        spec = self.weight_spec  # validates; a format fills in its bits / block, a default scale_dtype reads None
        for field in ("bits", "group_size", "scale_dtype"):
            object.__setattr__(self, field, getattr(spec, field))
        check_choice("observer", self.observer, WEIGHT_OBSERVERS)
        formats_used = sorted({self.format} | {o.format for o in self.overrides if o.format is not None})
        learned = [f for f in formats_used if f in formats.FORMATS and formats.FORMATS[f].scale == "lut"]
        if learned:
            try:
                who = f"method {get_method(self).name!r}"
            except KeyError:  # a config class not (yet) registered
                who = type(self).__name__
            raise ValueError(f"format {learned[0]!r} is a lookup table learned per weight row (k-means): use method = "
                             f"\"any4\" with bits = {formats.FORMATS[learned[0]].bits}; {who} rounds to fixed grids "
                             f"and does not take it (GPTQ over the LUT grid is not ported: quantlab/methods/any4.py)")
        if self.observer != "minmax" and formats_used != ["int"]:
            raise ValueError(f"observer {self.observer!r} searches integer grids; format "
                             f"{', '.join(f for f in formats_used if f != 'int')!r} has its own rounding "
                             f"(use observer = \"minmax\" there)")

    def spec_for(self, name: str) -> WeightSpec:
        """The grid of layer `name`: weight_spec with the matching overrides applied."""
        return spec_for(self.weight_spec, self.overrides, name)

    @property
    def weight_spec(self) -> WeightSpec:
        return WeightSpec(self.bits, self.group_size, self.symmetric, self.scale_dtype, self.format, self.double_quant)

    @property
    def selection(self) -> LayerSelection:
        return LayerSelection(self.include, self.exclude)


def observer_suffix(config: RTNConfig) -> str:
    """The scheme text's note of a clip search: "" for min-max, " + imatrix_mse clip" else."""
    return "" if config.observer == "minmax" else f" + {config.observer} clip"


@torch.no_grad()
def search_clip_ranges(model, config: RTNConfig, batches, progress: bool = True) -> dict:
    """Fix every prepared QuantLinear's qparams to its searched range (observer "mse" / "imatrix_mse"); returns the
    row's diagnostics (rtn_clip_ratio_mean: the mean of scale / min-max scale over all groups)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not m.frozen}
    importance = {}
    if config.observer == "imatrix_mse":
        with float_weights(layers):  # the float model's activations, as llama-imatrix collects them
            entries = collect_imatrix(model, batches, include=list(layers), exclude=[], progress=progress)
        importance = {n: normalized_importance(e.importance / e.count) for n, e in entries.items()}
    ratios = []
    for name, layer in layers.items():
        spec = layer.spec
        imp = importance.get(name)
        if imp is not None:
            imp = imp.to(layer.weight.device)
        p = search_qparams(layer.weight, spec.bits, spec.group_size, spec.symmetric, CLIP_SEARCHES[config.observer],
                           imp, spec.torch_scale_dtype)
        ratios.append((p.scale.float() / spec.qparams(layer.weight).scale.float()).mean())
        layer.fixed_qparams = p
    return {"rtn_clip_ratio_mean": float(torch.stack(ratios).mean()) if ratios else 1.0}


@register_method
class RTN(Method):
    name = "rtn"
    config_cls = RTNConfig

    def needs_calibration_for(self, config: RTNConfig) -> bool:
        return config.observer != "minmax"

    def describe(self, config: RTNConfig, dtype: str = "float32") -> str:
        return super().describe(config, dtype) + observer_suffix(config)

    def prepare(self, model, config: RTNConfig) -> None:
        swap_in_quant_linears(model, config.selection, config.weight_spec, config.overrides)

    def calibrate(self, model, config: RTNConfig, batches, progress: bool = True) -> dict | None:
        if config.observer == "minmax":
            return None
        return search_clip_ranges(model, config, batches, progress)

    def convert(self, model, config: RTNConfig) -> None:
        freeze_all(model)
