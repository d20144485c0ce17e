"""The surrogate slope gradient of positional LSH (``plsh_attention(..., slopes=<tensor requiring grad>)``).

Reference (the contract of issue 21): with the SAME partitions, dense autograd through
``softmax(s + log Mbar - (m - m.detach())[h] |i - j|) v`` — its value is the estimator, its gradient in ``m`` is the
surrogate ``-sum dS_hat |i - j|``. Built here from the definitions (``Partitions.mean_mask`` for ``Mbar``, the
distances and masks by hand), independent of the backends. Every backend (per-sample, multiplicity, the compiled
custom ops, the Triton kernels under the interpreter) must match it, and nothing may change when the slopes do not
require grad.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from positional_lsh import PositionalLSHAttention, plsh_attention, sample_partitions
from positional_lsh.ops._engine import engine, per_sample, routing
from positional_lsh.ops._engine.multiplicity import backend as multiplicity
from positional_lsh.ops.partitions.sampling import PartitionSampler, layer_seed

F64 = torch.float64


def _qkv(b, hq, hkv, lq, lk, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=F64).to(dtype).requires_grad_()
    return q, k, v


def _distance(lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``|i - j|`` (float64 ``(Lq, Lk)``) with query row ``r`` at position ``Lk - Lq + r``, and ``j > i``."""
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    return (i - j).abs().to(F64), j > i


def surrogate_reference(q, k, v, m, parts, *, causal, scale=None):
    """``softmax(s + log Mbar - (m - m.detach()) |i - j|) v`` in float64 (value: the estimator; ``m``-gradient: the
    surrogate)."""
    q, k, v = q.double(), k.double(), v.double()
    _, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = d**-0.5 if scale is None else scale
    dist, after = _distance(lq, lk)
    log_mbar = torch.log(parts.mean_mask(dtype=F64)[:, lk - lq :, :])
    if causal:
        log_mbar = log_mbar.masked_fill(after, -math.inf)
    mm = m.double().reshape(-1).expand(hq)[:, None, None]
    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = q @ kk.transpose(-1, -2) * sc + log_mbar - (mm - mm.detach()) * dist
    return torch.softmax(s, -1) @ vv


def exact_alibi(q, k, v, m, *, causal):
    """Exact ALiBi through the explicit ``-m |i - j|`` bias, float64 (the exact slope gradient by autograd)."""
    _, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dist, after = _distance(lq, lk)
    bias = -m.double()[:, None, None] * dist
    if causal:
        bias = bias.masked_fill(after, -math.inf)
    kk, vv = (x.double().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    return torch.softmax(q.double() @ kk.transpose(-1, -2) * d**-0.5 + bias, -1) @ vv


def _grads(out, g, inputs):
    return torch.autograd.grad((out * g).sum(), inputs)


# Shapes: (B, Hq, Hkv, Lq, Lk, d, slopes). GQA everywhere; Lq < Lk (cut blocks, query offsets); a slope-0 head
# (one block: every sample the same, counted T times) and a large slope (single positions: repeated samples); long
# causal blocks at small slopes (split into sub-blocks by the per-sample path); padded multiplicity tiles (Lq = 37).
CASES = {
    "gqa": (2, 4, 2, 40, 40, (0.5, 0.25, 0.125, 0.0625)),
    "decode": (1, 4, 2, 13, 40, (0.3, 0.1, 0.05, 0.02)),
    "repeats": (1, 2, 1, 37, 37, (0.0, 3.0)),
    "long": (1, 2, 2, 230, 230, (0.002, 0.004)),
}


# Long blocks are split only when causal: "long" runs causal only.
CASE_CAUSAL = [(c, causal) for c in CASES for causal in (True, False) if causal or c != "long"]


@pytest.mark.parametrize(("case", "causal"), CASE_CAUSAL)
@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_surrogate_equals_dense_reference_float64(method, causal, scheme, case):
    b, hq, hkv, lq, lk, slopes = CASES[case]
    q, k, v = _qkv(b, hq, hkv, lq, lk, 8)
    m = torch.tensor(slopes, dtype=F64, requires_grad=True)
    parts = sample_partitions(lk, m.detach(), 5, scheme=scheme, generator=3)
    ref = surrogate_reference(q, k, v, m, parts, causal=causal)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    want = _grads(ref, g, (q, k, v, m))
    for backend in ("flash", "math"):
        out = plsh_attention(q, k, v, m, partitions=parts, causal=causal, method=method, backend=backend)
        got = _grads(out, g, (q, k, v, m))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        scale = float(want[3].abs().max()) + 1.0
        torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-10 * scale)
        for a, w in zip(got[:3], want[:3], strict=True):
            torch.testing.assert_close(a, w, rtol=0, atol=1e-11)
        assert got[3].dtype == F64 and bool(want[3].abs().max() > 1e-3)  # a real gradient, not a zero


