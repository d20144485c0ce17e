from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from positional_lsh import (
    PositionalLSHAttention,
    alibi_attention,
    alibi_slopes,
    dense_plsh_attention,
    plsh_attention,
    sample_partitions,
)

from conftest import naive_alibi, naive_estimator, naive_mean_mask

SLOPES4 = torch.tensor([0.5, 0.1, 0.0, 0.03])


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def test_dense_oracle_matches_the_definition():
    q, k, v = _qkv(2, 4, 2, 9, 13, 5)
    for causal in (True, False):
        parts = sample_partitions(13, SLOPES4, 3, scheme="gamma", generator=4)
        mbar = naive_mean_mask(parts.pitch, parts.shift, 13)
        expected = naive_estimator(q, k, v, mbar, causal=causal)
        torch.testing.assert_close(dense_plsh_attention(q, k, v, parts, causal=causal), expected, rtol=0, atol=1e-12)


CASES = [
    # (hq, hkv, lq, lk)
    (4, 4, 37, 37),  # MHA
    (4, 2, 37, 37),  # GQA
    (4, 1, 37, 37),  # MQA
    (4, 2, 6, 37),  # chunked prefill: queries are the last 6 positions
    (4, 4, 1, 37),  # one decoding step
]


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "fixed"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_equals_oracle_float64_with_gradients(scheme, causal, backend, case):
    hq, hkv, lq, lk = case
    q, k, v = _qkv(2, hq, hkv, lq, lk, 8, grad=True)
    parts = sample_partitions(lk, SLOPES4, 5, scheme=scheme, generator=1)
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, backend=backend)
    ref = dense_plsh_attention(q, k, v, parts, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}")


def test_duplicate_samples_are_counted_with_multiplicity():
    # Slope 0 (one block) and very large slopes (singletons) make all samples of a head identical;
    # the fast path computes them once and must still weigh them T times relative to other heads' rows.
    q, k, v = _qkv(1, 3, 3, 20, 20, 4, grad=True)
    slopes = torch.tensor([0.0, 30.0, 0.3])
    parts = sample_partitions(20, slopes, 6, generator=0)
    out = plsh_attention(q, k, v, partitions=parts)
    ref = dense_plsh_attention(q, k, v, parts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_finite_differences(causal):
    q, k, v = _qkv(1, 2, 1, 11, 11, 3, grad=True)
    parts = sample_partitions(11, torch.tensor([0.4, 0.15]), 3, generator=9)
    assert torch.autograd.gradcheck(
        lambda a, b, c: plsh_attention(a, b, c, partitions=parts, causal=causal), (q, k, v), eps=1e-6, atol=1e-7
    )
    parts_g = sample_partitions(11, torch.tensor([0.4, 0.15]), 3, scheme="gamma", generator=9)
    assert torch.autograd.gradcheck(
        lambda a, b, c: plsh_attention(a, b, c, partitions=parts_g, causal=causal), (q, k, v), eps=1e-6, atol=1e-7
    )


def test_ratio_estimator_is_not_the_mean_of_sample_outputs():
    q, k, v = _qkv(1, 1, 1, 40, 40, 8, seed=3)
    parts = sample_partitions(40, [0.1], 4, generator=2)
    out = plsh_attention(q, k, v, partitions=parts)
    per_sample = torch.stack([plsh_attention(q, k, v, partitions=parts.select([t])) for t in range(4)])
    torch.testing.assert_close(out, dense_plsh_attention(q, k, v, parts), rtol=0, atol=1e-12)
    assert (per_sample.mean(0) - out).abs().max() > 1e-2


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_low_precision_against_float64_oracle(dtype, tol, backend):
    q, k, v = _qkv(2, 8, 4, 300, 300, 32, seed=5)
    parts = sample_partitions(300, alibi_slopes(8), 6, generator=3)
    ref = dense_plsh_attention(q, k, v, parts)
    out = plsh_attention(q.to(dtype), k.to(dtype), v.to(dtype), partitions=parts, backend=backend)
    assert out.dtype == dtype
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < tol, f"relative error {rel:.2e}"


def test_float32_gradients_relative_error():
    q, k, v = _qkv(1, 4, 2, 200, 200, 16, seed=8, grad=True)
    parts = sample_partitions(200, alibi_slopes(4), 4, generator=3)
    ref = dense_plsh_attention(q, k, v, parts)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = plsh_attention(q32, k32, v32, partitions=parts)
    grads = torch.autograd.grad(out, (q32, k32, v32), g.float())
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a.double() - b).norm() / b.norm() < 1e-5


