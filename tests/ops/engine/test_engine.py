"""The engine (ops/_engine/routing.py, ops/_engine/engine.py): the table of backends, the decision of what runs a
call, and every backend through the one interface (ops/_engine/backend.py) against float64 dense references.

* the table: every (method, kernel) row gives the backend computing that method with that kernel; other pairs are
  refused;
* the decision: ``dispatch`` (from the arguments) and ``decide`` (from the partitions) for backend × method ×
  device × dtype, CUDA calls checked without a GPU (a stand-in ``q`` for ``dispatch``, torch's device capability
  replaced, ``routing.triton_device`` replaced end to end), the refusals decided up front, one error for a forced
  choice that cannot run, no fallback per kernel call;
* the interface: ``plan`` → ``forward`` → ``backward(dist_grad=True)`` of each backend against the dense estimator
  (``conftest.naive_estimator`` of ``conftest.naive_mean_mask``) and autograd through the dense surrogate
  ``softmax(s + log Mbar - (m - m.detach()) |i - j|) v`` (its ``q, k, v`` gradients are the estimator's, its slope
  gradient ``-dist``). The Triton row runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest) on
  small blocks.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from positional_lsh import sample_partitions
from positional_lsh.ops._engine import engine, routing
from positional_lsh.ops._engine import per_sample as per_sample_module
from positional_lsh.ops._engine.backend import Saved
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.multiplicity.backend import MultiplicityBackend
from positional_lsh.ops._engine.multiplicity.plan import MultiplicityPlan
from positional_lsh.ops._engine.per_sample import PerSampleBackend, SamplesPlan
from positional_lsh.ops._engine.torch_attention import kernel_inputs

from conftest import dense_surrogate, naive_estimator, naive_mean_mask

F64 = torch.float64
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TORCH_ROWS = [("samples", "flash"), ("samples", "math"), ("multiplicity", "flash"), ("multiplicity", "math")]


def _has_triton() -> bool:
    return routing.triton_installed()


# ----------------------------------------------------------------------------------------------------- the table


@pytest.mark.parametrize(("method", "kernel"), TORCH_ROWS)
def test_every_torch_row_reaches_its_backend(method, kernel):
    backend = routing.backend_for(method, kernel)
    assert (backend.method, backend.kernel) == (method, kernel)
    assert isinstance(backend, PerSampleBackend if method == "samples" else MultiplicityBackend)
    assert routing.backend_for(method, kernel) is backend  # one object per row


@pytest.mark.skipif(not _has_triton(), reason="the Triton row imports triton")
def test_the_triton_row_reaches_the_triton_backend():
    from positional_lsh.ops._engine.triton.host import TRITON, TritonBackend

    backend = routing.backend_for("multiplicity", "triton")
    assert backend is TRITON and isinstance(backend, TritonBackend)
    assert (backend.method, backend.kernel) == ("multiplicity", "triton")


def test_the_table_has_one_row_per_pair_and_the_priority_list_walks_them_all():
    assert sorted(routing.BACKEND_TABLE) == sorted([*TORCH_ROWS, ("multiplicity", "triton"), ("multiplicity", "cpu")])
    assert sorted(routing.PRIORITY) == sorted(routing.BACKEND_TABLE)
    for method in (Method.SAMPLES, Method.MULTIPLICITY):
        for kernel in Kernel:
            if (method, kernel) not in routing.BACKEND_TABLE:
                with pytest.raises(ValueError, match=f"method='{method}' with kernel='{kernel}'"):
                    routing.backend_for(method, kernel)


# -------------------------------------------------------------------------------------------------- the decision


def _route(q, backend="auto", method="auto", causal=True, **kw):
    return routing.dispatch(q, causal=causal, scale=None, backend=backend, method=method, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "flash", "math"])
def test_cpu_decisions(backend, dtype, torch_path):
    n = 1024
    q = torch.zeros(1, 4, n, 64, dtype=dtype)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    kernel = "math" if backend == "math" else "flash"  # the CPU flash op takes every dtype and masks
    route = _route(q, backend)
    assert (route.method, route.samples, route.multiplicity) == ("auto", kernel, kernel)
    one = sample_partitions(n, slopes, 1, generator=0)
    many = sample_partitions(n, slopes, 64, generator=0)
    d = routing.decide(route, one, 4, n)  # one sample: always the per-sample path, without estimating
    assert (d.method, d.kernel) == ("samples", kernel)
    assert d.backend is routing.backend_for("samples", kernel) and isinstance(d.prepared, SamplesPlan)
    d = routing.decide(route, many, 4, n)  # T = 64: the multiplicity form, with the tiling it estimated
    assert (d.method, d.kernel) == ("multiplicity", kernel) and isinstance(d.prepared, MultiplicityPlan)
    for method in ("samples", "multiplicity"):  # forced methods are kept, and nothing is prepared
        forced = _route(q, backend, method)
        assert forced.kernel_of(Method(method)) == kernel
        for parts in (one, many):
            d = routing.decide(forced, parts, 4, n)
            assert (d.method, d.kernel, d.prepared) == (method, kernel, None)
            assert d.backend is routing.backend_for(method, kernel)


def test_plan_keeps_what_decide_chose():
    q = torch.zeros(1, 2, 64, 16)
    parts = sample_partitions(64, [0.5, 0.1], 40, generator=1)
    for method in ("auto", "samples", "multiplicity"):
        route = _route(q, "math", method)
        p = routing.plan(route, parts, 1, 64, CPU)
        d = routing.decide(route, parts, 1, 64)
        assert (p.route, p.method, p.kernel, p.partitions) == (route, d.method, d.kernel, parts)
        assert p.backend is d.backend
        want = SamplesPlan if p.method == "samples" else MultiplicityPlan
        assert isinstance(p.backend_plan, want) and p.backend_plan.causal


def cuda_like(d: int = 64, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """What ``dispatch`` reads of a CUDA tensor ``(1, 4, 64, d)``."""
    return SimpleNamespace(shape=torch.Size((1, 4, 64, d)), dtype=dtype, device=CUDA)


@pytest.fixture
def sm90(monkeypatch):
    """Routing on a CUDA device without one: torch's flash op of an sm_90 GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize(
    ("backend", "method", "dtype", "d", "t", "want"),
    [
        # the per-sample path: torch's CUDA flash op for half inputs, the math kernel for the rest
        ("auto", "samples", torch.bfloat16, 64, 8, ("samples", "flash")),
        ("flash", "samples", torch.float16, 128, 8, ("samples", "flash")),
        ("auto", "samples", torch.float32, 64, 8, ("samples", "math")),
        ("auto", "samples", torch.bfloat16, 60, 8, ("samples", "math")),  # head dim not a multiple of 8
        ("auto", "auto", torch.float64, 64, 1, ("samples", "math")),  # float64: no Triton, no CUDA flash
        ("math", "samples", torch.bfloat16, 64, 8, ("samples", "math")),
        # the multiplicity form on torch kernels: every call carries the mask log c, which the CUDA op never takes
        ("auto", "multiplicity", torch.bfloat16, 64, 8, ("multiplicity", "math")),
        ("auto", "auto", torch.float64, 64, 64, ("multiplicity", "math")),
        ("math", "multiplicity", torch.float32, 64, 8, ("multiplicity", "math")),
        # backend="flash" forbids the multiplicity form on CUDA: method="auto" keeps the per-sample path
        ("flash", "auto", torch.bfloat16, 64, 64, ("samples", "flash")),
    ],
)
def test_cuda_decisions_of_the_torch_kernels(sm90, monkeypatch, backend, method, dtype, d, t, want):
    monkeypatch.setattr(routing, "triton_installed", lambda: False)  # the torch path whatever is installed
    route = _route(cuda_like(d, dtype), backend, method)
    parts = sample_partitions(64, [0.5, 0.25, 0.125, 0.0625], t, generator=0)
    decision = routing.decide(route, parts, 4, 64)
    assert (decision.method, decision.kernel) == want
    assert decision.backend is routing.backend_for(*want)


