from __future__ import annotations

import math

import pytest
import torch

from positional_lsh import (
    Partitions,
    PositionalLSHAttention,
    alibi_matrix,
    alibi_slopes,
    dense_plsh_attention,
    plsh_attention,
    sample_partitions,
)
from positional_lsh.ops._engine.per_sample import segments
from positional_lsh.ops.checks import check_int, nonnegative_int, positive_int
from positional_lsh.ops.partitions import schemes
from positional_lsh.ops.partitions.schemes import Scheme, get_scheme, register_scheme, scheme_names, unregister_scheme

from conftest import naive_mean_mask


def test_slopes_power_of_two_formula():
    for h in (1, 2, 4, 8, 16, 32):
        expected = torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)])
        torch.testing.assert_close(alibi_slopes(h), expected.float())


def test_slopes_twelve_heads_match_press_et_al():
    expected = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
                0.70711, 0.35355, 0.17678, 0.08839]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), rtol=0, atol=1e-5)


def test_slopes_match_bloom_for_every_head_count():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for h in range(1, 41):
        # build_alibi_tensor returns slope * position; position 1 gives the slopes.
        alibi = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), h, torch.float32)
        torch.testing.assert_close(alibi_slopes(h), alibi[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [0, -3])
def test_slopes_bad_count(bad):
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(bad)


@pytest.mark.parametrize("bad", [1.5, True, "8"])
def test_slopes_bad_type(bad):
    with pytest.raises(TypeError, match="num_heads"):
        alibi_slopes(bad)


def _binomial_z(mbar: torch.Tensor, a: torch.Tensor, t: int) -> torch.Tensor:
    """|Mbar - A| in units of the standard deviation of a mean of t Bernoulli(A) draws."""
    std = torch.sqrt(a * (1 - a) / t).clamp_min(1e-12)
    z = (mbar - a).abs() / std
    return torch.where(a * (1 - a) * t < 1.0, torch.zeros_like(z), z)  # skip cells too rare to test


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_unbiased_schemes_mean_mask_matches_alibi(scheme):
    n, t = 24, 6000
    slopes = torch.tensor([0.5, 0.2, 0.05])
    parts = sample_partitions(n, slopes, t, scheme=scheme, generator=7)
    mbar = parts.mean_mask()
    a = alibi_matrix(n, slopes)
    z = _binomial_z(mbar, a, t)
    # ~1700 cells; for a true null, max |z| over them exceeds 5 with probability < 1e-3.
    assert z.max() < 5.0, f"max z-score {z.max():.2f}"
    # And the estimator actually moved towards A: mean error is about the binomial standard error.
    assert (mbar - a).abs().max() < 5 * math.sqrt(0.25 / t)


def test_fixed_scheme_is_biased():
    n, t = 24, 2000
    slopes = torch.tensor([0.2])
    parts = sample_partitions(n, slopes, t, scheme="fixed", generator=7)
    assert not parts.unbiased
    z = _binomial_z(parts.mean_mask(), alibi_matrix(n, slopes), t)
    assert z.max() > 20.0


def test_discrete_pitch_law():
    # P[B] = B x^{B-1} (1-x)^2  =>  E[B] = (1 + x) / (1 - x).
    m, t = 0.1, 20000
    parts = sample_partitions(10, [m], t, scheme="discrete", generator=3)
    x = math.exp(-m)
    pitch = parts.pitch[:, 0]
    assert torch.equal(pitch, pitch.round()) and pitch.min() >= 1
    mean = (1 + x) / (1 - x)
    var = 2 * x / (1 - x) ** 2  # two independent geometrics, each with variance x/(1-x)^2
    assert abs(pitch.mean().item() - mean) < 5 * math.sqrt(var / t)
    shift = parts.shift[:, 0]
    assert torch.equal(shift, shift.round()) and bool((shift >= 0).all()) and bool((shift < pitch).all())


def test_gamma_pitch_law():
    m, t = 0.05, 20000
    parts = sample_partitions(10, [m], t, scheme="gamma", generator=3)
    pitch = parts.pitch[:, 0]
    sigma = 1 / m
    # Gamma(2, sigma): mean 2 sigma, variance 2 sigma^2.
    assert abs(pitch.mean().item() - 2 * sigma) < 5 * math.sqrt(2 * sigma**2 / t)
    assert bool((parts.shift[:, 0] < pitch).all()) and bool((parts.shift >= 0).all())


def test_mean_mask_and_labels_follow_the_definition():
    slopes = torch.tensor([0.4, 0.1, 0.0])
    for scheme in ("discrete", "gamma", "fixed"):
        parts = sample_partitions(15, slopes, 4, scheme=scheme, generator=11)
        expected = naive_mean_mask(parts.pitch, parts.shift, 15)
        torch.testing.assert_close(parts.mean_mask(), expected, rtol=0, atol=1e-15)
        masks = parts.dense_masks()
        assert masks.shape == (4, 3, 15, 15) and masks.dtype == torch.bool
        torch.testing.assert_close(masks.double().mean(0), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "fixed"])
