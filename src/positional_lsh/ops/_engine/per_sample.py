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
over the call's (query, key) positions (``ops._engine.kernels.attend_bias_grad``, one more math pass over the
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
from positional_lsh.ops._engine.kernels import acc_dtype, attend, attend_backward, attend_bias_grad
from positional_lsh.ops._engine.parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops.partitions.partition import Partitions, Segment

__all__ = [
    "PER_SAMPLE_FLASH",
    "PER_SAMPLE_MATH",
    "HeadWork",
    "PerSampleBackend",
    "SamplesPlan",
    "WorkItem",
    "head_work",
    "samples_plan",
    "segment_distance",
    "split_causal",
    "work_items_of",
]  # fmt: skip


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


def head_work(partitions: Partitions, h: int, group: int, q_len: int, causal: bool) -> HeadWork:
    """Per-sample kernel work of query head ``h`` (``group`` query heads per key/value head)."""
    counts: dict[tuple[float, float], int] = {}
    first: dict[tuple[float, float], int] = {}
    for t in range(partitions.num_samples):
        pitch = float(partitions.pitch[t, h])
        key = (pitch, float(partitions.shift[t, h])) if pitch > 1.0 else (1.0, 0.0)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, t)
    samples = []
    for key, c in counts.items():
        segments = partitions.segments(first[key], h, q_len)
        if causal:
            segments = [piece for seg in segments for piece in split_causal(seg)]
        samples.append((segments, c))
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
    heads = tuple(head_work(partitions, h, group, q_len, causal) for h in range(partitions.num_heads))
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
    kernel: str,
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
    kernel: str,
    dist: torch.Tensor | None = None,
) -> None:
    """Accumulate one work item's share of ``(dq, dk, dv)``, each block run against the merged out/lse, and with
    ``dist (B, Hq)`` its share of ``sum dS |i - j|`` (disjoint entries per item)."""
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
                gq, gk, gv = attend_backward(
                    ds, qs, ks, vs, os_, ls, causal=causal and seg.masked, scale=scale, kernel=kernel
                )
                _add_rows(dq[b, h], seg, seg.q_start, seg.q_len, gq)
                _add_rows(dk[b, hk], seg, seg.k_start, seg.k_len, gk)
                _add_rows(dv[b, hk], seg, seg.k_start, seg.k_len, gv)
                if dist is not None:  # the surrogate slope gradient: sum dS |i - j| of this call (count included)
                    w = segment_distance(seg, q_offset, dist.dtype, dist.device)
                    total = attend_bias_grad(ds, qs, ks, vs, os_, ls, w, causal=causal and seg.masked, scale=scale)
                    dist[b, h] += total.sum(1).to(dist.dtype)


@dataclass(frozen=True)
class PerSampleBackend:
    """The per-sample path on a torch kernel (:class:`~positional_lsh.ops._engine.backend.Backend`).

    Attributes:
        kernel: ``"flash"`` or ``"math"`` (``ops._engine.kernels.attend``).
    """

    kernel: str

    @property
    def method(self) -> str:
        """``"samples"``."""
        return "samples"

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
        grads, dist = accumulators(saved, dist_grad)
        items = work_items_of(plan, q.shape[0], workers_for(q.device))
        per_row = None if dist is None else torch.zeros((q.shape[0], q.shape[1]), dtype=dist.dtype, device=dist.device)
        run = partial(_backward_item, saved=tuple(saved), dout=dout, grads=grads, causal=plan.causal, scale=scale,
                      kernel=self.kernel, dist=per_row)  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
        if dist is not None and per_row is not None:
            dist += per_row.sum(0)
        dq, dk, dv = grads
        return dq.to(q.dtype), dk.to(saved.k.dtype), dv.to(saved.v.dtype), dist


PER_SAMPLE_FLASH = PerSampleBackend("flash")
"""The per-sample path on torch's fused flash op of the device (the row ``("samples", "flash")``)."""
PER_SAMPLE_MATH = PerSampleBackend("math")
"""The per-sample path on batched matmuls (the row ``("samples", "math")``)."""
