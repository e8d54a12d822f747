"""`hqq`: Half-Quadratic Quantization (Badri & Shaji 2023), calibration-free.

Each group of g input columns sits on the asymmetric grid [0, 2^b - 1] with a real-valued zero z:
Ŵ = (clamp(round(W/s + z), 0, 2^b - 1) - z)·s. HQQ starts from min-max over the group's own range
(s = (max - min)/(2^b - 1), z = -min/s; rtn widens the range to hold 0 and rounds z) and then lowers
the L_p error ‖W - Ŵ‖_p^p, p < 1 (outliers cost little, so the grid need not chase them), over z by
half-quadratic splitting. Each iteration:

    W_e ← shrink_p(W - Ŵ, β)              # the sparse part of the error (generalised soft threshold)
    z   ← mean over the group of W_q - (W - W_e)/s      # the closed-form zero given W_e

until the mean |W - Ŵ| stops falling. That is the reference `hqq` package's default solver (hqq
0.2.8.post1, optimize_weights_proximal_legacy, axis=1). We call its step in our own copy of its loop:
the reference loop computes in float16 on CUDA, ours in float32 on every device. Two knobs go beyond
that default: kappa > 1 grows β by κ each iteration (the paper's schedule; the legacy solver lists
kappa = 1.01 among its options but never applies it), and optimize_scale also re-fits s in the
closed-form step (a least-squares line through (W - W_e, W_q) per group; quantlab's, not the reference's).

round_zero = true rounds the min-max start's zero to an integer before the solver, as the reference's
Quantizer.quantize(round_zero=True) does (hqq/core/quantize.py lines 132-134, "as in AutoAWQ"); the solver then
moves it off the integers again (with iters = 0 it stays integer). The default false is the reference's
Quantizer.quantize default (quantize.py line 83), which the tests match bit for bit; its model-level config,
BaseQuantizeConfig (hqq_base_quant_config, quantize.py line 1097: the config HQQLinear is given, and what
transformers' HqqConfig wraps), sets round_zero = (nbits == 4): true at 4 bits, false at 2, 3 and 8. The row's
scheme says "+ round_zero" when it is on.

Scale and zero are stored in scale_dtype (float16 by default, as HQQ keeps them) and the codes come
from the stored values, so the fake-quant forward equals the frozen one exactly. 4-bit g64 costs
4 + 16/64 + 16/64 = 4.5 bits per weight. Needs the `hqq` package: pip install 'quantlab[hqq]'.

    [[run]]
    name = "hqq-w4-g64"
    method = "hqq"
    bits = 4            # group_size = 64 and symmetric = false are hqq's defaults
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.lifecycle import freeze_all, swap_in_quant_linears
from ..core.primitives import QParams
from ..core.qlinear import WeightSpec
from ..core.registry import Method, register_method
from ..util.checks import check_int
from .rtn import RTNConfig

MAX_INV_SCALE = 2e4  # the reference's bound on 1/s (its half-precision guard); s >= 5e-5
FLAT_RANGE = 1e-4  # groups whose max - min is at most this get 1/s = 1, as in the reference


def _check_number(field: str, value, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > lo if lo_open else value >= lo) and (hi is None or value <= hi):
        return
    want = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}"
    raise ValueError(f"{field} must be a number {want}, got {value!r}")


@dataclass(frozen=True)
class HQQConfig(RTNConfig):
    """rtn's grid fields with hqq's defaults (group_size 64; asymmetric, integer format only) plus the
    solver's knobs, whose defaults are the reference's default solver (hqq 0.2.8.post1).

    round_zero: round the min-max start's zero to an integer before solving. False = Quantizer.quantize's
    default (hqq/core/quantize.py:83); the library's BaseQuantizeConfig rounds it at nbits = 4 only
    (quantize.py:1097), so round_zero = true with bits = 4 is the start of HQQLinear / transformers' HqqConfig."""

    group_size: int | None = 64
    symmetric: bool = False
    lp_norm: float = 0.7  # p of the L_p error minimised, in (0, 1]
    beta: float = 10.0  # the half-quadratic penalty β (the shrinkage threshold is 1/β)
    kappa: float = 1.0  # β ← κβ each iteration; 1.0 = the reference default, 1.01 the paper's schedule
    iters: int = 20  # at most (early stop); 0 = HQQ's min-max start, not optimised
    optimize_scale: bool = False  # also re-fit the scale each iteration (quantlab's extension)
    round_zero: bool = False  # round the start's zero (the reference's BaseQuantizeConfig does at 4 bits)

    def __post_init__(self):
        if self.symmetric is not False:  # checked before rtn's, whose messages assume a grid hqq never takes
            raise ValueError(f"hqq is asymmetric (a real-valued zero point per group); symmetric = "
                             f"{self.symmetric!r} is not allowed (leave it out or set false)")
        if self.observer != "minmax":
            raise ValueError(f"hqq fits its own scale and zero (the half-quadratic solver); observer = "
                             f"{self.observer!r} is not allowed (leave it out)")
        if self.format != "int":
            raise ValueError(f"hqq quantizes to the integer grid; format = {self.format!r} is not allowed "
                             f"(use method = \"rtn\" for number formats)")
        super().__post_init__()
        for rule in self.overrides:
            if rule.symmetric:
                raise ValueError(f"hqq: override {rule.pattern!r} sets symmetric = true; hqq is asymmetric")
            if rule.format not in (None, "int"):
                raise ValueError(f"hqq: override {rule.pattern!r} sets format = {rule.format!r}; hqq quantizes "
                                 f"to the integer grid")
        _check_number("lp_norm", self.lp_norm, 0, 1, lo_open=True)
        _check_number("beta", self.beta, 0, lo_open=True)
        _check_number("kappa", self.kappa, 1)
        check_int("iters", self.iters, 0)
        for field in ("optimize_scale", "round_zero"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be true or false, got {getattr(self, field)!r}")  # noqa: TRY004

    @property
    def solver(self) -> dict:
        """The solver's keyword arguments (for hqq_qparams)."""
        return {"lp_norm": self.lp_norm, "beta": self.beta, "kappa": self.kappa, "iters": self.iters,
                "optimize_scale": self.optimize_scale, "round_zero": self.round_zero}


def _reference():
    """The reference package's solver step and shrinkage operator (a clear error without the package)."""
    try:
        from hqq.core.optimize import optimize_weights_proximal_legacy_step, shrink_lp_op
    except ImportError as e:
        raise ImportError("method 'hqq' calls the reference hqq package's solver, which is not installed: "
                          "pip install 'quantlab[hqq]' (bash scripts/setup.sh installs it)") from e
    return optimize_weights_proximal_legacy_step, shrink_lp_op


def hqq_init(w: torch.Tensor, bits: int, round_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's min-max start for groups w (N, g): (inverse scale, zero), each (N, 1), as the reference's
    Quantizer: 1/s = (2^b - 1)/(max - min) (1 where max - min <= 1e-4; at most 2e4), z = -min/s, with
    round_zero z = round(z) (torch.round: ties to even, as the reference).

    >>> inv, zero = hqq_init(torch.tensor([[-1.5, 0.0, 1.5]]), 4, round_zero=True)   # inv 5, zero round(7.5) = 8
    """
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    span = hi - lo
    inv = torch.where(span.abs() <= FLAT_RANGE, torch.ones_like(span), (2**bits - 1) / span)
    inv = inv.clamp(max=MAX_INV_SCALE)
    zero = -lo * inv
    return inv, torch.round(zero) if round_zero else zero


def _scale_and_zero_step(w, inv, zero, qmax, beta, lp_norm, shrink):
    """optimize_scale: the reference step with (1/s, z) fitted jointly, W_q ≈ (1/s)(W - W_e) + z by least
    squares per group; a group whose fit is degenerate (flat W - W_e, or a slope <= 0) keeps its scale."""
    w_q = torch.round(w * inv + zero).clamp_(0, qmax)
    w_r = (w_q - zero) / inv
    x = w - shrink(w - w_r, beta, lp_norm)  # (N, g)
    x_mean, q_mean = x.mean(1, keepdim=True), w_q.mean(1, keepdim=True)
    x_c = x - x_mean
    var, cov = (x_c * x_c).mean(1, keepdim=True), (x_c * (w_q - q_mean)).mean(1, keepdim=True)
    slope = cov / var  # NaN where var == 0
    inv = torch.where((var > 0) & (slope > 0), slope.clamp(max=MAX_INV_SCALE), inv)
    return w_r, w_q, q_mean - inv * x_mean, inv


@torch.no_grad()
def hqq_solve(
    w: torch.Tensor, bits: int, lp_norm: float = 0.7, beta: float = 10.0, kappa: float = 1.0, iters: int = 20,
    optimize_scale: bool = False, round_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups w (N, g) -> (scale, zero), each (N, 1) float32, on w's device; one early stop for all groups.

    With the defaults equal to the reference's Quantizer.quantize(W, bits, group_size=g, axis=1) scale and
    zero on CPU, and with round_zero to Quantizer.quantize(..., round_zero=True) (tests/test_hqq.py). Pure: w is
    not modified.

    >>> scale, zero = hqq_solve(layer.weight.reshape(-1, 64), bits=4)
    """
    w = w.detach().float()
    inv, zero = hqq_init(w, bits, round_zero)
    if iters > 0:
        step, shrink = _reference()
    qmax = 2**bits - 1
    best = torch.tensor(math.inf, device=w.device)
    for _ in range(iters):
        if optimize_scale:
            w_r, _, zero, inv = _scale_and_zero_step(w, inv, zero, qmax, beta, lp_norm, shrink)
        else:
            w_r, _, zero, inv = step(w, inv, zero, [0, qmax], beta, lp_norm, 1)
        error = (w - w_r).abs().mean()  # of the zero this step started from
        # as the reference: stop once that error stops falling, keeping the zero the step computed from it
        if not error < best:
            break
        best = error
        beta *= kappa
    return 1.0 / inv, zero


@torch.no_grad()
def hqq_qparams(w: torch.Tensor, spec: WeightSpec, **solver) -> QParams:
    """W (out, in) -> QParams with scale and real-valued zero (out, n_groups) in spec's scale dtype.

    Groups run along the input dim (the reference's axis=1); a ragged last group (in % group_size) is
    solved on its own. solver: hqq_solve's knobs.

    >>> p = hqq_qparams(layer.weight, WeightSpec(bits=4, group_size=64, symmetric=False))   # p.float_zero
    """
    if spec.symmetric or spec.fmt is not None:
        raise ValueError(f"hqq needs an asymmetric integer grid, got {spec.describe()}")
    out_features, k = w.shape
    g = min(spec.group_size or k, k)
    full = k // g * g
    scales, zeros = [], []
    for part, size in ((w[:, :full], g), (w[:, full:], k - full)):
        if size:
            s, z = hqq_solve(part.reshape(-1, size), spec.bits, **solver)
            scales.append(s.reshape(out_features, -1))
            zeros.append(z.reshape(out_features, -1))
    dtype = spec.torch_scale_dtype
    big = torch.finfo(dtype).max  # keep both finite once rounded (only absurd weight ranges come near)
    scale = torch.cat(scales, 1).clamp(max=big).to(dtype)
    zero = torch.cat(zeros, 1).clamp(-big, big).to(dtype)
    return QParams(scale, zero, float_zero=True)


@register_method
class HQQ(Method):
    """prepare swaps in QuantLinear layers and solves each one's scale and zero (no data);
    convert freezes them to packed codes + scale + zero_f."""

    name = "hqq"
    config_cls = HQQConfig
    needs_calibration = False

    def describe(self, config: HQQConfig, dtype: str = "float32") -> str:
        """The grid's text, "+ round_zero" when the start's zero is rounded: "w4 g64 asym + round_zero"."""
        return super().describe(config, dtype) + (" + round_zero" if config.round_zero else "")

    def prepare(self, model, config: HQQConfig) -> None:
        names = swap_in_quant_linears(model, config.selection, config.weight_spec, config.overrides)
        for name in names:
            layer = model.get_submodule(name)  # layer.spec: the config's grid with its overrides applied
            layer.fixed_qparams = hqq_qparams(layer.weight, layer.spec, **config.solver)

    def convert(self, model, config: HQQConfig) -> None:
        freeze_all(model)
