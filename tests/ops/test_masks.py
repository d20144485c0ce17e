"""Masks with holes and packed sequences (ops/padding.py; issue 34, items 24 and 25).

A masked key leaves the softmax; positions are counted from each row's first valid key, holes included, so the
blocks (and ALiBi's distances) stay where the positions are; query rows at masked positions, and rows without valid
keys, are zeros with zero gradients. ``cu_seqlens`` splits every row into documents, each its own sequence.

Every route is compared with float64 dense references written here from the definitions: positional LSH's oracle
``softmax(s + log Mbar) v`` with ``Mbar`` from conftest's naive loops and the masked keys at ``-inf``, and exact
ALiBi / decays through an explicit ``n x n`` bias; packed calls against the documents run one by one."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from positional_lsh import (
    alibi_attention,
    decay_attention,
    plsh_attention,
    plsh_attention_with_kvcache,
    sample_partitions,
)
from positional_lsh.ops.exact.weights import alibi_attention_weights, plsh_attention_weights
from positional_lsh.ops.padding import row_groups, segment_ids

from conftest import naive_mean_mask

F64 = torch.float64
SLOPES = torch.tensor([0.5, 0.1, 0.0, 0.03], dtype=F64)
N = 16


def _holes(b: int = 5, n: int = N, seed: int = 0) -> torch.Tensor:
    """Random masks with holes (about 30 % masked), plus a row with one valid key and a row without any."""
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[-2] = False
    mask[-2, n // 2] = True
    mask[-1] = False
    return mask


def _qkv(b, hq, hkv, lq, lk, d, *, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


def _dense(q, k, v, mask, bias_of, *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """The float64 dense reference: per batch row, positions counted from its first valid key, the additive
    ``bias_of(h, i, j)`` ``(H, Lq, n)`` (``i, j`` those positions), masked keys and ``j > i`` at ``-inf``, query
    rows at masked positions and rows without valid keys zero."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    rows = []
    for r in range(b):
        valid = mask[r]
        if not valid.any():
            rows.append(torch.zeros(hq, lq, d, dtype=F64))
            continue
        first = int(valid.nonzero()[0])
        i = torch.arange(lk - lq, lk)[:, None] - first  # query positions
        j = torch.arange(lk)[None, :] - first  # key positions (negative before the first valid key: masked)
        s = q[r] @ kk[r].transpose(-1, -2) * sc + bias_of(i, j)
        drop = ~valid[None, :].expand(lq, lk)
        if causal:
            drop = drop | (j > i)
        s = s.masked_fill(drop, float("-inf"))
        s = s.masked_fill(torch.isinf(s).all(-1, keepdim=True), 0.0)  # rows with nothing to attend to: zeroed below
        w = torch.softmax(s, dim=-1)
        out = w @ vv[r]
        rows.append(torch.where(valid[lk - lq :][None, :, None], out, 0.0))
    return torch.stack(rows)


def _plsh_bias(parts):
    mbar = naive_mean_mask(parts.pitch, parts.shift, parts.seq_len)  # (H, n, n), from the definition

    def bias(i, j):
        return torch.log(mbar[:, i.clamp(min=0), j.clamp(min=0)])

    return bias


def _alibi_bias(m, window=None):
    def bias(i, j):
        dist = (i - j).abs().to(F64)
        out = -m[:, None, None] * dist
        if window is not None:
            out = out.masked_fill(dist > window[:, None, None], float("-inf"))
        return out

    return bias


def _grads(out, inputs, seed=1):
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    return torch.autograd.grad(out, inputs, up)