def test_slope_zero_is_exact_softmax_attention():
    q, k, v = _qkv(2, 3, 3, 50, 50, 8)
    out = plsh_attention(q, k, v, slopes=0.0, num_samples=3, generator=0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=1e-12)


def test_converges_to_exact_alibi_like_one_over_sqrt_t():
    q, k, v = _qkv(1, 4, 4, 64, 64, 16, seed=11)
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.02])
    exact = naive_alibi(q, k, v, slopes, causal=True)

    def err(t: int) -> float:
        # average over seeds to estimate the expected squared error
        errs = [
            (plsh_attention(q, k, v, slopes, num_samples=t, generator=s) - exact).pow(2).mean().item()
            for s in range(8)
        ]
        return math.sqrt(sum(errs) / len(errs))

    e4, e64, e1024 = err(4), err(64), err(1024)
    # Monte Carlo rate: error ~ c / sqrt(T), so a 16x larger T divides the error by about 4.
    assert 2.0 < e4 / e64 < 8.0, (e4, e64)
    assert 2.0 < e64 / e1024 < 8.0, (e64, e1024)
    assert e1024 < 0.02


def test_nan_inputs_propagate_without_raising():
    q, k, v = _qkv(1, 2, 2, 30, 30, 4, dtype=torch.float32)
    q[0, 0, 10] = float("nan")
    out = plsh_attention(q, k, v, num_samples=3, generator=0)
    assert bool(out[0, 0, 10].isnan().all())
    assert bool(torch.isfinite(out[0, 1]).all())
    v2 = v.clone()
    v2[0, 1, 0] = float("nan")
    out2 = plsh_attention(q, k, v2, num_samples=3, generator=0)
    assert bool(out2[0, 1, 0].isnan().all())


def test_seeded_calls_are_reproducible():
    q, k, v = _qkv(1, 8, 8, 100, 100, 8, dtype=torch.float32)
    a = plsh_attention(q, k, v, num_samples=4, generator=5)
    b = plsh_attention(q, k, v, num_samples=4, generator=5)
    c = plsh_attention(q, k, v, num_samples=4, generator=6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_module_training_resamples_and_eval_is_deterministic():
    q, k, v = _qkv(1, 4, 4, 80, 80, 8, dtype=torch.float32)
    attn = PositionalLSHAttention(4, num_samples=2, seed=0)
    assert attn.training
    a, b = attn(q, k, v), attn(q, k, v)
    assert not torch.equal(a, b)
    attn.eval()
    c, d = attn(q, k, v), attn(q, k, v)
    assert torch.equal(c, d)
    parts = attn.sample(80)
    torch.testing.assert_close(c, plsh_attention(q, k, v, partitions=parts))
    again = PositionalLSHAttention(4, num_samples=2, seed=0)
    torch.testing.assert_close(again(q, k, v), a)
    # Slopes survive dtype casts and state-dict round trips.
    attn.half()
    assert attn.slopes.dtype == torch.float64
    other = PositionalLSHAttention(4, slopes=[0.1, 0.2, 0.3, 0.4])
    other.load_state_dict(attn.state_dict())
    torch.testing.assert_close(other.slopes, alibi_slopes(4).double())


def _bad(**over):
    q, k, v = _qkv(1, 4, 2, 10, 10, 8, dtype=torch.float32)
    args = {"q": q, "k": k, "v": v} | over
    return plsh_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"q": torch.randn(4, 10, 8)}, ValueError, "q must have rank 4"),
        ({"q": torch.randn(1, 3, 10, 8)}, ValueError, "multiple"),
        ({"k": torch.randn(1, 2, 10, 7), "v": torch.randn(1, 2, 10, 7)}, ValueError, "head_dim"),
        ({"v": torch.randn(1, 2, 9, 8)}, ValueError, "same shape"),
        ({"k": torch.randn(2, 2, 10, 8), "v": torch.randn(2, 2, 10, 8)}, ValueError, "batch"),
        ({"q": torch.randn(1, 4, 11, 8)}, ValueError, "seq_len"),
        ({"k": torch.randn(1, 2, 10, 8, dtype=torch.float64)}, TypeError, "dtype"),
        ({"q": torch.ones(1, 4, 10, 8, dtype=torch.long)}, TypeError, "floating-point"),
        ({"q": "tensor"}, TypeError, "q must be a torch.Tensor"),
        ({"v": torch.randn(1, 2, 10, 8, device="meta")}, ValueError, "one device"),
        ({"slopes": [0.1, 0.2]}, ValueError, "one entry per head"),
        ({"slopes": [0.1, 0.2, -0.3, 0.1]}, ValueError, ">= 0"),
        ({"slopes": [0.1, 0.2, float("nan"), 0.1]}, ValueError, "finite"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"scheme": "exact"}, ValueError, "scheme"),
        ({"partitions": sample_partitions(12, alibi_slopes(4), 2, generator=0)}, ValueError, "seq_len=12"),
        ({"partitions": sample_partitions(10, alibi_slopes(8), 2, generator=0)}, ValueError, "8 heads"),
        ({"partitions": "p"}, TypeError, "partitions"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"causal": 1}, TypeError, "causal"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"generator": 1.5}, TypeError, "generator"),
    ],
)
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _bad(**over)


