"""``torch.compile(dynamic=True, fullgraph=True)`` of the ops over several lengths (issue 34, item 1): one graph
for every length (no recompile as the length changes), the same outputs and gradients as eager mode, and the float64
oracles. Before, the scale check read a symbolic float (``math.isfinite``) and the trace failed with ``Unsupported:
torch.* op returned non-Tensor``. The backend is ``aot_eager`` (the custom ops' backward is traced too); inductor was
checked by hand (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from positional_lsh import (
    PositionalLSHAttention,
    alibi_attention,
    alibi_slopes,
    decay_attention,
    plsh_attention,
    sample_partitions,
)
from positional_lsh.ops.partitions.decays import decay_attention_reference

from conftest import naive_alibi, naive_estimator, naive_mean_mask

F64 = torch.float64
LENGTHS = (17, 30, 45)
PAD = 4  # batch row 1 is left-padded by this many keys
SCALE = 0.3


@pytest.fixture(autouse=True)
def _dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(n: int, *, hq: int = 4, hkv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(n)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).requires_grad_()
        for shape in ((2, hq, n, d), (2, hkv, n, d), (2, hkv, n, d))
    )


def _mask(n: int) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :PAD] = False
    return mask


def _by_row(q, k, v, row_fn):
    """Row 0 on every key, row 1 on its keys ``PAD..n`` (positions counted from there; padded query rows zero)."""
    out = torch.zeros(q.shape, dtype=F64)
    out[0] = row_fn(q[:1], k[:1], v[:1])[0]
    out[1, :, PAD:] = row_fn(q[1:, :, PAD:], k[1:, :, PAD:], v[1:, :, PAD:])[0]
    return out


def _grads(out, inputs):
    up = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad(out, inputs, up)


def _check(fn, compiled, oracle, inputs, counter, frames):
    """Compiled equals eager (outputs and gradients) and the oracle; no frame compiled after the first length."""
    out, eager = compiled(*inputs), fn(*inputs)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-12)
    for a, b in zip(_grads(out, tensors), _grads(eager, tensors), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, oracle, rtol=0, atol=1e-10)
    frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled as the length changed: {frames}"


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_plsh_attention_one_graph_for_every_length(method):
    """Drawn from an int seed inside the graph, with a scale and a padding mask: the failing call of the issue."""

    def fn(q, k, v, mask, scale):
        return plsh_attention(q, k, v, num_samples=3, generator=11, scale=scale, method=method, key_padding_mask=mask)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
    frames: list[int] = []
    for n in LENGTHS:
        q, k, v = _qkv(n)
        parts = sample_partitions(n, alibi_slopes(4), 3, generator=11)  # the draw of generator=11

        def row(q, k, v, parts=parts):
            mbar = naive_mean_mask(parts.pitch, parts.shift, k.shape[2])
            return naive_estimator(q, k, v, mbar, causal=True, scale=SCALE)

        _check(fn, compiled, _by_row(q, k, v, row), (q, k, v, _mask(n), SCALE), counter, frames)


def test_plsh_attention_with_partitions_one_graph_for_every_length():
    def fn(q, k, v, parts, scale):
        return plsh_attention(q, k, v, partitions=parts, scale=scale)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
    frames: list[int] = []
    for n in LENGTHS:
        q, k, v = _qkv(n)
        parts = sample_partitions(n, alibi_slopes(4), 4, generator=n)
        oracle = naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, n), causal=True, scale=SCALE)
        _check(fn, compiled, oracle, (q, k, v, parts, SCALE), counter, frames)


def test_exact_ops_one_graph_for_every_length():
    slopes = torch.tensor([0.5, 0.1, 0.0, 0.03], dtype=F64, requires_grad=True)
    theta = torch.tensor([0.5, 1.0], dtype=F64, requires_grad=True)  # the power decay's (r1, r2), every head

    def alibi(q, k, v, mask, scale):
        return alibi_attention(q, k, v, slopes, scale=scale, key_padding_mask=mask)

    def decay(q, k, v, mask, scale):
        return decay_attention(q, k, v, "power", theta, scale=scale, key_padding_mask=mask)

    for fn in (alibi, decay):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
        frames: list[int] = []
        for n in LENGTHS:
            q, k, v = _qkv(n)
            if fn is alibi:
                row = lambda a, b, c: naive_alibi(a, b, c, slopes.detach(), causal=True, scale=SCALE)  # noqa: E731
            else:
                row = lambda a, b, c: decay_attention_reference(a, b, c, "power", theta, scale=SCALE)  # noqa: E731
            oracle = _by_row(q, k, v, row)
            _check(fn, compiled, oracle, (q, k, v, _mask(n), SCALE), counter, frames)


def test_module_training_one_graph_for_every_length():
    """Fresh partitions at every training call (the step is a tensor read inside the sampling op), the same ones as
    an eager module of the same seed; a module scale (a float attribute, symbolic under ``dynamic=True``)."""
    mod = PositionalLSHAttention(4, num_samples=2, seed=5, scale=SCALE)
    eager = PositionalLSHAttention(4, num_samples=2, seed=5, scale=SCALE)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mod, dynamic=True, fullgraph=True, backend=counter)
    frames: list[int] = []
    for n in LENGTHS:
        q, k, v = _qkv(n)
        out, ref = compiled(q, k, v), eager(q, k, v)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        frames.append(counter.frame_count)
    assert int(mod.calls) == int(eager.calls) == len(LENGTHS)
    assert frames[-1] == frames[0], f"recompiled as the length changed: {frames}"


def test_a_bad_scale_is_refused_under_dynamic_shapes():
    fn = torch.compile(lambda q, k, v, s: plsh_attention(q, k, v, generator=0, scale=s), dynamic=True, fullgraph=True,
                       backend="eager")  # fmt: skip
    q = torch.randn(1, 2, 8, 4)
    assert fn(q, q, q, 0.5).shape == q.shape
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(Exception, match="scale must be a positive finite float"):
            fn(q, q, q, bad)