def _assert_close_with_grads(out, ref, inputs, atol):
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=0, atol=atol)
    for a, b in zip(_grads(out, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------------------------------
# Holes, every route
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("method", ["samples", "multiplicity"])
@pytest.mark.parametrize(("causal", "lq"), [(True, N), (False, N), (True, 5)])
def test_plsh_holes_equal_the_oracle(method, causal, lq, backend):
    q, k, v = _qkv(5, 4, 2, lq, N, 4, seed=1)
    parts = sample_partitions(N, SLOPES, 3, generator=2)
    mask = _holes()
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, method=method, backend=backend,
                         key_padding_mask=mask)  # fmt: skip
    ref = _dense(q, k, v, mask, _plsh_bias(parts), causal=causal)
    _assert_close_with_grads(out, ref, (q, k, v), 1e-10)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_plsh_holes_learn_the_slopes_as_the_dense_surrogate(method):
    """The surrogate slope gradient with holes: the dense autograd of ``softmax(s + log Mbar - (m - m.detach())
    |i - j|) v`` with the masked keys at ``-inf``."""
    q, k, v = _qkv(5, 4, 4, N, N, 4, seed=3)
    m = SLOPES.clone().requires_grad_()
    parts = sample_partitions(N, SLOPES, 3, generator=4)
    mask = _holes(seed=5)
    out = plsh_attention(q, k, v, m, partitions=parts, method=method, key_padding_mask=mask)
    plsh_bias = _plsh_bias(parts)

    def bias(i, j):
        return plsh_bias(i, j) - (m - m.detach())[:, None, None] * (i - j).abs().to(F64)

    ref = _dense(q, k, v, mask, bias, causal=True)
    _assert_close_with_grads(out, ref, (q, k, v, m), 1e-10)


@pytest.mark.parametrize(
    ("causal", "lq", "window"), [(True, N, None), (False, N, 3.0), (True, 6, [1.0, 2.5, 9.0, 0.0])]
)
def test_alibi_holes_equal_the_dense_bias(causal, lq, window):
    q, k, v = _qkv(5, 4, 2, lq, N, 4, seed=7)
    m = torch.tensor([0.37, 0.11, 0.0, 0.73], dtype=F64, requires_grad=True)
    win = None if window is None else torch.as_tensor(window, dtype=F64).expand(4)
    mask = _holes(seed=8)
    for backend in ("flash", "math"):  # (the "fused" and the "banks" routes, ops/exact/alibi.py)
        out = alibi_attention(q, k, v, m, causal=causal, window=window, backend=backend, key_padding_mask=mask)
        ref = _dense(q, k, v, mask, _alibi_bias(m, win), causal=causal)
        _assert_close_with_grads(out, ref, (q, k, v, m), 1e-10)


@pytest.mark.parametrize("family", ["power", "truncated-linear"])
def test_decay_holes_equal_the_reference(family):
    q, k, v = _qkv(5, 2, 1, N, N, 4, seed=9)
    theta = torch.tensor([[0.5, 1.0], [2.0, 0.3]] if family == "power" else [[4.0], [9.0]], dtype=F64)
    theta.requires_grad_()
    mask = _holes(seed=10)
    out = decay_attention(q, k, v, family, theta, key_padding_mask=mask)

    def bias(i, j):  # log k_theta(|i - j|) from the families' definitions (per head)
        dist = (i - j).abs().to(F64)[None]
        if family == "power":
            return -theta[:, 0, None, None] * torch.log1p(theta[:, 1, None, None] * dist)
        width = theta[:, 0, None, None]
        return torch.where(dist < width, torch.log((1 - dist / width).clamp(min=1e-300)), float("-inf"))

    ref = _dense(q, k, v, mask, bias, causal=True)
    _assert_close_with_grads(out, ref, (q, k, v, theta), 1e-10)


def test_masked_positions_reach_nothing_and_are_zero():
    """NaN and inf at masked positions (queries, keys, values) change nothing; query rows at masked positions and
    rows without valid keys are zeros with zero gradients, on every op."""
    q, k, v = _qkv(5, 4, 4, N, N, 4, seed=11)
    mask = _holes(seed=12)
    parts = sample_partitions(N, SLOPES, 3, generator=13)
    calls = [
        lambda q, k, v: plsh_attention(q, k, v, partitions=parts, method="samples", key_padding_mask=mask),
        lambda q, k, v: plsh_attention(q, k, v, partitions=parts, method="multiplicity", key_padding_mask=mask),
        lambda q, k, v: alibi_attention(q, k, v, SLOPES, key_padding_mask=mask),
        lambda q, k, v: decay_attention(q, k, v, "power", [0.5, 1.0], key_padding_mask=mask),
    ]
    bad = ~mask[:, None, :, None]
    poisoned = [torch.where(bad, torch.tensor(float("nan"), dtype=F64), x.detach()) for x in (q, k, v)]
    for call in calls:
        out = call(q, k, v)
        assert torch.equal(call(*poisoned), out.detach())
        for x in (out, *_grads(out, (q, k, v))):
            assert not x.masked_select(bad.expand_as(x)).any()
            assert not x[-1].any()  # the row without valid keys


def test_all_valid_and_contiguous_masks_keep_their_meaning():
    """A mask without holes runs as before (each row on its run, no extra column): the same outputs as the
    contiguous row groups; and the groups of a holed mask carry their valid keys."""
    mask = _holes(seed=14)
    groups = row_groups(mask, N)
    assert groups is not None
    for g in groups:
        if g.valid is not None:
            assert torch.equal(g.valid, mask[g.rows][:, g.keys])
        else:
            assert mask[g.rows][:, g.keys].all()
    assert row_groups(torch.ones(3, N, dtype=torch.bool), N) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_holes_in_low_precision(dtype):
    """The masked keys' score (``-2^30 scale``) stays exact in every dtype's accumulation: float32 and half types
    against the float64 oracle, to their rounding."""
    q, k, v = _qkv(5, 4, 2, N, N, 8, dtype=dtype, seed=15)
    parts = sample_partitions(N, SLOPES, 4, generator=16)
    mask = _holes(seed=17)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    out = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask)
    ref = _dense(q, k, v, mask, _plsh_bias(parts), causal=True)
    torch.testing.assert_close(out, ref.to(dtype), rtol=0, atol=atol)
    out = alibi_attention(q, k, v, SLOPES, key_padding_mask=mask)
    ref = _dense(q, k, v, mask, _alibi_bias(SLOPES), causal=True)
    torch.testing.assert_close(out, ref.to(dtype), rtol=0, atol=atol)


