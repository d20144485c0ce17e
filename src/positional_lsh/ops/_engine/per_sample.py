"""The per-sample backend of the estimator: one kernel call per group of equal blocks of every sample.

Each sample of a head is computed as regular attention restricted to its contiguous blocks, returning
``(O_t, lse_t)``; samples are merged by log-sum-exp, ``lse = logsumexp_t lse_t``,
``out = sum_t exp(lse_t - lse) O_t`` (the ``1/T`` cancels), one fused ``lerp`` per sample. Identical samples of a
head (slope 0, or large slopes whose blocks are single positions) are computed once and counted with their
multiplicity.

Backward: the merged output is one softmax over the union of the (sample, block) key sets, so each block's
gradient is the standard flash-attention backward run with the *merged* ``out`` and ``lse``. (Autograd through the
merge would silently drop the gradient through the fused kernels' non-differentiable ``lse``; this module never
relies on it.) The surrogate slope gradient (``dist_grad``) adds, for every kernel call, ``sum_ij dS_ij |i - j|``
over the call's (query, key) positions (``ops._engine.torch_attention.attend_bias_grad``, one more math pass over the
call's scores) into its query head's entry.

The backend (:class:`PerSampleBackend`, the rows ``("samples", "flash")`` and ``("samples", "math")`` of the
engine's table: :data:`PER_SAMPLE_FLASH`, :data:`PER_SAMPLE_MATH`) implements
:class:`~positional_lsh.ops._engine.backend.Backend`: its plan is a :class:`SamplesPlan` (:func:`samples_plan`), one
:class:`HeadWork` per query head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from positional_lsh.ops._engine.backend import Gradients, Saved, accumulators
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops._engine.torch_attention import Grad, acc_dtype, attend, attend_backward, attend_bias_grad
from positional_lsh.ops.partitions.partition import Partitions, block_runs
from positional_lsh.ops.partitions.schemes import get_scheme

__all__ = [
    "PER_SAMPLE_FLASH",
    "PER_SAMPLE_MATH",
    "HeadWork",
    "PerSampleBackend",
    "SamplesPlan",
    "Segment",
    "WorkItem",
    "head_work",
    "samples_plan",
    "segment_distance",
    "segments",
    "split_causal",
    "work_items_of",
]  # fmt: skip


@dataclass(frozen=True)
class Segment:
    """``count`` equal-shape blocks of one (sample, head), processed by one kernel call.

    Block ``c`` (``0 <= c < count``) pairs the query rows ``q_start + c*step + [0, q_len)`` with the key rows
    ``k_start + c*step + [0, k_len)``, where ``step = stride or k_len`` (adjacent blocks by default). Query row
    ``r`` sits at key position ``r + Lk - Lq``: queries are aligned to the last keys. ``q_len < k_len`` only
    for the one block that the first query cuts (decoding, chunked prefill); its queries are the block's
    *last* ``q_len`` positions. If ``index`` is given, it is a ``(count, k_len)`` tensor of the key positions
    of non-adjacent blocks, and the rows are ``index + q_start`` for queries and ``index + k_start`` for keys.
    ``masked`` says whether the causal mask applies inside the segment (``False`` for pieces whose keys all
    precede their queries).
    """

    q_start: int
    k_start: int
    q_len: int
    k_len: int
    count: int
    index: torch.Tensor | None = None
    stride: int = 0
    masked: bool = True

    @property
    def step(self) -> int:
        """The distance between the starts of consecutive blocks."""
        return self.stride or self.k_len



def segments(partitions: Partitions, sample: int, head: int, q_len: int | None = None) -> list[Segment]:
    """The per-sample work list of one (sample, head) of ``partitions``, for ``q_len`` queries aligned to the last
    keys (default: all ``n``): its blocks as :class:`Segment` s, equal adjacent blocks in one."""
    n = partitions.seq_len
    q_len = n if q_len is None else q_len
    q0 = n - q_len
    pitch = float(partitions.pitch[sample, head])
    shift = float(partitions.shift[sample, head])
    if get_scheme(partitions.scheme).integer and math.isfinite(pitch):
        return _integer_segments(int(pitch), int(shift), n, q0)
    starts, sizes = block_runs(pitch, shift, n)
    return _generic_segments(starts, sizes, n, q0)


def _cut_block(start: int, size: int, q0: int) -> Segment:
    """A block that the first query position ``q0`` may cut: queries ``max(start, q0)..start+size``."""
    qs = max(start, q0)
    return Segment(q_start=qs - q0, k_start=start, q_len=start + size - qs, k_len=size, count=1)


def _integer_segments(b: int, s: int, n: int, q0: int) -> list[Segment]:
    """Blocks ``[0, s)`` (when ``s > 0``), then ``[s + k b, s + (k+1) b)`` clipped to ``n``."""
    segs: list[Segment] = []
    if s > 0 and min(s, n) > q0:
        segs.append(_cut_block(0, min(s, n), q0))
    if s >= n:
        return segs
    start = s + ((q0 - s) // b) * b if q0 > s else s  # the block holding q0, or the first after it
    if start < q0:
        end = min(start + b, n)
        segs.append(_cut_block(start, end - start, q0))
        start = end
    full = max(0, (n - start) // b)
    if full > 0:
        segs.append(Segment(q_start=start - q0, k_start=start, q_len=b, k_len=b, count=full))
    tail = start + full * b
    if tail < n:
        segs.append(_cut_block(tail, n - tail, q0))
    return segs


def _generic_segments(starts: torch.Tensor, sizes: torch.Tensor, n: int, q0: int) -> list[Segment]:
    ends = starts + sizes
    keep = ends > q0
    starts, sizes = starts[keep], sizes[keep]
    segs: list[Segment] = []
    if starts.numel() and int(starts[0]) < q0:
        segs.append(_cut_block(int(starts[0]), int(sizes[0]), q0))
        starts, sizes = starts[1:], sizes[1:]
    if starts.numel() == 0:
        return segs
    # Group the remaining (whole) blocks by size; one kernel call per size, gathering rows.
    for size in torch.unique(sizes).tolist():
        sel = starts[sizes == size]
        count = sel.numel()
        first = int(sel[0])
        if count == 1 or bool((torch.diff(sel) == size).all()):
            segs.append(Segment(q_start=first - q0, k_start=first, q_len=size, k_len=size, count=count))
        else:
            index = sel[:, None] + torch.arange(size)
            segs.append(Segment(q_start=-q0, k_start=0, q_len=size, k_len=size, count=count, index=index))
    return segs


@dataclass(frozen=True)
class HeadWork:
    """Distinct partitions of one query head: ``(segments, multiplicity)`` pairs."""

    head: int
    kv_head: int
    samples: list[tuple[list[Segment], int]]

    @property
    def cost(self) -> int:
        """Score entries computed for this head (per batch element): a proxy for its time."""
        return sum(s.count * s.q_len * s.k_len for segments, _ in self.samples for s in segments)

    @property
    def calls(self) -> int:
        """Kernel calls for this head (per work item)."""
        return sum(len(segments) for segments, _ in self.samples)


# Causal blocks at least this long are split into sub-blocks (see split_causal).
_SPLIT_MIN = 192


def split_causal(seg: Segment) -> list[Segment]:
    """Split long causal blocks so that the kernel skips most of the masked upper triangle.

    torch's CPU flash kernel computes whole 512-key tiles, so a causal block of ``B <= 512`` keys costs
    ``B^2`` rather than ``B^2/2``. Splitting each block into sub-blocks of ``c`` rows gives, per sub-block
    ``r``, a causal ``c x c`` diagonal piece and an unmasked piece over the ``r*c`` keys before it: the same
    key set, merged by log-sum-exp like any other piece, for about ``(1/2 + c/2B) B^2`` work.
    """
    b = seg.k_len
    if seg.index is not None or not seg.masked or seg.q_len != b or b < _SPLIT_MIN:
        return [seg]
    c = 256 if b >= 768 else (128 if b >= 384 else 64)
    out = []
    for r0 in range(0, b, c):
        rows = min(c, b - r0)
        out.append(Segment(seg.q_start + r0, seg.k_start + r0, rows, rows, seg.count, stride=seg.step))
        if r0:
            out.append(Segment(seg.q_start + r0, seg.k_start, rows, r0, seg.count, stride=seg.step, masked=False))
    return out


#: How many work lists :func:`head_work` keeps (a dict cleared when full): training draws fresh partitions at every
#: call, but a head's draws repeat (integer pitches of one law), and building a list costs 20-40 us.
WORK_CACHE_SIZE = 4096
_WORK: dict[tuple[float, float, int, int, bool, bool], tuple[Segment, ...]] = {}


def _work_of(pitch: float, shift: float, n: int, q_len: int, integer: bool, causal: bool) -> tuple[Segment, ...]:
    """The segments of one partition (causal blocks split, :func:`split_causal`), cached by value where they hold no
    index tensors (those of integer partitions never do)."""
    key = (pitch, shift, n, q_len, integer, causal)
    hit = _WORK.get(key)
    if hit is not None:
        return hit
    q0 = n - q_len
    if integer and math.isfinite(pitch):
        work = _integer_segments(int(pitch), int(shift), n, q0)
    else:
        work = _generic_segments(*block_runs(pitch, shift, n), n, q0)
    if causal:
        work = [piece for seg in work for piece in split_causal(seg)]
    out = tuple(work)
    if all(seg.index is None for seg in out):
        if len(_WORK) >= WORK_CACHE_SIZE:
            _WORK.clear()
        _WORK[key] = out
    return out


def head_work(
    pitches: list[float], shifts: list[float], partitions: Partitions, h: int, group: int, q_len: int, causal: bool
) -> HeadWork:
    """Per-sample kernel work of query head ``h`` (``group`` query heads per key/value head) whose ``T`` partitions
    are ``pitches``, ``shifts``: its distinct partitions (pitches ``<= 1`` are all one: every position its own block)
    and how many samples drew each."""
    counts: dict[tuple[float, float], int] = {}
    for pitch, shift in zip(pitches, shifts, strict=True):
        key = (pitch, shift) if pitch > 1.0 else (1.0, 0.0)
        counts[key] = counts.get(key, 0) + 1
    integer = get_scheme(partitions.scheme).integer
    n = partitions.seq_len
    samples = [(list(_work_of(p, s, n, q_len, integer, causal)), c) for (p, s), c in counts.items()]
    return HeadWork(h, h // group, samples)


@dataclass(frozen=True)
class SamplesPlan:
    """The per-sample path's plan of one call: the kernel work of every query head (built by :func:`samples_plan`).

    Attributes:
        heads: one :class:`HeadWork` per query head, in order.
        q_len: query rows (aligned to the last keys).
        causal: the causal mask.
    """

    heads: tuple[HeadWork, ...]
    q_len: int
    causal: bool


def samples_plan(partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool) -> SamplesPlan:
    """The per-sample work of every query head of ``partitions``."""
    group = partitions.num_heads // num_kv_heads
    pitches, shifts = partitions.pitch.T.tolist(), partitions.shift.T.tolist()  # (H, T): once, not per entry
    heads = tuple(
        head_work(pitches[h], shifts[h], partitions, h, group, q_len, causal) for h in range(partitions.num_heads)
    )
    return SamplesPlan(heads, q_len, causal)


def _segment_rows(x: torch.Tensor, seg: Segment, start: int, length: int) -> torch.Tensor:
    """The rows of one head ``x (B, L, ...)`` that a segment covers, as ``(B, count, length, ...)``."""
    if seg.index is not None:
        return x[:, seg.index + start]
    if seg.step == length or seg.count == 1:
        return x[:, start : start + seg.count * length].unflatten(1, (seg.count, length))
    size = (x.shape[0], seg.count, length, *x.shape[2:])
    stride = (x.stride(0), seg.step * x.stride(1), x.stride(1), *x.stride()[2:])
    return x.as_strided(size, stride, x.storage_offset() + start * x.stride(1))


def _merge_into(
    out_h: torch.Tensor, lse_h: torch.Tensor, seg: Segment, o: torch.Tensor, l: torch.Tensor, log_count: float
) -> None:
    """Merge one segment's ``(o, l)`` into the running ``(out_h, lse_h)`` of a head, in place."""
    l = l.to(lse_h.dtype)
    if log_count:
        l = l + log_count
    if seg.index is None:
        tgt_o = _segment_rows(out_h, seg, seg.q_start, seg.q_len)
        tgt_l = _segment_rows(lse_h, seg, seg.q_start, seg.q_len)
        new = torch.logaddexp(tgt_l, l)
        tgt_o.lerp_(o.to(out_h.dtype), torch.exp(l - new).unsqueeze(-1))
        tgt_l.copy_(new)
    else:
        idx = seg.index.reshape(-1) + seg.q_start
        b = out_h.shape[0]
        cur_o, cur_l = out_h[:, idx], lse_h[:, idx]
        l = l.reshape(b, -1)
        new = torch.logaddexp(cur_l, l)
        out_h[:, idx] = cur_o.lerp(o.reshape(b, -1, o.shape[-1]).to(out_h.dtype), torch.exp(l - new).unsqueeze(-1))
        lse_h[:, idx] = new


