"""The uniform theorem tested (positional_lsh.theory.adversarial): the bound holds for all inputs tried."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from positional_lsh import alibi_attention, dense_plsh_attention, sample_partitions
from positional_lsh.theory.adversarial import (
    adversarial_search,
    realize_row_input,
    uniform_error_bound,
    worst_row_error,
)


def _row_bound_naive(mbar, a, c, i):
    """sup over u in [e^-c, e^c]^J of sum u|M-A| / sum u A, by enumerating all vertices (tiny J)."""
    e, w = np.abs(mbar[i, : i + 1] - a[i, : i + 1]), a[i, : i + 1]
    best = 0.0
    for bits in range(2 ** (i + 1)):
        u = np.array([math.exp(c if (bits >> j) & 1 else -c) for j in range(i + 1)])
        best = max(best, float((u * e).sum() / (u * w).sum()))
    return 2 * best


def test_tight_bound_is_the_vertex_supremum_and_below_simple():
    n, c = 9, 0.7
    parts = sample_partitions(n, [0.4], 3, generator=1)
    b = uniform_error_bound(parts, 0, c)
    mbar = parts.mean_mask()[0].numpy()
    a = np.exp(-0.4 * np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]))
    for i in range(n):
        assert b.row_tight[i] == pytest.approx(_row_bound_naive(mbar, a, c, i), rel=1e-12)
        e = np.abs(mbar[i, : i + 1] - a[i, : i + 1]).sum()
        assert b.row_simple[i] == pytest.approx(2 * math.exp(2 * c) * e / a[i, : i + 1].sum())
    assert b.tight <= b.simple


@pytest.mark.parametrize("causal", [True, False])
def test_random_and_adversarial_inputs_stay_below_the_bound(causal):
    """Random inputs in the constraint set (including extreme ones): the per-row error never exceeds the bound."""
    n, d, c = 48, 8, 1.5
    scale = 1 / math.sqrt(d)
    radius = math.sqrt(c / scale)
    parts = sample_partitions(n, [0.2], 4, generator=2)
    b = uniform_error_bound(parts, 0, c, causal=causal)
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        q, k, v = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(3))
        if trial % 2:  # on the sphere: the extreme scores
            q, k = (x / x.norm(dim=-1, keepdim=True) * radius for x in (q, k))
        else:
            q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(radius) * radius for x in (q, k))
        v = v / v.norm(dim=-1, keepdim=True)
        err = (dense_plsh_attention(q, k, v, parts, causal=causal, scale=scale)
               - alibi_attention(q, k, v, parts.slopes, causal=causal, scale=scale))[0, 0].norm(dim=-1)  # fmt: skip
        assert bool((err.numpy() <= b.row_tight + 1e-12).all())


def test_row_search_is_realized_exactly():
    n, d, c = 64, 4, 1.0
    parts = sample_partitions(n, [1 / 8], 2, generator=3)
    row = 40
    err, s = worst_row_error(parts, 0, row, c, steps=60)
    scale = 1 / math.sqrt(d)
    q, k, v = realize_row_input(s, row, n, d, math.sqrt(c / scale), scale, parts, 0)
    assert float(q.norm(dim=-1).max()) <= math.sqrt(c / scale) + 1e-12
    assert float(k.norm(dim=-1).max()) <= math.sqrt(c / scale) + 1e-12 and float(v.norm(dim=-1).max()) <= 1
    out = dense_plsh_attention(q, k, v, parts, scale=scale) - alibi_attention(q, k, v, parts.slopes, scale=scale)
    assert float(out[0, 0, row].norm()) == pytest.approx(err, rel=1e-10)
    assert err <= uniform_error_bound(parts, 0, c).row_tight[row] + 1e-12


def test_adversarial_search_small():
    parts = sample_partitions(128, [1 / 16], 16, generator=4)
    res = adversarial_search(parts, score_bound=1.0, head_dim=8, rows=2, row_steps=60, pgd_steps=25)
    assert not res.violation and res.worst <= res.bound_tight <= res.bound_simple
    assert res.worst >= 3 * res.gaussian
    assert set(res.found) == {"equal keys", "aligned key", "bound vertex", "row PGD", "full PGD"}


def test_validate_adversarial_writes_table_csv_and_plot(tmp_path):
    from positional_lsh.cli.validate import ValidateConfig, run_validation

    cfg = ValidateConfig(out_dir=str(tmp_path), adversarial=True, adversarial_lengths=(64,),
                         adversarial_samples=(1, 8), adversarial_rows=1, progress=False)  # fmt: skip
    res = run_validation(cfg)
    for name in ("adversarial.md", "adversarial.csv", "adversarial.png", "config.json"):
        assert (tmp_path / name).exists()
    assert res.findings["adversarial_violations"] == 0
    text = (tmp_path / "adversarial.md").read_text()
    assert "| 64 | 8 |" in text and "No input above the bound." in text


def test_row_vertex_error_is_the_vertex_inputs_error():
    n, c = 80, 1.0
    parts = sample_partitions(n, [1 / 8], 4, generator=5)
    b = uniform_error_bound(parts, 0, c)
    mbar = parts.mean_mask()[0]
    for row in (0, 7, 40, n - 1):
        keys = row + 1
        a = torch.exp(-(row - torch.arange(keys, dtype=torch.float64)).abs() / 8)
        ratio = (mbar[row, :keys] - a).abs() / a
        s = torch.full((keys,), -c, dtype=torch.float64)
        s[torch.argsort(ratio, descending=True)[: int(b.vertex[row])]] = c
        w, wt = torch.softmax(s + torch.log(a), -1), torch.softmax(s + torch.log(mbar[row, :keys]), -1)  # ALiBi, LSH
        assert b.row_vertex_error[row] == pytest.approx(float((w - wt).abs().sum()), rel=1e-10, abs=1e-14)
    assert (b.row_vertex_error <= np.minimum(2.0, b.row_tight) + 1e-12).all()
