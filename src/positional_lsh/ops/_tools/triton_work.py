"""The work model of the Triton kernels' count: integer operations per computed score entry, from the layout.

Every (query tile, key block) pair a kernel visits (:mod:`positional_lsh.ops._engine.triton.plan`) computes its counts
with
``block_count`` (:mod:`positional_lsh.ops._engine.triton.kernels`): the forward and the ``dq`` kernel once per pair on
the
whole ``BLOCK_M x BLOCK_N`` tile, the ``dk, dv`` kernel on its ``dkdv_m x dkdv_n`` sub-tiles. :func:`count_work` gives,
for a layout and a kernel, the elementwise integer operations (adds, compares, selects, pointer adds; on vectors and
tiles, not on scalars; int casts excluded) that ``block_count`` executes — the same totals an instrumented run of the
kernels in Triton's interpreter counts (``tests/ops/engine/test_triton_work.py`` checks that equality) — and the score
entries computed. Per call over ``R x C`` entries:

* near (a table load): a pointer add and ``c > 0`` per entry, and one add per key;
* far: per entry the final add and ``c > 0``, plus one select per *breaking* event inside the block; per row two
  ops per breaking event before or inside the block; per key one op, plus two per stable event inside the block
  and one per breaking event inside it. The right side (bidirectional) negates the row and key coordinates first
  (one op per row and per key). Which events lie below a block's ends is read from the layout (``*_cuts``).

No term is ``O(T)`` per entry: ``T`` enters only through the breaking events inside a far block (one select per
entry each; the near table holds the keys where they crowd) and the events before it (per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from positional_lsh.ops._engine.triton.plan import TritonLayout

__all__ = ["CountWork", "count_work"]

_BIG = 2**40


@dataclass(frozen=True)
class CountWork:
    """Counting work of one kernel pass over a layout (the forward; ``dq`` and ``dk, dv`` each do the same again).

    Attributes:
        ops: ``(H,)`` int64, integer operations of ``block_count`` per head.
        entries: ``(H,)`` int64, computed score entries per head (``BLOCK_M * BLOCK_N`` per pair; the ``dk, dv``
            kernel's row steps stop at the last real row).
        pairs: ``(H,)`` int64, (tile, key block) pairs per head.
        near_pairs: ``(H,)`` int64, of which near (read from the near table).
    """

    ops: torch.Tensor
    entries: torch.Tensor
    pairs: torch.Tensor
    near_pairs: torch.Tensor

    @property
    def per_entry(self) -> float:
        """Integer operations per computed score entry over all heads (total / total)."""
        return float(self.ops.sum()) / max(1, float(self.entries.sum()))

    @property
    def per_entry_by_head(self) -> torch.Tensor:
        """``(H,)`` float64: each head's operations per computed score entry."""
        return self.ops.double() / self.entries.clamp_min(1).double()


def _far_ops(
    u: torch.Tensor,
    ns: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    t: int,
    rows: int,
    cols: int,
) -> torch.Tensor:
    """Operations of one ``_far`` call over ``rows x cols`` entries, for tiles with events ``u (tiles, T)`` (``ns``
    stable) and blocks ``[lo, hi)`` ``(tiles, blocks)`` in the events' coordinates."""
    r = torch.arange(t, device=u.device)
    stable = r[None, :] < ns[:, None]
    s_sorted = torch.where(stable, u, _BIG).contiguous()
    b_sorted = torch.where(stable, -_BIG, u).contiguous()
    s_lo, s_hi = torch.searchsorted(s_sorted, lo), torch.searchsorted(s_sorted, hi)
    b_lo, b_hi = torch.searchsorted(b_sorted, lo), torch.searchsorted(b_sorted, hi)  # absolute: ns + breaking below
    return (
        cols
        + 2 * cols * (s_hi - s_lo)
        + 2 * rows * (b_lo - ns[:, None])
        + (2 * rows + cols + rows * cols) * (b_hi - b_lo)
        + 2 * rows * cols
    )


def count_work(layout: TritonLayout, kernel: str = "fwd") -> CountWork:
    """The counting work of one kernel over ``layout``: ``"fwd"`` and ``"dq"`` (one ``BLOCK_M x BLOCK_N`` call per
    pair) or ``"dkdv"`` (``dkdv_m x dkdv_n`` calls covering each pair); see the module docstring."""
    if kernel not in ("fwd", "dq", "dkdv"):
        raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkdv', got {kernel!r}")
    cfg = layout.config
    bm, bn, near = cfg.block_m, cfg.block_n, cfg.near
    rows, cols = (cfg.sub_m, cfg.sub_n) if kernel == "dkdv" else (bm, bn)
    heads, tiles = layout.num_heads, layout.num_tiles
    i0 = (layout.k_len - layout.q_len) + torch.arange(tiles, dtype=torch.long) * bm
    tb0 = torch.div(i0 - layout.grid0, bn, rounding_mode="floor")
    near_lo = tb0 - near // bn
    near_hi = tb0 + (bm + (0 if layout.causal else near)) // bn
    # Calls per (tile, key block): one, or the dkdv kernel's row steps (of the tile's real rows) times key parts.
    real_rows = torch.clamp(layout.q_len - torch.arange(tiles) * bm, max=bm)
    calls = -(-real_rows // rows) * (bn // cols) if kernel == "dkdv" else torch.ones(tiles, dtype=torch.long)
    ops, pairs, near_pairs, entries = [], [], [], []
    for h in range(heads):
        first, last = layout.tile_first[h].long().cpu(), layout.tile_last[h].long().cpu()
        width = int((last - first).max()) if tiles else 0
        kb = first[:, None] + torch.arange(max(width, 0))[None, :]
        valid = kb < last[:, None]
        left = valid & (kb < near_lo[:, None])
        right = valid & (kb >= near_hi[:, None]) & (not layout.causal)
        nearby = valid & ~left & ~right
        k0 = layout.grid0 + kb * bn
        total = nearby * (2 * rows * cols + cols)
        lu, lns = layout.left_u[h].long().cpu(), layout.left_ns[h].long().cpu()
        total = total + left * _far_ops(lu, lns, k0, k0 + bn, layout.num_samples, rows, cols)
        if not layout.causal:
            ru, rns = layout.right_u[h].long().cpu(), layout.right_ns[h].long().cpu()
            far = _far_ops(ru, rns, 1 - k0 - bn, 1 - k0, layout.num_samples, rows, cols)
            total = total + right * (far + rows + cols)
        ops.append(int((total * calls[:, None])[valid].sum()))
        pairs.append(int(valid.sum()))
        near_pairs.append(int(nearby.sum()))
        entries.append(int((valid * calls[:, None]).sum()) * rows * cols)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return CountWork(as_t(ops), as_t(entries), as_t(pairs), as_t(near_pairs))
