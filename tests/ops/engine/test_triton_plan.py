"""The host side of the Triton kernels (ops/_engine/triton/plan.py) against dense float64 counts; torch only, no triton.

``c[i, j] = T * Mbar[i, j]`` (0 above the diagonal when causal) is materialized from ``Partitions.mean_mask`` and
every piece of the layout is checked against it: the near table, the event form of the far blocks (from the events as
stored, sorted and split), the event counts at the key-block boundaries, and that the key blocks a tile visits (and
the tiles a key block is visited by) cover every pair with ``c > 0``.
"""

from __future__ import annotations

import pytest
import torch

from positional_lsh import sample_partitions
from positional_lsh.ops._engine.triton.plan import (
    BLOCK_TABLE,
    BlockConfig,
    block_config,
    build_layout,
    head_bounds,
    near_dtype,
)
from positional_lsh.ops.partitions.bounds import block_bounds

SLOPES = torch.tensor([0.5, 0.1, 0.0, 0.03, 0.2])


def _dense_counts(parts, q_len, causal):
    """``(H, Lq, Lk)`` float64 counts ``c`` for queries aligned to the last keys."""
    n = parts.seq_len
    c = parts.mean_mask()[:, n - q_len :, :] * parts.num_samples
    if causal:
        above = torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None]
        c = c.masked_fill(above, 0.0)
    return c.round()


# (scheme, causal, heads, Lq, Lk, T, config)
_CASES = [
    ("discrete", True, 5, 70, 70, 6, BlockConfig(16, 16, 16)),
    ("gamma", False, 5, 70, 70, 6, BlockConfig(16, 16, 16)),
    ("gamma", True, 4, 23, 61, 5, BlockConfig(16, 8, 8)),
    ("discrete", False, 4, 33, 61, 7, BlockConfig(32, 16, 0)),
    ("discrete", True, 3, 1, 40, 3, BlockConfig(16, 16, 32)),
    ("gamma", False, 2, 50, 50, 300, BlockConfig(16, 16, 16)),  # T > 255: int16 near table
]


