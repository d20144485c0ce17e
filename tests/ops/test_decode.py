"""positional_lsh.ops.decode: the estimator for the last queries of a sequence on their own blocks' keys, against the
dense float64 oracle written from the definition (conftest.naive_estimator) and against plsh_attention."""

from __future__ import annotations

import pytest
import torch

from positional_lsh import alibi_attention, plsh_attention, sample_partitions
from positional_lsh.ops import decode
from positional_lsh.ops.decode import AlibiDecodePlan, DecodePlan, key_reach, plsh_decode
from positional_lsh.ops.partitions.bounds import block_bounds

from conftest import naive_alibi, naive_estimator, naive_mean_mask

SLOPES = torch.tensor([0.5, 0.12, 0.03, 0.0])  # the last head has no bias: one block, pitch inf


def _qkv(lq: int, n: int, *, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q, k, torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(
    "scheme, causal, lq, chunk",
    [
        ("discrete", True, 1, 64),
        ("gamma", True, 1, 64),
        ("discrete", True, 7, 3),
        ("gamma", False, 7, 3),
        ("fixed", True, 40, 64),
        ("discrete-strat", False, 40, 16),
    ],
)
def test_equals_the_dense_oracle(scheme, causal, lq, chunk):
    n = 40
    parts = sample_partitions(n, SLOPES, 5, scheme=scheme, generator=3)
    q, k, v = _qkv(lq, n)
    ref = naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, n), causal=causal)
    out = plsh_decode(q, k, v, parts, causal=causal, query_chunk=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, plsh_attention(q, k, v, partitions=parts, causal=causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_dropped_keys_and_key_reach(scheme):
    # Keys more than key_reach positions before the first query are never in one of its blocks: dropping them gives
    # the same rows; dropping one more key is refused.
    n, lq = 300, 3
    slopes = torch.tensor([0.5, 0.2, 0.1, 0.05])
    parts = sample_partitions(n, slopes, 6, scheme=scheme, generator=5)
    reach = key_reach(parts)
    assert reach is not None and 0 < reach < n - lq
    labels = parts.labels()  # (T, H, n)
    pos = torch.arange(n)
    for i in (n - lq, n - 1):  # no sample shares a block between i and a key more than `reach` before it
        same = (labels == labels[..., i : i + 1]).any(0).any(0)
        assert not same[pos < i - reach].any()
    q, k, v = _qkv(lq, n, seed=2)
    ref = plsh_attention(q, k, v, partitions=parts)  # on every key (plsh_decode = the oracle: the test above)
    live = n - lq - reach  # the first key a query of this call (or a later one) can reach
    out = plsh_decode(q, k[:, :, live:], v[:, :, live:], parts, key_offset=live)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    first = int(block_bounds(parts.pitch, parts.shift, n, torch.tensor(n - lq))[0].min())  # the first key needed
    assert live <= first
    out = plsh_decode(q, k[:, :, first:], v[:, :, first:], parts, key_offset=first)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="dropped"):
        plsh_decode(q, k[:, :, first + 1 :], v[:, :, first + 1 :], parts, key_offset=first + 1)
    assert key_reach(sample_partitions(n, SLOPES, 2, generator=0)) is None  # slope 0: every key stays reachable
    capped = sample_partitions(n, torch.tensor([1e-3] * 4), 4, generator=0, max_block=16)
    assert key_reach(capped) <= 15


def test_gradients_half_types_and_nonfinite_keys():
    n, lq = 48, 4
    parts = sample_partitions(n, SLOPES, 4, scheme="gamma", generator=1)
    q, k, v = _qkv(lq, n, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plsh_decode(*leaves, parts).square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plsh_attention(*ref_leaves, partitions=parts).square().sum().backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-11)
    # float32 / bfloat16: accumulated in float32, returned in the input dtype.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = plsh_decode(q.to(dtype), k.to(dtype), v.to(dtype), parts)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), plsh_decode(q, k, v, parts), rtol=0, atol=tol)
    # A non-finite key: the rows that keep it are NaN, as in plsh_attention; the others are untouched.
    k_bad = k.clone()
    k_bad[0, 0, n - 2] = float("inf")
    got = plsh_decode(q, k_bad, v, parts)
    want = plsh_attention(q, k_bad, v, partitions=parts)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-12)


