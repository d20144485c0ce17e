"""Counts ``c[i, j]``: in how many samples the block of query ``i`` holds key ``j``, over a span of keys.

The estimator's mask is ``log c`` (docs/design.md): query ``i`` and key ``j`` share a block in sample ``t`` iff ``j``
lies in ``[start_t(i), end_t(i))``, the block of ``i`` (:func:`~positional_lsh.ops.partitions.bounds.block_bounds`).
:func:`block_counts` turns those blocks into the counts of a span of keys with one difference array: ``+w`` at each
block's start, ``-w`` at its end, an integer prefix sum. Every builder of counts calls it: decoding
(:mod:`~positional_lsh.ops.kvcache`, a span of rows and a decoder's row) and the Triton plan's near table.
"""

from __future__ import annotations

import torch


def block_counts(
    start: torch.Tensor,
    end: torch.Tensor,
    first: torch.Tensor | int,
    width: int,
    weight: torch.Tensor | None = None,
    *,
    events: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``c[..., x] = sum_t weight[..., t] * [start[..., t] <= first + x < end[..., t]]`` for ``x in [0, width)``.

    Args:
        start, end: int64 ``(..., T)``: the blocks of each row (one per sample), ``end`` exclusive (a causal caller
            clips it to the row's position + 1); ``end`` may be ``(..., 1)``, one end shared by every block of the
            row (a causal caller's ``position + 1`` when every start is at most the position: one event per row).
        first: the key of column 0: an int, or an int64 tensor of the rows' shape ``(...)`` (one per row).
        width: the number of keys (columns), ``>= 0``; blocks are clipped to them.
        weight: int32 ``(..., T)`` (broadcastable), how many samples each block stands for; default 1 each.
        events, out: optional int32 buffers ``(..., width + 1)`` (zeroed here) and ``(..., width)`` for a caller that
            reuses its memory across calls.

    Returns:
        int32 ``(..., width)``, exact (an integer prefix sum).
    """
    base = first if isinstance(first, int) else first[..., None]
    lo = (start - base).clamp_(0, width)
    hi = (end - base).clamp_(0, width)
    if events is None:
        events = torch.zeros((*lo.shape[:-1], width + 1), dtype=torch.int32, device=lo.device)
    else:
        events.zero_()
    ones = torch.ones((), dtype=torch.int32, device=lo.device).expand(lo.shape) if weight is None else weight
    ones = ones.expand(lo.shape)
    events.scatter_add_(-1, lo, ones)
    if hi.shape[-1] != lo.shape[-1]:  # one shared end: the row's total weight, once
        ones = ones.sum(-1, keepdim=True, dtype=torch.int32).expand(hi.shape)
    events.scatter_add_(-1, hi, ones.neg())
    return torch.cumsum(events[..., :width], -1, dtype=torch.int32, out=out)
