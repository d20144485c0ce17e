"""Block sizes (positional_lsh.theory.blocks): largest blocks, work, the high-probability bound, pitch caps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import gamma as gamma_dist

from positional_lsh import alibi_matrix, dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops.partitions.decays import decay_matrix, power_decay
from positional_lsh.theory.blocks import (
    block_size_bound,
    block_size_tail,
    block_stats,
    capped_bias,
    capped_bias_norms,
    largest_blocks,
    pitch_tail,
)


def test_pitch_tails_closed_form():
    for sigma in (2.0, 16.0, 256.0):
        x = math.exp(-1 / sigma)
        b = np.arange(1, 40 * int(sigma))
        pmf = b * x ** (b - 1) * (1 - x) ** 2
        for size in (0, 1, 5, int(sigma), 3 * int(sigma)):
            assert math.isclose(float(pitch_tail(size, sigma)), pmf[b > size].sum(), rel_tol=1e-9, abs_tol=1e-15)
            assert math.isclose(float(pitch_tail(size, sigma, "gamma")), gamma_dist.sf(size, 2, scale=sigma),
                                rel_tol=1e-12)
    assert float(pitch_tail(3, 4.0, "discrete-strat")) == float(pitch_tail(3, 4.0))


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "discrete-strat", "gamma-strat"])
def test_block_stats_match_blocks(scheme):
    n = 97
    slopes = [2.0, 0.3, 0.05, 1 / 256, 0.0]
    parts = sample_partitions(n, slopes, 7, scheme=scheme, generator=3)
    st = block_stats(parts)
    for h in range(len(slopes)):
        work = causal = 0.0
        big = 0
        for t in range(7):
            sizes = parts.blocks(t, h)[1].double()
            assert int(sizes.sum()) == n
            assert int(st.largest[t, h]) == int(sizes.max())
            big = max(big, int(sizes.max()))
            work += float((sizes**2).sum())
            causal += float((sizes * (sizes + 1) / 2).sum())
        assert int(st.largest_per_head[h]) == big
        assert math.isclose(float(st.work[h]), work) and math.isclose(float(st.causal_work[h]), causal)
    assert st.largest_overall == n  # slope 0: one block
    assert torch.equal(largest_blocks(parts), st.largest)


def test_bound_is_monotone_and_logarithmic():
    b = [block_size_bound(10**6, 16.0, t, 0.01) for t in (1, 4, 16, 64)]
    assert b == sorted(b) and b[0] > 16 * math.log(100)
    assert block_size_tail(b[2], 10**6, 16.0, 16) <= 0.01 < block_size_tail(b[2] - 1, 10**6, 16.0, 16)
    assert block_size_bound(50, 256.0, 16, 0.01) == 50  # capped at n
    assert block_size_bound(10**6, 16.0, 16, 0.01, heads=8) > b[2]


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("sigma, n", [(2.0, 1000), (16.0, 4096), (256.0, 4096), (256.0, 300)])
def test_bound_holds_empirically(scheme, sigma, n):
    """10^4 independent draws of T = 16 samples: the share above the delta-bound is <= delta (+ 3 sd)."""
    r, t = 10_000, 16
    parts = sample_partitions(n, [1 / sigma] * r, t, scheme=scheme, generator=int(sigma) + n)
    if scheme == "discrete":
        largest = largest_blocks(parts).amax(0).numpy()
    else:  # every block holds <= ceil(pitch) positions: a conservative stand-in for the largest block
        largest = torch.ceil(parts.pitch).clamp_max(n).amax(0).numpy()
    for delta in (0.01, 0.1):
        bound = block_size_bound(n, sigma, t, delta, scheme)
        share = float((largest > bound).mean())
        assert share <= delta + 3 * math.sqrt(delta * (1 - delta) / r), (delta, bound, share)


def test_capped_bias_closed_forms_and_norms():
    n, cap = 60, 12
    for slope, scheme in ((1 / 8, "discrete"), (1 / 8, "gamma"), (0.5, "discrete")):
        bias = capped_bias(n, cap, slope=slope, scheme=scheme)
        d = np.arange(n)
        a = np.exp(-slope * d)
        np.testing.assert_allclose(bias, np.where(d < cap, -d / cap * np.exp(-slope * cap), -a), atol=1e-15)
        dense = np.array([[bias[abs(i - j)] for j in range(n)] for i in range(n)])
        mx, spec = capped_bias_norms(bias)
        assert mx == pytest.approx(np.exp(-slope * cap))
        assert spec == pytest.approx(np.abs(np.linalg.eigvalsh(dense)).max())
    # a decay: the sum over the pitch law
    bias = capped_bias(n, cap, decay=power_decay(0.5, 1.0))
    k = decay_matrix(power_decay(0.5, 1.0), n)[0, 0].numpy()
    assert bias[0] == 0 and (bias <= 1e-15).all() and np.allclose(bias[cap:], -k[cap:])


@pytest.mark.parametrize("case", ["discrete", "gamma", "decay"])
def test_capped_partitions_match_the_bias(case):
    n, cap, t = 40, 9, 20_000
    if case == "decay":
        dec = power_decay(0.8, 0.5)
        parts = sample_partitions(n, None, t, decay=dec, max_block=cap, generator=5)
        target = decay_matrix(dec, n)[0].numpy()
        bias = capped_bias(n, cap, decay=dec)
    else:
        parts = sample_partitions(n, [1 / 6], t, scheme=case, max_block=cap, generator=5)
        target = alibi_matrix(n, [1 / 6])[0].numpy()
        bias = capped_bias(n, cap, slope=1 / 6, scheme=case)
    assert not parts.unbiased and parts.max_block == cap and int(largest_blocks(parts).max()) <= cap
    expect = target + np.array([[bias[abs(i - j)] for j in range(n)] for i in range(n)])
    mbar = parts.mean_mask()[0].numpy()
    sd = np.sqrt(np.clip(expect * (1 - expect), 0, None) / t)
    ok = sd > 1e-6
    # Bonferroni over the n^2 cells at family-wise level 1e-3: |z| < 5.5
    assert np.abs((mbar - expect)[ok] / sd[ok]).max() < 5.5
    np.testing.assert_allclose(mbar[~ok], expect[~ok], atol=1e-12)


def test_capped_attention_and_work_saved():
    n = 256
    q = torch.randn(1, 2, n, 8, dtype=torch.float64)
    parts = sample_partitions(n, [1 / 64, 0.0], 8, max_block=32, generator=0)
    torch.testing.assert_close(plsh_attention(q, q, q, partitions=parts), dense_plsh_attention(q, q, q, parts))
    full = block_stats(sample_partitions(n, [1 / 64, 0.0], 8, generator=0))
    capped = block_stats(parts)
    assert capped.largest_overall <= 32 and bool((capped.work < full.work).all())


def block_bound_grid(draws: int = 10_000, seed: int = 0) -> list[dict]:
    """The docs' table (docs/theory.md §9): share of draws whose largest block exceeds the delta-bound."""
    rows = []
    for scheme in ("discrete", "gamma"):
        for sigma in (2.0, 16.0, 256.0):
            for n in (4096, 65536, 1_000_000):
                for t in (1, 4, 16, 64):
                    parts = sample_partitions(n, [1 / sigma] * draws, t, scheme=scheme, generator=seed)
                    if scheme == "discrete":
                        largest = largest_blocks(parts).amax(0).numpy()
                    else:
                        largest = torch.ceil(parts.pitch).clamp_max(n).amax(0).numpy()
                    for delta in (0.01, 0.1):
                        bound = block_size_bound(n, sigma, t, delta, scheme)
                        rows.append(dict(scheme=scheme, sigma=sigma, n=n, T=t, delta=delta, bound=bound,
                                         share=float((largest > bound).mean()), p99=float(np.quantile(largest, 0.99))))
    return rows


@pytest.mark.slow
def test_bound_grid_large():
    r = 10_000
    for row in block_bound_grid(r):
        d = row["delta"]
        assert row["share"] <= d + 3 * math.sqrt(d * (1 - d) / r), row
