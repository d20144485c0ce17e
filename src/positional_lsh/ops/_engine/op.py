"""``torch.compile`` support: the estimator as opaque custom operators over the one engine.

:func:`~positional_lsh.plsh_attention` plans its kernel calls on the host from the partition values (``.tolist()``,
Python loops over blocks and tiles), which dynamo cannot trace. When :func:`~positional_lsh.ops._engine.engine.dispatch`
finds the call traced by ``torch.compile`` (``Route.compiled``), :func:`run` executes it as one custom operator
that the compiler treats as a black box, running the same :func:`~positional_lsh.ops._engine.engine.plan`,
:func:`~positional_lsh.ops._engine.engine.forward` and :func:`~positional_lsh.ops._engine.engine.backward` as eager
mode:

* ``positional_lsh::plsh_forward(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, kernel, method)
  -> (out, lse)``: rebuilds the :class:`~positional_lsh.Partitions` from its tensors, plans and runs the forward;
* ``positional_lsh::plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, ..., slope_grad) -> (dq, dk, dv,
  dslopes)``: the same backward as eager mode; ``dslopes`` (shaped like ``slopes``, in its dtype) is the surrogate
  slope gradient ``-dist`` when ``slope_grad`` is true, else zeros (and no extra work). Connected to the forward by
  ``torch.library.register_autograd``, which gives ``dslopes`` to the ``slopes`` input when autograd needs it
  (``ctx.needs_input_grad``): a call that wants the slope gradient passes the slopes tensor requiring grad as
  ``slopes`` (its values are those the partitions were drawn from), any other call ``partitions.slopes``. It plans
  again: nothing host-side survives between the two ops.

The partition draw under ``torch.compile`` is the custom op ``positional_lsh::sample_partitions``
(:func:`positional_lsh.ops.partitions.sampling.sample_op`).
"""

from __future__ import annotations

from typing import Any

import torch

from positional_lsh.ops._engine.engine import Plan, Route, backward, forward, kernel_inputs, plan
from positional_lsh.ops._engine.kernels import acc_dtype
from positional_lsh.ops.partitions.partition import Partitions, check_same_slopes

__all__ = ["plsh_backward", "plsh_forward", "run", "run_eager", "slope_gradient"]


def _plan_of(q: torch.Tensor, k: torch.Tensor, partitions: Partitions, route: Route) -> Plan:
    """The plan both ops start from. The estimator reads only the pitches and shifts, the scheme (integer blocks or
    not) and the length (``Lk``); a decay's tables are not needed."""
    return plan(route, partitions, k.shape[1], q.shape[2], q.device)


@torch.library.custom_op("positional_lsh::plsh_forward", mutates_args=())
def plsh_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    causal: bool,
    scale: float,
    kernel: str,
    method: str,
    expected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the estimator (see :func:`positional_lsh.ops._engine.engine.forward`). ``expected``: slopes
    that must
    equal ``slopes`` in value (``plsh_attention`` given both ``slopes=`` and ``partitions=`` under ``torch.compile``,
    where the comparison cannot run at trace time: it runs here, on the data; ``ValueError`` when they differ)."""
    if expected is not None:
        check_same_slopes(expected, slopes)
    parts = Partitions(k.shape[2], slopes, pitch, shift, scheme, max_block=max_block)
    out, lse, _ = forward(_plan_of(q, k, parts, Route(method, kernel, False, causal, scale)), q, k, v)
    return out, lse


@plsh_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)


@torch.library.custom_op("positional_lsh::plsh_backward", mutates_args=())
def plsh_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    causal: bool,
    scale: float,
    kernel: str,
    method: str,
    slope_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dslopes)`` of the estimator (see :func:`positional_lsh.ops._engine.engine.backward`): ``dslopes``
    is
    the surrogate slope gradient ``-dist`` when ``slope_grad``, else zeros; shaped like ``slopes``, in its dtype."""
    parts = Partitions(k.shape[2], slopes, pitch, shift, scheme, max_block=max_block)
    qp, kp, vp, _ = kernel_inputs(q, k, v, kernel)
    p = _plan_of(q, k, parts, Route(method, kernel, False, causal, scale))
    dq, dk, dv, dist = backward(p, (qp, kp, vp, out, lse), dout, dist_grad=slope_grad)
    if not slope_grad:
        return dq, dk, dv, torch.zeros(slopes.shape, dtype=slopes.dtype, device=slopes.device)
    return dq, dk, dv, slope_gradient(dist, slopes, kernel)


