"""One engine behind the op: the backends of the estimator, the one dispatch, and the eager autograd Function.

Every call of :func:`~positional_lsh.plsh_attention` (and of :class:`~positional_lsh.PositionalLSHAttention`, the
language model, the transformers swap, context parallelism) goes through here:

1. :func:`dispatch` — the one place that decides *how* a call runs, from the arguments alone (method × device ×
   dtype × compile state): a :class:`Route` naming the backend (``"samples"``, ``"multiplicity"``, or ``"auto"``:
   decided per call by the cost model at plan time), the kernel (``"flash"``, ``"math"`` or ``"triton"``) and
   whether the call goes through the ``torch.compile`` custom ops (:mod:`positional_lsh.ops._engine.op`).
2. :func:`plan` — host-side, from the partition values: the backend's plan (``method="auto"`` resolved here).
3. :func:`forward` — the estimator's ``(out, lse)``; :func:`backward` — ``(dq, dk, dv)`` from the merged
   ``out``/``lse``, and with ``dist_grad=True`` the surrogate slope gradient's ``dist (Hq,)``
   (``sum dS |i - j|``; ``slopes.grad = -dist``). Both apply the non-finite-key rule
   (``ops._engine.kernels.nonfinite_keys``) for every backend.

The backends share one small interface — ``*_plan`` → ``*_forward`` → ``*_backward`` — and live in their own
modules: :mod:`~positional_lsh.ops._engine.per_sample` (one kernel call per group of equal blocks, merged by
log-sum-exp), :mod:`~positional_lsh.ops._engine.multiplicity` (each (query, key) pair once, with the mask ``log c``),
:mod:`~positional_lsh.ops._engine.triton.host` (the multiplicity form as Triton kernels; ``triton`` is imported
only when that route is taken). Eager calls run :func:`run` (a ``torch.autograd.Function``); compiled calls run the
custom ops, which call the same :func:`plan`, :func:`forward` and :func:`backward`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from positional_lsh.ops._checks import as_scale, check_bool
from positional_lsh.ops._engine.kernels import acc_dtype, kernel_layout, nonfinite_keys, poison_rows, resolve_backend
from positional_lsh.ops._engine.multiplicity import (
    AUTO_MARGIN,
    multiplicity_backward,
    multiplicity_forward,
    multiplicity_plan,
    tilings,
)
from positional_lsh.ops._engine.per_sample import samples_backward, samples_cost, samples_forward, samples_plan
from positional_lsh.ops.options import check_backend, check_method
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "Plan", "Route", "backward", "dispatch", "forward", "kernel_inputs", "plan", "rows_reaching", "triton_device",
    "triton_installed",
]  # fmt: skip


@dataclass(frozen=True)
class Route:
    """How a call runs (see :func:`dispatch`).

    Attributes:
        method: ``"samples"``, ``"multiplicity"``, or ``"auto"`` (the cost model decides at :func:`plan` time).
        kernel: ``"flash"`` (torch's fused flash op of the device: CPU or CUDA), ``"math"`` (batched matmuls) or
            ``"triton"`` (the multiplicity form on the Triton kernels; with ``method="auto"`` the per-sample path,
            where the cost model picks it, runs on the device's torch kernel).
        compiled: whether the call is traced by ``torch.compile`` (then it runs the custom ops).
        causal: the causal mask.
        scale: the score scale.
    """

    method: str
    kernel: str
    compiled: bool
    causal: bool
    scale: float


def triton_installed() -> bool:
    """Whether triton can be imported (``find_spec``: without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_device(device: torch.device) -> bool:
    """Whether ``backend="auto"`` sends the multiplicity form on ``device`` to the Triton kernels: CUDA devices.

    The one device test of :func:`dispatch` (tests replace it to check the routing of CUDA calls without a GPU).
    """
    return device.type == "cuda"


def dispatch(q: torch.Tensor, *, causal: object, scale: float | None, backend: object, method: object) -> Route:
    """The one decision of how a call runs, from its arguments (``q (B, Hq, Lq, d)`` gives device and dtype).

    * ``backend="triton"``: the Triton kernels (the multiplicity form; ``method="samples"`` is refused);
    * ``backend="auto"``, ``method`` ``"multiplicity"`` or ``"auto"``, a CUDA device (:func:`triton_device`), triton
      installed and inputs it takes (float32/bfloat16/float16, ``d <= 256``): kernel ``"triton"``. With
      ``method="auto"`` the cost model decides at :func:`plan` time, and every call it gives the multiplicity form
      runs the Triton kernels; the others take the per-sample path on torch's fused CUDA flash op (``"flash"``;
      the math backend where that op refuses the inputs). That cost model was fitted on a CPU: on CUDA it is
      unfitted until measured (docs/implementation.md, "Choosing the method");
    * otherwise the torch kernels: ``backend="auto"`` is ``"flash"`` on the CPU and on CUDA (torch's fused flash op
      of the device, with the math backend where it refuses the inputs) and ``"math"`` elsewhere;
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
    if backend == "triton":
        if method == "samples":
            raise ValueError(
                "backend='triton' computes method='multiplicity' (or 'auto', which means it there), "
                "got method='samples'"
            )
        from positional_lsh.ops._engine.triton.host import check_triton_call  # lazy: triton is optional

        check_triton_call(q)
        return Route("multiplicity", "triton", compiling, causal, scale_f)
    if backend == "auto" and method != "samples" and triton_device(q.device) and triton_installed():
        from positional_lsh.ops._engine.triton.host import triton_refusal

        if triton_refusal(q) is None:
            return Route(method, "triton", compiling, causal, scale_f)
    return Route(method, resolve_backend(backend, q.device), compiling, causal, scale_f)


@dataclass(frozen=True)
class Plan:
    """A call's work, host-side: the partitions, the resolved method, the backend's plan and its kernel.

    ``work`` is a list of :class:`~positional_lsh.ops._engine.per_sample.HeadWork` (``method="samples"``), a
    :class:`~positional_lsh.ops._engine.multiplicity.MultiplicityPlan` (``"multiplicity"``, torch kernels) or the
    :class:`~positional_lsh.ops._engine.triton.plan.TritonWork` of
    :func:`~positional_lsh.ops._engine.triton.host.triton_plan` (Triton kernels). ``kernel`` is the kernel the plan
    runs on: the route's, except for a ``"triton"`` route whose ``method="auto"`` chose the per-sample path (then
    the device's torch kernel, ``resolve_backend("auto", device)``).
    """

    route: Route
    method: str
    partitions: Partitions
    work: object
    kernel: str


def plan(route: Route, partitions: Partitions, num_kv_heads: int, q_len: int, device: torch.device) -> Plan:
    """The backend's plan of a call (host-side; reads the partition values). ``method="auto"`` is resolved here:
    one sample never takes the multiplicity form (it computes the same pairs plus a mask), otherwise the cost model
    decides (see ``_auto_tiles``); on a ``"triton"`` route the multiplicity form is the Triton kernels."""
    causal = route.causal
    heads = list(range(partitions.num_heads))
    method = route.method
    if route.kernel == "triton":
        if method == "auto":
            samples = samples_plan(partitions, num_kv_heads, q_len, causal)
            if _auto_tiles(partitions, heads, num_kv_heads, q_len, causal, samples) is None:
                return Plan(route, "samples", partitions, samples, resolve_backend("auto", device))
        from positional_lsh.ops._engine.triton.host import triton_plan

        return Plan(route, "multiplicity", partitions, triton_plan(partitions, q_len, causal, device), "triton")
    if method == "multiplicity":
        mplan = multiplicity_plan(partitions, heads, num_kv_heads, q_len, causal)
        return Plan(route, method, partitions, mplan, route.kernel)
    samples = samples_plan(partitions, num_kv_heads, q_len, causal)
    if method == "auto":
        tiles = _auto_tiles(partitions, heads, num_kv_heads, q_len, causal, samples)
        if tiles is not None:
            mplan = multiplicity_plan(partitions, heads, num_kv_heads, q_len, causal, tiles)
            return Plan(route, "multiplicity", partitions, mplan, route.kernel)
    return Plan(route, "samples", partitions, samples, route.kernel)


def _auto_tiles(
    partitions: Partitions,
    heads: list[int],
    num_kv_heads: int,
    q_len: int,
    causal: bool,
    samples: list | None = None,
) -> dict | None:
    """``method="auto"``: the tiling of the multiplicity form when the cost model picks it, else ``None``.

    The multiplicity form when the sum of its per-head estimates is at most ``AUTO_MARGIN`` times the per-sample
    path's; never for one sample. Decided once per call, for all heads (a per-head split measured slower than either
    method alone at n = 16384, T = 8; docs/implementation.md). The constants were fitted on the CPU; the same
    decision routes CUDA calls (Triton kernels or the fused flash op), unfitted there.
    """
    if partitions.num_samples <= 1:
        return None
    if samples is None:
        samples = samples_plan(partitions, num_kv_heads, q_len, causal)
    tiles = tilings(partitions, heads, q_len, causal)
    if sum(tiles[h][0] for h in heads) <= AUTO_MARGIN * samples_cost(samples, q_len):
        return tiles
    return None


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
    p: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The estimator for the plan ``p``: ``(out, lse, (q, k, v))`` with ``out`` in ``q``'s dtype, ``lse (B, Hq, Lq)``
    in the accumulation dtype (float32 from the Triton kernels), and the inputs as the kernels read them (what the
    backward needs). Rows that keep a non-finite key are NaN."""
    route = p.route
    q, k, v, bad = kernel_inputs(q, k, v, p.kernel)
    if p.kernel == "triton":
        from positional_lsh.ops._engine.triton.host import triton_forward

        out, lse = triton_forward(p.work, q, k, v, route.causal, route.scale)  # type: ignore[arg-type]
    else:
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        if p.method == "samples":
            samples_forward(p.work, q, k, v, out, lse, route.causal, route.scale, p.kernel)  # type: ignore[arg-type]
        else:
            multiplicity_forward(p.work, q, k, v, out, lse, route.scale, p.kernel)  # type: ignore[arg-type]
    if bad is not None:
        poison_rows(out, lse, rows_reaching(bad, p.partitions, q.shape[2], route.causal))
    return out.to(q.dtype), lse, (q, k, v)


def backward(
    p: Plan, saved: tuple[torch.Tensor, ...], dout: torch.Tensor, dist_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dist)`` from ``saved = (q, k, v, out, lse)`` (as :func:`forward` returned them) and the upstream
    gradient ``dout``: ``dq, dk, dv`` in the inputs' dtypes; with ``dist_grad``, ``dist (Hq,)`` ``= sum over batch,
    i, j of dS[b, h, i, j] * |i - j|`` with the estimator's own ``dS`` (query row ``r`` at position ``Lk - Lq + r``),
    in the accumulation dtype (float32; float64 for float64 inputs): the surrogate gradient of the slopes of the
    bias ``-m_h |i - j|`` is ``-dist``. Without ``dist_grad``: ``None``, and the same work and numbers as before
    (each backend adds one extra math pass per kernel call only when asked)."""
    route = p.route
    dout = dout.contiguous()
    if p.kernel == "triton":
        from positional_lsh.ops._engine.triton import host as triton_multiplicity  # lazy: triton is optional

        work: Any = p.work  # the TritonWork of triton_plan
        return triton_multiplicity.triton_backward(work, saved, dout, route.causal, route.scale, dist_grad=dist_grad)
    q, k, v = saved[:3]
    acc = acc_dtype(q.dtype)
    grads = (
        torch.zeros(q.shape, dtype=acc, device=q.device),
        torch.zeros(k.shape, dtype=acc, device=q.device),
        torch.zeros(v.shape, dtype=acc, device=q.device),
    )
    dist = torch.zeros(q.shape[1], dtype=acc, device=q.device) if dist_grad else None
    if p.method == "samples":
        samples_backward(p.work, saved, dout, grads, route.causal, route.scale, p.kernel, dist)  # type: ignore[arg-type]
    else:
        multiplicity_backward(p.work, saved, dout, grads, route.scale, p.kernel, dist)  # type: ignore[arg-type]
    dq, dk, dv = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dist
