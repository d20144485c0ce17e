"""The slope-gradient study (positional_lsh.theory.slope_grad) against dense float64 references.

References, all dense autograd through an explicit ``n x n`` bias:

* exact: ``softmax(scale q k^T - m |i - j| + causal mask) v``;
* surrogate: ``softmax(scale q k^T + log Mbar - (m - m.detach()) |i - j| + causal mask) v`` (value: the estimator,
  ``m``-gradient: the surrogate);
* ``E[L_plsh]`` at ``T = 1`` by enumerating every partition of the ``"discrete"`` law with its probability, a
  function of ``m`` (so ``d E[L] / dm`` is exact, by autograd): the score function's target.
"""

from __future__ import annotations

import math

import pytest
import torch

from positional_lsh import alibi_slopes, sample_partitions
from positional_lsh.theory import slope_grad as sg
from positional_lsh.theory.slope_grad import (
    exact_slope_gradient,
    log_prob,
    loss_weight,
    plsh_slope_gradients,
    score,
    slope_gradient_study,
    subseed,
)

D = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(b=1, hq=2, hkv=None, lq=16, lk=None, d=8, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    hkv = hq if hkv is None else hkv
    lk = lq if lk is None else lk
    q = torch.randn(b, hq, lq, d, generator=g, dtype=D) * spread
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=D) * spread
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=D)
    return q, k, v


def _dist(lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``|i - j|`` (query row r at position lk - lq + r) and the causal mask (-inf where j > i)."""
    i = torch.arange(lk - lq, lk, dtype=D)[:, None]
    j = torch.arange(lk, dtype=D)[None, :]
    return (i - j).abs(), torch.where(j > i, -math.inf, 0.0).to(D)


def _dense(q, k, v, bias, scale=None):
    """``softmax(scale q k^T + bias) v``, GQA by repeating k, v; bias (H, lq, lk)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ kk.transpose(-1, -2) * sc + bias, -1) @ vv


def dense_exact_grad(q, k, v, slopes, weight, causal=True, scale=None):
    m = torch.as_tensor(slopes, dtype=D).clone().requires_grad_(True)
    dist, mask = _dist(q.shape[2], k.shape[2])
    bias = -m[:, None, None] * dist + (mask if causal else 0.0)
    (g,) = torch.autograd.grad((_dense(q, k, v, bias, scale) * weight).sum(), m)
    return g


def dense_surrogate(q, k, v, parts, weight, causal=True, scale=None):
    """(per-head loss, surrogate gradient) of the dense surrogate reference."""
    m = parts.slopes.clone().requires_grad_(True)
    lq, lk = q.shape[2], k.shape[2]
    dist, mask = _dist(lq, lk)
    log_mbar = torch.log(parts.mean_mask()[:, lk - lq :, :])
    bias = log_mbar - (m - m.detach())[:, None, None] * dist + (mask if causal else 0.0)
    per_head = (_dense(q, k, v, bias, scale) * weight).sum((0, 2, 3))
    (g,) = torch.autograd.grad(per_head.sum(), m)
    return per_head.detach(), g


