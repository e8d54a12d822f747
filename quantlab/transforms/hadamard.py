"""Hadamard matrices and the fast Walsh-Hadamard transform, for rotations (QuaRot, SpinQuant).

A Hadamard matrix H of order n has entries +-1 and H Hᵀ = n I; H / sqrt(n) is orthogonal. Orders are 1, 2 or
multiples of 4. quantlab builds n = 2^k * m as the Kronecker product H_{2^k} ⊗ H_m, as QuaRot does:
- H_{2^k}: Sylvester's construction, applied as a fast Walsh-Hadamard transform (n log n adds);
- H_m, m > 1 not a power of two: Paley's constructions from the quadratic residues mod a prime q
  (Paley I: m = q + 1 with q ≡ 3 mod 4, e.g. 12, 20, 24, 44, 48, 60; Paley II: m = 2(q + 1) with q ≡ 1 mod 4,
  e.g. 28, 36, 60, 76), applied as a dense m x m matmul.
So 576 = 16 * 36 (Paley II, q = 17) and 1536 = 128 * 12 (Paley I, q = 11) are supported; an order with no such
factorisation (e.g. 6, 9, 52 = 4 * 13 needs q = 25, a prime power) fails naming the order.

    hadamard_matrix(12) @ hadamard_matrix(12).T == 12 * eye(12)
    y = hadamard_transform(x)        # x @ H / sqrt(n) along the last dim, in O(n log n)
"""
from __future__ import annotations

import functools
import math

import torch

MAX_PALEY_ORDER = 256  # largest non-power-of-two factor m tried (a dense m x m matmul per row)


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = legendre(j - i mod q): 0 on the diagonal, +-1 elsewhere (q an odd prime)."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.int64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley_kind(m: int) -> tuple[str, int] | None:
    """('I', q) or ('II', q) when a Paley construction gives order m, else None."""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I", m - 1
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II", m // 2 - 1
    return None


def _paley(m: int) -> torch.Tensor:
    kind, q = _paley_kind(m)
    ones = torch.ones(q, dtype=torch.int64)
    jac = _jacobsthal(q)
    if kind == "I":  # skew conference matrix C (q ≡ 3 mod 4): H = I + C
        c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = ones, -ones, jac
        return torch.eye(q + 1, dtype=torch.int64) + c
    # symmetric conference matrix C (q ≡ 1 mod 4): H = C ⊗ [[1, 1], [1, -1]] + I ⊗ [[1, -1], [-1, -1]]
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = ones, ones, jac
    a = torch.tensor([[1, 1], [1, -1]])
    b = torch.tensor([[1, -1], [-1, -1]])
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.int64), b)


def _try_factor(n: int) -> tuple[int, int] | None:
    pow2 = n & -n
    while pow2 >= 1:
        m = n // pow2
        if m == 1 or (m <= MAX_PALEY_ORDER and m % 4 == 0 and _paley_kind(m) is not None):
            return pow2, m
        pow2 //= 2
    return None


def factor_order(n: int) -> tuple[int, int]:
    """(2^k, m) with n = 2^k * m and m = 1 or a Paley order; the largest power of two that works."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a Hadamard order must be an integer >= 1, got {n!r}")
    found = _try_factor(n)
    if found is None:
        near = [k for k in range(max(1, n - 32), n + 33) if _try_factor(k)]
        raise ValueError(
            f"no Hadamard construction for order {n}: quantlab builds 2^k * m with m = 1 or a Paley order "
            f"(q + 1 for a prime q ≡ 3 mod 4, 2(q + 1) for a prime q ≡ 1 mod 4, m <= {MAX_PALEY_ORDER}); "
            f"supported orders near {n}: {', '.join(map(str, near))}")
    return found


@functools.cache
def _small(m: int) -> torch.Tensor:
    return torch.ones(1, 1, dtype=torch.int64) if m == 1 else _paley(m)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The integer (+-1, int64) Hadamard matrix H_{2^k} ⊗ H_m of order n (Sylvester order for 2^k)."""
    pow2, m = factor_order(n)
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < pow2:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.kron(h, _small(m))


def _fwht_(x: torch.Tensor, pow2: int, m: int) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform of x (..., pow2, m) along dim -2 (butterflies, Sylvester order)."""
    lead = x.shape[:-2]
    h = 1
    while h < pow2:
        x = x.reshape(*lead, pow2 // (2 * h), 2, h, m)
        a, b = x[..., 0, :, :], x[..., 1, :, :]
        x = torch.stack((a + b, a - b), dim=-3)
        h *= 2
    return x.reshape(*lead, pow2, m)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """x @ Q along the last dim, Q = diag(signs) H / sqrt(n) orthogonal (H = hadamard_matrix(n), symmetric in its
    2^k part; the m part multiplies from the right: x @ H_m). Fast: log2(2^k) butterfly passes + one m x m matmul.

    signs: optional +-1 vector (a randomized Hadamard, as QuaRot's R1). Computed in x's dtype.

    >>> torch.allclose(hadamard_transform(x), x @ hadamard_matrix(x.shape[-1]).to(x) / x.shape[-1] ** 0.5)
    """
    n = x.shape[-1]
    pow2, m = factor_order(n)
    if signs is not None:
        x = x * signs.to(x)
    y = x.reshape(*x.shape[:-1], pow2, m)
    if m > 1:
        y = y @ _small(m).to(device=x.device, dtype=x.dtype)
    y = _fwht_(y, pow2, m)
    return y.reshape(x.shape) / math.sqrt(n)


def random_orthogonal(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A Haar-random orthogonal n x n matrix (QR of a seeded Gaussian, signs fixed by R's diagonal)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(dtype)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """A seeded +-1 vector of length n (float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
