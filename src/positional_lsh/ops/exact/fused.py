"""The ``"fused"`` route of the exact ops (:func:`exact_route`): torch's fused CPU flash kernel on every head at once,
the bias a strided view of one ``O(n)`` line per head against the keys in reverse order (:class:`FusedPlan`): no bias
construction, and causal calls skip the masked triangle. Used by :mod:`positional_lsh.ops.exact.op`.
"""

from __future__ import annotations

import torch

from positional_lsh.ops._engine.kinds import Kernel
from positional_lsh.ops._engine.parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops._engine.torch_attention import Grad, attend, attend_backward
from positional_lsh.ops.exact.toeplitz import Chunk, Toeplitz

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


def exact_route(window: torch.Tensor | None, k_len: int, backend: str, device: torch.device) -> str:
    """The route (one of :data:`EXACT_ROUTES`) of an exact call with ``k_len`` keys, resolved torch kernel ``backend``
    (``"flash"`` or ``"math"``) on ``device``, and the largest kept distance of each head (``window (Hq,)`` float64,
    ``inf``: every key; ``None``: no window).

    * ``"fused"`` when the kernel is torch's fused CPU flash op and no head's window drops a key (none, or every
      entry ``>= k_len - 1``, the largest distance a call has), at every length: one kernel call per
      :data:`FUSED_ROWS` query rows (causal; bidirectional: all rows) for all heads and batch rows together, the
      keys in reverse order so that the bias, which depends on ``i - j`` only, is a strided view (with positive
      strides) of one ``O(Lq + Lk)`` line per head
      (:meth:`~positional_lsh.ops.exact.toeplitz.Toeplitz.line`): no ``n x n`` tensor and no bias
      construction. Causal calls skip the masked triangle above each call's rows.
    * ``"banks"`` otherwise (a window that cuts, the math kernel, other devices): per head, query chunks of about
      :data:`CHUNK_ELEMENTS` bias entries, views of one Toeplitz bank per head, each chunk on the keys it keeps.

    The slope and decay-parameter gradients take the ``"banks"`` chunks on either route (one math pass).
    """
    if backend != Kernel.FLASH or device.type != "cpu":
        return "banks"
    if window is not None and bool((window < k_len - 1).any()):
        return "banks"
    return "fused"


def _fused_chunks(q_len: int, k_len: int, causal: bool) -> list[Chunk]:
    """The ``"fused"`` route's query chunks: :data:`FUSED_ROWS` rows each (causal, every key up to the last row) or
    all rows on every key (bidirectional)."""
    q0 = k_len - q_len
    rows = FUSED_ROWS if causal else max(1, q_len)
    chunks = []
    for a in range(0, q_len, rows):
        b = min(q_len, a + rows)
        chunks.append(Chunk(a, b, 0, q0 + b if causal else k_len))
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

    def __init__(self, spec: Toeplitz, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
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

    def keys(self, c: Chunk) -> slice:
        """Chunk ``c``'s keys in the plan's key order."""
        return slice(self.k_len - c.hi, self.k_len - c.lo) if self.reversed else slice(c.lo, c.hi)

    def order(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, H, Lk, d)`` (keys, values or their gradients) in the plan's key order, or back (an involution)."""
        return x.flip(2) if self.reversed else x

    def bias(self, heads: slice, c: Chunk) -> torch.Tensor:
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


def fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, spec: Toeplitz,
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


def fused_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    spec: Toeplitz, causal: bool, scale: float,
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
            grad = Grad(dout[b, heads, qs], q[b, heads, qs], kr[b, kh, ks], vr[b, kh, ks], out[b, heads, qs],
                        lse[b, heads, qs])  # fmt: skip
            gq, gk, gv = attend_backward(grad, causal=False, scale=scale, kernel="flash", bias=plan.bias(heads, c))
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
