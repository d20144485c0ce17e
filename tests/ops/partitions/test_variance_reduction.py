"""Variance-reduced positional LSH: every mask marginally exact, errors lower at equal T, fast path exact."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from scipy.special import ndtri

from positional_lsh import dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops.partitions import variance_reduced
from positional_lsh.ops.partitions.schemes import get_scheme, register_scheme, scheme_names, unregister_scheme
from positional_lsh.theory import (
    MeanMaskOperator,
    alibi_spectral_norm,
    output_errors,
    spectral_error,
    unbiasedness_test,
)

VR = ("discrete-strat", "gamma-strat", "discrete-antithetic")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_schemes_are_registered():
    for s in VR:
        assert s in scheme_names()
        assert s in scheme_names(unbiased=True)
        assert s in scheme_names(coupled=True)
    assert set(scheme_names(coupled=True)) == set(VR)
    assert "fixed" in scheme_names() and "fixed" not in scheme_names(unbiased=True)
    assert {s: get_scheme(s).base for s in VR} == {
        "discrete-strat": "discrete",
        "gamma-strat": "gamma",
        "discrete-antithetic": "discrete",
    }
    assert [variance_reduced.stratified_group_size(t) for t in (1, 3, 9, 16, 64, 256, 10000)] == [1, 1, 2, 2, 4, 8, 50]


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("scheme", VR)
@pytest.mark.parametrize("slope, num_samples", [(0.5, 16), (0.05, 13)])
def test_every_mask_is_marginally_exact(scheme, slope, num_samples):
    # Per mask index and pair: binomial z-score with the exact Bernoulli(A_ij) variance, Bonferroni at 1e-3.
    r = unbiasedness_test(scheme, slope, num_samples=num_samples, replicates=3000, generator=12345)
    assert r.passed, r
    assert r.max_z < r.threshold and r.mean_max_z < r.threshold


@pytest.mark.parametrize(
    "name, sampler",
    [
        # strata without the random permutation: index t always draws from stratum t // K
        (
            "broken-no-permutation",
            lambda m, t, g: _no_permutation(m, t, g),
        ),
        # shifts not uniform given the pitch (never in the last tenth of the pitch)
        (
            "broken-shift",
            lambda m, t, g: (lambda p, s: (p, torch.floor(0.9 * s)))(*variance_reduced.sample_discrete_strat(m, t, g)),
        ),
    ],
)
def test_unbiasedness_test_detects_broken_couplings(name, sampler):
    register_scheme(name, sampler, unbiased=True, integer=True)
    try:
        r = unbiasedness_test(name, 0.2, num_samples=16, replicates=3000, generator=1)
    finally:
        unregister_scheme(name)
    assert not r.passed, r


def _no_permutation(m, t, g):
    k = variance_reduced.stratified_group_size(t)
    groups = -(-t // k)
    u = (torch.arange(groups, dtype=torch.float64)[:, None] + torch.rand((groups, m.numel()), generator=g)) / groups
    pitch = variance_reduced.discrete_pitch_quantile(1.0 - u, m[None, :]).repeat_interleave(k, 0)[:t]
    shift = torch.floor(torch.rand((t, m.numel()), generator=g, dtype=torch.float64) * pitch)
    return pitch, shift


def test_fixed_scheme_is_rejected():
    assert not unbiasedness_test("fixed", 0.2, replicates=500, generator=0).passed


@pytest.mark.parametrize("scheme", ["discrete-strat", "discrete-antithetic"])
def test_marginal_pitch_law_per_index(scheme):
    # P[pitch = B] = B x^(B-1) (1-x)^2 for every mask index; z-scores per pitch value, Bonferroni.
    m, reps, t = 0.3, 20000, 12
    parts = sample_partitions(4, [m] * reps, t, scheme=scheme, generator=7)
    x = math.exp(-m)
    bmax = 40
    b = np.arange(1, bmax + 1)
    pmf = b * x ** (b - 1) * (1 - x) ** 2
    pmf = np.append(pmf, 1 - pmf.sum())  # tail bin
    usable = reps * pmf * (1 - pmf) >= 5
    thr = ndtri(1 - 1e-3 / (2 * usable.sum() * 3))
    for idx in (0, t // 2, t - 1):
        p = parts.pitch[idx].numpy().astype(np.int64)
        counts = np.bincount(np.minimum(p, bmax + 1) - 1, minlength=bmax + 1)
        z = (counts - reps * pmf) / np.sqrt(reps * pmf * (1 - pmf) + 1e-300)
        assert np.abs(z[usable]).max() < thr
        assert (parts.shift[idx] < parts.pitch[idx]).all() and (parts.shift[idx] >= 0).all()
        # shift uniform on {0..B-1} given B: (shift + 1/2) / B has mean 1/2 and variance <= 1/12
        centred = (parts.shift[idx].numpy() + 0.5) / p
        assert abs(centred.mean() - 0.5) < 5 * math.sqrt(1 / 12 / reps)


def test_stratified_structure():
    # discrete-strat: slots sharing an integer pitch have shifts spread evenly over the residues
    parts = sample_partitions(100, [2.0, 0.5, 0.05, 0.003], 64, scheme="discrete-strat", generator=3)
    assert torch.equal(parts.pitch, parts.pitch.round()) and torch.equal(parts.shift, parts.shift.round())
    for h in range(4):
        by_pitch = collections.defaultdict(list)
        for b, s in zip(parts.pitch[:, h].tolist(), parts.shift[:, h].tolist(), strict=True):
            by_pitch[int(b)].append(int(s))
        for b, shifts in by_pitch.items():
            c = collections.Counter(shifts)
            per_residue = [c.get(r, 0) for r in range(b)]
            assert max(per_residue) - min(per_residue) <= 1, (h, b, per_residue)
        # the pitches are stratified: one per stratum of probability K/T = 1/16
        assert len(set(parts.pitch[:, h].tolist())) <= 16
    # gamma-strat: groups of K = 4 masks share a pitch, shifts a quarter pitch apart
    parts = sample_partitions(100, [0.05], 64, scheme="gamma-strat", generator=3)
    by_pitch = collections.defaultdict(list)
    for b, s in zip(parts.pitch[:, 0].tolist(), parts.shift[:, 0].tolist(), strict=True):
        by_pitch[b].append(s / b)
    assert len(by_pitch) == 16
    for fr in by_pitch.values():
        gaps = np.diff(np.sort(fr))
        assert len(fr) == 4 and np.allclose(gaps, 0.25, atol=1e-12)
    # pitches cover the law's strata: the sorted pitches' CDF values fall one per stratum
    pitches = np.sort(np.array(list(by_pitch)))
    t = pitches * 0.05
    cdf = 1 - np.exp(-t) * (1 + t)
    np.testing.assert_array_equal(np.floor(cdf * 16), np.arange(16))


def test_single_sample_and_slope_zero():
    for scheme in VR:
        p = sample_partitions(20, [0.0, 0.4], 1, scheme=scheme, generator=0)
        assert math.isinf(p.pitch[0, 0]) and p.shift[0, 0] == 0
        assert 0 <= p.shift[0, 1] < p.pitch[0, 1]


# ------------------------------------------------------------------------------------------ fast path


@pytest.mark.parametrize("scheme", VR)
@pytest.mark.parametrize("causal", [True, False])
def test_plsh_attention_matches_dense_oracle(scheme, causal):
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d = 2, 4, 2, 67, 8
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    parts = sample_partitions(n, [1.0, 0.3, 0.05, 0.0], 9, scheme=scheme, generator=4)
    for backend in ("flash", "math"):
        got = plsh_attention(q, k, v, partitions=parts, causal=causal, backend=backend)
        ref = dense_plsh_attention(q, k, v, parts, causal=causal)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    if causal:  # decoding: the last queries against the whole key cache
        got = plsh_attention(q[:, :, -5:], k, v, partitions=parts, causal=True)
        ref = dense_plsh_attention(q[:, :, -5:], k, v, parts, causal=True)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scheme", ["discrete-strat", "gamma-strat"])
def test_plsh_attention_gradients_match_dense_oracle(scheme):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    parts = sample_partitions(40, [0.4, 0.07], 16, scheme=scheme, generator=2)
    w = torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((plsh_attention(q, k, v, partitions=parts) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((dense_plsh_attention(q, k, v, parts) * w).sum(), (q, k, v))
    for a, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------------ the gain


def test_variance_reduction_at_t64():
    # docs/theory.md measures n = 1024 with all eight standard slopes; this is a smaller version.
    n, t, seeds = 512, 64, 6
    slopes = [0.5, 1 / 16, 1 / 128]
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, 32, generator=g, dtype=torch.float64) for _ in range(3))
    err = {}
    for scheme in ("discrete", "discrete-strat"):
        e = np.zeros((seeds, len(slopes), 2))
        for r in range(seeds):
            parts = sample_partitions(n, slopes, t, scheme=scheme, generator=100 + r)
            for h, m in enumerate(slopes):
                op = MeanMaskOperator(parts, h)
                dense = op.dense()
                spec = spectral_error(parts, h, operator=op, dense_mbar=dense, tol=1e-6).value
                e[r, h, 0] = spec / alibi_spectral_norm(n, m)
                e[r, h, 1] = output_errors(q, k, v, parts, h, operator=op, dense_mbar=dense).softmax_rel
        err[scheme] = e.mean(0)
    ratio = err["discrete"] / err["discrete-strat"]
    spectral, softmax = ratio[:, 0], ratio[:, 1]
    assert np.exp(np.log(spectral).mean()) >= 2.0, ratio
    assert spectral.min() >= 1.6, ratio
    assert np.exp(np.log(softmax).mean()) >= 1.6, ratio
    assert softmax.min() >= 1.3, ratio
