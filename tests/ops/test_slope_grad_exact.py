"""Exact gradients of the decay: ALiBi slopes (``alibi_attention``) and the built-in decay families' parameters
(``decay_attention``), against dense autograd through an explicit ``n x n`` bias in float64."""

from __future__ import annotations

import math

import pytest
import torch

import positional_lsh.ops.exact.fused as fused_module
import positional_lsh.ops.exact.toeplitz as toeplitz_module
from positional_lsh import alibi_attention, decay_attention
from positional_lsh.ops.exact.reference import alibi_attention_reference
from positional_lsh.ops.partitions.decays import (
    DECAY_FAMILIES,
    decay_attention_reference,
    decay_bias,
    decay_family,
)

from conftest import naive_alibi

F64 = torch.float64


def _qkv(b, hq, hkv, lq, lk, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


def _slopes(hq, dtype=F64):
    # not powers of two, one head at 0 (slope 0 is exact softmax attention and still gets a gradient)
    base = torch.tensor([0.37, 0.11, 0.0, 0.73, 0.05, 0.29, 0.9, 0.2][:hq], dtype=F64)
    return base.to(dtype).requires_grad_()


def _up(out, seed=1):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)


def _assert_matches_reference(out, ref, inputs):
    """``out`` equals the dense ``ref`` (``1e-12``) and so do the gradients of ``inputs = (q, k, v, parameter)``
    (``1e-10``) for one upstream gradient; the parameter's is not all but zero (a gradient there to get wrong)."""
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    up = _up(out)
    got = torch.autograd.grad(out, inputs, up)
    want = torch.autograd.grad(ref, inputs, up)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert got[3].abs().max() > 1e-3


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(toeplitz_module, "CHUNK_ELEMENTS", 24)  # a few query rows per chunk: multi-chunk backward
    monkeypatch.setattr(toeplitz_module, "GRAD_ELEMENTS", 12)  # and the parameter pass in sub-blocks of them


@pytest.fixture(params=["chunks", "sub-blocks"])
def chunking(request, monkeypatch):
    """Many chunks with sub-blocks, or one chunk per head whose parameter pass runs in one-row sub-blocks."""
    many = request.param == "chunks"
    monkeypatch.setattr(toeplitz_module, "CHUNK_ELEMENTS", 24 if many else 2**22)
    monkeypatch.setattr(toeplitz_module, "GRAD_ELEMENTS", 12 if many else 1)


