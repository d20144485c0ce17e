"""Every entry point reaches the Triton kernels on CUDA (ops/_engine/routing.py ``dispatch``, ``plan``), checked without
a GPU.

``dispatch`` reads only ``q.shape``, ``q.dtype`` and ``q.device``: a stand-in with ``device=torch.device("cuda")``
gives the route of a CUDA call. End to end, ``routing.triton_device`` (the one device test of ``dispatch``) is made
to say yes for the CPU, and the Triton kernels then run in Triton's interpreter on CPU tensors: ``plsh_attention``
with its defaults, the transformers swap, the context-parallel op and the language model (its ``ModelConfig``)
are each shown to route there, and to compute what the torch path computes.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from positional_lsh import plsh_attention, sample_partitions
from positional_lsh.ops._engine import routing
from positional_lsh.ops._engine.kinds import Kernel, Method

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")

from positional_lsh.ops._engine.per_sample import SamplesPlan  # noqa: E402
from positional_lsh.ops._engine.triton import host as tm  # noqa: E402
from positional_lsh.ops._engine.triton.plan import BlockConfig, TritonPlan  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def sm90(monkeypatch):
    """Routing a CUDA stand-in without a GPU: torch's flash op of an sm_90 GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def kind(route) -> tuple[str, str]:
    """``(method asked for, kernel)``: the multiplicity form's kernel where the route may take it, else the
    per-sample path's."""
    kernel = route.samples if route.method == "samples" or route.multiplicity is None else route.multiplicity
    return route.method, kernel


def cuda_like(d: int = 64, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """What ``dispatch`` reads of a CUDA tensor ``(1, 4, 64, d)``."""
    return SimpleNamespace(shape=torch.Size((1, 4, 64, d)), dtype=dtype, device=CUDA)


@pytest.mark.parametrize(
    ("backend", "method", "dtype", "d", "want"),
    [
        ("auto", "auto", torch.bfloat16, 64, ("auto", "triton")),  # the defaults
        ("auto", "multiplicity", torch.float16, 128, ("multiplicity", "triton")),
        ("auto", "auto", torch.float32, 256, ("auto", "triton")),
        ("auto", "samples", torch.bfloat16, 64, ("samples", "flash")),  # the CUDA flash op (math where it refuses)
        ("auto", "auto", torch.float64, 64, ("auto", "math")),  # triton takes no float64, nor the CUDA flash op
        ("auto", "multiplicity", torch.bfloat16, 512, ("multiplicity", "math")),  # nor d > 256; the mask: math
        ("math", "auto", torch.bfloat16, 64, ("auto", "math")),
        ("flash", "samples", torch.bfloat16, 64, ("samples", "flash")),
        ("triton", "auto", torch.bfloat16, 64, ("auto", "triton")),
    ],
)
def test_dispatch_of_cuda_calls(backend, method, dtype, d, want):
    route = routing.dispatch(cuda_like(d, dtype), causal=True, scale=None, backend=backend, method=method)
    assert kind(route) == want
    assert not route.compiled and route.causal and route.scale == pytest.approx(d**-0.5)


def test_dispatch_without_triton_or_cuda(monkeypatch, torch_path):
    q = torch.zeros(1, 4, 64, 64)
    assert kind(routing.dispatch(q, causal=True, scale=None, backend="auto", method="auto")) == ("auto", "flash")
    monkeypatch.setattr(routing, "triton_installed", lambda: False)
    route = routing.dispatch(cuda_like(), causal=True, scale=None, backend="auto", method="auto")
    assert kind(route) == ("auto", "math")  # the multiplicity form's mask: not on torch's CUDA flash op
    with pytest.raises(ValueError, match="got method='samples'"):
        routing.dispatch(cuda_like(), causal=True, scale=None, backend="triton", method="samples")


@pytest.mark.parametrize(("n", "t"), [(512, 1), (512, 2), (512, 16), (2048, 4), (2048, 64)])
def test_auto_on_cuda_runs_triton_whenever_it_picks_the_multiplicity_form(n, t):
    parts = sample_partitions(n, None, t, num_heads=4, generator=0)
    route = routing.dispatch(cuda_like(), causal=True, scale=None, backend="auto", method="auto")
    cpu = torch.device("cpu")  # the plan's tensors are built later, by the forward
    p = routing.plan(route, parts, 2, n, cpu)
    torch_route = routing.Route(Method.AUTO, Kernel.FLASH, Kernel.FLASH, False, True, route.scale)
    assert p.method == routing.plan(torch_route, parts, 2, n, cpu).method  # the one cost model decides
    if p.method == "multiplicity":
        assert p.kernel == "triton" and isinstance(p.backend_plan, TritonPlan)
    else:
        assert p.kernel == "flash" and isinstance(p.backend_plan, SamplesPlan)  # per sample, the device's flash op
    if t == 1:
        assert p.method == "samples"  # one sample never takes the multiplicity form
    if t == 64:
        assert p.method == "multiplicity"
    forced = routing.plan(routing.Route(Method.MULTIPLICITY, None, Kernel.TRITON, False, True, 0.1), parts, 2, n, cpu)
    assert (forced.method, forced.kernel) == ("multiplicity", "triton")


@pytest.fixture
def pretend_cuda(monkeypatch):
    """The CPU counts as a CUDA device for ``dispatch``; small Triton blocks; the Triton launches are counted."""
    monkeypatch.setattr(routing, "triton_device", lambda device: True)
    monkeypatch.setattr(tm, "config_for", lambda q: BlockConfig(16, 16, 16))
    launches = {"forward": 0, "backward": 0, "routes": []}
    forward, backward, dispatch = tm.TritonBackend.forward, tm.TritonBackend.backward, routing.dispatch

    def count(name, fn):
        def wrapped(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    def spy(q, **kwargs):
        route = dispatch(q, **kwargs)
        launches["routes"].append(kind(route))
        return route

    monkeypatch.setattr(tm.TritonBackend, "forward", count("forward", forward))
    monkeypatch.setattr(tm.TritonBackend, "backward", count("backward", backward))
    monkeypatch.setattr(routing, "dispatch", spy)
    return launches


@interpreter
def test_plsh_attention_defaults_reach_triton(pretend_cuda):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g).requires_grad_() for _ in range(3))
    out = plsh_attention(q, k, v, num_samples=16, generator=1)  # every default: backend="auto", method="auto"
    assert pretend_cuda["routes"] == [("auto", "triton")] and pretend_cuda["forward"] == 1
    out.sum().backward()
    assert pretend_cuda["backward"] == 1
    ref = plsh_attention(q, k, v, num_samples=16, generator=1, backend="math", method="multiplicity")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    one = plsh_attention(q, k, v, num_samples=1, generator=1)  # one sample: the per-sample path, flash op
    assert pretend_cuda["forward"] == 1 and one.shape == q.shape


