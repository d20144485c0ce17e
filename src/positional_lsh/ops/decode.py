"""Decoding: the estimator for a few queries at the end of a sequence, at the cost of their own blocks.

In sample ``t`` a query at position ``i`` shares a block with key ``j`` iff ``lab_t(i) = lab_t(j)``, so its row of
the estimator (docs/design.md) is ``softmax_j(s[i,j] + log c[i,j]) v`` with ``c[i,j] = #{t : lab_t(i) = lab_t(j)}``:
zero outside the union of the query's ``T`` blocks. A decoded token therefore needs only the keys of that union,
about the largest of its blocks — not the ``n`` keys of the sequence, and not a plan of every block of every sample.

* :func:`plsh_decode` computes those rows directly: for each chunk of queries, the span of keys their blocks
  cover, the counts ``c`` (a difference array over the span), one dense masked softmax. The host work per call is
  ``O(T H)`` numbers, the kernel work ``O(H * Lq * span * d)``; neither depends on the sequence length. It equals
  :func:`~positional_lsh.plsh_attention` (tests: the dense float64 oracle) and takes keys that start at
  ``key_offset``, so a cache may drop the keys no later query can reach.
* The blocks of the queries come from :func:`~positional_lsh.ops.partitions.bounds.block_bounds` (the floor formula
  of :meth:`~positional_lsh.Partitions.labels`, exactly). :func:`key_reach` is the farthest any query reaches back:
  keys more than ``key_reach(partitions)`` positions before a query are dead for it and for every later query
  (block starts never decrease with the position). ``positional_lsh.integrations.hf.cache`` drops them.

Torch ops only (any device and dtype, autograd included); used by the transformers swap for decoding.
"""

from __future__ import annotations

import torch

from positional_lsh.ops._checks import as_scale, check_bool, check_int, check_qkv, positive_int
from positional_lsh.ops._engine.kernels import acc_dtype, nonfinite_keys
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["key_reach", "plsh_decode"]

#: Queries per dense step of :func:`plsh_decode`: a chunk of ``c`` queries attends to at most ``c + span`` keys.
DECODE_QUERY_CHUNK = 64


def key_reach(partitions: Partitions) -> int | None:
    """The farthest a query reaches back: ``max_{t,h} ceil(pitch) - 1`` (``None`` when a pitch is ``inf``).

    A block of pitch ``b`` holds at most ``ceil(b)`` positions, so a query at ``i`` shares no block with a key
    ``j < i - key_reach``, in any sample and head; neither does any later query. Capped partitions
    (``max_block``) reach at most ``max_block - 1``.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    pitch = partitions.pitch
    if not bool(torch.isfinite(pitch).all()):
        return None
    return int(torch.ceil(pitch.clamp_min(1.0)).max().item()) - 1


# A dense step holds at most about this many scores (batch x heads x queries x span) at once.
_STEP_ELEMENTS = 2**24


def _rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    key_offset: int,
    rows: slice,
    scale: float,
) -> torch.Tensor:
    """Rows ``rows`` of the estimator; ``starts, ends`` (int64 ``(T, H, P)``) are the (causally clipped) blocks of
    those rows' queries and ``k, v`` the keys from position ``key_offset``."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    t, _, p = starts.shape
    lo, hi = (int(x) for x in torch.stack((starts.amin(), ends.amax())).tolist())
    if lo < key_offset:
        raise ValueError(
            f"the keys start at position {key_offset}, but a query shares a block with the key at position {lo}: "
            "keys it needs were dropped (see positional_lsh.ops.decode.key_reach)"
        )
    span = hi - lo
    acc = acc_dtype(q.dtype)
    dev = q.device
    # c[h, p, j]: samples in which query p and key lo + j share a block, from a difference array over the span
    # (exact: small integers).
    index = torch.cat((starts, ends)).sub_(lo).to(dev, torch.long).permute(1, 2, 0)  # (H, P, 2T)
    delta = torch.ones((), dtype=acc, device=dev).expand(hq, p, 2 * t).clone()
    delta[..., t:] = -1.0
    diff = torch.zeros(hq, p, span + 1, dtype=acc, device=dev).scatter_add_(2, index, delta)
    log_c = diff.cumsum_(2)[..., :span].log_()  # (H, P, span); log 0 = -inf: keys outside every block of the query
    ks = k[:, :, lo - key_offset : hi - key_offset]
    vs = v[:, :, lo - key_offset : hi - key_offset]
    bad = nonfinite_keys(ks, vs)  # (B, Hkv, span) or None: zeroed, and the rows that keep one set to NaN
    if bad is not None:
        ks, vs = ks.masked_fill(bad[..., None], 0), vs.masked_fill(bad[..., None], 0)
    g = hq // hkv
    qc = q[:, :, rows].to(acc).reshape(b, hkv, g, p, d)
    s = torch.matmul(qc, ks.to(acc).unsqueeze(2).transpose(-1, -2)).mul_(scale)  # (B, Hkv, G, P, span)
    s = s.add_(log_c.reshape(hkv, g, p, span)).softmax(dim=-1)
    out = torch.matmul(s, vs.to(acc).unsqueeze(2)).reshape(b, hq, p, d)
    if bad is not None:
        kept = torch.isfinite(log_c).reshape(1, hkv, g, p, span)
        reached = (bad[:, :, None, None, :] & kept).any(-1).reshape(b, hq, p)
        out = out.masked_fill(reached[..., None], float("nan"))
    return out.to(q.dtype)


