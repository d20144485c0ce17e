"""The paper's theory: bounds on ``||Mbar - A||`` and the empirical error metrics, at any scale.

Notation (DESIGN.md §2): ``n`` positions, slope ``m > 0`` and ``sigma = 1/m`` for one head, the ALiBi
matrix ``A[i, j] = exp(-m |i - j|)``, ``T`` (a.k.a. ``s``) sampled block masks ``M_1..M_T`` and their mean
``Mbar``.

**Bounds** (the formulas of the authors' public code):

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

**Empirical metrics, matrix-free** (never an ``n x n`` matrix unless asked):

* ``Mbar x`` costs ``O(n + #blocks)`` per matvec (:class:`MeanMaskOperator`): each mask is block-constant,
  so its matvec is a block sum broadcast back over the block (a reshape for integer pitches, a
  difference array of block sums for samples with few blocks). ``A x`` costs ``O(n)`` by the
  two-sided first-order recurrence ``y_i = x_i + e^{-m} y_{i-1}`` (:func:`alibi_matvec`).
* ``||Mbar - A||_2`` by the Lanczos recurrence on ``x -> Mbar x - A x`` (:func:`spectral_error`), stopped
  at a relative tolerance ``tol``: when the residual estimate ``beta_k |s_k|`` of the top Ritz pair is below
  ``tol * theta`` (then ``theta`` is within ``tol * theta`` of an eigenvalue), or when ``theta`` has stopped
  moving (by less than ``tol * theta`` over 30 steps; this happens in a dense band of top eigenvalues).
  Ritz values never exceed the largest ``|eigenvalue|``, so the estimate errs low, if at all.
* ``max |Mbar - A|`` exactly (:func:`max_error`), diagonal by diagonal: on the ``d``-th diagonal the count
  of samples in which ``i`` and ``i + d`` share a block is a difference of two counting functions of block
  starts and (ends - d), so each diagonal costs ``O(n + #blocks longer than d)``; diagonals whose error
  cannot beat the running maximum (by a bound from the longest block of each sample) are skipped.
* For given ``Q, K, V`` (:func:`output_errors`): the exp-weighted form ``(E∘A)V`` vs ``(E∘Mbar)V`` with
  ``E = exp(s)``, the softmax form ``softmax(s + log A) V`` vs ``softmax(s + log Mbar) V``, row-wise relative
  errors (median, p90, p99) and cosine similarities: the paper's §5.2 metrics. These need ``O(n^2)`` time
  (dense rows of ``Mbar`` are built chunk by chunk in ``O(T n + n^2)``) but only ``O(chunk * n)`` memory.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal, eigvalsh_tridiagonal
from scipy.signal import lfilter
from scipy.special import ndtri

from positional_lsh.ops import sampling
from positional_lsh.ops._checks import as_scale
from positional_lsh.ops.reference import alibi_matrix
from positional_lsh.ops.sampling import Partitions, sample_partitions

__all__ = [
    "MaskErrors",
    "MeanMaskOperator",
    "OutputErrors",
    "SpectralEstimate",
    "UnbiasednessResult",
    "alibi_matvec",
    "alibi_norm_bound",
    "alibi_spectral_norm",
    "dense_mask_errors",
    "expected_error_bound",
    "fit_power_law",
    "mask_errors",
    "max_error",
    "output_errors",
    "psi",
    "psi_without_one",
    "samples_for_error",
    "spectral_error",
    "suggested_samples",
    "tail_bound",
    "tail_bound_epsilon",
    "unbiasedness_test",
]

ArrayLike = float | np.ndarray | Sequence[float]


# ----------------------------------------------------------------------------------------------------
# Bounds
# ----------------------------------------------------------------------------------------------------


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
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (the bounds use log n), got {seq_len}")
    return int(seq_len)


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
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    m = float(slope)
    if not math.isfinite(m) or m < 0:
        raise ValueError(f"slope must be finite and >= 0, got {slope}")
    n = int(seq_len)
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


# ----------------------------------------------------------------------------------------------------
# Matrix-free operators
# ----------------------------------------------------------------------------------------------------


def alibi_matvec(x: np.ndarray, slope: float) -> np.ndarray:
    """``A x`` for ``A[i, j] = exp(-slope |i - j|)`` in ``O(n)``: ``x`` is ``(n,)`` or ``(n, k)`` float64.

    Uses the recurrences ``f_i = x_i + e^{-m} f_{i-1}`` (left to right) and the same right to left:
    ``A x = f + b - x``. Numerically stable for every slope (the filter is contractive).
    """
    x = np.asarray(x, dtype=np.float64)
    m = float(slope)
    if m == 0:
        return np.broadcast_to(x.sum(axis=0, keepdims=True), x.shape).copy()
    r = math.exp(-m)
    f = lfilter([1.0], [1.0, -r], x, axis=0)
    b = lfilter([1.0], [1.0, -r], np.ascontiguousarray(x[::-1]), axis=0)[::-1]
    return f + b - x


def _block_starts(pitch: float, shift: float, n: int) -> np.ndarray:
    """Starts (int64, ascending, first is 0) of the blocks of ``0..n-1`` for one (pitch, shift).

    Exactly the runs of :meth:`Partitions.labels` (``label(i) = floor((i - shift) / pitch)``), computed in
    ``O(#blocks)``: candidate boundaries ``ceil(shift + l * pitch)`` corrected against the floor formula.
    """
    if math.isinf(pitch):
        return np.zeros(1, dtype=np.int64)
    if pitch <= 1.0:
        return np.arange(n, dtype=np.int64)

    def lab(p: np.ndarray) -> np.ndarray:
        return np.floor((p.astype(np.float64) - shift) / pitch)

    l0 = math.floor((0.0 - shift) / pitch)
    l1 = math.floor((n - 1.0 - shift) / pitch)
    if l1 <= l0:
        return np.zeros(1, dtype=np.int64)
    labels = np.arange(l0 + 1, l1 + 1, dtype=np.float64)
    p = np.ceil(shift + labels * pitch).astype(np.int64)
    p = np.clip(p, 1, n - 1)
    for _ in range(4):  # floating-point corrections: at most one step in practice
        up = lab(p) < labels
        down = (p > 1) & (lab(p - 1) >= labels)
        if not (up.any() or down.any()):
            break
        p = np.clip(p + up - down, 1, n - 1)
    return np.concatenate([np.zeros(1, dtype=np.int64), p])


class MeanMaskOperator:
    """The mean mask ``Mbar`` of one head of :class:`~positional_lsh.Partitions` as a matrix-free operator.

    Stores ``O(T + #blocks of samples with few blocks)`` numbers. Identical samples (same pitch and shift)
    are merged with their multiplicity. ``matvec`` costs ``O(n)`` per distinct sample with many blocks
    (a reshape for integer pitch and shift, ``np.add.reduceat`` otherwise) and ``O(#blocks)`` for samples
    with few blocks (one shared prefix sum and one difference array).

    Args:
        partitions: the sampled partitions.
        head: which head.
    """

    def __init__(self, partitions: Partitions, head: int = 0) -> None:
        if not isinstance(partitions, Partitions):
            raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
        if isinstance(head, bool) or not isinstance(head, numbers.Integral):
            raise TypeError(f"head must be an int, got {type(head).__name__}")
        if not 0 <= head < partitions.num_heads:
            raise ValueError(f"head must be in [0, {partitions.num_heads}), got {head}")
        self.partitions = partitions
        self.head = int(head)
        self.n = n = partitions.seq_len
        self.num_samples = t_total = partitions.num_samples
        self.slope = float(partitions.slopes[head])
        pitch = partitions.pitch[:, head].numpy()
        shift = partitions.shift[:, head].numpy()
        # Merge identical samples; pitches <= 1 all mean "every position is its own block".
        key_p = np.where(pitch <= 1.0, 1.0, pitch)
        key_s = np.where(pitch <= 1.0, 0.0, shift)
        uniq, counts = np.unique(np.stack([key_p, key_s], 1), axis=0, return_counts=True)
        self.identity_weight = 0.0  # multiplicity of identity masks
        self.full_weight = 0.0  # multiplicity of one-block masks
        self.regular: list[tuple[int, int, float]] = []  # (pitch, shift, weight), integer, many blocks
        self.irregular: list[tuple[np.ndarray, float]] = []  # (starts, weight), many blocks
        sparse_starts, sparse_ends, sparse_w = [], [], []
        self.num_blocks = 0
        integer = partitions.scheme in _integer_schemes()
        for (p, s), c in zip(uniq.tolist(), counts.tolist(), strict=True):
            if p <= 1.0:
                self.identity_weight += c
                self.num_blocks += n
                continue
            starts = _block_starts(p, s, n)
            k = len(starts)
            self.num_blocks += k
            if k == 1:
                self.full_weight += c
            elif k <= max(8, n // 16):
                sparse_starts.append(starts)
                sparse_ends.append(np.append(starts[1:], n))
                sparse_w.append(np.full(k, float(c)))
            elif integer and math.isfinite(p) and float(p).is_integer() and float(s).is_integer():
                self.regular.append((int(p), int(s), float(c)))
            else:
                self.irregular.append((starts, float(c)))
        cat = np.concatenate
        self.sparse_starts = cat(sparse_starts) if sparse_starts else np.zeros(0, dtype=np.int64)
        self.sparse_ends = cat(sparse_ends) if sparse_ends else np.zeros(0, dtype=np.int64)
        self.sparse_weight = cat(sparse_w) if sparse_w else np.zeros(0)
        self._unique = (uniq, counts)
        self._t_total = t_total

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """``Mbar x``: ``x`` is ``(n,)`` float64, returns ``(n,)`` float64."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        n = self.n
        if x.shape[0] != n:
            raise ValueError(f"x must have {n} entries, got {x.shape[0]}")
        y = self.identity_weight * x
        if self.full_weight:
            y += self.full_weight * x.sum()
        if self.sparse_starts.size:
            c = np.empty(n + 1)
            c[0] = 0.0
            np.cumsum(x, out=c[1:])
            sums = (c[self.sparse_ends] - c[self.sparse_starts]) * self.sparse_weight
            diff = np.bincount(self.sparse_starts, weights=sums, minlength=n + 1)
            diff -= np.bincount(self.sparse_ends, weights=sums, minlength=n + 1)
            y += np.cumsum(diff[:n])
        for b, s, w in self.regular:
            if s > 0:
                y[:s] += w * x[:s].sum()
            k = (n - s) // b
            if k:
                end = s + k * b
                sums = x[s:end].reshape(k, b).sum(axis=1)
                y[s:end].reshape(k, b)[...] += (w * sums)[:, None]
            else:
                end = s
            if end < n:
                y[end:] += w * x[end:].sum()
        for starts, w in self.irregular:
            sums = np.add.reduceat(x, starts)
            y += w * np.repeat(sums, np.diff(np.append(starts, n)))
        return y / self._t_total

    def block_ranges(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For positions ``rows`` (``(r,)`` int64): the ``[start, end)`` of their block in every distinct
        sample, ``(S, r)`` int64 each, and the ``(S,)`` multiplicities of the distinct samples."""
        uniq, counts = self._unique
        n = self.n
        starts_all = np.empty((len(uniq), len(rows)), dtype=np.int64)
        ends_all = np.empty_like(starts_all)
        for u, (p, s) in enumerate(uniq.tolist()):
            if p <= 1.0:
                starts_all[u] = rows
                ends_all[u] = rows + 1
                continue
            starts = _block_starts(p, s, n)
            idx = np.searchsorted(starts, rows, side="right") - 1
            ends = np.append(starts[1:], n)
            starts_all[u] = starts[idx]
            ends_all[u] = ends[idx]
        return starts_all, ends_all, counts.astype(np.float64)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Dense rows ``Mbar[start:stop, :]``: ``(stop - start, n)`` float64, in ``O(T r + r n)``."""
        n = self.n
        rows = np.arange(start, stop, dtype=np.int64)
        r = len(rows)
        st, en, w = self.block_ranges(rows)
        local = np.arange(r, dtype=np.int64)[None, :] * (n + 1)
        weights = np.broadcast_to(w[:, None], st.shape).ravel()
        diff = np.bincount((local + st).ravel(), weights=weights, minlength=r * (n + 1))
        diff -= np.bincount((local + en).ravel(), weights=weights, minlength=r * (n + 1))
        out = np.cumsum(diff.reshape(r, n + 1)[:, :n], axis=1)
        return out / self._t_total

    def dense(self) -> np.ndarray:
        """``Mbar`` as a dense ``(n, n)`` float64 array (small ``n`` only)."""
        return self.rows(0, self.n)


def _integer_schemes() -> set[str]:
    return set(sampling._INTEGER)


# ----------------------------------------------------------------------------------------------------
# Spectral and max-norm errors
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpectralEstimate:
    """``||Mbar - A||_2`` for one head.

    Attributes:
        value: the estimate, the largest ``|Ritz value|`` (it does not exceed the true norm).
        residual: the Lanczos residual estimate ``beta_k |s_k|`` of that Ritz pair (in exact arithmetic an
            eigenvalue lies within it); 0 for the dense method.
        matvecs: number of operator applications.
        method: ``"lanczos"``, ``"dense"`` (tiny ``n``) or ``"exact"`` (slope 0: the error is 0).
    """

    value: float
    residual: float
    matvecs: int
    method: str


def _top_abs_eigenvalue(
    matvec: Callable[[np.ndarray], np.ndarray], n: int, tol: float, seed: int = 0, max_iter: int = 3000
) -> SpectralEstimate:
    """Largest-magnitude eigenvalue of a symmetric operator by the Lanczos recurrence (dense for tiny n).

    Plain three-term Lanczos (``O(n)`` memory, no re-orthogonalization: lost orthogonality only creates
    duplicate copies of converged Ritz values, the extreme ones stay inside the spectrum). The extreme
    Ritz values of the tridiagonal ``T_k`` are checked every few steps; it stops when the standard residual
    estimate ``beta_k |s_k|`` of the top Ritz pair is below ``tol |theta|``, or when ``theta`` has changed by
    less than ``tol |theta|`` over the last 30 steps (a dense band of eigenvalues at the top, as for the
    periodic errors of stratified schemes, where eigenvectors are never resolved but ``theta`` is).
    Vector operations are numpy ufuncs, not BLAS, so they stay single-threaded.
    """
    if n <= 64:
        dense = np.stack([matvec(e) for e in np.eye(n)], axis=1)
        w = np.linalg.eigvalsh((dense + dense.T) / 2)
        return SpectralEstimate(float(np.abs(w).max()), 0.0, n, "dense")
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(n)
    v /= math.sqrt(float((v * v).sum()))
    v_prev = np.zeros(n)
    alphas: list[float] = []
    betas: list[float] = []
    beta = 0.0
    history: list[tuple[int, float]] = []
    theta, resid = 0.0, math.inf
    for j in range(min(max_iter, n)):
        w = matvec(v)
        if beta:
            w -= beta * v_prev
        alpha = float((w * v).sum())
        w -= alpha * v
        beta = math.sqrt(float((w * w).sum()))
        alphas.append(alpha)
        betas.append(beta)
        k = j + 1
        done = beta <= 1e-14 * max(abs(alpha), 1e-300)
        if k >= 8 and (k % 4 == 0 or done or k == min(max_iter, n)):
            vals, vecs = eigh_tridiagonal(np.array(alphas), np.array(betas[:-1]))
            top = int(np.argmax(np.abs(vals)))
            theta = abs(float(vals[top]))
            resid = abs(beta * float(vecs[-1, top]))
            history.append((k, theta))
            old = [t for kk, t in history if kk <= k - 30]
            stalled = bool(old) and abs(theta - old[-1]) <= tol * theta
            if resid <= tol * theta or stalled or done:
                break
        if done:
            break
        v_prev, v = v, w / beta
    return SpectralEstimate(theta, resid, len(alphas), "lanczos")


def spectral_error(
    partitions: Partitions,
    head: int = 0,
    *,
    tol: float = 1e-8,
    operator: MeanMaskOperator | None = None,
    dense_mbar: np.ndarray | None = None,
) -> SpectralEstimate:
    """``||Mbar - A||_2`` for one head, matrix-free (Lanczos on ``x -> Mbar x - A x``).

    Args:
        partitions: sampled partitions (any scheme).
        head: which head.
        tol: relative tolerance of the Lanczos iteration (see the module docstring).
        operator: a prebuilt :class:`MeanMaskOperator` for this head (built if ``None``).
        dense_mbar: optionally the dense ``(n, n)`` ``Mbar`` (then its matvec is used, cheaper when
            the partitions hold very many samples).

    Returns:
        :class:`SpectralEstimate`.
    """
    if not (isinstance(tol, float) and 0 < tol < 1):
        raise ValueError(f"tol must be a float in (0, 1), got {tol!r}")
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    m = op.slope
    if m == 0:
        return SpectralEstimate(0.0, 0.0, 0, "exact")
    if dense_mbar is not None:
        mb = np.asarray(dense_mbar, dtype=np.float64)

        def mv(x: np.ndarray) -> np.ndarray:
            return mb @ x - alibi_matvec(x, m)

    else:

        def mv(x: np.ndarray) -> np.ndarray:
            return op.matvec(x) - alibi_matvec(x, m)

    return _top_abs_eigenvalue(mv, op.n, tol)


def max_error(partitions: Partitions, head: int = 0, *, operator: MeanMaskOperator | None = None) -> float:
    """``max_{i,j} |Mbar[i, j] - A[i, j]|`` for one head, exactly, without an ``n x n`` matrix.

    On diagonal ``d`` the number of samples in which ``i`` and ``i + d`` share a block is
    ``#{blocks longer than d with start <= i} - #{such blocks with end - d <= i}``; both counting
    functions are a ``bincount`` and a ``cumsum``. Diagonals whose error cannot exceed the running maximum
    are skipped: the count is at most the number of samples having a block longer than ``d`` and at least
    the number of samples that are a single block. Pairs farther apart than every block never collide,
    so their error is ``A`` itself, largest at the smallest such distance.
    """
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    n, t_total, m = op.n, op.num_samples, op.slope
    if m == 0 or n == 1:
        return 0.0
    uniq, counts = op._unique
    starts_l, sizes_l, weights_l = [], [], []
    longest = np.zeros(len(uniq), dtype=np.int64)
    for u, (p, s) in enumerate(uniq.tolist()):
        if p <= 1.0:
            longest[u] = 1
            continue
        starts = _block_starts(p, s, n)
        sizes = np.diff(np.append(starts, n))
        longest[u] = sizes.max()
        keep = sizes >= 2
        starts_l.append(starts[keep])
        sizes_l.append(sizes[keep])
        weights_l.append(np.full(int(keep.sum()), float(counts[u])))
    if not starts_l:
        return math.exp(-m)  # no pair ever collides: the largest error is A at distance 1
    starts = np.concatenate(starts_l)
    sizes = np.concatenate(sizes_l)
    weights = np.concatenate(weights_l)
    order = np.argsort(-sizes, kind="stable")
    starts, sizes, weights = starts[order], sizes[order], weights[order]
    ends = starts + sizes
    w_longest = counts.astype(np.float64)
    full = float(w_longest[longest >= n].sum())  # single-block samples: every pair collides
    dmax = int(longest.max())  # pairs at distance >= dmax never collide
    best = math.exp(-m * dmax) if dmax <= n - 1 else 0.0
    # number of samples (with multiplicity) whose longest block exceeds d, for every d
    srt = np.argsort(longest)
    lon_sorted, w_sorted = longest[srt], w_longest[srt]
    cum_w = np.concatenate([[0.0], np.cumsum(w_sorted)])
    last = min(dmax - 1, n - 1)
    num_longer = np.searchsorted(-sizes, -np.arange(1, last + 1), side="left")  # blocks longer than d
    for d in range(1, last + 1):
        a = math.exp(-m * d)
        upper = (t_total - cum_w[np.searchsorted(lon_sorted, d, side="right")]) / t_total
        if max(upper - a, a - full / t_total) <= best:
            continue
        k = int(num_longer[d - 1])
        st, en, w = starts[:k], ends[:k] - d, weights[:k]
        cnt = np.cumsum(np.bincount(st, weights=w, minlength=n + 1) - np.bincount(en, weights=w, minlength=n + 1))
        cnt = cnt[: n - d]
        best = max(best, float(cnt.max()) / t_total - a, a - float(cnt.min()) / t_total)
    return best


@dataclass(frozen=True)
class MaskErrors:
    """Mask-level errors of one head: the paper's ``||Mbar - A||_2``, relative error and ``max|Mbar - A|``.

    Attributes:
        head, slope, seq_len, num_samples, scheme: what was measured.
        spectral: ``||Mbar - A||_2`` (Lanczos estimate, see :class:`SpectralEstimate`).
        spectral_residual: Lanczos residual of ``spectral``.
        alibi_norm: exact ``||A||_2``.
        relative_spectral: ``spectral / alibi_norm``.
        max_abs: exact ``max |Mbar - A|``.
    """

    head: int
    slope: float
    seq_len: int
    num_samples: int
    scheme: str
    spectral: float
    spectral_residual: float
    alibi_norm: float
    relative_spectral: float
    max_abs: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def mask_errors(
    partitions: Partitions,
    heads: Sequence[int] | None = None,
    *,
    tol: float = 1e-8,
    dense_mbar: dict[int, np.ndarray] | None = None,
) -> list[MaskErrors]:
    """Spectral, relative spectral and max-norm error of ``Mbar`` against ``A``, per head, matrix-free.

    Args:
        partitions: sampled partitions.
        heads: heads to measure (default all).
        tol: Lanczos tolerance (see :func:`spectral_error`).
        dense_mbar: optional ``{head: dense Mbar}`` to use instead of the matrix-free operator (its
            matvec and its max error are then computed from the dense matrix).

    Returns:
        one :class:`MaskErrors` per requested head.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    heads = list(range(partitions.num_heads)) if heads is None else list(heads)
    out = []
    for h in heads:
        op = MeanMaskOperator(partitions, h)
        dense = None if dense_mbar is None else dense_mbar.get(h)
        spec = spectral_error(partitions, h, tol=tol, operator=op, dense_mbar=dense)
        norm_a = alibi_spectral_norm(partitions.seq_len, op.slope)
        if dense is not None:
            mx = _dense_max_error(dense, op.slope)
        else:
            mx = max_error(partitions, h, operator=op)
        out.append(
            MaskErrors(
                head=h,
                slope=op.slope,
                seq_len=partitions.seq_len,
                num_samples=partitions.num_samples,
                scheme=partitions.scheme,
                spectral=spec.value,
                spectral_residual=spec.residual,
                alibi_norm=norm_a,
                relative_spectral=spec.value / norm_a,
                max_abs=mx,
            )
        )
    return out


def _dense_max_error(mbar: np.ndarray, slope: float) -> float:
    n = mbar.shape[0]
    best = 0.0
    for a in range(0, n, 1024):
        b = min(n, a + 1024)
        dist = np.abs(np.arange(a, b)[:, None] - np.arange(n)[None, :])
        best = max(best, float(np.abs(mbar[a:b] - np.exp(-slope * dist)).max()))
    return best


def dense_mask_errors(partitions: Partitions, head: int = 0) -> tuple[float, float]:
    """``(||Mbar - A||_2, max|Mbar - A|)`` for one head from dense float64 matrices (a cross-check).

    Uses :meth:`Partitions.mean_mask` and :func:`~positional_lsh.alibi_matrix` and a full symmetric
    eigendecomposition: ``O(n^3)`` time and ``O(n^2)`` memory, small ``n`` only.
    """
    mb = partitions.mean_mask()[head]
    a = alibi_matrix(partitions.seq_len, partitions.slopes[head : head + 1])[0]
    diff = mb - a
    spec = float(torch.linalg.eigvalsh(diff).abs().max())
    return spec, float(diff.abs().max())


# ----------------------------------------------------------------------------------------------------
# Output errors for given Q, K, V
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputErrors:
    """The paper's output metrics for one head (all relative, dimensionless).

    ``exp`` refers to the exp-weighted form ``N = (E∘W) V`` with ``E = exp(s)``; ``softmax`` to the
    normalized form ``O = softmax(s + log W) V``; ``W`` is ``A`` (reference) or ``Mbar`` (estimate).

    Attributes:
        exp_rel: ``||N_Mbar - N_A||_F / ||N_A||_F``.
        softmax_rel: ``||O_Mbar - O_A||_F / ||O_A||_F``.
        exp_row_median, exp_row_p90, exp_row_p99: quantiles over rows of ``||N_Mbar,i - N_A,i|| / ||N_A,i||``.
        row_median, row_p90, row_p99: quantiles over rows of ``||O_Mbar,i - O_A,i|| / ||O_A,i||``.
        cosine_mean, cosine_min: cosine similarity of ``O_Mbar,i`` and ``O_A,i`` over rows.
    """

    exp_rel: float
    softmax_rel: float
    exp_row_median: float
    exp_row_p90: float
    exp_row_p99: float
    row_median: float
    row_p90: float
    row_p99: float
    cosine_mean: float
    cosine_min: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _as_head_matrix(name: str, x: object, n: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating (seq_len, head_dim) tensor, got {tuple(x.shape)} {x.dtype}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have {n} rows (the partitions' seq_len), got {x.shape[0]}")
    return x.detach().to("cpu", torch.float64)


def output_errors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    head: int = 0,
    *,
    causal: bool = True,
    scale: float | None = None,
    chunk_rows: int = 512,
    operator: MeanMaskOperator | None = None,
    dense_mbar: np.ndarray | None = None,
) -> OutputErrors:
    """The paper's §5.2 output metrics for one head, in float64, chunked over query rows.

    Args:
        q, k, v: ``(n, d)`` tensors of this head (any float dtype; computed in float64 on the CPU).
        partitions: partitions with ``seq_len == n``; ``head`` selects the head's masks and slope.
        causal: restrict query ``i`` to keys ``j <= i`` (both in ``A`` and ``Mbar``).
        scale: score scale ``s = scale * q.k``, default ``1/sqrt(d)``.
        chunk_rows: query rows per chunk (memory ``O(chunk_rows * n)``).
        operator: a prebuilt :class:`MeanMaskOperator` for this head.
        dense_mbar: optionally this head's dense ``(n, n)`` ``Mbar`` (reused instead of rebuilding rows).

    Returns:
        :class:`OutputErrors`. Rows are stabilized by their own maximum score; the Frobenius norms of the
        exp-weighted form use one global stabilizer (a common factor, so the ratio is exact).
    """
    n = partitions.seq_len
    qq = _as_head_matrix("q", q, n)
    kk = _as_head_matrix("k", k, n)
    vv = _as_head_matrix("v", v, n)
    if qq.shape[1] != kk.shape[1]:
        raise ValueError(f"q and k must have the same head_dim, got {qq.shape[1]} and {kk.shape[1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sc = as_scale(scale, qq.shape[1])
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    m = op.slope
    row_max = np.empty(n)
    num_a_sq = np.empty(n)
    num_diff_sq = np.empty(n)
    out_a_sq = np.empty(n)
    out_diff_sq = np.empty(n)
    cos = np.empty(n)
    pos = torch.arange(n, dtype=torch.float64)
    for a in range(0, n, chunk_rows):
        b = min(n, a + chunk_rows)
        s = (qq[a:b] @ kk.T) * sc
        dist = pos[a:b, None] - pos[None, :]
        if causal:
            s = s.masked_fill(dist < 0, float("-inf"))
        rmax = s.max(dim=1, keepdim=True).values
        e = torch.exp(s - rmax)
        wa = e * torch.exp(-m * dist.abs())
        rows = dense_mbar[a:b] if dense_mbar is not None else op.rows(a, b)
        wm = e * torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float64))
        na, nm = wa @ vv, wm @ vv
        da, dm = wa.sum(1, keepdim=True), wm.sum(1, keepdim=True)
        oa, om = na / da, nm / dm
        row_max[a:b] = rmax[:, 0].numpy()
        num_a_sq[a:b] = (na**2).sum(1).numpy()
        num_diff_sq[a:b] = ((nm - na) ** 2).sum(1).numpy()
        out_a_sq[a:b] = (oa**2).sum(1).numpy()
        out_diff_sq[a:b] = ((om - oa) ** 2).sum(1).numpy()
        cos[a:b] = torch.nn.functional.cosine_similarity(om, oa, dim=1, eps=1e-300).numpy()
    g = np.exp(2.0 * (row_max - row_max.max()))  # squared global stabilizer per row
    exp_rel = math.sqrt(float((g * num_diff_sq).sum()) / float((g * num_a_sq).sum()))
    with np.errstate(divide="ignore", invalid="ignore"):
        exp_rows = np.sqrt(num_diff_sq / num_a_sq)
        out_rows = np.sqrt(out_diff_sq / out_a_sq)
    exp_rows = exp_rows[np.isfinite(exp_rows)]
    out_rows = out_rows[np.isfinite(out_rows)]
    return OutputErrors(
        exp_rel=exp_rel,
        softmax_rel=math.sqrt(float(out_diff_sq.sum()) / float(out_a_sq.sum())),
        exp_row_median=float(np.median(exp_rows)),
        exp_row_p90=float(np.quantile(exp_rows, 0.9)),
        exp_row_p99=float(np.quantile(exp_rows, 0.99)),
        row_median=float(np.median(out_rows)),
        row_p90=float(np.quantile(out_rows, 0.9)),
        row_p99=float(np.quantile(out_rows, 0.99)),
        cosine_mean=float(np.mean(cos)),
        cosine_min=float(np.min(cos)),
    )


# ----------------------------------------------------------------------------------------------------
# Unbiasedness and scaling
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnbiasednessResult:
    """Outcome of :func:`unbiasedness_test` for one scheme and slope.

    Attributes:
        scheme, slope, seq_len, num_samples, replicates: what was tested.
        max_z: the largest ``|z|`` over all tested (sample index, pair) cells, where
            ``z = (hits - R a) / sqrt(R a (1 - a))`` is the standardized collision count of one mask index
            over ``R`` independent replicates (each mask is a Bernoulli(``a``) per pair if it is an exact
            sample, so this variance is exact).
        mean_max_z: the same for ``Mbar`` (the mean over all ``T`` indices), standardized by the empirical
            variance across replicates (coupled schemes have no closed-form variance).
        threshold: the Bonferroni-corrected two-sided normal quantile for the family-wise level ``alpha``.
        passed: ``max_z <= threshold and mean_max_z <= threshold``.
    """

    scheme: str
    slope: float
    seq_len: int
    num_samples: int
    replicates: int
    max_z: float
    mean_max_z: float
    threshold: float
    passed: bool


def unbiasedness_test(
    scheme: str,
    slope: float,
    *,
    seq_len: int = 40,
    num_samples: int = 16,
    replicates: int = 4000,
    alpha: float = 1e-3,
    generator: torch.Generator | int | None = 0,
    indices: Sequence[int] | None = None,
) -> UnbiasednessResult:
    """Statistical test that every mask of a scheme is marginally an exact positional-LSH sample.

    Draws ``replicates`` independent sets of ``num_samples`` coupled partitions (one call with the slope
    repeated per replicate: the schemes draw heads independently) and, for each tested mask index ``t``
    and each pair ``i < j`` with a usable normal approximation (``R a (1 - a) >= 5``), compares the number
    of replicates in which ``i`` and ``j`` share a block with its mean ``R a``, ``a = exp(-slope |i - j|)``,
    in units of the exact binomial standard deviation. Also tests ``E[Mbar] = A`` with the empirical
    variance. Rejects when any ``|z|`` exceeds the Bonferroni bound for family-wise level ``alpha``.
    """
    if replicates < 100:
        raise ValueError(f"replicates must be >= 100, got {replicates}")
    n = int(seq_len)
    r = int(replicates)
    parts = sample_partitions(n, [float(slope)] * r, num_samples, scheme=scheme, generator=generator)
    lab = parts.labels()  # (T, R, n)
    ii, jj = np.triu_indices(n, 1)
    a = np.exp(-float(slope) * (jj - ii))
    var = r * a * (1 - a)
    usable = var >= 5
    idx = list(range(num_samples)) if indices is None else list(indices)
    hits_all = np.zeros((r, len(ii)))
    max_z = 0.0
    for t in range(num_samples):
        same = (lab[t][:, ii] == lab[t][:, jj]).numpy().astype(np.float64)  # (R, pairs)
        hits_all += same
        if t in idx:
            z = (same.sum(0) - r * a)[usable] / np.sqrt(var[usable])
            if z.size:
                max_z = max(max_z, float(np.abs(z).max()))
    mbar = hits_all / num_samples
    sd = mbar.std(0, ddof=1)
    dev = mbar.mean(0) - a
    with np.errstate(divide="ignore", invalid="ignore"):
        # a deterministic Mbar (sd = 0) passes only if it equals A
        zm = np.where(sd > 0, dev / (sd / math.sqrt(r)), np.where(np.abs(dev) > 1e-12, np.inf, 0.0))
    mean_max_z = float(np.abs(zm[usable]).max()) if usable.any() else 0.0
    tests = int(usable.sum()) * (len(idx) + 1)
    threshold = float(ndtri(1 - alpha / (2 * max(tests, 1))))
    return UnbiasednessResult(
        scheme=scheme,
        slope=float(slope),
        seq_len=n,
        num_samples=int(num_samples),
        replicates=r,
        max_z=max_z,
        mean_max_z=mean_max_z,
        threshold=threshold,
        passed=max_z <= threshold and mean_max_z <= threshold,
    )


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``log y = slope * log x + intercept``; returns ``(slope, intercept)``."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    if lx.size < 2 or np.ptp(lx) == 0:
        raise ValueError("fit_power_law needs at least two distinct x values")
    slope, intercept = np.polyfit(lx, ly, 1)
    return float(slope), float(intercept)


def samples_for_error(x: Sequence[float], y: Sequence[float], eps: float) -> float:
    """The sample count at which the fitted power law ``y = e^c x^slope`` reaches ``eps`` (``inf`` if never)."""
    slope, intercept = fit_power_law(x, y)
    if slope >= 0:
        return math.inf
    return float(math.exp((math.log(eps) - intercept) / slope))
