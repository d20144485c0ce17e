"""The exact ops' ``"fused"`` route (``ops.exact.fused.exact_route``): which calls take it (at which sizes and with
which windows), and that it equals the float64 oracles, forward and gradients (``q, k, v`` and the slope / decay
parameters), with one and with many query chunks, causal and bidirectional, GQA/MQA, ``Lq < Lk``, key padding and
worker threads."""

from __future__ import annotations

import math

import pytest
import torch

import positional_lsh.ops.exact.fused as fused_module
import positional_lsh.ops.exact.op as op_module
from positional_lsh import alibi_attention, alibi_bias, alibi_slopes, decay_attention
from positional_lsh.ops.exact.fused import EXACT_ROUTES, FUSED_ROWS, exact_route
from positional_lsh.ops.exact.reference import alibi_attention_reference
from positional_lsh.ops.partitions.decays import decay_attention_reference

from conftest import naive_alibi

F64 = torch.float64
CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread", "torch_path")  # the routes of torch's kernels


def _qkv(b, hq, hkv, lq, lk, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


def _up(out, seed=1):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)


@pytest.fixture
def routes(monkeypatch):
    """The routes every exact call took, in order (``exact_route`` spied on)."""
    seen: list[str] = []
    real = op_module.exact_route
    monkeypatch.setattr(op_module, "exact_route", lambda *a: seen.append(real(*a)) or seen[-1])
    return seen


@pytest.fixture(params=["dense-bias", "reversed-one-chunk", "reversed-many-chunks"])
def fused_rows(request, monkeypatch):
    """The fused route's layouts: keys in order with a dense bias (what decoding and short chunks get), or keys
    reversed with the strided line, in one chunk (the default rows per call) or in 3-row chunks (a short last one)."""
    monkeypatch.setattr(fused_module, "FUSED_DENSE_RATIO", 10**9 if request.param == "dense-bias" else 0)
    if request.param == "reversed-many-chunks":
        monkeypatch.setattr(fused_module, "FUSED_ROWS", 3)


def test_route_choice_by_size_window_kernel_and_device():
    assert EXACT_ROUTES == ("fused", "banks") and FUSED_ROWS == 128
    for n in (1, 2, 512, 4096, 32768, 2**20):  # no window: fused at every length (the bias is O(n), no bound)
        assert exact_route(None, n, "flash", CPU) == "fused"
    w3 = torch.full((4,), 3.0, dtype=F64)
    assert [exact_route(w3, n, "flash", CPU) for n in (1, 3, 4, 5, 4096)] == ["fused"] * 3 + ["banks"] * 2
    per_head = torch.tensor([math.inf, 100.0, 7.0, math.inf], dtype=F64)  # the smallest window decides
    assert [exact_route(per_head, n, "flash", CPU) for n in (8, 9, 4096)] == ["fused", "banks", "banks"]
    assert exact_route(torch.full((2,), math.inf, dtype=F64), 4096, "flash", CPU) == "fused"
    assert exact_route(None, 512, "math", CPU) == "banks"  # the math kernel (half types, backend="math")
    assert exact_route(None, 512, "flash", torch.device("meta")) == "banks"  # CUDA's flash op takes no mask


def test_calls_take_the_route_of_their_inputs(routes):
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 9, 9, 4))
    alibi_attention(q, k, v)
    alibi_attention(q, k, v, window=8.0)  # keeps every key of 9: fused
    alibi_attention(q, k, v, window=3.0)
    alibi_attention(q, k, v, backend="math")
    alibi_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())  # auto: the math kernel for half types
    decay_attention(q, k, v, "power", [0.5, 1.0])
    decay_attention(q, k, v, "truncated-linear", [4.0])  # its support is a window
    assert routes == ["fused", "fused", "banks", "banks", "banks", "fused", "banks"]