# (hq, hkv, lq, lk, causal, window): causal and bidirectional, windowed (one and per-head), GQA, Lq < Lk
CASES = [
    (2, 2, 7, 7, True, None),
    (2, 2, 7, 7, False, None),
    (4, 2, 5, 9, True, 2.0),
    (4, 1, 6, 6, False, [1.0, 2.5, 9.0, 0.0]),
    (2, 1, 3, 8, False, 3.0),
]
CASE_IDS = ["causal", "bidirectional", "gqa-window-lq<lk", "mqa-per-head-window", "bidi-window-lq<lk"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_alibi_gradcheck_slopes_and_qkv(case, small_chunks):
    hq, hkv, lq, lk, causal, window = case
    q, k, v = _qkv(1, hq, hkv, lq, lk, 3, seed=2)
    m = _slopes(hq)
    with torch.no_grad():
        m[2 % hq] = 0.21  # gradcheck's finite differences need slopes away from 0 (negative ones are refused)

    def f(a, b, c, s):
        return alibi_attention(a, b, c, s, causal=causal, window=window)

    # the full Jacobian for one case; a random projection of it (fast mode) for the others
    fast = case is not CASES[0]
    assert torch.autograd.gradcheck(f, (q, k, v, m), eps=1e-6, atol=1e-7, fast_mode=fast)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_alibi_slope_grad_equals_dense_autograd(case, backend, chunking):
    hq, hkv, lq, lk, causal, window = case
    q, k, v = _qkv(2, hq, hkv, lq, lk, 4, seed=3)
    m = _slopes(hq)
    out = alibi_attention(q, k, v, m, causal=causal, window=window, backend=backend)
    ref = alibi_attention_reference(q, k, v, m, causal=causal, window=window)
    _assert_matches_reference(out, ref, (q, k, v, m))


def test_dense_reference_is_the_explicit_bias():
    """The dense reference against the Python-loop bias of conftest (values), so it is independent."""
    for hq, hkv, lq, lk, causal, window in CASES:
        q, k, v = _qkv(1, hq, hkv, lq, lk, 4, seed=4)
        m = _slopes(hq)
        win = None if window is None else torch.as_tensor(window, dtype=F64).expand(hq)
        ref = alibi_attention_reference(q, k, v, m, causal=causal, window=window)
        torch.testing.assert_close(ref, naive_alibi(q, k, v, m.detach(), causal=causal, window=win), rtol=0, atol=1e-13)


def test_slope_grad_is_minus_the_distance_weighted_ds():
    """dL/dm_h = -sum_{b,i,j} dS_ij |i - j| with dS = p (dP - D), written out densely."""
    q, k, v = _qkv(2, 2, 2, 6, 6, 4, seed=5)
    m = _slopes(2)
    out = alibi_attention(q, k, v, m)
    up = _up(out)
    (g,) = torch.autograd.grad(out, m, up)
    with torch.no_grad():
        s = q @ k.transpose(-1, -2) / 2.0
        i = torch.arange(6)
        dist = (i[:, None] - i[None, :]).abs().double()
        s = (s - m[:, None, None] * dist).masked_fill(i[None, :] > i[:, None], -math.inf)
        p = torch.softmax(s, -1)
        ds = p * (up @ v.transpose(-1, -2) - (up * (p @ v)).sum(-1, keepdim=True))
        torch.testing.assert_close(g, -(ds * dist).sum((0, 2, 3)), rtol=0, atol=1e-12)


def test_slope_grad_dtype_device_shape_and_scalar_slope():
    q, k, v = (t.detach() for t in _qkv(1, 3, 3, 5, 5, 4, seed=6))
    m32 = torch.tensor([0.3, 0.2, 0.1], dtype=torch.float32, requires_grad=True)
    (g,) = torch.autograd.grad(alibi_attention(q, k, v, m32).sum(), m32)
    assert g.dtype == torch.float32 and g.device == m32.device and g.shape == (3,)
    m64 = m32.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(alibi_attention(q, k, v, m64).sum(), m64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-6, atol=0)
    # one 0-d slope for every head: its gradient is the sum over heads
    m0 = torch.tensor(0.25, dtype=F64, requires_grad=True)
    mh = torch.full((3,), 0.25, dtype=F64, requires_grad=True)
    up = _up(alibi_attention(q, k, v, 0.25))
    (g0,) = torch.autograd.grad(alibi_attention(q, k, v, m0), m0, up)
    (gh,) = torch.autograd.grad(alibi_attention(q, k, v, mh), mh, up)
    assert g0.shape == () and torch.equal(g0, gh.sum())


def test_only_the_slopes_require_grad(monkeypatch):
    """With q, k, v constants only the slope pass runs (no attend_backward), and the gradient is the same."""
    q, k, v = _qkv(1, 2, 1, 6, 9, 4, seed=7)
    m = _slopes(2)
    up = _up(alibi_attention(q, k, v, m.detach()))
    full = torch.autograd.grad(alibi_attention(q, k, v, m, window=3.0), m, up)[0]
    calls = []
    for module in (toeplitz_module, fused_module):  # the two routes
        real = module.attend_backward
        monkeypatch.setattr(module, "attend_backward", lambda *a, _r=real, **kw: calls.append(1) or _r(*a, **kw))
    alone = torch.autograd.grad(alibi_attention(q.detach(), k.detach(), v.detach(), m, window=3.0), m, up)[0]
    assert not calls and torch.equal(alone, full)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_no_slope_grad_changes_nothing(backend, dtype, monkeypatch, torch_path):
    """Slopes that do not require grad (a float, a tensor without grad): no extra pass, and bitwise the same
    outputs and q/k/v gradients as with slopes that do."""
    if backend == "flash" and dtype == torch.bfloat16:
        backend = "auto"  # explicit flash refuses half types
    monkeypatch.setattr(toeplitz_module, "CHUNK_ELEMENTS", 64)
    q, k, v = _qkv(2, 4, 2, 9, 13, 8, dtype=dtype, seed=8)
    m = _slopes(4)
    calls = []
    real = toeplitz_module.attend_bias_grads
    monkeypatch.setattr(toeplitz_module, "attend_bias_grads", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    runs = []
    for slopes in (m, m.detach(), m.detach().tolist()):
        out = alibi_attention(q, k, v, slopes, window=4.0, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), _up(out))
        runs.append((out, *grads))
        if slopes is m:
            assert calls and m.grad is None  # the slope pass ran (its result is not asked for here)
            calls.clear()
        else:
            assert not calls
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(runs[0][0], alibi_attention(q, k, v, m.detach(), window=4.0, backend=backend))


def test_a_float_slope_gets_no_gradient():
    q, k, v = _qkv(1, 2, 2, 5, 5, 4)
    out = alibi_attention(q, k, v, 0.3)
    assert out.grad_fn is not None
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g is not None for g in grads)


