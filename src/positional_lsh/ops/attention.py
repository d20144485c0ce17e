"""Fast positional-LSH attention: ALiBi approximated by ``T`` runs of regular block-local attention.

The estimator (docs/design.md). For head ``h`` with sampled block masks ``M_1..M_T`` and their mean
``Mbar``::

    out_i = sum_j Mbar[i,j] e^{s[i,j]} v_j / sum_j Mbar[i,j] e^{s[i,j]} = softmax_j(s[i,j] + log Mbar[i,j]) v

with ``s[i,j] = scale * q_i . k_j`` (plus the causal mask). This is a ratio of averaged numerators and
denominators, *not* the mean of the ``T`` per-sample attention outputs. Each sample is computed as
regular attention restricted to its contiguous blocks, returning ``(O_t, lse_t)``; samples are merged
by log-sum-exp, ``lse = logsumexp_t lse_t``, ``out = sum_t exp(lse_t - lse) O_t`` (the ``1/T`` cancels),
accumulated one sample at a time with a single fused ``lerp`` per sample.

Backward: the merged output is one softmax over the union of the (sample, block) key sets, so each
block's gradient is the standard flash-attention backward run with the *merged* ``out`` and ``lse``.
(Autograd through the merge would silently drop the gradient through the fused kernels'
non-differentiable ``lse``; this module never relies on it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from positional_lsh.ops._checks import (
    GeneratorLike,
    SlopesLike,
    as_generator,
    as_scale,
    as_slopes,
    check_qkv,
    positive_int,
)
from positional_lsh.ops._kernels import (
    acc_dtype,
    attend,
    attend_backward,
    kernel_layout,
    nonfinite_keys,
    poison_rows,
    resolve_backend,
)
from positional_lsh.ops._parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops.multiplicity import (
    AUTO_MARGIN,
    BLOCK_COST,
    CALL_ROW_COST,
    ENTRY_COST,
    MultiplicityPlan,
    multiplicity_backward,
    multiplicity_forward,
    multiplicity_plan,
    tilings,
)
from positional_lsh.ops.partitions import Partitions, Segment, check_partitions, sample_partitions

__all__ = ["METHODS", "PositionalLSHAttention", "plsh_attention"]

# How heads are computed: per sampled block ("samples"), by multiplicity tiles ("multiplicity"), or chosen per
# head by the cost model ("auto"); see docs/implementation.md.
METHODS = ("auto", "samples", "multiplicity")


@dataclass(frozen=True)
class _HeadWork:
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


# Causal blocks at least this long are split into sub-blocks (see _split_causal).
_SPLIT_MIN = 192


def _split_causal(seg: Segment) -> list[Segment]:
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


def _plan(partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool) -> list[_HeadWork]:
    """Kernel work per head. Identical samples of a head (slope 0, or large slopes whose blocks are all
    single positions) are computed once and counted with their multiplicity."""
    group = partitions.num_heads // num_kv_heads
    plan = []
    for h in range(partitions.num_heads):
        plan.append(_head_plan(partitions, h, group, q_len, causal))
    return plan


def _head_plan(partitions: Partitions, h: int, group: int, q_len: int, causal: bool) -> _HeadWork:
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
            segments = [piece for seg in segments for piece in _split_causal(seg)]
        samples.append((segments, c))
    return _HeadWork(h, h // group, samples)


def _choose(
    partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, method: str
) -> tuple[list[_HeadWork], MultiplicityPlan | None]:
    """The heads' work for the per-sample path and the multiplicity form (``method``, or the cost model).

    ``"auto"`` decides once per call, for all heads: the multiplicity form when the sum of its estimates is at
    most ``AUTO_MARGIN`` times the per-sample path's. (A per-head split measured slower than either method
    alone at n = 16384, T = 8: the per-sample heads run in a thread pool, the multiplicity groups after them.)
    """
    group = partitions.num_heads // num_kv_heads
    heads = list(range(partitions.num_heads))
    if method == "auto" and partitions.num_samples == 1:
        method = "samples"  # one sample: the multiplicity form computes the same pairs plus a mask; skip the estimate
    if method == "multiplicity":
        return [], multiplicity_plan(partitions, heads, num_kv_heads, q_len, causal)
    plan = [_head_plan(partitions, h, group, q_len, causal) for h in heads]
    if method == "auto":
        tiles = tilings(partitions, heads, q_len, causal)
        estimate = sum(tiles[h][0] for h in heads)
        if estimate <= AUTO_MARGIN * sum(_samples_cost(work, q_len) for work in plan):
            return [], multiplicity_plan(partitions, heads, num_kv_heads, q_len, causal, tiles)
    return plan, None


def _samples_cost(work: _HeadWork, q_len: int) -> float:
    """Estimated time (ns, per batch element) of the per-sample path for one head (docs/implementation.md)."""
    blocks = sum(s.count for segments, _ in work.samples for s in segments)
    return ENTRY_COST * work.cost + BLOCK_COST * blocks + CALL_ROW_COST * q_len * work.calls


def _rows(x: torch.Tensor, seg: Segment, start: int, length: int) -> torch.Tensor:
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
        tgt_o = _rows(out_h, seg, seg.q_start, seg.q_len)
        tgt_l = _rows(lse_h, seg, seg.q_start, seg.q_len)
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
        _rows(acc_h, seg, start, length).add_(g.to(acc_h.dtype))
    else:
        acc_h.index_add_(1, seg.index.reshape(-1) + start, g.reshape(g.shape[0], -1, g.shape[-1]).to(acc_h.dtype))


def _segment_inputs(
    seg: Segment, q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        _rows(q_h, seg, seg.q_start, seg.q_len),
        _rows(k_h, seg, seg.k_start, seg.k_len),
        _rows(v_h, seg, seg.k_start, seg.k_len),
    )


WorkItem = tuple[list[_HeadWork], slice]


def _work_items(plan: list[_HeadWork], batch: int, workers: int) -> list[WorkItem]:
    return work_items([(w, w.kv_head, w.cost) for w in plan], batch, workers)


def _rows_reaching(bad: torch.Tensor, partitions: Partitions, q_len: int, causal: bool) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows that keep a ``bad`` key (``bad`` is ``(B, Hkv, Lk)``) in some sample."""
    b, hkv, lk = bad.shape
    hq = partitions.num_heads
    bad = bad.cpu()
    out = torch.zeros((b, hq, q_len), dtype=torch.bool)
    for h in range(hq):
        keys = bad[:, h // (hq // hkv)]
        j = torch.nonzero(keys.any(0)).flatten()
        if j.numel() == 0:
            continue
        lo, hi = partitions.block_span(h, j)
        if causal:
            lo = j  # rows before a key never see it
        for bi in range(b):
            sel = keys[bi, j]
            diff = torch.zeros(lk + 1, dtype=torch.long)
            diff.index_add_(0, lo[sel], torch.ones_like(lo[sel])).index_add_(0, hi[sel], -torch.ones_like(hi[sel]))
            out[bi, h] = diff.cumsum(0)[lk - q_len : lk] > 0
    return out.to(bad.device)


def _forward_item(
    item: WorkItem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_acc: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Run and merge every segment of one work item into ``out_acc`` and ``lse`` (disjoint rows per item)."""
    works, b = item
    for work in works:
        q_h, k_h, v_h = q[b, work.head], k[b, work.kv_head], v[b, work.kv_head]
        out_h, lse_h = out_acc[b, work.head], lse[b, work.head]
        for segments, count in work.samples:
            for seg in segments:
                o, l = attend(
                    *_segment_inputs(seg, q_h, k_h, v_h), causal=causal and seg.masked, scale=scale, backend=backend
                )
                _merge_into(out_h, lse_h, seg, o, l, math.log(count))


def _backward_item(
    item: WorkItem,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Accumulate one work item's share of ``(dq, dk, dv)``, each block run against the merged out/lse."""
    q, k, v, out, lse = saved
    dq, dk, dv = grads
    works, b = item
    for work in works:
        h, hk = work.head, work.kv_head
        q_h, k_h, v_h = q[b, h], k[b, hk], v[b, hk]
        for segments, count in work.samples:
            for seg in segments:
                qs, ks, vs = _segment_inputs(seg, q_h, k_h, v_h)
                os_, ls, ds = (_rows(x[b, h], seg, seg.q_start, seg.q_len) for x in (out, lse, dout))
                # A sample counted `count` times contributes `count` times its probabilities.
                if count > 1:
                    ds = ds * count
                gq, gk, gv = attend_backward(
                    ds, qs, ks, vs, os_, ls, causal=causal and seg.masked, scale=scale, backend=backend
                )
                _add_rows(dq[b, h], seg, seg.q_start, seg.q_len, gq)
                _add_rows(dk[b, hk], seg, seg.k_start, seg.k_len, gk)
                _add_rows(dv[b, hk], seg, seg.k_start, seg.k_len, gv)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q, k, v`` in the kernels' layout with non-finite keys zeroed, and those keys (``nonfinite_keys``)."""
    # Once per call: every block kernel call gets a view of a kernel-friendly layout.
    q, k, v = (kernel_layout(x, backend) for x in (q, k, v))
    bad = nonfinite_keys(k, v)  # zeroed here, and the rows that keep them set to NaN by _forward
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    return q, k, v, bad


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bad: torch.Tensor | None,
    plan: list[_HeadWork],
    mplan: MultiplicityPlan | None,
    partitions: Partitions,
    causal: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator's ``(out, lse)`` (``out`` in ``q``'s dtype, ``lse`` in the accumulation dtype) for ``q, k, v``
    from :func:`_prepare`. The one forward of the eager autograd Function and of the custom op (ops/compiled.py)."""
    acc = acc_dtype(q.dtype)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    items = _work_items(plan, q.shape[0], workers_for(q.device))
    run = partial(_forward_item, q=q, k=k, v=v, out_acc=out_acc, lse=lse, causal=causal, scale=scale, backend=backend)
    run_all(run, items, pool_size(len(items), q.device))
    if mplan is not None:
        multiplicity_forward(mplan, q, k, v, out_acc, lse, scale, backend)
    if bad is not None:
        poison_rows(out_acc, lse, _rows_reaching(bad, partitions, q.shape[2], causal).to(q.device))
    return out_acc.to(q.dtype), lse


def _backward(
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    plan: list[_HeadWork],
    mplan: MultiplicityPlan | None,
    causal: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, ``saved = (q, k, v, out, lse)`` with ``q, k, v`` from :func:`_prepare`
    and ``out, lse`` from :func:`_forward`. The one backward of the eager autograd Function and of the custom op."""
    q, k, v = saved[:3]
    acc = acc_dtype(q.dtype)
    grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    items = _work_items(plan, q.shape[0], workers_for(q.device))
    run = partial(
        _backward_item,
        saved=saved,
        dout=dout.contiguous(),
        grads=grads,
        causal=causal,
        scale=scale,
        backend=backend,
    )
    run_all(run, items, pool_size(len(items), q.device))
    if mplan is not None:
        multiplicity_backward(mplan, saved, dout.contiguous(), grads, scale, backend)
    dq, dk, dv = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _PositionalLSHFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: list[_HeadWork],
        mplan: MultiplicityPlan | None,
        partitions: Partitions,
        causal: bool,
        scale: float,
        backend: str,
    ) -> torch.Tensor:
        q, k, v, bad = _prepare(q, k, v, backend)
        out, lse = _forward(q, k, v, bad, plan, mplan, partitions, causal, scale, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.mplan, ctx.causal, ctx.scale, ctx.backend = plan, mplan, causal, scale, backend
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grads = _backward(ctx.saved_tensors, dout, ctx.plan, ctx.mplan, ctx.causal, ctx.scale, ctx.backend)
        return *grads, None, None, None, None, None, None


def plsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    num_samples: int = 8,
    causal: bool = True,
    partitions: Partitions | None = None,
    scheme: str = "discrete",
    generator: GeneratorLike = None,
    scale: float | None = None,
    backend: str = "auto",
    method: str = "auto",
) -> torch.Tensor:
    """Positional-LSH attention: the ALiBi estimator ``softmax(s + log Mbar) v`` in near-linear time.

    Args:
        q: ``(B, Hq, Lq, d)`` queries; float32, bfloat16, float16 or float64.
        k: ``(B, Hkv, Lk, d)`` keys with ``Hq % Hkv == 0`` (grouped-query attention) and ``Lq <= Lk``;
            queries are aligned to the last ``Lq`` keys (``Lq < Lk`` for decoding with a KV cache).
        v: ``(B, Hkv, Lk, d)`` values.
        slopes: ALiBi slopes, ``(Hq,)`` or one float for every head; default ``alibi_slopes(Hq)``.
            The bias being approximated is ``-slopes[h] * |i - j|`` added after scaling.
        num_samples: number ``T`` of sampled partitions per head (ignored when ``partitions`` is given).
        causal: restrict query ``i`` to keys ``j <= i``.
        partitions: pre-sampled :class:`~positional_lsh.Partitions` (``seq_len == Lk``, ``num_heads == Hq``);
            if given, ``slopes``, ``num_samples``, ``scheme`` and ``generator`` are not used for sampling
            (``slopes``, if given, must equal ``partitions.slopes``).
        scheme: partition scheme when sampling: ``"discrete"`` (default, exactly unbiased and fastest),
            ``"gamma"`` (the paper's), ``"fixed"`` (biased ablation), a variance-reduced scheme, or one added
            with :func:`~positional_lsh.register_scheme` (see :func:`~positional_lsh.ops.schemes.scheme_names`).
        generator: CPU ``torch.Generator``, ``int`` seed, or ``None`` (torch's global RNG).
        scale: score scale, default ``1/sqrt(d)``.
        backend: ``"auto"`` (CPU: torch's fused flash op; other devices: ``"math"``), ``"flash"``, ``"math"``,
            or ``"triton"`` (the Triton kernels of the multiplicity form, for ``method="multiplicity"`` or
            ``"auto"``; float32/bfloat16/float16 on CUDA). ``"auto"`` with ``method="multiplicity"`` on CUDA
            uses them when triton is installed (docs/implementation.md, "The Triton kernel").
        method: ``"samples"`` (one kernel call per block group of every sample, merged by log-sum-exp),
            ``"multiplicity"`` (query tiles attending to the union of their blocks with the additive mask
            ``log c``, ``c[i,j]`` the number of samples in which ``i`` and ``j`` share a block), or ``"auto"``
            (chosen per head by a cost model). All three compute the same estimator from the same partitions
            (docs/implementation.md). Default ``"auto"``: one sample never takes the multiplicity form; at
            T >= 16 most heads do. The choice changes the speed, not the result (beyond float rounding).

    Returns:
        ``(B, Hq, Lq, d)`` tensor in ``q``'s dtype. Differentiable w.r.t. ``q``, ``k``, ``v`` (exact gradients
        of the estimator for the sampled partitions). NaN in the inputs propagates to NaN in the rows it
        reaches; it never raises.
    """
    dims = check_qkv(q, k, v)
    hq, lk = dims[1], dims[4]
    if partitions is None and torch.compiler.is_compiling():
        from positional_lsh.ops.compiled import compiled_sampled_attention  # the custom ops (docs/implementation.md)

        call = {"causal": causal, "scale": scale, "backend": backend, "method": method}
        return compiled_sampled_attention(q, k, v, dims, slopes, num_samples, scheme, generator, **call)
    if partitions is None:
        partitions = sample_partitions(
            lk, as_slopes(slopes, hq), positive_int("num_samples", num_samples), scheme=scheme, generator=generator
        )
    elif slopes is not None and isinstance(partitions, Partitions) and partitions.num_heads == hq:
        if torch.compiler.is_compiling():
            raise ValueError("under torch.compile, pass partitions= without slopes= (comparing them reads the data)")
        if not torch.allclose(as_slopes(slopes, hq), partitions.slopes):
            raise ValueError("slopes differ from partitions.slopes; pass one or the other")
    return _plsh_checked(q, k, v, dims, partitions, causal=causal, scale=scale, backend=backend, method=method)


