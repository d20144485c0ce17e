"""The Triton kernels of the multiplicity form (ops/_engine/triton/kernels.py), run in Triton's CPU interpreter.

Sizes are tiny (the interpreter runs every block op in numpy); the block configuration is shrunk (``config_for``
replaced) so that tiles, key blocks, the near band and the far blocks on both sides all occur, and the ``dk, dv``
kernel's sub-tiles (``dkdv_m``, ``dkdv_n``) split them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from positional_lsh import dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.ops.partitions.partition import Partitions

# tests/conftest.py sets TRITON_INTERPRET=1 (before anything imports triton) on machines without CUDA: the kernels
# then run in Triton's CPU interpreter on CPU tensors. With a GPU the interpreter tests are skipped and
# test_cuda_against_the_torch_path runs the compiled kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")

from positional_lsh.ops._engine import engine, routing  # noqa: E402
from positional_lsh.ops._engine.triton import host as tm  # noqa: E402  (after the skip: it imports triton)
from positional_lsh.ops._engine.triton.plan import BlockConfig  # noqa: E402

SLOPES = torch.tensor([0.5, 0.1, 0.0, 0.03])


def _qkv(hq, hkv, lq, lk, d=16, dtype=torch.float32, seed=0, b=2):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes)


def _parts(hq, lk, t, scheme):
    return sample_partitions(lk, SLOPES[:hq] if hq <= 4 else None, t, scheme=scheme, generator=3)


def _triton(q, k, v, parts, causal=True):
    """``plsh_attention`` on the Triton kernels (the multiplicity form)."""
    return plsh_attention(q, k, v, partitions=parts, causal=causal, backend="triton", method="multiplicity")


def _triton_forward(q, k, v, parts, causal):
    """``(out, lse)`` of the Triton route of the engine, without autograd."""
    route = routing.dispatch(q, causal=causal, scale=None, backend="triton", method="multiplicity")
    assert route.multiplicity == "triton" and route.samples is None
    with torch.no_grad():
        out, lse, _ = engine.forward(routing.plan(route, parts, k.shape[1], q.shape[2], q.device), q, k, v)
    return out, lse


def _dense_lse(q, k, v, parts, causal):
    """float64 ``logsumexp_j(s + log c)`` from the materialized mean mask (``c = T * Mbar``)."""
    q, k = q.double(), k.double()
    hq, hkv, lq, lk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    c = parts.mean_mask()[:, lk - lq :, :] * parts.num_samples
    if causal:
        above = torch.arange(lk)[None, :] > torch.arange(lk - lq, lk)[:, None]
        c = c.masked_fill(above, 0.0)
    kk = k.repeat_interleave(hq // hkv, dim=1)
    s = q @ kk.transpose(-1, -2) / d**0.5 + torch.log(c)
    return torch.logsumexp(s, -1)


@pytest.fixture
def blocks(monkeypatch):
    def set_blocks(config):
        monkeypatch.setattr(tm, "config_for", lambda q: config)

    return set_blocks


SMALL = BlockConfig(16, 16, 16)
NO_NEAR = BlockConfig(16, 16, 0)  # every block but the diagonal one is far: the event counts alone
SUBTILED = BlockConfig(32, 16, 16, dkdv_m=8, dkdv_n=8)

# (scheme, causal, hq, hkv, lq, lk, T, config)
_CASES = [
    ("discrete", True, 4, 2, 77, 77, 5, SMALL),
    ("discrete", False, 2, 2, 32, 32, 1, SMALL),
    ("gamma", True, 2, 2, 61, 61, 5, NO_NEAR),
    ("gamma", False, 4, 2, 77, 77, 5, SUBTILED),
    ("discrete", True, 4, 2, 20, 77, 5, SUBTILED),  # Lq < Lk: queries aligned to the last keys (chunked prefill)
    ("discrete", False, 2, 1, 1, 50, 4, NO_NEAR),  # one query (decoding), MQA
    ("gamma", True, 2, 2, 77, 77, 1, None),  # the block table's configuration
]


@interpreter
@pytest.mark.parametrize(("scheme", "causal", "hq", "hkv", "lq", "lk", "t", "config"), _CASES)
def test_triton_matches_dense_oracle(blocks, scheme, causal, hq, hkv, lq, lk, t, config):
    if config is not None:
        blocks(config)
    q, k, v = _qkv(hq, hkv, lq, lk)
    parts = _parts(hq, lk, t, scheme)
    # Forward and lse (one launch), fp32 against float64.
    out, lse = _triton_forward(q, k, v, parts, causal)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = dense_plsh_attention(qd, kd, vd, parts, causal=causal)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), _dense_lse(q, k, v, parts, causal), rtol=1e-6, atol=1e-5)
    # Gradients (the dq and dk/dv kernels) against autograd through the float64 oracle.
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    out2 = _triton(qf, kf, vf, parts, causal=causal)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out2, (qf, kf, vf), g)
    want = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


@interpreter
@pytest.mark.parametrize(("dtype", "atol", "gatol"), [(torch.bfloat16, 3e-2, 6e-2), (torch.float16, 3e-3, 6e-3)])
def test_triton_half_precision(blocks, dtype, atol, gatol):
    blocks(SUBTILED)
    q, k, v = _qkv(4, 2, 45, 45, dtype=dtype)
    parts = _parts(4, 45, 5, "gamma")
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    out = _triton(qf, kf, vf, parts, causal=False)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = dense_plsh_attention(qd, kd, vd, parts, causal=False)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=atol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch.autograd.grad(out, (qf, kf, vf), g)
    want = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=0, atol=gatol, msg=lambda m, n=name: f"d{n}: {m}")


@interpreter
def test_plsh_attention_backend_triton(blocks):
    blocks(SMALL)
    q, k, v = _qkv(4, 2, 32, 32)
    parts = _parts(4, 32, 5, "discrete")
    out = plsh_attention(q, k, v, partitions=parts, backend="triton", method="multiplicity")
    torch.testing.assert_close(out, plsh_attention(q, k, v, partitions=parts, backend="triton"), rtol=0, atol=0)
    cpu = plsh_attention(q, k, v, partitions=parts, method="multiplicity")  # the torch path
    torch.testing.assert_close(out, cpu, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="backend='triton' computes method='multiplicity'"):
        plsh_attention(q, k, v, partitions=parts, backend="triton", method="samples")


@interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_nan_keys_reach_the_same_rows_as_the_torch_path(blocks, causal):
    blocks(NO_NEAR)
    q, k, v = _qkv(2, 2, 40, 40, seed=4)
    k = k.clone()
    k[1, 0, 17, 3] = float("nan")
    parts = _parts(2, 40, 3, "discrete")
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, backend="triton", method="multiplicity")
    ref = plsh_attention(q, k, v, partitions=parts, causal=causal, method="samples")  # the torch path's rule
    assert bool(ref.isnan().any()) and not bool(ref.isnan().all())
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=0, atol=1e-5)


@interpreter
@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("causal", [True, False])
def test_huge_pitches_are_one_block(blocks, scheme, causal):
    """Issue 27, item 9: slopes <= 1e-19 (pitches ~1e19 and beyond 2**63) give exact attention in one block, as
    the torch routes do; so does a hand-made gamma pitch of 1e300 (shift 0 or huge), whatever the shift's size."""
    blocks(SMALL)
    q, k, v = _qkv(2, 2, 40, 40)
    exact = plsh_attention(q, k, v, slopes=0.0, causal=causal, num_samples=1, generator=0)
    parts = sample_partitions(40, torch.tensor([1e-19, 1e-25], dtype=torch.float64), 4, scheme=scheme, generator=1)
    assert bool((parts.pitch > 2.0**62).any())
    out = _triton(q, k, v, parts, causal)
    torch.testing.assert_close(out, exact, rtol=0, atol=2e-6)
    torch.testing.assert_close(plsh_attention(q, k, v, partitions=parts, causal=causal), exact, rtol=0, atol=2e-6)
    for shift in (0.0, 1e299):
        pitch = torch.full((3, 2), 1e300, dtype=torch.float64)
        huge = Partitions(40, torch.zeros(2), pitch, torch.full((3, 2), shift, dtype=torch.float64), "gamma")
        torch.testing.assert_close(_triton(q, k, v, huge, causal), exact, rtol=0, atol=2e-6)
    # A shift of 5.5: blocks [0, 6) and [6, 40), as on the torch path.
    cut = Partitions(40, torch.zeros(2), pitch, torch.full((3, 2), 5.5, dtype=torch.float64), "gamma")
    ref = plsh_attention(q, k, v, partitions=cut, causal=causal, method="multiplicity")
    torch.testing.assert_close(_triton(q, k, v, cut, causal), ref, rtol=0, atol=2e-6)


