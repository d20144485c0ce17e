"""Exact and windowed ALiBi attention in ``O(n)`` memory: the production op :func:`alibi_attention`.

``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j``, the bias added after scaling, optionally restricted to
``|i - j| <= window[h]``. Chunked over queries, with a recomputing backward against the saved output and
log-sum-exp: never an ``n x n`` tensor. Two routes (:func:`exact_route`): ``"fused"`` (torch's fused CPU flash
kernel, every head in one call per :data:`FUSED_ROWS` query rows, the bias a strided view of one ``O(n)`` line per
head against the keys in reverse order: no bias construction, and it skips the causal triangle) whenever the
kernel is that op and no window drops a key; ``"banks"`` otherwise (per head, one Toeplitz bias bank per head of
which every chunk's bias is a view, each chunk on the keys its window keeps).
A ``slopes`` tensor that requires grad gets ``dL/dm_h = -sum_{b,i,j} dS_ij |i - j|`` from one more pass of score
recomputation per chunk in that backward (``ops._engine.kernels.attend_bias_grads`` with the weight
``d bias / dm = -|i - j|``, a view of a per-head Toeplitz distance bank). :func:`decay_attention` is the same op for
the built-in decay families (:data:`~positional_lsh.ops.partitions.decays.DECAY_FAMILIES`, bias
``log k_theta(|i - j|)``), with ``params.grad``. Both take a ``key_padding_mask`` (:mod:`positional_lsh.ops.padding`).

One custom-op registration serves both, eager and compiled: ``positional_lsh::exact_forward(q, k, v, theta,
window, kind, causal, scale, backend, check=False, key_padding_mask=None) -> (out, lse)`` (``theta``: the slopes
``(Hq,)``, or a decay family's parameters ``(Hq, P)``) and its backward ``positional_lsh::exact_backward``,
connected by ``torch.library.register_autograd``, which gives ``theta`` its exact gradient when autograd needs it.
``torch.compile(fullgraph=True)`` traces a call as that one opaque op; the values a trace cannot read (slopes,
window, parameters) are then checked inside it (``check``).

Runs the torch kernels of ``ops._engine.kernels`` only (``backend`` in :data:`ALIBI_BACKENDS`; exact ALiBi has no
Triton path). Used by the language model (``alibi`` and ``window-alibi``), the transformers swap, and every benchmark
and report as the exact/windowed peer. The dense conventions and oracles are in
:mod:`positional_lsh.ops.exact.reference`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from positional_lsh.ops._checks import (
    SlopesLike,
    as_scale,
    as_slopes,
    as_window,
    check_bool,
    check_meta_slopes,
    check_qkv,
    is_meta_tensor,
    meta_output,
)
from positional_lsh.ops._engine.kernels import (
    acc_dtype,
    attend,
    attend_backward,
    attend_bias_grads,
    kernel_layout,
    nonfinite_keys,
    output_buffers,
    poison_rows,
    resolve_backend,
)
from positional_lsh.ops._engine.parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops.exact.bias import alibi_bias
from positional_lsh.ops.options import ALIBI_BACKENDS, check_backend
from positional_lsh.ops.padding import check_key_padding_mask, forward_row_groups, row_groups
from positional_lsh.ops.partitions.decays import decay_family
from positional_lsh.ops.partitions.sampling import slopes_tensor

__all__ = ["alibi_attention", "decay_attention"]
"""``backend=`` of :func:`alibi_attention`: the torch kernels only (exact ALiBi has no Triton path)."""

# Each kernel call materializes at most about CHUNK_ELEMENTS bias/score entries; the parameter-gradient pass works
# on sub-blocks of a chunk of about GRAD_ELEMENTS scores.
_MIN_WINDOW_ROWS = 64  # query rows per chunk for windowed ALiBi (at least)
CHUNK_ELEMENTS = 2**22
GRAD_ELEMENTS = 2**16  # scores per call of the parameter-gradient pass (a sub-block of a chunk)
#: Query rows per kernel call of the ``"fused"`` route (:func:`exact_route`). Causal, each call's keys end at its last
#: row, so smaller calls skip more of the masked triangle and larger ones run the fused kernel on bigger tiles; 128
#: measured fastest (64-384 tried) at n = 512-4096, 1 thread, batch 2, H = 8, d = 64 (docs/benchmarks.md, "Short
#: contexts"). Bidirectional calls take every row at once (nothing to skip).
FUSED_ROWS = 128
#: The ``"fused"`` route keeps the keys in order, with a dense bias, while ``Hq * Lq < FUSED_DENSE_RATIO * Hkv * d``
#: (the bias then has fewer entries than this many copies of ``k``, which the reversed order would copy twice).
#: Measured (1 thread, H = 8, d = 64, Lk = 2048): decoding 1.8 ms with the dense bias, 13 ms reversed; Lq = 16:
#: 2.6 against 3.1 ms; Lq = 64: 11.5 against 9.9 ms; square n = 128: about even.
FUSED_DENSE_RATIO = 2
#: The routes of the exact ops (:func:`exact_route`).
EXACT_ROUTES = ("fused", "banks")


@dataclass(frozen=True)
class _Chunk:
    a: int  # query rows [a, b)
    b: int
    lo: int  # key rows [lo, hi)
    hi: int


class _HeadPlan:
    """Query chunks of one head, and the Toeplitz banks from which every chunk's bias and weights are views.

    A bias that depends on ``i - j`` only is Toeplitz: chunk queries at positions ``p + r`` and keys ``lo + c``
    see ``f(p - lo + r - c)``. One ``(rows, width)`` bank ``bank[r, x] = f(r - x + off)`` holds every chunk's
    bias as the column slice starting at ``off - (p - lo)``, so it is computed once per head; so are the weight
    banks of the parameter gradient (``d bias / d theta``, same layout, :meth:`view` slices both). ``reach`` (the
    largest kept distance ``|i - j|``; ``None``: every key) bounds the keys of each chunk.
    """

    def __init__(self, q_len: int, k_len: int, reach: int | None, causal: bool) -> None:
        q0 = k_len - q_len  # position of the first query
        span = k_len if reach is None else min(k_len, 2 * reach + 1)
        rows = max(1, min(q_len, CHUNK_ELEMENTS // max(1, span)))
        if reach is not None:  # a chunk of r rows spans r + reach keys: keep r near reach, not the whole input
            rows = min(rows, max(_MIN_WINDOW_ROWS, reach))
        chunks = []
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            first, last = q0 + a, q0 + b - 1
            lo = 0 if reach is None else max(0, first - reach)
            hi = last + 1 if causal else (k_len if reach is None else min(k_len, last + reach + 1))
            chunks.append(_Chunk(a, b, lo, hi))
        self.chunks = chunks
        deltas = [q0 + c.a - c.lo for c in chunks]
        self.off = max(deltas)
        self.width = max(self.off - d + (c.hi - c.lo) for d, c in zip(deltas, chunks, strict=True))
        self.rows = rows
        self.q0 = q0

    def rel(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``(rows, width)``: ``i - j`` of every bank entry (exact integers up to ``2^24`` in float32)."""
        r = torch.arange(self.rows, device=device, dtype=dtype) + self.off
        return r[:, None] - torch.arange(self.width, device=device, dtype=dtype)[None, :]

    def view(self, bank: torch.Tensor, c: _Chunk) -> torch.Tensor:
        """Chunk ``c``'s ``(..., rows, keys)`` slice of a ``(..., rows, width)`` bank (a view)."""
        start = self.off - (self.q0 + c.a - c.lo)
        return bank[..., : c.b - c.a, start : start + c.hi - c.lo]


