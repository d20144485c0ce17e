"""positional_lsh.ops.kvcache: the KV-cache entry point plsh_attention_with_kvcache, positional LSH and exact /
windowed ALiBi, against the dense float64 oracles written from the definitions (conftest.naive_estimator with the
mean mask, conftest.naive_alibi with an n x n bias) and against the full ops on the whole sequence."""

from __future__ import annotations

import pytest
import torch

from positional_lsh import alibi_attention, dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops import _decode, kvcache
from positional_lsh.ops._decode import decode_rows
from positional_lsh.ops.kvcache import DecodeState, key_reach, plsh_attention_with_kvcache
from positional_lsh.ops.partitions.bounds import block_bounds

from conftest import naive_alibi, naive_estimator, naive_mean_mask

SLOPES = torch.tensor([0.5, 0.12, 0.03, 0.0])  # the last head has no bias: one block, pitch inf


def _qkv(lq: int, n: int, *, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q, k, torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)


def _oracle(q, k, v, parts, causal=True):
    return naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, k.shape[2]), causal=causal)


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
    ref = _oracle(q, k, v, parts, causal)
    # The decoding kernels (chunked), and the entry point (which hands a long chunk of queries to plsh_attention).
    torch.testing.assert_close(decode_rows(q, k, v, parts, causal=causal, query_chunk=chunk), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(plsh_attention_with_kvcache(q, k, v, parts, causal=causal), ref, rtol=0, atol=1e-12)
    dense = dense_plsh_attention(q, k, v, parts, causal=causal)
    torch.testing.assert_close(plsh_attention_with_kvcache(q, k, v, parts, causal=causal), dense, rtol=0, atol=1e-12)


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
    ref = _oracle(q, k, v, parts)
    live = n - lq - reach  # the first key a query of this call (or a later one) can reach
    out = plsh_attention_with_kvcache(q, k[:, :, live:], v[:, :, live:], parts, key_offset=live)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    first = int(block_bounds(parts.pitch, parts.shift, n, torch.tensor(n - lq))[0].min())  # the first key needed
    assert live <= first
    out = plsh_attention_with_kvcache(q, k[:, :, first:], v[:, :, first:], parts, key_offset=first)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="dropped"):
        plsh_attention_with_kvcache(q, k[:, :, first + 1 :], v[:, :, first + 1 :], parts, key_offset=first + 1)
    assert key_reach(sample_partitions(n, SLOPES, 2, generator=0)) is None  # slope 0: every key stays reachable
    capped = sample_partitions(n, torch.tensor([1e-3] * 4), 4, generator=0, max_block=16)
    assert key_reach(capped) <= 15
    # A backend or method that runs the full op needs every key: no reach.
    assert key_reach(parts, backend="math") == reach and key_reach(parts, method="multiplicity") == reach
    assert key_reach(parts, backend="flash") is None and key_reach(parts, method="samples") is None


def test_gradients_half_types_and_nonfinite_keys():
    n, lq = 48, 4
    parts = sample_partitions(n, SLOPES, 4, scheme="gamma", generator=1)
    q, k, v = _qkv(lq, n, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plsh_attention_with_kvcache(*leaves, parts).square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plsh_attention(*ref_leaves, partitions=parts).square().sum().backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-11)
    # float32 / bfloat16: accumulated in float32, returned in the input dtype.
    ref = _oracle(q, k, v, parts)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        qq, kk, vv = (x.to(dtype) for x in (q, k, v))
        out = plsh_attention_with_kvcache(qq, kk, vv, parts)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), _oracle(qq, kk, vv, parts), rtol=0, atol=tol)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol * 4)
    # A non-finite key: the rows that keep it are NaN, as in plsh_attention; the others are untouched.
    k_bad = k.clone()
    k_bad[0, 0, n - 2] = float("inf")
    got = plsh_attention_with_kvcache(q, k_bad, v, parts)
    want = plsh_attention(q, k_bad, v, partitions=parts)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-12)