def _add_rows(acc_h: torch.Tensor, seg: Segment, start: int, length: int, g: torch.Tensor) -> None:
    if seg.index is None:
        _segment_rows(acc_h, seg, start, length).add_(g.to(acc_h.dtype))
    else:
        acc_h.index_add_(1, seg.index.reshape(-1) + start, g.reshape(g.shape[0], -1, g.shape[-1]).to(acc_h.dtype))


def _segment_inputs(
    seg: Segment, q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        _segment_rows(q_h, seg, seg.q_start, seg.q_len),
        _segment_rows(k_h, seg, seg.k_start, seg.k_len),
        _segment_rows(v_h, seg, seg.k_start, seg.k_len),
    )


def segment_distance(seg: Segment, q_offset: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``|i - j|`` of the (query, key) positions of a segment's blocks, in ``dtype`` on ``device``: ``(q_len, k_len)``
    (the same for every block of an adjacent or strided segment: queries and keys move together), or ``(1, count,
    q_len, k_len)`` for a segment with an ``index``. Query row ``r`` sits at position ``r + q_offset``
    (``q_offset = Lk - Lq``); broadcastable against the segment's ``(B, count, q_len, k_len)`` scores."""
    if seg.index is not None:
        idx = seg.index.to(device)
        qpos, kpos = idx + (seg.q_start + q_offset), idx + seg.k_start
        return (qpos[:, :, None] - kpos[:, None, :]).abs().to(dtype).unsqueeze(0)
    qpos = torch.arange(seg.q_len, device=device) + (seg.q_start + q_offset)
    kpos = torch.arange(seg.k_len, device=device) + seg.k_start
    return (qpos[:, None] - kpos[None, :]).abs().to(dtype)


WorkItem = tuple[list[HeadWork], slice]
"""Heads and batch rows one thread computes: disjoint output rows per item."""


def work_items_of(plan: SamplesPlan, batch: int, workers: int) -> list[WorkItem]:
    """``plan``'s heads split into thread work items balanced by cost (see ``ops._engine.parallel.work_items``)."""
    return work_items([(w, w.kv_head, w.cost) for w in plan.heads], batch, workers)


def _forward_item(
    item: WorkItem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_acc: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: Kernel,
) -> None:
    """Run and merge every segment of one work item into ``out_acc`` and ``lse`` (disjoint rows per item)."""
    works, b = item
    for work in works:
        q_h, k_h, v_h = q[b, work.head], k[b, work.kv_head], v[b, work.kv_head]
        out_h, lse_h = out_acc[b, work.head], lse[b, work.head]
        for segments, count in work.samples:
            for seg in segments:
                o, l = attend(
                    *_segment_inputs(seg, q_h, k_h, v_h), causal=causal and seg.masked, scale=scale, kernel=kernel
                )
                _merge_into(out_h, lse_h, seg, o, l, math.log(count))


def _backward_item(
    item: WorkItem,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    causal: bool,
    scale: float,
    kernel: Kernel,
    slope_dist: torch.Tensor | None = None,
) -> None:
    """Accumulate one work item's share of ``(dq, dk, dv)``, each block run against the merged out/lse, and with
    ``slope_dist (B, Hq)`` its share of ``sum dS |i - j|`` (disjoint entries per item)."""
    q, k, v, out, lse = saved
    dq, dk, dv = grads
    works, b = item
    q_offset = k.shape[2] - q.shape[2]
    for work in works:
        h, hk = work.head, work.kv_head
        q_h, k_h, v_h = q[b, h], k[b, hk], v[b, hk]
        for segments, count in work.samples:
            for seg in segments:
                qs, ks, vs = _segment_inputs(seg, q_h, k_h, v_h)
                os_, ls, ds = (_segment_rows(x[b, h], seg, seg.q_start, seg.q_len) for x in (out, lse, dout))
                # A sample counted `count` times contributes `count` times its probabilities.
                if count > 1:
                    ds = ds * count
                grad = Grad(ds, qs, ks, vs, os_, ls)
                gq, gk, gv = attend_backward(grad, causal=causal and seg.masked, scale=scale, kernel=kernel)
                _add_rows(dq[b, h], seg, seg.q_start, seg.q_len, gq)
                _add_rows(dk[b, hk], seg, seg.k_start, seg.k_len, gk)
                _add_rows(dv[b, hk], seg, seg.k_start, seg.k_len, gv)
                if slope_dist is not None:  # the surrogate slope gradient: sum dS |i - j| of this call (count included)
                    w = segment_distance(seg, q_offset, slope_dist.dtype, slope_dist.device)
                    total = attend_bias_grad(grad, w, causal=causal and seg.masked, scale=scale)
                    slope_dist[b, h] += total.sum(1).to(slope_dist.dtype)


@dataclass(frozen=True)
class PerSampleBackend:
    """The per-sample path on a torch kernel (:class:`~positional_lsh.ops._engine.backend.Backend`).

    Attributes:
        kernel: ``Kernel.FLASH`` or ``Kernel.MATH`` (``ops._engine.torch_attention.attend``).
    """

    kernel: Kernel

    @property
    def method(self) -> Method:
        """``Method.SAMPLES``."""
        return Method.SAMPLES

    def plan(
        self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device
    ) -> SamplesPlan:
        """:func:`samples_plan` (host-side; ``device`` is not needed)."""
        return samples_plan(partitions, num_kv_heads, q_len, causal)

    def forward(
        self, plan: SamplesPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge every block of ``plan`` into ``out``/``lse`` (accumulated in the accumulation dtype from 0 and
        ``-inf``), in a thread pool over (head, batch) items on the CPU; ``out`` returned in ``q``'s dtype."""
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        items = work_items_of(plan, q.shape[0], workers_for(q.device))
        run = partial(_forward_item, q=q, k=k, v=v, out_acc=out, lse=lse, causal=plan.causal, scale=scale,
                      kernel=self.kernel)  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
        return out.to(q.dtype), lse

    def backward(
        self, plan: SamplesPlan, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool
    ) -> Gradients:
        """Every block's gradient against the merged ``out``/``lse`` of ``saved``, accumulated in the accumulation
        dtype; with ``dist_grad`` each call's ``sum dS |i - j|`` too (per (batch, head) in the pool, then summed)."""
        q = saved.q
        grads, slope_dist = accumulators(saved, dist_grad)
        items = work_items_of(plan, q.shape[0], workers_for(q.device))
        per_row = None
        if slope_dist is not None:
            per_row = torch.zeros((q.shape[0], q.shape[1]), dtype=slope_dist.dtype, device=slope_dist.device)
        run = partial(_backward_item, saved=tuple(saved), dout=dout, grads=grads, causal=plan.causal, scale=scale,
                      kernel=self.kernel, slope_dist=per_row)  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
        if slope_dist is not None and per_row is not None:
            slope_dist += per_row.sum(0)
        dq, dk, dv = grads
        return dq.to(q.dtype), dk.to(saved.k.dtype), dv.to(saved.v.dtype), slope_dist


PER_SAMPLE_FLASH = PerSampleBackend(Kernel.FLASH)
"""The per-sample path on torch's fused flash op of the device (the row ``("samples", "flash")``)."""
PER_SAMPLE_MATH = PerSampleBackend(Kernel.MATH)
"""The per-sample path on batched matmuls (the row ``("samples", "math")``)."""
