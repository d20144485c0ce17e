"""The multiplicity form's plan, host-side: query tiles of each head's cheapest height, grouped by shape.

A tile's keys are one window ``[k_start, k_start + k_len)`` covering the union of its rows' intervals; tiles of
equal ``(tile, k_len)`` form a :class:`Group` (one batched kernel call). The method:
:mod:`positional_lsh.ops._engine.multiplicity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from positional_lsh.ops._engine.cost import TILE_HEIGHTS, tiling_estimate
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "CHUNK_ELEMENTS", "KEEP_MASK_ELEMENTS", "WHOLE_TILE_ROWS", "Call", "Group", "MultiplicityPlan", "Tiling",
    "call_chunks", "distinct_partitions", "multiplicity_plan", "tile_rows", "tilings",
]  # fmt: skip

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
#: A forward keeps its calls' masks for its backward (which then does not build them again) when they hold at most
#: this many entries in all (16 MB in float32; n = 256, H = 8, T = 8 needs about 2**19); the backward releases them.
KEEP_MASK_ELEMENTS = 2**22


@dataclass(frozen=True)
class Group:
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

    def to(self, device: torch.device) -> Group:
        """The group with its tensors on ``device``."""
        return Group(self.tile, self.k_len, *(x.to(device) for x in self._columns()))

    def _columns(self) -> tuple[torch.Tensor, ...]:
        return (self.head, self.kv_head, self.q_start, self.k_start, self.pitch, self.shift, self.weight)

    def split(self, size: int) -> list[Group]:
        """The group cut into groups of at most ``size`` tiles."""
        n = self.head.shape[0]
        return [
            Group(
                self.tile,
                self.k_len,
                *(x[a : a + size] for x in self._columns()),
            )
            for a in range(0, n, size)
        ]


@dataclass(frozen=True)
class Call:
    """One kernel call (a chunk of a group) with its index tensors, computed once per plan (they do not depend on
    ``q, k, v``): the rows and their key positions, the keys, and the flat ``head * length + position`` indices of
    the gathers and scatters."""

    g: Group
    rows: torch.Tensor  # (N, tile) query rows, clamped to Lq - 1
    real: torch.Tensor  # (N, tile) bool: a real row (not padding past Lq)
    pos: torch.Tensor  # (N, tile) the rows' key positions
    keys: torch.Tensor  # (N, k_len) key positions, clamped to n - 1
    q_index: torch.Tensor  # (N * tile,) head * Lq + row
    kv_index: torch.Tensor  # (N * k_len,) kv_head * n + key
    whole: tuple[torch.Tensor, torch.Tensor] | None  # int64 (pitch, shift) on the integer path, once per call
    # (ops.partitions.bounds.integer_pitch_shift); None: real partitions
    moves: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat index, value) of the block-move events, if used
    padded: bool = True  # whether some row is padding past Lq (False: ``real`` is all True)


@dataclass(frozen=True)
class MultiplicityPlan:
    """Kernel groups for the multiplicity form of some heads; built by :func:`multiplicity_plan`."""

    heads: tuple[int, ...]
    groups: tuple[Group, ...]
    q_len: int
    k_len: int
    causal: bool
    num_samples: int
    calls_cache: dict[tuple[str, int, int], tuple[Call, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )
    kept_masks: dict[tuple[str, int, int, torch.dtype], tuple[torch.Tensor, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def num_groups(self) -> int:
        """The groups of tiles of one shape: one batched kernel call each (split further only to cap memory,
        :func:`~positional_lsh.ops._engine.multiplicity.mask.kernel_calls`)."""
        return len(self.groups)


def round_up(k: np.ndarray, limit: int) -> np.ndarray:
    """Round int64 lengths up to one of ``_STEPS_PER_OCTAVE`` sizes per octave (multiples of 8), at most ``limit``."""
    kf = np.maximum(k.astype(np.float64), 8.0)
    octave = np.frexp(kf)[1] - 1 - math.log2(_STEPS_PER_OCTAVE)  # floor(log2(kf)), exactly
    unit = np.maximum(np.exp2(octave), 8.0)
    out = (np.ceil(kf / unit) * unit).astype(np.int64)
    out = ((out + 7) // 8) * 8
    return np.minimum(out, limit)


Tiling = tuple[float, tuple[torch.Tensor, ...], int]
"""One head's tiling: ``(estimated ns, (q_start, k_start, k_len), tile height)`` (see :func:`tilings`)."""


