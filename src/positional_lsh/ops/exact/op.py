"""The exact ops' one custom-op registration: ``positional_lsh::exact_forward`` / ``exact_backward``.

``exact_forward(q, k, v, theta, window, kind, causal, scale, backend, check=False, key_padding_mask=None) -> (out,
lse)`` (``theta``: the slopes ``(Hq,)``, or a decay family's parameters ``(Hq, P)``) and its backward, connected by
``torch.library.register_autograd``, which gives ``theta`` its exact gradient when autograd needs it; eager and under
``torch.compile`` (one opaque op; the values a trace cannot read are then checked inside it, ``check``). A call runs
on the ``"fused"`` route (:mod:`~positional_lsh.ops.exact.fused`) or the Toeplitz banks
(:mod:`~positional_lsh.ops.exact.toeplitz`), row group by row group with a ``key_padding_mask``. The entry points
are :func:`~positional_lsh.alibi_attention` and :func:`~positional_lsh.decay_attention`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from positional_lsh.ops._engine.cpu.backend import TableBias, table_backward, table_forward
from positional_lsh.ops._engine.custom_op import attention_op, backward_impl, backward_schema, keep_layout
from positional_lsh.ops._engine.kinds import Kernel
from positional_lsh.ops._engine.lru import LruCache
from positional_lsh.ops._engine.parallel import pool_size, run_all
from positional_lsh.ops._engine.torch_attention import Grad, Layout, acc_dtype, kernel_inputs, poison_rows
from positional_lsh.ops.checks import as_slopes, as_window
from positional_lsh.ops.exact.fused import exact_route, fused_backward, fused_forward
from positional_lsh.ops.exact.toeplitz import (
    Toeplitz,
    alibi_backward_item,
    alibi_forward_item,
    alibi_rows_with_bad_keys,
    head_items,
)
from positional_lsh.ops.padding import forward_row_groups, group_backward_inputs, row_groups, scatter_group_grads
from positional_lsh.ops.partitions.decays import decay_family


def _toeplitz_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Toeplitz, causal: bool, scale: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """``(out, lse, layout)`` of exact attention with the Toeplitz bias ``spec``, chunk by chunk (non-finite keys
    zeroed, the rows that keep one set to NaN); ``layout``: the inputs as the kernels read them. On the CPU kernel
    (``Kernel.CPU``) in one call, the bias a line per head."""
    layout = kernel_inputs(q, k, v, backend)
    q, k, v, bad = layout
    if backend == Kernel.CPU:
        out, lse = table_forward(q, k, v, _table(spec, k.shape[2]), causal, scale)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
        if exact_route(spec.window, k.shape[2], backend, q.device) == "fused":
            fused_forward(q, k, v, out, lse, spec, causal, scale)
        else:
            items = head_items(q, k, spec.window)
            run = partial(
                alibi_forward_item, q=q, k=k, v=v, out=out, lse=lse, spec=spec, causal=causal, scale=scale,
                backend=backend,
            )  # fmt: skip
            run_all(run, items, pool_size(len(items), q.device))
    if bad is not None:
        poison_rows(out, lse, alibi_rows_with_bad_keys(bad, q.shape[1], q.shape[2], spec.window, causal))
    return out, lse, layout


def _table(spec: Toeplitz, k_len: int) -> TableBias:
    """The CPU kernel's bias of ``spec``: the bias at each distance ``0 .. k_len - 1`` and each head's reach. The
    last few small ones are kept (a model's layers and steps share their slopes; building one costs a few percent of
    a call at ``n = 1024``)."""
    if spec.values.shape[0] * k_len > _TABLE_CACHE_ENTRIES:
        return _build_table(spec, k_len)
    window = None if spec.window is None else tuple(spec.window.tolist())
    name = "alibi" if spec.family is None else spec.family.name
    key = (name, tuple(spec.values.flatten().tolist()), tuple(spec.values.shape), window, k_len)
    return _TABLES.get(key, lambda: _build_table(spec, k_len))


_TABLE_CACHE_ENTRIES = 1 << 20  # the largest line kept, all heads: 4 MiB of float32 (and its reverse)
_TABLES: LruCache[TableBias] = LruCache(8)


def _build_table(spec: Toeplitz, k_len: int) -> TableBias:
    line = spec.line(0, k_len - 1, False, torch.float32, torch.device("cpu"))
    reaches = [spec.reach(h) for h in range(line.shape[0])]
    reach = [float("inf") if r is None else float(r) for r in reaches]
    return TableBias.of(line, reach)


def _kernel_backward(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    spec: Toeplitz,
    causal: bool,
    scale: float,
    theta_grad: bool,
    laid_out: bool,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """:func:`_toeplitz_backward` on the CPU kernel: ``dq, dk, dv`` and, for ALiBi's slopes, their gradient from the
    kernel's ``dS`` summed per distance (``d bias / d m = -|i - j|``); a decay family's parameters take the
    ``"banks"`` parameter pass (math kernel)."""
    q, k, v, out, lse = saved
    if not laid_out:
        q, k, v, _ = kernel_inputs(q, k, v, Kernel.CPU)
    alibi = spec.family is None
    table = _table(spec, k.shape[2])
    grads, dsum = table_backward(dout, (q, k, v, out, lse), table, causal, scale, theta_grad and alibi)
    param_grad = None
    if dsum is not None:
        dist = torch.arange(k.shape[2], dtype=torch.float64)
        param_grad = (-(dsum.double() * dist).sum(-1, keepdim=True)).to(acc_dtype(q.dtype))
    elif theta_grad:
        _, param_grad = _toeplitz_backward(dout, (q, k, v, out, lse), spec, causal, scale, Kernel.MATH, False, True)
    return grads, param_grad


def _toeplitz_backward(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    spec: Toeplitz,
    causal: bool,
    scale: float,
    backend: str,
    qkv_grad: bool,
    theta_grad: bool,
    laid_out: bool = False,
) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """``((dq, dk, dv) or None, param_grad (B, Hq, P) or None)`` against the saved ``out`` and ``lse``: each part
    only when asked for (the parameter part is one more math pass of every chunk's scores). ``saved``: the
    forward's ``(q, k, v, out, lse)``; ``laid_out``: its ``q, k, v`` are the forward's kernel layout."""
    if backend == Kernel.CPU:
        return _kernel_backward(dout, saved, spec, causal, scale, theta_grad, laid_out)
    q, k, v, out, lse = saved
    if not laid_out:
        q, k, v, _ = kernel_inputs(q, k, v, backend)
    dout = dout.contiguous()
    acc = acc_dtype(q.dtype)
    fused = qkv_grad and exact_route(spec.window, k.shape[2], backend, q.device) == "fused"
    grads = None
    if qkv_grad and not fused:
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    # per (batch row, head): every (b, h) belongs to one work item, so the workers write disjoint entries
    param_grad = None
    if theta_grad:
        param_grad = torch.zeros((q.shape[0], q.shape[1], spec.num_params), dtype=acc, device=q.device)
    if grads is not None or param_grad is not None:  # the "banks" chunks (on the "fused" route: the parameter pass)
        items = head_items(q, k, spec.window)
        run = partial(
            alibi_backward_item, saved=(q, k, v, out, lse), dout=dout, grads=grads, param_grad=param_grad,
            spec=spec, causal=causal, scale=scale, backend=backend,
        )  # fmt: skip
        run_all(run, items, pool_size(len(items), q.device))
    if fused:
        return fused_backward(dout, q, k, v, out, lse, spec, causal, scale), param_grad
    if grads is not None:
        grads = tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
    return grads, param_grad


def _spec(kind: str, theta: torch.Tensor, window: torch.Tensor | None, check: bool) -> Toeplitz:
    """The call's :class:`Toeplitz` from the op's ``theta`` (ALiBi: the slopes ``(Hq,)``; a decay family: its
    parameters ``(Hq, P)``), read detached in float64 on the CPU. ``check``: validate the values first (compiled
    calls, whose public function could not read them; ``ValueError`` naming ``slopes``, ``window`` or ``params``)."""
    hq = theta.shape[0]
    if kind == "alibi":
        values = as_slopes(theta, hq) if check else theta.detach().to("cpu", torch.float64)
        if check:
            window = as_window(window, hq)
        elif window is not None:
            window = window.detach().to("cpu", torch.float64)
        return Toeplitz(kind, values[:, None], window)
    fam = decay_family(kind)
    values = fam.check_params(theta, hq)[1] if check else theta.detach().to("cpu", torch.float64)
    return Toeplitz(fam.name, values, None)


def _exact_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    window: torch.Tensor | None,
    kind: str,
    causal: bool,
    scale: float,
    backend: str,
    check: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of exact attention with the bias of ``kind`` (``"alibi"``: slopes ``theta (Hq,)``, optional
    ``window (Hq,)``; a decay family's name: its parameters ``theta (Hq, P)``), row group by row group with a
    ``key_padding_mask`` (padded query rows: ``out = 0``, ``lse = -inf``). ``check``: see :func:`_spec`."""
    spec = _spec(kind, theta, window, check)
    groups = row_groups(key_padding_mask, q.shape[2])
    if groups is None:
        out, lse, layout = _toeplitz_forward(q, k, v, spec, causal, scale, backend)
        keep_layout(out, (q, k, v, theta), (layout.q, layout.k, layout.v))  # the backward's q, k, v
        return out, lse

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _toeplitz_forward(qg, kg, vg, spec, causal, scale, backend)[:2]

    return forward_row_groups(q, k, v, groups, attend, scale)


def _exact_backward(
    grad: Grad, a: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dtheta)`` of :func:`exact_forward` by recomputation against the saved ``out`` and ``lse``, from
    ``grad`` (``dout, q, k, v, out, lse``) and ``a``, the backward op's other arguments by name (``theta``,
    ``window``, the settings, ``qkv_grad``, ``theta_grad``, ``laid_out``, ``key_padding_mask``;
    ``ops._engine.custom_op``), row group by row group with a ``key_padding_mask`` (padded positions get zero
    gradients). ``dq, dk, dv`` when ``qkv_grad`` (else zeros); ``dtheta`` (``sum dS * d bias / d theta``,
    accumulated in float32, float64 for float64 inputs; in ``theta``'s shape, dtype and device) when ``theta_grad``
    (else zeros, and no extra pass); ``laid_out``: ``q, k, v`` are the forward's kernel layout."""
    dout, q, k, v, out, lse = grad
    theta, qkv_grad, theta_grad = a["theta"], a["qkv_grad"], a["theta_grad"]
    spec = _spec(a["kind"], theta, a["window"], False)  # the forward checked the values
    groups = row_groups(a["key_padding_mask"], q.shape[2])
    scale = a["scale"]
    args = (spec, a["causal"], scale, a["backend"], qkv_grad, theta_grad)
    if groups is None:
        grads, param_grad = _toeplitz_backward(dout, (q, k, v, out, lse), *args, a["laid_out"])
        dtheta = None if param_grad is None else param_grad.sum(0)
    else:
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)) if qkv_grad else None
        dtheta = torch.zeros((q.shape[1], spec.num_params), dtype=acc_dtype(q.dtype), device=q.device)
        for g in groups:
            gs = group_backward_inputs(g, (q, k, v, out, lse), dout, scale)
            part, pg = _toeplitz_backward(gs.dout, (gs.q, gs.k, gs.v, gs.out, gs.lse), *args)
            if grads is not None and part is not None:
                scatter_group_grads(g, grads, part)  # type: ignore[arg-type]
            if pg is not None:
                dtheta += pg.sum(0)
    if grads is None:
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    dq, dk, dv = grads
    if not theta_grad or dtheta is None:
        return dq, dk, dv, torch.zeros(theta.shape, dtype=theta.dtype, device=theta.device)
    return dq, dk, dv, dtheta.reshape(theta.shape).to(device=theta.device, dtype=theta.dtype)


