"""The attention weights of a call (``ops/exact/weights.py``) against float64 dense computations written here, and
against the ops' own outputs (weights @ v is the op's output); ``weighted_values`` (the output computed from the
weights, what ``output_attentions=True`` returns) against float64 references of the values and of the ``q, k, v``
and slope gradients, and against the ops' own gradients for every method."""

from __future__ import annotations

import pytest
import torch

import positional_lsh as plsh
from positional_lsh.ops.exact import weights as weights_module
from positional_lsh.ops.exact.reference import alibi_attention_reference, dense_plsh_attention
from positional_lsh.ops.exact.weights import alibi_attention_weights, plsh_attention_weights, weighted_values


def _qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, lq, d, generator=g),
        torch.randn(b, hkv, lk, d, generator=g),
        torch.randn(b, hkv, lk, d, generator=g),
    )


def _apply(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    vv = v.double().repeat_interleave(w.shape[1] // v.shape[1], dim=1)
    return torch.matmul(w.double(), vv)


def _alibi64(q: torch.Tensor, k: torch.Tensor, slopes: torch.Tensor, window: float | None = None) -> torch.Tensor:
    """softmax(s - m |i - j|) with the causal mask (queries aligned to the last keys), float64, written out."""
    lq, lk = q.shape[-2], k.shape[-2]
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    s = s - slopes.double()[:, None, None] * (i - j).abs()
    drop = j > i if window is None else (j > i) | ((i - j) > window)
    return torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1)


@pytest.mark.parametrize("lq", [12, 5, 1])
def test_alibi_weights_equal_float64(lq: int) -> None:
    q, k, v = _qkv(2, 4, 2, lq, 12)
    slopes = plsh.alibi_slopes(4)
    for window in (None, 3.0):
        w = alibi_attention_weights(q, k, slopes, window=window)
        assert w.shape == (2, 4, lq, 12) and w.dtype == torch.float32
        torch.testing.assert_close(w.double(), _alibi64(q, k, slopes, window), atol=1e-6, rtol=1e-5)
        ref = alibi_attention_reference(q.double(), k.double(), v.double(), slopes, window=window)
        torch.testing.assert_close(_apply(w, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lq", [16, 6])
def test_plsh_weights_equal_float64(lq: int) -> None:
    q, k, v = _qkv(2, 4, 4, lq, 16)
    parts = plsh.sample_partitions(16, plsh.alibi_slopes(4), 8, generator=0)
    w = plsh_attention_weights(q, k, parts)
    mbar = parts.mean_mask()[:, 16 - lq :, :]  # float64
    s = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    causal = torch.arange(16)[None, :] > (torch.arange(lq)[:, None] + 16 - lq)
    want = torch.softmax((s + mbar.log()).masked_fill(causal, float("-inf")), dim=-1)
    torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=1e-5)
    assert bool((w[..., mbar.expand_as(w) == 0] == 0).all())  # keys never in the query's block: weight 0
    oracle = dense_plsh_attention(q.double(), k.double(), v.double(), parts)
    torch.testing.assert_close(_apply(w, v), oracle, atol=1e-5, rtol=1e-5)
    out = plsh.plsh_attention(q, k, v, partitions=parts)
    torch.testing.assert_close(_apply(w, v).float(), out, atol=1e-5, rtol=1e-4)


def test_padding_rows_alone_and_zeros() -> None:
    """A left-padded row's weights are those of its valid run alone; padded keys weigh 0, padded queries are 0."""
    q, k, v = _qkv(2, 4, 2, 16, 16)
    slopes = plsh.alibi_slopes(4)
    parts = plsh.sample_partitions(16, slopes, 8, generator=1)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :5] = False
    for w, alone in [
        (plsh_attention_weights(q, k, parts, key_padding_mask=mask),
         plsh_attention_weights(q[1:, :, 5:], k[1:, :, 5:], parts.with_seq_len(11))),
        (alibi_attention_weights(q, k, slopes, key_padding_mask=mask),
         alibi_attention_weights(q[1:, :, 5:], k[1:, :, 5:], slopes)),
    ]:  # fmt: skip
        torch.testing.assert_close(w[1:, :, 5:, 5:], alone)
        assert bool((w[1, :, :, :5] == 0).all()) and bool((w[1, :, :5] == 0).all())
        torch.testing.assert_close(w[1, :, 5:].sum(-1), torch.ones(4, 11))
    out = plsh.plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask)
    w = plsh_attention_weights(q, k, parts, key_padding_mask=mask)
    torch.testing.assert_close(_apply(w, v).float(), out, atol=1e-5, rtol=1e-4)


