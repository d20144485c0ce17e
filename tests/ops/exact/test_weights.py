"""The attention weights of a call (``ops/exact/weights.py``) against float64 dense computations written here, and
against the ops' own outputs (weights @ v is the op's output)."""

from __future__ import annotations

import pytest
import torch

import positional_lsh as plsh
from positional_lsh.ops.exact import weights as weights_module
from positional_lsh.ops.exact.reference import alibi_attention_reference, dense_plsh_attention
from positional_lsh.ops.exact.weights import alibi_attention_weights, plsh_attention_weights


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
