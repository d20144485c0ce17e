"""Round three of the reliability probes (issue 27), the op layer: labels of extreme pitches, copies of the
caller's tensors, ints normalized, up-front size checks of a draw and of method="auto", meta slopes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from positional_lsh import alibi_attention, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.ops._engine import cost, routing
from positional_lsh.ops.attention import check_call_size
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import Partitions, check_draw_size


def _bounds_from_labels(lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[start, end)`` block of every position, read off the labels (positions sharing a label)."""
    n = lab.shape[-1]
    pos = torch.arange(n)
    same = lab[..., :, None] == lab[..., None, :]
    lo = torch.where(same, pos, n).amin(-1)
    hi = torch.where(same, pos, -1).amax(-1) + 1
    return lo, hi


@pytest.mark.parametrize("scheme", ["gamma", "discrete", "gamma-strat"])
@pytest.mark.parametrize("slope", [1e300, 1e18, 3.0, 1.0, 0.05, 1e-300, 0.0])
def test_labels_agree_with_block_bounds(scheme, slope):
    """Item 10: tiny pitches (huge slopes) gave labels [0, -2**63, ...]; now every position is its own block."""
    n = 48
    parts = sample_partitions(n, torch.tensor([slope, 0.5], dtype=torch.float64), 6, scheme=scheme, generator=0)
    lab = parts.labels()
    lo, hi = block_bounds(parts.pitch[..., None], parts.shift[..., None], n, torch.arange(n))
    lo2, hi2 = _bounds_from_labels(lab)
    assert torch.equal(lo, lo2) and torch.equal(hi, hi2)
    if slope >= 1e18:
        assert all(torch.unique(lab[t, 0]).numel() == n for t in range(6))
        eye = torch.eye(n, dtype=torch.float64)
        torch.testing.assert_close(parts.mean_mask()[0], eye, rtol=0, atol=0)


def test_labels_of_tiny_hand_made_pitches():
    pitch = torch.tensor([[1e-300, 0.5, 1.0, 2.5, float("inf")]], dtype=torch.float64)
    shift = torch.tensor([[5e-301, 0.25, 0.0, 1.0, 0.0]], dtype=torch.float64)
    parts = Partitions(10, torch.zeros(5), pitch, shift, "gamma")
    lab = parts.labels()[0]
    for h in range(3):
        assert torch.unique(lab[h]).numel() == 10
    assert lab[4].eq(0).all()
    lo, hi = block_bounds(pitch[..., None], shift[..., None], 10, torch.arange(10))
    lo2, hi2 = _bounds_from_labels(parts.labels())
    assert torch.equal(lo, lo2) and torch.equal(hi, hi2)


def test_partitions_copy_the_callers_tensors():
    """Item 11: mutating the tensors a Partitions was made from changes nothing (they were validated once)."""
    pitch = torch.full((4, 2), 3.0, dtype=torch.float64)
    shift = torch.zeros(4, 2, dtype=torch.float64)
    slopes = torch.tensor([0.3, 0.1], dtype=torch.float64)
    parts = Partitions(12, slopes, pitch, shift, "discrete")
    q = torch.randn(1, 2, 12, 8, generator=torch.Generator().manual_seed(0))
    before = plsh_attention(q, q, q, partitions=parts)
    pitch.fill_(-3.0)
    shift.fill_(0.5)
    slopes.fill_(7.0)
    assert parts.pitch.eq(3.0).all() and parts.shift.eq(0.0).all() and parts.slopes.tolist() == [0.3, 0.1]
    assert torch.equal(plsh_attention(q, q, q, partitions=parts), before)
    drawn = sample_partitions(12, slopes=[0.3, 0.1], num_samples=4, generator=0)
    again = Partitions(12, drawn.slopes, drawn.pitch, drawn.shift, "discrete")
    assert again.pitch.data_ptr() != drawn.pitch.data_ptr()


