"""positional_lsh.ops.partitions.counts.block_counts: the counts of a span of keys, against the definition in Python
loops, and against the blocks of real partitions (labels)."""

from __future__ import annotations

import torch

from positional_lsh import sample_partitions
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.counts import block_counts


def test_counts_equal_the_definition():
    g = torch.Generator().manual_seed(0)
    rows, t, width = 5, 4, 12
    start = torch.randint(-3, 14, (rows, t), generator=g)
    end = start + torch.randint(0, 9, (rows, t), generator=g)
    first = torch.randint(-2, 4, (rows,), generator=g)
    weight = torch.randint(1, 4, (rows, t), generator=g, dtype=torch.int32)
    want = torch.zeros(rows, width, dtype=torch.int32)
    want_w = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        for x in range(width):
            key = int(first[r]) + x
            inside = [(int(start[r, u]) <= key < int(end[r, u])) for u in range(t)]
            want[r, x] = sum(inside)
            want_w[r, x] = sum(int(weight[r, u]) for u in range(t) if inside[u])
    assert torch.equal(block_counts(start, end, first, width), want)
    events, out = torch.full((rows, width + 1), 7, dtype=torch.int32), torch.empty(rows, width, dtype=torch.int32)
    got = block_counts(start, end, first, width, weight, events=events, out=out)
    assert torch.equal(got, want_w) and got.data_ptr() == out.data_ptr()
    # An int first key: the same base for every row.
    fixed = torch.tensor([[sum(int(start[r, u]) <= 3 + x < int(end[r, u]) for u in range(t)) for x in range(width)]
                          for r in range(rows)], dtype=torch.int32)  # fmt: skip
    assert torch.equal(block_counts(start, end, 3, width), fixed)

def test_counts_of_partitions_equal_shared_labels():
    n = 30
    parts = sample_partitions(n, torch.tensor([0.4, 0.1]), 5, scheme="gamma", generator=2)
    labels = parts.labels()  # (T, H, n)
    pos = torch.arange(n)
    start, end = block_bounds(parts.pitch[..., None], parts.shift[..., None], n, pos)  # (T, H, n)
    c = block_counts(start.permute(1, 2, 0), end.permute(1, 2, 0), 0, n)  # (H, n, n)
    same = (labels[:, :, :, None] == labels[:, :, None, :]).sum(0)  # (H, n, n)
    assert torch.equal(c, same.to(torch.int32))
