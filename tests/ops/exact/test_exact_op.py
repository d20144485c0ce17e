"""The exact ops' one custom-op registration (``positional_lsh::exact_forward`` / ``exact_backward``, connected by
``register_autograd``): eager calls run it, ``torch.compile(fullgraph=True)`` traces a call without a graph break and
computes what eager mode computes (outputs, ``q, k, v`` gradients and the exact slope / decay-parameter gradients,
bitwise), the values it cannot read at trace time are checked inside the op, and ``opcheck`` passes."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from positional_lsh import alibi_attention, decay_attention
from positional_lsh.ops.exact.op import EXACT_INPUTS, exact_backward, exact_forward

F64 = torch.float64


def _qkv(b=2, hq=4, hkv=2, lq=12, lk=12, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g, dtype=F64).to(dtype).requires_grad_()
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    )


def _up(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out.dtype)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_eager_calls_run_the_custom_op():
    q, k, v = _qkv()
    assert "exact_forward" in alibi_attention(q, k, v).grad_fn.name()
    assert "exact_forward" in decay_attention(q, k, v, "power", [0.5, 1.0]).grad_fn.name()
    assert EXACT_INPUTS[:4] == ("q", "k", "v", "theta") and "key_padding_mask" in EXACT_INPUTS


def test_fullgraph_compile_equals_eager_with_exact_parameter_gradients():
    q, k, v = _qkv(lq=7)  # queries: the last 7 of 12 keys
    m = torch.tensor([0.37, 0.11, 0.0, 0.73], requires_grad=True)
    theta = torch.tensor([[0.5, 1.0], [2.0, 0.3], [1.0, 1.0], [0.2, 4.0]], dtype=F64, requires_grad=True)

    def f(q, k, v, m, theta):
        return (
            alibi_attention(q, k, v, m, causal=True),
            alibi_attention(q, k, v, 0.2, causal=False, window=3.0),
            decay_attention(q, k, v, "power", theta),
        )

    explained = torch._dynamo.explain(f)(q, k, v, m, theta)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    eager = f(q, k, v, m, theta)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, m, theta)
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
    up = [_up(x) for x in eager]
    inputs = (q, k, v, m, theta)
    for a, b in zip(torch.autograd.grad(got, inputs, up), torch.autograd.grad(eager, inputs, up), strict=True):
        assert torch.equal(a, b)


def test_compiled_calls_check_the_values_inside_the_op():
    q = _qkv()[0].detach()
    fn = torch.compile(lambda q, m, w: alibi_attention(q, q, q, m, window=w), backend="aot_eager", fullgraph=True)
    ok = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert torch.equal(fn(q, ok, torch.tensor(2.0)), alibi_attention(q, q, q, ok, window=2.0))
    with pytest.raises(ValueError, match="slopes must be >= 0"):
        fn(q, torch.tensor([0.1, -0.2, 0.3, 0.4]), torch.tensor(2.0))
    with pytest.raises(ValueError, match="window must be finite"):
        fn(q, ok, torch.tensor(float("nan")))
    decay = torch.compile(lambda q, t: decay_attention(q, q, q, "power", t), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"params\[:, 0\] \(r1 of the power decay\)"):
        decay(q, torch.tensor([-0.5, 1.0]))


def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 4, 8, generator=g, dtype=F64).transpose(1, 2).requires_grad_()  # non-contiguous
    k, v = (torch.randn(2, 10, 2, 8, generator=g, dtype=F64).transpose(1, 2).requires_grad_() for _ in range(2))
    slopes = torch.tensor([0.3, 0.2, 0.1, 0.0], requires_grad=True)
    theta = torch.tensor([[4.0], [9.0], [2.0], [6.0]], dtype=F64, requires_grad=True)
    out, lse = exact_forward(q, k, v, slopes, None, "alibi", True, 0.35, "auto")
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    fake_only = ("test_schema", "test_faketensor")  # (the full check, AOT dispatch included, takes seconds)
    cases = [
        (exact_forward, (q, k, v, slopes, None, "alibi", True, 0.35, "auto"), None),
        (exact_forward, (q, k, v, theta, None, "truncated-linear", False, 0.35, "math", True), fake_only),
        (exact_backward, (dout, qd, kd, vd, out.detach(), lse, slopes.detach(), None, "alibi", True, 0.35, "auto",
                          True, True), fake_only),
    ]  # fmt: skip
    for op, args, utils in cases:
        result = opcheck(op, args) if utils is None else opcheck(op, args, test_utils=utils)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
