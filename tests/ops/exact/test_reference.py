"""The exact/windowed ALiBi op (positional_lsh.ops.exact: alibi, op, toeplitz, fused) and the dense references
(positional_lsh.ops.exact.reference)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import positional_lsh.ops.exact.alibi as alibi_module
import positional_lsh.ops.exact.toeplitz as toeplitz_module
from positional_lsh import (
    alibi_attention,
    alibi_bias,
    alibi_matrix,
    alibi_slopes,
    dense_plsh_attention,
    sample_partitions,
)

from conftest import naive_alibi


def _qkv(b, hq, hkv, lq, lk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


WINDOWS = [None, 3.0, torch.tensor([1.0, 2.5, 10.0, 0.0])]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", WINDOWS, ids=["exact", "w3", "per-head"])
@pytest.mark.parametrize("shape", [(4, 4, 33, 33), (4, 2, 33, 33), (4, 1, 5, 33)])
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_alibi_attention_matches_explicit_bias(causal, window, shape, backend, monkeypatch):
    monkeypatch.setattr(toeplitz_module, "CHUNK_ELEMENTS", 64)  # force many chunks
    hq, hkv, lq, lk = shape
    q, k, v = _qkv(2, hq, hkv, lq, lk, 8)
    # float64 slopes that are not powers of two: any float32 rounding inside would show (> 1e-9)
    slopes = alibi_slopes(hq).double() / math.sqrt(3.0)
    win = None if window is None else (torch.full((hq,), window) if isinstance(window, float) else window)
    out = alibi_attention(q, k, v, slopes, causal=causal, window=window, backend=backend)
    ref = naive_alibi(q, k, v, slopes, causal=causal, window=win)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_alibi_attention_gradcheck():
    q, k, v = _qkv(1, 2, 1, 9, 9, 3)
    assert torch.autograd.gradcheck(
        lambda a, b, c: alibi_attention(a, b, c, [0.3, 0.1], window=4.0), (q, k, v), eps=1e-6, atol=1e-7
    )


def test_zero_slopes_equal_sdpa():
    q, k, v = _qkv(2, 4, 4, 40, 40, 8)
    for causal in (True, False):
        out = alibi_attention(q, k, v, 0.0, causal=causal)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_alibi_attention_low_precision(dtype):
    q, k, v = _qkv(1, 8, 8, 128, 128, 32, seed=2)
    ref = naive_alibi(q, k, v, alibi_slopes(8), causal=True)
    out = alibi_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).norm() / ref.norm() < tol


def test_alibi_attention_long_input_runs_in_chunks():
    # 4096^2 * 8 heads would be 512 MiB of float32 scores; the chunked path stays O(n).
    q, k, v = (t.detach().float() for t in _qkv(1, 2, 2, 4096, 4096, 16, seed=1))
    out = alibi_attention(q, k, v, window=64.0)
    exact_rows = naive_alibi(q[:, :, -3:], k, v, alibi_slopes(2), causal=True, window=torch.full((2,), 64.0))
    torch.testing.assert_close(out[:, :, -3:].double(), exact_rows, rtol=0, atol=1e-5)


def test_alibi_matrix_and_bias_values():
    a = alibi_matrix(5, [0.5, 0.0])
    assert a.shape == (2, 5, 5) and a.dtype == torch.float64
    assert a[0, 1, 4].item() == pytest.approx(math.exp(-1.5))
    assert bool((a[1] == 1).all())
    b = alibi_bias(2, 4, torch.tensor([0.5]), causal=True, q_offset=2)
    assert b[0, 0].tolist() == pytest.approx([-1.0, -0.5, 0.0, -math.inf])
    assert b[0, 1].tolist() == pytest.approx([-1.5, -1.0, -0.5, 0.0])


def test_dense_oracle_with_one_block_is_softmax():
    q, k, v = _qkv(1, 2, 2, 12, 12, 4)
    parts = sample_partitions(12, [0.0, 0.0], 2, generator=0)
    torch.testing.assert_close(
        dense_plsh_attention(q, k, v, parts),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        rtol=0,
        atol=1e-12,
    )


def test_dense_references_refuse_a_non_bool_causal():
    q = torch.randn(1, 1, 6, 2)
    with pytest.raises(TypeError, match="causal must be a bool"):
        dense_plsh_attention(q, q, q, sample_partitions(6, [0.1], 1, generator=0), causal=1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        alibi_bias(2, 4, torch.tensor([0.5]), causal=None)


def test_alibi_attention_is_the_op_of_ops_alibi():
    import positional_lsh
    import positional_lsh.ops.exact.reference as reference

    assert positional_lsh.alibi_attention is alibi_module.alibi_attention
    assert not hasattr(reference, "alibi_attention")  # reference.py holds the dense references only
    from positional_lsh.ops.options import ALIBI_BACKENDS

    assert ALIBI_BACKENDS == ("auto", "flash", "math")  # what alibi_attention's backend= takes (routing.exact_kernel)


def test_dense_helpers_refuse_large_sizes():
    with pytest.raises(ValueError, match="small sizes"):
        alibi_matrix(100_000, [0.5])
    q = torch.randn(1, 1, 20000, 2)
    parts = sample_partitions(20000, [0.1], 1, generator=0)
    with pytest.raises(ValueError, match="small"):
        dense_plsh_attention(q, q, q, parts)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"window": -1.0}, ValueError, "window"),
        ({"window": [1.0, 2.0]}, ValueError, "window"),
        ({"window": "wide"}, TypeError, "window"),
        ({"slopes": [0.1] * 3}, ValueError, "slopes"),
        ({"scale": 0.0}, ValueError, "scale"),
        ({"causal": "yes"}, TypeError, "causal"),
        ({"backend": "cuda"}, ValueError, r"backend must be one of \('auto', 'flash', 'math'\)"),
        ({"backend": "triton"}, ValueError, r"exact ALiBi has no Triton path.*\('auto', 'flash', 'math'\)"),
    ],
)
def test_alibi_attention_bad_input(kwargs, exc, match):
    q = torch.randn(1, 4, 8, 4)
    with pytest.raises(exc, match=match):
        alibi_attention(q, q, q, **kwargs)


def test_alibi_attention_worker_pool_matches_sequential():
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(3, 4, 2, 200, 200, 8, seed=3))
    g = torch.randn(3, 4, 200, 8)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            out = alibi_attention(q, k, v, window=torch.tensor([5.0, 50.0, 500.0, 0.0]))
            results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alibi_attention_explicit_flash_refuses_half_types(dtype, torch_path):
    q, k, v = (t.detach().to(dtype) for t in _qkv(1, 4, 2, 16, 16, 8))
    with pytest.raises(ValueError, match=r"backend='flash'.*math"):
        alibi_attention(q, k, v, backend="flash")
    auto = alibi_attention(q, k, v)  # "auto" picks the float32-score math path (on the torch path)
    torch.testing.assert_close(auto, alibi_attention(q, k, v, backend="math"), rtol=0, atol=0)