@pytest.mark.parametrize(("scheme", "causal", "heads", "lq", "lk", "t", "cfg"), _CASES)
def test_plan_against_dense_counts(scheme, causal, heads, lq, lk, t, cfg):
    parts = sample_partitions(lk, SLOPES[:heads], t, scheme=scheme, generator=5)
    layout = build_layout(parts, lq, causal, cfg, torch.device("cpu"))
    dense = _dense_counts(parts, lq, causal)
    bm, bn, near = cfg.block_m, cfg.block_n, cfg.near
    assert layout.near.dtype == near_dtype(t) and layout.near.shape == (heads, lq, cfg.width(causal))
    assert -bn < layout.grid0 <= 0 and (lk - lq - layout.grid0) % bn == 0
    for h in range(heads):
        covered = torch.zeros(lq, lk, dtype=torch.bool)
        for m in range(layout.num_tiles):
            rows = torch.arange(m * bm, min((m + 1) * bm, lq))
            pos = rows + (lk - lq)
            i0 = int(pos[0])
            tb0 = (i0 - layout.grid0) // bn
            # Near table: column o is key i0 - near + o.
            keys = i0 - near + torch.arange(layout.width)
            ok = (keys >= 0) & (keys < lk)
            want = torch.zeros(len(rows), layout.width, dtype=torch.float64)
            want[:, ok] = dense[h][rows][:, keys[ok]]
            torch.testing.assert_close(layout.near[h, rows].double(), want.double(), rtol=0, atol=0)
            # Events: stable first, each part sorted by u; stable means v above every row (left) / -row (right).
            sides = [(layout.left_u, layout.left_v, layout.left_ns, layout.left_cuts, pos, 1)]
            if not causal:
                sides.append((layout.right_u, layout.right_v, layout.right_ns, layout.right_cuts, -pos, -1))
            for u_all, v_all, ns_all, cuts, rcoord, sign in sides:
                u, v, ns = u_all[h, m].long(), v_all[h, m].long(), int(ns_all[h, m])
                assert torch.all(v[:ns] > rcoord.max()) and torch.all(v[ns:] <= rcoord.max())
                assert torch.equal(u[:ns], u[:ns].sort().values) and torch.equal(u[ns:], u[ns:].sort().values)
                base = int(layout.cut_base[h, m])
                for k in range(int(layout.tile_first[h, m]), int(layout.tile_last[h, m]) + 1):
                    key = layout.grid0 + k * bn if sign == 1 else 1 - (layout.grid0 + k * bn)
                    s_cut, b_cut = (int(x) for x in cuts[2 * (base + k) : 2 * (base + k) + 2])
                    assert s_cut == int((u[:ns] < key).sum()) and b_cut == ns + int((u[ns:] < key).sum())
            # Far blocks: c[i, j] = #{t : u_t <= col, v_t > row} with (col, row) = (j, i) left, (-j, -i) right.
            for kb in range(int(layout.tile_first[h, m]), int(layout.tile_last[h, m])):
                cols = layout.grid0 + kb * bn + torch.arange(bn)
                inside = (cols >= 0) & (cols < lk)
                covered[rows[:, None], cols[inside][None, :]] = True
                left = kb < tb0 - near // bn
                right = not causal and kb >= tb0 + (bm + near) // bn
                if not (left or right):
                    continue
                u, v = (layout.left_u, layout.left_v) if left else (layout.right_u, layout.right_v)
                u, v = u[h, m].long(), v[h, m].long()
                cc, rr = (cols, pos) if left else (-cols, -pos)
                got = ((u[None, None, :] <= cc[None, :, None]) & (v[None, None, :] > rr[:, None, None])).sum(-1)
                want = torch.zeros(len(rows), bn, dtype=torch.float64)
                want[:, inside] = dense[h][rows][:, cols[inside]]
                torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=0)
        # Coverage: the visited pairs hold every c > 0; the dk/dv kernel's tile ranges are the same pairs.
        assert not torch.any((dense[h] > 0) & ~covered)
        first, last = layout.tile_first[h].long(), layout.tile_last[h].long()
        for kb in range(layout.num_kb):
            visits = torch.nonzero((first <= kb) & (kb < last)).flatten().tolist()
            lo, hi = int(layout.kb_first[h, kb]), int(layout.kb_last[h, kb])
            assert visits == list(range(lo, hi)) or (not visits and lo >= hi)


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "fixed"])
def test_head_bounds_equal_block_bounds(scheme):
    parts = sample_partitions(300, SLOPES, 9, scheme=scheme, generator=2)
    pos = torch.arange(300)
    for h in range(parts.num_heads):
        got = head_bounds(parts.pitch[:, h], parts.shift[:, h], 300, pos)
        want = block_bounds(parts.pitch[:, h, None], parts.shift[:, h, None], 300, pos.expand(9, -1))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_block_config_and_table():
    assert block_config(torch.bfloat16, 128, 90) == BLOCK_TABLE[(90, "bfloat16", 128)]
    assert block_config(torch.float16, 100, 86) == BLOCK_TABLE[(80, "float16", 128)]  # sm_86 uses sm_80's row
    assert block_config(torch.float32, 64) == BLOCK_TABLE[(90, "float32", 64)]  # no GPU: sm_90's
    with pytest.raises(ValueError, match="no Triton block configuration"):
        block_config(torch.float64, 64, 90)
    with pytest.raises(ValueError, match="multiples of block_n"):
        BlockConfig(64, 32, 48)
    with pytest.raises(ValueError, match="power of two"):
        BlockConfig(48, 16, 16)
    with pytest.raises(ValueError, match="dkdv_m and dkdv_n"):
        BlockConfig(64, 32, 32, dkdv_m=128)
    for cfg in BLOCK_TABLE.values():
        assert cfg.block_m % cfg.sub_m == 0 and cfg.block_n % cfg.sub_n == 0
