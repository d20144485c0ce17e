"""``torch.compile`` support: the estimator and the partition draw as opaque custom operators.

:func:`~positional_lsh.plsh_attention` plans its kernel calls on the host from the partition values
(``.tolist()``, Python loops over blocks and tiles), which dynamo cannot trace. Under ``torch.compile`` the
whole computation is therefore one custom operator that the compiler treats as a black box:

* ``positional_lsh::plsh_forward(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, backend,
  method) -> (out, lse)``: rebuilds the :class:`~positional_lsh.Partitions` from its tensors and arguments,
  plans, and runs the forward of :mod:`positional_lsh.ops.attention` (the same code as eager mode).
* ``positional_lsh::plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, ...) -> (dq, dk, dv)``: the
  same backward as eager mode; connected to the forward by ``torch.library.register_autograd``.
* ``positional_lsh::sample_partitions(step, seed, slopes, num_samples, scheme) -> (pitch, shift)``: the draw of
  :func:`~positional_lsh.sample_partitions` from a generator seeded with ``seed`` (``None``: torch's global RNG),
  or with ``layer_seed(seed, step)`` when the int64 tensor ``step`` is given (read inside the op, so a module can
  advance it in place between compiled calls).

Outside ``torch.compile`` nothing here runs: eager calls keep the ``torch.autograd.Function`` path.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from positional_lsh.ops._checks import positive_int
from positional_lsh.ops._kernels import acc_dtype
from positional_lsh.ops._seeds import layer_seed
from positional_lsh.ops.attention import _backward, _check_call, _choose, _forward, _HeadWork, _prepare
from positional_lsh.ops.multiplicity import MultiplicityPlan
from positional_lsh.ops.partitions import Partitions, sample_partitions
from positional_lsh.ops.slopes import alibi_slopes

__all__ = ["compiled_attention", "compiled_sampled_attention", "plsh_backward", "plsh_forward", "sample_op"]


def _planned(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    causal: bool,
    backend: str,
    method: str,
) -> tuple[Partitions, list[_HeadWork], MultiplicityPlan | None, tuple[torch.Tensor | None, ...]]:
    """What both ops start from: the partitions the tensors describe, their plan and ``_prepare``'s
    ``(q, k, v, bad)`` (the tensors eager mode saves: same layout, same zeroed keys). The estimator reads only the
    pitches and shifts, the scheme (integer blocks or not) and the length (``Lk``); a decay's tables are not
    needed. The backward plans again: nothing host-side survives between the two ops."""
    partitions = Partitions(k.shape[2], slopes, pitch, shift, scheme, max_block=max_block)
    plan, mplan = _choose(partitions, k.shape[1], q.shape[2], causal, method)
    return partitions, plan, mplan, _prepare(q, k, v, backend)


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
    backend: str,
    method: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    partitions, plan, mplan, (qp, kp, vp, bad) = _planned(
        q, k, v, pitch, shift, slopes, scheme, max_block, causal, backend, method
    )
    return _forward(qp, kp, vp, bad, plan, mplan, partitions, causal, scale, backend)


@plsh_forward.register_fake
def _(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, backend, method):
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
    backend: str,
    method: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, plan, mplan, (qp, kp, vp, _) = _planned(
        q, k, v, pitch, shift, slopes, scheme, max_block, causal, backend, method
    )
    return _backward((qp, kp, vp, out, lse), dout, plan, mplan, causal, scale, backend)


@plsh_backward.register_fake
def _(dout, q, k, v, out, lse, pitch, shift, slopes, scheme, max_block, causal, scale, backend, method):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, pitch, shift, slopes, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, pitch, shift, slopes)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx, dout, dlse):
    q, k, v, out, lse, pitch, shift, slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = plsh_backward(dout, q, k, v, out, lse, pitch, shift, slopes, *ctx.args)
    return (dq, dk, dv) + (None,) * 9


plsh_forward.register_autograd(_backward_fn, setup_context=_setup_context)


@torch.library.custom_op("positional_lsh::sample_partitions", mutates_args=())
def sample_op(
    step: torch.Tensor | None, seed: int | None, slopes: torch.Tensor, num_samples: int, scheme: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if seed is None:
        generator = None  # torch's global RNG, as sample_partitions(generator=None)
    elif step is None:
        generator = seed
    else:
        generator = layer_seed(seed, int(step))
    parts = sample_partitions(1, slopes, num_samples, scheme=scheme, generator=generator)
    return parts.pitch.clone(), parts.shift.clone()


@sample_op.register_fake
def _(step, seed, slopes, num_samples, scheme):
    shape = (num_samples, slopes.shape[0])
    return torch.empty(shape, dtype=torch.float64), torch.empty(shape, dtype=torch.float64)


def compiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    *,
    causal: bool,
    scale: float,
    backend: str,
    method: str,
) -> torch.Tensor:
    """``plsh_forward``'s output for checked arguments (``scale`` a float, ``backend`` resolved)."""
    if pitch.shape[1] != q.shape[1]:
        raise ValueError(f"partitions were drawn for {pitch.shape[1]} heads, but q has {q.shape[1]} heads")
    out, _ = plsh_forward(q, k, v, pitch, shift, slopes, scheme, max_block, causal, scale, backend, method)
    return out


def _slopes_tensor(slopes: object, num_heads: int) -> torch.Tensor:
    """Slopes as a float64 CPU tensor without reading their values (the sample op validates them)."""
    if slopes is None:
        return alibi_slopes(num_heads).double()
    if isinstance(slopes, torch.Tensor):
        out = slopes.detach().to("cpu", torch.float64)
        return out.expand(num_heads).clone() if out.dim() == 0 else out
    if isinstance(slopes, numbers.Real) and not isinstance(slopes, bool):
        return torch.full((num_heads,), float(slopes), dtype=torch.float64)
    if isinstance(slopes, Sequence):
        return torch.tensor([float(s) for s in slopes], dtype=torch.float64)
    raise TypeError(f"slopes must be a tensor, a sequence of floats or a float, got {type(slopes).__name__}")


def compiled_sampled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dims: tuple[int, int, int, int, int, int],
    slopes: object,
    num_samples: int,
    scheme: str,
    generator: object,
    *,
    causal: object,
    scale: float | None,
    backend: str,
    method: str,
) -> torch.Tensor:
    """:func:`~positional_lsh.plsh_attention` without ``partitions=`` under ``torch.compile``: the draw from the int
    seed ``generator`` (the same partitions as eager mode), then the estimator."""
    if isinstance(generator, bool) or not isinstance(generator, numbers.Integral):
        raise ValueError(
            "under torch.compile, plsh_attention needs partitions= or an int seed as generator= (a torch.Generator "
            f"or torch's global RNG cannot be traced), got generator={generator!r}"
        )
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    scale_f, backend = _check_call(dims[5], q.device, causal, scale, backend, method)
    slopes_t = _slopes_tensor(slopes, dims[1])
    pitch, shift = sample_op(None, int(generator), slopes_t, positive_int("num_samples", num_samples), scheme)
    return compiled_attention(
        q, k, v, pitch, shift, slopes_t, scheme, None, causal=causal, scale=scale_f, backend=backend, method=method
    )