def _use_triton(q: torch.Tensor, backend: object, method: object) -> bool:
    """``backend="triton"``, or ``"auto"`` with ``method="multiplicity"`` on CUDA (not float64) with triton
    installed: the Triton kernels of :mod:`positional_lsh.ops.triton_multiplicity`. Does not import triton."""
    if isinstance(backend, str) and backend == "triton":
        return True
    if backend != "auto" or method != "multiplicity" or q.device.type != "cuda" or q.dtype == torch.float64:
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    *,
    causal: object,
    scale: object,
    method: str,
) -> torch.Tensor:
    """The Triton kernels (ops/triton_multiplicity.py) with the op's non-finite-key rule (see ``nonfinite_keys``)."""
    from positional_lsh.ops.triton_multiplicity import plsh_triton  # lazy: triton is optional

    bad = nonfinite_keys(k, v)
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    out = plsh_triton(q, k, v, partitions, causal=causal, scale=scale, method=method)  # type: ignore[arg-type]
    if bad is not None:
        rows = _rows_reaching(bad, partitions, q.shape[2], bool(causal)).to(q.device)
        out = out.masked_fill(rows[..., None], float("nan"))
    return out


def _plsh_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dims: tuple[int, int, int, int, int, int],
    partitions: object,
    *,
    causal: object,
    scale: float | None,
    backend: str,
    method: str = "auto",
) -> torch.Tensor:
    """:func:`plsh_attention` for ``q, k, v`` already checked by ``check_qkv`` (which returned ``dims``)."""
    _, hq, hkv, lq, lk, d = dims
    check_partitions(partitions, hq, lk)
    if _use_triton(q, backend, method):
        return _triton(q, k, v, partitions, causal=causal, scale=scale, method=method)
    scale_f, backend = _check_call(d, q.device, causal, scale, backend, method)
    if torch.compiler.is_compiling():
        from positional_lsh.ops.compiled import compiled_attention

        parts = (partitions.pitch, partitions.shift, partitions.slopes, partitions.scheme, partitions.max_block)
        return compiled_attention(q, k, v, *parts, causal=causal, scale=scale_f, backend=backend, method=method)
    plan, mplan = _choose(partitions, hkv, lq, causal, method)
    return _PositionalLSHFunction.apply(q, k, v, plan, mplan, partitions, causal, scale_f, backend)


