"""``key_padding_mask=`` of ``plsh_attention``, ``alibi_attention`` and ``decay_attention`` (ops/padding.py): each
batch row computed on its contiguous run of valid keys, positions counted from its first valid key, padded query
rows zero with zero gradients. Against the float64 oracles of conftest computed row by row on the run (outputs and
gradients), eager and compiled (``aot_eager``, ``fullgraph=True``), and the refusals of bad masks."""

from __future__ import annotations

import pytest
import torch

from positional_lsh import alibi_attention, decay_attention, plsh_attention, sample_partitions
from positional_lsh.ops.exact.reference import alibi_attention_reference
from positional_lsh.ops.padding import row_groups, valid_runs
from positional_lsh.ops.partitions.decays import decay_attention_reference

from conftest import naive_alibi, naive_estimator, naive_mean_mask

F64 = torch.float64
SLOPES4 = torch.tensor([0.5, 0.1, 0.0, 0.03])
N = 14
# (first, end) of each row's valid run: left padding, right padding, both, none, every key padded.
RUNS = [(3, N), (0, 9), (2, 11), (0, N), (0, 0)]


def _mask(runs=RUNS, n=N) -> torch.Tensor:
    mask = torch.zeros(len(runs), n, dtype=torch.bool)
    for row, (first, end) in enumerate(runs):
        mask[row, first:end] = True
    return mask


def _qkv(b, hq, hkv, lq, lk, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


def _by_row(q, k, v, runs, row_fn):
    """The reference: ``row_fn(q, k, v)`` of each row on its run (queries at valid positions), zeros elsewhere."""
    lq, lk = q.shape[2], k.shape[2]
    out = torch.zeros(q.shape, dtype=F64)
    for b, (first, end) in enumerate(runs):
        start = max(first, lk - lq)
        if end > start:
            qs = slice(start - (lk - lq), end - (lk - lq))
            out[b, :, qs] = row_fn(q[b : b + 1, :, qs], k[b : b + 1, :, first:end], v[b : b + 1, :, first:end])[0]
    return out


def _up(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out.dtype)


def _assert_same_grads(out, ref, inputs, atol):
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=0, atol=atol)
    up = _up(out)
    for a, b in zip(torch.autograd.grad(out, inputs, up), torch.autograd.grad(ref, inputs, up), strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=atol)


def test_valid_runs_and_row_groups():
    mask = _mask()
    assert valid_runs(mask) == RUNS
    groups = row_groups(mask, 5)  # queries: the last 5 positions (9..13)
    runs = {(g.keys.start, g.keys.stop): (g.rows.tolist(), g.queries) for g in groups}
    # (0, 9) has no query at a valid position, the empty row none at all: both left out (their output is zeros)
    assert runs == {(3, N): ([0], slice(0, 5)), (2, 11): ([2], slice(0, 2)), (0, N): ([3], slice(0, 5))}
    assert row_groups(None, 5) is None and row_groups(torch.ones(3, N, dtype=torch.bool), 5) is None


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
@pytest.mark.parametrize(("causal", "lq"), [(True, N), (False, N), (True, 6)])
def test_plsh_padding_equals_the_oracle_row_by_row(method, causal, lq):
    q, k, v = _qkv(len(RUNS), 4, 2, lq, N, 4, seed=1)
    parts = sample_partitions(N, SLOPES4, 3, generator=2)
    mask = _mask()

    def row(q, k, v):
        mbar = naive_mean_mask(parts.pitch, parts.shift, k.shape[2])  # positions counted from the first valid key
        return naive_estimator(q, k, v, mbar, causal=causal)

    out = plsh_attention(q, k, v, partitions=parts, causal=causal, method=method, key_padding_mask=mask)
    _assert_same_grads(out, _by_row(q, k, v, RUNS, row), (q, k, v), 1e-10)


