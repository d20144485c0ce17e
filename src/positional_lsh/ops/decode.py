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
* :class:`DecodePlan` is :func:`plsh_decode` for a decoder that calls it once per token: between two block
  boundaries of its partitions every query has the same blocks, so one ``log c`` row over the keys they cover serves
  every token up to the next boundary (a token reads a view of it); the row is rebuilt when the position crosses a
  boundary (about every ``mean pitch / (T H)`` tokens). A token then costs three kernel calls (scores plus bias,
  softmax, the values), no host work and no synchronisation. :class:`AlibiDecodePlan` is the same for exact and
  windowed ALiBi: the bias ``-m_h (i - j)`` of one row is a view of a per-head ramp.

Torch ops only (any device and dtype, autograd included); used by the transformers swap for decoding.
"""

from __future__ import annotations

import bisect
import math

import torch

from positional_lsh.ops._checks import (
    SlopesLike,
    as_scale,
    as_slopes,
    as_window,
    check_bool,
    check_int,
    check_qkv,
    positive_int,
)
from positional_lsh.ops._engine.kernels import acc_dtype, nonfinite_keys
from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["AlibiDecodePlan", "DecodePlan", "attend_row", "key_reach", "plsh_decode"]

#: Queries per dense step of :func:`plsh_decode`: a chunk of ``c`` queries attends to at most ``c + span`` keys.
DECODE_QUERY_CHUNK = 64

#: Positions whose blocks a :class:`DecodePlan` computes at once (one ``block_bounds`` call per this many tokens).
DECODE_PLAN_WINDOW = 256


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


# --------------------------------------------------------------------------------------------------
# One query row per call: the plans of a decoder
# --------------------------------------------------------------------------------------------------


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * q k^T + bias) v`` for one query row per head: the decoding kernel of the plans.

    Args:
        q: ``(B, Hq, 1, d)``.
        k, v: ``(B, Hkv, L, d)`` (``Hq % Hkv == 0``; any strides with row-major ``(L, d)`` slabs, e.g. a view of a
            cache buffer).
        bias: ``(Hq, L)`` in the accumulation dtype of ``q`` (``-inf``: a key the row does not keep; every row keeps
            at least one key), shared by the batch rows; its last dimension may be a slice of a wider tensor.
        scale: the score scale.

    Returns:
        ``(B, Hq, 1, d)`` in ``q``'s dtype, computed in the accumulation dtype (float32 for half types). The query
    heads of one key head are the rows of one matrix product (no copy of the keys per query head); with ``B = 1``
    the scale and the bias go into that product (``baddbmm``): three kernel calls in all.
    """
    b, hq, _, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    acc, dtype = bias.dtype, q.dtype
    if q.dtype != acc:
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    rows = bias.view(hkv, g, lk)
    if b == 1:
        s = torch.baddbmm(rows, q.reshape(hkv, g, d), k.reshape(hkv, lk, d).transpose(1, 2), alpha=scale)
        out = torch.bmm(torch.softmax(s, -1), v.reshape(hkv, lk, d))
    else:
        s = torch.matmul(q.reshape(b, hkv, g, d), k.transpose(-1, -2)).mul_(scale).add_(rows)
        out = torch.matmul(torch.softmax(s, -1), v)
    out = out.view(b, hq, 1, d)
    return out if out.dtype == dtype else out.to(dtype)


