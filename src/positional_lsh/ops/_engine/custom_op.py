"""The scaffold of an attention custom op: a forward op ``(q, k, v, ...) -> (out, lse)`` and its backward op,
connected by ``torch.library.register_autograd``, used eager and compiled alike.

The estimator's op (``ops._engine.op``: ``positional_lsh::plsh_forward`` / ``plsh_backward``) and the exact op
(``ops.exact.op``: ``exact_forward`` / ``exact_backward``) are built on it; both lay their inputs out with
``torch_attention.kernel_inputs``. What the scaffold shares (:func:`attention_op`):

* inputs read by name, never by position (:func:`input_names`: the forward's signature);
* the backward op's schema and arguments, derived from the forward's (:func:`backward_schema`, :func:`backward_impl`):
  ``(dout, q, k, v, out, lse)`` as one :class:`~positional_lsh.ops._engine.torch_attention.Grad`, then the forward's
  other tensors and settings as the forward declares them, the flags and ``laid_out`` and the ``key_padding_mask``;
  the backward function takes ``(grad, inputs)``, ``inputs`` by name (the forward's parameter list is written once, in
  the forward);
* the fakes: the forward returns :func:`~positional_lsh.ops._engine.torch_attention.output_buffers` of ``q`` (``out``
  in ``q``'s dtype, ``lse`` in the accumulation dtype); the backward returns empty tensors shaped like the inputs
  whose gradients it computes (``grads``, named in the backward's signature); only the tensors that shape the
  outputs are read;
* ``setup_context``: saves ``q, k, v``, the forward's other tensor inputs (``tensors``), ``out``, ``lse`` and the
  ``key_padding_mask``; keeps the settings (``settings``) as they are; ``lse`` is not differentiable. Where the
  forward kept its kernel layout (:func:`keep_layout`: ``q, k, v`` as its kernels read them, copied where their
  strides needed it, non-finite keys zeroed) it saves those in place of ``q, k, v``, so that the backward does not
  lay them out and scan the keys again;
* the autograd backward: ``dout`` (zeros where autograd gives none), the flags that say which gradients are needed
  (``flags``, from ``ctx.needs_input_grad`` by name), one call of the backward op
  ``backward(dout, q, k, v, out, lse, *tensors, **settings, **flags, laid_out=..., key_padding_mask=mask)``
  (``laid_out``: ``q, k, v`` are the forward's kept layout), and its four outputs returned at the inputs they
  belong to (``grads``), ``None`` for the others and for those not needed.

Each op module still registers its own ops (``torch.library.custom_op`` with its name, in its module:
``tests/test_architecture.py``, ``CUSTOM_OPS``) and hands them to :func:`attention_op`.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from positional_lsh.ops._engine.torch_attention import Grad, output_buffers

__all__ = ["AttentionOp", "attention_op", "backward_impl", "backward_schema", "input_names", "keep_layout"]

BackwardFn = Callable[[Grad, dict[str, Any]], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
"""An op's backward: ``(grad, inputs) -> four gradients``, ``inputs`` the backward op's other arguments by name."""

_KEPT = threading.local()  # .slot: (weakref to the forward's out, its kept q, k, v): one per thread, the last forward


def keep_layout(
    out: torch.Tensor, inputs: tuple[torch.Tensor, ...], layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Hand ``setup_context`` the ``layout``, the ``q, k, v`` a forward op's kernels read
    (``torch_attention.kernel_inputs``) of its ``inputs`` (``q, k, v`` and the tensors that get gradients), for the
    forward that returned ``out``; an eager forward calls it. Kept only where one of the ``inputs`` requires grad,
    in one slot per thread that the next forward replaces: a forward under ``torch.no_grad`` keeps at most its own
    layout alive until then. Compiled calls never find it (``setup_context`` runs on fakes there): their backward
    lays the inputs out again."""
    if any(x.requires_grad for x in inputs):  # else no backward will ask for it
        _KEPT.slot = (weakref.ref(out), layout)


