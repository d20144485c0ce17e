"""The engine behind the op: plan → forward → backward, and what every backend shares around them.

Every call of :func:`~positional_lsh.plsh_attention` (and of :class:`~positional_lsh.PositionalLSHAttention`, the
language model, the transformers swap, context parallelism) goes through here. Which backend runs is decided in one
module, :mod:`~positional_lsh.ops._engine.routing` (``dispatch`` where the inputs are known, ``decide`` from the
partitions, ``plan``); this module runs its :class:`~positional_lsh.ops._engine.routing.Plan`: :func:`forward` (the
estimator's ``(out, lse)``) and :func:`backward` (``(dq, dk, dv)`` from the merged ``out``/``lse``, and with
``dist_grad=True`` the surrogate slope gradient's ``slope_dist (Hq,)``, ``sum dS |i - j|``; ``slopes.grad =
-slope_dist``). Forward and backward apply the non-finite-key rule (``torch_attention.kernel_inputs``,
:func:`rows_reaching`) for every backend.

The backends implement one interface, :class:`~positional_lsh.ops._engine.backend.Backend` (``plan`` → ``forward``
→ ``backward``, each with a typed plan), in their own modules: :mod:`~positional_lsh.ops._engine.per_sample` (one
kernel call per group of equal blocks, merged by log-sum-exp), :mod:`~positional_lsh.ops._engine.multiplicity`
(each (query, key) pair once, with the mask ``log c``), :mod:`~positional_lsh.ops._engine.triton.host` (the
multiplicity form as Triton kernels; ``triton`` is imported only when that row is taken). Eager and compiled calls
(``ops._engine.op``) run the same :func:`forward` and :func:`backward`.
"""

from __future__ import annotations

from typing import Any

import torch

from positional_lsh.ops._engine.backend import Saved
from positional_lsh.ops._engine.routing import Plan
from positional_lsh.ops._engine.torch_attention import kernel_inputs, poison_rows, rows_keeping
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["backward", "forward", "rows_reaching"]


def rows_reaching(bad: torch.Tensor, partitions: Partitions, q_len: int, causal: bool) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows that keep a ``bad`` key (``bad`` is ``(B, Hkv, Lk)``) in some sample: a
    row's kept keys are the union of its blocks (``Partitions.block_span``; up to the row when ``causal``), searched
    by ``torch_attention.rows_keeping``."""
    lk = bad.shape[-1]
    pos = torch.arange(lk - q_len, lk)
    spans = [partitions.block_span(h, pos) for h in range(partitions.num_heads)]
    first = torch.stack([lo for lo, _ in spans])
    last = torch.stack([hi for _, hi in spans]) - 1
    if causal:
        last = torch.minimum(last, pos)
    return rows_keeping(bad, first.to(bad.device), last.to(bad.device))


def forward(
    p: Plan[Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The estimator for the plan ``p``: ``(out, lse, (q, k, v))`` with ``out`` in ``q``'s dtype, ``lse (B, Hq, Lq)``
    in the accumulation dtype (float32 from the Triton kernels), and the inputs as the kernels read them (the
    ``Layout``'s, what the backward takes). Rows that keep a non-finite key are NaN."""
    layout = kernel_inputs(q, k, v, p.kernel)
    out, lse = p.backend.forward(p.backend_plan, layout.q, layout.k, layout.v, p.route.scale)
    if layout.bad is not None:
        poison_rows(out, lse, rows_reaching(layout.bad, p.partitions, q.shape[2], p.route.causal))
    return out, lse, (layout.q, layout.k, layout.v)


def backward(
    p: Plan[Any], saved: tuple[torch.Tensor, ...], dout: torch.Tensor, dist_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, slope_dist)`` from ``saved = (q, k, v, out, lse)`` (the ``Layout``'s inputs, as
    :func:`forward` returned them, and its outputs) and the upstream gradient ``dout``: ``dq, dk, dv`` in the inputs'
    dtypes; with ``dist_grad``, ``slope_dist (Hq,)`` ``= sum over batch,
    i, j of dS[b, h, i, j] * |i - j|`` with the estimator's own ``dS`` (query row ``r`` at position ``Lk - Lq + r``),
    in the accumulation dtype (float32; float64 for float64 inputs, float32 from the Triton kernels): the surrogate
    gradient of the slopes of the bias ``-m_h |i - j|`` is ``-slope_dist``. Without ``dist_grad``: ``None``, and the
    same work and numbers as before (each backend adds one extra math pass per kernel call only when asked)."""
    return p.backend.backward(p.backend_plan, Saved(*saved), dout.contiguous(), p.route.scale, dist_grad)
