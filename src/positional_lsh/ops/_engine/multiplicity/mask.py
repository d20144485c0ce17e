"""The multiplicity form's kernel calls and their masks ``log c``.

Counts are int32, exact: a scatter of the block starts (and ends) of every row in each head's distinct partitions,
weighted by how many samples drew each (or, causal with integer pitches, the blocks' moves summed down the rows:
:func:`move_events`), an integer cumulative sum over keys and a lookup of ``log c`` in the table of its ``T + 1``
values (:func:`log_count_table`). The method: :mod:`positional_lsh.ops._engine.multiplicity`.
"""

from __future__ import annotations

import math

import torch

from positional_lsh.ops._engine.cost import MOVE_EVENT_NS, ROW_START_NS, ROW_SUM_ENTRY_NS, ROW_SUM_NS
from positional_lsh.ops._engine.multiplicity.plan import Call, Group, MultiplicityPlan, call_chunks, tile_rows
from positional_lsh.ops.partitions.bounds import block_bounds, exact_floor, integer_block_bounds, integer_pitch_shift
from positional_lsh.ops.partitions.counts import block_counts

__all__ = [
    "Workspace", "call_keys", "count_mask", "kernel_calls", "log_count_table", "move_events", "row_bounds",
]  # fmt: skip

def move_events(
    g: Group, pos: torch.Tensor, n: int, num_samples: int, whole: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The counts of a causal call with integer pitches from the moves of its blocks, or ``None`` where the per-row
    events are as cheap.

    Per row, the causal counts are ``c[r, j] = #{t : start_t(r) <= j}`` for ``j <= r``: ``T`` start events per row
    (:func:`count_mask`'s general form, whose cost grows with ``T``). Down a tile the starts change only where a block
    begins: when sample ``t``'s block begins at row ``beta`` its start moves from ``p`` to ``beta``, which for every
    row from ``beta`` on removes an event at ``p`` and adds one at ``beta``. So the rows' events are a running sum
    down the rows of a sparse array: the first row's ``T`` starts, ``-1`` at ``(beta, p)`` and ``+1`` at
    ``(beta, beta)`` per move, and the diagonal (``-T`` at ``(r, r + 1)``, undone by ``+T`` at ``(r + 1, r + 1)``).
    Each event carries its distinct partition's weight (``g.weight``: how many samples drew it). Returns the flat
    indices into ``(N, tile, k_len + 1)`` and int32 values of those events (the running sum over rows and then over
    keys is :func:`count_mask`'s). All rows must be real (consecutive positions ``pos``); ``whole``: ``g``'s int64
    pitches and shifts (``ops.partitions.bounds.integer_pitch_shift``).
    """
    num, tile = pos.shape
    kl = g.k_len
    distinct = g.pitch.shape[1]
    if num * distinct * ROW_START_NS <= ROW_SUM_NS:  # the running sum's one op per row alone costs more
        return None
    b = whole[0]  # (N, U) int64 pitches
    first, last = pos[:, :1], pos[:, -1:]  # (N, 1)
    start0, end0 = integer_block_bounds(*whole, n, first)  # (N, U): the first row's blocks
    # Block beginnings inside the tile's rows: end0, end0 + b, ... while <= the last row.
    w = g.weight  # (N, U): samples per distinct partition
    moves = torch.where((end0 <= last) & (w > 0), (last - end0) // b + 1, 0)  # (N, U)
    count = num * (distinct + 2 * tile) + 2 * int(moves.sum())  # the events
    by_moves = count * MOVE_EVENT_NS + tile * ROW_SUM_NS + num * tile * (kl + 1) * ROW_SUM_ENTRY_NS
    if by_moves >= num * tile * distinct * ROW_START_NS:
        return None
    width = kl + 1
    base = torch.arange(num, device=pos.device)[:, None] * (tile * width)  # (N, 1) offset of each tile
    k0 = g.k_start[:, None]
    idx = [base + (start0 - k0)]  # row 0: the first row's starts
    val = [w]
    total = int(moves.sum())
    if total:  # every move once (no padding to the most moves of a sample): its tile, sample and number
        flat_moves = moves.flatten()
        owner = torch.repeat_interleave(torch.arange(flat_moves.numel(), device=pos.device), flat_moves)
        first_of = torch.cumsum(flat_moves, 0) - flat_moves
        m = torch.arange(total, device=pos.device) - first_of[owner]
        tile_of = owner // moves.shape[1]
        step = b.flatten()[owner]
        beta = end0.flatten()[owner] + m * step
        prev = torch.where(m == 0, start0.flatten()[owner], beta - step)
        at = base[tile_of, 0] + (beta - first[tile_of, 0]) * width
        kk = k0[tile_of, 0]
        idx += [at + (prev - kk), at + (beta - kk)]
        wm = w.flatten()[owner]
        val += [-wm, wm]
    r = torch.arange(tile, device=pos.device)
    diag = (first + r + 1 - k0).clamp(max=kl)  # (N, tile) key column i + 1 of row i
    minus_t = torch.full(diag.shape, -num_samples, dtype=torch.int32, device=pos.device)
    idx.append(base + r * width + diag)
    val.append(minus_t)
    idx.append(base + (r[1:] * width) + diag[:, :-1])
    val.append(-minus_t[:, :-1])
    return torch.cat([x.flatten() for x in idx]), torch.cat([x.flatten() for x in val])


def kernel_calls(plan: MultiplicityPlan, device: torch.device, batch: int, d: int) -> tuple[Call, ...]:
    """The kernel calls of ``plan`` for inputs of ``batch`` rows and head dim ``d`` on ``device`` (cached on the
    plan: a forward's backward, and repeated calls with the same partitions, reuse them)."""
    key = (str(device), batch, d)
    hit = plan.calls_cache.get(key)
    if hit is not None:
        return hit
    calls = []
    lq, n = plan.q_len, plan.k_len
    # The integer path's int64 pitches and shifts of every tile, once per plan (one rule, one reduction), then cut
    # as the groups and their calls are.
    whole_all = None
    if plan.groups:
        pitch, shift = (torch.cat([getattr(g, name) for g in plan.groups]) for name in ("pitch", "shift"))
        whole_all = integer_pitch_shift(pitch, shift)
    at = 0
    for group in plan.groups:
        offset, at = at, at + group.head.shape[0]
        for g in call_chunks(group.to(device), batch, d):
            rows, real = tile_rows(g, lq)
            keys = call_keys(g, n)
            pos = rows + (n - lq)
            whole = None  # the call's (once per call, not per mask)
            if whole_all is not None:
                cut = slice(offset, offset + g.head.shape[0])
                whole = (whole_all[0][cut].to(device), whole_all[1][cut].to(device))
                offset = cut.stop
            moves = None
            padded = bool(g.q_start.max() + g.tile > lq)  # a tile that reaches past the last query row
            if whole is not None and plan.causal and not padded:
                moves = move_events(g, pos, n, plan.num_samples, whole)
            q_index = (g.head[:, None] * lq + rows).flatten()
            kv_index = (g.kv_head[:, None] * n + keys).flatten()
            calls.append(Call(g, rows, real, pos, keys, q_index, kv_index, whole, moves, padded))
    plan.calls_cache[key] = out = tuple(calls)
    return out


def call_keys(g: Group, n: int) -> torch.Tensor:
    return (g.k_start[:, None] + torch.arange(g.k_len, device=g.k_start.device)).clamp(max=n - 1)


def row_bounds(
    g: Group,
    pos: torch.Tensor,
    n: int,
    need_end: bool,
    integer: bool | None = None,
    whole: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``start_t``/``end_t`` of the block of every tile row in every sample: int64 ``(N, tile, T)``.

    ``pos`` (int64 ``(N, tile)``) are the rows' key positions in a sequence of ``n``; ``end`` is ``None`` unless
    ``need_end``; ``integer``: whether ``g``'s partitions take the integer path, where known (else it is checked);
    ``whole``: their int64 pitches and shifts there, where known (a call's, computed once per plan).

    Integer pitches and shifts (the one rule, :func:`~positional_lsh.ops.partitions.bounds.integer_pitch_shift`):
    :func:`~positional_lsh.ops.partitions.bounds.block_bounds` of every row, a few integer passes. Otherwise
    ``block_bounds`` of the first (and last) row of each tile only; inside a tile the rows are consecutive
    positions, so a block starts wherever the label ``floor((i - shift) / pitch)`` changes: ``start`` is a running
    maximum of those positions, ``end`` a reversed running minimum.
    """
    p = pos[..., None]  # (N, tile, 1)
    if whole is None and integer is not False:
        whole = integer_pitch_shift(g.pitch, g.shift)  # a module-level lookup (tests replace it)
    if whole is not None:
        start, end = integer_block_bounds(whole[0][:, None, :], whole[1][:, None, :], n, p)
        return start, end if need_end else None
    # Pitches <= 1 (every position its own block) as 0.5: their labels stay below 2**51, where exact_floor is exact.
    single = g.pitch <= 1.0
    pitch = torch.where(single, 0.5, g.pitch)[:, None, :]
    shift = torch.where(single, 0.0, g.shift)[:, None, :]
    lab = exact_floor((p.to(torch.float64) - shift) / pitch)  # (N, tile, T)
    change = lab[:, 1:] != lab[:, :-1]  # label of row r+1 differs from row r: a block starts at row r+1
    lo0, _ = block_bounds(g.pitch, g.shift, n, pos[:, :1])  # (N, T)
    start = torch.cat([lo0[:, None], torch.where(change, p[:, 1:], lo0[:, None])], 1).cummax(1).values
    if not need_end:
        return start, None
    _, hi1 = block_bounds(g.pitch, g.shift, n, pos[:, -1:])
    cand = torch.cat([torch.where(change, p[:, 1:], hi1[:, None]), hi1[:, None]], 1)
    end = cand.flip(1).cummin(1).values.flip(1)
    return start, end


class Workspace:
    """Buffers reused by the kernel calls of one forward or backward: a fresh multi-megabyte buffer per call costs
    its page faults (zeroing one took longer than the integer ``cumsum`` over it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A (uninitialized) ``shape`` view of the buffer of ``role``, grown as needed."""
        numel = math.prod(shape)
        buf = self.buffers.get(role)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(max(numel, 0 if buf is None else buf.numel()), dtype=dtype, device=self.device)
            self.buffers[role] = buf
        return buf[:numel].view(shape)

    def log_table(self, num_samples: int, dtype: torch.dtype) -> torch.Tensor:
        """:func:`log_count_table` of ``num_samples`` (built once per forward or backward)."""
        key = f"log_table_{num_samples}_{dtype}"
        if key not in self.buffers:
            self.buffers[key] = log_count_table(num_samples, dtype, self.device)
        return self.buffers[key]


def log_count_table(num_samples: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[-inf, log 1, ..., log T]`` as ``dtype``: ``log c`` of every possible count (the values of ``c.log()``)."""
    table = torch.arange(num_samples + 1, dtype=dtype, device=device).log_()
    table[0] = -math.inf
    return table


def count_mask(call: Call, plan: MultiplicityPlan, dtype: torch.dtype, ws: Workspace) -> torch.Tensor:
    """``log c`` over ``(N, tile, k_len)`` with ``-inf`` where ``c = 0`` (and above the diagonal when causal).

    Counts are int32, exact: an integer ``cumsum`` (about 2.5x faster than a float one, which waits on each add)
    of the blocks' start (and end) events, then ``log c`` by a lookup in the table of its ``T + 1`` values (an
    ``index_select``: 0.5 ns per entry on one core, against about 3 ns for ``log`` and a select of the zeros, whose
    ``log`` takes the math library's slow path). The events are the ``T`` block starts of every row or, for causal
    calls with integer pitches where they are fewer, the blocks' moves summed down the rows (:func:`move_events`).
    """
    g, rows, pos, n, kl = call.g, call.rows, call.pos, plan.k_len, call.g.k_len
    events = ws.take("events", (*rows.shape, kl + 1), torch.int32)
    counts = ws.take("counts", (*rows.shape, kl), torch.int32)
    if call.moves is not None:
        events.zero_().view(-1).index_add_(0, *call.moves)
        for r in range(1, rows.shape[1]):  # the running sum down the rows (torch's cumsum over dim 1 is ~20x slower)
            events[:, r].add_(events[:, r - 1])
        c = torch.cumsum(events[..., :kl], -1, dtype=torch.int32, out=counts)
    else:
        start, end = row_bounds(g, pos, n, not plan.causal, call.whole is not None, call.whole)
        if end is None:  # causal: every start is <= i, so every block of a row ends at its position + 1 (one end)
            end = (pos + 1).unsqueeze(-1)
        # each distinct partition counts its samples
        c = block_counts(start, end, g.k_start[:, None], kl, g.weight[:, None, :], events=events, out=counts)
    mask = ws.take("mask", c.shape, dtype)  # c is exactly 0 outside every block: -inf there
    torch.index_select(ws.log_table(plan.num_samples, dtype), 0, c.view(-1), out=mask.view(-1))
    return mask