def distinct_count(x: np.ndarray) -> np.ndarray:
    """The number of distinct values in each column of ``x (rows, cols)``, float64 ``(cols,)``."""
    srt = np.sort(x, 0)
    return ((srt[1:] != srt[:-1]).sum(0) + 1).astype(np.float64)


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
    # The candidate heights in numpy (a few dozen small ops each: torch's per-op cost was most of planning).
    fine_np, lo_np, end_np = fine.numpy(), lo_fine.numpy(), end_fine.numpy()
    best_cost = np.full(len(heads), math.inf)
    chosen: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # per height: (tile, q_start, k_start, k_len)
    which = np.zeros(len(heads), dtype=np.int64)  # each head's cheapest height (the first of equal estimates)
    # Short calls may also take one tile of all rows (fewer, larger kernel calls; the cost model weighs the pairs).
    heights = TILE_HEIGHTS if q_len > WHOLE_TILE_ROWS else (*TILE_HEIGHTS, q_len)
    for tile in heights:
        tile = min(tile, q_len)
        step = tile // unit if tile < q_len else fine_np.size  # one tile: first row 0, last row Lq - 1
        first_idx = np.arange(0, fine_np.size, step)
        last_idx = np.minimum(first_idx + step - 1, fine_np.size - 1)
        tile_lo, tile_end = lo_np[first_idx], end_np[last_idx]  # (tiles, heads)
        k_len = round_up(tile_end - tile_lo, n)
        k_start = np.minimum(tile_lo, n - k_len)
        pairs = k_len.sum(0).astype(np.float64) * tile
        shapes = distinct_count(k_len)  # each distinct window length is (at least) one kernel call
        costs = tiling_estimate(pairs, tile, first_idx.size, q_len, partitions.num_samples, shapes)
        better = costs < best_cost
        best_cost = np.where(better, costs, best_cost)
        which[better] = len(chosen)
        chosen.append((tile, fine_np[first_idx], k_start, k_len))
        if tile >= q_len:
            break
    best: dict[int, Tiling] = {}
    for col, h in enumerate(heads):
        tile, q_start, k_start, k_len = chosen[which[col]]
        columns = (q_start, np.ascontiguousarray(k_start[:, col]), np.ascontiguousarray(k_len[:, col]))
        best[h] = (float(best_cost[col]), tuple(torch.from_numpy(x) for x in columns), tile)
    return best


def distinct_partitions(partitions: Partitions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's distinct ``(pitch, shift)`` pairs and how many samples drew each: ``(H, U)`` float64 pitches and
    shifts and int32 weights, ``U`` the most distinct pairs of a head (the rest of a row repeats its first pair with
    weight 0). Equal partitions give equal blocks, so a count ``c`` is the weighted count over the distinct ones: at
    large ``T`` the heads of small ``sigma`` (whose draws repeat) have a fraction of ``T`` events per row."""
    p, s = partitions.pitch.numpy(), partitions.shift.numpy()  # (T, H) float64 CPU: numpy, no copies
    t, h = p.shape
    # Every head at once (a per-head np.unique was most of a short call's planning): each column sorted by pitch,
    # then shift (np.unique's order), a new pair wherever a value changes, its slot the running count of new pairs.
    order = np.lexsort((s, p), axis=0)
    ps, ss = np.take_along_axis(p, order, 0), np.take_along_axis(s, order, 0)
    new = np.ones((t, h), dtype=bool)
    new[1:] = (ps[1:] != ps[:-1]) | (ss[1:] != ss[:-1])
    slot = np.cumsum(new, 0) - 1  # (T, H): the distinct pair of each draw
    width = int(slot[-1].max()) + 1
    cols = np.broadcast_to(np.arange(h), (t, h))
    pitch, shift = np.repeat(ps[:1].T, width, 1), np.repeat(ss[:1].T, width, 1)  # (H, U): padding repeats pair 0
    pitch[cols, slot], shift[cols, slot] = ps, ss
    weight = np.zeros((h, width), dtype=np.int32)
    np.add.at(weight, (cols, slot), 1)
    return torch.from_numpy(pitch), torch.from_numpy(shift), torch.from_numpy(weight)


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
    # In numpy: a few dozen small ops per height, where torch's per-op cost was most of a short call's planning.
    distinct = tuple(x.numpy() for x in distinct_partitions(partitions))
    by_tile: dict[int, list[tuple[np.ndarray, ...]]] = {}
    for h in heads:
        _, tiling, tile = tiles[h]
        rows, k_start, k_len = (x.numpy() for x in tiling)
        by_tile.setdefault(tile, []).append((np.full(rows.shape, h, dtype=np.int64), rows, k_start, k_len))
    groups = []
    for tile in sorted(by_tile):
        head, q_start, k_start, k_len = (np.concatenate(c) for c in zip(*by_tile[tile], strict=True))
        order = np.argsort(k_len, kind="stable")
        head, q_start, k_start, k_len = head[order], q_start[order], k_start[order], k_len[order]
        cuts = [*np.flatnonzero(k_len[1:] != k_len[:-1]) + 1, k_len.size]  # runs of equal k_len
        cols = (head, head // group_size, q_start, k_start, *(x[head] for x in distinct))
        first = 0
        for end in cuts:
            groups.append(Group(tile, int(k_len[first]), *(torch.from_numpy(c[first:end].copy()) for c in cols)))
            first = end
    return MultiplicityPlan(tuple(heads), tuple(groups), q_len, partitions.seq_len, causal, partitions.num_samples)


def call_chunks(group: Group, batch: int, d: int) -> list[Group]:
    """Split a group so that one call's mask (and its gathered keys and values) and its per-row bounds each have
    about ``CHUNK_ELEMENTS`` entries at most."""
    per_tile = max(group.tile * group.k_len + 2 * batch * group.k_len * d // 8, group.tile * group.pitch.shape[1])
    size = max(1, CHUNK_ELEMENTS // max(1, per_tile))
    return group.split(size) if group.head.shape[0] > size else [group]


def tile_rows(g: Group, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows of every tile of ``g``, int64 ``(N, tile)`` clamped to ``q_len - 1``, and whether each is a
    real row (bool, ``False`` for the padding past ``q_len``)."""
    r = g.q_start[:, None] + torch.arange(g.tile, device=g.q_start.device)
    return r.clamp(max=q_len - 1), r < q_len