def _rounding_bound(q, k, v, bias, weights, up, saved_out, unit):
    """For a parameter gradient ``sum dS * weight`` computed from inputs of unit roundoff ``unit`` with float32
    accumulation, against float64 on the same (rounded) inputs: ``(bound, fp32, g_saved)``, each ``(H, P)``.

    The saved output is rounded to the input dtype and ``D_i = dout_i . out_i`` uses it, so ``|err| <= u sum_i
    (|dout_i| . |out_i|) sum_j p_ij |w_ij|`` plus float32 arithmetic (``fp32``: a few roundings of ``sum |dS w|``).
    ``g_saved`` is that first-order effect exactly (dense float64 with the saved output in ``D``): what is left
    of the error is float32 arithmetic only. ``bias`` ``(H, Lq, Lk)`` (``-inf`` masked), ``weights`` ``(P, H, Lq,
    Lk)``, everything float64.
    """
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    p = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, -1)
    out = p @ vv
    dp = up @ vv.transpose(-1, -2)
    ds = p * (dp - (up * out).sum(-1, keepdim=True))
    ds_saved = p * (dp - (up * saved_out).sum(-1, keepdim=True))
    d_mag = (up.abs() * out.abs()).sum(-1)  # (B, H, Lq)
    w = weights[:, None]  # (P, 1, H, Lq, Lk)
    fp32 = 8 * 2.0**-23 * (ds.abs() * w.abs()).sum((1, 3, 4))
    bound = unit * (d_mag * (p * w.abs()).sum(-1)).sum((1, 3)) + fp32
    g_saved = (ds_saved * w).sum((1, 3, 4))
    return bound.T, fp32.T, g_saved.T


def _check_low_precision(g, g64, g_saved, bound, fp32):
    err = (g - g64).abs()
    assert (err <= bound).all(), (err, bound)
    assert (bound < 0.2 * g64.abs().max()).all()  # the bound is not vacuous
    # what is left is float32 arithmetic: the gradient is accumulated in float32, not in the input dtype
    assert ((g - g_saved).abs() <= fp32).all(), ((g - g_saved).abs(), fp32)


HALF = [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)]


@pytest.mark.parametrize("dtype, unit", HALF, ids=["bf16", "fp16"])
def test_low_precision_slope_grad_within_its_rounding_bound(dtype, unit, small_chunks):
    """Half inputs, float32 accumulation: the slope gradient equals the float64 one on the same (rounded) inputs
    up to the rounding of the saved output, and exactly the float64 value with that output up to float32."""
    hq, hkv, lq, lk = 4, 2, 12, 16
    q, k, v = (t.detach().requires_grad_() for t in _qkv(2, hq, hkv, lq, lk, 8, dtype=dtype, seed=9))
    m = _slopes(hq)
    out = alibi_attention(q, k, v, m, window=6.0)
    up = _up(out)  # in dtype, as autograd would pass it
    (g,) = torch.autograd.grad(out, m, up)
    assert g.dtype == F64
    q64, k64, v64, up64 = (t.detach().double() for t in (q, k, v, up))
    ref = alibi_attention_reference(q64, k64, v64, m, window=6.0)
    (g64,) = torch.autograd.grad(ref, m, up64)
    i = torch.arange(lq)[:, None] + (lk - lq)
    dist = (i - torch.arange(lk)[None, :]).abs().double()
    masked = (torch.arange(lk)[None, :] > i) | (dist > 6.0)
    bias = (-m.detach()[:, None, None] * dist).masked_fill(masked, -math.inf)
    bound, fp32, g_saved = _rounding_bound(q64, k64, v64, bias, -dist.expand(1, hq, lq, lk), up64,
                                           out.detach().double(), unit)  # fmt: skip
    _check_low_precision(g, g64, g_saved[:, 0], bound[:, 0], fp32[:, 0])


