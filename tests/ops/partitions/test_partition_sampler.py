"""The one partition-sampling policy (``positional_lsh.ops.partitions.sampling``): what each mode draws, and bad
input."""

from __future__ import annotations

import pytest
import torch

from positional_lsh import PartitionSampler, alibi_slopes, sample_partitions
from positional_lsh.ops.partitions.sampling import layer_seed


def _formula(seed: int, key: int) -> int:
    return (seed * 1_000_003 + key * 7_919 + 1) % 2**62  # written out here, independent of the library


def _same(a, b) -> bool:
    return torch.equal(a.pitch, b.pitch) and torch.equal(a.shift, b.shift) and a.seq_len == b.seq_len


def test_layer_seed_is_the_documented_formula():
    for seed, key in ((0, 0), (5, 3), (2**61, 7), (123456789, 10**6)):
        assert layer_seed(seed, key) == _formula(seed, key)


def test_eval_and_training_draws():
    s = PartitionSampler(4, num_samples=3, scheme="gamma", seed=11, eval_seed=2)
    slopes = alibi_slopes(4)
    want = sample_partitions(50, slopes, 3, scheme="gamma", generator=2)
    assert _same(s.draw(50), want) and _same(s.draw(50), want)  # eval: the same at every call
    assert _same(s.draw(7), want.with_seq_len(7))  # ... and every length
    for step in (0, 1, 5):
        drawn = s.draw(50, training=True, step=step)
        assert _same(drawn, sample_partitions(50, slopes, 3, scheme="gamma", generator=_formula(11, step)))
        assert _same(s.draw(50, training=True, step=torch.tensor(step)), drawn)  # a tensor step: the same draw
    assert not _same(s.draw(50, training=True, step=0), s.draw(50, training=True, step=1))


def test_seed_none_trains_from_the_global_rng():
    s = PartitionSampler(2, [0.1, 0.2], num_samples=2)
    torch.manual_seed(3)
    a = s.draw(20, training=True)
    torch.manual_seed(3)
    assert _same(s.draw(20, training=True), a)
    assert not _same(s.draw(20, training=True), a)  # the global stream moved on: fresh partitions


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_heads": 0}, ValueError, "num_heads"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"scheme": "nope"}, ValueError, "scheme"),
        ({"scheme": 3}, TypeError, "scheme"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"eval_seed": None}, TypeError, "eval_seed"),
        ({"slopes": [0.1]}, ValueError, "slopes"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"num_heads": 2, **kwargs}
    with pytest.raises(error, match=match):
        PartitionSampler(**args)


def test_bad_draw_arguments():
    s = PartitionSampler(2, seed=0)
    with pytest.raises(ValueError, match="step"):
        s.draw(10, training=True, step=-1)
    with pytest.raises(ValueError, match="seq_len"):
        s.draw(0)