# (hq, hkv, lq, lk, causal): MHA, GQA, MQA, queries the last keys (chunked prefill, decoding)
SHAPES = [
    (2, 2, 11, 11, True),
    (2, 2, 11, 11, False),
    (4, 2, 7, 13, True),
    (4, 1, 5, 12, False),
    (4, 2, 1, 9, True),
]
SHAPE_IDS = ["causal", "bidirectional", "gqa-lq<lk", "mqa-bidi-lq<lk", "decode"]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fused_route_equals_the_float64_oracle(shape, fused_rows, routes):
    hq, hkv, lq, lk, causal = shape
    q, k, v = _qkv(2, hq, hkv, lq, lk, 8, seed=3)
    m = (alibi_slopes(hq).double() / math.sqrt(3.0)).requires_grad_()  # not powers of two
    out = alibi_attention(q, k, v, m, causal=causal)
    assert set(routes) == {"fused"}
    torch.testing.assert_close(out, naive_alibi(q, k, v, m.detach(), causal=causal), rtol=0, atol=1e-12)
    ref = alibi_attention_reference(q, k, v, m, causal=causal)  # dense autograd through the explicit bias
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    up = _up(out)
    got = torch.autograd.grad(out, (q, k, v, m), up)
    want = torch.autograd.grad(ref, (q, k, v, m), up)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert got[3].abs().max() > 1e-3
    # and the q, k, v gradients of the Python-loop oracle itself
    naive = torch.autograd.grad(naive_alibi(q, k, v, m.detach(), causal=causal), (q, k, v), up)
    for a, b in zip(got[:3], naive, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family, params", [("power", [[0.5, 1.0], [2.0, 0.3]]), ("exponential", [[0.3], [0.0]])])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_route_decay_families_equal_their_oracle(family, params, causal, fused_rows, routes):
    q, k, v = _qkv(2, 2, 1, 8, 10, 4, seed=5)
    theta = torch.tensor(params, dtype=F64, requires_grad=True)
    out = decay_attention(q, k, v, family, theta, causal=causal)
    assert set(routes) == {"fused"}
    ref = decay_attention_reference(q, k, v, family, theta, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    up = _up(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v, theta), up), torch.autograd.grad(ref, (q, k, v, theta), up), strict=True
    ):
        torch.testing.assert_close(a, b.reshape(a.shape), rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.usefixtures("fused_rows")
def test_fused_and_banks_routes_agree(causal, monkeypatch):
    q, k, v = _qkv(2, 4, 2, 10, 10, 8, seed=7)
    m = torch.tensor([0.37, 0.11, 0.0, 0.73], dtype=F64, requires_grad=True)
    results = []
    for route in EXACT_ROUTES:
        monkeypatch.setattr(op_module, "exact_route", lambda *a, route=route: route)
        out = alibi_attention(q, k, v, m, causal=causal)
        results.append((out, *torch.autograd.grad(out, (q, k, v, m), _up(out))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("fused_rows")
def test_fused_route_with_key_padding_and_non_finite_keys(routes):
    q, k, v = _qkv(2, 2, 2, 9, 9, 4, seed=9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False  # left padding in row 0
    m = torch.tensor([0.4, 0.1], dtype=F64)
    out = alibi_attention(q, k, v, m, key_padding_mask=mask)
    assert set(routes) == {"fused"}
    sub = naive_alibi(q[:1, :, 3:], k[:1, :, 3:], v[:1, :, 3:], m, causal=True)
    torch.testing.assert_close(out[:1, :, 3:], sub, rtol=0, atol=1e-12)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    torch.testing.assert_close(out[1:], naive_alibi(q[1:], k[1:], v[1:], m, causal=True), rtol=0, atol=1e-12)
    bad = k.detach().clone()
    bad[1, 0, 4, 0] = math.nan  # head 0's rows 4.. of batch row 1 keep key 4 (causal); no other row does
    nan = torch.isnan(alibi_attention(q.detach(), bad, v.detach(), m))
    want = torch.zeros_like(nan)
    want[1, 0, 4:] = True
    assert torch.equal(nan, want)


@pytest.mark.usefixtures("fused_rows")
def test_fused_route_with_worker_threads_matches_one_thread():
    q, k, v = (t.detach().float() for t in _qkv(3, 4, 2, 40, 40, 8, seed=11))
    up = torch.randn(3, 4, 40, 8, generator=torch.Generator().manual_seed(0))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            out = alibi_attention(qg, kg, vg)
            results.append((out, *torch.autograd.grad(out, (qg, kg, vg), up)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_key_order_by_query_rows(monkeypatch):
    """Decoding and short chunks keep the keys in order (dense bias); long prefills reverse them (strided line)."""
    keys = []
    real = fused_module.attend
    monkeypatch.setattr(fused_module, "attend", lambda q, k, *a, **kw: keys.append(k) or real(q, k, *a, **kw))
    g = torch.Generator().manual_seed(0)
    for lq in (1, 15, 16, 300):  # Hq = 4, Hkv = 2, d = 16: keys in order while 4 Lq < 2 * 2 * 16
        q = torch.randn(1, 4, lq, 16, generator=g)
        k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(2))
        keys.clear()
        torch.testing.assert_close(alibi_attention(q, k, v), naive_alibi(q, k, v, alibi_slopes(4), causal=True).float(),
                                   rtol=0, atol=2e-6)  # fmt: skip
        in_order = torch.equal(keys[0][..., 0, :], k[..., 0, :])  # the first key a call sees: key 0, or its last
        assert in_order == (lq < 16) and len(keys) == (1 if lq < 16 else -(-lq // FUSED_ROWS))


def test_float32_fused_route_is_torch_sdpa_with_the_float_mask():
    """At a size with several chunks, in float32: torch's fused SDPA with the prebuilt (1, H, n, n) ALiBi mask."""
    q, k, v = (x.detach().float() for x in _qkv(2, 4, 4, 300, 300, 16, seed=13))
    bias = alibi_bias(300, 300, alibi_slopes(4), causal=True)[None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(alibi_attention(q, k, v), want, rtol=0, atol=2e-6)