def test_surrogate_drawn_from_the_slopes_and_shared_scalar():
    """Without ``partitions=``: drawn from ``slopes.detach()`` (the same partitions as a float64 copy would draw);
    a 0-dim slope tensor gets the sum over heads."""
    q, k, v = _qkv(1, 4, 4, 32, 32, 8)
    m = torch.tensor([0.4, 0.2, 0.1, 0.05], dtype=F64, requires_grad=True)
    out = plsh_attention(q, k, v, m, num_samples=4, generator=7)
    parts = sample_partitions(32, m.detach(), 4, generator=7)
    ref = surrogate_reference(q, k, v, m, parts, causal=True)
    g = torch.randn_like(ref)
    torch.testing.assert_close(_grads(out, g, (m,))[0], _grads(ref, g, (m,))[0], rtol=0, atol=1e-10)
    one = torch.tensor(0.1, dtype=F64, requires_grad=True)
    out = plsh_attention(q, k, v, one, num_samples=4, generator=7, method="multiplicity")
    ref = surrogate_reference(q, k, v, one, sample_partitions(32, 0.1, 4, generator=7, num_heads=4), causal=True)
    (got,), (want,) = _grads(out, g, (one,)), _grads(ref, g, (one,))
    assert got.shape == () and bool(want.abs() > 1e-3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_surrogate_low_precision(method, dtype, tol):
    """float32 / bfloat16 inputs, float32 slopes: the gradient is accumulated in float32 and returned in the slopes'
    dtype; close to the float64 reference on the same (rounded) inputs, relative to its norm: float32 rounding
    (about 1e-6 per entry) for float32, the 8-bit mantissa of the output and of the kernels' bf16 products (about
    4e-3 per entry) for bfloat16."""
    q, k, v = _qkv(2, 4, 2, 48, 48, 16, dtype=dtype)
    m = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    parts = sample_partitions(48, m.detach(), 6, generator=2)
    out = plsh_attention(q, k, v, m, partitions=parts, method=method)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    m64 = m.detach().double().requires_grad_()
    ref = surrogate_reference(q64, k64, v64, m64, parts, causal=True)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (got,) = _grads(out, g.to(dtype), (m,))
    (want,) = _grads(ref, g, (m64,))
    assert got.dtype == torch.float32
    assert float((got.double() - want).norm() / want.norm()) < tol


def _counting(monkeypatch):
    """Count the backends' ``attend_bias_grad`` calls (module-level lookups in per_sample and multiplicity)."""
    calls = {"n": 0}
    real = per_sample.attend_bias_grad

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(per_sample, "attend_bias_grad", counted)
    monkeypatch.setattr(multiplicity, "attend_bias_grad", counted)
    return calls


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_nothing_changes_without_slope_grad(method, monkeypatch, torch_path):
    """Slopes not requiring grad, a float list, ``slope_grad="none"``: bitwise the same outputs and q/k/v gradients
    as with the surrogate on, and no extra pass (``attend_bias_grad`` is never called)."""
    calls = _counting(monkeypatch)
    q, k, v = _qkv(2, 4, 2, 30, 30, 8, dtype=torch.float32)
    values = [0.5, 0.25, 0.125, 0.0625]
    g = torch.randn(2, 4, 30, 8, generator=torch.Generator().manual_seed(1))
    m = torch.tensor(values, requires_grad=True)
    out = plsh_attention(q, k, v, m, num_samples=6, generator=4, method=method)
    base = _grads(out, g, (q, k, v, m))
    assert calls["n"] > 0 and base[3] is not None
    calls["n"] = 0
    variants = [
        dict(slopes=torch.tensor(values)),
        dict(slopes=values),
        dict(slopes=m, slope_grad="none"),
        dict(slopes=torch.tensor(values), slope_grad="none"),
    ]
    for kw in variants:
        out2 = plsh_attention(q, k, v, num_samples=6, generator=4, method=method, **kw)
        assert torch.equal(out2, out)
        grads = _grads(out2, g, (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(grads, base[:3], strict=True))
    assert calls["n"] == 0
    out3 = plsh_attention(q, k, v, m, num_samples=6, generator=4, method=method, slope_grad="none")
    (out3 * g).sum().backward()
    assert m.grad is None  # "none": the call gives the slopes no gradient
    # Only the slopes require grad: still the surrogate (autograd asks for it alone).
    qd, kd, vd = (x.detach() for x in (q, k, v))
    (only,) = _grads(plsh_attention(qd, kd, vd, m, num_samples=6, generator=4, method=method), g, (m,))
    torch.testing.assert_close(only, base[3], rtol=0, atol=0)


def test_engine_backward_interface():
    """``engine.backward(p, saved, dout, dist_grad)`` -> ``(dq, dk, dv, dist | None)``, ``dist`` in the accumulation
    dtype and ``slopes.grad = -dist``."""
    q, k, v = _qkv(1, 2, 2, 20, 20, 8, dtype=torch.float32)
    parts = sample_partitions(20, [0.3, 0.1], 3, generator=0)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="samples")
    p = routing.plan(route, parts, 2, 20, q.device)
    out, lse, inputs = engine.forward(p, q.detach(), k.detach(), v.detach())
    dout = torch.randn_like(out)
    plain = engine.backward(p, (*inputs, out, lse), dout)
    with_dist = engine.backward(p, (*inputs, out, lse), dout, dist_grad=True)
    assert plain[3] is None and with_dist[3].shape == (2,) and with_dist[3].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], with_dist[:3], strict=True))
    m = torch.tensor([0.3, 0.1], requires_grad=True)
    (gm,) = _grads(plsh_attention(q, k, v, m, partitions=parts, method="samples"), dout, (m,))
    torch.testing.assert_close(gm, -with_dist[3], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["samples", "multiplicity"])
