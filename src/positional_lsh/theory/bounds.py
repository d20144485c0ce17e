"""The paper's bounds on ``||Mbar - A||_2`` and the exact ``||A||_2`` (the formulas of the authors' public code).

Notation (docs/design.md, docs/theory.md §2): ``n`` positions, slope ``m > 0`` and ``sigma = 1/m`` for one head,
the ALiBi matrix ``A[i, j] = exp(-m |i - j|)``, ``T`` (a.k.a. ``s``) sampled block masks and their mean ``Mbar``.

* ``Psi(sigma) = 1 + sigma + (e^{1/sigma} + 1) / (e^{1/sigma} - 1)`` (:func:`psi`). The authors' code also
  contains a second variant without the leading ``1 +`` (:func:`psi_without_one`); the two disagree by
  exactly 1. We use the first everywhere (it is the larger, so every bound computed with it is implied
  by the other) and keep the second only for reference.
* expected spectral error ``E ||Mbar - A||_2 <= Psi (sqrt(log n / s) + log n / s)``
  (:func:`expected_error_bound`);
* tail bound ``P[||Mbar - A||_2 >= eps] <= n exp(-s eps^2 / (4 Psi (4 Psi + eps)))`` (:func:`tail_bound`),
  and its inverse, the ``eps`` that holds with probability ``1 - delta`` (:func:`tail_bound_epsilon`);
* suggested sample count ``ceil(sigma^2 log n / eps^2)`` (:func:`suggested_samples`);
* ``||A||_2 <= (e^{1/sigma} + 1) / (e^{1/sigma} - 1) = coth(m/2)`` (:func:`alibi_norm_bound`, the sum of an
  interior row of ``A``), and the exact ``||A||_2`` for finite ``n`` (:func:`alibi_spectral_norm`).

All errors are *absolute* (``eps`` is a spectral-norm error, not divided by ``||A||_2``); the relative
error is ``||Mbar - A||_2 / ||A||_2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.linalg import eigvalsh_tridiagonal

from positional_lsh.ops.checks import check_int, positive_int

ArrayLike = float | np.ndarray | Sequence[float]


def _as_sigma(sigma: ArrayLike, name: str = "sigma") -> np.ndarray:
    if isinstance(sigma, bool):
        raise TypeError(f"{name} must be a positive float or an array of them, got bool")
    try:
        arr = np.asarray(sigma, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive float or an array of them, got {type(sigma).__name__}") from None
    if np.isnan(arr).any() or (arr <= 0).any():
        raise ValueError(f"{name} must be > 0 (sigma = 1/slope; use inf for slope 0), got {sigma}")
    return arr


def _out(x: np.ndarray) -> float | np.ndarray:
    return float(x) if x.ndim == 0 else x


def _coth_half_inv(sigma: np.ndarray) -> np.ndarray:
    """``(e^{1/sigma} + 1) / (e^{1/sigma} - 1) = coth(1/(2 sigma))``, stable for every sigma > 0."""
    with np.errstate(divide="ignore", over="ignore"):
        return 1.0 / np.tanh(0.5 / sigma)


def psi(sigma: ArrayLike) -> float | np.ndarray:
    """The paper's constant ``Psi(sigma) = 1 + sigma + (e^{1/sigma} + 1) / (e^{1/sigma} - 1)``.

    This is the variant used throughout (see the module docstring): for large ``sigma`` it is about
    ``1 + 3 sigma``. ``sigma = inf`` (slope 0) gives ``inf``. Accepts a float or an array.
    """
    s = _as_sigma(sigma)
    return _out(1.0 + s + _coth_half_inv(s))


def psi_without_one(sigma: ArrayLike) -> float | np.ndarray:
    """The second ``Psi`` found in the authors' code, ``sigma + (e^{1/sigma}+1)/(e^{1/sigma}-1)``.

    It is :func:`psi` minus 1. Not used by this library; kept to document the discrepancy.
    """
    s = _as_sigma(sigma)
    return _out(s + _coth_half_inv(s))


def alibi_norm_bound(sigma: ArrayLike) -> float | np.ndarray:
    """``(e^{1/sigma} + 1) / (e^{1/sigma} - 1) = coth(m/2)``: an upper bound on ``||A||_2`` for every ``n``.

    It is the sum of an interior row of ``A`` (``A`` is symmetric with non-negative entries, so its
    spectral norm is at most its largest row sum), the limit of ``||A||_2`` as ``n -> inf``, and about
    ``2 sigma`` for large ``sigma``. It also equals ``E[pitch]`` of the ``discrete`` scheme.
    """
    s = _as_sigma(sigma)
    return _out(_coth_half_inv(s))


def _check_n(seq_len: object) -> int:
    n = check_int("seq_len", seq_len)
    if n < 2:
        raise ValueError(f"seq_len must be >= 2 (the bounds use log n), got {n}")
    return n


def _check_samples(num_samples: ArrayLike) -> np.ndarray:
    s = np.asarray(num_samples, dtype=np.float64)
    if np.isnan(s).any() or (s < 1).any():
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return s


def expected_error_bound(seq_len: int, sigma: ArrayLike, num_samples: ArrayLike) -> float | np.ndarray:
    """The paper's expectation bound ``E ||Mbar - A||_2 <= Psi(sigma) (sqrt(log n / s) + log n / s)``.

    Absolute spectral error. ``sigma`` and ``num_samples`` broadcast against each other.
    """
    n = _check_n(seq_len)
    s = _check_samples(num_samples)
    r = math.log(n) / s
    return _out(np.asarray(psi(sigma)) * (np.sqrt(r) + r))


def tail_bound(seq_len: int, sigma: ArrayLike, num_samples: ArrayLike, eps: ArrayLike) -> float | np.ndarray:
    """The paper's tail bound ``P[||Mbar - A||_2 >= eps] <= n exp(-s eps^2 / (4 Psi (4 Psi + eps)))``.

    Returned as computed (it exceeds 1, i.e. says nothing, when ``s`` is small); ``eps`` is absolute.
    """
    n = _check_n(seq_len)
    s = _check_samples(num_samples)
    e = np.asarray(eps, dtype=np.float64)
    if np.isnan(e).any() or (e <= 0).any():
        raise ValueError(f"eps must be > 0, got {eps}")
    p = np.asarray(psi(sigma))
    return _out(n * np.exp(-s * e**2 / (4.0 * p * (4.0 * p + e))))


def tail_bound_epsilon(
    seq_len: int, sigma: ArrayLike, num_samples: ArrayLike, delta: float = 0.05
) -> float | np.ndarray:
    """The ``eps`` at which :func:`tail_bound` equals ``delta``: ``||Mbar - A||_2 < eps`` w.p. ``>= 1 - delta``.

    Solves ``s eps^2 = 4 Psi (4 Psi + eps) L`` with ``L = log(n / delta)``:
    ``eps = (4 Psi L + sqrt(16 Psi^2 L^2 + 64 Psi^2 L s)) / (2 s)``.
    """
    n = _check_n(seq_len)
    s = _check_samples(num_samples)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    p = np.asarray(psi(sigma))
    lg = math.log(n / delta)
    return _out((4 * p * lg + np.sqrt(16 * p**2 * lg**2 + 64 * p**2 * lg * s)) / (2 * s))


def suggested_samples(seq_len: int, sigma: ArrayLike, eps: ArrayLike) -> int | np.ndarray:
    """The authors' suggested sample count ``ceil(sigma^2 log n / eps^2)`` (``eps`` absolute)."""
    n = _check_n(seq_len)
    sg = _as_sigma(sigma)
    e = np.asarray(eps, dtype=np.float64)
    if np.isnan(e).any() or (e <= 0).any():
        raise ValueError(f"eps must be > 0, got {eps}")
    out = np.ceil(sg**2 * math.log(n) / e**2)
    return int(out) if out.ndim == 0 else out.astype(np.int64)