def _dense_masked_fill(q, k, v, m, *, causal, window):
    """Dense ALiBi where masked scores are set to -inf after the score (a masked non-finite key reaches nothing)."""
    return alibi_attention_reference(q, k, v, m, causal=causal, window=window)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_non_finite_key_slope_grad_is_nan_exactly_where_dense_autograd_is(backend):
    """A NaN key poisons the rows that keep it; the slope gradient of a head with such a row is NaN (dS is NaN on
    that row, as dense autograd has it), the other heads' slope gradients are the clean ones, bitwise."""
    lq, lk, j = 6, 14, 2  # queries at positions 8..13; key 2 is 6..11 away
    window = [7.0, 3.0, 20.0, 5.0]  # head 0 keeps key 2 from rows 8, 9; head 1 never; head 2 always; head 3 never
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, lq, lk, 4, seed=10))
    m = _slopes(4)
    bad_k = k.clone()
    bad_k[1, 0, j, 1] = math.nan  # batch row 1, kv head 0 (query heads 0 and 1)
    out = alibi_attention(q, bad_k, v, m, causal=False, window=window, backend=backend)
    up = _up(out)
    (g,) = torch.autograd.grad(out, m, up)
    assert torch.isnan(g).tolist() == [True, False, False, False]
    (clean,) = torch.autograd.grad(alibi_attention(q, k, v, m, causal=False, window=window, backend=backend), m, up)
    assert torch.equal(g[1:], clean[1:])
    ref = _dense_masked_fill(q, bad_k, v, m, causal=False, window=window)
    (g_ref,) = torch.autograd.grad(ref, m, up)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10, equal_nan=True)


def test_worker_pool_slope_grad_matches_sequential():
    q, k, v = (t.detach().float() for t in _qkv(3, 4, 2, 40, 40, 8, seed=11))
    m = torch.tensor([0.3, 0.1, 0.05, 0.5], requires_grad=True)
    up = torch.randn(3, 4, 40, 8, generator=torch.Generator().manual_seed(0))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(torch.autograd.grad(alibi_attention(q, k, v, m, window=[5.0, 50.0, 9.0, 0.0]), m, up)[0])
    finally:
        torch.set_num_threads(threads)
    # the pieces are independent: equal up to the BLAS's thread-dependent rounding of a float32 sum (as in
    # tests/ops/test_attention.py's worker-pool test; seen here after other tests changed the allocator's state)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


# ---- the built-in decay families -------------------------------------------------------------------------------

PARAMS = {
    "exponential": [[0.37], [0.11], [0.73], [0.05]],
    "power": [[0.5, 1.0], [2.0, 0.3], [1.3, 0.7], [0.8, 2.5]],
    "truncated-linear": [[4.5], [2.3], [7.7], [1.6]],  # non-integer widths: log k is smooth in w at every integer d
}


def test_registry_has_the_three_families():
    assert set(DECAY_FAMILIES) == {"exponential", "power", "truncated-linear"}
    assert decay_family("power").param_names == ("r1", "r2")


