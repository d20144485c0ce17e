"""The decoding kernels of :func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache` (private: call the
entry point).

In sample ``t`` a query at position ``i`` shares a block with key ``j`` iff ``lab_t(i) = lab_t(j)``, so its row of
the estimator (docs/design.md) is ``softmax_j(s[i,j] + log c[i,j]) v`` with ``c[i,j] = #{t : lab_t(i) = lab_t(j)}``:
zero outside the union of the query's ``T`` blocks. A decoded token therefore needs only the keys of that union,
about the largest of its blocks — not the ``n`` keys of the sequence.

* Rows (:func:`decode_rows`): for each chunk of queries, the span of keys their blocks cover, the counts ``c``
  (:func:`~positional_lsh.ops.partitions.counts.block_counts`), one dense masked softmax. The host work per call is
  ``O(T H)`` numbers, the kernel work ``O(H * Lq * span * d)``; neither depends on the sequence length. Keys may start
  at ``key_offset``, so a cache may drop the keys no later query can reach
  (:func:`~positional_lsh.ops.kvcache.key_reach`).
* One token with a :class:`~positional_lsh.ops.kvcache.DecodeState` (the caller keeps one per layer and sequence,
  :class:`RowPlan`): between two block boundaries of the partitions every query has the same blocks, so one ``log c``
  row over the keys they cover serves every token up to the next boundary (a token reads a view of it); the row is
  rebuilt when the position crosses a boundary (about every ``mean pitch / (T H)`` tokens). A token then costs three
  kernel calls (scores plus bias, softmax, the values), no host work and no synchronisation. Exact and windowed
  ALiBi likewise (:class:`RampPlan`): the bias ``-m_h (i - j)`` of one row is a view of a per-head ramp.

Torch ops only (any device and dtype, autograd for ``q, k, v`` included).
"""

from __future__ import annotations

import bisect
import math

import torch

from positional_lsh.ops._engine.engine import rows_reaching
from positional_lsh.ops._engine.torch_attention import acc_dtype, nonfinite_keys
from positional_lsh.ops.checks import SlopesLike, as_scale, as_slopes, as_window, positive_int
from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.exact.toeplitz import bias_line
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.counts import block_counts
from positional_lsh.ops.partitions.partition import Partitions

#: Queries per dense step of :func:`decode_rows`: a chunk of ``c`` queries attends to at most ``c + span`` keys.
DECODE_QUERY_CHUNK = 64

#: Positions whose blocks a decoder's row plan computes at once (one ``block_bounds`` call per this many tokens).
DECODE_PLAN_WINDOW = 256

# A dense step holds at most about this many scores (batch x heads x queries x span) at once.
_STEP_ELEMENTS = 2**24

# --------------------------------------------------------------------------------------------------
# The decoding kernels
# --------------------------------------------------------------------------------------------------


def _rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    starts: torch.Tensor,
    ends: torch.Tensor,
    key_offset: int,
    rows: slice,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Rows ``rows`` of the estimator; ``starts, ends`` (int64 ``(T, H, P)``) are the (causally clipped) blocks of
    those rows' queries and ``k, v`` the keys from position ``key_offset``."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    p = starts.shape[2]
    lo, hi = (int(x) for x in torch.stack((starts.amin(), ends.amax())).tolist())
    if lo < key_offset:
        raise ValueError(
            f"the keys start at position {key_offset}, but a query shares a block with the key at position {lo}: "
            "keys it needs were dropped (see positional_lsh.ops.kvcache.key_reach)"
        )
    span = hi - lo
    acc = acc_dtype(q.dtype)
    # c[h, p, j]: samples in which query p and key lo + j share a block (exact: small integers); log 0 = -inf: keys
    # outside every block of the query.
    log_c = block_counts(starts.permute(1, 2, 0), ends.permute(1, 2, 0), lo, span).to(acc).log_()  # (H, P, span)
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
        # The engine's one search of the rows a bad key reaches, on the keys from position 0 up to the span's end
        # (the rows of this step are the last ones of that sequence when their queries end there).
        n = key_offset + k.shape[2]
        every = bad.new_zeros((b, hkv, n))
        every[..., lo:hi] = bad
        first_row = n - lq + rows.start
        reached = rows_reaching(every, partitions.with_seq_len(n), n - first_row, causal)[..., :p]
        out = out.masked_fill(reached[..., None], float("nan"))
    return out.to(q.dtype)


def decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    key_offset: int = 0,
    causal: bool = True,
    scale: float | None = None,
    query_chunk: int = DECODE_QUERY_CHUNK,
) -> torch.Tensor:
    """The decoding kernels for queries at the end of a sequence: the estimator of
    :func:`~positional_lsh.plsh_attention`, computed on the keys their blocks cover only (module docstring).

    ``q (B, Hq, Lq, d)``; ``k, v`` the keys of positions ``key_offset .. key_offset + Lk - 1`` (checked by
    :func:`plsh_attention_with_kvcache`; ``ValueError`` if a query shares a block with a dropped key); ``partitions``
    for ``Hq`` heads and at least ``key_offset + Lk`` positions; at most ``query_chunk`` queries per dense step (fewer
    when their span is long). Returns ``(B, Hq, Lq, d)`` in ``q``'s dtype.
    """
    b, hq, lq, d = q.shape
    query_chunk = positive_int("query_chunk", query_chunk)
    sc = as_scale(scale, d)
    n = key_offset + k.shape[2]
    pos = torch.arange(n - lq, n)
    starts, ends = block_bounds(partitions.pitch[..., None], partitions.shift[..., None], n, pos)  # (T, H, Lq)
    if causal:
        ends = torch.minimum(ends, pos + 1)
    if lq <= query_chunk and b * hq * lq * (n - float(starts[..., 0].min())) <= _STEP_ELEMENTS:
        return _rows(q, k, v, partitions, starts, ends, key_offset, slice(0, lq), causal, sc)
    first_key = starts.amin((0, 1)).tolist()  # per query, non-decreasing
    outs = []
    a = 0
    while a < lq:
        width = n - lq + a + query_chunk - int(first_key[a])  # keys of a chunk of query_chunk queries, at most
        size = max(1, min(query_chunk, lq - a, _STEP_ELEMENTS // max(1, b * hq * width)))
        rows = slice(a, a + size)
        outs.append(_rows(q, k, v, partitions, starts[..., rows], ends[..., rows], key_offset, rows, causal, sc))
        a += size
    return torch.cat(outs, dim=2)


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * q k^T + bias) v`` for one query row per head: the kernel of a one-token call.

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


class RowPlan:
    """One query at a time at the end of a growing sequence, positional LSH: the row of a :class:`DecodeState`.

    Between two block boundaries of the partitions (any sample, any head), every query has the same blocks, so the
    counts ``c[h, j]`` (samples whose block of the query holds key ``j``) are one row per head for all of them, over
    the keys from the first block start ``lo`` to the next boundary ``last``: the plan keeps ``log c`` of that row
    (:func:`~positional_lsh.ops.partitions.counts.block_counts` of the blocks, ended at ``last``) and a token reads a
    view of it. The blocks themselves come from :func:`~positional_lsh.ops.partitions.bounds.block_bounds` for
    :data:`DECODE_PLAN_WINDOW` positions at once, with the positions where they change.
    """

    def __init__(self, partitions: Partitions) -> None:
        self.partitions = partitions
        # The window of positions whose blocks are known: [win_first, win_end), their block starts (H, P, T), the
        # first key of each (host ints) and the positions where the blocks change (host, sorted, ending with win_end).
        self._win_first = 0
        self._win_end = 0
        self._win_starts: torch.Tensor | None = None
        self._win_lo: list[int] = []
        self._win_changes: list[int] = []
        self._first = 0  # the queries [first, last) share the row below; empty until the first call
        self._last = 0
        self._lo = 0  # the row's first key
        self._bias: torch.Tensor | None = None  # (H, last - lo): log c over keys lo .. last - 1
        self._logs: torch.Tensor | None = None  # (T + 1,): log 0 .. log T

    def serves(self, partitions: Partitions) -> bool:
        """Whether ``partitions`` are this plan's draw (the same object, or the same pitches and shifts: the same
        draw for another length); adopts them when they cover more positions."""
        own = self.partitions
        if partitions is own:
            return True
        same = (partitions.pitch.shape == own.pitch.shape and torch.equal(partitions.pitch, own.pitch)
                and torch.equal(partitions.shift, own.shift))  # fmt: skip
        if same and partitions.seq_len > own.seq_len:
            self.partitions = partitions
            self._win_end = min(self._win_end, own.seq_len)
        return same

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
        self._win_starts = starts.permute(1, 2, 0)  # (H, P, T)
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
        logs = self._logs
        if logs is None or logs.dtype != dtype or logs.device != device:
            t = starts.shape[-1]
            logs = torch.arange(t + 1, dtype=torch.float64).log().to(device, dtype)
            self._logs = logs
        # Every block of these queries ends at or after `last`: the counts of keys lo .. last - 1 are the starts'.
        row = starts[:, r]  # (H, T)
        counts = block_counts(row, torch.full_like(row, last), lo, last - lo)  # (H, last - lo)
        self._bias = logs[counts.long()]
        self._first, self._last, self._lo = i, last, lo

    def row(self, i: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(log c, lo)`` for the query at position ``i``: ``(H, i + 1 - lo)``, the bias over keys ``lo .. i``."""
        bias = self._bias
        if bias is None or not self._first <= i < self._last or bias.dtype != dtype or bias.device != device:
            self._build(i, dtype, device)
            bias = self._bias
            assert bias is not None
        return bias[:, : i + 1 - self._lo], self._lo

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int, scale: float, keys_finite: bool
    ) -> torch.Tensor:
        """One causal query ``q (B, Hq, 1, d)`` on ``k, v`` from position ``key_offset`` (checked by the caller)."""
        bias, lo = self.row(key_offset + k.shape[2] - 1, acc_dtype(q.dtype), q.device)
        if lo < key_offset:
            raise ValueError(
                f"the keys start at position {key_offset}, but the query shares a block with the key at position "
                f"{lo}: keys it needs were dropped (see positional_lsh.ops.kvcache.key_reach)"
            )
        ks, vs = (k, v) if lo == key_offset else (k[:, :, lo - key_offset :], v[:, :, lo - key_offset :])
        if not keys_finite and nonfinite_keys(ks, vs) is not None:
            return decode_rows(q, k, v, self.partitions, key_offset, True, scale)
        return attend_row(q, ks, vs, bias, scale)


class RampPlan:
    """Exact or windowed causal ALiBi for one query at a time: the ALiBi half of a :class:`DecodeState`.

    The bias of the query at ``i`` on keys ``j0 .. i`` is ``-m_h (i - j)`` (``-inf`` beyond ``window[h]``): a view of
    one per-head ramp over distances (:func:`~positional_lsh.ops.exact.toeplitz.bias_line`), kept by the plan and
    doubled when a row outgrows it. A token then costs the three kernel calls of :func:`attend_row`.
    """

    def __init__(self, slopes: SlopesLike, window: SlopesLike, num_heads: int) -> None:
        self._source = (slopes, window)  # the caller's objects: the same ones next call need no new checks
        self.slopes = as_slopes(slopes, num_heads)
        self.window = as_window(window, num_heads)
        # The largest distance any head keeps (None: every key, exact ALiBi).
        self.reach = None if self.window is None else math.floor(float(self.window.max()))
        self._ramp: torch.Tensor | None = None  # (H, C): column c is distance C - 1 - c

    def serves(self, slopes: SlopesLike, window: SlopesLike) -> bool:
        return self._source[0] is slopes and self._source[1] is window

    def check_reach(self, key_offset: int, q_len: int, k_len: int) -> None:
        """``ValueError`` if the first of ``q_len`` queries keeps a key before ``key_offset`` (a dropped one)."""
        if key_offset > 0 and (self.reach is None or k_len - q_len - self.reach < 0):
            raise ValueError(f"the KV cache dropped keys before position {key_offset} that this ALiBi attention needs")

    def row(self, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The bias ``(H, keys)`` of a query on the ``keys`` positions up to itself (the last column: distance 0)."""
        ramp = self._ramp
        if ramp is None or ramp.shape[1] < keys or ramp.dtype != dtype or ramp.device != device:
            width = max(2 * keys, 1024)
            ramp = bias_line(1 - width, 0, self.slopes, self.window, causal=False, dtype=dtype, device=device)
            self._ramp = ramp
        return ramp[:, ramp.shape[1] - keys :]

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keys_finite: bool) -> torch.Tensor:
        """One causal query ``q (B, Hq, 1, d)`` on ``k, v`` (checked by the caller, the reach too)."""
        lk = k.shape[2]
        lo = 0 if self.reach is None else max(0, lk - 1 - self.reach)  # the first key the query keeps
        ks, vs = (k, v) if lo == 0 else (k[:, :, lo:], v[:, :, lo:])
        if not keys_finite and nonfinite_keys(ks, vs) is not None:
            return alibi_attention(q, k, v, self.slopes, causal=True, window=self.window, scale=scale)
        return attend_row(q, ks, vs, self.row(lk - lo, acc_dtype(q.dtype), q.device), scale)