def alibi_spectral_norm(seq_len: int, slope: float) -> float:
    """Exact ``||A||_2`` for ``A[i, j] = exp(-slope |i - j|)``, ``i, j < seq_len``, in ``O(n)`` memory.

    ``A`` is the Kac–Murdock–Szegő matrix with ``x = e^{-slope}``; its inverse is tridiagonal,
    ``(1 - x^2) A^{-1} = tridiag(-x; 1, 1 + x^2, ..., 1 + x^2, 1; -x)``, so ``||A||_2 = lambda_max(A)`` is
    ``(1 - x^2)`` over the smallest eigenvalue of that tridiagonal matrix (LAPACK bisection). Slope 0
    gives ``n`` (all ones).
    """
    n = positive_int("seq_len", seq_len)
    m = float(slope)
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"slope must be finite and >= 0, got {slope}")
    if m == 0:
        return float(n)
    if n == 1:
        return 1.0
    x = math.exp(-m)
    if x < 1e-300:
        return 1.0
    d = np.full(n, 1.0 + x * x)
    d[0] = d[-1] = 1.0
    e = np.full(n - 1, -x)
    lam = float(eigvalsh_tridiagonal(d, e, select="i", select_range=(0, 0))[0])
    return (1.0 - x * x) / lam  # = -expm1(-2m) / lam, fine for the slopes in use (x^2 > 1e-16)
