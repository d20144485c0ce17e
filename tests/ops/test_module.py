"""PositionalLSHAttention as the language model uses it: ``persistent=False``, per-call ``slopes=`` kept by an owner,
and context parallelism as the ``context=`` argument (the :class:`ShardedAttention` protocol).

The expected partitions are computed here from the seed formula (``layer_seed``), not by the module, and every output
is compared with :func:`plsh_attention` on those partitions and with the float64 dense estimator of conftest.
"""

from __future__ import annotations

import pytest
import torch

from positional_lsh import PositionalLSHAttention, plsh_attention, sample_partitions
from positional_lsh.ops.module import log_slopes_parameter

from conftest import naive_estimator, naive_mean_mask

SLOPES4 = torch.tensor([0.5, 0.1, 0.2, 0.03], dtype=torch.float64)
N = 40


def formula(seed: int, key: int) -> int:
    return (seed * 1_000_003 + key * 7_919 + 1) % 2**62


def qkv(n: int = N, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for _ in range(3))


def test_not_persistent_keeps_only_parameters_in_the_state_dict() -> None:
    fixed = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=5, persistent=False)
    assert fixed.state_dict() == {}
    learned = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=5, learn_slopes=True, persistent=False)
    assert list(learned.state_dict()) == ["log_slopes"]
    assert set(PositionalLSHAttention(4, SLOPES4, learn_slopes=True).state_dict()) == {
        "calls", "_extra_state", "log_slopes"
    }  # fmt: skip
    fixed.load_state_dict({}, strict=True)  # nothing missing
    # The module behaves as a persistent one: the same draws, the same step.
    twin = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=5)
    q, k, v = qkv()
    for c in range(2):
        out = fixed(q, k, v)
        assert torch.equal(out, twin(q, k, v))
        parts = sample_partitions(N, SLOPES4, 3, generator=formula(5, c))
        torch.testing.assert_close(out, plsh_attention(q, k, v, partitions=parts), rtol=0, atol=0)
    assert int(fixed.calls) == 2
    with pytest.raises(TypeError, match="persistent must be a bool"):
        PositionalLSHAttention(4, persistent=1)


def test_slopes_of_an_owner_drive_the_draw_and_get_the_gradient() -> None:
    # An owner keeps learned slopes (as the language model does) and passes them per call: the result and the
    # gradient are those of a module that learns the same slopes itself.
    mine = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=2)
    own = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=2, learn_slopes=True)
    log_m = log_slopes_parameter(SLOPES4)
    assert log_m.dtype == torch.float32 and torch.equal(log_m, own.log_slopes)
    with torch.no_grad():
        log_m.add_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
        own.log_slopes.copy_(log_m)
    q, k, v = (t.float() for t in qkv())
    m = log_m.exp()
    out = mine(q, k, v, m)
    torch.testing.assert_close(out, own(q, k, v), rtol=0, atol=0)
    parts = sample_partitions(N, m.detach(), 3, generator=formula(2, 0))
    torch.testing.assert_close(parts.slopes, mine.sample(N, m).slopes)
    dense = naive_estimator(q.double(), k.double(), v.double(), naive_mean_mask(parts.pitch, parts.shift, N),
                            causal=True)  # fmt: skip
    torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref = log_m.detach().clone().requires_grad_()
    plsh_attention(q, k, v, ref.exp(), partitions=parts).sum().backward()
    torch.testing.assert_close(log_m.grad, ref.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="slopes= is for a module without learn_slopes"):
        own(q, k, v, m)
    with pytest.raises(TypeError, match="slopes must be a"):
        mine(q, k, v, [0.5, 0.1, 0.2, 0.03])
    with pytest.raises(ValueError, match="slope of 0 cannot be"):
        log_slopes_parameter(torch.tensor([0.5, 0.0]))


class Recording:
    """A ShardedAttention that says the whole sequence is ``factor`` times this rank's shard and records each call."""

    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.calls: list[dict] = []

    def seq_len(self, local_len: int) -> int:
        return self.factor * local_len

    def attend(self, q, k, v, call):
        self.calls.append(call)
        return torch.zeros_like(q)