@pytest.mark.parametrize(
    ("backend", "method", "dtype", "d", "refused"),
    [
        ("flash", "multiplicity", torch.bfloat16, 64, ["(multiplicity, flash): an additive mask"]),
        ("flash", "samples", torch.float32, 64, ["(samples, flash): dtype torch.float32"]),
        ("flash", "auto", torch.float32, 64, ["(samples, flash): dtype", "(multiplicity, flash): an additive mask"]),
        ("flash", "samples", torch.bfloat16, 60, ["(samples, flash): head dim 60"]),
    ],
)
def test_a_forced_backend_that_cannot_run_raises_one_error_with_every_reason(sm90, backend, method, dtype, d, refused):
    with pytest.raises(ValueError, match=f"backend='{backend}' with method='{method}' cannot run") as err:
        _route(cuda_like(d, dtype), backend, method)
    for why in refused:
        assert why in str(err.value)


def test_causal_calls_with_lq_below_lk_or_row_groups_refuse_the_cuda_flash_op(sm90, monkeypatch):
    monkeypatch.setattr(routing, "triton_installed", lambda: False)
    q = cuda_like(64)
    assert _route(q, method="samples").samples == "flash"
    assert _route(q, method="samples", k_len=90).samples == "math"  # the CUDA op aligns its causal mask elsewhere
    assert _route(q, method="samples", causal=False, k_len=90).samples == "flash"
    assert _route(q, method="samples", padded=True).samples == "math"  # row groups have Lq != Lk
    with pytest.raises(ValueError, match="causal with Lq != Lk"):
        _route(q, "flash", "samples", k_len=90)


