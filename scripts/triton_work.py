"""The work model of the Triton kernels' count at the issue-17 target: integer ops per computed score entry.

    python scripts/triton_work.py                       # n = 32768, H = 32 standard slopes, T = 8, 64, 256
    python scripts/triton_work.py --lengths 4096 --samples 64 --arch 80

For each (arch's block configuration for bf16, d = 128; causal / bidirectional; T) it builds the kernels' layout on the
CPU (``positional_lsh.ops._engine.triton.plan.build_layout``, scheme ``discrete``, seed 0) and prints
:func:`count_work`: integer operations per computed score entry over all heads (total / total) for the forward (= the
``dq`` kernel) and the ``dk, dv`` kernel, the per-head mean and maximum, the share of near (table) pairs and the
layout's bytes. The kernels before issue 17 spent ``2T`` per entry (128 at T = 64). Developer tooling, not used at run
time (not in the wheel).

**The model.** Every (query tile, key block) pair a kernel visits (:mod:`positional_lsh.ops._engine.triton.plan`)
computes its counts with ``block_count`` (:mod:`positional_lsh.ops._engine.triton.kernels`): the forward and the
``dq`` kernel once per pair on the whole ``BLOCK_M x BLOCK_N`` tile, the ``dk, dv`` kernel on its ``dkdv_m x dkdv_n``
sub-tiles. :func:`count_work` gives, for a layout and a kernel, the elementwise integer operations (adds, compares,
selects, pointer adds; on vectors and tiles, not on scalars; int casts excluded) that ``block_count`` executes — the
same totals an instrumented run of the kernels in Triton's interpreter counts (``tests/ops/engine/test_triton_work.py``
checks that equality) — and the score entries computed. Per call over ``R x C`` entries:

* near (a table load): a pointer add and ``c > 0`` per entry, and one add per key;
* far: per entry the final add and ``c > 0``, plus one select per *breaking* event inside the block; per row two
  ops per breaking event before or inside the block; per key one op, plus two per stable event inside the block
  and one per breaking event inside it. The right side (bidirectional) negates the row and key coordinates first
  (one op per row and per key). Which events lie below a block's ends is read from the layout (``*_cuts``).

No term is ``O(T)`` per entry: ``T`` enters only through the breaking events inside a far block (one select per
entry each; the near table holds the keys where they crowd) and the events before it (per row).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from positional_lsh import alibi_slopes, sample_partitions
from positional_lsh.ops._engine.triton.plan import TritonLayout, block_config, build_layout

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    ap.add_argument("--lengths", type=ints, default=(32768,))
    ap.add_argument("--samples", type=ints, default=(8, 64, 256))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--arch", type=ints, default=(90, 80))
    ap.add_argument("--bidirectional", action="store_true", help="also the bidirectional kernels")
    args = ap.parse_args(argv)
    print("| arch | config (m x n, near) | causal | n | T | fwd ops/entry | dkdv ops/entry | per-head mean | "
          "per-head max | near pairs | layout MiB |")  # fmt: skip
    print("|" + " --- |" * 11)
    for arch in args.arch:
        cfg = block_config(torch.bfloat16, 128, arch)
        for causal in (True, False) if args.bidirectional else (True,):
            for n in args.lengths:
                for t in args.samples:
                    parts = sample_partitions(n, alibi_slopes(args.heads), t, generator=0)
                    layout = build_layout(parts, n, causal, cfg, torch.device("cpu"))
                    fwd, dkdv = count_work(layout, "fwd"), count_work(layout, "dkdv")
                    head = fwd.per_entry_by_head
                    near = float(fwd.near_pairs.sum()) / float(fwd.pairs.sum())
                    tile = f"{cfg.block_m} x {cfg.block_n}, {cfg.near}"
                    print(f"| sm_{arch} | {tile} | {'yes' if causal else 'no'} | {n} | {t} | {fwd.per_entry:.2f} "
                          f"| {dkdv.per_entry:.2f} | {float(head.mean()):.2f} | {float(head.max()):.2f} | {near:.2f} "
                          f"| {layout.nbytes() / 2**20:.0f} |", flush=True)  # fmt: skip
                    del layout, parts


if __name__ == "__main__":
    main()
