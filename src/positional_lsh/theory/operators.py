"""Matrix-free operators: ``A x`` for the ALiBi matrix and ``Mbar x`` for the mean of sampled block masks.

* ``Mbar x`` costs ``O(n + #blocks)`` per matvec (:class:`MeanMaskOperator`): each mask is block-constant,
  so its matvec is a block sum broadcast back over the block (a reshape for integer pitches, a
  difference array of block sums for samples with few blocks).
* ``A x`` costs ``O(n)`` by the two-sided first-order recurrence ``y_i = x_i + e^{-m} y_{i-1}``
  (:func:`alibi_matvec`).
* The block starts of one sample (pitch, shift) in ``O(#blocks)`` (:func:`block_starts`), which the
  operator and :func:`~positional_lsh.theory.metrics.max_error` build on.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.signal import lfilter

from positional_lsh.ops.checks import check_int
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.schemes import scheme_names


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


def block_starts(pitch: float, shift: float, n: int) -> np.ndarray:
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
        head = check_int("head", head)
        if not 0 <= head < partitions.num_heads:
            raise ValueError(f"head must be in [0, {partitions.num_heads}), got {head}")
        self.partitions = partitions
        self.head = head
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
        integer = partitions.scheme in scheme_names(integer=True)
        for (p, s), c in zip(uniq.tolist(), counts.tolist(), strict=True):
            if p <= 1.0:
                self.identity_weight += c
                self.num_blocks += n
                continue
            starts = block_starts(p, s, n)
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

    @property
    def distinct_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct samples of this head and their multiplicities: ``((S, 2) float64, (S,) int64)``.

        Row ``u`` of the first array is ``(pitch, shift)``; pitches ``<= 1`` (every position its own block) are
        all stored as ``(1, 0)``. The counts sum to ``num_samples``.
        """
        return self._unique

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
            starts = block_starts(p, s, n)
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