class DecodePlan:
    """:func:`plsh_decode` for one query at a time, at the end of a growing sequence: the decoder's plan.

    Between two block boundaries of the partitions (any sample, any head), every query has the same blocks, so
    the counts ``c[h, j]`` (samples whose block of the query holds key ``j``) are one row per head for all of them,
    over the keys from the first block start ``lo`` to the next boundary: the plan keeps ``log c`` of that row and a
    token reads a view of it (module docstring). Per head the row is a step function: ``-inf`` before the first of
    its ``T`` block starts, ``log 1`` from it to the second, ..., ``log T`` from the last, so crossing a boundary
    rebuilds it with one ``repeat_interleave``. The blocks themselves come from
    :func:`~positional_lsh.ops.partitions.bounds.block_bounds` for :data:`DECODE_PLAN_WINDOW` positions at once,
    with the positions where they change.

    Args:
        partitions: the partitions (for at least as many positions as the sequence will have).

    The plan holds no keys: one plan may serve any sequence decoded with these partitions (a cache keeps one per
    layer so that consecutive tokens reuse the row).
    """

    def __init__(self, partitions: Partitions) -> None:
        if not isinstance(partitions, Partitions):
            raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
        self.partitions = partitions
        # The window of positions whose blocks are known: [win_first, win_end), their sorted block starts
        # (H, P, T), the first key of each (host ints) and the positions where the blocks change (host, sorted,
        # ending with win_end).
        self._win_first = 0
        self._win_end = 0
        self._win_starts: torch.Tensor | None = None
        self._win_lo: list[int] = []
        self._win_changes: list[int] = []
        self._first = 0  # the queries [first, last) share the row below; empty until the first call
        self._last = 0
        self._lo = 0  # the row's first key
        self._bias: torch.Tensor | None = None  # (H, last - lo): log c over keys lo .. last - 1
        self._logs: torch.Tensor | None = None  # (H * (T + 1),): log 0 .. log T per head

    def _window(self, i: int, device: torch.device) -> None:
        """The blocks of positions ``i .. i + DECODE_PLAN_WINDOW - 1`` (at most ``seq_len``)."""
        parts = self.partitions
        end = min(i + DECODE_PLAN_WINDOW, parts.seq_len)
        pos = torch.arange(i, end, device=device)
        pitch, shift = parts.pitch[..., None].to(device), parts.shift[..., None].to(device)
        starts, _ = block_bounds(pitch, shift, parts.seq_len, pos)  # (T, H, P)
        changed = (starts[..., 1:] != starts[..., :-1]).flatten(0, 1).any(0).nonzero()[:, 0] + (i + 1)
        self._win_lo = starts.amin((0, 1)).tolist()
        self._win_changes = [*changed.tolist(), end]
        self._win_starts = starts.permute(1, 2, 0).sort(dim=-1).values  # (H, P, T)
        self._win_first, self._win_end = i, end

    def _build(self, i: int, dtype: torch.dtype, device: torch.device) -> None:
        """The row of the queries from position ``i`` to the next block boundary."""
        starts = self._win_starts
        if starts is None or not self._win_first <= i < self._win_end or starts.device != device:
            self._window(i, device)
            starts = self._win_starts
            assert starts is not None
        r = i - self._win_first
        lo = self._win_lo[r]
        last = self._win_changes[bisect.bisect_right(self._win_changes, i)]
        h, _, t = starts.shape
        logs = self._logs
        if logs is None or logs.dtype != dtype or logs.device != device:
            logs = torch.arange(t + 1, dtype=torch.float64).log().to(device, dtype).repeat(h)
            self._logs = logs
        # Per head: the lengths of the runs of keys with count 0, 1, ..., T (from lo to the sorted starts to last).
        bounds = starts.new_empty((h, t + 2))
        bounds[:, 0], bounds[:, 1:-1], bounds[:, -1] = lo, starts[:, r], last
        width = last - lo
        self._bias = torch.repeat_interleave(logs, bounds.diff(dim=1).flatten(), output_size=h * width).view(h, width)
        self._first, self._last, self._lo = i, last, lo

    def row(self, i: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(log c, lo)`` for the query at position ``i``: ``(H, i + 1 - lo)``, the bias over keys ``lo .. i``."""
        bias = self._bias
        if bias is None or not self._first <= i < self._last or bias.dtype != dtype or bias.device != device:
            self._build(i, dtype, device)
            bias = self._bias
            assert bias is not None
        return bias[:, : i + 1 - self._lo], self._lo

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_offset: int = 0,
        scale: float | None = None,
        keys_finite: bool = False,
    ) -> torch.Tensor:
        """``plsh_decode(q, k, v, self.partitions, key_offset=key_offset, scale=scale)`` (causal).

        Args:
            q, k, v: as in :func:`plsh_decode`. One query (``Lq = 1``) takes the plan's row; more queries go to
                :func:`plsh_decode`.
            key_offset: position of the first key; ``ValueError`` if the query needs a key before it.
            scale: score scale, default ``1/sqrt(d)``.
            keys_finite: the caller knows that every key and value is finite (e.g. a cache that checked them when
                they came in): skips the scan for non-finite keys. Otherwise a non-finite key sends the call to
                :func:`plsh_decode`, which makes the rows that keep it NaN.

        Returns:
            ``(B, Hq, Lq, d)`` in ``q``'s dtype, equal to :func:`plsh_decode` (float rounding aside).
        """
        shape = check_qkv(q, k, v)
        key_offset = check_int("key_offset", key_offset, minimum=0)
        sc = as_scale(scale, shape.head_dim)
        parts = self.partitions
        if shape.q_len != 1 or parts.num_heads != shape.q_heads or parts.seq_len < key_offset + shape.k_len:
            return plsh_decode(q, k, v, parts, key_offset=key_offset, scale=sc)
        return self.step(q, k, v, key_offset, sc, check_bool("keys_finite", keys_finite))

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int, scale: float, keys_finite: bool
    ) -> torch.Tensor:
        """:meth:`attend` for one query, without checking the arguments: for a caller that built them (the
        transformers swap's decoding, where a token's Python work is a sizeable part of its time). ``q (B, Hq, 1,
        d)`` and ``k, v`` as :func:`plsh_decode` takes them, for the plan's heads and at most ``seq_len`` positions;
        ``key_offset`` an int ``>= 0``; ``scale`` a positive float."""
        bias, lo = self.row(key_offset + k.shape[2] - 1, acc_dtype(q.dtype), q.device)
        if lo < key_offset:
            raise ValueError(
                f"the keys start at position {key_offset}, but the query shares a block with the key at position "
                f"{lo}: keys it needs were dropped (see positional_lsh.ops.decode.key_reach)"
            )
        ks, vs = (k, v) if lo == key_offset else (k[:, :, lo - key_offset :], v[:, :, lo - key_offset :])
        if not keys_finite and nonfinite_keys(ks, vs) is not None:
            return plsh_decode(q, k, v, self.partitions, key_offset=key_offset, scale=scale)
        return attend_row(q, ks, vs, bias, scale)


class AlibiDecodePlan:
    """Exact or windowed ALiBi (:func:`~positional_lsh.alibi_attention`, causal) for one query at a time.

    The bias of the query at ``i`` on keys ``j0 .. i`` is ``-m_h (i - j)`` (``-inf`` beyond ``window[h]``): a view of
    one per-head ramp over distances, kept by the plan and doubled when a row outgrows it. A token then costs the
    three kernel calls of :func:`attend_row`.

    Args:
        slopes: ``(H,)`` slopes or one float (``-slope |i - j|`` after scaling).
        window: ``None`` (exact) or the largest kept distance, one number or one per head.
    """

    def __init__(self, slopes: SlopesLike, window: SlopesLike = None, *, num_heads: int | None = None) -> None:
        if num_heads is None:
            if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
                raise ValueError("num_heads is needed unless slopes is a 1-D tensor (one slope per head)")
            num_heads = slopes.numel()
        self.slopes = as_slopes(slopes, positive_int("num_heads", num_heads))
        self.window = as_window(window, self.slopes.numel())
        # The largest distance any head keeps (None: every key, exact ALiBi).
        self.reach = None if self.window is None else math.floor(float(self.window.max()))
        self._ramp: torch.Tensor | None = None  # (H, C): column c is distance C - 1 - c

    def row(self, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The bias ``(H, keys)`` of a query on the ``keys`` positions up to itself (the last column: distance 0)."""
        ramp = self._ramp
        if ramp is None or ramp.shape[1] < keys or ramp.dtype != dtype or ramp.device != device:
            width = max(2 * keys, 1024)
            dist = torch.arange(width - 1, -1, -1, dtype=torch.float64)
            ramp = dist * -self.slopes[:, None]
            if self.window is not None:
                ramp = ramp.masked_fill(dist > self.window[:, None], float("-inf"))
            ramp = ramp.to(device, dtype)
            self._ramp = ramp
        return ramp[:, ramp.shape[1] - keys :]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_offset: int = 0,
        scale: float | None = None,
        keys_finite: bool = False,
    ) -> torch.Tensor:
        """Causal ALiBi of the queries ``q`` (the last positions) on keys ``k, v`` at positions ``key_offset ..``.

        Equal to ``alibi_attention(q, k, v, slopes, causal=True, window=window, scale=scale)`` on the whole sequence
        (float rounding aside): ``ValueError`` if a query keeps a key before ``key_offset``. One query takes the
        ramp; more queries, and a non-finite key unless ``keys_finite`` (see :meth:`DecodePlan.attend`), go to
        :func:`~positional_lsh.alibi_attention`.
        """
        shape = check_qkv(q, k, v)
        key_offset = check_int("key_offset", key_offset, minimum=0)
        sc = as_scale(scale, shape.head_dim)
        if self.slopes.numel() != shape.q_heads:
            raise ValueError(f"the plan has {self.slopes.numel()} slopes; q has {shape.q_heads} heads")
        return self.step(q, k, v, key_offset, sc, check_bool("keys_finite", keys_finite))

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int, scale: float, keys_finite: bool
    ) -> torch.Tensor:
        """:meth:`attend` without checking the arguments (see :meth:`DecodePlan.step`): ``q (B, Hq, Lq, d)`` and
        ``k, v (B, Hkv, Lk, d)`` for the plan's heads, ``key_offset`` an int ``>= 0``, ``scale`` a positive float."""
        lq, lk = q.shape[2], k.shape[2]
        if key_offset > 0 and (self.reach is None or key_offset + lk - lq - self.reach < key_offset):
            raise ValueError(f"the KV cache dropped keys before position {key_offset} that this ALiBi attention needs")
        lo = 0 if self.reach is None else max(0, lk - 1 - self.reach)  # the first key the last query keeps
        ks, vs = (k, v) if lo == 0 else (k[:, :, lo:], v[:, :, lo:])
        if lq != 1 or (not keys_finite and nonfinite_keys(ks, vs) is not None):
            return alibi_attention(q, k, v, self.slopes, causal=True, window=self.window, scale=scale)
        return attend_row(q, ks, vs, self.row(lk - lo, acc_dtype(q.dtype), q.device), scale)
