"""The dense oracles (small ``n``, float64): the ALiBi matrix, exact ALiBi through an explicit bias, and the
positional-LSH oracle ``softmax(s + log Mbar) v``. Test and validation code only; the production bias is
:func:`positional_lsh.ops.exact.bias.alibi_bias`.

* :func:`alibi_matrix` — the multiplicative ALiBi matrix ``A[h, i, j] = exp(-m_h |i - j|)``.
* :func:`alibi_attention_reference` — exact (windowed) ALiBi attention through the explicit ``n x n`` bias,
  differentiable in ``q, k, v`` and a ``slopes`` tensor: the dense autograd reference of the ``O(n)`` op's gradients
  (slopes included).
* :func:`dense_plsh_attention` — the positional-LSH oracle ``softmax(s + log Mbar) v``, materialized;
  for tests and small-``n`` validation.

The ``n x n`` builders refuse sizes above ``MAX_DENSE_ELEMENTS`` entries.
"""

from __future__ import annotations

import torch

from positional_lsh.ops.checks import (
    SlopesLike,
    as_scale,
    as_slopes,
    as_window,
    check_bool,
    check_qkv,
    positive_int,
)
from positional_lsh.ops.partitions.partition import MAX_DENSE_ELEMENTS, Partitions

__all__ = ["alibi_attention_reference", "alibi_matrix", "dense_plsh_attention"]


def _check_dense_size(what: str, elements: int) -> None:
    if elements > MAX_DENSE_ELEMENTS:
        raise ValueError(
            f"{what} would materialize {elements:,} entries (more than {MAX_DENSE_ELEMENTS:,}); it is a dense "
            "reference for small sizes. Use alibi_attention or plsh_attention for long sequences"
        )


def alibi_matrix(
    seq_len: int,
    slopes: SlopesLike = None,
    *,
    num_heads: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``A[h, i, j] = exp(-slopes[h] * |i - j|)``: ``(H, n, n)`` (float64 by default; small n only)."""
    n = positive_int("seq_len", seq_len)
    if slopes is None or isinstance(slopes, (int, float)):
        if num_heads is None:
            raise ValueError("num_heads is required when slopes is None or a single number")
        h = positive_int("num_heads", num_heads)
    else:
        h = len(slopes)
    m = as_slopes(slopes, h)
    _check_dense_size("alibi_matrix", h * n * n)
    pos = torch.arange(n, dtype=torch.float64)
    dist = (pos[:, None] - pos[None, :]).abs()
    return torch.exp(-m[:, None, None] * dist).to(dtype=dtype, device=device)


def alibi_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    causal: bool = True,
    window: torch.Tensor | float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact (optionally windowed) ALiBi, dense: ``softmax(scale q k^T - m_h |i - j|) v`` with ``-inf`` masks.

    Shapes and arguments as :func:`~positional_lsh.ops.exact.alibi.alibi_attention` (``q (B, Hq, Lq, d)``, ``k, v (B,
    Hkv,
    Lk, d)``, queries aligned to the last keys; ``slopes`` ``(Hq,)``, 0-d or a float; ``window`` the largest kept
    distance). The bias ``-m_h |i - j|`` is built as an explicit ``(Hq, Lq, Lk)`` float64 tensor from the ``slopes``
    tensor itself, and the masked scores (``j > i`` if causal, ``|i - j| > window[h]``) are set to ``-inf`` with
    ``masked_fill`` (a non-finite key in ``k`` reaches no row that masks it). Plain autograd gives the gradients of
    ``q``, ``k``, ``v`` and the slopes (no gradient through the window). Computed in float64, returned in ``q``'s
    dtype; small sizes only.
    """
    b, hq, hkv, lq, lk, d = check_qkv(q, k, v)
    check_bool("causal", causal)
    sc = as_scale(scale, d)
    as_slopes(slopes, hq)  # the checks; the tensor itself carries the gradient
    win = as_window(window, hq)
    _check_dense_size("alibi_attention_reference", b * hq * lq * lk)
    if isinstance(slopes, torch.Tensor):
        m = slopes.to(device=q.device, dtype=torch.float64).reshape(-1).expand(hq)
    else:
        m = as_slopes(slopes, hq).to(q.device)
    rel = (torch.arange(lq, device=q.device)[:, None] + (lk - lq)) - torch.arange(lk, device=q.device)[None, :]
    dist = rel.abs().to(torch.float64)
    bias = -m[:, None, None] * dist
    drop = torch.zeros(hq, lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        drop |= rel < 0
    if win is not None:
        drop |= dist > win.to(q.device)[:, None, None]
    group = hq // hkv
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = (torch.matmul(q.double(), kk.transpose(-1, -2)) * sc + bias).masked_fill(drop, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vv).to(q.dtype)


def dense_plsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """The oracle ``softmax(s + log Mbar) v`` with ``Mbar`` the mean of the sampled masks, materialized.

    Shapes as :func:`~positional_lsh.plsh_attention` (``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``, queries
    aligned to the last keys). Computed in ``q``'s dtype (float32 for half types) by plain autograd-able
    torch ops. Refuses sizes whose ``n x n`` matrices would not fit.
    """
    b, hq, hkv, lq, lk, d = check_qkv(q, k, v)
    check_bool("causal", causal)
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    if partitions.num_heads != hq or partitions.seq_len != lk:
        raise ValueError(
            f"partitions are for {partitions.num_heads} heads and seq_len={partitions.seq_len}; "
            f"q has {hq} heads and k has {lk} positions"
        )
    _check_dense_size("dense_plsh_attention", b * hq * lq * lk)
    sc = as_scale(scale, d)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # half types in float32
    mbar = partitions.mean_mask(device=q.device, dtype=acc)[:, lk - lq :, :]
    log_mbar = torch.log(mbar)  # log 0 = -inf: keys never in the query's block
    if causal:  # key j after query i (at position Lk - Lq + r): never seen
        rel = (torch.arange(lq, device=q.device)[:, None] + (lk - lq)) - torch.arange(lk, device=q.device)[None, :]
        log_mbar = log_mbar.masked_fill(rel < 0, float("-inf"))
    group = hq // hkv
    kk = k.to(acc).repeat_interleave(group, dim=1)
    vv = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(acc), kk.transpose(-1, -2)) * sc + log_mbar
    return torch.matmul(torch.softmax(s, dim=-1), vv).to(q.dtype)