def test_blocks_are_contiguous_and_cover(scheme):
    n = 200
    parts = sample_partitions(n, alibi_slopes(8), 5, scheme=scheme, generator=2)
    labels = parts.labels()
    assert labels.shape == (5, 8, n) and labels.dtype == torch.long
    assert bool((labels.diff(dim=-1) >= 0).all())
    for t in range(5):
        for h in range(8):
            starts, sizes = parts.blocks(t, h)
            assert int(starts[0]) == 0 and int(sizes.sum()) == n
            # Every block holds one label, and consecutive blocks hold different labels.
            lab = labels[t, h]
            for s, z in zip(starts.tolist(), sizes.tolist(), strict=True):
                assert bool((lab[s : s + z] == lab[s]).all())
            assert bool((lab[starts[1:]] != lab[starts[1:] - 1]).all())
            if scheme == "discrete":
                b = int(parts.pitch[t, h])
                inner = sizes[1:-1]
                assert bool((inner == b).all())


def test_segments_cover_every_query_once():
    n = 90
    slopes = torch.tensor([0.6, 0.08, 0.0, 0.02])
    for scheme in ("discrete", "gamma", "fixed"):
        parts = sample_partitions(n, slopes, 6, scheme=scheme, generator=5)
        for q_len in (n, 17, 1):
            q0 = n - q_len
            for h, t, segs in ((h, t, segments(parts, t, h, q_len)) for h in range(4) for t in range(6)):
                lab = parts.labels()[t, h]
                covered = torch.zeros(q_len, dtype=torch.long)
                for seg in segs:
                    if seg.index is None:
                        for c in range(seg.count):
                            qs = seg.q_start + c * seg.q_len
                            ks = seg.k_start + c * seg.k_len
                            covered[qs : qs + seg.q_len] += 1
                            keys = torch.arange(ks, ks + seg.k_len)
                            queries = torch.arange(qs, qs + seg.q_len) + q0
                            # keys are exactly the block of each query
                            assert bool((lab[keys] == lab[queries[0]]).all())
                            assert int((lab == lab[queries[0]]).sum()) == seg.k_len
                            assert queries[-1] == keys[-1]
                    else:
                        rows = seg.index + seg.q_start
                        covered[rows.reshape(-1)] += 1
                        for block in seg.index:
                            assert int((lab == lab[block[0]]).sum()) == seg.k_len
                assert bool((covered == 1).all()), (scheme, q_len, h, t)


def test_slope_zero_is_one_block_and_large_slopes_are_singletons():
    parts = sample_partitions(30, torch.tensor([0.0, 50.0]), 3, generator=0)
    assert bool(torch.isinf(parts.pitch[:, 0]).all())
    assert bool((parts.labels()[:, 0] == 0).all())
    torch.testing.assert_close(parts.mean_mask()[1], torch.eye(30, dtype=torch.float64))