@interpreter
def test_numpy_ints_in_partitions(blocks):
    """Issue 27, item 21: a numpy int64 seq_len in a Partitions crashed the Triton launch (interpreter TypeError)."""
    import numpy as np

    blocks(SMALL)
    q, k, v = _qkv(2, 2, 24, 24)
    drawn = _parts(2, 24, 3, "discrete")
    parts = Partitions(np.int64(24), drawn.slopes, drawn.pitch, drawn.shift, "discrete")
    assert type(parts.seq_len) is int  # what the kernels' launch and block_bounds take
    torch.testing.assert_close(_triton(q, k, v, parts), _triton(q, k, v, drawn), rtol=0, atol=0)


@interpreter
def test_triton_refusals(monkeypatch):
    q, k, v = _qkv(2, 2, 8, 8)
    parts = _parts(2, 8, 2, "discrete")
    with pytest.raises(ValueError, match="float64"):
        _triton(q.double(), k.double(), v.double(), parts)
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        _triton(*_qkv(2, 2, 8, 8, d=264), parts)
    with pytest.raises(ValueError, match="partitions were drawn for 2 heads"):
        _triton(*_qkv(4, 2, 8, 8), parts)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        plsh_attention(q, k, v, partitions=parts, backend="triton", method="multiplicity")
    monkeypatch.setattr(tm, "triton", None)  # as if triton were not installed
    with pytest.raises(ImportError, match="optional dependency triton"):
        plsh_attention(q, k, v, partitions=parts, backend="triton", method="multiplicity")


