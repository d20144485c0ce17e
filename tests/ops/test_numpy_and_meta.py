"""Round four of the reliability probes (issue 34), the op layer's inputs: numpy slope arrays at every entry point
that takes slopes (item 16; before, ``plsh_attention``, ``alibi_attention`` and ``sample_partitions`` refused them
while ``Partitions`` took them), and ``decay_attention`` with meta tensors and meta parameters (item 15; before,
``NotImplementedError: Cannot copy out of meta tensor``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from positional_lsh import PositionalLSHAttention, alibi_attention, decay_attention, plsh_attention, sample_partitions
from positional_lsh.ops.partitions.decays import decay_attention_reference

SLOPES = [0.5, 0.25, 0.0, 0.03]
N = 24


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, N, 8, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize(
    "array",
    [np.array(SLOPES), np.array(SLOPES, dtype=np.float32), np.array([1, 0, 2, 1]), np.array(0.25)],
    ids=["float64", "float32", "int", "0-d"],
)
def test_numpy_slopes_equal_the_same_call_with_a_tensor(array):
    tensor = torch.from_numpy(array)
    q, k, v = _qkv()
    a, b = sample_partitions(N, array, 3, num_heads=4, generator=1), sample_partitions(N, tensor, 3, num_heads=4,
                                                                                      generator=1)  # fmt: skip
    assert torch.equal(a.pitch, b.pitch) and torch.equal(a.shift, b.shift) and torch.equal(a.slopes, b.slopes)
    assert torch.equal(plsh_attention(q, k, v, array, generator=2), plsh_attention(q, k, v, tensor, generator=2))
    assert torch.equal(plsh_attention(q, k, v, array, partitions=b), plsh_attention(q, k, v, partitions=b))
    assert torch.equal(alibi_attention(q, k, v, array), alibi_attention(q, k, v, tensor))
    windowed = alibi_attention(q, k, v, array, window=array * 8)
    assert torch.equal(windowed, alibi_attention(q, k, v, tensor, window=tensor * 8))
    mod, twin = PositionalLSHAttention(4, array, num_samples=2), PositionalLSHAttention(4, tensor, num_samples=2)
    assert torch.equal(mod.eval()(q, k, v), twin.eval()(q, k, v))


def test_numpy_slopes_under_torch_compile():
    """The coercion reads no numpy attribute a trace cannot (``torch.compile`` traces an array as a tensor)."""
    torch._dynamo.reset()
    array = np.array(SLOPES)
    q, k, v = _qkv()
    plsh = torch.compile(lambda q, k, v: plsh_attention(q, k, v, array, generator=2), fullgraph=True, backend="eager")
    alibi = torch.compile(lambda q, k, v: alibi_attention(q, k, v, array), fullgraph=True, backend="eager")
    tensor = torch.from_numpy(array)
    torch.testing.assert_close(plsh(q, k, v), plsh_attention(q, k, v, tensor, generator=2), rtol=0, atol=1e-12)
    torch.testing.assert_close(alibi(q, k, v), alibi_attention(q, k, v, tensor), rtol=0, atol=1e-12)
    torch._dynamo.reset()


def test_bad_numpy_slopes_are_refused_naming_the_argument():
    q, k, v = _qkv()
    for bad, error, match in [
        (np.array([True, False, True, True]), TypeError, "slopes must be a real array, got numpy dtype bool"),
        (np.array([1j] * 4), TypeError, "slopes must be a real array, got numpy dtype complex128"),
        (np.array(["a"] * 4), TypeError, "slopes must be a real array"),
        (np.ones((2, 2)), ValueError, "slopes must be a 1-D tensor"),
        (np.array([0.5, -1.0, 0.0, 0.0]), ValueError, "slopes must be >= 0"),
        (np.array([np.nan] * 4), ValueError, "slopes must be finite"),
        (np.array([0.5] * 3), ValueError, "one entry per head|num_heads=4 but slopes has 3 entries"),
    ]:
        with pytest.raises(error, match=match):
            plsh_attention(q, k, v, bad)
        with pytest.raises(error, match=match):
            alibi_attention(q, k, v, bad)
        with pytest.raises(error, match=match):
            sample_partitions(N, bad, 2, num_heads=4)


@pytest.mark.parametrize("family, params", [("power", [[0.5, 1.0]] * 4), ("exponential", [0.3]),
                                            ("truncated-linear", [[6.0]] * 4)])  # fmt: skip
@pytest.mark.parametrize("grad", [True, False])
def test_decay_attention_on_meta_parameters_propagates_shapes(family, params, grad):
    q = torch.randn(2, 4, N, 8, device="meta", requires_grad=True)
    kv = torch.randn(2, 2, N, 8, device="meta")
    theta = torch.tensor(params, device="meta", requires_grad=grad)
    mask = torch.ones(2, N, dtype=torch.bool, device="meta")
    out = decay_attention(q, kv, kv, family, theta, key_padding_mask=mask)
    assert out.shape == q.shape and out.device.type == "meta" and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    if grad:
        assert theta.grad is not None and theta.grad.shape == theta.shape
    # The same call on real tensors: the values are those of the dense reference (the meta call changes nothing).
    qr, kr, vr = _qkv(1)
    real = torch.tensor(params, dtype=torch.float64)
    torch.testing.assert_close(decay_attention(qr, kr, vr, family, real),
                               decay_attention_reference(qr, kr, vr, family, real), rtol=0, atol=1e-10)  # fmt: skip


def test_decay_attention_meta_parameters_are_checked():
    q = torch.randn(1, 4, N, 8, device="meta")
    with pytest.raises(ValueError, match=r"params of the power decay .* must have shape \(4, 2\)"):
        decay_attention(q, q, q, "power", torch.rand(3, 2, device="meta"))
    with pytest.raises(TypeError, match="params must be a real floating-point tensor"):
        decay_attention(q, q, q, "power", torch.ones(4, 2, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="family"):
        decay_attention(q, q, q, "nope", torch.rand(4, 2, device="meta"))
    x = torch.randn(1, 4, N, 8)
    with pytest.raises(ValueError, match="params is a meta tensor"):
        decay_attention(x, x, x, "power", torch.rand(4, 2, device="meta"))
