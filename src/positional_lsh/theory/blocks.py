"""Block sizes of sampled partitions: the largest block, the work it implies, and high-probability bounds.

Every block of a partition with pitch ``b`` holds at most ``ceil(b)`` positions (exactly ``b`` for integer
pitches, except the first and last blocks, which are cut), and at most ``n``. So the largest block of one
(sample, head) is governed by **one number**, its pitch — not by a union over the ``~ n/b`` blocks — and the
largest block over ``T`` independent samples of a head is ``<= min(n, max_t ceil(B_t))`` (docs/theory.md §9):

    P[largest block of a head > L] <= 1 - (1 - P[B > L])^T <= T P[B > L]

with the pitch tails (``sigma = 1/m``, ``x = e^{-m}``, ``L`` a non-negative integer)

    discrete:  P[B > L] = x^L (1 + L (1 - x))          (B = 1 + G1 + G2)
    gamma:     P[b > L] = (1 + L/sigma) e^{-L/sigma}   (b ~ Gamma(2, sigma); a block > L needs b > L)

For integer pitches the first inequality is an equality whenever every pitch that occurs has a complete
block (``2B - 1 <= n`` suffices); otherwise it is an upper bound. :func:`block_size_bound` returns the
smallest ``L`` whose bound is ``<= delta``.

A pitch cap (``sample_partitions(..., max_block=c)``) bounds every block by ``c`` at the price of a bias,
computed exactly here (:func:`capped_bias`, :func:`capped_bias_norms`): pairs at distance ``d`` share a
block with probability ``E[(1 - d/min(B, c))_+] <= A[d]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from positional_lsh.ops.checks import positive_int
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.schemes import get_scheme


def pitch_tail(size: int | np.ndarray, sigma: float, scheme: str = "discrete") -> np.ndarray:
    """``P[pitch > size]`` for integer ``size >= 0``: float64 array of ``size``'s shape.

    ``scheme`` is ``"discrete"`` (``x^L (1 + L(1-x))``, ``x = e^{-1/sigma}``) or ``"gamma"``
    (``(1 + L/sigma) e^{-L/sigma}``); their variance-reduced versions have the same marginal pitch law.
    """
    base = get_scheme(scheme).base
    L = np.asarray(size, dtype=np.float64)
    s = float(sigma)
    if not s > 0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    if base == "discrete":
        m = 1.0 / s
        return np.exp(-m * L) * (1.0 + L * -np.expm1(-m))
    if base == "gamma":
        return (1.0 + L / s) * np.exp(-L / s)
    raise ValueError(f"pitch tails are known for the discrete and gamma schemes, got {scheme!r}")


def block_size_tail(
    size: int, n: int, sigma: float, num_samples: int, scheme: str = "discrete", *, heads: int = 1
) -> float:
    """Upper bound on ``P[some block of the T samples (of each of heads heads) holds more than size positions]``.

    ``1 - (1 - P[B > size])^(T * heads)``, and 0 when ``size >= n``. Independent samples and heads.
    """
    if size >= n:
        return 0.0
    p = float(pitch_tail(size, sigma, scheme))
    k = positive_int("num_samples", num_samples) * positive_int("heads", heads)
    return float(-np.expm1(k * np.log1p(-min(p, 1.0)))) if p < 1 else 1.0


def block_size_bound(
    n: int, sigma: float, num_samples: int, delta: float, scheme: str = "discrete", *, heads: int = 1
) -> int:
    """The smallest ``L <= n`` with :func:`block_size_tail` ``<= delta``: with probability ``>= 1 - delta``, no
    block of the ``T`` samples (of each of ``heads`` heads with length scale ``sigma``) is longer than ``L``.

    About ``sigma (log(T heads / delta) + log log(T heads / delta))``; independent of ``n`` until it reaches ``n``.
    """
    n = positive_int("n", n)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    k = positive_int("num_samples", num_samples) * positive_int("heads", heads)
    target = -math.expm1(math.log1p(-delta) / k)  # P[B > L] <= target  <=>  1 - (1 - P)^k <= delta
    lo, hi = 0, n  # tail(hi) passes by convention (no block exceeds n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if float(pitch_tail(mid, sigma, scheme)) <= target:
            hi = mid
        else:
            lo = mid
    return hi if float(pitch_tail(lo, sigma, scheme)) > target else lo


def _integer_blocks(pitch: torch.Tensor, shift: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """For integer pitch/shift: (first, full count, pitch, tail) block sizes; inf pitch -> one block of n."""
    finite = torch.isfinite(pitch)
    b = torch.where(finite, pitch, torch.full_like(pitch, float(n) + 1.0)).clamp_min(1.0)
    s = torch.where(finite, shift, torch.zeros_like(shift))
    first = s.clamp_max(float(n))
    rest = (n - s).clamp_min(0.0)
    full = torch.floor(rest / b)
    tail = rest - full * b
    return first, full, b, tail


def largest_blocks(partitions: Partitions) -> torch.Tensor:
    """The largest block of every (sample, head): ``(T, H)`` int64, in positions.

    Closed form for integer schemes (blocks ``[0, shift)``, then whole pitches, then the cut last block);
    from :meth:`Partitions.blocks` otherwise.
    """
    n = partitions.seq_len
    if get_scheme(partitions.scheme).integer:
        first, full, b, tail = _integer_blocks(partitions.pitch, partitions.shift, n)
        big = torch.maximum(torch.maximum(first, tail), torch.where(full > 0, b, torch.zeros_like(b)))
        return big.long()
    out = torch.empty(partitions.num_samples, partitions.num_heads, dtype=torch.long)
    for t in range(partitions.num_samples):
        for h in range(partitions.num_heads):
            out[t, h] = partitions.blocks(t, h)[1].max()
    return out


@dataclass(frozen=True)
class BlockStats:
    """Block sizes and work of a :class:`~positional_lsh.Partitions`.

    Attributes:
        largest: ``(T, H)`` int64, the largest block of each (sample, head).
        largest_per_head: ``(H,)`` int64, over the samples.
        largest_overall: the largest block of all.
        blocks: ``(H,)`` int64, number of blocks summed over the samples.
        work: ``(H,)`` float64, ``sum_t sum_blocks len^2``: query-key pairs scored (bidirectional).
        causal_work: ``(H,)`` float64, ``sum_t sum_blocks len (len + 1)/2`` (causal: about half).
        dense_work: ``n^2``, the work of one dense attention head, for comparison.
    """

    largest: torch.Tensor
    largest_per_head: torch.Tensor
    largest_overall: int
    blocks: torch.Tensor
    work: torch.Tensor
    causal_work: torch.Tensor
    dense_work: float


def block_stats(partitions: Partitions) -> BlockStats:
    """Largest blocks and the work of the per-block attention for each head (see :class:`BlockStats`).

    The fast path's time for one head is ``O(d * work / T)`` per sample, at most ``O(n * largest * d)``:
    ``O(n * max_block * T * d)`` for all ``T`` samples.
    """
    n = partitions.seq_len
    largest = largest_blocks(partitions)
    if get_scheme(partitions.scheme).integer:
        first, full, b, tail = _integer_blocks(partitions.pitch, partitions.shift, n)
        work = (first**2 + full * b**2 + tail**2).sum(0)
        causal = (first * (first + 1) + full * b * (b + 1) + tail * (tail + 1)).sum(0) / 2
        count = ((first > 0).double() + full + (tail > 0).double()).sum(0).long()
    else:
        h_count = partitions.num_heads
        work = torch.zeros(h_count, dtype=torch.float64)
        causal = torch.zeros(h_count, dtype=torch.float64)
        count = torch.zeros(h_count, dtype=torch.long)
        for t in range(partitions.num_samples):
            for h in range(h_count):
                sizes = partitions.blocks(t, h)[1].double()
                work[h] += (sizes**2).sum()
                causal[h] += (sizes * (sizes + 1)).sum() / 2
                count[h] += sizes.numel()
    per_head = largest.amax(0)
    return BlockStats(largest, per_head, int(per_head.max()), count, work, causal, float(n) ** 2)


def capped_bias(
    n: int,
    cap: int,
    *,
    slope: float | None = None,
    scheme: str = "discrete",
    decay: object | None = None,
) -> np.ndarray:
    """The exact bias ``E[M](d) - A(d)``, ``d = 0..n-1``, of one mask drawn with pitches capped at ``cap``.

    ``E[M](d) = E[(1 - d/min(B, cap))_+]``; with ``m = max(cap, d)`` and ``c = cap``:

        discrete:  x^c (1 + c(1-x)) (1 - d/c)_+ - x^m (1 + (m - d)(1 - x))      (x = e^{-slope})
        gamma:     (1 + c/sigma) e^{-c/sigma} (1 - d/c)_+ - (1 + (m - d)/sigma) e^{-m/sigma}
        decay:     sum_{b > c} P(B = b) [(1 - d/c)_+ - (1 - d/b)_+]  (the whole-sequence block: b = inf)

    Both closed forms reduce to ``-(d/c) A(c)`` for ``d < c`` and ``-A(d)`` for ``d >= c`` (no capped mask joins
    positions ``c`` or more apart), so ``max |bias| = A(c)``.
    All entries are ``<= 0``: capping only removes far collisions. Returns ``(n,)`` float64, the first row of
    the symmetric Toeplitz bias matrix.
    """
    n, c = positive_int("n", n), positive_int("cap", cap)
    d = np.arange(n, dtype=np.float64)
    tri = np.clip(1.0 - d / c, 0.0, None)
    mx = np.maximum(float(c), d)
    if decay is not None:
        from positional_lsh.ops.partitions.decays import pitch_law

        probs_t, whole = pitch_law(decay, n)  # type: ignore[arg-type]
        probs = probs_t.numpy()
        b = np.arange(1, n, dtype=np.float64)
        # S0(k) = sum_{b > k} p_b, S1(k) = sum_{b > k} p_b / b, for k = 0..n-1 (b <= n-1 here)
        s0 = np.concatenate([np.cumsum(probs[::-1])[::-1], [0.0]]) + whole
        s1 = np.concatenate([np.cumsum((probs / b)[::-1])[::-1], [0.0]])
        k = np.minimum(mx, n - 1).astype(np.int64)
        above = s0[min(c, n - 1)] if c < n else whole
        return above * tri - (s0[k] - d * s1[k])
    if slope is None or not slope > 0:
        raise ValueError(f"slope must be > 0 (or pass decay=), got {slope!r}")
    base = get_scheme(scheme).base
    if base == "discrete":
        om = -math.expm1(-slope)
        return np.exp(-slope * c) * (1 + c * om) * tri - np.exp(-slope * mx) * (1 + (mx - d) * om)
    if base == "gamma":
        sig = 1.0 / slope
        return (1 + c / sig) * math.exp(-c / sig) * tri - (1 + (mx - d) / sig) * np.exp(-mx / sig)
    raise ValueError(f"capped bias is known for the discrete and gamma schemes and decays, got {scheme!r}")


def capped_bias_norms(bias_row: np.ndarray) -> tuple[float, float]:
    """``(max |E[Mbar] - A|, ||E[Mbar] - A||_2)`` of the symmetric Toeplitz bias with first row ``bias_row``.

    All entries are ``<= 0``, so the spectral norm is the Perron root of ``-bias``, computed by Lanczos
    (``scipy.sparse.linalg.eigsh``) on an FFT Toeplitz matvec: ``O(n log n)`` per step, any ``n``.
    """
    from scipy.linalg import matmul_toeplitz
    from scipy.sparse.linalg import LinearOperator, eigsh

    row = -np.asarray(bias_row, dtype=np.float64)
    n = row.size
    if n <= 2 or not np.any(row):
        dense = np.array([[row[abs(i - j)] for j in range(n)] for i in range(n)])
        return float(np.abs(row).max()), float(np.abs(np.linalg.eigvalsh(dense)).max()) if n else 0.0
    op = LinearOperator((n, n), matvec=lambda x: matmul_toeplitz((row, row), x), dtype=np.float64)
    top = eigsh(op, k=1, which="LA", tol=1e-10, return_eigenvectors=False)
    return float(np.abs(row).max()), float(top[0])