@pytest.mark.parametrize("family", list(PARAMS))
def test_closed_form_derivatives_equal_autodiff(family):
    fam = decay_family(family)
    d = torch.arange(12, dtype=F64)
    for row in PARAMS[family]:
        theta = torch.tensor(row, dtype=F64)
        jac = torch.autograd.functional.jacobian(lambda t: fam.log_k(d, t), theta)  # (12, P), autograd
        got = fam.grad_log_k(d, theta).T
        finite = torch.isfinite(fam.log_k(d, theta))
        torch.testing.assert_close(got[finite], jac[finite], rtol=1e-13, atol=1e-14)
        assert torch.equal(got[~finite], torch.zeros_like(got[~finite]))  # no gradient through the support's edge


@pytest.mark.parametrize("family", list(PARAMS))
def test_decay_bias_of_params_equals_the_decay_objects(family):
    fam = decay_family(family)
    theta = torch.tensor(PARAMS[family], dtype=F64)
    for causal in (True, False):
        got = decay_bias(family, 5, 11, params=theta, causal=causal)
        want = decay_bias([fam.make(*row) for row in PARAMS[family]], 5, 11, causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)  # -inf in the same places


@pytest.mark.parametrize("family", list(PARAMS))
@pytest.mark.parametrize("causal", [True, False])
def test_decay_gradcheck(family, causal, small_chunks):
    q, k, v = _qkv(1, 4, 2, 5, 8, 3, seed=12)
    theta = torch.tensor(PARAMS[family], dtype=F64, requires_grad=True)

    def f(a, b, c, t):
        return decay_attention(a, b, c, family, t, causal=causal)

    fast = not (causal and family == "power")  # the full Jacobian once, a random projection of it otherwise
    assert torch.autograd.gradcheck(f, (q, k, v, theta), eps=1e-6, atol=1e-7, fast_mode=fast)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("family", list(PARAMS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decay_grads_equal_dense_autograd(case, family, backend, chunking):
    hq, hkv, lq, lk, causal, _ = case
    q, k, v = _qkv(2, hq, hkv, lq, lk, 4, seed=13)
    theta = torch.tensor(PARAMS[family][:hq], dtype=F64, requires_grad=True)
    out = decay_attention(q, k, v, family, theta, causal=causal, backend=backend)
    ref = decay_attention_reference(q, k, v, family, theta, causal=causal)
    _assert_matches_reference(out, ref, (q, k, v, theta))


def test_shared_params_get_the_sum_over_heads_and_keep_their_dtype():
    q, k, v = (t.detach() for t in _qkv(1, 3, 3, 6, 6, 4, seed=14))
    shared = torch.tensor([0.7, 0.4], dtype=torch.float32, requires_grad=True)
    per_head = shared.detach().double()[None].repeat(3, 1).requires_grad_()
    up = _up(decay_attention(q, k, v, "power", [0.7, 0.4]))
    (gs,) = torch.autograd.grad(decay_attention(q, k, v, "power", shared), shared, up)
    (gh,) = torch.autograd.grad(decay_attention(q, k, v, "power", per_head), per_head, up)
    assert gs.dtype == torch.float32 and gs.shape == (2,)
    torch.testing.assert_close(gs.double(), gh.sum(0), rtol=1e-6, atol=1e-7)


def test_exponential_family_is_alibi():
    q, k, v = _qkv(2, 4, 2, 7, 10, 4, seed=15)
    m = _slopes(4)
    theta = m.detach()[:, None].clone().requires_grad_()
    for causal in (True, False):
        a = alibi_attention(q, k, v, m, causal=causal)
        b = decay_attention(q, k, v, "exponential", theta, causal=causal)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
        up = _up(a)
        ga = torch.autograd.grad(a, (q, k, v, m), up)
        gb = torch.autograd.grad(b, (q, k, v, theta), up)
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(x, y.reshape(x.shape), rtol=0, atol=1e-12)


def test_truncated_linear_visits_only_keys_within_its_width(monkeypatch, small_chunks):
    """Its support is the window: each kernel call's keys stay within the width (and the result is still exact)."""
    keys = []
    real = toeplitz_module.attend
    spy = lambda q, k, *a, **kw: keys.append(k.shape[-2]) or real(q, k, *a, **kw)  # noqa: E731
    monkeypatch.setattr(toeplitz_module, "attend", spy)
    q, k, v = _qkv(1, 2, 2, 40, 40, 4, seed=16)
    theta = torch.tensor([[3.5], [6.0]], dtype=F64, requires_grad=True)  # reach 3 and 5
    out = decay_attention(q, k, v, "truncated-linear", theta, causal=False)
    assert keys and max(keys) <= 2 + 2 * 5  # CHUNK_ELEMENTS = 24: 24 // 11 = 2 rows per chunk for reach 5
    torch.testing.assert_close(out, decay_attention_reference(q, k, v, "truncated-linear", theta, causal=False),
                               rtol=0, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("dtype, unit", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(PARAMS))
def test_low_precision_decay_param_grad_within_its_rounding_bound(family, dtype, unit, small_chunks):
    hq, lq, lk = 4, 10, 12
    q, k, v = (t.detach().requires_grad_() for t in _qkv(1, hq, 2, lq, lk, 8, dtype=dtype, seed=17))
    theta = torch.tensor(PARAMS[family], dtype=F64, requires_grad=True)
    out = decay_attention(q, k, v, family, theta)
    up = _up(out)
    (g,) = torch.autograd.grad(out, theta, up)
    q64, k64, v64, up64 = (t.detach().double() for t in (q, k, v, up))
    ref = decay_attention_reference(q64, k64, v64, family, theta)
    (g64,) = torch.autograd.grad(ref, theta, up64)
    fam = decay_family(family)
    i = torch.arange(lq)[:, None] + (lk - lq)
    dist = (i - torch.arange(lk)[None, :]).double()
    bias = decay_bias(family, lq, lk, params=theta.detach(), causal=True)
    weights = fam.grad_log_k(dist.abs(), theta.detach()[:, None, None, :]).masked_fill(torch.isinf(bias), 0.0)
    bound, fp32, g_saved = _rounding_bound(q64, k64, v64, bias, weights, up64, out.detach().double(), unit)
    _check_low_precision(g, g64, g_saved, bound, fp32)


@pytest.mark.parametrize(
    "family, params, exc, match",
    [
        ("power", [[0.5, 1.0]] * 3, ValueError, r"params .*shape \(2, 2\)"),
        ("power", [0.5], ValueError, r"params .*shape"),
        ("power", torch.ones(2, 2, 1), ValueError, r"params .*shape"),
        ("exponential", [-0.1], ValueError, r"params\[:, 0\] \(slope"),
        ("exponential", [math.nan], ValueError, r"slope"),
        ("power", [[0.5, 1.0], [0.5, 0.0]], ValueError, r"params\[:, 1\] \(r2"),
        ("power", [0.0, 1.0], ValueError, r"params\[:, 0\] \(r1"),
        ("truncated-linear", [0.5], ValueError, r"params\[:, 0\] \(width.*>= 1"),
        ("gaussian", [1.0], ValueError, r"family must be one of"),
        (3, [1.0], ValueError, r"family must be one of"),
        ("power", "r1", TypeError, r"params must be"),
        ("power", torch.ones(2, dtype=torch.long), TypeError, r"params must be a real floating-point"),
    ],
)
def test_decay_attention_bad_input(family, params, exc, match):
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 4, 4, 4))
    with pytest.raises(exc, match=match):
        decay_attention(q, k, v, family, params)


def test_decay_constructors_and_references_check_their_parameters():
    fam = decay_family("truncated-linear")
    with pytest.raises(ValueError, match="width must be finite and >= 1"):
        fam.make(0.9)
    with pytest.raises(ValueError, match="slope must be finite and >= 0"):
        decay_family("exponential").make(-1.0)
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 4, 4, 4))
    with pytest.raises(ValueError, match="params is required"):
        decay_attention_reference(q, k, v, "power")
    with pytest.raises(ValueError, match="params is only for a decay family name"):
        decay_attention_reference(q, k, v, fam.make(2.0), [2.0])


