"""Primitives shared by the ported llama.cpp quantizers (ggml-quants.c), bit for bit.

ggml-base is compiled without architecture flags: plain IEEE float32, no fused multiply-add. So every port here
keeps the C code's float32 evaluation order: a*b*c is (a*b)*c, and a sum the C code accumulates in a loop is
accumulated in the same order (`seq_sum`), never with torch.sum (whose reduction order differs).

Layout: the make_* fitters take x as (G, n) float32, G independent groups of n weights, and vectorize over G;
Python loops run only over element positions and candidate steps. Their codes L come back as (G, n) uint8.

Public pieces the ggml ports share: nearest_int, sqrtf, fp16_round / fp16_bytes / fp16_from_bytes, wrap_u8 /
wrap_i8 (C's integer narrowing), seq_sum and first_absmax (over the FIRST dim: (n, G) -> (G,)), and the fitters
make_qx_quants, make_q3_quants, make_qkx2_quants, make_qkx3_quants, make_qp_quants.

Two torch traps the code avoids: `scalar / tensor` is computed as reciprocal-then-multiply (not correctly
rounded), so numerators are always tensors (`_full`); and constants the C code computes in float (0.1f*is + nmax)
are computed in numpy float32, whose values torch then receives exactly.
"""
from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = float(np.float32(1e-15))  # ggml-quants.c's 1e-15f


def f32(value: float) -> float:
    """A Python float holding the float32 rounding of value (C's `1e-15f`, `0.1f`), passed to torch exactly."""
    return float(np.float32(value))


def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: the magic-number round (fval + 12582912.f, low mantissa bits) -> int32, emulated on the
    float32 bits so it matches even outside |f| < 2^22 (round half to even inside). nearest_int(tensor([2.5])) -> 2."""
    bits = (f.float() + 12582912.0).view(torch.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def wrap_u8(i: torch.Tensor) -> torch.Tensor:
    """C's int -> uint8_t conversion (modulo 256), kept in int32."""
    return i & 0xFF


def wrap_i8(i: torch.Tensor) -> torch.Tensor:
    """C's int -> int8_t conversion (two's complement wrap), kept in int32."""
    return ((i + 128) & 0xFF) - 128


def sqrtf(x: torch.Tensor) -> torch.Tensor:
    """C's sqrtf, correctly rounded. torch.sqrt on float32 CPU tensors can be 1 ulp off; a double sqrt rounded to
    float is exact (53 >= 2*24 + 2 bits). sqrtf(tensor([2.])) -> tensor([1.4142])"""
    return torch.sqrt(x.double()).float()


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x)): round to nearest even half, back to float32 exactly."""
    return x.half().float()


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(N,) float32 -> (N, 2) uint8: GGML_FP32_TO_FP16(x) as little-endian bytes of a block's ggml_half."""
    return x.half().contiguous().view(torch.int16).view(torch.uint8).view(-1, 2)


def fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 little-endian ggml_half -> (N,) float32 (GGML_FP16_TO_FP32, exact)."""
    return b.contiguous().view(torch.float16).view(-1).float()


def seq_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the FIRST dim in index order from 0.0, as `float s = 0; for (i...) s += p[i];` does.
    p: (n, ...) -> (...). seq_sum(torch.tensor([[1e8], [1.0], [-1e8]])) -> tensor([0.])"""
    s = torch.zeros_like(p[0])
    for row in p:
        s = s + row
    return s


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