def test_scores_too_large_to_mask_are_refused():
    q, k, v = (x.detach() for x in _qkv(5, 4, 4, N, N, 4, seed=18))
    mask = _holes(seed=19)
    huge = k * 1e9
    with pytest.raises(ValueError, match="key_padding_mask has holes"):
        alibi_attention(q, huge, v, SLOPES, key_padding_mask=mask)


@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("offset", [0, 4])
def test_kvcache_holes_equal_the_oracle(lq, offset):
    """The decode entry point with holes (a right-padded prompt continued by generate, a random mask), on the
    decoding kernels and on a cache that dropped its first keys: the dense oracles of the whole sequence."""
    q, k, v = _qkv(5, 4, 2, lq, N, 4, seed=20)
    mask = _holes(seed=21)
    mask[0] = True
    mask[0, 8:11] = False  # row 0: a prompt of 8 tokens right-padded to 11, then decoded tokens
    # dropped keys: blocks and a window short enough that no query needs them (short blocks: large slopes)
    slopes = SLOPES if offset == 0 else torch.tensor([2.0, 1.5, 1.0, 3.0], dtype=F64)
    window = None if offset == 0 else torch.full((4,), 3.0, dtype=F64)
    parts = sample_partitions(N, slopes, 3, generator=22)
    kc, vc = k[:, :, offset:], v[:, :, offset:]
    out = plsh_attention_with_kvcache(q, kc, vc, parts, key_offset=offset, key_padding_mask=mask)
    ref = _dense(q, k, v, mask, _plsh_bias(parts), causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    out = plsh_attention_with_kvcache(q, kc, vc, slopes=slopes, window=window, key_offset=offset,
                                      key_padding_mask=mask)  # fmt: skip
    ref = _dense(q, k, v, mask, _alibi_bias(slopes, window), causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_attention_weights_with_holes_are_the_ops_weights():
    q, k, v = (x.detach() for x in _qkv(5, 4, 4, 6, N, 4, seed=23))
    mask = _holes(seed=24)
    parts = sample_partitions(N, SLOPES, 3, generator=25)
    vv = v
    w = plsh_attention_weights(q, k, parts, key_padding_mask=mask)
    torch.testing.assert_close(w @ vv, plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask), atol=1e-12,
                               rtol=0)  # fmt: skip
    assert not w.masked_select(~mask[:, None, None, :].expand_as(w)).any()
    w = alibi_attention_weights(q, k, SLOPES, key_padding_mask=mask)
    torch.testing.assert_close(w @ vv, alibi_attention(q, k, v, SLOPES, key_padding_mask=mask), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------------------------------

CU = torch.tensor([0, 5, 6, 11, N])


def _one_by_one(q, k, v, call):
    """Each document of :data:`CU` run alone (its own positions and partitions), concatenated."""
    bounds = CU.tolist()
    return torch.cat([call(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], b - a) for a, b in itertools.pairwise(bounds)], 2)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_packed_plsh_equals_the_documents_one_by_one(method):
    q, k, v = _qkv(2, 4, 2, N, N, 4, seed=30)
    m = SLOPES.clone().requires_grad_()
    parts = sample_partitions(N, SLOPES, 3, generator=31)
    out = plsh_attention(q, k, v, m, partitions=parts, method=method, cu_seqlens=CU)

    def alone(q, k, v, n):
        return plsh_attention(q, k, v, m, partitions=parts.with_seq_len(n), method=method)

    _assert_close_with_grads(out, _one_by_one(q, k, v, alone), (q, k, v, m), 1e-12)
    # and against the oracle: each document's positions from 0, Mbar of its own length
    ref = _one_by_one(q, k, v, lambda q, k, v, n: _dense(q, k, v, torch.ones(2, n, dtype=torch.bool),
                                                         _plsh_bias(parts.with_seq_len(n)), causal=True))  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_packed_exact_ops_equal_the_documents_one_by_one():
    q, k, v = _qkv(2, 4, 2, N, N, 4, seed=32)
    m = SLOPES.clone().requires_grad_()
    out = alibi_attention(q, k, v, m, window=3.0, cu_seqlens=CU.to(torch.int32))
    ref = _one_by_one(q, k, v, lambda q, k, v, n: alibi_attention(q, k, v, m, window=3.0))
    _assert_close_with_grads(out, ref, (q, k, v, m), 1e-12)
    theta = torch.tensor([0.5, 1.0], dtype=F64, requires_grad=True)
    out = decay_attention(q, k, v, "power", theta, causal=False, cu_seqlens=CU)
    ref = _one_by_one(q, k, v, lambda q, k, v, n: decay_attention(q, k, v, "power", theta, causal=False))
    _assert_close_with_grads(out, ref, (q, k, v, theta), 1e-12)


def test_packed_with_a_mask_masks_within_documents():
    q, k, v = _qkv(3, 4, 4, N, N, 4, seed=33)
    parts = sample_partitions(N, SLOPES, 3, generator=34)
    mask = _holes(b=3, seed=35)
    out = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask, cu_seqlens=CU)
    bounds = CU.tolist()
    ref = torch.cat([
        _dense(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], _plsh_bias(parts.with_seq_len(b - a)),
               causal=True)
        for a, b in itertools.pairwise(bounds)
    ], 2)  # fmt: skip
    _assert_close_with_grads(out, ref, (q, k, v), 1e-10)