def plsh_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    *,
    key_offset: int = 0,
    causal: bool = True,
    scale: float | None = None,
    query_chunk: int = DECODE_QUERY_CHUNK,
) -> torch.Tensor:
    """The estimator of :func:`~positional_lsh.plsh_attention` for queries at the end of a sequence, computed on
    the keys their blocks cover only (module docstring).

    Args:
        q: ``(B, Hq, Lq, d)`` queries: the last ``Lq`` positions of the sequence.
        k, v: ``(B, Hkv, Lk, d)``: the keys and values of positions ``key_offset .. key_offset + Lk - 1``
            (``Hq % Hkv == 0``, ``Lq <= Lk``); the sequence ends there. Keys before ``key_offset`` may have been
            dropped: ``ValueError`` if a query shares a block with one of them (see :func:`key_reach`).
        partitions: the partitions, for ``Hq`` heads and at least ``key_offset + Lk`` positions (their law does not
            depend on the length: a decoder may pass the same partitions at every step).
        key_offset: position of the first key (``>= 0``).
        causal: restrict query ``i`` to keys ``j <= i``.
        scale: score scale, default ``1/sqrt(d)``.
        query_chunk: at most this many queries per dense step (fewer when their span is long); a step attends to
            the keys its queries' blocks cover.

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype, equal to ``plsh_attention(q, k_all, v_all, partitions=...)`` on the
        whole sequence (float rounding aside). Differentiable (plain torch ops). A non-finite key or value makes
        the rows that keep it NaN, as in :func:`~positional_lsh.plsh_attention`.
    """
    shape = check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    key_offset = check_int("key_offset", key_offset, minimum=0)
    query_chunk = positive_int("query_chunk", query_chunk)
    sc = as_scale(scale, shape.head_dim)
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    n = key_offset + shape.k_len
    if partitions.num_heads != shape.q_heads or partitions.seq_len < n:
        raise ValueError(
            f"partitions are for {partitions.num_heads} heads and seq_len={partitions.seq_len}; q has "
            f"{shape.q_heads} heads and the keys cover positions {key_offset}..{n - 1} (at least seq_len={n})"
        )
    lq = shape.q_len
    pos = torch.arange(n - lq, n)
    starts, ends = block_bounds(partitions.pitch[..., None], partitions.shift[..., None], n, pos)  # (T, H, Lq)
    if causal:
        ends = torch.minimum(ends, pos + 1)
    if lq <= query_chunk and shape.batch * shape.q_heads * lq * (n - float(starts[..., 0].min())) <= _STEP_ELEMENTS:
        return _rows(q, k, v, starts, ends, key_offset, slice(0, lq), sc)
    first_key = starts.amin((0, 1)).tolist()  # per query, non-decreasing
    outs = []
    a = 0
    while a < lq:
        width = n - lq + a + query_chunk - int(first_key[a])  # keys of a chunk of query_chunk queries, at most
        size = max(1, min(query_chunk, lq - a, _STEP_ELEMENTS // max(1, shape.batch * shape.q_heads * width)))
        rows = slice(a, a + size)
        outs.append(_rows(q, k, v, starts[..., rows], ends[..., rows], key_offset, rows, sc))
        a += size
    return torch.cat(outs, dim=2)