def test_plsh_padding_padded_keys_never_reach_a_row():
    """A NaN key at a padded position changes nothing; padded query rows are zeros with zero gradients."""
    q, k, v = _qkv(len(RUNS), 4, 4, N, N, 4, seed=3)
    parts = sample_partitions(N, SLOPES4, 3, generator=4)
    mask = _mask()
    out = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask)
    with torch.no_grad():
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[0, :, 1], v2[1, :, 10] = float("nan"), float("inf")
    assert torch.equal(plsh_attention(q, k2, v2, partitions=parts, key_padding_mask=mask), out.detach())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), _up(out))
    for b, (first, end) in enumerate(RUNS):
        pad = torch.ones(N, dtype=torch.bool)
        pad[first:end] = False
        for x in (out, dq, dk, dv):
            assert not x[b, :, pad].any()


def test_plsh_all_valid_mask_is_no_mask_and_slopes_learn_row_by_row():
    q, k, v = _qkv(len(RUNS), 4, 2, N, N, 4, seed=5)
    m = SLOPES4.clone().requires_grad_()
    parts = sample_partitions(N, SLOPES4, 3, generator=6)
    plain = plsh_attention(q, k, v, m, partitions=parts)
    ones = plsh_attention(q, k, v, m, partitions=parts, key_padding_mask=torch.ones(len(RUNS), N, dtype=torch.bool))
    assert torch.equal(plain, ones)
    # The surrogate slope gradient with padding is the sum over rows of each row's own (unpadded) call.
    out = plsh_attention(q, k, v, m, partitions=parts, key_padding_mask=_mask())
    up = _up(out)
    (got,) = torch.autograd.grad(out, m, up)
    want = torch.zeros(4, dtype=m.dtype)
    for b, (first, end) in enumerate(RUNS):
        if end > first:
            s = slice(first, end)
            row = plsh_attention(q[b : b + 1, :, s], k[b : b + 1, :, s], v[b : b + 1, :, s], m,
                                 partitions=parts.with_seq_len(end - first))  # fmt: skip
            want += torch.autograd.grad(row, m, up[b : b + 1, :, s])[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("causal", "lq", "window"), [(True, N, None), (False, N, 3.0), (True, 6, [1.0, 2.5, 9.0, 0.0])]
)
def test_alibi_padding_equals_the_oracle_row_by_row(causal, lq, window):
    q, k, v = _qkv(len(RUNS), 4, 2, lq, N, 4, seed=7)
    m = torch.tensor([0.37, 0.11, 0.0, 0.73], dtype=F64, requires_grad=True)
    win = None if window is None else torch.as_tensor(window, dtype=F64).expand(4)
    out = alibi_attention(q, k, v, m, causal=causal, window=window, key_padding_mask=_mask())
    oracle = _by_row(q, k, v, RUNS, lambda a, b, c: naive_alibi(a, b, c, m.detach(), causal=causal, window=win))
    torch.testing.assert_close(out, oracle, rtol=0, atol=1e-12)
    dense = _by_row(q, k, v, RUNS, lambda a, b, c: alibi_attention_reference(a, b, c, m, causal=causal, window=window))
    _assert_same_grads(out, dense, (q, k, v, m), 1e-10)


@pytest.mark.parametrize("family", ["power", "truncated-linear"])
def test_decay_padding_equals_the_reference_row_by_row(family):
    q, k, v = _qkv(len(RUNS), 2, 1, N, N, 4, seed=8)
    theta = torch.tensor([[0.5, 1.0], [2.0, 0.3]] if family == "power" else [[4.0], [9.0]], dtype=F64)
    theta.requires_grad_()
    out = decay_attention(q, k, v, family, theta, key_padding_mask=_mask())
    ref = _by_row(q, k, v, RUNS, lambda a, b, c: decay_attention_reference(a, b, c, family, theta))
    _assert_same_grads(out, ref, (q, k, v, theta), 1e-10)


BAD_MASKS = [
    (torch.ones(len(RUNS), N), TypeError, "key_padding_mask must be a bool tensor"),
    (torch.ones(len(RUNS), N, dtype=torch.long), TypeError, "key_padding_mask must be a bool tensor"),
    ([[True] * N] * len(RUNS), TypeError, "key_padding_mask must be None or a bool tensor"),
    (torch.ones(len(RUNS), N - 1, dtype=torch.bool), ValueError, r"key_padding_mask must have shape \(batch, k_len\)"),
    (torch.ones(N, dtype=torch.bool), ValueError, r"key_padding_mask must have shape"),
    (torch.ones(len(RUNS), N, dtype=torch.bool, device="meta"), ValueError, "key_padding_mask must be on q's device"),
]  # fmt: skip