def test_compiled_equals_eager(method, monkeypatch):
    """The custom ops (``plsh_backward`` returns the slope gradient, ``register_autograd`` gives it to ``slopes``):
    the same numbers as eager mode, with and without the slopes requiring grad (then no extra pass)."""
    import torch._dynamo

    q, k, v = _qkv(1, 4, 2, 24, 24, 8, dtype=torch.float32)
    m = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)

    def f(q, k, v, m):
        return plsh_attention(q, k, v, m, num_samples=4, generator=3, method=method)

    eager = f(q, k, v, m)
    g = torch.randn_like(eager)
    want = _grads(eager, g, (q, k, v, m))
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, m)
    assert torch.equal(out, eager)
    got = _grads(out, g, (q, k, v, m))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    calls = _counting(monkeypatch)
    fixed = m.detach()
    out = compiled(q, k, v, fixed)
    assert torch.equal(out, eager)
    got = _grads(out, g, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3], strict=True)) and calls["n"] == 0
    torch._dynamo.reset()


def test_compiled_backward_op_returns_slope_grad():
    from positional_lsh.ops._engine.op import plsh_backward, plsh_forward

    q, k, v = _qkv(1, 2, 2, 12, 12, 8, dtype=torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    parts = sample_partitions(12, [0.3, 0.1], 2, generator=0)
    args = (parts.pitch, parts.shift, parts.slopes, parts.scheme, None, True, 0.3, "samples", "flash", "")
    out, lse = plsh_forward(q, k, v, *args)
    dout = torch.randn_like(out)
    off = plsh_backward(dout, q, k, v, out, lse, *args)
    on = plsh_backward(dout, q, k, v, out, lse, *args, True)
    assert torch.equal(off[3], torch.zeros(2, dtype=F64)) and on[3].dtype == F64 and bool(on[3].abs().max() > 0)
    assert all(torch.equal(a, b) for a, b in zip(off[:3], on[:3], strict=True))
    torch.library.opcheck(plsh_backward, (dout, q, k, v, out, lse, *args, True))


def test_bad_slope_grad_is_refused():
    q, k, v = _qkv(1, 2, 2, 8, 8, 4)
    for bad in ("x", None, 1, "Surrogate"):
        with pytest.raises(ValueError, match="slope_grad"):
            plsh_attention(q, k, v, slope_grad=bad)
        with pytest.raises(ValueError, match="slope_grad"):
            PositionalLSHAttention(2, slope_grad=bad)
    # A non-tensor slope (or a tensor without requires_grad) with slope_grad="surrogate": accepted, nothing to learn.
    out = plsh_attention(q, k, v, 0.1, slope_grad="surrogate", generator=0)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="learn_slopes"):
        PositionalLSHAttention(2, [0.0, 0.5], learn_slopes=True)
    with pytest.raises((TypeError, ValueError), match="learn_slopes"):
        PositionalLSHAttention(2, learn_slopes="yes")
    with pytest.raises(ValueError, match="slopes differ"):  # partitions= whose slopes are not the tensor's values
        plsh_attention(q, k, v, torch.tensor([0.3, 0.2], requires_grad=True),
                       partitions=sample_partitions(8, [0.3, 0.1], 2, generator=0))  # fmt: skip


