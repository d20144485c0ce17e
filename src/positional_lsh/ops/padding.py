"""Padding: the ``key_padding_mask=`` argument of :func:`~positional_lsh.plsh_attention`,
:func:`~positional_lsh.alibi_attention` and :func:`~positional_lsh.decay_attention`.

A key padding mask is a ``(B, Lk)`` bool tensor on ``q``'s device, ``True`` for a valid key. Each row's valid keys
must be one contiguous run ``[first, end)`` (left and/or right padding, or none). The row is then computed on its
run alone, as if the sequence were those keys: positions are counted from ``first`` (so the partitions of the
estimator, and the distances of a positional bias, start there), queries stay aligned to the last ``Lq`` keys of
the whole row, and query rows at padded positions (before ``first`` or from ``end`` on) return zeros and get zero
gradients. A row without valid keys returns zeros.

The ops compute it by row groups (:func:`row_groups`): the batch rows that share one run are one call of the
unpadded computation, on that run. The shape and dtype are checked when the op is called
(:func:`check_key_padding_mask`, also under ``torch.compile``); the runs are read from the data inside the op
(:func:`valid_runs`), where a hole between valid keys raises ``ValueError`` naming ``key_padding_mask``.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from positional_lsh.ops._engine.torch_attention import output_buffers

__all__ = ["valid_runs"]


def check_key_padding_mask(mask: object, q: torch.Tensor, k_len: int) -> torch.Tensor | None:
    """``mask`` if it is ``None`` or a ``(B, k_len)`` bool tensor on ``q``'s device (``B = q.shape[0]``), else
    ``TypeError``/``ValueError`` naming ``key_padding_mask``. Reads shapes only (trace-safe); the runs are checked
    by :func:`valid_runs` when the op reads them."""
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


def valid_runs(mask: torch.Tensor, name: str = "key_padding_mask") -> list[tuple[int, int]]:
    """``(first, end)`` of the contiguous run of valid keys of every row of ``mask (B, n)`` (bool, ``True`` =
    valid).

    A row without valid keys gives ``(0, 0)``; padding between valid keys raises ``ValueError`` naming ``name``
    and the rows. Reads the data (one host transfer of ``3 B`` numbers).
    """
    n = mask.shape[-1]
    pos = torch.arange(n, device=mask.device)
    first = torch.where(mask, pos, n).amin(-1)
    end = torch.where(mask, pos, -1).amax(-1) + 1
    count = mask.sum(-1)
    holes = (count > 0) & (end - first != count)
    if bool(holes.any()):
        rows = torch.nonzero(holes).flatten().tolist()
        raise ValueError(
            f"{name} has padding between valid keys in batch row(s) {rows}; only left and/or right padding is "
            "supported (each row's valid keys must be one contiguous run)"
        )
    runs = zip(first.tolist(), end.tolist(), count.tolist(), strict=True)
    return [(int(f), int(e)) if c > 0 else (0, 0) for f, e, c in runs]


class RowGroup(NamedTuple):
    """Batch rows that share one run of valid keys, and what of ``q (B, H, Lq, d)`` and ``k (B, H, Lk, d)`` they
    compute on.

    Attributes:
        rows: the batch rows, an int64 index tensor on the mask's device.
        keys: the run ``[first, end)``, a slice of ``k``'s positions (its length is the group's sequence length).
        queries: the slice of ``q``'s rows at valid positions (``max(first, Lk - Lq) .. end``, shifted by
            ``Lk - Lq``): the group's queries, aligned to the last keys of its run.
    """

    rows: torch.Tensor
    keys: slice
    queries: slice


def row_groups(mask: torch.Tensor | None, q_len: int) -> list[RowGroup] | None:
    """The :class:`RowGroup` of every run of ``mask (B, Lk)`` that has a valid query; ``None`` when no row has padding
    (``mask`` is ``None`` or all ``True``: the call runs as without a mask). Groups whose queries are all padding
    (and rows without valid keys) are left out: their output is zeros. ``ValueError`` from :func:`valid_runs`."""
    if mask is None or bool(mask.all()):
        return None
    k_len = mask.shape[-1]
    q0 = k_len - q_len  # position of the first query
    runs: dict[tuple[int, int], list[int]] = {}
    for row, run in enumerate(valid_runs(mask)):
        runs.setdefault(run, []).append(row)
    groups = []
    for (first, end), rows in runs.items():
        start = max(first, q0)
        if end > start:
            index = torch.tensor(rows, dtype=torch.long, device=mask.device)
            groups.append(RowGroup(index, slice(first, end), slice(start - q0, end - q0)))
    return groups


def forward_row_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: list[RowGroup],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a padded call: ``attend(q, k, v) -> (out, lse)`` on each row group's queries and valid keys
    (:func:`row_groups`), written into buffers whose padded query rows keep ``out = 0``, ``lse = -inf``. The forward
    of both ops with a ``key_padding_mask`` (the estimator's and the exact one)."""
    out, lse = output_buffers(q)
    for g in groups:
        o, lg = attend(q[g.rows][:, :, g.queries], k[g.rows][:, :, g.keys], v[g.rows][:, :, g.keys])
        out[g.rows, :, g.queries] = o
        lse[g.rows, :, g.queries] = lg.to(lse.dtype)
    return out, lse