def test_bad_input():
    n = 20
    parts = sample_partitions(n, SLOPES, 2, generator=0)
    q, k, v = _qkv(1, n)
    with pytest.raises(ValueError, match="seq_len"):
        plsh_attention_with_kvcache(q, k, v, parts.with_seq_len(n - 1))  # partitions for fewer positions than keys
    # More positions are fine: only the pitches and shifts are read, and the sequence ends with the last key.
    torch.testing.assert_close(
        plsh_attention_with_kvcache(q, k, v, parts.with_seq_len(n + 100)), plsh_attention_with_kvcache(q, k, v, parts)
    )
    bad_calls = [
        (ValueError, "heads", dict(q=q[:, :2], k=k[:, :1], v=v[:, :1])),
        (ValueError, "key_offset", dict(key_offset=-1)),
        (TypeError, "key_offset", dict(key_offset=1.0)),
        (TypeError, "partitions", dict(partitions="x")),
        (TypeError, "causal", dict(causal=1)),
        (TypeError, "keys_finite", dict(keys_finite=1)),
        (TypeError, "dtype", dict(q=q.float())),
        (ValueError, "exactly one", dict(partitions=None)),
        (ValueError, "exactly one", dict(slopes=SLOPES)),
        (ValueError, "window", dict(window=3.0)),
        (ValueError, "backend", dict(backend="cuda")),
        (ValueError, "method", dict(method="fast")),
        (TypeError, "state", dict(state=object())),
        (ValueError, "key_padding_mask", dict(key_padding_mask=torch.ones(2, n - 1, dtype=torch.bool))),
        (TypeError, "key_padding_mask", dict(key_padding_mask=torch.ones(2, n))),
    ]
    for error, match, change in bad_calls:
        args = dict(q=q, k=k, v=v, partitions=parts) | change
        qq, kk, vv, pp = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("partitions")
        with pytest.raises(error, match=match):
            plsh_attention_with_kvcache(qq, kk, vv, pp, **args)
    with pytest.raises(ValueError, match="method"):
        plsh_attention_with_kvcache(q, k, v, slopes=SLOPES, method="samples")  # ALiBi has no method
    with pytest.raises(ValueError, match="backend"):
        plsh_attention_with_kvcache(q, k, v, slopes=SLOPES, backend="triton")
    with pytest.raises(ValueError, match="slopes"):
        plsh_attention_with_kvcache(q, k, v, slopes=SLOPES[:2])
    with pytest.raises(ValueError, match="query_chunk"):
        decode_rows(q, k, v, parts, query_chunk=0)
    with pytest.raises(TypeError, match="partitions"):
        key_reach(None)


def test_backend_and_method_are_honoured_or_refused(monkeypatch):
    # "auto" / "math" / "multiplicity" are the decoding kernels; another choice runs plsh_attention with it on every
    # key, and is refused in one line when the cache dropped keys.
    n = 60
    parts = sample_partitions(n, SLOPES, 4, scheme="gamma", generator=2)
    q, k, v = _qkv(2, n, seed=9)
    ref = _oracle(q, k, v, parts)
    calls: list[dict] = []
    real = kvcache.plsh_attention
    monkeypatch.setattr(kvcache, "plsh_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for backend, method in (("auto", "auto"), ("math", "multiplicity"), ("auto", "multiplicity")):
        out = plsh_attention_with_kvcache(q, k, v, parts, backend=backend, method=method)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert calls == []
    for backend, method in (("math", "samples"), ("flash", "auto"), ("flash", "multiplicity")):
        out = plsh_attention_with_kvcache(q, k, v, parts, backend=backend, method=method)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        assert (calls[-1]["backend"], calls[-1]["method"]) == (backend, method)
    with pytest.raises(ValueError, match=r"^method='samples' .*dropped"):
        plsh_attention_with_kvcache(q, k[:, :, 1:], v[:, :, 1:], parts, key_offset=1, method="samples")
    with pytest.raises(ValueError, match=r"^backend='flash' .*dropped"):
        plsh_attention_with_kvcache(q, k[:, :, 1:], v[:, :, 1:], parts, key_offset=1, backend="flash")
    # ALiBi: "flash" runs alibi_attention with it (also on a windowed cache that dropped keys).
    win = torch.full((4,), 5.0, dtype=torch.float64)
    want = naive_alibi(q, k, v, SLOPES.double(), causal=True, window=win)
    for backend in ("auto", "math", "flash"):
        got = plsh_attention_with_kvcache(q, k[:, :, 50:], v[:, :, 50:], slopes=SLOPES, window=win, key_offset=50,
                                          backend=backend)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["plsh", "alibi"])