def test_package_imports_without_triton():
    """With triton unimportable the package imports, the default path works and backend="triton" says why not."""
    code = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch
import positional_lsh
from positional_lsh import plsh_attention
from positional_lsh.ops._engine.triton import host as triton_multiplicity
assert not triton_multiplicity.triton_available()
q = torch.randn(1, 2, 8, 16)
plsh_attention(q, q, q, num_samples=2, method="multiplicity")
try:
    plsh_attention(q, q, q, num_samples=2, backend="triton", method="multiplicity")
except ImportError as e:
    assert "optional dependency triton" in str(e), e
else:
    raise AssertionError("no error")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (compiled Triton kernels)")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_against_the_torch_path(causal):
    # The compiled kernels on a GPU against the torch tiles in float64 on the same device, GQA, n = 1000, T = 16.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 8, 1000, 64), (2, 4, 1000, 64), (2, 4, 1000, 64)))
    parts = sample_partitions(1000, [2.0**-i for i in range(1, 9)], 16, generator=1)
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = plsh_attention(qc, kc, vc, partitions=parts, causal=causal, backend="triton", method="multiplicity")
    qd, kd, vd = (x.cuda().double().requires_grad_() for x in (q, k, v))
    ref = plsh_attention(qd, kd, vd, partitions=parts, causal=causal, backend="math", method="multiplicity")
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    gout = torch.randn(out.shape, generator=g).cuda()
    for a, b in zip(
        torch.autograd.grad(out, (qc, kc, vc), gout), torch.autograd.grad(ref, (qd, kd, vd), gout.double()), strict=True
    ):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-4)
