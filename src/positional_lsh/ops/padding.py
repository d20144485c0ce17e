"""Masks and packed sequences: the ``key_padding_mask=`` and ``cu_seqlens=`` arguments of
:func:`~positional_lsh.plsh_attention`, :func:`~positional_lsh.alibi_attention` and
:func:`~positional_lsh.decay_attention` (and ``key_padding_mask=`` of
:func:`~positional_lsh.plsh_attention_with_kvcache`).

**A key mask** is a ``(B, Lk)`` bool tensor on ``q``'s device, ``True`` for a valid key. Any pattern is taken: left
and right padding, and holes between valid keys (a right-padded prompt continued by ``generate``, a random mask).
How positions are counted: each row's positions start at its **first valid key** (left padding shifts the row, so a
left-padded row computes what the same tokens unpadded compute), and from there every key keeps its index, masked
or not: a hole is a position like any other, it only leaves the softmax. So the partitions' blocks (and the
distances of a positional bias) stay where the positions are, and a masked key simply gets weight 0. Queries stay
aligned to the last ``Lq`` keys of the whole row. A query row at a masked position (its own key is masked) returns
zeros and gets zero gradients, and so does every query row of a row without valid keys: they are the only rows with
no key to attend to (a query at a valid position always sees its own key, in every block and window).

**Packed sequences** (padding-free training): ``cu_seqlens``, a 1-D integer tensor ``[0, n_1, n_1 + n_2, ...,
Lk]`` (strictly increasing, from 0 to ``Lk``), splits every batch row into documents ``[cu[s], cu[s+1])``, as
flash-attention's varlen entry points do. Each document is its own sequence: its positions restart at 0 (at its
first valid key, with a mask), it attends to nothing outside itself, and the partitions apply to it as
``partitions.with_seq_len(its length)`` (the same pitches and shifts, blocks counted from the document's start):
the output equals running the documents one by one with those partitions. A key mask applies within documents.

How the ops compute it (:func:`row_groups`): the batch rows (and documents) that share one span ``[first, end)``
(first to last valid key) are one call of the unmasked computation on that span; a span with holes runs with one
more head-dim column (:func:`with_holes`), in which a masked key's score is ``-2^30`` (its key and value zeroed, so a
NaN there reaches nothing), far below every valid score (``ValueError`` for inputs whose scores could come near it).
The ops' internal mask argument carries both: the bool mask, or int64 segment ids (:func:`segment_ids`: ``0`` for a
masked key, ``s >= 1`` for a key of document ``s``). The shape and dtype are checked when the op is called
(:func:`check_key_padding_mask`, :func:`check_cu_seqlens`, also under ``torch.compile``); the spans are read from the
data inside the op.

Example:
    >>> import torch
    >>> import positional_lsh as plsh
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    >>> mask = torch.ones(2, 16, dtype=torch.bool)
    >>> mask[1, :5] = False  # row 1 is left-padded: its sequence is positions 5..15
    >>> parts = plsh.sample_partitions(16, plsh.alibi_slopes(4), 8, generator=0)
    >>> out = plsh.plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask)
    >>> alone = plsh.plsh_attention(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], partitions=parts.with_seq_len(11))
    >>> torch.allclose(out[1:, :, 5:], alone, atol=1e-6), bool((out[1, :, :5] == 0).all())
    (True, True)
    >>> cu = torch.tensor([0, 6, 16])  # two packed documents of 6 and 10 tokens
    >>> packed = plsh.plsh_attention(q, k, v, partitions=parts, cu_seqlens=cu)
    >>> doc = plsh.plsh_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], partitions=parts.with_seq_len(10))
    >>> torch.allclose(packed[:, :, 6:], doc, atol=1e-6)
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from positional_lsh.ops._engine.torch_attention import output_buffers

__all__ = ["valid_runs"]

#: The extra head-dim column of a span with holes: ``+HOLE`` on the queries, ``-HOLE`` on masked keys (0 on valid
#: ones), so a masked key's score is ``-HOLE**2 * scale`` (exact in every dtype's accumulation, float16 included).
HOLE = 2.0**15
#: Valid scores are kept at least this far (natural log) above a masked key's.
HOLE_MARGIN = 64.0


def check_key_padding_mask(mask: object, q: torch.Tensor, k_len: int) -> torch.Tensor | None:
    """``mask`` if it is ``None`` or a ``(B, k_len)`` bool tensor on ``q``'s device (``B = q.shape[0]``), else
    ``TypeError``/``ValueError`` naming ``key_padding_mask``. Reads shapes only (trace-safe); any pattern of valid
    keys is taken."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be None or a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = valid key), got dtype {mask.dtype}")
    want = (q.shape[0], k_len)
    if tuple(mask.shape) != want:
        raise ValueError(f"key_padding_mask must have shape (batch, k_len) = {want}, got {tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"key_padding_mask must be on q's device ({q.device}), got {mask.device}")
    return mask


CU_SEQLENS_RULE = "cu_seqlens must be a 1-D integer tensor [0, ..., k_len], strictly increasing"


def check_cu_seqlens(cu_seqlens: object, k_len: int) -> torch.Tensor | None:
    """``cu_seqlens`` if it is ``None`` or a 1-D integer tensor of at least two entries, else ``TypeError`` /
    ``ValueError`` naming ``cu_seqlens``. Its values (``0`` first, strictly increasing, ``k_len`` last) are checked
    here in eager mode; under ``torch.compile`` (where they cannot be read) inside the op (:func:`segment_ids`)."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be None or an integer tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{CU_SEQLENS_RULE}; got dtype {cu_seqlens.dtype}, shape {tuple(cu_seqlens.shape)}")
    if not torch.compiler.is_compiling() and cu_seqlens.device.type != "meta":
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != k_len or any(b <= a for a, b in itertools.pairwise(cu)):
            raise ValueError(f"{CU_SEQLENS_RULE} (k_len = {k_len}); got {cu}")
    return cu_seqlens


def segment_ids(
    mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, batch: int, k_len: int, device: torch.device
) -> torch.Tensor | None:
    """The ops' internal mask argument from a checked ``key_padding_mask`` and ``cu_seqlens``: ``mask`` itself
    without ``cu_seqlens``; else ``(batch, k_len)`` int64 segment ids on ``device``, ``s >= 1`` for a key of
    document ``s`` (0 for a masked key), every entry ``-1`` when ``cu_seqlens``'s values break
    :data:`CU_SEQLENS_RULE` (the op then raises). Trace-safe: tensor ops only."""
    if cu_seqlens is None:
        return mask
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    pos = torch.arange(k_len, device=device)
    ids = (cu[None, 1:-1] <= pos[:, None]).sum(-1) + 1  # document index of every position, 1-based
    good = (cu[0] == 0) & (cu[-1] == k_len) & (cu[1:] > cu[:-1]).all()
    ids = torch.where(good, ids, torch.full_like(ids, -1))[None, :].expand(batch, k_len)
    return torch.where(mask, ids, torch.zeros_like(ids)) if mask is not None else ids


def valid_runs(mask: torch.Tensor, name: str = "key_padding_mask") -> list[tuple[int, int]]:
    """``(first, end)`` of every row of ``mask (B, n)`` (bool, ``True`` = valid): its first valid key and one past
    its last (``(0, 0)`` for a row without valid keys). The keys between may have holes. Reads the data (one host
    transfer of ``2 B`` numbers). ``name`` is kept for callers that name their mask in messages."""
    n = mask.shape[-1]
    pos = torch.arange(n, device=mask.device)
    first = torch.where(mask, pos, n).amin(-1)
    end = torch.where(mask, pos, -1).amax(-1) + 1
    runs = zip(first.tolist(), end.tolist(), strict=True)
    return [(int(f), int(e)) if e > 0 else (0, 0) for f, e in runs]


def routed_like(q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What the routing of a call with ``mask`` should see of ``q``: ``q`` itself, or a stand-in (an expanded view,
    no memory) with one more head-dim column when a span may have holes (:func:`with_holes`): when ``mask`` has
    one, and under ``torch.compile`` (where the mask cannot be read) whenever a mask is given."""
    if mask is None:
        return q
    if not torch.compiler.is_compiling():
        n = mask.shape[-1]
        pos = torch.arange(n, device=mask.device)
        first = torch.where(mask, pos, n).amin(-1)
        end = torch.where(mask, pos, -1).amax(-1) + 1
        if not bool(((end > 0) & (end - first != mask.sum(-1))).any()):
            return q
    return q.new_empty(()).expand(*q.shape[:-1], q.shape[-1] + 1)


class RowGroup(NamedTuple):
    """Batch rows (or documents of packed rows) that share one span of keys, and what of ``q (B, H, Lq, d)`` and
    ``k (B, H, Lk, d)`` they compute on.

    Attributes:
        rows: the batch rows, an int64 index tensor on the mask's device.
        keys: the span ``[first, end)`` from the first to one past the last valid key, a slice of ``k``'s positions
            (its length is the group's sequence length).
        queries: the slice of ``q``'s rows at the span's positions (``max(first, Lk - Lq) .. end``, shifted by
            ``Lk - Lq``): the group's queries, aligned to the last keys of its span.
        valid: ``None`` when every key of the span is valid in every row, else ``(len(rows), end - first)`` bool:
            which keys of the span are valid (the holes are ``False``).
    """

    rows: torch.Tensor
    keys: slice
    queries: slice
    valid: torch.Tensor | None = None


def row_groups(mask: torch.Tensor | None, q_len: int) -> list[RowGroup] | None:
    """The :class:`RowGroup` of every span of ``mask (B, Lk)`` (bool, or the int64 segment ids of
    :func:`segment_ids`) that has a query; ``None`` when nothing is masked or packed (``mask`` is ``None`` or all
    ``True``: the call runs as without a mask). Groups whose queries are all outside their span (and rows without
    valid keys) are left out: their output is zeros. Reads the data (a few host transfers); ``ValueError`` naming
    ``cu_seqlens`` for segment ids marked invalid, or naming ``key_padding_mask`` for documents that interleave."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        if bool(mask.all()):
            return None
        ids = mask.to(torch.long)
    else:
        ids = mask
        if bool((ids < 0).any()):
            raise ValueError(f"{CU_SEQLENS_RULE}")
    b, k_len = ids.shape
    segs = int(ids.max()) + 1 if ids.numel() else 1
    pos = torch.arange(k_len, device=ids.device).expand(b, k_len)
    slot = (torch.arange(b, device=ids.device)[:, None] * segs + ids).flatten()
    flat = pos.flatten()
    first = torch.full((b * segs,), k_len, dtype=torch.long, device=ids.device).scatter_reduce(0, slot, flat, "amin")
    end = torch.full((b * segs,), -1, dtype=torch.long, device=ids.device).scatter_reduce(0, slot, flat, "amax") + 1
    count = torch.zeros(b * segs, dtype=torch.long, device=ids.device).scatter_add(0, slot, torch.ones_like(flat))
    nonzero = torch.cat([ids.new_zeros(b, 1), (ids != 0).long().cumsum(-1)], dim=-1)  # (B, Lk + 1)
    row_of = torch.arange(b * segs, device=ids.device) // segs
    span_nonzero = nonzero[row_of, end.clamp(0, k_len)] - nonzero[row_of, first.clamp(0, k_len)]
    table = torch.stack([first, end, count, span_nonzero]).view(4, b, segs)[:, :, 1:].tolist()
    q0 = k_len - q_len  # position of the first query
    spans: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for row in range(b):
        for s in range(segs - 1):
            f, e, c, nz = (table[x][row][s] for x in range(4))
            if c == 0:
                continue
            if nz != c:
                raise ValueError(f"key_padding_mask: documents interleave in batch row {row}")
            spans.setdefault((f, e), []).append((row, s + 1, c != e - f))
    groups = []
    for (f, e), members in spans.items():
        start = max(f, q0)
        if e <= start:
            continue
        index = torch.tensor([r for r, _, _ in members], dtype=torch.long, device=ids.device)
        valid = None
        if any(h for _, _, h in members):
            seg = torch.tensor([s for _, s, _ in members], dtype=torch.long, device=ids.device)
            valid = ids[index, f:e] == seg[:, None]
        groups.append(RowGroup(index, slice(f, e), slice(start - q0, e - q0), valid))
    return groups


def _query_valid(g: RowGroup, q_len: int) -> torch.Tensor:
    """``(len(rows), 1, q_len, 1)`` bool: the group's query rows at valid positions (its last ``q_len`` keys')."""
    assert g.valid is not None
    return g.valid[:, None, g.valid.shape[1] - q_len :, None]


def with_holes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span with holes as an unmasked call: ``q, k, v`` (``(G, H, Lq, d)``, ``(G, Hkv, Lk, d)``) with one more
    head-dim column, ``+HOLE`` on every query and ``-HOLE`` on the masked keys (``valid (G, Lk)`` ``False``), whose
    keys and values are zeroed, as are the queries at masked positions (queries aligned to the last keys). The call
    must pass ``scale`` explicitly; the outputs' last column is dropped (:func:`strip`). ``ValueError`` naming
    ``key_padding_mask`` when some valid score could come within :data:`HOLE_MARGIN` of a masked one."""
    kv = valid[:, None, :, None]
    qv = valid[:, None, valid.shape[1] - q.shape[2] :, None]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    q, k, v = torch.where(qv, q, zero), torch.where(kv, k, zero), torch.where(kv, v, zero)
    bound = float(q.detach().float().norm(dim=-1).amax()) * float(k.detach().float().norm(dim=-1).amax())
    if scale * (HOLE * HOLE - 2.0 * bound) < HOLE_MARGIN:
        raise ValueError(
            f"key_padding_mask has holes, and scores of these inputs (|q| |k| up to {bound:.3g}, scale {scale:.3g}) "
            "could come near a masked key's: they cannot be masked exactly"
        )
    hole = torch.where(kv, zero, torch.full((), -HOLE, dtype=k.dtype, device=k.device))
    one = torch.full((*q.shape[:-1], 1), HOLE, dtype=q.dtype, device=q.device)
    return (
        torch.cat([q, one], dim=-1),
        torch.cat([k, hole.expand(*k.shape[:-1], 1)], dim=-1),
        torch.cat([v, torch.zeros((*v.shape[:-1], 1), dtype=v.dtype, device=v.device)], dim=-1),
    )