def test_reproducible_and_prefix_consistent():
    a = sample_partitions(100, alibi_slopes(8), 4, generator=42)
    b = sample_partitions(100, alibi_slopes(8), 4, generator=torch.Generator().manual_seed(42))
    c = sample_partitions(100, alibi_slopes(8), 9, generator=42)
    d = sample_partitions(100, alibi_slopes(8), 4, generator=43)
    assert torch.equal(a.pitch, b.pitch) and torch.equal(a.shift, b.shift)
    assert torch.equal(c.pitch[:4], a.pitch) and torch.equal(c.shift[:4], a.shift)
    assert not torch.equal(a.pitch, d.pitch)
    g = torch.Generator().manual_seed(1)
    e = sample_partitions(100, alibi_slopes(8), 4, generator=g)
    f = sample_partitions(100, alibi_slopes(8), 4, generator=g)
    assert not torch.equal(e.pitch, f.pitch)  # a generator advances
    torch.manual_seed(5)
    x = sample_partitions(100, alibi_slopes(8), 4)
    torch.manual_seed(5)
    y = sample_partitions(100, alibi_slopes(8), 4)
    assert torch.equal(x.pitch, y.pitch)


def test_partitions_store_numbers_not_labels():
    parts = sample_partitions(10**9, alibi_slopes(8), 16, generator=0)
    assert parts.pitch.shape == (16, 8) and parts.shift.shape == (16, 8)
    assert parts.with_seq_len(50).labels().shape == (16, 8, 50)
    assert parts.select(slice(0, 3)).num_samples == 3
    assert "num_samples=16" in repr(parts)


def test_dense_helpers_refuse_huge_sizes():
    parts = sample_partitions(100_000, alibi_slopes(8), 2, generator=0)
    with pytest.raises(ValueError, match="small seq_len"):
        parts.mean_mask()
    with pytest.raises(ValueError, match="small seq_len"):
        parts.dense_masks()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": 2.5}, TypeError, "seq_len"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"scheme": "uniform"}, ValueError, "scheme"),
        ({"scheme": 3}, TypeError, "scheme"),
        ({"slopes": [0.5, -0.1]}, ValueError, "slopes"),
        ({"slopes": [0.5, float("nan")]}, ValueError, "slopes"),
        ({"slopes": [0.5, float("inf")]}, ValueError, "slopes"),
        ({"slopes": torch.ones(2, 2)}, ValueError, "slopes"),
        ({"slopes": ["a", "b"]}, TypeError, "slopes"),
        ({"slopes": None}, ValueError, "num_heads"),
        ({"generator": "seed"}, TypeError, "generator"),
        ({"generator": -1}, ValueError, "generator"),
        ({"slopes": [0.1, 0.2], "num_heads": 3}, ValueError, "num_heads"),
    ],
)
def test_sample_partitions_bad_input(kwargs, exc, match):
    args = {"seq_len": 10, "slopes": [0.5, 0.1], "num_samples": 2} | kwargs
    with pytest.raises(exc, match=match):
        sample_partitions(args.pop("seq_len"), args.pop("slopes"), args.pop("num_samples"), **args)


def test_single_float_slope_needs_num_heads():
    parts = sample_partitions(10, 1 / 256, 2, num_heads=3, generator=0)
    assert parts.num_heads == 3 and torch.allclose(parts.slopes, torch.full((3,), 1 / 256, dtype=torch.float64))
    assert isinstance(parts, Partitions)


# ----------------------------------------------------------------------------------- the scheme registry


@pytest.fixture
def restore_registry():
    saved = {name: get_scheme(name) for name in scheme_names()}
    yield
    for name in reversed(scheme_names()):  # derived schemes were registered after their base
        if name not in saved:
            unregister_scheme(name)
    assert {name: get_scheme(name) for name in scheme_names()} == saved, "a test replaced a registered scheme"


def test_registry_properties():
    assert scheme_names()[:3] == ("discrete", "gamma", "fixed")
    assert scheme_names(integer=True) == ("discrete", "discrete-strat", "discrete-antithetic")
    assert scheme_names(unbiased=False) == ("fixed",)
    assert scheme_names(coupled=False) == ("discrete", "gamma", "fixed")
    s = get_scheme("gamma-strat")
    assert isinstance(s, Scheme) and s.coupled and s.unbiased and not s.integer and s.base == "gamma"
    assert get_scheme("discrete").base == "discrete"
    with pytest.raises(ValueError, match=r"unknown scheme 'nope'.*discrete"):
        get_scheme("nope")


