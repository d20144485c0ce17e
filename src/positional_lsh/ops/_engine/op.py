"""The estimator's one operator registration, used eager and compiled.

:func:`~positional_lsh.plsh_attention` always runs :func:`run`, which calls the custom operator
``positional_lsh::plsh_forward`` (through ``torch.ops``, in eager mode as under ``torch.compile``); its backward is
the custom operator ``positional_lsh::plsh_backward``, connected by ``torch.library.register_autograd``. Both plan
their kernel calls on the host from the partition values (``.tolist()``, Python loops over blocks and tiles), which
dynamo cannot trace: to the compiler they are black boxes (lean fakes name only the tensors that shape the
outputs), and they run the same :func:`~positional_lsh.ops._engine.engine.plan`,
:func:`~positional_lsh.ops._engine.engine.forward` and :func:`~positional_lsh.ops._engine.engine.backward` in both
modes:

* ``plsh_forward(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, kernel, method,
  key_padding_mask=None, expected=None) -> (out, lse)``: rebuilds the :class:`~positional_lsh.Partitions` from its
  tensors, plans and runs the forward. With a ``key_padding_mask`` (:mod:`positional_lsh.ops.padding`), each group
  of batch rows with one run of valid keys is planned and run on that run; padded query rows get ``out = 0`` and
  ``lse = -inf``. ``expected``: slopes that must equal ``slopes`` in value (compared here, on the data: under
  ``torch.compile`` the comparison cannot run at trace time);
* ``plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, ..., slope_grad=False, key_padding_mask=None) ->
  (dq, dk, dv, dslopes)``: ``dslopes`` (shaped like ``slopes``, in its dtype) is the surrogate slope gradient
  ``-dist`` when ``slope_grad`` is true, else zeros (and no extra work). ``register_autograd`` asks for it only
  when autograd needs the gradient of the ``slopes`` input (``ctx.needs_input_grad``): a call that learns the
  slopes passes the slopes tensor requiring grad as ``slopes`` (its values are those the partitions were drawn
  from), any other call ``partitions.slopes``.

Nothing host-side passes between the two ops: the backward plans from its inputs, as the forward did, and finds the
forward's plan in a small cache keyed by the values of every argument of the plan (:data:`PLAN_CACHE_SIZE`). The
inputs are read by name (:data:`FORWARD_INPUTS`), never by position.

The partition draw under ``torch.compile`` is the custom op ``positional_lsh::sample_partitions``
(:func:`positional_lsh.ops.partitions.sampling.sample_op`).
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from typing import Any

import torch

from positional_lsh.ops._engine.engine import Plan, Route, backward, forward, kernel_inputs, plan
from positional_lsh.ops._engine.kernels import acc_dtype, output_buffers
from positional_lsh.ops.padding import RowGroup, forward_row_groups, row_groups
from positional_lsh.ops.partitions.partition import Partitions, check_same_slopes

__all__ = ["FORWARD_INPUTS", "PLAN_CACHE_SIZE", "plsh_backward", "plsh_forward", "run", "slope_gradient"]


#: How many plans :func:`_plan_of` keeps (the most recently used): the backward of a call finds its forward's.
PLAN_CACHE_SIZE = 8
_PLANS: OrderedDict[tuple[object, ...], Plan] = OrderedDict()
_PLANS_LOCK = threading.Lock()


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
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    parts = Partitions(k_len, slopes, pitch, shift, scheme, max_block=max_block)
    p = plan(route, parts, k.shape[1], q_len, k.device)
    with _PLANS_LOCK:
        _PLANS[key] = p
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return p


def _group(x: torch.Tensor, g: RowGroup, positions: slice) -> torch.Tensor:
    """``x (B, H, L, ...)``'s batch rows ``g.rows`` at ``positions``."""
    return x[g.rows][:, :, positions]


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
    kernel: str,
    method: str,
    key_padding_mask: torch.Tensor | None = None,
    expected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the estimator (see :func:`positional_lsh.ops._engine.engine.forward`), row group by row
    group with a ``key_padding_mask``. ``expected``: slopes that must equal ``slopes`` in value (``plsh_attention``
    given both ``slopes=`` and ``partitions=`` under ``torch.compile``; ``ValueError`` when they differ)."""
    if expected is not None:
        check_same_slopes(expected, slopes)
    route = Route(method, kernel, False, causal, scale)
    tensors = (pitch, shift, slopes)
    groups = row_groups(key_padding_mask, q.shape[2])
    if groups is None:
        out, lse, _ = forward(_plan_of(q.shape[2], k, k.shape[2], tensors, scheme, max_block, route), q, k, v)
        return out, lse

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        og, lg, _ = forward(_plan_of(qg.shape[2], k, kg.shape[2], tensors, scheme, max_block, route), qg, kg, vg)
        return og, lg

    return forward_row_groups(q, k, v, groups, attend)


#: The names of ``plsh_forward``'s inputs, in order: ``setup_context`` and the backward read and return them by
#: name.
FORWARD_INPUTS: tuple[str, ...] = tuple(inspect.signature(_plsh_forward).parameters)

plsh_forward = torch.library.custom_op("positional_lsh::plsh_forward", _plsh_forward, mutates_args=())


@plsh_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    return output_buffers(q, empty=True)


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
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dslopes)`` of :func:`plsh_forward` (see :func:`positional_lsh.ops._engine.engine.backward`),
    row group by row group with a ``key_padding_mask`` (padded positions get zero gradients): ``dslopes`` is the
    surrogate slope gradient ``-dist`` when ``slope_grad``, else zeros; shaped like ``slopes``, in its dtype."""
    route = Route(method, kernel, False, causal, scale)
    tensors = (pitch, shift, slopes)
    groups = row_groups(key_padding_mask, q.shape[2])
    if groups is None:
        p = _plan_of(q.shape[2], k, k.shape[2], tensors, scheme, max_block, route)
        qp, kp, vp, _ = kernel_inputs(q, k, v, kernel)
        dq, dk, dv, dist = backward(p, (qp, kp, vp, out, lse), dout, dist_grad=slope_grad)
    else:
        dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # as the fake
        dist = torch.zeros(q.shape[1], dtype=acc_dtype(q.dtype), device=q.device) if slope_grad else None
        for g in groups:
            qg, kg, vg = _group(q, g, g.queries), _group(k, g, g.keys), _group(v, g, g.keys)
            p = _plan_of(qg.shape[2], k, kg.shape[2], tensors, scheme, max_block, route)
            qp, kp, vp, _ = kernel_inputs(qg, kg, vg, kernel)
            saved = (qp, kp, vp, _group(out, g, g.queries).contiguous(), _group(lse, g, g.queries).contiguous())
            gq, gk, gv, gd = backward(p, saved, _group(dout, g, g.queries), dist_grad=slope_grad)
            dq[g.rows, :, g.queries] = gq
            dk[g.rows, :, g.keys] = gk
            dv[g.rows, :, g.keys] = gv
            if dist is not None:
                dist -= slope_gradient(gd, dist, kernel)  # the group's dist (slope_gradient is -dist)
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
    **__: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    dq, dk, dv, ds = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, slopes))
    return dq, dk, dv, ds