def test_partitions_and_different_slopes_conflict():
    parts = sample_partitions(10, alibi_slopes(4), 2, generator=0)
    with pytest.raises(ValueError, match="slopes differ"):
        _bad(partitions=parts, slopes=[0.1, 0.1, 0.1, 0.1])
    _bad(partitions=parts, slopes=alibi_slopes(4))  # agreeing slopes are fine


def test_module_bad_input():
    with pytest.raises(ValueError, match="scheme"):
        PositionalLSHAttention(4, scheme="nope")
    with pytest.raises(ValueError, match="num_samples"):
        PositionalLSHAttention(4, num_samples=0)
    with pytest.raises(ValueError, match="slopes"):
        PositionalLSHAttention(4, slopes=[0.1])


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_long_causal_blocks_are_split_and_exact(backend):
    # Slopes this small give blocks of hundreds of positions, which the fast path splits into sub-blocks.
    from positional_lsh.ops._engine.per_sample import samples_plan

    n = 900
    q, k, v = _qkv(1, 3, 3, n, n, 8, seed=4, grad=True)
    parts = sample_partitions(n, torch.tensor([0.004, 0.002, 0.0]), 3, generator=1)
    pieces = [seg for work in samples_plan(parts, 3, n, True).heads for segs, _ in work.samples for seg in segs]
    assert any(not seg.masked for seg in pieces) and any(seg.stride for seg in pieces)
    out = plsh_attention(q, k, v, partitions=parts, backend=backend)
    ref = dense_plsh_attention(q, k, v, parts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("b", "hq", "hkv"), [(1, 8, 8), (2, 4, 2), (4, 1, 1), (3, 2, 1)])