def test_key_padding_mask(kind):
    # Left padding: each row on its valid run, positions counted from its first valid key, padded query rows zero;
    # also on a cache that dropped keys (the mask covers the dropped positions too).
    n, lq = 40, 3
    q, k, v = _qkv(lq, n, b=3, seed=11)
    firsts = (0, 4, 38)  # the last row's queries: position 38, 39 valid, the first one padding
    mask = torch.ones(3, n, dtype=torch.bool)
    for row, f in enumerate(firsts):
        mask[row, :f] = False
    parts = sample_partitions(n, torch.tensor([0.5, 0.2, 0.3, 0.4]), 4, scheme="gamma", generator=6)
    win = torch.full((4,), 9.0, dtype=torch.float64)
    if kind == "plsh":
        call = dict(partitions=parts)
        reach = key_reach(parts)
    else:
        call = dict(slopes=SLOPES, window=win)
        reach = 9
    want = torch.zeros_like(q)
    for row, f in enumerate(firsts):
        qs = max(f, n - lq)
        qr, kr, vr = q[row : row + 1, :, qs - (n - lq) :], k[row : row + 1, :, f:], v[row : row + 1, :, f:]
        if kind == "plsh":
            ref = _oracle(qr, kr, vr, parts.with_seq_len(n - f))
        else:
            ref = naive_alibi(qr, kr, vr, SLOPES.double(), causal=True, window=win)
        want[row, :, qs - (n - lq) :] = ref[0]
    got = plsh_attention_with_kvcache(q, k, v, key_padding_mask=mask, **call)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    live = n - lq - reach
    got = plsh_attention_with_kvcache(q, k[:, :, live:], v[:, :, live:], key_offset=live, key_padding_mask=mask,
                                      **call)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    one = plsh_attention_with_kvcache(q[..., -1:, :], k, v, key_padding_mask=mask, state=DecodeState(), **call)
    torch.testing.assert_close(one, want[..., -1:, :], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# A decoder: one query per call, with a DecodeState
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme, b, hkv", [("discrete", 1, 2), ("gamma", 1, 4), ("fixed", 2, 2), ("discrete-strat", 2, 1)]
)
def test_state_equals_the_dense_oracle_token_by_token(scheme, b, hkv, monkeypatch):
    # One state decodes every position in turn (rebuilding its row at block boundaries, and its window of blocks
    # every 7 positions here), then positions out of order; each row equals the float64 oracle's, with every key
    # and with the keys a cache would have dropped; partitions of the same draw for another length reuse the state.
    monkeypatch.setattr(_decode, "DECODE_PLAN_WINDOW", 7)
    n = 48
    parts = sample_partitions(n, SLOPES, 5, scheme=scheme, generator=7)
    longer = parts.with_seq_len(2 * n)
    q, k, v = _qkv(n, n, b=b, hkv=hkv, seed=3)
    ref = _oracle(q, k, v, parts)
    reach = key_reach(parts)
    state, dropping = DecodeState(), DecodeState()
    for i in [*range(n), 30, 3, 47, 20]:
        row = q[:, :, i : i + 1]
        out = plsh_attention_with_kvcache(row, k[:, :, : i + 1], v[:, :, : i + 1], parts if i % 2 else longer,
                                          state=state)  # fmt: skip
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
        first = 0 if reach is None else max(0, i - reach)
        out = plsh_attention_with_kvcache(row, k[:, :, first : i + 1], v[:, :, first : i + 1], parts,
                                          key_offset=first, keys_finite=True, state=dropping)  # fmt: skip
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
    held = state._plsh
    plsh_attention_with_kvcache(q[:, :, :1], k[:, :, :1], v[:, :, :1], parts, state=state)
    assert state._plsh is held  # the same draw: the row is kept
    other = sample_partitions(n, SLOPES, 5, scheme=scheme, generator=8)
    out = plsh_attention_with_kvcache(q[:, :, -1:], k, v, other, state=state)  # another draw: a new row
    same = torch.equal(other.pitch, parts.pitch) and torch.equal(other.shift, parts.shift)  # ("fixed" draws alike)
    assert (state._plsh is held) == same
    torch.testing.assert_close(out, _oracle(q, k, v, other)[:, :, -1:], rtol=0, atol=1e-12)