exact_forward = torch.library.custom_op("positional_lsh::exact_forward", _exact_forward, mutates_args=())
_TENSORS, _SETTINGS = ("theta", "window"), ("kind", "causal", "scale", "backend")
_BACKWARD = backward_schema(_exact_forward, tensors=_TENSORS, settings=_SETTINGS, flags=("qkv_grad", "theta_grad"))
exact_backward = torch.library.custom_op(
    "positional_lsh::exact_backward", backward_impl(_exact_backward, _BACKWARD), mutates_args=(), schema=_BACKWARD
)
EXACT_OP = attention_op(
    exact_forward, _exact_forward, exact_backward, _BACKWARD, tensors=_TENSORS, settings=_SETTINGS,
    grads=("q", "k", "v", "theta"), flags=lambda n: {"qkv_grad": n["q"] or n["k"] or n["v"], "theta_grad": n["theta"]},
)  # fmt: skip
"""The exact op pair on the one scaffold (``ops._engine.custom_op``): fakes, ``setup_context`` and the autograd
backward, inputs read by name (``theta`` gets its exact gradient when autograd needs it)."""

#: The names of ``exact_forward``'s inputs, in order: ``setup_context`` and the backward read and return them by name.
EXACT_INPUTS: tuple[str, ...] = EXACT_OP.inputs
