"""A statistical test that every sampled mask of a scheme is marginally an exact positional-LSH sample."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import ndtri

from positional_lsh.ops.partitions.partition import sample_partitions


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
