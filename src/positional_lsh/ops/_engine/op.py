"""The estimator's one operator registration, used eager and compiled.

:func:`~positional_lsh.plsh_attention` always runs :func:`run`, which calls the custom operator
``positional_lsh::plsh_forward`` (through ``torch.ops``, in eager mode as under ``torch.compile``); its backward is
the custom operator ``positional_lsh::plsh_backward``, connected by ``torch.library.register_autograd``. Both plan
their kernel calls on the host from the partition values (``.tolist()``, Python loops over blocks and tiles), which
dynamo cannot trace: to the compiler they are black boxes (lean fakes name only the tensors that shape the
outputs), and they run the same :func:`~positional_lsh.ops._engine.routing.plan`,
:func:`~positional_lsh.ops._engine.engine.forward` and :func:`~positional_lsh.ops._engine.engine.backward` in both
modes:

* ``plsh_forward(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, method, samples_kernel,
  multiplicity_kernel, key_padding_mask=None, expected=None) -> (out, lse)``: the route that
  ``ops._engine.routing.dispatch`` decided where the inputs are known (the method asked for and each method's kernel,
  ``""`` for a method the call may not take: :func:`route_args`, :func:`route_of`); rebuilds the
  :class:`~positional_lsh.Partitions` from its tensors, plans and runs the forward. With a ``key_padding_mask``
  (:mod:`positional_lsh.ops.padding`), each group of batch rows with one run of valid keys is planned and run on that
  run; padded query rows get ``out = 0`` and ``lse = -inf``. ``expected``: slopes that must equal ``slopes`` in value
  (compared here, on the data: under ``torch.compile`` the comparison cannot run at trace time);
* ``plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, ..., slope_grad=False, laid_out=False,
  key_padding_mask=None) -> (dq, dk, dv, dslopes)`` (its schema derived from the forward's,
  ``ops._engine.custom_op.backward_schema``): ``dslopes`` (shaped like ``slopes``, in its dtype) is the surrogate
  slope gradient ``-slope_dist`` when ``slope_grad`` is true, else zeros (and no extra work). ``register_autograd``
  asks for it only when autograd needs the gradient of the ``slopes`` input (``ctx.needs_input_grad``): a call that
  learns the slopes passes the slopes tensor requiring grad as ``slopes`` (its values are those the partitions were
  drawn from), any other call ``partitions.slopes``.

The backward plans from its inputs, as the forward did, and finds the forward's plan in a small cache keyed by the
values of every argument of the plan (:data:`PLAN_CACHE_SIZE`); an eager forward also hands it its kernel layout
(``ops._engine.custom_op.keep_layout``: ``q, k, v`` as laid out, non-finite keys zeroed). The inputs are read by
name (:data:`FORWARD_INPUTS`), never by position.

The partition draw under ``torch.compile`` is the custom op ``positional_lsh::sample_partitions``
(:func:`positional_lsh.ops.partitions.sampling.sample_op`).
"""

from __future__ import annotations

from typing import Any

import torch

from positional_lsh.ops._engine.custom_op import attention_op, backward_impl, backward_schema, keep_layout
from positional_lsh.ops._engine.engine import backward, forward
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.lru import LruCache
from positional_lsh.ops._engine.routing import Plan, Route, plan
from positional_lsh.ops._engine.torch_attention import Grad, acc_dtype, kernel_inputs
from positional_lsh.ops.padding import forward_row_groups, group_backward_inputs, row_groups, scatter_group_grads
from positional_lsh.ops.partitions.partition import Partitions, check_same_slopes

__all__ = [
    "FORWARD_INPUTS", "PLAN_CACHE_SIZE", "PLSH_OP", "plsh_backward", "plsh_forward", "route_args", "route_of", "run",
    "slope_gradient",
]  # fmt: skip


#: How many plans :func:`_plan_of` keeps (the most recently used): the backward of a call finds its forward's.
PLAN_CACHE_SIZE = 8
_PLANS: LruCache[Plan] = LruCache(PLAN_CACHE_SIZE)


