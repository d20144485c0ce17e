"""The slope gradient inside the Triton backward (``TRITON.backward(..., dist_grad=True)``), in Triton's interpreter.

``dist[h] = sum over batch, i, j of dS_hat[b, h, i, j] |i - j|`` (the estimator's own score gradient; the surrogate
gradient of a slope is ``-dist``) against the dense float64 surrogate reference of the contract: autograd through
``softmax(s + log Mbar - (m - m.detach())[h] |i - j|) v`` with the same partitions (value: the estimator; gradient
in ``m``: the surrogate). Tiny sizes: the interpreter runs every block op in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

from positional_lsh import plsh_attention, sample_partitions

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")

from positional_lsh.ops._engine.backend import Saved  # noqa: E402
from positional_lsh.ops._engine.triton import host as tm  # noqa: E402  (after the skip: it imports triton)
from positional_lsh.ops._engine.triton.plan import BlockConfig  # noqa: E402

SLOPES = torch.tensor([0.5, 0.1, 0.0, 0.03])
SMALL = BlockConfig(16, 16, 16)
NO_NEAR = BlockConfig(16, 16, 0)  # only the diagonal block is near: the far event counts on both sides
SUBTILED = BlockConfig(32, 16, 16, dkdv_m=8, dkdv_n=8)


def _inputs(hq, hkv, lq, lk, t, scheme, dtype, d=16, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d), (b, hq, lq, d))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)
    parts = sample_partitions(lk, SLOPES[:hq], t, scheme=scheme, generator=3)
    return q, k, v, dout, parts


def _dense_surrogate(q, k, v, dout, parts, causal, scale):
    """``sum dS_hat |i - j|`` per query head, float64, by autograd through the dense estimator with the slope term."""
    hq, hkv, lq, lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    pos = torch.arange(lk - lq, lk)  # queries are the last Lq of the Lk positions
    dist = (pos[:, None] - torch.arange(lk)[None, :]).abs().double()
    mbar = parts.mean_mask()[:, lk - lq :, :].double()
    if causal:
        mbar = mbar.masked_fill(torch.arange(lk)[None, :] > pos[:, None], 0.0)
    m = torch.zeros(hq, dtype=torch.float64, requires_grad=True)
    s = q @ k.transpose(-1, -2) * scale + torch.log(mbar) - (m - m.detach())[:, None, None] * dist
    out = torch.softmax(s, -1) @ v
    out.backward(dout.double())
    return -m.grad, out.detach()


def _triton(q, k, v, dout, parts, causal, scale, config, dist_grad):
    tm_config = tm.config_for
    tm.config_for = lambda x: config
    try:
        plan = tm.TRITON.plan(parts, k.shape[1], q.shape[2], causal, q.device)
        out, lse = tm.TRITON.forward(plan, q, k, v, scale)
        return out, tm.TRITON.backward(plan, Saved(q, k, v, out, lse), dout, scale, dist_grad)
    finally:
        tm.config_for = tm_config


# (scheme, causal, hq, hkv, lq, lk, T, config, dtype, compare): compare: also run the plain backward (batch 1;
# batch 2 otherwise: dist sums over it)
_CASES = [
    ("discrete", True, 4, 2, 33, 33, 5, SMALL, torch.float32, True),
    ("gamma", False, 4, 2, 33, 33, 5, SUBTILED, torch.float32, False),
    ("discrete", True, 4, 2, 20, 61, 4, NO_NEAR, torch.float32, False),  # Lq < Lk: the queries are the last 20
    ("gamma", False, 2, 1, 9, 50, 3, NO_NEAR, torch.float32, False),  # Lq < Lk bidirectional, MQA
    ("discrete", False, 2, 2, 1, 40, 4, SMALL, torch.float32, False),  # one query (decoding)
    ("gamma", True, 2, 1, 33, 33, 5, SUBTILED, torch.bfloat16, True),
    ("discrete", False, 2, 2, 33, 33, 5, SMALL, torch.bfloat16, False),
]


@pytest.mark.parametrize(("scheme", "causal", "hq", "hkv", "lq", "lk", "t", "config", "dtype", "compare"), _CASES)
def test_dist_grad_matches_the_dense_surrogate(scheme, causal, hq, hkv, lq, lk, t, config, dtype, compare):
    q, k, v, dout, parts = _inputs(hq, hkv, lq, lk, t, scheme, dtype, b=1 if compare else 2)
    scale = q.shape[-1] ** -0.5
    want, ref_out = _dense_surrogate(q, k, v, dout, parts, causal, scale)
    out, (dq, dk, dv, dist) = _triton(q, k, v, dout, parts, causal, scale, config, dist_grad=True)
    assert dist is not None and dist.shape == (hq,) and dist.dtype == torch.float32
    if dtype == torch.float32:  # float32 accumulation of up to ~1e3 terms of size up to Lk
        torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(dist.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    else:  # the saved bf16 output enters delta = rowsum(dout * out): bf16 rounding (2^-8) of the weights
        torch.testing.assert_close(dist.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    if compare:  # the switch changes nothing else: the same dq, dk, dv bit for bit, and no dist
        _, (dq0, dk0, dv0, none) = _triton(q, k, v, dout, parts, causal, scale, config, dist_grad=False)
        assert none is None
        for a, b in ((dq, dq0), (dk, dk0), (dv, dv0)):
            assert a.dtype == dtype and torch.equal(a, b)


def test_dist_grad_of_the_block_table_configuration():
    # The dispatch's own configuration (the block table's, one tile for this size): the plain config_for.
    q, k, v, dout, parts = _inputs(2, 2, 30, 30, 4, "gamma", torch.float32)
    scale = 0.3
    want, _ = _dense_surrogate(q, k, v, dout, parts, True, scale)
    plan = tm.TRITON.plan(parts, k.shape[1], 30, True, q.device)
    out, lse = tm.TRITON.forward(plan, q, k, v, scale)
    *_, dist = tm.TRITON.backward(plan, Saved(q, k, v, out, lse), dout, scale, True)
    torch.testing.assert_close(dist.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_plsh_attention_gives_the_slopes_the_kernels_dist(monkeypatch):
    # End to end: plsh_attention(backend="triton", slopes=<requires grad>) -> engine -> TRITON.backward(dist_grad).
    monkeypatch.setattr(tm, "config_for", lambda x: SMALL)
    q, k, v, dout, parts = _inputs(4, 2, 20, 40, 4, "discrete", torch.float32)
    want, _ = _dense_surrogate(q, k, v, dout, parts, True, q.shape[-1] ** -0.5)
    slopes = SLOPES.clone().requires_grad_()
    out = plsh_attention(q, k, v, slopes=slopes, partitions=parts, backend="triton", method="multiplicity")
    out.backward(dout)
    assert slopes.grad.dtype == torch.float32
    torch.testing.assert_close(slopes.grad.double(), -want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
