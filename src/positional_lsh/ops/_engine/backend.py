"""The one interface of the estimator's backends: :class:`Backend`, and what its three steps exchange.

A backend computes the estimator one way — one (method, kernel) row of the engine's table
(``ops._engine.engine.BACKEND_TABLE``) — in three steps with one signature for all of them:

* ``plan(partitions, num_kv_heads, q_len, causal, device) -> P``: host-side, from the partition values, the
  backend's own typed plan of one call (``P``: :class:`~positional_lsh.ops._engine.per_sample.SamplesPlan`,
  :class:`~positional_lsh.ops._engine.multiplicity.MultiplicityPlan`,
  :class:`~positional_lsh.ops._engine.triton.plan.TritonPlan`). The plan holds ``causal``: the later steps read it
  there.
* ``forward(plan, q, k, v, scale) -> (out, lse)``: ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)`` as
  ``ops._engine.torch_attention.kernel_inputs`` laid them out (non-finite keys zeroed); ``out`` in ``q``'s dtype, ``lse
  (B, Hq, Lq)`` in the accumulation dtype (``ops._engine.torch_attention.acc_dtype``; float32 from the Triton kernels).
* ``backward(plan, saved, dout, scale, dist_grad) -> (dq, dk, dv, slope_dist)``: :class:`Saved` is what ``forward``
  took and returned, ``dout`` the upstream gradient (contiguous); ``dq, dk, dv`` in the inputs' dtypes and, with
  ``dist_grad``, ``slope_dist (Hq,)`` in the accumulation dtype: the slope-gradient partial ``slope_dist[h] = sum over
  batch, i, j of dS[b, h, i, j] |i - j|`` with the estimator's own ``dS`` (query row ``r`` at position ``Lk - Lq +
  r``; the surrogate gradient of the slopes of the bias ``-m_h |i - j|`` is ``-slope_dist``; not torch.distributed).
  Without ``dist_grad``: ``None``, and
  no extra work.

The engine adds what every backend shares (the non-finite-key rule, the dtype of ``dout``) around these steps, and
``ops._engine.routing`` decides which backend runs (``dispatch``: each backend's refusal, up front; ``decide``).
Adding a backend is one module with an object that implements this protocol, one row of the table and one of the
priority list.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, TypeVar

import torch

from positional_lsh.ops._engine.torch_attention import acc_dtype
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["Backend", "Gradients", "Saved", "accumulators"]

P = TypeVar("P")


class Saved(NamedTuple):
    """What the backward needs of a call: the inputs as the forward read them and its ``(out, lse)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(dq, dk, dv, slope_dist)``: a backward's result (``slope_dist`` ``None`` unless asked for)."""


class Backend(Protocol[P]):
    """One way of computing the estimator (see the module docstring); ``P`` is its plan's type.

    Attributes:
        method: the method it computes (``"samples"`` or ``"multiplicity"``).
        kernel: the kernel it runs (``"flash"``, ``"math"`` or ``"triton"``).
    """

    @property
    def method(self) -> str: ...

    @property
    def kernel(self) -> str: ...

    def plan(self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device) -> P:
        """The backend's plan of one call (host-side, from the partition values)."""
        ...

    def forward(
        self, plan: P, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the call."""
        ...

    def backward(self, plan: P, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool) -> Gradients:
        """``(dq, dk, dv, slope_dist)`` of the call."""
        ...


def accumulators(
    saved: Saved, dist_grad: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """Zeroed ``(dq, dk, dv)`` shaped like ``saved``'s inputs and ``slope_dist (Hq,)`` (when ``dist_grad``) in the
    accumulation dtype: what the torch backends add their kernel calls' gradients into."""
    q, k, v = saved.q, saved.k, saved.v
    acc = acc_dtype(q.dtype)
    grads = (
        torch.zeros(q.shape, dtype=acc, device=q.device),
        torch.zeros(k.shape, dtype=acc, device=q.device),
        torch.zeros(v.shape, dtype=acc, device=q.device),
    )
    slope_dist = torch.zeros(q.shape[1], dtype=acc, device=q.device) if dist_grad else None
    return grads, slope_dist