def _kept_layout(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The layout :func:`keep_layout` kept for the forward that returned ``out`` (the slot is emptied), or ``None``."""
    slot = getattr(_KEPT, "slot", None)
    _KEPT.slot = None
    if slot is None or slot[0]() is not out:
        return None
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = slot[1]
    return kept


def input_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``fn``'s parameters, in order: how an op's inputs are read (by name, never by position)."""
    return tuple(inspect.signature(fn).parameters)


def _schema_names(schema: str) -> tuple[str, ...]:
    """The argument names of an op schema ``"(Type name, Type name=default, ...) -> ..."``."""
    return tuple(d.split("=")[0].rsplit(" ", 1)[1] for d in _schema_args(schema))


def _schema_args(schema: str) -> list[str]:
    return schema[1 : schema.index(") ->")].split(", ")


def backward_schema(
    forward_fn: Callable[..., Any], *, tensors: tuple[str, ...], settings: tuple[str, ...], flags: tuple[str, ...]
) -> str:
    """The schema of the backward op of the forward op made from ``forward_fn``: ``(Tensor dout, Tensor q, Tensor k,
    Tensor v, Tensor out, Tensor lse, <tensors and settings, typed as the forward types them>, bool <flag>=False...,
    bool laid_out=False, Tensor? key_padding_mask=None) -> (Tensor, Tensor, Tensor, Tensor)``."""
    declared = torch.library.infer_schema(forward_fn, mutates_args=())
    by_name = dict(zip(_schema_names(declared), _schema_args(declared), strict=True))
    args = [f"Tensor {n}" for n in Grad._fields] + [by_name[n] for n in (*tensors, *settings)]
    args += [f"bool {n}=False" for n in (*flags, "laid_out")] + ["Tensor? key_padding_mask=None"]
    return f"({', '.join(args)}) -> (Tensor, Tensor, Tensor, Tensor)"


def backward_impl(fn: BackwardFn, schema: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The backward op's implementation for ``schema`` (:func:`backward_schema`): calls ``fn(grad, inputs)`` with
    its first six arguments as one :class:`Grad` and the others by name (defaults filled in)."""
    names = _schema_names(schema)
    defaults = {
        name: None if arg.endswith("=None") else False
        for name, arg in zip(names, _schema_args(schema), strict=True)
        if "=" in arg
    }

    def impl(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        named = defaults | dict(zip(names, args, strict=False)) | kwargs
        return fn(Grad(*(named.pop(n) for n in Grad._fields)), named)

    return impl


@dataclass(frozen=True)
class AttentionOp:
    """A registered forward / backward pair (see :func:`attention_op`).

    Attributes:
        forward: the forward op, ``(q, k, v, ...) -> (out, lse)``.
        backward: the backward op, ``(dout, q, k, v, out, lse, ...) -> (four gradients)``.
        inputs: the forward's input names, in order.
        tensors: the forward's tensor inputs saved for the backward besides ``q, k, v`` and the mask.
        settings: the forward's inputs the backward takes as they are.
        grads: the forward inputs the backward's four outputs belong to.
    """

    forward: Any
    backward: Any
    inputs: tuple[str, ...]
    tensors: tuple[str, ...]
    settings: tuple[str, ...]
    grads: tuple[str, str, str, str]


def attention_op(
    forward: Any,
    forward_fn: Callable[..., Any],
    backward: Any,
    schema: str,
    *,
    tensors: tuple[str, ...],
    settings: tuple[str, ...],
    grads: tuple[str, str, str, str],
    flags: Callable[[Mapping[str, bool]], dict[str, bool]],
) -> AttentionOp:
    """Register the fakes and the autograd of the custom ops ``forward`` (made from ``forward_fn``) and ``backward``
    (of ``schema``, :func:`backward_schema`), as the module docstring says. ``flags(need)``: the backward op's flags
    from ``need`` (input name -> whether autograd needs its gradient; inputs left at their defaults read
    ``False``)."""
    inputs = names_in = input_names(forward_fn)
    grad_like = grads
    back_names = _schema_names(schema)
    missing = [n for n in ("q", "k", "v", "key_padding_mask", *tensors, *settings) if n not in inputs]
    missing += [n for n in grad_like[3:] if n not in back_names]
    if missing:
        raise ValueError(f"attention_op: the ops have no inputs named {missing}")

    def forward_fake(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q = kwargs["q"] if "q" in kwargs else args[inputs.index("q")]
        return output_buffers(q, empty=True)

    def backward_fake(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        named = dict(zip(back_names, args, strict=False)) | kwargs
        return tuple(torch.empty(named[n].shape, dtype=named[n].dtype, device=named[n].device) for n in grad_like)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        # (torch calls it with keywords: ctx, inputs, output)
        args = dict(zip(names_in, inputs, strict=True))
        out, lse = output
        kept = _kept_layout(out)
        qkv = kept if kept is not None else (args["q"], args["k"], args["v"])
        ctx.save_for_backward(*qkv, *(args[n] for n in tensors), out, lse, args["key_padding_mask"])
        ctx.settings = {n: args[n] for n in settings}
        ctx.laid_out = kept is not None
        ctx.mark_non_differentiable(lse)

    def backward_autograd(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, *rest = ctx.saved_tensors
        *saved, out, lse, mask = rest
        if dout is None:
            dout = torch.zeros_like(out)
        # (the dispatcher drops trailing inputs left at their defaults from needs_input_grad: none of them is a grad's)
        need = {n: bool(x) for n, x in zip(inputs, ctx.needs_input_grad, strict=False)}
        need.update({n: False for n in inputs if n not in need})
        result = backward(
            dout, q, k, v, out, lse, *saved, **ctx.settings, **flags(need), laid_out=ctx.laid_out,
            key_padding_mask=mask,
        )  # fmt: skip
        by_name = dict(zip(grads, result, strict=True))
        return tuple(by_name[n] if n in by_name and need[n] else None for n in inputs)

    forward.register_fake(forward_fake)
    backward.register_fake(backward_fake)
    forward.register_autograd(backward_autograd, setup_context=setup_context)
    return AttentionOp(forward, backward, inputs, tensors, settings, grads)