# The forward's settings the backward takes as they are (its other inputs are tensors saved for it).
_SETTINGS = ("scheme", "max_block", "causal", "scale", "kernel", "method")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    args = dict(zip(FORWARD_INPUTS, inputs, strict=True))
    out, lse = output
    names = ("q", "k", "v", "pitch", "shift", "slopes")
    ctx.save_for_backward(*(args[n] for n in names), out, lse, args["key_padding_mask"])
    ctx.settings = {n: args[n] for n in _SETTINGS}
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, pitch, shift, slopes, out, lse, mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    want = bool(ctx.needs_input_grad[FORWARD_INPUTS.index("slopes")])
    dq, dk, dv, dslopes = plsh_backward(
        dout, q, k, v, out, lse, pitch, shift, slopes, **ctx.settings, slope_grad=want, key_padding_mask=mask
    )
    grads = {"q": dq, "k": dk, "v": dv, "slopes": dslopes if want else None}
    return tuple(grads.get(name) for name in FORWARD_INPUTS)


plsh_forward.register_autograd(_backward_fn, setup_context=_setup_context)


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
        route.causal, route.scale, route.kernel, route.method, key_padding_mask=key_padding_mask, expected=expected,
    )  # fmt: skip
    return out


def slope_gradient(dist: torch.Tensor | None, like: torch.Tensor, kernel: str) -> torch.Tensor:
    """The surrogate gradient of slopes ``like`` (a ``(Hq,)`` tensor, or one shaped like it) from
    :func:`~positional_lsh.ops._engine.engine.backward`'s ``dist`` (asked for with ``dist_grad=True``): ``-dist`` in
    ``like``'s dtype and device.

    Never silently: a ``dist`` of ``None`` (the ``kernel``'s backward returned no slope gradient although asked)
    raises ``RuntimeError``."""
    if dist is None:
        raise RuntimeError(f"the {kernel!r} backward returned no slope gradient (dist_grad=True)")
    return (-dist).to(dtype=like.dtype, device=like.device).reshape(like.shape)