def _plan_of(
    q_len: int,
    k: torch.Tensor,
    k_len: int,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scheme: str,
    max_block: int | None,
    route: Route,
) -> Plan:
    """The plan of a call (or of one row group) of ``q_len`` queries on ``k_len`` keys. The estimator reads only the
    pitches and shifts, the scheme (integer blocks or not) and the length; a decay's tables are not needed.

    A plan is a function of its arguments' values alone, so the last :data:`PLAN_CACHE_SIZE` are kept, keyed by
    every one of them (the partition tensors by their bytes, never by identity): the backward op finds the plan
    of its forward (at n = 256, T = 8 planning is about 0.4 ms per-sample and 0.75 ms multiplicity, some 10 % of a
    forward and backward on the CPU)."""
    pitch, shift, slopes = (x.detach().to("cpu", torch.float64) for x in tensors)
    values = tuple(x.numpy().tobytes() for x in (pitch, shift, slopes))
    key = (route, scheme, max_block, k_len, q_len, k.shape[1], str(k.device), tuple(pitch.shape), *values)

    def build() -> Plan:
        parts = Partitions(k_len, slopes, pitch, shift, scheme, max_block=max_block)
        return plan(route, parts, k.shape[1], q_len, k.device)

    return _PLANS.get(key, build)


