"""General positional decays (positional_lsh.ops.partitions.decays): exact pitch laws, sampling, the dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from positional_lsh import dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops.partitions.decays import (
    Decay,
    decay_attention_reference,
    decay_bias,
    decay_matrix,
    exponential_decay,
    mean_pitch,
    pitch_law,
    power_decay,
    tabulated_decay,
    truncated_linear_decay,
)

from conftest import naive_mean_mask

FAMILIES = [power_decay(0.5, 1.0), power_decay(2.0, 0.3), truncated_linear_decay(7), truncated_linear_decay(4.5),
            exponential_decay(0.2)]


def _triangle_mixture(probs: torch.Tensor, whole: float, n: int) -> torch.Tensor:
    """P[same block] at d = 0..n-1 from the definition: sum_b P(B=b) (1 - d/b)_+ + P(whole)."""
    d = torch.arange(n, dtype=torch.float64)
    out = torch.full((n,), whole, dtype=torch.float64)
    for b in range(1, n):
        out += probs[b - 1] * (1 - d / b).clamp_min(0)
    return out


@pytest.mark.parametrize("decay", FAMILIES, ids=repr)
@pytest.mark.parametrize("n", [1, 2, 3, 17, 200])
def test_pitch_law_reproduces_decay_exactly(decay, n):
    probs, whole = pitch_law(decay, n)
    assert probs.shape == (n - 1,) and bool((probs >= 0).all()) and whole >= 0
    assert math.isclose(float(probs.sum()) + whole, 1.0, abs_tol=1e-12)
    torch.testing.assert_close(_triangle_mixture(probs, whole, n), decay.values(n), rtol=0, atol=1e-12)


def test_exponential_decay_is_the_discrete_scheme():
    for m in (2.0, 0.5, 1 / 16, 1 / 256):
        n = 300
        probs, _ = pitch_law(exponential_decay(m), n)
        x = math.exp(-m)
        b = torch.arange(1, n - 1, dtype=torch.float64)
        torch.testing.assert_close(probs[:-1], b * x ** (b - 1) * (1 - x) ** 2, rtol=1e-9, atol=1e-15)
        if m >= 1 / 16:  # the discrete scheme's mean pitch coth(m/2) (truncation negligible: P[B > 300] < 1e-6)
            assert math.isclose(mean_pitch(exponential_decay(m), n), (1 + x) / (1 - x), rel_tol=1e-5)


def test_truncated_linear_integer_width_is_one_pitch():
    parts = sample_partitions(40, None, 50, decay=truncated_linear_decay(6), generator=0)
    assert bool((parts.pitch == 6).all()) and set(parts.shift.flatten().tolist()) <= set(range(6))


@pytest.mark.parametrize("decay", [power_decay(0.5, 1.0), power_decay(1.5, 0.2), truncated_linear_decay(9.5)],
                         ids=repr)
def test_mean_of_4000_masks_matches_decay(decay):
    n, t = 64, 4000
    parts = sample_partitions(n, None, t, decay=decay, generator=1)
    assert parts.decays == (decay,) and parts.unbiased and torch.isnan(parts.slopes).all()
    mbar = parts.mean_mask()[0]
    kmat = decay_matrix(decay, n)[0]
    sd = (kmat * (1 - kmat) / t).sqrt()
    # Bonferroni over the n(n-1)/2 pairs at family-wise level 1e-3: |z| <= 5.1
    z = ((mbar - kmat).abs() / sd.clamp_min(1e-300))[sd > 0]
    assert float(z.max()) < 5.1, float(z.max())
    assert bool((mbar[sd == 0] == kmat[sd == 0]).all())


def test_plsh_attention_with_decay_partitions_equals_dense_oracle():
    torch.manual_seed(0)
    n = 96
    decays = [power_decay(0.7, 0.5), truncated_linear_decay(13), exponential_decay(0.1)]
    parts = sample_partitions(n, None, 6, decay=decays, generator=3)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for _ in range(3))
    for causal in (True, False):
        out = plsh_attention(q, k, v, partitions=parts, causal=causal)
        ref = dense_plsh_attention(q, k, v, parts, causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(parts.mean_mask(), naive_mean_mask(parts.pitch, parts.shift, n), rtol=0, atol=0)


def test_decay_reference_is_softmax_with_log_decay_and_the_limit():
    torch.manual_seed(1)
    n, d = 48, 4
    dec = power_decay(0.5, 2.0)
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64) for _ in range(3))
    ref = decay_attention_reference(q, k, v, dec)
    kmat = decay_matrix(dec, n)[0]
    w = torch.exp(q[0, 0] @ k[0, 0].T / 2) * kmat * torch.tril(torch.ones(n, n, dtype=torch.float64))
    torch.testing.assert_close(ref[0, 0], (w / w.sum(-1, keepdim=True)) @ v[0, 0], rtol=1e-12, atol=1e-12)
    # decoding-shaped bias: the last q_len rows
    torch.testing.assert_close(decay_bias(dec, 5, n, causal=True)[0], decay_bias(dec, n, n, causal=True)[0, -5:])
    # many masks: the estimator approaches the reference
    parts = sample_partitions(n, None, 3000, decay=dec, generator=2)
    err = (dense_plsh_attention(q, k, v, parts) - ref).abs().max()
    assert float(err) < 0.05


@pytest.mark.parametrize(
    "values, match",
    [
        ([1.0, 0.5, 0.6, 0.2], "not decreasing at distance 2"),
        ([1.0, 0.9, 0.5, 0.45, 0.1], "not convex at distance 1"),
        ([1.0, 0.5, 0.3, 0.2, 0.15, 0.2], "not decreasing at distance 5"),
        ([0.9, 0.5, 0.2], r"k\(0\) = 1"),
        ([1.0, 0.5, -0.1], "not convex at distance 1"),
        ([1.0, float("nan")], "not finite at distance 1"),
    ],
)
def test_refuses_non_convex_or_increasing_decay(values, match):
    with pytest.raises(ValueError, match=match):
        sample_partitions(len(values), None, 2, decay=tabulated_decay(values), generator=0)


def test_gaussian_decay_is_refused_at_first_concave_distance():
    gauss = Decay("gaussian", fn=lambda d: torch.exp(-(d.double() / 4) ** 2))
    with pytest.raises(ValueError, match="not convex at distance 1"):
        pitch_law(gauss, 20)


def test_callable_per_head_and_arguments():
    parts = sample_partitions(30, None, 3, decay=lambda d: 0.9 ** d.double(), num_heads=2, generator=0)
    assert parts.num_heads == 2 and parts.decays[0] is parts.decays[1]
    assert parts.with_seq_len(10).seq_len == 10 and parts.select(slice(0, 1)).decays == parts.decays
    with pytest.raises(ValueError, match="exact only up to"):
        parts.with_seq_len(31)
    with pytest.raises(ValueError, match="slopes or decay"):
        sample_partitions(30, [0.1], 3, decay=power_decay(1, 1))
    with pytest.raises(ValueError, match="discrete"):
        sample_partitions(30, None, 3, decay=power_decay(1, 1), scheme="gamma")
    with pytest.raises(ValueError, match="num_heads=3"):
        sample_partitions(30, None, 3, decay=[power_decay(1, 1)] * 2, num_heads=3)
    with pytest.raises(ValueError, match="r1"):
        power_decay(0, 1)


def test_prefix_consistency_and_heavy_tail_cost():
    a = sample_partitions(100, None, 5, decay=power_decay(0.5, 1.0), generator=4)
    b = sample_partitions(100, None, 9, decay=power_decay(0.5, 1.0), generator=4)
    assert torch.equal(a.pitch, b.pitch[:5]) and torch.equal(a.shift, b.shift[:5])
    # r1 = 0.5: the mean pitch grows like n^{1/2}; r1 = 2: it converges
    heavy = [mean_pitch(power_decay(0.5, 1.0), n) for n in (1000, 4000)]
    light = [mean_pitch(power_decay(2.0, 1.0), n) for n in (1000, 4000)]
    assert 1.7 < heavy[1] / heavy[0] < 2.1 and light[1] / light[0] < 1.01