def test_sampler_draw_slopes_override():
    s = PartitionSampler(3, [0.5, 0.2, 0.1], num_samples=4, scheme="gamma", seed=11, eval_seed=2)
    before = s.draw(50, training=True, step=3)
    new = torch.tensor([0.4, 0.3, 0.05])
    parts = s.draw(50, training=True, step=3, slopes=new)
    want = sample_partitions(50, new, 4, scheme="gamma", generator=layer_seed(11, 3))
    assert torch.equal(parts.pitch, want.pitch) and torch.equal(parts.shift, want.shift)
    assert torch.equal(parts.slopes, new.double())
    # The cache follows the slope values; without slopes= the draws are those of the sampler's own slopes.
    again = s.draw(50, training=True, step=3)
    assert torch.equal(again.pitch, before.pitch) and torch.equal(again.shift, before.shift)
    assert torch.equal(before.pitch, sample_partitions(50, [0.5, 0.2, 0.1], 4, scheme="gamma",
                                                       generator=layer_seed(11, 3)).pitch)  # fmt: skip
    ev = s.draw(50, slopes=new)
    assert torch.equal(ev.pitch, sample_partitions(50, new, 4, scheme="gamma", generator=2).pitch)
    assert torch.equal(s.draw(50).pitch, sample_partitions(50, [0.5, 0.2, 0.1], 4, scheme="gamma", generator=2).pitch)


def test_module_learn_slopes():
    q, k, v = _qkv(1, 4, 4, 40, 40, 8, dtype=torch.float32)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    fixed = PositionalLSHAttention(4, slopes, num_samples=4, seed=1)
    assert set(fixed.state_dict()) == {"calls", "_extra_state"} and not list(fixed.parameters())
    mod = PositionalLSHAttention(4, slopes, num_samples=4, seed=1, learn_slopes=True)
    assert set(mod.state_dict()) == {"calls", "_extra_state", "log_slopes"}
    assert mod.log_slopes.dtype == torch.float32
    torch.testing.assert_close(mod.slopes, torch.tensor(slopes, dtype=F64), rtol=1e-6, atol=0)
    with torch.no_grad():
        mod.log_slopes.add_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    m = mod.log_slopes.detach().exp()
    parts = sample_partitions(40, m, 4, generator=layer_seed(1, 0))  # training call 0 draws from the current slopes
    out = mod(q, k, v)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    mt = m.clone().requires_grad_()
    ref = plsh_attention(q, k, v, mt, partitions=parts)
    assert torch.equal(out, ref)
    (gm,) = _grads(ref, g, (mt,))
    torch.testing.assert_close(mod.log_slopes.grad, gm * m, rtol=1e-6, atol=1e-7)  # d/d log m = m d/dm
    # Fixed slopes: outputs exactly the draws of the fixed-slope policy (eval: eval_seed).
    fixed.eval()
    want = plsh_attention(q, k, v, partitions=sample_partitions(40, slopes, 4, generator=0))
    assert torch.equal(fixed(q, k, v), want)
    # The state dict carries the learned slopes.
    other = PositionalLSHAttention(4, slopes, num_samples=4, seed=1, learn_slopes=True)
    other.load_state_dict(mod.state_dict())
    assert torch.equal(other.log_slopes, mod.log_slopes) and int(other.calls) == 1
    none = PositionalLSHAttention(4, slopes, num_samples=4, seed=1, learn_slopes=True, slope_grad="none")
    none(q, k, v).sum().backward()
    assert none.log_slopes.grad is None