def test_flash_on_other_devices_is_refused_and_auto_takes_math():
    q = torch.zeros(1, 2, 8, 8, device="meta")
    assert _route(q).samples == "math" and _route(q).multiplicity == "math"
    with pytest.raises(ValueError, match="torch's fused flash op runs on the CPU or CUDA; tensors are on meta"):
        _route(q, "flash")


def test_torch_kernel_of_the_exact_ops(sm90):
    assert routing.torch_kernel("auto", CPU, masked=True) == "flash"
    assert routing.torch_kernel("auto", CUDA, masked=True) == "math"  # every exact call carries its bias
    assert routing.torch_kernel("auto", CUDA, masked=False) == "flash"
    assert routing.torch_kernel("auto", torch.device("mps"), masked=False) == "math"
    assert routing.torch_kernel("flash", CPU, masked=True) == "flash"
    with pytest.raises(ValueError, match="refuses an additive mask"):
        routing.torch_kernel("flash", CUDA, masked=True)
    with pytest.raises(ValueError, match="backend='flash' uses torch's fused flash-attention op"):
        routing.torch_kernel("flash", torch.device("mps"), masked=False)


@pytest.mark.skipif(not _has_triton(), reason="the Triton route needs triton installed")
@pytest.mark.parametrize(
    ("backend", "method", "dtype", "t", "want"),
    [
        ("auto", "auto", torch.bfloat16, 64, ("multiplicity", "triton")),
        ("auto", "auto", torch.bfloat16, 1, ("samples", "flash")),  # per sample: the device's torch kernel
        ("auto", "auto", torch.float32, 1, ("samples", "math")),  # ... which refuses float32 up front
        ("auto", "multiplicity", torch.float16, 1, ("multiplicity", "triton")),  # forced: even T = 1
        ("triton", "auto", torch.float32, 64, ("multiplicity", "triton")),
    ],
)
def test_cuda_decisions_of_the_triton_route(sm90, backend, method, dtype, t, want):
    route = _route(cuda_like(64, dtype), backend, method)
    assert route.multiplicity == "triton"
    parts = sample_partitions(64, [0.5, 0.25, 0.125, 0.0625], t, generator=0)
    decision = routing.decide(route, parts, 4, 64)
    assert (decision.method, decision.kernel) == want
    assert decision.backend is routing.backend_for(*want)