def test_registered_scheme_is_accepted_everywhere(restore_registry):
    from positional_lsh import ModelConfig

    def halves(m, t, g):  # pitch 4, shift 0 or 2: integer, biased
        pitch = torch.full((t, m.numel()), 4.0, dtype=torch.float64)
        return pitch, 2.0 * (torch.arange(t, dtype=torch.float64) % 2)[:, None].expand_as(pitch)

    assert "test-halves" not in scheme_names()
    with pytest.raises(ValueError, match="scheme"):
        ModelConfig(position="plsh", scheme="test-halves")
    register_scheme("test-halves", halves, unbiased=False, integer=True)
    assert scheme_names()[-1] == "test-halves" and "test-halves" in scheme_names(integer=True)
    parts = sample_partitions(10, [0.5, 0.1], 2, scheme="test-halves")
    assert parts.labels()[1, 0].tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1] and not parts.unbiased
    q = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    out = plsh_attention(q, q, q, [0.5, 0.1], num_samples=2, scheme="test-halves")
    torch.testing.assert_close(out, dense_plsh_attention(q, q, q, parts))
    PositionalLSHAttention(2, num_samples=2, scheme="test-halves")(q, q, q)
    cfg = ModelConfig(position="plsh", scheme="test-halves")
    cfg.validate()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name=""), "name"),
        (dict(name=3), "name"),
        (dict(name="discrete"), "name 'discrete' is already registered"),
        (dict(sampler=None), "sampler"),
        (dict(unbiased=1), "unbiased"),
        (dict(integer="yes"), "integer"),
        (dict(coupled=None), "coupled"),
        (dict(coupled=True), "base"),
        (dict(coupled=True, base="nope"), "base"),
        (dict(coupled=True, base="discrete-strat"), "base"),
        (dict(base="discrete"), "base"),
        (dict(name="discrete", replace="y"), "replace"),
    ],
)
def test_register_scheme_refuses_bad_input(restore_registry, kwargs, match):
    args = dict(name="test-new", sampler=schemes.sample_discrete, unbiased=True, integer=True) | kwargs
    with pytest.raises(ValueError, match=match):
        register_scheme(args.pop("name"), args.pop("sampler"), **args)
    assert "test-new" not in scheme_names()


def test_register_scheme_replace(restore_registry):
    register_scheme("test-new", schemes.sample_gamma, unbiased=True, integer=False)
    register_scheme("test-new", schemes.sample_discrete, unbiased=True, integer=True, replace=True)
    assert get_scheme("test-new").integer
    coupled = register_scheme("test-c", schemes.sample_discrete, unbiased=True, integer=True, coupled=True,
                              base="test-new")
    assert coupled.base == "test-new" and "test-c" in scheme_names(coupled=True)


def test_unregister_scheme(restore_registry):
    register_scheme("test-new", schemes.sample_gamma, unbiased=True, integer=False)
    register_scheme("test-c", schemes.sample_discrete, unbiased=True, integer=True, coupled=True, base="test-new")
    with pytest.raises(ValueError, match=r"scheme 'test-new' is the base of \['test-c'\]"):
        unregister_scheme("test-new")
    unregister_scheme("test-c")
    unregister_scheme("test-new")
    assert "test-new" not in scheme_names() and "test-c" not in scheme_names()
    with pytest.raises(ValueError, match="unknown scheme 'test-new'"):
        get_scheme("test-new")
    for name, match in (("test-new", "'test-new' is not registered"), (3, "3 is not registered"),
                        ("discrete", "'discrete' is built in")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            unregister_scheme(name)
    assert "discrete" in scheme_names()


def test_int_validators():
    assert check_int("n", 3) == 3 and check_int("n", -5) == -5 and check_int("n", 2, minimum=2) == 2
    assert positive_int("n", 1) == 1 and nonnegative_int("n", 0) == 0
    for fn, bad in ((positive_int, 0), (nonnegative_int, -1)):
        with pytest.raises(ValueError, match="n must be >="):
            fn("n", bad)
    with pytest.raises(ValueError, match="count must be >= 3, got 2"):
        check_int("count", 2, minimum=3)
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="n must be an int"):
            check_int("n", bad)