def strip(x: torch.Tensor) -> torch.Tensor:
    """``x`` without the extra head-dim column of :func:`with_holes`."""
    return x[..., :-1]


def pad_column(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a zero head-dim column (an output or its gradient, alongside :func:`with_holes`'s inputs)."""
    return torch.cat([x, torch.zeros((*x.shape[:-1], 1), dtype=x.dtype, device=x.device)], dim=-1)


def forward_row_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: list[RowGroup],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a masked or packed call: ``attend(q, k, v) -> (out, lse)`` (run at the explicit ``scale``)
    on each row group's queries and span of keys (:func:`row_groups`; a span with holes through
    :func:`with_holes`), written into buffers whose query rows outside every span keep ``out = 0``,
    ``lse = -inf``; query rows at masked positions inside a span get ``out = 0`` (their ``lse`` is the finite one
    the call computed, which the backward needs). The forward of both ops (the estimator's and the exact one)."""
    out, lse = output_buffers(q)
    for g in groups:
        qg, kg, vg = q[g.rows][:, :, g.queries], k[g.rows][:, :, g.keys], v[g.rows][:, :, g.keys]
        if g.valid is None:
            o, lg = attend(qg, kg, vg)
        else:
            o, lg = attend(*with_holes(qg, kg, vg, g.valid, scale))
            o = torch.where(_query_valid(g, qg.shape[2]), strip(o), torch.zeros((), dtype=o.dtype, device=o.device))
        out[g.rows, :, g.queries] = o
        lse[g.rows, :, g.queries] = lg.to(lse.dtype)
    return out, lse


class GroupSaved(NamedTuple):
    """What the backward of one row group runs on (:func:`group_backward_inputs`): the group's ``q, k, v``, saved
    ``out``, ``lse`` and the incoming ``dout``, with :func:`with_holes`'s extra column when its span has holes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor


def group_backward_inputs(
    g: RowGroup,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dout: torch.Tensor,
    scale: float,
) -> GroupSaved:
    """The backward inputs of row group ``g`` from the call's ``saved = (q, k, v, out, lse)`` and ``dout``: sliced
    to its queries and span, and for a span with holes extended as the forward was (the ``dout`` of query rows at
    masked positions zeroed: their output is the constant 0)."""
    q, k, v, out, lse = saved
    qg, kg, vg = q[g.rows][:, :, g.queries], k[g.rows][:, :, g.keys], v[g.rows][:, :, g.keys]
    og, lg = out[g.rows][:, :, g.queries].contiguous(), lse[g.rows][:, :, g.queries].contiguous()
    dg = dout[g.rows][:, :, g.queries]
    if g.valid is None:
        return GroupSaved(qg, kg, vg, og, lg, dg)
    qv = _query_valid(g, qg.shape[2])
    dg = torch.where(qv, dg, torch.zeros((), dtype=dg.dtype, device=dg.device))
    return GroupSaved(*with_holes(qg, kg, vg, g.valid, scale), pad_column(og), lg, pad_column(dg).contiguous())


def scatter_group_grads(
    g: RowGroup, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], part: tuple[torch.Tensor, ...]
) -> None:
    """Write row group ``g``'s ``(dq, dk, dv)`` (``part``, with :func:`with_holes`'s column when its span has holes,
    dropped here) into the call's ``grads`` at its queries and span."""
    for full, x, where in zip(grads, part, (g.queries, g.keys, g.keys), strict=True):
        full[g.rows, :, where] = x if g.valid is None else strip(x)