class _Toeplitz:
    """The per-head Toeplitz bias of one call, ALiBi's or a decay family's, from detached float64 values.

    ``kind`` is ``"alibi"`` (``values (Hq, 1)`` the slopes: bias ``-m_h |i - j|``, ``-inf`` beyond ``window[h]``)
    or a name of :data:`~positional_lsh.ops.partitions.decays.DECAY_FAMILIES` (``values (Hq, P)``: bias ``log
    k_theta_h(|i - j|)``, its finite support as the window). Causal masking adds ``-inf`` for ``j > i``.
    """

    def __init__(self, kind: str, values: torch.Tensor, window: torch.Tensor | None) -> None:
        self.family = None if kind == "alibi" else decay_family(kind)
        self.values = values
        if self.family is not None:
            reach = [self.family.reach(values[h]) for h in range(values.shape[0])]
            window = None if all(math.isinf(r) for r in reach) else torch.tensor(reach, dtype=torch.float64)
        self.window = window  # (Hq,) float64, the largest kept distance (inf: all), or None

    @property
    def num_params(self) -> int:
        return int(self.values.shape[1])

    def reach(self, h: int) -> int | None:
        """Head ``h``'s largest kept distance as an int, ``None`` for every key."""
        if self.window is None or math.isinf(float(self.window[h])):
            return None
        return int(float(self.window[h]))

    def line(self, first: int, last: int, causal: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``(Hq, last - first + 1)`` contiguous: entry ``x`` of head ``h`` is the bias at ``i - j = first + x``
        (``-m_h |i - j|`` or ``log k_theta_h(|i - j|)``, ``-inf`` beyond the window and, when ``causal``, for
        ``j > i``), computed in float64 and rounded once to ``dtype``. Every bias entry of a call is one of these
        ``O(Lq + Lk)`` values: the ``"fused"`` route's bias is a strided view of this line."""
        if self.family is None:
            return bias_line(first, last, self.values[:, 0], self.window, causal=causal, dtype=dtype, device=device)
        rel = torch.arange(first, last + 1, dtype=torch.float64)
        family = self.family
        line = torch.stack([family.log_k(rel.abs(), self.values[h]) for h in range(self.values.shape[0])])
        if causal:
            line = line.masked_fill(rel[None] < 0, -math.inf)
        return line.to(device=device, dtype=dtype).contiguous()

    def banks(
        self, h: int, plan: _HeadPlan, causal: bool, dtype: torch.dtype, weight_dtype: torch.dtype | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Head ``h``'s bias bank ``(rows, width)`` in ``dtype`` and, for a ``weight_dtype``, its weight banks
        ``(P, rows, width)``: ``d bias / d theta_p`` (finite; 0 where the bias is ``-inf``)."""
        if self.family is None:
            win = None if self.window is None else torch.tensor([float(self.window[h])], dtype=torch.float64)
            slope = self.values[h, :1]
            bias = alibi_bias(
                plan.rows, plan.width, slope, causal=causal, window=win, q_offset=plan.off, dtype=dtype, device=device
            )[0]
            if weight_dtype is None:
                return bias, None
            return bias, plan.rel(weight_dtype, device).abs_().neg_()[None]  # d(-m |i - j|)/dm
        arith = torch.float64 if dtype == torch.float64 else torch.float32
        rel = plan.rel(arith, device)
        dist = rel.abs()
        theta = self.values[h].to(device, arith)
        log_k = self.family.log_k(dist, theta)
        if causal:
            log_k.masked_fill_(rel < 0, -math.inf)
        if weight_dtype is None:
            return log_k.to(dtype), None
        weights = self.family.grad_log_k(dist.to(weight_dtype), theta.to(weight_dtype))
        return log_k.to(dtype), weights.masked_fill_(torch.isneginf(log_k)[None], 0.0)


def bias_line(
    first: int, last: int, slopes: torch.Tensor, window: torch.Tensor | None, *, causal: bool, dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.Tensor:  # fmt: skip
    """The ALiBi ramp: ``(H, last - first + 1)`` contiguous, entry ``x`` of head ``h`` the bias at ``i - j = first +
    x``: ``-slopes[h] |i - j|``, ``-inf`` beyond ``window[h]`` and, when ``causal``, for ``j > i``; computed in float64
    (``slopes``, ``window``: ``(H,)`` float64) and rounded once to ``dtype``. Every bias entry of an exact ALiBi call
    is one of these values: the ``"fused"`` route's bias and a decoded token's bias row are views of it."""
    rel = torch.arange(first, last + 1, dtype=torch.float64)
    dist = rel.abs()
    line = dist[None] * -slopes[:, None]
    if window is not None:
        line = line.masked_fill(dist[None] > window[:, None], -math.inf)
    if causal:
        line = line.masked_fill(rel[None] < 0, -math.inf)
    return line.to(device=device, dtype=dtype).contiguous()


def _head_items(q: torch.Tensor, k: torch.Tensor, window: torch.Tensor | None) -> list[tuple[list[int], slice]]:
    """Independent (heads, batch slice) pieces; a head's cost is its key span."""
    group = q.shape[1] // k.shape[1]
    lk = k.shape[2]
    spans = [lk if window is None else min(lk, 2 * float(window[h]) + 1) for h in range(q.shape[1])]
    return work_items([(h, h // group, spans[h]) for h in range(q.shape[1])], q.shape[0], workers_for(q.device))


def _alibi_rows_with_bad_keys(
    bad: torch.Tensor, num_heads: int, q_len: int, window: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows whose kept keys (causal and window mask) include a ``bad`` (non-finite) key.

    ``bad`` is ``(B, Hkv, Lk)`` bool; these are the rows :func:`alibi_attention` sets to NaN.
    """
    b, hkv, lk = bad.shape
    before = torch.nn.functional.pad(bad.long().cumsum(-1), (1, 0))  # before[..., j]: bad keys among 0..j-1
    before = before.repeat_interleave(num_heads // hkv, dim=1)  # (B, Hq, Lk + 1)
    pos = torch.arange(q_len, device=bad.device, dtype=torch.float64) + (lk - q_len)
    reach = torch.full((num_heads, 1), float(lk), dtype=torch.float64, device=bad.device)
    if window is not None:
        reach = torch.floor(window.to(bad.device, torch.float64)).clamp_max(lk)[:, None]
    lo = (pos - reach).clamp_min(0).long()  # (Hq, Lq): first kept key
    hi = (pos if causal else (pos + reach).clamp_max(lk - 1)).long().expand(num_heads, q_len)  # last kept key
    count = before.gather(-1, (hi + 1).expand(b, -1, -1)) - before.gather(-1, lo.expand(b, -1, -1))
    return count > 0


def _head_chunks(
    heads: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    spec: _Toeplitz,
    causal: bool,
    backend: str,
    weights: bool = False,
) -> Iterator[tuple[int, int, _Chunk, torch.Tensor, torch.Tensor | None]]:
    """``(query head, key head, chunk, its bias (1, 1, rows, keys), its weights (P, rows, keys) or None)`` for
    every query chunk of ``heads``, in order; the weights (``d bias / d theta``) only when asked for.

    The forward and the recomputing backward walk the same chunks with the same bias (one plan per head).
    """
    group = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    bias_dtype = q.dtype if backend == "flash" else acc
    for h in heads:
        plan = _HeadPlan(q.shape[2], k.shape[2], spec.reach(h), causal)
        bias_bank, weight_bank = spec.banks(h, plan, causal, bias_dtype, acc if weights else None, q.device)
        for c in plan.chunks:
            w = None if weight_bank is None else plan.view(weight_bank, c)
            yield h, h // group, c, plan.view(bias_bank, c)[None, None], w


def _alibi_forward_item(
    item: tuple[list[int], slice],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: _Toeplitz,
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Exact attention for one work item's heads and batch rows, chunk by chunk, into ``out`` and ``lse``."""
    heads, b = item
    for h, hk, c, bias, _ in _head_chunks(heads, q, k, spec, causal, backend):
        o, l = attend(
            q[b, h : h + 1, c.a : c.b],
            k[b, hk : hk + 1, c.lo : c.hi],
            v[b, hk : hk + 1, c.lo : c.hi],
            causal=False,
            scale=scale,
            kernel=backend,
            bias=bias,
        )
        out[b, h, c.a : c.b] = o[:, 0]
        lse[b, h, c.a : c.b] = l[:, 0]


def _alibi_backward_item(
    item: tuple[list[int], slice],
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    grads: tuple[torch.Tensor, ...] | None,
    param_grad: torch.Tensor | None,
    spec: _Toeplitz,
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Accumulate one work item's ``(dq, dk, dv)`` (into ``grads``) and its share of the parameter gradient
    (``param_grad[b, h, p] += sum_ij dS_ij d bias_ij / d theta_p``), recomputing each chunk against the saved
    out/lse. ``None`` skips either part; the parameter part is one more math pass of the chunk's scores."""
    q, k, v, out, lse = saved[:5]
    heads, b = item
    for h, hk, c, bias, weights in _head_chunks(heads, q, k, spec, causal, backend, param_grad is not None):
        qs, ks = slice(c.a, c.b), slice(c.lo, c.hi)
        args = (
            dout[b, h : h + 1, qs],
            q[b, h : h + 1, qs],
            k[b, hk : hk + 1, ks],
            v[b, hk : hk + 1, ks],
            out[b, h : h + 1, qs],
            lse[b, h : h + 1, qs],
        )
        if grads is not None:
            dq, dk, dv = grads
            gq, gk, gv = attend_backward(*args, causal=False, scale=scale, kernel=backend, bias=bias)
            dq[b, h, qs] += gq[:, 0]
            dk[b, hk, ks] += gk[:, 0]
            dv[b, hk, ks] += gv[:, 0]
        if param_grad is not None:
            assert weights is not None
            q0 = k.shape[2] - q.shape[2]
            param_grad[b, h] += _param_grad_share(args, bias, weights, c, q0, spec.reach(h), causal, scale)


def _param_grad_share(
    args: tuple[torch.Tensor, ...],
    bias: torch.Tensor,
    weights: torch.Tensor,
    c: _Chunk,
    q0: int,
    reach: int | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """``(N, P)``: ``sum_ij dS_ij weights[p]_ij`` over chunk ``c`` (``args``: its ``dout, q, k, v, out, lse`` views;
    ``q0`` the position of query row 0).

    The chunk is walked in sub-blocks of about ``GRAD_ELEMENTS`` scores (cache-sized: the pass is elementwise
    work around two matmuls), each on the keys its rows keep (causal: up to its last row; window: within reach), so
    masked pairs, whose ``p`` is 0, are not computed; the sum is the chunk's.
    """
    dout, q, k, v, out, lse = args
    keys = c.hi - c.lo
    span = keys if reach is None else min(keys, 2 * reach + 1)
    step = max(1, min(c.b - c.a, GRAD_ELEMENTS // max(1, span)))
    total = torch.zeros((q.shape[0], weights.shape[0]), dtype=acc_dtype(q.dtype), device=q.device)
    for a in range(c.a, c.b, step):
        b = min(c.b, a + step)
        first, last = q0 + a, q0 + b - 1
        lo = c.lo if reach is None else max(c.lo, first - reach)
        hi = min(c.hi, last + 1) if causal else (c.hi if reach is None else min(c.hi, last + reach + 1))
        rs, ks = slice(a - c.a, b - c.a), slice(lo - c.lo, hi - c.lo)
        sub = (dout[..., rs, :], q[..., rs, :], k[..., ks, :], v[..., ks, :], out[..., rs, :], lse[..., rs])
        ws = [weights[p, rs, ks][None, None] for p in range(weights.shape[0])]
        total += attend_bias_grads(*sub, ws, causal=False, scale=scale, bias=bias[..., rs, ks])[:, 0]
    return total


def exact_route(window: torch.Tensor | None, k_len: int, backend: str, device: torch.device) -> str:
    """The route (one of :data:`EXACT_ROUTES`) of an exact call with ``k_len`` keys, resolved torch kernel ``backend``
    (``"flash"`` or ``"math"``) on ``device``, and the largest kept distance of each head (``window (Hq,)`` float64,
    ``inf``: every key; ``None``: no window).

    * ``"fused"`` when the kernel is torch's fused CPU flash op and no head's window drops a key (none, or every
      entry ``>= k_len - 1``, the largest distance a call has), at every length: one kernel call per
      :data:`FUSED_ROWS` query rows (causal; bidirectional: all rows) for all heads and batch rows together, the
      keys in reverse order so that the bias, which depends on ``i - j`` only, is a strided view (with positive
      strides) of one ``O(Lq + Lk)`` line per head (:meth:`_Toeplitz.line`): no ``n x n`` tensor and no bias
      construction. Causal calls skip the masked triangle above each call's rows.
    * ``"banks"`` otherwise (a window that cuts, the math kernel, other devices): per head, query chunks of about
      :data:`CHUNK_ELEMENTS` bias entries, views of one Toeplitz bank per head, each chunk on the keys it keeps.

    The slope and decay-parameter gradients take the ``"banks"`` chunks on either route (one math pass).
    """
    if backend != "flash" or device.type != "cpu":
        return "banks"
    if window is not None and bool((window < k_len - 1).any()):
        return "banks"
    return "fused"


def _fused_chunks(q_len: int, k_len: int, causal: bool) -> list[_Chunk]:
    """The ``"fused"`` route's query chunks: :data:`FUSED_ROWS` rows each (causal, every key up to the last row) or
    all rows on every key (bidirectional)."""
    q0 = k_len - q_len
    rows = FUSED_ROWS if causal else max(1, q_len)
    chunks = []
    for a in range(0, q_len, rows):
        b = min(q_len, a + rows)
        chunks.append(_Chunk(a, b, 0, q0 + b if causal else k_len))
    return chunks


class _FusedPlan:
    """The ``"fused"`` route of one call: its chunks, its key order, and every chunk's bias from one line per head.

    Against keys in reverse order (``kr[x] = k[Lk - 1 - x]``), chunk ``c``'s keys ``[lo, hi)`` are the slice
    ``kr[Lk - hi : Lk - lo]``, whose column ``x`` is key ``hi - 1 - x``; query row ``r`` (position ``q0 + a + r``)
    then has ``i - j = r + x + q0 + a - hi + 1``, which grows along rows and along columns alike. So the chunk's
    bias is the view of the line (bias at ``i - j = first + t``) with strides ``(1, 1)`` from entry
    ``q0 + a - hi + 1 - first``: positive strides, which the fused kernel reads as any mask.

    Reversing costs a copy of ``k`` and ``v`` per pass (and of ``dk, dv`` in the backward). With few query rows
    (decoding, short chunks: ``Hq Lq <`` :data:`FUSED_DENSE_RATIO` ``Hkv d``) the keys stay in order and one call
    takes a dense ``(1, Hq, Lq, Lk)`` bias copied from the reversed line (no more entries than that many copies of
    ``k``).
    """

    def __init__(self, spec: _Toeplitz, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
        q_len, k_len = q.shape[2], k.shape[2]
        self.q0 = k_len - q_len
        self.k_len = k_len
        self.reversed = q.shape[1] * q_len >= FUSED_DENSE_RATIO * k.shape[1] * k.shape[3]
        self.chunks = _fused_chunks(q_len, k_len, causal and self.reversed)
        self.first = min((self.q0 + c.a - c.hi + 1 for c in self.chunks), default=0)
        last = max((self.q0 + c.b - 1 - c.lo for c in self.chunks), default=0)
        self.line = spec.line(self.first, max(self.first, last), causal, q.dtype, q.device)
        self.dense = None
        if not self.reversed:  # bias[r, j] = line[q0 + r - j - first] = flipped[r' + j], r' = Lq - 1 - r
            flipped = self.line.flip(-1)
            width = flipped.shape[1]
            view = flipped.as_strided((1, flipped.shape[0], q_len, k_len), (0, width, 1, 1))
            self.dense = view.flip(-2) if q_len > 1 else view

    def keys(self, c: _Chunk) -> slice:
        """Chunk ``c``'s keys in the plan's key order."""
        return slice(self.k_len - c.hi, self.k_len - c.lo) if self.reversed else slice(c.lo, c.hi)

    def order(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, H, Lk, d)`` (keys, values or their gradients) in the plan's key order, or back (an involution)."""
        return x.flip(2) if self.reversed else x

    def bias(self, heads: slice, c: _Chunk) -> torch.Tensor:
        """``(1, heads, rows, keys)``: chunk ``c``'s bias for query ``heads`` against its keys (a view)."""
        if self.dense is not None:
            return self.dense[:, heads]
        line = self.line
        width = line.shape[1]
        start = line.storage_offset() + heads.start * width + self.q0 + c.a - c.hi + 1 - self.first
        shape = (1, heads.stop - heads.start, c.b - c.a, c.hi - c.lo)
        return line.as_strided(shape, (0, width, 1, 1), start)


def _fused_items(q: torch.Tensor, k: torch.Tensor) -> list[tuple[slice, slice]]:
    """``(query heads, batch rows)`` pieces of the ``"fused"`` route: all at once with one worker (one kernel call
    per chunk), else :func:`work_items`' pieces (the query heads of one key/value head, a slice of the batch)."""
    workers = workers_for(q.device)
    if workers <= 1:
        return [(slice(0, q.shape[1]), slice(0, q.shape[0]))]
    group = q.shape[1] // k.shape[1]
    items = work_items([(h, h // group, 1.0) for h in range(q.shape[1])], q.shape[0], workers)
    return [(slice(min(heads), max(heads) + 1), b) for heads, b in items]


def _kv_heads(heads: slice, group: int) -> slice:
    return slice(heads.start // group, (heads.stop - 1) // group + 1)


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, spec: _Toeplitz,
    causal: bool, scale: float,
) -> None:  # fmt: skip
    """The ``"fused"`` route's forward into ``out`` and ``lse`` (inputs in the flash kernel's layout)."""
    plan = _FusedPlan(spec, q, k, causal)
    kr, vr = plan.order(k), plan.order(v)
    group = q.shape[1] // k.shape[1]

    def run(item: tuple[slice, slice]) -> None:
        heads, b = item
        kh = _kv_heads(heads, group)
        for c in plan.chunks:
            ks = plan.keys(c)
            o, l = attend(q[b, heads, c.a : c.b], kr[b, kh, ks], vr[b, kh, ks], causal=False, scale=scale,
                          kernel="flash", bias=plan.bias(heads, c))  # fmt: skip
            out[b, heads, c.a : c.b] = o
            lse[b, heads, c.a : c.b] = l

    items = _fused_items(q, k)
    run_all(run, items, pool_size(len(items), q.device))


def _fused_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    spec: _Toeplitz, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` of the ``"fused"`` route against the saved ``out`` and ``lse`` (float32 or float64, its own
    accumulation dtype). The last chunk's keys are every key: its key gradients initialise the sums (walked last to
    first), which the other chunks add to."""
    plan = _FusedPlan(spec, q, k, causal)
    kr, vr = plan.order(k), plan.order(v)
    group = q.shape[1] // k.shape[1]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dkr, dvr = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))

    def run(item: tuple[slice, slice]) -> None:
        heads, b = item
        kh = _kv_heads(heads, group)
        for i, c in enumerate(reversed(plan.chunks)):
            ks, qs = plan.keys(c), slice(c.a, c.b)
            gq, gk, gv = attend_backward(
                dout[b, heads, qs], q[b, heads, qs], kr[b, kh, ks], vr[b, kh, ks], out[b, heads, qs],
                lse[b, heads, qs], causal=False, scale=scale, kernel="flash", bias=plan.bias(heads, c),
            )  # fmt: skip
            dq[b, heads, qs] = gq
            if i == 0 and ks == slice(0, k.shape[2]):
                dkr[b, kh] = gk
                dvr[b, kh] = gv
            else:
                dkr[b, kh, ks] += gk
                dvr[b, kh, ks] += gv

    items = _fused_items(q, k)
    run_all(run, items, pool_size(len(items), q.device))
    return dq, plan.order(dkr), plan.order(dvr)


def _toeplitz_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: _Toeplitz, causal: bool, scale: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of exact attention with the Toeplitz bias ``spec``, chunk by chunk (non-finite keys zeroed,
    the rows that keep one set to NaN)."""
    q, k, v, bad = _kernel_inputs(q, k, v, backend)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
    if exact_route(spec.window, k.shape[2], backend, q.device) == "fused":
        _fused_forward(q, k, v, out, lse, spec, causal, scale)
    else:
        items = _head_items(q, k, spec.window)
        run = partial(
            _alibi_forward_item, q=q, k=k, v=v, out=out, lse=lse, spec=spec, causal=causal, scale=scale,
            backend=backend,
        )  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
    if bad is not None:
        poison_rows(out, lse, _alibi_rows_with_bad_keys(bad, q.shape[1], q.shape[2], spec.window, causal))
    return out, lse


def _kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q, k, v`` in the kernel's layout (once per call; chunks are views) with non-finite keys zeroed, and those
    keys; the forward and the backward read the same tensors."""
    q, k, v = (kernel_layout(x, backend) for x in (q, k, v))
    bad = nonfinite_keys(k, v)  # zeroed here, and the rows that keep them set to NaN by the forward
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    return q, k, v, bad


def _toeplitz_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: _Toeplitz,
    causal: bool,
    scale: float,
    backend: str,
    qkv_grad: bool,
    theta_grad: bool,
) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """``((dq, dk, dv) or None, param_grad (B, Hq, P) or None)`` against the saved ``out`` and ``lse``: each part
    only when asked for (the parameter part is one more math pass of every chunk's scores)."""
    q, k, v, _ = _kernel_inputs(q, k, v, backend)
    dout = dout.contiguous()
    acc = acc_dtype(q.dtype)
    fused = qkv_grad and exact_route(spec.window, k.shape[2], backend, q.device) == "fused"
    grads = None
    if qkv_grad and not fused:
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    # per (batch row, head): every (b, h) belongs to one work item, so the workers write disjoint entries
    param_grad = None
    if theta_grad:
        param_grad = torch.zeros((q.shape[0], q.shape[1], spec.num_params), dtype=acc, device=q.device)
    if grads is not None or param_grad is not None:  # the "banks" chunks (on the "fused" route: the parameter pass)
        items = _head_items(q, k, spec.window)
        run = partial(
            _alibi_backward_item, saved=(q, k, v, out, lse), dout=dout, grads=grads, param_grad=param_grad,
            spec=spec, causal=causal, scale=scale, backend=backend,
        )  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
    if fused:
        return _fused_backward(dout, q, k, v, out, lse, spec, causal, scale), param_grad
    if grads is not None:
        grads = tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
    return grads, param_grad


def _spec(kind: str, theta: torch.Tensor, window: torch.Tensor | None, check: bool) -> _Toeplitz:
    """The call's :class:`_Toeplitz` from the op's ``theta`` (ALiBi: the slopes ``(Hq,)``; a decay family: its
    parameters ``(Hq, P)``), read detached in float64 on the CPU. ``check``: validate the values first (compiled
    calls, whose public function could not read them; ``ValueError`` naming ``slopes``, ``window`` or ``params``)."""
    hq = theta.shape[0]
    if kind == "alibi":
        values = as_slopes(theta, hq) if check else theta.detach().to("cpu", torch.float64)
        if check:
            window = as_window(window, hq)
        elif window is not None:
            window = window.detach().to("cpu", torch.float64)
        return _Toeplitz(kind, values[:, None], window)
    fam = decay_family(kind)
    values = fam.check_params(theta, hq)[1] if check else theta.detach().to("cpu", torch.float64)
    return _Toeplitz(fam.name, values, None)


def _exact_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    window: torch.Tensor | None,
    kind: str,
    causal: bool,
    scale: float,
    backend: str,
    check: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of exact attention with the bias of ``kind`` (``"alibi"``: slopes ``theta (Hq,)``, optional
    ``window (Hq,)``; a decay family's name: its parameters ``theta (Hq, P)``), row group by row group with a
    ``key_padding_mask`` (padded query rows: ``out = 0``, ``lse = -inf``). ``check``: see :func:`_spec`."""
    spec = _spec(kind, theta, window, check)
    groups = row_groups(key_padding_mask, q.shape[2])
    if groups is None:
        return _toeplitz_forward(q, k, v, spec, causal, scale, backend)

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _toeplitz_forward(qg, kg, vg, spec, causal, scale, backend)

    return forward_row_groups(q, k, v, groups, attend)


#: The names of ``exact_forward``'s inputs, in order: ``setup_context`` and the backward read and return them by name.
EXACT_INPUTS: tuple[str, ...] = tuple(inspect.signature(_exact_forward).parameters)

exact_forward = torch.library.custom_op("positional_lsh::exact_forward", _exact_forward, mutates_args=())


@exact_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    return output_buffers(q, empty=True)


@torch.library.custom_op("positional_lsh::exact_backward", mutates_args=())
def exact_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    theta: torch.Tensor,
    window: torch.Tensor | None,
    kind: str,
    causal: bool,
    scale: float,
    backend: str,
    qkv_grad: bool,
    theta_grad: bool,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dtheta)`` of :func:`exact_forward` by recomputation against the saved ``out`` and ``lse``,
    row group by row group with a ``key_padding_mask`` (padded positions get zero gradients). ``dq, dk, dv`` when
    ``qkv_grad`` (else zeros); ``dtheta`` (``sum dS * d bias / d theta``, accumulated in float32, float64 for
    float64 inputs; in ``theta``'s shape, dtype and device) when ``theta_grad`` (else zeros, and no extra pass)."""
    spec = _spec(kind, theta, window, False)  # the forward checked the values
    groups = row_groups(key_padding_mask, q.shape[2])
    args = (spec, causal, scale, backend, qkv_grad, theta_grad)
    if groups is None:
        grads, param_grad = _toeplitz_backward(dout, q, k, v, out, lse, *args)
        dtheta = None if param_grad is None else param_grad.sum(0)
    else:
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)) if qkv_grad else None
        dtheta = torch.zeros((q.shape[1], spec.num_params), dtype=acc_dtype(q.dtype), device=q.device)
        for g in groups:
            gk, gq = g.keys, g.queries
            part, pg = _toeplitz_backward(
                dout[g.rows][:, :, gq], q[g.rows][:, :, gq], k[g.rows][:, :, gk], v[g.rows][:, :, gk],
                out[g.rows][:, :, gq], lse[g.rows][:, :, gq], *args,
            )  # fmt: skip
            if grads is not None and part is not None:
                for full, x, where in zip(grads, part, (gq, gk, gk), strict=True):
                    full[g.rows, :, where] = x
            if pg is not None:
                dtheta += pg.sum(0)
    if grads is None:
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dq, dk, dv = grads
    if not theta_grad or dtheta is None:
        return dq, dk, dv, torch.zeros(theta.shape, dtype=theta.dtype, device=theta.device)
    return dq, dk, dv, dtheta.reshape(theta.shape).to(device=theta.device, dtype=theta.dtype)


@exact_backward.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    theta: torch.Tensor,
    *_: object,
    **__: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    dq, dk, dv, dt = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, theta))
    return dq, dk, dv, dt


# The forward's settings the backward takes as they are (its other inputs are tensors saved for it).
_SETTINGS = ("kind", "causal", "scale", "backend")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    args = dict(zip(EXACT_INPUTS, inputs, strict=True))
    out, lse = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, args["theta"], args["window"],
                          args["key_padding_mask"])  # fmt: skip
    ctx.settings = {n: args[n] for n in _SETTINGS}
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, theta, window, mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # (the dispatcher drops trailing inputs left at their defaults from needs_input_grad: none of them is a grad's)
    need = dict(zip(EXACT_INPUTS, ctx.needs_input_grad, strict=False))
    qkv_grad = bool(need["q"] or need["k"] or need["v"])
    theta_grad = bool(need["theta"])
    dq, dk, dv, dtheta = exact_backward(
        dout, q, k, v, out, lse, theta, window, **ctx.settings, qkv_grad=qkv_grad, theta_grad=theta_grad,
        key_padding_mask=mask,
    )  # fmt: skip
    grads = {"q": dq, "k": dk, "v": dv, "theta": dtheta}
    return tuple(grads[n] if n in grads and need[n] else None for n in EXACT_INPUTS)


exact_forward.register_autograd(_backward_fn, setup_context=_setup_context)


def _kernel_backend(backend: str, q: torch.Tensor, op: str) -> str:
    """The torch kernel of an exact op's ``backend`` for ``q`` (half types: ``"math"``, float32 scores)."""
    if backend == "triton":
        raise ValueError(
            f"backend='triton' is not available for {op}: exact ALiBi has no Triton path "
            f"(the Triton kernels are positional LSH's); backend must be one of {ALIBI_BACKENDS}"
        )
    check_backend(backend, ALIBI_BACKENDS)
    requested = backend
    backend = resolve_backend(backend, q.device)
    if q.dtype in (torch.float16, torch.bfloat16):
        if requested == "flash":
            raise ValueError(
                f"backend='flash' is not supported for {q.dtype} in {op}: the fused op would round the "
                "bias to the input precision. Use backend='math' or 'auto' (float32 scores)"
            )
        backend = "math"
    return backend


def alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    causal: bool = True,
    window: torch.Tensor | float | None = None,
    scale: float | None = None,
    backend: str = "auto",
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact (optionally windowed) ALiBi attention with ``O(n)`` memory and a recomputing backward.

    Computes ``softmax_j(scale * q_i . k_j - slopes[h] * |i - j|) v`` over keys ``j <= i`` when ``causal``,
    dropping keys with ``|i - j| > window[h]`` when ``window`` is given (one number or one per head).

    Args:
        q: ``(B, Hq, Lq, d)``; float32, float64, bfloat16 or float16.
        k, v: ``(B, Hkv, Lk, d)``, ``Hq % Hkv == 0``, ``Lq <= Lk`` (queries aligned to the last keys).
        slopes: ``(Hq,)`` slopes ``>= 0`` or one float; default ``alibi_slopes(Hq)``. A tensor (``(Hq,)`` or 0-d,
            any dtype and device) that requires grad gets ``dL/dm_h = -sum_{b,i,j} dS_bhij |i - j|`` (``dS`` the
            gradient of the loss with respect to the biased score), accumulated in float32 (float64 for float64
            inputs) and returned in the slopes' dtype and device (a 0-d tensor gets the sum over heads). The
            window is a hard mask: no gradient flows through it. A float (or a tensor without grad) gets none,
            and then the backward does no extra work.
        causal: causal masking.
        window: ``None`` (exact), or the largest kept distance ``|i - j|``, one float or ``(Hq,)``.
        scale: score scale, default ``1/sqrt(d)``.
        backend: one of :data:`ALIBI_BACKENDS`: ``"auto"`` (CPU: ``"flash"``, other devices: ``"math"``),
            ``"flash"`` (CPU fused op, float32/float64) or ``"math"``. ``"auto"`` uses ``"math"`` (float32 scores)
            for half types, so that the bias is not rounded to 8 bits; an explicit ``"flash"`` with a half type
            is refused (``ValueError``), and so is ``"triton"`` (no Triton path for exact ALiBi).
        key_padding_mask: ``None`` (every key valid) or a ``(B, Lk)`` bool tensor on ``q``'s device, ``True`` for a
            valid key; each row's valid keys must be one contiguous run (left and/or right padding), else
            ``ValueError`` naming ``key_padding_mask``. Each row is computed on its run alone (distances are
            counted within it), queries stay aligned to the last ``Lq`` keys, and query rows at padded positions
            return zeros and get zero gradients (:mod:`positional_lsh.ops.padding`).

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype; supports autograd (``q``, ``k``, ``v`` and a ``slopes`` tensor). A NaN
        or inf in a key or value makes exactly the rows that keep that key NaN, and the slope gradient of exactly
        the heads with such a row NaN (as dense autograd with a masked bias gives); masked (causal or
        out-of-window) keys never reach a row.

    Example:
        >>> import torch
        >>> from positional_lsh import alibi_attention, alibi_bias, alibi_slopes
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 4, 64, 16, dtype=torch.float64, generator=g) for _ in range(3))
        >>> bias = alibi_bias(64, 64, alibi_slopes(4), causal=True, dtype=torch.float64)  # -m |i - j|, -inf if j > i
        >>> dense = torch.softmax(q @ k.transpose(-1, -2) / 16**0.5 + bias, dim=-1) @ v
        >>> torch.allclose(alibi_attention(q, k, v), dense)
        True
        >>> windowed = alibi_attention(q, k, v, window=8.0)  # keys with |i - j| <= 8 only
        >>> torch.allclose(windowed[..., :9, :], dense[..., :9, :])  # rows 0..8 have no farther key
        True
        >>> m = alibi_slopes(4).double().requires_grad_()  # learned slopes
        >>> alibi_attention(q, k, v, m).sum().backward()
        >>> m.grad.shape
        torch.Size([4])
    """
    _, hq, _, _, lk, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    check_bool("causal", causal)
    backend = _kernel_backend(backend, q, "alibi_attention")
    mask = check_key_padding_mask(key_padding_mask, q, lk)
    compiling = torch.compiler.is_compiling()  # then the op checks the values (they cannot be read when tracing)
    if q.device.type == "meta" and is_meta_tensor(slopes) and not compiling:
        # Meta slopes hold no values: shapes only (connected to the slopes for autograd).
        assert isinstance(slopes, torch.Tensor)
        check_meta_slopes(slopes, hq)
        if not is_meta_tensor(window):
            as_window(window, hq)
        return meta_output(q, k, v, slopes)
    if compiling:
        theta, win = slopes_tensor(slopes, hq), None if window is None else slopes_tensor(window, hq)
    else:
        theta, win = as_slopes(slopes, hq), as_window(window, hq)  # detached float64 values, checked
    if isinstance(slopes, torch.Tensor) and slopes.requires_grad:  # learnable: the tensor is the op's input
        theta = slopes.expand(hq) if slopes.dim() == 0 else slopes
    return _exact_call(q, k, v, theta, win, "alibi", causal, sc, backend, compiling, mask)


def decay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    family: str,
    params: torch.Tensor | Sequence[float],
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention with a built-in positional decay, ``O(n)`` memory, and gradients for its parameters.

    Computes ``softmax_j(scale * q_i . k_j + log k_theta_h(|i - j|)) v`` (over ``j <= i`` when ``causal``): the
    bias is added after scaling, ``-inf`` where ``k = 0``. The families
    (:data:`~positional_lsh.ops.partitions.decays.DECAY_FAMILIES`) and their parameters, in this order:

    * ``"exponential"``: ``slope >= 0``, ``log k = -slope d`` (ALiBi's ``-m |i - j|``);
    * ``"power"``: ``r1 > 0, r2 > 0``, ``log k = -r1 log(1 + r2 d)`` (KERPLE's power/log decay);
    * ``"truncated-linear"``: ``width >= 1``, ``log k = log(1 - d / width)`` for ``d < width``, ``-inf`` beyond
      (a hard mask: no gradient through the support's edge).

    Chunked over queries like :func:`alibi_attention` (the same Toeplitz banks and recomputing backward; a
    truncated-linear head only visits keys within its width).

    Args:
        q: ``(B, Hq, Lq, d)``; float32, float64, bfloat16 or float16.
        k, v: ``(B, Hkv, Lk, d)``, ``Hq % Hkv == 0``, ``Lq <= Lk`` (queries aligned to the last keys).
        family: a family name (above); ``ValueError`` naming ``family`` otherwise.
        params: ``(Hq, P)`` (one row per query head) or ``(P,)`` (every head), a tensor (any float dtype and
            device) or numbers. A tensor that requires grad gets ``dL/dtheta_hp = sum_{b,i,j} dS_bhij d log
            k_theta_h(|i - j|) / d theta_p`` (``dS``: the gradient of the loss with respect to the biased score),
            accumulated in float32 (float64 for float64 inputs), in its own shape, dtype and device; each
            parameter costs one more math pass of score recomputation per chunk in the backward. ``ValueError``
            naming ``params`` for a wrong shape or a value outside the family's bounds.
        causal: causal masking.
        scale: score scale, default ``1/sqrt(d)``.
        backend: as :func:`alibi_attention`.
        key_padding_mask: as :func:`alibi_attention`.

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype; supports autograd (``q``, ``k``, ``v``, ``params``). Non-finite keys
        poison exactly the rows that keep them, as in :func:`alibi_attention`.

    Example:
        >>> import torch
        >>> from positional_lsh import decay_attention
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 32, 8, dtype=torch.float64, generator=g) for _ in range(3))
        >>> theta = torch.tensor([[0.5, 1.0], [2.0, 0.3]], dtype=torch.float64, requires_grad=True)  # (r1, r2)
        >>> decay_attention(q, k, v, "power", theta).sum().backward()
        >>> theta.grad.shape
        torch.Size([2, 2])
    """
    _, hq, _, _, lk, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    check_bool("causal", causal)
    fam = decay_family(family)
    compiling = torch.compiler.is_compiling()  # then the op checks the parameters (shape and values)
    if compiling:
        theta = params if isinstance(params, torch.Tensor) else torch.as_tensor(params, dtype=torch.float64)
        if theta.dim() == 1 and theta.shape[0] == fam.num_params:
            theta = theta[None].expand(hq, fam.num_params)
    else:
        theta, _ = fam.check_params(params, hq)
    backend = _kernel_backend(backend, q, "decay_attention")
    mask = check_key_padding_mask(key_padding_mask, q, lk)
    return _exact_call(q, k, v, theta, None, fam.name, causal, sc, backend, compiling, mask)


def _exact_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    window: torch.Tensor | None,
    kind: str,
    causal: bool,
    scale: float,
    backend: str,
    check: bool,
    key_padding_mask: torch.Tensor | None,
) -> torch.Tensor:
    """A checked call of either exact op, eager or compiled: :func:`exact_forward` through ``torch.ops``."""
    out, _ = exact_forward(
        q, k, v, theta, window, kind, causal, scale, backend, check=check, key_padding_mask=key_padding_mask
    )
    return out