def _partition_law(n: int, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every partition of 0..n-1 the "discrete" scheme draws, as block labels ``(P, n)``, and its probability
    ``(P,)`` as a function of ``m`` (differentiable): pitch b < n with shift xi, ``(1-x)^2 x^{b-1}`` each; pitches
    b >= n cut at most once: a cut at c (1 <= c < n) with total probability ``(1-x) x^{n-1}``, one block with
    ``x^{n-1}``."""
    x = torch.exp(-m)
    pos = torch.arange(n, dtype=D)
    labels, probs = [], []
    for b in range(1, n):
        for xi in range(b):
            labels.append(torch.floor((pos - xi) / b))
            probs.append((1 - x) ** 2 * x ** (b - 1))
    for c in range(1, n):
        labels.append((pos >= c).to(D))
        probs.append((1 - x) * x ** (n - 1))
    labels.append(torch.zeros(n, dtype=D))
    probs.append(x ** (n - 1))
    return torch.stack(labels), torch.stack(probs)


def expected_loss_t1(q, k, v, slopes, weight, causal=True):
    """``E[L_h]`` of positional LSH with ``T = 1`` ("discrete"), per head, differentiable in ``slopes``."""
    n = k.shape[2]
    _, mask = _dist(n, n)
    out = []
    for h in range(q.shape[1]):
        labels, probs = _partition_law(n, slopes[h])
        same = labels[:, :, None] == labels[:, None, :]  # (P, n, n)
        bias = torch.where(same, 0.0, -math.inf).to(D) + (mask if causal else 0.0)
        qh, kh, vh = q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1]
        losses = torch.stack([(_dense(qh, kh, vh, bias[p][None]) * weight[:, h : h + 1]).sum()
                              for p in range(len(probs))])  # fmt: skip
        out.append((probs * losses).sum())
    return torch.stack(out)


# ------------------------------------------------------------------------------------------ the scores


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_score_is_the_derivative_of_log_prob(scheme):
    m = torch.tensor([0.5, 1 / 16, 2.0], dtype=D)
    pitch = torch.tensor([[1.0, 7.0, 2.0], [3.0, 30.0, 1.0], [12.0, 1.0, 5.0]], dtype=D)
    if scheme == "gamma":
        pitch = pitch * 0.731
    shift = pitch * 0.5 if scheme == "gamma" else torch.floor(pitch * 0.5)
    h = 1e-6
    fd = (log_prob(scheme, pitch, shift, m * (1 + h)) - log_prob(scheme, pitch, shift, m * (1 - h))) / (2 * h * m)
    torch.testing.assert_close(score(scheme, pitch, m), fd, rtol=1e-7, atol=1e-7)
    mm = m.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(log_prob(scheme, pitch, shift, mm).sum(), mm)
    torch.testing.assert_close(score(scheme, pitch, m).sum(0), auto, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [0.5, 1 / 16, 2.0])
def test_discrete_law_is_normalized_and_its_score_has_mean_zero(m):
    b = torch.arange(1, 40000, dtype=D)[:, None]
    mt = torch.tensor([m], dtype=D)
    p_b = b * torch.exp(log_prob("discrete", b, torch.zeros_like(b), mt))  # P(B = b): b shifts, each p(b, xi)
    assert float(p_b.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float((p_b * score("discrete", b, mt)).sum()) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("m", [0.5, 1 / 16])
def test_gamma_law_is_normalized_and_its_score_has_mean_zero(m):
    b = torch.linspace(1e-9, 60 / m, 400001, dtype=D)[:, None]
    mt = torch.tensor([m], dtype=D)
    dens = b * torch.exp(log_prob("gamma", b, torch.zeros_like(b), mt))  # density of b: integral over the shift
    assert float(torch.trapezoid(dens[:, 0], b[:, 0])) == pytest.approx(1.0, abs=1e-7)
    assert float(torch.trapezoid((dens * score("gamma", b, mt))[:, 0], b[:, 0])) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_the_samplers_draw_the_law_whose_score_is_used(scheme):
    """The score is of the law the library samples: its mean over sampled pitches is 0 within 4 standard errors,
    and (discrete) the frequencies of the smallest pitches are those of b x^{b-1} (1-x)^2."""
    m = torch.tensor([0.5, 1 / 16], dtype=D)
    parts = sample_partitions(64, m, 20000, scheme=scheme, generator=3)
    s = score(scheme, parts.pitch, m)
    z = s.mean(0) / (s.std(0) / math.sqrt(s.shape[0]))
    assert bool((z.abs() < 4).all()), z
    if scheme == "discrete":
        for b in (1, 2, 3, 4):
            x = math.exp(-0.5)
            p = b * x ** (b - 1) * (1 - x) ** 2
            freq = float((parts.pitch[:, 0] == b).double().mean())
            assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / 20000), (b, freq, p)


def test_score_refuses_schemes_without_a_law():
    b = torch.ones(1, 1, dtype=D)
    with pytest.raises(ValueError, match="scheme must be one of"):
        score("discrete-strat", b, torch.ones(1, dtype=D))
    with pytest.raises(ValueError, match="unknown scheme"):
        log_prob("nope", b, b * 0, torch.ones(1, dtype=D))
    with pytest.raises(ValueError, match="shift"):
        log_prob("discrete", b, b, torch.ones(1, dtype=D))


# ------------------------------------------------------------------------------------------ the library's ops


@pytest.mark.parametrize(
    "shape, causal",
    [(dict(b=2, hq=3, lq=20), True), (dict(b=1, hq=4, hkv=2, lq=12, lk=20), True), (dict(hq=2, lq=18), False)],
)
def test_exact_gradient_equals_dense_autograd(shape, causal):
    q, k, v = _qkv(**shape)
    m = alibi_slopes(q.shape[1]).double() * 3
    w = loss_weight((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), seed=5)
    got = exact_slope_gradient(q, k, v, m, w, causal=causal)
    torch.testing.assert_close(got, dense_exact_grad(q, k, v, m, w, causal=causal), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
@pytest.mark.parametrize(
    "shape, causal, scheme",
    [(dict(b=2, hq=3, lq=20), True, "discrete"), (dict(hq=4, hkv=2, lq=12, lk=20), True, "gamma"),
     (dict(hq=2, lq=18), False, "discrete")],
)  # fmt: skip
def test_surrogate_equals_the_dense_surrogate(shape, causal, scheme, method):
    q, k, v = _qkv(**shape)
    m = alibi_slopes(q.shape[1]).double() * 3
    w = loss_weight((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), seed=5)
    parts = sample_partitions(k.shape[2], m, 5, scheme=scheme, generator=1)
    loss, g = plsh_slope_gradients(q, k, v, parts, w, causal=causal, method=method)
    ref_loss, ref_g = dense_surrogate(q, k, v, parts, w, causal=causal)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-10, atol=1e-12)
    fwd, none = plsh_slope_gradients(q, k, v, parts, w, causal=causal, grad=False, method=method)
    assert none is None
    torch.testing.assert_close(fwd, ref_loss, rtol=1e-10, atol=1e-12)


def test_study_replicates_are_separate_draws_measured_by_the_dense_references():
    """Each replicate of the stacked call is the dense surrogate of its own partitions; the score-function and
    finite-difference estimates are recomputed from the dense losses, and the rows from the estimates."""
    q, k, v = _qkv(hq=2, lq=16, seed=2)
    m = torch.tensor([0.5, 0.125], dtype=D)
    r, t = 3, 4
    st = slope_gradient_study(q, k, v, m, samples=(t,), replicates=r, seed=7, fd_step=0.1)
    w = loss_weight(q.shape, 7)
    torch.testing.assert_close(st.exact, dense_exact_grad(q, k, v, m, w), rtol=1e-10, atol=1e-12)
    seed = subseed(7, "partitions", t)
    assert st.row("surrogate", t).seed == seed
    parts = sample_partitions(16, m.repeat(r), t, generator=seed)
    up = sample_partitions(16, m.repeat(r) * 1.1, t, generator=seed)
    down = sample_partitions(16, m.repeat(r) * 0.9, t, generator=seed)
    losses, sur, fd, scores = [], [], [], []
    for i in range(r):
        heads = slice(2 * i, 2 * i + 2)

        def sel(p, heads=heads):
            return type(p)(16, p.slopes[heads], p.pitch[:, heads], p.shift[:, heads], p.scheme)

        loss, g = dense_surrogate(q, k, v, sel(parts), w)
        losses.append(loss)
        sur.append(g)
        fd.append((dense_surrogate(q, k, v, sel(up), w)[0] - dense_surrogate(q, k, v, sel(down), w)[0]) / (0.2 * m))
        b = sel(parts).pitch
        x = torch.exp(-m)
        scores.append((-(b - 1) + 2 * x / (1 - x)).sum(0))
    lh = torch.stack(losses)
    torch.testing.assert_close(st.losses[t], lh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.estimates[("surrogate", t)], torch.stack(sur), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.estimates[("fd", t)], torch.stack(fd), rtol=1e-8, atol=1e-10)
    baseline = torch.stack([(lh.sum(0) - lh[i]) / (r - 1) for i in range(r)])
    sf = (lh - baseline) * torch.stack(scores)
    torch.testing.assert_close(st.estimates[("score", t)], sf, rtol=1e-9, atol=1e-10)
    # the rows from the estimates
    g = st.exact
    row = st.row("surrogate", t)
    est = torch.stack(sur)
    assert row.rel_bias == pytest.approx(float((est.mean(0) - g).norm() / g.norm()), rel=1e-9)
    assert row.rel_rmse == pytest.approx(float(((est - g) ** 2).sum(1).mean().sqrt() / g.norm()), rel=1e-9)
    assert row.rel_var == pytest.approx(float(est.var(0).sum() / g.norm() ** 2), rel=1e-9)
    assert row.rel_bias_se == pytest.approx(float((est.var(0).sum() / r).sqrt() / g.norm()), rel=1e-9)
    h1 = st.row("surrogate", t, 1)
    assert h1.rel_bias == pytest.approx(float((est[:, 1].mean() - g[1]).abs() / g[1].abs()), rel=1e-9)
    assert h1.slope == 0.125 and h1.exact == float(g[1])
    srow = st.row("score", t)
    assert srow.rel_bias_vs_fd == pytest.approx(float((sf.mean(0) - torch.stack(fd).mean(0)).norm() / g.norm()),
                                                rel=1e-6)  # fmt: skip
    assert math.isnan(row.rel_bias_vs_fd)


# ------------------------------------------------------------------------------------------ statistics


def _within(est: torch.Tensor, target: torch.Tensor, k: float = 4.0) -> bool:
    """Each head's mean over the replicates within ``k`` standard errors of ``target``."""
    se = est.std(0) / math.sqrt(est.shape[0])
    return bool(((est.mean(0) - target).abs() <= k * se).all())


def test_surrogate_converges_to_the_exact_gradient_as_t_grows():
    """The surrogate's mean over replicates: far outside its error bars at T = 1, within 4 standard errors of the
    exact gradient at T = 256, with a bias and an RMSE that fall with T. (Slopes with m n <= 2, so every pair is in
    a common block often enough for T = 256 to reach the limit at this R; steeper heads converge more slowly.)"""
    q, k, v = _qkv(hq=2, lq=16, d=8, seed=4, spread=1.5)
    m = torch.tensor([0.125, 0.0625], dtype=D)
    st = slope_gradient_study(q, k, v, m, samples=(1, 16, 256), replicates=64, seed=0, fd_step=0.0)
    g = st.exact
    assert not _within(st.estimates[("surrogate", 1)], g, k=6)  # biased at T = 1
    assert _within(st.estimates[("surrogate", 256)], g)  # consistent: the bias is gone (within the noise) at T = 256
    b1, b16, b256 = (st.row("surrogate", t).rel_bias for t in (1, 16, 256))
    assert b1 > 3 * b16 and b16 > b256
    r1, r16, r256 = (st.row("surrogate", t).rel_rmse for t in (1, 16, 256))
    assert r1 > 2 * r16 > 4 * r256


def test_score_function_is_unbiased_for_the_gradient_of_the_expected_estimator():
    """At T = 1 ("discrete"), d E[L_plsh] / dm is computed exactly by enumerating the partition law: the score
    function's mean lies within 4 standard errors of it and the finite differences' mean within 4 of the exact
    central difference (itself within 2 % of it at the default step), while the exact gradient lies far from it."""
    q, k, v = _qkv(hq=2, lq=10, d=4, seed=1, spread=1.5)
    m = torch.tensor([0.7, 0.2], dtype=D)
    st = slope_gradient_study(q, k, v, m, samples=(1,), replicates=4000, seed=0)  # the default fd_step, 0.25
    w = loss_weight(q.shape, 0)
    mm = m.clone().requires_grad_(True)
    el = expected_loss_t1(q, k, v, mm, w)
    (target,) = torch.autograd.grad(el.sum(), mm)
    mean_loss = st.losses[1].mean(0)
    assert _within(st.losses[1], el.detach())  # the enumeration is the law the library samples
    assert _within(st.estimates[("score", 1)], target)
    with torch.no_grad():
        central = (expected_loss_t1(q, k, v, m * 1.25, w) - expected_loss_t1(q, k, v, m * 0.75, w)) / (0.5 * m)
    assert _within(st.estimates[("fd", 1)], central)
    assert float((central - target).abs().max()) < 0.02 * float(target.abs().max())  # the step's own bias is small
    # the score function's target is not the exact gradient: far outside its error bars
    sf = st.estimates[("score", 1)]
    assert bool(((sf.mean(0) - st.exact).abs() > 6 * sf.std(0) / math.sqrt(4000)).all()), (target, st.exact)
    assert mean_loss.shape == (2,)


# ------------------------------------------------------------------------------------------ the API


def test_study_rows_reproducible_and_schemes_without_a_score():
    q, k, v = _qkv(hq=2, lq=12)
    kw = dict(samples=(1, 4), replicates=3, fd_step=0.1)
    a = slope_gradient_study(q, k, v, **kw, seed=3)
    b = slope_gradient_study(q, k, v, **kw, seed=3)
    c = slope_gradient_study(q, k, v, **kw, seed=4)

    def strip(study):  # without the wall times; repr so that NaN equals NaN
        return [repr({**r.as_dict(), "seconds": 0}) for r in study.rows]

    assert strip(a) == strip(b)
    assert strip(a) != strip(c)
    assert {(r.estimator, r.T) for r in a.rows} == {(e, t) for e in ("surrogate", "score", "fd") for t in (1, 4)}
    assert len(a.rows) == 3 * 2 * 3  # (estimators) x T x (norm + 2 heads)
    strat = slope_gradient_study(q, k, v, **kw, scheme="discrete-strat")
    assert {r.estimator for r in strat.rows} == {"surrogate", "fd"}
    assert {r.estimator for r in slope_gradient_study(q, k, v, **{**kw, "fd_step": 0}).rows} == {"surrogate", "score"}
    with pytest.raises(KeyError):
        a.row("score", 16)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(replicates=1), "replicates"),
        (dict(samples=()), "samples"),
        (dict(samples=(0,)), "samples"),
        (dict(samples=(4, 4)), "distinct"),
        (dict(slopes=0.0), "slopes must be > 0"),
        (dict(fd_step=1.0), "fd_step"),
        (dict(fd_step=True), "fd_step"),
        (dict(scheme="nope"), "unknown scheme"),
        (dict(seed=-1), "seed"),
        (dict(method="fast"), "method"),
        (dict(causal="yes"), "causal"),
    ],
)
def test_study_bad_input(kw, match):
    q, k, v = _qkv(hq=2, lq=8)
    with pytest.raises((TypeError, ValueError), match=match):
        slope_gradient_study(q, k, v, **{"samples": (1,), "replicates": 2, **kw})
    with pytest.raises(TypeError, match="label"):
        slope_gradient_study(q, k, v, samples=(1,), replicates=2, label=3)


def test_module_functions_are_exported():
    """The study's entry points are public at the room's package, their one home (the module lists no __all__)."""
    from positional_lsh import theory

    public = ["SlopeGradRow", "SlopeGradStudy", "exact_slope_gradient", "log_prob", "loss_weight",
              "plsh_slope_gradients", "score", "shipped_qkv", "slope_gradient_study"]  # fmt: skip
    assert not hasattr(sg, "__all__")
    for name in public:
        assert name in theory.__all__ and getattr(theory, name) is getattr(sg, name)
