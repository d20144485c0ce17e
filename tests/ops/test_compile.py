"""``torch.compile(fullgraph=True)`` of :class:`PositionalLSHAttention` and :func:`plsh_attention` (CPU): the custom
ops of ``positional_lsh.ops._engine.op`` against eager mode and the dense oracle, and ``torch.library.opcheck``."""

from __future__ import annotations

import pytest
import torch

from positional_lsh import PositionalLSHAttention, dense_plsh_attention, plsh_attention, sample_partitions

SLOPES4 = torch.tensor([0.5, 0.1, 0.0, 0.03])
N = 96


@pytest.fixture(scope="module", autouse=True)
def _dynamo():
    """A fresh dynamo cache for this file, with room for its recompiles (one per module setting and dtype)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        yield
    torch._dynamo.reset()


def _qkv(b=2, hq=4, hkv=2, lq=N, lk=N, d=16, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _grads(out, inputs):
    return torch.autograd.grad(out, inputs, torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
@pytest.mark.parametrize("causal", [True, False])
def test_compiled_module_eval_equals_eager(method, causal):
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=3, causal=causal, method=method, eval_seed=7).eval()
    compiled = torch.compile(mod, fullgraph=True)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        q, k, v = _qkv(dtype=dtype)
        torch.testing.assert_close(compiled(q, k, v), mod(q, k, v), rtol=0, atol=atol)
    # Gradients through the backward op, for the same (eval-mode) partitions as eager mode.
    q, k, v = _qkv(grad=True)
    got, want = _grads(compiled(q, k, v), (q, k, v)), _grads(mod(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@torch.compile(fullgraph=True)
def _plsh_fn(q, k, v, parts, method, causal):
    return plsh_attention(q, k, v, partitions=parts, method=method, causal=causal)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_compiled_function_forward_backward_equals_dense_oracle(method):
    for causal, lq in ((True, N), (False, N), (True, 40)):  # 40: queries are the last 40 of 96 keys
        q, k, v = _qkv(lq=lq, grad=True)
        parts = sample_partitions(N, SLOPES4, 4, generator=3)
        out, ref = _plsh_fn(q, k, v, parts, method, causal), dense_plsh_attention(q, k, v, parts, causal=causal)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
        for g, w in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v)), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_compiled_function_samples_from_an_int_seed_like_eager():
    q, k, v = _qkv(grad=True)
    fn = torch.compile(lambda q, k, v: plsh_attention(q, k, v, num_samples=3, generator=11), fullgraph=True)
    out, ref = fn(q, k, v), plsh_attention(q, k, v, num_samples=3, generator=11)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_compiled_function_refuses_what_it_cannot_trace():
    # With fullgraph=True dynamo reports the ValueError as an "Observed exception" carrying its message.
    errors = (ValueError, torch._dynamo.exc.Unsupported)
    q, k, v = _qkv(b=1, lq=16, lk=16)
    untraced = torch.compile(lambda q, k, v: plsh_attention(q, k, v, num_samples=2), fullgraph=True)
    with pytest.raises(errors, match="needs partitions= or an int seed as generator="):
        untraced(q, k, v)
    parts = sample_partitions(16, SLOPES4, 2, generator=0)
    as_list = SLOPES4.tolist()
    with_list = torch.compile(lambda q, k, v: plsh_attention(q, k, v, as_list, partitions=parts), fullgraph=True)
    with pytest.raises(errors, match="slopes= with partitions= must be a tensor"):
        with_list(q, k, v)
    # A slopes tensor is compared with the partitions' inside the compiled op, on the data.
    with_tensor = torch.compile(lambda q, k, v, m: plsh_attention(q, k, v, m, partitions=parts), fullgraph=True)
    torch.testing.assert_close(with_tensor(q, k, v, SLOPES4), plsh_attention(q, k, v, partitions=parts), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"slopes differ from partitions\.slopes"):
        with_tensor(q, k, v, SLOPES4 * 2)


def test_compiled_training_draws_fresh_reproducible_partitions():
    q, k, v = _qkv(dtype=torch.float32)

    def run(seed):
        mod = PositionalLSHAttention(4, SLOPES4, num_samples=2, seed=seed)
        compiled = torch.compile(mod, fullgraph=True)
        outs = [compiled(q, k, v) for _ in range(3)]
        assert int(mod.calls) == 3
        return outs

    first, again, other = run(5), run(5), run(6)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    # One sampling policy: eager training calls draw the same partitions for the same steps, and call c is the
    # draw from layer_seed(seed, c) (computed here from the formula, not from the module).
    eager = PositionalLSHAttention(4, SLOPES4, num_samples=2, seed=5)
    for c, a in enumerate(first):
        torch.testing.assert_close(eager(q, k, v), a, rtol=0, atol=1e-6)
        parts = sample_partitions(N, SLOPES4, 2, generator=(5 * 1_000_003 + c * 7_919 + 1) % 2**62)
        torch.testing.assert_close(a, plsh_attention(q, k, v, partitions=parts), rtol=0, atol=1e-6)
    # seed=None: the draw is from torch's global RNG inside the op, exactly as eager training draws.
    mod = PositionalLSHAttention(4, SLOPES4, num_samples=2)
    torch.manual_seed(123)
    eager = mod(q, k, v)
    torch.manual_seed(123)
    assert torch.equal(torch.compile(mod, fullgraph=True)(q, k, v), eager)


def test_opcheck_custom_ops():
    from positional_lsh.ops._engine.op import plsh_backward, plsh_forward
    from positional_lsh.ops.partitions.sampling import sample_op

    q, k, v = _qkv(b=1, lq=12, lk=12, d=8, grad=True)
    parts = sample_partitions(12, SLOPES4, 2, generator=0)
    tensors = (parts.pitch, parts.shift, parts.slopes)
    for method in ("samples", "multiplicity"):
        route = (method, "flash" if method == "samples" else "", "flash" if method == "multiplicity" else "")
        args = (q, k, v, *tensors, parts.scheme, None, True, 0.3, *route)
        torch.library.opcheck(plsh_forward, args)
        out, lse = plsh_forward(*(x.detach() if isinstance(x, torch.Tensor) else x for x in args))
        dout = torch.randn_like(out)
        back = (dout, q.detach(), k.detach(), v.detach(), out, lse, *tensors, parts.scheme, None, True, 0.3)
        torch.library.opcheck(plsh_backward, (*back, *route))
    torch.library.opcheck(sample_op, (torch.tensor(3), 5, parts.slopes, 2, "discrete"))
    torch.library.opcheck(sample_op, (None, 5, parts.slopes, 2, "gamma"))
