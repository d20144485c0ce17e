"""Tests of positional_lsh.theory: bounds, matrix-free operators and error metrics against dense float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from positional_lsh import alibi_matrix, alibi_slopes, dense_plsh_attention, sample_partitions
from positional_lsh.ops.partitions.schemes import scheme_names
from positional_lsh.theory import (
    MeanMaskOperator,
    alibi_matvec,
    alibi_norm_bound,
    alibi_spectral_norm,
    block_starts,
    dense_mask_errors,
    dense_max_error,
    expected_error_bound,
    fit_power_law,
    mask_errors,
    max_error,
    output_errors,
    psi,
    psi_without_one,
    samples_for_error,
    spectral_error,
    suggested_samples,
    tail_bound,
    tail_bound_epsilon,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------ bounds


def test_psi_formulas_and_the_one_difference():
    sigma = np.array([0.5, 1.0, 4.0, 256.0])
    e = np.exp(1 / sigma)
    expected = 1 + sigma + (e + 1) / (e - 1)
    np.testing.assert_allclose(psi(sigma), expected, rtol=1e-12)
    np.testing.assert_allclose(psi(sigma) - psi_without_one(sigma), 1.0, rtol=1e-14)
    assert isinstance(psi(2.0), float)
    # large sigma: Psi ~ 1 + 3 sigma; sigma = inf (slope 0) is infinite
    assert psi(1e6) == pytest.approx(1 + 3e6, rel=1e-6)
    assert math.isinf(psi(math.inf))
    # tiny sigma: coth(1/(2 sigma)) -> 1 without overflow
    assert psi(1e-4) == pytest.approx(2.0001, rel=1e-9)


def test_alibi_norm_bound_is_coth_and_mean_pitch():
    for m in (0.01, 0.5, 3.0):
        x = math.exp(-m)
        assert alibi_norm_bound(1 / m) == pytest.approx((1 + x) / (1 - x), rel=1e-13)
        assert alibi_norm_bound(1 / m) == pytest.approx(1 / math.tanh(m / 2), rel=1e-13)
    assert alibi_norm_bound(1000.0) == pytest.approx(2000.0, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 300])
@pytest.mark.parametrize("slope", [0.0, 1e-3, 0.05, 0.5, 4.0, 50.0])
def test_alibi_spectral_norm_exact(n, slope):
    dense = float(torch.linalg.eigvalsh(alibi_matrix(n, [slope])[0])[-1])
    assert alibi_spectral_norm(n, slope) == pytest.approx(dense, rel=1e-10, abs=1e-12)
    if slope > 0:
        assert alibi_spectral_norm(n, slope) <= alibi_norm_bound(1 / slope) * (1 + 1e-12)


def test_bounds_formulas_and_inverse():
    n, sigma = 4096, 16.0
    s = np.array([1, 10, 100, 1000])
    lg = math.log(n)
    np.testing.assert_allclose(expected_error_bound(n, sigma, s), psi(sigma) * (np.sqrt(lg / s) + lg / s), rtol=1e-14)
    # the bound decreases like s^-1/2 for large s
    ratio = expected_error_bound(n, sigma, 4e10) / expected_error_bound(n, sigma, 1e10)
    assert ratio == pytest.approx(0.5, rel=1e-4)
    eps = 3.0
    p = psi(sigma)
    assert tail_bound(n, sigma, 100, eps) == pytest.approx(n * math.exp(-100 * eps**2 / (4 * p * (4 * p + eps))))
    for delta in (0.05, 0.5):
        e = tail_bound_epsilon(n, sigma, 1000, delta)
        assert tail_bound(n, sigma, 1000, e) == pytest.approx(delta, rel=1e-9)
    assert suggested_samples(n, sigma, 0.5) == math.ceil(sigma**2 * lg / 0.25)
    assert suggested_samples(n, np.array([1.0, 2.0]), 1.0).tolist() == [math.ceil(lg), math.ceil(4 * lg)]


@pytest.mark.parametrize(
    "call, exc, word",
    [
        (lambda: psi(-1.0), ValueError, "sigma"),
        (lambda: psi(True), TypeError, "sigma"),
        (lambda: expected_error_bound(1, 2.0, 10), ValueError, "seq_len"),
        (lambda: expected_error_bound(2.5, 2.0, 10), TypeError, "seq_len"),
        (lambda: expected_error_bound(100, 2.0, 0), ValueError, "num_samples"),
        (lambda: tail_bound(100, 2.0, 10, 0.0), ValueError, "eps"),
        (lambda: tail_bound_epsilon(100, 2.0, 10, 1.5), ValueError, "delta"),
        (lambda: suggested_samples(100, 2.0, -1.0), ValueError, "eps"),
        (lambda: alibi_spectral_norm(10, -1.0), ValueError, "slope"),
        (lambda: MeanMaskOperator("x"), TypeError, "partitions"),
        (lambda: MeanMaskOperator(sample_partitions(8, [0.1], 2, generator=0), 3), ValueError, "head"),
        (lambda: spectral_error(sample_partitions(8, [0.1], 2, generator=0), tol=2.0), ValueError, "tol"),
        (lambda: fit_power_law([1, 1], [1, 2]), ValueError, "x"),
    ],
)
def test_bad_input_names_the_argument(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


# ------------------------------------------------------------------------------------------ operators


@pytest.mark.parametrize("slope", [0.0, 1e-4, 0.01, 0.7, 30.0])
def test_alibi_matvec_matches_dense(slope):
    n = 257
    rng = np.random.default_rng(0)
    a = alibi_matrix(n, [slope])[0].numpy()
    x = rng.standard_normal(n)
    np.testing.assert_allclose(alibi_matvec(x, slope), a @ x, rtol=1e-12, atol=1e-12)
    xx = rng.standard_normal((n, 3))
    np.testing.assert_allclose(alibi_matvec(xx, slope), a @ xx, rtol=1e-12, atol=1e-12)


def test_block_starts_match_label_runs():
    rng = np.random.default_rng(1)
    n = 97
    pos = np.arange(n, dtype=np.float64)
    cases = [(math.inf, 0.0), (1.0, 0.0), (0.3, 0.1), (5.0, 0.0), (5.0, 4.0), (1000.0, 3.0)]
    cases += [(float(b), float(rng.uniform(0, b))) for b in rng.uniform(1.0, 40.0, 200)]
    cases += [(b, s) for b in (1.5, 2.5, 3.0 + 1e-12) for s in (0.0, 0.5 * b, b - 1e-12)]
    for pitch, shift in cases:
        if math.isinf(pitch):
            labels = np.zeros(n)
        else:
            labels = np.floor((pos - shift) / pitch)
        runs = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
        np.testing.assert_array_equal(block_starts(pitch, shift, n), runs, err_msg=f"{pitch}, {shift}")


@pytest.mark.parametrize("scheme", scheme_names())
@pytest.mark.parametrize("n", [1, 40, 300])
def test_mean_mask_operator_matches_dense(scheme, n):
    slopes = [0.0, 3.0, 0.5, 0.05, 1 / 256]
    parts = sample_partitions(n, slopes, 23, scheme=scheme, generator=n)
    dense = parts.mean_mask().numpy()
    rng = np.random.default_rng(2)
    for h in range(len(slopes)):
        op = MeanMaskOperator(parts, h)
        x = rng.standard_normal(n)
        np.testing.assert_allclose(op.matvec(x), dense[h] @ x, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(op.dense(), dense[h])
        if n > 3:
            np.testing.assert_array_equal(op.rows(1, 3), dense[h][1:3])


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "discrete-strat", "gamma-strat"])
def test_spectral_and_max_error_match_dense(scheme):
    n = 600
    slopes = [2.0, 0.5, 0.05, 1 / 256, 0.0]
    parts = sample_partitions(n, slopes, 30, scheme=scheme, generator=7)
    for h in range(len(slopes)):
        ds, dm = dense_mask_errors(parts, h)
        est = spectral_error(parts, h)
        assert est.value == pytest.approx(ds, rel=1e-6, abs=1e-12)
        assert est.value <= ds * (1 + 1e-9)  # a Rayleigh quotient never exceeds the norm
        assert est.residual <= 1e-6 * max(ds, 1e-300) or ds == 0
        assert max_error(parts, h) == pytest.approx(dm, rel=1e-12, abs=1e-15)
        dense_mx = dense_max_error(parts.mean_mask()[h].numpy(), float(slopes[h]))
        assert dense_mx == pytest.approx(dm, rel=1e-12, abs=1e-15)


def test_distinct_samples_merge_repeats_and_count_every_sample():
    fixed = sample_partitions(64, [0.1], 40, scheme="fixed", generator=2)  # every sample: pitch 2/m, shift 0
    uniq, counts = MeanMaskOperator(fixed, 0).distinct_samples
    np.testing.assert_allclose(uniq, [[20.0, 0.0]])
    assert counts.tolist() == [40]
    parts = sample_partitions(64, [0.1], 40, generator=2)
    uniq, counts = MeanMaskOperator(parts, 0).distinct_samples
    assert uniq.shape == (len(counts), 2) and int(counts.sum()) == 40
    assert len(np.unique(uniq, axis=0)) == len(counts)


def test_spectral_error_cross_check_n1024():
    # The cross-check (1e-6 relative; docs/theory.md has it at n = 4096), at a quick length.
    n = 1024
    parts = sample_partitions(n, [0.25, 1 / 128], 100, generator=3)
    for h in range(2):
        ds, dm = dense_mask_errors(parts, h)
        errs = mask_errors(parts, [h])[0]
        assert errs.spectral == pytest.approx(ds, rel=1e-6)
        assert errs.max_abs == pytest.approx(dm, rel=1e-12)
        assert errs.relative_spectral == pytest.approx(ds / alibi_spectral_norm(n, parts.slopes[h].item()), rel=1e-6)


def test_max_error_edge_cases():
    # one sample whose blocks are all single positions: Mbar = I, error = A at distance 1
    parts = sample_partitions(50, [40.0], 3, generator=0)
    assert max_error(parts) == pytest.approx(math.exp(-40.0), rel=1e-12)
    # slope 0: one block, exact
    assert max_error(sample_partitions(50, [0.0], 3, generator=0)) == 0.0
    # a single block covering everything (huge pitch, shift 0): error = 1 - A at the farthest pair
    from positional_lsh.ops.partitions.partition import Partitions

    big = Partitions(
        30, torch.tensor([0.1], dtype=torch.float64), torch.tensor([[1e9]]), torch.tensor([[0.0]]), "gamma"
    )
    assert max_error(big) == pytest.approx(1 - math.exp(-0.1 * 29), rel=1e-12)
    assert dense_mask_errors(big)[1] == pytest.approx(max_error(big), rel=1e-12)


def test_matrix_free_scales_to_long_sequences():
    # Never builds n x n: n = 60k would need 29 GB dense.
    n = 60_000
    parts = sample_partitions(n, [0.5, 1 / 256], 16, generator=11)
    errs = mask_errors(parts, tol=1e-6)
    for e in errs:
        assert 0.05 < e.relative_spectral < 1.0
        assert 0.1 < e.max_abs <= 1.0
        assert e.spectral_residual <= 1e-6 * e.spectral
        assert e.alibi_norm == pytest.approx(alibi_norm_bound(1 / e.slope), rel=1e-3)
        assert e.alibi_norm <= alibi_norm_bound(1 / e.slope)


def _reference_output_metrics(q, k, v, mbar, a, causal, scale):
    s = (q @ k.T) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s - s.max())  # one global factor: relative errors are unchanged
    na, nm = (e * a) @ v, (e * mbar) @ v
    oa = torch.softmax(s + torch.log(a), -1) @ v
    om = torch.softmax(s + torch.log(mbar), -1) @ v
    rows = (om - oa).norm(dim=1) / oa.norm(dim=1)
    cos = torch.nn.functional.cosine_similarity(om, oa, dim=1)
    return {
        "exp_rel": float((nm - na).norm() / na.norm()),
        "softmax_rel": float((om - oa).norm() / oa.norm()),
        "row_median": float(np.median(rows.numpy())),
        "row_p90": float(np.quantile(rows.numpy(), 0.9)),
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "exp_row_p99": float(np.quantile(((nm - na).norm(dim=1) / na.norm(dim=1)).numpy(), 0.99)),
    }, om


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scheme", ["discrete", "gamma-strat"])
def test_output_errors_match_dense_reference(causal, scheme):
    n, d = 160, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    q = q * 2.0  # sharper attention
    parts = sample_partitions(n, [0.3, 0.02], 12, scheme=scheme, generator=5)
    mbar = parts.mean_mask()
    a = alibi_matrix(n, parts.slopes)
    for h in range(2):
        ref, om = _reference_output_metrics(q, k, v, mbar[h], a[h], causal, 0.25)
        got = output_errors(q, k, v, parts, h, causal=causal, scale=0.25, chunk_rows=37)
        for key, val in ref.items():
            assert getattr(got, key) == pytest.approx(val, rel=1e-9, abs=1e-12), key
    # the estimate above is the library's oracle softmax(s + log Mbar) v (one head, float64)
    one = sample_partitions(n, [0.3], 12, scheme=scheme, generator=5)
    out = dense_plsh_attention(q[None, None], k[None, None], v[None, None], one, causal=causal, scale=0.25)[0, 0]
    _, om = _reference_output_metrics(q, k, v, one.mean_mask()[0], alibi_matrix(n, [0.3])[0], causal, 0.25)
    torch.testing.assert_close(out, om, rtol=1e-10, atol=1e-12)


def test_output_errors_checks_shapes():
    parts = sample_partitions(10, [0.3], 2, generator=0)
    x = torch.randn(10, 4)
    with pytest.raises(ValueError, match="q"):
        output_errors(torch.randn(9, 4), x, x, parts)
    with pytest.raises(TypeError, match="k"):
        output_errors(x, "k", x, parts)
    with pytest.raises(TypeError, match="causal"):
        output_errors(x, x, x, parts, causal=1)


# ------------------------------------------------------------------------------------------ theory in action


def test_error_is_under_the_expectation_bound_and_decays_like_mc():
    n = 512
    slopes = alibi_slopes(4).double()
    ss = [4, 16, 64, 256]
    rel = np.zeros((len(ss), 4))
    for i, s in enumerate(ss):
        parts = sample_partitions(n, slopes, s, generator=100 + i)
        for e in mask_errors(parts, tol=1e-6):
            rel[i, e.head] = e.relative_spectral
            assert e.spectral <= expected_error_bound(n, 1 / e.slope, s)
    slope, _ = fit_power_law(ss, np.exp(np.log(rel).mean(1)))
    assert -0.6 <= slope <= -0.4
    needed = samples_for_error(ss, np.exp(np.log(rel).mean(1)), 0.05)
    assert 64 < needed < 4096


def test_samples_for_error_power_law():
    x = [1, 10, 100]
    y = [1.0, 10**-0.5, 0.1]
    assert fit_power_law(x, y)[0] == pytest.approx(-0.5)
    assert samples_for_error(x, y, 0.01) == pytest.approx(1e4, rel=1e-9)
    assert samples_for_error(x, [1, 1, 1], 0.5) == math.inf