def test_state_dtypes_gradients_and_nonfinite_keys():
    n = 40
    slopes = torch.tensor([0.5, 0.2, 0.1, 0.05])
    parts = sample_partitions(n, slopes, 4, scheme="gamma", generator=2)
    q, k, v = _qkv(3, n, seed=5)
    state = DecodeState()
    last = q[:, :, -1:]
    want = _oracle(q, k, v, parts)[:, :, -1:]
    # float32 / bfloat16: accumulated in float32, returned in the input dtype.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = plsh_attention_with_kvcache(last.to(dtype), k.to(dtype), v.to(dtype), parts, state=state)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    # Gradients (plain torch ops), against plsh_attention's on the whole sequence.
    leaves = [x.clone().requires_grad_() for x in (last, k, v)]
    plsh_attention_with_kvcache(*leaves, parts, state=state).square().sum().backward()
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
        got = plsh_attention_with_kvcache(last, k_bad, v, parts, state=state)
        ref = plsh_attention(q, k_bad, v, partitions=parts)[:, :, -1:]
        assert torch.equal(got.isnan(), ref.isnan()) and bool(got.isnan().any()) == (kv_head == head or pos > first)
        torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="dropped"):
        plsh_attention_with_kvcache(last, k[:, :, first + 1 :], v[:, :, first + 1 :], parts, key_offset=first + 1,
                                    state=state)  # fmt: skip
    with pytest.raises(ValueError, match="seq_len"):
        plsh_attention_with_kvcache(last, k, v, parts, key_offset=1, state=state)  # keys end past the partitions


@pytest.mark.parametrize("window", [None, 3.0, [2.0, 5.0, 9.0, 1.5]])
@pytest.mark.parametrize("b, hkv", [(1, 2), (2, 4)])
def test_alibi_equals_the_dense_oracle(window, b, hkv):
    n = 40
    slopes = torch.tensor([0.5, 0.12, 0.03, 0.0], dtype=torch.float64)
    win = None if window is None else torch.as_tensor(window, dtype=torch.float64).expand(4)
    q, k, v = _qkv(n, n, b=b, hkv=hkv, seed=6)
    ref = naive_alibi(q, k, v, slopes, causal=True, window=win)
    state = DecodeState()
    for i in [*range(n), 12, 39]:
        row = q[:, :, i : i + 1]
        out = plsh_attention_with_kvcache(row, k[:, :, : i + 1], v[:, :, : i + 1], slopes=slopes, window=window,
                                          state=state)  # fmt: skip
        torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
        if win is not None:  # the keys a windowed cache keeps
            first = max(0, i - int(win.max()))
            out = plsh_attention_with_kvcache(row, k[:, :, first : i + 1], v[:, :, first : i + 1], slopes=slopes,
                                              window=window, key_offset=first, state=state)  # fmt: skip
            torch.testing.assert_close(out, ref[:, :, i : i + 1], rtol=0, atol=1e-12)
    last = q[:, :, -1:]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = plsh_attention_with_kvcache(last.to(dtype), k.to(dtype), v.to(dtype), slopes=slopes, window=window,
                                          state=state)  # fmt: skip
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref[:, :, -1:], rtol=0, atol=tol)
    # Several queries, and a non-finite key the call is not told about: alibi_attention.
    got = plsh_attention_with_kvcache(q[:, :, -3:], k, v, slopes=slopes, window=window, state=state)
    torch.testing.assert_close(got, ref[:, :, -3:], rtol=0, atol=1e-12)
    k_bad = k.clone()
    k_bad[0, 0, n - 2] = float("nan")
    got = plsh_attention_with_kvcache(last, k_bad, v, slopes=slopes, window=window, state=state)
    want = alibi_attention(last, k_bad, v, slopes, causal=True, window=win)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=1e-12)
    first = 1 if win is None else n - 1 - int(win.max()) + 1
    with pytest.raises(ValueError, match="dropped keys"):
        plsh_attention_with_kvcache(last, k[:, :, first:], v[:, :, first:], slopes=slopes, window=window,
                                    key_offset=first, state=state)  # fmt: skip