def test_alibi_attention_refuses_bad_trainable_slopes():
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 4, 4, 4))
    with pytest.raises(ValueError, match="slopes must be >= 0"):
        alibi_attention(q, k, v, torch.tensor([0.1, -0.1], requires_grad=True))
    with pytest.raises(ValueError, match="slopes must have one entry per head"):
        alibi_attention(q, k, v, torch.tensor([0.1, 0.1, 0.2], requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_keeps_the_graph_of_learnable_slopes(dtype: torch.dtype, causal: bool) -> None:
    """``alibi_bias`` with a slopes tensor requiring grad: the values of the fixed-slope bias bit for bit, and the
    gradient ``d/dm_h sum(W * bias) = -sum_{kept (i, j)} W_ij |i - j|`` (computed here from integer positions)."""
    from positional_lsh.ops.exact.bias import alibi_bias

    m = torch.tensor([0.5, 0.1, 0.013, 0.0037], dtype=torch.float64)
    window = torch.tensor([3.0, 7.5, 100.0, 2.0], dtype=torch.float64)
    lq, lk = 5, 40
    fixed = alibi_bias(lq, lk, m, causal=causal, window=window, q_offset=lk - lq, dtype=dtype)
    learn = m.clone().requires_grad_()
    bias = alibi_bias(lq, lk, learn, causal=causal, window=window, q_offset=lk - lq, dtype=dtype)
    assert torch.equal(bias.detach(), fixed)
    w = torch.randn(4, lq, lk, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (grad,) = torch.autograd.grad((bias.double().masked_fill(bias.isinf(), 0) * w).sum(), learn)
    rel = (torch.arange(lq)[:, None] + lk - lq) - torch.arange(lk)[None, :]
    kept = rel.abs()[None] <= window[:, None, None]
    if causal:
        kept &= rel >= 0
    expected = -(w * rel.abs() * kept).sum((-1, -2))
    # The upstream gradient reaches the float32/float64 product through the cast to ``dtype``: it is rounded to
    # ``dtype`` once per entry (relative eps/2), so the sum is within eps/2 * sum |W| |i - j| of the exact one.
    eps = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-15
    bound = eps / 2 * (w.abs() * rel.abs() * kept).sum((-1, -2)) + 1e-12
    assert ((grad - expected).abs() <= bound).all(), (grad, expected, bound)


@pytest.mark.parametrize("causal", [True, False])
def test_attend_bias_grads_is_dense_autograd_for_every_weight_in_one_pass(causal: bool) -> None:
    """``attend_bias_grads`` (several weights, one recomputation): each column is ``d L / d theta_p`` for the bias
    ``bias0 + sum_p theta_p W_p`` by dense float64 autograd, and equals :func:`attend_bias_grad` of that weight."""
    from positional_lsh.ops._engine.torch_attention import Grad, attend, attend_bias_grad, attend_bias_grads

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=F64)
    k, v = (torch.randn(2, 3, 7, 4, generator=g, dtype=F64) for _ in range(2))
    bias0 = torch.randn(5, 7, generator=g, dtype=F64)
    weights = [torch.randn(5, 7, generator=g, dtype=F64), torch.randn(2, 3, 5, 7, generator=g, dtype=F64)]
    theta = torch.zeros(2, 2, 3, 1, 1, dtype=F64, requires_grad=True)
    i, j = torch.arange(5)[:, None] + 2, torch.arange(7)[None, :]
    mask = torch.zeros(5, 7, dtype=F64).masked_fill(j > i, float("-inf")) if causal else 0.0
    s = q @ k.transpose(-1, -2) * 0.5 + bias0 + theta[0] * weights[0] + theta[1] * weights[1] + mask
    o = torch.softmax(s, -1) @ v
    dout = torch.randn(o.shape, generator=g, dtype=F64)
    (dense,) = torch.autograd.grad((o * dout).sum(), theta)
    out, lse = attend(q, k, v, causal=causal, scale=0.5, kernel="math", bias=bias0)
    got = attend_bias_grads(Grad(dout, q, k, v, out, lse), weights, causal=causal, scale=0.5, bias=bias0)
    assert got.shape == (2, 3, 2)
    torch.testing.assert_close(got, dense[..., 0, 0].permute(1, 2, 0), rtol=1e-10, atol=1e-12)
    for p, w in enumerate(weights):
        one = attend_bias_grad(Grad(dout, q, k, v, out, lse), w, causal=causal, scale=0.5, bias=bias0)
        assert torch.equal(one, got[..., p])