def test_no_kernel_call_falls_back(monkeypatch):
    # The kernel decided up front is the one every kernel call runs: attend is never handed another.
    kernels = []
    real = per_sample_module.attend

    def spy(*args, **kwargs):
        kernels.append(kwargs["kernel"])
        return real(*args, **kwargs)

    monkeypatch.setattr(per_sample_module, "attend", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))
    parts = sample_partitions(24, [0.3, 0.1], 3, generator=0)
    for backend in ("flash", "math"):
        kernels.clear()
        p = routing.plan(_route(q, backend, "samples"), parts, 2, 24, CPU)
        engine.forward(p, q, k, v)
        assert p.kernel == backend and set(kernels) == {backend}


@pytest.mark.skipif(not (_has_triton() and INTERPRET), reason="the Triton route on CPU needs the interpreter")
def test_cuda_routing_end_to_end(monkeypatch):
    # routing.triton_device replaced: the CPU counts as a CUDA device; the defaults reach the Triton backend when the
    # cost model picks the multiplicity form, and the per-sample path on the device's torch kernel otherwise.
    from positional_lsh.ops._engine.triton import host as tm
    from positional_lsh.ops._engine.triton.plan import BlockConfig, TritonPlan

    monkeypatch.setattr(routing, "triton_device", lambda device: True)
    monkeypatch.setattr(tm, "config_for", lambda q: BlockConfig(16, 16, 16))
    q = torch.zeros(1, 2, 40, 16)
    route = _route(q)
    assert (route.method, route.samples, route.multiplicity) == ("auto", "flash", "triton")
    p = routing.plan(route, sample_partitions(40, [0.2, 0.05], 40, generator=0), 2, 40, CPU)
    assert (p.method, p.kernel) == ("multiplicity", "triton")
    assert isinstance(p.backend_plan, TritonPlan)
    p = routing.plan(route, sample_partitions(40, [0.2, 0.05], 1, generator=0), 2, 40, CPU)
    assert (p.method, p.kernel) == ("samples", "flash") and isinstance(p.backend_plan, SamplesPlan)
    assert _route(q, method="samples").multiplicity is None  # the per-sample path never routes to Triton


# ------------------------------------------------------------------------------- every backend against the oracle


# (hq, hkv, lq, lk, T, scheme, causal)
_CASES = [
    (4, 2, 24, 24, 5, "discrete", True),
    (4, 2, 24, 24, 5, "gamma", False),
    (2, 1, 10, 30, 3, "gamma", True),  # Lq < Lk, MQA
    (2, 2, 1, 20, 4, "discrete", False),  # one query (decoding)
]


def _inputs(hq, hkv, lq, lk, t, scheme, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, hq, lq, 16), (2, hkv, lk, 16), (2, hkv, lk, 16), (2, hq, lq, 16))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=F64).to(dtype) for s in shapes)
    parts = sample_partitions(lk, [0.5, 0.1, 0.03, 0.0][:hq], t, scheme=scheme, generator=seed + 3)
    return q, k, v, dout, parts


def _through_the_interface(backend, q, k, v, dout, parts, causal, scale):
    """The backend's plan → forward → backward(dist_grad=True), as the engine calls them."""
    qi, ki, vi, bad = kernel_inputs(q, k, v, backend.kernel)
    assert bad is None
    plan = backend.plan(parts, k.shape[1], q.shape[2], causal, q.device)
    assert plan.causal == causal
    out, lse = backend.forward(plan, qi, ki, vi, scale)
    grads = backend.backward(plan, Saved(qi, ki, vi, out, lse), dout.contiguous(), scale, True)
    plain = backend.backward(plan, Saved(qi, ki, vi, out, lse), dout.contiguous(), scale, False)
    assert plain[3] is None and all(torch.equal(a, b) for a, b in zip(plain[:3], grads[:3], strict=True))
    return out, lse, grads


def _check(out, lse, grads, q, k, v, dout, parts, causal, scale, tol):
    mbar = naive_mean_mask(parts.pitch, parts.shift, parts.seq_len)
    want = dense_surrogate(q, k, v, dout, mbar, causal=causal, scale=scale)
    oracle = naive_estimator(q, k, v, mbar, causal=causal, scale=scale)
    assert out.dtype == q.dtype and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=tol)
    torch.testing.assert_close(want[0], oracle, rtol=0, atol=1e-12)  # the surrogate's value is the estimator
    dq, dk, dv, dist = grads
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype) and dist.shape == (q.shape[1],)
    for got, ref in zip((dq, dk, dv), want[1:4], strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * max(1.0, float(ref.abs().max())))
    torch.testing.assert_close(dist.double(), want[4], rtol=tol, atol=tol * max(1.0, float(want[4].abs().max())))


