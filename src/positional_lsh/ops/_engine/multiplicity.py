"""The multiplicity form of the estimator: one masked attention call per group of query tiles.

For head ``h`` with ``T`` sampled partitions, let ``c[i,j] = #{t : i and j share a block of sample t}``. Then
``Mbar = c / T`` and the estimator (docs/design.md) is

    out_i = softmax_j(s[i,j] + log c[i,j]) v_j          (the 1/T cancels; log 0 = -inf)

with ``s[i,j] = scale * q_i . k_j`` and, when causal, ``-inf`` for ``j > i``. Every sampled block is a
contiguous run of positions, so with ``start_t(i)``/``end_t(i)`` the first/one-past-last position of ``i``'s
block in sample ``t``:

* causal: ``c[i,j] = #{t : start_t(i) <= j}`` for ``j <= i`` — a step function of ``j`` with at most ``T`` steps;
* bidirectional: ``c[i,j] = #{t : start_t(i) <= j < end_t(i)}``.

Query ``i``'s keys are the interval ``[min_t start_t(i), max_t end_t(i))``: its work is the *union* of its
``T`` blocks (mean extent about ``sigma * H_T`` causal, ``H_T`` the harmonic number) instead of their sum
(``T * sigma``), which is where the per-sample path spends its time at large ``T``.

Computation. Queries are cut into tiles of ``tile`` consecutive rows (per head, chosen by the plan). A tile's
keys are one window ``[k_start, k_start + k_len)`` covering the union of its rows' intervals (both ends are
monotone in ``i``, so the first and last row fix it). Tiles with equal ``(tile, k_len)`` (``k_len`` rounded
up to a few sizes per octave) form a *group*: one batched attention call over ``(B, tiles, tile, k_len)``
with the additive float mask ``log c`` (``-inf`` outside), built on the device from int32 counts: a scatter of
the block starts (and ends) of every row in each head's distinct partitions, weighted by how many samples drew
each (or, causal with integer pitches, the blocks' moves summed down the rows: :func:`_move_events`), an integer
cumulative sum over keys — ``O(U + k_len)`` per row, ``U <= T`` — and a lookup of ``log c`` in the table of its
``T + 1`` values (:func:`log_count_table`). Groups are split into calls of about :data:`CHUNK_ELEMENTS` mask
entries, whose index tensors are planned once (:func:`kernel_calls`).
Each query row lives in exactly one tile, so the call's ``(out, lse)`` are final: no merge. The backward
is the same attention's backward with the saved ``out``/``lse`` and the mask rebuilt, its key gradients
scatter-added back (tiles share keys). The surrogate slope gradient (``dist_grad``) adds each masked call's
``sum_ij dS_ij |i - j|`` over its rows and union keys (``ops._engine.kernels.attend_bias_grad``, one more math pass
over the call's scores) into its tiles' query heads.

All of it is device-agnostic torch: gathers, ``scatter_add_``, ``cumsum``, ``index_select`` and the attention kernels
of :mod:`positional_lsh.ops._engine.kernels` (CPU: torch's fused flash op with ``attn_mask``; elsewhere: chunked
matmul). The number of kernel calls is the number of groups (a handful per head), split further only to cap
the memory of one call (:data:`CHUNK_ELEMENTS`). Each head's tile height is the cheapest by the cost model
(:mod:`positional_lsh.ops._engine.cost`).

The backend (:class:`MultiplicityBackend`, the rows ``("multiplicity", "flash")`` and ``("multiplicity", "math")``
of the engine's table: :data:`MULTIPLICITY_FLASH`, :data:`MULTIPLICITY_MATH`) implements
:class:`~positional_lsh.ops._engine.backend.Backend`: its plan is a :class:`MultiplicityPlan`
(:func:`multiplicity_plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from positional_lsh.ops._engine.backend import Gradients, Saved, accumulators
from positional_lsh.ops._engine.cost import TILE_HEIGHTS, tiling_estimate
from positional_lsh.ops._engine.kernels import acc_dtype, attend, attend_backward, attend_bias_grad
from positional_lsh.ops.partitions.bounds import block_bounds, exact_floor, integer_pitch_shift
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "CHUNK_ELEMENTS",
    "MOVE_EVENT_NS",
    "MULTIPLICITY_FLASH",
    "MULTIPLICITY_MATH",
    "ROW_START_NS",
    "ROW_SUM_ENTRY_NS",
    "ROW_SUM_NS",
    "WHOLE_TILE_ROWS",
    "MultiplicityBackend",
    "MultiplicityPlan",
    "Tiling",
    "kernel_calls",
    "log_count_table",
    "multiplicity_plan",
    "row_bounds",
    "tile_rows",
    "tilings",
]

#: Calls of at most this many query rows may take one tile of all of them (:func:`tilings`).
WHOLE_TILE_ROWS = 1024
# Key-window lengths are rounded up to one of this many sizes per octave (fewer distinct shapes, fewer calls).
_STEPS_PER_OCTAVE = 4
# Planning evaluates block bounds over at most about this many (tile, sample, head) entries at once.
_BOUNDS_ELEMENTS = 2**18
# One kernel call's mask has at most about this many entries, and its per-row bounds as many (tile row, sample)
# pairs: small enough for the mask, its counts and the gathered keys to stay in the cache between the passes
# (2**21: about 20 % faster than 2**23 at n = 32768, T = 8, one thread).
CHUNK_ELEMENTS = 2**21


@dataclass(frozen=True)
class _Group:
    """Query tiles sharing one shape ``(tile, k_len)``; tile ``a`` holds query rows ``q_start[a] + [0, tile)``
    (clamped to ``Lq - 1``) of query head ``head[a]`` and keys ``k_start[a] + [0, k_len)`` of ``kv_head[a]``."""

    tile: int
    k_len: int
    head: torch.Tensor  # (N,) int64
    kv_head: torch.Tensor  # (N,) int64
    q_start: torch.Tensor  # (N,) int64, query rows
    k_start: torch.Tensor  # (N,) int64, key positions
    pitch: torch.Tensor  # (N, U) float64: the distinct partitions of each tile's head ...
    shift: torch.Tensor  # (N, U) float64
    weight: torch.Tensor  # (N, U) int32: ... and how many of the T samples each is (0: padding)

    def to(self, device: torch.device) -> _Group:
        return _Group(self.tile, self.k_len, *(x.to(device) for x in self._columns()))

    def _columns(self) -> tuple[torch.Tensor, ...]:
        return (self.head, self.kv_head, self.q_start, self.k_start, self.pitch, self.shift, self.weight)

    def split(self, size: int) -> list[_Group]:
        n = self.head.shape[0]
        return [
            _Group(
                self.tile,
                self.k_len,
                *(x[a : a + size] for x in self._columns()),
            )
            for a in range(0, n, size)
        ]


@dataclass(frozen=True)
class MultiplicityPlan:
    """Kernel groups for the multiplicity form of some heads; built by :func:`multiplicity_plan`."""

    heads: tuple[int, ...]
    groups: tuple[_Group, ...]
    q_len: int
    k_len: int
    causal: bool
    num_samples: int
    calls_cache: dict[tuple[str, int, int], tuple[_Call, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def num_calls(self) -> int:
        return len(self.groups)

    def pairs(self) -> int:
        """Score entries the kernel calls compute (per batch element), padding included."""
        return sum(int(g.head.shape[0]) * g.tile * g.k_len for g in self.groups)


def _round_up(k: torch.Tensor, limit: int) -> torch.Tensor:
    """Round lengths up to one of ``_STEPS_PER_OCTAVE`` sizes per octave (multiples of 8), at most ``limit``."""
    kf = k.to(torch.float64).clamp_min(8.0)
    octave = torch.floor(torch.log2(kf)) - math.log2(_STEPS_PER_OCTAVE)
    unit = torch.exp2(octave).clamp_min(8.0)
    out = (torch.ceil(kf / unit) * unit).long()
    out = ((out + 7) // 8) * 8
    return torch.minimum(out, torch.full_like(out, limit))


Tiling = tuple[float, tuple[torch.Tensor, ...], int]
"""One head's tiling: ``(estimated ns, (q_start, k_start, k_len), tile height)`` (see :func:`tilings`)."""