def test_bad_input():
    n = 20
    parts = sample_partitions(n, SLOPES, 2, generator=0)
    q, k, v = _qkv(1, n)
    with pytest.raises(ValueError, match="seq_len"):
        plsh_decode(q, k, v, parts.with_seq_len(n - 1))  # partitions for fewer positions than the keys cover
    # More positions are fine: only the pitches and shifts are read, and the sequence ends with the last key.
    torch.testing.assert_close(plsh_decode(q, k, v, parts.with_seq_len(n + 100)), plsh_decode(q, k, v, parts))
    with pytest.raises(ValueError, match="heads"):
        plsh_decode(q[:, :2], k[:, :1], v[:, :1], parts)
    with pytest.raises(ValueError, match="key_offset"):
        plsh_decode(q, k, v, parts, key_offset=-1)
    with pytest.raises(TypeError, match="key_offset"):
        plsh_decode(q, k, v, parts, key_offset=1.0)
    with pytest.raises(ValueError, match="query_chunk"):
        plsh_decode(q, k, v, parts, query_chunk=0)
    with pytest.raises(TypeError, match="partitions"):
        plsh_decode(q, k, v, "x")
    with pytest.raises(TypeError, match="causal"):
        plsh_decode(q, k, v, parts, causal=1)
    with pytest.raises(TypeError, match="dtype"):
        plsh_decode(q.float(), k, v, parts)
    with pytest.raises(TypeError, match="partitions"):
        key_reach(None)


# --------------------------------------------------------------------------------------------------
# The decoder's plans: one query row per call
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme, b, hkv", [("discrete", 1, 2), ("gamma", 1, 4), ("fixed", 2, 2), ("discrete-strat", 2, 1)]
)
def test_decode_plan_equals_the_dense_oracle_token_by_token(scheme, b, hkv, monkeypatch):
    # One plan decodes every position in turn (rebuilding its row at block boundaries, and its window of blocks
    # every 7 positions here), then positions out of order; each row equals the float64 oracle's, with every key
    # and with the keys a cache would have dropped.
    monkeypatch.setattr(decode, "DECODE_PLAN_WINDOW", 7)
    n = 48
    parts = sample_partitions(n, SLOPES, 5, scheme=scheme, generator=7)
    q, k, v = _qkv(n, n, b=b, hkv=hkv, seed=3)
    ref = naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, n), causal=True)
    reach = key_reach(parts.with_seq_len(n))
    plan, dropping = DecodePlan(parts), DecodePlan(parts)
    for i in [*range(n), 30, 3, 47, 20]:
        row = q[:, :, i : i + 1]
        out = plan.attend(row, k[:, :, : i + 1], v[:, :, : i + 1])
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
        first = 0 if reach is None else max(0, i - reach)
        out = dropping.attend(row, k[:, :, first : i + 1], v[:, :, first : i + 1], key_offset=first, keys_finite=True)
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)