def _check_call(
    head_dim: int, device: torch.device, causal: object, scale: float | None, backend: str, method: str
) -> tuple[float, str]:
    """Validate the scalar arguments of a call: returns ``(scale, backend)`` resolved."""
    scale_f = as_scale(scale, head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    backend = resolve_backend(backend, device)
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return scale_f, backend


class PositionalLSHAttention(nn.Module):
    """Positional-LSH attention as a module holding slopes, sample count, scheme and a sampling policy.

    In training mode every call draws fresh partitions from the module's own CPU generator (seeded by
    ``seed``; ``None`` uses torch's global RNG). In eval mode every call draws partitions from a
    generator seeded with ``eval_seed``, so evaluation is deterministic. Call with ``q (B, Hq, Lq, d)``,
    ``k, v (B, Hkv, Lk, d)``; see :func:`plsh_attention`.

    Under ``torch.compile`` (``fullgraph=True`` included) the draw is the custom op
    ``positional_lsh::sample_partitions`` and the estimator the op ``positional_lsh::plsh_forward``
    (:mod:`positional_lsh.ops.compiled`); the module's Python generator is not used:

    * eval mode draws from ``eval_seed`` exactly as eager mode does: the same partitions, the same output;
    * training mode with an int ``seed``: compiled training call ``c`` (``c = 0, 1, ...``, counted by the int64
      buffer ``_calls``, advanced in place by each compiled training call, not saved in the state dict) draws
      from a generator seeded with ``layer_seed(seed, c)`` (:mod:`positional_lsh.ops._seeds`). Every call gets
      fresh partitions and a new module with the same ``seed`` repeats the sequence, but it is not the sequence
      of eager training calls (which draw from one generator stream);
    * training mode with ``seed=None`` draws from torch's global RNG inside the op, as eager training does.
    """

    def __init__(
        self,
        num_heads: int,
        slopes: SlopesLike = None,
        *,
        num_samples: int = 8,
        scheme: str = "discrete",
        causal: bool = True,
        seed: int | None = None,
        eval_seed: int = 0,
        scale: float | None = None,
        backend: str = "auto",
        method: str = "auto",
    ) -> None:
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        # Slopes only drive the CPU sampler: a float64 attribute, kept in the state dict as extra state, so
        # that casting the model (``.half()``, ``.to(bfloat16)``) never rounds them.
        self.slopes = as_slopes(slopes, self.num_heads)
        self.num_samples = positive_int("num_samples", num_samples)
        # Validate the scheme now rather than at the first call.
        sample_partitions(1, self.slopes, 1, scheme=scheme, generator=0)
        self.scheme = scheme
        self.causal = causal
        self.scale = scale
        self.backend = backend
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.method = method
        self.eval_seed = eval_seed
        self.generator = as_generator(seed)
        self._seed = seed
        # Compiled training calls so far: the key of their draws (see the class docstring).
        self.register_buffer("_calls", torch.zeros((), dtype=torch.long), persistent=False)

    def get_extra_state(self) -> dict[str, list[float]]:
        return {"slopes": self.slopes.tolist()}

    def set_extra_state(self, state: dict[str, list[float]]) -> None:
        self.slopes = as_slopes(state["slopes"], self.num_heads)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_samples={self.num_samples}, scheme={self.scheme!r}"

    def sample(self, seq_len: int) -> Partitions:
        """The partitions the next call at this length would use (advances the training generator)."""
        gen = self.generator if self.training else as_generator(self.eval_seed)
        return sample_partitions(seq_len, self.slopes, self.num_samples, scheme=self.scheme, generator=gen)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dims = check_qkv(q, k, v)  # validated once, here; sampling needs the key length
        if torch.compiler.is_compiling():
            return self._compiled_forward(q, k, v, dims)
        partitions = self.sample(dims[4])
        return _plsh_checked(
            q, k, v, dims, partitions, causal=self.causal, scale=self.scale, backend=self.backend, method=self.method
        )

    def _compiled_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: tuple[int, int, int, int, int, int]
    ) -> torch.Tensor:
        """:meth:`forward` under ``torch.compile``: the draw and the estimator as custom ops (class docstring)."""
        from positional_lsh.ops.compiled import compiled_attention, sample_op

        name, seed = ("seed", self._seed) if self.training else ("eval_seed", self.eval_seed)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"under torch.compile, {name} must be an int or None, got {type(seed).__name__}")
        scale, backend = _check_call(dims[5], q.device, self.causal, self.scale, self.backend, self.method)
        step = self._calls if self.training and seed is not None else None
        pitch, shift = sample_op(step, seed, self.slopes, self.num_samples, self.scheme)
        if self.training:
            self._calls.add_(1)
        parts = (pitch, shift, self.slopes, self.scheme, None)
        return compiled_attention(q, k, v, *parts, causal=self.causal, scale=scale, backend=backend, method=self.method)