def test_module_learn_slopes_compiled():
    import torch._dynamo

    q, k, v = _qkv(1, 2, 2, 24, 24, 8, dtype=torch.float32)
    eager = PositionalLSHAttention(2, [0.3, 0.1], num_samples=3, seed=2, learn_slopes=True)
    comp = PositionalLSHAttention(2, [0.3, 0.1], num_samples=3, seed=2, learn_slopes=True)
    torch._dynamo.reset()
    run = torch.compile(comp, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the second call: new step, slopes moved by the first update
        a, b = eager(q, k, v), run(q, k, v)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        a.sum().backward()
        b.sum().backward()
        torch.testing.assert_close(comp.log_slopes.grad, eager.log_slopes.grad, rtol=1e-5, atol=1e-6)
        for mod in (eager, comp):
            with torch.no_grad():
                mod.log_slopes.sub_(0.5 * mod.log_slopes.grad.sign())
            mod.log_slopes.grad = None
    torch._dynamo.reset()


def test_context_parallel_refuses_learnable_slopes(monkeypatch):
    """More than one rank computes no slope gradient: refused (on every rank alike), never a silent None. A group of
    two ranks is faked: this process plays both (``all_gather`` copies its own tensor)."""
    import torch.distributed as dist

    from positional_lsh.distributed import context_parallel_plsh_attention

    def all_gather(out, tensor, group=None):
        for o in out:
            o.copy_(tensor)

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    q, k, v = _qkv(1, 2, 2, 8, 8, 4)
    m = torch.tensor([0.3, 0.1], requires_grad=True)
    with pytest.raises(ValueError, match=r"slopes requires grad.*slope_grad"):
        context_parallel_plsh_attention(q, k, v, m, num_samples=2, generator=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton route on CPU needs the interpreter")
def test_triton_route_surrogate(monkeypatch):
    """The Triton kernels' ``dist`` (H3) through the engine's autograd Function, against the dense reference."""
    pytest.importorskip("triton")
    from positional_lsh.ops._engine.triton import host as tm
    from positional_lsh.ops._engine.triton.plan import BlockConfig

    monkeypatch.setattr(routing, "triton_device", lambda device: True)
    monkeypatch.setattr(tm, "config_for", lambda q: BlockConfig(16, 16, 16))
    q, k, v = _qkv(1, 2, 1, 20, 28, 16, dtype=torch.float32)
    m = torch.tensor([0.3, 0.1], requires_grad=True)
    parts = sample_partitions(28, m.detach(), 4, generator=1)
    out = plsh_attention(q, k, v, m, partitions=parts, method="multiplicity")
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    m64 = m.detach().double().requires_grad_()
    ref = surrogate_reference(q64, k64, v64, m64, parts, causal=True)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (got,) = _grads(out, g.float(), (m,))
    (want,) = _grads(ref, g, (m64,))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_surrogate_approaches_the_exact_gradient():
    """Consistency: as ``T`` grows the surrogate approaches the exact ALiBi slope gradient (dense autograd through
    ``-m |i - j|``). Over 12 fixed seeds per ``T``: the mean relative error must fall from each ``T`` to the next by
    more than three standard errors of the difference, and at the largest ``T`` the mean surrogate must be within four
    standard errors (its spread over the seeds) of the exact gradient, head by head."""
    q, k, v = _qkv(1, 2, 2, 48, 48, 8, seed=5)
    q, k, v = q.detach(), k.detach(), v.detach()
    m = torch.tensor([0.3, 0.08], dtype=F64, requires_grad=True)
    g = torch.randn(1, 2, 48, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    (exact,) = _grads(exact_alibi(q, k, v, m, causal=True), g, (m,))
    seeds = range(12)
    levels = []
    for t in (4, 64, 1024):
        grads = []
        for s in seeds:
            out = plsh_attention(q, k, v, m, num_samples=t, generator=s, method="multiplicity")
            grads.append(_grads(out, g, (m,))[0])
        gs = torch.stack(grads)
        errs = (gs - exact).norm(dim=1) / exact.norm()
        se = gs.std(0) / math.sqrt(len(seeds))
        levels.append((float(errs.mean()), float(errs.std() / math.sqrt(len(seeds))), gs.mean(0), se))
    for (mean_a, se_a, *_), (mean_b, se_b, *_) in itertools.pairwise(levels):
        assert mean_b < mean_a - 3 * math.hypot(se_a, se_b), levels
    _, _, mean_big, se_big = levels[-1]
    assert bool(((mean_big - exact).abs() < 4 * se_big).all()), (mean_big, exact, se_big)
