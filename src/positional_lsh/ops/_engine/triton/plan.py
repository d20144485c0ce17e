"""The host side of the Triton kernels: block configurations, the per-call plan and its layouts (torch only).

The backend's plan of a call (:class:`TritonPlan`) is the call itself; the tensors the kernels read (a
:class:`TritonLayout`: events, cuts, the near table) depend on the block configuration, which the inputs' dtype
and head dim fix, so the plan builds them on first use (:meth:`TritonPlan.layout_for`, :func:`build_layout`).

The kernels (:mod:`positional_lsh.ops._engine.triton.kernels`) compute the multiplicity form

    out_i = softmax_j(s[i,j] + log c[i,j]) v_j,    c[i,j] = #{t : start_t(i) <= j < end_t(i)}

(``end_t(i)`` replaced by ``i + 1`` when causal) over query tiles of ``BLOCK_M`` rows and key blocks of
``BLOCK_N`` keys on one grid: key block ``b`` holds keys ``grid0 + b * BLOCK_N + [0, BLOCK_N)``, with ``grid0``
chosen so that every tile's first row is on the grid. Relative to a tile with rows ``[i0, i0 + BLOCK_M)`` (key
positions; ``i_last`` its last real row) a key block is

* **near** when it lies in ``[i0 - near, i0 + BLOCK_M + near_right)`` (``near_right = near`` bidirectional,
  ``0`` causal): its counts are read from the layout's *near table* ``near[h, r, o] = c[i, i0 - near + o]``, a band
  of ``width = near + BLOCK_M + near_right`` counts per query row, built here;
* **far left** (keys ``j < i0 - near``): every sample's block of such a key and of a tile row can only be the block
  of row ``i0``, ``[s_t, e_t)``; so ``c[i,j] = #{t : s_t <= j, e_t > i}``, a count over ``T`` points per *tile*;
* **far right** (bidirectional, ``j >= i0 + BLOCK_M + near``): likewise with the block ``[s'_t, e'_t)`` of
  ``i_last``: ``c[i,j] = #{t : s'_t <= i, e'_t > j}``, which is the left form in negated coordinates
  (``u = 1 - e'``, ``v = 1 - s'``, rows ``-i``, keys ``-j``).

The ``T`` points ``(u, v)`` of each tile and side are *events*, sorted by ``u``: first the *stable* ones (``v`` above
every row of the tile: they add a step in ``j`` only), then the *breaking* ones (the block ends inside the tile:
a step in both ``i`` and ``j``). Per score entry a far block costs the kernels an add and a compare, plus one select
per breaking event whose ``u`` falls inside the block — see ``scripts/triton_work.py`` for the exact
count. Which events lie below each key-block boundary is stored too (the *cuts*), so the kernels never search.
Nothing here is ``O(n^2)``: events are ``O(H * n / BLOCK_M * T)`` integers, the near table ``O(H * n * width)`` small
integers; building them costs ``O(H * n * T)`` elementwise work (the rows' block bounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.counts import block_counts
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "BLOCK_TABLE",
    "DEFAULT_ARCH",
    "BlockConfig",
    "TritonLayout",
    "TritonPlan",
    "block_config",
    "build_layout",
    "head_bounds",
    "near_dtype",
]


@dataclass(frozen=True)
class BlockConfig:
    """Tile shape and launch settings of the kernels.

    Attributes:
        block_m: query rows per tile (a multiple of ``block_n``).
        block_n: keys per key block.
        near: keys before the tile (and after it, bidirectional) whose counts come from the near table (a
            multiple of ``block_n``).
        num_warps, num_stages: Triton launch options of the forward and ``dq`` kernels.
        dkdv_m, dkdv_n: the ``dk, dv`` kernel's tile: a program owns ``dkdv_n`` keys of a key block and visits the
            query tiles ``dkdv_m`` rows at a time (divisors of ``block_n`` and ``block_m``; ``0``: the same).
        dkdv_warps, dkdv_stages: its launch options (``0``: the same as the others).
    """

    block_m: int
    block_n: int
    near: int
    num_warps: int = 4
    num_stages: int = 2
    dkdv_m: int = 0
    dkdv_n: int = 0
    dkdv_warps: int = 0
    dkdv_stages: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockConfig.{name} must be a power of two, got {value}")
        if self.block_m % self.block_n or self.near % self.block_n or self.near < 0:
            raise ValueError(
                f"BlockConfig: block_m ({self.block_m}) and near ({self.near}) must be multiples of "
                f"block_n ({self.block_n})"
            )
        if self.block_m % self.sub_m or self.block_n % self.sub_n or self.sub_m & (self.sub_m - 1):
            raise ValueError("BlockConfig: dkdv_m and dkdv_n must be powers of two dividing block_m and block_n")

    @property
    def sub_m(self) -> int:
        """Rows per step of the ``dk, dv`` kernel."""
        return self.dkdv_m or self.block_m

    @property
    def sub_n(self) -> int:
        """Keys per program of the ``dk, dv`` kernel."""
        return self.dkdv_n or self.block_n

    def launch(self, kernel: str) -> tuple[int, int]:
        """``(num_warps, num_stages)`` of ``kernel`` (``"dkdv"`` or another)."""
        if kernel == "dkdv":
            return self.dkdv_warps or self.num_warps, self.dkdv_stages or self.num_stages
        return self.num_warps, self.num_stages

    def width(self, causal: bool) -> int:
        """Counts per query row in the near table: ``near + block_m`` (``+ near`` bidirectional)."""
        return self.near + self.block_m + (0 if causal else self.near)


DEFAULT_ARCH = 90
"""The architecture (``major * 10 + minor``) whose configurations are used where there is no GPU (the interpreter)."""

# (arch, dtype, largest head dim) -> configuration, chosen by the ahead-of-time compile checks
# (scripts/triton_compile.py: search_config; `python scripts/triton_resources.py --search --dims
# 64,128,256`,
# triton 3.9.0, every launch with maxnreg=255): the first of its candidates, in order of preference (larger tiles
# first), whose kernels compile causal and bidirectional without spills (stack 0) and within the architecture's shared
# memory; where none does (marked "spills") the least-spilling candidates. BlockConfig(block_m, block_n, near,
# num_warps, num_stages, dkdv_m, dkdv_n, dkdv_warps, dkdv_stages). Not tuned for speed: no GPU has run them.
BLOCK_TABLE: dict[tuple[int, str, int], BlockConfig] = {
    (80, "bfloat16", 64): BlockConfig(64, 32, 96, 4, 2, 64, 32, 8, 2),
    (80, "bfloat16", 128): BlockConfig(64, 32, 96, 4, 2, 32, 32, 8, 2),
    (80, "bfloat16", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),
    (80, "float16", 64): BlockConfig(64, 32, 96, 4, 2, 64, 32, 8, 2),
    (80, "float16", 128): BlockConfig(64, 32, 96, 4, 2, 32, 32, 8, 2),
    (80, "float16", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),
    (80, "float32", 64): BlockConfig(32, 16, 96, 4, 1, 32, 16, 4, 2),
    (80, "float32", 128): BlockConfig(32, 16, 96, 4, 1, 16, 16, 2, 1),
    (80, "float32", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),
    (90, "bfloat16", 64): BlockConfig(64, 64, 128, 4, 2, 64, 64, 4, 2),
    (90, "bfloat16", 128): BlockConfig(64, 64, 128, 4, 2, 64, 32, 4, 2),
    (90, "bfloat16", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),  # spills
    (90, "float16", 64): BlockConfig(64, 64, 128, 4, 2, 64, 64, 4, 2),
    (90, "float16", 128): BlockConfig(64, 64, 128, 4, 2, 64, 32, 4, 2),
    (90, "float16", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),  # spills
    (90, "float32", 64): BlockConfig(32, 16, 96, 4, 1, 32, 16, 4, 2),
    (90, "float32", 128): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),  # spills
    (90, "float32", 256): BlockConfig(32, 16, 96, 4, 1, 16, 16, 4, 1),  # spills
}

_HEAD_DIMS = (64, 128, 256)


def block_config(dtype: torch.dtype, head_dim: int, arch: int | None = None) -> BlockConfig:
    """The configuration of :data:`BLOCK_TABLE` for ``dtype`` (float32, bfloat16, float16), ``head_dim <= 256`` and
    ``arch`` (``major * 10 + minor``; ``None``: :data:`DEFAULT_ARCH`). Architectures between the table's use the
    row below them (sm_86/sm_89 use sm_80's), newer ones sm_90's (unchecked there)."""
    arch = DEFAULT_ARCH if arch is None else arch
    row = 90 if arch >= 90 else 80
    name = str(dtype).removeprefix("torch.")
    dim = next((d for d in _HEAD_DIMS if head_dim <= d), None)
    if dim is None or (row, name, dim) not in BLOCK_TABLE:
        raise ValueError(f"no Triton block configuration for dtype={name}, head_dim={head_dim}")
    return BLOCK_TABLE[(row, name, dim)]


def near_dtype(num_samples: int) -> torch.dtype:
    """The near table's dtype: the smallest that holds counts ``0..T``."""
    if num_samples <= 255:
        return torch.uint8
    return torch.int16 if num_samples <= 32767 else torch.int32


def head_bounds(
    pitch: torch.Tensor, shift: torch.Tensor, seq_len: int, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` int64 ``(T, P)``: the block of each position ``pos (P,)`` in each of a head's ``T`` partitions
    (``pitch, shift (T,)`` float64, on ``pos``'s device): :func:`~positional_lsh.ops.partitions.bounds.block_bounds`,
    integer arithmetic under its one rule. Only these bounds reach the kernels (int32 events and counts, clipped to
    ``[0, Lk]``), never a pitch or a shift, so every pitch the rule takes is fine for them."""
    return block_bounds(pitch[:, None], shift[:, None], seq_len, pos[None, :])


@dataclass(frozen=True)
class TritonLayout:
    """Everything the kernels read besides ``q, k, v`` (int32 unless said; built by :func:`build_layout`).

    Attributes:
        config: the block configuration the layout was built for.
        causal, q_len, k_len, num_samples, num_heads: the call.
        grid0: key position of key block 0's first key (``-block_n < grid0 <= 0``).
        num_tiles, num_kb: query tiles and key blocks.
        width: counts per row of the near table.
        tile_first, tile_last: ``(H, tiles)``: the key blocks ``[first, last)`` a tile visits.
        left_u, left_v: ``(H, tiles, T)`` left events, stable first, each part sorted by ``u``; ``left_ns`` ``(H,
            tiles)`` how many are stable. ``right_*`` likewise (bidirectional; the left ones again when causal).
        left_cuts: flat int32 pairs ``(stable, breaking)``: for each tile and each key-block boundary ``k`` in
            ``[first, last]`` (key ``grid0 + k * block_n``), the events below it (left: ``u < key``; the breaking
            count includes the stable ones, an index into the events). ``right_cuts`` likewise with ``u < 1 - key``.
        cut_base: ``(H, tiles)`` int64: the pair of boundary ``k`` of a tile is ``cuts[2 * (cut_base + k)]``.
        near: ``(H, Lq, width)`` counts (:func:`near_dtype`).
        kb_first, kb_last: ``(H, num_kb)``: the query tiles ``[first, last)`` that visit each key block.
    """

    config: BlockConfig
    causal: bool
    q_len: int
    k_len: int
    num_samples: int
    num_heads: int
    grid0: int
    num_tiles: int
    num_kb: int
    width: int
    tile_first: torch.Tensor
    tile_last: torch.Tensor
    left_u: torch.Tensor
    left_v: torch.Tensor
    left_ns: torch.Tensor
    right_u: torch.Tensor
    right_v: torch.Tensor
    right_ns: torch.Tensor
    left_cuts: torch.Tensor
    right_cuts: torch.Tensor
    cut_base: torch.Tensor
    near: torch.Tensor
    kb_first: torch.Tensor
    kb_last: torch.Tensor

    def nbytes(self) -> int:
        """Bytes of the layout's tensors (the near table dominates: ``H * Lq * width`` small integers)."""
        seen: set[int] = set()
        total = 0
        for value in self.__dict__.values():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
        return total


def _grid0(q_len: int, k_len: int, block_n: int) -> int:
    return -((block_n - (k_len - q_len) % block_n) % block_n)


def _sorted_events(u: torch.Tensor, v: torch.Tensor, stable: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(T, tiles)`` events → ``(tiles, T)`` int32 ``u, v`` sorted stable-first, then by ``u``; and the stable
    counts ``(tiles,)``."""
    u, v, brk = u.t(), v.t(), (~stable).t()
    order = torch.sort(u, dim=1, stable=True).indices
    u, v, brk = u.gather(1, order), v.gather(1, order), brk.gather(1, order)
    order = torch.sort(brk.to(torch.int8), dim=1, stable=True).indices
    u, v = u.gather(1, order), v.gather(1, order)
    return u.to(torch.int32), v.to(torch.int32), (~brk).sum(1).to(torch.int32)


def _cuts(u: torch.Tensor, ns: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``(tiles, K, 2)`` int64: per tile the stable events with ``u < key`` and ``ns +`` the breaking ones, for the
    ``keys (tiles, K)``; ``u (tiles, T)`` sorted stable-first as :func:`_sorted_events` leaves them."""
    u = u.long()
    stable = torch.arange(u.shape[1], device=u.device)[None, :] < ns[:, None]
    big = 2**40
    s = torch.searchsorted(torch.where(stable, u, big).contiguous(), keys.contiguous())
    b = torch.searchsorted(torch.where(stable, -big, u).contiguous(), keys.contiguous())
    return torch.stack([s, b], -1)


def _near_rows(
    pitch: torch.Tensor, shift: torch.Tensor, plan_args: tuple[int, int, int, int, bool], rows: torch.Tensor
) -> torch.Tensor:
    """Near-table counts ``(R, width)`` int32 of query ``rows (R,)`` of one head."""
    q_len, k_len, block_m, near, causal = plan_args
    width = near + block_m + (0 if causal else near)
    pos = rows + (k_len - q_len)
    base = (k_len - q_len) + torch.div(rows, block_m, rounding_mode="floor") * block_m - near  # key of column 0
    start, end = head_bounds(pitch, shift, k_len, pos)  # (T, R)
    c = block_counts(start.t(), end.t(), base, width)  # (R, width)
    if causal:  # keys after the row: 0 (its blocks end after it: their ends change no column up to the row)
        cols = torch.arange(width, device=rows.device)
        c = c.masked_fill(cols[None, :] > (pos - base)[:, None], 0)
    return c


def build_layout(
    partitions: Partitions, q_len: int, causal: bool, config: BlockConfig, device: torch.device
) -> TritonLayout:
    """The kernels' layout for ``partitions`` (``seq_len = Lk``), ``q_len`` queries aligned to the last keys, on
    ``device`` (see the module docstring)."""
    n, t_count, heads = partitions.seq_len, partitions.num_samples, partitions.num_heads
    if n >= 2**31 - 1 or t_count >= 2**31:
        raise ValueError("partitions: seq_len and num_samples must fit in int32 for the Triton kernels")
    bm, bn, near = config.block_m, config.block_n, config.near
    g0 = _grid0(q_len, n, bn)
    num_tiles = -(-q_len // bm)
    num_kb = -(-(n - g0) // bn)
    width = config.width(causal)
    pitch_all, shift_all = partitions.pitch.to(device), partitions.shift.to(device)
    i0 = (n - q_len) + torch.arange(num_tiles, device=device, dtype=torch.long) * bm
    i_last = torch.clamp(i0 + bm, max=n) - 1
    first, last, lefts, rights, nears, lcuts, rcuts = [], [], [], [], [], [], []
    rows_per_chunk = max(1, 2**23 // max(1, t_count + width))  # bounds temporaries to a few hundred MiB
    for h in range(heads):
        pitch, shift = pitch_all[:, h], shift_all[:, h]
        s, e = head_bounds(pitch, shift, n, i0)  # (T, tiles): the block of each tile's first row
        lefts.append(_sorted_events(s, e, e > i_last[None, :]))
        first.append(torch.div(s.amin(0) - g0, bn, rounding_mode="floor"))
        if causal:
            last.append(torch.div(i_last - g0, bn, rounding_mode="floor") + 1)
        else:
            s2, e2 = head_bounds(pitch, shift, n, i_last)  # the block of each tile's last row
            rights.append(_sorted_events(1 - e2, 1 - s2, s2 <= i0[None, :]))
            last.append(-torch.div(-(e2.amax(0) - g0), bn, rounding_mode="floor"))
        # Event counts below every key-block boundary k in [first, last] of each tile.
        span = int((last[-1] - first[-1]).max()) + 1 if num_tiles else 1
        k = first[-1][:, None] + torch.arange(span, device=device)[None, :]
        inside = k <= last[-1][:, None]
        keys = g0 + k * bn
        lcuts.append(_cuts(lefts[-1][0], lefts[-1][2].long(), keys)[inside])
        if not causal:
            rcuts.append(_cuts(rights[-1][0], rights[-1][2].long(), 1 - keys)[inside])
        rows = torch.arange(q_len, device=device, dtype=torch.long)
        table = torch.empty((q_len, width), dtype=near_dtype(t_count), device=device)
        for a in range(0, q_len, rows_per_chunk):
            chunk = rows[a : a + rows_per_chunk]
            table[a : a + chunk.numel()] = _near_rows(pitch, shift, (q_len, n, bm, near, causal), chunk)
        nears.append(table)
    tile_first = torch.stack(first).to(torch.int32).contiguous()
    tile_last = torch.stack(last).to(torch.int32).contiguous()
    kb = torch.arange(num_kb, device=device, dtype=torch.int32).expand(heads, -1).contiguous()
    # Tile m visits key block b iff first[m] <= b < last[m]; both are nondecreasing in m, so these tiles are one run.
    kb_first = torch.searchsorted(tile_last, kb, right=True).to(torch.int32).contiguous()
    kb_last = torch.searchsorted(tile_first, kb, right=True).to(torch.int32).contiguous()

    def stack(parts: list[tuple[torch.Tensor, ...]], i: int) -> torch.Tensor:
        return torch.stack([p[i] for p in parts]).contiguous()

    left = [stack(lefts, i) for i in range(3)]
    right = left if causal else [stack(rights, i) for i in range(3)]
    # Tile (h, m) owns the boundaries [first, last] at offset sum of the earlier tiles' counts: base = offset - first.
    counts = (tile_last - tile_first + 1).long().flatten()
    offset = torch.cumsum(counts, 0) - counts
    cut_base = (offset.view(heads, num_tiles) - tile_first.long()).contiguous()
    left_cuts = torch.cat(lcuts).to(torch.int32).flatten().contiguous()
    right_cuts = left_cuts if causal else torch.cat(rcuts).to(torch.int32).flatten().contiguous()
    (left_u, left_v, left_ns), (right_u, right_v, right_ns) = left, right
    return TritonLayout(
        config, causal, q_len, n, t_count, heads, g0, num_tiles, num_kb, width,
        tile_first, tile_last, left_u, left_v, left_ns, right_u, right_v, right_ns,
        left_cuts, right_cuts, cut_base, torch.stack(nears).contiguous(), kb_first, kb_last,
    )  # fmt: skip


@dataclass
class TritonPlan:
    """The Triton backend's plan of one call (``ops._engine.triton.host.TRITON.plan``): the call, with its
    :class:`TritonLayout` built on first use for the block configuration of the inputs (the dtype and head dim pick
    it, and the engine plans before it sees them); the backward reuses the forward's layout."""

    partitions: Partitions
    q_len: int
    causal: bool
    device: torch.device
    _layouts: dict[BlockConfig, TritonLayout] = field(default_factory=dict, repr=False)

    def layout_for(self, config: BlockConfig) -> TritonLayout:
        """The layout for ``config`` (built once)."""
        layout = self._layouts.get(config)
        if layout is None:
            layout = build_layout(self.partitions, self.q_len, self.causal, config, self.device)
            self._layouts[config] = layout
        return layout