def test_partitions_ints_become_python_ints():
    """Item 21: a numpy int64 seq_len reached the Triton launch; the ints are Python ints, bools refused."""
    parts = sample_partitions(np.int64(16), alibi_slopes(2), np.int64(3), generator=0, max_block=np.int64(8))
    assert type(parts.seq_len) is int and type(parts.max_block) is int and parts.num_samples == 3
    made = Partitions(np.int64(16), parts.slopes, parts.pitch, parts.shift, "discrete", max_block=np.int32(8))
    assert type(made.seq_len) is int and type(made.max_block) is int
    assert type(made.with_seq_len(np.int64(20)).seq_len) is int
    with pytest.raises(TypeError, match="seq_len must be an int"):
        Partitions(True, parts.slopes, parts.pitch, parts.shift, "discrete")
    with pytest.raises(TypeError, match="num_samples must be an int"):
        sample_partitions(16, alibi_slopes(2), True)


def test_draw_refused_up_front():
    """Item 18: num_samples=10**9 ran 8 s into a MemoryError; now refused at once with the estimate."""
    with pytest.raises(UserError, match=r"sample_partitions with num_samples=1000000000 and 4 heads .*(memory|take)"):
        sample_partitions(64, alibi_slopes(4), 10**9)
    with pytest.raises(UserError, match="num_samples=10000000000"):
        check_draw_size(10**10, 1)
    check_draw_size(10**6, 8)  # 8e6 entries: fine
    assert sample_partitions(64, alibi_slopes(4), 1000, generator=0).num_samples == 1000


@pytest.mark.parametrize("grad", [True, False])
def test_meta_slopes_propagate_shapes(grad):
    """Item 20: meta slopes (learnable or not) with meta q, k, v give the output's shape, as meta q, k, v do."""
    q = torch.randn(2, 4, 8, 16, device="meta", requires_grad=True)
    slopes = torch.rand(4, device="meta", requires_grad=grad)
    for op in (alibi_attention, plsh_attention):
        out = op(q, q, q, slopes=slopes)
        assert out.shape == q.shape and out.device.type == "meta" and out.dtype == q.dtype
        out.sum().backward()
        if grad:
            assert slopes.grad is not None and slopes.grad.shape == slopes.shape
            slopes.grad = None
    with pytest.raises(ValueError, match="slopes must be a 1-D tensor of shape \\(4,\\)"):
        plsh_attention(q, q, q, slopes=torch.rand(3, device="meta", requires_grad=True))
    with pytest.raises(ValueError, match="slopes must be a 1-D tensor of shape \\(4,\\)"):
        alibi_attention(q, q, q, slopes=torch.rand(3, device="meta", requires_grad=True))
    x = torch.randn(1, 4, 8, 16)
    for op in (alibi_attention, plsh_attention):
        with pytest.raises(ValueError, match="slopes is a meta tensor"):
            op(x, x, x, slopes=torch.rand(4, device="meta", requires_grad=grad))


def test_auto_is_not_refused_where_multiplicity_is_quick():
    """Item 24: n = 16, T = 3,000,000 was refused as ~85 s (the per-sample plan) for method="auto"; the
    multiplicity form runs it, so auto takes it without planning the per-sample path."""
    check_call_size(3_000_000, 1, 16, 16, 8, True, "auto")
    assert cost.AutoEstimate.of(3_000_000, 1, 16).up_front
    assert not cost.AutoEstimate.of(64, 8, 4096).up_front  # ordinary calls: decided from the plans, as before
    assert not cost.AutoEstimate.of(1, 8, 16).up_front
    with pytest.raises(UserError, match="method='samples'"):
        check_call_size(3_000_000, 1, 16, 16, 8, True, "samples")


def test_auto_skips_the_per_sample_plan(monkeypatch):
    """Where planning the per-sample path alone is over the bound, decide() never builds it."""
    monkeypatch.setattr(cost, "AUTO_PLAN_SECONDS", 1e-9)

    def no_plan(*args, **kwargs):
        raise AssertionError("the per-sample plan was built")

    monkeypatch.setattr(routing, "samples_plan", no_plan)
    q = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    parts = sample_partitions(16, alibi_slopes(2), 64, generator=0)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="auto")
    assert routing.plan(route, parts, 2, 16, q.device).method == "multiplicity"
    out = plsh_attention(q, q, q, partitions=parts)
    ref = plsh_attention(q, q, q, partitions=parts, method="multiplicity")
    assert torch.equal(out, ref)
