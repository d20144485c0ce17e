"""The ``"banks"`` route of the exact ops: per head, query chunks whose bias (and weights) are views of one Toeplitz
bank.

Exact attention with a bias that depends on ``i - j`` only (ALiBi's ``-m_h |i - j|``, a decay family's ``log
k_theta(|i - j|)``, ``-inf`` beyond a window): per head, query chunks of about :data:`CHUNK_ELEMENTS` bias entries,
each on the keys it keeps, whose biases are views of one bank per head (:class:`HeadPlan`); the parameter gradient
(``d bias / d theta``) from one more math pass per chunk in sub-blocks of about :data:`GRAD_ELEMENTS` scores.
:func:`bias_line` is the ALiBi ramp every exact bias entry is one value of (the ``"fused"`` route's bias and a decoded
token's bias row are views of it). Used by :mod:`positional_lsh.ops.exact.op`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from positional_lsh.ops._engine.kinds import Kernel
from positional_lsh.ops._engine.parallel import work_items, workers_for
from positional_lsh.ops._engine.torch_attention import (
    Grad,
    acc_dtype,
    attend,
    attend_backward,
    attend_bias_grads,
    rows_keeping,
)
from positional_lsh.ops.exact.bias import alibi_bias
from positional_lsh.ops.partitions.decays import decay_family

# Each kernel call materializes at most about CHUNK_ELEMENTS bias/score entries; the parameter-gradient pass works
# on sub-blocks of a chunk of about GRAD_ELEMENTS scores.
_MIN_WINDOW_ROWS = 64  # query rows per chunk for windowed ALiBi (at least)
CHUNK_ELEMENTS = 2**22
GRAD_ELEMENTS = 2**16  # scores per call of the parameter-gradient pass (a sub-block of a chunk)


@dataclass(frozen=True)
class Chunk:
    a: int  # query rows [a, b)
    b: int
    lo: int  # key rows [lo, hi)
    hi: int


class HeadPlan:
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
            chunks.append(Chunk(a, b, lo, hi))
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

    def view(self, bank: torch.Tensor, c: Chunk) -> torch.Tensor:
        """Chunk ``c``'s ``(..., rows, keys)`` slice of a ``(..., rows, width)`` bank (a view)."""
        start = self.off - (self.q0 + c.a - c.lo)
        return bank[..., : c.b - c.a, start : start + c.hi - c.lo]


class Toeplitz:
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
        self, h: int, plan: HeadPlan, causal: bool, dtype: torch.dtype, weight_dtype: torch.dtype | None,
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


def head_items(q: torch.Tensor, k: torch.Tensor, window: torch.Tensor | None) -> list[tuple[list[int], slice]]:
    """Independent (heads, batch slice) pieces; a head's cost is its key span."""
    group = q.shape[1] // k.shape[1]
    lk = k.shape[2]
    spans = [lk if window is None else min(lk, 2 * float(window[h]) + 1) for h in range(q.shape[1])]
    return work_items([(h, h // group, spans[h]) for h in range(q.shape[1])], q.shape[0], workers_for(q.device))


def alibi_rows_with_bad_keys(
    bad: torch.Tensor, num_heads: int, q_len: int, window: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows whose kept keys (causal and window mask) include a ``bad`` (non-finite) key.

    ``bad`` is ``(B, Hkv, Lk)`` bool; these are the rows :func:`alibi_attention` sets to NaN.
    """
    lk = bad.shape[-1]
    pos = torch.arange(q_len, device=bad.device, dtype=torch.float64) + (lk - q_len)
    reach = torch.full((num_heads, 1), float(lk), dtype=torch.float64, device=bad.device)
    if window is not None:
        reach = torch.floor(window.to(bad.device, torch.float64)).clamp_max(lk)[:, None]
    first = (pos - reach).clamp_min(0).long()  # (Hq, Lq)
    last = (pos if causal else (pos + reach).clamp_max(lk - 1)).long().expand(num_heads, q_len)
    return rows_keeping(bad, first, last)


def _head_chunks(
    heads: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    spec: Toeplitz,
    causal: bool,
    backend: str,
    weights: bool = False,
) -> Iterator[tuple[int, int, Chunk, torch.Tensor, torch.Tensor | None]]:
    """``(query head, key head, chunk, its bias (1, 1, rows, keys), its weights (P, rows, keys) or None)`` for
    every query chunk of ``heads``, in order; the weights (``d bias / d theta``) only when asked for.

    The forward and the recomputing backward walk the same chunks with the same bias (one plan per head).
    """
    group = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    bias_dtype = q.dtype if backend == Kernel.FLASH else acc
    for h in heads:
        plan = HeadPlan(q.shape[2], k.shape[2], spec.reach(h), causal)
        bias_bank, weight_bank = spec.banks(h, plan, causal, bias_dtype, acc if weights else None, q.device)
        for c in plan.chunks:
            w = None if weight_bank is None else plan.view(weight_bank, c)
            yield h, h // group, c, plan.view(bias_bank, c)[None, None], w


def alibi_forward_item(
    item: tuple[list[int], slice],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: Toeplitz,
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


def alibi_backward_item(
    item: tuple[list[int], slice],
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    grads: tuple[torch.Tensor, ...] | None,
    param_grad: torch.Tensor | None,
    spec: Toeplitz,
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
            gq, gk, gv = attend_backward(Grad(*args), causal=False, scale=scale, kernel=backend, bias=bias)
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
    c: Chunk,
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
        total += attend_bias_grads(Grad(*sub), ws, causal=False, scale=scale, bias=bias[..., rs, ks])[:, 0]
    return total