def test_key_offset_is_the_dropped_prefix() -> None:
    """``key_offset``: the weights over the kept keys equal the full call's, renormalized over the kept keys when
    the dropped ones weigh 0 (a window shorter than the offset)."""
    q, k, _ = _qkv(1, 2, 2, 1, 20)
    slopes = plsh.alibi_slopes(2)
    full = alibi_attention_weights(q, k, slopes, window=4.0)
    cut = alibi_attention_weights(q, k[:, :, 8:], slopes, window=4.0, key_offset=8)
    torch.testing.assert_close(cut, full[..., 8:])


def test_too_large_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2**14 + 1  # n^2 > MAX_DENSE_ELEMENTS: refused before anything n x n is built
    q = torch.zeros(1, 1, n, 1)
    with pytest.raises(ValueError, match=r"alibi_attention_weights would materialize .* attention weights") as e:
        alibi_attention_weights(q, q, 0.5)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(weights_module, "MAX_DENSE_ELEMENTS", 100)
    parts = plsh.sample_partitions(16, plsh.alibi_slopes(1), 2, generator=0)
    small = torch.zeros(1, 1, 16, 4)
    with pytest.raises(ValueError, match="plsh_attention_weights would materialize"):
        plsh_attention_weights(small, small, parts)


def test_bad_arguments() -> None:
    q, k, _ = _qkv(1, 2, 2, 4, 4)
    parts = plsh.sample_partitions(4, plsh.alibi_slopes(2), 2, generator=0)
    with pytest.raises(ValueError, match="partitions"):
        plsh_attention_weights(q, k, parts.with_seq_len(3))
    with pytest.raises(TypeError, match="partitions"):
        plsh_attention_weights(q, k, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_padding_mask"):
        alibi_attention_weights(q, k, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_offset"):
        alibi_attention_weights(q, k, key_offset=-1)


def _leaves(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _grads(out: torch.Tensor, g: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * g).sum(), xs))


def _reference64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_bias: torch.Tensor, keep: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """float64 ``softmax(z) v`` with ``z = s + log_bias`` on the kept pairs, written out, and the gradients of
    ``sum(out * g)`` with respect to ``q, k, v`` and the slopes' ``-sum_{b,i,j} dz[b,h,i,j] |i - j|`` (``dz`` from
    autograd on ``z``: exact ALiBi's slope gradient, and positional LSH's surrogate, evaluated with the call's own
    score gradient)."""
    q, k, v = _leaves(q.double(), k.double(), v.double())
    hq = q.shape[1]
    kk, vv = (x.repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
    z = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5 + log_bias
    z.retain_grad()
    out = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1) @ vv
    (out * g).sum().backward()
    lq, lk = q.shape[-2], k.shape[-2]
    dist = ((torch.arange(lq)[:, None] + lk - lq) - torch.arange(lk)[None, :]).abs().double()
    assert z.grad is not None and q.grad is not None and k.grad is not None and v.grad is not None
    dm = -(z.grad.masked_fill(~keep, 0.0) * dist).sum(dim=(0, 2, 3))
    return out.detach(), [q.grad, k.grad, v.grad, dm]


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_weighted_values_are_the_estimator_and_its_gradients(method: str) -> None:
    """``weighted_values(plsh_attention_weights(...), v)``: the op's output and its ``q, k, v`` and (surrogate)
    slope gradients, for both methods, against a float64 reference written here (float64: within 1e-10)."""
    q, k, v = (x.double() for x in _qkv(2, 4, 2, 16, 16))
    slopes = plsh.alibi_slopes(4).double()
    parts = plsh.sample_partitions(16, slopes, 4, generator=3)
    mbar = parts.mean_mask()
    causal = torch.arange(16)[None, :] <= torch.arange(16)[:, None]
    keep = (mbar > 0) & causal
    g = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want, want_grads = _reference64(q, k, v, mbar.log(), keep.expand(2, 4, 16, 16), g)
    for path in ("weights", "op"):
        xs = _leaves(q, k, v, slopes)
        if path == "weights":
            out = weighted_values(plsh_attention_weights(xs[0], xs[1], parts, slopes=xs[3]), xs[2])
        else:
            out = plsh.plsh_attention(xs[0], xs[1], xs[2], xs[3], partitions=parts, method=method, backend="math")
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        for got, ref in zip(_grads(out, g, xs), want_grads, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_weighted_values_equal_the_op_with_holes_in_float32(method: str) -> None:
    """float32, a mask with holes and left padding, grouped heads: the output from the weights and its gradients
    equal the op's (every method) up to float32 rounding."""
    q, k, v = _qkv(2, 4, 2, 16, 16, seed=2)
    parts = plsh.sample_partitions(16, plsh.alibi_slopes(4), 4, generator=4)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, 6] = mask[0, 9] = False
    mask[1, :3] = False
    g = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(6))
    a = _leaves(q, k, v)
    out_a = weighted_values(plsh_attention_weights(a[0], a[1], parts, key_padding_mask=mask), a[2])
    b = _leaves(q, k, v)
    out_b = plsh.plsh_attention(*b, partitions=parts, method=method, key_padding_mask=mask)
    torch.testing.assert_close(out_a, out_b, atol=2e-6, rtol=1e-5)
    for x, y in zip(_grads(out_a, g, a), _grads(out_b, g, b), strict=True):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 3.0])
