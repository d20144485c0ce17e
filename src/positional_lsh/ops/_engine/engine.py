"""One engine behind the op: how a call runs (route, then decision), the backends' table, plan → forward → backward.

Every call of :func:`~positional_lsh.plsh_attention` (and of :class:`~positional_lsh.PositionalLSHAttention`, the
language model, the transformers swap, context parallelism) goes through here. How a call runs is decided in two
steps, because part of it depends on the partition values, which are drawn after the arguments are checked:

1. :func:`dispatch` — from the arguments alone (method × backend × device × dtype × compile state): a
   :class:`Route` with the method asked for (``"samples"``, ``"multiplicity"`` or ``"auto"``), the kernel the
   backend resolves to on the device (``"flash"``, ``"math"`` or ``"triton"``) and whether the call goes through
   the ``torch.compile`` custom ops (:mod:`positional_lsh.ops._engine.op`). It validates the arguments.
2. :func:`decide` — from the route and the partitions: the :class:`Decision` of what runs. ``method="auto"``
   becomes a method here (the cost model, :mod:`~positional_lsh.ops._engine.cost`, estimates both from the
   partition values), the kernel becomes the one that runs (``"math"`` where torch's flash op of the device refuses
   the call as a whole: ``ops._engine.kernels.flash_refusal``; the per-sample path of a ``"triton"`` route runs on
   the device's torch kernel), and the (method, kernel) pair picks the backend from :data:`BACKEND_TABLE`, the one
   table of backends.

Then :func:`plan` (the decision and the backend's own plan, host-side), :func:`forward` (the estimator's
``(out, lse)``) and :func:`backward` (``(dq, dk, dv)`` from the merged ``out``/``lse``, and with ``dist_grad=True``
the surrogate slope gradient's ``dist (Hq,)``, ``sum dS |i - j|``; ``slopes.grad = -dist``). Forward and backward
apply the non-finite-key rule (``ops._engine.kernels.nonfinite_keys``) for every backend.

The backends implement one interface, :class:`~positional_lsh.ops._engine.backend.Backend` (``plan`` → ``forward``
→ ``backward``, each with a typed plan), in their own modules: :mod:`~positional_lsh.ops._engine.per_sample` (one
kernel call per group of equal blocks, merged by log-sum-exp), :mod:`~positional_lsh.ops._engine.multiplicity`
(each (query, key) pair once, with the mask ``log c``), :mod:`~positional_lsh.ops._engine.triton.host` (the
multiplicity form as Triton kernels; ``triton`` is imported only when that row is taken). Eager and compiled calls
(``ops._engine.op``) run the same :func:`plan`, :func:`forward` and :func:`backward`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from positional_lsh.ops._checks import as_scale, check_bool
from positional_lsh.ops._engine.backend import Backend, Saved
from positional_lsh.ops._engine.cost import auto_method, auto_up_front, samples_estimate
from positional_lsh.ops._engine.kernels import (
    flash_refusal,
    kernel_layout,
    nonfinite_keys,
    poison_rows,
    resolve_backend,
)
from positional_lsh.ops._engine.multiplicity import MULTIPLICITY_FLASH, MULTIPLICITY_MATH, multiplicity_plan, tilings
from positional_lsh.ops._engine.per_sample import PER_SAMPLE_FLASH, PER_SAMPLE_MATH, samples_plan
from positional_lsh.ops.options import check_backend, check_method
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "BACKEND_TABLE", "Decision", "Plan", "Route", "backend_for", "backward", "decide", "dispatch", "forward",
    "kernel_inputs", "plan", "rows_reaching", "triton_device", "triton_installed",
]  # fmt: skip

P = TypeVar("P")


@dataclass(frozen=True)
class Route:
    """How a call runs, from its arguments (see :func:`dispatch`).

    Attributes:
        method: ``"samples"``, ``"multiplicity"``, or ``"auto"`` (:func:`decide` picks one from the partitions).
        kernel: the kernel the backend resolves to on the device: ``"flash"`` (torch's fused flash op of the
            device: CPU or CUDA), ``"math"`` (batched matmuls) or ``"triton"`` (the multiplicity form on the Triton
            kernels; with ``method="auto"`` the per-sample path, where the cost model picks it, runs on the device's
            torch kernel). :func:`decide` gives the kernel that runs (``Decision.kernel``).
        compiled: whether the call is traced by ``torch.compile`` (then it runs the custom ops).
        causal: the causal mask.
        scale: the score scale.
        dtype, head_dim: what :func:`dispatch` read of ``q``: :func:`decide` runs ``"math"`` up front where torch's
            flash op refuses them. ``None`` (a route built from its first five fields, as inside the custom ops):
            not known; then such a call's kernel calls take the math formula one by one, with the same numbers
            (``ops._engine.kernels.attend``).
    """

    method: str
    kernel: str
    compiled: bool
    causal: bool
    scale: float
    dtype: torch.dtype | None = None
    head_dim: int | None = None


def triton_installed() -> bool:
    """Whether triton can be imported (``find_spec``: without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_device(device: torch.device) -> bool:
    """Whether ``backend="auto"`` sends the multiplicity form on ``device`` to the Triton kernels: CUDA devices.

    The one device test of :func:`dispatch` (tests replace it to check the routing of CUDA calls without a GPU).
    """
    return device.type == "cuda"


def dispatch(q: torch.Tensor, *, causal: object, scale: float | None, backend: object, method: object) -> Route:
    """The route of a call, from its arguments (``q (B, Hq, Lq, d)`` gives device, dtype and head dim).

    * ``backend="triton"``: the Triton kernels (the multiplicity form; ``method="samples"`` is refused);
    * ``backend="auto"``, ``method`` ``"multiplicity"`` or ``"auto"``, a CUDA device (:func:`triton_device`), triton
      installed and inputs it takes (float32/bfloat16/float16, ``d <= 256``): kernel ``"triton"``. With
      ``method="auto"`` the cost model decides in :func:`decide`, and every call it gives the multiplicity form
      runs the Triton kernels; the others take the per-sample path on torch's fused CUDA flash op (``"flash"``;
      the math kernel where that op refuses the inputs). That cost model was fitted on a CPU: on CUDA it is
      unfitted until measured (docs/implementation.md, "Choosing the method");
    * otherwise the torch kernels: ``backend="auto"`` is ``"flash"`` on the CPU and on CUDA (torch's fused flash op
      of the device; :func:`decide` runs the math kernel where it refuses the inputs) and ``"math"`` elsewhere;
    * ``compiled`` when ``torch.compile`` is tracing the call.

    Reads only ``q.shape``, ``q.dtype`` and ``q.device``. Validates ``causal`` (bool), ``scale`` (positive float or
    ``None``: ``1/sqrt(d)``), ``backend`` (``ops.options.BACKENDS``) and ``method`` (``ops.options.METHODS``),
    naming the argument on error.
    """
    causal = check_bool("causal", causal)
    scale_f = as_scale(scale, q.shape[-1])
    backend = check_backend(backend)
    method = check_method(method)
    compiling = torch.compiler.is_compiling()
    dtype, head_dim = q.dtype, int(q.shape[-1])
    if backend == "triton":
        if method == "samples":
            raise ValueError(
                "backend='triton' computes method='multiplicity' (or 'auto', which means it there), "
                "got method='samples'"
            )
        from positional_lsh.ops._engine.triton.host import check_triton_call  # lazy: triton is optional

        check_triton_call(q)
        return Route("multiplicity", "triton", compiling, causal, scale_f, dtype, head_dim)
    if backend == "auto" and method != "samples" and triton_device(q.device) and triton_installed():
        from positional_lsh.ops._engine.triton.host import triton_refusal

        if triton_refusal(q) is None:
            return Route(method, "triton", compiling, causal, scale_f, dtype, head_dim)
    return Route(method, resolve_backend(backend, q.device), compiling, causal, scale_f, dtype, head_dim)


def _triton() -> Backend[Any]:
    from positional_lsh.ops._engine.triton.host import TRITON  # lazy: importing it imports triton

    return TRITON


BACKEND_TABLE: dict[tuple[str, str], Callable[[], Backend[Any]]] = {
    ("samples", "flash"): lambda: PER_SAMPLE_FLASH,
    ("samples", "math"): lambda: PER_SAMPLE_MATH,
    ("multiplicity", "flash"): lambda: MULTIPLICITY_FLASH,
    ("multiplicity", "math"): lambda: MULTIPLICITY_MATH,
    ("multiplicity", "triton"): _triton,
}
"""The backends, one per (method, kernel): each row gives the object implementing
:class:`~positional_lsh.ops._engine.backend.Backend` (a function, so that a row's module is imported only when the
row is taken: the Triton row imports triton). Adding a backend is one module and one row here."""


def backend_for(method: str, kernel: str) -> Backend[Any]:
    """The backend of :data:`BACKEND_TABLE` that computes ``method`` with ``kernel``; ``ValueError`` for a pair
    without one."""
    row = BACKEND_TABLE.get((method, kernel))
    if row is None:
        raise ValueError(
            f"no backend computes method={method!r} with kernel={kernel!r}; the (method, kernel) pairs are "
            f"{sorted(BACKEND_TABLE)}"
        )
    return row()


@dataclass(frozen=True)
class Decision(Generic[P]):
    """What runs a call (see :func:`decide`).

    Attributes:
        method: the method, resolved (``"samples"`` or ``"multiplicity"``).
        kernel: the kernel that runs it (``"flash"``, ``"math"`` or ``"triton"``).
        layout: the kernel the inputs are laid out for (:func:`kernel_inputs`): the route's torch kernel, or
            ``"triton"``. It differs from ``kernel`` where ``"flash"`` runs the math kernel (the inputs keep the
            flash layout they had when that fallback was taken call by call, so the numbers stay the same).
        backend: the backend of :data:`BACKEND_TABLE` for ``(method, kernel)``.
        prepared: the backend's plan where deciding built it (``method="auto"`` estimates from the plans), so that
            :func:`plan` does not build it again; else ``None``.
    """

    method: str
    kernel: str
    layout: str
    backend: Backend[P]
    prepared: P | None = None


def _torch_kernel(kernel: str, route: Route, device: torch.device, masked: bool) -> str:
    """``"math"`` where torch's flash op of ``device`` refuses the route's inputs (``masked``: every call carries an
    additive mask), else ``kernel``."""
    if kernel != "flash":
        return kernel
    return "math" if flash_refusal(device, route.dtype, route.head_dim, masked) is not None else kernel


def decide(route: Route, partitions: Partitions, num_kv_heads: int, q_len: int, device: torch.device) -> Decision[Any]:
    """What runs the call that :func:`dispatch` routed, now that its partitions are drawn (host-side).

    * the method: ``method="auto"`` builds the per-sample plan and each head's cheapest multiplicity tiling and lets
      the cost model choose (``ops._engine.cost.auto_method``: one sample never takes the multiplicity form, it
      would compute the same pairs plus a mask); the chosen plan is kept (``Decision.prepared``). Forced methods
      are kept. A ``"triton"`` route runs the multiplicity form on the Triton kernels.
    * the kernel: the route's; the per-sample path of a ``"triton"`` route runs on the device's torch kernel
      (``resolve_backend("auto", device)``); ``"flash"`` becomes ``"math"`` where the device's flash op refuses the
      whole call (``ops._engine.kernels.flash_refusal``: on CUDA the multiplicity form, whose calls all carry the
      mask ``log c``, and inputs of a dtype or head dim the op does not take).
    * the backend: :func:`backend_for` ``(method, kernel)``.
    """
    torch_kernel = route.kernel if route.kernel != "triton" else resolve_backend("auto", device)
    method = route.method
    samples = None
    tiles = None
    if method == "auto" and auto_up_front(partitions.num_samples, partitions.num_heads, q_len) is not None:
        method = "multiplicity"  # planning the per-sample path alone would take minutes (ops._engine.cost)
    if method == "auto":
        samples = samples_plan(partitions, num_kv_heads, q_len, route.causal)
        heads = list(range(partitions.num_heads))
        if partitions.num_samples > 1:  # one sample: nothing to estimate
            tiles = tilings(partitions, heads, q_len, route.causal)
        multiplicity_ns = float("inf") if tiles is None else sum(tiles[h][0] for h in heads)
        method = auto_method(partitions.num_samples, multiplicity_ns, samples_estimate(samples))
    if method == "samples":
        kernel = _torch_kernel(torch_kernel, route, device, masked=False)
        return Decision("samples", kernel, torch_kernel, backend_for("samples", kernel), samples)
    if route.kernel == "triton":
        return Decision("multiplicity", "triton", "triton", backend_for("multiplicity", "triton"))
    kernel = _torch_kernel(torch_kernel, route, device, masked=True)
    prepared = None
    if tiles is not None:  # the tiling the cost model estimated: the plan reuses it
        heads = list(range(partitions.num_heads))
        prepared = multiplicity_plan(partitions, heads, num_kv_heads, q_len, route.causal, tiles)
    return Decision("multiplicity", kernel, torch_kernel, backend_for("multiplicity", kernel), prepared)


@dataclass(frozen=True)
class Plan(Generic[P]):
    """A call's work, host-side: the route, what :func:`decide` chose and the backend's own plan.

    Attributes:
        route: the call's :class:`Route`.
        method: the method, resolved (``"samples"`` or ``"multiplicity"``).
        kernel: the kernel that runs the plan (``Decision.kernel``).
        layout: the kernel the inputs are laid out for (``Decision.layout``; :func:`kernel_inputs`).
        partitions: the call's partitions.
        backend: the backend of :data:`BACKEND_TABLE` that runs it.
        backend_plan: that backend's plan (``P``: a ``SamplesPlan``, ``MultiplicityPlan`` or ``TritonPlan``).
    """

    route: Route
    method: str
    kernel: str
    layout: str
    partitions: Partitions
    backend: Backend[P]
    backend_plan: P


def plan(route: Route, partitions: Partitions, num_kv_heads: int, q_len: int, device: torch.device) -> Plan[Any]:
    """The plan of a call (host-side; reads the partition values): :func:`decide`, then the backend's plan (the
    one deciding built, where it did)."""
    d = decide(route, partitions, num_kv_heads, q_len, device)
    backend_plan = d.prepared
    if backend_plan is None:
        backend_plan = d.backend.plan(partitions, num_kv_heads, q_len, route.causal, device)
    return Plan(route, d.method, d.kernel, d.layout, partitions, d.backend, backend_plan)


def rows_reaching(bad: torch.Tensor, partitions: Partitions, q_len: int, causal: bool) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows that keep a ``bad`` key (``bad`` is ``(B, Hkv, Lk)``) in some sample."""
    b, hkv, lk = bad.shape
    hq = partitions.num_heads
    device = bad.device
    bad = bad.cpu()
    out = torch.zeros((b, hq, q_len), dtype=torch.bool)
    for h in range(hq):
        keys = bad[:, h // (hq // hkv)]
        j = torch.nonzero(keys.any(0)).flatten()
        if j.numel() == 0:
            continue
        lo, hi = partitions.block_span(h, j)
        if causal:
            lo = j  # rows before a key never see it
        for bi in range(b):
            sel = keys[bi, j]
            diff = torch.zeros(lk + 1, dtype=torch.long)
            diff.index_add_(0, lo[sel], torch.ones_like(lo[sel])).index_add_(0, hi[sel], -torch.ones_like(hi[sel]))
            out[bi, h] = diff.cumsum(0)[lk - q_len : lk] > 0
    return out.to(device)


def kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q, k, v`` in the kernel's layout with non-finite keys zeroed, and those keys (``nonfinite_keys``)."""
    if kernel == "triton":
        q, k, v = (x.contiguous() for x in (q, k, v))
    else:
        q, k, v = (kernel_layout(x, kernel) for x in (q, k, v))
    bad = nonfinite_keys(k, v)  # zeroed here; the rows that keep them are set to NaN by forward
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    return q, k, v, bad


def forward(
    p: Plan[Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The estimator for the plan ``p``: ``(out, lse, (q, k, v))`` with ``out`` in ``q``'s dtype, ``lse (B, Hq, Lq)``
    in the accumulation dtype (float32 from the Triton kernels), and the inputs as the kernels read them (what the
    backward needs). Rows that keep a non-finite key are NaN."""
    q, k, v, bad = kernel_inputs(q, k, v, p.layout)
    out, lse = p.backend.forward(p.backend_plan, q, k, v, p.route.scale)
    if bad is not None:
        poison_rows(out, lse, rows_reaching(bad, p.partitions, q.shape[2], p.route.causal))
    return out, lse, (q, k, v)


def backward(
    p: Plan[Any], saved: tuple[torch.Tensor, ...], dout: torch.Tensor, dist_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dist)`` from ``saved = (q, k, v, out, lse)`` (as :func:`forward` returned them) and the upstream
    gradient ``dout``: ``dq, dk, dv`` in the inputs' dtypes; with ``dist_grad``, ``dist (Hq,)`` ``= sum over batch,
    i, j of dS[b, h, i, j] * |i - j|`` with the estimator's own ``dS`` (query row ``r`` at position ``Lk - Lq + r``),
    in the accumulation dtype (float32; float64 for float64 inputs, float32 from the Triton kernels): the surrogate
    gradient of the slopes of the bias ``-m_h |i - j|`` is ``-dist``. Without ``dist_grad``: ``None``, and the same
    work and numbers as before (each backend adds one extra math pass per kernel call only when asked)."""
    return p.backend.backward(p.backend_plan, Saved(*saved), dout.contiguous(), p.route.scale, dist_grad)
