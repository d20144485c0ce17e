"""Memory-lean local compute of context-parallel attention: heads in chunks, recomputed in the backward.

The plain path (:func:`~positional_lsh.distributed.halo_exchange` then one ``plsh_attention`` call) keeps a
joined copy of the key/value window next to the caller's shard, and ``plsh_attention`` keeps its inputs, output
and log-sum-exp for the backward. :class:`ChunkedWindowAttention` keeps only the caller's ``q, k, v`` and the
small received halo: its forward runs ``plsh_attention`` on ``head_chunk`` key/value heads at a time (building
only that chunk's window), without autograd; its backward recomputes each chunk with autograd, writes the
chunk's gradients into the full ``dq, dk, dv`` and the halo gradients, and sends those back to their owners.
Heads are independent in positional-LSH attention, so the result equals the unchunked call (up to the kernels'
summation order). Cost: one more forward pass of the local attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from positional_lsh import Partitions, plsh_attention
from positional_lsh.distributed.exchange import receive_halo, return_halo_grads
from positional_lsh.distributed.halo import HaloPlan


class LocalOptions(NamedTuple):
    """The options of every local ``plsh_attention`` call of context-parallel attention (checked by the caller)."""

    causal: bool
    scale: float | None
    backend: str
    method: str


class RankWindow(NamedTuple):
    """This rank's part of a context-parallel call: the halo plan, the rank in its process group, the partitions
    of its key window (whole sequence before :func:`~positional_lsh.distributed.halo.crop_partitions`), the local
    options and the head chunk (``None``: all heads at once)."""

    plan: HaloPlan
    rank: int
    group: Any
    partitions: Partitions
    options: LocalOptions
    head_chunk: int | None


def head_slice(partitions: Partitions, h0: int, h1: int) -> Partitions:
    """The partitions of query heads ``h0 .. h1 - 1`` (every per-head field sliced, the rest kept)."""
    changes: dict[str, Any] = {
        "slopes": partitions.slopes[h0:h1],
        "pitch": partitions.pitch[:, h0:h1],
        "shift": partitions.shift[:, h0:h1],
    }
    if partitions.decays is not None:
        changes["decays"] = tuple(partitions.decays[h0:h1])
    return dataclasses.replace(partitions, **changes)


def _window(
    k: torch.Tensor, v: torch.Tensor, halo: list[torch.Tensor], n_left: int, hs: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value window of the key/value heads ``hs``: the halo pieces (position order) around the shard."""
    left, right = halo[:n_left], halo[n_left:]
    kw = torch.cat([*(p[0, :, hs] for p in left), k[:, hs], *(p[0, :, hs] for p in right)], dim=2)
    vw = torch.cat([*(p[1, :, hs] for p in left), v[:, hs], *(p[1, :, hs] for p in right)], dim=2)
    return kw, vw


class ChunkedWindowAttention(torch.autograd.Function):
    """``(q, k, v)`` shard -> this rank's rows of positional-LSH attention, heads in chunks (see module docs)."""

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx; the attributes set here are read by backward
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: RankWindow,  # partitions cropped to the window, head_chunk set, group not None
    ) -> torch.Tensor:
        plan, rank, group, local_parts, options, head_chunk = window
        assert head_chunk is not None
        left, right = receive_halo(k, v, plan, rank, group)
        hkv, group_size = k.shape[1], q.shape[1] // k.shape[1]
        right_len = plan.right[rank] - plan.ends[rank]
        out = torch.empty_like(q)
        for h0 in range(0, hkv, head_chunk):
            hs = slice(h0, min(hkv, h0 + head_chunk))
            qs = slice(hs.start * group_size, hs.stop * group_size)
            kw, vw = _window(k, v, [*left, *right], len(left), hs)
            parts = head_slice(local_parts, qs.start, qs.stop)
            out[:, qs] = local_window_attention(q[:, qs], kw, vw, parts, options, right_len)
            del kw, vw
        ctx.save_for_backward(q, k, v, *left, *right)
        ctx.n_left, ctx.window, ctx.right_len = len(left), window, right_len
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *halo = ctx.saved_tensors
        window: RankWindow = ctx.window
        plan, rank, head_chunk = window.plan, window.rank, window.head_chunk
        assert head_chunk is not None
        hkv, group_size = k.shape[1], q.shape[1] // k.shape[1]
        start, end, win_left = plan.starts[rank], plan.ends[rank], plan.left[rank]
        incoming = plan.incoming(rank)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        halo_grads = [torch.empty_like(p) for p in halo]  # sorted by position, like `halo`
        order = sorted(range(len(incoming)), key=lambda i: incoming[i].start)
        offsets = [incoming[i].start - win_left for i in order]
        for h0 in range(0, hkv, head_chunk):
            hs = slice(h0, min(hkv, h0 + head_chunk))
            qs = slice(hs.start * group_size, hs.stop * group_size)
            with torch.enable_grad():
                qc = q[:, qs].detach().requires_grad_()
                kw, vw = (x.detach().requires_grad_() for x in _window(k, v, halo, ctx.n_left, hs))
                parts = head_slice(window.partitions, qs.start, qs.stop)
                out = local_window_attention(qc, kw, vw, parts, window.options, ctx.right_len)
                gq, gk, gv = torch.autograd.grad(out, (qc, kw, vw), dout[:, qs])
            del out, kw, vw, qc
            dq[:, qs] = gq
            dk[:, hs] = gk[:, :, start - win_left : end - win_left]
            dv[:, hs] = gv[:, :, start - win_left : end - win_left]
            for g, off in zip(halo_grads, offsets, strict=True):
                length = g.shape[3]
                g[0, :, hs] = gk[:, :, off : off + length]
                g[1, :, hs] = gv[:, :, off : off + length]
            del gq, gk, gv
        # Back to plan order for the exchange.
        in_plan_order = [halo_grads[order.index(i)] for i in range(len(incoming))]
        return_halo_grads(in_plan_order, dk, dv, plan, rank, window.group)
        return dq, dk, dv, None


def local_window_attention(
    q: torch.Tensor,
    kw: torch.Tensor,
    vw: torch.Tensor,
    parts: Partitions,
    options: LocalOptions,
    right_len: int,
) -> torch.Tensor:
    """``plsh_attention`` of the shard's queries ``q (B, Hq, n_local, d)`` on a key/value window
    ``kw, vw (B, Hkv, left halo + n_local + right_len, d)`` with the window's partitions ``parts``.

    Queries are aligned to the last keys, so with a right halo (bidirectional attention) the queries are padded
    with ``right_len`` zero rows, whose outputs are dropped (they get no gradient). Returns ``(B, Hq, n_local, d)``.
    """
    n_local = q.shape[2]
    padded = not (options.causal or right_len == 0)
    if padded:
        q = torch.cat([q, q.new_zeros((*q.shape[:2], right_len, q.shape[3]))], dim=2)
    out = plsh_attention(
        q, kw, vw, partitions=parts, causal=options.causal, scale=options.scale, backend=options.backend,
        method=options.method,
    )  # fmt: skip
    return out[:, :, :n_local] if padded else out