def test_worker_pool_matches_sequential(b, hq, hkv):
    # With several torch threads the heads (and, if needed, batch slices) run on single-threaded workers;
    # the pieces are independent, so the result equals the sequential computation up to the rounding of the
    # BLAS inside the kernels, whose blocking follows its thread count (MKL adapts it to the machine's load, so a
    # busy machine can change the last bit of a float32 sum; seen under pytest-xdist).
    q, k, v = _qkv(b, hq, hkv, 300, 300, 16, dtype=torch.float32, seed=2, grad=True)
    parts = sample_partitions(300, alibi_slopes(hq), 3, generator=0)
    g = torch.randn(b, hq, 300, 16)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            out = plsh_attention(q, k, v, partitions=parts)
            results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    finally:
        torch.set_num_threads(threads)
    for a, c in zip(*results, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert not results[1][0].requires_grad or results[1][0].grad_fn is not None


def test_work_items_cover_every_head_and_batch_row_once():
    from positional_lsh.ops._engine.per_sample import samples_plan, work_items_of

    parts = sample_partitions(64, alibi_slopes(6), 2, generator=0)
    plan = samples_plan(parts, 3, 64, True)
    for batch, workers in ((1, 2), (5, 4), (2, 16), (3, 1)):
        seen = torch.zeros(batch, 6, dtype=torch.long)
        for works, sl in work_items_of(plan, batch, workers):
            assert len({w.kv_head for w in works}) == 1  # key/value gradients never shared across items
            for w in works:
                seen[sl, w.head] += 1
        assert bool((seen == 1).all())


# ------------------------------------------------------------------ issue #11: layouts, modes, bad input


def _op(name):
    """The two ops with a fixed configuration: ``f(q, k, v, **kw)``."""
    if name == "plsh":
        return lambda q, k, v, **kw: plsh_attention(q, k, v, SLOPES4, num_samples=4, generator=0, **kw)
    return lambda q, k, v, **kw: alibi_attention(q, k, v, SLOPES4, **kw)


B, H, L, D = 2, 4, 24, 8
# Each layout builds a (B, H, L, D) float32 view from fresh storage of another shape.
LAYOUTS = {
    "contiguous": lambda g: torch.randn(B, H, L, D, generator=g),
    "transposed (B, L, H, d)": lambda g: torch.randn(B, L, H, D, generator=g).transpose(1, 2),
    "last two dims transposed": lambda g: torch.randn(B, H, D, L, generator=g).transpose(-1, -2),
    "sliced last dim": lambda g: torch.randn(B, H, L, 2 * D, generator=g)[..., ::2],
    "sliced length": lambda g: torch.randn(B, H, 2 * L, D, generator=g)[:, :, ::2],
    "sliced heads": lambda g: torch.randn(B, 2 * H, L, D, generator=g)[:, 1::2],
    "sliced batch": lambda g: torch.randn(2 * B, H, L, D, generator=g)[::2],
    "expanded batch": lambda g: torch.randn(1, H, L, D, generator=g).expand(B, H, L, D),
    "expanded heads": lambda g: torch.randn(B, 1, L, D, generator=g).expand(B, H, L, D),
    "expanded length": lambda g: torch.randn(B, H, 1, D, generator=g).expand(B, H, L, D),
    "expanded last dim": lambda g: torch.randn(B, H, L, 1, generator=g).expand(B, H, L, D),
    "fused projection (Falcon)": lambda g: torch.randn(B, L, H + 2, D, generator=g)[:, :, 1 : H + 1].transpose(1, 2),
}


@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("op", ["plsh", "alibi"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_contiguous_values_and_gradients(layout, op, backend):
    g = torch.Generator().manual_seed(7)
    views = [LAYOUTS[layout](g).requires_grad_(False) for _ in range(3)]
    dense = [x.contiguous().requires_grad_() for x in views]
    leaves = [x.detach().requires_grad_() for x in views]  # the strided data, same strides, as leaves
    strided = [x.as_strided(v.shape, v.stride(), v.storage_offset()) for x, v in zip(leaves, views, strict=True)]
    f = _op(op)
    up = torch.randn(B, H, L, D, generator=g)
    ref = f(*dense, backend=backend)
    out = f(*strided, backend=backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out, strided, up)
    ref_grads = torch.autograd.grad(ref, dense, up)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kernel_inputs_are_row_major_views_of_one_copy(monkeypatch):
    import positional_lsh.ops._engine.per_sample as per_sample

    seen = []
    real = per_sample.attend

    def spy(q, k, v, **kw):
        seen.append((q.stride()[-2:], k.stride()[-2:], q.untyped_storage().data_ptr()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(per_sample, "attend", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (LAYOUTS["fused projection (Falcon)"](g) for _ in range(3))
    plsh_attention(q, k[:, :1], v[:, :1], num_samples=4, generator=0, method="samples")
    assert len(seen) > 4
    assert {s[0] for s in seen} == {(D, 1)} and {s[1] for s in seen} == {(D, 1)}
    assert len({s[2] for s in seen}) == 1  # one copy of q per call, not one per block


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op", ["plsh", "alibi"])
def test_inference_mode_with_worker_threads(op, threads):
    f = _op(op)
    q, k, v = (t.float() for t in _qkv(2, 4, 2, 40, 40, 8, seed=5))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ref = f(q, k, v)
        with torch.inference_mode():
            out = f(q, k, v)
        assert out.is_inference()
        with torch.no_grad():
            torch.testing.assert_close(f(q, k, v), ref, rtol=0, atol=0)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["plsh", "alibi"])
@pytest.mark.parametrize("hq, hkv", [(0, 0), (2, 0), (0, 2)])
def test_zero_heads_is_a_value_error(op, hq, hkv):
    q, k = torch.randn(1, hq, 8, 4), torch.randn(1, hkv, 8, 4)
    fn = plsh_attention if op == "plsh" else alibi_attention
    with pytest.raises(ValueError, match="non-empty"):
        fn(q, k, k)


def _reaching(op, lk, lq, j, causal, window, partitions=None):
    """(H, Lq) bool: rows that keep key j (the rows a non-finite key j may turn NaN)."""
    i = torch.arange(lq)[:, None] + (lk - lq)
    keep = torch.ones(SLOPES4.numel(), lq, dtype=torch.bool)
    if causal:
        keep &= (i >= j).T
    if op == "plsh":
        keep &= partitions.mean_mask()[:, lk - lq :, j] > 0
    elif window is not None:
        keep &= (i - j).abs().T <= window
    return keep


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize(
    "op, causal, window, lq",
    [("plsh", True, None, 48), ("plsh", False, None, 48), ("plsh", True, None, 20), ("alibi", True, None, 48),
     ("alibi", True, 6.0, 48), ("alibi", False, 6.0, 48), ("alibi", True, None, 20)],
)
@pytest.mark.parametrize("backend", ["auto", "math"])
def test_non_finite_key_reaches_only_the_rows_that_keep_it(op, causal, window, lq, where, bad, backend):
    lk, j = 48, 30
    q, k, v = (t.float().detach() for t in _qkv(2, 4, 2, lq, lk, 8, seed=9))
    parts = sample_partitions(lk, SLOPES4, 4, generator=0) if op == "plsh" else None
    if op == "plsh":
        def f(q, k, v):
            return plsh_attention(q, k, v, partitions=parts, causal=causal, backend=backend)
    else:
        def f(q, k, v):
            return alibi_attention(q, k, v, SLOPES4, causal=causal, window=window, backend=backend)
    clean = f(q, k, v)
    poisoned = [k.clone(), v.clone()]
    poisoned[0 if where == "k" else 1][1, 0, j, 3] = bad  # batch row 1, kv head 0 (query heads 0 and 1)
    out = f(q, *poisoned)
    reach = torch.zeros(2, 4, lq, dtype=torch.bool)
    reach[1, :2] = _reaching(op, lk, lq, j, causal, window, parts)[:2]
    assert reach.any() and not reach.all()
    assert torch.isnan(out[reach]).all()
    torch.testing.assert_close(out[~reach], clean[~reach], rtol=0, atol=0)
    if causal:  # rows before j in particular
        assert torch.isfinite(out[..., : lq - (lk - j), :]).all()
    # the gradient w.r.t. the queries of the rows that do not keep key j is the clean one
    qg = q.clone().requires_grad_()
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (g_bad,) = torch.autograd.grad(f(qg, *poisoned), qg, up)
    (g_clean,) = torch.autograd.grad(f(qg, k, v), qg, up)
    torch.testing.assert_close(g_bad[~reach], g_clean[~reach], rtol=0, atol=0)


def test_module_checks_qkv_once(monkeypatch):
    import positional_lsh.ops.attention as attention

    calls = []
    real = attention.check_qkv
    monkeypatch.setattr(attention, "check_qkv", lambda *a: calls.append(1) or real(*a))
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=2, seed=0)
    q, k, v = (t.float() for t in _qkv(1, 4, 2, 16, 16, 8))
    mod(q, k, v)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="heads"):
        mod(*(t.float() for t in _qkv(1, 2, 2, 16, 16, 8)))