def test_alibi_weighted_values_and_the_exact_slope_gradient(window: float | None) -> None:
    """``weighted_values(alibi_attention_weights(...), v)`` with learned slopes: exact ALiBi's output and its
    ``q, k, v`` and slope gradients (the exact ones), as ``alibi_attention``'s, against float64 written here."""
    q, k, v = (x.double() for x in _qkv(2, 4, 2, 12, 12, seed=7))
    slopes = plsh.alibi_slopes(4).double()
    dist = (torch.arange(12)[:, None] - torch.arange(12)[None, :]).double()
    keep = dist >= 0 if window is None else (dist >= 0) & (dist <= window)
    bias = -slopes[:, None, None] * dist.abs()
    g = torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want, want_grads = _reference64(q, k, v, bias, keep.expand(2, 4, 12, 12), g)
    for path in ("weights", "op"):
        xs = _leaves(q, k, v, slopes)
        if path == "weights":
            out = weighted_values(alibi_attention_weights(xs[0], xs[1], xs[3], window=window), xs[2])
        else:
            out = plsh.alibi_attention(xs[0], xs[1], xs[2], xs[3], window=window)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        for got, ref in zip(_grads(out, g, xs), want_grads, strict=True):
            torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_weighted_values_keep_nan_to_the_rows_that_weigh_it() -> None:
    """A NaN value: the rows that give it weight are NaN, as the op's; the others are computed without it."""
    q, k, v = _qkv(1, 2, 2, 10, 10, seed=8)
    v[0, 0, 5, 1] = float("nan")
    slopes = plsh.alibi_slopes(2)
    out = weighted_values(alibi_attention_weights(q, k, slopes, window=2.0), v)
    op = plsh.alibi_attention(q, k, v, slopes, window=2.0)
    assert torch.equal(out.isnan(), op.isnan())
    assert bool(out[0, 0, 5:8].isnan().all()) and not bool(out[0, 0, :5].isnan().any())
    assert not bool(out[0, 0, 8:].isnan().any()) and not bool(out[0, 1].isnan().any())
    torch.testing.assert_close(out.nan_to_num(0.0), op.nan_to_num(0.0), atol=1e-5, rtol=1e-4)


def test_weighted_values_bad_arguments() -> None:
    w = torch.zeros(1, 4, 3, 5)
    with pytest.raises(ValueError, match=r"weights must be \(B, Hq, Lq, Lk\)"):
        weighted_values(w[0], torch.zeros(1, 2, 5, 8))
    with pytest.raises(ValueError, match="does not fit weights"):
        weighted_values(w, torch.zeros(1, 3, 5, 8))
    with pytest.raises(ValueError, match="does not fit weights"):
        weighted_values(w, torch.zeros(1, 2, 4, 8))
    with pytest.raises(TypeError, match="tensors"):
        weighted_values(w, None)  # type: ignore[arg-type]
    parts = plsh.sample_partitions(5, plsh.alibi_slopes(4), 2, generator=0)
    with pytest.raises(ValueError, match="slopes"):
        plsh_attention_weights(torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), parts, slopes=0.5)