def test_context_draws_the_whole_sequence_and_passes_the_options() -> None:
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=7, scale=0.25, backend="math", method="samples")
    q, k, v = qkv(10)
    ctx = Recording(4)
    for c in range(2):
        mod(q, k, v, context=ctx)
        got = ctx.calls[-1]
        assert (got.causal, got.scale, got.backend, got.method) == (True, 0.25, "math", "samples")
        want = sample_partitions(40, SLOPES4, 3, generator=formula(7, c))
        assert got.partitions.seq_len == 40
        assert torch.equal(got.partitions.pitch, want.pitch) and torch.equal(got.partitions.shift, want.shift)
    assert int(mod.calls) == 2
    with pytest.raises(TypeError, match="context must be a ShardedAttention"):
        mod(q, k, v, context=object())
    learned = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=7, learn_slopes=True)
    with pytest.raises(ValueError, match="slopes that require grad with context="):
        learned(q, k, v, context=ctx)


def test_context_shards_of_one_process_is_the_plain_call() -> None:
    from positional_lsh.distributed import ContextShards

    mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=1).eval()
    q, k, v = qkv()
    for shards in (ContextShards(None, shard_lengths=[N]), ContextShards()):  # no process group: plsh_attention
        torch.testing.assert_close(mod(q, k, v, context=shards), mod(q, k, v), rtol=0, atol=0)


def test_key_padding_mask_is_passed_to_the_op() -> None:
    """Issue 34 item 5: the module takes plsh_attention's ``key_padding_mask`` (before, a TypeError): the result and
    gradients of the functional form on the same partitions, and of the float64 oracle on each row's valid run
    (positions counted from its first valid key; padded query rows zero)."""
    runs = [(5, N), (0, 31)]  # left padding, right padding
    mask = torch.zeros(2, N, dtype=torch.bool)
    for row, (first, end) in enumerate(runs):
        mask[row, first:end] = True
    for training in (False, True):
        mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=4, eval_seed=9).train(training)
        q, k, v = (x.requires_grad_() for x in qkv(seed=3))
        parts = sample_partitions(N, SLOPES4, 3, generator=formula(4, 0) if training else 9)
        out = mod(q, k, v, key_padding_mask=mask)
        ref = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        oracle = torch.zeros(q.shape, dtype=torch.float64)
        for row, (first, end) in enumerate(runs):
            mbar = naive_mean_mask(parts.pitch, parts.shift, end - first)
            sl = slice(first, end)
            oracle[row, :, sl] = naive_estimator(q[row : row + 1, :, sl], k[row : row + 1, :, sl],
                                                 v[row : row + 1, :, sl], mbar, causal=True)[0]  # fmt: skip
        torch.testing.assert_close(out, oracle, rtol=0, atol=1e-12)
        up = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), up), torch.autograd.grad(oracle, (q, k, v), up),
                        strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # Refused, naming the argument, before the training step advances; not with context= (no mask there).
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=4)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        mod(q, k, v, key_padding_mask=mask[:, :-1])
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        mod(q, k, v, key_padding_mask=mask.long())
    assert int(mod.calls) == 0
    with pytest.raises(ValueError, match="key_padding_mask with context="):
        mod(q, k, v, key_padding_mask=mask, context=Recording(1))


def test_holes_and_cu_seqlens_are_passed_to_the_op() -> None:
    """Issue 34 items 24 and 25: the module takes a mask with holes and ``cu_seqlens`` (the functional form on the same
    partitions, which tests/ops/test_masks.py compares with the float64 oracle); bad ``cu_seqlens`` is refused before
    the training step advances, and with ``context=``."""
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, 7:10], mask[1, :3], mask[1, 20] = False, False, False
    cu = torch.tensor([0, 12, N])
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, seed=4, eval_seed=9).eval()
    q, k, v = qkv(seed=5)
    parts = sample_partitions(N, SLOPES4, 3, generator=9)
    want = plsh_attention(q, k, v, partitions=parts, key_padding_mask=mask, cu_seqlens=cu)
    assert torch.equal(mod(q, k, v, key_padding_mask=mask, cu_seqlens=cu), want)
    mod.train()
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        mod(q, k, v, cu_seqlens=torch.tensor([0, 12, N - 1]))
    assert int(mod.calls) == 0
    with pytest.raises(ValueError, match="cu_seqlens with context="):
        mod(q, k, v, cu_seqlens=cu, context=Recording(1))