def _plsh_forward(
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
    method: str,
    samples_kernel: str,
    multiplicity_kernel: str,
    key_padding_mask: torch.Tensor | None = None,
    expected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the estimator (see :func:`positional_lsh.ops._engine.engine.forward`), row group by row
    group with a ``key_padding_mask``. ``expected``: slopes that must equal ``slopes`` in value (``plsh_attention``
    given both ``slopes=`` and ``partitions=`` under ``torch.compile``; ``ValueError`` when they differ)."""
    if expected is not None:
        check_same_slopes(expected, slopes)
    route = route_of(method, samples_kernel, multiplicity_kernel, causal, scale)
    tensors = (pitch, shift, slopes)
    groups = row_groups(key_padding_mask, q.shape[2])
    if groups is None:
        out, lse, laid = forward(_plan_of(q.shape[2], k, k.shape[2], tensors, scheme, max_block, route), q, k, v)
        keep_layout(out, (q, k, v, slopes), laid)  # the backward's q, k, v (ops._engine.custom_op)
        return out, lse

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        og, lg, _ = forward(_plan_of(qg.shape[2], k, kg.shape[2], tensors, scheme, max_block, route), qg, kg, vg)
        return og, lg

    return forward_row_groups(q, k, v, groups, attend, scale)


def _plsh_backward(grad: Grad, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dslopes)`` of :func:`plsh_forward` (see :func:`positional_lsh.ops._engine.engine.backward`)
    from ``grad`` (``dout, q, k, v, out, lse``) and ``a``, the backward op's other arguments by name (the forward's
    tensors and settings, ``slope_grad``, ``laid_out``, ``key_padding_mask``; ``ops._engine.custom_op``), row group by
    row group with a ``key_padding_mask`` (padded positions get zero gradients): ``dslopes`` is the surrogate slope
    gradient ``-slope_dist`` when ``slope_grad``, else zeros; shaped like ``slopes``, in its dtype. ``laid_out``:
    ``q, k, v`` are the forward's kernel layout (``ops._engine.custom_op.keep_layout``), taken as they are."""
    dout, q, k, v, out, lse = grad
    route = route_of(a["method"], a["samples_kernel"], a["multiplicity_kernel"], a["causal"], a["scale"])
    tensors = (a["pitch"], a["shift"], a["slopes"])
    slopes, scheme, max_block, slope_grad = a["slopes"], a["scheme"], a["max_block"], a["slope_grad"]
    scale = a["scale"]
    groups = row_groups(a["key_padding_mask"], q.shape[2])
    if groups is None:
        p = _plan_of(q.shape[2], k, k.shape[2], tensors, scheme, max_block, route)
        qp, kp, vp = (q, k, v) if a["laid_out"] else kernel_inputs(q, k, v, p.kernel)[:3]
        dq, dk, dv, slope_dist = backward(p, (qp, kp, vp, out, lse), dout, dist_grad=slope_grad)
    else:
        dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # as the fake
        slope_dist = torch.zeros(q.shape[1], dtype=acc_dtype(q.dtype), device=q.device) if slope_grad else None
        for g in groups:
            gs = group_backward_inputs(g, (q, k, v, out, lse), dout, scale)
            p = _plan_of(gs.q.shape[2], k, gs.k.shape[2], tensors, scheme, max_block, route)
            qp, kp, vp, _ = kernel_inputs(gs.q, gs.k, gs.v, p.kernel)
            gq, gk, gv, gd = backward(p, (qp, kp, vp, gs.out, gs.lse), gs.dout, dist_grad=slope_grad)
            scatter_group_grads(g, (dq, dk, dv), (gq, gk, gv))
            if slope_dist is not None:
                slope_dist -= slope_gradient(gd, slope_dist, p.kernel)  # the group's (slope_gradient is -slope_dist)
    if not slope_grad:
        return dq, dk, dv, torch.zeros(slopes.shape, dtype=slopes.dtype, device=slopes.device)
    return dq, dk, dv, slope_gradient(slope_dist, slopes, route.method)


plsh_forward = torch.library.custom_op("positional_lsh::plsh_forward", _plsh_forward, mutates_args=())
_TENSORS = ("pitch", "shift", "slopes")
_SETTINGS = ("scheme", "max_block", "causal", "scale", "method", "samples_kernel", "multiplicity_kernel")
_BACKWARD = backward_schema(_plsh_forward, tensors=_TENSORS, settings=_SETTINGS, flags=("slope_grad",))
plsh_backward = torch.library.custom_op(
    "positional_lsh::plsh_backward", backward_impl(_plsh_backward, _BACKWARD), mutates_args=(), schema=_BACKWARD
)
PLSH_OP = attention_op(
    plsh_forward, _plsh_forward, plsh_backward, _BACKWARD, tensors=_TENSORS, settings=_SETTINGS,
    grads=("q", "k", "v", "slopes"), flags=lambda need: {"slope_grad": need["slopes"]},
)  # fmt: skip
"""The estimator's op pair on the one scaffold (``ops._engine.custom_op``): fakes, ``setup_context`` and the
autograd backward, inputs read by name."""

#: The names of ``plsh_forward``'s inputs, in order: ``setup_context`` and the backward read and return them by
#: name.
FORWARD_INPUTS: tuple[str, ...] = PLSH_OP.inputs


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    route: Route,
    slopes: torch.Tensor | None = None,
    expected: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """A checked call, eager or compiled: :func:`plsh_forward` through ``torch.ops``. ``slopes`` ``(Hq,)``, the
    values ``partitions`` were drawn from, gets the surrogate gradient when given (it is passed as the op's
    ``slopes`` input in place of ``partitions.slopes``). ``expected`` (``(Hq,)``): the caller's ``slopes=`` given
    with ``partitions=`` under ``torch.compile``, compared with the partitions' slopes inside the op (on the data).
    ``key_padding_mask``: ``None`` or a checked ``(B, Lk)`` bool mask (:mod:`positional_lsh.ops.padding`)."""
    slopes_in = partitions.slopes if slopes is None else slopes
    if expected is not None and slopes is not None:
        expected = partitions.slopes  # the learnable slopes are the op's input: compare them with the partitions'
    out, _ = plsh_forward(
        q, k, v, partitions.pitch, partitions.shift, slopes_in, partitions.scheme, partitions.max_block,
        route.causal, route.scale, *route_args(route), key_padding_mask=key_padding_mask, expected=expected,
    )  # fmt: skip
    return out


def route_args(route: Route) -> tuple[str, str, str]:
    """The op's ``(method, samples_kernel, multiplicity_kernel)`` arguments of ``route`` (``""``: no kernel)."""
    return (
        route.method.value,
        "" if route.samples is None else route.samples.value,
        "" if route.multiplicity is None else route.multiplicity.value,
    )


def route_of(method: str, samples_kernel: str, multiplicity_kernel: str, causal: bool, scale: float) -> Route:
    """The :class:`~positional_lsh.ops._engine.routing.Route` of the op's arguments (:func:`route_args`'s inverse;
    ``compiled`` is ``False``: inside the op the call runs)."""
    samples = Kernel(samples_kernel) if samples_kernel else None
    multiplicity = Kernel(multiplicity_kernel) if multiplicity_kernel else None
    return Route(Method(method), samples, multiplicity, False, causal, scale)


def slope_gradient(slope_dist: torch.Tensor | None, like: torch.Tensor, kernel: str) -> torch.Tensor:
    """The surrogate gradient of slopes ``like`` (a ``(Hq,)`` tensor, or one shaped like it) from
    :func:`~positional_lsh.ops._engine.engine.backward`'s ``slope_dist`` (asked for with ``dist_grad=True``):
    ``-slope_dist`` in ``like``'s dtype and device.

    Never silently: a ``slope_dist`` of ``None`` (the ``kernel``'s backward returned no slope gradient although asked)
    raises ``RuntimeError``."""
    if slope_dist is None:
        raise RuntimeError(f"the {kernel!r} backward returned no slope gradient (dist_grad=True)")
    return (-slope_dist).to(dtype=like.dtype, device=like.device).reshape(like.shape)