def _distinct_count(x: torch.Tensor) -> torch.Tensor:
    """The number of distinct values in each column of ``x (rows, cols)``, float64 ``(cols,)``."""
    srt = x.sort(0).values
    return ((srt[1:] != srt[:-1]).sum(0) + 1).to(torch.float64)


def tilings(partitions: Partitions, heads: list[int], q_len: int, causal: bool) -> dict[int, Tiling]:
    """The cheapest tiling of each of ``heads`` by the cost model (``ops._engine.cost.tiling_estimate``):
    ``head -> (estimated ns, (q_start, k_start, k_len), tile)``.

    For each candidate tile height the bounds of every head's tile rows come from one vectorized
    :func:`~positional_lsh.ops.partitions.bounds.block_bounds` over ``(tiles, T, heads)`` (a per-head loop costs
    ~30 % of a short call's forward in planning overhead). A tile's key window covers the union of its rows'
    intervals; both ends are monotone in the row, so the first and last row fix it.
    """
    n = partitions.seq_len
    q0 = n - q_len
    index = torch.tensor(heads, dtype=torch.long)
    pitch, shift = partitions.pitch[:, index], partitions.shift[:, index]  # (T, heads)
    # Every candidate height is a multiple of the smallest (or covers all rows in one tile), so the first and
    # last rows of all tilings are among those of the finest: their bounds once, for all heads and heights.
    unit = TILE_HEIGHTS[0]
    fine = torch.arange(0, q_len, unit, dtype=torch.long)
    fine_last = torch.clamp(fine + unit, max=q_len) - 1 + q0
    # (fine tiles, T, heads) bounds, a few heads at a time: block_bounds holds ~10 float64 temporaries of that
    # shape, which for all heads at once would dominate the call's peak memory at large n and T.
    # At very large T one head alone is too many: then a head's samples are taken a slice at a time as well.
    num_t = pitch.shape[0]
    chunk = max(1, _BOUNDS_ELEMENTS // max(1, fine.numel() * num_t))
    t_chunk = num_t if chunk > 1 else max(1, _BOUNDS_ELEMENTS // max(1, fine.numel()))
    lo_cols, end_cols = [], []
    for a in range(0, len(heads), chunk):
        lo_h: torch.Tensor | None = None
        end_h: torch.Tensor | None = None
        for b in range(0, num_t, t_chunk):
            p, sh = pitch[b : b + t_chunk, a : a + chunk], shift[b : b + t_chunk, a : a + chunk]
            lo = block_bounds(p, sh, n, (fine + q0)[:, None, None])[0].amin(1)
            lo_h = lo if lo_h is None else torch.minimum(lo_h, lo)
            if not causal:
                end = block_bounds(p, sh, n, fine_last[:, None, None])[1].amax(1)
                end_h = end if end_h is None else torch.maximum(end_h, end)
        assert lo_h is not None
        lo_cols.append(lo_h)
        if end_h is not None:
            end_cols.append(end_h)
    lo_fine = torch.cat(lo_cols, 1)  # (fine tiles, heads)
    end_fine = (fine_last + 1)[:, None].expand_as(lo_fine) if causal else torch.cat(end_cols, 1)
    best: dict[int, Tiling] = {}
    # Short calls may also take one tile of all rows (fewer, larger kernel calls; the cost model weighs the pairs).
    heights = TILE_HEIGHTS if q_len > WHOLE_TILE_ROWS else (*TILE_HEIGHTS, q_len)
    for tile in heights:
        tile = min(tile, q_len)
        step = tile // unit if tile < q_len else fine.numel()  # one tile: first row 0, last row Lq - 1
        first_idx = torch.arange(0, fine.numel(), step)
        last_idx = torch.clamp(first_idx + step - 1, max=fine.numel() - 1)
        q_start = fine[first_idx]
        lo, end = lo_fine[first_idx], end_fine[last_idx]  # (tiles, heads)
        k_len = _round_up(end - lo, n)
        k_start = torch.minimum(lo, n - k_len)
        pairs = k_len.sum(0).to(torch.float64) * tile
        shapes = _distinct_count(k_len)  # each distinct window length is (at least) one kernel call
        costs = tiling_estimate(pairs, tile, q_start.numel(), q_len, partitions.num_samples, shapes).tolist()
        for col, (h, cost) in enumerate(zip(heads, costs, strict=True)):
            if h not in best or cost < best[h][0]:
                best[h] = (cost, (q_start, k_start[:, col].contiguous(), k_len[:, col].contiguous()), tile)
        if tile >= q_len:
            break
    return best


def _distinct_partitions(partitions: Partitions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's distinct ``(pitch, shift)`` pairs and how many samples drew each: ``(H, U)`` float64 pitches and
    shifts and int32 weights, ``U`` the most distinct pairs of a head (the rest of a row repeats its first pair with
    weight 0). Equal partitions give equal blocks, so a count ``c`` is the weighted count over the distinct ones: at
    large ``T`` the heads of small ``sigma`` (whose draws repeat) have a fraction of ``T`` events per row."""
    per_head = []
    for h in range(partitions.num_heads):
        pairs = torch.stack([partitions.pitch[:, h], partitions.shift[:, h]], 1)  # (T, 2)
        uniq, counts = torch.unique(pairs, dim=0, return_counts=True)
        per_head.append((uniq, counts))
    width = max(u.shape[0] for u, _ in per_head)
    pitch = torch.empty(partitions.num_heads, width, dtype=torch.float64)
    shift = torch.empty_like(pitch)
    weight = torch.zeros(partitions.num_heads, width, dtype=torch.int32)
    for h, (uniq, counts) in enumerate(per_head):
        u = uniq.shape[0]
        pitch[h], shift[h] = uniq[0, 0], uniq[0, 1]
        pitch[h, :u], shift[h, :u], weight[h, :u] = uniq[:, 0], uniq[:, 1], counts.to(torch.int32)
    return pitch, shift, weight


def multiplicity_plan(
    partitions: Partitions,
    heads: list[int],
    num_kv_heads: int,
    q_len: int,
    causal: bool,
    tiles: dict[int, Tiling] | None = None,
) -> MultiplicityPlan:
    """Tiles of the given query heads, grouped by shape (one batched kernel call per group).

    ``tiles``: the per-head choice of :func:`tilings` where already computed (``method="auto"``).
    """
    group_size = partitions.num_heads // num_kv_heads
    tiles = dict(tiles or {})
    missing = [h for h in heads if h not in tiles]
    if missing:
        tiles.update(tilings(partitions, missing, q_len, causal))
    # Every tile of every head as one row of (head, q_start, k_start, k_len), per tile height; sorted by k_len,
    # each run of equal k_len is one group (vectorized: a per-head loop was most of a short call's planning).
    distinct = _distinct_partitions(partitions)
    by_tile: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    for h in heads:
        _, (q_start, k_start, k_len), tile = tiles[h]
        by_tile.setdefault(tile, []).append((torch.full_like(q_start, h), q_start, k_start, k_len))
    groups = []
    for tile in sorted(by_tile):
        head, q_start, k_start, k_len = (torch.cat(c) for c in zip(*by_tile[tile], strict=True))
        k_len, order = torch.sort(k_len, stable=True)
        head, q_start, k_start = head[order], q_start[order], k_start[order]
        lengths, counts = torch.unique_consecutive(k_len, return_counts=True)
        cols = (head, head // group_size, q_start, k_start, *(x[head] for x in distinct))
        splits = [c.split(counts.tolist()) for c in cols]
        for kl, *parts in zip(lengths.tolist(), *splits, strict=True):
            groups.append(_Group(tile, int(kl), *(c.contiguous() for c in parts)))
    return MultiplicityPlan(tuple(heads), tuple(groups), q_len, partitions.seq_len, causal, partitions.num_samples)


def _chunks(group: _Group, batch: int, d: int) -> list[_Group]:
    """Split a group so that one call's mask (and its gathered keys and values) and its per-row bounds each have
    about ``CHUNK_ELEMENTS`` entries at most."""
    per_tile = max(group.tile * group.k_len + 2 * batch * group.k_len * d // 8, group.tile * group.pitch.shape[1])
    size = max(1, CHUNK_ELEMENTS // max(1, per_tile))
    return group.split(size) if group.head.shape[0] > size else [group]


@dataclass(frozen=True)
class _Call:
    """One kernel call (a chunk of a group) with its index tensors, computed once per plan (they do not depend on
    ``q, k, v``): the rows and their key positions, the keys, and the flat ``head * length + position`` indices of
    the gathers and scatters."""

    g: _Group
    rows: torch.Tensor  # (N, tile) query rows, clamped to Lq - 1
    real: torch.Tensor  # (N, tile) bool: a real row (not padding past Lq)
    pos: torch.Tensor  # (N, tile) the rows' key positions
    keys: torch.Tensor  # (N, k_len) key positions, clamped to n - 1
    q_index: torch.Tensor  # (N * tile,) head * Lq + row
    kv_index: torch.Tensor  # (N * k_len,) kv_head * n + key
    integer: bool  # the partitions' integer path (ops.partitions.bounds.integer_pitch_shift)
    moves: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat index, value) of the block-move events, if used


# A causal call's counts come from its block moves (:func:`_move_events`) where that is estimated cheaper than the T
# start events of every row: ns per (row, sample) start (its bounds and scatter), per move event, per row of the
# running sum down the rows (one torch op) and per entry it adds (measured on one core at n = 32768).
ROW_START_NS = 8.0
MOVE_EVENT_NS = 10.0
ROW_SUM_NS = 3000.0
ROW_SUM_ENTRY_NS = 0.35


def _move_events(g: _Group, pos: torch.Tensor, n: int, num_samples: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The counts of a causal call with integer pitches from the moves of its blocks, or ``None`` where the per-row
    events are as cheap.

    Per row, the causal counts are ``c[r, j] = #{t : start_t(r) <= j}`` for ``j <= r``: ``T`` start events per row
    (:func:`_mask`'s general form, whose cost grows with ``T``). Down a tile the starts change only where a block
    begins: when sample ``t``'s block begins at row ``beta`` its start moves from ``p`` to ``beta``, which for every
    row from ``beta`` on removes an event at ``p`` and adds one at ``beta``. So the rows' events are a running sum
    down the rows of a sparse array: the first row's ``T`` starts, ``-1`` at ``(beta, p)`` and ``+1`` at
    ``(beta, beta)`` per move, and the diagonal (``-T`` at ``(r, r + 1)``, undone by ``+T`` at ``(r + 1, r + 1)``).
    Each event carries its distinct partition's weight (``g.weight``: how many samples drew it). Returns the flat
    indices into ``(N, tile, k_len + 1)`` and int32 values of those events (the running sum over rows and then over
    keys is :func:`_mask`'s). All rows must be real (consecutive positions ``pos``).
    """
    num, tile = pos.shape
    kl = g.k_len
    distinct = g.pitch.shape[1]
    if num * distinct * ROW_START_NS <= ROW_SUM_NS:  # the running sum's one op per row alone costs more
        return None
    whole = integer_pitch_shift(g.pitch, g.shift)
    assert whole is not None
    b = whole[0]  # (N, U) int64 pitches
    first, last = pos[:, :1], pos[:, -1:]  # (N, 1)
    start0, end0 = block_bounds(g.pitch, g.shift, n, first)  # (N, U): the first row's blocks
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


def kernel_calls(plan: MultiplicityPlan, device: torch.device, batch: int, d: int) -> tuple[_Call, ...]:
    """The kernel calls of ``plan`` for inputs of ``batch`` rows and head dim ``d`` on ``device`` (cached on the
    plan: a forward's backward, and repeated calls with the same partitions, reuse them)."""
    key = (str(device), batch, d)
    hit = plan.calls_cache.get(key)
    if hit is not None:
        return hit
    calls = []
    lq, n = plan.q_len, plan.k_len
    for group in plan.groups:
        integer = integer_pitch_shift(group.pitch, group.shift) is not None  # once per group, not per call
        for g in _chunks(group.to(device), batch, d):
            rows, real = tile_rows(g, lq)
            keys = _keys(g, n)
            pos = rows + (n - lq)
            moves = _move_events(g, pos, n, plan.num_samples) if integer and plan.causal and bool(real.all()) else None
            q_index = (g.head[:, None] * lq + rows).flatten()
            kv_index = (g.kv_head[:, None] * n + keys).flatten()
            calls.append(_Call(g, rows, real, pos, keys, q_index, kv_index, integer, moves))
    plan.calls_cache[key] = out = tuple(calls)
    return out


def tile_rows(g: _Group, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows of every tile of ``g``, int64 ``(N, tile)`` clamped to ``q_len - 1``, and whether each is a
    real row (bool, ``False`` for the padding past ``q_len``)."""
    r = g.q_start[:, None] + torch.arange(g.tile, device=g.q_start.device)
    return r.clamp(max=q_len - 1), r < q_len


def row_bounds(
    g: _Group, pos: torch.Tensor, n: int, need_end: bool, integer: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``start_t``/``end_t`` of the block of every tile row in every sample: int64 ``(N, tile, T)``.

    ``pos`` (int64 ``(N, tile)``) are the rows' key positions in a sequence of ``n``; ``end`` is ``None`` unless
    ``need_end``; ``integer``: whether ``g``'s partitions take the integer path, where known (else it is checked).

    Integer pitches and shifts (the one rule, :func:`~positional_lsh.ops.partitions.bounds.integer_pitch_shift`):
    :func:`~positional_lsh.ops.partitions.bounds.block_bounds` of every row, a few integer passes. Otherwise
    ``block_bounds`` of the first (and last) row of each tile only; inside a tile the rows are consecutive
    positions, so a block starts wherever the label ``floor((i - shift) / pitch)`` changes: ``start`` is a running
    maximum of those positions, ``end`` a reversed running minimum.
    """
    p = pos[..., None]  # (N, tile, 1)
    if integer is None:
        integer = integer_pitch_shift(g.pitch, g.shift) is not None  # a module-level lookup (tests replace it)
    if integer:
        start, end = block_bounds(g.pitch[:, None, :], g.shift[:, None, :], n, p)
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


class _Workspace:
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


def _mask(call: _Call, plan: MultiplicityPlan, dtype: torch.dtype, ws: _Workspace) -> torch.Tensor:
    """``log c`` over ``(N, tile, k_len)`` with ``-inf`` where ``c = 0`` (and above the diagonal when causal).

    Counts are int32, exact: an integer ``cumsum`` (about 2.5x faster than a float one, which waits on each add)
    of the blocks' start (and end) events, then ``log c`` by a lookup in the table of its ``T + 1`` values (an
    ``index_select``: 0.5 ns per entry on one core, against about 3 ns for ``log`` and a select of the zeros, whose
    ``log`` takes the math library's slow path). The events are the ``T`` block starts of every row or, for causal
    calls with integer pitches where they are fewer, the blocks' moves summed down the rows (:func:`_move_events`).
    """
    g, rows, pos, n, kl = call.g, call.rows, call.pos, plan.k_len, call.g.k_len
    events = ws.take("events", (*rows.shape, kl + 1), torch.int32).zero_()
    if call.moves is not None:
        events.view(-1).index_add_(0, *call.moves)
        for r in range(1, rows.shape[1]):  # the running sum down the rows (torch's cumsum over dim 1 is ~20x slower)
            events[:, r].add_(events[:, r - 1])
    else:
        start, end = row_bounds(g, pos, n, not plan.causal, call.integer)
        k0 = g.k_start[:, None, None]
        ones = g.weight[:, None, :].expand(start.shape)  # each distinct partition counts its samples
        events.scatter_add_(-1, start - k0, ones)
        if end is not None:
            events.scatter_add_(-1, (end - k0).clamp(max=kl), -ones)
        else:  # causal: every start is <= i, so subtracting T at key i + 1 zeroes the counts above the diagonal
            above = (pos - g.k_start[:, None] + 1).clamp(max=kl).unsqueeze(-1)
            minus_t = torch.full(above.shape, -plan.num_samples, dtype=torch.int32, device=rows.device)
            events.scatter_add_(-1, above, minus_t)
    c = torch.cumsum(events[..., :kl], -1, dtype=torch.int32, out=ws.take("counts", (*rows.shape, kl), torch.int32))
    mask = ws.take("mask", c.shape, dtype)  # c is exactly 0 outside every block: -inf there
    torch.index_select(ws.log_table(plan.num_samples, dtype), 0, c.view(-1), out=mask.view(-1))
    return mask


def _gather(
    x: torch.Tensor, index: torch.Tensor, shape: torch.Size, ws: _Workspace | None = None, role: str = ""
) -> torch.Tensor:
    """Rows ``index`` (flat ``head * L + position``) of ``x (B, H, L, ...)`` as ``(B, *shape, ...)`` (into
    ``ws``'s buffer of ``role`` where given and ``(H, L)`` flattens to a view)."""
    b, length, rest = x.shape[0], x.shape[2], x.shape[3:]
    if x.stride(1) == length * x.stride(2) or x.shape[1] == 1:  # (H, L) merges into one dim without a copy
        flat = x.flatten(1, 2)
        if ws is None:
            return flat.index_select(1, index).view(b, *shape, *rest)
        buf = ws.take(role, (b, index.numel(), *rest), x.dtype)
        return torch.index_select(flat, 1, index, out=buf).view(b, *shape, *rest)
    return x[:, index // length, index % length].view(b, *shape, *rest)


def _call_inputs(
    c: _Call, plan: MultiplicityPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cd: torch.dtype, ws: _Workspace
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel call's mask and its gathered ``q, k, v`` tiles in the accumulation dtype ``cd`` (half inputs are
    converted tile by tile, in the cache: a whole-tensor conversion paged in a fresh copy and was slower)."""
    mask = _mask(c, plan, cd, ws)
    qg = _gather(q, c.q_index, c.rows.shape, ws, "q").to(cd)
    kg = _gather(k, c.kv_index, c.keys.shape, ws, "k").to(cd)
    vg = _gather(v, c.kv_index, c.keys.shape, ws, "v").to(cd)
    return mask, qg, kg, vg


def _keys(g: _Group, n: int) -> torch.Tensor:
    return (g.k_start[:, None] + torch.arange(g.k_len, device=g.k_start.device)).clamp(max=n - 1)


@dataclass(frozen=True)
class MultiplicityBackend:
    """The multiplicity form on a torch kernel (:class:`~positional_lsh.ops._engine.backend.Backend`). Tiles are
    computed in the accumulation dtype (``ops._engine.kernels.acc_dtype``: float32 for half inputs, so that the
    mask's ``log c`` is not rounded to 8 bits).

    Attributes:
        kernel: ``"flash"`` or ``"math"`` (``ops._engine.kernels.attend``; every call has the mask ``log c``).
    """

    kernel: str

    @property
    def method(self) -> str:
        """``"multiplicity"``."""
        return "multiplicity"

    def plan(
        self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device
    ) -> MultiplicityPlan:
        """:func:`multiplicity_plan` of every query head (host-side; the groups move to the inputs' device)."""
        return multiplicity_plan(partitions, list(range(partitions.num_heads)), num_kv_heads, q_len, causal)

    def forward(
        self, plan: MultiplicityPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's masked call, its rows written into ``out``/``lse`` (no merge: each row is in one tile); the
        rows of heads outside ``plan.heads`` stay 0 and ``-inf``. ``out`` in ``q``'s dtype."""
        cd = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=cd, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cd, device=q.device)
        b, d = q.shape[0], q.shape[-1]
        ws = _Workspace(q.device)
        for c in kernel_calls(plan, q.device, b, d):
            mask, qg, kg, vg = _call_inputs(c, plan, q, k, v, cd, ws)
            o, l = attend(qg, kg, vg, causal=False, scale=scale, kernel=self.kernel, bias=mask.unsqueeze(0))
            # Padded rows repeat row Lq-1 of the same tile: they write the same values.
            out.view(b, -1, d).index_copy_(1, c.q_index, o.flatten(1, 2).to(out.dtype))
            lse.view(b, -1).index_copy_(1, c.q_index, l.flatten(1, 2).to(lse.dtype))
        return out.to(q.dtype), lse

    def backward(
        self, plan: MultiplicityPlan, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool
    ) -> Gradients:
        """Every group's masked backward against the saved ``out``/``lse``, its key gradients scatter-added
        (accumulation dtype); with ``dist_grad`` each call's ``sum dS |i - j|`` into its tiles' heads."""
        q, k, v, out, lse = saved
        (dq, dk, dv), dist = accumulators(saved, dist_grad)
        cd = acc_dtype(q.dtype)
        b, hq, lq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        dq_f, dk_f, dv_f = dq.view(b, hq * lq, d), dk.view(b, hkv * n, d), dv.view(b, hkv * n, d)
        ws = _Workspace(q.device)
        for c in kernel_calls(plan, q.device, b, d):
            mask, qg, kg, vg = _call_inputs(c, plan, q, k, v, cd, ws)
            og = _gather(out, c.q_index, c.rows.shape, ws, "out").to(cd)
            lg = _gather(lse.unsqueeze(-1), c.q_index, c.rows.shape).squeeze(-1).to(cd)
            # Padding rows get a zero upstream gradient, so they contribute nothing.
            dg = (_gather(dout, c.q_index, c.rows.shape).to(cd) * c.real[None, :, :, None]).to(cd)
            gq, gk, gv = attend_backward(
                dg, qg, kg, vg, og, lg, causal=False, scale=scale, kernel=self.kernel, bias=mask.unsqueeze(0)
            )
            dq_f.index_add_(1, c.q_index, gq.flatten(1, 2).to(dq.dtype))
            dk_f.index_add_(1, c.kv_index, gk.flatten(1, 2).to(dk.dtype))
            dv_f.index_add_(1, c.kv_index, gv.flatten(1, 2).to(dv.dtype))
            if dist is not None:  # the surrogate slope gradient: |i - j| of the tiles' rows and union keys
                w = (c.pos[:, :, None] - c.keys[:, None, :]).abs().to(cd).unsqueeze(0)
                total = attend_bias_grad(dg, qg, kg, vg, og, lg, w, causal=False, scale=scale, bias=mask.unsqueeze(0))
                dist.index_add_(0, c.g.head, total.sum(0).to(dist.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dist


MULTIPLICITY_FLASH = MultiplicityBackend("flash")
"""The multiplicity form on torch's fused flash op of the device (the row ``("multiplicity", "flash")``)."""
MULTIPLICITY_MATH = MultiplicityBackend("math")
"""The multiplicity form on batched matmuls (the row ``("multiplicity", "math")``)."""
