"""The multiplicity form of plsh_attention (method="multiplicity"/"auto") against the independent dense oracle."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from positional_lsh import alibi_slopes, dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops._engine.multiplicity import mask as mult
from positional_lsh.ops._engine.multiplicity import plan as mult_plan
from positional_lsh.ops._engine.multiplicity.plan import multiplicity_plan, tile_rows
from positional_lsh.ops.partitions.schemes import scheme_names

from conftest import naive_estimator, naive_mean_mask

pytestmark = pytest.mark.usefixtures("torch_path")  # torch's kernels and their cost model (PLSH_CPU_KERNEL=0)

SLOPES = torch.tensor([0.5, 0.1, 0.0, 0.03, 40.0, 0.7])


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad) for s in shapes)


def _check(out, ref, inputs, atol=1e-10):
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    g = torch.randn_like(out)
    for name, a, b in zip("qkv", torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=f"d{name}")


# One shape per (scheme, causality): the shapes cycle over the schemes so that each of MHA, GQA, MQA with chunked
# prefill, one decoding step and a longer sequence (against the dense oracle) runs causal and bidirectional.
_SHAPES = [(6, 45, 45), (2, 45, 45), (1, 7, 45), (3, 1, 45), (2, 200, 200)]
_CASES = [(s, c, *_SHAPES[i % len(_SHAPES)]) for i, s in enumerate(scheme_names()) for c in (True, False)]


@functools.cache
def _naive_mask(scheme: str, n: int) -> torch.Tensor:
    parts = sample_partitions(n, SLOPES, 7, scheme=scheme, generator=3)
    return naive_mean_mask(parts.pitch, parts.shift, n)


@pytest.mark.parametrize(("scheme", "causal", "hkv", "lq", "lk"), _CASES)
def test_multiplicity_equals_naive_oracle_float64(scheme, causal, hkv, lq, lk):
    q, k, v = _qkv(2, 6, hkv, lq, lk, 8, grad=True)
    parts = sample_partitions(lk, SLOPES, 7, scheme=scheme, generator=3)
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, method="multiplicity")
    if lk <= 45:  # the naive loops of conftest, independent of the library (slow beyond small sizes)
        ref = naive_estimator(q, k, v, _naive_mask(scheme, lk), causal=causal)
    else:
        ref = dense_plsh_attention(q, k, v, parts, causal=causal)
    _check(out, ref, (q, k, v))


def test_cases_cover_every_scheme_causality_and_shape():
    assert {c[0] for c in _CASES} == set(scheme_names())
    for shape in _SHAPES:
        assert {c[1] for c in _CASES if tuple(c[2:]) == shape} == {True, False}


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_multiplicity_matches_samples_and_dense_oracle(backend):
    q, k, v = _qkv(1, 8, 4, 300, 300, 16, grad=True)
    parts = sample_partitions(300, alibi_slopes(8), 24, scheme="gamma", generator=1)
    out = plsh_attention(q, k, v, partitions=parts, method="multiplicity", backend=backend)
    _check(out, dense_plsh_attention(q, k, v, parts), (q, k, v))
    torch.testing.assert_close(out, plsh_attention(q, k, v, partitions=parts, method="samples"), rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_multiplicity_gradcheck(causal):
    # Integer pitches causal, generic (gamma) pitches bidirectional; the oracle tests above check both ways.
    q, k, v = _qkv(1, 2, 1, 13, 13, 3, grad=True)
    parts = sample_partitions(13, torch.tensor([0.4, 0.15]), 5, scheme="discrete" if causal else "gamma", generator=9)
    assert torch.autograd.gradcheck(
        lambda a, b, c: plsh_attention(a, b, c, partitions=parts, causal=causal, method="multiplicity"),
        (q, k, v),
        eps=1e-6,
        atol=1e-7,
    )


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_multiplicity_low_precision(dtype, tol):
    q, k, v = _qkv(2, 8, 4, 300, 300, 32, seed=5)
    parts = sample_partitions(300, alibi_slopes(8), 16, generator=3)
    ref = dense_plsh_attention(q, k, v, parts)
    out = plsh_attention(q.to(dtype), k.to(dtype), v.to(dtype), partitions=parts, method="multiplicity")
    assert out.dtype == dtype
    assert (out.double() - ref).norm() / ref.norm() < tol


def test_auto_mixes_methods_per_head_and_stays_exact():
    q, k, v = _qkv(1, 8, 8, 1024, 1024, 8, grad=True)
    parts = sample_partitions(1024, alibi_slopes(8), 64, generator=0)
    out = plsh_attention(q, k, v, partitions=parts, method="auto")
    ref = plsh_attention(q, k, v, partitions=parts, method="samples")
    _check(out, ref, (q, k, v), atol=1e-10)


@pytest.mark.parametrize("n", [1024, 4096, 32768])
def test_auto_cost_model_choices(n):
    # The call-level decision of method="auto" (docs/implementation.md, "Choosing the method"): one sample takes
    # the per-sample path without estimating; at T = 2 the summed estimates keep it there (the multiplicity form
    # measures 1.1-1.3x slower at T = 2, n = 1k-16k); from T = 4 on every head takes the multiplicity form (0.73-0.88x
    # the per-sample time at T = 4, 0.46x at T = 8; docs/benchmarks.md, "Choosing the method").
    from positional_lsh.ops._engine import routing

    slopes = alibi_slopes(8)
    q = torch.zeros(1, 8, n, 64)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="auto")
    for t in (1, 2):
        p = routing.plan(route, sample_partitions(n, slopes, t, generator=0), 8, n, q.device)
        assert p.method == "samples" and len(p.backend_plan.heads) == 8
    for t in (4, 64):
        p = routing.plan(route, sample_partitions(n, slopes, t, generator=0), 8, n, q.device)
        assert p.method == "multiplicity" and p.backend_plan.heads == tuple(range(8))


def test_nan_keys_reach_the_same_rows():
    q, k, v = _qkv(1, 2, 2, 60, 60, 4)
    k = k.clone()
    k[0, 1, 30, 0] = float("nan")
    parts = sample_partitions(60, [0.2, 0.05], 6, generator=2)
    a = plsh_attention(q, k, v, partitions=parts, method="multiplicity")
    b = plsh_attention(q, k, v, partitions=parts, method="samples")
    assert torch.equal(a.isnan(), b.isnan()) and bool(a.isnan().any())
    torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=0, atol=1e-12)


def test_plan_is_a_few_calls_and_bad_method():
    parts = sample_partitions(4096, alibi_slopes(8), 64, generator=0)
    plan = multiplicity_plan(parts, list(range(8)), 8, 4096, True)
    assert plan.num_groups <= 8 * 12
    q, k, v = _qkv(1, 1, 1, 8, 8, 4)
    with pytest.raises(ValueError, match="method"):
        plsh_attention(q, k, v, num_samples=2, method="dense")


@pytest.mark.parametrize("causal", [True, False])
def test_integer_row_bounds_equal_the_general_ones(causal, monkeypatch):
    # Integer pitches take i - ((i - shift) mod pitch); the general path (labels + running max/min) must agree on
    # every row of every tile, including the clamping at 0 and n and the padded rows past Lq.

    n, lq = 300, 290
    parts = sample_partitions(n, SLOPES[SLOPES > 0], 7, generator=5)  # discrete: integers (slope 0: infinite pitch)
    plan = multiplicity_plan(parts, list(range(parts.num_heads)), parts.num_heads, lq, causal)
    for g in plan.groups:
        rows, _ = tile_rows(g, lq)
        pos = rows + (n - lq)
        assert mult.integer_pitch_shift(g.pitch, g.shift) is not None
        fast = mult.row_bounds(g, pos, n, True)
        with monkeypatch.context() as m:
            m.setattr(mult, "integer_pitch_shift", lambda pitch, shift: None)
            slow = mult.row_bounds(g, pos, n, True)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


@pytest.mark.parametrize("causal", [True, False])
def test_many_small_kernel_calls_reuse_their_buffers_exactly(causal, monkeypatch):
    # Groups split into one-tile calls reuse the forward's and the backward's buffers (counts, mask, gathered q, k, v)
    # from call to call, at shapes that shrink and grow: the result is still the oracle's, gradients included.
    monkeypatch.setattr(mult_plan, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(mult_plan, "TILE_HEIGHTS", (16,))
    monkeypatch.setattr(mult_plan, "WHOLE_TILE_ROWS", 0)
    q, k, v = _qkv(2, 6, 3, 150, 150, 8, grad=True)
    parts = sample_partitions(150, SLOPES, 5, generator=4)
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, method="multiplicity")
    plan = multiplicity_plan(parts, list(range(6)), 3, 150, causal)
    assert len(mult.kernel_calls(plan, q.device, 2, 8)) > len(plan.groups) > 1  # several calls per group
    _check(out, dense_plsh_attention(q, k, v, parts, causal=causal), (q, k, v))


def test_log_table_is_the_log_of_every_count():
    for dtype in (torch.float32, torch.float64):
        table = mult.log_count_table(9, dtype, torch.device("cpu"))
        assert table[0] == -math.inf and table.dtype == dtype
        torch.testing.assert_close(table[1:], torch.arange(1, 10, dtype=dtype).log(), rtol=0, atol=0)


@pytest.mark.parametrize("events", ["rows", "moves"])
@pytest.mark.parametrize("causal", [True, False])
def test_repeated_draws_and_block_moves_stay_exact(events, causal, monkeypatch):
    # At T = 64 and small sigma most draws repeat: the plan keeps each head's distinct partitions with their sample
    # counts as weights. Causal counts come from the T starts of each row or from the blocks' moves down the rows
    # (multiplicity._move_events), forced here either way: both are the oracle's, gradients included.
    monkeypatch.setattr(mult, "ROW_START_NS", 1e9 if events == "moves" else 0.0)
    q, k, v = _qkv(1, 4, 2, 190, 190, 8, grad=True)
    parts = sample_partitions(190, [2.0, 0.5, 0.1, 0.02], 64, generator=5)
    plan = multiplicity_plan(parts, list(range(4)), 2, 190, causal)
    distinct = {int(h): int((w > 0).sum()) for g in plan.groups for h, w in zip(g.head, g.weight, strict=True)}
    assert distinct[0] < 16 and all(int(g.weight.sum(1).min()) == 64 for g in plan.groups)
    calls = mult.kernel_calls(plan, q.device, 1, 8)
    assert any(c.moves is not None for c in calls) == (causal and events == "moves")
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, method="multiplicity")
    _check(out, dense_plsh_attention(q, k, v, parts, causal=causal), (q, k, v))


def test_distinct_partitions_count_every_draw_once():
    # Each head's distinct (pitch, shift) pairs, sorted, with how many of its T draws each is (padding: the first
    # pair, weight 0), against Python's Counter over the drawn values.
    from collections import Counter

    for scheme, t in (("discrete", 9), ("gamma", 4), ("discrete", 200)):
        parts = sample_partitions(120, torch.cat([SLOPES, torch.tensor([0.0])]), t, generator=3, scheme=scheme)
        pitch, shift, weight = mult_plan.distinct_partitions(parts)
        for h in range(parts.num_heads):
            want = sorted(Counter(zip(parts.pitch[:, h].tolist(), parts.shift[:, h].tolist(), strict=True)).items())
            u = len(want)
            got = list(zip(pitch[h, :u].tolist(), shift[h, :u].tolist(), strict=True))
            assert got == [pair for pair, _ in want] and weight[h, :u].tolist() == [c for _, c in want]
            assert not weight[h, u:].any() and bool((pitch[h, u:] == want[0][0][0]).all())