BAD_CU = [
    (torch.tensor([0, 5, 5, N]), ValueError, "strictly increasing"),
    (torch.tensor([1, N]), ValueError, "strictly increasing"),
    (torch.tensor([0, N - 1]), ValueError, "strictly increasing"),
    (torch.tensor([0, 9, 4, N]), ValueError, "strictly increasing"),
    (torch.tensor([[0, N]]), ValueError, "cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([0.0, N]), ValueError, "cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([N]), ValueError, "cu_seqlens must be a 1-D integer tensor"),
    ([0, N], TypeError, "cu_seqlens must be None or an integer tensor"),
]


@pytest.mark.parametrize(("cu", "exc", "match"), BAD_CU)
def test_bad_cu_seqlens_are_refused(cu, exc, match):
    q, k, v = (x.detach() for x in _qkv(2, 2, 2, N, N, 4))
    for call in (
        lambda: plsh_attention(q, k, v, num_samples=2, generator=0, cu_seqlens=cu),
        lambda: alibi_attention(q, k, v, cu_seqlens=cu),
        lambda: decay_attention(q, k, v, "power", [0.5, 1.0], cu_seqlens=cu),
    ):
        with pytest.raises(exc, match=match):
            call()


def test_segment_ids_mark_bad_values_for_the_op():
    """Under torch.compile the values of cu_seqlens are checked inside the op: segment_ids marks them."""
    ids = segment_ids(None, torch.tensor([0, 9, 4, N]), 2, N, torch.device("cpu"))
    assert ids is not None and bool((ids == -1).all())
    with pytest.raises(ValueError, match="cu_seqlens"):
        row_groups(ids, N)


def test_compiled_holes_and_packing_equal_eager():
    """One graph (fullgraph=True) with a holed mask and cu_seqlens; bad cu_seqlens are refused when it runs."""
    q, k, v = (x.detach().float() for x in _qkv(3, 4, 2, N, N, 4, seed=36))
    parts = sample_partitions(N, SLOPES, 3, generator=37)
    mask = _holes(b=3, seed=38)

    def both(q, k, v, mask, cu):
        a = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask, cu_seqlens=cu)
        b = alibi_attention(q, k, v, SLOPES, key_padding_mask=mask, cu_seqlens=cu)
        return a, b

    torch._dynamo.reset()
    compiled = torch.compile(both, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, v, mask, CU), both(q, k, v, mask, CU), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cu_seqlens"):
        compiled(q, k, v, mask, torch.tensor([0, 9, 4, N]))
    torch._dynamo.reset()


def test_triton_route_with_holes_and_packing():
    """The Triton kernels (the interpreter without a GPU) take the holed span's extra column."""
    pytest.importorskip("triton")
    from positional_lsh.ops._engine.triton.host import triton_refusal

    q, k, v = (x.detach().float() for x in _qkv(2, 2, 2, N, N, 16, seed=39))
    if triton_refusal(q) is not None:
        pytest.skip(f"the Triton kernels refuse these inputs here: {triton_refusal(q)}")
    parts = sample_partitions(N, SLOPES[:2], 3, generator=40)
    mask = _holes(b=2, seed=41)
    out = plsh_attention(q, k, v, partitions=parts, backend="triton", key_padding_mask=mask, cu_seqlens=CU)
    ref = plsh_attention(q, k, v, partitions=parts, backend="math", key_padding_mask=mask, cu_seqlens=CU)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