def test_decode_plan_falls_back_dtypes_gradients_and_refusals():
    n = 40
    slopes = torch.tensor([0.5, 0.2, 0.1, 0.05])
    parts = sample_partitions(n, slopes, 4, scheme="gamma", generator=2)
    q, k, v = _qkv(3, n, seed=5)
    plan = DecodePlan(parts)
    # More than one query: plsh_decode.
    torch.testing.assert_close(plan.attend(q, k, v), plsh_decode(q, k, v, parts), rtol=0, atol=0)
    last = q[:, :, -1:]
    want = plsh_decode(last, k, v, parts)
    # float32 / bfloat16: accumulated in float32, returned in the input dtype.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = plan.attend(last.to(dtype), k.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    # Gradients (plain torch ops), against plsh_attention's on the whole sequence.
    leaves = [x.clone().requires_grad_() for x in (last, k, v)]
    plan.attend(*leaves).square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plsh_attention(*ref_leaves, partitions=parts)[:, :, -1:].square().sum().backward()
    torch.testing.assert_close(leaves[0].grad, ref_leaves[0].grad[:, :, -1:], rtol=0, atol=1e-11)
    for a, r in zip(leaves[1:], ref_leaves[1:], strict=True):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=1e-11)
    # A non-finite key: scanned for unless the caller vouches for the keys; then the rows that keep it are NaN.
    starts = block_bounds(parts.pitch, parts.shift, n, torch.tensor(n - 1))[0]  # (T, H)
    first = int(starts.min())
    head = int(starts.amin(0).argmin()) // 2  # the key head of the query head that reaches farthest back
    for pos, kv_head in ((n - 2, 0), (first, head), (first, 1 - head)):  # kept by all; by one head; by none
        k_bad = k.clone()
        k_bad[1, kv_head, pos] = float("inf")
        got, ref = plan.attend(last, k_bad, v), plsh_decode(last, k_bad, v, parts)
        assert torch.equal(got.isnan(), ref.isnan()) and bool(got.isnan().any()) == (kv_head == head or pos > first)
        torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="dropped"):
        plan.attend(last, k[:, :, first + 1 :], v[:, :, first + 1 :], key_offset=first + 1)
    with pytest.raises(ValueError, match="seq_len"):
        plan.attend(last, k, v, key_offset=1)  # the keys would end past the partitions' positions
    with pytest.raises(ValueError, match="key_offset"):
        plan.attend(last, k, v, key_offset=-1)
    with pytest.raises(TypeError, match="partitions"):
        DecodePlan("x")


@pytest.mark.parametrize("window", [None, 3.0, [2.0, 5.0, 9.0, 1.5]])
@pytest.mark.parametrize("b, hkv", [(1, 2), (2, 4)])
def test_alibi_decode_plan_equals_the_dense_oracle(window, b, hkv):
    n = 40
    slopes = torch.tensor([0.5, 0.12, 0.03, 0.0], dtype=torch.float64)
    win = None if window is None else torch.as_tensor(window, dtype=torch.float64).expand(4)
    q, k, v = _qkv(n, n, b=b, hkv=hkv, seed=6)
    ref = naive_alibi(q, k, v, slopes, causal=True, window=win)
    plan = AlibiDecodePlan(slopes, window)
    for i in [*range(n), 12, 39]:
        row = q[:, :, i : i + 1]
        out = plan.attend(row, k[:, :, : i + 1], v[:, :, : i + 1])
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
        if win is not None:  # the keys a windowed cache keeps
            first = max(0, i - int(win.max()))
            out = plan.attend(row, k[:, :, first : i + 1], v[:, :, first : i + 1], key_offset=first)
            torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
    last = q[:, :, -1:]
    out = plan.attend(last.float(), k.float(), v.float())
    torch.testing.assert_close(out.double(), ref[:, :, -1:], rtol=0, atol=1e-5)
    # Several queries, and a non-finite key the plan is not told about: alibi_attention.
    torch.testing.assert_close(plan.attend(q[:, :, -3:], k, v), ref[:, :, -3:], rtol=0, atol=1e-12)
    k_bad = k.clone()
    k_bad[0, 0, n - 2] = float("nan")
    got = plan.attend(last, k_bad, v)
    want = alibi_attention(last, k_bad, v, slopes, causal=True, window=win)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-12)
    if win is None:
        with pytest.raises(ValueError, match="dropped keys"):
            plan.attend(last, k[:, :, 1:], v[:, :, 1:], key_offset=1)
    else:
        first = n - 1 - int(win.max())
        with pytest.raises(ValueError, match="dropped keys"):
            plan.attend(last, k[:, :, first + 1 :], v[:, :, first + 1 :], key_offset=first + 1)


def test_alibi_decode_plan_settings():
    assert AlibiDecodePlan(0.1, 4.5, num_heads=3).reach == 4
    assert AlibiDecodePlan(torch.tensor([0.1, 0.2])).reach is None
    with pytest.raises(ValueError, match="num_heads"):
        AlibiDecodePlan(0.1)
    with pytest.raises(ValueError, match="slopes"):
        AlibiDecodePlan(torch.tensor([0.1, 0.2])).attend(*_qkv(1, 5))  # 2 slopes, 4 heads
