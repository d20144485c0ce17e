"""The estimator's one custom-op registration (ops/_engine/op.py): eager calls run ``positional_lsh::plsh_forward``
(and its backward op), its inputs are read by name, and its plan cache is keyed by values, so the backward reuses
the forward's plan and never a stale one."""

from __future__ import annotations

import torch

from positional_lsh import plsh_attention, sample_partitions
from positional_lsh.ops._engine import op

from conftest import naive_estimator, naive_mean_mask

SLOPES4 = torch.tensor([0.5, 0.1, 0.0, 0.03])


def _qkv(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))


def test_eager_calls_run_the_custom_op_and_inputs_are_named():
    q, k, v = _qkv()
    assert "plsh_forward" in plsh_attention(q, k, v, generator=0).grad_fn.name()
    names = op.FORWARD_INPUTS
    assert names[:6] == ("q", "k", "v", "pitch", "shift", "slopes") and names[-2:] == ("key_padding_mask", "expected")


def test_the_backward_reuses_the_forwards_plan(monkeypatch):
    q, k, v = _qkv()
    calls = []
    real = op.plan
    monkeypatch.setattr(op, "plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for seed in (101, 102):  # partitions not seen before: one plan per call, the backward's a hit
        parts = sample_partitions(24, SLOPES4, 3, generator=seed)
        for method in ("samples", "multiplicity"):
            calls.clear()
            plsh_attention(q, k, v, partitions=parts, method=method).sum().backward()
            assert len(calls) == 1, (seed, method)


def test_the_plan_cache_is_keyed_by_values():
    """Partitions of one shape but other values (or another length, GQA layout, method) never share a plan: every
    call equals the dense oracle."""
    for seed in range(2 * op.PLAN_CACHE_SIZE):
        n = 16 + seed % 3
        q, k, v = (x[:, :, :n] for x in _qkv(n=24, seed=seed))
        k, v = (x[:, : 2 if seed % 2 else 4] for x in (k, v))
        parts = sample_partitions(n, SLOPES4, 2, generator=seed % 4)  # each value seen several times
        out = plsh_attention(q, k, v, partitions=parts, method=("samples", "multiplicity")[seed % 2])
        ref = naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, n), causal=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_the_backward_takes_the_forwards_layout(monkeypatch):
    """Issue 31: the backward reuses the forward's kernel layout (a copy of non-contiguous inputs, the non-finite
    keys zeroed) instead of making it again; its gradients are those of the dense oracle, and the rows a NaN key
    reaches are NaN in the output as before."""
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(2, 24, 3, 4, 8, generator=g, dtype=torch.float64)  # (B, L, qkv, H, d): strided views
    fused[1, 7, 1, 2] = float("nan")  # one non-finite key of batch row 1, head 2
    fused.requires_grad_()
    q, k, v = (fused[:, :, i].transpose(1, 2) for i in range(3))
    parts = sample_partitions(24, SLOPES4, 3, generator=7)
    laid = []
    real = op.kernel_inputs
    monkeypatch.setattr(op, "kernel_inputs", lambda *a, **kw: laid.append(1) or real(*a, **kw))
    for method in ("samples", "multiplicity"):
        out = plsh_attention(q, k, v, partitions=parts, method=method)
        up = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grad = torch.autograd.grad(out.nan_to_num(), fused, up)[0]
        assert not laid  # the backward's only layout is the forward's
        clean = fused.detach().clone()
        clean[1, 7, 1, 2] = 0.0
        clean.requires_grad_()
        cq, ck, cv = (clean[:, :, i].transpose(1, 2) for i in range(3))
        ref = naive_estimator(cq, ck, cv, naive_mean_mask(parts.pitch, parts.shift, 24), causal=True)
        nan_rows = out.isnan().any(-1)
        assert bool(nan_rows[1, 2].any()) and not bool(nan_rows[0].any())
        ref = ref.masked_fill(nan_rows[..., None], 0.0)
        want = torch.autograd.grad(ref, clean, up.masked_fill(nan_rows[..., None], 0.0))[0]
        torch.testing.assert_close(out.nan_to_num(), ref, rtol=0, atol=1e-10)
        finite = grad.isfinite()
        torch.testing.assert_close(grad[finite], want[finite], rtol=0, atol=1e-10)