@pytest.mark.parametrize(("mask", "exc", "match"), BAD_MASKS)
def test_bad_masks_are_refused(mask, exc, match):
    q, k, v = (t.detach() for t in _qkv(len(RUNS), 2, 2, N, N, 4))
    for call in (
        lambda: plsh_attention(q, k, v, num_samples=2, generator=0, key_padding_mask=mask),
        lambda: alibi_attention(q, k, v, key_padding_mask=mask),
        lambda: decay_attention(q, k, v, "power", [0.5, 1.0], key_padding_mask=mask),
    ):
        with pytest.raises(exc, match=match):
            call()


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def test_compiled_padding_equals_eager():
    """One graph per op (fullgraph=True), the same outputs and gradients as eager mode, learned slopes included,
    and with a hole in the mask (the spans are read inside the op)."""
    q, k, v = _qkv(len(RUNS), 4, 2, N, N, 4, dtype=torch.float32, seed=9)
    parts = sample_partitions(N, SLOPES4, 3, generator=10)
    m = SLOPES4.clone().requires_grad_()
    mask = _mask()

    def both(q, k, v, m, mask):
        a = plsh_attention(q, k, v, m, partitions=parts, key_padding_mask=mask)
        b = alibi_attention(q, k, v, m, window=5.0, key_padding_mask=mask)
        c = decay_attention(q, k, v, "power", [0.5, 1.0], key_padding_mask=mask)
        return a, b, c

    eager = both(q, k, v, m, mask)
    compiled = _compiled(both)
    got = compiled(q, k, v, m, mask)
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
    up = [_up(x) for x in eager]
    want = torch.autograd.grad(eager, (q, k, v, m), up)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, m), up), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hole = mask.clone()
    hole[3, 5] = False  # a hole (tests/ops/test_masks.py): the same graph, the spans read inside the op
    for a, b in zip(compiled(q, k, v, m, hole), both(q, k, v, m, hole), strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_custom_ops_with_a_mask_pass_opcheck():
    """Schema, fakes, autograd registration and AOT dispatch of both ops with a padding mask, on the transposed
    (non-contiguous) q, k, v a projection gives."""
    from torch.library import opcheck

    from positional_lsh.ops._engine.op import plsh_backward, plsh_forward
    from positional_lsh.ops.exact.op import exact_backward, exact_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 10, 2, 8, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False
    parts = sample_partitions(10, SLOPES4, 4, generator=0)
    settings = (parts.scheme, None, True, 0.35, "auto", "flash", "flash")  # method, then each method's kernel
    tensors = (parts.pitch, parts.shift, parts.slopes)
    out, lse = plsh_forward(q, k, v, *tensors, *settings, key_padding_mask=valid)
    dout = torch.randn(out.shape, generator=g)
    qd, kd, vd = (x.detach() for x in (q, k, v))  # (the backward ops are not differentiated themselves)
    slopes = SLOPES4.clone().double().requires_grad_()
    window = torch.full((4,), 3.0, dtype=F64)
    eout, else_ = exact_forward(q, k, v, slopes, window, "alibi", True, 0.35, "auto", key_padding_mask=valid)
    fake_only = ("test_schema", "test_faketensor")  # (the full check, AOT dispatch included, takes seconds)
    exact_args = (window, "alibi", True, 0.35, "auto")
    cases = [
        (plsh_forward, (q, k, v, *tensors, *settings), {"key_padding_mask": valid}, None),
        (plsh_backward, (dout, qd, kd, vd, out.detach(), lse, *tensors, *settings, True), {"key_padding_mask": valid},
         fake_only),
        (exact_forward, (q, k, v, slopes, *exact_args), {"key_padding_mask": valid}, None),
        (exact_backward, (dout, qd, kd, vd, eout.detach(), else_, slopes.detach(), *exact_args, True, True),
         {"key_padding_mask": valid}, fake_only),
    ]  # fmt: skip
    for op, args, kwargs, utils in cases:
        result = opcheck(op, args, kwargs) if utils is None else opcheck(op, args, kwargs, test_utils=utils)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