@interpreter
def test_transformers_swap_reaches_triton(pretend_cuda):
    transformers = pytest.importorskip("transformers")
    from positional_lsh.integrations import hf

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, 50, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hf.use_positional_lsh(model, num_samples=12, seed=0):  # the defaults
        model(ids)
    assert pretend_cuda["routes"] == [("auto", "triton")] * 2  # both layers (the cost model then decides)
    first = pretend_cuda["forward"]
    with torch.no_grad(), hf.use_positional_lsh(model, num_samples=12, seed=0, method="multiplicity"):
        logits = model(ids).logits
    assert pretend_cuda["routes"][2:] == [("multiplicity", "triton")] * 2 and pretend_cuda["forward"] == first + 2
    with torch.no_grad(), hf.use_positional_lsh(model, num_samples=12, seed=0, backend="math", method="multiplicity"):
        ref = model(ids).logits
    assert pretend_cuda["routes"][4:] == [("multiplicity", "math")] * 2  # backend and method pass through
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)


@interpreter
def test_context_parallel_op_and_model_config_reach_triton(pretend_cuda):
    from positional_lsh import PositionalLSHAttention
    from positional_lsh.distributed import ContextShards, context_parallel_plsh_attention
    from positional_lsh.lm import ModelConfig, TransformerLM

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    parts = sample_partitions(32, None, 12, num_heads=2, generator=2)
    out = context_parallel_plsh_attention(q, k, v, partitions=parts)  # one process: its local call
    assert pretend_cuda["routes"] == [("auto", "triton")]
    ref = plsh_attention(q, k, v, partitions=parts, backend="math", method="multiplicity")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # The module's backend / method (a language-model layer's attn_backend / plsh_method) reach the context-parallel
    # op through its context= argument.
    for backend, method, want in [("auto", "auto", ("auto", "triton")), ("math", "samples", ("samples", "math"))]:
        layer = PositionalLSHAttention(2, num_samples=12, eval_seed=2, backend=backend, method=method).eval()
        layer(q, k, v, context=ContextShards(None, shard_lengths=[32]))
        assert pretend_cuda["routes"][-1] == want
    # And the language model's own layers: the defaults, and plsh_method="multiplicity" (then two launches).
    tokens = torch.randint(0, 40, (1, 32), generator=g)
    for method, want in [("auto", ("auto", "triton")), ("multiplicity", ("multiplicity", "triton"))]:
        cfg = ModelConfig(
            vocab_size=40, seq_len=32, n_layer=2, n_head=2, d_model=32, position="plsh", num_samples=12,
            plsh_method=method,
        )  # fmt: skip
        before = pretend_cuda["forward"]
        with torch.no_grad():
            TransformerLM(cfg).eval()(tokens)
        assert pretend_cuda["routes"][-2:] == [want] * 2
    assert pretend_cuda["forward"] == before + 2


# --------------------------------------------------------------------- the per-sample path on CUDA: the fused flash op


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_cuda_flash_calls_on_meta_tensors():
    # The CUDA op and its backward, called as attend / attend_backward call them, through torch's shape functions.
    from positional_lsh.ops._engine.torch_attention import Grad, cuda_flash_attend, cuda_flash_attend_backward

    q, k = _meta(2, 3, 40, 64), _meta(2, 3, 90, 64)
    v = _meta(2, 3, 90, 64).transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim strided: made contiguous
    out, lse = cuda_flash_attend(q, k, v, False, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 3, 40) and lse.dtype == torch.float32
    dq, dk, dv = cuda_flash_attend_backward(Grad(out, q, k, v, out, lse), False, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == q.dtype


def test_the_flash_kernel_runs_the_cuda_op_without_a_fallback(monkeypatch):
    # On a CUDA (here: meta) device the flash kernel is the CUDA op, whatever the call: the routing decided up front
    # that the op takes it (ops/_engine/routing.py); math is math.
    from positional_lsh.ops._engine import torch_attention as _kernels

    calls = []
    real = _kernels.cuda_flash_attend
    monkeypatch.setattr(_kernels, "cuda_flash_attend", lambda *a: calls.append("flash") or real(*a))
    q = _meta(1, 2, 16, 64)
    out, lse = _kernels.attend(q, q, q, causal=True, scale=0.125, kernel=Kernel.FLASH)
    assert calls == ["flash"] and out.shape == q.shape
    out, lse = _kernels.attend(q, q, q, causal=True, scale=0.125, kernel=Kernel.MATH)
    assert calls == ["flash"] and out.shape == q.shape and lse.dtype == torch.float32