def first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, G): `if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }` from 0 -> (amax, max), each (G,)."""
    amax = torch.zeros_like(x[0])
    signed = torch.zeros_like(x[0])
    for row in x:
        ax = row.abs()
        better = ax > amax
        amax = torch.where(better, ax, amax)
        signed = torch.where(better, row, signed)
    return amax, signed


def _clamp(i: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return i.clamp(lo, hi)


def _round_clamp_(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """In place, p <- clamp(nearest_int(p), lo, hi) as float, for p that is either |p| < 2^22 or not finite (an
    overflowed iscale): torch.round agrees with nearest_int on the former; nearest_int(+-inf) is -2^22 and
    nearest_int(NaN) is 0 (x86's default NaN has no payload), which nan_to_num puts back."""
    p.round_()
    torch.nan_to_num_(p, nan=0.0, posinf=-4194304.0, neginf=-4194304.0)
    return p.clamp_(lo, hi)


def make_qx_quants(x: torch.Tensor, nmax: int, rmse_type: int = 1,
                   qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qx_quants: a symmetric scale for each group, searched over 18 nearby scales by weighted error.

    x: (G, n) float32 groups; nmax: codes are l + nmax with l in [-nmax, nmax-1] (Q6_K: 32, Q3_K: 4, Q4_0: 8);
    rmse_type: the C argument (1 everywhere in llama.cpp; 0 = plain round, <0 = return early, 2..4 other weights);
    qw: (G, n) float32 weights (the C `qw`), or None for the rmse_type's own weights (type 1: x*x).
    Returns (scale (G,) float32, L (G, n) uint8); x ~ scale * (L - nmax). All-|x| < 1e-15 groups: scale 0, L 0.

        scale, L = make_qx_quants(x.view(-1, 16), 32, 1, None)   # Q6_K's sub-block fit
    """
    xt = x.float().t().contiguous()  # (n, G)
    amax, max_ = first_absmax(xt)
    all_zero = amax < GROUP_MAX_EPS
    iscale = _full(max_, float(-nmax)) / max_

    def codes(iscale_):  # |iscale * x| <= nmax + 1 unless iscale overflowed
        return _round_clamp_(iscale_ * xt, -nmax, nmax - 1)

    if rmse_type == 0:
        L, scale = codes(iscale) + nmax, torch.ones_like(iscale) / iscale
        return _finish_qx(all_zero, scale, L)
    return_early = rmse_type < 0
    rmse_type = abs(rmse_type)
    if qw is not None:
        w = qw.float().t().contiguous()
    else:
        w = {1: xt * xt, 2: torch.ones_like(xt), 3: xt.abs()}.get(rmse_type)
        w = sqrtf(xt.abs()) if w is None else w
    wx = w * xt
    prods = torch.empty(xt.shape[0], 2, xt.shape[1], dtype=xt.dtype, device=xt.device)  # (n, 2, G)

    def sums(l):
        torch.mul(wx, l, out=prods[:, 0])
        torch.mul(w, l, out=prods[:, 1]).mul_(l)
        return seq_sum(prods)  # of (w*x)*l, (w*l)*l

    l = codes(iscale)
    L = l + nmax
    sumlx, suml2 = sums(l)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    if return_early:
        inv = torch.ones_like(iscale) / iscale
        return _finish_qx(all_zero, torch.where(suml2 > 0, f32(0.5) * (scale + inv), inv), L)
    best = scale * sumlx
    best_iscale = iscale  # L is recomputed from the best candidate's iscale at the end
    for step in range(-9, 10):
        if step == 0:
            continue
        c = -(np.float32(nmax) + np.float32(0.1) * np.float32(step))
        iscale = _full(max_, float(c)) / max_
        sumlx, suml2 = sums(codes(iscale))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = torch.where(better, iscale, best_iscale)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    return _finish_qx(all_zero, scale, codes(best_iscale) + nmax)


def _finish_qx(all_zero, scale, L):
    scale = torch.where(all_zero, torch.zeros_like(scale), scale)
    L = torch.where(all_zero, torch.zeros_like(L), L)
    return scale, L.t().to(torch.uint8)


def make_q3_quants(x: torch.Tensor, nmax: int, do_rmse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_q3_quants (Q3_K's unweighted sub-block fit): a symmetric scale refined by up to 5 passes of
    coordinate descent on the x²-weighted error. x: (G, n) float32; codes L = l + nmax, l in [-nmax, nmax-1].
    Returns (scale (G,), L (G, n) uint8); all-|x| < 1e-15 groups: scale 0, L 0.

        scale, L = make_q3_quants(x.view(-1, 16), 4)
    """
    xt = x.float().t().contiguous()  # (n, G)
    amax, max_ = first_absmax(xt)
    all_zero = amax < GROUP_MAX_EPS
    iscale = _full(max_, float(-nmax)) / max_
    L = _clamp(nearest_int(iscale * xt), -nmax, nmax - 1)
    if not do_rmse:
        return _finish_qx(all_zero, torch.ones_like(iscale) / iscale, L + nmax)
    w = xt * xt
    wx = w * xt
    Lf = L.float()
    sumlx, suml2 = seq_sum(wx * Lf), seq_sum(w * Lf * Lf)
    L = list(L)  # per-position rows, updated in place of the C array
    for _ in range(5):
        changed = torch.zeros_like(all_zero)
        for i in range(len(L)):
            li = L[i].float()
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new_l = _clamp(nearest_int(xt[i] * sl2 / slx), -nmax, nmax - 1)
            nf = new_l.float()
            slx2 = slx + wx[i] * nf
            sl22 = sl2 + w[i] * nf * nf
            take = (slx > 0) & (new_l != L[i]) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = torch.where(take, new_l, L[i])
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
            changed |= take
        if not changed.any():  # the C loop's `if (!n_changed) break`: a pass that changed nothing would again
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    return _finish_qx(all_zero, scale, torch.stack(L) + nmax)


def make_qkx3_quants(x: torch.Tensor, weights: torch.Tensor | None, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx3_quants: an asymmetric fit x ~ scale * L - the_min, L in [0, nmax], searched over nstep+1
    candidate scales (rmin + rdelta*is + nmax) / (max - min) by weighted least squares with clamped min.

    x: (G, n) float32; weights: (G, n) float32, or None for x*x; rmin, rdelta: the C float constants (rounded
    to float32 here); use_mad: weighted |error| (True) or squared error (False) decides between candidates.
    Returns (scale (G,), the_min (G,) = minus the fitted offset (>= 0), L (G, n) uint8).

        scale, the_min, L = make_qkx3_quants(x.view(-1, 32), w.view(-1, 32), 15, -0.9, 0.05, 36, False)  # Q4_K
    """
    return _make_qkx(x, weights, nmax, rmin, rdelta, nstep, use_mad, degenerate_if_equal_only=False)


def make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants: make_qkx3_quants with weights required (the k-quants' unweighted *_ref path).
    Same arguments and returns as make_qkx3_quants."""
    return _make_qkx(x, weights, nmax, rmin, rdelta, nstep, use_mad, degenerate_if_equal_only=True)


def _make_qkx(x, weights, nmax, rmin, rdelta, nstep, use_mad, degenerate_if_equal_only):
    xt = x.float().t().contiguous()  # (n, G)
    w = xt * xt if weights is None else weights.float().t().contiguous()
    mn, mx = xt[0], xt[0]
    sum_w = w[0]
    sum_x = sum_w * xt[0]
    for i in range(1, xt.shape[0]):
        mn = torch.where(xt[i] < mn, xt[i], mn)
        mx = torch.where(xt[i] > mx, xt[i], mx)
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * xt[i]
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)
    degenerate = (mx == mn) if degenerate_if_equal_only else (mx <= mn)
    min_start = mn  # the C code's `min` before the search (a degenerate group returns it)
    iscale = _full(mn, float(nmax)) / (mx - mn)
    scale = torch.ones_like(iscale) / iscale
    # where the best L came from: L = clamp(nearest_int(iscale * (x - min)), 0, nmax), that step's iscale and min
    best_iscale, best_min_used = iscale, mn
    if nstep >= 1:
        l = torch.empty_like(xt)
        prods = torch.empty(xt.shape[0], 3, xt.shape[1], dtype=xt.dtype, device=xt.device)  # (n, 3, G)
        best = _weighted_error(_codes_qkx(l, xt, mn, iscale, nmax), scale, mn, xt, w, use_mad)
        for step in range(nstep + 1):
            c = np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)
            iscale = _full(mn, float(c)) / (mx - mn)  # mn moves with each better candidate, as the C `min` does
            _codes_qkx(l, xt, mn, iscale, nmax)
            wl = torch.mul(w, l, out=prods[:, 0])
            torch.mul(wl, l, out=prods[:, 1])
            torch.mul(wl, xt, out=prods[:, 2])
            sum_l, sum_l2, sum_xl = seq_sum(prods)  # of w*l, (w*l)*l, (w*l)*x
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
            this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
            cur = _weighted_error(l, this_scale, this_min, xt, w, use_mad)
            better = (D > 0) & (cur < best)
            best = torch.where(better, cur, best)
            scale = torch.where(better, this_scale, scale)
            best_iscale = torch.where(better, iscale, best_iscale)
            best_min_used = torch.where(better, mn, best_min_used)
            mn = torch.where(better, this_min, mn)
    L = _codes_qkx(torch.empty_like(xt), xt, best_min_used, best_iscale, nmax)
    scale = torch.where(degenerate, torch.zeros_like(scale), scale)
    mn = torch.where(degenerate, min_start, mn)
    L = torch.where(degenerate, torch.zeros_like(L), L)
    return scale, -mn, L.t().to(torch.uint8)


def _codes_qkx(out, xt, mn, iscale, nmax):
    """out <- clamp(nearest_int(iscale * (x - min)), 0, nmax), in place (n, G); |iscale * (x - min)| <= nmax + 1
    unless iscale overflowed (a subnormal max - min)."""
    torch.sub(xt, mn, out=out)
    return _round_clamp_(out.mul_(iscale), 0, nmax)


def _weighted_error(lf, scale, offset, xt, w, use_mad):
    """sum over i in order of w * |scale*l + offset - x| (use_mad) or w * (scale*l + offset - x)^2."""
    diff = lf * scale
    diff.add_(offset).sub_(xt)
    if use_mad:
        diff.abs_()
    else:
        diff.mul_(diff)
    return seq_sum(diff.mul_(w))


def make_qp_quants(x: torch.Tensor, nmax: int, quant_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's make_qp_quants: a positive-only scale for non-negative values (the sub-block scales and mins of
    the *_impl paths), x ~ scale * L, L = min(nmax, round(x / scale)), by weighted search and coordinate descent.

    x: (G, n) float32; quant_weights: (G, n) float32. Returns (scale (G,), L (G, n) int32 holding the C uint8_t
    value, i.e. a negative code wrapped mod 256). max(x) < 1e-15 groups: scale 0, L 0.

        d, Ls = make_qp_quants(scales.view(-1, 8), 63, sw.view(-1, 8))   # Q4_K's super-block scale
    """
    xt = x.float().t().contiguous()  # (n, G)
    qw = quant_weights.float().t().contiguous()
    max_ = torch.zeros_like(xt[0])
    for row in xt:
        max_ = torch.where(max_ > row, max_, row)  # MAX(a, b) = a > b ? a : b
    all_zero = max_ < GROUP_MAX_EPS
    one = torch.ones_like(max_)

    def weighted_mse(scale_, l):
        diff = xt - scale_ * l.float()
        return seq_sum(qw * diff * diff)

    iscale = _full(max_, float(nmax)) / max_
    best_mse = weighted_mse(one / iscale, wrap_u8(nearest_int(iscale * xt)))
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        c = np.float32(0.1) * np.float32(step) + np.float32(nmax)
        iscale_is = _full(max_, float(c)) / max_
        mse = weighted_mse(one / iscale_is, nearest_int(iscale_is * xt).clamp(max=nmax))
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        iscale = torch.where(better, iscale_is, iscale)
    l = nearest_int(iscale * xt).clamp(max=nmax)
    wx = qw * xt
    lf = l.float()
    sumlx, suml2 = seq_sum(wx * lf), seq_sum(qw * lf * lf)
    L = list(wrap_u8(l))
    for _ in range(5):
        changed = torch.zeros_like(all_zero)
        for i in range(len(L)):
            li = L[i].float()
            slx = sumlx - wx[i] * li
            sl2 = suml2 - qw[i] * li * li
            new_l = nearest_int(xt[i] * sl2 / slx).clamp(max=nmax)
            nf = new_l.float()
            slx2 = slx + wx[i] * nf
            sl22 = sl2 + qw[i] * nf * nf
            take = ((slx > 0) & (sl2 > 0) & (new_l != L[i])
                    & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22))
            L[i] = torch.where(take, wrap_u8(new_l), L[i])
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
            changed |= take
        if not changed.any():  # as in make_q3_quants: groups whose pass changed nothing are at a fixed point
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    scale = torch.where(all_zero, torch.zeros_like(scale), scale)
    L = torch.where(all_zero, torch.zeros_like(L[0]), torch.stack(L))
    return scale, L.t().contiguous()