@plsh_backward.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    *_: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    dq, dk, dv, ds = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, slopes))
    return dq, dk, dv, ds


# plsh_forward's inputs: q, k, v, pitch, shift, slopes, six non-tensor arguments, then `expected`.
_SLOPES_INPUT = 5
_LATER_INPUTS = 7


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, pitch, shift, slopes, *args, _expected = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, pitch, shift, slopes)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, pitch, shift, slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    want = bool(ctx.needs_input_grad[_SLOPES_INPUT])
    dq, dk, dv, dslopes = plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, *ctx.args, want)
    return (dq, dk, dv, None, None, dslopes if want else None) + (None,) * _LATER_INPUTS


plsh_forward.register_autograd(_backward_fn, setup_context=_setup_context)


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    route: Route,
    slopes: torch.Tensor | None = None,
    expected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compiled execution of a checked call (the counterpart of :func:`positional_lsh.ops._engine.engine.run`):
    ``slopes``
    ``(Hq,)``, the values ``partitions`` were drawn from, gets the surrogate gradient when given (it is passed as the
    op's ``slopes`` input in place of ``partitions.slopes``). ``expected`` (``(Hq,)``): the caller's ``slopes=``
    given with ``partitions=``, compared with the partitions' slopes inside the op (on the data)."""
    slopes_in = partitions.slopes if slopes is None else slopes
    if expected is not None and slopes is not None:
        expected = partitions.slopes  # the learnable slopes are the op's input: compare them with the partitions'
    parts = (partitions.pitch, partitions.shift, slopes_in, partitions.scheme, partitions.max_block)
    out, _ = plsh_forward(q, k, v, *parts, route.causal, route.scale, route.kernel, route.method, expected)
    return out


def slope_gradient(dist: torch.Tensor | None, like: torch.Tensor, kernel: str) -> torch.Tensor:
    """The surrogate gradient of slopes ``like`` (a ``(Hq,)`` tensor, or one shaped like it) from :func:`backward`'s
    ``dist`` (asked for with ``dist_grad=True``): ``-dist`` in ``like``'s dtype and device.

    Never silently: a ``dist`` of ``None`` (the ``kernel``'s backward returned no slope gradient although asked)
    raises ``RuntimeError``."""
    if dist is None:
        raise RuntimeError(f"the {kernel!r} backward returned no slope gradient (dist_grad=True)")
    return (-dist).to(dtype=like.dtype, device=like.device).reshape(like.shape)


class _EngineFunction(torch.autograd.Function):
    """The eager autograd Function of every backend: :func:`forward` and :func:`backward` for one :class:`Plan`.

    ``slopes`` is ``None`` or the ``(Hq,)`` slopes tensor whose surrogate gradient is wanted: it takes no part in the
    forward (the plan's partitions were drawn from its detached values); the backward computes ``-dist`` only when
    autograd asks for its gradient (``ctx.needs_input_grad``)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor | None, p: Plan
    ) -> torch.Tensor:
        out, lse, inputs = forward(p, q, k, v)
        ctx.save_for_backward(*inputs, out, lse)
        ctx.plan = p
        # A detached stand-in of the slopes (dtype, device, shape): nothing of the graph is kept.
        ctx.slopes_like = None if slopes is None else slopes.detach()
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        want = ctx.slopes_like is not None and bool(ctx.needs_input_grad[3])
        dq, dk, dv, dist = backward(ctx.plan, ctx.saved_tensors, dout, dist_grad=want)
        if not want:
            return dq, dk, dv, None, None
        return dq, dk, dv, slope_gradient(dist, ctx.slopes_like, ctx.plan.kernel), None


def run_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    route: Route,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager execution of a checked call: plan, then the autograd Function (differentiable in ``q, k, v``, and in
    ``slopes`` (``(Hq,)``, the values ``partitions`` were drawn from) by the surrogate gradient when given)."""
    p = plan(route, partitions, k.shape[1], q.shape[2], q.device)
    return _EngineFunction.apply(q, k, v, slopes, p)