@pytest.mark.parametrize(("hq", "hkv", "lq", "lk", "t", "scheme", "causal"), _CASES)
@pytest.mark.parametrize(("method", "kernel"), TORCH_ROWS)
def test_every_torch_backend_equals_the_oracle(method, kernel, hq, hkv, lq, lk, t, scheme, causal):
    backend = routing.backend_for(method, kernel)
    q, k, v, dout, parts = _inputs(hq, hkv, lq, lk, t, scheme, F64)
    scale = 16**-0.5
    out, lse, grads = _through_the_interface(backend, q, k, v, dout, parts, causal, scale)
    assert lse.dtype == F64 and grads[3].dtype == F64
    _check(out, lse, grads, q, k, v, dout, parts, causal, scale, 1e-10)


@pytest.mark.skipif(not (_has_triton() and INTERPRET), reason="CPU tensors need Triton's interpreter")
@pytest.mark.parametrize(("hq", "hkv", "lq", "lk", "t", "scheme", "causal"), _CASES)
def test_the_triton_backend_equals_the_oracle(monkeypatch, hq, hkv, lq, lk, t, scheme, causal):
    from positional_lsh.ops._engine.triton import host as tm
    from positional_lsh.ops._engine.triton.plan import BlockConfig

    monkeypatch.setattr(tm, "config_for", lambda q: BlockConfig(16, 16, 16))  # small tiles: near and far blocks
    backend = routing.backend_for("multiplicity", "triton")
    q, k, v, dout, parts = _inputs(hq, hkv, lq, lk, t, scheme, torch.float32)
    scale = 16**-0.5
    out, lse, grads = _through_the_interface(backend, q, k, v, dout, parts, causal, scale)
    assert lse.dtype == torch.float32 and grads[3].dtype == torch.float32
    _check(out, lse, grads, q, k, v, dout, parts, causal, scale, 2e-5)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_the_engine_adds_the_nonfinite_key_rule_and_the_same_numbers(method):
    # engine.forward/backward = kernel_inputs + the backend's steps + the rows that keep a NaN key set to NaN.
    q, k, v, dout, parts = _inputs(4, 2, 24, 24, 5, "gamma", F64)
    route = _route(q, "math", method)
    p = routing.plan(route, parts, 2, 24, CPU)
    out, lse, inputs = engine.forward(p, q, k, v)
    direct = p.backend.forward(p.backend_plan, *inputs, route.scale)
    assert torch.equal(out, direct[0]) and torch.equal(lse, direct[1])
    grads = engine.backward(p, (*inputs, out, lse), dout, dist_grad=True)
    direct_grads = p.backend.backward(p.backend_plan, Saved(*inputs, out, lse), dout, route.scale, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, direct_grads, strict=True))
    k = k.clone()
    k[1, 0, 3, 2] = float("nan")
    out, _, _ = engine.forward(p, q, k, v)
    rows = engine.rows_reaching(torch.isnan(k).any(-1), parts, 24, True)
    assert bool(rows.any()) and torch.equal(out.isnan().any(-1), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_keys_found_in_every_dtype_and_not_in_large_finite_ones(dtype):
    from positional_lsh.ops._engine.torch_attention import nonfinite_keys

    big = torch.finfo(dtype).max / 2  # the sum of a few overflows: the exact check must clear them
    k = torch.full((1, 2, 6, 4), big, dtype=dtype)
    v = torch.ones(1, 2, 6, 4, dtype=dtype)
    assert nonfinite_keys(k, v) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        kk, vv = k.clone(), v.clone()
        vv[0, 1, 4, 2] = bad
        kk[0, 0, 1, 3] = bad
        expect = torch.zeros(1, 2, 6, dtype=torch.bool)
        expect[0, 1, 4] = expect[0, 0, 1] = True
        assert torch.equal(nonfinite_keys(kk, vv), expect)
